"""Optimizers on numpy arrays, so every engine updates its parameters the same way.

Semantics follow PyTorch's `torch.optim.SGD` (momentum, dampening 0, L2 weight decay added to the
gradient) and `torch.optim.AdamW` (decoupled weight decay, bias correction), the reference the
tests compare against. State is plain arrays, so checkpoints need no pickle. An engine with a
faster kernel of its own for a step (PyTorch's fused AdamW, a quarter of numpy's time here) passes
it as `dense_kernel`: it then steps the dense weights on this module's state arrays, with its own
rounding (`StageEngine.optimizer_kernel`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import numpy as np

from runtime.engines.base import RowGradient, dense_gradient
from runtime.heap import sparse_zeros

# Elements per pass: every step's dozen elementwise passes run over one chunk of a tensor at a time,
# so they stay in the core's cache (5 float32 arrays of 32768 = 640 KiB) and each weight, gradient
# and moment is read from memory once per step instead of once per pass. Measured here on MiniLM's
# 68 MB of weights: AdamW 75 -> 46 ms a step, bit for bit the same result (the same operations on
# every element, only in another order of elements).
CHUNK = 32768


def _scratch(params: Mapping[str, np.ndarray]) -> np.ndarray:
    """One chunk's worth of working space, reused by every pass of a step."""
    return np.empty(min(CHUNK, max((p.size for p in params.values()), default=1)), np.float32)


