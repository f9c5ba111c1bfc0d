"""An exported ONNX model with its frozen weights stored quantized (`confidant export --base-dtype`).

Each weight `ir.precision.quantizable` picks (a 2-D float weight read only by products and lookups,
not a classifier's fresh head) is replaced in the file by its storage arrays, the ones a bundle
holds (`ir.precision.storage_tensors`: `NAME.q_codes`, `NAME.q_scales`, int4's `NAME.q_mins`),
and a few standard ops that widen them back to `NAME` as float32, so the rest of the graph is
unchanged and ONNX Runtime (generation), the lowering (which folds them) and any other reader
computes with exactly the weight `ir.precision.dequantize` gives:

- int8: Cast(codes, float) [rows, blocks, 32] x Cast(scales, float) [rows, blocks, 1];
- int4: the packed bytes Cast to float, the high nibble Floor(b / 16), the low b - 16 x high (exact
  in float32), interleaved low first, x step + offset (llama.cpp's Q4_1: w = q d + m);
- bfloat16: a BFLOAT16 tensor Cast to float;
then reshaped to [rows, padded columns], cut to the real columns and, for a weight blocked along
its first axis, transposed back. The float32 products and sums are the ones numpy makes in
`QuantizedTensor.widen_storage_rows`, so the values are bit for bit the same.

Why not ONNX's blocked `DequantizeLinear`: it needs opset 21 (the exports here are opset 14-20, and
raising a model's opset changes other ops' forms), and Q4_1's per-block float offset is no integer
zero point: y = (q - zp) d cannot give q d + m. The ops above run at every opset the exporters write.

The file records what it did in its metadata (`confidant.base_dtype`, and per weight its storage and
blocked axis in `confidant.quantized_weights`), so `train-local` and `plan` hold the base at the
file's precision (quantizing its dequantized weights again gives back the very same codes, see
ir/precision.py) and refuse another precision, which would round the rounded weights a second time.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

import numpy as np

from ir.precision import BLOCK, QuantizedTensor, check_base_dtype, quantize, storage_tensors

BASE_DTYPE_KEY = "confidant.base_dtype"
WEIGHTS_KEY = "confidant.quantized_weights"


def _initializer(name: str, value: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    if value.dtype == np.uint16:  # bfloat16 bit patterns: an ONNX BFLOAT16 tensor of those bits
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(value.shape), value.tobytes(), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(value), name)


def _widen_nodes(name: str, q: QuantizedTensor) -> tuple[list, list]:
    """(initializers, nodes) that compute `name` (float32, its logical shape) from `q`'s storage arrays."""
    arrays, inits, nodes = widen_parts(name, q)
    return [_initializer(k, v) for k, v in arrays] + inits, nodes


def widen_parts(name: str, q: QuantizedTensor) -> tuple[list, list, list]:
    """(storage arrays as (initializer name, array), the widening's small constant initializers, its
    nodes): `_widen_nodes` with the big arrays left as arrays, for a writer that streams them."""
    from onnx import helper

    arrays = [(k, v) for k, v in storage_tensors(name, q).items() if v.size]  # bfloat16's scales are empty
    p = f"{name}.q_"
    inits, nodes, stored = _widen_ops(p, [f"{name}.q_codes", f"{name}.q_scales", f"{name}.q_mins"], q, q.rows)
    final = helper.make_node("Transpose", [stored], [name], name=p + "logical", perm=[1, 0]) if q.axis == 0 else \
        helper.make_node("Identity", [stored], [name], name=p + "logical")
    nodes.append(final)
    return arrays, inits, nodes


def _widen_ops(p: str, pieces: list[str], q: QuantizedTensor, rows: int) -> tuple[list, list, str]:
    """(small constant initializers, nodes, output name): float32 [rows, cols] in storage layout from
    `rows` rows of `q`'s storage arrays, named by `pieces` (codes, scales, mins), the nodes' names
    prefixed `p`; `rows` -1: as many as the pieces hold (a lookup's rows)."""
    from onnx import TensorProto, helper, numpy_helper

    inits, nodes = [], []

    def const(suffix: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), p + suffix))
        return p + suffix

    def op(kind: str, inputs, suffix: str, **attrs) -> str:
        nodes.append(helper.make_node(kind, list(inputs), [p + suffix], name=p + suffix, **attrs))
        return p + suffix

    cols = q.cols
    if q.storage == "bfloat16":
        stored = op("Cast", [pieces[0]], "widened", to=TensorProto.FLOAT)
        padded = cols
    else:
        codes = op("Cast", [pieces[0]], "codes_f", to=TensorProto.FLOAT)
        padded = q.codes.shape[1] * (2 if q.storage == "int4" else 1)
        if q.storage == "int4":
            high = op("Floor", [op("Mul", [codes, const("sixteenth", np.float32(1 / 16))], "over16")], "high")
            low = op("Sub", [codes, op("Mul", [high, const("sixteen", np.float32(16))], "high16")], "low")
            axes = const("axis2", np.array([2], np.int64))
            pair = op("Concat", [op("Unsqueeze", [low, axes], "low3"), op("Unsqueeze", [high, axes], "high3")],
                      "pairs", axis=2)
            codes = pair
        blocks = padded // q.block
        shape3 = const("shape3", np.array([rows, blocks, q.block], np.int64))
        shape_s = const("shape_s", np.array([rows, blocks, 1], np.int64))
        grid = op("Reshape", [codes, shape3], "grid")
        scales = op("Reshape", [op("Cast", [pieces[1]], "scales_f", to=TensorProto.FLOAT), shape_s], "scales3")
        out = op("Mul", [grid, scales], "scaled")
        if q.storage == "int4":
            mins = op("Reshape", [op("Cast", [pieces[2]], "mins_f", to=TensorProto.FLOAT), shape_s], "mins3")
            out = op("Add", [out, mins], "offset")
        stored = op("Reshape", [out, const("shape2", np.array([rows, padded], np.int64))], "widened")
    if padded != cols:
        stored = op("Slice", [stored, const("start", np.array([0], np.int64)), const("end", np.array([cols], np.int64)),
                              const("axes", np.array([1], np.int64))], "cut")
    return inits, nodes, stored


