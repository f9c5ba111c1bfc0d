"""Cut a model into pipeline stages over the cluster's devices: CP-SAT, brute force, manual, even.

Every partitioner takes a fully prepared `PartitionInstance` (integers only: microseconds and
bytes, built by `make_instance` from planner.cost) and returns an `ir.partition.Partition` with
the predicted stage times and memory filled in, so everything downstream is shared.

The problem. Choose p (1 <= p <= min(devices, blocks)), an ordered list of p distinct devices
(the pipeline order) and contiguous block ranges, one per stage, covering every block in order,
such that every stage fits its device's memory budget, minimising the predicted step time of
planner.cost.predicted_step_s in integer microseconds. With C_s the stage's compute
(forward+backward of its blocks on its device, less MNN's forward re-run where the stage reuses
its forward: planner.cost.reuses_forward), U_s its optimizer step, and B_s one transfer of the
activation crossing boundary s (between stages s and s+1) over that device pair (bytes /
bandwidth + latency):
- flush schedules (gpipe, 1f1b-flush): t_s = C_s + B_s + B_{s-1};
  step = sum_s t_s + (m-1) max_s t_s + max_s U_s   (every stage updates at once after the flush)
- 1f1b-stash (asynchronous, transfers overlap compute, an update after every backward):
  step = m max(max_s (C_s + U_s), max_s 2 B_s)
Both are the exact objectives, not proxies: linear in sums and max variables.

Memory of stage s of p on device d is linear in the blocks it runs, with coefficients that
depend only on the stage's distance r = p-1-s from the last stage (planner.cost: weight copies
including old versions under 1f1b-stash, micro-batches in flight), and so does whether the
stage reuses its forward. The model therefore numbers stages from the end: one model covers
every stage count, positions 0..P-1 with position 0 always used and the high ones left empty
for shorter pipelines, and every coefficient stays a constant. The result is optimal when
CP-SAT proves it so within the time limit.

The model (the `_add_*` steps) has: pos[k] (the position of block k; falls by 0 or 1 per block,
0 at the last) channelled to in_pos[r][k]; used[r]; cut_after[k] and last_of[r][k] (block k
ends position r+1); on[r][c] (position r runs a device of class c, a class running at most as
many positions as it has devices: `device_classes` groups interchangeable devices, so eight
identical phones cost one class, not eight); compute C_r, update U_r and transfer B_r as
integer variables fixed by constraints enforced on on[r][c] (and on[r+1][a] for links, summed
over the few distinct boundary sizes); memory as one linear constraint per (r, c) enforced on
on[r][c].

When nothing fits, the same model with memory made soft (minimise the largest overflow over
any device) find the least-overflow assignment, and `PlanDoesNotFit` reports its tightest device,
by how much it is over, and what would help.
"""
from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from ir.graph import Graph
from ir.partition import Partition, StageAssignment
from planner.cluster import Cluster, format_bytes
from planner.cost import (ASYNC_SCHEDULES, OPTIMIZER_STATE_COPIES, accumulated_share, block_costs, block_input_bytes,
                          check_blocks, check_optimizer, check_schedule, in_flight_microbatches, reuses_forward,
                          weight_copies)

US_PER_S = 1_000_000


