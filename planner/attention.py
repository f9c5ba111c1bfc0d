"""Attention matching: where each block's attention sits among its lowered nodes, so a device can
split the block's heads across backends without matching anything itself.

`annotate_attention` runs when a model is lowered (`planner.passes.run_passes`) and records an
`ir.graph.AttentionSite` on every encoder or decoder block whose nodes compute multi-head
attention in a form the split engine (`runtime.engines.split`) reproduces per head group:

  a = x, or Norm(x) (LayerNorm or RMSNorm: a pre-norm block, GPT-2 and Llama)
  Q, K, V = a @ W (+ b): separate projections, or column slices of one fused projection (GPT-2's
            c_attn, its Split lowered to Slices), with or without a 2-D reshape around (Gemm)
  heads: Reshape to (.., heads | kv_heads, head size) and Transpose; rotary embeddings on Q and K
         (a `Rotary` node with constant cos/sin tables) optional; key/value heads repeated for
         grouped-query attention (Reshape, Expand, Reshape) optional
  softmax(Q K^T * scale + mask) V, merged, @ Wo (+ bo), and the residual Add of that and x,

with nothing else in the block reading x or any attention value. The mask must be a block input
(the additive padding and causal mask of the host tier). Blocks that do not match keep
`attention=None`: their heads are not split, and `match_attention` says why (naming the block and
the node where the pattern breaks).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ir.graph import AttentionSite, Block, Graph, Node, use_def

NORMS = ("LayerNorm", "RMSNorm")


def annotate_attention(graph: Graph) -> Graph:
    """`graph` with every matching encoder block's `attention` recorded."""
    blocks = []
    for block in graph.blocks:
        site = None
        if block.kind in ("encoder", "decoder") and block.heads:
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
    """Find the attention of a block; raises `PatternError` naming the block and the node where the
    lowered nodes stop looking like the attention of the module docstring."""
    return _Matcher(graph, block).match()