HEAD_ROWS = 4096  # rows of a tied table widened at a time for its LM head (SmolLM2's: 9.4 MB a block)


def read_by_rows(graph, weights: Mapping[str, QuantizedTensor], head_rows: int = HEAD_ROWS,
                 branches: Mapping[str, tuple] | None = None) -> dict[str, list]:
    """Rewrite the ONNX `graph` (a GraphProto without `weights` among its initializers) so that no node
    reads one of `weights` ([rows, width], blocked along a row's width) widened whole and transposed, as
    `widen_parts` and the exporter's Transpose would have it: each Gather of it widens only the rows it
    looks up, and each Transpose of it that only MatMuls read as their weight (x @ W^T: a projection, a
    tied LM head) runs as a Gemm (transB) over `head_rows` rows of it widened at a time, the blocks'
    products concatenated. The numbers are those of the widened weight (the same widening ops, row by
    row, and a product over the same float32 values). Returns, for each weight it rewrote, the storage
    arrays to write as initializers, [(name, array)]; a weight some other node reads is left alone.
    `branches`: weight name -> (A [in, r], B [r, out]) float32, a LoRA adapter (its scale in B) whose
    product x @ A @ B is added to x @ W^T (Gemm's C), its base kept stored (written as `NAME.lora_A`,
    `NAME.lora_B` beside the storage arrays): a trained model without its merged weights in float32.
    A plain float32 array of `weights` (a float32 base) is read as it is stored: its lookups are left as
    they are, each of its products a Gemm (transB) over it whole, no transposed copy (returned as its own
    name and array). Why: ONNX Runtime widened SmolLM2's int8 table to float32 for the lookup and again for the head's
    Transpose at every run, ~230 MiB of an int4 run's evaluation (MEMORY_NOTES, helpers h78, h84). The
    graph's nodes are rebuilt once: protobuf keeps every message it copied until the whole model goes."""
    every = list(graph.node)  # these objects throughout: `made` is keyed by their ids
    readers: dict[str, list] = {}
    for n in every:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    made: dict[int, list] = {}  # id of a replaced node -> the nodes in its place
    inits: list = []
    done = {}
    for name, q in weights.items():
        uses = readers.get(name, [])
        plain = isinstance(q, np.ndarray)
        if plain:  # a float32 weight: its lookups read it as it is, its products by rows
            uses = [n for n in uses if n.op_type != "Gather" or not _by_rows(n, name, readers, outputs)]
        if (plain and (q.ndim != 2 or q.dtype != np.float32)) or (not plain and (q.axis != 1 or q.storage == "bfloat16")) \
                or not uses or not all(_by_rows(n, name, readers, outputs) for n in uses):
            continue
        lora = (branches or {}).get(name)
        _rewrite_by_rows(name, q, uses, readers, made, inits, head_rows, lora)
        done[name] = [(name, q)] if plain else [(k, v) for k, v in storage_tensors(name, q).items() if v.size]
        if lora is not None:
            done[name] += [(f"{name}.lora_A", lora[0]), (f"{name}.lora_B", lora[1])]
    if done:
        rewritten = []
        for n in every:
            rewritten += made.get(id(n), [n])
        del graph.node[:]
        graph.node.extend(rewritten)
        graph.initializer.extend(inits)
    return done


