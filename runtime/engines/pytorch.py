"""PyTorch stage engine (optional extra): interprets the IR with torch ops and autograd.

It is the laptop/GPU engine of later issues and, in float64, the independent gradient oracle the
MNN engine is tested against. Importing this module requires torch; the runtime never does unless
this engine is chosen.

The causal-LM loss never holds a second vocabulary-sized copy of the logits: with the LM head on
the stage, `_LinearCrossEntropy` fuses the head's projection into it (logits a chunk of target rows
at a time, forward and backward; `runtime.engines.lm_loss` is the numpy twin the MNN engine uses);
alone, `_TokenCrossEntropy` writes its gradient over the logits it saved.
"""
from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ir.graph import Node, use_def
from ir.mapped_pages import drop_pages_under, gather_rows, give_back_pages, mapping_of, read_only_mappings
from ir.ops import REMADE_FROM_INPUTS
from ir.precision import QuantizedTensor, stored_arrays
from runtime.engines.attention_sites import AttentionUnit, attention_units
from runtime.engines.base import RowGradient, StageEngine, StageGradients, accumulate, own_array, rows_at
from runtime.engines.lm_loss import chunk_rows, quantized_linear_cross_entropy, vocabulary_chunk_rows
from runtime.engines.stage import StageSpec, fused_lm_head, host_values, looked_up_only
from runtime.heap import steady_heap
from runtime.library_pages import drop_library_pages
from runtime.optim import AdamW, AdamWStep

# Every process that runs a torch stage (a worker, the profile's fresh children, which fork from a
# server that imported this module, the profiling process) fixes glibc's mmap threshold here, before
# its stage's first tensor: with glibc's rising threshold a stage's peak moved ~6% run to run with
# the order of allocations (SmolLM2's middle torch stage 467-495 MiB on one plan), at 2 MiB it repeats
# within ~1% and sits ~35 MiB lower, for ~8% more CPU (runtime.heap; MEMORY_NOTES.md, helper h57)
steady_heap()
# ... and gives back the pages of torch's libraries that only their loading read (~80 MiB, of which
# a stage's training maps ~35 again: runtime.library_pages; MEMORY_NOTES.md, helper h85). Here, at the
# import, alike in a worker, the profile's fresh children and the profiling process, so the runtime's
# and the engine's terms of a plan are measured as a worker holds them.
LIBRARY_PAGES_GIVEN_BACK = drop_library_pages()  # bytes, at this import


def _shifted(scale: torch.Tensor, offset: float | None) -> torch.Tensor:
    """An RMSNorm's scale plus its offset (Gemma's 1 + w); the scale itself without one."""
    return scale + offset if offset else scale


def _run_node(node: Node, args: list[torch.Tensor]) -> torch.Tensor:
    op, a = node.op, node.attrs
    if op == "Gather":
        return F.embedding(args[1].long(), args[0])
    if op == "MatMul":
        b = args[1].transpose(-1, -2) if a.get("trans_b") else args[1]
        return torch.matmul(args[0], b)
    if op == "Add":
        return args[0] + args[1]
    if op == "Sub":
        return args[0] - args[1]
    if op == "Mul":
        return args[0] * args[1]
    if op == "Div":
        return args[0] / args[1]
    if op == "Pow":
        return args[0] ** a["exponent"]
    if op == "Sqrt":
        return torch.sqrt(args[0])
    if op == "Erf":
        return torch.erf(args[0])
    if op == "Tanh":
        return torch.tanh(args[0])
    if op == "Relu":
        return torch.relu(args[0])
    if op == "ReduceMean":
        return args[0].mean(dim=tuple(a["axes"]), keepdim=bool(a.get("keepdims", True)))
    if op == "Softmax":
        return torch.softmax(args[0], dim=a["axis"])
    if op == "LayerNorm":
        return F.layer_norm(args[0], (args[0].shape[-1],), args[1], args[2], a["epsilon"])
    if op == "Gelu":
        return F.gelu(args[0], approximate=a.get("approximate", "none"))
    if op == "Transpose":
        return args[0].permute(*a["perm"])
    if op == "Reshape":
        return args[0].reshape(*a["shape"])
    if op == "SoftmaxCrossEntropy":
        return -(args[1] * torch.log_softmax(args[0], dim=-1)).sum()
    if op == "RMSNorm":
        x = args[0]
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + a["epsilon"]) * _shifted(args[1], a.get("offset"))
    if op == "Sigmoid":
        return torch.sigmoid(args[0])
    if op == "Silu":
        return F.silu(args[0])
    if op == "Rotary":
        x, half = args[0], args[0].shape[-1] // 2
        return x * args[1] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * args[2]
    if op == "Expand":
        return args[0].expand(*a["shape"])
    if op == "Slice":
        return args[0].narrow(a["axis"], a["start"], a["end"] - a["start"])
    if op == "Concat":
        return torch.cat(list(args), dim=a["axis"])
    if op == "TokenCrossEntropy":
        return _TokenCrossEntropy.apply(args[0], args[1], args[2])
    raise NotImplementedError(f"torch engine: op {op} (node {node.name!r})")


