"""Lower an ONNX transformer into Confidant's graph IR (the only module that imports onnx).

Lowering binds batch and sequence length, so every shape becomes static; folds everything that
then becomes constant (the exporters' Shape/Gather/Concat arithmetic) with the same numpy host
evaluator the runtime uses; classifies the remaining nodes into the compute tier (float, trainable
path) and the host tier (mask bookkeeping); maps ONNX compute ops onto the closed op set of
``ir.ops``; appends the loss; then runs the graph passes (fusions, blocks) and verifies the result.

What the exporters write, as users export (TorchScript and dynamo, constant folding on or off,
dynamo's optimizer on or off, eager or SDPA attention), lowers to the same kind of IR:

* ``CastLike`` is a ``Cast`` to the other input's type; float-to-float casts on the compute path
  are dropped.
* SDPA attention guards its softmax as ``Where(IsNaN(p), 0, p)``: a row whose every key is masked
  (a padding row of a batch) is NaN after a softmax over ``-inf`` and the guard zeroes it. The
  guard is lowered away and the mask is clamped to float32's lowest finite value instead (a host
  ``Max`` node), which is what eager attention adds. Every row with at least one attended token is
  unchanged (exp(lowest - max) is 0.0 in float32); rows with none (padding, which no loss, metric
  or prediction reads) get eager attention's uniform weights instead of zeros.
* ``Where(c, x, y)`` on the compute path with a host condition (``masked_fill``) becomes
  ``x * c + where(c, 0, y)``: exact, and differentiable in x.
* ``Gather`` with constant indices along a non-leading axis of an activation (the classifier's
  ``hidden[:, 0]``) becomes a product with a constant one-hot matrix (exact, with the gradient
  scattered back); a ``Slice`` of an activation (step 1) is the IR's ``Slice`` (one per axis), and a
  ``Split`` with several outputs (GPT-2's fused QKV) one ``Slice`` per output.

Decoder LLMs (`confidant export --task causal-lm`: Llama/SmolLM2 and GPT-2): the rotary cos/sin
tables are computed from the positions, which are constants once the sequence length is bound, so
they fold (a float initializer that only feeds Cos/Sin, the dynamo exporter's ``inv_freq``, is a
buffer, not a weight); ``Expand`` of an activation (grouped-query attention repeating key/value
heads) is the IR's ``Expand``; ``Concat``, ``Sigmoid`` and ``Reciprocal`` of activations lower to
``Concat``, ``Sigmoid`` and a ``Div``. A model whose logits are vocabulary-sized (their last axis
has the rows of the table `input_ids` is looked up in) gets the causal-LM loss
``TokenCrossEntropy`` over the inputs ``target_ids`` and ``target_weights`` (tasks/causal_lm/data.py);
any other model the classifier's ``SoftmaxCrossEntropy`` over ``targets``.

Every failure names the file and the node and says what to do (``ImportError_``, an
``ir.errors.InputFileError``): damaged files, unknown ops, dangling value names, missing inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ir.errors import InputFileError
from ir.graph import Graph, Node, Value, topological_order
from ir.host_eval import HOST_IMPLS, ONNX_DTYPES, eval_host_op
from ir.ops import compute_output_shape
from ir.verify import GraphError, verify_graph

SUPPORTED_OPSETS = range(14, 23)  # 21-22 add types (int4, bfloat16), no semantics the lowering reads
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# A graph input of this name (optimum's exports, a plain export given positions) is bound to 0..S-1 on
# every row: what transformers computes when it is not given, for right-padded rows as trained here.
POSITION_IDS_INPUT = "position_ids"
TARGETS_INPUT = "targets"
TARGET_IDS_INPUT = "target_ids"
TARGET_WEIGHTS_INPUT = "target_weights"
LOSS_OUTPUT = "loss"
LOSS_KINDS = ("auto", "classes", "causal-lm")

_ONNX_DTYPE_NAMES = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 11: "float64", 10: "float16"}
_ONNX_CODE = {np.dtype(v): k for k, v in ONNX_DTYPES.items()}
_FOLDABLE_FLOAT = {
    "Sqrt": np.sqrt, "Neg": np.negative, "Reciprocal": np.reciprocal, "Tanh": np.tanh,
    "IsNaN": np.isnan, "IsInf": np.isinf, "Cos": np.cos, "Sin": np.sin, "Exp": np.exp, "Log": np.log,
    "Sigmoid": lambda x: (1.0 / (1.0 + np.exp(-x))).astype(x.dtype),
}
_ALIAS_OPS = {"Identity", "Dropout"}
_RESHAPING_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten"}
_LOWEST = np.finfo(np.float32).min
_HINT = ("re-export the model with `confidant export` (opset 14-20, eval mode), or add the op to "
         "ir/ops.py with its MNN and PyTorch lowering")
_DAMAGED = "the file is damaged (truncated, or edited by hand) or not an ONNX export: re-export it"


class ImportError_(InputFileError):
    """A model that cannot be lowered; the message names the file, node and op, and what to do."""


@dataclass(frozen=True)
class ImportOptions:
    batch: int = 8
    seq: int = 128
    with_loss: bool = True
    # which loss to append: "auto" (causal-LM for vocabulary-sized logits, else the classifier's),
    # "classes" (SoftmaxCrossEntropy over targets) or "causal-lm" (TokenCrossEntropy)
    loss: str = "auto"


def load_model(path: str | Path, batch: int = 8, seq: int = 128, with_loss: bool = True, loss: str = "auto",
               mapped: bool = False) -> Graph:
    """Read an ONNX file and lower it (see module docstring); errors name the file and node.
    `mapped`: the weights stored as they are used are read-only views onto a mapping of the file
    (planner.onnx_weights.map_raw), resident only while read: for a process that ships them
    (a pipeline's coordinator emits its plans from the graph), not for one that trains them in
    place (an engine given them with `take_weights` would copy each)."""
    from ir.precision import stored_arrays
    from planner.onnx_quantize import widen_stored_weights
    from planner.onnx_weights import drop_mapped_pages

    path = Path(path)
    model, arrays = read_onnx_apart(path, mapped)
    try:  # weights `confidant export --base-dtype` stored quantized: float32 initializers again
        widen_stored_weights(model, arrays)
    except ValueError as exc:
        raise ImportError_(f"{path}: {exc}; {_DAMAGED}") from None
    graph = lower_model(model, ImportOptions(batch, seq, with_loss, loss), source=str(path), arrays=arrays)
    if mapped:  # what lowering read of the mapped weights (tied ones compared; a stored quantized one's pieces)
        drop_mapped_pages(a for v in graph.constants.values() for a in stored_arrays(v))
    return graph


def stored_precisions(model, shapes: Mapping[str, tuple[int, ...]], base_dtype: str) -> dict[str, tuple[str, int]]:
    """weight name -> (storage, blocked axis) for the weights `base_dtype` stores quantized in `model`
    (a graph whose weights `planner.onnx_quantize.take_weight_inputs` took), decided on the lowered graph as the lowering
    of the written file will see it, with zero-stride stand-ins for the weights."""
    from onnx import ModelProto, TensorProto

    from ir.precision import check_base_dtype, lookup_tables, quantizable, storage_for

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


def _checked_size(path: Path) -> int:
    """The size of the ONNX file `path`, or an error saying why it is not one."""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.onnx"))[:3]
        fix = f"give one of its ONNX files, e.g. {path / inside[0]}" if inside else "give the .onnx file itself"
        raise ImportError_(f"{path}: is a directory, not an ONNX file; {fix}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ONNX file")
    size = path.stat().st_size
    if size == 0:
        raise ImportError_(f"{path}: the file is empty (0 bytes), not an ONNX model; re-export it "
                           "(`confidant export -o FILE`)")
    return size


def read_onnx(path: Path, external_data: bool = True):
    """The ONNX ModelProto in `path`, or an error saying why the file is not a usable ONNX model
    (`external_data` False: weights stored beside the file are not read)."""
    import onnx

    size = _checked_size(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types for a damaged file
        raise ImportError_(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc}); "
                           f"{_DAMAGED}") from None
    _check_model(model, path, size)
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external and external_data:
        try:
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(path.parent))
        except Exception as exc:
            raise _external_error(path, external[0], exc) from None
    return model


def _external_error(path: Path, name: str, exc: Exception) -> ImportError_:
    return ImportError_(f"{path}: the weights stored next to it (external data, e.g. {name!r}) "
                        f"cannot be read ({type(exc).__name__}: {exc}); keep the .onnx file and its "
                        "data file(s) together in one folder")


def read_onnx_apart(path: Path, mapped: bool = False) -> tuple[object, dict[str, np.ndarray]]:
    """`read_onnx(path)` with its initializers' data out of the message: (the ModelProto without
    them, initializer name -> array read straight from the file or its external data files, half
    precision widened to float32 and typed so in the message). Each weight is held once: the file's
    bytes and a parsed copy of every weight are never in memory beside the arrays
    (planner/onnx_weights.py). A file the wire-format walk cannot read goes through `read_onnx`,
    whose errors name what is wrong. `mapped`: where a weight is stored as it is used, its array is
    a read-only view onto a mapping of the file instead (`load_model`'s)."""
    import onnx

    from planner.onnx_quantize import stored_piece_names
    from planner.onnx_weights import RAW_DTYPES, WireError, map_file, map_raw, read_raw, without_raw_data

    size = _checked_size(path)
    try:
        stripped, spans = without_raw_data(path)
        model = onnx.ModelProto.FromString(stripped)
        del stripped
        inits = model.graph.initializer
        if any(s.index >= len(inits) for s in spans):
            raise WireError("the walk and the parse disagree on the initializers")
    except Exception:  # onnx's own reading says what is wrong (or reads what the walk does not)
        model = read_onnx(path)
        return model, {}
    _check_model(model, path, size)
    arrays: dict[str, np.ndarray] = {}
    # weights stored as they are used are views onto a mapping of the file: file-backed pages that
    # a coordinator gives back once it has shipped them (planner.onnx_weights.drop_mapped_pages)
    view = map_file(path) if spans and mapped else None
    # the pieces of the weights `export --base-dtype` stored quantized: mapped whatever their size, float16 kept
    pieces = stored_piece_names(model) if view is not None else frozenset()
    with open(path, "rb") as f:
        for span in spans:
            t = inits[span.index]
            if t.data_type not in RAW_DTYPES:  # packed 4-bit, float8: onnx reads it from the message
                f.seek(span.offset)
                t.raw_data = f.read(span.nbytes)
                continue
            try:
                on_file = None if view is None else map_raw(view, span.offset, span.nbytes, t.data_type, tuple(t.dims),
                                                            stored_piece=t.name in pieces)
                arrays[t.name] = on_file if on_file is not None else \
                    read_raw(f, span.offset, span.nbytes, t.data_type, tuple(t.dims))
            except (WireError, ValueError) as exc:
                raise ImportError_(f"{path}: initializer {t.name!r} cannot be read ({exc}); {_DAMAGED}") from None
            if t.data_type in _HALF_TYPES and arrays[t.name].dtype == np.float32:
                t.data_type = onnx.TensorProto.FLOAT
    # an external data file is mapped as the model file is (one mapping a file): a model past protobuf's
    # 2 GiB keeps its weights there (the Qwen2.5-0.5B-class export: 1884 MiB), and read into memory they
    # were the whole base in anonymous memory, whatever the run then gave back (helper h165)
    external_views: dict[Path, object] | None = {} if mapped else None
    for t in inits:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            try:
                _read_external(t, path.parent, arrays, onnx, external_views)
            except Exception as exc:
                raise _external_error(path, t.name, exc) from None
    return model, arrays


def _read_external(tensor, folder: Path, arrays: dict[str, np.ndarray], onnx, views: dict | None = None) -> None:
    """The external data of `tensor` (a file in `folder`, at an offset) into `arrays`, or (a type
    read only by onnx) into the message. `views` (file -> its mapping, filled here): read mapped, the
    array a read-only view onto the file's mapping where `map_raw` can view it (as `read_onnx_apart`'s
    own weights)."""
    from planner.onnx_weights import RAW_DTYPES, map_file, map_raw, read_raw

    info = {e.key: e.value for e in tensor.external_data}
    location = Path(info.get("location", ""))
    base = folder.resolve()
    file = (base / location).resolve()
    if not info.get("location") or location.is_absolute() or base not in file.parents:
        raise ValueError(f"location {str(location)!r} is not a file inside {folder}")
    if tensor.data_type not in RAW_DTYPES:
        from onnx.external_data_helper import load_external_data_for_tensor

        load_external_data_for_tensor(tensor, str(folder))
        tensor.data_location = onnx.TensorProto.DEFAULT
        return
    dims = tuple(tensor.dims)
    nbytes = int(info["length"]) if "length" in info else \
        int(np.prod(dims, dtype=np.int64)) * np.dtype(RAW_DTYPES[tensor.data_type]).itemsize
    offset = int(info.get("offset", 0))
    on_file = None
    if views is not None:
        if file not in views:
            views[file] = map_file(file)
        on_file = map_raw(views[file], offset, nbytes, tensor.data_type, dims)
    if on_file is not None:
        arrays[tensor.name] = on_file
    else:
        with open(file, "rb") as f:
            arrays[tensor.name] = read_raw(f, offset, nbytes, tensor.data_type, dims)
    if tensor.data_type in _HALF_TYPES:
        tensor.data_type = onnx.TensorProto.FLOAT


def _check_model(model, path: Path, size: int) -> None:
    if not model.opset_import or not model.HasField("graph"):
        raise ImportError_(f"{path}: not an ONNX model ({size} bytes without an ONNX graph or opset); "
                           f"{_DAMAGED}")
    if not model.graph.node:
        raise ImportError_(f"{path}: the ONNX graph has no nodes; {_DAMAGED}")


def lower_model(model, options: ImportOptions, source: str = "<model>",
                arrays: Mapping[str, np.ndarray] | None = None) -> Graph:
    """`model` lowered; `arrays` (initializer name -> array) are the initializers whose data the
    message does not hold (`read_onnx_apart`)."""
    from planner.passes import run_passes

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset not in SUPPORTED_OPSETS:
        raise ImportError_(
            f"{source}: ONNX opset {opset} is not supported (supported: {SUPPORTED_OPSETS.start}-"
            f"{SUPPORTED_OPSETS.stop - 1}); re-export with `confidant export --opset 17`"
        )
    if options.batch < 1 or options.seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={options.batch} seq={options.seq}")
    model = _as_float32(model)
    lowering = _Lowering(model.graph, options, source, opset, arrays or {})
    del model, arrays
    graph = lowering.run()
    try:
        graph = run_passes(graph)
        verify_graph(graph)
    except (GraphError, ValueError, KeyError, IndexError) as exc:
        why = exc if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise ImportError_(f"{source}: lowered, but {why}; Confidant cuts encoder models (embeddings, layers of "
                           "attention + feed-forward, a task head) exported with `confidant export`, and decoder "
                           "LLMs (embeddings, pre-norm decoder layers, final norm + LM head) exported with "
                           "`confidant export --task causal-lm`") from None
    return graph


_HALF_TYPES = (10, 16)  # TensorProto.FLOAT16, BFLOAT16


def _as_float32(model):
    """`model`, or a copy of it with every float16 and bfloat16 tensor as float32: initializers,
    Constant and ConstantOfShape values, Cast targets, graph inputs, outputs and value types. A file
    saved in half precision (`model.half()` before export) trains in float32 as any other; the
    trained weights go back into it in its own precision (`write_weights`). Its numbers are the
    half-precision values widened, so they match ONNX Runtime on the file to half precision only."""
    from onnx import numpy_helper

    def half(t) -> bool:
        return t.data_type in _HALF_TYPES

    graph = model.graph
    values = list(graph.input) + list(graph.output) + list(graph.value_info)
    tensors = [a.t for n in graph.node for a in n.attribute if a.HasField("t")]
    if not (any(half(t) for t in graph.initializer) or any(half(t) for t in tensors)
            or any(v.type.tensor_type.elem_type in _HALF_TYPES for v in values)
            or any(a.name == "to" and a.i in _HALF_TYPES for n in graph.node if n.op_type == "Cast"
                   for a in n.attribute)):
        return model
    widened = type(model)()
    widened.CopyFrom(model)
    graph = widened.graph

    def widen(t) -> None:
        if half(t):
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    for t in graph.initializer:
        widen(t)
    for n in graph.node:
        for a in n.attribute:
            if a.HasField("t"):
                widen(a.t)
            if n.op_type == "Cast" and a.name == "to" and a.i in _HALF_TYPES:
                a.i = 1
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        if v.type.tensor_type.elem_type in _HALF_TYPES:
            v.type.tensor_type.elem_type = 1
    return widened


class _Lowering:
    def __init__(self, onnx_graph, options: ImportOptions, source: str, opset: int = 17,
                 arrays: Mapping[str, np.ndarray] = {}):
        from onnx import numpy_helper

        self.g = onnx_graph
        self.opt = options
        self.source = source
        self.const: dict[str, np.ndarray] = {}
        for init in onnx_graph.initializer:
            if init.name in arrays:
                self.const[init.name] = arrays[init.name]
                continue
            try:
                self.const[init.name] = numpy_helper.to_array(init)
            except Exception as exc:
                raise ImportError_(f"{source}: initializer {init.name!r} cannot be read ({type(exc).__name__}: "
                                   f"{exc}); {_DAMAGED}") from None
        self.shape: dict[str, tuple[int, ...]] = {k: v.shape for k, v in self.const.items()}
        # The model's weights: float initializers of 2+ elements. Nothing derived from one is ever
        # folded into a new constant (a transposed copy per use would untie a weight shared by
        # several layers, as ALBERT's, and hide the initializer a trained model is written back to):
        # the IR's parameters are exactly these initializers.
        self.weights: set[str] = {k for k, v in self.const.items() if v.dtype.kind == "f" and v.size >= 2}
        self.weights -= _position_buffers(onnx_graph, self.weights, {POSITION_IDS_INPUT})
        self.token_table_rows: int | None = None  # rows of the table input_ids is looked up in
        self.transposed: dict[str, str] = {}  # Transpose(W) output -> W, used as MatMul(x, W, trans_b)
        self.dtype: dict[str, str] = {}
        self.tier: dict[str, str] = {}  # value -> "host" | "compute" (constants are absent)
        self.alias: dict[str, str] = {}
        self.nodes: list[Node] = []
        self.node_at: dict[str, int] = {}  # IR node name -> index in self.nodes
        self.producer: dict[str, str] = {}  # IR value -> IR node name
        self.inputs: list[Value] = []
        self.nan_test: dict[str, str] = {}  # IsNaN output -> the value it tests (resolved by a Where)
        self.clamped: dict[str, str] = {}  # mask value -> its clamped copy
        # activations sliced to nothing (Phi-3's rotary "pass-through" part when the rotary covers the
        # whole head) -> the node that made them: only a Concat may read one, which then drops it
        self.empty: dict[str, str] = {}
        self._names: set[str] = set()
        self._schemas: dict[tuple[str, str], object] = {}
        self.opset = opset
        # a weight's transpose folded by the exporter into an initializer of its own is that weight
        for copy, weight in folded_transposes(onnx_graph, self.const, self.weights).items():
            del self.const[copy]
            self.weights.discard(copy)
            self.transposed[copy] = weight
            self.shape[copy] = self.shape[weight][::-1]
            self.dtype[copy], self.tier[copy] = "float32", "compute"

    # --- helpers -------------------------------------------------------------------------
    def _where(self, node) -> str:
        return f"{self.source}: node {node.name or (node.output[0] if node.output else '?')!r} (op {node.op_type})"

    def _fail(self, node, why: str) -> ImportError_:
        return ImportError_(f"{self._where(node)}: {why}")

    def _r(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self._names or name in self.const or name in self.shape:
            name, k = f"{base}.{k}", k + 1
        self._names.add(name)
        return name

    def _attrs(self, node) -> dict:
        from onnx import helper, numpy_helper

        out = {}
        for a in node.attribute:
            v = helper.get_attribute_value(a)
            if hasattr(v, "dims") and hasattr(v, "data_type"):
                v = numpy_helper.to_array(v)
            elif isinstance(v, bytes):
                v = v.decode()
            elif isinstance(v, list):
                v = [x.decode() if isinstance(x, bytes) else x for x in v]
            out[a.name] = v
        return out

    def _bind_inputs(self) -> None:
        init = set(self.const)
        for vi in self.g.input:
            if vi.name in init:
                continue
            t = vi.type.tensor_type
            dims = []
            for i, d in enumerate(t.shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(int(d.dim_value))
                else:
                    dims.append(self.opt.batch if i == 0 else self.opt.seq)
            wanted = (self.opt.batch, self.opt.seq)[:len(dims)]
            if vi.name in TOKEN_INPUTS and tuple(dims[:2]) != wanted:
                raise ImportError_(
                    f"{self.source}: input {vi.name!r} has the fixed shape {tuple(dims)} (exported without dynamic "
                    f"axes), not batch {self.opt.batch} x sequence {self.opt.seq}; use --batch {dims[0]}"
                    f"{f' --seq {dims[1]}' if len(dims) > 1 else ''}, or re-export with dynamic axes "
                    "(`confidant export` does)")
            dtype = _ONNX_DTYPE_NAMES.get(t.elem_type)
            if dtype is None:
                raise ImportError_(f"{self.source}: graph input {vi.name!r} has unsupported element type "
                                   f"{t.elem_type}; token inputs are int64 (or int32) tensors")
            if vi.name == POSITION_IDS_INPUT:
                self._bind_positions(vi.name, dims, dtype)
                continue
            self.shape[vi.name] = tuple(dims)
            self.dtype[vi.name] = dtype
            self.tier[vi.name] = "host" if dtype != "float32" else "compute"
            self.inputs.append(Value(vi.name, tuple(dims), dtype))
            self._names.add(vi.name)
        if not any(v.name == "input_ids" for v in self.inputs):
            raise ImportError_(f"{self.source}: the model has no graph input named 'input_ids' "
                               f"(inputs: {[v.name for v in self.inputs]}); re-export a token model with "
                               "`confidant export`, whose inputs are input_ids, attention_mask and token_type_ids")

    def _bind_positions(self, name: str, dims: list[int], dtype: str) -> None:
        """`position_ids` as the constant 0..S-1 on every row (`POSITION_IDS_INPUT`): the rotary
        tables and position embeddings it selects then fold as they do without it."""
        if dtype not in ("int64", "int32") or not 1 <= len(dims) <= 2 or dims[-1] != self.opt.seq:
            raise ImportError_(f"{self.source}: graph input {name!r} is {dtype} {dims}; Confidant binds it to the "
                               f"positions 0..{self.opt.seq - 1} and needs an int64 or int32 [batch, seq] input "
                               "(re-export with dynamic axes, or without position_ids)")
        self._set_const(name, np.broadcast_to(np.arange(self.opt.seq), dims).astype(dtype))

    # --- main loop -----------------------------------------------------------------------
    def run(self) -> Graph:
        self._bind_inputs()
        for node in self.g.node:
            try:
                self._lower(node)
            except ImportError_:
                raise
            except Exception as exc:  # a malformed node (too few inputs, bad attribute) or a lowering gap
                if isinstance(exc, ValueError) and "broadcast" in str(exc):
                    raise self._fail(node, f"cannot be lowered at batch {self.opt.batch} x sequence {self.opt.seq} "
                                           f"({exc}); the model may not take sequences this long (its position "
                                           "table): try a smaller --seq") from None
                raise self._fail(node, f"cannot be lowered ({type(exc).__name__}: {exc}); "
                                       f"{_DAMAGED}") from None
        if not self.g.output:
            raise ImportError_(f"{self.source}: the graph declares no output; {_DAMAGED}")
        outputs = [self._r(o.name) for o in self.g.output]
        if len(outputs) != 1:
            raise ImportError_(f"{self.source}: expected one output (logits), found {len(outputs)} "
                               f"({[o.name for o in self.g.output]}); export the classifier's logits only")
        logits = outputs[0]
        if logits not in self.shape:
            raise ImportError_(f"{self.source}: graph output {self.g.output[0].name!r} is produced by no node; "
                               f"{_DAMAGED}")
        if self.tier.get(logits) != "compute":
            raise ImportError_(f"{self.source}: output {logits!r} does not depend on the model's parameters")
        graph_outputs = [logits]
        if self.opt.with_loss:
            shape = self.shape[logits]
            if self._causal_lm(shape):
                for name, dtype in ((TARGET_IDS_INPUT, "int64"), (TARGET_WEIGHTS_INPUT, "float32")):
                    self.inputs.append(Value(name, shape[:-1], dtype))
                    self.shape[name], self.dtype[name], self.tier[name] = shape[:-1], dtype, "host"
                self._emit("loss/TokenCrossEntropy", "TokenCrossEntropy",
                           [logits, TARGET_IDS_INPUT, TARGET_WEIGHTS_INPUT], LOSS_OUTPUT, {})
            else:
                self.inputs.append(Value(TARGETS_INPUT, shape, "float32"))
                self.shape[TARGETS_INPUT], self.dtype[TARGETS_INPUT] = shape, "float32"
                self.tier[TARGETS_INPUT] = "host"
                self._emit("loss/SoftmaxCrossEntropy", "SoftmaxCrossEntropy", [logits, TARGETS_INPUT], LOSS_OUTPUT, {})
            graph_outputs = [LOSS_OUTPUT]
        return self._finish(graph_outputs, logits)

    def _causal_lm(self, logits_shape: tuple[int, ...]) -> bool:
        """Whether the model is a causal LM: by `ImportOptions.loss`, or ("auto") logits [B, S, V]
        over the vocabulary (V = the rows of the token embedding table)."""
        if self.opt.loss not in LOSS_KINDS:
            raise ValueError(f"loss must be one of {LOSS_KINDS}, got {self.opt.loss!r}")
        if self.opt.loss != "auto":
            if self.opt.loss == "causal-lm" and len(logits_shape) != 3:
                raise ImportError_(f"{self.source}: a causal-LM loss needs logits [batch, seq, vocab], the model's "
                                   f"are {list(logits_shape)}")
            return self.opt.loss == "causal-lm"
        return len(logits_shape) == 3 and self.token_table_rows is not None \
            and logits_shape[-1] == self.token_table_rows

    def _emit(self, name: str, op: str, inputs: list[str], output: str, attrs: dict, tier: str = "compute",
              shape=None, dtype="float32") -> None:
        if shape is None:
            shape = compute_output_shape(op, attrs, [self.shape[i] for i in inputs])
        if name in self.node_at:
            name = self._fresh(name)
        self.node_at[name] = len(self.nodes)
        self.nodes.append(Node(name, op, tuple(inputs), (output,), attrs, tier))
        self.producer[output] = name
        self._names.update((name, output))
        self.shape[output], self.dtype[output], self.tier[output] = tuple(int(d) for d in shape), dtype, tier

    def _add_const(self, base: str, value: np.ndarray) -> str:
        name = self._fresh(base)
        self._set_const(name, value)
        return name

    def _check_arity(self, node) -> None:
        """Every input the op's ONNX schema requires is given (a damaged or hand-edited node)."""
        from onnx import defs

        key = (node.domain or "", node.op_type)
        if key not in self._schemas:
            try:
                self._schemas[key] = defs.get_schema(node.op_type, self.opset, node.domain or "")
            except Exception:  # an unknown op: refused by name where it is lowered
                self._schemas[key] = None
        schema = self._schemas[key]
        if schema is None:
            return
        single = defs.OpSchema.FormalParameterOption.Single
        for k, formal in enumerate(schema.inputs):
            if formal.option == single and (k >= len(node.input) or not node.input[k]):
                raise self._fail(node, f"has no input {formal.name!r} ({k + 1} of {node.op_type}'s "
                                       f"{schema.min_input} required inputs); {_DAMAGED}")

    def _check_inputs(self, node, ins: list[str]) -> None:
        for k, (raw, i) in enumerate(zip(node.input, ins)):
            if not i:
                continue
            if i in self.nan_test and not (node.op_type == "Where" and k == 0):
                raise self._fail(node, f"reads the IsNaN test {raw!r}; IsNaN is supported only as the softmax guard "
                                       f"Where(IsNaN(p), 0, p) of exported SDPA attention; {_HINT}")
            if i not in self.const and i not in self.shape and i not in self.nan_test:
                raise self._fail(node, f"reads value {raw!r}, which no earlier node, initializer or graph input "
                                       f"produces (a dangling name); {_DAMAGED}")

    def _lower(self, node) -> None:
        op = node.op_type
        attrs = self._attrs(node)
        ins = [self._r(i) if i else "" for i in node.input]
        outs = list(node.output)
        if not outs or not outs[0]:
            raise self._fail(node, f"has no output; {_DAMAGED}")
        name = node.name or outs[0]
        if node.domain not in ("", "ai.onnx") and not (node.domain == "com.microsoft" and op in ("Gelu", "FastGelu")):
            raise self._fail(node, f"operator domain {node.domain!r} is not supported; {_HINT}")
        self._check_arity(node)
        self._check_inputs(node, ins)
        if op == "Constant":
            self._set_const(outs[0], self._constant_value(node, attrs))
            return
        if op == "CastLike":
            op, attrs, ins = "Cast", {"to": self._onnx_code_of(node, ins[1])}, ins[:1]
        present = [i for i in ins if i]
        reads_weight = any(i in self.weights or i in self.transposed for i in present)
        if present and all(i in self.const for i in present) and not reads_weight:
            folded = self._fold(node, op, attrs, ins)
            if folded is not None:
                for o, v in zip(outs, folded):
                    self._set_const(o, v)
                return
        if op == "Shape":
            self._set_const(outs[0], eval_host_op("Shape", attrs, [np.zeros(self.shape[ins[0]], np.int8)]))
            return
        if op == "IsNaN" and self.tier.get(ins[0]) == "compute":
            self.nan_test[outs[0]] = ins[0]
            return
        if op == "Where" and ins[0] in self.nan_test:
            self._lower_nan_guard(node, ins, outs)
            return
        if op == "Identity" and ins[0] in self.weights and _all_equal(self.const[ins[0]]):
            self._untie(outs[0], ins[0])
            return
        if op in _ALIAS_OPS or (op == "Cast" and (self.tier.get(ins[0]) == "compute" or ins[0] in self.weights)
                                and attrs.get("to") in (1, 11)):
            self.alias[outs[0]] = ins[0]
            return
        if not reads_weight and all(self.tier.get(i) != "compute" for i in present):
            self._lower_host(node, op, attrs, ins, outs, name)
        else:
            self._lower_compute(node, op, attrs, ins, outs, name)

    def _untie(self, name: str, weight: str) -> None:
        """`name` as a parameter of its own, equal to `weight` at export.

        Exporters merge initializers with equal values: TorchScript keeps one and reads it through
        an Identity per merged parameter. Two parameters equal element by element are either one
        weight shared on purpose (ALBERT's layer, whose weight TorchScript's constant folding
        transposes once per use, then merges) or a fresh model's constant tensors (zero biases,
        unit LayerNorm scales) that merely start equal. A constant-valued tensor is therefore
        untied (it trains on its own, as in PyTorch), any other stays tied (one parameter, its
        gradient summed over its uses). Initializers read directly by several nodes are one weight:
        TorchScript shares them so; the dynamo exporter's optimizer also merges equal ones that
        way, which `confidant export` therefore does not run (`jobs.export.encoder`)."""
        self._set_const(name, self.const[weight].copy())
        self.weights.add(name)

    def _onnx_code_of(self, node, name: str) -> int:
        dtype = self.const[name].dtype if name in self.const else self.dtype.get(name)
        code = _ONNX_CODE.get(np.dtype(_np_dtype(dtype) if isinstance(dtype, str) else dtype)) if dtype else None
        if code is None:
            raise self._fail(node, f"CastLike to the type of {name!r} ({dtype}) is not supported")
        return code

    def _set_const(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value)
        self.const[name] = value
        self.shape[name] = tuple(value.shape)
        self._names.add(name)

    def _constant_value(self, node, attrs) -> np.ndarray:
        for key in ("value", "value_float", "value_int", "value_floats", "value_ints"):
            if key in attrs:
                v = attrs[key]
                if key in ("value_float", "value_floats"):
                    return np.asarray(v, dtype=np.float32)
                if key in ("value_int", "value_ints"):
                    return np.asarray(v, dtype=np.int64)
                return np.asarray(v)
        raise self._fail(node, f"Constant without a supported value attribute ({sorted(attrs)})")

    def _fold(self, node, op, attrs, ins) -> list[np.ndarray] | None:
        vals = [self.const[i] if i else None for i in ins]
        if op in HOST_IMPLS:
            try:
                return [eval_host_op(op, attrs, vals)]
            except Exception as exc:
                why = f"cannot fold constant inputs ({type(exc).__name__}: {exc})"
                if op == "Gather" and isinstance(exc, IndexError):  # positions past a position table
                    why += (f" at batch {self.opt.batch} x sequence {self.opt.seq}; the model may not take "
                            "sequences this long (its position table): try a smaller --seq")
                raise self._fail(node, why) from None
        if op in _FOLDABLE_FLOAT and _FOLDABLE_FLOAT[op] is not None:
            return [_FOLDABLE_FLOAT[op](vals[0])]
        if op == "Pow":
            return [np.power(vals[0], vals[1]).astype(vals[0].dtype)]
        if op == "Split":
            x = vals[0]
            axis = int(attrs.get("axis", 0)) % x.ndim
            sizes = _split_sizes(x.shape[axis], len(node.output), attrs, vals[1] if len(vals) > 1 else None)
            return np.split(x, np.cumsum(sizes)[:-1], axis=axis)
        return None

    def _lower_host(self, node, op, attrs, ins, outs, name) -> None:
        if op not in HOST_IMPLS:
            raise self._fail(node, f"not in Confidant's op set (host tier, no gradient); {_HINT}")
        if len(outs) != 1:
            raise self._fail(node, "host ops with several outputs are not supported")
        dummy = [None if not i else (self.const[i] if i in self.const else
                                     np.zeros(self.shape[i], dtype=_np_dtype(self.dtype[i]))) for i in ins]
        try:
            probe = eval_host_op(op, attrs, dummy)
        except Exception as exc:
            raise self._fail(node, f"cannot evaluate on bound shapes ({type(exc).__name__}: {exc})") from None
        dtype = {np.dtype(np.bool_): "bool"}.get(probe.dtype, str(probe.dtype))
        self._emit(name, op, ins, outs[0], attrs, tier="host", shape=probe.shape, dtype=dtype)

    def _const_input(self, node, name: str, what: str) -> np.ndarray:
        if name not in self.const:
            raise self._fail(node, f"{what} must be a constant after binding batch and sequence length")
        return self.const[name]

    # --- the SDPA softmax guard and masked_fill -------------------------------------------
    def _lower_nan_guard(self, node, ins, outs) -> None:
        """Where(IsNaN(p), 0, p) after a Softmax: see the module docstring."""
        p = self.nan_test[ins[0]]
        zero = ins[1]
        if (len(ins) != 3 or ins[2] != p or zero not in self.const or np.any(self.const[zero] != 0)
                or self._producer_op(p) != "Softmax"):
            raise self._fail(node, "IsNaN is supported only as the softmax guard Where(IsNaN(p), 0, p) of exported "
                                   f"SDPA attention; {_HINT}")
        softmax = self.nodes[self.node_at[self.producer[p]]]
        scores = softmax.inputs[0]
        if self._producer_op(scores) == "Add":
            add_name = self.producer[scores]
            add = self.nodes[self.node_at[add_name]]
            inputs = [self._finite_mask(node, i) if self.tier.get(i) != "compute" else i for i in add.inputs]
            self.nodes[self.node_at[add_name]] = Node(add.name, add.op, tuple(inputs), add.outputs, add.attrs, add.tier)
        elif not self._finite_inputs(scores):
            raise self._fail(node, f"the guarded softmax {softmax.name!r} does not read scores + mask; {_HINT}")
        self.alias[outs[0]] = p

    def _producer_op(self, value: str) -> str | None:
        n = self.producer.get(value)
        return None if n is None else self.nodes[self.node_at[n]].op

    def _finite_inputs(self, value: str) -> bool:
        """True when `value` is computed from compute values and finite constants only (no mask)."""
        n = self.producer.get(value)
        if n is None:
            return False
        node = self.nodes[self.node_at[n]]
        return all(self.tier.get(i) == "compute" or (i in self.const and np.all(np.isfinite(self.const[i])))
                   for i in node.inputs)

    def _finite_mask(self, node, mask: str) -> str:
        """`mask` with -inf raised to float32's lowest finite value (a constant, or a host Max node)."""
        if mask in self.clamped:
            return self.clamped[mask]
        if mask in self.const:
            value = self.const[mask]
            out = self._add_const(f"{mask}/finite", np.maximum(value, _LOWEST).astype(value.dtype))
        else:
            if self.dtype.get(mask) not in ("float32", "float64"):
                raise self._fail(node, f"the attention mask {mask!r} is {self.dtype.get(mask)}, expected float")
            lowest = self._add_const(f"{mask}/lowest", np.asarray(_LOWEST, _np_dtype(self.dtype[mask])))
            out = self._fresh(f"{mask}/finite")
            self._emit(f"{out}/Max", "Max", [mask, lowest], out, {}, tier="host", shape=self.shape[mask],
                       dtype=self.dtype[mask])
        self.clamped[mask] = out
        return out

    def _lower_where(self, node, ins, out, name) -> None:
        """Where(c, x, y) with a host condition: x * float(c) + y * float(not c) for a computed side, where(c, x, 0)
        or where(c, 0, y) for a constant or host side (exact: the other side is multiplied by 0, not by inf)."""
        cond, x, y = ins
        if self.tier.get(cond) == "compute":
            raise self._fail(node, f"Where with a computed condition is not supported; {_HINT}")
        if cond not in self.const and self.dtype.get(cond) != "bool":
            raise self._fail(node, "Where's condition must be boolean")
        branches = [(x, cond, False), (y, cond, True)]
        terms: list[str] = []
        fills: list[tuple[str, bool]] = []
        for value, c, negate in branches:
            if self.tier.get(value) == "compute":
                keep = self._host_value(f"{name}/keep{'_not' if negate else ''}", "Not" if negate else None, c)
                prod = self._fresh(f"{name}/{'else' if negate else 'then'}")
                self._emit(f"{prod}/Mul", "Mul", [value, keep], prod, {})
                terms.append(prod)
            else:
                fills.append((value, negate))
        if fills:
            # the constant/host branch where it is selected, 0 elsewhere
            value, negate = fills[0]
            zero = self._add_const(f"{name}/zero", np.zeros((), self._float_dtype(value)))
            args = [cond, value, zero] if not negate else [cond, zero, value]
            fill = self._fresh(f"{name}/fill")
            dummy = [self.const[a] if a in self.const else np.zeros(self.shape[a], _np_dtype(self.dtype[a]))
                     for a in args]
            if all(a in self.const for a in args):
                self._set_const(fill, eval_host_op("Where", {}, dummy))
            else:
                probe = eval_host_op("Where", {}, dummy)
                self._emit(f"{fill}/Where", "Where", args, fill, {}, tier="host", shape=probe.shape,
                           dtype=str(probe.dtype))
            terms.append(fill)
        total = terms[0]
        for k, t in enumerate(terms[1:]):
            nxt = out if k == len(terms) - 2 else self._fresh(f"{name}/sum")
            self._emit(f"{name}/Add" if nxt == out else f"{nxt}/Add", "Add", [total, t], nxt, {})
            total = nxt
        if total != out:
            self.alias[out] = total
        self._check_shape(node, out, self._probe_where(cond, x, y))

    def _float_dtype(self, value: str):
        if value in self.const:
            return self.const[value].dtype
        return _np_dtype(self.dtype.get(value, "float32"))

    def _probe_where(self, c, x, y) -> tuple[int, ...]:
        return tuple(np.broadcast_shapes(self.shape[c], self.shape[x], self.shape[y]))

    def _check_shape(self, node, out: str, want: tuple[int, ...]) -> None:
        got = self.shape[self._r(out)]
        if tuple(got) != tuple(want):
            raise self._fail(node, f"lowered to shape {got}, ONNX semantics give {want}")

    def _host_value(self, base: str, op: str | None, cond: str) -> str:
        """float32(cond) (or float32(not cond)) as a host value or a constant."""
        src = cond
        if op == "Not":
            src = self._host_node(base + "/not", "Not", [cond], {})
        return self._host_node(base, "Cast", [src], {"to": 1})

    def _host_node(self, base: str, op: str, args: list[str], attrs: dict) -> str:
        out = self._fresh(base)
        vals = [self.const[a] if a in self.const else np.zeros(self.shape[a], _np_dtype(self.dtype[a])) for a in args]
        probe = eval_host_op(op, attrs, vals)
        if all(a in self.const for a in args):
            self._set_const(out, probe)
        else:
            dtype = "bool" if probe.dtype == np.bool_ else str(probe.dtype)
            self._emit(f"{out}/{op}", op, args, out, attrs, tier="host", shape=probe.shape, dtype=dtype)
        return out

    # --- selecting along an axis of an activation ------------------------------------------
    def _lower_select(self, node, x: str, axis: int, indices: np.ndarray, out: str, name: str,
                      out_shape: tuple[int, ...]) -> None:
        """out = x taken at constant `indices` along `axis` (ONNX Gather semantics), as a one-hot
        MatMul: exact (each output is one input times 1.0 plus zeros) and differentiable."""
        shape = self.shape[x]
        rank = len(shape)
        axis %= rank
        flat = np.asarray(indices, np.int64).reshape(-1) % shape[axis]
        onehot = np.zeros((shape[axis], flat.size), np.float32)
        onehot[flat, np.arange(flat.size)] = 1.0
        e = self._add_const(f"{name}/onehot", onehot)
        cur = x
        if axis != rank - 1:
            perm = [d for d in range(rank) if d != axis] + [axis]
            cur_t = self._fresh(f"{name}/to_last")
            self._emit(f"{cur_t}/Transpose", "Transpose", [cur], cur_t, {"perm": perm})
            cur = cur_t
        picked = self._fresh(f"{name}/picked")
        self._emit(f"{picked}/MatMul", "MatMul", [cur, e], picked, {"trans_b": False})
        cur = picked
        if axis != rank - 1:
            back = list(range(axis)) + [rank - 1] + list(range(axis, rank - 1))
            cur_b = self._fresh(f"{name}/back")
            self._emit(f"{cur_b}/Transpose", "Transpose", [cur], cur_b, {"perm": back})
            cur = cur_b
        self._emit(name, "Reshape", [cur], out, {"shape": [int(d) for d in out_shape]})

    def _lower_compute_slice(self, node, ins, out, name) -> None:
        x = ins[0]
        starts = self._const_input(node, ins[1], "Slice starts").reshape(-1)
        ends = self._const_input(node, ins[2], "Slice ends").reshape(-1)
        axes = (self._const_input(node, ins[3], "Slice axes").reshape(-1) if len(ins) > 3 and ins[3]
                else np.arange(len(starts)))
        steps = (self._const_input(node, ins[4], "Slice steps").reshape(-1) if len(ins) > 4 and ins[4]
                 else np.ones(len(starts), np.int64))
        cur = x
        rank = len(self.shape[x])
        probe_in = np.arange(int(np.prod(self.shape[x]))).reshape(self.shape[x])
        final = eval_host_op("Slice", {}, [probe_in, starts, ends, axes, steps]).shape
        for k, (s, e, a, st) in enumerate(zip(starts, ends, axes, steps)):
            a = int(a) % rank
            idx = np.arange(self.shape[cur][a])[slice(int(s), int(e), int(st))]
            if len(idx) == self.shape[cur][a] and int(st) == 1:
                continue
            if len(idx) == 0:
                self.empty[out] = node.name or out
                self.shape[out], self.dtype[out], self.tier[out] = tuple(int(d) for d in final), "float32", "compute"
                return
            target = list(self.shape[cur])
            target[a] = len(idx)
            nxt = out if k == len(starts) - 1 else self._fresh(f"{name}/axis{a}")
            if int(st) == 1:  # a contiguous range: the IR's Slice
                self._emit(name if nxt == out else f"{nxt}/Slice", "Slice", [cur], nxt,
                           {"axis": a, "start": int(idx[0]), "end": int(idx[-1]) + 1})
            else:
                self._lower_select(node, cur, a, idx, nxt, name if nxt == out else f"{nxt}/select", tuple(target))
            cur = nxt
        if cur != out:
            self.alias[out] = cur
        self._check_shape(node, out, tuple(final))

    # --- compute ops ---------------------------------------------------------------------
    def _lower_compute(self, node, op, attrs, ins, outs, name) -> None:
        if op == "Split":
            self._lower_split(node, attrs, ins, outs, name)
            return
        if len(outs) > 1 and any(outs[1:]) and op not in ("LayerNormalization", "Dropout"):
            raise self._fail(node, "several outputs are not supported on the compute path")
        out = outs[0]
        empty = [i for i in ins if i in self.empty]
        if empty and op != "Concat":
            raise self._fail(node, f"reads {empty[0]!r}, which node {self.empty[empty[0]]!r} sliced to nothing; "
                                   f"only a Concat may read an empty activation")
        if op == "Transpose" and ins[0] in self.weights and len(self.shape[ins[0]]) == 2 \
                and list(attrs.get("perm") or [1, 0]) == [1, 0]:
            self.transposed[out] = ins[0]  # emitted as trans_b of the MatMul that reads it (or on first other use)
            self.shape[out], self.dtype[out], self.tier[out] = self.shape[ins[0]][::-1], "float32", "compute"
            return
        trans_b = op == "MatMul" and len(ins) > 1 and ins[1] in self.transposed
        if op == "Gemm" and len(ins) > 1 and ins[1] in self.transposed:
            attrs = {**attrs, "transB": 1 - int(attrs.get("transB", 0))}
            ins = [ins[0], self.transposed[ins[1]], *ins[2:]]
        ins = [self._materialized(i) if not (trans_b and k == 1) else i for k, i in enumerate(ins)]
        if op == "Gather":
            axis = int(attrs.get("axis", 0))
            if self.tier.get(ins[0]) == "compute":
                indices = self._const_input(node, ins[1], "the indices of a Gather from an activation")
                want = eval_host_op("Gather", attrs, [np.zeros(self.shape[ins[0]], np.int8), indices]).shape
                self._lower_select(node, ins[0], axis, indices, out, name, tuple(want))
                return
            if ins[0] not in self.const or axis != 0:
                raise self._fail(node, "only embedding lookups (Gather rows of a constant table) and selections "
                                       "at constant indices are supported")
            if ins[1] not in self.const and self.token_table_rows is None:  # the first lookup of data: tokens
                self.token_table_rows = int(self.const[ins[0]].shape[0])
            self._emit(name, "Gather", ins[:2], out, {})
        elif op == "Slice":
            self._lower_compute_slice(node, ins, out, name)
        elif op == "Where":
            self._lower_where(node, ins, out, name)
        elif op == "MatMul":
            if trans_b:
                self._emit(name, "MatMul", [ins[0], self.transposed[ins[1]]], out, {"trans_b": True})
            else:
                self._emit(name, "MatMul", ins, out, {"trans_b": False})
        elif op == "Gemm":
            if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                raise self._fail(node, "Gemm with transA, alpha or beta other than 1 is not supported")
            mm_out = out if len(ins) < 3 or not ins[2] else f"{out}/matmul"
            self._emit(f"{name}/matmul", "MatMul", ins[:2], mm_out, {"trans_b": bool(attrs.get("transB", 0))})
            if mm_out != out:
                self._emit(f"{name}/bias", "Add", [mm_out, ins[2]], out, {})
        elif op in ("Add", "Sub", "Mul", "Div"):
            self._emit(name, op, ins, out, {})
        elif op == "Neg":
            minus = self._add_const(f"{name}/minus_one", np.asarray(-1.0, np.float32))
            self._emit(name, "Mul", [ins[0], minus], out, {})
        elif op == "Pow":
            exponent = self._const_input(node, ins[1], "the exponent of Pow")
            self._emit(name, "Pow", ins[:1], out, {"exponent": float(exponent.reshape(-1)[0])})
        elif op in ("Sqrt", "Erf", "Tanh", "Relu", "Sigmoid"):
            self._emit(name, op, ins[:1], out, {})
        elif op == "Reciprocal":
            one = self._add_const(f"{name}/one", np.asarray(1.0, np.float32))
            self._emit(name, "Div", [one, ins[0]], out, {})
        elif op == "Expand":
            target = self._const_input(node, ins[1], "the shape of an Expand of an activation")
            shape = np.broadcast_shapes(self.shape[ins[0]], tuple(int(d) for d in target.reshape(-1)))
            self._emit(name, "Expand", ins[:1], out, {"shape": [int(d) for d in shape]})
        elif op == "Concat":
            rank = len(self.shape[ins[0]])
            axis = int(attrs.get("axis", 0)) % rank
            parts = [i for i in ins if i and i not in self.empty]
            want = list(self.shape[ins[0]])
            want[axis] = sum(self.shape[i][axis] for i in ins if i)
            if not parts:
                raise self._fail(node, "concatenates only activations sliced to nothing")
            if len(parts) == 1:  # the others were empty: the one left is the result
                self.alias[out] = parts[0]
            else:
                self._emit(name, "Concat", parts, out, {"axis": axis})
            self._check_shape(node, out, tuple(want))
        elif op == "ReduceMean":
            axes = attrs.get("axes")
            if axes is None and len(ins) > 1 and ins[1]:
                axes = self._const_input(node, ins[1], "ReduceMean axes").tolist()
            if axes is None:
                raise self._fail(node, "ReduceMean over all axes is not supported")
            self._emit(name, "ReduceMean", ins[:1], out, {"axes": [int(a) for a in axes],
                                                        "keepdims": bool(attrs.get("keepdims", 1))})
        elif op == "Softmax":
            rank = len(self.shape[ins[0]])
            axis = int(attrs.get("axis", -1)) % rank
            if axis != rank - 1:
                raise self._fail(node, f"Softmax over axis {axis} of a rank-{rank} tensor; only the last axis is supported")
            self._emit(name, "Softmax", ins, out, {"axis": axis})
        elif op == "LayerNormalization":
            rank = len(self.shape[ins[0]])
            if int(attrs.get("axis", -1)) % rank != rank - 1:
                raise self._fail(node, "LayerNormalization is supported over the last axis only")
            if len(ins) < 3 or not ins[2]:
                raise self._fail(node, "LayerNormalization without a bias is not supported")
            self._emit(name, "LayerNorm", ins[:3], out, {"epsilon": float(attrs.get("epsilon", 1e-5))})
        elif op in ("Gelu", "FastGelu"):
            approx = "tanh" if op == "FastGelu" else attrs.get("approximate", "none")
            self._emit(name, "Gelu", ins[:1], out, {"approximate": approx})
        elif op == "Transpose":
            perm = attrs.get("perm") or list(reversed(range(len(self.shape[ins[0]]))))
            self._emit(name, "Transpose", ins, out, {"perm": [int(p) for p in perm]})
        elif op in _RESHAPING_OPS:
            probe_inputs = [np.zeros(self.shape[ins[0]], np.int8)] + [
                self._const_input(node, i, f"input {k + 1} of {op}") if i else None for k, i in enumerate(ins[1:])]
            shape = eval_host_op(op, attrs, probe_inputs).shape
            self._emit(name, "Reshape", ins[:1], out, {"shape": [int(d) for d in shape]})
        else:
            raise self._fail(node, f"not in Confidant's op set (compute tier); {_HINT}")

    def _lower_split(self, node, attrs, ins, outs, name) -> None:
        """Split of an activation into several outputs (GPT-2's fused QKV): one Slice per output."""
        x = self._materialized(ins[0])
        if self.tier.get(x) != "compute":
            raise self._fail(node, f"Split of {x!r}, which is neither an activation nor a constant; {_HINT}")
        shape = self.shape[x]
        axis = int(attrs.get("axis", 0)) % len(shape)
        sizes = _split_sizes(shape[axis], len(outs), attrs,
                             self._const_input(node, ins[1], "the sizes of a Split") if len(ins) > 1 and ins[1]
                             else None)
        start = 0
        for k, (out, size) in enumerate(zip(outs, sizes)):
            if out:
                self._emit(f"{name}/{k}", "Slice", [x], out, {"axis": axis, "start": start, "end": start + size})
            start += size

    def _materialized(self, value: str) -> str:
        """A transposed weight read by anything but a MatMul's right operand, as a Transpose node."""
        if value in self.transposed and value not in self.producer:
            self._emit(f"{value}/Transpose", "Transpose", [self.transposed[value]], value, {"perm": [1, 0]})
        return value

    # --- finish --------------------------------------------------------------------------
    def _finish(self, outputs: list[str], logits: str) -> Graph:
        # nodes made late (a clamped mask, a materialised transpose) may sit after their readers
        ordered = topological_order(self.nodes, [v.name for v in self.inputs] + list(self.const))
        needed = set(outputs)
        kept: list[Node] = []
        for n in reversed(ordered):
            if any(o in needed for o in n.outputs):
                kept.append(n)
                needed.update(i for i in n.inputs if i)
        kept.reverse()
        used = {i for n in kept for i in n.inputs if i}
        inputs = [v for v in self.inputs if v.name in used]
        consts = {k: v for k, v in self.const.items() if k in used}
        compute_consumed = {i for n in kept if n.tier == "compute" for i in n.inputs}
        params = tuple(k for k in consts if k in compute_consumed and k in self.weights)
        consts = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in consts.items()}
        values = {}
        for name in set(used) | {o for n in kept for o in n.outputs}:
            dtype = self.dtype.get(name) or ("bool" if consts[name].dtype == np.bool_ else str(consts[name].dtype))
            values[name] = Value(name, tuple(self.shape[name]), dtype)
        graph_name = self.g.name or "model"
        return Graph(graph_name, tuple(inputs), tuple(values[o] for o in outputs), tuple(kept), values,
                     consts, params, (), self.opt.batch, self.opt.seq)


def _split_sizes(length: int, n: int, attrs: dict, sizes: np.ndarray | None) -> list[int]:
    """The output sizes of an ONNX Split of an axis of `length` into `n` outputs (sizes given as the
    second input, the `split` attribute of opsets < 13, or equal parts, the last one smaller)."""
    if sizes is None and attrs.get("split") is not None:
        sizes = np.asarray(attrs["split"])
    if sizes is not None:
        out = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(out) != n or sum(out) != length:
            raise ValueError(f"Split sizes {out} do not cut an axis of {length} into {n} parts")
        return out
    part = -(-length // n)
    return [min(part, length - k * part) for k in range(n)]


def _position_buffers(onnx_graph, weights: set[str], bound: set[str] = frozenset()) -> set[str]:
    """Float initializers that are buffers of the rotary position code, not weights: those a Cos or
    Sin node reads through values that depend on nothing but initializers, constants, shapes and the
    inputs the lowering binds to constants (`bound`: the positions), and that nothing else reads (the
    dynamo exporter keeps `inv_freq` as an initializer). Their values fold with the positions once
    the sequence length is bound."""
    static = {i.name for i in onnx_graph.initializer} | {i.name for i in onnx_graph.input if i.name in bound}
    producer = {}
    for n in onnx_graph.node:
        for o in n.output:
            producer[o] = n
        if n.op_type in ("Shape", "Constant") or all(i in static for i in n.input if i):
            static.update(o for o in n.output if o)
    readers: dict[str, list] = {}
    for n in onnx_graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    found: set[str] = set()
    stack = [i for n in onnx_graph.node if n.op_type in ("Cos", "Sin") for i in n.input if i in static]
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in weights and all(o in static for r in readers.get(v, []) for o in r.output if o):
            found.add(v)
        node = producer.get(v)
        if node is not None and node.op_type != "Shape":
            stack.extend(i for i in node.input if i in static)
    return found


def folded_transposes(onnx_graph, values: Mapping[str, np.ndarray], weights: set[str] | None = None
                      ) -> dict[str, str]:
    """Initializers that are another weight's transpose, folded by the exporter (copy -> weight).

    TorchScript's constant folding (on by default) turns `x @ W.T` into a MatMul by a new
    initializer `W.T`: for a decoder whose LM head is tied to the token embedding, the head then
    reads a copy of the table that would train on its own (the model silently untied; its gradients
    no longer transformers'). A 2-D float initializer equal element by element to the transpose of
    another, neither of constant value, is that other weight read transposed; the weight kept is
    the one a Gather reads (the embedding table), else the one not named by the exporter
    (`onnx::...`), else the first in the file. Equal values cannot be told from a tie: an untied
    head that starts as an exact copy of the embedding trains tied (as transformers does by
    default)."""
    from ir.mapped_pages import PagesGivenBack

    weights = set(values) if weights is None else weights
    gathered = {n.input[0] for n in onnx_graph.node if n.op_type == "Gather" and n.input}
    order = {i.name: k for k, i in enumerate(onnx_graph.initializer)}
    by_shape: dict[tuple[int, ...], list[str]] = {}
    # the weights may be mapped from the file: what is read of them is given back as it goes, so
    # the comparisons hold a few MiB of the file's pages, not every weight's (planner.onnx_weights)
    pages = PagesGivenBack()
    for name in weights:
        v = values.get(name)
        # a weight the file stores quantized (a QuantizedTensor) is its own: no exporter folded it
        if isinstance(v, np.ndarray) and v.ndim == 2 and v.dtype.kind == "f" and v.shape[0] != v.shape[1] \
                and not _all_equal(v, pages):
            by_shape.setdefault(v.shape, []).append(name)

    def rank(name: str) -> tuple:
        return (name not in gathered, name.startswith("onnx::"), order.get(name, len(order)), name)

    found: dict[str, str] = {}
    for shape, names in sorted(by_shape.items()):
        if shape[0] > shape[1]:
            continue  # each pair once, from its wide side
        for a in names:
            for b in by_shape.get(shape[::-1], []):
                if a in found or b in found:
                    continue
                va, vb = values[a], values[b]
                pages.read(va, 0)  # the first elements' pages, given back with the rest
                pages.read(vb, 0)
                if va[0, 0] == vb[0, 0] and _transposes(va, vb, pages):
                    keep, copy = sorted((a, b), key=rank)
                    found[copy] = keep
    pages.done()
    return found


_COMPARED_ELEMENTS = 1 << 20  # elements compared at a time (4 MiB of float32 a side)


def _all_equal(value: np.ndarray, pages=None) -> bool:
    """Every element of `value` its first: a chunk at a time, so a weight (which differs within its
    first chunk) is read no further than that."""
    flat = np.asarray(value).reshape(-1)
    if flat.size == 0:
        return True
    head = min(flat.size, 1024)  # a page's worth first: a trained weight differs within it
    for lo, hi in ((0, head), *((lo, lo + _COMPARED_ELEMENTS) for lo in range(head, flat.size, _COMPARED_ELEMENTS))):
        part = flat[lo:hi]
        same = bool(np.all(part == flat[0]))
        if pages is not None:
            pages.read(value, part.nbytes)
        if not same:
            return False
    return True


def _transposes(wide: np.ndarray, tall: np.ndarray, pages) -> bool:
    """`np.array_equal(wide, tall.T)`, a chunk of `tall`'s rows at a time (read in order; `wide`'s
    columns across its rows), stopping at the first difference."""
    if wide.shape != tall.shape[::-1]:
        return False
    step = max(1, _COMPARED_ELEMENTS // max(tall.shape[1], 1))
    for lo in range(0, tall.shape[0], step):
        rows = tall[lo:lo + step]
        same = bool(np.array_equal(rows, wide[:, lo:lo + step].T))
        pages.read(tall, rows.nbytes)
        pages.read(wide, rows.nbytes)
        if not same:
            return False
    return True


def _np_dtype(name: str):
    return np.bool_ if name == "bool" else np.dtype(name)


def initializer_shapes(path: str | Path) -> dict[str, list[int]]:
    """Name -> shape of every initializer of the ONNX file `path` (its weights are not read)."""
    model = read_onnx(Path(path), external_data=False)
    return {t.name: [int(d) for d in t.dims] for t in model.graph.initializer}


def with_folded_copies(path: str | Path, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`weights` (IR parameter name -> array) plus, for each initializer of the file `path` that the
    exporter folded as one of them transposed (`folded_transposes`), that array transposed: what the
    file's initializers must hold to compute with `weights`."""
    return _with_folded_copies(read_onnx(Path(path)), weights)


def _with_folded_copies(model, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    two_d = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 2}
    out = dict(weights)
    for copy, weight in folded_transposes(model.graph, two_d).items():
        if weight in out and copy not in out:
            out[copy] = np.asarray(out[weight]).T
    return out


def write_weights(source: str | Path, destination: str | Path, weights, keep: set[str] | None = None) -> Path:
    """The ONNX file `source` with `weights` (IR parameter name -> array, e.g. fine-tuned) in place of
    its own, written to `destination`: the model out of Confidant, for ONNX Runtime or anything else.

    IR parameters are the file's initializers (a weight read through a Transpose keeps its own
    layout: the lowering reads it with `trans_b`), except the parameters the lowering untied from
    an Identity of a merged initializer (`_Lowering._untie`): each becomes an initializer of its
    own under the Identity's output name, and the Identity goes. A name that is neither is refused.
    An initializer the exporter folded as a weight's transpose (`folded_transposes`) gets the
    transpose of that weight's new value, so the file stays tied as the training was.
    """
    import onnx
    from onnx import numpy_helper

    from planner.onnx_quantize import as_plain_initializers

    source, destination = Path(source), Path(destination)
    model = read_onnx(source)
    # weights `export --base-dtype` stored quantized that are written: plain initializers again
    as_plain_initializers(model, {k: np.asarray(v) for k, v in weights.items()})
    by_name = {t.name: t for t in model.graph.initializer}
    weights = _with_folded_copies(model, weights)
    identities = {n.output[0]: n for n in model.graph.node if n.op_type == "Identity" and n.input[0] in by_name}
    unknown = [k for k in weights if k not in by_name and k not in identities]
    if unknown:
        raise ImportError_(f"{source}: weights {unknown[:4]} are neither initializers of the file nor merged copies; "
                           "was the checkpoint trained on this model?")
    for name, value in weights.items():
        value = np.asarray(value)
        if name in by_name:
            old = by_name[name]
            dtype = numpy_helper.to_array(old).dtype
            if tuple(old.dims) != value.shape:
                raise ImportError_(f"{source}: weight {name!r} has shape {tuple(old.dims)} in the file, {value.shape} "
                                   "in the checkpoint")
            old.CopyFrom(numpy_helper.from_array(value.astype(dtype), name))
        else:
            node = identities[name]
            model.graph.node.remove(node)
            dtype = numpy_helper.to_array(by_name[node.input[0]]).dtype
            model.graph.initializer.append(numpy_helper.from_array(value.astype(dtype), name))
    destination.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(destination))
    return destination
