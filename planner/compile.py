"""The planner driver: a graph, a cluster (devices with their profiles) and a request (schedule,
micro-batches, optimizer, manual cuts or not) compiled into a plan ready to emit. `confidant plan`
(jobs.planning), `confidant estimate` (jobs.estimate) and every re-plan (planner.replan) run these
same steps, so a re-plan after a lost device or a slowed one decides what the first plan decided:

1. head splits (`with_head_splits`): a device whose attention heads run faster split across its
   backends is costed, and then run, split; the partition must see that speed, so this comes first;
2. engines and cuts (`search`): each device's engine and what it does with its activations, picked
   for the blocks it gets, with the partition solved for the picks (`planner.engines.best_picks`),
   or re-picked for given cuts;
3. costs, schedule and predicted step (`finish`), and the settings the emitter writes per device
   (`emit_settings`: a frozen `EmitSettings`, `planner.emit`'s config as typed data).

Pure: time enters only through the callables given (a solve with its time limit, `keep_going`),
and notes through `note`. `Deadline` is the one way both callers spend a time limit over the
searches."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ir.backend import engine_of, threads_of
from ir.documents import OptimizerSettings, PlannedHeadSplit, PlannedLora
from ir.graph import Graph, tied_parameters
from ir.partition import Partition, StageCost
from ir.plan import Schedule
from ir.training import TRAINING
from planner.cluster import Cluster, charged_reserve, device_backend
from planner.cost import activations_of, check_tied_schedule, compute_s, predicted_step_s, stage_costs
from planner.engines import EnginePicks, Solve, best_picks, pick_engines
from planner.heads import HeadSplit, choose_head_split, profile_with_head_split, split_base_backend, split_extra_cost_s
from planner.partition import PlanDoesNotFit, check_feasible, make_instance, manual_partition
from planner.schedule import make_schedule

Note = Callable[[str], None]

# Each search's share of a Deadline's time left (planner.engines.best_picks solves once per starting
# cluster and again after each round of engine picks; most stop early, proven optimal).
SEARCH_SHARE = 0.4


def _silent(_: str) -> None:
    pass


class CompileError(ValueError):
    """A request the cluster cannot serve as asked (manual cuts that do not fit, a schedule that
    cannot carry a weight tied across stages): one line naming what."""


class NoSteadyState(CompileError):
    """An asynchronous schedule (1f1b-stash, 2bw) over too few micro-batches for its stages: it has
    no steady state, so it could train one step only. A usage error: the fix is a flag."""


def steady_state_refusal(schedule: Schedule, steps: int | None = None) -> str | None:
    """The one line that refuses `schedule` for a run of `steps` steps (None: any number, as a plan
    is made for) when it has no steady state to run them with; None when it can run them."""
    if schedule.flushes or schedule.steady is not None or steps == 1:
        return None
    p, m = schedule.stages, schedule.microbatches
    every = "" if schedule.update_every in (1, m) else f" and --update-every {schedule.update_every} dividing them"
    return (f"{schedule.name} over {p} stages with {m} micro-batch{'es' if m != 1 else ''} per step has no steady "
            f"state (it needs at least stages - 1 = {p - 1} micro-batches{every}), so it cannot train "
            f"{'more than one step' if steps is None else f'{steps} steps'}: use --microbatches {max(p - 1, 1)} or "
            f"more, or --schedule 1f1b-flush")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: the schedule, micro-batches per batch, the optimizer, backwards per update
    (1f1b-stash, 2bw), and manual cuts (first block of stages 2..p) with the devices that run the
    stages in pipeline order (None: the cluster's order); no cuts (None): the solver's; cuts=()
    with one device in `order`: the whole model on that device."""

    schedule: str = TRAINING.schedule
    microbatches: int = TRAINING.microbatches
    optimizer: str = TRAINING.optimizer
    update_every: int = TRAINING.update_every
    cuts: tuple[int, ...] | None = None
    order: tuple[str, ...] | None = None

    @property
    def costing(self) -> tuple[str, int, str]:
        """(schedule, micro-batches, optimizer): the leading arguments of the cost model's calls."""
        return self.schedule, self.microbatches, self.optimizer


