"""Confidant's head allocator: split one attention layer's heads across a device's backends.

Inside a device, an attention layer's H heads can run concurrently on several backends (MNN on the
CPU, a GPU, a second engine); each backend computes its share of the heads, and the partial outputs
of the output projection are summed. This module decides the shares. It is pure: it reads measured
curves and returns a `HeadSplit`.

The model. Backend b computing h heads takes `curve_b(h) + extra_b` seconds, where `curve_b(h)` is
the measured forward+backward time of h heads (`ir.profile.AttentionCurve.seconds[h-1]`, already
the faster of fused and head-by-head) and `extra_b` is the fixed cost of using b at all besides the
primary backend: launch, copying the input in and the partial output out, and adding it to the
sum (0 for the primary, which holds the activations anyway). A backend given 0 heads costs
nothing. `confidant profile` measures `extra_b` per block signature
(`DeviceProfile.split_extra_cost_s`, `runtime.profiling.split_costs.split_extra_cost`): real splits beside the
backend `runtime.engines.split.attention` keeps in-process, the worst excess over the curves, which also holds
what the two concurrent engines slow each other down by; `planner.heads.choose_head_split`
passes it here for the backends a split runs in child processes. The split's time is the slowest
used backend's:

    time({h_b}) = max over b with h_b > 0 of curve_b(h_b) + extra_b,   sum of h_b = H.

The algorithm (exact for non-decreasing curves):

1. Drop every backend whose one-head time `curve_b(1) + extra_b` exceeds the drop threshold
   (default: the best single backend's full-H time, times `drop_factor`, default 1). With the
   default a dropped backend could never help: any split using it takes longer than one backend
   alone. A factor below 1 drops backends that could only help a little, at a possible loss.
2. Binary-search the time T over the finite set of candidate times `curve_b(h) + extra_b`: the
   capacity of b at T is the largest h with `curve_b(h) + extra_b <= T` (0 if none); T* is the
   smallest candidate whose capacities sum to >= H (whole heads only). Capacity grows with T, so
   the search is valid, and the optimum is one of the candidates, so T* is the optimum.
3. Assign exactly H heads: take the backends with the largest capacity at T* first, as few as
   reach H (fewer backends, fewer copies); then take back the surplus one head at a time from the
   backend that finishes last (trim the slowest share). Non-decreasing curves keep every finish
   time <= T*, and none is lower than T* for all, since T* is the least feasible time.
4. Never predict worse than the best single backend: if the split is slower (possible only with
   `drop_factor` < 1), return the best single backend with all H heads.

Measured curves are noisy and may dip (h+1 heads fused measured faster than h). Step 2 therefore
runs on each curve's running maximum, a safe upper bound; `predicted_s` is then the returned
split's time on the curves as given, which can only be lower. `exhaustive_split` is the oracle:
every split, on the curves as given.

What the partitioner sees. The cost model reads one backend's measured block costs per device.
`profile_with_head_split` lowers, in a copy of the profile, the forward+backward of every
attention-bearing block kind by what the split saves on its attention: that backend's own time for
all H heads minus the split's time. It never raises a cost and never takes one below zero.

`HeadSplit` belongs in `ir/plan.py` (DESIGN.md lists it there); it is defined here until it moves.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from ir.backend import engine_of, threads_of
from ir.graph import Graph, block_signature
from ir.profile import AttentionCurve, BlockCost, DeviceProfile

Curves = Mapping[str, "AttentionCurve | Sequence[float]"]


@dataclass(frozen=True)
class HeadSplit:
    """How one attention layer's heads are split across backends.

    `heads`: backend name -> heads it computes, only backends with at least one head, in the order
    the curves were given; the counts sum to H. `predicted_s`: the split's forward+backward seconds
    under the allocator's model. `single_best`: (backend, seconds) of the fastest backend computing
    all H heads alone, what the split is compared with. `dropped`: backends left out because one
    head on them takes longer than the drop threshold (and that do not run the whole layer alone)."""

    heads: dict[str, int]
    predicted_s: float
    single_best: tuple[str, float]
    dropped: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.heads:
            raise ValueError("a head split needs at least one backend with heads")
        bad = {b: h for b, h in self.heads.items() if isinstance(h, bool) or not isinstance(h, int) or h < 1}
        if bad:
            raise ValueError(f"head counts must be integers >= 1, got {bad}")
        if set(self.heads) & set(self.dropped):
            raise ValueError(f"backends {sorted(set(self.heads) & set(self.dropped))} are both dropped and given heads")

    @property
    def total_heads(self) -> int:
        return sum(self.heads.values())

    @property
    def speedup(self) -> float:
        """The best single backend's time over the split's (>= 1 for the allocator's splits)."""
        return self.single_best[1] / self.predicted_s if self.predicted_s > 0 else 1.0


def _prepare(curves: Curves, extra_cost_s: Mapping[str, float] | None) -> tuple[dict[str, tuple[float, ...]], dict[str, float], int]:
    if not curves:
        raise ValueError("no backends to split heads across")
    seconds = {b: tuple(float(s) for s in (c.seconds if isinstance(c, AttentionCurve) else c))
               for b, c in curves.items()}
    lengths = {b: len(s) for b, s in seconds.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"attention curves must cover the same heads; lengths per backend: {lengths}")
    heads = next(iter(lengths.values()))
    if heads < 1:
        raise ValueError("attention curves are empty (need seconds for h = 1..H)")
    for b, s in seconds.items():
        if not all(math.isfinite(x) and x >= 0 for x in s):
            raise ValueError(f"attention curve of {b!r} has a negative or non-finite time: {s}")
    extra = dict(extra_cost_s or {})
    unknown = sorted(set(extra) - set(seconds))
    if unknown:
        raise ValueError(f"extra_cost_s names backends without a curve: {unknown} (curves: {sorted(seconds)})")
    for b, x in extra.items():
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"extra_cost_s[{b!r}] must be a finite time >= 0, got {x}")
    return seconds, {b: float(extra.get(b, 0.0)) for b in seconds}, heads


