"""Numpy evaluation of host-tier ops with ONNX semantics.

Used at plan time to fold shape arithmetic once batch and sequence length are bound, and at run time
to turn graph inputs such as ``attention_mask`` into the values compute nodes read (e.g. the additive
mask bias). Keeping both uses on one implementation means a folded constant and a run-time value
can never disagree.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

ONNX_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64,
               9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}


def _axes(node_attrs, inputs, index) -> list[int] | None:
    if len(inputs) > index and inputs[index] is not None:
        return [int(a) for a in np.asarray(inputs[index]).reshape(-1)]
    a = node_attrs.get("axes")
    return None if a is None else [int(x) for x in a]


def _unsqueeze(attrs, x, *rest):
    axes = _axes(attrs, (x, *rest), 1)
    rank = x.ndim + len(axes)
    out = x
    for a in sorted(a % rank for a in axes):
        out = np.expand_dims(out, a)
    return out


def _squeeze(attrs, x, *rest):
    axes = _axes(attrs, (x, *rest), 1)
    return np.squeeze(x) if axes is None else np.squeeze(x, axis=tuple(a % x.ndim for a in axes))


def _slice(attrs, x, starts, ends, axes=None, steps=None):
    axes = list(range(len(starts))) if axes is None else [int(a) % x.ndim for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    index = [slice(None)] * x.ndim
    for a, s, e, st in zip(axes, starts, ends, steps):
        # ONNX clamps INT64 max/min; numpy slicing clamps the same way
        index[a] = slice(int(s), int(e), st)
    return x[tuple(index)]


def _reshape(attrs, x, shape):
    shape = [int(d) for d in shape]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _gather(attrs, data, indices):
    return np.take(data, indices.astype(np.int64), axis=int(attrs.get("axis", 0)))


def _gather_nd(attrs, data, indices):
    batch_dims = int(attrs.get("batch_dims", 0))
    if batch_dims != 0:
        raise NotImplementedError("GatherND with batch_dims != 0")
    k = indices.shape[-1]
    flat = indices.reshape(-1, k)
    out = np.stack([data[tuple(i)] for i in flat]) if len(flat) else np.zeros((0,) + data.shape[k:], data.dtype)
    return out.reshape(indices.shape[:-1] + data.shape[k:])


def _constant_of_shape(attrs, shape):
    value = attrs.get("value")
    value = np.zeros(1, np.float32) if value is None else np.asarray(value)
    return np.full([int(d) for d in shape], value.reshape(-1)[0], dtype=value.dtype)


def _expand(attrs, x, shape):
    target = np.broadcast_shapes(x.shape, tuple(int(d) for d in shape))
    return np.broadcast_to(x, target).copy()


def _flatten(attrs, x):
    axis = int(attrs.get("axis", 1))
    axis = axis + x.ndim if axis < 0 else axis  # axis == rank is legal: [prod(shape), 1]
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def _cumsum(attrs, x, axis):
    axis = int(np.asarray(axis).reshape(-1)[0]) % max(x.ndim, 1)
    if attrs.get("reverse", 0):
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis, dtype=x.dtype)
    if attrs.get("exclusive", 0):
        out = out - x
    return np.flip(out, axis) if attrs.get("reverse", 0) else out


def _div(attrs, a, b):
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        return (np.trunc(a / b)).astype(a.dtype)
    return (a / b).astype(a.dtype)


def _log(attrs, x):
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) = -inf, as in ONNX (buckets: then not taken)
        return np.log(x)


def _cast(attrs, x):
    with np.errstate(invalid="ignore"):  # -inf to an integer (a bucket Where then discards it)
        return x.astype(ONNX_DTYPES[int(attrs["to"])])


def _clip(attrs, x, lo=None, hi=None):
    lo = attrs.get("min") if lo is None else lo  # opset < 11: bounds as attributes
    hi = attrs.get("max") if hi is None else hi
    out = x if lo is None else np.maximum(x, np.asarray(lo, x.dtype))
    return out if hi is None else np.minimum(out, np.asarray(hi, x.dtype))


HOST_IMPLS: dict[str, Callable] = {
    "Identity": lambda attrs, x: x,
    "Shape": lambda attrs, x: np.array(x.shape, dtype=np.int64)[attrs.get("start", 0):attrs.get("end")],
    "Gather": _gather,
    "GatherND": _gather_nd,
    "GatherElements": lambda attrs, data, idx: np.take_along_axis(
        data, np.where(idx < 0, idx + data.shape[int(attrs.get("axis", 0))], idx).astype(np.int64),
        axis=int(attrs.get("axis", 0))),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": lambda attrs, *xs: np.concatenate(xs, axis=int(attrs["axis"])),
    "Slice": lambda attrs, *xs: _slice(attrs, *xs),
    "Cast": _cast,
    "Range": lambda attrs, s, l, d: np.arange(s.item(), l.item(), d.item()).astype(np.asarray(s).dtype),
    "ConstantOfShape": _constant_of_shape,
    "Equal": lambda attrs, a, b: np.equal(a, b),
    "Greater": lambda attrs, a, b: np.greater(a, b),
    "GreaterOrEqual": lambda attrs, a, b: np.greater_equal(a, b),
    "Less": lambda attrs, a, b: np.less(a, b),
    "LessOrEqual": lambda attrs, a, b: np.less_equal(a, b),
    "And": lambda attrs, a, b: np.logical_and(a, b),
    "Or": lambda attrs, a, b: np.logical_or(a, b),
    "Not": lambda attrs, a: np.logical_not(a),
    "Where": lambda attrs, c, a, b: np.where(c, a, b).astype(np.result_type(a, b)),
    "Expand": _expand,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Max": lambda attrs, *xs: np.maximum.reduce(np.broadcast_arrays(*xs)),
    "Min": lambda attrs, *xs: np.minimum.reduce(np.broadcast_arrays(*xs)),
    "Add": lambda attrs, a, b: (a + b).astype(a.dtype),
    "Sub": lambda attrs, a, b: (a - b).astype(a.dtype),
    "Mul": lambda attrs, a, b: (a * b).astype(a.dtype),
    "Div": _div,
    "Neg": lambda attrs, a: -a,
    "CumSum": _cumsum,  # RoBERTa's position ids: cumsum(input_ids != pad) * mask + pad
    "Transpose": lambda attrs, x: np.transpose(x, attrs.get("perm")),
    # relative-position buckets (MPNet, T5-style) and sliding-window masks (ModernBERT): |i - j|, log
    "Abs": lambda attrs, x: np.abs(x),
    "Log": _log,
    "Sign": lambda attrs, x: np.sign(x),
    "Ceil": lambda attrs, x: np.ceil(x),
    "Floor": lambda attrs, x: np.floor(x),
    "Clip": _clip,
    "Tile": lambda attrs, x, repeats: np.tile(x, [int(r) for r in np.asarray(repeats).reshape(-1)]),  # GPT-J's sin/cos
}


def eval_host_op(op: str, attrs: Mapping, inputs: Sequence[np.ndarray | None]) -> np.ndarray:
    """Evaluate one host op; trailing optional inputs may be None."""
    impl = HOST_IMPLS.get(op)
    if impl is None:
        raise NotImplementedError(f"host op {op} has no numpy implementation")
    args = list(inputs)
    while args and args[-1] is None:
        args.pop()
    out = impl(dict(attrs), *[None if a is None else np.asarray(a) for a in args])
    return np.asarray(out)


def eval_host_nodes(nodes, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run host-tier `nodes` (in topological order) over `env` (graph inputs and constants)."""
    for node in nodes:
        try:
            env[node.outputs[0]] = eval_host_op(node.op, node.attrs, [env[i] if i else None for i in node.inputs])
        except KeyError as missing:
            raise KeyError(f"host node {node.name!r} ({node.op}) needs value {missing} which was not provided") from None
    return env
