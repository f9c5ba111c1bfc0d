"""Graph IR: values, nodes, blocks and the graph, as frozen dataclasses.

A lowered graph has static shapes (batch and sequence length are bound at lowering), its trainable
parameters as named numpy arrays, and its nodes grouped into *blocks*: embeddings, one per encoder
layer, the task head and the loss. Blocks are the unit the planner cuts a model into pipeline stages
by; a contiguous block range is what one engine runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

BLOCK_KINDS = ("embeddings", "encoder", "decoder", "head", "loss")

DTYPE_BYTES = {"float32": 4, "float64": 8, "int64": 8, "int32": 4, "bool": 1, "float16": 2}


@dataclass(frozen=True)
class Value:
    """A tensor in the graph; `shape` is static (ints) after lowering."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Node:
    """One op of `ir.ops`; `tier` is "compute" (float, differentiable) or "host" (numpy, no grad)."""

    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    tier: str = "compute"

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


@dataclass(frozen=True)
class AttentionSite:
    """Where an encoder block's attention sits among its nodes, so its heads can be split across
    backends (`runtime.engines.split`). The planner finds it when it lowers the model
    (`planner.attention`) and it travels in the block table, so a device only reads it.

    `x` is the attention's input (the block's hidden-state input), `mask` the additive mask added
    to the scaled scores, `output` the output projection plus its bias, `residual` output + x (the
    value the rest of the block reads); `nodes` are the attention's nodes and the residual Add;
    `weights` lists (role, graph constant, stored transposed) for the roles Wq, bq, Wk, bk, Wv,
    bv, Wo, bo; `scale` multiplies the scores (1/sqrt(head size))."""

    x: str
    mask: str
    output: str
    residual: str
    nodes: tuple[str, ...]
    weights: tuple[tuple[str, str, bool], ...]
    scale: float

    @property
    def weight_of(self) -> dict[str, tuple[str, bool]]:
        """role -> (graph constant, stored transposed)."""
        return {role: (name, transposed) for role, name, transposed in self.weights}

    def to_json(self) -> dict[str, Any]:
        return {"x": self.x, "mask": self.mask, "output": self.output, "residual": self.residual,
                "nodes": list(self.nodes), "weights": [list(w) for w in self.weights], "scale": self.scale}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "AttentionSite":
        return cls(str(doc["x"]), str(doc["mask"]), str(doc["output"]), str(doc["residual"]),
                   tuple(str(n) for n in doc["nodes"]),
                   tuple((str(r), str(n), bool(t)) for r, n, t in doc["weights"]), float(doc["scale"]))


@dataclass(frozen=True)
class Block:
    """A contiguous group of compute nodes: the unit of pipeline partitioning.

    `inputs` are the values the block reads that another block or the graph inputs produce (the
    hidden state first, then host values such as the attention-mask bias); `output` is the single
    value it hands to the next block. `host_nodes` are the host-tier nodes it needs, recomputed
    from graph inputs wherever the block runs.
    """

    index: int
    name: str
    kind: str
    nodes: tuple[str, ...]
    host_nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    output: str
    params: tuple[str, ...]
    params_bytes: int
    activation_bytes: int
    flops: int
    heads: int | None = None
    head_size: int | None = None
    # an encoder block whose attention heads can be split (None: not found, or not an encoder)
    attention: AttentionSite | None = None
    # bytes of frozen weights the block reads (LoRA's base weights): held once, never stashed,
    # stepped or moved; `params_bytes` counts the trainable ones
    frozen_bytes: int = 0


@dataclass(frozen=True, eq=False)
class Graph:
    """A lowered model. `constants` holds every constant tensor, parameters included; `params`
    names the trainable ones (float, at least 2 elements, feeding compute nodes)."""

    name: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    nodes: tuple[Node, ...]
    values: Mapping[str, Value]
    constants: Mapping[str, np.ndarray]
    params: tuple[str, ...]
    blocks: tuple[Block, ...] = ()
    batch: int = 0
    seq: int = 0

    def node(self, name: str) -> Node:
        return self._node_index()[name]

    def _node_index(self) -> dict[str, Node]:
        cache = self.__dict__.get("_nodes_by_name")
        if cache is None:
            cache = {n.name: n for n in self.nodes}
            object.__setattr__(self, "_nodes_by_name", cache)
        return cache

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n)
        return out

    def input_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.inputs)

    def with_blocks(self, blocks: Iterable[Block]) -> "Graph":
        return Graph(
            self.name, self.inputs, self.outputs, self.nodes, self.values, self.constants,
            self.params, tuple(blocks), self.batch, self.seq,
        )

    def param_bytes(self) -> int:
        return sum(int(self.constants[p].nbytes) for p in self.params)


def topological_order(nodes: Iterable[Node], available: Iterable[str]) -> list[Node]:
    """Kahn's order of `nodes`, given names available up front; raises naming a node on a cycle."""
    nodes = list(nodes)
    ready = set(available)
    produced_by = {o: n.name for n in nodes for o in n.outputs}
    pending = {n.name: {i for i in n.inputs if i and i not in ready and i in produced_by} for n in nodes}
    waiting_on: dict[str, list[str]] = {}
    for name, deps in pending.items():
        for d in deps:
            waiting_on.setdefault(produced_by[d], []).append(name)
    by_name = {n.name: n for n in nodes}
    queue = [n.name for n in nodes if not pending[n.name]]
    order: list[Node] = []
    done_values: set[str] = set()
    while queue:
        name = queue.pop(0)
        node = by_name[name]
        order.append(node)
        for o in node.outputs:
            done_values.add(o)
        for follower in waiting_on.get(name, ()):
            deps = pending[follower]
            deps.difference_update(node.outputs)
            if not deps and follower not in {x.name for x in order} and follower not in queue:
                queue.append(follower)
    if len(order) != len(nodes):
        stuck = [n for n in nodes if n.name not in {x.name for x in order}]
        raise ValueError(f"graph has a cycle or a missing input at node {stuck[0].name!r} ({stuck[0].op})")
    return order


def format_table(graph: Graph) -> str:
    """The block table `confidant inspect` prints."""
    rows = [("#", "block", "kind", "params", "activation", "GFLOPs", "heads x size")]
    for b in graph.blocks:
        hs = f"{b.heads} x {b.head_size}" if b.heads else "-"
        rows.append((str(b.index), b.name, b.kind, _mib(b.params_bytes), _mib(b.activation_bytes),
                     f"{b.flops / 1e9:.3f}", hs))
    total_p = sum(b.params_bytes for b in graph.blocks)
    total_f = sum(b.flops for b in graph.blocks)
    rows.append(("", "total", "", _mib(total_p), "", f"{total_f / 1e9:.3f}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def block_signature(block: Block) -> str:
    """Blocks with equal signatures cost the same to run (e.g. all encoder layers of a model), so a
    device profiles each signature once."""
    heads = f"/h{block.heads}x{block.head_size}" if block.heads else ""
    return f"{block.kind}/p{block.params_bytes}/f{block.flops}/a{block.activation_bytes}{heads}"
