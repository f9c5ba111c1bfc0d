"""What one engine runs: a contiguous block range of a lowered graph, prepared engine-independently.

A stage reads one activation from the previous stage (none for the first) plus graph inputs
(token ids, the attention mask, loss targets); host-tier nodes turn graph inputs into the values
compute nodes read (the additive attention mask), evaluated with numpy wherever the stage runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ir.graph import Block, Graph, Node
from ir.host_eval import eval_host_nodes


@dataclass(frozen=True, eq=False)
class StageSpec:
    graph: Graph
    first_block: int
    last_block: int
    compute_nodes: tuple[Node, ...]
    host_nodes: tuple[Node, ...]
    activation_input: str | None
    graph_inputs: tuple[str, ...]
    output: str
    params: tuple[str, ...]

    @property
    def blocks(self) -> tuple[Block, ...]:
        return self.graph.blocks[self.first_block : self.last_block + 1]

    @property
    def is_last(self) -> bool:
        return self.last_block == len(self.graph.blocks) - 1

    def block_nodes(self) -> list[tuple[Block, list[Node]]]:
        by_name = {n.name: n for n in self.compute_nodes}
        return [(b, [by_name[n] for n in b.nodes]) for b in self.blocks]


def stage_spec(graph: Graph, first_block: int, last_block: int) -> StageSpec:
    n = len(graph.blocks)
    if not (0 <= first_block <= last_block < n):
        raise ValueError(f"block range [{first_block}, {last_block}] is outside the model's {n} blocks (0..{n - 1})")
    blocks = graph.blocks[first_block : last_block + 1]
    names = {x for b in blocks for x in b.nodes}
    host_names = {x for b in blocks for x in b.host_nodes}
    compute = tuple(node for node in graph.nodes if node.name in names)
    host = tuple(node for node in graph.nodes if node.name in host_names)
    needed = {i for node in compute + host for i in node.inputs}
    graph_inputs = tuple(i for i in graph.input_names() if i in needed)
    activation = blocks[0].inputs[0] if first_block > 0 else None
    # a weight several blocks share (ALBERT's layer) is one parameter of the stage, listed once
    params = tuple(dict.fromkeys(p for b in blocks for p in b.params))
    return StageSpec(graph, first_block, last_block, compute, host, activation, graph_inputs,
                     blocks[-1].output, params)


def looked_up_only(spec: StageSpec) -> frozenset[str]:
    """The stage's parameters that nothing but embedding lookups read (as their table): their
    lookup's backward never reads them, so weight stashing keeps no old version of them (PyTorch
    unless it re-runs its forwards; MNN feeds a forward it re-runs the rows that forward gathered)."""
    readers: dict[str, set[str]] = {}
    for n in spec.compute_nodes:
        for i, name in enumerate(n.inputs):
            readers.setdefault(name, set()).add("lookup" if n.op == "Gather" and i == 0 else n.op)
    return frozenset(p for p in spec.params if readers.get(p) == {"lookup"})


def host_values(spec: StageSpec, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Graph inputs of this stage plus every host value its compute nodes read."""
    missing = [i for i in spec.graph_inputs if i not in feeds]
    if missing:
        raise KeyError(f"stage blocks {spec.first_block}-{spec.last_block} need inputs {missing}")
    env: dict[str, np.ndarray] = {i: np.asarray(feeds[i]) for i in spec.graph_inputs}
    for i in spec.graph_inputs:
        expected = spec.graph.values[i].shape
        if tuple(env[i].shape) != tuple(expected):
            raise ValueError(f"input {i!r} has shape {tuple(env[i].shape)}, the plan was lowered for {tuple(expected)}")
    env.update({k: v for k, v in spec.graph.constants.items()
                if any(k in n.inputs for n in spec.host_nodes)})
    eval_host_nodes(spec.host_nodes, env)
    return env


@dataclass(frozen=True)
class FusedLmHead:
    """The LM head's projection and the causal-LM loss on one stage, run as one fused kernel
    (`runtime.engines.lm_loss.LinearCrossEntropy`), so no vocabulary-sized logits are held:
    `matmul` (logits = hidden x weight, `transposed`: weight^T) is the head block's last node and
    `loss` the loss block's TokenCrossEntropy reading its output."""

    head_index: int
    loss_index: int
    matmul: Node
    loss: Node
    hidden: str
    weight: str
    transposed: bool


def fused_lm_head(graph: Graph, first_block: int, last_block: int) -> FusedLmHead | None:
    """The fusable LM head + loss of blocks first..last (a decoder LLM's last two blocks on one
    stage), or None. The planner's memory model uses the same test (`planner.cost`)."""
    if last_block < 1 or last_block != len(graph.blocks) - 1 or first_block > last_block - 1:
        return None
    head, loss = graph.blocks[last_block - 1], graph.blocks[last_block]
    if len(loss.nodes) != 1:
        return None
    loss_node = graph.node(loss.nodes[0])
    if loss_node.op != "TokenCrossEntropy" or loss_node.inputs[0] != head.output:
        return None
    matmul = graph.node(head.nodes[-1]) if head.nodes else None
    if matmul is None or matmul.op != "MatMul" or matmul.outputs[0] != head.output or len(head.nodes) < 2:
        return None
    weight = matmul.inputs[1]
    if weight not in graph.constants or graph.constants[weight].ndim != 2:
        return None
    readers = [n for n in graph.nodes if head.output in n.inputs]
    if readers != [loss_node]:
        return None
    return FusedLmHead(head.index, loss.index, matmul, loss_node, matmul.inputs[0], weight,
                       bool(matmul.attrs.get("trans_b")))
