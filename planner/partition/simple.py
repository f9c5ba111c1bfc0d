"""The partitions that need no solver: brute force, manual, even, greedy, and the feasibility check.

`brute_force_partition` is the tests' oracle (small instances only); `manual_partition` and
`even_partition` place given cuts (the even split is `ir.partition.even_ranges`, the project's one
even-split rule) without enforcing budgets; `greedy_partition` finds a plan that fits, fast, which
CP-SAT (planner.partition.cpsat) starts from; `check_feasible` checks any partition against the
problem statement independently of all of them.
"""
from __future__ import annotations

import itertools
import random
from typing import Sequence

from ir.partition import Partition, even_ranges
from planner.partition.explain import _does_not_fit
from planner.partition.instance import (US_PER_S, Assignment, PartitionInstance, _cuts_joined, _objective_us,
                                        _overflows, _partition)

# --- brute force (the tests' oracle) ---------------------------------------------------------

def _all_assignments(inst: PartitionInstance):
    n, nd = inst.blocks, len(inst.devices)
    for p in range(1, min(nd, n) + 1):
        for cuts in itertools.combinations(range(1, n), p - 1):
            if any(c - 1 in inst.joined for c in cuts):
                continue
            bounds = (0,) + cuts + (n,)
            ranges = tuple((bounds[i], bounds[i + 1] - 1) for i in range(p))
            for devs in itertools.permutations(range(nd), p):
                yield devs, ranges


def brute_force_partition(inst: PartitionInstance) -> Partition:
    """Every ordered device subset x every composition of the blocks; for tests (<= 10 blocks, <= 5 devices)."""
    if inst.blocks > 10 or len(inst.devices) > 5:
        raise ValueError(f"brute force is for small instances (<= 10 blocks, <= 5 devices), "
                         f"got {inst.blocks} blocks and {len(inst.devices)} devices")
    best, least = None, None
    for devs, ranges in _all_assignments(inst):
        worst = max(_overflows(inst, devs, ranges))
        if worst <= 0:
            obj = _objective_us(inst, devs, ranges)
            if best is None or obj < best[0]:
                best = (obj, devs, ranges)
        elif best is None and (least is None or worst < least[0]):
            least = (worst, devs, ranges)
    if best is None:
        raise _does_not_fit(inst, least[1], least[2])
    return _partition(inst, best[1], best[2], "brute-force", optimal=True)


# --- manual and even ------------------------------------------------------------------------

def _device_indices(inst: PartitionInstance, devices: Sequence[str]) -> tuple[int, ...]:
    index = {name: i for i, name in enumerate(inst.devices)}
    for name in devices:
        if name not in index:
            raise ValueError(f"no device {name!r} in the cluster (devices: {', '.join(inst.devices)})")
    if len(set(devices)) != len(devices):
        raise ValueError(f"a device may run one stage only; got {list(devices)}")
    if not devices:
        raise ValueError("at least one device is needed")
    return tuple(index[n] for n in devices)


def manual_partition(inst: PartitionInstance, devices: Sequence[str], cuts: Sequence[int]) -> Partition:
    """Stage i runs on devices[i]; `cuts` are the first blocks of stages 1..p-1 (e.g. [3, 6] for
    blocks 0-2, 3-5, 6-n). Budgets are not enforced here: run `check_feasible` on the result."""
    devs = _device_indices(inst, devices)
    cuts = list(cuts)
    if len(cuts) != len(devs) - 1:
        raise ValueError(f"{len(devs)} devices need {len(devs) - 1} cuts, got {len(cuts)}: {cuts}")
    bounds = [0] + cuts + [inst.blocks]
    for a, b in zip(bounds, bounds[1:]):
        if not (isinstance(b, int) and a < b):
            raise ValueError(f"cuts must be increasing block indices in 1..{inst.blocks - 1}, got {cuts}")
    ranges = tuple((bounds[i], bounds[i + 1] - 1) for i in range(len(devs)))
    _check_joined(inst, ranges)
    return _partition(inst, devs, ranges, "manual")


