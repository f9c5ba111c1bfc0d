"""Graph passes run after lowering, each a pure function Graph -> Graph.

* ``fuse_layer_norm`` requires: compute nodes from lowering. Ensures: the decomposed LayerNorm of
  opset < 17 exporters (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add) is one
  ``LayerNorm`` node, so engines see one op whatever the exporter emitted.
* ``fuse_gelu`` ensures: x * 0.5 * (1 + erf(x / sqrt 2)) (in any factor order, Div or Mul by
  1/sqrt 2) is one ``Gelu`` node.
* ``simplify_layout`` ensures: no Transpose reads a Transpose and no Reshape a Reshape (each pair
  is one node), no Transpose keeps the order and no Reshape the shape, and a scalar constant
  factor of a MatMul operand is one factor of its product. Dynamo exports without the optimizer
  and SDPA attention (which scales Q and K by d^-1/4 each) write attention this way; afterwards it
  has the eager pattern that ``planner.attention`` matches, so its heads can be split.
* ``planner.decoder.run_decoder_fusions`` (RMSNorm, SiLU, rotary embeddings, GPT-2's tanh GELU)
  runs next: see that module.
* ``find_blocks`` requires: fused LayerNorms. Ensures: every compute node belongs to exactly one
  block; blocks are cut at LayerNorm outputs that dominate the loss (every path from the token
  inputs to the loss passes through them), grouped into embeddings, encoder layers (an attention
  segment with a Softmax plus its feed-forward segment), head and loss, each with its sizes,
  FLOPs and attention head count. A pre-norm model (a decoder LLM: its norms sit on the residual
  branches, so none dominates the loss before the final one) is cut at its residual Adds instead:
  embeddings, decoder layers (kind ``decoder``: the attention residual and the MLP residual),
  head (the final norm and the LM head) and loss. Attention blocks report their heads, key/value
  heads (fewer under grouped-query attention, whose repeated key/value heads are an ``Expand``)
  and head size.
"""
from __future__ import annotations

import math

import networkx as nx
import numpy as np

from ir.graph import Block, Graph, Node, Value, topological_order, use_def
from ir.ops import LOSS_INPUTS, LOSS_OPS, compute_flops
from planner.attention import annotate_attention
from planner.decoder import run_decoder_fusions

SQRT2 = math.sqrt(2.0)


def run_passes(graph: Graph) -> Graph:
    graph = fuse_layer_norm(graph)
    graph = fuse_gelu(graph)
    graph = simplify_layout(graph)
    graph = run_decoder_fusions(graph)
    return annotate_attention(find_blocks(graph))


# --- helpers ------------------------------------------------------------------------------
def _scalar(graph: Graph, name: str) -> float | None:
    v = graph.constants.get(name)
    if v is None or v.size != 1:
        return None
    return float(np.asarray(v).reshape(-1)[0])


def _replace(graph: Graph, removed: set[str], added: list[Node]) -> Graph:
    kept = [n for n in graph.nodes if n.name not in removed] + added
    producers = {o for n in kept for o in n.outputs}
    ordered = topological_order(kept, [v.name for v in graph.inputs] + list(graph.constants))
    used = {i for n in ordered for i in n.inputs} | {v.name for v in graph.outputs}
    values = {k: v for k, v in graph.values.items() if k in used or k in producers}
    constants = {k: v for k, v in graph.constants.items() if k in used}
    params = tuple(p for p in graph.params if p in constants)
    return Graph(graph.name, graph.inputs, graph.outputs, tuple(ordered), values, constants, params,
                 (), graph.batch, graph.seq)


def _other(node: Node, name: str) -> str | None:
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    return b if a == name else a if b == name else None


