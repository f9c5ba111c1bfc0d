"""What a profile measurement feeds its engine: synthetic graph inputs of the lowered shape, random
activations, the additive mask a block really sees, and a timer."""
from __future__ import annotations

import time
from typing import Callable, Mapping

import numpy as np

from ir.graph import Block, Graph
from runtime.engines.stage import host_values, stage_spec

# Where profiling reports progress, one line at a time (the CLI prints them).
Progress = Callable[[str], None]
# a causal LM's per-position loss weights (`ir.ops` TokenCrossEntropy's third input)
TARGET_WEIGHTS = "target_weights"


def synthetic_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Graph inputs of the lowered shape: valid token ids, an attention mask with a padded row
    (so the additive mask really holds its large negative value), and one-hot float targets; a
    causal LM's targets are random next-token ids at every attended position (the most the loss ever
    computes: instruction data counts only the answers)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "Gather" and n.tier == "compute" and n.inputs[0] in graph.constants:
            size = int(graph.constants[n.inputs[0]].shape[0])
            rows[n.inputs[1]] = min(rows.get(n.inputs[1], size), size)
    feeds = {}
    for v in graph.inputs:
        shape = tuple(v.shape)
        if v.name in ("target_ids", "target_weights"):
            continue
        if v.dtype.startswith("float"):
            labels = rng.integers(0, shape[-1], shape[:-1])
            count = max(1, int(np.prod(shape[:-1], dtype=np.int64)))
            feeds[v.name] = (np.eye(shape[-1])[labels] / count).astype(v.dtype)
        elif "mask" in v.name:
            mask = np.ones(shape, v.dtype)
            if mask.ndim == 2 and shape[0] > 1:
                mask[-1, shape[1] // 2:] = 0
            feeds[v.name] = mask
        else:
            feeds[v.name] = rng.integers(0, rows.get(v.name, 1), shape).astype(v.dtype)
    names = {v.name: v for v in graph.inputs}
    if "target_ids" in names and "target_weights" in names:
        shape = tuple(names["target_ids"].shape)
        vocab = next((graph.values[n.inputs[0]].shape[-1] for n in graph.nodes if n.op == "TokenCrossEntropy"), 1)
        mask = np.asarray(feeds.get("attention_mask", np.ones(shape, np.int64)))[:, :shape[-1]] != 0
        mask[:, -1] = False  # the last position has no next token
        weights = mask / max(1, int(mask.sum()))
        feeds["target_ids"] = rng.integers(0, vocab, shape).astype(names["target_ids"].dtype)
        feeds["target_weights"] = weights.astype(names["target_weights"].dtype)
    return feeds


def activation(graph: Graph, name: str, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(graph.values[name].shape).astype(np.float32)




def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def block_mask(graph: Graph, block: Block, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """The additive attention mask the block really adds to its scores, from the synthetic feeds."""
    spec = stage_spec(graph, block.index, block.index)
    env = host_values(spec, feeds)
    if block.attention is not None and block.attention.mask in env:
        return np.asarray(env[block.attention.mask], np.float32)
    for name in block.inputs[1:]:
        v = graph.values.get(name)
        if v is not None and v.dtype == "float32" and len(v.shape) == 4 and name in env:
            return np.asarray(env[name], np.float32)
    batch, seq = graph.values[block.inputs[0]].shape[:2]
    return np.zeros((batch, 1, 1, seq), np.float32)
