"""The lean ONNX export of a causal LM (issue 31): the graph traced without its weights, the weights
written after it one tensor at a time (quantized one at a time for `--base-dtype`).

Why: `torch.onnx.export` with its parameters builds the whole protobuf in memory (a copy of every
weight), serializes it (another), and `--base-dtype` then read the file back, lowered it (float32
weights again), quantized and rewrote it through `onnx.load` / `onnx.save` (two more copies): a
Llama-3.2-1B-class model (4.7 GiB of float32 weights) needed ~20 GiB, a laptop's whole memory. Here:

1. the TorchScript exporter traces with `export_params=False`: the weights are graph inputs named
   as in the state dict (the exporter's own names, one per shared tensor), the message is a few MB;
2. which weights are stored quantized is decided by lowering that graph with zero-stride stand-ins
   (`np.broadcast_to`: the shape, no memory), by the same rule as before (`ir.precision.quantizable`);
3. the file is written in protobuf's wire format: the message less its weights, then each weight
   as an initializer whose bytes are copied from the model's own tensor (a view of the torch
   parameter) or from its quantized storage arrays, quantized a chunk of rows at a time. A float
   file over protobuf's 2 GiB limit keeps its weights in one external data file beside it
   (`NAME.onnx.data`), which ONNX Runtime and the lowering read.

So the export holds the loaded model, the quantized arrays (the file's size) and one tensor's work.
The files are the ones the old path wrote: same nodes, same initializer names and values (the
widening ops of `planner.onnx_quantize`), checked against it by tests/test_lean_export.py.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Mapping

import numpy as np

INLINE_LIMIT = 1_900_000_000  # bytes of weights kept inside the protobuf (its limit is 2 GiB)
_LENGTH = 2
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def trace_without_weights(module, args, **export_kwargs):
    """The TorchScript export of `module` on `args` as a ModelProto whose weights are graph inputs.

    The exporter's ONNX shape inference (`_jit_pass_onnx_graph_shape_type_inference`, run twice)
    serializes the graph with every parameter's data even under `export_params=False`: 2x the
    weights for a moment (measured: +225 MiB for 108 MiB of weights). It is given only the small
    constants (under 1024 elements: ones that may feed a shape); the weights are typed graph
    inputs, which inference reads by their declared types. tests/test_lean_export.py checks the
    nodes against the old export's."""
    import onnx
    import torch

    infer = getattr(torch._C, "_jit_pass_onnx_graph_shape_type_inference", None)

    def lean_infer(graph, params, *rest):
        return infer(graph, {k: v for k, v in params.items() if v.numel() < 1024}, *rest)

    buf = io.BytesIO()
    if infer is not None:
        torch._C._jit_pass_onnx_graph_shape_type_inference = lean_infer
    try:
        torch.onnx.export(module, args, buf, dynamo=False, export_params=False, **export_kwargs)
    finally:
        if infer is not None:
            torch._C._jit_pass_onnx_graph_shape_type_inference = infer
    return onnx.load_from_string(buf.getvalue())


def take_weight_inputs(model, known: Mapping[str, object]) -> list[str]:
    """The names of `model`'s graph inputs that are weights (names in `known`), removed from its inputs."""
    inputs = list(model.graph.input)
    names = [i.name for i in inputs if i.name in known]
    del model.graph.input[:]
    model.graph.input.extend(i for i in inputs if i.name not in known)
    return names


def stored_precisions(model, shapes: Mapping[str, tuple[int, ...]], base_dtype: str) -> dict[str, tuple[str, int]]:
    """weight name -> (storage, blocked axis) for the weights `base_dtype` stores quantized in `model`
    (a graph whose weights `take_weight_inputs` took), decided on the lowered graph as the lowering
    of the written file will see it, with zero-stride stand-ins for the weights."""
    from onnx import ModelProto, TensorProto

    from ir.precision import check_base_dtype, lookup_tables, quantizable, storage_for
    from planner.onnx_import import ImportOptions, lower_model

    check_base_dtype(base_dtype)
    if base_dtype == "float32":
        return {}
    probe = ModelProto()
    probe.CopyFrom(model)
    for name, shape in shapes.items():
        stub = TensorProto(name=name, data_type=TensorProto.FLOAT)
        stub.dims.extend(int(d) for d in shape)
        probe.graph.initializer.append(stub)
    stand_ins = {name: np.broadcast_to(np.float32(0), tuple(shape)) for name, shape in shapes.items()}
    graph = lower_model(probe, ImportOptions(1, 8, False), source="the traced graph", arrays=stand_ins)
    tables = lookup_tables(graph.nodes)
    return {name: (storage_for(base_dtype, name in tables), axis)
            for name, axis in quantizable(graph.nodes, graph.constants, ()).items() if name in shapes}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _field(number: int, length: int) -> bytes:
    return _varint(number << 3 | _LENGTH) + _varint(length)