# --- LayerNorm ----------------------------------------------------------------------------
def fuse_layer_norm(graph: Graph) -> Graph:
    params = frozenset(graph.params)
    prod = graph.producers()
    cons = graph.consumers()
    removed: set[str] = set()
    added: list[Node] = []
    last_axis = lambda n: n.op == "ReduceMean" and [a % len(graph.values[n.inputs[0]].shape) for a in n.attrs["axes"]] == [len(graph.values[n.inputs[0]].shape) - 1]
    for div in graph.nodes:
        if div.op != "Div" or div.tier != "compute":
            continue
        sub, sqrt = prod.get(div.inputs[0]), prod.get(div.inputs[1])
        if not (sub and sqrt and sub.op == "Sub" and sqrt.op == "Sqrt"):
            continue
        mean = prod.get(sub.inputs[1])
        add_eps = prod.get(sqrt.inputs[0])
        if not (mean and last_axis(mean) and mean.inputs[0] == sub.inputs[0] and add_eps and add_eps.op == "Add"):
            continue
        var = prod.get(add_eps.inputs[0])
        eps = _scalar(graph, add_eps.inputs[1])
        if not (var and last_axis(var) and eps is not None):
            continue
        pw = prod.get(var.inputs[0])
        if not (pw and pw.op == "Pow" and pw.attrs.get("exponent") == 2.0 and pw.inputs[0] == sub.outputs[0]):
            continue
        chain = [mean, sub, pw, var, add_eps, sqrt, div]
        after = cons.get(div.outputs[0], [])
        if len(after) != 1 or after[0].op != "Mul":
            continue
        mul = after[0]
        scale = _other(mul, div.outputs[0])
        after = cons.get(mul.outputs[0], [])
        if scale not in params or len(after) != 1 or after[0].op != "Add":
            continue
        add = after[0]
        bias = _other(add, mul.outputs[0])
        if bias not in params:
            continue
        internal = {o for n in chain + [mul] for o in n.outputs}
        if any(c.name not in {n.name for n in chain + [mul, add]} for v in internal for c in cons.get(v, [])):
            continue
        removed.update(n.name for n in chain + [mul, add])
        added.append(Node(add.name, "LayerNorm", (sub.inputs[0], scale, bias), add.outputs, {"epsilon": eps}))
    return _replace(graph, removed, added) if removed else graph


# --- Gelu ---------------------------------------------------------------------------------
def fuse_gelu(graph: Graph) -> Graph:
    prod = graph.producers()
    cons = graph.consumers()
    removed: set[str] = set()
    added: list[Node] = []
    for erf in graph.nodes:
        if erf.op != "Erf":
            continue
        scale_node = prod.get(erf.inputs[0])
        if scale_node is None or scale_node.op not in ("Div", "Mul"):
            continue
        x = scale_node.inputs[0]
        c = _scalar(graph, scale_node.inputs[1])
        if c is None:
            continue
        factor = 1 / c if scale_node.op == "Div" else c
        if abs(factor - 1 / SQRT2) > 1e-4:
            continue
        after = cons.get(erf.outputs[0], [])
        if len(after) != 1 or after[0].op != "Add" or _scalar(graph, _other(after[0], erf.outputs[0]) or "") != 1.0:
            continue
        add1 = after[0]
        matched = _match_half_x_product(graph, prod, cons, add1.outputs[0], x)
        if matched is None:
            continue
        product_nodes, out = matched
        group = [scale_node, erf, add1] + product_nodes
        names = {n.name for n in group}
        internal = {o for n in group for o in n.outputs if o != out}
        if any(c.name not in names for v in internal for c in cons.get(v, [])):
            continue
        removed.update(names)
        added.append(Node(product_nodes[-1].name, "Gelu", (x,), (out,), {"approximate": "none"}))
    return _replace(graph, removed, added) if removed else graph


def _match_half_x_product(graph, prod, cons, start: str, x: str):
    """Follow up to two Muls from `start` (1 + erf) whose other factors multiply to 0.5 * x."""
    current, nodes, factors = start, [], []
    for _ in range(2):
        after = cons.get(current, [])
        if len(after) != 1 or after[0].op != "Mul":
            break
        mul = after[0]
        other = _other(mul, current)
        nodes.append(mul)
        factors.append(other)
        current = mul.outputs[0]
        half = 1.0
        has_x = False
        extra = []
        for f in factors:
            s = _scalar(graph, f)
            if f == x:
                has_x = True
            elif s is not None:
                half *= s
            else:
                p = prod.get(f)
                if p is not None and p.op == "Mul" and x in p.inputs and _scalar(graph, _other(p, x) or "") is not None:
                    has_x, half = True, half * _scalar(graph, _other(p, x))
                    extra.append(p)
                else:
                    half = float("nan")
        if has_x and abs(half - 0.5) < 1e-6:
            return extra + nodes, current
    return None


