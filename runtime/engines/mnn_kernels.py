"""Differentiable MNN building blocks for the MNN stage engine.

This is the only module in Confidant that imports MNN.  Everything above it
(the stage engine that runs a slice of a BERT-class model forward and
backward) sees MNN ``Var`` objects, builds graphs from the functions here,
and gets gradients back as numpy arrays.  The functions exist because the
obvious MNN Python API gives silently wrong or missing gradients:

* PyMNN evaluates eagerly unless ``lazy_eval(True)`` is set; eager results
  are frozen constants and ``Grad`` then finds nothing to differentiate.
* The ``MNN.expr`` wrappers insert float-to-float ``Cast`` ops, and ``Cast``
  has no gradient, so gradients stop there without an error.  The raw
  bindings (``_mnncengine._expr``) are used instead.
* The fused LayerNorm op and the erf form of GELU have no usable gradient
  (``gelu`` is the tanh approximation), so both are composed here.
* A 3-D activation times a ``(1, K, N)`` weight gets a wrongly shaped weight
  gradient; weights stay 2-D and the activation is flattened to 2-D.
* Reading gradients one by one re-runs the shared backward graph for every
  read; :class:`GradientProgram` reads all of them through one concat.
* ``Var.read()`` returns a view into memory the Var owns; :func:`read`
  always copies.

Two process-wide settings are made at import, before anything creates an
MNN executor or thread pool: denormal flushing (MNN's worker threads inherit
the main thread's MXCSR, and denormals from a -10000 attention mask make the
backward several times slower) and lazy evaluation.

Hazards the caller must know:

* Weight versions.  A backward graph reads the *current* contents of the
  Vars it was built from.  Writing new weights into a Var after the forward
  and before the backward makes the backward use the new weights.  Keep one
  set of Vars per weight version when a backward must see the old ones.
* Thread count.  A graph is bound to the thread count in force when it is
  first evaluated; :func:`set_threads` affects graphs evaluated afterwards,
  never graphs that already ran.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap
from typing import Sequence

import numpy as np

from runtime.engines import fpmode

_DENORMALS_FLUSHED = fpmode.enable_flush_denormals()



def _import_quietly():
    """Import MNN's native module with fd 1 muted: it printf()s a CPU-feature line on import,
    which would corrupt machine-readable output such as `confidant backends --json`."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        import _mnncengine._expr as expr
        import _mnncengine._optim as optim
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    return expr, optim


R, _optim = _import_quietly()  # must follow the MXCSR setup

R.lazy_eval(True)

Var = R.Var

__all__ = [
    "Var",
    "constant",
    "placeholder",
    "trainable",
    "write",
    "shrink",
    "read",
    "matmul",
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "relu",
    "pow_scalar",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "erf",
    "tanh",
    "reduce_sum",
    "reduce_mean",
    "softmax",
    "log_softmax",
    "layer_norm",
    "rms_norm",
    "gelu",
    "sigmoid",
    "silu",
    "rotary",
    "expand",
    "slice_axis",
    "concat",
    "transpose",
    "reshape",
    "softmax_cross_entropy",
    "GradientProgram",
    "gradients",
    "set_threads",
    "get_threads",
    "available_backends",
    "denormals_flushed_at_import",
]

_NP_TO_MNN = {np.dtype(np.float32): R.float, np.dtype(np.int32): R.int}


def denormals_flushed_at_import() -> bool:
    """Whether FTZ/DAZ were set before MNN was imported (False off x86-64 glibc)."""
    return _DENORMALS_FLUSHED


# --------------------------------------------------------------------------
# Creating, writing and reading Vars
# --------------------------------------------------------------------------

def _as_array(value, dtype=None) -> np.ndarray:
    arr = np.asarray(value)
    if dtype is not None:
        arr = arr.astype(dtype, copy=False)
    elif arr.dtype.kind in "iub":
        arr = arr.astype(np.int32, copy=False)
    else:
        arr = arr.astype(np.float32, copy=False)
    if arr.dtype not in _NP_TO_MNN:
        raise TypeError(f"MNN Vars hold float32 or int32, not {arr.dtype}")
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return arr


def constant(value) -> Var:
    """A constant Var holding a copy of ``value`` (float data as float32, integers as int32)."""
    arr = _as_array(value)
    return R.const(arr, list(arr.shape), R.NCHW, _NP_TO_MNN[arr.dtype])


def placeholder(shape: Sequence[int], dtype=np.float32) -> Var:
    """An input Var of ``shape`` whose contents are set (repeatedly) with :func:`write`."""
    dt = np.dtype(dtype)
    if dt not in _NP_TO_MNN:
        raise TypeError(f"placeholders hold float32 or int32, not {dt}")
    return R.placeholder([int(s) for s in shape], R.NCHW, _NP_TO_MNN[dt])


