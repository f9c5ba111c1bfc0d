"""The PyTorch engine runs each placed attention site as one scaled_dot_product_attention
(runtime.engines.attention_sites): on every exporter's BERT and on decoders (rotary embeddings,
grouped-query attention, GPT-2's fused c_attn), the fused forward and every gradient equal the
node-by-node engine's in float64; where something was added to a site (LoRA adapters on its
projections) the stage runs node by node, as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from support import Lazy, token_feeds

B, S = 2, 12


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """family -> a tiny random decoder LLM's graph (torchscript export), lowered on first use."""
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm

    root = tmp_path_factory.mktemp("fused-decoders")
    return Lazy(lambda family: load_model(export_causal_lm(random_causal_lm(family), root / f"{family}.onnx",
                                                           LlmExportOptions(), kv_cache=False), B, S))


def _graph(tiny_onnx, decoders, which: str):
    return decoders[which] if which in ("llama", "gpt2") else load_model(tiny_onnx[which], B, S)


def _feeds(graph, spec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in spec.graph_inputs:
        v = graph.values[name]
        if name == "attention_mask":
            mask = np.ones(v.shape, np.int64)
            mask[1, S - 4:] = 0  # padding on the second row: the mask is real
            feeds[name] = mask
        elif v.dtype.startswith("int"):  # ids below the size of the table that looks them up
            rows = [graph.constants[n.inputs[0]].shape[0] for n in graph.nodes if n.op == "Gather" and n.inputs[1] == name]
            feeds[name] = rng.integers(0, min(rows + [100]), v.shape).astype(np.int64)
        elif name == "target_weights":
            feeds[name] = np.full(v.shape, 1.0 / np.prod(v.shape), np.float32)
        else:
            feeds[name] = np.eye(v.shape[-1], dtype=np.float32)[rng.integers(0, v.shape[-1], v.shape[:-1])]
    if spec.activation_input is not None:
        shape = graph.values[spec.activation_input].shape
        feeds[spec.activation_input] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _fwd_bwd(engine, spec, feeds):
    out = engine.forward(feeds, 0)
    grad = None if spec.is_last else np.random.default_rng(7).standard_normal(out.shape)
    result = engine.backward(0, grad)
    return out, result.params, result.activation_input


MODELS = ["torchscript-17", "torchscript-17-sdpa", "dynamo-18", "llama", "gpt2"]


@pytest.mark.parametrize("which", MODELS)
@pytest.mark.parametrize("where", ["whole", "middle"])
def test_fused_attention_equals_node_by_node_in_float64(tiny_onnx, decoders, which, where):
    graph = _graph(tiny_onnx, decoders, which)
    n = len(graph.blocks)
    first, last = (0, n - 1) if where == "whole" else (1, n - 3)
    spec = stage_spec(graph, first, last)
    fused = TorchStageEngine(spec, dtype=torch.float64)
    nodes = TorchStageEngine(spec, dtype=torch.float64, fuse_attention=False)
    placed = tuple(b.index for b in spec.blocks if b.attention is not None)
    assert placed and fused.fused_attention_blocks == placed  # every placed attention runs fused
    assert nodes.fused_attention_blocks == ()
    feeds = _feeds(graph, spec)
    (y, g, dx), (y0, g0, dx0) = _fwd_bwd(fused, spec, feeds), _fwd_bwd(nodes, spec, feeds)
    np.testing.assert_allclose(y, y0, rtol=1e-10, atol=1e-12)
    assert g.keys() == g0.keys()
    for k in g0:
        np.testing.assert_allclose(np.asarray(g[k]), np.asarray(g0[k]), rtol=1e-9, atol=1e-12, err_msg=k)
    if dx0 is not None:
        np.testing.assert_allclose(dx, dx0, rtol=1e-9, atol=1e-12)


def test_a_site_with_adapters_on_its_projections_runs_node_by_node(tiny_onnx, decoders):
    """LoRA's adapters read the site's input and add to its projections: the site is no longer the
    form the fused kernel computes, so the stage runs it op by op, with the same results."""
    graph = _graph(tiny_onnx, decoders, "torchscript-17")
    lora, _ = add_lora(graph, LoraSettings(4, 8.0, targets=("q", "v"), seed=1))
    for g in lora.params:
        if lora.constants[g].ndim == 2 and not lora.constants[g].any():  # B = 0 would hide the adapters
            lora.constants[g][...] = np.random.default_rng(2).normal(0, 0.1, lora.constants[g].shape)
    spec = stage_spec(lora, 0, len(lora.blocks) - 1)
    engine = TorchStageEngine(spec, dtype=torch.float64)
    assert engine.fused_attention_blocks == ()
    plain = TorchStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), dtype=torch.float64)
    assert plain.fused_attention_blocks != ()
    feeds = _feeds(lora, spec)
    adapted_loss, base_loss = engine.forward(feeds, 0), plain.forward(feeds, 0)
    assert not np.allclose(adapted_loss, base_loss)  # the adapters count


def test_the_fused_kernel_keeps_fewer_activations(tiny_onnx):
    """What a training forward leaves for its backward: the fused site keeps no [B, heads, S, S]
    probability matrix (the node-by-node softmax keeps its output for the backward; measured as
    the storage of autograd's saved tensors of one micro-batch, parameters included)."""
    graph = load_model(tiny_onnx["torchscript-17"], B, 32)
    spec = stage_spec(graph, 1, 2)
    feeds = _feeds(graph, spec)

    def saved_bytes(engine) -> int:
        seen, total = set(), 0

        def pack(t):
            nonlocal total
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.forward(feeds, 0)
        return total

    fused, nodes = saved_bytes(TorchStageEngine(spec)), saved_bytes(TorchStageEngine(spec, fuse_attention=False))
    heads = graph.blocks[1].heads
    scores = 4 * B * heads * 32 * 32  # one [B, heads, S, S] float32 matrix
    assert fused <= nodes - scores, (fused, nodes, scores)