# --- layout --------------------------------------------------------------------------------
def simplify_layout(graph: Graph) -> Graph:
    nodes = {n.name: n for n in graph.nodes}
    constants = dict(graph.constants)
    values = dict(graph.values)
    params = frozenset(graph.params)
    # the graph's use-def view by node name, copied: this pass keeps it up to date as it rewrites nodes
    prod = {o: n.name for o, n in graph.producers().items()}
    readers = {v: {n.name for n in ns} for v, ns in graph.consumers().items()}
    keep_names = {v.name for v in graph.outputs}

    def only_reader(value: str, reader: str) -> bool:
        return readers.get(value, set()) == {reader} and value not in keep_names

    def producer(value: str) -> Node | None:
        name = prod.get(value)
        return nodes.get(name) if name else None

    def set_node(old: Node | None, new: Node) -> None:
        if old is not None:
            for i in old.inputs:
                readers.get(i, set()).discard(old.name)
        nodes[new.name] = new
        for o in new.outputs:
            prod[o] = new.name
        for i in new.inputs:
            readers.setdefault(i, set()).add(new.name)

    def drop(node: Node) -> None:
        for i in node.inputs:
            readers.get(i, set()).discard(node.name)
        del nodes[node.name]

    def bypass(node: Node) -> None:
        """Remove a node that passes its input through: its readers read the input instead."""
        src, out = node.inputs[0], node.outputs[0]
        drop(node)
        for r in list(readers.pop(out, ())):
            rn = nodes[r]
            set_node(rn, Node(rn.name, rn.op, tuple(src if i == out else i for i in rn.inputs), rn.outputs,
                              rn.attrs, rn.tier))

    def scalar_factor(value: str, reader: str) -> tuple[str, float] | None:
        mul = producer(value)
        if mul is None or mul.op != "Mul" or mul.tier != "compute" or not only_reader(value, reader):
            return None
        for k, c in enumerate(mul.inputs):
            v = constants.get(c)
            if v is not None and c not in params and v.size == 1 and v.dtype.kind == "f":
                return mul.inputs[1 - k], float(np.asarray(v).reshape(-1)[0])
        return None

    changed = True
    while changed:
        changed = False
        for node in list(nodes.values()):
            if node.name not in nodes or node.tier != "compute":
                continue
            inner = producer(node.inputs[0]) if node.inputs else None
            if node.op == "Transpose":
                perm = list(node.attrs["perm"])
                if inner is not None and inner.op == "Transpose" and inner.tier == "compute" \
                        and only_reader(inner.outputs[0], node.name):
                    first = list(inner.attrs["perm"])
                    drop(inner)
                    set_node(node, Node(node.name, "Transpose", inner.inputs, node.outputs,
                                        {"perm": [first[p] for p in perm]}, node.tier))
                    changed = True
                elif perm == sorted(perm) and node.outputs[0] not in keep_names:
                    bypass(node)
                    changed = True
            elif node.op == "Reshape" and _merged_transpose(node, inner, producer, only_reader, values) is not None:
                perm, src, merge, transpose = _merged_transpose(node, inner, producer, only_reader, values)
                drop(transpose)
                drop(merge)
                set_node(node, Node(node.name, "Transpose", (src,), node.outputs, {"perm": perm}, node.tier))
                changed = True
            elif node.op == "Reshape":
                if inner is not None and inner.op == "Reshape" and inner.tier == "compute" \
                        and only_reader(inner.outputs[0], node.name):
                    drop(inner)
                    set_node(node, Node(node.name, "Reshape", inner.inputs, node.outputs, node.attrs, node.tier))
                    changed = True
                elif tuple(values[node.inputs[0]].shape) == tuple(node.attrs["shape"]) \
                        and node.outputs[0] not in keep_names:
                    bypass(node)
                    changed = True
            elif node.op == "MatMul" and not node.name.endswith("/unscaled"):
                factors = [scalar_factor(i, node.name) for i in node.inputs]
                if any(factors):
                    scale, ins = 1.0, list(node.inputs)
                    for k, f in enumerate(factors):
                        if f:
                            drop(producer(ins[k]))
                            ins[k], scale = f[0], scale * f[1]
                    out = node.outputs[0]
                    raw, const = f"{out}/unscaled", f"{node.name}/scale"
                    values[raw] = Value(raw, values[out].shape, values[out].dtype)
                    constants[const] = np.asarray(scale, np.float32)
                    set_node(node, Node(f"{node.name}/unscaled", "MatMul", tuple(ins), (raw,), node.attrs, node.tier))
                    del nodes[node.name]
                    set_node(None, Node(node.name, "Mul", (raw, const), (out,), {}, node.tier))
                    changed = True
    if len(nodes) == len(graph.nodes) and all(nodes.get(n.name) is n for n in graph.nodes):
        return graph
    kept = list(nodes.values())
    ordered = topological_order(kept, [v.name for v in graph.inputs] + list(constants))
    used = {i for n in ordered for i in n.inputs} | keep_names
    produced = {o for n in ordered for o in n.outputs}
    return Graph(graph.name, graph.inputs, graph.outputs, tuple(ordered),
                 {k: v for k, v in values.items() if k in used or k in produced},
                 {k: v for k, v in constants.items() if k in used}, tuple(p for p in graph.params if p in used),
                 (), graph.batch, graph.seq)