def _onnx_type(array: np.ndarray) -> int:
    from onnx import TensorProto, helper

    if array.dtype == np.uint16:  # bfloat16 bit patterns (planner.onnx_quantize stores them so)
        return TensorProto.BFLOAT16
    return helper.np_dtype_to_tensor_dtype(array.dtype)


def write_with_weights(model, weights: Mapping[str, object], path: Path, base_dtype: str = "float32") -> list[str]:
    """Write `model` (weights taken out, `take_weight_inputs`) to `path` with `weights` (name -> float
    array, or QuantizedTensor for a weight stored quantized) as its initializers, streamed; the names
    stored quantized. Float weights over `INLINE_LIMIT` go to `NAME.onnx.data` beside the file."""
    import json

    from onnx import ModelProto, TensorProto

    from ir.precision import QuantizedTensor
    from planner.onnx_quantize import BASE_DTYPE_KEY, WEIGHTS_KEY, widen_parts

    path = Path(path)
    pieces: list[tuple[str, np.ndarray]] = []
    nodes, record = [], {}
    for name, value in weights.items():
        if isinstance(value, QuantizedTensor):
            arrays, consts, widen = widen_parts(name, value)
            pieces += arrays
            model.graph.initializer.extend(consts)
            nodes += widen
            record[name] = [value.storage, value.axis, value.block, *value.shape]
        else:
            pieces.append((name, np.ascontiguousarray(value)))
    if nodes:  # topological: the widened weights before any reader
        rest = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes + rest)
    if record:
        for key, value in ((BASE_DTYPE_KEY, base_dtype), (WEIGHTS_KEY, json.dumps(record))):
            model.metadata_props.add(key=key, value=value)
    external = sum(a.nbytes for _, a in pieces) > INLINE_LIMIT
    data_path = path.with_name(path.name + ".data")
    headers, offset = [], 0
    for name, array in pieces:
        t = TensorProto(name=name, data_type=_onnx_type(array))
        t.dims.extend(int(d) for d in array.shape)
        if external:
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", str(offset)),
                               ("length", str(array.nbytes))):
                t.external_data.add(key=key, value=value)
            offset += -(-array.nbytes // 4096) * 4096
        headers.append(t.SerializeToString())
    head = ModelProto()
    head.CopyFrom(model)
    head.ClearField("graph")
    graph_bytes = model.graph.SerializeToString()
    entries = []
    for header, (_, array) in zip(headers, pieces):
        inner = len(header) + (0 if external else len(_field(_TENSOR_RAW_DATA, array.nbytes)) + array.nbytes)
        entries.append((_field(_GRAPH_INITIALIZER, inner), header))
    graph_length = len(graph_bytes) + sum(len(tag) + len(h) for tag, h in entries) + \
        (0 if external else sum(len(_field(_TENSOR_RAW_DATA, a.nbytes)) + a.nbytes for _, a in pieces))
    with open(path, "wb") as f:
        f.write(head.SerializeToString())
        f.write(_field(_MODEL_GRAPH, graph_length))
        f.write(graph_bytes)
        for (tag, header), (_, array) in zip(entries, pieces):
            f.write(tag)
            f.write(header)
            if not external:
                f.write(_field(_TENSOR_RAW_DATA, array.nbytes))
                f.write(_bytes_of(array))
    if external:
        with open(data_path, "wb") as f:
            for _, array in pieces:
                f.write(_bytes_of(array))
                f.write(b"\0" * (-array.nbytes % 4096))
    elif data_path.exists():
        data_path.unlink()  # a stale data file of an earlier, larger export
    return list(record)


def _bytes_of(array: np.ndarray) -> memoryview:
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return memoryview(array.reshape(-1)).cast("B")


__all__ = ["INLINE_LIMIT", "stored_precisions", "take_weight_inputs", "trace_without_weights", "write_with_weights"]
