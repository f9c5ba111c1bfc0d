"""`confidant train PLAN`: ship each device its bundle and train with the plan's schedule, optionally
re-planning from the measured stage times while training (`--replan-every`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from ir.bundle import PLAN_BASE, BundleError, LoadedPlan, load_plan, load_plan_folder
from ir.documents import PlanDocument
from ir.plan import FLUSH_SCHEDULES
from ir.serialize import merge_slices
from jobs.common.errors import FlagError, JobError
from jobs.common.memory_check import check_memory
from jobs.common.metrics import DeviceFigures, TrainingMetrics, steps_from
from jobs.train.pipeline_run import describe_event, progress, run_on_workers
from jobs.train.pipeline import AUTO_SNAPSHOTS, FaultPolicy, PipelineResult, SurvivorPlan, train_pipeline
from jobs.common.report import Reporter, Silent
from jobs.common.settings import check_fault_flags
from jobs.common.workers import LocalWorkers, coordinator_pair
from ir.precision import QuantizedTensor
from jobs.common.lora import with_base_mapped
from planner.cluster import Cluster, ClusterError, load_cluster
from planner.emit import load_plan_cluster
from planner.compile import steady_state_refusal
from planner.replan import PlanReplanner
from runtime.pipeline.bundles import plan_base
from runtime.pipeline.checkpoints import check_checkpoint_target
from runtime.pipeline.snapshots import peer_snapshot_bytes
from runtime.pipeline.coordinator import PipelineConfig
from runtime.procfs import peak_rss_bytes
from jobs.train.pipeline_tasks import (PipelineTask, lm_perplexity_on_stages, task_run, task_target_positions,
                                     weights_evaluation)
from jobs.common.task_choice import check_graph
from tasks.causal_lm.task import TokenizerNotFound
from tasks.choice import task_named, task_of


@dataclass(frozen=True)
class PlanRunSettings:
    """How to run a plan: steps, the data shuffle seed, the tokenizer, local workers or the plan's
    addresses, where to checkpoint, re-planning (every N steps, least gain, the cluster to re-plan
    with; default the plan's cluster.json), the coordinator's address and the silence timeout."""

    steps: int = 60
    seed: int = 0
    tokenizer: Path | None = None
    local: bool = False
    checkpoint: Path | None = None
    replan_every: int | None = None
    replan_threshold: float = 0.1
    cluster: Path | None = None
    listen: str = "tcp://127.0.0.1:0"
    timeout_s: float = 600.0
    keys: Path | None = None          # coordinator.key (signed the plan) and, for remote workers, NAME.pub
    insecure: bool = False
    on_failure: str | None = None     # None: the plan's (plan.json's `on_failure`); another is refused
    failure_timeout_s: float = 3.0
    checkpoint_every: int | None = None
    # local workers started with the plan's base weights file (False: as remote workers started without
    # `--base`, sent every frozen weight; benchmarks/memory_plans.py --workers-without-base)
    local_base: bool = True


def _checkpoint_meta(plan_dir: Path, plan: PlanDocument, task) -> dict:
    """What a checkpoint of this run records beside the weights: the plan, and what predict,
    export-trained and export-adapter need to use them (the model file the plan was made from, the
    task, its labels, the LoRA settings of a LoRA plan)."""
    meta = {"plan": str(plan_dir), "model": plan.model, "task": task.name, "labels": list(task.labels),
            "batch": plan.batch, "seq": plan.seq, "optimizer": plan.optimizer.name, "lr": plan.optimizer.lr}
    if plan.model_path is not None:
        meta["model_path"] = plan.model_path
    if plan.lora is not None:  # export-adapter names the adapters from these; predict sends LoRA runs there
        meta["lora"] = plan.lora.to_json()
        if plan.base_dtype != "float32":  # export-adapter and resume see the base's precision (absent: float32)
            meta["lora"]["base_dtype"] = plan.base_dtype
    return meta


def planned_values(plan_dir: Path) -> dict[str, set]:
    """What the plan at `plan_dir` fixes of the training flags, flag -> the value(s) its devices use
    (a plan may give its devices different engines and thread counts)."""
    try:
        plan = load_plan(Path(plan_dir))
    except (BundleError, FileNotFoundError, ValueError) as exc:
        raise JobError(str(exc)) from None
    return {"batch": {plan.batch}, "seq": {plan.seq}, "lr": {plan.optimizer.lr}, "optimizer": {plan.optimizer.name},
            "engine": {d.engine for d in plan.devices}, "threads": {d.threads for d in plan.devices}}


def _coordinator_keys(settings: PlanRunSettings, loaded: LoadedPlan, reporter):
    """The coordinator's pair, after checking that it signed every bundle of the plan (a worker
    would refuse them otherwise; better said here, before any worker starts)."""
    from runtime.keys import KeyFileError, verifier

    if settings.insecure:
        return None
    if settings.keys is None:
        raise JobError("training from a plan needs the coordinator's keys (--keys DIR, the folder `confidant plan` "
                       "signed the bundles from) or --insecure")
    try:
        pair = coordinator_pair(settings.keys, note=reporter.note)
    except KeyFileError as exc:
        raise JobError(str(exc)) from None
    try:
        loaded.check_signatures(verifier(pair.public))
    except BundleError as exc:
        raise JobError(f"{exc} (re-run `confidant plan` with this coordinator's --keys {settings.keys})") from None
    return pair


def _remote_keys(settings: PlanRunSettings, pair, names, addresses, plan_dir: Path | None = None):
    """Each worker's public key by address: the cluster file's `key:` (--cluster, else the plan's
    cluster.json) where a device has one, else NAME.pub in --keys DIR."""
    from runtime.keys import COORDINATOR_KEY, ClusterKeys, KeyDir, KeyFileError, PublicKey

    listed, source = {}, None
    try:
        if settings.cluster is not None:
            cluster, source = load_cluster(settings.cluster), str(settings.cluster)
        elif plan_dir is not None and (plan_dir / "cluster.json").is_file():
            cluster, source = load_plan_cluster(plan_dir), str(plan_dir / "cluster.json")
        else:
            cluster = None
    except (ClusterError, BundleError) as exc:
        raise JobError(str(exc)) from None
    if cluster is not None:
        listed = {d.name: d.key for d in cluster.devices if d.key}
    try:
        keys = {}
        keydir = None
        for n, a in zip(names, addresses):
            if n in listed:
                keys[a] = PublicKey.parse(listed[n], f"{source}: device {n!r}: key")
                continue
            if keydir is None:
                keydir = KeyDir.load(settings.keys, COORDINATOR_KEY)
            keys[a] = keydir.key_of(n)
        return ClusterKeys(pair, keys)
    except KeyFileError as exc:
        raise JobError(f"{exc} (the coordinator needs each device's public key: `key:` in the cluster file, or "
                       f"NAME.pub in --keys DIR)") from None


def train_from_plan(plan_dir: Path, data: Path, eval_path: Path | None, settings: PlanRunSettings,
                    reporter: Reporter = Silent()) -> TrainingMetrics:
    if settings.steps < 1:
        raise JobError(f"--steps must be at least 1, got {settings.steps}")
    if settings.checkpoint is not None:
        check_checkpoint_target(settings.checkpoint)
    plan_dir = Path(plan_dir)
    loaded = load_plan_folder(plan_dir)  # read and verified once; its bundles' bytes are what the workers get
    plan, contents = loaded.plan, list(loaded.contents)
    settings = replace(settings, on_failure=plan_policy(plan_dir, plan, settings.on_failure))
    check_fault_flags(settings.on_failure, settings.failure_timeout_s, settings.checkpoint_every, settings.checkpoint)
    refusal = steady_state_refusal(loaded.schedule, settings.steps)
    if refusal is not None:
        raise FlagError(f"{plan_dir}: {refusal} (re-plan with `confidant plan`)")
    names = plan.device_names
    replanner = _plan_replanner(settings, plan_dir, plan, contents)  # None without --replan-every
    pair = _coordinator_keys(settings, loaded, reporter)
    sign = None
    if pair is not None:
        from runtime.keys import signer

        sign = signer(pair)
    if replanner is not None:
        replanner.sign = sign  # new plans are signed like the first
    rescuer = replanner if replanner is not None else _failure_replanner(settings, plan_dir, plan, contents, sign)
    spares = _spare_devices(replanner or rescuer, names)
    M, rows, seq = plan.microbatches, plan.batch, plan.seq
    full = _plan_graph(plan, contents)
    task = data_task(plan_dir, data, eval_path, settings, full, rows, M, seq, note=reporter.note)
    check_lookup_rows(plan, task, settings.steps, data)
    check_target_positions(plan, task, settings.steps, data)
    if not settings.local and not all(d.address for d in plan.devices):
        raise JobError(f"{plan_dir}/plan.json lacks worker addresses; pass --local or re-plan with addresses")
    config = PipelineConfig(schedule=plan.schedule, microbatches=M, timeout_s=settings.timeout_s)
    reporter.start(f"train {plan_dir.name} ({len(names)} devices, {plan.schedule})", settings.steps)

    base = plan_base(plan_dir, plan)
    local = None
    if settings.local:  # on this machine the plan's base weights file is at hand: no frozen weight is sent
        local = LocalWorkers.start(len(names) + len(spares), max(d.threads for d in plan.devices), coordinator=pair,
                                   insecure=settings.insecure, failure_timeout_s=settings.failure_timeout_s,
                                   base_files=[plan_dir / PLAN_BASE] if base is not None and settings.local_base else ())
        addresses = local.addresses[:len(names)]
        spares = dict(zip(spares, local.addresses[len(names):]))
        keys = local.keys
    else:
        addresses = [d.address for d in plan.devices]
        keys = None if pair is None else _remote_keys(settings, pair, names + list(spares),
                                                       addresses + list(spares.values()), plan_dir)
    address_of = {**dict(zip(names, addresses)), **spares}
    state_on, why = state_place(plan.devices)
    if why:
        reporter.note(why)
    faults = FaultPolicy(settings.on_failure, settings.failure_timeout_s, AUTO_SNAPSHOTS, settings.checkpoint_every,
                         state_on=state_on)

    def metrics_of(result: PipelineResult, error: str | None = None, **replan_figures) -> TrainingMetrics:
        return TrainingMetrics(
            "train", plan.model, rows * M, seq, steps_from(result.losses, result.step_seconds, rows * M,
                                                               state_seconds=result.state_seconds),
            _device_figures(result, names, replanner), microbatches=M, schedule=plan.schedule, plan=str(plan_dir),
            predicted_step_s=plan.predicted_step_s, coordinator_peak_rss_bytes=peak_rss_bytes(),
            settings=asdict(settings), events=tuple(result.events), error=error, **replan_figures)
    result = run_on_workers(lambda: train_pipeline(
        None, None, len(task.labels), addresses, config, settings.steps, listen=settings.listen,
        on_step=progress(reporter, rows * M), bundles=loaded.files, devices=names, stage_graphs=contents,
        checkpoint_dir=settings.checkpoint, meta=_checkpoint_meta(plan_dir, plan, task),
        replan_every=settings.replan_every, on_replan=replanner, spare_devices=spares,
        on_replanned=lambda step, reconf: _report_replan(reporter, replanner, step, reconf), schedule=loaded.schedule,
        update_every=plan.update_every, keys=keys, insecure=settings.insecure, faults=faults,
        plan_over=None if rescuer is None else _plan_over(rescuer, address_of),
        on_event=lambda event: reporter.note(describe_event(event)), feeds_of_step=task.feeds_of_step, base=base,
        after_training=task.evaluate_on_stages),
        metrics_of, local, reporter)
    metrics = metrics_of(result, **(_replan_figures(replanner, result) if replanner is not None else {}))
    reporter.note(f"step time: predicted {plan.predicted_step_s:.3f} s, measured {metrics.measured_step_s:.3f} s")
    promised = plan  # after a re-plan, the figures of the plan the run ended on
    if replanner is not None and replanner.applied:
        promised = replanner.applied[-1].loaded.plan
    # a plan that left room for the snapshot copies on the workers promised its figure and that room
    reserved = any(d.reserved_bytes for d in promised.devices)
    if reserved:
        kept = ", ".join(f"{d.name} {d.reserved_bytes / 2**20:.0f} MiB" for d in promised.devices)
        reporter.note(f"planned memory below: each device's plan + what it left free for the fault policy's "
                      f"snapshot copies on the workers ({kept})")
    metrics = check_memory(metrics, {d.name: d.promised_bytes for d in promised.devices},
                           {d.name: d.memory_budget_bytes for d in promised.devices}, reporter,
                           "the plan + reserve" if reserved else "the plan")
    if base is not None:
        reporter.note(f"setup sent {result.setup_bytes / 2**20:.1f} MiB; {result.base_bytes_held / 2**20:.1f} MiB of "
                      f"frozen weights came from the devices' own copies of {PLAN_BASE} (confidant worker --base)")
    figures = result.after_training if task.evaluate_on_stages is not None else task.evaluate(result.weights)
    if figures is not None:
        reporter.note(f"{task.headline(figures)} after training")
        metrics = replace(metrics, eval=figures)
    return metrics


def plan_policy(plan_dir: Path, plan: PlanDocument, given: str | None) -> str:
    """The fault policy a plan runs with: the one it was made for (plan.json's `on_failure`, whose
    memory it left room for), or a FlagError naming both when `given` (--on-failure) is another."""
    if given is not None and given != plan.on_failure:
        room = "leaves room for" if plan.on_failure == "replan" else "has no room for"
        raise FlagError(f"--on-failure {given}: {plan_dir} was planned for --on-failure {plan.on_failure} (its memory "
                        f"{room} the snapshot copies); drop the flag, or re-plan with `confidant plan --on-failure "
                        f"{given}`")
    return plan.on_failure


def data_task(plan_dir: Path, data: Path, eval_path: Path | None, settings: PlanRunSettings, full, rows: int, M: int,
              seq: int, note: Callable[[str], None] | None = None) -> PipelineTask:
    """The task `full` (the model at micro-batch `rows`) trains, on `data`: the one its head says
    (`tasks.choice.task_of`), its figures of the trained weights on the merged slices. `plan_dir`: where
    a causal LM's tokenizer is (unless settings.tokenizer; exact match needs the exported model
    file to generate with: `confidant generate` or train-pipeline), and the model named in
    label-count errors."""
    task = task_named(task_of(full).task)
    try:
        run = task.read_data(plan_dir, data, eval_path, seq, tokenizer=settings.tokenizer, note=note)
    except TokenizerNotFound as exc:
        raise JobError(f"{exc} (pass --tokenizer with the exported model's folder)") from None
    check_graph(task, plan_dir, full, run, eval_path)
    made = task_run(task, full, run, rows * M, M, settings.seed, weights_evaluation(task, full, run, rows))
    if task.loss == "causal-lm":  # scored on the workers, which hold the trained weights (issue 32)
        return replace(made, evaluate_on_stages=lm_perplexity_on_stages(full, run, note))
    return made


def task_lookup_rows(task: PipelineTask, steps: int | None = None) -> dict[str, int]:
    """`planner.lookups.lookup_rows` of the batches of `steps` training steps (None: one pass over
    the data, every batch the task has)."""
    from planner.lookups import lookup_rows

    count = task.batches if steps is None else (min(steps, task.batches) if task.batches else steps)
    return lookup_rows(task.graph, (feed for k in range(count) for feed in task.feeds_of_step(k)))


def check_lookup_rows(plan, task: PipelineTask, steps: int, data: Path) -> None:
    """A FlagError (bad input, exit 2) when this run looks up more rows of a table than the data the
    plan was made for (`confidant plan --data`): the plan holds that table's AdamW state for that
    many rows only."""
    if not plan.lookup_rows:
        return
    here = task_lookup_rows(task, steps)
    for table, planned in sorted(plan.lookup_rows.items()):
        if here.get(table, 0) > planned:
            raise FlagError(f"{data} looks up {here[table]} rows of embedding table {table!r} in {steps} steps, but the "
                           f"plan was made for data that looks up {planned} (`confidant plan --data`), and its memory "
                           f"model holds that table's optimizer state for {planned} rows only: re-plan with --data "
                           f"{data}, or without --data to charge the table whole")


def check_target_positions(plan, task: PipelineTask, steps: int, data: Path) -> None:
    """A FlagError (bad input, exit 2) when a micro-batch of this run has more loss-target positions
    than the data the plan was made for (`confidant plan --data`): its LM head + loss stage is
    charged for that many only."""
    if plan.target_positions is None:
        return
    here = task_target_positions(task, steps)
    if here is not None and here > plan.target_positions:
        raise FlagError(f"{data} has {here} loss-target positions in a micro-batch in {steps} steps, but the plan was "
                       f"made for data with at most {plan.target_positions} (`confidant plan --data`), and its memory "
                       f"model charges the LM head + loss for that many only: re-plan with --data {data}, or "
                       f"without --data to charge every position")


# --- re-planning while training from a plan folder --------------------------------------------------

def _plan_over(replanner, address_of):
    """train_pipeline's plan_over from a plan folder: a new plan over the cluster's devices whose
    workers are candidates (PlanReplanner.without when stages are not among them: lost or moved
    off; with_devices when devices came back), written from the held state."""
    device_of = {a: d for d, a in address_of.items()}

    def plan_over(step, snapshot, stages, candidates) -> SurvivorPlan | None:
        gone = [device_of.get(a, a) for a in stages if a not in set(candidates)]
        keep = [device_of[a] for a in candidates if a in device_of]
        if gone:
            plan = replanner.without(step, gone, snapshot.state.weights, keep=keep)
        else:
            plan = replanner.with_devices(step, keep, snapshot.state.weights)
        if plan is None:
            return None
        return SurvivorPlan([tuple(r) for r in plan.ranges], [address_of[d] for d in plan.devices],
                            list(plan.bundles), list(plan.devices), plan.schedule, plan.directory, plan.loaded)

    return plan_over


def _plan_graph(plan: PlanDocument, contents):
    """The whole model from the plan's bundles, with the lookups and target positions of the data it
    was planned for (so that a re-plan charges the tables' optimizer state and the LM head + loss as
    the first plan did)."""
    return replace(merge_slices([c.graph for c in contents]), lookup_rows=dict(plan.lookup_rows),
                   target_positions=plan.target_positions)


def _failure_replanner(settings: PlanRunSettings, plan_dir: Path, plan: PlanDocument, contents, sign):
    """Without --replan-every: a re-planner used only when a device is lost (None when the plan has
    no cluster.json to re-plan with, or --on-failure stop)."""
    if settings.on_failure != "replan":
        return None
    try:
        cluster = load_cluster(settings.cluster) if settings.cluster is not None else load_plan_cluster(plan_dir)
        graph = _plan_graph(plan, contents)
        return PlanReplanner(plan_dir, plan, graph, _as_planned(cluster, settings, plan_dir, plan, graph),
                             settings.replan_threshold, sign=sign)
    except (BundleError, ValueError):
        return None


def _as_planned(cluster: Cluster, settings: PlanRunSettings, plan_dir: Path, plan: PlanDocument, graph) -> Cluster:
    """`cluster` with its devices marked as `plan` marked them (`jobs.common.lora.with_base_mapped`), so a re-plan
    charges a stage what `plan` charges it over the same devices: a PyTorch device reads a float32 LoRA base mapped
    where its worker holds the plan's base file (a local worker is given it unless `PlanRunSettings.local_base` is
    off; a remote one is started with `confidant worker --base`, as `plan` assumes). Without, a re-plan after a
    device left charged each stage its whole base, and found no plan where only the mapped charge fits."""
    held = plan_base(plan_dir, plan) is not None and (settings.local_base or not settings.local)
    float32 = not any(isinstance(v, QuantizedTensor) for v in graph.constants.values())
    return with_base_mapped(cluster, plan.lora is not None and held and float32)


def _plan_replanner(settings: PlanRunSettings, plan_dir: Path, plan: PlanDocument, contents, sign=None):
    """The re-planner of `confidant train --replan-every`, or None without it; a JobError for what
    cannot be re-planned, before any worker starts."""
    every = settings.replan_every
    if every is None:
        return None
    if every < 1 or plan.schedule not in FLUSH_SCHEDULES:
        raise JobError(f"--replan-every needs a whole number of steps >= 1 and a flush schedule (1f1b-flush or "
                       f"gpipe), got {every} with {plan_dir}'s {plan.schedule}; for 1f1b-stash there is no step "
                       f"boundary to switch plans at (plan again with `confidant plan --schedule 1f1b-flush`)")
    if not settings.replan_threshold >= 0:
        raise JobError(f"--replan-threshold must be a number >= 0 (0.1: 10% faster), got {settings.replan_threshold}")
    if settings.cluster is not None:
        cluster = load_cluster(settings.cluster)
    else:
        try:
            cluster = load_plan_cluster(plan_dir)
        except BundleError as exc:
            raise JobError(f"{exc} (`confidant train --cluster FILE`)") from None
    shapes = {(d.profile.batch, d.profile.seq) for d in cluster.devices}
    if shapes != {(plan.batch, plan.seq)}:
        raise JobError(f"the cluster's profiles were measured at (micro-batch rows, seq) {sorted(shapes)}, the "
                       f"plan {plan_dir} runs ({plan.batch}, {plan.seq}); give a cluster profiled at the "
                       f"plan's shape")
    try:
        graph = _plan_graph(plan, contents)
        return PlanReplanner(plan_dir, plan, graph, _as_planned(cluster, settings, plan_dir, plan, graph),
                             settings.replan_threshold, sign=sign)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def _spare_devices(replanner, names) -> dict[str, str]:
    """Cluster devices the plan leaves out, by name, with their addresses: a re-plan may use them."""
    if replanner is None:
        return {}
    return {d.name: d.address for d in replanner.cluster.devices if d.name not in names}


def _stages_text(devices, ranges) -> str:
    return " | ".join(f"{d} {a}-{b}" for d, (a, b) in zip(devices, ranges))


def _report_replan(reporter: Reporter, replanner, step: int, reconf) -> None:
    """One line per re-plan: what ran where before and after, what moved, what was predicted."""
    applied = replanner.applied[-1]
    d = applied.decision
    reporter.note(f"re-plan after step {step}: {_stages_text(applied.old_devices, applied.old_ranges)} -> "
                  f"{_stages_text(applied.devices, applied.ranges)}; moved {reconf.moved_bytes / 2**20:.2f} MiB; "
                  f"predicted gain {d.gain:.1%} ({d.predicted_old_s:.4g} s -> {d.predicted_new_s:.4g} s per step); "
                  f"new plan {applied.directory}")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _replan_figures(replanner, result: PipelineResult) -> dict:
    """Every re-plan applied (with what moved) and every check's reason, for the metrics document."""
    applied = []
    for plan, (step, reconf) in zip(replanner.applied, result.replans):
        d = plan.decision
        applied.append({
            "step": step, "plan": str(plan.directory),
            "old": [{"device": n, "blocks": list(r)} for n, r in zip(plan.old_devices, plan.old_ranges)],
            "new": [{"device": n, "blocks": list(r)} for n, r in zip(plan.devices, plan.ranges)],
            "moved_bytes": reconf.moved_bytes, "sent_bytes": reconf.sent_bytes, "seconds": reconf.seconds,
            "predicted_old_step_s": _finite(d.predicted_old_s), "predicted_new_step_s": d.predicted_new_s,
            "predicted_gain": _finite(d.gain), "forced": d.forced})
    checks = [{"step": step, "replanned": d.new_partition is not None, "reason": d.reason}
              for step, d in replanner.decisions]
    return {"replans": tuple(applied), "replan_checks": tuple(checks)}