def last_position_only(graph, output: str = "logits") -> bool:
    """Rewrite the ONNX `graph` of a causal LM so that its `output` ([batch, seq, vocab], a MatMul's) holds
    the last position only ([batch, 1, vocab]): the hidden states sliced before the head. What
    generation reads (`tasks.causal_lm.generate`: each step's last logits); a prompt's other positions'
    logits were [seq, vocab] floats made and dropped (SmolLM2: 49152 a position). False, `graph`
    untouched, when no MatMul makes `output`."""
    from onnx import helper, numpy_helper

    head = next((n for n in graph.node if output in n.output), None)
    if head is None or head.op_type != "MatMul":
        return False
    p = f"{output}.last_"
    bounds = [(p + "start", -1), (p + "end", 2 ** 62), (p + "axis", 1)]
    graph.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), k) for k, v in bounds)
    graph.node.append(helper.make_node("Slice", [head.input[0], *(k for k, _ in bounds)], [p + "hidden"],
                                       name=p + "hidden"))  # ONNX Runtime orders the nodes itself
    head.input[0] = p + "hidden"
    for o in graph.output:
        if o.name == output and len(o.type.tensor_type.shape.dim) == 3:
            o.type.tensor_type.shape.dim[1].Clear()
            o.type.tensor_type.shape.dim[1].dim_value = 1
    return True