def trainable(value) -> Var:
    """A trainable float32 Var initialised with a copy of ``value``.

    Gradients can be taken with respect to it and :func:`write` replaces its
    contents in place (see the weight-version hazard in the module docstring).
    """
    var = constant(_as_array(value, np.float32))
    var.fix_as_trainable()
    return var


def write(var: Var, value) -> None:
    """Copy ``value`` into ``var``; graphs that depend on it recompute on their next read.

    A placeholder whose shape differs from ``value`` is resized first.
    """
    dtype = np.float32 if var.dtype == R.float else np.int32
    arr = _as_array(value, dtype)
    if list(arr.shape) != list(var.shape):
        var.resize(list(arr.shape))
    var.write(arr)


def shrink(var: Var) -> None:
    """Resize the placeholder ``var`` to one row of its last dimension without evaluating anything:
    MNN then lets go of the buffers of every graph that reads it (the block's output and its forward's
    and gradient program's intermediates, ~1.1 and ~1.3 MiB a SmolLM2 layer at 1 x 128), which it
    otherwise keeps until the Vars die. The next :func:`write` of a full-sized value resizes it back
    (and the graphs plan their buffers anew at their next read)."""
    shape = list(var.shape)
    if len(shape) >= 2:
        var.resize([1] * (len(shape) - 1) + [shape[-1]])


class _VarMemory:
    """The array interface of a Var's own memory, holding the Var: an array made from it keeps the
    Var (and so the memory) alive, where MNN's bare view would dangle once the Var is gone."""

    def __init__(self, var: Var):
        self.var = var
        self.__array_interface__ = dict(var.read().__array_interface__)


def memory_of(var: Var) -> np.ndarray:
    """A writable numpy array over ``var``'s own memory (no copy). Writing into it changes the Var;
    graphs re-read it when they next recompute, which every write of one of their inputs causes."""
    arr = np.asarray(_VarMemory(var))
    if not arr.flags.writeable:
        raise RuntimeError("MNN gave a read-only view of a trainable Var")
    return arr


def frozen_view_of(var: Var) -> np.ndarray:
    """A read-only numpy array over a constant Var's own memory (no copy), keeping the Var alive:
    what a caller holds in place of the array the Var was built from, so a frozen weight is held
    once (MNN's const copies what it is given, and its Python binding cannot build over memory)."""
    arr = np.asarray(_VarMemory(var))
    arr.flags.writeable = False
    return arr


def shares_memory(var: Var, arr: np.ndarray) -> bool:
    """Whether ``arr`` (from :func:`memory_of`) still lies over the Var's memory."""
    return var.read().__array_interface__["data"][0] == arr.__array_interface__["data"][0]


def read(var: Var) -> np.ndarray:
    """Evaluate ``var`` and return a copy of its value (MNN's own view dies with the Var)."""
    return np.array(var.read(), copy=True)


def _var(x) -> Var:
    return x if isinstance(x, Var) else constant(_as_array(x, np.float32))


# --------------------------------------------------------------------------
# Differentiable operations
# --------------------------------------------------------------------------

def matmul(a: Var, b: Var, trans_b: bool = False) -> Var:
    """``a @ b`` (``a @ b.T`` with ``trans_b``).

    ``b`` is either a 2-D weight, with ``a`` of any rank >= 2 (the leading
    dimensions are flattened so the weight gradient stays 2-D and the GEMM is
    one large call), or a tensor of the same rank as ``a`` for batched
    products such as attention scores ``Q @ K^T`` and ``P @ V``.
    """
    a_shape, b_shape = list(a.shape), list(b.shape)
    if len(b_shape) == 2 and len(a_shape) > 2:
        k = a_shape[-1]
        n = b_shape[0] if trans_b else b_shape[1]
        flat = R.matmul(R.reshape(a, [-1, k]), b, False, trans_b)
        return R.reshape(flat, a_shape[:-1] + [n])
    if len(a_shape) != len(b_shape):
        raise ValueError(f"matmul of ranks {len(a_shape)} and {len(b_shape)}: use a 2-D weight "
                         "or operands of equal rank")
    return R.matmul(a, b, False, trans_b)


def add(a, b) -> Var:
    """``a + b`` with numpy broadcasting; either side may be a Python or numpy constant."""
    return R.add(_var(a), _var(b))


def sub(a, b) -> Var:
    """``a - b`` with numpy broadcasting."""
    return R.subtract(_var(a), _var(b))