@dataclass(frozen=True)
class DeviceRun:
    """How one device of a plan runs its stage: the engine and its threads, the worker's address,
    what the engine does with its activations (None: the engine's default) and its head split."""

    engine: str
    threads: int
    address: str
    activations: str | None = None
    head_split: PlannedHeadSplit | None = None


@dataclass(frozen=True)
class EmitSettings:
    """What `planner.emit.emit_plan` writes beside the partition and schedule: the model's name and
    file, the LoRA settings its graph was adapted with (None: full fine-tuning), the optimizer, the
    backend kind, and each device's `DeviceRun` in pipeline order."""

    model: str | None
    optimizer: OptimizerSettings
    devices: Mapping[str, DeviceRun]
    model_path: str | None = None
    lora: PlannedLora | None = None
    backend: str = "cpu"
    on_failure: str = "replan"  # the fault policy the job left memory for (plan.json records it)

    def config(self) -> dict[str, Any]:
        """`emit_plan`'s config dict (planner.emit.CONFIG_DEFAULTS)."""
        runs = self.devices
        return {"model": self.model, "model_path": self.model_path, "backend": self.backend,
                "lora": None if self.lora is None else self.lora.to_json(), "optimizer": self.optimizer.to_json(),
                "engine": {n: r.engine for n, r in runs.items()}, "threads": {n: r.threads for n, r in runs.items()},
                "addresses": {n: r.address for n, r in runs.items()},
                "head_split": {n: r.head_split.to_json() for n, r in runs.items() if r.head_split is not None},
                "activations": {n: r.activations for n, r in runs.items() if r.activations is not None},
                "on_failure": self.on_failure}


@dataclass(frozen=True)
class CompiledPlan:
    """A plan ready to emit: the graph, the cluster as costed (head splits applied to the split
    devices' profiles, every device's engine and activations picked), the partition, the head
    splits, the stage costs, the schedule, the predicted step, what to emit, and the engine search's
    account (which devices moved engine, the predicted step before and after)."""

    graph: Graph
    cluster: Cluster
    partition: Partition
    splits: Mapping[str, HeadSplit]
    costs: tuple[StageCost, ...]
    schedule: Schedule
    step_s: float
    emit: EmitSettings
    picks: EnginePicks | None = None  # None: a partition and picks decided elsewhere (planner.replan)


class Deadline:
    """A time limit spent over a whole plan (or re-plan), lowering included: each search gets a
    share of what is left before a reserve for writing the bundles, and at least MIN_SEARCH_S (a
    search stops early anyway once it proves its plan optimal)."""

    MIN_SEARCH_S = 0.5
    WRITE_SHARE = 0.2  # kept back for costing, scheduling and writing the plan

    # a further starting point of the engine search (planner.engines.best_picks) only while this
    # share of the limit is left: its solve and re-solves take at least MIN_SEARCH_S each
    FURTHER_START_SHARE = 0.3

    def __init__(self, limit_s: float, started_s: float | None = None):
        self.limit_s = limit_s
        self.end = (time.monotonic() if started_s is None else started_s) + (1 - self.WRITE_SHARE) * limit_s

    def search_s(self, share: float) -> float:
        return max(self.MIN_SEARCH_S, share * (self.end - time.monotonic()))

    def room_for_another_start(self) -> bool:
        return self.end - time.monotonic() > self.FURTHER_START_SHARE * self.limit_s


# --- 1. head splits -------------------------------------------------------------------------------

