"""The attention of h heads (or key/value groups) as a small IR graph: the unit a head split runs on
each backend; and `AttentionForm`, what a block's attention computes (BERT's post-LN attention, or
a pre-norm decoder's with rotary embeddings and grouped-query heads).

`runtime.engines.split.attention` runs one such piece per backend of a split (each holding its
heads' slices of the block's weights); `runtime.profiling` times pieces of 1..H heads to draw the
attention curves the planner's head allocator reads. Both build it here, so what is profiled is
what runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ir.graph import Block, Graph, Node, Value

# The roles of a block's attention weights (x @ W layout), as `ir.graph.AttentionSite` names them.
PROJECTIONS = ("Wq", "Wk", "Wv", "Wo")
BIASES = ("bq", "bk", "bv", "bo")
NORM_WEIGHTS = ("norm_w", "norm_b")


@dataclass(frozen=True, eq=False)
class AttentionForm:
    """What a block's attention computes, as far as a piece of it must reproduce it.

    `hidden`: the model width (x and the output are (batch, seq, hidden)); `heads` query heads and
    `kv_heads` key/value heads (equal without grouped-query attention; each key/value head serves
    `group` = heads / kv_heads query heads) of `head_size`; `roles`: the weight roles present
    (`PROJECTIONS`, and of `BIASES` and `NORM_WEIGHTS` those the block has); `norm`: "LayerNorm" or
    "RMSNorm" when the attention reads norm(x) (pre-norm), with `norm_epsilon` (and an RMSNorm's
    `norm_offset`, added to its scale: Gemma's 1); `cos`, `sin`:
    rotary tables (1 or batch, 1, seq, head size) applied to Q and K, None without rotary
    embeddings; `scale` multiplies the scores.

    The unit of a split is a key/value head with its group of query heads (`units` of them): a
    backend given units [u, u + c) computes query heads [u * group, (u + c) * group)."""

    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    roles: frozenset[str] = field(default_factory=lambda: frozenset(PROJECTIONS + BIASES))
    norm: str | None = None
    norm_epsilon: float = 0.0
    cos: np.ndarray | None = None
    sin: np.ndarray | None = None
    scale: float | None = None
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads cannot be grouped over {self.kv_heads} key/value heads")
        missing = [r for r in PROJECTIONS if r not in self.roles]
        if missing:
            raise ValueError(f"an attention form needs the projections {missing}")
        if (self.cos is None) != (self.sin is None):
            raise ValueError("rotary embeddings need both a cos and a sin table")
        if self.norm is None and any(r in self.roles for r in NORM_WEIGHTS):
            raise ValueError("norm weights without a norm")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def units(self) -> int:
        return self.kv_heads

    @property
    def score_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size) if self.scale is None else float(self.scale)

    def weight_shape(self, role: str, units: int | None = None) -> tuple[int, ...]:
        """The shape of `role` for `units` units (default: the whole block), x @ W layout."""
        u = self.units if units is None else units
        q, kv, D = u * self.group * self.head_size, u * self.head_size, self.hidden
        return {"Wq": (D, q), "Wk": (D, kv), "Wv": (D, kv), "Wo": (q, D), "bq": (q,), "bk": (kv,), "bv": (kv,),
                "bo": (D,), "norm_w": (D,), "norm_b": (D,)}[role]

    def piece_roles(self) -> tuple[str, ...]:
        """The roles a piece holds (all but the output bias, added once after the pieces' sum), in a
        fixed order."""
        return tuple(r for r in PROJECTIONS + BIASES + NORM_WEIGHTS if r in self.roles and r != "bo")

    def columns(self, role: str, first: int, count: int) -> slice:
        """Which entries of `role` (columns of Wq/Wk/Wv and entries of their biases, rows of Wo)
        units [first, first + count) own; norm weights are shared by every piece (slice(None))."""
        if role in NORM_WEIGHTS:
            return slice(None)
        width = self.group * self.head_size if role in ("Wq", "bq", "Wo") else self.head_size
        return slice(first * width, (first + count) * width)


def bert_form(heads: int, head_size: int, hidden: int | None = None) -> AttentionForm:
    """The post-LayerNorm BERT attention: biases everywhere, hidden = heads x head size unless given."""
    return AttentionForm(heads * head_size if hidden is None else int(hidden), heads, heads, head_size)


def random_weights(form: AttentionForm, seed: int = 0) -> dict[str, np.ndarray]:
    """Full weights of every role of `form` (x @ W layout), random; a norm's scale ones."""
    rng = np.random.default_rng(seed)
    return {role: (np.ones(form.weight_shape(role)) if role == "norm_w" else
                   rng.normal(0, 0.02, form.weight_shape(role))).astype(np.float32)
            for role in PROJECTIONS + BIASES + NORM_WEIGHTS if role in form.roles}


def attention_form(graph: Graph, block: Block) -> AttentionForm:
    """The form of `block`'s attention as the lowering found it (`block.attention`)."""
    site = block.attention
    if site is None:
        raise ValueError(f"block {block.index} ({block.name}) has no splittable attention")
    cos = sin = None
    if site.rotary is not None:
        cos, sin = (np.asarray(graph.constants[t], np.float32) for t in site.rotary)
    return AttentionForm(int(graph.values[site.x].shape[-1]), int(block.heads), int(block.split_units),
                         int(block.head_size), frozenset(site.weight_of), site.norm, site.norm_epsilon, cos, sin,
                         site.scale, site.norm_offset)


def attention_piece(batch: int, seq: int, hidden: int, heads: int, head_size: int,
                    mask_shape: Sequence[int], seed: int = 0, form: AttentionForm | None = None) -> Graph:
    """The attention of `heads` units (query heads, or key/value groups under grouped-query
    attention) as a two-block IR graph whose block 1 is the piece.

    Block 1 reads the hidden state `x` (batch, seq, hidden) and the additive mask `mask`; takes
    the form's pre-norm of x if it has one; projects to Q of width units x group x head size and
    to K, V of width units x head size (with the biases the form has); applies the rotary
    embeddings to Q and K if the form has them; repeats each key/value head for its group of query
    heads; runs scaled dot-product attention with the mask added to the scores, and multiplies the
    context by its rows of the output projection. Block 0 is an empty stand-in so that `x` is a
    stage's activation input and the backward computes its gradient, as a pipeline stage's does.
    Weights are random (times do not depend on their values; denormals are flushed). Without a
    `form`, BERT's (`bert_form`)."""
    form = form or bert_form(heads, head_size, hidden)
    if form.hidden != hidden or form.head_size != head_size:
        raise ValueError(f"a piece of hidden {hidden} x head size {head_size} from a form of {form.hidden} x "
                         f"{form.head_size}")
    rng = np.random.default_rng(seed)
    B, S, D, u, hs, g = batch, seq, hidden, heads, head_size, form.group
    h = u * g
    consts: dict[str, np.ndarray] = {}
    values: dict[str, Value] = {}
    nodes: list[Node] = []

    def value(name: str, shape: Sequence[int]) -> str:
        values[name] = Value(name, tuple(int(d) for d in shape), "float32")
        return name

    def const(name: str, arr: np.ndarray) -> str:
        consts[name] = np.asarray(arr, np.float32)
        return value(name, np.shape(arr))

    def node(op: str, inputs: Sequence[str], out: str, out_shape: Sequence[int], **attrs) -> str:
        nodes.append(Node(f"attn/{out}", op, tuple(inputs), (value(out, out_shape),), attrs))
        return out

    def weight(role: str) -> str:
        shape = form.weight_shape(role, u)
        init = np.ones(shape) if role == "norm_w" else rng.normal(0, 0.02, shape)
        params.append(const(PIECE_PARAM[role], init))
        return PIECE_PARAM[role]

    x = value("x", (B, S, D))
    mask = value("mask", mask_shape)
    params: list[str] = []
    a = x
    if form.norm is not None:
        norm_inputs = [x] + [weight(r) for r in NORM_WEIGHTS if r in form.roles]
        offset = {"offset": float(form.norm_offset)} if form.norm_offset else {}
        a = node(form.norm, norm_inputs, "normed", (B, S, D), epsilon=float(form.norm_epsilon), **offset)
    rotary = None
    if form.cos is not None:
        rotary = (const("rotary_cos", form.cos), const("rotary_sin", form.sin))
    heads_of = {}
    for p, count in (("q", h), ("k", u), ("v", u)):
        w = count * hs
        y = node("MatMul", (a, weight("W" + p)), f"{p}_proj", (B, S, w), trans_b=False)
        if "b" + p in form.roles:
            y = node("Add", (y, weight("b" + p)), f"{p}_bias", (B, S, w))
        y = node("Reshape", (y,), f"{p}_split", (B, S, count, hs), shape=[B, S, count, hs])
        if p == "k" and rotary is None and g == 1:  # BERT's K: straight to (B, heads, hs, S)
            heads_of[p] = node("Transpose", (y,), "k_heads", (B, count, hs, S), perm=[0, 2, 3, 1])
            continue
        y = node("Transpose", (y,), f"{p}_heads", (B, count, S, hs), perm=[0, 2, 1, 3])
        if rotary is not None and p in ("q", "k"):
            y = node("Rotary", (y, *rotary), f"{p}_rotary", (B, count, S, hs))
        if p != "q" and g > 1:
            y = node("Reshape", (y,), f"{p}_unsqueeze", (B, u, 1, S, hs), shape=[B, u, 1, S, hs])
            y = node("Expand", (y,), f"{p}_repeat", (B, u, g, S, hs), shape=[B, u, g, S, hs])
            y = node("Reshape", (y,), f"{p}_grouped", (B, h, S, hs), shape=[B, h, S, hs])
        if p == "k":
            y = node("Transpose", (y,), "k_t", (B, h, hs, S), perm=[0, 1, 3, 2])
        heads_of[p] = y
    scale = const("scale", np.array(form.score_scale))
    wo = weight("Wo")
    s = node("MatMul", (heads_of["q"], heads_of["k"]), "scores", (B, h, S, S), trans_b=False)
    s = node("Mul", (s, scale), "scaled", (B, h, S, S))
    s = node("Add", (s, mask), "masked", (B, h, S, S))
    s = node("Softmax", (s,), "probs", (B, h, S, S), axis=3)
    c = node("MatMul", (s, heads_of["v"]), "context", (B, h, S, hs), trans_b=False)
    c = node("Transpose", (c,), "context_t", (B, S, h, hs), perm=[0, 2, 1, 3])
    c = node("Reshape", (c,), "context_flat", (B, S, h * hs), shape=[B, S, h * hs])
    out = node("MatMul", (c, wo), "out", (B, S, D), trans_b=False)

    params_bytes = sum(int(consts[p].nbytes) for p in params)
    flops = 2 * B * S * D * hs * (2 * h + 2 * u) + 2 * 2 * B * h * S * S * hs
    blocks = (
        Block(0, "input", "embeddings", (), (), (), x, (), 0, values[x].nbytes, 0),
        Block(1, f"attention.h{h}", "encoder", tuple(n.name for n in nodes), (), (x, mask), out, tuple(params),
              params_bytes, values[out].nbytes, flops, h, hs, kv_heads=u),
    )
    return Graph(f"attention-{h}x{hs}", (values[x], values[mask]), (values[out],), tuple(nodes), values,
                 consts, tuple(params), blocks, B, S)


# The piece's parameter for each role (bo is added outside the pieces).
PIECE_PARAM = {"Wq": "wq", "bq": "bq", "Wk": "wk", "bk": "bk", "Wv": "wv", "bv": "bv", "Wo": "wo",
               "norm_w": "norm_w", "norm_b": "norm_b"}