def _merged_transpose(node: Node, inner: Node | None, producer, only_reader, values):
    """Reshape(Transpose(Reshape(x, merge the first k dims), perm keeping dim 0), split them back)
    is a Transpose of x (how dynamo's SDPA writes K^T): (perm, x, first Reshape, the Transpose),
    or None when `node` does not end that pattern."""
    if inner is None or inner.op != "Transpose" or inner.tier != "compute" \
            or not only_reader(inner.outputs[0], node.name):
        return None
    merge = producer(inner.inputs[0])
    if merge is None or merge.op != "Reshape" or merge.tier != "compute" \
            or not only_reader(merge.outputs[0], inner.name):
        return None
    x, y, q = values[merge.inputs[0]].shape, values[merge.outputs[0]].shape, list(inner.attrs["perm"])
    if not q or q[0] != 0:
        return None
    for k in range(1, len(x)):
        if int(np.prod(x[:k])) == y[0] and tuple(x[k:]) == tuple(y[1:]):
            split = list(x[:k]) + [y[j] for j in q[1:]]
            if list(node.attrs["shape"]) == split:
                return list(range(k)) + [k - 1 + j for j in q[1:]], merge.inputs[0], merge, inner
    return None


# --- blocks -------------------------------------------------------------------------------
class BlockError(ValueError):
    """The graph does not have the embeddings / layers / head structure Confidant cuts along."""


def find_blocks(graph: Graph) -> Graph:
    every = [n for n in graph.nodes if n.tier == "compute"]
    free = _weight_derived(graph, every)
    # the layer structure is that of the nodes on the data's path; what is computed from weights and
    # constants alone (MPNet's relative-position bias, read by every layer) joins its readers' blocks
    compute = [n for n in every if n.name not in free]
    prod = use_def(compute).producers
    dag = nx.DiGraph()
    src = "__source__"
    dag.add_node(src)
    for n in compute:
        dag.add_node(n.name)
        preds = {prod[i].name for i in n.inputs if i in prod}
        if not preds:
            dag.add_edge(src, n.name)
        for p in preds:
            dag.add_edge(p, n.name)
    sinks = [n for n in dag.nodes if dag.out_degree(n) == 0 and n != src]
    if len(sinks) != 1:
        raise BlockError(f"expected one final compute node (the loss or logits), found {len(sinks)}: {sinks[:5]}")
    sink = sinks[0]
    idom = nx.immediate_dominators(dag, src)
    by_name = {n.name: n for n in compute}
    chain = []
    cur = sink
    while cur != src:
        chain.append(cur)
        cur = idom[cur]
    chain.reverse()
    boundaries = [c for c in chain if by_name[c].op == "LayerNorm"]
    segments = _segments(compute, idom, src, boundaries)
    if not boundaries or any(n.op == "Softmax" for n in segments[0]) \
            or any(sum(n.op == "Softmax" for n in seg) > 1 for seg in segments):
        # pre-norm: no norm dominates before the attention of the first layer, or (a pre-norm encoder
        # whose embeddings end in a norm: ModernBERT) several attentions between two norms of the path
        residuals = _residual_adds(chain, idom, by_name, prod, compute)
        if residuals:
            return _decoder_blocks(graph, compute, idom, src, residuals, free)
    if not boundaries:
        raise BlockError("no LayerNorm on the path to the output: cannot find layer boundaries")
    loss_nodes = [n for n in segments[-1] if n.op in LOSS_OPS]
    tail = [n for n in segments[-1] if n.op not in LOSS_OPS]
    body = segments[:-1]

    groups: list[tuple[str, str, list[Node]]] = []
    if not any(n.op == "Gather" for n in body[0]):
        raise BlockError("the first segment has no embedding lookup (Gather)")
    groups.append(("embeddings", "embeddings", body[0]))
    i, layer = 1, 0
    while i < len(body):
        seg = body[i]
        if any(n.op == "Softmax" for n in seg) and i + 1 < len(body) and not any(n.op == "Softmax" for n in body[i + 1]):
            groups.append((f"layer.{layer}", "encoder", seg + body[i + 1]))
            layer += 1
            i += 2
        else:
            kinds = "attention" if any(n.op == "Softmax" for n in seg) else "no attention"
            raise BlockError(f"segment ending at {boundaries[i]!r} ({kinds}) does not fit the pattern "
                             "attention+LayerNorm, feed-forward+LayerNorm of an encoder layer")
    if not tail:
        raise BlockError("no task head after the last encoder layer")
    groups.append(("head", "head", tail))
    if loss_nodes:
        groups.append(("loss", "loss", loss_nodes))

    return _with_groups(*_attach_weight_derived(graph, groups, free))


