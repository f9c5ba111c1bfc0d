"""Graph IR: values, nodes, blocks and the graph, as frozen dataclasses.

A lowered graph has static shapes (batch and sequence length are bound at lowering), its trainable
parameters as named numpy arrays, and its nodes grouped into *blocks*: embeddings, one per encoder
layer, the task head and the loss. Blocks are the unit the planner cuts a model into pipeline stages
by; a contiguous block range is what one engine runs.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

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
    """Where a block's attention sits among its nodes, so its heads can be split across backends
    (`runtime.engines.split`). The planner finds it when it lowers the model (`planner.attention`)
    and it travels in the block table, so a device only reads it.

    `x` is the block's hidden-state input, `mask` the additive mask added to the scaled scores,
    `output` the output projection (plus its bias, if any), `residual` output + x (the value the
    rest of the block reads); `nodes` are the attention's nodes (a pre-norm included) and the
    residual Add; `weights` lists (role, graph constant, stored transposed, first column, end
    column) for the roles Wq, Wk, Wv, Wo and the optional bq, bk, bv, bo, norm_w, norm_b, where
    the column range [first, end) of a fused projection (GPT-2's c_attn, x @ W layout) is the
    role's share (None, None: the whole constant); `scale` multiplies the scores.
    `norm`: "LayerNorm" or "RMSNorm" when the attention reads norm(x) (a pre-norm block: GPT-2,
    Llama), None when it reads x (post-LN BERT); `norm_epsilon` its epsilon, `norm_offset` what an
    RMSNorm adds to its scale (Gemma's 1). `rotary`: the (cos,
    sin) constants of rotary embeddings applied to Q and K, None without them."""

    x: str
    mask: str
    output: str
    residual: str
    nodes: tuple[str, ...]
    weights: tuple[tuple[str, str, bool, int | None, int | None], ...]
    scale: float
    norm: str | None = None
    norm_epsilon: float = 0.0
    rotary: tuple[str, str] | None = None
    norm_offset: float = 0.0

    @property
    def weight_of(self) -> dict[str, tuple[str, bool]]:
        """role -> (graph constant, stored transposed)."""
        return {role: (name, transposed) for role, name, transposed, *_ in self.weights}

    @property
    def columns_of(self) -> dict[str, tuple[int, int] | None]:
        """role -> the (first, end) columns of its fused constant that it owns, None for all."""
        return {w[0]: (None if w[3] is None else (int(w[3]), int(w[4]))) for w in self.weights}

    def to_json(self) -> dict[str, Any]:
        doc = {"x": self.x, "mask": self.mask, "output": self.output, "residual": self.residual,
               "nodes": list(self.nodes), "weights": [list(w) for w in self.weights], "scale": self.scale}
        if self.norm is not None:
            doc["norm"], doc["norm_epsilon"] = self.norm, self.norm_epsilon
            if self.norm_offset:
                doc["norm_offset"] = self.norm_offset
        if self.rotary is not None:
            doc["rotary"] = list(self.rotary)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "AttentionSite":
        def weight(w) -> tuple[str, str, bool, int | None, int | None]:
            first, end = (w[3], w[4]) if len(w) == 5 else (None, None)  # 3 entries: written before fused roles
            return (str(w[0]), str(w[1]), bool(w[2]), None if first is None else int(first),
                    None if end is None else int(end))

        rotary = doc.get("rotary")
        return cls(str(doc["x"]), str(doc["mask"]), str(doc["output"]), str(doc["residual"]),
                   tuple(str(n) for n in doc["nodes"]), tuple(weight(w) for w in doc["weights"]),
                   float(doc["scale"]), None if doc.get("norm") is None else str(doc["norm"]),
                   float(doc.get("norm_epsilon", 0.0)), None if rotary is None else (str(rotary[0]), str(rotary[1])),
                   float(doc.get("norm_offset", 0.0)))


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
    # a block whose attention heads can be split (None: no attention the lowering could place)
    attention: AttentionSite | None = None
    # bytes of frozen weights the block reads (LoRA's base weights): held once, never stashed,
    # stepped or moved; `params_bytes` counts the trainable ones
    frozen_bytes: int = 0
    # key/value heads of an attention block: `heads` for multi-head attention, fewer under
    # grouped-query attention (each key/value head serves heads / kv_heads query heads); None
    # where the block has no attention
    kv_heads: int | None = None

    @property
    def split_units(self) -> int | None:
        """How many pieces the block's attention can be split into: one per key/value head (with
        its heads / kv_heads query heads; one query head each without grouped-query attention)."""
        return self.kv_heads or self.heads


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
    # How many distinct rows of each embedding table the training data looks up (table name ->
    # rows; `planner.lookups`, from `confidant plan --data`): the optimizer keeps state only for
    # those rows (runtime.optim), which the memory model then charges instead of the whole table.
    # A fact about the data, like `batch` and `seq`; empty (the default): unknown, charged dense.
    lookup_rows: Mapping[str, int] = field(default_factory=dict)
    # The most positions of one micro-batch that are loss targets in the data the plan is made for
    # (`confidant plan --data`): a causal LM's fused head + loss computes logits for those only, so
    # its workspace is charged for that many (`ir.profile.BlockCost.workspace_at_targets`). A fact
    # about the data, like `lookup_rows`; None (the default): unknown, every position charged.
    target_positions: int | None = None

    def node(self, name: str) -> Node:
        return self._node_index()[name]

    def _node_index(self) -> dict[str, Node]:
        cache = self.__dict__.get("_nodes_by_name")
        if cache is None:
            cache = {n.name: n for n in self.nodes}
            object.__setattr__(self, "_nodes_by_name", cache)
        return cache

    def producers(self) -> Mapping[str, Node]:
        """Value name -> the node that writes it (read-only, built once per graph, as `node` is)."""
        return MappingProxyType(self._use_def().producers)

    def consumers(self) -> Mapping[str, tuple[Node, ...]]:
        """Value name -> the nodes that read it, in graph order (read-only, built once per graph)."""
        return MappingProxyType(self._use_def().readers)

    def _use_def(self) -> "UseDef":  # plain dicts in the cache, so a Graph still pickles
        cache = self.__dict__.get("_use_def_index")
        if cache is None:
            cache = use_def(self.nodes)
            object.__setattr__(self, "_use_def_index", cache)
        return cache

    def input_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.inputs)

    def with_blocks(self, blocks: Iterable[Block]) -> "Graph":
        return Graph(
            self.name, self.inputs, self.outputs, self.nodes, self.values, self.constants,
            self.params, tuple(blocks), self.batch, self.seq,
        )

    def param_bytes(self) -> int:
        return sum(int(self.constants[p].nbytes) for p in self.params)


@dataclass(frozen=True)
class UseDef:
    """Who writes and who reads each value of a list of nodes: the index a pass walks a pattern by.
    A Graph's own is `Graph.producers()`/`consumers()`; `use_def(nodes)` gives one for part of a
    graph (one block's nodes, the compute nodes of a stage)."""

    producers: Mapping[str, Node]
    readers: Mapping[str, tuple[Node, ...]]


def use_def(nodes: Iterable[Node]) -> UseDef:
    nodes = tuple(nodes)
    readers: dict[str, list[Node]] = {}
    for n in nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)
    return UseDef({o: n for n in nodes for o in n.outputs}, {k: tuple(v) for k, v in readers.items()})


