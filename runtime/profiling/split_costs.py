"""`split_extra_cost_s` (block signature -> backend -> seconds) is what a real head split costs beyond
the attention curves, the allocator's `extra_cost_s` (`planner.heads`). The curves time each
backend alone; a split also pays the child's command round trips, the copies of x and dy into
shared memory and of the partial output, dx and slice gradients out of it, the sum of the partial
outputs, and, because both engines now compute at once, whatever they slow each other down by
(shared caches and memory bandwidth). So, per attention block kind, the in-process backend of a
split is picked as `runtime.engines.split.attention` picks it (`split_primary`: a torch one if present), and
every other backend with a curve that fits beside it on this machine's CPUs runs real
`SplitAttention`s with it (`split_extra_cost`), the other in a child process as the split engine
runs it, for 1, H/2 and H-1 heads on the child; each takes the median of `reps` forward+backward
after a warm-up, and the backend's figure is the largest excess of a measured time over the
curves' max(curve_primary(h_p), curve_other(h_o)), floored at 0. The in-process backend has no
entry (0 by the allocator's model), nor has a backend that does not fit beside it (its pair would
only measure oversubscription). Measured on a 2-CPU x86-64 machine, mnn:cpu:t1 in a child beside
torch:cpu:t1 (benchmarks/heads.py, two runs, batch 8, seq 128): MiniLM's shape (12 heads of 32)
7-17 ms against ~40 ms splits, in ~1.7 s; BERT-base's (12 heads of 64) 76-111 ms, in ~5.5 s,
where the MNN child computed 27-43% slower than its in-process curve (its busy time, not the
copies). The figures are noisy (the curves themselves drift ±15%) and the worst excess is taken,
so they err high: they say when a split does not pay, not by exactly how much it loses.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ir.backend import BackendSpec
from ir.graph import Block, Graph
from ir.profile import AttentionCurve, BackendProfile
from runtime.engines.split.attention import SplitAttention
from runtime.engines.split.piece import AttentionForm, attention_form, bert_form, random_weights
from runtime.profiling.inputs import Progress, block_mask


@dataclass(frozen=True)
class SplitRun:
    """One measured allocation of a real split: `heads` on the measured backend, `primary_heads`
    on the in-process one, the median measured forward+backward seconds and the curves' prediction
    max(curve_primary(primary_heads), curve_backend(heads))."""

    heads: int
    primary_heads: int
    measured_s: float
    predicted_s: float
    # median compute seconds (forward + backward) per backend inside the split, as
    # `SplitAttention.last_busy_s` reports them: tells copies and round trips (measured above busy)
    # from the engines slowing each other (busy above their curves)
    busy_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SplitExtraCost:
    """What running `backend` in a child process next to `primary` costs beyond the curves."""

    backend: str
    primary: str
    runs: tuple[SplitRun, ...]

    @property
    def extra_s(self) -> float:
        """The fixed cost the allocator adds for `backend`: the worst excess over the runs, >= 0.
        The worst, not the mean: the copies are the same whatever the allocation, and what else
        the excess holds (the two engines slowing each other on shared caches and memory
        bandwidth) is a cost the planner must not be surprised by."""
        return max(0.0, max(r.measured_s - r.predicted_s for r in self.runs))


def split_primary(backends: Sequence[BackendSpec]) -> BackendSpec:
    """The backend a head split keeps in the calling process, as `runtime.engines.split.attention` does: a
    torch one if there is any (torch computes without holding the GIL), else the first; among
    several torch ones the one with the fewest threads, which leaves the most cores to the others.
    Its extra cost is 0 by definition (it holds the activations; `planner.heads`)."""
    if not backends:
        raise ValueError("no backends to pick a head split's in-process backend from")
    torch = [b for b in backends if b.engine == "torch"]
    return min(torch, key=lambda b: b.thread_count) if torch else backends[0]


def split_allocations(heads: int) -> list[int]:
    """Head counts for the measured (child) backend of a two-backend split of `heads` heads:
    1, H/2 and H-1 (distinct, each leaving the in-process backend at least one head)."""
    return sorted({h for h in (1, heads // 2, heads - 1) if 1 <= h <= heads - 1})


def time_split_attention(sa, x: np.ndarray, mask: np.ndarray, dy: np.ndarray, reps: int
                         ) -> tuple[list[float], list[dict[str, float]]]:
    """Wall seconds of `reps` forward+backward passes of a `runtime.engines.split.attention.SplitAttention`,
    and per pass each backend's busy seconds (its compute, without waiting for the others)."""
    times, busy = [], []
    for _ in range(reps):
        start = time.perf_counter()
        sa.forward(x, mask)
        fwd_busy = dict(sa.last_busy_s)
        sa.backward(dy)
        times.append(time.perf_counter() - start)
        busy.append({b: fwd_busy[b] + sa.last_busy_s[b] for b in fwd_busy})
    return times, busy