def with_head_splits(graph: Graph, cluster: Cluster, note: Note = _silent,
                     applied: frozenset[str] = frozenset()) -> tuple[Cluster, dict[str, HeadSplit]]:
    """The cluster with each device whose attention runs faster split across its backends costed
    (and run) split, and those splits. A split device is costed on its MNN backend (the split engine
    runs everything but the attention on MNN): the chosen one when it is MNN, else the fastest MNN
    one; a device profiled without MNN is not split. Nor is one whose whole model would run slower
    that way than on the backend it would have without the split (a faster PyTorch elsewhere in the
    layer can outweigh what splitting the attention saves).

    `applied`: devices whose profile and backend already carry this decision (a re-plan over the
    cluster a plan folder recorded, planner.emit's cluster.json): the decision is made again (it
    depends on the device's profile and the whole graph, not on the cut) to learn the split, but the
    device is left as it is."""
    splits, devices = {}, []
    n = len(graph.blocks)
    for d in cluster.devices:
        split = choose_head_split(graph, d.profile)
        base = split_base_backend(d.profile, d.backend) if split is not None else None  # (nominal profiles: no split)
        if split is not None and base is not None:
            candidate = dataclasses.replace(d, backend=base, profile=profile_with_head_split(
                d.profile, base, split, split_extra_cost_s(graph, d.profile, split)))
            with_split, without = sum(compute_s(graph, candidate, 0, n - 1)), sum(compute_s(graph, d, 0, n - 1))
            # an applied device's profile was lowered by this split already, which lowering again
            # may leave as it is (a block's time is never taken below zero): no slower counts there
            if with_split < without or (d.name in applied and with_split <= without):
                splits[d.name] = split
                d = d if d.name in applied else candidate
            elif d.name not in applied:
                note(f"{d.name}: no head split: the model on {base} with its attention split "
                     f"({with_split * 1e3:.0f} ms a micro-batch) is slower than on "
                     f"{device_backend(d).backend} unsplit ({without * 1e3:.0f} ms)")
        devices.append(d)
    return dataclasses.replace(cluster, devices=tuple(devices)), splits


# --- 2. engines and cuts ---------------------------------------------------------------------------

def manual_cuts(graph: Graph, cluster: Cluster, request: PlanRequest) -> Partition:
    """The request's manual cuts over its devices (the cluster's order without one), checked to fit."""
    order = list(request.order) if request.order else [d.name for d in cluster.devices]
    instance = make_instance(graph, cluster, *request.costing, request.update_every)
    partition = manual_partition(instance, order[:len(request.cuts) + 1], list(request.cuts))
    problems = check_feasible(partition, instance)
    if problems:
        raise CompileError("the manual cuts do not fit: " + "; ".join(problems))
    return partition


def search(graph: Graph, cluster: Cluster, request: PlanRequest, solve: Solve, fixed: frozenset[str] = frozenset(),
           partition: Partition | None = None, keep_going: Callable[[], bool] = lambda: True) -> EnginePicks:
    """Each device's engine (auto devices) and activations picked for the blocks it gets, with the
    partition solved for the picks (`planner.engines.best_picks`, each solve by `solve`), or, given
    `partition` (manual cuts), re-picked for it (the cuts stay). `fixed` devices (head-split ones)
    keep their engine. PlanDoesNotFit when nothing fits."""
    if partition is not None:
        return pick_engines(graph, cluster, partition, *request.costing, solve=None, fixed=fixed,
                            update_every=request.update_every)
    return best_picks(graph, cluster, *request.costing, solve, fixed=fixed, keep_going=keep_going,
                      update_every=request.update_every)


def compile_within_reserve(compile_over: Callable[[Cluster, PlanRequest], Any], cluster: Cluster,
                           request: PlanRequest, note: Callable[[str], None] = lambda _: None,
                           step_of: Callable[[Any], float] = lambda c: c.step_s) -> Any:
    """The plan `compile_over(cluster, request)` makes within each device's budget less its reserve
    (`DeviceSpec.reserved_bytes`: the snapshot copies' working bytes between the stages of a
    pipeline) where it spans several devices. A plan on one device has no peer to copy to, so it
    keeps no reserve (`charged_reserve`): when the reserved plan ends on one device, that device is
    planned alone within its whole budget; when nothing fits with the reserve (and no cuts were
    asked for), each device is tried alone that way and the fastest that fits (by `step_of`) is the
    plan (else the reserved plan's refusal stands). A lone try is `compile_over(cluster without
    reserves, request with cuts=() and order=(device,))`. `compile_over` may return anything with a
    `partition` (`estimate` and `replan` pass the engine picks). `plan`, `estimate` and every
    re-plan (`planner.replan.replan`) decide by this one function."""
    if not any(d.reserved_bytes for d in cluster.devices) or request.cuts:  # manual cuts: each stage its reserve
        return compile_over(cluster, request)
    refusal = None
    try:
        reserved = compile_over(cluster, request)
    except PlanDoesNotFit as exc:
        reserved, refusal = None, exc
    if reserved is not None and len(reserved.partition.stages) > 1:
        return reserved
    names = [reserved.partition.devices[0]] if reserved is not None else list(cluster.names)
    bare = charged_reserve(cluster, names[:1])
    best = None
    for name in names:
        try:
            lone = compile_over(bare, dataclasses.replace(request, cuts=(), order=(name,)))
        except (PlanDoesNotFit, CompileError):
            continue
        if best is None or step_of(lone) < step_of(best):
            best = lone
    if best is None:
        if reserved is not None:
            return reserved
        raise refusal
    if reserved is None:
        note(f"no pipeline fits with the snapshot copies' reserve; {best.partition.devices[0]!r} alone fits its whole "
             f"budget (one device copies no snapshots)")
    return best