def _by_rows(n, name: str, readers, outputs) -> bool:
    """Whether node `n`, a reader of `name`, is one `read_by_rows` rewrites."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type == "Gather":
        return list(n.input).count(name) == 1 and n.input[0] == name and attrs.get("axis", 0) == 0
    return (n.op_type == "Transpose" and list(attrs.get("perm", [1, 0])) == [1, 0] and n.output[0] not in outputs
            and bool(readers.get(n.output[0]))
            and all(m.op_type == "MatMul" and m.input[1] == n.output[0] and m.input[0] != n.output[0]
                    for m in readers[n.output[0]]))


def _rewrite_by_rows(name: str, q: QuantizedTensor, uses, readers, made, inits, head_rows: int,
                     lora: tuple | None) -> None:
    """`read_by_rows` of one weight: the nodes in place of each of its `uses` into `made`."""
    from onnx import helper, numpy_helper

    plain = isinstance(q, np.ndarray)  # float32 as it is stored: no widening, one product over it whole
    pieces = [name] if plain else [k for k, v in storage_tensors(name, q).items() if v.size]
    rows, width = int(q.shape[0]), int(q.shape[1]) if plain else q.cols
    if plain:
        head_rows = rows

    def const(key: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), key))
        return key

    for k, n in enumerate(uses):
        p = f"{name}.q_use{k}_"
        nodes = made.setdefault(id(n), [])
        if n.op_type == "Gather":
            ids = n.input[1]
            flat = p + "ids"
            nodes.append(helper.make_node("Reshape", [ids, const(p + "flat", np.array([-1], np.int64))], [flat], name=flat))
            looked = []
            for piece in pieces:
                looked.append(f"{p}{piece.rsplit('.q_', 1)[1]}_rows")
                nodes.append(helper.make_node("Gather", [piece, flat], [looked[-1]], name=looked[-1], axis=0))
            more, ops, wide = _widen_ops(p, looked + [None] * (3 - len(looked)), q, -1)
            inits += more
            nodes += ops
            nodes.append(helper.make_node("Shape", [ids], [p + "ids_shape"], name=p + "ids_shape"))
            nodes.append(helper.make_node("Concat", [p + "ids_shape", const(p + "width", np.array([width], np.int64))],
                                          [p + "out_shape"], name=p + "out_shape", axis=0))
            nodes.append(helper.make_node("Reshape", [wide, p + "out_shape"], [n.output[0]], name=p + "out"))
            continue
        for m_index, m in enumerate(readers[n.output[0]]):
            p = f"{name}.q_use{k}_{m_index}_"
            x, y = m.input[0], m.output[0]
            heads = made.setdefault(id(m), [])
            flat = p + "x2"
            heads.append(helper.make_node("Reshape", [x, const(p + "shape_x2", np.array([-1, width], np.int64))],
                                          [flat], name=flat))
            branch = None
            if lora is not None:  # x @ A @ B beside the base's product (A [in, r], B [r, out], scaled)
                heads.append(helper.make_node("MatMul", [flat, f"{name}.lora_A"], [p + "xa"], name=p + "xa"))
                branch = p + "xab"
                heads.append(helper.make_node("MatMul", [p + "xa", f"{name}.lora_B"], [branch], name=branch))
            parts = []
            blocks = list(range(0, rows, head_rows))
            for b, lo in enumerate(blocks):
                hi = min(rows, lo + head_rows)
                pb = f"{p}b{b}_"
                bounds = [] if hi - lo == rows else [
                    const(pb + "lo", np.array([lo], np.int64)), const(pb + "hi", np.array([hi], np.int64)),
                    const(pb + "axis", np.array([0], np.int64))]
                cut = []
                for piece in pieces:
                    if hi - lo == rows:  # one block: the stored arrays as they are
                        cut.append(piece)
                        continue
                    cut.append(f"{pb}{piece.rsplit('.q_', 1)[1]}_block")
                    heads.append(helper.make_node("Slice", [piece, *bounds], [cut[-1]], name=cut[-1]))
                if plain:
                    wide = cut[0]
                else:
                    more, ops, wide = _widen_ops(pb, cut + [None] * (3 - len(cut)), q, hi - lo)
                    inits += more
                    heads += ops
                parts.append(pb + "product")
                added = [branch] if branch is not None and len(blocks) == 1 else []  # Gemm's C: + x A B
                heads.append(helper.make_node("Gemm", [flat, wide, *added], [parts[-1]], name=parts[-1], transB=1))
            whole = parts[0]
            if len(parts) > 1:
                whole = p + "logits2"
                heads.append(helper.make_node("Concat", parts, [whole], name=whole, axis=1))
                if branch is not None:
                    heads.append(helper.make_node("Add", [whole, branch], [p + "sum"], name=p + "sum"))
                    whole = p + "sum"
            heads.append(helper.make_node("Shape", [x], [p + "x_shape"], name=p + "x_shape"))
            heads.append(helper.make_node("Slice", [p + "x_shape", const(p + "lead0", np.array([0], np.int64)),
                                                    const(p + "lead1", np.array([-1], np.int64))],
                                          [p + "lead"], name=p + "lead"))
            heads.append(helper.make_node("Concat", [p + "lead", const(p + "rows", np.array([rows], np.int64))],
                                          [p + "out_shape"], name=p + "out_shape", axis=0))
            heads.append(helper.make_node("Reshape", [whole, p + "out_shape"], [y], name=p + "out"))
        made[id(n)] = []  # the Transpose goes


def quantized_weights(graph, storage: str, keep_float: set[str] = frozenset()) -> dict[str, QuantizedTensor]:
    """The lowered `graph`'s frozen-to-be weights held at `storage` (tables at int8 under int4, as
    `ir.precision.storage_for`), those in `keep_float` left out (a classifier's fresh head)."""
    from ir.precision import lookup_tables, quantizable, storage_for

    check_base_dtype(storage)
    if storage == "float32":
        return {}
    tables = lookup_tables(graph.nodes)
    return {name: quantize(np.asarray(graph.constants[name], np.float32), storage_for(storage, name in tables), axis)
            for name, axis in quantizable(graph.nodes, graph.constants, keep_float).items()}


def write_quantized(path: Path, weights: Mapping[str, QuantizedTensor], base_dtype: str) -> list[str]:
    """Rewrite the ONNX file `path` in place with each of `weights` (by initializer name, logical
    shape as in the file) stored quantized; the names replaced (a weight the file does not hold as
    an initializer of that shape is skipped)."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path))  # a file this process just exported (the lowering read it first)
    graph = model.graph
    by_name = {t.name: t for t in graph.initializer}
    done, inits, nodes = [], [], []
    for name, q in weights.items():
        old = by_name.get(name)
        if old is None or tuple(old.dims) != tuple(q.shape):
            continue
        graph.initializer.remove(old)
        more_inits, more_nodes = _widen_nodes(name, q)
        inits += more_inits
        nodes += more_nodes
        done.append(name)
    graph.initializer.extend(inits)
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)  # topological: the widened weights before any reader
    stored = {k: weights[k] for k in done}
    props = {p.key: p for p in model.metadata_props}
    for key, value in ((BASE_DTYPE_KEY, base_dtype),
                       (WEIGHTS_KEY, json.dumps({k: [q.storage, q.axis, q.block, *q.shape]
                                                 for k, q in stored.items()}))):
        if key in props:
            props[key].value = value
        else:
            model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return done


def stored_piece_names(model) -> frozenset[str]:
    """The initializer names of the storage arrays (`ir.precision.storage_piece_names`) of every weight the
    file `model` (a ModelProto) records as stored quantized; empty for a file without the record."""
    from ir.precision import storage_piece_names

    record = {p.key: p.value for p in model.metadata_props}.get(WEIGHTS_KEY)
    if not record:
        return frozenset()
    return frozenset(n for name, (storage, *_) in json.loads(record).items()
                     for n in storage_piece_names(name, storage))


def widen_stored_weights(model, arrays: dict[str, np.ndarray]) -> None:
    """For the lowering: each weight the file stores quantized (its metadata says which) becomes a
    float32 initializer again (`dequantize` of its storage arrays: the values the widening ops give),
    its storage arrays and widening ops gone from `model` (a ModelProto whose initializers' data is
    in `arrays`, `planner.onnx_import.read_onnx_apart`, or in the message). A file without the
    record is left as it is."""
    from onnx import TensorProto, numpy_helper

    from ir.precision import from_storage_tensors

    record = {p.key: p.value for p in model.metadata_props}.get(WEIGHTS_KEY)
    if not record:
        return
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}

    def piece(key: str, dtype) -> np.ndarray:
        if key in arrays:
            value = arrays.pop(key)
        elif key in inits:
            value = numpy_helper.to_array(inits[key])
        else:
            raise ValueError(f"the file records {key.split('.q_')[0]!r} as stored quantized, but it has no {key!r}")
        if dtype == np.uint16 and value.dtype == np.float32:  # bfloat16 bits, widened by the reader
            return (np.ascontiguousarray(value).view(np.uint32) >> 16).astype(np.uint16)
        return value.astype(dtype, copy=False)

    for name, (storage, axis, block, *shape) in json.loads(record).items():
        dtypes = {"q_codes": {"bfloat16": np.uint16, "int8": np.int8, "int4": np.uint8}[storage],
                  "q_scales": np.float16, "q_mins": np.float16}
        tensors = {f"{name}.{k}": piece(f"{name}.{k}", d) for k, d in dtypes.items()
                   if (k != "q_mins" or storage == "int4") and (k != "q_scales" or storage != "bfloat16")}
        if storage == "bfloat16":
            tensors[f"{name}.q_scales"] = np.zeros((shape[1 - axis], 0), np.float16)
        # held as stored: a QuantizedTensor over the file's own arrays (no float32 copy); it reads as the
        # float32 weight it stands for wherever a consumer widens it (np.asarray), and a quantized base
        # of its precision takes it as it is (ir.precision.quantize_frozen)
        arrays[name] = from_storage_tensors(name, tensors, storage, axis, block, shape)
        prefix = f"{name}.q_"
        for t in [t for t in graph.initializer if t.name.startswith(prefix)]:
            graph.initializer.remove(t)
            arrays.pop(t.name, None)
        for n in [n for n in graph.node if n.name.startswith(prefix)]:
            graph.node.remove(n)
        stub = TensorProto(name=name, data_type=TensorProto.FLOAT)  # its data: arrays[name]
        stub.dims.extend(int(d) for d in shape)
        graph.initializer.append(stub)


def with_float_weights(path: Path, weights: Mapping[str, np.ndarray]) -> bytes:
    """The ONNX file `path` as bytes with each of `weights` that it stores quantized a plain float32
    initializer of the given value instead (its stored arrays and widening ops gone, the record
    updated): what ONNX Runtime runs with trained weights in their place, since a weight computed by
    ops cannot be replaced as an initializer can."""
    import onnx

    model = onnx.load(str(path))
    as_plain_initializers(model, weights)
    return model.SerializeToString()


def as_plain_initializers(model, weights: Mapping[str, np.ndarray]) -> None:
    """`with_float_weights` on a loaded ModelProto, in place (`planner.onnx_import.write_weights`
    writes a trained model out of a stored-quantized export with it)."""
    from onnx import numpy_helper

    props = {p.key: p for p in model.metadata_props}
    record = json.loads(props[WEIGHTS_KEY].value) if WEIGHTS_KEY in props else {}
    graph = model.graph
    for name in [k for k in weights if k in record]:
        prefix = f"{name}.q_"
        for t in [t for t in graph.initializer if t.name.startswith(prefix)]:
            graph.initializer.remove(t)
        for n in [n for n in graph.node if n.name.startswith(prefix)]:
            graph.node.remove(n)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weights[name], np.float32), name))
        del record[name]
    if WEIGHTS_KEY in props:
        props[WEIGHTS_KEY].value = json.dumps(record)


def recorded_base_dtype(path: Path) -> str:
    """The precision `confidant export --base-dtype` stored the file's frozen weights at (float32
    for a file it did not quantize, or one that is not ONNX at all: the lowering says why)."""
    import onnx

    from planner.onnx_weights import without_raw_data

    try:  # the message without its weights' bytes: a float model's 500 MB are never read for this
        model = onnx.ModelProto.FromString(without_raw_data(Path(path))[0])
    except Exception:  # noqa: BLE001 - not readable here: the lowering reports it properly
        return "float32"
    value = {p.key: p.value for p in model.metadata_props}.get(BASE_DTYPE_KEY, "float32")
    return value if value in ("float32", "bfloat16", "int8", "int4") else "float32"


# --- the lean export (`confidant export --task causal-lm`) ---------------------------------------------
# The lean ONNX export of a causal LM (issue 31): the graph traced without its weights, the weights
# written after it one tensor at a time (quantized one at a time for `--base-dtype`).
#
# Why: `torch.onnx.export` with its parameters builds the whole protobuf in memory (a copy of every
# weight), serializes it (another), and `--base-dtype` then read the file back, lowered it (float32
# weights again), quantized and rewrote it through `onnx.load` / `onnx.save` (two more copies): a
# Llama-3.2-1B-class model (4.7 GiB of float32 weights) needed ~20 GiB, a laptop's whole memory. Here:
#
# 1. the TorchScript exporter traces with `export_params=False`: the weights are graph inputs named
#    as in the state dict (the exporter's own names, one per shared tensor), the message is a few MB;
# 2. which weights are stored quantized is decided by lowering that graph with zero-stride stand-ins
#    (`np.broadcast_to`: the shape, no memory), by the same rule as before (`ir.precision.quantizable`;
#    `planner.onnx_import.stored_precisions`);
# 3. the file is written in protobuf's wire format: the message less its weights, then each weight
#    as an initializer whose bytes are copied from the model's own tensor (a view of the torch
#    parameter) or from its quantized storage arrays, quantized a chunk of rows at a time. A float
#    file over protobuf's 2 GiB limit keeps its weights in one external data file beside it
#    (`NAME.onnx.data`), which ONNX Runtime and the lowering read.
#
# So the export holds the loaded model, the quantized arrays (the file's size) and one tensor's work.
# The files are the ones the old path wrote: same nodes, same initializer names and values (the
# widening ops of `planner.onnx_quantize`), checked against it by tests/models/test_lean_export.py.

INLINE_LIMIT = 1_900_000_000  # bytes of weights kept inside the protobuf (its limit is 2 GiB)
_LENGTH = 2
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def take_weight_inputs(data: bytes, known: Mapping[str, object]) -> tuple[object, list[str]]:
    """The ONNX model in `data` with the graph inputs that are weights (names in `known`) taken out of
    its inputs, and those names in order."""
    import onnx

    model = onnx.load_from_string(data)
    inputs = list(model.graph.input)
    names = [i.name for i in inputs if i.name in known]
    del model.graph.input[:]
    model.graph.input.extend(i for i in inputs if i.name not in known)
    return model, names


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


class Unwritten:
    """A weight `write_with_weights` declares (shape, dtype) but leaves as zeros (a hole of a sparse
    external data file: no bytes written): one a session is given in place (ONNX Runtime's shared
    initializers), never read from the file."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize


def write_with_weights(model, weights: Mapping[str, object], path: Path, base_dtype: str = "float32") -> list[str]:
    """Write `model` (weights taken out, `take_weight_inputs`) to `path` with `weights` (name -> float
    array, QuantizedTensor for a weight stored quantized, or `ir.safetensors.FileTensor`, read from its
    checkpoint as it is written) as its initializers, streamed; the names
    stored quantized. Float weights over `INLINE_LIMIT` go to `NAME.onnx.data` beside the file."""
    import json

    from onnx import ModelProto, TensorProto

    from ir.precision import QuantizedTensor
    from ir.safetensors import FileTensor

    path = Path(path)
    pieces: list[tuple[str, np.ndarray | FileTensor]] = []
    nodes, record = [], {}
    for name, value in weights.items():
        if isinstance(value, QuantizedTensor):
            arrays, consts, widen = widen_parts(name, value)
            pieces += arrays
            model.graph.initializer.extend(consts)
            nodes += widen
            record[name] = [value.storage, value.axis, value.block, *value.shape]
        elif isinstance(value, (FileTensor, Unwritten)):
            pieces.append((name, value))  # read when its bytes are written: one such tensor held at a time
        else:
            pieces.append((name, np.ascontiguousarray(value)))
    if nodes:  # topological: the widened weights before any reader
        rest = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes + rest)
    if record:
        for key, value in ((BASE_DTYPE_KEY, base_dtype), (WEIGHTS_KEY, json.dumps(record))):
            model.metadata_props.add(key=key, value=value)
    # a weight left unwritten is always external: a hole of the data file, never parsed with the message
    external = sum(a.nbytes for _, a in pieces) > INLINE_LIMIT or any(isinstance(a, Unwritten) for _, a in pieces)
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
                for chunk in _byte_chunks(array):
                    f.write(chunk)
    if external:
        with open(data_path, "wb") as f:
            for _, array in pieces:
                if isinstance(array, Unwritten):
                    f.seek(array.nbytes, 1)
                else:
                    for chunk in _byte_chunks(array):
                        f.write(chunk)
                f.write(b"\0" * (-array.nbytes % 4096))
            f.truncate(f.tell())  # a hole at the end too
    elif data_path.exists():
        data_path.unlink()  # a stale data file of an earlier, larger export
    return list(record)