def split_extra_cost(primary: BackendSpec, other: BackendSpec, curves: Mapping[str, AttentionCurve],
                     batch: int, seq: int, hidden: int, heads: int, head_size: int, mask: np.ndarray,
                     reps: int = 3, start_timeout_s: float = 300.0, seed: int = 0,
                     form: AttentionForm | None = None) -> SplitExtraCost:
    """Run real splits of one attention block between `primary` (in this process) and `other` (in a
    child process) and compare them with what the curves predict.

    For each allocation of `split_allocations(heads)`, a `runtime.engines.split.attention.SplitAttention` is
    built as the split engine builds one (concurrent: fork server, shared memory, the child's serve
    loop; the primary listed first, so that it is the in-process backend even when neither is
    torch), runs one training forward and backward unmeasured, then `reps` timed ones; the median
    is compared with max(curve_primary(h_p), curve_other(h_o)), the allocator's model without
    extra costs. `curves` maps both backends' names to their curves of this block shape. `heads`
    counts the split's units (key/value groups under grouped-query attention, `form.units`);
    `form`: the block's attention form (BERT's if not given)."""
    if primary.name == other.name:
        raise ValueError(f"a split needs two different backends, got {primary.name} twice")
    if heads < 2:
        raise ValueError(f"a block of {heads} head(s) cannot be split")
    seconds = {b.name: tuple(curves[b.name].seconds) for b in (primary, other)}
    for name, s in seconds.items():
        if len(s) != heads:
            raise ValueError(f"the curve of {name} covers {len(s)} heads, the block has {heads}")
    form = form or bert_form(heads, head_size, hidden)
    full = random_weights(form, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq, hidden)).astype(np.float32)
    dy = (1e-3 * rng.standard_normal((batch, seq, hidden))).astype(np.float32)
    mask = np.asarray(mask, np.float32)
    runs = []
    for h_other in split_allocations(heads):
        h_primary = heads - h_other
        allocation = {primary.name: h_primary, other.name: h_other}
        with SplitAttention(full, heads, head_size, allocation, batch, seq, mask.shape,
                            start_timeout_s=start_timeout_s, form=form) as sa:
            if sa.placement != {primary.name: "process", other.name: "child"}:  # pragma: no cover - a rule changed
                raise AssertionError(f"split {allocation} placed its backends {sa.placement}; expected "
                                     f"{primary.name} in this process")
            sa.forward(x, mask)
            sa.backward(dy)
            times, busy = time_split_attention(sa, x, mask, dy, max(1, reps))
        predicted = max(seconds[primary.name][h_primary - 1], seconds[other.name][h_other - 1])
        runs.append(SplitRun(h_other, h_primary, statistics.median(times), predicted,
                             {b: statistics.median(r[b] for r in busy) for b in busy[0]}))
    return SplitExtraCost(other.name, primary.name, tuple(runs))


def measure_split_extra_costs(graph: Graph, kinds: Mapping[str, Block], feeds: Mapping[str, np.ndarray],
                               present: Sequence[BackendSpec], profiles: Sequence[BackendProfile], reps: int,
                               say: Progress, started: float) -> dict[str, dict[str, float]]:
    """`split_extra_cost_s`: per attention block kind of >= 2 heads, `split_extra_cost` of every
    backend with a curve besides the in-process one (`split_primary`) that fits next to it on this
    machine's CPUs (threads summed; an oversubscribed pair would measure the contention, not the
    split). A backend that fails is reported and left out (unknown), like one that does not fit."""
    cpus = os.cpu_count() or 1
    by_name = {b.name: b for b in present}
    out: dict[str, dict[str, float]] = {}
    for sig, block in kinds.items():
        if block.attention is None or (block.split_units or 0) < 2:
            continue
        curves = {p.backend: p.attention[sig] for p in profiles if sig in p.attention and p.backend in by_name}
        if len(curves) < 2:
            continue
        primary = split_primary([by_name[n] for n in curves])
        batch, seq, hidden = graph.values[block.inputs[0]].shape
        mask = block_mask(graph, block, feeds)
        costs: dict[str, float] = {}
        for name in curves:
            other = by_name[name]
            if other == primary:
                continue
            if other.thread_count + primary.thread_count > cpus:
                say(f"split extra cost {other.name}: not measured ({other.thread_count} + {primary.thread_count} threads "
                    f"beside {primary.name} on {cpus} CPUs)")
                continue
            try:
                form = attention_form(graph, block)
                got = split_extra_cost(primary, other, curves, batch, seq, hidden, form.units, block.head_size, mask,
                                       reps, form=form)
            except Exception as exc:  # noqa: BLE001 (any failure: the figure stays unknown, and says why)
                say(f"split extra cost {other.name}: not measured ({type(exc).__name__}: {str(exc).strip()[-300:]})")
                continue
            costs[other.name] = got.extra_s
            runs = ", ".join(f"{r.heads}+{r.primary_heads} {r.measured_s * 1e3:.1f} (curves {r.predicted_s * 1e3:.1f})"
                             for r in got.runs)
            say(f"split extra cost {other.name} beside {primary.name}, {block.name}: {got.extra_s * 1e3:.1f} ms "
                f"({'heads' if block.split_units == block.heads else 'key/value groups'} {other.name}+{primary.name}: {runs} ms) [{time.perf_counter() - started:.1f} s]")
        if costs:
            out[sig] = costs
    return out
