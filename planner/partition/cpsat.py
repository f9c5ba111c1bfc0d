"""The OR-Tools CP-SAT model of the partitioning problem: `cpsat_plan` and `cpsat_partition`.

The only module of the project that imports ortools. It solves the problem stated in
planner.partition.instance exactly; the result is optimal when CP-SAT proves it so within the
time limit, and the search starts from a given plan (planner.partition.solve passes the best one
the fixed-order program found) or from planner.partition.simple's greedy plan. `cpsat_partition`
is the model alone, as `solve_partition` was before planner.partition.dp: the benchmark and the
tests compare the combined solver with it.

Memory of stage s of p on device d is linear in the blocks it runs, with coefficients that
depend only on the stage's distance r = p-1-s from the last stage (planner.cost: weight copies
including old versions under 1f1b-stash, micro-batches in flight), and so does whether the
stage reuses its forward. The model therefore numbers stages from the end: one model covers
every stage count, positions 0..P-1 with position 0 always used and the high ones left empty
for shorter pipelines, and every coefficient stays a constant.

The model (the `_add_*` steps) has: pos[k] (the position of block k; falls by 0 or 1 per block,
0 at the last) channelled to in_pos[r][k]; used[r]; cut_after[k] and last_of[r][k] (block k
ends position r+1); on[r][c] (position r runs a device of class c, a class running at most as
many positions as it has devices: `device_classes` groups interchangeable devices, so eight
identical phones cost one class, not eight); compute C_r, update U_r and transfer B_r as
integer variables fixed by constraints enforced on on[r][c] (and on[r+1][a] for links, summed
over the few distinct boundary sizes); memory as one linear constraint per (r, c) enforced on
on[r][c].

When nothing fits, the same model with memory made soft (minimise the largest overflow over
any device) finds the least-overflow assignment, and `PlanDoesNotFit` (planner.partition.explain)
reports its tightest device, by how much it is over, and what would help.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Sequence

from ir.partition import Partition
from ir.plan import ASYNC_SCHEDULES
from planner.cost import kept_copies
from planner.partition.explain import PlanDoesNotFit, _does_not_fit
from planner.partition.instance import (Assignment, PartitionInstance, _objective_us, _overflows, _partition,
                                        _stage_times_us, _times_us, _weights_us, device_classes)
from planner.partition.simple import greedy_partition


class _OnFirstUse:
    """ortools' cp_model, imported when the CP-SAT model is first built: importing it costs ~0.45 s
    (it pulls in pandas), and most plans (above CPSAT_MAX_BLOCKS blocks, or proven by the
    fixed-order program) never build one."""

    def __getattr__(self, name: str):
        module = importlib.import_module("ortools.sat.python.cp_model")
        globals()["cp_model"] = module
        return getattr(module, name)


cp_model = _OnFirstUse()


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
    update: list            # [r] IntVar: the position's tail, its W pass (split backwards) + optimizer step
    weight: list | None = None  # [r] IntVar: the position's W pass (None unless the schedule splits backwards)
    slowest: object = None  # IntVar: the largest stage time (flush) or period (1f1b-stash)
    slowest_update: object = None  # IntVar: the largest tail (flush)


def _add_stage_order(model: cp_model.CpModel, inst: PartitionInstance, P: int):
    """Contiguous stages in order: pos falls by 0 or 1 per block, down to 0 at the last block."""
    n = inst.blocks
    pos = [model.new_int_var(0, P - 1, f"pos_{k}") for k in range(n)]
    in_pos = [[model.new_bool_var(f"in_{r}_{k}") for k in range(n)] for r in range(P)]
    cut_after = [model.new_bool_var(f"cut_{k}") for k in range(n - 1)]
    for k in inst.joined:  # blocks k and k+1 stay on one stage
        model.add(cut_after[k] == 0)
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
    """compute[r], update[r] (the tail: W + optimizer step) and weight[r] (W) of the position's blocks
    on its device."""
    n, weighted = inst.blocks, cp_model.LinearExpr.weighted_sum  # weighted_sum: fast to build
    for r in range(v.positions):
        for c, members in enumerate(v.classes):
            d = members[0]
            v.model.add(v.compute[r] == weighted(v.in_pos[r], [inst.stage_compute_us(d, k, r + 1, 0) for k in range(n)])
                        ).only_enforce_if(v.on[r][c])
            v.model.add(v.update[r] == weighted(v.in_pos[r], [u + w for u, w in zip(inst.update_us[d], inst.weight_us[d])])
                        ).only_enforce_if(v.on[r][c])
            if v.weight is not None:
                v.model.add(v.weight[r] == weighted(v.in_pos[r], list(inst.weight_us[d]))).only_enforce_if(v.on[r][c])
        v.model.add(v.compute[r] == 0).only_enforce_if(v.used[r].Not())
        v.model.add(v.update[r] == 0).only_enforce_if(v.used[r].Not())
        if v.weight is not None:
            v.model.add(v.weight[r] == 0).only_enforce_if(v.used[r].Not())


def _add_memory(v: _Vars, inst: PartitionInstance, overflow=None) -> None:
    """The stage at position r fits its device's budget (or exceeds it by at most `overflow`):
    PartitionInstance.stage_bytes, its per-block sum linear in in_pos, its one transient (the
    largest of the stage's blocks') a variable at least each of its blocks' transients, its once
    part per further micro-batch in flight likewise (PartitionInstance.stage_kept_once), and its frozen
    base held mapped likewise, in both phases (PartitionInstance.stage_mapped_frozen)."""
    for r in range(v.positions):
        fl = inst.in_flight[r][0]  # stage 0 of r+1 stages is at position r
        for c, members in enumerate(v.classes):
            d = members[0]
            used = inst.overhead_bytes[d] + cp_model.LinearExpr.weighted_sum(v.in_pos[r], [
                inst.weight_bytes(d, k, r + 1, 0) + inst.input_bytes[k] * fl + inst.held_workspace(d, k, fl)
                for k in range(inst.blocks)])
            resident = _stage_largest(v, r, inst.mapped_frozen_bytes[d], f"mapped_frozen_{r}_{c}")
            used = used + resident + _stage_largest(v, r, inst.transient_bytes[d], f"transient_{r}_{c}")
            once, copies = inst.kept_once_bytes[d], kept_copies(fl, inst.keeps_activations[d])
            if copies and any(once):
                held = v.model.new_int_var(0, max(once), f"kept_once_{r}_{c}")
                for k, o in enumerate(once):
                    if o:
                        v.model.add(held >= o * v.in_pos[r][k])
                used = used + copies * held
            whole = 0
            if r == 0 and inst.whole_model_delta_bytes[d]:  # the whole model on one stage (PartitionInstance.stage_bytes)
                whole = inst.whole_model_delta_bytes[d] * (1 - v.used[1] if v.positions > 1 else 1)
            limit = inst.memory_budget_bytes[d] + (0 if overflow is None else overflow)
            v.model.add(used + whole <= limit).only_enforce_if(v.on[r][c])
            floor = inst.stage_floor_bytes(d)  # whatever the stage holds (PartitionInstance.stage_bytes)
            if floor and overflow is not None:
                v.model.add(overflow >= floor - inst.memory_budget_bytes[d]).only_enforce_if(v.on[r][c])
            elif floor > inst.memory_budget_bytes[d]:
                v.model.add(v.on[r][c] == 0)
            if any(inst.update_bytes[d]):  # and at its update: held + the update's part (PartitionInstance.stage_phases)
                at_update = inst.overhead_bytes[d] + cp_model.LinearExpr.weighted_sum(v.in_pos[r], [
                    inst.weight_bytes(d, k, r + 1, 0) + inst.input_bytes[k] * fl + inst.held_workspace(d, k, fl)
                    - inst.block_backward_bytes(d, k, fl) + inst.update_bytes[d][k] for k in range(inst.blocks)])
                v.model.add(at_update + resident + whole <= limit).only_enforce_if(v.on[r][c])


def _stage_largest(v: _Vars, r: int, per_block: Sequence[int], name: str):
    """A variable at least each per-block figure of the blocks at position r (the largest of a stage's blocks': a
    transient, a frozen base held mapped one block resident), or 0 where every figure is 0 (no variable)."""
    if not any(per_block):
        return 0
    largest = v.model.new_int_var(0, max(per_block), name)
    for k, f in enumerate(per_block):
        if f:
            v.model.add(largest >= f * v.in_pos[r][k])
    return largest


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
    """The predicted step time (see planner.partition.instance's docstring)."""
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
        deferred = sum(v.weight) if v.weight is not None else 0  # split backwards' W, out of the first trip
        model.minimize(sum(v.compute) - deferred + 2 * sum(v.link) + (m - 1) * slowest + slowest_update)


def _upper_bounds_us(inst: PartitionInstance) -> tuple[int, int, int]:
    """Largest possible stage compute, single transfer and stage optimizer step."""
    nd = len(inst.devices)
    return (max(sum(row) for row in inst.compute_us),
            max([0] + [inst.transfer_us(d, e, k) for d in range(nd) for e in range(nd) if d != e
                       for k in range(inst.blocks - 1)]),
            max(sum(u) + sum(w) for u, w in zip(inst.update_us, inst.weight_us)))


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
    if any(map(any, inst.weight_us)):
        v.weight = [model.new_int_var(0, compute_ub, f"weight_{r}") for r in range(P)]
    _add_compute(v, inst)
    if soft_memory:
        most_in_flight = max(map(max, inst.in_flight))
        max_use = max(o + max(t, default=0) + inst.stage_kept_once(d, 0, inst.blocks - 1, most_in_flight) + max(w, 0)
                      + inst.stage_mapped_frozen(d, 0, inst.blocks - 1)
                      for d, (o, t, w) in enumerate(zip(inst.overhead_bytes, inst.transient_bytes,
                                                         inst.whole_model_delta_bytes))) + sum(
            inst.params_bytes[k] * max(map(max, inst.weight_copies)) + inst.input_bytes[k] * max(map(max, inst.in_flight))
            + max(inst.held_workspace(d, k, max(map(max, inst.in_flight))) + inst.update_bytes[d][k]
                  for d in range(len(inst.devices)))
            for k in range(inst.blocks))
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
BUILD_S_PER_TERM = 10e-6    # building the model in Python: about 10 us per linear term (5-15 measured)


def estimated_build_s(inst: PartitionInstance) -> float:
    """Seconds building the CP-SAT model of `inst` should take (planner.partition.solve skips the
    model when this would eat too much of its time limit)."""
    return model_size(inst)["terms"] * BUILD_S_PER_TERM


def _solver(seconds: float, workers: int, seed: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 0.01)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    return solver


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
    weight = _weights_us(inst, devs, ranges)
    for r in range(v.positions):
        s = p - 1 - r
        v.model.add_hint(v.compute[r], compute[s] if r < p else 0)
        v.model.add_hint(v.update[r], update[s] + weight[s] if r < p else 0)
        if v.weight is not None:
            v.model.add_hint(v.weight[r], weight[s] if r < p else 0)
        if r < v.positions - 1:
            v.model.add_hint(v.link[r], link[s - 1] if r + 1 < p else 0)
            for k in range(inst.blocks - 1):
                v.model.add_hint(v.last_of[r][k], int(r + 1 < p and ranges[s - 1][1] == k))
    if v.slowest is not None:
        if inst.schedule in ASYNC_SCHEDULES:
            v.model.add_hint(v.slowest, max([c + u for c, u in zip(compute, update)] + [2 * b for b in link]))
        else:
            v.model.add_hint(v.slowest, max(_stage_times_us(compute, link)))
            v.model.add_hint(v.slowest_update, max(u + w for u, w in zip(update, weight)))


def _search(inst: PartitionInstance, time_limit_s: float, workers: int, seed: int, soft_memory: bool,
            start: Assignment | None = None):
    """((value, assignment) or None, whether the answer (or its absence) is proven, CP-SAT's bound).

    The search starts from `start` (a plan that fits) or, without one, from the greedy plan.
    `time_limit_s` is the solver's; building the model comes on top (see `estimated_build_s`)."""
    v = _build(inst, soft_memory)
    if start is None and not soft_memory:
        start = greedy_partition(inst)
    if start is not None:
        _add_hint(v, inst, start)
    solver = _solver(time_limit_s, workers, seed)
    if model_size(inst)["terms"] > LARGE_MODEL_TERMS:
        # CP-SAT's probing presolve alone took 15 s on 64 devices x 192 blocks, so a 10 s limit ended
        # before the search began; without it the search starts from the hint and proves a bound
        solver.parameters.cp_model_probing_level = 0
    status = solver.solve(v.model)
    bound = solver.best_objective_bound if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = (round(solver.objective_value), _extract(v, solver))
        if status == cp_model.FEASIBLE and start is not None and _objective_us(inst, *start) < found[0]:
            found = (_objective_us(inst, *start), start)
        return found, status == cp_model.OPTIMAL, bound
    if start is not None:  # the solver ran out of time before finding anything: keep the start
        return (_objective_us(inst, *start), start), False, None
    return None, status == cp_model.INFEASIBLE, None


def cpsat_plan(inst: PartitionInstance, time_limit_s: float, workers: int = 8, seed: int = 0,
               start: Assignment | None = None):
    """CP-SAT alone on the problem: (assignment or None, proven, lower bound in microseconds).

    `proven`: the assignment is optimal (or, when None, that no plan fits). The bound is CP-SAT's
    (0 when it has none). Raises RuntimeError when its answer disagrees with the evaluation."""
    best, proven, bound = _search(inst, time_limit_s, workers, seed, soft_memory=False, start=start)
    if best is None:
        return None, proven, 0.0
    value, (devs, ranges) = best
    # `slowest` is only bounded from below, so a solution cut short by the time limit may carry
    # slack in its objective: it can only over-state the evaluated time, never under-state it.
    if value < _objective_us(inst, devs, ranges) or max(_overflows(inst, devs, ranges)) > 0:
        raise RuntimeError(f"CP-SAT's answer {devs} {ranges} disagrees with the evaluation (a bug in the model)")
    exact = _objective_us(inst, devs, ranges)
    return (devs, ranges), proven, float(exact if proven else min(exact, bound or 0.0))


def does_not_fit(inst: PartitionInstance, time_limit_s: float, workers: int = 8, seed: int = 0,
                 none_fits: bool = True) -> Partition | PlanDoesNotFit:
    """When no plan was found: the least-overflow assignment (memory made soft), as the error to
    raise; or, if the soft search stumbles on a plan that fits, that plan (not proven optimal).
    `none_fits`: it is proven that no plan fits (the error then says so when the soft search is
    proven too). Raises TimeoutError when not even an assignment was found."""
    least, least_proven, _ = _search(inst, time_limit_s, workers, seed, soft_memory=True)
    if least is None:
        raise TimeoutError(f"CP-SAT found no assignment at all within {time_limit_s:.1f} s; raise time_limit_s")
    _, (devs, ranges) = least
    if max(_overflows(inst, devs, ranges)) <= 0:
        return _partition(inst, devs, ranges, "cp-sat", False)
    return _does_not_fit(inst, devs, ranges, none_fits and least_proven)


def cpsat_partition(inst: PartitionInstance, time_limit_s: float = 10.0, workers: int = 8, seed: int = 0) -> Partition:
    """The CP-SAT model alone, from the greedy start (what `solve_partition` was before the
    fixed-order program): the plan with the least predicted step time under every device's budget.

    Raises PlanDoesNotFit when no plan fits (then a second search, also up to `time_limit_s`,
    finds the least-overflow assignment for the message). `optimal` is True when proven."""
    assignment, proven, _ = cpsat_plan(inst, time_limit_s, workers, seed)
    if assignment is not None:
        return _partition(inst, *assignment, "cp-sat", proven)
    got = does_not_fit(inst, time_limit_s, workers, seed, none_fits=proven)
    if isinstance(got, Partition):
        return got
    raise got
