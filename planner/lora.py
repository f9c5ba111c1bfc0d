"""LoRA as a graph pass: low-rank adapters on chosen linear projections, their base weights frozen.

For every targeted projection `y = x W` (W a parameter, [in, out] or stored [out, in] with
`trans_b`) the pass writes

    y = x W + (alpha / r) * (x A) B        A: [in, r], B: [r, out]

as IR nodes of the same block (MatMul, MatMul, Mul by a scalar constant, Add), with A initialised
as PEFT initialises `lora_A` (Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in));
PEFT stores it transposed, [r, in]) and B zero, so the adapted model starts as the base model. W
leaves the graph's parameters: it becomes a frozen constant, which no engine differentiates,
no optimizer steps, no stash copies and no checkpoint or re-plan moves; only A, B and the
parameters named by `train_also` stay trainable (`ir.graph.Graph.params` is the trainable set,
DESIGN.md's contract). Blocks record their frozen bytes, which the planner counts once.

Targets are roles or name patterns. Roles are found from the lowered structure, not from names
(exporters rename weights): `q`, `k`, `v`, `o` are the attention projections of an encoder block
(its `ir.graph.AttentionSite`), `up` and `down` the first and second other projections of the
block (the feed-forward). In a decoder block (Llama, GPT-2) they are traced from its attention:
`q` and `k` are the projections the scores are made of (back through rotary embeddings, head
reshapes and grouped-query repeats), `v` the one the probabilities multiply, `o` the one reading
the context; GPT-2's fused QKV projection (one weight, split three ways) has the role `qkv`, chosen
by any of q, k, v. The feed-forward's projection into the residual is `down`; under SwiGLU the one
feeding the activation is `gate` and the other `up`. Where the structure does not tell, weight-name
patterns do (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj,
c_fc). Any other target is a substring matched against the weight's name.
`train_also` names block kinds (`head`, `embeddings`), `norms` (LayerNorm and RMSNorm scales and
biases), or substrings of parameter names, trained in full beside the adapters. The default
("auto") trains an encoder's task head in full (it is new and random, as PEFT's `modules_to_save`)
and nothing else of a decoder LLM, whose head is pretrained (and, tied, the embedding table).

`base_dtype` (`ir.precision`: float32, bfloat16, int8, int4) is how the frozen base is held: after
the adapters are in, every frozen 2-D weight a product or a lookup reads becomes an
`ir.precision.QuantizedTensor` (QLoRA's frozen 4-bit base under float adapters), the blocks'
`frozen_bytes` count it at that precision, and every engine computes with exactly its dequantized
values. float32 (the default) leaves the weights as they are.

An adapted block's attention no longer has the plain pattern, so its heads are not split (the
pass re-runs `planner.attention.annotate_attention`, which then finds no site there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from ir.graph import Block, Graph, Node, Value, use_def
from ir.precision import BASE_DTYPES, quantize_frozen
from ir.training import TRAINING
from planner.attention import annotate_attention

ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_ROLES = ("up", "down", "gate")
DEFAULT_TARGETS = ATTENTION_ROLES
DEFAULT_TRAIN_ALSO = ("auto",)  # the head of an encoder; nothing of a decoder LLM
_FUSED_QKV = "qkv"
_NAME_ROLES = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o"), ("gate_proj", "gate"),
               ("up_proj", "up"), ("down_proj", "down"), ("attn.c_attn", _FUSED_QKV), ("attn.c_proj", "o"),
               ("mlp.c_fc", "up"), ("mlp.c_proj", "down"))
_THROUGH = ("Reshape", "Transpose", "Rotary", "Expand", "Slice")
_SITE_ROLE = {"Wq": "q", "Wk": "k", "Wv": "v", "Wo": "o"}


@dataclass(frozen=True)
class LoraSettings:
    """Rank r, alpha (the update is scaled by alpha / r; PEFT's default alpha is 8), the targets,
    what else trains in full, and the seed of A's initialisation."""

    rank: int
    alpha: float = TRAINING.lora_alpha
    targets: tuple[str, ...] = DEFAULT_TARGETS
    train_also: tuple[str, ...] = DEFAULT_TRAIN_ALSO
    seed: int = 0
    base_dtype: str = "float32"  # how the frozen base weights are held (ir.precision)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target (e.g. q,k,v,o)")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"--base-dtype {self.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


@dataclass(frozen=True)
class Adapter:
    """One adapted projection: its base weight, the adapter parameters, the role (or pattern) that
    chose it, and its block. `base_transposed`: W is stored [out, in] (`trans_b`)."""

    block: int
    base: str
    role: str
    a: str
    b: str
    base_transposed: bool
    in_features: int
    out_features: int


def adapter_names(base: str) -> tuple[str, str]:
    """The parameter names of the adapter on weight `base`: (A, B)."""
    return f"{base}.lora_A", f"{base}.lora_B"


def projection_roles(graph: Graph, block: Block) -> dict[str, str]:
    """Weight name -> role for the block's linear projections with a parameter weight: q/k/v/o
    from its attention site, then up/down for the other projections in block order."""
    if block.kind == "decoder":
        return _decoder_roles(graph, block)
    roles: dict[str, str] = {}
    if block.attention is not None:
        for role, (name, _) in block.attention.weight_of.items():
            if role in _SITE_ROLE:
                roles[name] = _SITE_ROLE[role]
    others = [n.inputs[1] for n in (graph.node(x) for x in block.nodes)
              if n.op == "MatMul" and n.inputs[1] in graph.params and n.inputs[1] not in roles
              and len(graph.constants[n.inputs[1]].shape) == 2]
    if block.kind == "encoder":
        for name, role in zip(others, MLP_ROLES):
            roles.setdefault(name, role)
    return roles


def _decoder_roles(graph: Graph, block: Block) -> dict[str, str]:
    """Roles of a decoder block's projections, traced from its attention (module docstring), with
    weight-name patterns for any the structure leaves open."""
    nodes = [graph.node(x) for x in block.nodes]
    index = use_def(nodes)
    prod, users = index.producers, index.readers
    params = frozenset(graph.params)

    def weight_of(n: Node | None) -> str | None:
        if n is not None and n.op == "MatMul" and n.inputs[1] in params and graph.constants[n.inputs[1]].ndim == 2:
            return n.inputs[1]
        return None

    def source(value: str, depth: int = 32) -> str | None:
        """The projection weight `value` is computed from, through layout ops and bias Adds, and
        through a rotary applied to part of the heads (Slices, rotation, Concat: every branch from
        the same weight)."""
        for step in range(depth):
            n = prod.get(value)
            if n is None:
                return None
            if weight_of(n):
                return weight_of(n)
            inside = [i for i in n.inputs if i in prod or i == block.inputs[0]]
            if n.op not in _THROUGH + ("Add", "Mul", "Div", "Concat", "MatMul") or not inside:
                return None
            if len(inside) > 1 or n.op == "MatMul":
                if n.op == "MatMul" and len(inside) != 1:  # a product of two activations: not a projection
                    return None
                found = {source(i, depth - step - 1) for i in inside}
                return found.pop() if len(found) == 1 else None
            value = inside[0]
        return None

    roles: dict[str, str] = {}
    softmax = next((n for n in nodes if n.op == "Softmax"), None)
    if softmax is not None:
        scores = softmax.inputs[0]
        for _ in range(4):  # back through the mask Add and the scaling to the Q K^T product
            n = prod.get(scores)
            if n is None or n.op == "MatMul":
                break
            inside = [i for i in n.inputs if i in prod]
            scores = inside[0] if len(inside) == 1 else scores
        qk = prod.get(scores)
        ctx = next((u for u in users.get(softmax.outputs[0], []) if u.op == "MatMul"), None)
        found = {}
        if qk is not None and qk.op == "MatMul":
            found["q"], found["k"] = source(qk.inputs[0]), source(qk.inputs[1])
        if ctx is not None:
            found["v"] = source(ctx.inputs[1])
            value = ctx.outputs[0]
            for _ in range(8):  # forward through the head merge to the output projection
                after = users.get(value, [])
                if len(after) != 1:
                    break
                if weight_of(after[0]):
                    found["o"] = weight_of(after[0])
                    break
                value = after[0].outputs[0]
        qkv = [found.get(r) for r in ("q", "k", "v")]
        if qkv[0] is not None and qkv[0] == qkv[1] == qkv[2]:
            roles[qkv[0]] = _FUSED_QKV
        else:
            roles.update({w: r for r, w in found.items() if w is not None and r != "o"})
        if found.get("o"):
            roles[found["o"]] = "o"
    others = [weight_of(n) for n in nodes if weight_of(n) and weight_of(n) not in roles]
    if others:
        roles[others[-1]] = "down"  # the last projection writes the residual
        rest = others[:-1]
        if len(rest) == 2:  # SwiGLU: act(gate(x)) * up(x)
            gate = next((w for w in rest if _feeds_activation(w, nodes, users)), rest[0])
            roles[gate] = "gate"
            roles[next(w for w in rest if w != gate)] = "up"
        elif len(rest) == 1:
            roles[rest[0]] = "up"
    for n in nodes:  # weight-name patterns where the structure said nothing
        w = weight_of(n)
        if w is not None and w not in roles:
            role = next((r for pattern, r in _NAME_ROLES if pattern in w), None)
            if role is not None:
                roles[w] = role
    return roles


def _feeds_activation(weight: str, nodes: list[Node], users: Mapping[str, Sequence[Node]]) -> bool:
    outs = [n.outputs[0] for n in nodes if n.op == "MatMul" and len(n.inputs) > 1 and n.inputs[1] == weight]
    for value in outs:
        for _ in range(3):
            after = users.get(value, [])
            if any(u.op in ("Silu", "Sigmoid", "Gelu", "Relu", "Tanh") for u in after):
                return True
            if len(after) != 1 or after[0].op not in ("Reshape", "Add"):
                break
            value = after[0].outputs[0]
    return False


def _targeted(graph: Graph, settings: LoraSettings) -> list[tuple[Block, Node, str]]:
    """(block, MatMul node, role or pattern) of every projection the settings target, each once."""
    roles_wanted = {t for t in settings.targets if t in ATTENTION_ROLES + MLP_ROLES + (_FUSED_QKV,)}
    patterns = [t for t in settings.targets if t not in roles_wanted]
    chosen, seen = [], set()
    for block in graph.blocks:
        roles = projection_roles(graph, block)
        for node in (graph.node(x) for x in block.nodes):
            if node.op != "MatMul" or node.inputs[1] not in graph.params or node.inputs[1] in seen:
                continue
            w = node.inputs[1]
            if len(graph.constants[w].shape) != 2:
                continue
            role = roles.get(w)
            wanted = role in roles_wanted or (role == _FUSED_QKV and roles_wanted & {"q", "k", "v", _FUSED_QKV})
            why = role if wanted else next((p for p in patterns if p in w), None)
            if why is not None:
                chosen.append((block, node, why))
                seen.add(w)
    return chosen


def _check_targets(graph: Graph, settings: LoraSettings, chosen) -> None:
    """Every target chose a projection (a typo is no silent no-op), every `train_also` item names
    something, and no adapter sits on a weight the model also reads as a lookup table (a tied LM
    head: the adapter would change the head only, while merged into the one weight it changes the
    token embedding too, and PEFT adapts the lookup instead)."""
    roles = {t for t in settings.targets if t in ATTENTION_ROLES + MLP_ROLES + (_FUSED_QKV,)}
    used = {why for _, _, why in chosen}
    fused = {"q", "k", "v", _FUSED_QKV} & roles if _FUSED_QKV in used else set()
    missed = [t for t in settings.targets if t not in used and t not in fused]
    present = sorted({r for b in graph.blocks for r in projection_roles(graph, b).values()})
    if missed:
        raise ValueError(f"LoRA targets {missed} match no linear projection of {graph.name!r} (its roles: "
                         f"{', '.join(present)}; other targets are substrings of weight names)")
    tables = {n.inputs[0] for n in graph.nodes if n.op == "Gather"}
    tied = [(node.inputs[1], why) for _, node, why in chosen if node.inputs[1] in tables]
    if tied:
        weight, why = tied[0]
        raise ValueError(f"LoRA target {why!r} chose {weight!r}, the LM head tied to the token embedding table: "
                         "an adapter there would change the head but, merged or loaded by PEFT, the lookup too; "
                         "target the projections, or train the head in full (--train-also head)")
    kinds = ("auto", "head", "embeddings", "encoder", "decoder", "loss", "norms")
    unknown = [t for t in settings.train_also if t not in kinds and not any(t in p for p in graph.params)]
    if unknown:
        raise ValueError(f"--train-also {unknown} names nothing of {graph.name!r} (give {', '.join(kinds)}, or "
                         "a substring of weight names)")


def _trained_in_full(graph: Graph, names: Sequence[str]) -> set[str]:
    out: set[str] = set()
    decoder = any(b.kind == "decoder" for b in graph.blocks)
    names = [x for item in names for x in (((), ("head",))[not decoder] if item == "auto" else (item,))]
    for item in names:
        if item in ("head", "embeddings", "encoder", "decoder", "loss"):
            out.update(p for b in graph.blocks if b.kind == item for p in b.params)
        elif item == "norms":
            out.update(i for n in graph.nodes if n.op in ("LayerNorm", "RMSNorm") for i in n.inputs[1:]
                       if i in graph.params)
        else:
            out.update(p for p in graph.params if item in p)
    return out


def add_lora(graph: Graph, settings: LoraSettings) -> tuple[Graph, tuple[Adapter, ...]]:
    """`graph` with adapters on every targeted projection and every other parameter frozen except
    those `train_also` names; and the adapters. Raises ValueError when nothing matches a target."""
    chosen = _targeted(graph, settings)
    if not chosen:
        raise ValueError(f"LoRA targets {list(settings.targets)} match no linear projection of {graph.name!r} "
                         f"(roles: {', '.join(ATTENTION_ROLES + MLP_ROLES)}; other targets are substrings of "
                         f"weight names)")
    _check_targets(graph, settings, chosen)
    rng = np.random.default_rng(settings.seed)
    constants, values = dict(graph.constants), dict(graph.values)
    scale_name = "lora.scale"
    constants[scale_name] = np.asarray(settings.scale, np.float32)
    values[scale_name] = Value(scale_name, (), "float32")
    inserted: dict[str, list[Node]] = {}   # base MatMul name -> the nodes that replace it
    renamed: dict[str, Node] = {}
    adapters, new_params_of = [], {}
    for block, node, why in chosen:
        w = node.inputs[1]
        transposed = bool(node.attrs.get("trans_b"))
        d_in, d_out = graph.constants[w].shape[::-1] if transposed else graph.constants[w].shape
        a_name, b_name = adapter_names(w)
        bound = 1.0 / math.sqrt(d_in)
        constants[a_name] = rng.uniform(-bound, bound, (d_in, settings.rank)).astype(np.float32)
        constants[b_name] = np.zeros((settings.rank, d_out), np.float32)
        values[a_name] = Value(a_name, (d_in, settings.rank), "float32")
        values[b_name] = Value(b_name, (settings.rank, d_out), "float32")
        x, y = node.inputs[0], node.outputs[0]
        lead = values[y].shape[:-1]
        names = {k: f"{y}/lora_{k}" for k in ("base", "a", "b", "scaled")}
        values[names["base"]] = replace(values[y], name=names["base"])
        values[names["a"]] = Value(names["a"], lead + (settings.rank,), "float32")
        values[names["b"]] = Value(names["b"], lead + (d_out,), "float32")
        values[names["scaled"]] = Value(names["scaled"], lead + (d_out,), "float32")
        renamed[node.name] = replace(node, outputs=(names["base"],))
        inserted[node.name] = [
            Node(f"{node.name}/lora_a", "MatMul", (x, a_name), (names["a"],), {"trans_b": False}),
            Node(f"{node.name}/lora_b", "MatMul", (names["a"], b_name), (names["b"],), {"trans_b": False}),
            Node(f"{node.name}/lora_scale", "Mul", (names["b"], scale_name), (names["scaled"],)),
            Node(f"{node.name}/lora_add", "Add", (names["base"], names["scaled"]), (y,)),
        ]
        new_params_of.setdefault(block.index, []).extend([a_name, b_name])
        adapters.append(Adapter(block.index, w, why, a_name, b_name, transposed, int(d_in), int(d_out)))
    nodes = []
    for n in graph.nodes:
        nodes.append(renamed.get(n.name, n))
        nodes.extend(inserted.get(n.name, ()))
    keep = _trained_in_full(graph, settings.train_also)
    adapter_params = {p for ps in new_params_of.values() for p in ps}
    params = tuple(p for p in graph.params if p in keep) + tuple(p for a in adapters for p in (a.a, a.b))
    constants = quantize_frozen(nodes, constants, params, settings.base_dtype)
    blocks = tuple(_adapted_block(b, inserted, new_params_of.get(b.index, []), set(params), constants, values)
                   for b in graph.blocks)
    out = Graph(graph.name, graph.inputs, graph.outputs, tuple(nodes), values, constants, params, blocks,
                graph.batch, graph.seq)
    assert adapter_params <= set(out.params)
    return annotate_attention(out), tuple(adapters)


def _adapted_block(block: Block, inserted: Mapping[str, list[Node]], new_params: Sequence[str],
                   trainable: set[str], constants: Mapping[str, np.ndarray], values: Mapping[str, Value]) -> Block:
    names = []
    for n in block.nodes:
        names.append(n)
        names.extend(x.name for x in inserted.get(n, ()))
    reads = dict.fromkeys([p for p in block.params] + list(new_params))
    params = tuple(p for p in reads if p in trainable)
    frozen = [p for p in reads if p not in trainable]
    extra_flops = 0
    for n in block.nodes:
        for x in inserted.get(n, ()):
            if x.op == "MatMul":
                rows = int(np.prod(values[x.inputs[0]].shape[:-1]))
                w = constants[x.inputs[1]].shape
                extra_flops += 2 * rows * int(w[0]) * int(w[1])
    return replace(block, nodes=tuple(names), params=params,
                   params_bytes=sum(int(constants[p].nbytes) for p in params),
                   frozen_bytes=block.frozen_bytes + sum(int(constants[p].nbytes) for p in frozen),
                   flops=block.flops + extra_flops)