def topological_order(nodes: Iterable[Node], available: Iterable[str]) -> list[Node]:
    """Kahn's order of `nodes`, given names available up front; raises naming a node on a cycle.

    Stable: among the nodes ready at any time, the one given first goes first, so nodes already in
    order come back unchanged. O(n log n) in the number of nodes and edges (a heap of ready
    positions), which keeps lowering a deep model linear in its depth up to the log factor."""
    nodes = list(nodes)
    ready = set(available)
    produced_by = {o: k for k, n in enumerate(nodes) for o in n.outputs}
    missing = [0] * len(nodes)
    waiting_on: dict[int, list[int]] = {}
    for k, n in enumerate(nodes):
        deps = {produced_by[i] for i in n.inputs if i and i not in ready and i in produced_by}
        deps.discard(k)
        if any(i in n.outputs and i not in ready for i in n.inputs if i):
            missing[k] = 1  # reads its own output: on a cycle, never ready
        missing[k] += len(deps)
        for d in deps:
            waiting_on.setdefault(d, []).append(k)
    heap = [k for k in range(len(nodes)) if not missing[k]]
    heapq.heapify(heap)
    order: list[Node] = []
    while heap:
        k = heapq.heappop(heap)
        order.append(nodes[k])
        for follower in waiting_on.get(k, ()):
            missing[follower] -= 1
            if not missing[follower]:
                heapq.heappush(heap, follower)
    if len(order) != len(nodes):
        stuck = next(n for k, n in enumerate(nodes) if missing[k])
        raise ValueError(f"graph has a cycle or a missing input at node {stuck.name!r} ({stuck.op})")
    return order