def _target_rows(weights: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(weights.reshape(-1)).reshape(-1)


def _softmax_minus_onehot(z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w * (softmax(z) - onehot(ids)) for one chunk of rows, in place over z."""
    z.sub_(z.max(dim=1, keepdim=True).values).exp_()
    z.div_(z.sum(dim=1, keepdim=True))
    z[torch.arange(len(ids)), ids] -= 1.0
    return z.mul_(w[:, None])


def _chunk_loss(z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    picked = z[torch.arange(len(ids)), ids]
    return (w.double() * (torch.logsumexp(z, dim=1).double() - picked.double())).sum()


class _TokenCrossEntropy(torch.autograd.Function):
    """sum(w * (logsumexp(logits) - logits[id])), a chunk of target rows at a time; the backward
    writes the gradient into the saved logits (nothing else reads them after the loss)."""

    @staticmethod
    def forward(ctx, logits, ids, weights):
        z = logits.reshape(-1, logits.shape[-1])
        ids, w = ids.reshape(-1).long(), weights.reshape(-1).to(logits.dtype)
        rows = _target_rows(w)
        total = torch.zeros((), dtype=torch.float64)
        step = chunk_rows(z.shape[1])
        for lo in range(0, len(rows), step):
            r = rows[lo:lo + step]
            total += _chunk_loss(z[r], ids[r], w[r])
        ctx.save_for_backward(logits, ids, w)
        return total.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, ids, w = ctx.saved_tensors
        out = logits.detach()  # the same storage: the gradient replaces the logits
        z = out.reshape(-1, out.shape[-1])
        rows = _target_rows(w)
        scaled = w * grad
        z[w == 0] = 0.0
        step = chunk_rows(z.shape[1])
        for lo in range(0, len(rows), step):
            r = rows[lo:lo + step]
            z[r] = _softmax_minus_onehot(z[r], ids[r], scaled[r])
        return out, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """The LM head (h W^T, or h W) fused with the token loss: no [.., V] tensor ever exists; the
    backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, weights, transposed, into=None):
        h = hidden.reshape(-1, hidden.shape[-1])
        wt = weight.t() if transposed else weight
        ids, w = ids.reshape(-1).long(), weights.reshape(-1).to(hidden.dtype)
        rows = _target_rows(w)
        total = torch.zeros((), dtype=torch.float64)
        step = chunk_rows(wt.shape[1])
        for lo in range(0, len(rows), step):
            r = rows[lo:lo + step]
            total += _chunk_loss(h[r] @ wt, ids[r], w[r])
        ctx.save_for_backward(hidden, weight, ids, w)
        ctx.transposed = transposed
        ctx.into = into
        return total.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, ids, w = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        wt = weight.t() if ctx.transposed else weight
        dh = torch.zeros_like(h)
        dw = None
        if ctx.needs_input_grad[1]:
            # the running sum where the engine gives one (`_HeadSum`): the weight's gradient is added
            # into it chunk by chunk, and no second weight-sized array is made beside it
            dw = ctx.into.take(weight) if ctx.into is not None else None
            summed = dw is not None
            dw = torch.zeros_like(weight) if dw is None else dw
        rows = _target_rows(w)
        scaled = w * grad
        step = chunk_rows(wt.shape[1])
        for lo in range(0, len(rows), step):
            r = rows[lo:lo + step]
            z = _softmax_minus_onehot(h[r] @ wt, ids[r], scaled[r])
            dh[r] = z @ wt.t()
            if dw is not None:  # in place: no weight-sized temporary
                dw.addmm_(z.t(), h[r]) if ctx.transposed else dw.addmm_(h[r].t(), z)
        if dw is not None and summed:
            dw = None  # already in the sum: autograd gets no gradient for the weight from here
        return dh.reshape(hidden.shape), dw, None, None, None, None


class _FrozenLinearCrossEntropy(torch.autograd.Function):
    """The fused LM head and loss over a frozen float head (LoRA's base), a chunk of vocabulary rows at a
    time: one pass over the chunks keeps a running logsumexp per target row (the online softmax) and, when
    the hidden state needs a gradient, the running sum(exp(z - top) W_chunk), so the gradient of h,
    w * (softmax - onehot) W, is made in the forward and kept ([targets, H]); the backward reads no weight.
    Where the table lies on a read-only file mapping (`source`, the graph's array the tensor views: a base
    read mapped), each chunk's pages are given back once it is read (`drop_pages_under`), so the head holds
    one chunk of the table, not the table: `_LinearCrossEntropy` splits by target rows, each piece reading
    every row of the table (a Qwen2.5-0.5B-class tied table, 519 MiB, resident through the head's passes:
    benchmarks/MEMORY_NOTES.md, helpers h165, h167). The loss summed in float64."""

    @staticmethod
    def forward(ctx, hidden, ids, weights, table, transposed, source=None, chunk_bytes=None):
        want = ctx.needs_input_grad[0]
        dt = hidden.dtype
        h = hidden.detach().reshape(-1, hidden.shape[-1])
        ids, w = ids.reshape(-1).long(), weights.reshape(-1).to(dt)
        rows = _target_rows(w)
        hr, ids_r, w_r = h[rows], ids[rows], w[rows]
        vocab = table.shape[0] if transposed else table.shape[1]
        count = len(rows)
        step = vocabulary_chunk_rows(vocab, h.shape[1], count, table.element_size(), chunk_bytes)
        top = torch.full((count,), -math.inf, dtype=dt)
        total = torch.zeros(count, dtype=torch.float64)
        picked = torch.zeros(count, dtype=torch.float64)
        acc = torch.zeros_like(hr) if want else None
        for lo in range(0, vocab if count else 0, step):
            hi = min(vocab, lo + step)
            chunk = table[lo:hi].t() if transposed else table[:, lo:hi]  # [H, rows]
            z = hr @ chunk.to(dt)
            new_top = torch.maximum(top, z.max(dim=1).values)
            rescale = torch.exp((top - new_top).double())
            inside = ((ids_r >= lo) & (ids_r < hi)).nonzero().reshape(-1)
            picked[inside] = z[inside, ids_r[inside] - lo].double()
            z.sub_(new_top[:, None]).exp_()
            total = total * rescale + z.sum(dim=1, dtype=torch.float64)
            if acc is not None:
                acc.mul_(rescale.to(dt)[:, None]).addmm_(z, chunk.t().to(dt))
            top = new_top
            del z, chunk
            if source is not None:  # the chunk's pages of a mapped table go back: the next chunk's replace them
                drop_pages_under([source[lo:hi] if transposed else source[:, lo:hi]])
        lse = torch.log(total) + top.double()
        loss = (w_r.double() * (lse - picked)).sum()
        ctx.grad_hidden = None
        if want:
            if count:  # w * (acc / total - W[ids])
                target = table[ids_r] if transposed else table[:, ids_r].t()
                acc.div_(total.to(dt)[:, None]).sub_(target.to(dt)).mul_(w_r[:, None])
            dh = torch.zeros_like(h)
            dh[rows] = acc
            ctx.grad_hidden = dh.reshape(hidden.shape)
            if source is not None:
                drop_pages_under([source])  # the target rows' pages
        return loss.to(dt)

    @staticmethod
    def backward(ctx, grad):
        g, ctx.grad_hidden = ctx.grad_hidden, None  # one backward a forward
        return g * grad, None, None, None, None, None, None


class _HeadSum:
    """The running gradient sum a fused LM head adds its weight's gradient into during one backward
    (`TorchStageEngine.backward_into`): set before the backward, read by `_LinearCrossEntropy.backward`.
    The head's new gradient (vocabulary x hidden, 108 MiB for SmolLM2's tied head) was made beside the
    sum from the second micro-batch on, the last stage's peak (benchmarks/MEMORY_NOTES.md, h129/h131)."""

    def __init__(self):
        self.target: torch.Tensor | None = None
        self.added = False

    def take(self, weight: torch.Tensor) -> torch.Tensor | None:
        target = self.target
        if target is None or target.shape != weight.shape or target.dtype != weight.dtype:
            return None
        self.target, self.added = None, True  # once: a head run twice in one backward is not summed here
        return target


class _FrozenWeight:
    """A frozen weight held quantized (`ir.precision.QuantizedTensor`): its codes and scales as
    tensors sharing the numpy arrays' memory, widened to the engine's dtype on demand. Nothing
    keeps a widened copy: each product widens it, uses it, drops it."""

    def __init__(self, q: QuantizedTensor, dtype: torch.dtype):
        self.q, self.dtype = q, dtype
        codes = q.codes
        with warnings.catch_warnings():
            # arrays on a read-only mapping of a file that stores the base quantized (`load_model(mapped=True)`):
            # torch warns that writing through the view is undefined; nothing writes a frozen weight
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            self._codes = torch.from_numpy(codes.view(np.int16) if q.storage == "bfloat16" else codes)
            self._scales = torch.from_numpy(q.scales)
            self._mins = None if q.mins is None else torch.from_numpy(q.mins)

    def widen(self) -> torch.Tensor:
        """The whole weight in its logical layout (a transposed view where it is blocked along rows)."""
        q, c = self.q, self._codes
        if q.storage == "bfloat16":
            stored = c.view(torch.bfloat16).to(self.dtype)
        else:
            rows = c.shape[0]
            if q.storage == "int4":
                # each nibble cast straight into its place in the one float array (lower first), where
                # stacking them as bytes and casting that made two more weight-sized arrays: a SmolLM2
                # MLP weight 1.39 -> 0.88 ms, a third of the int4 product's widening (MEMORY_NOTES, h45)
                stored = torch.empty((rows, c.shape[1], 2), dtype=self.dtype)
                stored[:, :, 0] = c & 0x0F
                stored[:, :, 1] = c >> 4
            else:
                stored = c.to(self.dtype, memory_format=torch.contiguous_format)
            # q * d (+ m) in place: the same two roundings as before, so the same bits
            blocks = stored.view(rows, -1, q.block)
            blocks.mul_(self._scales.to(self.dtype)[:, :, None])
            if self._mins is not None:
                blocks.add_(self._mins.to(self.dtype)[:, :, None])
            stored = blocks.view(rows, -1)[:, :q.cols]
        return stored if q.axis == 1 else stored.t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a table blocked along its rows (an embedding lookup), widened."""
        out = self.q.widen_rows(ids.reshape(-1).numpy())
        return torch.from_numpy(out).to(self.dtype).reshape(*ids.shape, self.q.cols)


class _FrozenQuantizedMatMul(torch.autograd.Function):
    """x @ W (x @ W^T when `transposed`) for a frozen quantized W: the forward widens W, multiplies
    and drops it; the backward widens it again for the input's gradient. No weight gradient, and
    nothing saved but the handle: the product's memory is its output's. Under a per-block checkpoint
    (`keep_widened`) the backward takes the re-run's widening instead of widening once more."""

    @staticmethod
    def forward(ctx, x, weight: _FrozenWeight, transposed: bool, keep_widened: bool = False):
        ctx.weight, ctx.transposed = weight, transposed
        w = weight.widen()
        if keep_widened:
            # a per-block re-run (`_BlockRecompute`'s backward; its forward runs without a graph, so
            # that widening is dropped at once): the re-run's serves this product's backward, so a block's backward
            # widens each weight once, not twice. Held from the re-run to this product's backward: one
            # block's widened weights at most, in the per-block workspace a profile measures
            # (planner.memory_defaults.widened_bytes, the estimate's, is a block's whole widening)
            ctx.save_for_backward(w)
        return torch.matmul(x, w.t() if transposed else w)

    @staticmethod
    def backward(ctx, grad_y):
        saved = ctx.saved_tensors
        w = saved[0] if saved else ctx.weight.widen()
        return torch.matmul(grad_y, w if ctx.transposed else w.t()), None, None, None


class _QuantizedLinearCrossEntropy(torch.autograd.Function):
    """The fused LM head and loss over a frozen quantized head (`lm_loss.quantized_linear_cross_entropy`:
    the head widened a chunk of vocabulary rows at a time). The hidden state's gradient is computed in
    the forward's second pass when one is needed and kept ([rows, H], the hidden state's size)."""

    @staticmethod
    def forward(ctx, hidden, ids, weights, weight: _FrozenWeight):
        want = ctx.needs_input_grad[0]
        r = quantized_linear_cross_entropy(hidden.detach().numpy(), weight.q, ids.numpy(), weights.numpy(), grad=want)
        ctx.grad_hidden = None if r.grad_hidden is None else torch.from_numpy(r.grad_hidden)
        return torch.tensor(r.loss, dtype=hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.grad_hidden * grad, None, None, None


def _seed(out: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """A scalar whose gradient with respect to `out` is `grad` (ones without one), bit for bit:
    sum(out * grad), whose backward is 1.0 * grad. Handed to autograd with no grad_outputs, where
    giving `grad` as autograd's seed makes torch check its shape through
    torch.fx.experimental.symbolic_shapes, whose first import (sympy and mpmath, ~490 modules) held
    31 MiB of every torch worker from its first backward on (benchmarks/MEMORY_NOTES.md, helper h85)."""
    return out.sum() if grad is None else (out * grad).sum()


class _BlockRecompute(torch.autograd.Function):
    """One block's forward recomputed in its backward (per block): the forward runs without a graph
    and saves only the block's inputs that need a gradient (its input, its weights, a split
    backward's anchor); the backward runs the block's forward again on detached copies of them with
    gradients on and differentiates that. The same ops on the same inputs as keeping, so the same
    gradients bit for bit. Not `torch.utils.checkpoint`: its first call imports torch._dynamo (and
    so sympy), ~41-75 MiB held by every torch worker recomputing per block from its first step on
    (benchmarks/MEMORY_NOTES.md, helpers h105, h110). No RNG state is kept: no op the engine runs
    draws random numbers (checkpoint ran with preserve_rng_state=False too)."""

    @staticmethod
    def forward(ctx, run, *held):
        ctx.run = run
        ctx.save_for_backward(*held)
        return run(list(held), False)

    @staticmethod
    def backward(ctx, grad):
        held = ctx.saved_tensors
        run, ctx.run = ctx.run, None  # one backward a forward
        with torch.enable_grad():
            values = [t.detach().requires_grad_(True) for t in held]
            out = run(values, True)
            del held
            if not out.requires_grad:
                return (None, *(None for _ in values))
            grads = torch.autograd.grad([_seed(out, grad)], values, allow_unused=True)
        return (None, *grads)


@dataclass(frozen=True)
class _PendingWeightGrad:
    """What a deferred projection's weight gradient needs (zero-bubble W): its input and the
    gradient of its output, both [..., width]."""

    x: torch.Tensor
    grad_y: torch.Tensor
    weight: str
    bias: str | None
    transposed: bool


class _Remade:
    """A projection's input made again in its backward from what another node saves anyway:
    a GELU's output from the GELU's input, a LayerNorm's output from its input and weights (its
    backward reads the input, and keeps the statistics beside it), rather than holding the value from
    the forward to the backward too (MiniLM at 2 x 128: 1.5 MiB a layer a micro-batch for the FFN's
    second projection, 0.375 for each LayerNorm's output a projection reads; stage 0's forward under zb-h1
    saved 18.6 -> 15.6 MiB, 24.6 -> 15.6 unsplit: helper h144). One value's projections share one
    `_Remade`: the first backward among them makes it, the rest reuse it, and the last lets go of it (a
    W's pending items hold it from there), so q, k and v do not each hold a copy."""

    def __init__(self, node: Node, source: torch.Tensor):
        # source: the forward's value (weakly: the point is not to hold it), to tell a re-run's apart
        self.node, self.source = node, weakref.ref(source)
        self.readers, self.value = 0, None

    def make(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():  # the forward's value, bit for bit: the same kernel on the same inputs
                self.value = _run_node(self.node, list(args))
        value = self.value
        self.readers -= 1
        if self.readers == 0:
            self.value = None
        return value


class _DeferredLinear(torch.autograd.Function):
    """x @ W (x @ W^T when `transposed`) plus an optional bias, whose backward computes only the
    input gradient and leaves (x, dy) in `sink` for the weight gradients of a later W. `anchor` is a
    dummy leaf the B pass differentiates with respect to, so autograd runs every deferred node even
    where nothing before it needs a gradient (a LoRA adapter reading frozen embeddings). With a
    `remade` (`_Remade`), x is saved as the tensors `sources` it is made from, not itself."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, transposed, sink, names, remade=None, *sources):
        ctx.save_for_backward(weight, *((x,) if remade is None else sources))
        ctx.transposed, ctx.sink, ctx.names, ctx.remade = transposed, sink, names, remade
        ctx.x_needs_grad, ctx.sources = x.requires_grad, len(sources)
        if remade is not None:
            remade.readers += 1
        return F.linear(x, weight if transposed else weight.t(), bias)

    @staticmethod
    def backward(ctx, grad_y):
        weight, *held = ctx.saved_tensors
        x = held[0] if ctx.remade is None else ctx.remade.make(tuple(held))
        del held
        ctx.sink.append(_PendingWeightGrad(x.detach(), grad_y, ctx.names[0], ctx.names[1], ctx.transposed))
        dx = None
        if ctx.x_needs_grad:
            dx = grad_y @ weight if ctx.transposed else grad_y @ weight.t()
        return (dx, None, None, torch.zeros((), dtype=grad_y.dtype), None, None, None, None,
                *(None for _ in range(ctx.sources)))


class _WeightSums:
    """The running gradient sums a whole backward adds its products' weight gradients straight into
    (`TorchStageEngine._backward_summed`): set for that backward, read by `_RemadeLinear.backward`. A
    product by a weight whose sum is there adds x^T dy into it with one GEMM (`addmm_`, beta 1), where
    autograd made the gradient in a new array and the hook then added it into the sum: MiniLM's FFN
    weights' 2.25 MiB gradients were mapped fresh (over the engine's 2 MiB mmap threshold), their pages
    faulted in, written and read again, each micro-batch (2.8 -> 1.9 ms a weight alone; helper h149)."""

    def __init__(self):
        self.into: dict | None = None
        self.added: set[str] = set()

    def target(self, name: str | None, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """The sum of weight `name` as a tensor sharing its memory, or None (no sum yet, a row or read-only
        sum, another shape or dtype: the gradient then goes through autograd as before)."""
        acc = None if self.into is None or name is None else self.into.get(name)
        if (not isinstance(acc, np.ndarray) or not acc.flags.writeable or not acc.flags.c_contiguous
                or tuple(acc.shape) != tuple(shape)):
            return None
        t = torch.from_numpy(acc)
        if t.dtype != dtype:
            return None
        self.added.add(name)
        return t


class _RemadeLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) (weight [out, in]) for a whole backward (no W waits for its products).
    With a `remade` (`_Remade`) its x is saved as the tensors `sources` it is made from, not itself. With
    `sums` (`_WeightSums`) its weight's gradient is added straight into the weight's running sum where there
    is one (`name`: the weight's parameter)."""

    @staticmethod
    def forward(ctx, x, weight, bias, remade, sums, name, *sources):
        ctx.save_for_backward(weight, *((x,) if remade is None else sources))
        ctx.remade, ctx.sources, ctx.sums, ctx.name = remade, len(sources), sums, name
        if remade is not None:
            remade.readers += 1
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        weight, *held = ctx.saved_tensors
        x = held[0] if ctx.remade is None else ctx.remade.make(tuple(held))
        del held
        dx = grad_y @ weight if ctx.needs_input_grad[0] else None
        dw, db = _linear_weight_grads(ctx, x, grad_y, weight, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return (dx, dw, db, None, None, None, *(None for _ in range(ctx.sources)))


def _linear_weight_grads(ctx, x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor, want_w: bool,
                         want_b: bool) -> tuple:
    """(dw, db) of F.linear(x, weight, bias) for `_RemadeLinear` and `_GeluLinear`; dw None where it went
    into the weight's running sum (`ctx.sums`, `ctx.name`) or is not wanted."""
    gy = grad_y.reshape(-1, grad_y.shape[-1])
    dw = None
    if want_w:
        x = x.reshape(-1, x.shape[-1])
        # an ONNX [in, out] weight is read as its transpose: its gradient in the weight's own layout
        as_transpose = weight.stride(0) == 1 and weight.stride(1) != 1
        target = None if ctx.sums is None else ctx.sums.target(
            ctx.name, weight.shape[::-1] if as_transpose else weight.shape, weight.dtype)
        if target is not None:  # into the sum: autograd gets no gradient for the weight from here
            target.addmm_(x.t(), gy) if as_transpose else target.addmm_(gy.t(), x)
        else:
            # in the weight's own layout: the gradient autograd accumulates then needs no strided copy
            dw = (x.t() @ gy).t() if as_transpose else gy.t() @ x
    return dw, (gy.sum(0) if want_b else None)


class _GeluLinear(torch.autograd.Function):
    """F.linear(gelu(h), weight, bias) differentiated with respect to h, for a GELU whose output only this product
    reads (`a`, the forward's GELU output, given detached): the backward makes gelu(h) again (`remade`, as
    `_RemadeLinear`) and writes the GELU's gradient over the product's input gradient in place, where the GELU's
    own backward wrote a second [rows, 4 x hidden] array (MiniLM: 1.5 MiB a layer a micro-batch, most of them
    faulted in afresh; helper h149)."""

    @staticmethod
    def forward(ctx, h, a, weight, bias, remade, sums, name, approximate):
        ctx.save_for_backward(weight, h)
        ctx.remade, ctx.sums, ctx.name, ctx.approximate = remade, sums, name, approximate
        remade.readers += 1
        return F.linear(a, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        weight, h = ctx.saved_tensors
        a = ctx.remade.make((h,))
        dh = None
        if ctx.needs_input_grad[0]:
            da = grad_y @ weight
            dh = torch.ops.aten.gelu_backward.grad_input(da, h, approximate=ctx.approximate, grad_input=da)
        dw, db = _linear_weight_grads(ctx, a, grad_y, weight, ctx.needs_input_grad[2], ctx.needs_input_grad[3])
        return (dh, None, dw, db, None, None, None, None)


class _ReplayedLookup(torch.autograd.Function):
    """A lookup a recomputed forward does not run again: the rows the stage's first forward gathered
    (the table has been stepped in place since), with the lookup's own backward (aten's
    embedding_backward: it reads the ids, never the table), rows or dense as `as_rows` says."""

    @staticmethod
    def forward(ctx, table, ids, rows, as_rows):
        ctx.save_for_backward(ids)
        ctx.rows_of_table, ctx.as_rows = table.shape[0], as_rows
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        table_grad = torch.ops.aten.embedding_backward(grad, ids, ctx.rows_of_table, -1, False, ctx.as_rows)
        return table_grad, None, None, None


def _weight_grads(pending: list[_PendingWeightGrad], shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The deferred weight (and bias) gradients, summed per parameter."""
    out: dict[str, torch.Tensor] = {}
    for item in pending:
        x = item.x.reshape(-1, item.x.shape[-1])
        gy = item.grad_y.reshape(-1, item.grad_y.shape[-1])
        accumulate(out, {item.weight: (gy.t() @ x if item.transposed else x.t() @ gy).reshape(shapes[item.weight])})
        if item.bias is not None:
            accumulate(out, {item.bias: gy.sum(0)})
    return out


@dataclass(frozen=True)
class _Linear:
    """A MatMul by a 2-D weight whose only reader adds a 1-D bias: run as one F.linear."""

    matmul: Node
    add: str
    bias: str


_SKIP = object()  # `_defer`'s answer for a MatMul its fused bias Add computes


def _bias_fusions(spec: StageSpec, constants: set[str]) -> dict[str, _Linear]:
    """MatMul node name and Add node name -> the `_Linear` they make, for every projection of the
    stage whose product feeds nothing but its bias Add (and is not the stage's output)."""
    graph = spec.graph
    index = use_def(spec.compute_nodes)
    readers, producer = index.readers, index.producers
    out: dict[str, _Linear] = {}
    for add in spec.compute_nodes:
        if add.op != "Add" or len(add.inputs) != 2:
            continue
        for product, bias in (add.inputs, add.inputs[::-1]):
            mm = producer.get(product)
            if (mm is None or mm.op != "MatMul" or bias not in constants or product == spec.output
                    or len(readers.get(product, ())) != 1 or mm.inputs[1] not in constants):
                continue
            w_shape, b_shape = graph.values[mm.inputs[1]].shape, graph.values[bias].shape
            width = w_shape[0] if mm.attrs.get("trans_b") else w_shape[-1]
            if len(w_shape) == 2 and tuple(b_shape) == (width,):
                out[mm.name] = out[add.name] = _Linear(mm, add.name, bias)
                break
    return out


def fused_adamw(batch, hp: AdamWStep) -> None:
    """AdamW on [(weight, gradient, m, v), ...] (runtime.optim's arrays, seen as tensors sharing
    their memory) with PyTorch's fused kernel, in place: one vectorised pass per tensor where
    numpy makes a dozen. torch.optim.AdamW(fused=True)'s arithmetic, so its rounding, not numpy's."""
    weights, grads, ms, vs = ([torch.from_numpy(entry[i]) for entry in batch] for i in range(4))
    step = torch.tensor(float(hp.step))  # read, not advanced, by the kernel
    torch._fused_adamw_(weights, grads, ms, vs, [], [step] * len(weights), lr=hp.lr, beta1=hp.beta1,
                        beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False, maximize=False)


def _frozen_tensor(value: np.ndarray, dtype: torch.dtype, np_dtype) -> torch.Tensor:
    """A frozen constant as the engine reads it: a view of the graph's own array (`torch.from_numpy`)
    where it already is the engine's float dtype, C-contiguous and aligned, else a copy. Frozen
    weights are never written (no in-place op touches a constant; `set_parameters` replaces only
    trainable ones), so a stage holds a float base once, not twice: the copy was 72 MiB of a 516 MiB
    per-block stage (benchmarks/MEMORY_NOTES.md, h35, h42)."""
    arr = np.asarray(value)
    # an array on a mapping of the model file is viewed even where its offset in the file leaves it unaligned
    # (an ONNX file's raw data lies where protobuf puts it: 270 of SmolLM2's 513 MiB): x86 reads floats at any
    # address and the products' results are the same bits (tests/runtime/test_torch_mapped_base.py); a copy would
    # be anonymous memory that no page given back lets go of
    if arr.dtype == np_dtype and arr.flags.c_contiguous and (arr.flags.aligned or mapping_of(arr) is not None):
        with warnings.catch_warnings():
            # a mapped (read-only) array: torch warns that writing through the view is undefined;
            # nothing writes a frozen weight
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            return torch.from_numpy(arr)
    return torch.tensor(arr, dtype=dtype if arr.dtype.kind == "f" else torch.int64)


class TorchStageEngine(StageEngine):
    """The stage on PyTorch. `recompute`: a training forward keeps only its inputs (and the weight
    tensors it used) instead of autograd's graph of every activation, and its backward runs the
    forward again with gradients on (activation checkpointing over the whole stage): memory of one
    micro-batch's activations however many are in flight, for one more forward per backward.
    `per_block`: each block's forward runs under a checkpoint of its own (`_BlockRecompute`),
    so a micro-batch in flight holds only its blocks' inputs, and each block's backward runs that
    block's forward again: memory of one block's activations at a time, for one more forward per
    backward (the planner's `activations: per-block`). The planner chooses where keeping them does
    not fit (`planner.cost`). Gradients are the same every way: the same ops on the same inputs."""

    # zb-h1's first stage (`B.m W.m`): one whole backward summed as autograd completes each weight's gradient
    # (`_backward_summed`), never the B's (x, dy) of every projection held for the W (helpers h134, h144)
    joins_weight_passes = True
    # MiniLM zb-h1:torch worker 0 (2 processes, 4 micro-batches of 2 x 128): with the free heap given back after
    # each step's first backward 418-423 MB against 430-438 without, the step +1%; after every backward 414-416
    # but +7-10% a step (benchmarks/MEMORY_NOTES.md, helper h145 and the 2026-12-07 merge)
    releases_heap_each_step = True

    def __init__(self, spec: StageSpec, dtype: torch.dtype = torch.float32, threads: int | None = None,
                 weights: Mapping[str, np.ndarray] | None = None, recompute: bool = False, take_weights: bool = False,
                 fuse_attention: bool = True, native_step: bool = True, per_block: bool = False):
        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.dtype = dtype
        if recompute and per_block:
            raise ValueError("recompute (the whole stage's forward again) and per_block (each block's) are two "
                             "choices, not one")
        self.recompute = bool(recompute)
        self.per_block = bool(per_block)
        # AdamW's dense weights stepped by PyTorch's fused kernel (runtime.optim keeps the state):
        # a quarter of numpy's time, which 1f1b-stash pays after every backward
        self.native_step = bool(native_step) and dtype == torch.float32
        source = weights if weights is not None else spec.graph.constants
        # with take_weights a parameter shares the caller's array (torch.from_numpy): one copy of the weights
        np_dtype = np.float32 if dtype == torch.float32 else np.float64
        self._params = {p: torch.from_numpy(own_array(source[p], np_dtype, take_weights)).requires_grad_(True)
                        for p in spec.params}
        param_set = set(spec.params)
        self._consts = {}
        # frozen weights held quantized (LoRA's base under --base-dtype): widened per product
        self._frozen: dict[str, _FrozenWeight] = {}
        for n in spec.compute_nodes:
            for i in n.inputs:
                if i in spec.graph.constants and i not in param_set:
                    v = spec.graph.constants[i]
                    if isinstance(v, QuantizedTensor):
                        self._frozen[i] = _FrozenWeight(v, dtype)
                        continue
                    self._consts[i] = _frozen_tensor(v, dtype, np_dtype)
        # the read-only file mappings the frozen weights lie in (a base read mapped: `load_model(mapped=True)`):
        # their pages are given back after each block's forward and before each block's re-run, so a per-block
        # stage holds one block's frozen weights at a time (and the LM head's table from its backward to the
        # last layer's re-run), not the whole base; the next read faults them in again from the page cache
        # a base the file stores quantized (`export --base-dtype int4`) the same: its codes, scales and offsets are
        # views onto the mapping (`planner.onnx_weights.map_raw`'s stored pieces), widened per product from there
        self._mapped = read_only_mappings([spec.graph.constants[name] for name in self._consts]
                                          + [a for w in self._frozen.values() for a in stored_arrays(w.q)])
        self._block_ends = frozenset(nodes[-1].name for _, nodes in spec.block_nodes() if nodes)
        self._saved: dict[int, tuple] = {}
        # while a training forward runs: its `_Remade`s by value where backwards are not split (`_linear_of`),
        # and the inputs of each GELU and LayerNorm it ran by their output (`_remade`: the forward may have let
        # go of them in `env`; their own backward saves them anyway)
        self._remakes: dict | None = None
        self._made_from: dict[str, tuple] | None = None
        # set while a block's forward runs under its checkpoint (per block): see _FrozenQuantizedMatMul
        self._checkpointing = False
        # split backwards: per micro-batch, the deferred weight gradients B left for its W
        self._pending: dict[int, list[_PendingWeightGrad]] = {}
        # Weight stashing: a step with forwards in flight gives the stage new leaf tensors (their
        # autograd graphs hold the old ones). Tensors of versions no forward in flight holds any
        # more are reused for that (no fresh pages to fault in, 47 MB for MiniLM's table), and a
        # table that is only looked up is stepped in place: an embedding's backward reads its
        # indices, never the table's values (a forward re-run with `recompute` replays the rows its
        # first run gathered).
        self._retired: list[dict[str, torch.Tensor]] = []
        self._stepped_in_place = looked_up_only(spec)
        self._lm = fused_lm_head(spec.graph, spec.first_block, spec.last_block)
        # a frozen head's table on a read-only file mapping, viewed by the engine's tensor: the fused loss gives
        # its pages back a vocabulary chunk at a time (`_FrozenLinearCrossEntropy`)
        self._head_source = spec.graph.constants[self._lm.weight] \
            if self._lm is not None and self._lm.weight in self._consts and self._views_mapping(self._lm.weight) else None
        # frozen tables on a read-only file mapping that the engine's tensor views, looked up a file span of rows at a
        # time (`gather_rows`): read at once, a lookup faults in a page-cache folio around each row (up to 2 MiB in a
        # freshly written base.safetensors: 46-52 MiB of SmolLM2's table, helper h172), which stage 0 of a PyTorch
        # pipeline over a mapped float32 base held until its block's pages went back, 1.3 MiB over its plan (h178)
        self._mapped_tables = {
            n.inputs[0]: spec.graph.constants[n.inputs[0]] for n in spec.compute_nodes
            if n.op == "Gather" and n.inputs[0] in self._consts and self._views_mapping(n.inputs[0])}
        self._head_sum = _HeadSum()  # `backward_into`: the head's weight gradient added into the sum
        self._weight_sums = _WeightSums()  # `_backward_summed`: the products' weight gradients added into the sums
        self._linear = _bias_fusions(spec, set(self._params) | set(self._consts))  # never a quantized weight
        # GELU and LayerNorm nodes by their output: a deferred projection of one saves what the node's
        # own backward saves (its input, a LayerNorm's weights) and makes its output again (`_Remade`)
        self._remade_from = {n.outputs[0]: n for n in spec.compute_nodes if n.op in REMADE_FROM_INPUTS}
        # the GELUs whose output one product alone reads: under a summed whole backward that product differentiates
        # the GELU too (`_GeluLinear`)
        readers = use_def(spec.compute_nodes).readers
        self._gelu_read_once = {v for v, n in self._remade_from.items()
                                if n.op == "Gelu" and v != spec.output and len(readers.get(v, ())) == 1}
        # attention sites run as one scaled_dot_product_attention each (runtime.engines.attention_sites)
        self._units = attention_units(spec) if fuse_attention else {}
        self._unit_nodes = frozenset(n for u in self._units.values() for n in u.nodes)
        # per block: (block, its nodes, whether it runs as it is); the others run under a checkpoint.
        # A block with a lookup runs as it is (a table stepped in place would give a re-run other rows,
        # and its activations are the looked-up rows, its output), as does the LM head with its loss
        # (the fused loss keeps only its input, the head's hidden state)
        head = {self._lm.matmul.name, self._lm.loss.name} if self._lm is not None else set()
        self._last_reads = self._values_read_last()
        self._block_runs = [(b, nodes, any(n.op in ("Gather", "TokenCrossEntropy") or n.name in head for n in nodes))
                            for b, nodes in spec.block_nodes()]

    def _values_read_last(self) -> dict[str, tuple[str, ...]]:
        """By node, the values the stage's nodes make that a forward run node by node reads for the last time
        there (a fused unit's nodes read at the unit's last node, a MatMul fused with its bias at the Add, the
        fused LM head at its loss): `_run` lets each go there, so a forward holds autograd's saved tensors and the
        values still to be read, not every value it made (MiniLM LoRA at 8 x 32: 19.2 MiB a layer held until the
        forward ended, of which autograd saves 4.2; helper h136). The stage's output is kept."""
        runs_at = {n: u.at for u in self._units.values() for n in u.nodes}
        runs_at.update({lin.matmul.name: lin.add for lin in self._linear.values()})
        if self._lm is not None:
            runs_at[self._lm.matmul.name] = self._lm.loss.name
        nodes = self.spec.compute_nodes
        position = {n.name: k for k, n in enumerate(nodes)}
        made = {o for n in nodes for o in n.outputs} - {self.spec.output}
        last: dict[str, int] = {}
        for n in nodes:
            at = position[runs_at.get(n.name, n.name)]
            for i in n.inputs:
                if i in made:
                    last[i] = max(last.get(i, at), at)
        reads: dict[str, list[str]] = {}
        for value, k in last.items():
            reads.setdefault(nodes[k].name, []).append(value)
        return {name: tuple(values) for name, values in reads.items()}

    @property
    def fused_attention_blocks(self) -> tuple[int, ...]:
        """The blocks whose attention runs as one fused unit (the rest of the stage runs node by node)."""
        return tuple(sorted(u.block for u in self._units.values()))

    def _tensor(self, v: np.ndarray) -> torch.Tensor:
        v = np.asarray(v)
        return torch.tensor(v, dtype=self.dtype if v.dtype.kind == "f" else torch.int64)

    def forward(self, feeds, microbatch: int = 0, train: bool = True, until_block: int | None = None) -> np.ndarray:
        inputs: dict[str, torch.Tensor] = {k: self._tensor(v) for k, v in host_values(self.spec, feeds).items()}
        x_in = None
        if self.spec.activation_input is not None:
            x_in = self._tensor(feeds[self.spec.activation_input])
        params = dict(self._params)
        if train and self.recompute:
            if until_block is not None:
                raise ValueError("a training forward must run the whole stage")
            gathered: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                out = self._run(inputs, x_in, params, False, None, lookups=gathered)
            # what the backward runs the forward from: the rows of the tables stepped in place are
            # the ones this forward gathered (an update may have stepped the table since)
            self._saved[microbatch] = (inputs, x_in, params, gathered)
        else:
            deferral = self._deferral() if train else None
            out = self._run(inputs, x_in, params, train, until_block, deferral)
            if train:
                self._saved[microbatch] = (x_in, out, params, deferral)
        return out.detach().cpu().numpy().astype(np.float32 if self.dtype == torch.float32 else np.float64)

    def logits_at(self, feeds, until_block: int, positions) -> np.ndarray:
        if self._lm is None or until_block != self._lm.head_index:
            return super().logits_at(feeds, until_block, positions)
        # the head's projection of the chosen positions only: [rows, V] (or [rows, k, V]), never the
        # [rows, S, V] logits (SmolLM2 at 128 positions: 24 MiB a row)
        inputs = {k: self._tensor(v) for k, v in host_values(self.spec, feeds).items()}
        x_in = None if self.spec.activation_input is None else self._tensor(feeds[self.spec.activation_input])
        with torch.no_grad():
            hidden = self._run(inputs, x_in, dict(self._params), False, until_block, head_hidden=True)
            rows = hidden[tuple(torch.tensor(i) for i in rows_at(positions))]
            lm = self._lm
            if lm.weight in self._frozen:
                logits = _FrozenQuantizedMatMul.apply(rows, self._frozen[lm.weight], lm.transposed)
            else:
                w = self._params[lm.weight] if lm.weight in self._params else self._consts[lm.weight]
                logits = rows @ (w.t() if lm.transposed else w)
        return logits.cpu().numpy().astype(np.float32)

    def _deferral(self) -> tuple | None:
        """(anchor, sink, deferred names) for a training forward whose weight gradients a split
        backward computes later; None when backwards are not split."""
        if not self.split_backward:
            return None
        return torch.zeros((), dtype=self.dtype, requires_grad=True), [], set(), {}

    def _run(self, inputs: Mapping[str, torch.Tensor], x_in: torch.Tensor | None, params: Mapping[str, torch.Tensor],
             train: bool, until_block: int | None, deferral: tuple | None = None,
             lookups: dict[str, torch.Tensor] | None = None, head_hidden: bool = False) -> torch.Tensor:
        """The stage's forward from its host values, activation input and weight tensors. With a
        `deferral`, every projection by a trainable 2-D weight runs as `_DeferredLinear`. With
        `lookups`, the lookups of the tables stepped in place: a forward without gradients keeps
        their rows there (by lookup node), one with gradients replays them (`_ReplayedLookup`).
        `head_hidden` (with `until_block` the fused LM head's block): the head's input, its
        projection left out."""
        env: dict[str, torch.Tensor] = dict(inputs)
        if x_in is not None:
            x_in.requires_grad_(train)
            env[self.spec.activation_input] = x_in
        env.update(params)
        env.update(self._consts)
        stop_after = set()
        if until_block is not None:
            stop_after = {n for b in self.spec.graph.blocks[until_block + 1:] for n in b.nodes}
        fused = self._lm if until_block is None else None
        self._remakes, self._made_from = ({}, {}) if train else (None, None)
        try:
            return self._run_nodes(env, params, train, until_block, deferral, lookups, head_hidden, stop_after, fused)
        finally:
            self._remakes = self._made_from = None

    def _run_nodes(self, env: dict, params: Mapping[str, torch.Tensor], train: bool, until_block: int | None,
                   deferral: tuple | None, lookups: dict | None, head_hidden: bool, stop_after: set, fused):
        """`_run`'s loop over the stage's nodes (per block, or node by node)."""
        with torch.set_grad_enabled(train):
            if train and self.per_block and until_block is None:
                for block, nodes, alone in self._block_runs:
                    if alone:
                        for node in nodes:
                            self._node(node, env, params, train, deferral, lookups, fused)
                    else:
                        env[block.output] = self._checkpointed(block, nodes, env, params, deferral, lookups, fused)
                    give_back_pages(self._mapped)  # what the block read of a mapped base
            else:
                # each value let go after its last reader (`_values_read_last`: a forward stopped early returns a
                # value read after it, so never let go); not where a deferred projection reads a GELU's input
                read_last = self._last_reads if deferral is None else {}
                for node in self.spec.compute_nodes:
                    if node.name in stop_after:
                        break
                    if head_hidden and node.name == self._lm.matmul.name:
                        return env[self._lm.hidden]
                    self._node(node, env, params, train, deferral, lookups, fused)
                    for value in read_last.get(node.name, ()):
                        env.pop(value, None)
                    if not train and node.name in self._block_ends:
                        # an evaluation's forward holds one block of a mapped base at a time too (a training
                        # forward that keeps its graph reads every weight again in its backward anyway)
                        give_back_pages(self._mapped)
        return env[self.spec.output if until_block is None else self.spec.graph.blocks[until_block].output]

    def _checkpointed(self, block, nodes: list[Node], env: dict, params: Mapping[str, torch.Tensor],
                      deferral: tuple | None, lookups: dict | None, fused) -> torch.Tensor:
        """`block`'s output, its forward run under `_BlockRecompute`: autograd keeps none of its
        intermediates, only what the block reads (its input, the weights, the host values), and runs
        the block's forward again inside its own backward."""
        produced = {o for n in nodes for o in n.outputs}
        reads = {i: env[i] for n in nodes for i in n.inputs if i not in produced and i in env}
        names = [k for k, t in reads.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        held = [reads[k] for k in names] + ([deferral[0]] if deferral is not None else [])

        def run(values: list[torch.Tensor], again: bool) -> torch.Tensor:
            local = dict(reads)
            local.update(zip(names, values))
            # the deferred projections of the re-run differentiate its own anchor (the last value)
            own = deferral if deferral is None else (values[-1], *deferral[1:])
            if again:  # the block after this one (or the LM head) read last: its pages of a mapped base go back
                give_back_pages(self._mapped)
            self._checkpointing = again  # a product's backward takes the re-run's widening
            try:
                for node in nodes:
                    self._node(node, local, params, True, own, lookups, fused)
            finally:
                self._checkpointing = False
            return local[block.output]

        if not held:  # nothing of the block needs a gradient: nothing to run again
            return run([], False)
        return _BlockRecompute.apply(run, *held)

    def _node(self, node: Node, env: dict, params: Mapping[str, torch.Tensor], train: bool,
              deferral: tuple | None, lookups: dict | None, fused) -> None:
        """Run one compute node of the stage into `env` (a fused unit at its last node)."""
        if node.name in self._unit_nodes:
            unit = self._units.get(node.name)
            if unit is not None:  # the site's last node: every input of the unit is there
                env[unit.site.residual] = self._attention(unit, env, params, deferral)
            return
        if fused is not None and node.name == fused.matmul.name:
            return
        if fused is not None and node.name == fused.loss.name and fused.weight in self._frozen:
            env[node.outputs[0]] = _QuantizedLinearCrossEntropy.apply(
                env[fused.hidden], env[node.inputs[1]], env[node.inputs[2]], self._frozen[fused.weight])
            return
        if any(i in self._frozen for i in node.inputs):
            env[node.outputs[0]] = self._run_frozen(node, env)
            return
        if fused is not None and node.name == fused.loss.name and fused.weight in self._consts:
            # a frozen float head (LoRA's base): by vocabulary chunks, a mapped table's pages given back after each
            env[node.outputs[0]] = _FrozenLinearCrossEntropy.apply(
                env[fused.hidden], env[node.inputs[1]],
                env[node.inputs[2]], self._consts[fused.weight], fused.transposed, self._head_source)
            return
        if fused is not None and node.name == fused.loss.name:
            env[node.outputs[0]] = _LinearCrossEntropy.apply(
                env[fused.hidden], env[fused.weight], env[node.inputs[1]], env[node.inputs[2]],
                fused.transposed, self._head_sum)
            return
        if deferral is not None and node.op in ("MatMul", "Add"):
            deferred = self._defer(node, env, params, deferral)
            if deferred is not None:
                if deferred is not _SKIP:
                    env[node.outputs[0]] = deferred
                return
        if lookups is not None and node.op == "Gather" and node.inputs[0] in self._stepped_in_place:
            table, ids = env[node.inputs[0]], env[node.inputs[1]].long()
            if train:
                env[node.outputs[0]] = _ReplayedLookup.apply(table, ids, lookups[node.name], self.row_gradients)
            else:
                env[node.outputs[0]] = lookups[node.name] = F.embedding(ids, table)
            return
        if node.op == "Gather" and train and self.row_gradients and node.inputs[0] in params:
            # the table's gradient as the rows it touches (base.RowGradient), not a dense copy
            env[node.outputs[0]] = F.embedding(env[node.inputs[1]].long(), env[node.inputs[0]], sparse=True)
            return
        if node.op == "Gather" and node.inputs[0] in self._mapped_tables:  # frozen: no gradient to the table
            ids = env[node.inputs[1]].long()
            env[node.outputs[0]] = torch.from_numpy(gather_rows(self._mapped_tables[node.inputs[0]], ids.numpy()))
            return
        linear = self._linear.get(node.name)
        if linear is not None:
            if linear.add == node.name:  # MatMul + bias as one addmm (skips a pass each way)
                mm = linear.matmul
                w = env[mm.inputs[1]]
                env[node.outputs[0]] = self._linear_of(mm.inputs[0], env, env[mm.inputs[0]],
                                                       w if mm.attrs.get("trans_b") else w.t(), env[linear.bias],
                                                       mm.inputs[1])
            return  # the MatMul itself: computed with its bias
        args = [env[i] for i in node.inputs]
        if (node.op == "MatMul" and self._remakes is not None and node.inputs[1] in params
                and params[node.inputs[1]].dim() == 2 and node.inputs[0] in self._remade_from):
            w = args[1]  # a product by a trainable weight (a LoRA adapter's A) reading a GELU's or LayerNorm's output
            env[node.outputs[0]] = self._linear_of(node.inputs[0], env, args[0],
                                                   w if node.attrs.get("trans_b") else w.t(), None, node.inputs[1])
            return
        env[node.outputs[0]] = _run_node(node, args)
        if self._made_from is not None and node.outputs[0] in self._remade_from and torch.is_grad_enabled():
            self._made_from[node.outputs[0]] = tuple(args)  # held anyway: the node's own backward saves them

    def _views_mapping(self, name: str) -> bool:
        """Whether the engine's constant `name` views the graph's array, and that array lies on a read-only file
        mapping (a frozen base read mapped), whose pages the engine may give back after reading them."""
        array = self.spec.graph.constants[name]
        return bool(read_only_mappings([array])) and self._consts[name].data_ptr() == array.ctypes.data

    def _run_frozen(self, node: Node, env: dict) -> torch.Tensor:
        """A node reading a quantized frozen weight: a product widens it inside `_FrozenQuantizedMatMul`,
        a lookup widens the rows it gathers; any other reader gets it widened for that node alone."""
        if node.op == "MatMul" and node.inputs[1] in self._frozen and node.inputs[0] not in self._frozen:
            return _FrozenQuantizedMatMul.apply(env[node.inputs[0]], self._frozen[node.inputs[1]],
                                                bool(node.attrs.get("trans_b")), self._checkpointing)
        if node.op == "Gather" and node.inputs[0] in self._frozen and self._frozen[node.inputs[0]].q.axis == 1:
            return self._frozen[node.inputs[0]].rows(env[node.inputs[1]].long())
        return _run_node(node, [self._frozen[i].widen() if i in self._frozen else env[i] for i in node.inputs])

    def _attention(self, unit: AttentionUnit, env: dict, params: Mapping[str, torch.Tensor],
                   deferral: tuple | None) -> torch.Tensor:
        """The residual of `unit`'s attention (the form `runtime.engines.split.piece.attention_piece`
        spells out op by op): the pre-norm if any, the projections, rotary embeddings, the key/value
        heads repeated for their query groups, scaled dot-product attention with the additive mask,
        the output projection, plus the block input."""
        site = unit.site
        x = env[site.x]
        B, S, D = x.shape
        h, u, hs = unit.heads, unit.kv_heads, unit.head_size
        a = x
        # what a projection of `a` makes it again from (`_remade`): the stage's node that made the layer's
        # input (a post-norm layer: the last one's LayerNorm); a pre-norm's output is held as it is
        remake = (site.x if site.norm is None else "", env)
        if site.norm is not None:
            w = env[unit.weight("norm_w")[0]]
            if site.norm == "LayerNorm":
                b = unit.weight("norm_b")
                a = F.layer_norm(x, (D,), w, env[b[0]] if b else None, site.norm_epsilon)
            else:  # RMSNorm, as _run_node computes it
                a = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + site.norm_epsilon) * _shifted(w, site.norm_offset)

        def project(role: str, bias_role: str, y: torch.Tensor) -> torch.Tensor:  # y: `a`, or the context for Wo
            name, transposed, first, end = unit.weight(role)
            bias = unit.weight(bias_role)
            if (deferral is not None and first is None and name in params and params[name].dim() == 2
                    and (bias is None or bias[2] is None)):
                anchor, sink, names, remakes = deferral  # zero bubble: the weight gradient waits for W, as in _defer
                names.add(name)
                bias_name = bias[0] if bias is not None and bias[0] in params else None
                if bias_name is not None:
                    names.add(bias_name)
                remade, sources = self._remade(*remake, y, remakes) if y is a else (None, ())
                return _DeferredLinear.apply(y, params[name], env[bias[0]] if bias else None, anchor, transposed,
                                             sink, (name, bias_name), remade, *sources)
            if name in self._frozen and first is None:  # widened inside the product, then dropped
                y = _FrozenQuantizedMatMul.apply(y, self._frozen[name], transposed, self._checkpointing)
                return y if bias is None else y + (env[bias[0]] if bias[2] is None else env[bias[0]][bias[2]:bias[3]])
            w_full = self._frozen[name].widen() if name in self._frozen else env[name]
            weight = w_full if transposed else w_full.t()  # [out, in], as F.linear takes it
            b = None
            if bias is not None:
                b = env[bias[0]] if bias[2] is None else env[bias[0]][bias[2]:bias[3]]
            if first is not None:
                weight = weight[first:end]
            whole = name if first is None and name in params else None  # the parameter itself, not a slice
            return self._linear_of(remake[0] if y is a else None, env, y, weight, b, whole)

        def heads(y: torch.Tensor, count: int) -> torch.Tensor:
            return y.reshape(B, S, count, hs).transpose(1, 2)

        q, k, v = heads(project("Wq", "bq", a), h), heads(project("Wk", "bk", a), u), heads(project("Wv", "bv", a), u)
        if site.rotary is not None:
            cos, sin = env[site.rotary[0]], env[site.rotary[1]]
            half = hs // 2
            q = q * cos + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * sin
            k = k * cos + torch.cat([-k[..., half:], k[..., :half]], dim=-1) * sin
        if h > u:  # each key/value head serves its group of h / u query heads
            k, v = k.repeat_interleave(h // u, dim=1), v.repeat_interleave(h // u, dim=1)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=env[site.mask], scale=float(site.scale))
        return project("Wo", "bo", context.transpose(1, 2).reshape(B, S, h * hs)) + x

    def _defer(self, node: Node, env: dict, params: Mapping[str, torch.Tensor], deferral: tuple):
        """The deferred projection's output for `node` (a MatMul by a trainable 2-D weight, or the
        bias Add fused with one), _SKIP for the MatMul of a fused pair (its Add computes both), or
        None when the node is not deferred."""
        anchor, sink, names, remakes = deferral
        linear = self._linear.get(node.name)
        mm = linear.matmul if linear is not None else node
        if mm.op != "MatMul" or mm.inputs[1] not in params or params[mm.inputs[1]].dim() != 2:
            return None
        if linear is not None and node.name == mm.name:
            return _SKIP
        bias = linear.bias if linear is not None else None
        if bias is not None and bias not in params:
            bias_t, bias_name = env[bias], None  # a frozen bias: added, never differentiated
        else:
            bias_t, bias_name = (env[bias], bias) if bias is not None else (None, None)
        names.add(mm.inputs[1])
        if bias_name is not None:
            names.add(bias_name)
        x = env[mm.inputs[0]]
        remade, sources = self._remade(mm.inputs[0], env, x, remakes)
        return _DeferredLinear.apply(x, env[mm.inputs[1]], bias_t, anchor, bool(mm.attrs.get("trans_b")), sink,
                                     (mm.inputs[1], bias_name), remade, *sources)

    def _linear_of(self, value: str | None, env: Mapping, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, name: str | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for `value` (= x; None: a value nothing makes again); in a training forward
        with gradients to a weight that needs one, as `_RemadeLinear` where `_remade` can make x again (its
        autograd saving then what x is made from, not x; where the weight needs no gradient, F.linear saves no x
        either), and where the backward is whole (it adds into the running sums, `_backward_summed`), the gradient of
        the weight `name` (the whole parameter, never a slice of one) straight into its sum (`_WeightSums`)."""
        if self._remakes is not None and torch.is_grad_enabled() and weight.requires_grad:
            remade, sources = self._remade(value, env, x, self._remakes) if value is not None else (None, ())
            sums = self._weight_sums if not self.split_backward else None
            if remade is not None and sums is not None and value in self._gelu_read_once:
                # the GELU's gradient written over the product's input gradient (`_GeluLinear`)
                return _GeluLinear.apply(sources[0], x.detach(), weight, bias, remade, sums, name,
                                         remade.node.attrs.get("approximate", "none"))
            if remade is not None or sums is not None:
                return _RemadeLinear.apply(x, weight, bias, remade, sums, name, *sources)
        return F.linear(x, weight, bias)

    def _remade(self, value: str, env: Mapping, x: torch.Tensor, remakes: dict) -> tuple:
        """(`_Remade`, the tensors it is made from) for a projection reading `value` (= `x`): the output of a
        GELU or LayerNorm node of the stage whose inputs are tensors (none quantized), as this forward ran it
        (`_made_from`) or in `env`; else (None, ())."""
        node = self._remade_from.get(value)
        if node is not None and self._made_from is not None and value in self._made_from:
            env = dict(zip(node.inputs, self._made_from[value]))
        if node is None or any(i in self._frozen or not isinstance(env.get(i), torch.Tensor) for i in node.inputs):
            return None, ()
        remade = remakes.get(value)
        if remade is None or remade.source() is not x:
            remade = remakes[value] = _Remade(node, x)
        return remade, tuple(env[i] for i in node.inputs)

    def backward(self, microbatch: int, grad_output=None) -> StageGradients:
        result = self.backward_input(microbatch, grad_output)
        if microbatch in self._pending:
            for name, g in self.backward_weight(microbatch).items():
                result.params[name] = g
        return result

    def _graph_of(self, microbatch: int) -> tuple:
        """(stage input, output, the weight tensors it ran with, deferral) of `microbatch`'s training
        forward, its graph rebuilt where the engine recomputes (the rows it gathered replayed)."""
        if microbatch not in self._saved:
            raise KeyError(f"backward of micro-batch {microbatch} before its forward")
        if not self.recompute:
            return self._saved.pop(microbatch)
        inputs, x_in, used, gathered = self._saved.pop(microbatch)
        deferral = self._deferral()
        # the forward again, with its graph this time
        return x_in, self._run(inputs, x_in, used, True, None, deferral, lookups=gathered), used, deferral

    def backward_input(self, microbatch: int, grad_output=None) -> StageGradients:
        x_in, out, used, deferral = self._graph_of(microbatch)
        deferred = deferral[2] if deferral is not None else set()
        now = {k: p for k, p in used.items() if k not in deferred}
        wrt = list(now.values()) + ([x_in] if x_in is not None else []) + ([deferral[0]] if deferral else [])
        if not wrt:
            # nothing to differentiate: a first stage that holds only frozen weights (LoRA's
            # embeddings); autograd refuses an empty list, and the answer is no gradients at all
            return StageGradients({}, None)
        given = None if grad_output is None else self._tensor(grad_output)
        grads = torch.autograd.grad([_seed(out, given)], wrt, allow_unused=True)
        params = {}
        # autograd's fresh tensors, shared with numpy without a copy (nothing else holds them; the
        # executor accumulates into them in place)
        summed = self._head_sum.added and self._lm is not None
        self._head_sum.added = False
        for (name, p), g in zip(now.items(), grads):
            if g is None and summed and name == self._lm.weight:
                continue  # all of it already added into the running sum (`backward_into`)
            if g is not None and g.is_sparse:
                params[name] = RowGradient(g._indices()[0].numpy(), g._values().detach().numpy(), tuple(p.shape))
            else:
                params[name] = (torch.zeros_like(p) if g is None else g).detach().numpy()
        dx = grads[len(now)].detach().numpy() if x_in is not None else None
        if deferral is not None:
            self._pending[microbatch] = (deferral[1], {k: used[k] for k in deferred})
        return StageGradients(params, dx)

    def backward_into(self, microbatch: int, into: dict, grad_output=None) -> np.ndarray | None:
        """`backward` with the gradients added into the running sum `into`; a fused LM head's weight
        gradient straight into its sum where there is one (a dense array of the weight's dtype, the
        second micro-batch on), a chunk of target rows at a time: the same products added in another
        order (float rounding apart), and never a second vocabulary x hidden array beside the sum.
        Any other reader of the weight (a tied table's lookup on the same stage) gives its part as
        before, added after."""
        target = self._head_sum_target(into)
        if target is None and self.split_backward:
            return super().backward_into(microbatch, into, grad_output)
        self._head_sum.target, self._head_sum.added = target, False
        try:
            if not self.split_backward:
                # every whole backward (1F1B, GPipe, train-local, zb-h1's joined passes): SmolLM2's per-block full
                # fine-tuning stages held 117-194 MiB less than with the whole set beside the sum (1067.6 / 1025.6
                # MiB against 1184.8 / 1219.4; benchmarks/MEMORY_NOTES.md, the 2026-12-07 merge and helper h150),
                # which the profile measures so (`runtime.profiling.compute.peak_workspace`'s `summed`)
                return self._backward_summed(microbatch, into, grad_output)
            result = self.backward(microbatch, grad_output)
        finally:
            self._head_sum.target, self._head_sum.added = None, False
        accumulate(into, result.params)
        return result.activation_input

    def _backward_summed(self, microbatch: int, into: dict, grad_output=None) -> np.ndarray | None:
        """The whole backward of `microbatch` with each weight's gradient added into `into` once it is
        complete (autograd's post-accumulate hook, as `backward_and_step` steps it) and let go: the
        stage never holds the micro-batch's whole set of weight gradients beside the sum (MiniLM's
        four-layer stage 0: 27 MiB), only the gradients autograd has not finished. A product by a weight
        whose sum is already there adds its part into the sum with one GEMM (`_WeightSums`): the same sums
        as `backward` then `accumulate`, float rounding apart (the GEMM adds into the sum as it goes).
        Returns the gradient of the stage input (None on the first stage)."""
        x_in, out, used, _ = self._graph_of(microbatch)
        done: set[str] = set()

        def add(name: str, grad: torch.Tensor) -> None:
            if grad.is_sparse:
                g = RowGradient(grad._indices()[0].numpy(), grad._values().detach().numpy(), tuple(grad.shape))
            else:
                g = grad.detach().numpy()
            accumulate(into, {name: g})
            done.add(name)

        def hook(name: str):
            def take(t: torch.Tensor) -> None:
                grad, t.grad = t.grad, None
                # None: every product added its part into the sum (`_WeightSums`), or a fused head's weight whose
                # gradient is already there (`_HeadSum`)
                if grad is not None:
                    add(name, grad)
            return take

        wrt = list(used.values()) + ([x_in] if x_in is not None else [])
        if not wrt:  # only frozen weights and no stage input: no gradients at all (`backward_input`)
            return None
        handles = [t.register_post_accumulate_grad_hook(hook(k)) for k, t in used.items()]
        self._weight_sums.into, self._weight_sums.added = into, set()
        try:
            given = None if grad_output is None else self._tensor(grad_output)
            torch.autograd.backward([_seed(out, given)], inputs=wrt)
        finally:
            for h in handles:
                h.remove()
            done |= self._weight_sums.added  # added into their sums by the products (`_WeightSums`)
            self._weight_sums.into, self._weight_sums.added = None, set()
        if self._head_sum.added and self._lm is not None:
            done.add(self._lm.weight)  # all of it already added into the running sum (`_HeadSum`)
        for name, p in used.items():  # a weight no op of this micro-batch reached: a zero gradient
            if name not in done:
                accumulate(into, {name: torch.zeros_like(p).detach().numpy()})
        if x_in is None:
            return None
        dx, x_in.grad = x_in.grad, None
        return (torch.zeros_like(x_in) if dx is None else dx).detach().numpy()

    def backward_input_into(self, microbatch: int, into: dict, grad_output=None) -> StageGradients:
        """`backward_input` (B of a split backward), a fused LM head's weight gradient added straight
        into `into` as `backward_into` does; the other gradients returned, for the caller to add."""
        target = self._head_sum_target(into)
        self._head_sum.target, self._head_sum.added = target, False
        try:
            return self.backward_input(microbatch, grad_output)
        finally:
            self._head_sum.target, self._head_sum.added = None, False

    def _head_sum_target(self, into: dict) -> torch.Tensor | None:
        """The running sum of the fused LM head's trainable weight as a tensor sharing its memory, or
        None (no fused head, a frozen one, no sum yet, a row or read-only sum, another dtype)."""
        if self._lm is None or self._lm.weight not in self._params:
            return None
        acc = into.get(self._lm.weight)
        p = self._params[self._lm.weight]
        if (not isinstance(acc, np.ndarray) or not acc.flags.writeable or not acc.flags.c_contiguous
                or tuple(acc.shape) != tuple(p.shape)):
            return None
        t = torch.from_numpy(acc)
        return t if t.dtype == p.dtype else None

    def backward_weight(self, microbatch: int) -> dict[str, np.ndarray]:
        if microbatch not in self._pending:
            return {}
        sink, weights = self._pending.pop(microbatch)
        with torch.no_grad():
            grads = _weight_grads(sink, {k: w.shape for k, w in weights.items()})
        # a deferred weight no projection of this micro-batch reached still gets its zero gradient
        return {k: (grads[k] if k in grads else torch.zeros_like(w)).numpy() for k, w in weights.items()}

    def backward_weight_into(self, microbatch: int, into: dict) -> None:
        """W one parameter at a time: each weight's (and bias's) gradient summed over its projections
        in `_weight_grads`' order and added into `into` once its last projection is done, each
        projection's (x, dy) let go once read. So a W holds one weight's gradient beside the sum,
        never the micro-batch's whole set (+27 MiB on MiniLM's stage 0). A weight whose sum is already
        there gets each projection's part added straight into it with one GEMM (`_WeightSums`: no
        gradient beside the sum at all); the sums are then `backward_weight`'s then `accumulate`'s, float
        rounding apart (bit for bit where no sum was there yet: the step's first W)."""
        if microbatch not in self._pending:
            return
        sink, weights = self._pending.pop(microbatch)
        left: dict[str, int] = {}
        for item in sink:
            for name in (item.weight, item.bias):
                if name is not None:
                    left[name] = left.get(name, 0) + 1
        partial: dict[str, torch.Tensor] = {}

        def add(name: str, g: torch.Tensor) -> None:
            acc = partial.get(name)
            if acc is None:
                partial[name] = g
            else:
                acc += g
            left[name] -= 1
            if not left[name]:
                accumulate(into, {name: partial.pop(name).numpy()})

        sums = _WeightSums()
        sums.into = into
        with torch.no_grad():
            for k in range(len(sink)):
                item, sink[k] = sink[k], None  # its (x, dy) go once both products have read them
                x = item.x.reshape(-1, item.x.shape[-1])
                gy = item.grad_y.reshape(-1, item.grad_y.shape[-1])
                w = weights[item.weight]
                target = None if item.weight in partial else sums.target(item.weight, tuple(w.shape), w.dtype)
                if target is not None and w.dim() == 2:
                    target.addmm_(gy.t(), x) if item.transposed else target.addmm_(x.t(), gy)
                    left[item.weight] -= 1
                else:
                    add(item.weight, (gy.t() @ x if item.transposed else x.t() @ gy).reshape(w.shape))
                if item.bias is not None:
                    add(item.bias, gy.sum(0))
                del item, x, gy
            # a deferred weight no projection of this micro-batch reached still gets its zero gradient
            for k, w in weights.items():
                if k not in left:
                    accumulate(into, {k: torch.zeros_like(w).numpy()})

    def parameters(self):
        return {k: v.detach().numpy().copy() for k, v in self._params.items()}

    def parameter_arrays(self):
        return {k: v.detach().numpy() for k, v in self._params.items()}

    def _in_flight_tensors(self) -> set[int]:
        held = {id(t) for entry in self._saved.values() for t in entry[2].values()}  # the params it ran with
        held |= {id(t) for _, weights in self._pending.values() for t in weights.values()}
        return held

    def _spare_versions(self) -> tuple[list[dict[str, torch.Tensor]], dict[str, list[torch.Tensor]]]:
        """The retired versions a forward in flight (or the current weights) still holds, and the
        tensors of the others by parameter: free for a step's new weights."""
        held = self._in_flight_tensors() | {id(t) for t in self._params.values()}
        spare: dict[str, list[torch.Tensor]] = {}
        still = []
        for version in self._retired:
            if any(id(t) in held for t in version.values()):
                still.append(version)
            else:
                for k, t in version.items():
                    spare.setdefault(k, []).append(t)
        return still, spare

    def _new_version(self) -> dict[str, torch.Tensor]:
        """Leaf tensors holding the current weights, for a step while forwards are in flight: the
        tensors of a retired version no forward in flight holds where there is one."""
        still, spare = self._spare_versions()
        fresh: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for k, p in self._params.items():
                if k in self._stepped_in_place:
                    fresh[k] = p
                elif spare.get(k):
                    fresh[k] = spare[k].pop().copy_(p)
                else:
                    fresh[k] = p.detach().clone().requires_grad_(True)
        old = {k: p for k, p in self._params.items() if k not in self._stepped_in_place}
        self._retired = still + [old]  # spare tensors not taken now are let go
        return fresh

    steps_in_backward = True

    def backward_and_step(self, microbatch: int, optimizer, grad_output=None) -> np.ndarray | None:
        """`backward` then `step` with its gradients as one (B then UPDATE of 1f1b-stash updating
        after every backward): each weight is stepped once its gradient is complete (autograd's
        post-accumulate hook: every op reading it has run its backward) and the gradient let go,
        so the stage never holds all its weight gradients at once. With forwards in flight the new
        weights go where `step` would put them (a retired version's tensors no forward in flight
        holds, this micro-batch's own once its backward is past them, else new ones): the same
        weights and optimizer state as `backward` then `step`, bit for bit. Returns the gradient of
        the stage input (None on the first stage)."""
        if self.split_backward:
            raise RuntimeError("a split backward steps after its W, not in its B")
        x_in, out, used, _ = self._graph_of(microbatch)
        in_flight = bool(self._saved or self._pending)
        current = dict(self._params)
        spare: dict[str, list[torch.Tensor]] = {}
        still = self._retired
        if in_flight:  # as `_new_version`, except that this micro-batch's tensors free up one by one
            still, spare = self._spare_versions()
        kernel = self.optimizer_kernel(optimizer)
        stepped: dict[str, torch.Tensor] = {}

        def step_one(name: str, grad: torch.Tensor | None) -> None:
            p = current[name]
            if in_flight and name not in self._stepped_in_place:
                with torch.no_grad():
                    p = spare[name].pop().copy_(p) if spare.get(name) else p.detach().clone().requires_grad_(True)
            if grad is None:
                g = np.zeros(tuple(p.shape), np.float32 if self.dtype == torch.float32 else np.float64)
            elif grad.is_sparse:
                g = RowGradient(grad._indices()[0].numpy(), grad._values().detach().numpy(), tuple(p.shape))
            else:
                g = grad.detach().numpy()
            views, grads = {name: p.detach().numpy()}, {name: g}
            if kernel is None:
                optimizer.step(views, grads, begun=True)
            else:
                optimizer.step(views, grads, dense_kernel=kernel, begun=True)
            stepped[name] = p

        def hook(name: str):
            def take(t: torch.Tensor) -> None:
                grad, t.grad = t.grad, None
                step_one(name, grad)
            return take

        optimizer.begin_step()
        handles = [t.register_post_accumulate_grad_hook(hook(k)) for k, t in used.items()]
        try:
            wrt = list(used.values()) + ([x_in] if x_in is not None else [])
            if wrt:
                given = None if grad_output is None else self._tensor(grad_output)
                torch.autograd.backward([_seed(out, given)], inputs=wrt)
        finally:
            for h in handles:
                h.remove()
        for name in current:  # a weight no op of this micro-batch reached: its step with a zero gradient
            if name not in stepped:
                step_one(name, None)
        if in_flight:
            self._params = stepped
            self._retired = still + [{k: p for k, p in current.items() if k not in self._stepped_in_place}]
        dx = None
        if x_in is not None:
            dx, x_in.grad = x_in.grad, None
            dx = (torch.zeros_like(x_in) if dx is None else dx).detach().numpy()
        return dx

    def step(self, optimizer, grads) -> None:
        if self._saved or self._pending:
            # a micro-batch in flight keeps the tensors its forward ran with (weight stashing: its
            # autograd graph holds them), so the step writes new ones; taken arrays stay with it
            self._params = self._new_version()
        # numpy views of the leaf tensors, stepped in place: nothing else holds them now
        views = {k: p.detach().numpy() for k, p in self._params.items()}
        kernel = self.optimizer_kernel(optimizer)
        if kernel is None:
            optimizer.step(views, grads)
        else:
            optimizer.step(views, grads, dense_kernel=kernel)

    def steps_in_parts(self) -> bool:
        return not (self._saved or self._pending)  # nothing in flight: the tensors are stepped where they are

    def step_part(self, optimizer, grads) -> None:
        if not self.steps_in_parts():
            raise RuntimeError("a part of a step with micro-batches in flight (their weights would change)")
        views = {k: self._params[k].detach().numpy() for k in grads}
        kernel = self.optimizer_kernel(optimizer)
        if kernel is None:
            optimizer.step(views, grads, begun=True)
        else:
            optimizer.step(views, grads, dense_kernel=kernel, begun=True)

    def optimizer_kernel(self, optimizer):
        return fused_adamw if self.native_step and isinstance(optimizer, AdamW) else None

    def set_parameters(self, values):
        # New leaf tensors rather than in-place copies: a forward still waiting for its backward
        # keeps the tensors it ran with, which is weight stashing for free.
        for k, v in values.items():
            if k not in self._params:
                raise KeyError(f"parameter {k!r} is not in this stage")
            self._params[k] = torch.tensor(np.asarray(v), dtype=self.dtype, requires_grad=True)