def mul(a, b) -> Var:
    """``a * b`` with numpy broadcasting."""
    return R.multiply(_var(a), _var(b))


def div(a, b) -> Var:
    """``a / b`` with numpy broadcasting."""
    return R.divide(_var(a), _var(b))


def neg(x: Var) -> Var:
    """``-x`` (keeps the shape, unlike multiplying by a constant, which would make a 0-d Var 1-d)."""
    return R.negative(x)


def pow_scalar(x: Var, exponent: float) -> Var:
    """``x ** exponent`` for a constant exponent.

    Small whole exponents (2, 3: GPT-2's tanh-GELU cube) are products, exact for negative x too;
    otherwise MNN's gradient is ``exponent * x ** (exponent - 1)`` except at ``x == 0`` with a
    fractional or negative exponent, where it returns 0 or NaN.
    """
    if exponent == 2.0:
        return R.multiply(x, x)
    if exponent == 3.0:
        return R.multiply(x, R.multiply(x, x))
    return R.pow(x, constant(np.float32(exponent)))


def sqrt(x: Var) -> Var:
    """Element-wise square root."""
    return R.sqrt(x)


def rsqrt(x: Var) -> Var:
    """Element-wise ``1 / sqrt(x)``."""
    return R.rsqrt(x)


def exp(x: Var) -> Var:
    """Element-wise exponential."""
    return R.exp(x)


def log(x: Var) -> Var:
    """Element-wise natural logarithm."""
    return R.log(x)


def erf(x: Var) -> Var:
    """Element-wise error function."""
    return R.erf(x)


def tanh(x: Var) -> Var:
    """Element-wise hyperbolic tangent."""
    return R.tanh(x)


def relu(x: Var) -> Var:
    """Element-wise max(x, 0) (gradient 1 where x > 0, else 0)."""
    return R.relu(x, 0.0)


def _axes(axes) -> list[int]:
    if isinstance(axes, int):
        return [axes]
    return [int(a) for a in axes]


def reduce_sum(x: Var, axes=(), keepdims: bool = False) -> Var:
    """Sum over ``axes`` (all axes when empty)."""
    return R.reduce_sum(x, _axes(axes), keepdims)


def reduce_mean(x: Var, axes=(), keepdims: bool = False) -> Var:
    """Mean over ``axes`` (all axes when empty)."""
    return R.reduce_mean(x, _axes(axes), keepdims)


def softmax(x: Var, axis: int = -1) -> Var:
    """Softmax along ``axis``."""
    return R.softmax(x, axis)


def _stop_gradient(x: Var) -> Var:
    # MNN's autodiff has no rule for Cast, so a float-to-float Cast passes the
    # value and blocks the gradient; MNN has no public stop-gradient op.
    return R.cast(x, R.float)


def log_softmax(x: Var, axis: int = -1) -> Var:
    """Numerically stable ``log(softmax(x))`` along ``axis``.

    The row maximum is subtracted for stability and held constant for the
    gradient: the result does not depend on it mathematically, and MNN's
    ReduceMax gradient is wrong (the arg-max gets 1 divided by the number of
    maxima taken instead of 1), so letting it through would only add noise.
    """
    shifted = R.subtract(x, _stop_gradient(R.reduce_max(x, [axis], True)))
    return R.subtract(shifted, R.log(R.reduce_sum(R.exp(shifted), [axis], True)))


def layer_norm(x: Var, scale: Var, bias: Var, eps: float = 1e-12) -> Var:
    """LayerNorm over the last axis, composed from differentiable ops.

    MNN's fused LayerNorm has no gradient.  Uses the biased variance, as
    PyTorch and BERT do; ``scale`` and ``bias`` have the last axis's length.
    """
    centered = R.subtract(x, R.reduce_mean(x, [-1], True))
    variance = R.reduce_mean(R.multiply(centered, centered), [-1], True)
    normed = R.multiply(centered, R.rsqrt(R.add(variance, constant(np.float32(eps)))))
    return R.add(R.multiply(normed, scale), bias)


def mean_last(x: Var) -> Var:
    """Mean over the last axis (kept, as size 1) as a product with a column of 1/n: MNN's
    ``reduce_mean`` sums in plain float32 order (relative error ~2e-6 over 576 values, 6x numpy's),
    which over a 30-layer decoder's residual stream of magnitude ~1e4 cost 4x the logits error of
    float32 PyTorch; the GEMM's blocked sum is as exact as numpy's."""
    shape = [int(d) for d in x.shape]
    n = shape[-1]
    column = constant(np.full((n, 1), 1.0 / n, np.float32))
    return R.reshape(R.matmul(R.reshape(x, [-1, n]), column, False, False), shape[:-1] + [1])