@dataclass(frozen=True)
class PartitionInstance:
    """Everything a partitioner needs, as integers (times in microseconds, sizes in bytes).

    Indices: d, e over `devices`; k over blocks; p-1 and s over the (stages, stage) tables, which
    have one row per stage count p = 1..len(devices), of length p.
    """

    devices: tuple[str, ...]
    block_names: tuple[str, ...]
    compute_us: tuple[tuple[int, ...], ...]          # [d][k] forward+backward of one micro-batch
    params_bytes: tuple[int, ...]                    # [k]
    input_bytes: tuple[int, ...]                     # [k] activation block k reads, stashed per micro-batch
    workspace_bytes: tuple[tuple[int, ...], ...]     # [d][k] per-op caches of one micro-batch
    overhead_bytes: tuple[int, ...]                  # [d] resident runtime
    memory_budget_bytes: tuple[int, ...]             # [d]
    boundary_bytes: tuple[int, ...]                  # [k], k < n-1: bytes crossing a cut after block k
    link_bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]  # [d][e]; the diagonal is unused
    link_latency_us: tuple[tuple[int, ...], ...]     # [d][e]; the diagonal is unused
    weight_copies: tuple[tuple[int, ...], ...]       # [p-1][s] bytes held per parameter byte
    in_flight: tuple[tuple[int, ...], ...]           # [p-1][s] micro-batches of activations held
    microbatches: int
    schedule: str
    optimizer: str = "sgd"
    # [d][k] the part of compute_us that is MNN's re-run of the forward, skipped where the stage
    # reuses its forward (`reuses`); [d][k] one optimizer step over block k's parameters.
    # Empty: all zero (profiles without these measurements).
    recompute_us: tuple[tuple[int, ...], ...] = ()
    update_us: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        check_schedule(self.schedule)
        check_optimizer(self.optimizer)
        nd, n = len(self.devices), len(self.block_names)
        if nd < 1 or n < 1:
            raise ValueError(f"an instance needs at least one device and one block, got {nd} and {n}")
        if len(set(self.devices)) != nd:
            raise ValueError(f"device names repeat: {self.devices}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {self.microbatches!r}")
        shapes = {
            "compute_us": (self.compute_us, (nd, n)), "workspace_bytes": (self.workspace_bytes, (nd, n)),
            "params_bytes": (self.params_bytes, (n,)), "input_bytes": (self.input_bytes, (n,)),
            "overhead_bytes": (self.overhead_bytes, (nd,)), "memory_budget_bytes": (self.memory_budget_bytes, (nd,)),
            "boundary_bytes": (self.boundary_bytes, (n - 1,)),
            "link_bandwidth_bytes_per_s": (self.link_bandwidth_bytes_per_s, (nd, nd)),
            "link_latency_us": (self.link_latency_us, (nd, nd)),
        }
        for name, (value, shape) in shapes.items():
            rows = value if len(shape) == 2 else [value]
            if len(value) != shape[0] or (len(shape) == 2 and any(len(r) != shape[1] for r in rows)):
                raise ValueError(f"PartitionInstance.{name} must have shape {shape}")
            for r in rows:
                if any(x < 0 for x in r):
                    raise ValueError(f"PartitionInstance.{name} has a negative entry")
        for name in ("recompute_us", "update_us"):
            table = getattr(self, name)
            if not table:
                object.__setattr__(self, name, tuple((0,) * n for _ in range(nd)))
            elif len(table) != nd or any(len(r) != n or any(x < 0 for x in r) for r in table):
                raise ValueError(f"PartitionInstance.{name} must have shape {(nd, n)} with entries >= 0")
        if any(r > c for rr, cr in zip(self.recompute_us, self.compute_us) for r, c in zip(rr, cr)):
            raise ValueError("PartitionInstance.recompute_us exceeds compute_us: the re-run is part of the backward")
        for name in ("weight_copies", "in_flight"):
            table = getattr(self, name)
            if len(table) != nd or any(len(row) != p + 1 for p, row in enumerate(table)):
                raise ValueError(f"PartitionInstance.{name} needs one row per stage count 1..{nd}, of that length")
            # the solver numbers stages from the end (see the CP-SAT section), which is exact only
            # because these counts depend on p-1-s alone (true of every schedule in planner.cost)
            for p, row in enumerate(table, start=1):
                for s, x in enumerate(row):
                    if x != table[p - 1 - s][0]:
                        raise ValueError(f"PartitionInstance.{name}[{p - 1}][{s}] = {x} differs from "
                                         f"[{p - 1 - s}][0] = {table[p - 1 - s][0]}: the entry must depend "
                                         f"only on the distance p-1-s from the last stage")
        for d, e in itertools.permutations(range(nd), 2):
            if self.link_bandwidth_bytes_per_s[d][e] <= 0:
                raise ValueError("PartitionInstance.link_bandwidth_bytes_per_s must be more than 0 between devices")
            if (self.link_bandwidth_bytes_per_s[d][e] != self.link_bandwidth_bytes_per_s[e][d]
                    or self.link_latency_us[d][e] != self.link_latency_us[e][d]):
                raise ValueError(f"links must be symmetric: {self.devices[d]!r}-{self.devices[e]!r} differs "
                                 f"from {self.devices[e]!r}-{self.devices[d]!r}")

    @property
    def blocks(self) -> int:
        return len(self.block_names)

    def reuses(self, p: int, s: int) -> bool:
        """Whether stage s of p skips MNN's forward re-run (planner.cost.reuses_forward)."""
        return reuses_forward(self.schedule, p, s, self.microbatches)

    def stage_compute_us(self, d: int, k: int, p: int, s: int) -> int:
        """Block k's forward+backward on device d at stage s of p."""
        return self.compute_us[d][k] - (self.recompute_us[d][k] if self.reuses(p, s) else 0)

    def transfer_us(self, d: int, e: int, k: int) -> int:
        """One transfer of the activation after block k between devices d and e."""
        return round(self.boundary_bytes[k] * US_PER_S / self.link_bandwidth_bytes_per_s[d][e]) + self.link_latency_us[d][e]


