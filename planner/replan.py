"""Re-planning: given the plan in use and the cluster as it is now (a device slower, with less
memory, or gone), decide whether to move to a new plan, and which blocks' weights then move where.

Pure functions; the runtime applies a decision (runtime.pipeline.coordinator.Coordinator.reconfigure) at a
flush boundary, where every stage has applied the same number of updates, so gathering weights and
optimizer state there and handing them to the new stages loses no update.

Deciding. `replan` prices the current plan on the new cluster with the same cost model the
partitioner minimises (planner.partition.predicted_step_us) and searches for the best plan. It
re-plans when the predicted throughput gain, old step / new step - 1, is above `threshold`
(0.1: at least 10% more steps per second); it must re-plan, whatever the gain, when a device of the
current plan has left the cluster or the current plan no longer fits a memory budget.

`keep_order=True` restricts the search to the current plan's devices in their current order (minus
any that left), moving only the cut points: an exact enumeration, cheap and predictable, for
`confidant train-pipeline`, whose workers are not named devices. The free search (CP-SAT, any of
the cluster's devices in any order) is what `PlanReplanner` uses for a plan folder: the runtime
renumbers worker processes at a re-plan (runtime.pipeline.coordinator), so a new order needs no restart.

One re-planner (`PlanReplanner`) serves every run (issue 34). From a plan folder (`confidant train
plan/ --replan-every N`): the folder's cluster.json (planner.emit) gives the devices and profiles;
each re-plan that passes the threshold is written as a complete new plan folder inside it
(plan/replan-step0012/: plan.json, cluster.json with the recalibrated profiles, one bundle per
device holding the weights training has reached), read and verified once (`ir.bundle.LoadedPlan`),
which the workers then verify and load like the first one. For `confidant train-pipeline
--replan-every N` the plan in use was made in memory: the same re-planner, `keep_order`, over the
workers as devices with FLOPs-only profiles (`flops_cluster`) that the measured times recalibrate,
emits each new plan in memory (jobs.train.pipeline.PlanInMemory).

Re-profiling cheaply. A full `confidant profile` takes minutes; the runtime measures each stage's
forward and backward seconds every step anyway. `profile_from_timings` turns "stage s took k
times its prediction" into the device's profile with every block time scaled by k (the shape of
the profile, i.e. which blocks cost what relative to each other, is kept: a slowed device, e.g.
one whose threads were cut or that got hot, is slower at everything). `recalibrate` does that for
every device of a plan. When no device was profiled at all, `flops_cluster` stands in: each block
costs its FLOPs at one nominal speed, so measured timings alone calibrate each device.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ir.backend import runs_as
from ir.bundle import LoadedPlan, load_plan_folder
from ir.documents import PlanDocument
from ir.plan import Schedule
from ir.graph import Graph, block_signature
from ir.partition import Partition, StageAssignment
from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile, Link
from ir.training import TRAINING
from planner.cluster import Cluster, DeviceSpec, charged_reserve
from ir.plan import ASYNC_SCHEDULES, check_optimizer_name
from planner.compile import SEARCH_SHARE, Deadline, PlanRequest, compile_within_reserve, search
from planner.compile import engine_moves as engine_moves_text  # (ReplanDecision.engine_moves is the data)
from planner.cost import OPTIMIZER_STATE_COPIES, accumulate_s, check_blocks, compute_s, reuses_forward
from planner.partition import (US_PER_S, PartitionInstance, PlanDoesNotFit, check_feasible, make_instance,
                               manual_partition, predicted_step_us, solve_partition)
from planner.partition.instance import _cuts_joined

if TYPE_CHECKING:
    import numpy as np

# keep_order enumerates every placement of the cuts; beyond this many the caller should use the solver
MAX_KEEP_ORDER_CANDIDATES = 200_000


@dataclass(frozen=True)
class BlockMove:
    """Block `block`'s parameters (names `params`, `nbytes` bytes of weights) move from one
    device to another. `state_nbytes` is the optimizer state that travels with them (0 when the
    optimizer was not given)."""

    block: int
    from_device: str
    to_device: str
    params: tuple[str, ...]
    nbytes: int
    state_nbytes: int = 0


@dataclass(frozen=True)
class ReplanDecision:
    """`new_partition` is None when the current plan stays. Step times are predicted seconds per
    step on the *new* cluster; `predicted_old_s` is infinite when the current plan cannot run there
    (a device left). `forced`: the current plan could not continue, so the threshold did not apply."""

    new_partition: Partition | None
    moves: tuple[BlockMove, ...]
    predicted_old_s: float
    predicted_new_s: float
    reason: str
    forced: bool = False
    # the cluster the new plan was costed on: its devices' engines and activations as picked for
    # their new blocks (planner.compile.search); None when the current plan stays
    new_cluster: Cluster | None = None
    # devices of the new plan whose engine or activations the search changed: name -> (before, after)
    engine_moves: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def gain(self) -> float:
        """Predicted throughput gain of the best plan found over the current one (0.25: 25% more steps/s)."""
        if math.isinf(self.predicted_old_s):
            return math.inf
        return self.predicted_old_s / self.predicted_new_s - 1 if self.predicted_new_s > 0 else 0.0

    @property
    def moved_bytes(self) -> int:
        return sum(m.nbytes + m.state_nbytes for m in self.moves)


# --- moves ---------------------------------------------------------------------------------------

def _owners(partition: Partition, n_blocks: int, what: str) -> list[str]:
    owners: list[str | None] = [None] * n_blocks
    expected = 0
    for st in partition.stages:
        if st.first_block != expected or st.last_block < st.first_block or st.last_block >= n_blocks:
            raise ValueError(f"{what} plan: stage {st.stage} runs blocks {st.first_block}..{st.last_block}, "
                             f"expected a range starting at block {expected} within 0..{n_blocks - 1}")
        for k in range(st.first_block, st.last_block + 1):
            owners[k] = st.device
        expected = st.last_block + 1
    if expected != n_blocks:
        raise ValueError(f"{what} plan covers blocks 0..{expected - 1}, the model has 0..{n_blocks - 1}")
    return owners  # type: ignore[return-value]


def moves_between(old: Partition, new: Partition, graph: Graph, optimizer: str | None = None) -> tuple[BlockMove, ...]:
    """Every block whose device differs between the two plans, in block order. With `optimizer`,
    each move also counts the optimizer state of its parameters (planner.cost's copies)."""
    blocks = check_blocks(graph)
    if optimizer is not None:
        check_optimizer_name(optimizer)
    before = _owners(old, len(blocks), "old")
    after = _owners(new, len(blocks), "new")
    copies = OPTIMIZER_STATE_COPIES[optimizer] if optimizer is not None else 0
    return tuple(BlockMove(b.index, before[b.index], after[b.index], tuple(b.params), b.params_bytes,
                           b.params_bytes * copies)
                 for b in blocks if before[b.index] != after[b.index])


# --- cheap re-profiling --------------------------------------------------------------------------

def scale_profile(profile: DeviceProfile, factor: float, backend: str | None = None) -> DeviceProfile:
    """The profile with every time (block forward, backward and recompute seconds, attention
    curves) multiplied by `factor`; memory figures unchanged. `backend`: scale only that backend
    (default: all of them, since a slowed device is slower on every backend)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")
    if backend is not None:
        profile.backend(backend)  # raises, naming the profile's backends, when absent
    f = float(factor)

    def scaled(b: BackendProfile) -> BackendProfile:
        if backend is not None and b.backend != backend:
            return b
        return BackendProfile(
            b.backend,
            {k: dataclasses.replace(c, forward_s=c.forward_s * f, backward_s=c.backward_s * f,
                                    recompute_s=c.recompute_s * f)
             for k, c in b.blocks.items()},
            {k: AttentionCurve(tuple(s * f for s in a.seconds), a.fused_faster) for k, a in b.attention.items()})

    return dataclasses.replace(profile, backends=tuple(scaled(b) for b in profile.backends))


def profile_from_timings(profile: DeviceProfile, measured_stage_seconds: float, predicted_stage_seconds: float,
                         backend: str | None = None) -> DeviceProfile:
    """The device's profile re-scaled by what the run measured: a stage whose forward+backward
    took k x its prediction (both in the same unit, e.g. seconds per step) gets every block time
    scaled by k."""
    for name, v in (("measured", measured_stage_seconds), ("predicted", predicted_stage_seconds)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} stage seconds must be a finite number > 0, got {v!r}")
    return scale_profile(profile, measured_stage_seconds / predicted_stage_seconds, backend)


def predicted_compute_s(graph: Graph, cluster: Cluster, partition: Partition, microbatches: int = 1,
                        schedule: str = "1f1b-flush", update_every: int = 1) -> list[float]:
    """Per stage, the predicted forward+backward seconds of `microbatches` micro-batches (one
    step) under `schedule` (which decides where MNN skips its forward re-run) with an update after
    every `update_every` backwards (1f1b-stash, 2bw): what the runtime's measured F+B seconds per
    step compare with."""
    out, p = [], len(partition.stages)
    for s, st in enumerate(partition.stages):
        spec = cluster.device(st.device)
        forward, backward = compute_s(graph, spec, st.first_block, st.last_block,
                                      reuses_forward(schedule, p, s, microbatches))
        backward += accumulate_s(graph, spec, st.first_block, st.last_block, schedule, microbatches, update_every)
        out.append(microbatches * (forward + backward))
    return out


def recalibrate(graph: Graph, cluster: Cluster, partition: Partition, measured_stage_seconds: Sequence[float],
                microbatches: int = 1, schedule: str = "1f1b-flush", update_every: int = 1) -> Cluster:
    """The cluster with each of the plan's devices' profiles scaled by measured / predicted
    forward+backward seconds of its stage (`measured_stage_seconds[s]` for stage s, per step of
    `microbatches` micro-batches). Devices outside the plan keep their profiles."""
    measured = list(measured_stage_seconds)
    if len(measured) != len(partition.stages):
        raise ValueError(f"{len(measured)} measured stage times for a plan of {len(partition.stages)} stages")
    predicted = predicted_compute_s(graph, cluster, partition, microbatches, schedule, update_every)
    profiles = {st.device: profile_from_timings(cluster.device(st.device).profile, m, p,
                                                cluster.device(st.device).backend)
                for st, m, p in zip(partition.stages, measured, predicted)}
    return with_devices(cluster, {name: {"profile": prof} for name, prof in profiles.items()})


def with_devices(cluster: Cluster, changes: Mapping[str, Mapping]) -> Cluster:
    """The cluster with some devices' fields replaced, e.g. {"b": {"memory_budget_bytes": 10**9}}."""
    fields = {f.name for f in dataclasses.fields(DeviceSpec)} - {"name"}
    for name, change in changes.items():
        cluster.device(name)  # raises, naming the cluster's devices, when absent
        unknown = set(change) - fields
        if unknown:
            raise ValueError(f"device {name!r}: unknown field(s) {sorted(unknown)} (fields: {sorted(fields)})")
    return dataclasses.replace(cluster, devices=tuple(
        dataclasses.replace(d, **changes[d.name]) if d.name in changes else d for d in cluster.devices))


def without_devices(cluster: Cluster, *names: str) -> Cluster:
    """The cluster without the named devices (they left), and without their links."""
    for name in names:
        cluster.device(name)
    keep = tuple(d for d in cluster.devices if d.name not in names)
    if not keep:
        raise ValueError("no device would be left in the cluster")
    links = {pair: link for pair, link in cluster.links.items() if not set(pair) & set(names)}
    return dataclasses.replace(cluster, devices=keep, links=links)


def flops_cluster(graph: Graph, names: Sequence[str], seconds_per_flop: float = 1e-9,
                  min_block_s: float = 1e-6, link: Link | None = None) -> Cluster:
    """A cluster of identical devices whose profiles know only FLOPs (forward: FLOPs x
    `seconds_per_flop`, backward twice that, at least `min_block_s` each), unlimited memory and
    free links unless `link` is given: the starting point of `recalibrate` when no device was
    profiled. Nominal, not measured: only the ratios between devices that `recalibrate` finds
    mean anything."""
    blocks = check_blocks(graph)
    costs = {}
    for b in blocks:
        forward = max(b.flops * seconds_per_flop, min_block_s)
        costs[block_signature(b)] = BlockCost(forward, 2 * forward)
    unlimited = 2 ** 62
    devices = tuple(DeviceSpec(name, f"nominal://{name}",
                               DeviceProfile(name, graph.name, graph.batch, graph.seq,
                                             (BackendProfile("nominal", costs),), unlimited), unlimited)
                    for name in names)
    return Cluster(devices, link or Link(math.inf, 0.0))


# --- deciding ------------------------------------------------------------------------------------

def _fits(partition: Partition) -> bool:
    return all(s.memory_bytes <= s.memory_budget_bytes for s in partition.stages)


# A re-plan after a loss counts plans predicted within this share of the best step as equal, and
# takes among them the one that leaves the most of the survivors' trainable state where it is
# (`bytes_in_place`): what stays needs no fetch, no send and no setup of its weights and moments
# (runtime.pipeline.kept_state), and predicted steps a few % apart are within the cost model's error.
KEEP_IN_PLACE_WITHIN = 0.03


def bytes_in_place(graph: Graph, current: Partition, candidate: Partition) -> int:
    """Bytes of the trainable parameters that `candidate` runs on the same device as `current` does
    (blocks of a device gone from `candidate` are never in place)."""
    blocks = check_blocks(graph)
    before, after = _owners(current, len(blocks), "current"), _owners(candidate, len(blocks), "candidate")
    return sum(b.params_bytes for b in blocks if before[b.index] == after[b.index])


def best_cuts(inst: PartitionInstance, devices: Sequence[str], prefer: Callable[[Partition], int] | None = None,
              within: float = 0.0) -> Partition:
    """The best plan that runs `devices` in this order, one stage each, by trying every placement of
    the cuts (exact; for the few devices and tens of blocks of an edge cluster). With `prefer`,
    every plan predicted within `within` (a share) of the best step counts as best, and the one
    `prefer` scores highest among them is taken (a tie: the faster)."""
    if within < 0:
        raise ValueError(f"within must be a share >= 0, got {within!r}")
    p, n = len(devices), inst.blocks
    if p > n:
        raise ValueError(f"{p} devices in order need at least {p} blocks, the model has {n}")
    if math.comb(n - 1, p - 1) > MAX_KEEP_ORDER_CANDIDATES:
        raise ValueError(f"{math.comb(n - 1, p - 1)} ways to cut {n} blocks for {p} devices are too many to try; "
                         f"re-plan with keep_order=False (the CP-SAT solver)")
    best = least = None
    fitting: list[tuple[float, tuple[int, ...]]] = []  # with `prefer`: every fitting plan's step and cuts
    for cuts in itertools.combinations(range(1, n), p - 1):
        if any(c - 1 in inst.joined for c in cuts):  # blocks that stay on one stage
            continue
        part = manual_partition(inst, devices, list(cuts))
        if _fits(part):
            value = predicted_step_us(inst, part)
            if prefer is not None:
                fitting.append((value, cuts))
            if best is None or value < best[0]:
                best = (value, part)
        elif best is None:
            over = max(s.memory_bytes - s.memory_budget_bytes for s in part.stages)
            if least is None or over < least[0]:
                least = (over, part)
    if best is None and least is None:
        raise ValueError(f"{p} devices in order cannot each run a stage of {n} blocks when blocks "
                         f"{', '.join(f'{k}-{k + 1}' for k in inst.joined)} stay on one stage")
    if best is None:
        over, part = least
        tight = max(part.stages, key=lambda s: s.memory_bytes - s.memory_budget_bytes)
        raise PlanDoesNotFit(f"no placement of the cuts over {', '.join(devices)} (in this order) fits the memory "
                             f"budgets: every one overflows some device by at least {over} bytes; the least-"
                             f"overflow attempt has {tight.device!r} over by {over} bytes. Re-plan with "
                             f"keep_order=False to choose devices freely, or raise the budgets",
                             tight.device, over, part)
    if prefer is not None:
        near = [(value, manual_partition(inst, devices, list(cuts))) for value, cuts in fitting
                if value <= best[0] * (1 + within)]
        value, part = max(near, key=lambda vp: (prefer(vp[1]), -vp[0]))
        return dataclasses.replace(part, method="keep-order", optimal=value == best[0])
    return dataclasses.replace(best[1], method="keep-order", optimal=True)


def replan(graph: Graph, cluster_new: Cluster, current: Partition, schedule: str, m: int, optimizer: str,
           threshold: float = TRAINING.replan_threshold, *, keep_order: bool = False, time_limit_s: float = 10.0, workers: int = 8,
           seed: int = 0, update_every: int = 1, fixed: frozenset[str] = frozenset(),
           keep_in_place: float = 0.0) -> ReplanDecision:
    """Whether and how to re-plan `current` for the cluster as it is now (see the module docstring),
    priced with an update after every `update_every` backwards (1f1b-stash, 2bw: the gradient sum
    in memory, the additions and the fewer updates in time).

    The new plan is searched as `confidant plan` searches (planner.compile.search): every device's
    engine and activations picked again for the blocks it would get, the cuts solved for the picks;
    `cluster_new`'s devices run as the current plan runs them (its picks), which prices the current
    plan and is where the search starts; `fixed` devices (head-split ones) keep their engine.
    `time_limit_s` is the whole search's (planner.compile.Deadline). `keep_in_place` (a share, with
    `keep_order`): plans predicted within it of the best count as equal, and the one that leaves
    the most of `current`'s trainable bytes on their devices is taken (`bytes_in_place`).

    Raises PlanDoesNotFit when no plan fits the new cluster's budgets."""
    if not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    inst = make_instance(graph, cluster_new, schedule, m, optimizer, update_every)
    _owners(current, inst.blocks, "current")
    gone = [d for d in current.devices if d not in cluster_new.names]
    forced = None
    split = _cuts_joined(inst, current.ranges)
    if gone:
        forced = f"device{'s' if len(gone) > 1 else ''} {', '.join(map(repr, gone))} left the cluster"
        old_s = math.inf
    elif split:  # a plan made before planner.cost.joined_boundaries
        forced = (f"the current plan separates blocks {split[0]} and {split[0] + 1}, which run as one on a stage "
                  f"(an LM head fused with its loss)")
        old_s = math.inf
    else:  # priced as a plan is charged: a plan on one device keeps no reserve
        charged = make_instance(graph, charged_reserve(cluster_new, current.devices), schedule, m, optimizer,
                                update_every)
        repriced = manual_partition(charged, current.devices, [r[0] for r in current.ranges[1:]])
        old_s = predicted_step_us(charged, repriced) / US_PER_S
        problems = check_feasible(repriced, charged)
        if problems:
            forced = "the current plan no longer fits: " + "; ".join(problems)
    deadline = Deadline(time_limit_s)
    kept = [d for d in current.devices if d not in gone]

    def pick(cluster: Cluster, request: PlanRequest):
        # request.order: one device alone, within its whole budget (compile_within_reserve)
        order = list(request.order) if request.order else kept
        if request.order:
            cluster = without_devices(cluster, *[d for d in cluster.names if d not in request.order])

        def solve(instance: PartitionInstance) -> Partition:
            if keep_order or request.order:
                if keep_in_place > 0:
                    return best_cuts(instance, order, lambda part: bytes_in_place(graph, current, part), keep_in_place)
                return best_cuts(instance, order)
            return solve_partition(instance, time_limit_s=deadline.search_s(SEARCH_SHARE), workers=workers, seed=seed)

        return search(graph, cluster, request, solve, fixed, keep_going=deadline.room_for_another_start)

    # the reserve as `plan` charges it: kept on a pipeline, none on a plan of one device
    picks = compile_within_reserve(pick, cluster_new, PlanRequest(schedule, m, optimizer, update_every),
                                   step_of=lambda p: p.after_us)
    new, new_cluster = picks.partition, picks.cluster
    new_s = predicted_step_us(make_instance(graph, new_cluster, schedule, m, optimizer, update_every), new) / US_PER_S
    engines = {name: move for name, move in picks.changed.items() if name in new.devices}
    moved = f"; engine per device for its new blocks: {', '.join(engine_moves_text(engines))}" if engines else ""
    if forced is not None:
        return ReplanDecision(new, moves_between(current, new, graph, optimizer), old_s, new_s,
                              f"{forced}: re-planned (predicted step {new_s:.4g} s){moved}", forced=True,
                              new_cluster=new_cluster, engine_moves=engines)
    decision = ReplanDecision(None, (), old_s, new_s, "")
    if new.devices == current.devices and new.ranges == current.ranges and not engines:
        return dataclasses.replace(decision, reason=f"the current plan is still the best (predicted step {old_s:.4g} s)")
    if decision.gain <= threshold:
        return dataclasses.replace(decision, reason=(
            f"predicted throughput gain {decision.gain:.1%} ({old_s:.4g} s -> {new_s:.4g} s per step) is not above "
            f"the threshold {threshold:.1%}: keeping the current plan"))
    return dataclasses.replace(decision, new_partition=new, moves=moves_between(current, new, graph, optimizer),
                               new_cluster=new_cluster, engine_moves=engines,
                               reason=f"predicted throughput gain {decision.gain:.1%} ({old_s:.4g} s -> "
                                      f"{new_s:.4g} s per step) is above the threshold {threshold:.1%}: re-planned"
                                      f"{moved}")


def partition_of(ranges: Sequence[tuple[int, int]], devices: Sequence[str], method: str = "manual") -> Partition:
    """A bare Partition (no predicted figures) of stage s running ranges[s] on devices[s]."""
    if len(ranges) != len(devices):
        raise ValueError(f"{len(ranges)} block ranges for {len(devices)} devices")
    return Partition(tuple(StageAssignment(s, d, a, b) for s, ((a, b), d) in enumerate(zip(ranges, devices))), method)


def replan_without(graph: Graph, ranges: Sequence[tuple[int, int]], devices: Sequence[str], gone: Sequence[str],
                   schedule: str, m: int, optimizer: str, cluster: Cluster | None = None,
                   update_every: int = 1) -> list[tuple[int, int]]:
    """The best block ranges for the devices left when `gone` have left, in their order (stage k of
    the result on the k-th survivor): `replan` forced by the loss, keep-order, over `cluster`
    (default: FLOPs-only profiles, `flops_cluster`, as when nothing was profiled); among plans
    predicted within KEEP_IN_PLACE_WITHIN of the best, the one keeping most of the survivors'
    trainable bytes in place (a lost first stage need not shift every range)."""
    gone = set(gone)
    survivors = [d for d in devices if d not in gone]
    if not survivors:
        raise ValueError(f"no device is left: {sorted(gone)} were every device of the plan")
    cluster = cluster if cluster is not None else flops_cluster(graph, list(devices))
    current = partition_of([tuple(r) for r in ranges], list(devices))
    left = without_devices(cluster, *[d for d in devices if d in gone and d in cluster.names])
    decision = replan(graph, left, current, schedule, m, optimizer, keep_order=True, update_every=update_every,
                      keep_in_place=KEEP_IN_PLACE_WITHIN)
    return [tuple(r) for r in decision.new_partition.ranges]


def replan_with(graph: Graph, ranges: Sequence[tuple[int, int]], devices: Sequence[str], order: Sequence[str],
                schedule: str, m: int, optimizer: str, cluster: Cluster | None = None,
                update_every: int = 1) -> list[tuple[int, int]] | None:
    """The best block ranges over `order` (the current `devices`, which run `ranges`, and devices
    that came back, in the order wanted), one stage each, keep-order over `cluster` (default:
    FLOPs-only profiles, as `replan_without`); None when that plan does not fit or is predicted
    no faster than the current one (the returned devices then wait as spares)."""
    missing = [d for d in devices if d not in order]
    if missing:
        raise ValueError(f"the new order {list(order)} leaves out current devices {missing}; use replan_without")
    cluster = cluster if cluster is not None else flops_cluster(graph, list(order))
    inst = make_instance(graph, cluster, schedule, m, optimizer, update_every)
    current = manual_partition(inst, list(devices), [r[0] for r in ranges[1:]])
    new = best_cuts(inst, list(order))
    if check_feasible(new, inst):
        return None
    if not check_feasible(current, inst) and predicted_step_us(inst, new) >= predicted_step_us(inst, current):
        return None
    return [tuple(r) for r in new.ranges]


# --- re-planning a plan folder --------------------------------------------------------------------

REPLAN_DIR = "replan-step{step:04d}"  # inside the plan folder, one per re-plan that was applied


@dataclass(frozen=True)
class ReplannedPlan:
    """A re-plan made (after `step` steps): the new plan, read and verified once (`loaded`,
    `ir.bundle.LoadedPlan`: a plan folder's, `directory`, or one emitted in memory, directory None),
    its devices in pipeline order with their block ranges, and the decision behind it."""

    step: int
    directory: Path | None
    devices: list[str]
    ranges: list[tuple[int, int]]
    loaded: LoadedPlan
    decision: ReplanDecision
    old_devices: list[str]
    old_ranges: list[tuple[int, int]]

    @property
    def bundles(self) -> list[dict[str, bytes]]:
        """The new plan's bundle files by device, in pipeline order, as read once (shipped as they are)."""
        return list(self.loaded.files)

    @property
    def schedule(self) -> Schedule:
        """The new plan's, which the stages run from the next step on."""
        return self.loaded.schedule


def _with_plan_engines(cluster: Cluster, plan: PlanDocument) -> Cluster:
    """`cluster` with each auto device's backend pinned (`DeviceSpec.picked`) to the engine and
    threads the plan runs it with (`planner.engines` may have picked them for its blocks), and its
    choice of keeping or recomputing activations kept, so a re-plan prices the current plan as it
    really runs, and its search starts from there."""
    runs = {d.name: (d.engine, d.threads) for d in plan.devices}
    activations = {d.name: d.activations for d in plan.devices}
    devices = []
    for d in cluster.devices:
        if d.backend is None and d.name in runs:
            match = [b.backend for b in d.profile.backends if runs_as(b.backend, *runs[d.name])]
            if match:
                d = dataclasses.replace(d, picked=match[0])
        if activations.get(d.name) is not None:
            d = dataclasses.replace(d, activations=activations[d.name])
        devices.append(d)
    return dataclasses.replace(cluster, devices=tuple(devices))


def _splits_applied(plan_dir: Path, cluster: Cluster) -> frozenset[str]:
    """The devices of `cluster` whose profile is the one the plan folder's cluster.json recorded:
    `confidant plan` wrote it with each head-split device's profile lowered by its split and its
    backend pinned to the split's MNN one (planner.compile.with_head_splits), so the split is not
    applied to it again. A cluster file given instead (`train --cluster`) holds profiles as measured."""
    from ir.bundle import BundleError
    from planner.emit import load_plan_cluster

    try:
        recorded = load_plan_cluster(plan_dir)
    except (BundleError, ValueError, OSError):
        return frozenset()
    return frozenset(d.name for d in cluster.devices
                     if d.name in recorded.names and recorded.device(d.name).profile == d.profile)


class PlanReplanner:
    """The re-planner (issue 34: one for every run): `train_pipeline`'s on_replan, and the plan_over
    of a run from a plan folder (`without`, `with_devices`).

    At each call: recalibrate the plan's devices from the measured forward+backward seconds per
    stage (`recalibrate`), search the best plan over the cluster's devices (`replan`: free order,
    or with `keep_order` the current devices in their order, moving only the cuts), and, when that
    passes `threshold`, emit it from the weights training has reached (`weights()`, gathered from
    the workers only then), read and verified once (`ir.bundle.LoadedPlan`), and return it
    (`ReplannedPlan`).

    Where a new plan goes: with `plan_dir`, a new plan folder inside it (REPLAN_DIR), compiled as
    `confidant plan` compiles one (planner.compile): each device's head split is decided from its
    profile (once, here: it does not depend on the cut), and its engine and activations are picked
    again for the blocks it gets, so a device that takes over a lost one's blocks may move to the
    engine that runs its new stage fastest, and a spare device the first plan left out runs split
    where that is faster. Without (`plan_dir` None), `emit(partition, cluster, weights)` makes it in
    memory (`train-pipeline`'s plans: jobs.train.pipeline.PlanInMemory, whose workers keep the
    engine, head split and activations they were given).
    `decisions` keeps every (step, ReplanDecision), `applied` every ReplannedPlan."""

    def __init__(self, plan_dir: str | Path | None, plan: PlanDocument, graph: Graph, cluster: Cluster,
                 threshold: float = TRAINING.replan_threshold, time_limit_s: float = 10.0, workers: int = 8, sign=None,
                 keep_order: bool = False,
                 emit: Callable[[Partition, Cluster, Mapping[str, "np.ndarray"]], LoadedPlan] | None = None):
        from planner.compile import with_head_splits
        from planner.heads import HeadSplit

        if (plan_dir is None) == (emit is None):
            raise ValueError("a re-planner writes its plans into a plan folder (plan_dir) or emits them in memory "
                             "(emit), one of the two")
        self.plan_dir = None if plan_dir is None else Path(plan_dir)
        self.emit = emit
        self.sign = sign  # signs the new plans' bundles (planner.emit), as the first plan's were
        self.keep_order = keep_order
        self.plan = plan
        self.graph = graph
        self.threshold = threshold
        self.time_limit_s = time_limit_s
        self.workers = workers
        self.schedule = plan.schedule
        self.microbatches = plan.microbatches
        # the plan records a flush schedule's one update per batch as update_every = m
        self.update_every = plan.update_every if plan.schedule in ASYNC_SCHEDULES else 1
        self.optimizer = plan.optimizer.name
        names = plan.device_names
        missing = [n for n in names if n not in cluster.names]
        if missing:
            raise ValueError(f"the plan's devices {missing} are not in the cluster to re-plan with "
                             f"(devices: {list(cluster.names)})")
        applied = _splits_applied(self.plan_dir, cluster) if self.plan_dir is not None else frozenset()
        cluster, self.splits = with_head_splits(graph, cluster, applied=applied)
        for d in plan.devices:  # what the plan runs split is what its devices' profiles were lowered by
            if d.head_split is not None and d.head_split.predicted_s is not None and d.head_split.single_best:
                self.splits[d.name] = HeadSplit(dict(d.head_split.heads), d.head_split.predicted_s,
                                                d.head_split.single_best)
        self.cluster = _with_plan_engines(cluster, plan)
        self.partition = partition_of([d.blocks for d in plan.devices], names)
        self.decisions: list[tuple[int, ReplanDecision]] = []
        self.applied: list[ReplannedPlan] = []

    def follow(self, devices: Sequence[str], ranges: Sequence[tuple[int, int]]) -> None:
        """Carry on from a plan the run switched to without this re-planner (stage k runs ranges[k]
        on devices[k]); the devices keep what was measured of them."""
        unknown = [d for d in devices if d not in self.cluster.names]
        if unknown:
            raise ValueError(f"the run switched to devices {unknown}, which are not in the cluster to re-plan with")
        self.partition = partition_of([tuple(r) for r in ranges], list(devices))

    def __call__(self, step: int, measured_stage_seconds: Sequence[float],
                 weights: Callable[[], Mapping[str, "np.ndarray"]]) -> ReplannedPlan | None:
        if any(not (math.isfinite(x) and x > 0) for x in measured_stage_seconds):
            return None  # nothing measured on some stage: no basis for a decision
        self.cluster = recalibrate(self.graph, self.cluster, self.partition, measured_stage_seconds, self.microbatches,
                                   self.schedule, self.update_every)
        return self._decide(step, self.cluster, self.threshold, weights, "")

    def without(self, step: int, gone: Sequence[str], weights: Mapping[str, "np.ndarray"],
                keep: Sequence[str] | None = None) -> ReplannedPlan:
        """The plan after devices `gone` left (lost): re-planned over the rest of the cluster (any
        device still there, in any order; `keep` limits it to those with a worker), written as a
        new plan folder from `weights` (the state held off the devices). PlanDoesNotFit, naming
        the tightest device, when the rest cannot hold the model."""
        left = [d.name for d in self.cluster.devices if d.name not in set(gone) and (keep is None or d.name in keep)]
        if not left:
            raise PlanDoesNotFit(f"no device is left after {sorted(gone)} left", "", 0, None)
        return self._apply(step, left, 0.0, "recovery", weights)

    def with_devices(self, step: int, keep: Sequence[str], weights: Mapping[str, "np.ndarray"]) -> ReplannedPlan | None:
        """The plan once devices came back: the best over the cluster's devices in `keep` (those with
        a worker, the current ones among them), written as a new plan folder from `weights` when it
        passes `threshold`; None otherwise (the devices that came back wait as spares)."""
        left = [d.name for d in self.cluster.devices if d.name in set(keep)]
        return self._apply(step, left, self.threshold, "joined", weights)

    def _apply(self, step: int, names: Sequence[str], threshold: float, why: str,
               weights: Mapping[str, "np.ndarray"]) -> ReplannedPlan | None:
        """Re-plan over the cluster's devices `names`; the new plan folder when the decision is to move."""
        cluster = dataclasses.replace(self.cluster, devices=tuple(d for d in self.cluster.devices if d.name in names),
                                      links={k: v for k, v in self.cluster.links.items() if set(k) <= set(names)})
        return self._decide(step, cluster, threshold, lambda: weights, "-" + why)

    def _decide(self, step: int, cluster: Cluster, threshold: float,
                weights: Callable[[], Mapping[str, "np.ndarray"]], suffix: str) -> ReplannedPlan | None:
        """Re-plan over `cluster`; when the decision is to move, the new plan (in a folder named
        REPLAN_DIR and `suffix`, numbered when taken, or in memory), and the devices' picks kept for
        the next re-plan."""
        decision = replan(self.graph, cluster, self.partition, self.schedule, self.microbatches, self.optimizer,
                          threshold, keep_order=self.keep_order, time_limit_s=self.time_limit_s, workers=self.workers,
                          update_every=self.update_every, fixed=frozenset(self.splits))
        self.decisions.append((step, decision))
        new = decision.new_partition
        if new is None:
            return None
        # the picks kept for the next re-plan, each device with its reserve (a plan of one device was
        # searched without: the next may span several again)
        picked = {d.name: d for d in decision.new_cluster.devices}
        cluster = dataclasses.replace(self.cluster, devices=tuple(
            dataclasses.replace(picked[d.name], reserved_bytes=d.reserved_bytes) if d.name in picked else d
            for d in self.cluster.devices))
        charged = charged_reserve(cluster, new.devices)  # what the new plan records: none on one device
        directory = None
        if self.plan_dir is not None:
            directory = self.plan_dir / (REPLAN_DIR.format(step=step) + suffix)
            n = 2
            while suffix and directory.exists():
                directory = self.plan_dir / (REPLAN_DIR.format(step=step) + f"{suffix}{n}")
                n += 1
            loaded = self._emit(directory, new, charged, weights())
        else:
            loaded = self.emit(new, charged, weights())
        if loaded.devices != list(new.devices):
            raise ValueError(f"the new plan runs devices {loaded.devices}, the decision {list(new.devices)}")
        old, self.partition, self.cluster = self.partition, new, cluster
        self.applied.append(ReplannedPlan(step, directory, new.devices, new.ranges, loaded, decision,
                                          old.devices, old.ranges))
        return self.applied[-1]

    def _emit(self, directory: Path, partition: Partition, cluster: Cluster,
              weights: Mapping[str, "np.ndarray"]) -> LoadedPlan:
        """Write the plan of `partition` over `cluster` as picked (planner.compile): the model file
        and LoRA settings carry over (a checkpoint of training from the new folder needs them), as do
        the optimizer and the addresses the first plan gave its devices. Returns the folder read
        and verified once (`ir.bundle.load_plan_folder`): what the workers get, byte for byte."""
        from planner.compile import DeviceRun, assemble, emit_compiled, emit_settings

        taken = self.plan.device_names + list(cluster.names)
        if directory.name.lower() in {n.lower() for n in taken}:
            raise ValueError(f"a device is named {directory.name!r}, the folder this re-plan goes to; "
                             f"rename the device")
        unknown = sorted(set(weights) - set(self.graph.params))
        if unknown:
            raise ValueError(f"the gathered weights name {unknown[:5]}, which are not parameters of the model")
        before = {d.name: DeviceRun(d.engine, d.threads, d.address or "", d.activations) for d in self.plan.devices}
        emit = emit_settings(cluster, partition.devices, self.splits, self.plan.optimizer, self.plan.model,
                             self.plan.model_path, self.plan.lora, self.plan.backend,
                             addresses={n: r.address for n, r in before.items() if r.address}, previous=before)
        emit = dataclasses.replace(emit, on_failure=self.plan.on_failure)  # the policy the run goes on with
        compiled = assemble(self.graph, cluster, partition, self.splits,
                            PlanRequest(self.schedule, self.microbatches, self.optimizer, self.update_every), emit)
        graph = dataclasses.replace(self.graph, constants={**self.graph.constants, **weights})
        emit_compiled(directory, compiled, self.sign, graph)
        return load_plan_folder(directory)
