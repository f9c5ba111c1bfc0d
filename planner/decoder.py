"""Fusions for decoder LLMs (Llama/SmolLM2, GPT-2), each a pure function Graph -> Graph run by
`planner.passes.run_passes` before the blocks are found.

* ``fuse_rms_norm`` ensures: x * (1 / sqrt(mean(x^2) + eps)) * w (TorchScript's Div(1, Sqrt),
  dynamo's Reciprocal, or x / sqrt(...) * w; either factor order) is one ``RMSNorm`` node, as the
  decomposed LayerNorm is one ``LayerNorm``; Gemma's scale (c + w), a constant c, is its ``offset``.
* ``fuse_silu`` ensures: x * Sigmoid(x) is one ``Silu`` (the SwiGLU MLP is then
  down(Silu(gate(x)) * up(x)), plain MatMuls and a Mul).
* ``fuse_rotary`` ensures: HF's rotate-half rotary embedding, x * cos + concat(-x[..., d/2:],
  x[..., :d/2]) * sin with constant cos/sin tables (folded once batch and sequence are bound), is
  one ``Rotary`` node. A rotary form that does not match stays as Slice/Mul/Concat, which every
  engine runs too (only slower).
* ``fuse_tanh_gelu`` ensures: GPT-2's 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) is one
  ``Gelu`` with ``approximate="tanh"``.

A match is taken only when every intermediate value is read inside the pattern alone.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ir.graph import Graph, Node, topological_order

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def run_decoder_fusions(graph: Graph) -> Graph:
    for fuse in (fuse_rms_norm, fuse_silu, fuse_rotary, fuse_tanh_gelu):
        graph = fuse(graph)
    return graph


# --- helpers ------------------------------------------------------------------------------
class _Index:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.prod = graph.producers()
        self.cons = graph.consumers()
        self.params = frozenset(graph.params)
        self.outputs = {v.name for v in graph.outputs}

    def node(self, value: str, op: str | tuple[str, ...]) -> Node | None:
        n = self.prod.get(value)
        ops = (op,) if isinstance(op, str) else op
        return n if n is not None and n.tier == "compute" and n.op in ops else None

    def scalar(self, value: str) -> float | None:
        v = self.graph.constants.get(value)
        if v is None or value in self.params or v.size != 1 or v.dtype.kind != "f":
            return None
        return float(np.asarray(v).reshape(-1)[0])

    def constant(self, value: str) -> bool:
        return value in self.graph.constants and value not in self.params

    def only_inside(self, nodes: list[Node], keep: str) -> bool:
        """Every value the nodes produce, but `keep`, is read by these nodes alone."""
        names = {n.name for n in nodes}
        for n in nodes:
            for o in n.outputs:
                if o == keep:
                    continue
                if o in self.outputs or any(c.name not in names for c in self.cons.get(o, [])):
                    return False
        return True


def _other(node: Node, name: str) -> str | None:
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    return b if a == name else a if b == name else None


def _rewrite(graph: Graph, removed: set[str], added: list[Node]) -> Graph:
    if not removed:
        return graph
    kept = [n for n in graph.nodes if n.name not in removed] + added
    ordered = topological_order(kept, [v.name for v in graph.inputs] + list(graph.constants))
    produced = {o for n in ordered for o in n.outputs}
    used = {i for n in ordered for i in n.inputs} | {v.name for v in graph.outputs}
    values = {k: v for k, v in graph.values.items() if k in used or k in produced}
    constants = {k: v for k, v in graph.constants.items() if k in used}
    return Graph(graph.name, graph.inputs, graph.outputs, tuple(ordered), values, constants,
                 tuple(p for p in graph.params if p in constants), (), graph.batch, graph.seq)


def _fuse_each(graph: Graph, match: Callable[[_Index, Node], tuple[list[Node], Node] | None]) -> Graph:
    """Run `match` at every compute node; each match (nodes to remove, the node replacing them) is
    applied unless it overlaps an earlier one."""
    index = _Index(graph)
    removed: set[str] = set()
    added: list[Node] = []
    for node in graph.nodes:
        if node.tier != "compute" or node.name in removed:
            continue
        found = match(index, node)
        if found is None:
            continue
        nodes, replacement = found
        names = {n.name for n in nodes}
        if names & removed:
            continue
        removed |= names
        added.append(replacement)
    return _rewrite(graph, removed, added)


# --- RMSNorm --------------------------------------------------------------------------------
def fuse_rms_norm(graph: Graph) -> Graph:
    return _fuse_each(graph, _match_rms_norm)


def _match_rms_norm(ix: _Index, sqrt: Node):
    if sqrt.op != "Sqrt":
        return None
    add = ix.node(sqrt.inputs[0], "Add")
    if add is None:
        return None
    mean = next((ix.node(i, "ReduceMean") for i in add.inputs if ix.node(i, "ReduceMean")), None)
    eps = ix.scalar(_other(add, mean.outputs[0]) or "") if mean else None
    if mean is None or eps is None or not mean.attrs.get("keepdims", True):
        return None
    pw = ix.node(mean.inputs[0], "Pow")
    if pw is None or pw.attrs.get("exponent") != 2.0:
        return None
    x = pw.inputs[0]
    rank = len(ix.graph.values[x].shape)
    if [a % rank for a in mean.attrs["axes"]] != [rank - 1]:
        return None
    users = ix.cons.get(sqrt.outputs[0], [])
    if len(users) != 1 or users[0].op != "Div":
        return None
    div = users[0]
    chain = [pw, mean, add, sqrt, div]
    if div.inputs == (x, sqrt.outputs[0]):  # x / sqrt(...)
        normed = div
    elif div.inputs[1] == sqrt.outputs[0] and ix.scalar(div.inputs[0]) == 1.0:  # x * (1 / sqrt(...))
        after = ix.cons.get(div.outputs[0], [])
        if len(after) != 1 or after[0].op != "Mul" or _other(after[0], div.outputs[0]) != x:
            return None
        normed = after[0]
        chain.append(normed)
    else:
        return None
    after = ix.cons.get(normed.outputs[0], [])
    if len(after) != 1 or after[0].op != "Mul":
        return None
    scale_mul = after[0]
    scale = _other(scale_mul, normed.outputs[0])
    width = ix.graph.values[x].shape[-1]
    attrs = {"epsilon": eps}
    shifted = ix.node(scale or "", "Add")
    weight = next((i for i in shifted.inputs if i in ix.params), None) if shifted is not None else None
    if weight is not None:  # Gemma's (1 + w)
        offset = ix.scalar(_other(shifted, weight) or "")
        if offset is None:
            return None
        scale = weight
        chain.append(shifted)
        attrs["offset"] = offset
    if scale not in ix.params or tuple(ix.graph.constants[scale].shape) != (width,):
        return None
    chain.append(scale_mul)
    if not ix.only_inside(chain, scale_mul.outputs[0]):
        return None
    return chain, Node(scale_mul.name, "RMSNorm", (x, scale), scale_mul.outputs, attrs)


# --- SiLU ------------------------------------------------------------------------------------
def fuse_silu(graph: Graph) -> Graph:
    return _fuse_each(graph, _match_silu)


def _match_silu(ix: _Index, sig: Node):
    if sig.op != "Sigmoid":
        return None
    x = sig.inputs[0]
    users = ix.cons.get(sig.outputs[0], [])
    if len(users) != 1 or users[0].op != "Mul" or _other(users[0], sig.outputs[0]) != x:
        return None
    mul = users[0]
    if not ix.only_inside([sig, mul], mul.outputs[0]):
        return None
    return [sig, mul], Node(mul.name, "Silu", (x,), mul.outputs, {})


# --- rotary embeddings --------------------------------------------------------------------------
def fuse_rotary(graph: Graph) -> Graph:
    return _fuse_each(graph, _match_rotary)


def _match_rotary(ix: _Index, add: Node):
    """Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h:d)), Slice(x, 0:h)), sin)) -> Rotary(x, cos, sin)."""
    if add.op != "Add" or len(add.inputs) != 2:
        return None
    for first, second in (add.inputs, add.inputs[::-1]):
        m_cos, m_sin = ix.node(first, "Mul"), ix.node(second, "Mul")
        if m_cos is None or m_sin is None:
            continue
        for x, cos in (m_cos.inputs, m_cos.inputs[::-1]):
            if not ix.constant(cos) or ix.constant(x):
                continue
            found = _rotate_half_times_sin(ix, m_sin, x)
            if found is None:
                continue
            nodes, sin = found
            chain = [m_cos, m_sin, add] + nodes
            x_shape = tuple(ix.graph.values[x].shape)
            tables = [tuple(ix.graph.constants[t].shape) for t in (cos, sin)]
            if any(len(t) > len(x_shape) or np.broadcast_shapes(t, x_shape) != x_shape for t in tables):
                continue
            if not ix.only_inside(chain, add.outputs[0]):
                continue
            return chain, Node(add.name, "Rotary", (x, cos, sin), add.outputs, {})
    return None


def _rotate_half_times_sin(ix: _Index, m_sin: Node, x: str):
    for rot, sin in (m_sin.inputs, m_sin.inputs[::-1]):
        if not ix.constant(sin):
            continue
        concat = ix.node(rot, "Concat")
        if concat is None or len(concat.inputs) != 2:
            continue
        shape = ix.graph.values[x].shape
        d, last = shape[-1], len(shape) - 1
        if concat.attrs.get("axis") != last or d % 2:
            continue
        neg = ix.node(concat.inputs[0], "Mul")
        low = ix.node(concat.inputs[1], "Slice")
        if neg is None or low is None:
            continue
        minus = next((i for i in neg.inputs if ix.scalar(i) == -1.0), None)
        if minus is None:
            continue
        high = ix.node(_other(neg, minus) or "", "Slice")
        if high is None:
            continue
        half = d // 2
        if (low.inputs[0], high.inputs[0]) != (x, x) \
                or (low.attrs["axis"], low.attrs["start"], low.attrs["end"]) != (last, 0, half) \
                or (high.attrs["axis"], high.attrs["start"], high.attrs["end"]) != (last, half, d):
            continue
        return [high, neg, low, concat], sin
    return None


# --- GPT-2's tanh GELU ---------------------------------------------------------------------------
def fuse_tanh_gelu(graph: Graph) -> Graph:
    return _fuse_each(graph, _match_tanh_gelu)


def _scaled(ix: _Index, value: str, want: float) -> tuple[Node, str] | None:
    """value = Mul(y, c) with the constant c == want: (the Mul, y)."""
    mul = ix.node(value, "Mul")
    if mul is None:
        return None
    for y, c in (mul.inputs, mul.inputs[::-1]):
        s = ix.scalar(c)
        if s is not None and abs(s - want) <= 1e-6 * abs(want):
            return mul, y
    return None


def _match_tanh_gelu(ix: _Index, tanh: Node):
    if tanh.op != "Tanh":
        return None
    inner = _scaled(ix, tanh.inputs[0], SQRT_2_OVER_PI)
    if inner is None:
        return None
    mul_c, s = inner
    add = ix.node(s, "Add")
    if add is None:
        return None
    for x, cubic_term in (add.inputs, add.inputs[::-1]):
        cubic = _scaled(ix, cubic_term, 0.044715)
        if cubic is None:
            continue
        mul_k, cube = cubic
        pw = ix.node(cube, "Pow")
        if pw is None or pw.inputs[0] != x or pw.attrs.get("exponent") != 3.0:
            continue
        users = ix.cons.get(tanh.outputs[0], [])
        if len(users) != 1 or users[0].op != "Add" or ix.scalar(_other(users[0], tanh.outputs[0]) or "") != 1.0:
            return None
        one_plus = users[0]
        users = ix.cons.get(one_plus.outputs[0], [])
        if len(users) != 1 or users[0].op != "Mul":
            return None
        final = users[0]
        half = _scaled(ix, _other(final, one_plus.outputs[0]) or "", 0.5)
        if half is None or half[1] != x:
            return None
        chain = [pw, mul_k, add, mul_c, tanh, one_plus, half[0], final]
        if not ix.only_inside(chain, final.outputs[0]):
            return None
        return chain, Node(final.name, "Gelu", (x,), final.outputs, {"approximate": "tanh"})
    return None