def make_instance(graph: Graph, cluster: Cluster, schedule: str, microbatches: int, optimizer: str) -> PartitionInstance:
    """The instance for partitioning `graph` over all of `cluster`'s devices (planner.cost's numbers)."""
    check_schedule(schedule)
    check_optimizer(optimizer)
    blocks = check_blocks(graph)
    specs = cluster.devices
    costs = [block_costs(graph, spec) for spec in specs]
    share = accumulated_share(schedule, microbatches)  # gradient additions per micro-batch
    nd = len(specs)

    def link(d: int, e: int):
        return None if d == e else cluster.link(specs[d].name, specs[e].name)

    return PartitionInstance(
        devices=tuple(s.name for s in specs),
        block_names=tuple(b.name for b in blocks),
        compute_us=tuple(tuple(round((c.forward_s + c.backward_s + b.params_bytes * share
                                      * s.profile.accumulate_s_per_param_byte) * US_PER_S)
                               for c, b in zip(row, blocks)) for row, s in zip(costs, specs)),
        params_bytes=tuple(b.params_bytes for b in blocks),
        input_bytes=block_input_bytes(graph),
        workspace_bytes=tuple(tuple(c.workspace_bytes for c in row) for row in costs),
        overhead_bytes=tuple(s.profile.runtime_overhead_bytes for s in specs),
        memory_budget_bytes=tuple(s.memory_budget_bytes for s in specs),
        boundary_bytes=tuple(b.activation_bytes for b in blocks[:-1]),
        link_bandwidth_bytes_per_s=tuple(tuple(math.inf if link(d, e) is None else link(d, e).bandwidth_bytes_per_s
                                               for e in range(nd)) for d in range(nd)),
        link_latency_us=tuple(tuple(0 if link(d, e) is None else round(link(d, e).latency_s * US_PER_S)
                                    for e in range(nd)) for d in range(nd)),
        weight_copies=tuple(tuple(weight_copies(schedule, optimizer, p, s, microbatches) for s in range(p))
                            for p in range(1, nd + 1)),
        in_flight=tuple(tuple(in_flight_microbatches(schedule, p, s, microbatches) for s in range(p))
                        for p in range(1, nd + 1)),
        microbatches=microbatches, schedule=schedule, optimizer=optimizer,
        recompute_us=tuple(tuple(round(c.recompute_s * US_PER_S) for c in row) for row in costs),
        update_us=tuple(tuple(round(b.params_bytes * s.profile.update_s_per_param_byte.get(optimizer, 0.0) * US_PER_S)
                              for b in blocks) for s in specs))


# --- evaluating one assignment (shared by brute force, the solver's answer and manual plans) ---

Assignment = tuple[tuple[int, ...], tuple[tuple[int, int], ...]]  # device indices, block ranges


def _memory_bytes(inst: PartitionInstance, d: int, first: int, last: int, s: int, p: int) -> int:
    wc, fl = inst.weight_copies[p - 1][s], inst.in_flight[p - 1][s]
    return inst.overhead_bytes[d] + sum(inst.params_bytes[k] * wc + inst.input_bytes[k] * fl
                                        + inst.workspace_bytes[d][k] for k in range(first, last + 1))


def _times_us(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]):
    """(compute per stage, one transfer per boundary, optimizer step per stage)."""
    p = len(devs)
    compute = [sum(inst.stage_compute_us(d, k, p, s) for k in range(first, last + 1))
               for s, (d, (first, last)) in enumerate(zip(devs, ranges))]
    link = [inst.transfer_us(devs[s], devs[s + 1], ranges[s][1]) for s in range(p - 1)]
    update = [sum(inst.update_us[d][first:last + 1]) for d, (first, last) in zip(devs, ranges)]
    return compute, link, update


def _stage_times_us(compute: list[int], link: list[int]) -> list[int]:
    p = len(compute)
    return [compute[s] + (link[s] if s < p - 1 else 0) + (link[s - 1] if s > 0 else 0) for s in range(p)]


def _objective_us(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]) -> int:
    compute, link, update = _times_us(inst, devs, ranges)
    if inst.schedule in ASYNC_SCHEDULES:
        return inst.microbatches * max([c + u for c, u in zip(compute, update)] + [2 * b for b in link])
    times = _stage_times_us(compute, link)
    return sum(times) + (inst.microbatches - 1) * max(times) + max(update)


def _overflows(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[int]:
    p = len(devs)
    return [_memory_bytes(inst, d, first, last, s, p) - inst.memory_budget_bytes[d]
            for s, (d, (first, last)) in enumerate(zip(devs, ranges))]


def _partition(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]], method: str,
               optimal: bool = False) -> Partition:
    p = len(devs)
    compute, link, _ = _times_us(inst, devs, ranges)
    times = _stage_times_us(compute, link)
    stages = tuple(StageAssignment(s, inst.devices[d], first, last, times[s] / US_PER_S,
                                   _memory_bytes(inst, d, first, last, s, p), inst.memory_budget_bytes[d])
                   for s, (d, (first, last)) in enumerate(zip(devs, ranges)))
    return Partition(stages, method, max(times) / US_PER_S, optimal)


def _assignment(inst: PartitionInstance, partition: Partition) -> Assignment:
    index = {name: i for i, name in enumerate(inst.devices)}
    return tuple(index[n] for n in partition.devices), tuple(partition.ranges)