def format_table(graph: Graph) -> str:
    """The block table `confidant inspect` prints."""
    rows = [("#", "block", "kind", "params", "activation", "GFLOPs", "heads x size", "head split")]
    for b in graph.blocks:
        hs = f"{b.heads} x {b.head_size}" if b.heads else "-"
        if b.heads and b.kv_heads and b.kv_heads != b.heads:
            hs = f"{b.heads} x {b.head_size} (kv {b.kv_heads})"
        split = "-"
        if b.heads:  # where the lowering placed the attention, the units a head split deals out
            split = ("no" if b.attention is None else f"{b.split_units} heads" if b.split_units == b.heads else
                     f"{b.split_units} kv groups")
        rows.append((str(b.index), b.name, b.kind, _mib(b.params_bytes), _mib(b.activation_bytes),
                     f"{b.flops / 1e9:.3f}", hs, split))
    total_p = sum(b.params_bytes for b in graph.blocks)
    total_f = sum(b.flops for b in graph.blocks)
    rows.append(("", "total", "", _mib(total_p), "", f"{total_f / 1e9:.3f}", "", ""))
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
    if block.heads and block.kv_heads and block.kv_heads != block.heads:
        heads += f"/kv{block.kv_heads}"
    return f"{block.kind}/p{block.params_bytes}/f{block.flops}/a{block.activation_bytes}{heads}"


def is_causal_lm(graph: Graph) -> bool:
    """A decoder lowered with its causal-LM loss (the last block's op is TokenCrossEntropy)."""
    return bool(graph.blocks and graph.blocks[-1].nodes) and graph.node(graph.blocks[-1].nodes[0]).op == \
        "TokenCrossEntropy"


def logits_shape(graph: Graph) -> tuple[int, ...]:
    """The shape of the head's output, the logits the loss block reads: [batch, labels] for a
    sequence classifier, [batch, seq, labels] for a token classifier (and a causal LM)."""
    return tuple(graph.values[graph.blocks[-2].output].shape)


def is_sequence_classifier(graph: Graph) -> bool:
    """One label per sequence (logits [batch, labels]), not one per token."""
    return len(logits_shape(graph)) == 2


def tied_parameters(graph: Graph, ranges) -> dict[str, tuple[int, ...]]:
    """Parameters that more than one stage holds, for stages running the block ranges `ranges`
    ([first, last] per stage, in order): a weight read by blocks on several stages (ALBERT's one
    layer, cut through) -> those stages. Each holder keeps a copy; before any of them updates, the
    gradients of all holders are summed and every holder applies the same sum (DESIGN.md: tied
    weights), so a pipeline trains exactly as one device does."""
    return tied_parameters_of_blocks(graph.blocks, ranges)


def tied_parameters_of_blocks(blocks: Sequence[Block], ranges) -> dict[str, tuple[int, ...]]:
    """`tied_parameters` from the blocks alone (every graph slice keeps all blocks' metadata)."""
    holders: dict[str, list[int]] = {}
    for stage, (first, last) in enumerate(ranges):
        for block in blocks[first:last + 1]:
            for p in block.params:
                stages = holders.setdefault(p, [])
                if not stages or stages[-1] != stage:
                    stages.append(stage)
    return {p: tuple(s) for p, s in holders.items() if len(s) > 1}
