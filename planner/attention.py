"""Attention matching: where each encoder block's attention sits among its lowered nodes, so a
device can split the block's heads across backends without matching anything itself.

`annotate_attention` runs when a model is lowered (`planner.passes.run_passes`) and records an
`ir.graph.AttentionSite` on every encoder block whose nodes have the (post-LayerNorm) BERT attention
pattern: Q/K/V projections (MatMul + bias Add) of the block input, scaled dot-product attention with
the additive mask, the output projection and the residual Add, with nothing else in the block
reading x or any attention value. Blocks that do not match keep `attention=None`: their heads are
not split, and `match_attention` says why (naming the block and the node where the pattern breaks).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ir.graph import AttentionSite, Block, Graph, Node


def annotate_attention(graph: Graph) -> Graph:
    """`graph` with every matching encoder block's `attention` recorded."""
    blocks = []
    for block in graph.blocks:
        site = None
        if block.kind == "encoder" and block.heads:
            try:
                site = match_attention(graph, block)
            except PatternError:
                site = None
        blocks.append(block if site == block.attention else _with_attention(block, site))
    return graph.with_blocks(blocks)


def _with_attention(block: Block, site: AttentionSite | None) -> Block:
    return replace(block, attention=site)


class PatternError(ValueError):
    pass


def match_attention(graph: Graph, block: Block) -> AttentionSite:
    """Find the attention of an encoder block; raises `PatternError` naming the block and the node
    where the lowered nodes stop looking like (post-LN) BERT attention."""
    return _Matcher(graph, block).match()