def _weight_derived(graph: Graph, compute: list[Node]) -> frozenset[str]:
    """Compute nodes whose inputs are weights, constants or the outputs of such nodes: nothing of
    the data flows into them."""
    made: set[str] = set()
    free: set[str] = set()
    for n in compute:  # topological order
        if all(i in graph.constants or i in made for i in n.inputs if i):
            free.add(n.name)
            made.update(n.outputs)
    return frozenset(free)


def _attach_weight_derived(graph: Graph, groups: list[tuple[str, str, list[Node]]],
                           free: frozenset[str]) -> tuple[Graph, list[tuple[str, str, list[Node]]]]:
    """Each weight-derived node joins the block of its readers. Read from several blocks, it is
    computed again in each (a copy named NAME@BLOCK), so no value crosses a pipeline cut: its
    weights are then read by several blocks, as a tied weight is (gradients summed over readers)."""
    if not free:
        return graph, groups
    current = {n.name: n for n in graph.nodes}
    group_of = {n.name: k for k, (_, _, nodes) in enumerate(groups) for n in nodes}
    members: list[list[str]] = [[n.name for n in nodes] for _, _, nodes in groups]
    # the compute nodes' readers by name, copied: kept up to date below as copies take readers over
    readers = {v: [n.name for n in ns]
               for v, ns in use_def(n for n in graph.nodes if n.tier == "compute").readers.items()}
    values = dict(graph.values)
    for name in reversed([n.name for n in graph.nodes if n.name in free]):
        node = current[name]
        where = sorted({group_of[r] for o in node.outputs for r in readers.get(o, []) if r in group_of})
        if not where:
            raise ValueError(f"node {name!r} ({node.op}) computes from weights alone and nothing reads it")
        home, *others = where
        group_of[name] = home
        members[home].append(name)
        for k in others:
            suffix = f"@{groups[k][0]}"
            renamed = {o: o + suffix for o in node.outputs}
            copy = Node(name + suffix, node.op, node.inputs, tuple(renamed.values()), node.attrs, node.tier)
            current[copy.name] = copy
            group_of[copy.name] = k
            members[k].append(copy.name)
            for o, o2 in renamed.items():
                values[o2] = Value(o2, values[o].shape, values[o].dtype)
                moved = [r for r in readers.get(o, []) if group_of.get(r) == k]
                for r in moved:
                    current[r] = Node(current[r].name, current[r].op,
                                      tuple(o2 if i == o else i for i in current[r].inputs), current[r].outputs,
                                      current[r].attrs, current[r].tier)
                readers[o] = [r for r in readers[o] if r not in moved]
                readers[o2] = moved
            for i in node.inputs:
                readers.setdefault(i, []).append(copy.name)
    ordered = topological_order(list(current.values()), [v.name for v in graph.inputs] + list(graph.constants))
    graph = Graph(graph.name, graph.inputs, graph.outputs, tuple(ordered), values, graph.constants, graph.params,
                  (), graph.batch, graph.seq, graph.lookup_rows, graph.target_positions)
    position = {n.name: k for k, n in enumerate(ordered)}
    return graph, [(gname, kind, sorted((current[m] for m in names), key=lambda n: position[n.name]))
                   for (gname, kind, _), names in zip(groups, members)]