def rms_norm(x: Var, scale: Var, eps: float = 1e-6, offset: float = 0.0) -> Var:
    """RMSNorm over the last axis (Llama's): ``x / sqrt(mean(x^2) + eps) * scale``, composed;
    Gemma's multiplies by ``scale + offset`` (offset 1)."""
    mean_square = mean_last(R.multiply(x, x))
    if offset:
        scale = R.add(scale, constant(np.float32(offset)))
    return R.multiply(R.multiply(x, R.rsqrt(R.add(mean_square, constant(np.float32(eps))))), scale)


def sigmoid(x: Var) -> Var:
    """Element-wise logistic function (the raw binding: no Cast, a correct gradient)."""
    return R.sigmoid(x)


def silu(x: Var) -> Var:
    """``x * sigmoid(x)`` (SiLU / swish, the gate of Llama's SwiGLU MLP)."""
    return R.multiply(x, R.sigmoid(x))


def _axis(x: Var, axis: int) -> int:
    return int(axis) % len(x.shape)


def rotary(x: Var, cos: Var, sin: Var) -> Var:
    """Rotary position embedding with rotate-half: ``x * cos + concat(-x2, x1) * sin``, where x1, x2
    are the two halves of the last axis (HF's Llama). MNN's ``split`` and ``concat`` have
    gradients (its ``slice`` does not)."""
    last = len(x.shape) - 1
    half = int(x.shape[-1]) // 2
    x1, x2 = R.split(x, [half, half], last)
    return R.add(R.multiply(x, cos), R.multiply(R.concat([R.negative(x2), x1], last), sin))


def expand(x: Var, shape: Sequence[int]) -> Var:
    """``x`` broadcast to ``shape`` (grouped-query attention's repeated key/value heads); the
    gradient sums over the repeats."""
    return R.broadcast_to(x, constant(np.asarray([int(d) for d in shape], np.int32)))


def slice_axis(x: Var, axis: int, start: int, end: int) -> Var:
    """``x[..., start:end, ...]`` along ``axis`` (strided_slice: it has a gradient, ``slice`` not)."""
    shape = [int(d) for d in x.shape]
    axis = _axis(x, axis)
    begin = [0] * len(shape)
    stop = list(shape)
    begin[axis], stop[axis] = int(start), int(end)
    return R.strided_slice(x, constant(np.asarray(begin, np.int32)), constant(np.asarray(stop, np.int32)),
                           constant(np.ones(len(shape), np.int32)), 0, 0, 0, 0, 0)


def concat(xs: Sequence[Var], axis: int) -> Var:
    """``xs`` joined along ``axis``."""
    return R.concat(list(xs), _axis(xs[0], axis))


_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def erf_gelu(x: Var) -> tuple[Var, Var]:
    """The exact (erf) GELU and its erf term, which the engine caches for the backward: MNN's erf
    costs 8-10x its tanh or exp (benchmarks/mnn_ops.py), and the gradient needs it again."""
    inner = R.erf(R.multiply(x, constant(np.float32(_SQRT_HALF))))
    half_x = R.multiply(x, constant(np.float32(0.5)))
    return R.multiply(half_x, R.add(inner, constant(np.float32(1.0)))), inner


def gelu(x: Var, approximate: str = "none") -> Var:
    """GELU as in PyTorch: the exact erf form (``"none"``, BERT's) or the tanh approximation."""
    if approximate == "none":
        return erf_gelu(x)[0]
    if approximate == "tanh":
        cubic = R.multiply(R.multiply(x, R.multiply(x, x)), constant(np.float32(0.044715)))
        inner = R.tanh(R.multiply(R.add(x, cubic), constant(np.float32(_SQRT_2_OVER_PI))))
    else:
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    half_x = R.multiply(x, constant(np.float32(0.5)))
    return R.multiply(half_x, R.add(inner, constant(np.float32(1.0))))


def transpose(x: Var, perm: Sequence[int]) -> Var:
    """Permute the axes of ``x``."""
    return R.transpose(x, [int(p) for p in perm])


def reshape(x: Var, shape: Sequence[int]) -> Var:
    """Reshape ``x`` (one dimension may be -1); ``[]`` makes a one-element Var 0-d."""
    shape = [int(s) for s in shape]
    if not shape:
        # MNN's Reshape to [] crashes the process; a full reduction of one
        # element gives the same 0-d value and gradient.
        if int(np.prod(x.shape, dtype=np.int64)) != 1:
            raise ValueError(f"cannot reshape a Var of shape {x.shape} to []")
        return R.reduce_sum(x, [], False)
    return R.reshape(x, shape)


