"""Graph passes run after lowering, each a pure function Graph -> Graph.

* ``fuse_layer_norm`` requires: compute nodes from lowering. Ensures: the decomposed LayerNorm of
  opset < 17 exporters (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add) is one
  ``LayerNorm`` node, so engines see one op whatever the exporter emitted.
* ``fuse_gelu`` ensures: x * 0.5 * (1 + erf(x / sqrt 2)) (in any factor order, Div or Mul by
  1/sqrt 2) is one ``Gelu`` node.
* ``find_blocks`` requires: fused LayerNorms. Ensures: every compute node belongs to exactly one
  block; blocks are cut at LayerNorm outputs that dominate the loss (every path from the token
  inputs to the loss passes through them), grouped into embeddings, encoder layers (an attention
  segment with a Softmax plus its feed-forward segment), head and loss, each with its sizes,
  FLOPs and attention head count.
"""
from __future__ import annotations

import math

import networkx as nx
import numpy as np

from ir.graph import Block, Graph, Node, topological_order
from ir.ops import compute_flops
from planner.attention import annotate_attention

SQRT2 = math.sqrt(2.0)


def run_passes(graph: Graph) -> Graph:
    graph = fuse_layer_norm(graph)
    graph = fuse_gelu(graph)
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
        if scale not in graph.params or len(after) != 1 or after[0].op != "Add":
            continue
        add = after[0]
        bias = _other(add, mul.outputs[0])
        if bias not in graph.params:
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


# --- blocks -------------------------------------------------------------------------------
class BlockError(ValueError):
    """The graph does not have the embeddings / layers / head structure Confidant cuts along."""


def find_blocks(graph: Graph) -> Graph:
    compute = [n for n in graph.nodes if n.tier == "compute"]
    prod = {o: n for n in compute for o in n.outputs}
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
    if not boundaries:
        raise BlockError("no LayerNorm on the path to the output: cannot find layer boundaries")
    boundary_index = {b: i for i, b in enumerate(boundaries)}

    def segment_of(name: str) -> int:
        if name in boundary_index:
            start = idom[name]
        else:
            start = idom[name]
        while start != src and start not in boundary_index:
            start = idom[start]
        return 0 if start == src else boundary_index[start] + 1

    segments: list[list[Node]] = [[] for _ in range(len(boundaries) + 1)]
    for n in compute:
        segments[segment_of(n.name)].append(n)
    loss_nodes = [n for n in segments[-1] if n.op == "SoftmaxCrossEntropy"]
    tail = [n for n in segments[-1] if n.op != "SoftmaxCrossEntropy"]
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

    blocks = [_make_block(graph, idx, name, kind, nodes) for idx, (name, kind, nodes) in enumerate(groups)]
    for prev, nxt in zip(blocks, blocks[1:]):
        if nxt.inputs[:1] != (prev.output,):
            raise BlockError(f"block {nxt.name!r} reads {nxt.inputs[:1]} but block {prev.name!r} produces "
                             f"{prev.output!r}: a value skips across blocks, which a pipeline cut cannot carry")
    return graph.with_blocks(blocks)


def _make_block(graph: Graph, index: int, name: str, kind: str, nodes: list[Node]) -> Block:
    order = {n.name: k for k, n in enumerate(graph.nodes)}
    nodes = sorted(nodes, key=lambda n: order[n.name])
    produced = {o for n in nodes for o in n.outputs}
    host_prod = {o: n for n in graph.nodes if n.tier == "host" for o in n.outputs}
    graph_inputs = set(graph.input_names())
    compute_inputs, host_inputs = [], []
    for n in nodes:
        for i in n.inputs:
            if i in produced or i in graph.constants or i in compute_inputs or i in host_inputs:
                continue
            if i in host_prod or (i in graph_inputs and graph.values[i].dtype != "float32") or i == "targets":
                host_inputs.append(i)
            else:
                compute_inputs.append(i)
    if len(compute_inputs) > 1:
        raise BlockError(f"block {name!r} reads several activations from other blocks: {compute_inputs}")
    needed_host: list[str] = []
    stack = [i for i in host_inputs if i in host_prod]
    seen = set()
    while stack:
        v = stack.pop()
        node = host_prod[v]
        if node.name in seen:
            continue
        seen.add(node.name)
        needed_host.append(node.name)
        stack.extend(i for i in node.inputs if i in host_prod)
    host_nodes = tuple(n.name for n in graph.nodes if n.name in seen)
    consumers_outside = [o for o in produced
                         if any(o in m.inputs for m in graph.nodes if m.tier == "compute" and m not in nodes)]
    output = nodes[-1].outputs[0] if not consumers_outside else consumers_outside[0]
    if len(set(consumers_outside)) > 1:
        raise BlockError(f"block {name!r} hands several values to later blocks: {sorted(set(consumers_outside))}")
    params = tuple(dict.fromkeys(i for n in nodes for i in n.inputs if i in graph.params))
    flops = sum(compute_flops(n.op, n.attrs, [graph.values[i].shape if i in graph.values else graph.constants[i].shape
                                               for i in n.inputs], graph.values[n.outputs[0]].shape) for n in nodes)
    heads = head_size = None
    softmax = [n for n in nodes if n.op == "Softmax"]
    if softmax:
        scores = graph.values[softmax[0].inputs[0]].shape
        heads = int(scores[1]) if len(scores) == 4 else None
        qk = [n for n in nodes if n.op == "MatMul" and graph.values[n.outputs[0]].shape == scores
              and len(graph.values[n.inputs[0]].shape) == 4]
        if qk:
            head_size = int(graph.values[qk[0].inputs[0]].shape[-1])
    return Block(
        index=index, name=name, kind=kind, nodes=tuple(n.name for n in nodes), host_nodes=host_nodes,
        inputs=tuple(compute_inputs + host_inputs), output=output, params=params,
        params_bytes=sum(int(graph.constants[p].nbytes) for p in params),
        activation_bytes=graph.values[output].nbytes, flops=int(flops), heads=heads, head_size=head_size,
    )
