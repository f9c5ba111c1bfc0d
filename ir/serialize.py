"""Graph IR to and from plain JSON plus named numpy arrays (never pickle).

A device receives only its stage's slice of the graph: the nodes, values and constants of its
block range, with the block table of the whole model kept so that block indices mean the same
everywhere. The JSON half travels as a control message or a bundle file; the arrays travel as
raw tensors (or safetensors files in bundles).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ir.graph import AttentionSite, Block, Graph, Node, Value
from ir.precision import QuantizedTensor, from_storage_tensors, quantize, storage_piece_names, storage_tensors
from ir.versioned import check_header

SCHEMA_VERSION = 1


def _attr_to_json(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_attr_to_json(v) for v in value]
    return value


def _attr_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=value["dtype"]).reshape(value["shape"])
    if isinstance(value, list):
        return [_attr_from_json(v) for v in value]
    return value


def slice_graph(graph: Graph, first_block: int, last_block: int) -> Graph:
    """The part of `graph` that a stage of blocks first..last needs, with every block's metadata."""
    blocks = graph.blocks[first_block : last_block + 1]
    names = {n for b in blocks for n in b.nodes} | {n for b in blocks for n in b.host_nodes}
    nodes = tuple(n for n in graph.nodes if n.name in names)
    # The slice's values and constants in the order of first use (the graph's inputs it reads, then each node's
    # inputs and outputs in node order, then the blocks' inputs and the last block's output), not in
    # the order of the graph's dicts: a lowered graph's dicts may come out in an order that depends
    # on the interpreter's string hashing (PYTHONHASHSEED), and a bundle's bytes must not.
    order = [x for n in nodes for x in (*n.inputs, *n.outputs) if x]
    order += [i for b in blocks for i in b.inputs] + [blocks[-1].output]
    used = dict.fromkeys([v.name for v in graph.inputs if v.name in set(order)] + order)
    values = {k: graph.values[k] for k in used if k in graph.values}
    constants = {k: graph.constants[k] for k in used if k in graph.constants}
    params = tuple(p for p in graph.params if p in constants)
    inputs = tuple(v for v in graph.inputs if v.name in used)
    outputs = (graph.values[blocks[-1].output],)
    return Graph(graph.name, inputs, outputs, nodes, values, constants, params, graph.blocks, graph.batch, graph.seq)


def graph_to_json(graph: Graph, stored: bool = False) -> dict:
    """Everything but the constant tensors, as a JSON-ready dict. A frozen weight held quantized
    (`ir.precision`) travels one of two ways:

    - `stored` (plan bundles): as its storage arrays (`ir.precision.storage_tensors`: NAME.q_codes,
      NAME.q_scales, int4's NAME.q_mins), listed under `quantized` (name -> [storage, blocked axis,
      block]); the tensors to send are `stored_constants(graph)`. Nothing is widened either side.
    - otherwise (the coordinator's setup message): as its float32 values plus its precision under
      `precisions` (same triple); the reader quantizes it again, which gives back the very same
      weight. Bundles written before `stored` existed are read this way too."""
    doc = _graph_doc(graph)
    held = {k: [v.storage, v.axis, v.block] for k, v in graph.constants.items() if isinstance(v, QuantizedTensor)}
    if held:
        doc["quantized" if stored else "precisions"] = held
    return doc


def stored_constants(constants) -> dict:
    """The tensors a `graph_to_json(graph, stored=True)` document's weights file holds: each
    quantized constant as its storage arrays, the others as they are."""
    out = {}
    for name, value in constants.items():
        out.update(storage_tensors(name, value))
    return out


def constant_tensor_names(doc: Mapping) -> set[str]:
    """The tensor names a graph document's weights file must hold (ValueError for a malformed
    `quantized` table)."""
    quantized = doc.get("quantized", {})
    if not isinstance(quantized, Mapping) or not all(isinstance(v, list) and len(v) == 3 and isinstance(v[0], str)
                                                     for v in quantized.values()):
        raise ValueError("quantized must map each weight to [storage, axis, block]")
    stray = sorted(set(quantized) - set(doc["constants"]))
    if stray:
        raise ValueError(f"quantized names {stray[0]!r}, which is not a constant of the graph")
    names = set()
    for name in doc["constants"]:
        names.update(storage_piece_names(name, quantized[name][0]) if name in quantized else (name,))
    return names


