"""Lower an ONNX transformer into Confidant's graph IR (the only module that imports onnx).

Lowering binds batch and sequence length, so every shape becomes static; folds everything that
then becomes constant (the exporters' Shape/Gather/Concat arithmetic) with the same numpy host
evaluator the runtime uses; classifies the remaining nodes into the compute tier (float, trainable
path) and the host tier (mask bookkeeping); maps ONNX compute ops onto the closed op set of
``ir.ops``; appends the loss; then runs the graph passes (fusions, blocks) and verifies the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ir.graph import Graph, Node, Value
from ir.host_eval import HOST_IMPLS, eval_host_op
from ir.ops import compute_output_shape
from ir.verify import verify_graph

SUPPORTED_OPSETS = range(14, 21)
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TARGETS_INPUT = "targets"
LOSS_OUTPUT = "loss"

_ONNX_DTYPE_NAMES = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 11: "float64", 10: "float16"}
_FOLDABLE_FLOAT = {
    "Sqrt": np.sqrt, "Neg": np.negative, "Reciprocal": np.reciprocal, "Tanh": np.tanh,
}
_ALIAS_OPS = {"Identity", "Dropout"}
# Ops through which a parameter enters the trainable path from host-only inputs (token ids).
_PARAM_ENTRY_OPS = {"Gather", "MatMul", "Gemm", "LayerNormalization"}
_RESHAPING_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Flatten"}
_HINT = ("re-export the model with `confidant export` (opset 14-18, eval mode), or add the op to "
         "ir/ops.py with its MNN and PyTorch lowering")


class ImportError_(ValueError):
    """A model that cannot be lowered; the message names the file, node and op."""


@dataclass(frozen=True)
class ImportOptions:
    batch: int = 8
    seq: int = 128
    with_loss: bool = True


def load_model(path: str | Path, batch: int = 8, seq: int = 128, with_loss: bool = True) -> Graph:
    """Read an ONNX file and lower it (see module docstring); errors name the file and node."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ONNX file")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf raises several unrelated types for a damaged file
        raise ImportError_(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise ImportError_(f"{path}: the ONNX graph has no nodes")
    return lower_model(model, ImportOptions(batch, seq, with_loss), source=str(path))


def lower_model(model, options: ImportOptions, source: str = "<model>") -> Graph:
    from planner.passes import run_passes

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset not in SUPPORTED_OPSETS:
        raise ImportError_(
            f"{source}: ONNX opset {opset} is not supported (supported: {SUPPORTED_OPSETS.start}-"
            f"{SUPPORTED_OPSETS.stop - 1}); re-export with `confidant export --opset 17`"
        )
    if options.batch < 1 or options.seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={options.batch} seq={options.seq}")
    lowering = _Lowering(model.graph, options, source)
    graph = lowering.run()
    graph = run_passes(graph)
    verify_graph(graph)
    return graph


class _Lowering:
    def __init__(self, onnx_graph, options: ImportOptions, source: str):
        from onnx import numpy_helper

        self.g = onnx_graph
        self.opt = options
        self.source = source
        self.const: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in onnx_graph.initializer}
        self.shape: dict[str, tuple[int, ...]] = {k: v.shape for k, v in self.const.items()}
        self.dtype: dict[str, str] = {}
        self.tier: dict[str, str] = {}  # value -> "host" | "compute" (constants are absent)
        self.alias: dict[str, str] = {}
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []

    # --- helpers -------------------------------------------------------------------------
    def _where(self, node) -> str:
        return f"{self.source}: node {node.name or node.output[0]!r} (op {node.op_type})"

    def _fail(self, node, why: str) -> ImportError_:
        return ImportError_(f"{self._where(node)}: {why}")

    def _r(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
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
            dtype = _ONNX_DTYPE_NAMES.get(t.elem_type)
            if dtype is None:
                raise ImportError_(f"{self.source}: graph input {vi.name!r} has unsupported element type {t.elem_type}")
            self.shape[vi.name] = tuple(dims)
            self.dtype[vi.name] = dtype
            self.tier[vi.name] = "host" if dtype != "float32" else "compute"
            self.inputs.append(Value(vi.name, tuple(dims), dtype))
        if not any(v.name == "input_ids" for v in self.inputs):
            raise ImportError_(f"{self.source}: the model has no graph input named 'input_ids' "
                               f"(inputs: {[v.name for v in self.inputs]}); export a token model with `confidant export`")

    # --- main loop -----------------------------------------------------------------------
    def run(self) -> Graph:
        self._bind_inputs()
        for node in self.g.node:
            self._lower(node)
        outputs = [self._r(o.name) for o in self.g.output]
        if len(outputs) != 1:
            raise ImportError_(f"{self.source}: expected one output (logits), found {len(outputs)}")
        logits = outputs[0]
        if self.tier.get(logits) != "compute":
            raise ImportError_(f"{self.source}: output {logits!r} does not depend on the model's parameters")
        graph_outputs = [logits]
        if self.opt.with_loss:
            shape = self.shape[logits]
            self.inputs.append(Value(TARGETS_INPUT, shape, "float32"))
            self.shape[TARGETS_INPUT], self.dtype[TARGETS_INPUT] = shape, "float32"
            self.tier[TARGETS_INPUT] = "host"
            self._emit("loss/SoftmaxCrossEntropy", "SoftmaxCrossEntropy", [logits, TARGETS_INPUT], LOSS_OUTPUT, {})
            graph_outputs = [LOSS_OUTPUT]
        return self._finish(graph_outputs, logits)

    def _emit(self, name: str, op: str, inputs: list[str], output: str, attrs: dict, tier: str = "compute",
              shape=None, dtype="float32") -> None:
        if shape is None:
            shape = compute_output_shape(op, attrs, [self.shape[i] for i in inputs])
        self.nodes.append(Node(name, op, tuple(inputs), (output,), attrs, tier))
        self.shape[output], self.dtype[output], self.tier[output] = tuple(int(d) for d in shape), dtype, tier

    def _lower(self, node) -> None:
        op = node.op_type
        attrs = self._attrs(node)
        ins = [self._r(i) if i else "" for i in node.input]
        outs = list(node.output)
        name = node.name or outs[0]
        if node.domain not in ("", "ai.onnx") and not (node.domain == "com.microsoft" and op in ("Gelu", "FastGelu")):
            raise self._fail(node, f"operator domain {node.domain!r} is not supported; {_HINT}")
        if op == "Constant":
            self._set_const(outs[0], self._constant_value(node, attrs))
            return
        present = [i for i in ins if i]
        keeps_param = op in _PARAM_ENTRY_OPS and any(self._param_like(i) for i in present)
        if present and all(i in self.const for i in present) and not keeps_param:
            folded = self._fold(node, op, attrs, ins)
            if folded is not None:
                for o, v in zip(outs, folded):
                    self._set_const(o, v)
                return
        if op == "Shape":
            self._set_const(outs[0], eval_host_op("Shape", attrs, [np.zeros(self.shape[ins[0]], np.int8)]))
            return
        if op in _ALIAS_OPS or (op == "Cast" and self.tier.get(ins[0]) == "compute"
                                and attrs.get("to") in (1, 11)):
            self.alias[outs[0]] = ins[0]
            return
        enters_compute = op in _PARAM_ENTRY_OPS and any(self._param_like(i) for i in present)
        if not enters_compute and all(self.tier.get(i) != "compute" for i in present):
            self._lower_host(node, op, attrs, ins, outs, name)
        else:
            self._lower_compute(node, op, attrs, ins, outs, name)

    def _param_like(self, name: str) -> bool:
        v = self.const.get(name)
        return v is not None and v.dtype.kind == "f" and v.size >= 2

    def _set_const(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value)
        self.const[name] = value
        self.shape[name] = tuple(value.shape)

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
                raise self._fail(node, f"cannot fold constant inputs ({type(exc).__name__}: {exc})") from None
        if op in _FOLDABLE_FLOAT:
            return [_FOLDABLE_FLOAT[op](vals[0])]
        if op == "Pow":
            return [np.power(vals[0], vals[1]).astype(vals[0].dtype)]
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

    def _lower_compute(self, node, op, attrs, ins, outs, name) -> None:
        if len(outs) > 1 and any(outs[1:]) and op not in ("LayerNormalization", "Dropout"):
            raise self._fail(node, "several outputs are not supported on the compute path")
        out = outs[0]
        if op == "Gather":
            if self.tier.get(ins[0]) == "compute" or ins[0] not in self.const or attrs.get("axis", 0) != 0:
                raise self._fail(node, "only embedding lookups (Gather rows of a constant table) are supported")
            self._emit(name, "Gather", ins[:2], out, {})
        elif op == "MatMul":
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
        elif op == "Pow":
            exponent = self._const_input(node, ins[1], "the exponent of Pow")
            self._emit(name, "Pow", ins[:1], out, {"exponent": float(exponent.reshape(-1)[0])})
        elif op in ("Sqrt", "Erf", "Tanh"):
            self._emit(name, op, ins, out, {})
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

    # --- finish --------------------------------------------------------------------------
    def _finish(self, outputs: list[str], logits: str) -> Graph:
        needed = set(outputs)
        kept: list[Node] = []
        for n in reversed(self.nodes):
            if any(o in needed for o in n.outputs):
                kept.append(n)
                needed.update(i for i in n.inputs if i)
        kept.reverse()
        used = {i for n in kept for i in n.inputs if i}
        inputs = [v for v in self.inputs if v.name in used]
        consts = {k: v for k, v in self.const.items() if k in used}
        compute_consumed = {i for n in kept if n.tier == "compute" for i in n.inputs}
        params = tuple(k for k, v in consts.items()
                       if k in compute_consumed and v.dtype.kind == "f" and v.size >= 2)
        consts = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in consts.items()}
        values = {}
        for name in set(used) | {o for n in kept for o in n.outputs}:
            dtype = self.dtype.get(name) or ("bool" if consts[name].dtype == np.bool_ else str(consts[name].dtype))
            values[name] = Value(name, tuple(self.shape[name]), dtype)
        graph_name = self.g.name or "model"
        return Graph(graph_name, tuple(inputs), tuple(values[o] for o in outputs), tuple(kept), values,
                     consts, params, (), self.opt.batch, self.opt.seq)


def _np_dtype(name: str):
    return np.bool_ if name == "bool" else np.dtype(name)
