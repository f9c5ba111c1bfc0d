"""`confidant plan`: lower the model, read the cluster, choose head splits and the partition (CP-SAT,
or the user's cuts), cost and schedule it, and write the plan folder (plan.json + one bundle per
device). The decisions are the planner's pure functions; this job joins them and writes files."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ir.backend import engine_of, runs_as, threads_of
from ir.bundle import load_plan
from ir.graph import is_causal_lm, tied_parameters
from ir.partition import StageCost
from ir.plan import DEFAULT_LR
from jobs.errors import JobError
from jobs.lora import adapted
from jobs.report import Reporter, Silent
from planner.cluster import Cluster, device_backend, load_cluster
from planner.cost import activations_of, check_tied_schedule, compute_s, predicted_step_s, stage_costs
from planner.engines import best_picks, pick_engines
from planner.emit import emit_plan
from planner.lookups import charged_rows
from planner.lora import LoraSettings
from planner.heads import HeadSplit, choose_head_split, profile_with_head_split, split_base_backend, split_extra_cost_s
from planner.onnx_import import load_model
from planner.partition import PlanDoesNotFit, check_feasible, make_instance, manual_partition, solve_partition
from planner.schedule import make_schedule
from planner.simulate import simulate, write_chrome_trace


@dataclass(frozen=True)
class PlanSettings:
    """What to plan for: the schedule, batch rows, tokens per row, micro-batches, backwards per update
    (1f1b-stash), the optimizer and learning rate, manual cuts and device order (None: the solver's),
    and the planning time limit in seconds (`_Deadline`)."""

    schedule: str = "1f1b-flush"
    batch: int = 8
    seq: int = 128
    microbatches: int = 4
    update_every: int = 1
    optimizer: str = "adamw"
    lr: float = DEFAULT_LR
    cuts: tuple[int, ...] | None = None
    devices: tuple[str, ...] | None = None
    time_limit_s: float = 10.0
    # time.monotonic() when the time limit started counting (the command's start, before its
    # imports); None: when plan_model is called
    started_s: float | None = None
    lora: LoraSettings | None = None  # None: full fine-tuning
    # the training data (and its tokenizer, else the model's): the embedding rows it looks up set
    # how much AdamW state the memory model charges those tables (`planner.lookups`)
    data: Path | None = None
    tokenizer: Path | None = None


# Each search's share of the time left (planner.engines.best_picks solves once per starting
# cluster and again after each round of engine picks; most stop early, proven optimal).
SEARCH_SHARE = 0.4


class _Deadline:
    """`PlanSettings.time_limit_s` spent over the whole plan, lowering included: each search gets a
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


def plan_model(model: Path, cluster_file: Path, settings: PlanSettings, output: Path,
               reporter: Reporter = Silent(), sign=None) -> Path:
    """Write the plan folder `output` for `model` over the cluster in `cluster_file`; returns it.
    `sign` (runtime.keys.signer of the coordinator's key) signs every bundle."""
    deadline = _Deadline(settings.time_limit_s, settings.started_s)
    M = settings.microbatches
    if M < 1 or settings.batch % M:
        raise JobError(f"--batch {settings.batch} must be a multiple of --microbatches {M}")
    cluster = load_cluster(cluster_file)
    graph = adapted(load_model(model, settings.batch // M, settings.seq), settings.lora, reporter)
    profiled = {(d.profile.batch, d.profile.seq) for d in cluster.devices}
    if profiled != {(graph.batch, graph.seq)}:
        raise JobError(f"the profiles were measured at (micro-batch rows, seq) {sorted(profiled)} but this plan uses "
                       f"({graph.batch}, {graph.seq}) = --batch {settings.batch} / --microbatches {M}, --seq "
                       f"{settings.seq}; re-profile with `confidant profile --batch {graph.batch} --seq {graph.seq}`")
    if settings.data is not None:
        graph = _with_lookup_rows(graph, Path(model), settings, reporter)
    cluster, splits = _with_head_splits(graph, cluster, reporter)
    reporter.note(f"planning {len(graph.blocks)} blocks over {len(cluster.devices)} devices ({settings.schedule}, "
                  f"{M} micro-batches)")
    if settings.devices and not settings.cuts:
        raise JobError(f"--devices {','.join(settings.devices)} orders the devices of --cuts; without --cuts the planner "
                       "picks the devices and their order itself: give --cuts too, or drop --devices")
    if settings.cuts and settings.devices and len(settings.devices) != len(settings.cuts) + 1:
        raise JobError(f"--devices names {len(settings.devices)} devices but --cuts {','.join(map(str, settings.cuts))} "
                       f"makes {len(settings.cuts) + 1} stages: give one device per stage, in pipeline order")
    if settings.cuts:
        order = list(settings.devices) if settings.devices else [d.name for d in cluster.devices]
        instance = make_instance(graph, cluster, settings.schedule, M, settings.optimizer, settings.update_every)
        partition = manual_partition(instance, order[:len(settings.cuts) + 1], list(settings.cuts))
        problems = check_feasible(partition, instance)
        if problems:
            raise JobError("the manual cuts do not fit: " + "; ".join(problems))
    else:
        partition = None
    partition, cluster = _pick_engines(graph, cluster, partition, settings, reporter, frozenset(splits), deadline)
    try:
        check_tied_schedule(graph, partition.ranges, settings.schedule)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    tied = tied_parameters(graph, partition.ranges)
    if tied:
        holders = sorted({s for stages in tied.values() for s in stages})
        reporter.note(f"{len(tied)} weight(s) tied across stages {holders} (e.g. {next(iter(tied))!r}): each holder keeps "
                      "a copy, charged in memory and in the update's transfer time; their gradients are summed "
                      "through the coordinator before every update")
    costs = stage_costs(graph, cluster, partition, settings.schedule, M, settings.optimizer, settings.update_every)
    schedule = make_schedule(settings.schedule, len(partition.stages), M, update_every=settings.update_every)
    config = {**_emit_config(Path(model).name, cluster, partition.devices, splits, settings),
              "model_path": str(Path(model).resolve()),
              "lora": None if settings.lora is None else asdict(settings.lora)}
    step_s = predicted_step_s(costs, settings.schedule, M, settings.update_every)
    path = emit_plan(output, graph, partition, schedule, config, costs, step_s,
                     cluster=cluster, sign=sign)
    reporter.note(f"wrote {path} and {len(partition.stages)} bundles")
    if is_causal_lm(graph):
        copied = copy_lm_tokenizer(Path(model), Path(output))
        if copied:
            reporter.note(f"copied the tokenizer beside the plan ({', '.join(copied)}): `confidant train` reads it there")
    return Path(output)


def _with_lookup_rows(graph, model: Path, settings: PlanSettings, reporter: Reporter):
    """The graph with the rows of each embedding table one pass over `settings.data` looks up, read
    as `confidant train` will read it (the same task, tokenizer and batches)."""
    from jobs.plan_training import PlanRunSettings, data_task, task_lookup_rows

    M = settings.microbatches
    try:
        task = data_task(model, settings.data, None, PlanRunSettings(tokenizer=settings.tokenizer), graph,
                         graph.batch, M, settings.seq)
        rows = task_lookup_rows(task)
    except (ValueError, OSError) as exc:
        raise JobError(f"--data {settings.data}: {exc}") from None
    # only the tables whose charge the rows set are kept (and checked again by train)
    charged = {}
    for table, n, total, rows_charged, why in charged_rows(graph, rows, settings.optimizer):
        if rows_charged is not None:
            charged[table] = rows_charged
        reporter.note(f"--data looks up {n} of the {total} rows of {table} ({100 * n / total:.1f}%, {task.batches} "
                      f"batches): {why}")
    return dataclasses.replace(graph, lookup_rows=charged)


def _pick_engines(graph, cluster: Cluster, partition, settings: PlanSettings, reporter: Reporter,
                  fixed: frozenset[str], deadline: _Deadline):
    """Each device's engine (auto devices) and activations picked for the blocks it gets, with the
    partition solved for the picks (`planner.engines.best_picks`), or re-picked for the manual cuts'
    `partition` (which stays); head-split devices (`fixed`) keep their engine."""
    M = settings.microbatches

    def solve(inst):
        return solve_partition(inst, time_limit_s=deadline.search_s(SEARCH_SHARE))

    if partition is not None:
        picks = pick_engines(graph, cluster, partition, settings.schedule, M, settings.optimizer, solve=None,
                             fixed=fixed, update_every=settings.update_every)
    else:
        try:
            picks = best_picks(graph, cluster, settings.schedule, M, settings.optimizer, solve, fixed=fixed,
                               keep_going=deadline.room_for_another_start, update_every=settings.update_every)
        except PlanDoesNotFit as exc:
            hint = ""
            if settings.lora is None:
                hint = lora_fit_hint(graph, cluster, settings.schedule, M, settings.optimizer, settings.update_every)
            raise JobError(str(exc) + hint) from None
    if picks.changed:
        moves = ", ".join(_devices_moved(picks.changed))
        reporter.note(f"engine per device for the blocks it runs: {moves} (predicted step "
                      f"{picks.before_us / 1e3:.0f} -> {picks.after_us / 1e3:.0f} ms)")
    return picks.partition, picks.cluster


# the rank `plan` tries when full fine-tuning does not fit (PEFT's usual first choice)
HINT_LORA_RANK = 8


def lora_fit_hint(graph, cluster: Cluster, schedule: str, microbatches: int, optimizer: str, update_every: int = 1,
                  rank: int = HINT_LORA_RANK, time_limit_s: float = 1.0) -> str:
    """A line for plan's "what would make it fit" when full fine-tuning of `graph` does not fit
    `cluster` but LoRA of rank `rank` does ("" otherwise), priced as `confidant estimate` prices it:
    the devices' profiles price the adapted blocks they lack as the same blocks without adapters."""
    from planner.memory_defaults import with_profile_costs

    try:
        lora = adapted(graph, LoraSettings(rank))
        devices = tuple(dataclasses.replace(d, profile=with_profile_costs(lora, d.profile, graph)[0])
                        for d in cluster.devices)
        inst = make_instance(lora, dataclasses.replace(cluster, devices=devices), schedule, microbatches, optimizer,
                             update_every)
        partition = solve_partition(inst, time_limit_s=time_limit_s)
    except (JobError, ValueError):  # PlanDoesNotFit among them: LoRA does not fit either
        return ""
    tight = max(partition.stages, key=lambda s: s.memory_bytes / s.memory_budget_bytes)
    return (f"\n  - --lora {rank}: fits (adapters only, the base frozen; tightest {tight.device!r} "
            f"{tight.memory_bytes / 2**20:.0f} MiB of {tight.memory_budget_bytes / 2**20:.0f} MiB); `confidant "
            f"estimate` prices every lever")


SHOWN_NAMES = 4  # device names per engine move in plan's note


def _devices_moved(changed: dict[str, tuple[str, str]]) -> list[str]:
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


def copy_lm_tokenizer(model: Path, plan_dir: Path) -> list[str]:
    """A causal LM's tokenizer.json and chat_template.json (written beside it by `confidant export
    --task causal-lm`) copied into the plan folder, so that `confidant train PLAN` can encode
    instruction data with the plan alone; the names copied (none when the model has no tokenizer)."""
    import shutil

    from tasks.causal_lm.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE

    copied = []
    for name in (TOKENIZER_FILE, CHAT_TEMPLATE_FILE):
        if (model.parent / name).is_file():
            shutil.copyfile(model.parent / name, plan_dir / name)
            copied.append(name)
    return copied


def _with_head_splits(graph, cluster: Cluster, reporter: Reporter = Silent()) -> tuple[Cluster, dict[str, HeadSplit]]:
    """Head splits come first: a device whose attention heads run split is faster, and the partition
    and the predicted times must see that speed, so the cluster's profiles are lowered by it. The
    split engine runs everything but the attention on MNN, so a split device is costed (and run) on
    its MNN backend: the chosen one when it is MNN, else the fastest MNN one; a device profiled
    without MNN is not split. Nor is one whose whole model would run slower that way than on the
    backend it would have without the split (a faster PyTorch elsewhere in the layer can outweigh
    what splitting the attention saves)."""
    splits, devices = {}, []
    n = len(graph.blocks)
    for d in cluster.devices:
        split = choose_head_split(graph, d.profile)
        base = split_base_backend(d.profile, d.backend)
        if split is not None and base is not None:
            candidate = dataclasses.replace(d, backend=base, profile=profile_with_head_split(
                d.profile, base, split, split_extra_cost_s(graph, d.profile, split)))
            with_split, without = sum(compute_s(graph, candidate, 0, n - 1)), sum(compute_s(graph, d, 0, n - 1))
            if with_split < without:
                splits[d.name] = split
                d = candidate
            else:
                reporter.note(f"{d.name}: no head split: the model on {base} with its attention split "
                              f"({with_split * 1e3:.0f} ms a micro-batch) is slower than on "
                              f"{device_backend(d).backend} unsplit ({without * 1e3:.0f} ms)")
        devices.append(d)
    return dataclasses.replace(cluster, devices=tuple(devices)), splits


def _emit_config(model_name: str, cluster: Cluster, devices, splits: dict[str, HeadSplit],
                 settings: PlanSettings) -> dict:
    """planner.emit's config: each device runs the engine of its fastest (or chosen) backend, so
    frameworks may differ; a split device runs MNN (the split engine runs the rest of its stage)."""
    specs = {d.name: d for d in cluster.devices}
    backends = {d.name: device_backend(d).backend for d in cluster.devices}
    config = {
        "model": model_name, "engine": {n: engine_of(backends[n]) for n in devices},
        "threads": {n: threads_of(backends[n]) for n in devices},
        "optimizer": {"name": settings.optimizer, "lr": settings.lr, "weight_decay": None},
        "addresses": {n: specs[n].address for n in devices}, "head_split": {},
        # what each device does with its activations; a head split recomputes (MNN, one graph set)
        "activations": {n: "recompute" if n in splits else activations_of(specs[n]) for n in devices
                        if activations_of(specs[n]) is not None},
    }
    for n in devices:
        split = splits.get(n)
        if split is not None:
            config["head_split"][n] = {"heads": dict(split.heads), "predicted_s": split.predicted_s,
                                       "single_best": [split.single_best[0], split.single_best[1]]}
            config["engine"][n] = "mnn"
    return config


def simulate_plan(plan_dir: Path, steps: int, output: Path):
    """Replay a plan's schedule on its cost model for `steps` batches and write a Chrome trace (its
    rows named by the plan's devices); returns (the plan, the simulation)."""
    plan, sim = plan_simulation(plan_dir, steps)
    write_chrome_trace(sim, output, [d.name for d in plan.devices])
    return plan, sim


def plan_simulation(plan_dir: Path, steps: int):
    """(the plan, its schedule replayed on its cost model for `steps` batches)."""
    plan = load_plan(plan_dir)
    costs = []
    for d in plan.devices:
        if d.cost is None:
            raise JobError(f"{plan_dir}/plan.json has no cost model for device {d.name!r}; re-run `confidant plan`")
        costs.append(StageCost(stage=d.stage, device=d.name, memory_bytes=d.memory_bytes,
                               memory_budget_bytes=d.memory_budget_bytes, **dataclasses.asdict(d.cost)))
    return plan, simulate(plan.to_schedule(), costs, steps=steps)


@dataclass(frozen=True)
class EngineChoice:
    """Why a device of a plan runs its engine: its stage's time per micro-batch on the backend the
    plan gave it, and on the fastest other profiled backend (None: no other) with what that
    backend's engine would add to the device's memory."""

    device: str
    backend: str
    seconds: float | None
    runner_up: str | None = None
    runner_up_seconds: float | None = None
    runner_up_extra_bytes: int = 0
    given: bool = False  # the cluster file named the backend (not auto)


def engine_choices(plan_dir: Path) -> list[EngineChoice]:
    """Each device's engine choice in the plan at `plan_dir`, from its cluster.json (empty for a plan
    written without one)."""
    from ir.bundle import load_bundle_dir
    from planner.cost import backend_times, reuses_forward
    from planner.emit import load_plan_cluster

    plan = load_plan(plan_dir)
    if plan.cluster_sha256 is None:
        return []
    cluster = load_plan_cluster(plan_dir)
    graph = load_bundle_dir(plan_dir / plan.devices[0].bundle).graph  # every slice keeps every block's metadata
    out = []
    for d in plan.devices:
        spec = cluster.device(d.name)
        reuse = reuses_forward(plan.schedule, plan.stages, d.stage, plan.microbatches)
        times = backend_times(graph, spec, d.first_block, d.last_block, reuse)
        chosen = next((t for t in times if runs_as(t[0], d.engine, d.threads)), None)
        others = [t for t in times if chosen is None or t[0] != chosen[0]]
        own_extra = chosen[2] if chosen is not None else 0
        best = others[0] if others else None
        out.append(EngineChoice(d.name, chosen[0] if chosen else f"{d.engine} ({d.threads} threads)",
                                chosen[1] if chosen else None, best[0] if best else None,
                                best[1] if best else None, (best[2] - own_extra) if best else 0,
                                spec.backend is not None))
    return out