def _time(split: Mapping[str, int], seconds: Mapping[str, Sequence[float]], extra: Mapping[str, float]) -> float:
    return max(seconds[b][h - 1] + extra[b] for b, h in split.items() if h > 0)


def split_time(split: Mapping[str, int], curves: Curves, extra_cost_s: Mapping[str, float] | None = None) -> float:
    """The model's time of a split (backend -> heads; zero counts allowed, at least one positive)."""
    seconds, extra, _ = _prepare(curves, extra_cost_s)
    if not any(h > 0 for h in split.values()):
        raise ValueError("a split must give some backend a head")
    return _time(split, seconds, extra)


def _single_best(seconds, extra, heads: int) -> tuple[str, float]:
    best = min(seconds, key=lambda b: seconds[b][heads - 1] + extra[b])  # first listed wins ties
    return best, seconds[best][heads - 1] + extra[best]


def allocate_heads(curves: Curves, extra_cost_s: Mapping[str, float] | None = None, *,
                   drop_factor: float = 1.0, drop_threshold_s: float | None = None) -> HeadSplit:
    """Split H heads across the backends of `curves` (name -> AttentionCurve or seconds for h = 1..H).

    `extra_cost_s`: per backend, the fixed seconds of using it besides the primary (missing: 0).
    Backends whose one-head time exceeds `drop_threshold_s` (default: `drop_factor` x the best single
    backend's full-H time) are dropped. See the module docstring for the model and the algorithm."""
    seconds, extra, heads = _prepare(curves, extra_cost_s)
    if not (math.isfinite(drop_factor) and drop_factor > 0):
        raise ValueError(f"drop_factor must be a finite number > 0, got {drop_factor}")
    best, best_s = _single_best(seconds, extra, heads)
    threshold = drop_factor * best_s if drop_threshold_s is None else float(drop_threshold_s)
    dropped = tuple(b for b in seconds if seconds[b][0] + extra[b] > threshold)
    kept = [b for b in seconds if b not in dropped]
    # step 4's answer; the best backend is not reported dropped when it runs everything
    fallback = HeadSplit({best: heads}, best_s, (best, best_s), tuple(b for b in dropped if b != best))
    if not kept:
        return fallback

    # Step 2 on running maxima (finish times that never fall as heads are added).
    bound = {b: tuple(itertools.accumulate((s + extra[b] for s in seconds[b]), max)) for b in kept}

    def capacity(b: str, t: float) -> int:
        return bisect.bisect_right(bound[b], t)

    candidates = sorted({t for b in kept for t in bound[b]})
    lo, hi = 0, len(candidates) - 1
    if sum(capacity(b, candidates[hi]) for b in kept) < heads:  # pragma: no cover - the max is always feasible
        raise AssertionError("no candidate time fits all heads")
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(capacity(b, candidates[mid]) for b in kept) >= heads:
            hi = mid
        else:
            lo = mid + 1
    t_star = candidates[lo]

    # Step 3: fewest backends (largest capacities first), then trim the surplus from the slowest.
    caps = {b: capacity(b, t_star) for b in kept}
    order = sorted((b for b in kept if caps[b] > 0), key=lambda b: -caps[b])  # stable: listed order breaks ties
    share: dict[str, int] = {}
    for b in order:
        if sum(share.values()) >= heads:
            break
        share[b] = caps[b]
    surplus = sum(share.values()) - heads
    while surplus > 0:
        # the backend finishing last; among equals the last-listed (the primary is usually listed first)
        slowest = max(reversed(list(share)), key=lambda b: bound[b][share[b] - 1])
        share[slowest] -= 1
        surplus -= 1
        if share[slowest] == 0:
            del share[slowest]

    split = {b: share[b] for b in seconds if b in share}
    predicted = _time(split, seconds, extra)
    if predicted > best_s:  # step 4: reachable with an aggressive threshold, or curves that dip
        return fallback
    return HeadSplit(split, predicted, (best, best_s), dropped)