def _device_figures(result: PipelineResult, names, replanner) -> tuple[DeviceFigures, ...]:
    """Each device of the final plan with its blocks and peak RSS over every step it ran."""
    final = result.devices or names
    return tuple(DeviceFigures(n, k, a, b, result.peak_rss_bytes.get(addr))
                 for k, (n, addr, (a, b)) in enumerate(zip(final, result.addresses, result.ranges)))


def state_place(devices) -> tuple[str, str | None]:
    """Where the fault policy keeps its snapshots for a plan's devices (`ir.documents.DevicePlan`,
    in stage order): on the workers ("peers", the coordinator then holds none) when every device's
    budget has room for the copies beside what the plan charges it
    (`runtime.pipeline.snapshots.peer_snapshot_bytes`), else on the coordinator, with the line that
    says why (a plan's memory is a promise: the copies must not take a device over its budget)."""
    terms = [d.memory_terms or {} for d in devices]
    state = [t.get("trainable", d.trainable_bytes or 0) + t.get("optimizer state", 0) for t, d in zip(terms, devices)]
    extra = peer_snapshot_bytes(state)
    over = [(d, e) for d, e in zip(devices, extra) if d.memory_bytes + e > d.memory_budget_bytes]
    if not over:
        return "peers", None
    d, e = max(over, key=lambda de: de[0].memory_bytes + de[1] - de[0].memory_budget_bytes)
    return "coordinator", (f"fault policy: the snapshots are kept on the coordinator; on the workers their copies "
                           f"({e / 2**20:.0f} MiB on {d.name}) would take {d.name} to "
                           f"{(d.memory_bytes + e) / 2**20:.0f} MiB, over its {d.memory_budget_bytes / 2**20:.0f} MiB "
                           f"budget")