def softmax_cross_entropy(logits: Var, targets: Var) -> Var:
    """``-sum(targets * log_softmax(logits, -1))`` over all elements, as a 0-d Var.

    ``targets`` has the logits' shape (one-hot rows, soft labels, or rows of
    zeros for ignored positions); dividing by the number of counted
    positions is the caller's choice.
    """
    return R.negative(R.reduce_sum(R.multiply(targets, log_softmax(logits, -1)), [], False))


# --------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------

class GradientProgram:
    """Gradients of several outputs with respect to several Vars, read in one pass.

    ``build`` creates the backward graph once; ``run`` evaluates it and may be
    called again after :func:`write` has put new values into placeholders
    (inputs, output gradients) or trainable Vars, which is much cheaper than
    building a new graph per step.  All gradients are flattened, concatenated
    and read with a single evaluation, then split in numpy: reading them one
    by one would re-run the shared part of the backward for each read.
    """

    def __init__(self) -> None:
        self._built = False
        self._flat: Var | None = None  # the one gradient, flattened (None: several, or none)
        self._pieces: list[Var] = []
        self._wrt_shapes: list[tuple[int, ...]] = []
        self._received: list[bool] = []

    def build(self, outputs: Sequence[Var], output_grads: Sequence[Var],
              wrt: Sequence[Var]) -> "GradientProgram":
        """Build the backward graph of ``outputs`` seeded with ``output_grads``.

        ``output_grads[i]`` has the shape of ``outputs[i]``; make it a
        placeholder to feed a new upstream gradient each step.  A Var in
        ``wrt`` that receives no gradient gets zeros from :meth:`run`.
        """
        outputs, output_grads, wrt = list(outputs), list(output_grads), list(wrt)
        if len(outputs) != len(output_grads):
            raise ValueError(f"{len(outputs)} outputs but {len(output_grads)} output gradients")
        for out, grad in zip(outputs, output_grads):
            if list(out.shape) != list(grad.shape):
                raise ValueError(f"output of shape {out.shape} seeded with a gradient of shape "
                                 f"{grad.shape}")
        self._wrt_shapes = [tuple(int(s) for s in v.shape) for v in wrt]

        # MNN returns gradients only for the Vars that received one, in
        # ``wrt`` order, as new Python objects; unique temporary names tell
        # which ones they are.  The Vars' own names are restored afterwards.
        old_names = [v.name for v in wrt]
        try:
            for i, v in enumerate(wrt):
                v.name = f"__confidant_wrt_{i}"
            tags = [v.name for v in wrt]
            got_vars, got_grads = _optim.Grad().grad(outputs, output_grads, wrt)
            got = list(zip([g.name for g in got_vars], got_grads))
        finally:
            for v, name in zip(wrt, old_names):
                v.name = name

        grads: list[Var | None] = []
        j = 0
        for tag in tags:
            if j < len(got) and got[j][0] == tag:
                grads.append(got[j][1])
                j += 1
            else:
                grads.append(None)
        if j != len(got):
            raise RuntimeError("could not match MNN's gradients to the requested Vars")

        pieces = []
        self._received = []
        for grad, shape in zip(grads, self._wrt_shapes):
            if grad is None:
                self._received.append(False)
                continue
            if tuple(int(s) for s in grad.shape) != shape:
                raise RuntimeError(f"MNN produced a gradient of shape {grad.shape} for a Var of "
                                   f"shape {list(shape)}")
            self._received.append(True)
            pieces.append(R.reshape(grad, [-1]))
        # Several gradients are read as one concatenation, built anew at each run and let go after
        # the read: a Var keeps the value it was last evaluated to, so one concatenation kept per
        # program held a second copy of every block's gradients for the engine's life (SmolLM2 full
        # fine-tuning: ~800 MiB of a 3482 MiB peak).
        self._pieces = pieces
        self._flat = pieces[0] if len(pieces) == 1 else None
        self._built = True
        return self

    @property
    def received(self) -> list[bool]:
        """For each ``wrt`` Var, whether MNN produced a gradient for it (else :meth:`run` gives zeros)."""
        return list(self._received)

    def run(self) -> list[np.ndarray]:
        """Evaluate the gradients with the current contents of all Vars; one array per ``wrt`` Var."""
        if not self._built:
            raise RuntimeError("GradientProgram.run() before build()")
        if self._flat is not None:
            flat = read(self._flat)
        elif self._pieces:
            concatenated = R.concat(self._pieces, 0)
            flat = read(concatenated)
            del concatenated
        else:
            flat = np.zeros(0, np.float32)
        result = []
        offset = 0
        for shape, received in zip(self._wrt_shapes, self._received):
            if received:
                size = int(np.prod(shape, dtype=np.int64))
                result.append(flat[offset:offset + size].reshape(shape))
                offset += size
            else:
                result.append(np.zeros(shape, np.float32))
        return result