def exhaustive_split(curves: Curves, extra_cost_s: Mapping[str, float] | None = None) -> HeadSplit:
    """The best split by trying every one (the oracle for tests): the least time, then the fewest
    backends, then the first in enumeration order. Nothing is dropped. Cost grows as
    C(H + n - 1, n - 1) for n backends: fine for n <= 4 and H <= 16, not for planning."""
    seconds, extra, heads = _prepare(curves, extra_cost_s)
    names = list(seconds)
    best_key, best_split = None, None
    for counts in _compositions(heads, len(names)):
        split = {b: h for b, h in zip(names, counts) if h > 0}
        key = (_time(split, seconds, extra), len(split))
        if best_key is None or key < best_key:
            best_key, best_split = key, split
    assert best_split is not None and best_key is not None
    return HeadSplit(best_split, best_key[0], _single_best(seconds, extra, heads), ())


def _compositions(total: int, parts: int):
    """Every tuple of `parts` non-negative integers summing to `total`."""
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, out = -1, []
        for bar in bars:
            out.append(bar - prev - 1)
            prev = bar
        out.append(total + parts - 2 - prev)
        yield tuple(out)


def profile_with_head_split(profile: DeviceProfile, backend: str | None, split: "HeadSplit | Mapping[str, int]",
                            extra_cost_s: Mapping[str, float] | None = None) -> DeviceProfile:
    """`profile` with the block costs of `backend` (None: the profile's fastest, as
    `DeviceProfile.backend`) lowered where `split` (a `HeadSplit` or backend -> heads) runs the
    attention, so that the partitioner and the predicted step time see the split device's speed.

    For each block signature with attention curves on `backend` and on every backend of the split:
    saving = `backend`'s curve at H heads - `split_time(split, curves, extra_cost_s)` (for the
    signature the split was allocated on, with the same extra costs, the latter is the split's
    `predicted_s`). The block's forward+backward is lowered by the saving, shared between forward
    and backward in proportion to them (the curves measure only their sum); the part of the
    backward that is MNN's re-run of the forward (`recompute_s`) shrinks in the same proportion,
    as the re-run covers the attention too. A saving <= 0 changes nothing, and one above the
    block's time takes it to 0. Signatures lacking a curve on `backend` or on a backend of the
    split keep their cost: no measurement, no credit. Every other backend and the workspace are
    unchanged.

    Memory: every backend of the split that `runtime.engines.split.attention` runs in a child process
    (`split_child_processes`) adds the profile's measured `split_child_bytes` of its engine kind
    to `runtime_overhead_bytes`, the memory the cost model charges the device besides its stage.
    A profile without the figure for a needed engine (one made before it was measured, or made by
    hand) is charged 0 bytes for that child, with a `UserWarning` that names the profile and the
    engine; re-running `confidant profile` on the device measures it. Pure: returns a new profile."""
    given = dict(split.heads if isinstance(split, HeadSplit) else split)
    heads = {b: h for b, h in given.items() if h > 0}  # a backend with no heads does not run
    if not heads:
        raise ValueError(f"head split {given} gives no backend a head")
    base = profile.backend(backend)  # a KeyError naming the profile's backends if unknown
    names = [b.backend for b in profile.backends]
    missing = [b for b in heads if b not in names]
    if missing:
        raise ValueError(f"head split {heads} names backends {missing} that profile {profile.name!r} lacks "
                         f"(it has {names}); plan the split from this device's profile")
    by_name = {b.backend: b for b in profile.backends}
    blocks = dict(base.blocks)
    for sig, own in base.attention.items():
        curves = {b: by_name[b].attention.get(sig) for b in heads}
        if sig not in blocks or any(c is None for c in curves.values()):
            continue
        total = sum(heads.values())
        if len(own.seconds) != total or any(len(c.seconds) != total for c in curves.values()):
            raise ValueError(f"profile {profile.name!r}, block signature {sig}: the attention curves cover "
                             f"{sorted({len(own.seconds)} | {len(c.seconds) for c in curves.values()})} heads but "
                             f"the split {heads} covers {total}; one split cannot serve blocks of different "
                             f"head counts (plan the split for this block kind)")
        saving = own.seconds[total - 1] - split_time(heads, curves, extra_cost_s)
        blocks[sig] = _lowered(blocks[sig], saving)
    lowered = dataclasses.replace(base, blocks=blocks)
    return dataclasses.replace(profile, backends=tuple(lowered if b is base else b for b in profile.backends),
                               runtime_overhead_bytes=profile.runtime_overhead_bytes
                               + _split_children_bytes(profile, heads))