def _check_joined(inst: PartitionInstance, ranges: Sequence[tuple[int, int]]) -> None:
    cut = _cuts_joined(inst, ranges)
    if cut:
        k = cut[0]
        other = f" or {k + 2}" if k + 2 < inst.blocks else ""
        raise ValueError(f"cannot cut between block {k} {inst.block_names[k]!r} and block {k + 1} "
                         f"{inst.block_names[k + 1]!r}: they run as one on a stage (a decoder's LM head fused "
                         f"with its loss, planner.cost.joined_boundaries); start the stage at block {k}{other} "
                         f"instead")


def even_partition(inst: PartitionInstance, devices: Sequence[str] | None = None) -> Partition:
    """Equal block counts (the first stages take one more when it does not divide) over `devices`,
    all of the cluster's in order by default; blocks joined to the next (`PartitionInstance.joined`)
    count as one with it. Budgets are not enforced here."""
    devices = list(inst.devices if devices is None else devices)
    devs = _device_indices(inst, devices)
    # the units no cut may split: runs of blocks joined to the next
    units = [[0]]
    for k in range(1, inst.blocks):
        if k - 1 in inst.joined:
            units[-1].append(k)
        else:
            units.append([k])
    if len(devs) > len(units):
        joined = f" ({len(units)} once the joined blocks {list(inst.joined)} stay together)" if inst.joined else ""
        raise ValueError(f"{len(devs)} devices for {inst.blocks} blocks{joined}: each stage needs at least one block")
    ranges = tuple((units[a][0], units[b][-1]) for a, b in even_ranges(len(units), len(devs)))
    return _partition(inst, devs, ranges, "even")


# --- a greedy start -------------------------------------------------------------------------

def _greedy_fill(inst: PartitionInstance, order: Sequence[int], limit_us: int) -> Assignment | None:
    """Fill positions from the end of the pipeline: each device of `order` in turn takes blocks
    backwards from the last unassigned one while they fit its budget at that position and its
    compute stays within `limit_us` (one block at least); a device that cannot hold one is skipped."""
    k, devs, ranges = inst.blocks - 1, [], []
    for d in order:
        if k < 0:
            break
        r = len(devs)
        fl = inst.in_flight[r][0]
        memory, time_us, last, transient = inst.overhead_bytes[d], 0, k, 0
        at_update = memory
        while k >= 0:
            grow = inst.weight_bytes(d, k, r + 1, 0) + inst.input_bytes[k] * fl + inst.held_workspace(d, k, fl)
            more = inst.stage_compute_us(d, k, r + 1, 0)
            # the stage's one transient and its once part, the largest of its blocks' (PartitionInstance.
            # stage_bytes), and what it holds at its update (PartitionInstance.stage_phases)
            wider = max(transient, inst.transient_bytes[d][k])
            once = inst.stage_kept_once(d, k, last, fl)
            mapped = inst.stage_mapped_frozen(d, k, last)  # its frozen base held mapped, in both phases
            update = grow - inst.block_backward_bytes(d, k, fl) + inst.update_bytes[d][k]
            if (max(memory + grow + wider + once + mapped, at_update + update + mapped, inst.stage_floor_bytes(d))
                    > inst.memory_budget_bytes[d]
                    or (k < last and time_us + more > limit_us)):
                break
            memory, at_update, time_us, k, transient = memory + grow, at_update + update, time_us + more, k - 1, wider
        while k < last and k in inst.joined:  # the stage may not start inside a joined pair: give
            k += 1                             # its first block back to the next device
        if k < last:
            devs.append(d)
            ranges.append((k + 1, last))
    if k >= 0:
        return None
    return tuple(reversed(devs)), tuple(reversed(ranges))


