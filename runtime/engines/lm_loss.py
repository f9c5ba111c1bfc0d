"""The causal-LM loss without a second vocabulary-sized copy of the logits (numpy, any engine).

The loss of a (micro-)batch is sum over positions of w * (logsumexp(z) - z[id]) (ir.ops'
``TokenCrossEntropy``: ids are the next tokens, w is 1/the batch's count of targets where counted,
else 0). The logits z are [B, S, V]: for SmolLM2 (V = 49152) at batch 4 x 128 that is 100 MB, the
largest activation of the model, and a naive lowering holds several copies (the logits, the
softmax, its gradient, an engine's cached copy). Two kernels avoid that:

* `LinearCrossEntropy` fuses the LM head's projection with the loss (the head and the loss on one
  stage, the usual case): logits are computed `CHUNK_BYTES` at a time for the rows that have a
  target (rows of weight 0, prompt tokens and padding, contribute exactly 0 to the loss and to
  every gradient, so they are skipped), and the gradients of the hidden state and of the weight
  are accumulated chunk by chunk in the same pass. No [B, S, V] array exists at any time.
* `token_cross_entropy` / `token_cross_entropy_grad`: the loss alone over given logits (the loss
  on its own stage, or evaluation); the gradient is written into the logits array itself, so the
  stage holds one copy.

Rows are processed in float32 (as the engines compute), with the loss summed in float64. The
kernels are exact rewrites of the unfused computation, up to float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# one chunk of logits: ~170 rows of a 49152-token vocabulary (or of a quantized head's widened rows)
CHUNK_BYTES = 32 << 20
# the weight gradient is accumulated this many bytes of it at a time: numpy has no in-place GEMM
# (C += A B), and a whole-weight temporary per chunk would be a second weight-sized array
_ACCUMULATE_BYTES = 8 << 20


def chunk_rows(vocab: int, chunk_bytes: int | None = None) -> int:
    """Rows of logits per chunk (`chunk_bytes`, default the module's CHUNK_BYTES read at call time)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return max(8, int(chunk_bytes // (4 * max(1, vocab))))


def _softmax_rows(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """z (float32 [c, V]) turned into softmax(z) in place; returns (z, logsumexp per row, float64)."""
    top = z.max(axis=1, keepdims=True)
    np.subtract(z, top, out=z)
    np.exp(z, out=z)
    total = z.sum(axis=1, dtype=np.float64)
    z /= total.astype(np.float32)[:, None]
    return z, np.log(total) + top[:, 0].astype(np.float64)


def token_cross_entropy(logits: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> float:
    """sum(w * (logsumexp(logits) - logits[id])) over all positions, chunk by chunk."""
    z = np.asarray(logits).reshape(-1, logits.shape[-1])
    ids, w = np.asarray(ids).reshape(-1), np.asarray(weights, np.float32).reshape(-1)
    rows = np.nonzero(w)[0]
    total = 0.0
    step = chunk_rows(z.shape[1])
    for lo in range(0, len(rows), step):
        r = rows[lo:lo + step]
        part = z[r].astype(np.float32)
        picked = part[np.arange(len(r)), ids[r]].astype(np.float64)
        _, lse = _softmax_rows(part)
        total += float(np.dot(w[r].astype(np.float64), lse - picked))
    return total


def token_cross_entropy_grad(logits: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                             scale: float = 1.0) -> np.ndarray:
    """d loss / d logits = scale * w * (softmax(logits) - onehot(id)), written into `logits` (which
    must be a writable float32 array; it is returned) so no second copy is made."""
    if logits.dtype != np.float32 or not logits.flags.writeable or not logits.flags.c_contiguous:
        logits = np.ascontiguousarray(logits, np.float32).copy()
    z = logits.reshape(-1, logits.shape[-1])
    ids, w = np.asarray(ids).reshape(-1), np.asarray(weights, np.float32).reshape(-1) * np.float32(scale)
    rows = np.nonzero(w)[0]
    zero = np.nonzero(w == 0)[0]
    z[zero] = 0.0
    step = chunk_rows(z.shape[1])
    for lo in range(0, len(rows), step):
        r = rows[lo:lo + step]
        part, _ = _softmax_rows(z[r])
        part[np.arange(len(r)), ids[r]] -= 1.0
        part *= w[r][:, None]
        z[r] = part
    return logits


def _accumulate(dw: np.ndarray, z: np.ndarray, hr: np.ndarray, transposed: bool) -> None:
    """dw += z^T hr ([V, H], transposed) or hr^T z ([H, V]), a block of vocabulary rows at a time."""
    vocab = z.shape[1]
    step = max(1, _ACCUMULATE_BYTES // (4 * hr.shape[1]))
    for lo in range(0, vocab, step):
        hi = min(vocab, lo + step)
        if transposed:
            dw[lo:hi] += z[:, lo:hi].T @ hr
        else:
            dw[:, lo:hi] += hr.T @ z[:, lo:hi]


@dataclass
class LinearCrossEntropyResult:
    loss: float
    grad_hidden: np.ndarray | None  # [..., H] like the hidden state
    grad_weight: np.ndarray | None  # like the weight


class LinearCrossEntropy:
    """The LM head (logits = h W^T, or h W with `transposed` False) fused with the token loss.

    `weight` is [V, H] when `transposed` (PyTorch's Linear layout and a tied embedding table) else
    [H, V]. `__call__` returns the loss and, with `grad`, the gradients of h and of W, computed in
    the same pass over the target rows (module docstring)."""

    def __init__(self, transposed: bool, chunk_bytes: int | None = None):
        self.transposed = transposed
        self.chunk_bytes = chunk_bytes

    def logits(self, hidden: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """The full logits (evaluation only: one [.., V] array). A head held quantized
        (`ir.precision.QuantizedTensor`, storage [V, H] in both layouts) is widened a chunk of
        vocabulary rows at a time (`quantized_logits`), never whole."""
        if hasattr(weight, "widen_range"):
            return quantized_logits(hidden, weight, self.chunk_bytes)
        return hidden @ (weight.T if self.transposed else weight)

    def __call__(self, hidden: np.ndarray, weight: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 grad: bool = True, weight_grad: bool = True,
                 weight_grad_into: np.ndarray | None = None) -> LinearCrossEntropyResult:
        """`weight_grad` False (a frozen head weight, LoRA) skips the weight's gradient and its GEMM.
        `weight_grad_into` (float32, the weight's shape, writable): the weight's gradient added into it
        chunk by chunk, in place (a running sum), and none returned: no second weight-sized array."""
        h = np.asarray(hidden, np.float32).reshape(-1, hidden.shape[-1])
        vocab = weight.shape[0] if self.transposed else weight.shape[1]
        ids, w = np.asarray(ids).reshape(-1), np.asarray(weights, np.float32).reshape(-1)
        rows = np.nonzero(w)[0]
        total = 0.0
        dh = np.zeros_like(h) if grad else None
        if weight_grad_into is not None and weight_grad_into.shape != weight.shape:
            raise ValueError(f"a weight gradient of shape {weight.shape} added into an array of shape "
                             f"{weight_grad_into.shape}")
        dw = None
        if grad and weight_grad:
            dw = np.zeros(weight.shape, np.float32) if weight_grad_into is None else weight_grad_into
        wt = weight.T if self.transposed else weight  # [H, V] view
        step = chunk_rows(vocab, self.chunk_bytes)
        for lo in range(0, len(rows), step):
            r = rows[lo:lo + step]
            hr = h[r]
            z = hr @ wt
            picked = z[np.arange(len(r)), ids[r]].astype(np.float64)
            z, lse = _softmax_rows(z)
            total += float(np.dot(w[r].astype(np.float64), lse - picked))
            if not grad:
                continue
            z[np.arange(len(r)), ids[r]] -= 1.0
            z *= w[r][:, None]
            dh[r] = z @ wt.T
            if dw is not None:
                _accumulate(dw, z, hr, self.transposed)
        if grad:
            dh = dh.reshape(hidden.shape)
        return LinearCrossEntropyResult(total, dh, None if weight_grad_into is not None else dw)


def quantized_logits(hidden: np.ndarray, weight, chunk_bytes: int | None = None) -> np.ndarray:
    """hidden [.., H] @ W^T for a head held quantized ([V, H] storage rows), float32 [.., V]: the
    rows of W widened `chunk_bytes` at a time into one buffer (as `quantized_linear_cross_entropy`
    widens them), each chunk's logits written into the output."""
    h = np.asarray(hidden, np.float32).reshape(-1, np.asarray(hidden).shape[-1])
    vocab = weight.rows
    out = np.empty((h.shape[0], vocab), np.float32)
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    step = int(min(vocab, max(64, budget // (4 * max(weight.cols, 1)))))
    buffer = np.empty(step * weight.codes.shape[1] * (2 if weight.storage == "int4" else 1), np.float32) \
        if weight.storage in ("int8", "int4") else None
    for lo in range(0, vocab, step):
        hi = min(vocab, lo + step)
        chunk = weight.widen_range(lo, hi, buffer).astype(np.float32, copy=False)
        np.matmul(h, chunk.T, out=out[:, lo:hi])
    return out.reshape(*np.asarray(hidden).shape[:-1], vocab)


def quantized_linear_cross_entropy(hidden: np.ndarray, weight, ids: np.ndarray, weights: np.ndarray,
                                   grad: bool = True, chunk_bytes: int | None = None) -> LinearCrossEntropyResult:
    """`LinearCrossEntropy` for a frozen LM head held quantized (`ir.precision.QuantizedTensor`,
    whose storage layout is [V, H] for both head layouts: its blocks run along H), by vocabulary chunk
    (`_by_vocabulary`): each chunk of rows widened into one buffer (a fresh chunk-sized array each time
    cost page faults), once per micro-batch (its widening was most of an int4 stage's loss when the
    pass ran twice: SmolLM2 0.28 -> 1.25 s a step). No weight gradient (the head is frozen)."""
    buffer = np.empty(_vocabulary_step(weight.rows, weight.cols, hidden, weights, chunk_bytes)
                      * weight.codes.shape[1] * (2 if weight.storage == "int4" else 1), np.float32) \
        if weight.storage in ("int8", "int4") else None
    return _by_vocabulary(hidden, ids, weights, grad, weight.rows, weight.cols, chunk_bytes,
                          lambda lo, hi: weight.widen_range(lo, hi, buffer))


def frozen_linear_cross_entropy(hidden: np.ndarray, weight: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                                transposed: bool, grad: bool = True, chunk_bytes: int | None = None,
                                after_chunk=None) -> LinearCrossEntropyResult:
    """`LinearCrossEntropy` for a frozen float head (LoRA's base: [V, H] when `transposed`, else [H, V]) by
    vocabulary chunk (`_by_vocabulary`): each row of the table read once per pass, a chunk's rows after another,
    where `LinearCrossEntropy` splits by target rows and each piece reads every row of the table. `after_chunk(
    view)` is called with each chunk of the table once read (the engine gives a mapped table's pages back there:
    the table resident a chunk at a time, not whole; a Qwen2.5-0.5B-class tied table is 519 MiB:
    benchmarks/MEMORY_NOTES.md, helpers h165, h171)."""
    vocab, cols = (weight.shape if transposed else weight.shape[::-1])

    def chunk(lo: int, hi: int) -> np.ndarray:
        return weight[lo:hi] if transposed else weight[:, lo:hi].T  # [rows, H], a view

    def read(lo: int, hi: int) -> None:
        if after_chunk is not None:
            after_chunk(weight[lo:hi] if transposed else weight[:, lo:hi])

    return _by_vocabulary(hidden, ids, weights, grad, vocab, cols, chunk_bytes, chunk, read)


def vocabulary_chunk_rows(vocab: int, hidden: int, targets: int, itemsize: int, chunk_bytes: int | None = None) -> int:
    """Vocabulary rows per chunk of a frozen head's fused loss (here, and PyTorch's
    `runtime.engines.pytorch._FrozenLinearCrossEntropy`): so many that the larger of the table's rows [rows, H] and
    their logits [targets, rows] is `chunk_bytes` (`CHUNK_BYTES`), at least 64 (`planner.cost.head_table_chunk`
    charges the same rows)."""
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return int(min(vocab, max(64, budget // (itemsize * max(targets, hidden, 1)))))


def _vocabulary_step(vocab: int, cols: int, hidden: np.ndarray, weights: np.ndarray, chunk_bytes: int | None) -> int:
    """`vocabulary_chunk_rows` for the numpy kernels: computed in `hidden`'s float dtype, over its weighted rows."""
    itemsize = 8 if np.asarray(hidden).dtype == np.float64 else 4
    return vocabulary_chunk_rows(vocab, cols, int(np.count_nonzero(np.asarray(weights))), itemsize, chunk_bytes)


def _by_vocabulary(hidden: np.ndarray, ids: np.ndarray, weights: np.ndarray, grad: bool, vocab: int, cols: int,
                   chunk_bytes: int | None, chunk_of, read=None) -> LinearCrossEntropyResult:
    """The fused head + loss over a frozen head a chunk of vocabulary rows at a time (`chunk_of(lo, hi)`:
    its rows [hi - lo, H]), one pass: a running logsumexp per target row (the online softmax), each row's
    target logit picked, and with `grad` the running sum(exp(z - top) W_chunk), rescaled as `top` rises, and
    each target's own row of W copied out of its chunk, so the hidden gradient w * (softmax - onehot) W =
    w * (acc / total - W[ids]) is made in the pass. `read(lo, hi)` after each chunk's use. The target rows are
    not gathered from the table after the pass: on a mapping each such read faulted in a large folio's pages
    around its row (26 rows of a 7.3 MiB table mapped 4.8 MiB of it, helper h171). Computes in `hidden`'s float
    dtype (float64 for the engines' oracles), the loss summed in float64."""
    dt = np.float64 if np.asarray(hidden).dtype == np.float64 else np.float32
    h = np.asarray(hidden, dt).reshape(-1, hidden.shape[-1])
    ids, w = np.asarray(ids).reshape(-1), np.asarray(weights, dt).reshape(-1)
    rows = np.nonzero(w)[0]
    hr, ids_r, w_r = h[rows], ids[rows].astype(np.int64), w[rows]
    count = len(rows)
    step = _vocabulary_step(vocab, cols, hidden, weights, chunk_bytes)
    top = np.full(count, -np.inf, dt)
    total = np.zeros(count, np.float64)
    picked = np.zeros(count, np.float64)
    at = np.arange(count)
    acc = np.zeros_like(hr) if grad else None
    target = np.zeros_like(hr) if grad else None  # W[ids], row by row as each chunk holds it
    for lo in range(0, vocab, step):
        hi = min(vocab, lo + step)
        chunk = chunk_of(lo, hi).astype(dt, copy=False)
        z = hr @ chunk.T
        new_top = np.maximum(top, z.max(axis=1))
        rescale = np.exp((top - new_top).astype(np.float64))
        inside = (ids_r >= lo) & (ids_r < hi)
        picked[inside] = z[at[inside], ids_r[inside] - lo]
        np.subtract(z, new_top[:, None], out=z)
        np.exp(z, out=z)
        total = total * rescale + z.sum(axis=1, dtype=np.float64)
        if acc is not None:
            acc *= rescale.astype(dt)[:, None]
            acc += z @ chunk
            target[inside] = chunk[ids_r[inside] - lo]
        top = new_top
        del z, chunk
        if read is not None:
            read(lo, hi)
    lse = np.log(total) + top.astype(np.float64)
    loss = float(np.dot(w_r.astype(np.float64), lse - picked))
    if not grad:
        return LinearCrossEntropyResult(loss, None, None)
    acc /= total.astype(dt)[:, None]
    acc -= target
    acc *= w_r[:, None]
    dh = np.zeros_like(h)
    dh[rows] = acc
    return LinearCrossEntropyResult(loss, dh.reshape(np.asarray(hidden).shape), None)