def split_child_processes(split: "HeadSplit | Mapping[str, int]") -> list[str]:
    """The backends of `split` that `runtime.engines.split.attention.SplitAttention` (concurrent, as the split
    engine runs it) puts in child processes, in the split's order: with two or more backends given
    heads, all but one; the one kept in the calling process is the first torch backend if there is
    one (torch computes without holding the GIL), else the first. Restated here because the
    planner does not import the runtime; tests/planner/test_heads.py checks it against the runtime's."""
    given = split.heads if isinstance(split, HeadSplit) else split
    used = [b for b, h in given.items() if h > 0]
    if len(used) < 2:
        return []
    local = next((b for b in used if engine_of(b) == "torch"), used[0])
    return [b for b in used if b != local]


def _split_children_bytes(profile: DeviceProfile, heads: Mapping[str, int]) -> int:
    """Measured bytes of the split's child processes; 0 with a warning for an engine not measured.

    A torch backend kept in the worker's own process (the split engine's host runs MNN) makes the
    worker import torch too: charged as a torch child's bytes less an MNN child's, the measured
    difference between a process with torch and one without."""
    total = 0
    children = split_child_processes(heads)
    local = [b for b, h in heads.items() if h > 0 and b not in children]
    figures = profile.split_child_bytes
    if children and any(engine_of(b) == "torch" for b in local) and {"torch", "mnn"} <= set(figures):
        total += max(0, int(figures["torch"]) - int(figures["mnn"]))
    for b in children:
        engine = engine_of(b)
        if engine in profile.split_child_bytes:
            total += int(profile.split_child_bytes[engine])
        else:
            warnings.warn(f"profile {profile.name!r} has no measured memory of a {engine!r} head-split child "
                          f"process (split_child_bytes has {sorted(profile.split_child_bytes)}); the child of "
                          f"backend {b!r} is counted as 0 bytes. Re-run `confidant profile` on device "
                          f"{profile.name!r} to measure it", UserWarning, stacklevel=3)
    return total


def _lowered(cost: BlockCost, saving_s: float) -> BlockCost:
    """`cost` with forward+backward lowered by `saving_s`, in proportion, never below 0 or raised."""
    total = cost.forward_s + cost.backward_s
    if saving_s <= 0 or total <= 0:
        return cost
    keep = max(0.0, total - saving_s) / total
    return dataclasses.replace(cost, forward_s=cost.forward_s * keep, backward_s=cost.backward_s * keep,
                               recompute_s=cost.recompute_s * keep)


