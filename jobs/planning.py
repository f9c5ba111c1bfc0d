"""`confidant plan`: lower the model, read the cluster, compile the plan (`planner.compile`: head
splits, engines and the partition by CP-SAT or the user's cuts, costs and schedule), and write the
plan folder (plan.json + one bundle per device). The decisions are the planner's; this job checks
the flags, joins them and writes files."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ir.backend import runs_as
from ir.bundle import load_plan
from ir.documents import OptimizerSettings, PlannedLora
from ir.errors import InputFileError
from ir.graph import is_causal_lm
from ir.partition import StageCost
from ir.plan import FAILURE_POLICIES
from ir.training import TRAINING
from jobs.common.errors import FlagError, JobError
from jobs.common.lora import adapted, load_adapted
from jobs.common.report import Reporter, Silent
from planner.cluster import Cluster, load_cluster, with_reserve
from planner.compile import (SEARCH_SHARE, CompileError, CompiledPlan, Deadline, NoSteadyState, PlanRequest,
                              compile_plan, emit_compiled)
from planner.lookups import charged_rows
from planner.lora import LoraSettings
from planner.partition import PlanDoesNotFit, make_instance, solve_partition
from planner.simulate import simulate, write_chrome_trace


@dataclass(frozen=True)
class PlanSettings:
    """What to plan for: the schedule, batch rows, tokens per row, micro-batches, backwards per update
    (1f1b-stash), the optimizer and learning rate, manual cuts and device order (None: the solver's),
    and the planning time limit in seconds (`planner.compile.Deadline`)."""

    schedule: str = TRAINING.schedule
    batch: int = TRAINING.batch
    seq: int = TRAINING.seq
    microbatches: int = TRAINING.microbatches
    update_every: int = TRAINING.update_every
    optimizer: str = TRAINING.optimizer
    lr: float = TRAINING.lr
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
    # the fault policy `train` will run the plan with (`ir.plan.FAILURE_POLICIES`; plan.json records
    # it): "replan" leaves each device of a pipeline room for the snapshot copies on the workers
    # (`snapshot_reserve`; a plan on one device has no peer to copy to and keeps none), "stop" none
    on_failure: str = "replan"

    @property
    def request(self) -> PlanRequest:
        return PlanRequest(self.schedule, self.microbatches, self.optimizer, self.update_every, self.cuts,
                           self.devices)


def lora_record(lora: LoraSettings | None) -> PlannedLora | None:
    """The LoRA settings as plan.json records them (None: full fine-tuning)."""
    if lora is None:
        return None
    return PlannedLora(lora.rank, float(lora.alpha), tuple(lora.targets), tuple(lora.train_also), int(lora.seed))


def with_base_mapped(cluster: Cluster, float32_lora: bool) -> Cluster:
    """`cluster` with each device marked as reading a float32 LoRA base mapped (`DeviceSpec.frozen_mapped`)
    where the plan is written with its base weights file (`plan` always: base.safetensors beside the
    bundles): its workers hold that file (`train PLAN`'s local workers; a remote one started with
    `confidant worker --base`) and view a stage's frozen weights on a mapping of it, which a per-block
    engine reads a block at a time (runtime.pipeline.bundles.rebuild_weights); the cost model charges such
    a stage so only where its activations map (`planner.cost.maps_frozen`). MNN devices too, since its engine
    reads a mapped table's rows and a block's weights a file span at a time (`ir.mapped_pages.gather_rows`,
    `_BlockProgram.load_frozen`) and the charge holds what those reads keep (`planner.cost.mapped_read_bytes`):
    before, a SmolLM2 MNN stage's worker read 1.04-1.20 of the mapped charge (its first stage's lookup faulted
    44-52 MiB of the mapped table in, helpers h162 and h172). A plan run from memory (`train-pipeline`) ships
    whole bundles and is not marked. A worker started without the base file receives its weights into memory and
    holds the stage's whole base beside the plan's figure."""
    if not float32_lora:
        return cluster
    return dataclasses.replace(cluster, devices=tuple(
        dataclasses.replace(d, frozen_mapped=True) if d.backend is not None else d for d in cluster.devices))


def plan_model(model: Path, cluster_file: Path, settings: PlanSettings, output: Path,
               reporter: Reporter = Silent(), sign=None) -> Path:
    """Write the plan folder `output` for `model` over the cluster in `cluster_file`; returns it.
    `sign` (runtime.keys.signer of the coordinator's key) signs every bundle."""
    deadline = Deadline(settings.time_limit_s, settings.started_s)
    M = settings.microbatches
    if M < 1 or settings.batch % M:
        raise JobError(f"--batch {settings.batch} must be a multiple of --microbatches {M}")
    if settings.on_failure not in FAILURE_POLICIES:
        raise FlagError(f"--on-failure must be {' or '.join(FAILURE_POLICIES)}, not {settings.on_failure!r}")
    cluster = with_base_mapped(load_cluster(cluster_file),
                               settings.lora is not None and settings.lora.base_dtype == "float32")
    reserve = snapshot_reserve(cluster, settings.on_failure)
    if any(reserve.values()):
        reporter.note(f"planning a pipeline within each device's budget less {max(reserve.values()) / 2**20:.0f} MiB "
                      f"kept for the fault policy's snapshot copies on the workers (a device alone keeps none; "
                      f"`--on-failure stop` keeps none)")
    # a LoRA base held below float32 read from a mapping of a float32 file (`read_mapped`): read into
    # memory first, the file stood beside the quantized base (SmolLM2 int4: ~700 MiB, helper h76)
    graph = load_adapted(model, settings.batch // M, settings.seq, settings.lora, reporter)
    profiled = {(d.profile.batch, d.profile.seq) for d in cluster.devices}
    if profiled != {(graph.batch, graph.seq)}:
        raise JobError(f"the profiles were measured at (micro-batch rows, seq) {sorted(profiled)} but this plan uses "
                       f"({graph.batch}, {graph.seq}) = --batch {settings.batch} / --microbatches {M}, --seq "
                       f"{settings.seq}; re-profile with `confidant profile --batch {graph.batch} --seq {graph.seq}`")
    if settings.data is not None:
        graph = _with_data_figures(graph, Path(model), settings, reporter)
    if settings.devices and not settings.cuts:
        raise JobError(f"--devices {','.join(settings.devices)} orders the devices of --cuts; without --cuts the planner "
                       "picks the devices and their order itself: give --cuts too, or drop --devices")
    if settings.cuts and settings.devices and len(settings.devices) != len(settings.cuts) + 1:
        raise JobError(f"--devices names {len(settings.devices)} devices but --cuts {','.join(map(str, settings.cuts))} "
                       f"makes {len(settings.cuts) + 1} stages: give one device per stage, in pipeline order")
    def compile_over(over: Cluster, request: PlanRequest):
        return compile_plan(
            graph, over, request, OptimizerSettings(settings.optimizer, settings.lr),
            lambda inst: solve_partition(inst, time_limit_s=deadline.search_s(SEARCH_SHARE)),
            model=Path(model).name, model_path=str(Path(model).resolve()),
            lora=lora_record(settings.lora),
            keep_going=deadline.room_for_another_start, note=reporter.note)
    try:
        compiled = compile_within_reserve(compile_over, cluster, reserve, settings.request, reporter.note)
        compiled = dataclasses.replace(compiled, emit=dataclasses.replace(compiled.emit, on_failure=settings.on_failure))
    except NoSteadyState as exc:  # the fix is a flag: a usage error
        raise FlagError(str(exc)) from None
    except CompileError as exc:
        raise JobError(str(exc) + _reserve_hint(reserve)) from None
    except PlanDoesNotFit as exc:
        hint = ""
        if settings.lora is None:
            # priced as the refused plan was: a pipeline within each budget less the reserve
            hint = lora_fit_hint(graph, with_reserve(cluster, reserve), settings.schedule, M, settings.optimizer,
                                 settings.update_every)
        raise JobError(str(exc) + hint + _reserve_hint(reserve)) from None
    path = emit_compiled(output, compiled, sign)
    reporter.note(f"wrote {path} and {len(compiled.partition.stages)} bundles")
    if is_causal_lm(graph):
        copied = copy_lm_tokenizer(Path(model), Path(output))
        if copied:
            reporter.note(f"copied the tokenizer beside the plan ({', '.join(copied)}): `confidant train` reads it there")
    return Path(output)


def snapshot_reserve(cluster: Cluster, on_failure: str = "replan") -> dict[str, int]:
    """Each device's reserve under the fault policy `on_failure`: for "replan" (the default), the
    working bytes of its snapshot copies on the workers (`runtime.pipeline.snapshots.peer_snapshot_bytes`:
    the chunks on their way, or a window sent after a loss; the copies themselves lie in files), which
    `train` keeps there only when the plan's figure and they fit the budget
    (`jobs.train.from_plan.state_place`), charged for a pipeline over every device of the cluster
    (`compile_within_reserve` plans a device alone without it); for "stop", which copies nothing, none."""
    from runtime.pipeline.snapshots import peer_snapshot_bytes

    if on_failure == "stop":
        return {}
    charge = peer_snapshot_bytes([0] * len(cluster.devices))  # the charge does not grow with the state
    return {d.name: b for d, b in zip(cluster.devices, charge)}


def compile_within_reserve(compile_over: Callable[[Cluster, PlanRequest], CompiledPlan], cluster: Cluster,
                           reserve: Mapping[str, int], request: PlanRequest,
                           note: Callable[[str], None] = lambda _: None,
                           step_of: Callable[[CompiledPlan], float] = lambda c: c.step_s) -> CompiledPlan:
    """The plan `compile_over(cluster, request)` makes within each device's budget less its
    `reserve` where it spans several devices, none on one device: `planner.compile.compile_within_reserve`,
    the one rule `plan`, `estimate` and the re-plans during training (planner.replan) follow."""
    from planner.compile import compile_within_reserve as within

    return within(compile_over, with_reserve(cluster, reserve) if any(reserve.values()) else cluster, request, note,
                  step_of)


def _reserve_hint(reserve: dict[str, int]) -> str:
    """What a refusal's budgets mean when the plan kept a reserve ("" when it kept none)."""
    if not any(reserve.values()):
        return ""
    return (f"\n  (each budget above is the device's less the {max(reserve.values()) / 2**20:.0f} MiB kept for the "
            f"fault policy's snapshot copies on the workers)")


def _with_data_figures(graph, model: Path, settings: PlanSettings, reporter: Reporter):
    """The graph with the facts of one pass over `settings.data` that the memory model charges by,
    read as `confidant train` will read it (the same task, tokenizer and batches): the rows of each
    embedding table it looks up, and the most loss-target positions a micro-batch of it has."""
    from jobs.train.from_plan import PlanRunSettings, data_task, task_lookup_rows
    from jobs.train.pipeline_tasks import task_target_positions

    M = settings.microbatches
    try:
        task = data_task(model, settings.data, None, PlanRunSettings(tokenizer=settings.tokenizer), graph,
                         graph.batch, M, settings.seq)
        rows = task_lookup_rows(task)
        targets = task_target_positions(task)
    except (ValueError, OSError) as exc:
        # a file the user gave that cannot be used: bad input (exit 2, as train's reading of the same file);
        # the task's readers name the file already ("--data PATH: ..."), and said twice the line read as two
        said = str(exc)
        raise InputFileError(said if said.startswith(f"--data {settings.data}") else f"--data {settings.data}: "
                             f"{said}") from None
    if targets is not None:
        reporter.note(f"--data has at most {targets} loss-target positions in a micro-batch of {graph.batch} x "
                      f"{graph.seq}: the LM head + loss is charged for that many (train refuses data with more)")
        graph = dataclasses.replace(graph, target_positions=targets)
    # only the tables whose charge the rows set are kept (and checked again by train)
    charged = {}
    for table, n, total, rows_charged, why in charged_rows(graph, rows, settings.optimizer):
        if rows_charged is not None:
            charged[table] = rows_charged
        reporter.note(f"--data looks up {n} of the {total} rows of {table} ({100 * n / total:.1f}%, {task.batches} "
                      f"batches): {why}")
    return dataclasses.replace(graph, lookup_rows=charged)


# the rank `plan` tries when full fine-tuning does not fit (PEFT's usual first choice)
HINT_LORA_RANK = TRAINING.lora_rank


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
    except TimeoutError:  # CP-SAT found no assignment in the hint's second (a loaded machine): no hint
        return ""
    tight = max(partition.stages, key=lambda s: s.memory_bytes / s.memory_budget_bytes)
    return (f"\n  - --lora {rank}: fits (adapters only, the base frozen; tightest {tight.device!r} "
            f"{tight.memory_bytes / 2**20:.0f} MiB of {tight.memory_budget_bytes / 2**20:.0f} MiB); `confidant "
            f"estimate` prices every lever")


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