SHOWN_NAMES = 4  # device names per engine move in a note


def engine_moves(changed: Mapping[str, tuple[str, str]]) -> list[str]:
    """`name: before -> after` per device, devices with the same move as one entry (a 64-device plan
    moves a dozen devices the same way): `a, b, c (3 devices): before -> after`, at most
    SHOWN_NAMES names each."""
    by_move: dict[tuple[str, str], list[str]] = {}
    for name, move in changed.items():
        by_move.setdefault(move, []).append(name)
    out = []
    for (before, after), names in by_move.items():
        if len(names) == 1:
            out.append(f"{names[0]}: {before} -> {after}")
        else:
            shown = ", ".join(names[:SHOWN_NAMES]) + (", ..." if len(names) > SHOWN_NAMES else "")
            out.append(f"{shown} ({len(names)} devices): {before} -> {after}")
    return out


def note_engine_moves(picks: EnginePicks, note: Note) -> None:
    if picks.changed:
        note(f"engine per device for the blocks it runs: {', '.join(engine_moves(picks.changed))} (predicted step "
             f"{picks.before_us / 1e3:.0f} -> {picks.after_us / 1e3:.0f} ms)")


# --- 3. costs, schedule, emit settings --------------------------------------------------------------

def finish(graph: Graph, cluster: Cluster, partition: Partition,
           request: PlanRequest) -> tuple[tuple[StageCost, ...], Schedule, float]:
    """The stages' costs, the schedule's actions and the predicted step in seconds."""
    costs = stage_costs(graph, cluster, partition, *request.costing, request.update_every)
    schedule = make_schedule(request.schedule, len(partition.stages), request.microbatches,
                             update_every=request.update_every)
    return tuple(costs), schedule, predicted_step_s(costs, request.schedule, request.microbatches,
                                                    request.update_every)


def emit_settings(cluster: Cluster, devices: Sequence[str], splits: Mapping[str, HeadSplit],
                  optimizer: OptimizerSettings, model: str | None, model_path: str | None = None,
                  lora: PlannedLora | None = None, backend: str = "cpu",
                  addresses: Mapping[str, str] | None = None,
                  previous: Mapping[str, DeviceRun] | None = None) -> EmitSettings:
    """Each device runs the engine of its chosen (or picked) backend, so frameworks may differ; a
    split device runs MNN (the split engine runs the rest of its stage) and recomputes (one graph
    set). Addresses: `addresses` where it names the device, else the cluster's. `previous`: how the
    plan before ran its devices, for one whose backend names no engine (a nominal profile's)."""
    runs = {}
    for name in devices:
        spec = cluster.device(name)
        backend_name = device_backend(spec).backend
        try:
            engine, threads = engine_of(backend_name), threads_of(backend_name)
        except ValueError:  # a nominal profile's backend (planner.replan.flops_cluster) names no engine
            run = (previous or {}).get(name)
            engine, threads = (run.engine, run.threads) if run is not None else ("mnn", 1)
        split = splits.get(name)
        activations = activations_of(spec)
        if split is not None and activations is not None:
            activations = "recompute"
        runs[name] = DeviceRun(
            "mnn" if split is not None else engine, threads, (addresses or {}).get(name) or spec.address, activations,
            None if split is None else PlannedHeadSplit(dict(split.heads), split.predicted_s,
                                                        (split.single_best[0], split.single_best[1])))
    return EmitSettings(model, optimizer, runs, model_path, lora, backend)


