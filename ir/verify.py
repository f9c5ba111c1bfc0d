"""Structural checks of a lowered graph (plans get theirs in the pipeline issue); pure functions."""
from __future__ import annotations

from ir.graph import BLOCK_KINDS, Graph
from ir.ops import COMPUTE_OPS, HOST_OPS, compute_output_shape


class GraphError(ValueError):
    """A graph that breaks an IR invariant; the message names the node or block."""


def verify_graph(graph: Graph) -> None:
    known = set(graph.input_names()) | set(graph.constants)
    producers: dict[str, str] = {}
    for node in graph.nodes:
        ops = COMPUTE_OPS if node.tier == "compute" else HOST_OPS
        if node.op not in ops:
            raise GraphError(f"node {node.name!r}: op {node.op} is not a {node.tier} op of ir/ops.py")
        for i in node.inputs:
            if i and i not in known:
                raise GraphError(f"node {node.name!r} ({node.op}) reads {i!r}, which nothing before it produces")
        for o in node.outputs:
            if o in producers or o in graph.constants:
                raise GraphError(f"value {o!r} is produced twice (by {producers.get(o, 'a constant')!r} and {node.name!r})")
            producers[o] = node.name
            known.add(o)
            if o not in graph.values:
                raise GraphError(f"node {node.name!r}: output {o!r} has no Value entry")
        if node.tier == "compute":
            shapes = [graph.values[i].shape if i in graph.values else tuple(graph.constants[i].shape) for i in node.inputs]
            try:
                expected = compute_output_shape(node.op, dict(node.attrs), shapes)
            except ValueError as exc:
                raise GraphError(f"node {node.name!r} ({node.op}): {exc}") from None
            if tuple(expected) != tuple(graph.values[node.outputs[0]].shape):
                raise GraphError(f"node {node.name!r} ({node.op}): output shape {graph.values[node.outputs[0]].shape} "
                                 f"!= shape rule {expected}")
    for p in graph.params:
        if p not in graph.constants:
            raise GraphError(f"parameter {p!r} has no constant tensor")
    for v in graph.outputs:
        if v.name not in known:
            raise GraphError(f"graph output {v.name!r} is never produced")
    if graph.blocks:
        seen: dict[str, str] = {}
        for b in graph.blocks:
            if b.kind not in BLOCK_KINDS:
                raise GraphError(f"block {b.name!r}: unknown kind {b.kind!r}")
            for n in b.nodes:
                if n in seen:
                    raise GraphError(f"node {n!r} is in blocks {seen[n]!r} and {b.name!r}")
                seen[n] = b.name
        missing = [n.name for n in graph.nodes if n.tier == "compute" and n.name not in seen]
        if missing:
            raise GraphError(f"compute node {missing[0]!r} belongs to no block ({len(missing)} such nodes)")