def _byte_chunks(array):
    """The little-endian bytes of `array`, in order: an `ir.safetensors.FileTensor` read from its checkpoint
    and widened a few MiB of rows at a time (a 544 MB tied table is never held whole to be written)."""
    from ir.safetensors import FileTensor

    if isinstance(array, Unwritten):
        for lo in range(0, array.nbytes, 1 << 22):
            yield bytes(min(1 << 22, array.nbytes - lo))
    elif isinstance(array, FileTensor):
        for lo, hi in array.row_chunks():
            yield _bytes_of(array.read_rows(lo, hi))
    else:
        yield _bytes_of(array)


def _bytes_of(array: np.ndarray) -> memoryview:
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return memoryview(array.reshape(-1)).cast("B")


# a node of layer N as the exporters name it: torch's "/model/layers.3/mlp/..." and `read_by_rows`'s
# "model.layers.3.mlp.up_proj.weight.q_use0_0_x2"
_LAYER = re.compile(r"(?:^|[./])(?:layers|h|layer|blocks)[./](\d+)[./]")


def write_layer_ranges(path: Path, range_bytes: int | None = None, head_bytes: int | None = None) -> list[tuple] | None:
    """Write the ONNX causal LM at `path` (its weights external, as `write_with_weights` writes a copy
    that shares them) again as parts run one after another, each a model of its own beside it
    (`NAME.partK.onnx`, the same external data file): the nodes before the first layer (the
    embedding, the mask's and positions' arithmetic), consecutive layers whose weights come to at most
    `range_bytes` (one layer at least; None: the largest weight outside the layers, which its part reads
    whole anyway, a tied table, or `head_bytes` where that table is read by rows), and what follows the last
    layer (the final norm and the head). `head_bytes`: the head's product over a table of more bytes
    (x @ W^T, a Gemm over the weight as it is stored: `read_by_rows`' float32 head) is a part of its own
    whose table is an input (NAME.rows) run a range of at most so many bytes of its rows at a time (a row
    range of a row-major table is a contiguous range of its bytes, so a view of the caller's array is
    fed, no copy), the products' columns joined by the caller, what reads them a part after it; the
    entry of that part is (file, [the table], rows a run, the input's name). Why: the head's part read
    the tied table whole (SmolLM2 113 MB, a Qwen2.5-0.5B 545 MB) while training's fused head reads it by
    vocabulary chunk (helper h170).
    Each part takes the values it reads that an earlier part made (the hidden state, the mask, the
    rotary tables) or the graph's inputs, and gives those a later part reads or the graph gives: run in
    order over one dict of values they compute what the whole graph computes, node for node. Why:
    one run of a session reads every weight it holds, and a reader of a mapped float32 base can give a
    part's pages back only between runs (SmolLM2's generation held its 513 MB base; MEMORY_NOTES,
    helpers h159, h163). Returns each part's file name and the initializers it reads, in order, or None
    (nothing written) when the
    graph cannot be cut so (no layer names, a node with a subgraph, a layer reading a later part)."""
    import onnx
    from onnx import ModelProto, helper, shape_inference

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return None
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output if o}
    order = _topological(graph.node, producer)
    layer_of = {}
    for n in order:
        found = _LAYER.search(n.name)
        if found:
            layer_of[id(n)] = int(found.group(1))
    if not layer_of:
        return None
    weight = {}  # bytes of the weights each layer reads
    for n in order:
        if id(n) in layer_of:
            for i in n.input:
                if i in inits:
                    weight.setdefault(layer_of[id(n)], {})[i] = _tensor_bytes(inits[i])
    by_rows = {n.input[1] for n in order if id(n) not in layer_of and head_bytes and _rows_product(n, inits, head_bytes)}
    if range_bytes is None:  # what the part before or after the layers reads whole anyway (a tied table not cut)
        range_bytes = max([_tensor_bytes(inits[i]) for n in order if id(n) not in layer_of for i in n.input
                           if i in inits and i not in by_rows] + [head_bytes or 0])
    head_cut = None  # the head's product over a table, run a range of its rows at a time (its own part)
    part_of_layer, part, held = {}, 0, None
    for layer in range(max(layer_of.values()) + 1):
        size = sum(weight.get(layer, {}).values())
        if held is None or held + size > range_bytes:
            part, held = part + 1, 0
        part_of_layer[layer], held = part, held + size
    last, head = part, part + 1
    part_of: dict[int, int | None] = {}
    # a node outside the layers that reads only weights (a stored weight's widening, the head's table widened a
    # block of rows at a time) runs in the part of its first reader: placed with the embedding, its outputs were
    # carried through every part to the head (SmolLM2 int4: the tied table's 12 widened blocks, 113 MB, held
    # from the first part of each step to the last; helper h175)
    weights_only: set[int] = set()
    for n in order:
        made = [part_of[id(producer[i])] for i in n.input if i in producer]
        made = [p for p in made if p is not None]
        if id(n) in layer_of:
            p = part_of_layer[layer_of[id(n)]]
            if made and max(made) > p:
                return None
        elif not n.input:
            p = None  # a Constant: copied into each part that reads it
        elif all(i in inits or (i in producer and (id(producer[i]) in weights_only or not producer[i].input))
                 for i in n.input if i):
            weights_only.add(id(n))
            p = None  # placed below, once its readers are
        else:
            p = max(made, default=0)
            p = head if p == last else p
            if p == head and head_cut is None and head_bytes and _rows_product(n, inits, head_bytes):
                head_cut, p = n, head + 1
            elif p == head + 1:
                p = head + 2  # what reads the product: after its rows' runs
        part_of[id(n)] = p
    node_readers: dict[str, list] = {}
    for n in order:
        for i in n.input:
            node_readers.setdefault(i, []).append(n)
    for n in reversed(order):
        if id(n) in weights_only:
            parts_reading = [part_of[id(r)] for o in n.output for r in node_readers.get(o, ())
                             if part_of[id(r)] is not None]
            part_of[id(n)] = min(parts_reading, default=0)
    readers: dict[str, set[int]] = {}
    for n in order:
        if part_of[id(n)] is not None:
            for i in n.input:
                readers.setdefault(i, set()).add(part_of[id(n)])
    inferred = shape_inference.infer_shapes(model)
    types = {v.name: v.type for v in [*inferred.graph.value_info, *graph.input, *graph.output]}
    if head_cut is not None:  # what shape inference may leave untyped (a Reshape to [-1, width]): [n, width]
        table = inits[head_cut.input[1]]
        for value, width in ((head_cut.input[0], table.dims[1]), (head_cut.output[0], table.dims[0])):
            types.setdefault(value, helper.make_tensor_type_proto(table.data_type, [None, width]))
    given = {o.name for o in graph.output}
    names, parts = [], []
    for k in range(head + 3):
        nodes = [n for n in order if part_of[id(n)] == k]
        if not nodes:
            continue
        read = {i for n in nodes for i in n.input if i}
        nodes = [n for n in order if part_of[id(n)] is None and set(n.output) & read] + nodes
        made = {o for n in nodes for o in n.output if o}
        ins = sorted(read - made - set(inits))
        outs = sorted(o for o in made if o in given or any(r > k for r in readers.get(o, ())))
        if any(v not in types for v in ins + outs):
            return None
        part = ModelProto()
        part.CopyFrom(model)
        del part.graph.node[:], part.graph.initializer[:], part.graph.input[:], part.graph.output[:]
        part.graph.ClearField("value_info")
        entry = (f"{path.stem}.part{len(names)}.onnx", sorted(read & set(inits)))
        if k == head + 1:  # the table an input of a range of its rows, the product's columns as many
            table = inits[nodes[-1].input[1]]
            rows = max(1, head_bytes // max(1, _tensor_bytes(table) // table.dims[0]))
            feed = nodes[-1].input[1] + ROWS_SUFFIX
            nodes[-1].input[1] = feed
            part.graph.input.append(helper.make_tensor_value_info(feed, table.data_type, ["rows", table.dims[1]]))
            out = helper.make_value_info(nodes[-1].output[0], types[nodes[-1].output[0]])
            product = out.type.tensor_type.shape.dim
            product[len(product) - 1].Clear()
            product[len(product) - 1].dim_param = "rows"
            part.graph.output.append(out)
            outs = []
            entry = (*entry, rows, feed)
        else:
            part.graph.initializer.extend(inits[i] for i in entry[1])
        part.graph.node.extend(nodes)
        part.graph.input.extend(helper.make_value_info(v, types[v]) for v in ins)
        part.graph.output.extend(helper.make_value_info(v, types[v]) for v in outs)
        names.append(entry)
        parts.append(part)
    for (name, *_), part in zip(names, parts):
        (path.parent / name).write_bytes(part.SerializeToString())
    return names


# the name a part run by rows (`write_layer_ranges`) gives the input that takes a range of its table's rows
ROWS_SUFFIX = ".rows"


def _rows_product(n, inits, range_bytes: int) -> bool:
    """Whether node `n` is a product x @ W^T (Gemm, transB, no C, alpha 1) over a 2-D initializer W of more
    than `range_bytes`: a row range of W (contiguous in a row-major array) gives a column range of it."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return (n.op_type == "Gemm" and len(n.input) == 2 and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
            and attrs.get("transB", 0) == 1 and attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0
            and n.input[0] not in inits and _tensor_bytes(inits[n.input[1]]) > range_bytes)


def _topological(nodes, producer) -> list:
    """`nodes` in an order where each comes after the producers of its inputs (`last_position_only`
    appends its Slice at the end: ONNX Runtime orders a graph's nodes itself)."""
    done, order = set(), []
    for start in nodes:
        stack = [(start, False)]
        while stack:
            n, ready = stack.pop()
            if id(n) in done:
                continue
            if ready:
                done.add(id(n))
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((producer[i], False) for i in n.input if i in producer and id(producer[i]) not in done)
    return order


def _tensor_bytes(t) -> int:
    """A TensorProto's bytes, its data external or not."""
    from onnx import helper

    count = int(np.prod(t.dims)) if len(t.dims) else 1
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


__all__ = ["BASE_DTYPE_KEY", "BLOCK", "HEAD_ROWS", "stored_piece_names", "Unwritten", "last_position_only", "read_by_rows", "WEIGHTS_KEY", "as_plain_initializers", "quantized_weights",
           "recorded_base_dtype", "INLINE_LIMIT", "take_weight_inputs",
           "widen_parts", "widen_stored_weights", "with_float_weights", "write_layer_ranges", "write_quantized",
           "write_with_weights"]