class _Matcher:
    """One block's nodes, indexed by the values they produce and read, and the steps that walk the
    attention pattern back from its Softmax; `used` collects the nodes the pattern claims."""

    def __init__(self, graph: Graph, block: Block):
        self.graph, self.block = graph, block
        self.nodes = [graph.node(n) for n in block.nodes]
        index = use_def(self.nodes)
        self.inside, self.users = index.producers, index.readers
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

    def note(self, *nodes: Node) -> None:
        for n in nodes:
            if all(n is not u for u in self.used):  # a fused projection is reached three times
                self.used.append(n)

    def shape(self, value: str) -> tuple[int, ...]:
        return tuple(self.graph.values[value].shape)

    def projection(self, value: str, what: str) -> tuple[str, tuple[str, bool], str | None, tuple[int, int] | None]:
        """value = [Slice of] [Reshape to 3-D of] MatMul(a, W) [+ b] -> (a, (W, trans_b), b, columns)."""
        columns = None
        n = self.inside.get(value)
        if n is not None and n.op == "Slice":
            rank = len(self.shape(n.inputs[0]))
            if n.attrs.get("axis") not in (rank - 1, -1):
                self.fail(f"{what}'s Slice {n.name!r} of a fused projection is over axis {n.attrs.get('axis')}, "
                          "expected the last")
            columns = (int(n.attrs["start"]), int(n.attrs["end"]))
            self.note(n)
            value = n.inputs[0]
            n = self.inside.get(value)
        flat = False
        if n is not None and n.op == "Reshape" and len(self.shape(n.inputs[0])) == 2:
            flat = True  # Gemm on (batch x seq, features), reshaped back
            self.note(n)
            value = n.inputs[0]
            n = self.inside.get(value)
        bias = None
        if n is not None and n.op == "Add":
            params = [v for v in n.inputs if self.is_param(v)]
            other = [v for v in n.inputs if not self.is_param(v)]
            if len(params) != 1 or len(other) != 1 or len(self.shape(params[0])) != 1:
                self.fail(f"{what}'s bias Add {n.name!r} should add one 1-D parameter to one MatMul")
            bias = params[0]
            self.note(n)
            value = other[0]
        mm = self.producer(value, "MatMul", f"{what}'s projection")
        if not self.is_param(mm.inputs[1]):
            self.fail(f"{what}'s projection {mm.name!r} should multiply by a weight parameter")
        self.note(mm)
        a = mm.inputs[0]
        if flat:
            r = self.producer(a, "Reshape", f"{what}'s 2-D input reshape")
            self.note(r)
            a = r.inputs[0]
        width = self.shape(mm.outputs[0])[-1]
        if columns is not None and not (0 <= columns[0] < columns[1] <= width):
            self.fail(f"{what}'s columns {columns} are outside its fused projection of width {width}")
        return a, (mm.inputs[1], bool(mm.attrs.get("trans_b"))), bias, columns

    def heads(self, value: str, perm: list[int], count: int, what: str) -> str:
        """value = Transpose(Reshape(projection, (.., count, head size)), perm) -> the projection."""
        tr = self.producer(value, "Transpose", f"{what}'s head transpose")
        if list(tr.attrs["perm"]) != perm:
            self.fail(f"{what}'s head transpose {tr.name!r} has perm {list(tr.attrs['perm'])}, expected {perm}")
        rs = self.producer(tr.inputs[0], "Reshape", f"{what}'s head reshape")
        if list(rs.attrs["shape"])[2:] != [count, self.block.head_size]:
            self.fail(f"{what}'s head reshape {rs.name!r} has shape {rs.attrs['shape']}, expected (.., {count}, "
                      f"{self.block.head_size})")
        self.note(tr, rs)
        return rs.inputs[0]

    def rotated(self, value: str, what: str) -> tuple[str, tuple[str, str] | None]:
        """Strip a Rotary node off `value`: (its input, (cos, sin)), or (value, None)."""
        n = self.inside.get(value)
        if n is None or n.op != "Rotary":
            return value, None
        cos, sin = n.inputs[1], n.inputs[2]
        for t in (cos, sin):
            if t not in self.graph.constants or self.is_param(t):
                self.fail(f"{what}'s rotary table {t!r} is computed, not a constant (bind batch and sequence "
                          "when lowering so the tables fold)")
            shape = self.shape(t)
            if len(shape) != 4 or shape[1] != 1 or shape[-1] != self.block.head_size:
                self.fail(f"{what}'s rotary table {t!r} has shape {shape}, expected (1 or batch, 1, seq, "
                          f"{self.block.head_size})")
        self.note(n)
        return n.inputs[0], (cos, sin)

    def unrepeat(self, value: str, what: str) -> str:
        """Strip grouped-query attention's repeat of the key/value heads (Reshape to (B, kv, 1, S, hs),
        Expand to (B, kv, group, S, hs), Reshape to (B, heads, S, hs)) off `value`."""
        heads, kv = self.block.heads, self.kv_heads
        if kv == heads:
            return value
        merged = self.producer(value, "Reshape", f"{what}'s merge of repeated key/value heads")
        expand = self.producer(merged.inputs[0], "Expand", f"{what}'s repeat of key/value heads")
        split = self.producer(expand.inputs[0], "Reshape", f"{what}'s key/value head unsqueeze")
        b, s, hs = self.block_shape[0], self.block_shape[1], self.block.head_size
        if (list(split.attrs["shape"]) != [b, kv, 1, s, hs] or list(expand.attrs["shape"]) != [b, kv, heads // kv, s, hs]
                or list(merged.attrs["shape"]) != [b, heads, s, hs]):
            self.fail(f"{what}'s key/value repeat {expand.name!r} has shapes {split.attrs['shape']} -> "
                      f"{expand.attrs['shape']} -> {merged.attrs['shape']}, expected ({b}, {kv}, 1, {s}, {hs}) -> "
                      f"({b}, {kv}, {heads // kv}, {s}, {hs}) -> ({b}, {heads}, {s}, {hs})")
        self.note(merged, expand, split)
        return split.inputs[0]

    def keys(self, value: str) -> tuple[str, tuple[str, str] | None]:
        """The scores' second operand (K^T per head) -> (K's projection value, rotary tables)."""
        tr = self.producer(value, "Transpose", "K's head transpose")
        perm = list(tr.attrs["perm"])
        if perm == [0, 2, 3, 1]:  # (B, S, kv, hs) -> (B, kv, hs, S) straight from the reshape
            if self.kv_heads != self.block.heads:
                self.fail(f"K's transpose {tr.name!r} reads {self.kv_heads} key/value heads without repeating them "
                          f"for {self.block.heads} query heads")
            return self.heads(value, [0, 2, 3, 1], self.kv_heads, "K"), None
        if perm != [0, 1, 3, 2]:
            self.fail(f"K's transpose {tr.name!r} has perm {perm}, expected [0, 2, 3, 1] or [0, 1, 3, 2]")
        self.note(tr)
        k, rot_after = self.rotated(tr.inputs[0], "K")
        k = self.unrepeat(k, "K")
        k, rot_before = self.rotated(k, "K")
        return self.heads(k, [0, 2, 1, 3], self.kv_heads, "K"), rot_after or rot_before

    def softmax(self) -> Node:
        softmaxes = [n for n in self.nodes if n.op == "Softmax"]
        if len(softmaxes) != 1:
            self.fail(f"has {len(softmaxes)} Softmax nodes, an attention layer has one")
        softmax = softmaxes[0]
        rank = len(self.shape(softmax.inputs[0]))
        if softmax.attrs.get("axis") not in (rank - 1, -1):
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
        if not (math.isfinite(scale) and scale > 0):
            self.fail(f"the attention scale is {scale}")
        scores = self.producer(scores_in[0], "MatMul", "the attention scores")
        if scores.attrs.get("trans_b"):
            self.fail(f"the scores MatMul {scores.name!r} uses trans_b; expected K transposed per head")
        return masked, scale_node, scores, scale, mask_in[0]

    def output(self, ctx: Node) -> tuple[Node, str, tuple[str, bool], str | None]:
        """The context merged and projected: (residual Add, output value, (Wo, trans_b), bo)."""
        x = self.block.inputs[0]
        ctx_t = self.only_user(ctx.outputs[0], "Transpose", "the context")
        if list(ctx_t.attrs["perm"]) != [0, 2, 1, 3]:
            self.fail(f"the context transpose {ctx_t.name!r} has perm {list(ctx_t.attrs['perm'])}")
        ctx_flat = self.only_user(ctx_t.outputs[0], "Reshape", "the transposed context")
        flat = len(self.shape(ctx_flat.outputs[0])) == 2
        out_mm = self.only_user(ctx_flat.outputs[0], "MatMul", "the merged context")
        if out_mm.inputs[0] != ctx_flat.outputs[0] or not self.is_param(out_mm.inputs[1]):
            self.fail(f"the output projection {out_mm.name!r} should multiply the merged context by a weight")
        self.note(ctx_t, ctx_flat, out_mm)
        value, bias = out_mm.outputs[0], None
        users = self.users.get(value, [])
        if len(users) == 1 and users[0].op == "Add":
            params = [v for v in users[0].inputs if self.is_param(v)]
            if len(params) == 1 and len(self.shape(params[0])) == 1:
                bias = params[0]
                self.note(users[0])
                value = users[0].outputs[0]
        if flat:
            back = self.only_user(value, "Reshape", "the output projection")
            if self.shape(back.outputs[0]) != self.block_shape:
                self.fail(f"the output reshape {back.name!r} gives {self.shape(back.outputs[0])}, expected "
                          f"{self.block_shape}")
            self.note(back)
            value = back.outputs[0]
        residual = self.only_user(value, "Add", "the attention output")
        if sorted(residual.inputs) != sorted([value, x]):
            self.fail(f"the residual Add {residual.name!r} should add the attention output and the block input")
        return residual, value, (out_mm.inputs[1], bool(out_mm.attrs.get("trans_b"))), bias

    def attention_input(self, a: str) -> tuple[Node | None, tuple[str, ...]]:
        """The norm whose output the projections read (None: they read x), and its parameters."""
        x = self.block.inputs[0]
        if a == x:
            return None, ()
        norm = self.inside.get(a)
        if norm is None or norm.op not in NORMS or norm.inputs[0] != x:
            self.fail(f"Q/K/V should project the block input {x!r} or a LayerNorm/RMSNorm of it, they read {a!r} "
                      f"({norm.op if norm else 'not computed in the block'})")
        params = norm.inputs[1:]
        if not params or not all(self.is_param(p) for p in params):
            self.fail(f"the pre-norm {norm.name!r} should scale (and shift) by parameters")
        self.note(norm)
        return norm, tuple(params)

    def match(self) -> AttentionSite:
        block = self.block
        self.kv_heads = block.kv_heads or block.heads
        self.block_shape = self.shape(block.inputs[0])
        if len(self.block_shape) != 3:
            self.fail(f"the block input has shape {self.block_shape}, expected (batch, seq, hidden)")
        softmax = self.softmax()
        masked, scale_node, scores, scale, mask = self.scaled_scores(softmax)
        q, rot_q = self.rotated(scores.inputs[0], "Q")
        aq, wq, bq, cq = self.projection(self.heads(q, [0, 2, 1, 3], block.heads, "Q"), "Q")
        k, rot_k = self.keys(scores.inputs[1])
        ak, wk, bk, ck = self.projection(k, "K")
        if rot_q != rot_k:
            self.fail(f"Q and K should be rotated by the same tables, Q by {rot_q}, K by {rot_k}")
        ctx = self.only_user(softmax.outputs[0], "MatMul", "the attention probabilities")
        if ctx.inputs[0] != softmax.outputs[0] or ctx.attrs.get("trans_b"):
            self.fail(f"the context MatMul {ctx.name!r} should multiply the probabilities by V")
        av, wv, bv, cv = self.projection(self.heads(self.unrepeat(ctx.inputs[1], "V"), [0, 2, 1, 3], self.kv_heads,
                                                     "V"), "V")
        if not (aq == ak == av):
            self.fail(f"Q/K/V should project one value, they read {sorted({aq, ak, av})}")
        self.check_widths(wq, cq, wk, ck, wv, cv)
        residual, output, wo, bo = self.output(ctx)
        norm, norm_params = self.attention_input(aq)
        self.note(masked, scale_node, scores, softmax, ctx, residual)
        names = self.check_rest_reads_only(residual, block.inputs[0])
        roles = [("Wq", wq, cq), ("Wk", wk, ck), ("Wv", wv, cv), ("Wo", wo, None)]
        for role, bias, cols in (("bq", bq, cq), ("bk", bk, ck), ("bv", bv, cv), ("bo", bo, None)):
            if bias is not None:
                roles.append((role, (bias, False), cols))
        for role, p in zip(("norm_w", "norm_b"), norm_params):
            roles.append((role, (p, False), None))
        weights = tuple((role, name, transposed, *(cols if cols else (None, None)))
                        for role, (name, transposed), cols in roles)
        return AttentionSite(block.inputs[0], mask, output, residual.outputs[0],
                             tuple(n.name for n in self.nodes if n.name in names), weights, scale,
                             None if norm is None else norm.op,
                             0.0 if norm is None else float(norm.attrs.get("epsilon", 1e-5)), rot_q,
                             0.0 if norm is None else float(norm.attrs.get("offset", 0.0)))

    def check_widths(self, wq, cq, wk, ck, wv, cv) -> None:
        """Each projection's share is heads (or kv_heads) x head size wide."""
        hs = self.block.head_size
        for what, (w, transposed), cols, count in (("Q", wq, cq, self.block.heads), ("K", wk, ck, self.kv_heads),
                                                    ("V", wv, cv, self.kv_heads)):
            shape = self.shape(w)
            width = (cols[1] - cols[0]) if cols else (shape[0] if transposed else shape[-1])
            if len(shape) != 2 or width != count * hs:
                self.fail(f"{what}'s weight {w!r} ({shape}, columns {cols}) is not {count} x {hs} wide")
        shares = [(wq[0], cq), (wk[0], ck), (wv[0], cv)]
        for i, (w, cols) in enumerate(shares):
            for w2, cols2 in shares[i + 1:]:
                if w == w2 and (cols is None or cols2 is None or (cols[0] < cols2[1] and cols2[0] < cols[1])):
                    self.fail(f"Q, K and V read overlapping parts of {w!r} (columns {cols} and {cols2})")

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