# --- the decision for one device ------------------------------------------------------------

def choose_head_split(graph: Graph, profile: DeviceProfile) -> "HeadSplit | None":
    """The head split to record for one device, or None: a `planner.heads.HeadSplit` across backends
    of `profile` (an `ir.profile.DeviceProfile`) for the attention of the first block (encoder or
    decoder) whose signature has curves on at least two of them. The split deals out units: heads,
    or under grouped-query attention key/value heads, each with its query heads (a curve's length).

    Candidates. The device is not the planning machine, so its core count is not known here; its
    profile is what we have. Backends of one split run concurrently and must not share cores, so a
    candidate set takes one backend per engine (mnn, torch, ...) for two or more engines, with
    thread counts summing to at most the largest thread count profiled on that device (a device
    profiled at tN has at least N cores to give); e.g. on a two-core device profiled at t1 and t2,
    mnn:cpu:t1 + torch:cpu:t1. Every candidate set is allocated (`allocate_heads`), and the set with
    the fastest prediction wins; when no set fits, no split.

    Fixed costs. Each candidate set is allocated with the profile's measured `split_extra_cost_s`
    for this block signature (`runtime.profiling.split_costs`) on the backends the split engine runs in
    child processes (`split_child_processes`: all but the in-process one, a torch backend
    if the set has one); the in-process backend pays none. A backend without a measured figure (a
    profile made before it was measured) is charged 0, as before: optimistic.

    The split is recorded only if it uses >= 2 backends and its prediction is below the H-head time
    of EVERY backend profiled with a curve for this signature, whatever its thread count: a single
    backend using all the cores (torch:cpu:t2) may beat two one-core backends split. The returned
    split's `single_best` is that fastest single backend. Any schedule: the split engine stashes
    weight versions like the MNN engine."""
    for block in graph.blocks:
        if block.attention is None:  # only attention the lowering could place (encoder or decoder)
            continue
        sig = block_signature(block)
        curves = {b.backend: b.attention[sig] for b in profile.backends if sig in b.attention}
        if len(curves) < 2:
            continue
        heads = len(next(iter(curves.values())).seconds)
        single = min(curves, key=lambda b: curves[b].seconds[heads - 1])  # first listed wins ties
        single_s = curves[single].seconds[heads - 1]
        by_engine: dict[str, list[str]] = {}
        for name in curves:
            by_engine.setdefault(engine_of(name), []).append(name)
        cores = max(threads_of(b.backend) for b in profile.backends)
        measured = profile.split_extra_cost_s.get(sig, {})
        best = None
        for n in range(2, len(by_engine) + 1):
            for engines in itertools.combinations(by_engine, n):
                for names in itertools.product(*(by_engine[e] for e in engines)):
                    if sum(threads_of(b) for b in names) > cores:
                        continue
                    # charged as if all of the set got heads; a split that leaves out the in-process
                    # backend is overcharged here, and tried correctly as its own smaller set
                    extra = {b: float(measured.get(b, 0.0)) for b in split_child_processes({b: 1 for b in names})}
                    split = allocate_heads({b: curves[b] for b in names}, extra)
                    if len(split.heads) >= 2 and (best is None or split.predicted_s < best.predicted_s):
                        best = split
        if best is None or not best.predicted_s < single_s:
            return None
        return replace(best, single_best=(single, single_s))
    return None


def split_extra_cost_s(graph: Graph, profile: DeviceProfile, split: "HeadSplit") -> dict[str, float]:
    """The measured fixed cost of each child backend of `split`, as choose_head_split allocated it
    (the first attention block with measured costs; 0 where none was measured)."""
    for block in graph.blocks:
        measured = profile.split_extra_cost_s.get(block_signature(block)) if block.attention is not None else None
        if measured:
            return {b: float(measured.get(b, 0.0)) for b in split_child_processes(split)}
    return {}


def split_base_backend(profile: DeviceProfile, chosen: str | None) -> str | None:
    """The MNN backend a head-split device runs its non-attention work on (None: it has none)."""
    if chosen is not None and engine_of(chosen) == "mnn":
        return chosen
    mnn = [b for b in profile.backends if engine_of(b.backend) == "mnn"]
    if not mnn:
        return None
    return min(mnn, key=lambda b: b.seconds).backend