def predicted_step_us(inst: PartitionInstance, partition: Partition) -> int:
    """The objective every partitioner minimises: predicted step time in integer microseconds."""
    devs, ranges = _assignment(inst, partition)
    return _objective_us(inst, devs, ranges)


# --- when nothing fits ---------------------------------------------------------------------------

class PlanDoesNotFit(ValueError):
    """No assignment fits the memory budgets. `over_bytes` is the least, over all assignments, of
    the largest overflow of any device: every plan overflows some device by at least that much.
    `device` is the tightest device of the assignment that attains it (`attempt`). When the
    search ran out of time, the message says the bound is not proven."""

    def __init__(self, message: str, device: str, over_bytes: int, attempt: Partition):
        super().__init__(message)
        self.device = device
        self.over_bytes = over_bytes
        self.attempt = attempt


def _nbytes(n: int) -> str:
    return f"{n} bytes" if abs(n) < 1024 else f"{n} bytes ({format_bytes(n)})"


def _blocks_text(first: int, last: int) -> str:
    return f"block {first}" if first == last else f"blocks {first}-{last}"


def _does_not_fit(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]],
                  proven: bool = True) -> PlanDoesNotFit:
    """The error for the least-overflow assignment (devs, ranges), with what would help on its
    tightest device; `proven`: no plan fits and no assignment overflows less (else: none found in time)."""
    p = len(devs)
    over = _overflows(inst, devs, ranges)
    s = max(range(p), key=lambda i: over[i])
    d, (first, last) = devs[s], ranges[s]
    name, budget, worst = inst.devices[d], inst.memory_budget_bytes[d], over[s]
    plan = ", ".join(f"{inst.devices[e]} {_blocks_text(a, b)}" for e, (a, b) in zip(devs, ranges))
    others = [f"{inst.devices[devs[i]]!r} by {_nbytes(over[i])}" for i in range(p) if i != s and over[i] > 0]
    params = sum(inst.params_bytes[first:last + 1])
    activations = sum(inst.input_bytes[first:last + 1])
    hints = [f"more devices, or larger memory budgets (at least {worst} more bytes on {name!r})"]
    # copies beyond a one-stage pipeline's are old weight versions (1f1b-stash only)
    old = inst.weight_copies[p - 1][s] - inst.weight_copies[0][0] if inst.schedule in ASYNC_SCHEDULES else 0
    if old > 0 and params:
        hints.append(f"1f1b-flush instead of 1f1b-stash: saves {_nbytes(old * params)} on {name!r} "
                     f"({old} old weight version{'s' if old != 1 else ''})")
    in_flight = inst.in_flight[p - 1][s]
    if activations and in_flight:
        hints.append(f"fewer micro-batches in flight or smaller micro-batches: stashed activations take "
                     f"{_nbytes(in_flight * activations)} on {name!r} ({in_flight} micro-batches in flight"
                     + ("; 1f1b-flush keeps at most p-s of gpipe's m)" if inst.schedule == "gpipe" else ")"))
    if inst.optimizer == "adamw" and params:
        saving = (OPTIMIZER_STATE_COPIES["adamw"] - OPTIMIZER_STATE_COPIES["sgd"]) * params
        hints.append(f"sgd instead of adamw: saves {_nbytes(saving)} on {name!r} (one optimizer state copy less)")
    claim = (f"every plan overflows some device by at least {_nbytes(worst)}" if proven else
             f"the best attempt found in the time limit overflows a device by {_nbytes(worst)} (not proven: a "
             f"longer time_limit_s may find a plan)")
    message = (f"no plan fits the memory budgets ({inst.schedule}, {inst.microbatches} micro-batches, "
               f"{inst.optimizer}): {claim}. "
               f"Tightest device: {name!r}, which in the best attempt ({plan}) needs {budget + worst} bytes "
               f"of its {budget}-byte budget"
               + (f" (also over there: {', '.join(others)})" if others else "")
               + ". What would make it fit:\n" + "\n".join(f"  - {h}" for h in hints))
    return PlanDoesNotFit(message, name, worst, _partition(inst, devs, ranges, "least-overflow"))


# --- brute force (the tests' oracle) ---------------------------------------------------------

def _all_assignments(inst: PartitionInstance):
    n, nd = inst.blocks, len(inst.devices)
    for p in range(1, min(nd, n) + 1):
        for cuts in itertools.combinations(range(1, n), p - 1):
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
    return _partition(inst, devs, ranges, "manual")