class _Matcher:
    """One block's nodes, indexed by the values they produce and read, and the steps that walk the
    attention pattern back from its Softmax; `used` collects the nodes the pattern claims."""

    def __init__(self, graph: Graph, block: Block):
        self.graph, self.block = graph, block
        self.nodes = [graph.node(n) for n in block.nodes]
        self.inside = {o: n for n in self.nodes for o in n.outputs}
        self.users: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                self.users.setdefault(i, []).append(n)
        self.used: list[Node] = []
        self.params = frozenset(graph.params)

    def fail(self, msg: str):
        raise PatternError(f"block {self.block.index} ({self.block.name}): {msg}")

    def producer(self, value: str, op: str, what: str) -> Node:
        n = self.inside.get(value)
        if n is None or n.op != op:
            self.fail(f"{what} should be a {op}, is {n.op if n else 'not computed in the block'} ({value!r})")
        return n

    def only_user(self, value: str, op: str, what: str) -> Node:
        us = self.users.get(value, [])
        if len(us) != 1 or us[0].op != op:
            self.fail(f"{what} ({value!r}) should feed exactly one {op}, feeds {[u.op for u in us]}")
        return us[0]

    def is_param(self, v: str) -> bool:
        return v in self.params

    def linear(self, value: str, what: str) -> tuple[str, tuple[str, bool], str, Node]:
        """value = MatMul(x, W) + b -> (x, (W, trans_b), b, matmul)."""
        add = self.producer(value, "Add", f"{what}'s bias Add")
        bias = [v for v in add.inputs if self.is_param(v)]
        other = [v for v in add.inputs if not self.is_param(v)]
        if len(bias) != 1 or len(other) != 1:
            self.fail(f"{what}'s bias Add {add.name!r} should add one parameter to one MatMul")
        mm = self.producer(other[0], "MatMul", f"{what}'s projection")
        if not self.is_param(mm.inputs[1]):
            self.fail(f"{what}'s projection {mm.name!r} should multiply by a weight parameter")
        self.used.extend([add, mm])
        return mm.inputs[0], (mm.inputs[1], bool(mm.attrs.get("trans_b"))), bias[0], mm

    def heads(self, value: str, perm: list[int], what: str) -> str:
        """value = Transpose(Reshape(linear), perm) -> the linear's output."""
        tr = self.producer(value, "Transpose", f"{what}'s head transpose")
        if list(tr.attrs["perm"]) != perm:
            self.fail(f"{what}'s head transpose {tr.name!r} has perm {list(tr.attrs['perm'])}, expected {perm}")
        rs = self.producer(tr.inputs[0], "Reshape", f"{what}'s head reshape")
        if list(rs.attrs["shape"])[2:] != [self.block.heads, self.block.head_size]:
            self.fail(f"{what}'s head reshape {rs.name!r} has shape {rs.attrs['shape']}")
        self.used.extend([tr, rs])
        return rs.inputs[0]

    def softmax(self) -> Node:
        softmaxes = [n for n in self.nodes if n.op == "Softmax"]
        if len(softmaxes) != 1:
            self.fail(f"has {len(softmaxes)} Softmax nodes, a BERT encoder layer has one")
        softmax = softmaxes[0]
        if softmax.attrs.get("axis") not in (3, -1):
            self.fail(f"Softmax {softmax.name!r} is over axis {softmax.attrs.get('axis')}, expected the last")
        return softmax

    def scaled_scores(self, softmax: Node) -> tuple[Node, Node, Node, float, str]:
        """Softmax(Mul|Div(MatMul(Q, K), scale) + mask) -> (mask Add, scaling, scores MatMul, scale, mask)."""
        block = self.block
        masked = self.producer(softmax.inputs[0], "Add", "the mask Add before the Softmax")
        scaled_in = [v for v in masked.inputs if v in self.inside]
        mask_in = [v for v in masked.inputs if v not in self.inside]
        if len(scaled_in) != 1 or len(mask_in) != 1 or mask_in[0] not in block.inputs:
            self.fail(f"the Add {masked.name!r} before the Softmax should add a block input (the mask) to the "
                      f"scaled scores")
        scale_node = self.inside.get(scaled_in[0])
        if scale_node is None or scale_node.op not in ("Mul", "Div"):
            self.fail(f"the scores should be scaled by a Mul or Div before the mask, found "
                      f"{scale_node.op if scale_node else None}")
        consts = [v for v in scale_node.inputs if v in self.graph.constants and v not in self.params]
        scores_in = [v for v in scale_node.inputs if v in self.inside]
        if len(consts) != 1 or len(scores_in) != 1 or (scale_node.op == "Div" and scale_node.inputs[1] != consts[0]):
            self.fail(f"the scaling {scale_node.name!r} should combine the scores with one constant")
        c = np.asarray(self.graph.constants[consts[0]], np.float64)
        if c.size != 1:
            self.fail(f"the attention scale {consts[0]!r} is not a scalar")
        scale = float(c.reshape(-1)[0]) if scale_node.op == "Mul" else 1.0 / float(c.reshape(-1)[0])
        want = 1.0 / math.sqrt(block.head_size)
        if abs(scale - want) > 1e-6 * want:
            self.fail(f"the attention scale is {scale}, the split attention uses 1/sqrt({block.head_size}) = {want}")
        scores = self.producer(scores_in[0], "MatMul", "the attention scores")
        if scores.attrs.get("trans_b"):
            self.fail(f"the scores MatMul {scores.name!r} uses trans_b; expected K transposed to (0, 2, 3, 1)")
        return masked, scale_node, scores, scale, mask_in[0]

    def match(self) -> AttentionSite:
        softmax = self.softmax()
        masked, scale_node, scores, scale, mask = self.scaled_scores(softmax)
        xq, wq, bq, _ = self.linear(self.heads(scores.inputs[0], [0, 2, 1, 3], "Q"), "Q")
        xk, wk, bk, _ = self.linear(self.heads(scores.inputs[1], [0, 2, 3, 1], "K"), "K")
        ctx = self.only_user(softmax.outputs[0], "MatMul", "the attention probabilities")
        if ctx.inputs[0] != softmax.outputs[0] or ctx.attrs.get("trans_b"):
            self.fail(f"the context MatMul {ctx.name!r} should multiply the probabilities by V")
        xv, wv, bv, _ = self.linear(self.heads(ctx.inputs[1], [0, 2, 1, 3], "V"), "V")
        ctx_t = self.only_user(ctx.outputs[0], "Transpose", "the context")
        if list(ctx_t.attrs["perm"]) != [0, 2, 1, 3]:
            self.fail(f"the context transpose {ctx_t.name!r} has perm {list(ctx_t.attrs['perm'])}")
        ctx_flat = self.only_user(ctx_t.outputs[0], "Reshape", "the transposed context")
        out_mm = self.only_user(ctx_flat.outputs[0], "MatMul", "the merged context")
        out_add = self.only_user(out_mm.outputs[0], "Add", "the output projection")
        xo, wo, bo, mm_o = self.linear(out_add.outputs[0], "the output projection")
        if mm_o is not out_mm or xo != ctx_flat.outputs[0]:
            self.fail(f"the output projection {out_mm.name!r} should read the merged context")
        x = self.block.inputs[0]
        if not (xq == xk == xv == x):
            self.fail(f"Q/K/V should project the block input {x!r}, they read {sorted({xq, xk, xv})} "
                      "(a pre-LayerNorm block is not supported)")
        residual = self.only_user(out_add.outputs[0], "Add", "the attention output")
        if sorted(residual.inputs) != sorted([out_add.outputs[0], x]):
            self.fail(f"the residual Add {residual.name!r} should add the attention output and the block input")
        self.used.extend([masked, scale_node, scores, softmax, ctx, ctx_t, ctx_flat, residual])
        names = self.check_rest_reads_only(residual, x)
        roles = {"Wq": wq, "bq": (bq, False), "Wk": wk, "bk": (bk, False), "Wv": wv, "bv": (bv, False),
                 "Wo": wo, "bo": (bo, False)}
        return AttentionSite(x, mask, out_add.outputs[0], residual.outputs[0],
                             tuple(n.name for n in self.nodes if n.name in names),
                             tuple((role, name, transposed) for role, (name, transposed) in roles.items()), scale)

    def check_rest_reads_only(self, residual: Node, x: str) -> frozenset[str]:
        """The claimed nodes' names, once everything else in the block reads only the residual sum
        (never x or an attention value) and no node is claimed twice."""
        names = frozenset(n.name for n in self.used)
        internal = {o for n in self.used for o in n.outputs} - {residual.outputs[0]}
        for n in self.nodes:
            if n.name in names:
                continue
            bad = [i for i in n.inputs if i in internal or i == x]
            if bad:
                self.fail(f"node {n.name!r} ({n.op}) outside the attention reads {bad}")
        if len(names) != len(self.used):
            self.fail("the attention pattern uses a node twice")
        return names