def tied_note(graph: Graph, partition: Partition, schedule: str, note: Note = _silent) -> None:
    """CompileError when `schedule` cannot carry a weight tied across the partition's stages; a note
    naming the tied weights when it can."""
    try:
        check_tied_schedule(graph, partition.ranges, schedule)
    except ValueError as exc:
        raise CompileError(str(exc)) from None
    tied = tied_parameters(graph, partition.ranges)
    if tied:
        holders = sorted({s for stages in tied.values() for s in stages})
        note(f"{len(tied)} weight(s) tied across stages {holders} (e.g. {next(iter(tied))!r}): each holder keeps "
             "a copy, charged in memory and in the update's transfer time; their gradients are summed "
             "through the coordinator before every update")


def compile_plan(graph: Graph, cluster: Cluster, request: PlanRequest, optimizer: OptimizerSettings,
                 solve: Solve, *, model: str | None = None, model_path: str | None = None,
                 lora: PlannedLora | None = None, keep_going: Callable[[], bool] = lambda: True,
                 note: Note = _silent) -> CompiledPlan:
    """`graph` over `cluster` as `request` asks (the module docstring's steps), each partition
    search by `solve`. PlanDoesNotFit when no partition fits; CompileError for manual cuts that do
    not fit or a schedule that cannot carry a tied weight."""
    cluster, splits = with_head_splits(graph, cluster, note)
    note(f"planning {len(graph.blocks)} blocks over {len(cluster.devices)} devices ({request.schedule}, "
         f"{request.microbatches} micro-batches)")
    # cuts=() with one device in `order`: the plan on that device alone
    partition = manual_cuts(graph, cluster, request) if request.cuts is not None else None
    picks = search(graph, cluster, request, solve, frozenset(splits), partition, keep_going)
    note_engine_moves(picks, note)
    tied_note(graph, picks.partition, request.schedule, note)
    emit = emit_settings(picks.cluster, picks.partition.devices, splits, optimizer, model, model_path, lora)
    compiled = assemble(graph, picks.cluster, picks.partition, splits, request, emit, picks)
    refusal = steady_state_refusal(compiled.schedule)
    if refusal is not None:
        raise NoSteadyState(refusal)
    check_within_budgets(compiled)
    return compiled


def check_within_budgets(compiled: CompiledPlan) -> None:
    """A plan is a promise that each device's run stays within its budget: the stage costs the
    plan will carry, priced after every choice (engines, activations, cached blocks), must fit, or
    PlanDoesNotFit names the device. (A search's starting partition once came back from the
    engine picks without fitting, and the plan was written over its budget.)"""
    over = [(c.memory_bytes - c.memory_budget_bytes, c) for c in compiled.costs
            if c.memory_budget_bytes > 0 and c.memory_bytes > c.memory_budget_bytes]
    if not over:
        return
    worst, cost = max(over, key=lambda pair: pair[0])
    mib = 1 << 20
    raise PlanDoesNotFit(
        f"device {cost.device!r} (stage {cost.stage}) needs {cost.memory_bytes / mib:.1f} MiB against its "
        f"{cost.memory_budget_bytes / mib:.1f} MiB budget ({worst / mib:.1f} MiB over) in the best plan found: "
        "give it more memory, add a device, or lower what a device holds (--lora, --base-dtype, more "
        "--microbatches)", cost.device, worst, compiled.partition)


def assemble(graph: Graph, cluster: Cluster, partition: Partition, splits: Mapping[str, HeadSplit],
             request: PlanRequest, emit: EmitSettings, picks: EnginePicks | None = None) -> CompiledPlan:
    """The compiled plan of a decided partition over `cluster` (its devices' engines picked)."""
    costs, schedule, step_s = finish(graph, cluster, partition, request)
    return CompiledPlan(graph, cluster, partition, splits, costs, schedule, step_s, emit, picks)


def emit_compiled(output, compiled: CompiledPlan, sign=None, graph: Graph | None = None):
    """Write `compiled` as a plan folder at `output` (planner.emit.emit_plan, which verifies it);
    `graph`: the same model with other weights (a re-plan's, from training) instead of the compiled
    one's. Returns plan.json's path."""
    from planner.emit import emit_plan

    c = compiled
    return emit_plan(output, graph if graph is not None else c.graph, c.partition, c.schedule, c.emit.config(),
                     list(c.costs), c.step_s, cluster=c.cluster, sign=sign)