def _with_groups(graph: Graph, groups: list[tuple[str, str, list[Node]]]) -> Graph:
    index = _GraphIndex(graph)
    blocks = [_make_block(graph, index, idx, name, kind, nodes) for idx, (name, kind, nodes) in enumerate(groups)]
    for prev, nxt in zip(blocks, blocks[1:]):
        if nxt.inputs[:1] != (prev.output,):
            raise BlockError(f"block {nxt.name!r} reads {nxt.inputs[:1]} but block {prev.name!r} produces "
                             f"{prev.output!r}: a value skips across blocks, which a pipeline cut cannot carry")
    return graph.with_blocks(blocks)


def _segments(compute: list[Node], idom: dict, src: str, boundaries: list[str]) -> list[list[Node]]:
    """Compute nodes grouped by the last boundary that dominates them: segment 0 before the first,
    segment k + 1 after boundary k (a boundary ends its own segment)."""
    boundary_index = {b: i for i, b in enumerate(boundaries)}
    segments: list[list[Node]] = [[] for _ in range(len(boundaries) + 1)]
    for n in compute:
        start = idom[n.name]
        while start != src and start not in boundary_index:
            start = idom[start]
        segments[0 if start == src else boundary_index[start] + 1].append(n)
    return segments


def _residual_adds(chain: list[str], idom: dict, by_name: dict[str, Node], prod: dict[str, Node],
                   compute: list[Node]) -> list[str]:
    """The pre-norm residual Adds on the dominator chain: h = x + f(norm(x)), x the output of the
    chain node before (which dominates it) and f a branch that starts with a LayerNorm or RMSNorm
    of x; with the node producing the first x (the embeddings' output) in front. The first may read
    x itself when x is a norm's output (ModernBERT's first layer has no norm of its own: its input
    is the embeddings' norm)."""
    normed = {n.inputs[0] for n in compute if n.op in ("LayerNorm", "RMSNorm")}
    out: list[str] = []
    for prev, name in zip(chain, chain[1:]):
        node, before = by_name[name], by_name[prev]
        if node.op != "Add" or idom[name] != prev or len(node.inputs) != 2:
            continue
        x = before.outputs[0]
        other = [i for i in node.inputs if i != x]
        first_of_norm = not out and before.op in ("LayerNorm", "RMSNorm")
        if node.inputs.count(x) != 1 or len(other) != 1 or other[0] not in prod or not (x in normed or first_of_norm):
            continue
        if not out:
            out.append(prev)
        out.append(name)
    return out


def _decoder_blocks(graph: Graph, compute: list[Node], idom: dict, src: str, boundaries: list[str],
                    free: frozenset[str] = frozenset()) -> Graph:
    """Blocks of a pre-norm decoder cut at its residual Adds (see the module docstring)."""
    segments = _segments(compute, idom, src, boundaries)
    embeddings, body, last = segments[0], segments[1:-1], segments[-1]
    if not any(n.op == "Gather" for n in embeddings):
        raise BlockError("the first segment has no embedding lookup (Gather)")
    if any(n.op == "Softmax" for n in embeddings):
        raise BlockError("attention before the first residual connection: not a pre-norm decoder")
    groups: list[tuple[str, str, list[Node]]] = [("embeddings", "embeddings", embeddings)]
    i, layer = 0, 0
    while i < len(body):
        seg = body[i]
        if not any(n.op == "Softmax" for n in seg):
            raise BlockError(f"residual segment ending at {seg[-1].name!r} has no attention (Softmax): a decoder "
                             "layer is an attention residual, then (optionally) a feed-forward residual")
        if i + 1 < len(body) and not any(n.op == "Softmax" for n in body[i + 1]):
            seg, i = seg + body[i + 1], i + 2
        else:
            i += 1  # a parallel block (attention and MLP on one residual)
        groups.append((f"layer.{layer}", "decoder", seg))
        layer += 1
    loss_nodes = [n for n in last if n.op in LOSS_OPS]
    tail = [n for n in last if n.op not in LOSS_OPS]
    if not tail:
        raise BlockError("no final norm or LM head after the last decoder layer")
    groups.append(("head", "head", tail))
    if loss_nodes:
        groups.append(("loss", "loss", loss_nodes))
    return _with_groups(*_attach_weight_derived(graph, groups, free))


