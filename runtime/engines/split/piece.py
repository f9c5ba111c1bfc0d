"""The attention of h heads as a small IR graph: the unit a head split runs on each backend.

`runtime.engines.split.attention` runs one such piece per backend of a split (each holding its
heads' slices of the block's weights); `runtime.profiling` times pieces of 1..H heads to draw the
attention curves the planner's head allocator reads. Both build it here, so what is profiled is
what runs.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ir.graph import Block, Graph, Node, Value


def attention_piece(batch: int, seq: int, hidden: int, heads: int, head_size: int,
                    mask_shape: Sequence[int], seed: int = 0) -> Graph:
    """The attention of `heads` heads as a two-block IR graph whose block 1 is the piece.

    Block 1 reads the hidden state `x` (batch, seq, hidden) and the additive mask `mask`, projects
    to Q, K, V of width heads x head_size (with biases), runs scaled dot-product attention with the
    mask added to the scores, and multiplies the context by the heads x head_size rows of the
    output projection. Block 0 is an empty stand-in so that `x` is a stage's activation input and
    the backward computes its gradient, as a pipeline stage's does. Weights are random (times do
    not depend on their values; denormals are flushed).
    """
    rng = np.random.default_rng(seed)
    B, S, D, h, hs = batch, seq, hidden, heads, head_size
    w = h * hs
    consts: dict[str, np.ndarray] = {}
    values: dict[str, Value] = {}
    nodes: list[Node] = []

    def value(name: str, shape: Sequence[int]) -> str:
        values[name] = Value(name, tuple(int(d) for d in shape), "float32")
        return name

    def const(name: str, arr: np.ndarray) -> str:
        consts[name] = arr.astype(np.float32)
        return value(name, arr.shape)

    def node(op: str, inputs: Sequence[str], out: str, out_shape: Sequence[int], **attrs) -> str:
        nodes.append(Node(f"attn/{out}", op, tuple(inputs), (value(out, out_shape),), attrs))
        return out

    x = value("x", (B, S, D))
    mask = value("mask", mask_shape)
    params = []
    heads_of = {}
    for p, perm in (("q", (0, 2, 1, 3)), ("k", (0, 2, 3, 1)), ("v", (0, 2, 1, 3))):
        wt = const(f"w{p}", rng.normal(0, 0.02, (D, w)))
        bias = const(f"b{p}", rng.normal(0, 0.02, (w,)))
        params += [wt, bias]
        y = node("MatMul", (x, wt), f"{p}_proj", (B, S, w), trans_b=False)
        y = node("Add", (y, bias), f"{p}_bias", (B, S, w))
        y = node("Reshape", (y,), f"{p}_split", (B, S, h, hs), shape=[B, S, h, hs])
        heads_of[p] = node("Transpose", (y,), f"{p}_heads", tuple((B, S, h, hs)[i] for i in perm), perm=list(perm))
    scale = const("scale", np.array(1.0 / math.sqrt(hs)))
    wo = const("wo", rng.normal(0, 0.02, (w, D)))
    params.append(wo)
    s = node("MatMul", (heads_of["q"], heads_of["k"]), "scores", (B, h, S, S), trans_b=False)
    s = node("Mul", (s, scale), "scaled", (B, h, S, S))
    s = node("Add", (s, mask), "masked", (B, h, S, S))
    s = node("Softmax", (s,), "probs", (B, h, S, S), axis=3)
    c = node("MatMul", (s, heads_of["v"]), "context", (B, h, S, hs), trans_b=False)
    c = node("Transpose", (c,), "context_t", (B, S, h, hs), perm=[0, 2, 1, 3])
    c = node("Reshape", (c,), "context_flat", (B, S, w), shape=[B, S, w])
    out = node("MatMul", (c, wo), "out", (B, S, D), trans_b=False)

    params_bytes = sum(int(consts[p].nbytes) for p in params)
    flops = 2 * B * S * D * w * 4 + 2 * 2 * B * h * S * S * hs
    blocks = (
        Block(0, "input", "embeddings", (), (), (), x, (), 0, values[x].nbytes, 0),
        Block(1, f"attention.h{h}", "encoder", tuple(n.name for n in nodes), (), (x, mask), out, tuple(params),
              params_bytes, values[out].nbytes, flops, h, hs),
    )
    return Graph(f"attention-{h}x{hs}", (values[x], values[mask]), (values[out],), tuple(nodes), values,
                 consts, tuple(params), blocks, B, S)