@dataclass
class _RowState:
    """Optimizer state of an embedding table kept for the rows that ever had a gradient (`ids`, in
    slot order; `slot[row]` is the row's slot or -1), one array of shape [capacity, *row] per state
    (AdamW: m, v; SGD: momentum). Every other row's state is exactly zero, and stays so: its update
    is then a plain scale (AdamW's decoupled decay) or nothing, so a step touches the table once
    instead of reading and writing the table, its gradient made dense and every state array."""

    slot: np.ndarray
    ids: np.ndarray
    arrays: list[np.ndarray]
    n: int = 0

    @classmethod
    def empty(cls, shape: tuple[int, ...], count: int) -> "_RowState":
        """Room for a slot per table row from the start, in anonymous maps of which only the pages
        written become resident (`runtime.heap.sparse_zeros`): the rows fill the slots in order, so
        what is resident is the held rows' own pages, and the state never grows by copying. (Grown
        by doubling, the old and the new arrays were alive at once at an update: up to 3x the rows.)"""
        return cls(np.full(shape[0], -1, np.int64), sparse_zeros((shape[0],), np.int64),
                   [sparse_zeros(tuple(shape), np.float32) for _ in range(count)])

    @classmethod
    def from_dense(cls, dense: list[np.ndarray]) -> "_RowState":
        """The rows of dense state arrays where any is non-zero (the others behave as never touched)."""
        live = np.zeros(dense[0].shape[0], bool)
        for a in dense:
            live |= np.any(a.reshape(a.shape[0], -1) != 0, axis=1)
        state = cls.empty(dense[0].shape, len(dense))
        ids = np.flatnonzero(live)
        state.add(ids)
        for mine, a in zip(state.arrays, dense):
            mine[:state.n] = a[ids]
        return state

    def add(self, rows: np.ndarray) -> None:
        """Give the rows not yet held a slot (state zero), in the order given."""
        new = rows[self.slot[rows] < 0]
        if not new.size:
            return
        need = self.n + new.size  # at most the table's rows: every slot's room is there (`empty`)
        self.ids[self.n:need] = new
        self.slot[new] = np.arange(self.n, need)
        self.n = need

    def dense(self, k: int) -> np.ndarray:
        return _sparse(self, k).dense()

    def take(self, g: RowGradient) -> tuple[np.ndarray, np.ndarray]:
        """g's rows summed, each row once, after giving the rows new to the state a slot: their
        slots, ascending, and the sums in that order. Each element gets g's additions in g's order,
        starting from zero, as `g.dense()` does, so the sums are bit for bit the dense gradient's."""
        uniq, inverse = np.unique(np.asarray(g.ids, np.int64).reshape(-1), return_inverse=True)
        rows = np.asarray(g.rows)
        summed = np.zeros((uniq.size,) + self.arrays[0].shape[1:], rows.dtype)  # as g.dense() sums
        np.add.at(summed, inverse.reshape(-1), rows)
        self.add(uniq)
        slots = self.slot[uniq]
        order = np.argsort(slots, kind="stable")
        return slots[order], summed[order]

    def gradient_chunks(self, slots: np.ndarray, summed: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        """The summed gradient of every held row in slot order (zero for a row `take` did not
        get), a run of slots at a time: (start, stop, float32 rows). Runs of about CHUNK elements
        in one reused buffer (valid until the next run), so a step's working memory does not grow
        with the rows that ever had a gradient (a whole-state gradient and step would: 12 MB more
        a step on MiniLM's table after 4000 rows)."""
        shape = self.arrays[0].shape[1:]
        run = max(1, CHUNK // max(1, int(np.prod(shape, dtype=np.int64))))
        buf = np.empty((min(run, self.n),) + shape, np.float32)
        for start in range(0, self.n, run):
            stop = min(self.n, start + run)
            lo, hi = np.searchsorted(slots, (start, stop))
            out = buf[:stop - start]
            out.fill(0)
            out[slots[lo:hi] - start] = summed[lo:hi]
            yield start, stop, out


@dataclass(frozen=True)
class SparseRows:
    """A state array of shape `shape` that is zero but for rows `ids` (`rows[i]` is row `ids[i]`):
    a table's optimizer state as `_RowState` holds it, handed out without making it dense (the
    arrays may be the optimizer's own: read them before its next step)."""

    ids: np.ndarray
    rows: np.ndarray
    shape: tuple[int, ...]

    def dense(self) -> np.ndarray:
        out = np.zeros(self.shape, np.float32)
        out[self.ids] = self.rows
        return out


def _sparse(state: "_RowState", k: int) -> SparseRows:
    return SparseRows(state.ids[:state.n], state.arrays[k][:state.n], (len(state.slot),) + state.arrays[k].shape[1:])


# Above this share of a table's rows with state, a step over the rows costs more than the dense
# step (gathering and scattering the rows): measured here on MiniLM's 30522 x 384 table with
# AdamW, rows 9 ms at 10% of the rows, 15 ms at 30%, 28 ms at 50%, dense 21 ms. The table then
# goes dense for good.
ROWS_DENSE_SHARE = 0.4


def _row_gradient(g, p: np.ndarray) -> RowGradient | None:
    """g when it is a table's row gradient that the row path can take (a C-contiguous table)."""
    if (isinstance(g, RowGradient) and p.ndim >= 2 and p.dtype == np.float32 and p.flags.c_contiguous
            and tuple(g.shape) == p.shape):
        return g
    return None


def _chunks(*arrays: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """Matching flat chunks of same-shaped arrays (the first is written in place, so where any
    written one is not C-contiguous, and flattening would copy it, the whole arrays at once)."""
    if not all(a.flags.c_contiguous for a in arrays):
        yield arrays
        return
    flat = [a.reshape(-1) for a in arrays]
    n = flat[0].size
    for start in range(0, n, CHUNK):
        yield tuple(a[start:start + CHUNK] for a in flat)


def _with_gradient(p: np.ndarray, g, *state: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """Matching chunks (p, gradient, *state) for a dense step. A table's row gradient is scattered
    into one chunk of rows at a time, never into a dense copy of the table (47 MB a step for
    MiniLM's once its state has gone dense): its ids sorted stably, so each element gets its rows
    added in the order `RowGradient.dense` adds them, and the same values."""
    rows = _row_gradient(g, p)
    if rows is None or not all(a.flags.c_contiguous for a in state):
        yield from _chunks(p, np.broadcast_to(np.asarray(dense_gradient(g), np.float32), p.shape), *state)
        return
    order = np.argsort(rows.ids, kind="stable")
    ids, values = rows.ids[order], rows.rows[order]
    width = int(np.prod(p.shape[1:]))
    per_chunk = max(1, CHUNK // max(1, width))
    # the rows summed in their own dtype, as `RowGradient.dense` sums them, then made float32
    buffer = np.empty((min(per_chunk, p.shape[0]),) + p.shape[1:], values.dtype)
    for start in range(0, p.shape[0], per_chunk):
        stop = min(start + per_chunk, p.shape[0])
        a, b = np.searchsorted(ids, (start, stop))
        gc = buffer[:stop - start]
        gc.fill(0)
        np.add.at(gc, ids[a:b] - start, values[a:b])
        yield (p[start:stop], gc if gc.dtype == np.float32 else gc.astype(np.float32), *(x[start:stop] for x in state))


@dataclass
class SGD:
    """torch.optim.SGD semantics; updates the given arrays in place (they are the optimizer's own
    copies of the weights, so no allocation per step on 22M-parameter models)."""

    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0
    # momentum of tables updated by rows (`_RowState`); without weight decay a row that never had a
    # gradient has zero momentum and does not move
    row_buffers: dict[str, _RowState] = field(default_factory=dict)
    dense_tables: set[str] = field(default_factory=set)  # tables whose rows with state passed ROWS_DENSE_SHARE

    def begin_step(self) -> None:
        """Begin a step taken in parts (`step(..., begun=True)` for each): its count, once."""
        self.steps += 1

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray],
             begun: bool = False) -> dict[str, np.ndarray]:
        """One step over `params` in place; `begun`: these are part of the step `begin_step` began
        (an engine stepping each weight as its gradient comes), which other parts take too."""
        if not begun:
            self.begin_step()
        f = np.float32
        scratch = _scratch(params)
        for name, p in params.items():
            rows = None if self.weight_decay or name in self.dense_tables else _row_gradient(grads[name], p)
            if rows is not None:
                if name in self.buffers:  # a dense momentum (a loaded checkpoint): its live rows
                    self.row_buffers[name] = _RowState.from_dense([self.buffers.pop(name)])
                self._step_rows(name, p, rows)
                if self.row_buffers[name].n > ROWS_DENSE_SHARE * p.shape[0]:
                    self.buffers[name] = self.row_buffers.pop(name).dense(0)
                    self.dense_tables.add(name)
                continue
            if name in self.row_buffers:  # a dense gradient after row steps: the momentum dense again
                self.buffers[name] = self.row_buffers.pop(name).dense(0)
            g = grads[name]
            buf, first = None, False
            if self.momentum:
                buf = self.buffers.get(name)
                if buf is None and _row_gradient(g, p) is not None:
                    # zero momentum, then the later steps' rule: 0 * momentum + g (+ wd * p) is the
                    # first step's buffer exactly, with no dense copy of the gradient
                    buf = self.buffers[name] = np.zeros_like(p, np.float32)
                elif buf is None:
                    g = np.asarray(g, np.float32)
                    buf = self.buffers[name] = np.array(g, np.float32)
                    if self.weight_decay:
                        buf += f(self.weight_decay) * p
                    first = True
            for pc, gc, *rest in _with_gradient(p, g, *(() if buf is None else (buf,))):
                tmp = scratch[:pc.size].reshape(pc.shape) if pc.size <= scratch.size else np.empty(pc.shape, np.float32)
                if self.weight_decay:  # g + wd * p, as torch adds L2 decay to the gradient
                    np.multiply(pc, f(self.weight_decay), out=tmp)
                    tmp += gc
                else:
                    np.copyto(tmp, gc)
                if buf is not None:
                    (bc,) = rest
                    if not first:
                        bc *= f(self.momentum)
                        bc += tmp
                    np.copyto(tmp, bc)
                tmp *= f(self.lr)
                pc -= tmp
        return params

    def _step_rows(self, name: str, p: np.ndarray, g: RowGradient) -> None:
        """The step of a table without weight decay over the rows that ever had a gradient: the
        dense step's operations on those rows; every other row has zero momentum (or, without
        momentum, zero gradient) and would get p - lr * 0, itself."""
        f = np.float32
        state = self.row_buffers.get(name)
        if state is None:
            state = self.row_buffers[name] = _RowState.empty(p.shape, 1)
        had = state.n
        slots, summed = state.take(g)
        for start, stop, gc in state.gradient_chunks(slots, summed):
            if self.momentum:
                buf = state.arrays[0][start:stop]
                # rows new this step: their momentum starts as the gradient, as the dense first step's
                # (a row with zero momentum gets 0 * momentum + g, the same values)
                buf[:max(0, had - start)] *= f(self.momentum)
                buf += gc
                np.copyto(gc, buf)  # the step, in the gradient's buffer
            gc *= f(self.lr)
            p[state.ids[start:stop]] -= gc

    def state(self) -> dict[str, np.ndarray]:
        dense, rows = self.state_parts()
        return dense | {k: r.dense() for k, r in rows.items()}

    def state_parts(self) -> tuple[dict[str, np.ndarray], dict[str, SparseRows]]:
        """`state()` without making the tables' row state dense: the dense arrays (the optimizer's
        own) and the row state, under the same keys."""
        dense = {f"momentum/{k}": v for k, v in self.buffers.items()} | {"steps": np.array(self.steps)}
        return dense, {f"momentum/{k}": _sparse(r, 0) for k, r in self.row_buffers.items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.buffers = {k.split("/", 1)[1]: np.array(v) for k, v in state.items() if k.startswith("momentum/")}
        self.row_buffers, self.dense_tables = {}, set()
        self.steps = int(state.get("steps", 0))


@dataclass(frozen=True)
class AdamWStep:
    """What a native AdamW kernel needs besides the arrays: the hyperparameters and the step
    number (from 1) its bias correction uses."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


# A native step over [(weight, gradient, m, v), ...] (float32, C-contiguous, same shapes), in place.
DenseAdamWKernel = Callable[[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], AdamWStep], None]


def _kernel_takes(*arrays) -> bool:
    """Whether a native kernel can take these arrays as they are: dense float32 arrays of one
    shape, C-contiguous and writable (a kernel sees them as its own tensors, no copy)."""
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
               and a.shape == arrays[0].shape for a in arrays)


@dataclass
class AdamW:
    """torch.optim.AdamW semantics; updates the given arrays in place with one scratch buffer."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0
    # m and v of tables updated by rows (`_RowState`): a row that never had a gradient has m = v = 0,
    # and its update is exactly the decoupled decay, p * (1 - lr * wd)
    rows: dict[str, _RowState] = field(default_factory=dict)
    dense_tables: set[str] = field(default_factory=set)  # tables whose rows with state passed ROWS_DENSE_SHARE

    def begin_step(self) -> None:
        """Begin a step taken in parts (`step(..., begun=True)` for each): its count, once."""
        self.steps += 1

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray],
             dense_kernel: "DenseAdamWKernel | None" = None, begun: bool = False) -> dict[str, np.ndarray]:
        """One step over `params` in place. `dense_kernel`, an engine's native step (PyTorch's
        fused AdamW on the engine's own tensors), takes the weights with a dense float32 gradient
        all at once, this optimizer keeping their state: faster where the engine's kernel is, and
        the same semantics, though not bit for bit this module's rounding. Tables stepped by rows,
        and whatever the kernel does not take, go the numpy way. `begun`: these are part of the
        step `begin_step` began (an engine stepping each weight as its gradient comes)."""
        if not begun:
            self.begin_step()
        b1, b2 = self.betas
        c1 = 1 - b1 ** self.steps
        c2 = 1 - b2 ** self.steps
        f = np.float32
        scratch = _scratch(params)
        native: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for name, p in params.items():
            rows = None if name in self.dense_tables else _row_gradient(grads[name], p)
            if rows is not None:
                if name in self.m:  # dense moments (a loaded checkpoint): their live rows
                    self.rows[name] = _RowState.from_dense([self.m.pop(name), self.v.pop(name)])
                self._step_rows(name, p, rows, c1, c2)
                if self.rows[name].n > ROWS_DENSE_SHARE * p.shape[0]:
                    state = self.rows.pop(name)
                    self.m[name], self.v[name] = state.dense(0), state.dense(1)
                    self.dense_tables.add(name)
                continue
            if name in self.rows:  # a dense gradient after row steps: the moments dense again
                state = self.rows.pop(name)
                self.m[name], self.v[name] = state.dense(0), state.dense(1)
            m = self.m.get(name)
            v = self.v.get(name)
            if m is None:
                m = self.m[name] = np.zeros_like(p)
                v = self.v[name] = np.zeros_like(p)
            g = grads[name]
            if dense_kernel is not None and _kernel_takes(p, g, m, v):
                native.append((p, g, m, v))
                continue
            for pc, gc, mc, vc in _with_gradient(p, g, m, v):
                tmp = scratch[:pc.size].reshape(pc.shape) if pc.size <= scratch.size else np.empty(pc.shape, np.float32)
                self._moments_and_step(gc, mc, vc, tmp, c1, c2)
                if self.weight_decay:
                    pc *= f(1 - self.lr * self.weight_decay)
                pc -= tmp
        if native:
            dense_kernel(native, AdamWStep(self.lr, b1, b2, self.eps, self.weight_decay, self.steps))
        return params

    def _moments_and_step(self, gc, mc, vc, tmp, c1: float, c2: float) -> None:
        """m and v updated in place; tmp = the step (before the decay) for these elements."""
        b1, b2 = self.betas
        f = np.float32
        np.multiply(gc, f(1 - b1), out=tmp)
        mc *= f(b1)
        mc += tmp
        np.multiply(gc, gc, out=tmp)
        tmp *= f(1 - b2)
        vc *= f(b2)
        vc += tmp
        np.sqrt(vc, out=tmp)
        tmp *= f(1 / np.sqrt(c2))
        tmp += f(self.eps)
        np.divide(mc, tmp, out=tmp)
        tmp *= f(self.lr / c1)

    def _step_rows(self, name: str, p: np.ndarray, g: RowGradient, c1: float, c2: float) -> None:
        """The dense step's operations on the rows that ever had a gradient (their m, v and step),
        the decay alone on every row (the others' step is exactly zero: m / (sqrt(v) + eps) with
        m = v = 0): bit for bit the dense step, touching the table once."""
        f = np.float32
        state = self.rows.get(name)
        if state is None:
            state = self.rows[name] = _RowState.empty(p.shape, 2)
        slots, summed = state.take(g)
        if self.weight_decay:
            for (pc,) in _chunks(p):
                pc *= f(1 - self.lr * self.weight_decay)
        tmp = None
        for start, stop, gc in state.gradient_chunks(slots, summed):
            tmp = np.empty_like(gc) if tmp is None else tmp  # the first run is the longest
            tc = tmp[:gc.shape[0]]
            m, v = (a[start:stop] for a in state.arrays)
            for parts in _chunks(gc, m, v, tc):
                self._moments_and_step(*parts, c1, c2)
            p[state.ids[start:stop]] -= tc

    def state(self) -> dict[str, np.ndarray]:
        dense, rows = self.state_parts()
        return dense | {k: r.dense() for k, r in rows.items()}

    def state_parts(self) -> tuple[dict[str, np.ndarray], dict[str, SparseRows]]:
        """`state()` without making the tables' row state dense: the dense arrays (the optimizer's
        own) and the row state, under the same keys."""
        dense = ({f"m/{k}": x for k, x in self.m.items()} | {f"v/{k}": x for k, x in self.v.items()}
                 | {"steps": np.array(self.steps)})
        rows = {f"{kind}/{k}": _sparse(r, i) for k, r in self.rows.items() for i, kind in enumerate(("m", "v"))}
        return dense, rows

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.m = {k[2:]: np.array(x) for k, x in state.items() if k.startswith("m/")}
        self.v = {k[2:]: np.array(x) for k, x in state.items() if k.startswith("v/")}
        self.rows, self.dense_tables = {}, set()
        self.steps = int(state.get("steps", 0))


def make_optimizer(name: str, lr: float, weight_decay: float | None = None):
    if name == "sgd":
        return SGD(lr=lr, weight_decay=0.0 if weight_decay is None else weight_decay)
    if name == "adamw":
        return AdamW(lr=lr, weight_decay=0.01 if weight_decay is None else weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose sgd or adamw")
