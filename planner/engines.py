"""The engine per device and what it does with activations, as planning decisions (issue 14, levers 1
and 5): each auto device (no `backend` in the cluster file) trains on the profiled backend (engine
and thread count) that runs the blocks the plan gives it fastest within its budget, not the one
fastest over the whole model; and every device keeps the activations of each micro-batch in flight
until its backward (fastest: PyTorch's autograd, MNN with one set of block graphs per micro-batch
in flight) or recomputes them there (one micro-batch's activations held: PyTorch runs the forward
again, MNN re-runs it as it does by default) or recomputes them per block (only block inputs held:
MNN keeps no per-op caches, PyTorch checkpoints each block, where its profile measured that: the
leanest), whichever is faster within its budget (`planner.cost`:
the memory model charges a keeping device each block's measured kept part once more per further
micro-batch in flight, a per-block one its measured per-block parts).

Why a search and not one choice per device. Which backend is fastest depends on the blocks: on
this machine PyTorch runs a decoder's vocabulary-sized LM head and loss several times faster than
MNN while MNN runs the small decoder layers faster, so the device holding the head wants torch and
the one holding the layers wants MNN; and which blocks a device holds depends on how fast its
backend is. `pick_engines` therefore alternates, starting from a partition; `best_picks` runs it
from the whole-model choice's, every device recomputing's and the leanest engines' (those that
fit) and keeps the best:

1. for every stage, rank the device's backends (an auto device's all, another's own) with keeping or
   recomputing activations by the forward+backward time of the stage's blocks (with the schedule's
   forward reuse) and take the fastest whose stage fits the budget (`stage_pick`);
2. if any device's pick changed, re-cost the same cuts with the new picks and re-solve the
   partition for them (`solve`), and keep whichever predicts the shorter step;
3. accept the round only if it predicts a shorter step than the plan before it, or the same step
   in less memory (summed over the stages), or the same step and memory with less work (forward
   and backward summed over the stages: keeping activations where that costs no memory the budget
   lacks); stop when a round changes nothing or does not help (at most `rounds`).

No accepted round raises the predicted step time, so the result is never predicted slower than
the whole-model choice; it is a local optimum of this alternation, not a proven joint optimum
over every (device, backend) combination. Devices the cluster file fixed (`backend`) and head-split
devices (costed on their MNN backend) keep their backend (still choosing what to do with
activations), and head-split devices keep everything (the split engine recomputes). Pure: returns a
new cluster and partition; the picks travel in `DeviceSpec.picked` and `DeviceSpec.activations`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ir.graph import Graph
from ir.partition import Partition
from planner.cluster import Cluster, DeviceSpec, device_backend
from planner.cost import (ACTIVATIONS, activation_mode, activations_of, compute_s, device_engine, hybrid_count,
                          leanest_activations, maps_frozen, offers_activations, reuses_forward, stage_memory_bytes,
                          with_cached_blocks)
from planner.partition import (PartitionInstance, PlanDoesNotFit, check_feasible, make_instance, manual_partition,
                               predicted_step_us)

Solve = Callable[[PartitionInstance], Partition]


@dataclasses.dataclass(frozen=True)
class EnginePicks:
    """What `pick_engines` did: the final cluster and partition, the picks per device that changed
    from the whole-model choice (device -> (before, after)), and the predicted step before and
    after, in microseconds."""

    cluster: Cluster
    partition: Partition
    changed: dict[str, tuple[str, str]]
    before_us: int
    after_us: int


def stage_pick(graph: Graph, device: DeviceSpec, first: int, last: int, stage: int, stages: int, schedule: str,
               microbatches: int, optimizer: str, update_every: int = 1) -> tuple[str, str | None] | None:
    """(backend, activations) for blocks first..last at this stage position: the fastest backend
    of `device` (only the cluster file's, where it names one) whose stage fits the device's budget,
    with its activations kept or recomputed (`planner.cost.activations_of`: keeping is faster,
    recomputing holds one micro-batch's activations instead of one per micro-batch in flight); at
    equal time the leaner. None when nothing fits."""
    reuse = reuses_forward(schedule, stages, stage, microbatches)
    names = [device.backend] if device.backend is not None else [b.backend for b in device.profile.backends]
    options = []
    for name in names:
        for activations in ACTIVATIONS:
            trial = dataclasses.replace(device, picked=None if device.backend is not None else name,
                                        activations=activations)
            if activations_of(trial) is None and activations != ACTIVATIONS[0]:
                continue  # an engine the model cannot choose for: costed once, as measured
            if activations_of(trial) is not None and not offers_activations(trial, activations):
                continue  # per-block on PyTorch only where its profile measured it
            try:
                forward, backward = compute_s(graph, trial, first, last, reuse)
            except ValueError:  # this backend lacks a block
                continue
            memory = stage_memory_bytes(graph, trial, first, last, stage, stages, schedule, microbatches, optimizer,
                                        update_every)
            if memory <= device.plannable_bytes:
                options.append((forward + backward, memory, name, activations_of(trial)))
    if not options:
        return None
    _, _, name, activations = min(options, key=lambda o: (o[0], o[1]))
    return name, activations


def recompute_everywhere(cluster: Cluster) -> Cluster:
    """`cluster` with every device recomputing its activations as leanly as its engine can
    (`planner.cost.leanest_activations`: per block; PyTorch over the stage where its profile did not
    measure per block): the leanest start, for a model that does not fit with PyTorch keeping them
    (`pick_engines` then keeps them, or recomputes them less, wherever that fits)."""
    return dataclasses.replace(cluster, devices=tuple(dataclasses.replace(d, activations=leanest_activations(d))
                                                      for d in cluster.devices))


def leanest_everywhere(cluster: Cluster) -> Cluster:
    """`cluster` with every device recomputing its activations and every auto device (no `backend`
    in the cluster file) on the profiled backend whose engine adds the least memory to the runtime
    (MNN: nothing; PyTorch's import: some 200-300 MB), the fastest of those at a tie. The whole-model
    choice takes the fastest engine that fits beside the runtime alone, which can leave no room for
    any stage on a small device where the leaner engine would fit one."""
    def lean(device: DeviceSpec) -> DeviceSpec:
        if device.backend is not None or not device.profile.backends:
            return dataclasses.replace(device, activations=leanest_activations(device))
        backend = min(device.profile.backends, key=lambda b: (b.engine_overhead_bytes, b.seconds))
        picked = dataclasses.replace(device, picked=backend.backend)
        return dataclasses.replace(picked, activations=leanest_activations(picked))

    return dataclasses.replace(cluster, devices=tuple(lean(d) for d in cluster.devices))


def starting_clusters(cluster: Cluster) -> list[Cluster]:
    """The clusters `best_picks` starts `pick_engines` from, each costed differently from the one
    before it: the whole-model choice, every device recomputing its activations
    (`recompute_everywhere`), and every auto device on its leanest engine as well
    (`leanest_everywhere`)."""
    def costed_as(c: Cluster) -> tuple:
        return tuple((device_backend(d).backend, activations_of(d)) for d in c.devices)

    starts = [cluster]
    for lean in (recompute_everywhere(cluster), leanest_everywhere(cluster)):
        if costed_as(lean) != costed_as(starts[-1]):
            starts.append(lean)
    return starts


def best_picks(graph: Graph, cluster: Cluster, schedule: str, microbatches: int, optimizer: str, solve: Solve,
               fixed: frozenset[str] = frozenset(), rounds: int = 4,
               keep_going: Callable[[], bool] = lambda: True, update_every: int = 1) -> EnginePicks:
    """`pick_engines` from the partition of each starting cluster that fits (`starting_clusters`),
    the result predicting the shortest step (at a tie the least memory, then the least work, then
    the earlier start).
    Starting lean matters: `pick_engines` re-picks per stage for the cuts it has, so from the
    whole-model choice (PyTorch keeping its activations, say) it never finds the cut that only
    recomputing on one device makes fit, which a start with every device recomputing does (it
    then keeps them wherever they fit). `changed` and `before_us` are against the whole-model
    choice (its partition where it fits, else the first start that does). Raises the leanest
    start's PlanDoesNotFit where none fits (what fits nowhere). A further start is tried only while
    `keep_going()` (a planning deadline) or while nothing has fitted yet."""
    results: list[EnginePicks] = []
    error: PlanDoesNotFit | None = None
    for start in starting_clusters(cluster):
        if results and not keep_going():
            break
        try:
            partition = solve(make_instance(graph, start, schedule, microbatches, optimizer, update_every))
        except PlanDoesNotFit as exc:
            error = exc
            continue
        results.append(pick_engines(graph, start, partition, schedule, microbatches, optimizer, solve=solve,
                                    rounds=rounds, fixed=fixed, update_every=update_every))
    if not results:
        raise error
    # (pick_engines answers 0 us for a partition that does not fit as given: never the best)
    best = min(results, key=lambda r: (r.after_us <= 0, r.after_us, _memory(r.partition), _work_us(r.partition)))
    origin = {d.name: _choice(d) for d in cluster.devices}
    changed = {d.name: (origin[d.name], _choice(d)) for d in best.cluster.devices if _choice(d) != origin[d.name]}
    return dataclasses.replace(best, changed=changed, before_us=results[0].before_us)


def _picked(device: DeviceSpec, pick: tuple[str, str | None]) -> DeviceSpec:
    """The device running `pick` (backend, activations); a backend the cluster file fixed stays."""
    return dataclasses.replace(device, picked=None if device.backend is not None else pick[0], activations=pick[1])


def _choice(device: DeviceSpec) -> str:
    name = device_backend(device).backend
    policy = activations_of(device)
    return f"{name} ({policy})" if policy is not None else name


def _recosted(inst: PartitionInstance, partition: Partition) -> tuple[int, Partition] | None:
    """`partition`'s cuts re-costed on `inst` (its stage times and memory under the instance's
    backends) and its predicted step in us; None when it does not fit."""
    cuts = [first for first, _ in partition.ranges[1:]]
    same = manual_partition(inst, partition.devices, cuts)
    if check_feasible(same, inst):
        return None
    # the same cuts keep what found them; proven optimal only for the backends it was solved with
    same = dataclasses.replace(same, method=partition.method, optimal=False)
    return predicted_step_us(inst, same), same


def _memory(partition: Partition) -> int:
    return sum(s.memory_bytes for s in partition.stages)


def _work_us(partition: Partition) -> int:
    """The stages' forward+backward per micro-batch, summed: at the same step and memory, the plan
    that computes less (a stage off the critical path keeping activations it has room for rather
    than recomputing them) is as fast on its own devices and faster where they share processors."""
    return round(sum(s.predicted_time_s for s in partition.stages) * 1e6)


def pick_engines(graph: Graph, cluster: Cluster, partition: Partition, schedule: str, microbatches: int,
                 optimizer: str, solve: Solve | None = None, rounds: int = 4,
                 fixed: frozenset[str] = frozenset(), update_every: int = 1) -> EnginePicks:
    """Re-pick every device's backend (auto devices) and activations for the blocks `partition`
    gives it, re-solving the partition with `solve` (an instance -> its partition; None: keep the
    cuts, e.g. manual `--cuts`), as the module docstring says; devices in `fixed` (head-split ones) keep what they have."""
    start = {d.name: _choice(d) for d in cluster.devices}
    first = _recosted(make_instance(graph, cluster, schedule, microbatches, optimizer, update_every), partition)
    if first is None:  # the partition given does not fit: nothing to improve on here
        return EnginePicks(cluster, partition, {}, 0, 0)
    best_us = before_us = first[0]
    best_memory, best_work = _memory(first[1]), _work_us(first[1])
    for _ in range(rounds):
        p = len(partition.stages)
        picks: dict[str, tuple[str, str | None]] = {}
        for s, (name, (lo, hi)) in enumerate(zip(partition.devices, partition.ranges)):
            device = cluster.device(name)
            if name in fixed:
                continue
            pick = stage_pick(graph, device, lo, hi, s, p, schedule, microbatches, optimizer, update_every)
            if pick is not None and pick != (device_backend(device).backend, activations_of(device)):
                picks[name] = pick
        if not picks:
            break
        # every pick at once, and (should that not help) the picks that add no memory to their
        # stage at its cuts: a stage off the critical path that keeps what it recomputed at no cost
        held = {st.device: st.memory_bytes for st in partition.stages}
        free = {}
        for s, (name, (lo, hi)) in enumerate(zip(partition.devices, partition.ranges)):
            if name in picks:
                trial_device = _picked(cluster.device(name), picks[name])
                if stage_memory_bytes(graph, trial_device, lo, hi, s, p, schedule, microbatches, optimizer,
                                      update_every) <= held[name]:
                    free[name] = picks[name]
        options: list[tuple[int, Partition, Cluster]] = []
        for chosen_picks in ([picks] + ([free] if free and free != picks else [])):
            trial = dataclasses.replace(cluster, devices=tuple(
                _picked(d, chosen_picks[d.name]) if d.name in chosen_picks else d for d in cluster.devices))
            inst = make_instance(graph, trial, schedule, microbatches, optimizer, update_every)
            same = _recosted(inst, partition)
            if same is not None:
                options.append((*same, trial))
            if solve is not None:
                try:
                    again = solve(inst)
                except PlanDoesNotFit:
                    again = None
                if again is not None:
                    options.append((predicted_step_us(inst, again), again, trial))
        if not options:
            break
        # a shorter step first; at the same step, less memory (a stage off the critical path that
        # needs no PyTorch import leaves its device the ~200 MB the import costs), then less work
        us, chosen, trial = min(options, key=lambda o: (o[0], _memory(o[1]), _work_us(o[1])))
        if (us, _memory(chosen), _work_us(chosen)) >= (best_us, best_memory, best_work):
            break
        cluster, partition = trial, chosen
        best_us, best_memory, best_work = us, _memory(chosen), _work_us(chosen)
    cluster = hybrid_activations(graph, cluster, partition, schedule, microbatches, optimizer, update_every)
    partition = _with_recosted_bytes(graph, cluster, partition, schedule, microbatches, optimizer, update_every)
    changed = {d.name: (start[d.name], _choice(d)) for d in cluster.devices if _choice(d) != start[d.name]}
    return EnginePicks(cluster, partition, changed, before_us, best_us)


def _with_recosted_bytes(graph: Graph, cluster: Cluster, partition: Partition, schedule: str, microbatches: int,
                         optimizer: str, update_every: int) -> Partition:
    """`partition` with the memory of each stage the partition instance does not price as the memory model
    does re-costed by the memory model (`stage_memory_bytes`), so the plan's figure is what it charges the
    stage: a hybrid stage with its caches (`hybrid_activations` picks them after the partition was costed
    plain per block; SmolLM2 int4, 1f1b-stash, the last stage per-block+5: planned 190.9 MiB, its terms
    252.8, measured 231.3), and a stage reading its float32 frozen base mapped (`maps_frozen`): on MNN its
    placeholder sets' frozen weights, where the instance charges every block's, the search's bound; on PyTorch the
    instance charges what the model does (the largest block's: `planner.cost.holds_one_block_mapped`), so the
    re-cost leaves its figure as it is."""
    stages, p = list(partition.stages), len(partition.stages)
    for s, stage in enumerate(stages):
        device = cluster.device(stage.device)
        if (activation_mode(device)[0] == "per-block" and activation_mode(device)[1] > 0) or maps_frozen(device):
            stages[s] = dataclasses.replace(stage, memory_bytes=stage_memory_bytes(
                graph, device, stage.first_block, stage.last_block, s, p, schedule, microbatches, optimizer,
                update_every))
    return dataclasses.replace(partition, stages=tuple(stages))


def hybrid_activations(graph: Graph, cluster: Cluster, partition: Partition, schedule: str, microbatches: int,
                       optimizer: str, update_every: int = 1) -> Cluster:
    """`cluster` with every MNN device that recomputes per block, and whose every backward follows
    its own forward (`reuses_forward`: one device, the last stage of 1F1B), keeping the per-op caches
    of as many of its stage's last blocks as its budget has room for beside what the stage holds
    recomputing per block ("per-block+K", `planner.cost.hybrid_count`): each such block skips its
    forward's re-run in its backward (a SmolLM2 layer: ~47 ms of a ~5.5 s step of 4 x 1 x 128, for
    ~10 MiB of caches). Where no backward follows its forward the caches would go stale unused, so
    such a stage stays plain per-block. Pure."""
    stages = len(partition.stages)
    devices = {d.name: d for d in cluster.devices}
    for s, (name, (lo, hi)) in enumerate(zip(partition.devices, partition.ranges)):
        device = with_cached_blocks(devices[name], 0) if activation_mode(devices[name])[0] == "per-block" \
            else devices[name]
        if (activation_mode(device)[0] != "per-block" or device_engine(device) != "mnn"
                or not reuses_forward(schedule, stages, s, microbatches)):
            continue
        # priced with its base held: a hybrid stage holds its frozen weights as constants (`maps_frozen`), so the
        # room for caches is what is left beside the whole base, not beside the few blocks a mapped stage holds
        whole = dataclasses.replace(device, frozen_mapped=False)
        held = stage_memory_bytes(graph, whole, lo, hi, s, stages, schedule, microbatches, optimizer, update_every)
        count = hybrid_count(graph, whole, lo, hi, device.plannable_bytes - held)
        devices[name] = with_cached_blocks(device, count)
    return dataclasses.replace(cluster, devices=tuple(devices[d.name] for d in cluster.devices))