def gradients(outputs: Sequence[Var], output_grads: Sequence[Var],
              wrt: Sequence[Var]) -> list[np.ndarray]:
    """One-off gradients: ``GradientProgram().build(...).run()``."""
    return GradientProgram().build(outputs, output_grads, wrt).run()


# --------------------------------------------------------------------------
# Execution settings
# --------------------------------------------------------------------------

_CPU = 0  # MNNForwardType: CPU=0, METAL=1, CUDA=2, OPENCL=3, OPENGL=6, VULKAN=7
_PRECISION_NORMAL = 0
_threads = 1


def set_threads(n: int) -> None:
    """Use ``n`` CPU threads for graphs evaluated from now on.

    A graph keeps the thread count it was first evaluated with, so call this
    before building the graphs of a stage.  Worker threads inherit the
    calling thread's denormal flushing; call from the main thread.
    """
    global _threads
    n = int(n)
    if n < 1:
        raise ValueError(f"thread count must be >= 1, not {n}")
    R.set_global_executor_config(_CPU, _PRECISION_NORMAL, n)
    _threads = n


def get_threads() -> int:
    """The thread count last set with :func:`set_threads` (MNN's default is 1)."""
    return _threads


_BACKENDS = {"cpu": "CPU", "opencl": "OPENCL", "vulkan": "VULKAN", "metal": "METAL", "cuda": "CUDA"}

# Runs in a child process: it builds a one-op model, runs it on the requested
# backend and prints a marker with the result.  MNN's only sign of a missing
# backend is a "Can't Find type=N backend, use 0 instead" line on stdout
# (printf, not stderr) before it silently runs on the CPU.
_PROBE = textwrap.dedent("""
    import os, sys, tempfile
    import numpy as np
    import MNN
    import _mnncengine._expr as R
    x = R.placeholder([1, 4], R.NCHW, R.float)
    x.name = "x"
    y = R.relu(x)
    y.name = "y"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "probe.mnn")
        R.save([y], path)
        net = MNN.Interpreter(path)
        session = net.createSession({"backend": sys.argv[1], "numThread": 1})
        inp = net.getSessionInput(session)
        src = MNN.Tensor((1, 4), MNN.Halide_Type_Float,
                         np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32),
                         MNN.Tensor_DimensionType_Caffe)
        inp.copyFrom(src)
        net.runSession(session)
        out = net.getSessionOutput(session)
        host = MNN.Tensor((1, 4), MNN.Halide_Type_Float,
                          np.zeros((1, 4), np.float32), MNN.Tensor_DimensionType_Caffe)
        out.copyToHostTensor(host)
        values = np.array(host.getData(), np.float32).ravel().tolist()
    sys.stdout.flush()
    print("CONFIDANT_PROBE", values, flush=True)
""")