class _GraphIndex:
    """What every block's bookkeeping looks up, built once per graph (so finding the blocks of a
    deep model stays linear in its size): node positions, host producers, compute readers."""

    def __init__(self, graph: Graph):
        self.order = {n.name: k for k, n in enumerate(graph.nodes)}
        self.host_prod = use_def(n for n in graph.nodes if n.tier == "host").producers
        self.compute_readers = {v: {n.name for n in ns}
                                for v, ns in use_def(n for n in graph.nodes if n.tier == "compute").readers.items()}
        self.graph_inputs = set(graph.input_names())
        self.params = frozenset(graph.params)


def _make_block(graph: Graph, index: _GraphIndex, block_index: int, name: str, kind: str,
                nodes: list[Node]) -> Block:
    nodes = sorted(nodes, key=lambda n: index.order[n.name])
    members = {n.name for n in nodes}
    produced = {o for n in nodes for o in n.outputs}
    host_prod = index.host_prod
    compute_inputs, host_inputs = [], []
    seen_inputs: set[str] = set()
    for n in nodes:
        for i in n.inputs:
            if i in produced or i in graph.constants or i in seen_inputs:
                continue
            seen_inputs.add(i)
            if i in host_prod or (i in index.graph_inputs and graph.values[i].dtype != "float32") or i in LOSS_INPUTS:
                host_inputs.append(i)
            else:
                compute_inputs.append(i)
    if len(compute_inputs) > 1:
        raise BlockError(f"block {name!r} reads several activations from other blocks: {compute_inputs}")
    stack = [i for i in host_inputs if i in host_prod]
    seen: set[str] = set()
    while stack:
        node = host_prod[stack.pop()]
        if node.name in seen:
            continue
        seen.add(node.name)
        stack.extend(i for i in node.inputs if i in host_prod)
    host_nodes = tuple(sorted(seen, key=index.order.__getitem__))
    consumers_outside = [o for n in nodes for o in n.outputs
                         if any(r not in members for r in index.compute_readers.get(o, ()))]
    output = nodes[-1].outputs[0] if not consumers_outside else consumers_outside[0]
    if len(set(consumers_outside)) > 1:
        raise BlockError(f"block {name!r} hands several values to later blocks: {sorted(set(consumers_outside))}")
    params = tuple(dict.fromkeys(i for n in nodes for i in n.inputs if i in index.params))
    flops = sum(compute_flops(n.op, n.attrs, [graph.values[i].shape if i in graph.values else graph.constants[i].shape
                                               for i in n.inputs], graph.values[n.outputs[0]].shape) for n in nodes)
    heads = head_size = kv_heads = None
    softmax = [n for n in nodes if n.op == "Softmax"]
    if softmax:
        scores = graph.values[softmax[0].inputs[0]].shape
        heads = int(scores[1]) if len(scores) == 4 else None
        qk = [n for n in nodes if n.op == "MatMul" and graph.values[n.outputs[0]].shape == scores
              and len(graph.values[n.inputs[0]].shape) == 4]
        if qk:
            head_size = int(graph.values[qk[0].inputs[0]].shape[-1])
        kv_heads = heads and _kv_heads(graph, nodes, heads)
    return Block(
        index=block_index, name=name, kind=kind, nodes=tuple(n.name for n in nodes), host_nodes=host_nodes,
        inputs=tuple(compute_inputs + host_inputs), output=output, params=params,
        params_bytes=sum(int(graph.constants[p].nbytes) for p in params),
        activation_bytes=graph.values[output].nbytes, flops=int(flops), heads=heads, head_size=head_size,
        kv_heads=kv_heads,
    )


def _kv_heads(graph: Graph, nodes: list[Node], heads: int) -> int:
    """Key/value heads of an attention block: grouped-query attention repeats each of its kv heads
    heads/kv times (HF's repeat_kv: [B, kv, 1, S, D] expanded to [B, kv, n_rep, S, D]); without
    such an Expand every query head has its own."""
    for n in nodes:
        if n.op != "Expand":
            continue
        src, out = graph.values[n.inputs[0]].shape, graph.values[n.outputs[0]].shape
        if len(src) == 5 and src[2] == 1 and out[1] == src[1] and src[1] * out[2] == heads:
            return int(src[1])
    return heads