def _graph_doc(graph: Graph) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "name": graph.name,
        "batch": graph.batch,
        "seq": graph.seq,
        "inputs": [v.name for v in graph.inputs],
        "outputs": [v.name for v in graph.outputs],
        "values": [[v.name, list(v.shape), v.dtype] for v in graph.values.values()],
        "nodes": [{"name": n.name, "op": n.op, "inputs": list(n.inputs), "outputs": list(n.outputs),
                   "attrs": {k: _attr_to_json(v) for k, v in n.attrs.items()}, "tier": n.tier} for n in graph.nodes],
        "params": list(graph.params),
        "constants": {k: [str(v.dtype), list(v.shape)] for k, v in graph.constants.items()},
        "blocks": [{**{f: getattr(b, f) for f in Block.__dataclass_fields__},
                    "nodes": list(b.nodes), "host_nodes": list(b.host_nodes), "inputs": list(b.inputs),
                    "params": list(b.params), "attention": None if b.attention is None else b.attention.to_json()}
                   for b in graph.blocks],
    }


def graph_from_json(doc: Mapping, constants: Mapping[str, np.ndarray]) -> Graph:
    """Rebuild a graph; every declared constant must be present with its declared dtype and shape."""
    check_header(doc, format=None, versions=SCHEMA_VERSION, where="graph",
                 redo="the sender runs a different Confidant version")
    declared = doc["constants"]
    missing = sorted(constant_tensor_names(doc) - set(constants))
    if missing:
        raise ValueError(f"graph constants missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    quantized = doc.get("quantized", {})
    consts = {}
    for name, (dtype, shape) in declared.items():
        if name in quantized:
            if dtype != "float32":
                raise ValueError(f"constant {name!r} is held quantized, declared {dtype}")
            storage, axis, block = quantized[name]
            consts[name] = from_storage_tensors(name, constants, storage, axis, block, shape)
            continue
        arr = np.asarray(constants[name])
        if str(arr.dtype) != dtype or list(arr.shape) != list(shape):
            raise ValueError(f"constant {name!r} is {arr.dtype}{list(arr.shape)}, declared {dtype}{shape}")
        consts[name] = arr
    for name, (storage, axis, block) in doc.get("precisions", {}).items():
        if name not in consts:
            raise ValueError(f"precisions names {name!r}, which is not a constant of the graph")
        consts[name] = quantize(consts[name], str(storage), int(axis), int(block))
    values = {name: Value(name, tuple(shape), dtype) for name, shape, dtype in doc["values"]}
    nodes = tuple(Node(n["name"], n["op"], tuple(n["inputs"]), tuple(n["outputs"]),
                       {k: _attr_from_json(v) for k, v in n["attrs"].items()}, n["tier"]) for n in doc["nodes"])
    blocks = tuple(Block(**{**b, "nodes": tuple(b["nodes"]), "host_nodes": tuple(b["host_nodes"]),
                            "inputs": tuple(b["inputs"]), "params": tuple(b["params"]),
                            "attention": None if b.get("attention") is None else AttentionSite.from_json(b["attention"])})
                   for b in doc["blocks"])
    return Graph(doc["name"], tuple(values[i] for i in doc["inputs"]), tuple(values[o] for o in doc["outputs"]),
                 nodes, values, consts, tuple(doc["params"]), blocks, int(doc["batch"]), int(doc["seq"]))


def merge_slices(slices) -> Graph:
    """The whole model back from its stages' slices (e.g. all bundles of a plan), for evaluation
    on one machine after pipeline training."""
    slices = list(slices)
    nodes, values, constants, params, inputs = [], {}, {}, [], {}
    seen = set()
    for g in slices:
        for n in g.nodes:
            if n.name not in seen:
                seen.add(n.name)
                nodes.append(n)
        values.update(g.values)
        constants.update(g.constants)
        params.extend(p for p in g.params if p not in params)
        inputs.update({v.name: v for v in g.inputs})
    last = slices[-1]
    return Graph(last.name, tuple(inputs.values()), last.outputs, tuple(nodes), values, constants, tuple(params),
                 last.blocks, last.batch, last.seq)