def _start_probe(mnn_name: str) -> subprocess.Popen | None:
    try:
        return subprocess.Popen([sys.executable, "-c", _PROBE, mnn_name], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    except OSError:
        return None


def _probe_succeeded(proc: subprocess.Popen | None, timeout: float) -> bool:
    if proc is None:
        return False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False
    log = out + err
    if proc.returncode != 0 or "Can't Find type=" in log or "use 0 instead" in log:
        return False
    return "CONFIDANT_PROBE [0.0, 2.0, 0.0, 4.0]" in out


@functools.lru_cache(maxsize=1)
def available_backends(timeout: float = 60.0) -> dict[str, bool]:
    """Which MNN backends really run here: ``{"cpu", "opencl", "vulkan", "metal", "cuda"} -> bool``.

    Each backend is tried in its own child process (all at once), so that a
    failing GPU driver cannot disturb this process, and a backend MNN falls
    back from (to the CPU, with only a log line) is reported as absent.  The
    result is cached for the life of the process.
    """
    procs = {name: _start_probe(mnn_name) for name, mnn_name in _BACKENDS.items()}
    return {name: _probe_succeeded(proc, timeout) for name, proc in procs.items()}


def release_memory() -> None:
    """Hand MNN's cached buffers back to the system (used before memory measurements)."""
    R.gc(True)


# --------------------------------------------------------------------------
# Frozen weights held quantized (ir.precision): widened inside the graph
# --------------------------------------------------------------------------

def widened_weight(q) -> Var:
    """`widened_weight_parts(q)`'s expression."""
    return widened_weight_parts(q)[0]


def widened_weight_parts(q) -> tuple[Var, dict[str, Var]]:
    """The float32 weight of an `ir.precision.QuantizedTensor` (int8 or int4) as a graph expression
    over MNN constants that hold its codes as uint8 (MNN's wrapper has no int8 Var: int8 codes are
    held offset by 128; int4 codes two to a byte as stored) and its block scales (and int4's
    offsets) as float32 (no float16 Var either). Each evaluation of a graph reading it widens the
    weight into a temporary that MNN's executor does not keep: measured, a layer's forward+backward holds one widened
    weight at a time, not one per graph (runtime/engines/MNN_BACKWARD.md)."""
    rows = q.codes.shape[0]
    raw = q.codes if q.storage == "int4" else (q.codes.astype(np.int16) + 128).astype(np.uint8)
    held = R.const(np.ascontiguousarray(raw), list(raw.shape), R.NCHW, R.uint8)
    codes = R.cast(held, R.int)
    if q.storage == "int4":
        sixteen = R.const(np.array([16], np.int32), [1], R.NCHW, R.int)
        low, high = R.floormod(codes, sixteen), R.floordiv(codes, sixteen)  # the lower nibble first
        codes = R.reshape(R.concat([R.reshape(low, [rows, -1, 1]), R.reshape(high, [rows, -1, 1])], 2), [rows, -1])
        values = R.cast(codes, R.float)
    elif q.storage == "int8":
        values = R.cast(codes, R.float) - 128.0
    else:
        raise ValueError(f"MNN widens int8 and int4 weights in its graphs, not {q.storage}")
    scales = q.scales.astype(np.float32)[:, :, None]
    scale = R.const(np.ascontiguousarray(scales), list(scales.shape), R.NCHW, R.float)
    blocks = R.reshape(values, [rows, -1, q.block]) * scale
    if q.mins is not None:  # int4: q * d + m
        mins = q.mins.astype(np.float32)[:, :, None]
        offset = R.const(np.ascontiguousarray(mins), list(mins.shape), R.NCHW, R.float)
        blocks = blocks + offset
    stored = R.reshape(blocks, [rows, -1])
    if stored.shape[1] != q.cols:
        stored = slice_axis(stored, 1, 0, q.cols)
    # and the constants it reads, by the QuantizedTensor field they hold: int4's uint8 codes are the
    # very bytes of `q.codes`, the float32 scales (and offsets) `q.scales` widened exactly, so a
    # caller can hold views of them in their place (`frozen_view_of`) and each is held once
    parts = {"codes": held, "scales": scale}
    if q.mins is not None:
        parts["mins"] = offset
    return (stored if q.axis == 1 else R.transpose(stored, [1, 0])), parts


def int4_halves_parts(q) -> tuple[tuple[Var, Var], dict[str, Var]]:
    """An int4 `QuantizedTensor`'s stored matrix ([other, blocked]) widened as its two halves along
    the blocked axis, each given transposed, [blocked / 2, other]: the values of the lower nibbles
    (blocked positions 0, 2, 4, ...) and of the upper ones (1, 3, 5, ...), with the constants read by
    QuantizedTensor field as `widened_weight_parts` gives them, but each held transposed (`codes` as
    [blocked / 2, other] bytes, `scales` and `mins` as [blocks, 1, other]; `transposed_view` gives
    the QuantizedTensor's layout back over them).

    Why so: widening into halves skips the interleaving concat that puts the nibbles back in order;
    the nibbles are taken by integer masks (MNN's integer floordiv and floormod cost twice as much, its
    float floor and arithmetic a quarter more); and transposed, each block's scale and offset broadcast
    along the middle axis of [blocks, block / 2, other], which MNN does 4x faster than along a last
    axis of one ([other, blocks, block / 2] by [other, blocks, 1]). A SmolLM2 MLP weight's product
    (128 tokens, one thread) 4.5 ms -> 3.8 by the masks -> 3.4 transposed (float32 2.6; MEMORY_NOTES).
    `int4_matmul` multiplies by the halves. The decoded values pass through a Cast (int to float),
    which stops MNN's gradient walk (nothing here needs one)."""
    rows = q.codes.shape[0]
    codes_t = np.ascontiguousarray(q.codes.T)  # [blocked / 2, other]; no copy if q.codes is a transposed view
    held = R.const(codes_t, list(codes_t.shape), R.NCHW, R.uint8)
    codes = R.cast(held, R.int)
    # the upper nibble left 16 times its value, the 16 folded into its scales
    low = R.bitwise_and(codes, R.const(np.array([15], np.int32), [1], R.NCHW, R.int))
    high16 = R.bitwise_and(codes, R.const(np.array([240], np.int32), [1], R.NCHW, R.int))
    scales = np.ascontiguousarray(q.scales.astype(np.float32).T[:, None, :])  # [blocks, 1, other]
    scale = R.const(scales, list(scales.shape), R.NCHW, R.float)
    scale16 = R.multiply(scale, constant(np.float32(1 / 16)))  # exact; block-sized, made per widening, not held
    mins = np.ascontiguousarray(q.mins.astype(np.float32).T[:, None, :])
    offset = R.const(mins, list(mins.shape), R.NCHW, R.float)
    halves = tuple(R.reshape(R.add(R.multiply(R.reshape(R.cast(v, R.float), [-1, q.block // 2, rows]), s), offset),
                             [-1, rows]) for v, s in ((low, scale), (high16, scale16)))
    return halves, {"codes": held, "scales": scale, "mins": offset}


def transposed_view(held: np.ndarray, shape) -> np.ndarray:
    """A QuantizedTensor field of `shape` ([other, n]) over memory `int4_halves_parts` holds transposed
    (n before other, any axes of one between): the same values, a strided view, no copy."""
    rows, n = (int(d) for d in shape)
    return held.reshape(n, rows).T


def int4_splits(q, trans_b: bool) -> bool:
    """Whether `int4_matmul` can multiply by `q` (2-D int4, no padding along the blocked axis, an even
    block): else the caller widens it whole (`widened_weight_parts`)."""
    return (getattr(q, "storage", None) == "int4" and q.mins is not None and len(q.shape) == 2 and q.block % 2 == 0
            and q.cols % 2 == 0 and q.codes.shape[1] * 2 == q.cols)


# Up to this many elements an int4 weight blocked along the contraction is multiplied by its stacked halves in
# one GEMM; a larger one by x's even and odd columns, two GEMMs of half the depth (`int4_matmul`).
INT4_STACKED_MAX_ELEMENTS = 1 << 19


def int4_matmul(x: Var, halves: tuple[Var, Var], q, trans_b: bool) -> Var:
    """``x @ W`` (``x @ W.T`` with ``trans_b``) for an int4 W given as `int4_halves_parts`' (transposed) halves. Where
    W is blocked along the contraction and has at most `INT4_STACKED_MAX_ELEMENTS` elements, one GEMM of
    the full depth: the halves stacked ([the lower nibbles' rows; the upper ones'], W's rows in
    even-then-odd order) and x's columns put in that order by one activation-sized transpose. That beats
    two GEMMs of half the depth by x's even and odd columns, summed (their split, second GEMM and sum cost
    a SmolLM2 attention weight 0.1-0.4 ms a product at 128 tokens, more than the concat); a larger W
    (an MLP's) takes those two GEMMs, as the concat's weight-sized output raised a SmolLM2 step's
    training peak ~1 MiB (benchmarks/mnn_int4_widening.py, MEMORY_NOTES h73). Blocked along the
    output, each half makes the even or odd output columns, interleaved after (an activation-sized
    concat, not a weight-sized one)."""
    low, high = halves
    x_shape = [int(d) for d in x.shape]
    k = x_shape[-1]
    flat = R.reshape(x, [-1, k])
    blocked_is_k = (q.axis == 0) != bool(trans_b)  # stored is [other, blocked]; W is stored or its transpose
    if blocked_is_k and int(low.shape[0]) * int(low.shape[1]) * 2 <= INT4_STACKED_MAX_ELEMENTS:
        in_halves_order = R.reshape(R.transpose(R.reshape(flat, [-1, k // 2, 2]), [0, 2, 1]), [-1, k])
        y = R.matmul(in_halves_order, R.concat([low, high], 0), False, False)
    elif blocked_is_k:
        even, odd = R.split(R.reshape(flat, [-1, k // 2, 2]), [1, 1], 2)
        even, odd = R.reshape(even, [-1, k // 2]), R.reshape(odd, [-1, k // 2])
        y = R.add(R.matmul(even, low, False, False), R.matmul(odd, high, False, False))
    else:
        ye, yo = R.matmul(flat, low, False, True), R.matmul(flat, high, False, True)
        n = int(ye.shape[-1])
        y = R.reshape(R.concat([R.reshape(ye, [-1, n, 1]), R.reshape(yo, [-1, n, 1])], 2), [-1, 2 * n])
    return R.reshape(y, x_shape[:-1] + [int(y.shape[-1])])