def greedy_partition(inst: PartitionInstance) -> Assignment | None:
    """A plan that fits, found fast (None if the greedy finds none): a few device orders x a binary
    search on the stage-compute limit, keeping the least predicted step. CP-SAT starts from it, so
    large instances get a good plan even when the solver's time runs out before it finds one."""
    nd = len(inst.devices)
    total = [sum(row) for row in inst.compute_us]
    budget = inst.memory_budget_bytes
    orders = {tuple(range(nd)),
              tuple(sorted(range(nd), key=lambda d: total[d])),
              tuple(sorted(range(nd), key=lambda d: -total[d])),
              tuple(sorted(range(nd), key=lambda d: budget[d])),
              tuple(sorted(range(nd), key=lambda d: -budget[d])),
              # memory per unit of time: devices that hold much and run fast first, and last
              tuple(sorted(range(nd), key=lambda d: -budget[d] / max(1, total[d]))),
              tuple(sorted(range(nd), key=lambda d: budget[d] / max(1, total[d])))}
    shuffler = random.Random(0)  # a few seeded shuffles: cheap, and they help on mixed clusters
    for _ in range(8):
        order = list(range(nd))
        shuffler.shuffle(order)
        orders.add(tuple(order))
    best = None
    for order in sorted(orders):
        lo, hi = 0, max(total)
        while lo < hi:
            mid = (lo + hi) // 2
            found = _greedy_fill(inst, order, mid)
            if found is None:
                lo = mid + 1
                continue
            hi = mid
            if max(_overflows(inst, *found)) <= 0:
                value = _objective_us(inst, *found)
                if best is None or value < best[0]:
                    best = (value, found)
        found = _greedy_fill(inst, order, hi)
        if found is not None and max(_overflows(inst, *found)) <= 0:
            value = _objective_us(inst, *found)
            if best is None or value < best[0]:
                best = (value, found)
    return None if best is None else best[1]


# --- an independent check --------------------------------------------------------------------

def check_feasible(partition: Partition, inst: PartitionInstance) -> list[str]:
    """Problems of `partition` on `inst` (empty: it is a valid plan that fits every budget).

    Written from the problem statement, not from the solver or the evaluation helpers of
    planner.partition.instance, so
    that it can check them: structure, memory recomputed block by block, and recorded numbers.
    """
    problems: list[str] = []
    stages = partition.stages
    if not stages:
        return ["the partition has no stages"]
    p = len(stages)
    if p > len(inst.devices):
        problems.append(f"{p} stages but only {len(inst.devices)} devices")
        return problems
    seen: set[str] = set()
    next_block = 0
    for i, st in enumerate(stages):
        where = f"stage {i} on {st.device!r}"
        if st.stage != i:
            problems.append(f"{where}: numbered {st.stage}")
        if st.first_block != next_block or st.last_block < st.first_block:
            problems.append(f"{where}: runs blocks {st.first_block}..{st.last_block}, expected to start at {next_block}")
        next_block = st.last_block + 1
        if st.device not in inst.devices:
            problems.append(f"{where}: not a device of the cluster")
        elif st.device in seen:
            problems.append(f"{where}: the device already runs another stage")
        seen.add(st.device)
    if next_block != inst.blocks:
        problems.append(f"the stages end at block {next_block - 1}, the model has blocks 0..{inst.blocks - 1}")
    for st in stages[:-1]:
        if st.last_block in inst.joined:
            problems.append(f"stage {st.stage} on {st.device!r}: ends at block {st.last_block}, which is joined "
                            f"to block {st.last_block + 1} (they stay on one stage)")
    if problems:
        return problems
    for i, st in enumerate(stages):
        d = inst.devices.index(st.device)
        blocks = range(st.first_block, st.last_block + 1)
        need = inst.stage_bytes(d, st.first_block, st.last_block, p, i)
        budget = inst.memory_budget_bytes[d]
        where = f"stage {i} on {st.device!r}"
        if need > budget:
            problems.append(f"{where}: needs {need} bytes, {need - budget} over its budget of {budget}")
        if st.memory_bytes != need or st.memory_budget_bytes != budget:
            problems.append(f"{where}: records {st.memory_bytes} of {st.memory_budget_bytes} bytes, "
                            f"recomputed {need} of {budget}")
        links = 0
        for j, k in ((i - 1, st.first_block - 1), (i + 1, st.last_block)):
            if 0 <= j < p:
                e = inst.devices.index(stages[j].device)
                bw = inst.link_bandwidth_bytes_per_s[d][e]
                links += round(inst.boundary_bytes[k] * US_PER_S / bw) + inst.link_latency_us[d][e]
        # MNN skips its forward re-run where every backward follows its own forward: the last
        # stage of a 1F1B schedule, and any stage when there is one micro-batch
        reuse = inst.microbatches == 1 or (i == p - 1 and inst.schedule != "gpipe")
        t_us = sum(inst.compute_us[d][k] - (inst.recompute_us[d][k] if reuse else 0) for k in blocks) + links
        if abs(st.predicted_time_s - t_us / US_PER_S) > 1e-9:
            problems.append(f"{where}: records {st.predicted_time_s} s per micro-batch, recomputed {t_us / US_PER_S}")
    return problems