def even_partition(inst: PartitionInstance, devices: Sequence[str] | None = None) -> Partition:
    """Equal block counts (the first stages take one more when it does not divide) over `devices`,
    all of the cluster's in order by default. Budgets are not enforced here."""
    devices = list(inst.devices if devices is None else devices)
    devs = _device_indices(inst, devices)
    p, n = len(devs), inst.blocks
    if p > n:
        raise ValueError(f"{p} devices for {n} blocks: each stage needs at least one block")
    sizes = [n // p + (1 if i < n % p else 0) for i in range(p)]
    starts = list(itertools.accumulate([0] + sizes[:-1]))
    return _partition(inst, devs, tuple((a, a + size - 1) for a, size in zip(starts, sizes)), "even")


# --- interchangeable devices -----------------------------------------------------------------

def device_classes(inst: PartitionInstance) -> tuple[tuple[int, ...], ...]:
    """Groups of devices the solver may treat as interchangeable, each in index order.

    Two devices are interchangeable when their measured costs, memory figures and budgets are equal
    and every other device reaches them over equal links, so that a plan stays as good when the two
    swap. Clusters of edge devices repeat a few device models (eight phones of one kind), and the
    model grows with the number of classes, not of devices. Found by partition refinement: start
    from equal costs and budgets, split by the multiset of link values towards each class until
    stable, and split a class into single devices where one member sees different links towards
    the members of one class (refinement alone cannot see that).
    """
    nd = len(inst.devices)
    bw, lat = inst.link_bandwidth_bytes_per_s, inst.link_latency_us
    keys: dict = {}
    label = [keys.setdefault((inst.compute_us[d], inst.recompute_us[d], inst.update_us[d], inst.workspace_bytes[d],
                              inst.overhead_bytes[d], inst.memory_budget_bytes[d]), len(keys)) for d in range(nd)]

    def towards(d: int) -> dict[int, list]:
        out: dict[int, list] = {}
        for e in range(nd):
            if e != d:
                out.setdefault(label[e], []).append((bw[d][e], lat[d][e]))
        return out

    while True:
        while True:
            sigs: dict = {}
            new = [sigs.setdefault((label[d], tuple(sorted((c, tuple(sorted(v))) for c, v in towards(d).items()))),
                                   len(sigs)) for d in range(nd)]
            stable = len(sigs) == len(set(label))
            label = new
            if stable:
                break
        mixed = {label[d] for d in range(nd) if any(len(set(v)) > 1 for v in towards(d).values())}
        if not mixed:
            break
        label = [label[d] if label[d] not in mixed else len(label) + d for d in range(nd)]
    groups: dict[int, list[int]] = {}
    for d in range(nd):
        groups.setdefault(label[d], []).append(d)
    return tuple(tuple(g) for g in sorted(groups.values()))


# --- the CP-SAT model ---------------------------------------------------------------------
#
# One model for every stage count. Stages are numbered from the END of the pipeline (position
# r = p-1-s), because everything a stage's cost depends on besides its blocks and device is a
# function of r alone: micro-batches in flight (min(r+1, m) under 1F1B), old weight versions
# (from min(r, m)), whether it reuses its forward (r = 0). So position 0 always exists and a plan
# with fewer stages simply leaves the high positions unused, with no per-p models.

@dataclass
class _Vars:
    model: cp_model.CpModel
    positions: int
    classes: tuple          # device classes (tuples of device indices)
    pos: list               # [k] IntVar: position of block k, counted from the last stage
    in_pos: list            # [r][k] BoolVar
    used: list              # [r] BoolVar: the pipeline has a stage at position r
    cut_after: list         # [k] BoolVar, k < n-1
    last_of: list           # [r][k] BoolVar: block k ends position r+1 (r < positions-1, k < n-1)
    on: list                # [r][c] BoolVar: position r runs a device of class c
    compute: list           # [r] IntVar, microseconds
    link: list              # [r] IntVar, one transfer between positions r+1 and r (r < positions-1)
    update: list            # [r] IntVar, the position's optimizer step, microseconds
    slowest: object = None  # IntVar: the largest stage time (flush) or period (1f1b-stash)
    slowest_update: object = None  # IntVar: the largest optimizer step (flush)


def _add_stage_order(model: cp_model.CpModel, inst: PartitionInstance, P: int):
    """Contiguous stages in order: pos falls by 0 or 1 per block, down to 0 at the last block."""
    n = inst.blocks
    pos = [model.new_int_var(0, P - 1, f"pos_{k}") for k in range(n)]
    in_pos = [[model.new_bool_var(f"in_{r}_{k}") for k in range(n)] for r in range(P)]
    cut_after = [model.new_bool_var(f"cut_{k}") for k in range(n - 1)]
    model.add(pos[n - 1] == 0)
    for k in range(n):
        model.add_exactly_one(in_pos[r][k] for r in range(P))
        model.add(pos[k] == sum(r * in_pos[r][k] for r in range(P)))
    for k in range(n - 1):
        model.add(pos[k] == pos[k + 1] + cut_after[k])
    # position r is used iff block 0 (in the first stage, position p-1) sits at r or beyond
    used = [model.new_bool_var(f"used_{r}") for r in range(P)]
    for r in range(P):
        model.add(used[r] == sum(in_pos[q][0] for q in range(r, P)))
    last_of = []
    for r in range(P - 1):
        row = []
        for k in range(n - 1):
            e = model.new_bool_var(f"last_{r}_{k}")
            model.add_implication(e, in_pos[r + 1][k])
            model.add_implication(e, cut_after[k])
            model.add_bool_or([in_pos[r + 1][k].Not(), cut_after[k].Not(), e])
            row.append(e)
        model.add(sum(row) == used[r + 1])
        last_of.append(row)
    return pos, in_pos, used, cut_after, last_of


def _add_device_order(model: cp_model.CpModel, classes, used: list, P: int):
    """Each used position runs one device of some class; a class runs at most its size of them."""
    on = [[model.new_bool_var(f"on_{r}_{c}") for c in range(len(classes))] for r in range(P)]
    for r in range(P):
        model.add(sum(on[r]) == used[r])
    for c, members in enumerate(classes):
        model.add(sum(on[r][c] for r in range(P)) <= len(members))
    return on


def _add_compute(v: _Vars, inst: PartitionInstance) -> None:
    """compute[r] and update[r] = the position's blocks' time and optimizer step on its device."""
    n, weighted = inst.blocks, cp_model.LinearExpr.weighted_sum  # weighted_sum: fast to build
    for r in range(v.positions):
        for c, members in enumerate(v.classes):
            d = members[0]
            v.model.add(v.compute[r] == weighted(v.in_pos[r], [inst.stage_compute_us(d, k, r + 1, 0) for k in range(n)])
                        ).only_enforce_if(v.on[r][c])
            v.model.add(v.update[r] == weighted(v.in_pos[r], list(inst.update_us[d]))).only_enforce_if(v.on[r][c])
        v.model.add(v.compute[r] == 0).only_enforce_if(v.used[r].Not())
        v.model.add(v.update[r] == 0).only_enforce_if(v.used[r].Not())


def _add_memory(v: _Vars, inst: PartitionInstance, overflow=None) -> None:
    """The stage at position r fits its device's budget (or exceeds it by at most `overflow`)."""
    for r in range(v.positions):
        wc, fl = inst.weight_copies[r][0], inst.in_flight[r][0]  # stage 0 of r+1 stages is at position r
        for c, members in enumerate(v.classes):
            d = members[0]
            used = inst.overhead_bytes[d] + cp_model.LinearExpr.weighted_sum(v.in_pos[r], [
                inst.params_bytes[k] * wc + inst.input_bytes[k] * fl + inst.workspace_bytes[d][k]
                for k in range(inst.blocks)])
            limit = inst.memory_budget_bytes[d] + (0 if overflow is None else overflow)
            v.model.add(used <= limit).only_enforce_if(v.on[r][c])


def _add_links(v: _Vars, inst: PartitionInstance) -> None:
    """link[r] = one transfer of the activation ending position r+1, between the two devices.

    A transfer's time depends on the bytes crossing the cut, and a transformer's boundaries share
    a few sizes (every encoder block passes the same hidden state), so the constraint per pair of
    classes sums over the distinct sizes, not over the blocks."""
    sizes = sorted(set(inst.boundary_bytes))
    at_size = {b: [k for k in range(inst.blocks - 1) if inst.boundary_bytes[k] == b] for b in sizes}
    for r in range(v.positions - 1):
        crossing = {b: sum(v.last_of[r][k] for k in at_size[b]) for b in sizes}
        for a, first in enumerate(v.classes):
            for c, second in enumerate(v.classes):
                d, e = first[0], (second[1] if a == c and len(second) > 1 else second[0])
                if d == e:
                    continue  # a one-device class cannot run two positions
                k_of = {b: at_size[b][0] for b in sizes}
                v.model.add(v.link[r] == sum(inst.transfer_us(d, e, k_of[b]) * crossing[b] for b in sizes)
                            ).only_enforce_if([v.on[r + 1][a], v.on[r][c]])
        v.model.add(v.link[r] == 0).only_enforce_if(v.used[r + 1].Not())


def _add_objective(v: _Vars, inst: PartitionInstance) -> None:
    """The predicted step time (see the module docstring)."""
    m, model, P = inst.microbatches, v.model, v.positions
    compute_ub, link_ub, update_ub = _upper_bounds_us(inst)
    slowest = model.new_int_var(0, compute_ub + update_ub + 2 * link_ub, "slowest")
    slowest_update = model.new_int_var(0, update_ub, "slowest_update")
    for r in range(P):
        if inst.schedule in ASYNC_SCHEDULES:
            model.add(slowest >= v.compute[r] + v.update[r])
            if r < P - 1:
                model.add(slowest >= 2 * v.link[r])
        else:
            model.add(slowest >= v.compute[r] + (v.link[r] if r < P - 1 else 0) + (v.link[r - 1] if r > 0 else 0))
            model.add(slowest_update >= v.update[r])
    # Redundant bounds for the LP relaxation, which the enforced constraints leave weak: every
    # block runs somewhere, at least as fast as on its fastest device (with forward reuse).
    cheapest = [min(inst.compute_us[d][k] - inst.recompute_us[d][k] for d in range(len(inst.devices)))
                for k in range(inst.blocks)]
    model.add(sum(v.compute) >= sum(cheapest))
    model.add(slowest >= max(cheapest))
    v.slowest, v.slowest_update = slowest, slowest_update
    if inst.schedule in ASYNC_SCHEDULES:
        model.minimize(m * slowest)
    else:
        model.minimize(sum(v.compute) + 2 * sum(v.link) + (m - 1) * slowest + slowest_update)


def _upper_bounds_us(inst: PartitionInstance) -> tuple[int, int, int]:
    """Largest possible stage compute, single transfer and stage optimizer step."""
    nd = len(inst.devices)
    return (max(sum(row) for row in inst.compute_us),
            max([0] + [inst.transfer_us(d, e, k) for d in range(nd) for e in range(nd) if d != e
                       for k in range(inst.blocks - 1)]),
            max(sum(row) for row in inst.update_us))


def model_size(inst: PartitionInstance) -> dict[str, int]:
    """Positions, device classes, boundary sizes and linear terms of the model (for benchmarks)."""
    P, C, n = min(len(inst.devices), inst.blocks), len(device_classes(inst)), inst.blocks
    J = len(set(inst.boundary_bytes))
    return {"positions": P, "classes": C, "boundary_sizes": J,
            "terms": P * C * 3 * n + (P - 1) * C * C * J + P * n * 4}


def _build(inst: PartitionInstance, soft_memory: bool = False) -> _Vars:
    """The model; with `soft_memory`, minimise the largest overflow instead of the step time."""
    model = cp_model.CpModel()
    P = min(len(inst.devices), inst.blocks)
    classes = device_classes(inst)
    pos, in_pos, used, cut_after, last_of = _add_stage_order(model, inst, P)
    on = _add_device_order(model, classes, used, P)
    compute_ub, link_ub, update_ub = _upper_bounds_us(inst)
    compute = [model.new_int_var(0, compute_ub, f"compute_{r}") for r in range(P)]
    link = [model.new_int_var(0, link_ub, f"link_{r}") for r in range(P - 1)]
    update = [model.new_int_var(0, update_ub, f"update_{r}") for r in range(P)]
    v = _Vars(model, P, classes, pos, in_pos, used, cut_after, last_of, on, compute, link, update)
    _add_compute(v, inst)
    if soft_memory:
        max_use = max(inst.overhead_bytes) + sum(
            inst.params_bytes[k] * max(map(max, inst.weight_copies)) + inst.input_bytes[k] * max(map(max, inst.in_flight))
            + max(inst.workspace_bytes[d][k] for d in range(len(inst.devices))) for k in range(inst.blocks))
        overflow = model.new_int_var(-max(inst.memory_budget_bytes), max_use, "overflow")
        _add_memory(v, inst, overflow)
        model.minimize(overflow)
    else:
        _add_memory(v, inst)
        _add_links(v, inst)
        _add_objective(v, inst)
    return v


def _extract(v: _Vars, solver: cp_model.CpSolver) -> Assignment:
    pos = [solver.value(x) for x in v.pos]
    p = pos[0] + 1
    free = [list(members) for members in v.classes]
    devs = []
    for s in range(p):
        c = next(c for c in range(len(v.classes)) if solver.value(v.on[p - 1 - s][c]))
        devs.append(free[c].pop(0))
    ranges = tuple((pos.index(p - 1 - s), len(pos) - 1 - pos[::-1].index(p - 1 - s)) for s in range(p))
    return tuple(devs), ranges


LARGE_MODEL_TERMS = 50_000  # model_size terms above which presolve probing is skipped


def _solver(seconds: float, workers: int, seed: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 0.01)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    return solver


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
        wc, fl = inst.weight_copies[r][0], inst.in_flight[r][0]
        memory, time_us, last = inst.overhead_bytes[d], 0, k
        while k >= 0:
            grow = inst.params_bytes[k] * wc + inst.input_bytes[k] * fl + inst.workspace_bytes[d][k]
            more = inst.stage_compute_us(d, k, r + 1, 0)
            if memory + grow > inst.memory_budget_bytes[d] or (k < last and time_us + more > limit_us):
                break
            memory, time_us, k = memory + grow, time_us + more, k - 1
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


def _add_hint(v: _Vars, inst: PartitionInstance, assignment: Assignment) -> None:
    devs, ranges = assignment
    p = len(devs)
    pos = [p - 1 - s for s, (first, last) in enumerate(ranges) for _ in range(first, last + 1)]
    cls = {d: c for c, members in enumerate(v.classes) for d in members}
    for k in range(inst.blocks):
        v.model.add_hint(v.pos[k], pos[k])
        for r in range(v.positions):
            v.model.add_hint(v.in_pos[r][k], int(pos[k] == r))
    for k in range(inst.blocks - 1):
        v.model.add_hint(v.cut_after[k], int(pos[k] != pos[k + 1]))
    for r in range(v.positions):
        v.model.add_hint(v.used[r], int(r < p))
        for c in range(len(v.classes)):
            v.model.add_hint(v.on[r][c], int(r < p and cls[devs[p - 1 - r]] == c))
    # the derived values too: a complete hint is checked at once and becomes the first solution
    compute, link, update = _times_us(inst, devs, ranges)
    for r in range(v.positions):
        s = p - 1 - r
        v.model.add_hint(v.compute[r], compute[s] if r < p else 0)
        v.model.add_hint(v.update[r], update[s] if r < p else 0)
        if r < v.positions - 1:
            v.model.add_hint(v.link[r], link[s - 1] if r + 1 < p else 0)
            for k in range(inst.blocks - 1):
                v.model.add_hint(v.last_of[r][k], int(r + 1 < p and ranges[s - 1][1] == k))
    if v.slowest is not None:
        if inst.schedule in ASYNC_SCHEDULES:
            v.model.add_hint(v.slowest, max([c + u for c, u in zip(compute, update)] + [2 * b for b in link]))
        else:
            v.model.add_hint(v.slowest, max(_stage_times_us(compute, link)))
            v.model.add_hint(v.slowest_update, max(update))


def _search(inst: PartitionInstance, time_limit_s: float, workers: int, seed: int, soft_memory: bool):
    """(value, assignment) or None, and whether the answer (or its absence) is proven."""
    v = _build(inst, soft_memory)
    start = None if soft_memory else greedy_partition(inst)
    if start is not None:
        _add_hint(v, inst, start)
    solver = _solver(time_limit_s, workers, seed)
    if model_size(inst)["terms"] > LARGE_MODEL_TERMS:
        # CP-SAT's probing presolve alone took 15 s on 64 devices x 192 blocks, so a 10 s limit ended
        # before the search began; without it the search starts from the hint and proves a bound
        solver.parameters.cp_model_probing_level = 0
    status = solver.solve(v.model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = (round(solver.objective_value), _extract(v, solver))
        if status == cp_model.FEASIBLE and start is not None and _objective_us(inst, *start) < found[0]:
            found = (_objective_us(inst, *start), start)
        return found, status == cp_model.OPTIMAL
    if start is not None:  # the solver ran out of time before finding anything: keep the greedy plan
        return (_objective_us(inst, *start), start), False
    return None, status == cp_model.INFEASIBLE


def solve_partition(inst: PartitionInstance, time_limit_s: float = 10.0, workers: int = 8, seed: int = 0) -> Partition:
    """The plan with the least predicted step time under every device's budget (CP-SAT).

    Raises PlanDoesNotFit when no plan fits (then a second search, also up to `time_limit_s`,
    finds the least-overflow assignment for the message). `optimal` is True when proven.
    """
    start = time.monotonic()
    best, proven = _search(inst, time_limit_s, workers, seed, soft_memory=False)
    if best is not None:
        value, (devs, ranges) = best
        # `slowest` is only bounded from below, so a solution cut short by the time limit may carry
        # slack in its objective: it can only over-state the evaluated time, never under-state it.
        if value < _objective_us(inst, devs, ranges) or max(_overflows(inst, devs, ranges)) > 0:
            raise RuntimeError(f"CP-SAT's answer {devs} {ranges} disagrees with the evaluation (a bug in the model)")
        return _partition(inst, devs, ranges, "cp-sat", proven)
    least, least_proven = _search(inst, time_limit_s, workers, seed, soft_memory=True)
    if least is None:
        raise TimeoutError(f"CP-SAT found no assignment at all within {2 * time_limit_s} s "
                           f"({time.monotonic() - start:.1f} s used); raise time_limit_s")
    _, (devs, ranges) = least
    if max(_overflows(inst, devs, ranges)) <= 0:
        # the first search ran out of time; the soft one stumbled on a plan that fits
        return _partition(inst, devs, ranges, "cp-sat", False)
    raise _does_not_fit(inst, devs, ranges, proven and least_proven)


# --- an independent check --------------------------------------------------------------------

def check_feasible(partition: Partition, inst: PartitionInstance) -> list[str]:
    """Problems of `partition` on `inst` (empty: it is a valid plan that fits every budget).

    Written from the problem statement, not from the solver or the evaluation helpers above, so
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
    if problems:
        return problems
    for i, st in enumerate(stages):
        d = inst.devices.index(st.device)
        blocks = range(st.first_block, st.last_block + 1)
        weights = sum(inst.params_bytes[k] for k in blocks) * inst.weight_copies[p - 1][i]
        stashed = sum(inst.input_bytes[k] for k in blocks) * inst.in_flight[p - 1][i]
        workspace = sum(inst.workspace_bytes[d][k] for k in blocks)
        need = weights + stashed + workspace + inst.overhead_bytes[d]
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
