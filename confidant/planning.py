"""`confidant plan`, `show` and `train plan/`: compile a plan once per model and device set, ship
one bundle per device, train. Side effects (files, processes) live here; the decisions are made by
the pure planner functions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from confidant.cli import CliError


def _threads_of(backend: str | None) -> int:
    """'mnn:cpu:t2' -> 2; backends without a thread setting run 1 thread."""
    if backend:
        for part in backend.split(":"):
            if part.startswith("t") and part[1:].isdigit():
                return int(part[1:])
    return 1


def _engine_of(backend: str) -> str:
    return backend.split(":")[0]


def plan_head_split(graph, profile):
    """The head split to record for one device, or None: a `planner.heads.HeadSplit` across backends
    of `profile` (an `ir.profile.DeviceProfile`) for the attention of the first encoder block whose
    signature has curves on at least two of them.

    Candidates. The device is not the planning machine, so its core count is not known here; its
    profile is what we have. Backends of one split run concurrently and must not share cores, so a
    candidate set takes one backend per engine (mnn, torch, ...) for two or more engines, with
    thread counts summing to at most the largest thread count profiled on that device (a device
    profiled at tN has at least N cores to give); e.g. on a two-core device profiled at t1 and t2,
    mnn:cpu:t1 + torch:cpu:t1. Every candidate set is allocated (`allocate_heads`), and the set with
    the fastest prediction wins; when no set fits, no split.

    Fixed costs. Each candidate set is allocated with the profile's measured `split_extra_cost_s`
    for this block signature (`runtime.profiling.compute`) on the backends the split engine runs in child
    processes (`planner.heads.split_child_processes`: all but the in-process one, a torch backend
    if the set has one); the in-process backend pays none. A backend without a measured figure (a
    profile made before it was measured) is charged 0, as before: optimistic.

    The split is recorded only if it uses >= 2 backends and its prediction is below the H-head time
    of EVERY backend profiled with a curve for this signature, whatever its thread count: a single
    backend using all the cores (torch:cpu:t2) may beat two one-core backends split. The returned
    split's `single_best` is that fastest single backend. Any schedule: the split engine stashes
    weight versions like the MNN engine."""
    import dataclasses
    import itertools

    from ir.graph import block_signature
    from planner.heads import allocate_heads, split_child_processes

    for block in graph.blocks:
        if block.kind != "encoder":
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
            by_engine.setdefault(_engine_of(name), []).append(name)
        cores = max(_threads_of(b.backend) for b in profile.backends)
        measured = profile.split_extra_cost_s.get(sig, {})
        best = None
        for n in range(2, len(by_engine) + 1):
            for engines in itertools.combinations(by_engine, n):
                for names in itertools.product(*(by_engine[e] for e in engines)):
                    if sum(_threads_of(b) for b in names) > cores:
                        continue
                    # charged as if all of the set got heads; a split that leaves out the in-process
                    # backend is overcharged here, and tried correctly as its own smaller set
                    extra = {b: float(measured.get(b, 0.0)) for b in split_child_processes({b: 1 for b in names})}
                    split = allocate_heads({b: curves[b] for b in names}, extra)
                    if len(split.heads) >= 2 and (best is None or split.predicted_s < best.predicted_s):
                        best = split
        if best is None or not best.predicted_s < single_s:
            return None
        return dataclasses.replace(best, single_best=(single, single_s))
    return None


def _split_extra_cost(graph, profile, split) -> dict[str, float]:
    """The measured fixed cost of each child backend of `split`, as plan_head_split allocated it
    (the first encoder block with measured costs; 0 where none was measured)."""
    from ir.graph import block_signature
    from planner.heads import split_child_processes

    for block in graph.blocks:
        measured = profile.split_extra_cost_s.get(block_signature(block)) if block.kind == "encoder" else None
        if measured:
            return {b: float(measured.get(b, 0.0)) for b in split_child_processes(split)}
    return {}


def _mnn_base(profile, chosen: str | None) -> str | None:
    """The MNN backend a head-split device runs its non-attention work on (None: it has none)."""
    if chosen is not None and chosen.startswith("mnn:"):
        return chosen
    mnn = [b for b in profile.backends if b.backend.startswith("mnn:")]
    if not mnn:
        return None
    return min(mnn, key=lambda b: sum(c.forward_s + c.backward_s for c in b.blocks.values())).backend


def cmd_plan(args) -> int:
    import dataclasses

    from planner.cluster import load_cluster
    from planner.cost import predicted_step_s, stage_costs
    from planner.emit import emit_plan
    from planner.heads import profile_with_head_split
    from planner.onnx_import import load_model
    from planner.partition import PlanDoesNotFit, check_feasible, make_instance, manual_partition, solve_partition
    from planner.schedule import make_schedule

    M = args.microbatches
    if M < 1 or args.batch % M:
        raise CliError(f"--batch {args.batch} must be a multiple of --microbatches {M}")
    cluster = load_cluster(args.cluster)
    graph = load_model(args.model, args.batch // M, args.seq)
    profiled = {(d.profile.batch, d.profile.seq) for d in cluster.devices}
    if profiled != {(graph.batch, graph.seq)}:
        raise CliError(f"the profiles were measured at (micro-batch rows, seq) {sorted(profiled)} but this plan uses "
                       f"({graph.batch}, {graph.seq}) = --batch {args.batch} / --microbatches {M}, --seq {args.seq}; "
                       f"re-profile with `confidant profile --batch {graph.batch} --seq {graph.seq}`")
    # Head splits come first: a device whose attention heads run split is faster, and the partition
    # and the predicted times must see that speed, so the cluster's profiles are lowered by it.
    # The split engine runs everything but the attention on MNN, so a split device is costed (and
    # run) on its MNN backend: the chosen one when it is MNN, else the fastest MNN one; a device
    # profiled without MNN is not split.
    splits, devices = {}, []
    for d in cluster.devices:
        split = plan_head_split(graph, d.profile)
        base = _mnn_base(d.profile, d.backend)
        if split is not None and base is not None:
            splits[d.name] = split
            d = dataclasses.replace(d, backend=base, profile=profile_with_head_split(
                d.profile, base, split, _split_extra_cost(graph, d.profile, split)))
        devices.append(d)
    cluster = dataclasses.replace(cluster, devices=tuple(devices))
    instance = make_instance(graph, cluster, args.schedule, M, args.optimizer)
    print(f"planning {len(graph.blocks)} blocks over {len(cluster.devices)} devices ({args.schedule}, {M} micro-batches)",
          file=sys.stderr)
    try:
        if args.cuts:
            devices = args.devices.split(",") if args.devices else [d.name for d in cluster.devices]
            cuts = [int(c) for c in args.cuts.split(",")]
            partition = manual_partition(instance, devices[:len(cuts) + 1], cuts)
            problems = check_feasible(partition, instance)
            if problems:
                raise CliError("the manual cuts do not fit: " + "; ".join(problems))
        else:
            partition = solve_partition(instance, time_limit_s=args.time_limit)
    except PlanDoesNotFit as exc:
        raise CliError(str(exc)) from None
    costs = stage_costs(graph, cluster, partition, args.schedule, M, args.optimizer)
    schedule = make_schedule(args.schedule, len(partition.stages), M, update_every=args.update_every)
    step_s = predicted_step_s(costs, args.schedule, M)
    specs = {d.name: d for d in cluster.devices}
    backends = {d.name: d.profile.backend(d.backend).backend for d in cluster.devices}
    config = {
        # each device runs the engine of its fastest (or chosen) backend: frameworks may differ
        "model": Path(args.model).name, "engine": {n: backends[n].split(":")[0] for n in partition.devices},
        "threads": {n: _threads_of(backends[n]) for n in partition.devices},
        "optimizer": {"name": args.optimizer, "lr": args.lr, "weight_decay": None},
        "addresses": {n: specs[n].address for n in partition.devices},
    }
    head_split = {}
    for n in partition.devices:
        split = splits.get(n)
        if split is not None:
            head_split[n] = {"heads": dict(split.heads), "predicted_s": split.predicted_s,
                             "single_best": [split.single_best[0], split.single_best[1]]}
            # the split engine runs the rest of the stage on MNN, whatever backend the device chose
            config["engine"][n] = "mnn"
    config["head_split"] = head_split
    path = emit_plan(args.output, graph, partition, schedule, config, costs, step_s, cluster=cluster)
    print(f"wrote {path} and {len(partition.stages)} bundles", file=sys.stderr)
    return cmd_show(type("A", (), {"plan": args.output})())


def _heads_cell(split) -> str:
    """'mnn:cpu:t1 1 + torch:cpu:t1 3 (pred 41 ms vs 58 ms single)', or '-' without a split."""
    if not split:
        return "-"
    text = " + ".join(f"{b} {h}" for b, h in split["heads"].items())
    best = split.get("single_best")
    if split.get("predicted_s") is not None and best:
        text += f" (pred {split['predicted_s'] * 1000:.0f} ms vs {best[1] * 1000:.0f} ms single)"
    return text


def cmd_show(args) -> int:
    from ir.bundle import load_plan

    plan = load_plan(args.plan)
    rows = [("stage", "device", "address", "blocks", "memory / budget", "time/micro-batch", "engine", "threads", "heads")]
    for d in plan["devices"]:
        rows.append((str(d["stage"]), d["name"], d.get("address") or "-", f"{d['blocks'][0]}-{d['blocks'][1]}",
                     f"{d['memory_bytes'] / 2**20:.0f} / {d['memory_budget_bytes'] / 2**20:.0f} MiB",
                     f"{d['predicted_time_s'] * 1000:.0f} ms", d.get("engine", plan["engine"]),
                     str(d.get("threads", 1)), _heads_cell(d.get("head_split"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"plan {args.plan}: model {plan['model']}, schedule {plan['schedule']}, {plan['microbatches']} micro-batches "
          f"of {plan['batch']} x {plan['seq']}, partition {plan['partition_method']}"
          f"{' (optimal)' if plan.get('partition_optimal') else ''}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"predicted step: {plan['predicted_step_s']:.3f} s "
          f"({plan['batch'] * plan['microbatches'] / plan['predicted_step_s']:.1f} samples/s)")
    print("schedule (one row per stage):")
    for stage_actions in plan["actions"]:
        compute = [a for a in stage_actions if ".F." in a or ".B." in a or ".UPDATE" in a]
        print("  " + " ".join(a.split(".", 1)[1] for a in compute))
    return 0


def cmd_train_plan(args) -> int:
    from confidant.commands import _busy_fraction, _load_training_data
    from jobs.pipeline_training import LocalWorkers, train_pipeline
    from confidant.progress import Progress
    from ir.bundle import load_bundle_dir, load_plan
    from ir.serialize import merge_slices
    from runtime.pipeline.coordinator import PipelineConfig, WorkerFailed
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec
    from tasks.tokenize import make_batches
    from tasks.trainer import TrainConfig, evaluate

    plan_dir = Path(args.plan)
    plan = load_plan(plan_dir, verify_bundles=True)
    names = [d["name"] for d in plan["devices"]]
    bundles = [plan_dir / d["bundle"] for d in plan["devices"]]
    contents = [load_bundle_dir(b) for b in bundles]
    replanner = _plan_replanner(args, plan_dir, plan, contents)  # None without --replan-every
    spares = _spare_devices(replanner, names)
    M, rows, seq = int(plan["microbatches"]), int(plan["batch"]), int(plan["seq"])
    labels, _, dev_sents, train_enc, dev_enc = _load_training_data(args, seq)
    batches = make_batches(train_enc, rows * M, seq, seed=args.seed)
    local = None
    if args.local:
        threads = max(int(d.get("threads", 1)) for d in plan["devices"])
        local = LocalWorkers.start(len(names) + len(spares), threads)
        addresses = local.addresses[:len(names)]
        spares = dict(zip(spares, local.addresses[len(names):]))
    else:
        addresses = [d.get("address") for d in plan["devices"]]
        if not all(addresses):
            raise CliError(f"{plan_dir}/plan.json lacks worker addresses; pass --local or re-plan with addresses")
    config = PipelineConfig(schedule=plan["schedule"], microbatches=M, timeout_s=args.timeout)
    bar = Progress(args.steps, f"train {plan_dir.name} ({len(names)} devices, {plan['schedule']})")

    def on_step(step, loss, seconds, stage_seconds, done):
        busy = "/".join(f"{_busy_fraction(d):.0%}" for d in done)
        bar.update(step, loss=loss, **{"samples/s": rows * M / seconds, "busy": busy})

    try:
        result = train_pipeline(None, batches, len(labels), addresses, config, args.steps, listen=args.listen,
                                on_step=on_step, bundles=bundles, devices=names, stage_graphs=contents,
                                checkpoint_dir=args.checkpoint, meta={"plan": str(plan_dir)},
                                replan_every=getattr(args, "replan_every", None), on_replan=replanner,
                                spare_devices=spares,
                                on_replanned=lambda step, reconf: _report_replan(replanner, step, reconf))
    except WorkerFailed as exc:
        raise CliError(str(exc)) from None
    finally:
        if local:
            local.wait(30.0)
    measured = sum(result.step_seconds) / len(result.step_seconds)
    figures = {"command": "train", "plan": str(plan_dir), "predicted_step_s": plan["predicted_step_s"],
               "measured_step_s": measured, "losses": result.losses,
               "devices": _device_figures(result, names, replanner)}
    if replanner is not None:
        figures.update(_replan_figures(replanner, result))
    print(f"step time: predicted {plan['predicted_step_s']:.3f} s, measured {measured:.3f} s", file=sys.stderr)
    if dev_sents:
        full = merge_slices([c.graph for c in contents])
        engine = MnnStageEngine(stage_spec(full, 0, len(full.blocks) - 1), weights={**full.constants, **result.weights},
                                cache_activations=False)
        scores = evaluate(engine, dev_enc, [s.tags for s in dev_sents], labels, TrainConfig(batch=rows, seq=seq),
                          len(full.blocks) - 2)
        figures["f1"] = scores.f1
        print(f"entity F1 after training: {scores.f1:.4f}", file=sys.stderr)
    if args.metrics_out:
        args.metrics_out.write_text(json.dumps(figures, indent=1))
    return 0


def cmd_profile(args) -> int:
    import dataclasses
    import socket

    from runtime.profiling import compute as prof

    if args.serve_link:
        prof.link_probe_server(args.listen, sessions=None,
                               ready=lambda addr: print(f"listening {addr}", flush=True))
        return 0
    if args.link:
        link = prof.measure_link(args.link)
        doc = {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}
        print(f"link to {args.link}: {link.bandwidth_bytes_per_s * 8 / 1e6:.1f} Mbit/s, "
              f"latency {link.latency_s * 1000:.2f} ms")
        if args.output:
            args.output.write_text(json.dumps(doc, indent=1))
        return 0
    if args.model is None:
        raise CliError("give --model (to profile compute) or --link ADDRESS (to profile a link)")
    from planner.cluster import parse_bytes
    from planner.onnx_import import load_model

    graph = load_model(args.model, args.batch, args.seq)
    name = args.name or socket.gethostname()
    backends = tuple(args.backends.split(",")) if args.backends else prof.DEFAULT_BACKENDS
    memory = parse_bytes(args.memory) if args.memory else None
    profile = prof.profile_device(graph, name, backends=backends, reps=args.reps, memory_bytes=memory,
                                  attention=not args.no_attention,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    profile = dataclasses.replace(profile, model=Path(args.model).name)
    output = args.output or Path(f"{name}.profile.json")
    profile.save(output)
    print(f"wrote {output}: backends {', '.join(b.backend for b in profile.backends)}; "
          f"fastest {profile.backend().backend}")
    return 0


def cmd_simulate(args) -> int:
    from ir.bundle import load_plan
    from ir.partition import StageCost
    from ir.plan import Schedule
    from planner.simulate import simulate, write_chrome_trace

    plan = load_plan(args.plan)
    costs = []
    for d in plan["devices"]:
        if "cost" not in d:
            raise CliError(f"{args.plan}/plan.json has no cost model for device {d['name']!r}; re-run `confidant plan`")
        costs.append(StageCost(stage=d["stage"], device=d["name"], memory_bytes=d["memory_bytes"],
                               memory_budget_bytes=d["memory_budget_bytes"], **d["cost"]))
    schedule = Schedule.from_json({"schema_version": plan["schema_version"], "name": plan["schedule"],
                                   "stages": plan["stages"], "microbatches": plan["microbatches"],
                                   "actions": plan["actions"], "stash_depth": plan["stash_depth"],
                                   "update_every": plan["update_every"]})
    sim = simulate(schedule, costs, steps=args.steps)
    write_chrome_trace(sim, args.output)
    print(f"simulated {args.steps} step(s): {sim.step_s:.3f} s per step, "
          f"{sim.throughput_samples_per_s(plan['batch']):.1f} samples/s, bubble {sim.bubble_fraction:.1%}; "
          f"peak memory " + ", ".join(f"{d['name']} {m / 2**20:.0f} MiB" for d, m in zip(plan["devices"],
                                                                                      sim.peak_memory_bytes)))
    print(f"wrote {args.output} (open in Perfetto / chrome://tracing)")
    return 0


# --- re-planning while training from a plan folder (cmd_train_plan) -------------------------------

def _plan_replanner(args, plan_dir: Path, plan: dict, contents):
    """The re-planner of `confidant train --replan-every`, or None without it; a CliError for what
    cannot be re-planned, before any worker starts."""
    every = getattr(args, "replan_every", None)
    cluster_file = getattr(args, "cluster", None)
    if every is None:
        if cluster_file is not None:
            raise CliError("--cluster is the cluster to re-plan with: give it with --replan-every N")
        return None
    if every < 1 or plan["schedule"] not in ("1f1b-flush", "gpipe"):
        raise CliError(f"--replan-every needs a whole number of steps >= 1 and a flush schedule (1f1b-flush or "
                       f"gpipe), got {every} with {plan_dir}'s {plan['schedule']}; for 1f1b-stash there is no step "
                       f"boundary to switch plans at (plan again with `confidant plan --schedule 1f1b-flush`)")
    threshold = getattr(args, "replan_threshold", 0.1)
    if not threshold >= 0:
        raise CliError(f"--replan-threshold must be a number >= 0 (0.1: 10% faster), got {threshold}")
    from ir.bundle import BundleError
    from ir.serialize import merge_slices
    from planner.cluster import load_cluster
    from planner.emit import load_plan_cluster
    from planner.replan import PlanReplanner

    if cluster_file is not None:
        cluster = load_cluster(cluster_file)
    else:
        try:
            cluster = load_plan_cluster(plan_dir)
        except BundleError as exc:
            raise CliError(f"{exc} (`confidant train --cluster FILE`)") from None
    shapes = {(d.profile.batch, d.profile.seq) for d in cluster.devices}
    if shapes != {(int(plan["batch"]), int(plan["seq"]))}:
        raise CliError(f"the cluster's profiles were measured at (micro-batch rows, seq) {sorted(shapes)}, the "
                       f"plan {plan_dir} runs ({plan['batch']}, {plan['seq']}); give a cluster profiled at the "
                       f"plan's shape")
    try:
        return PlanReplanner(plan_dir, plan, merge_slices([c.graph for c in contents]), cluster, threshold)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _spare_devices(replanner, names) -> dict[str, str]:
    """Cluster devices the plan leaves out, by name, with their addresses: a re-plan may use them."""
    if replanner is None:
        return {}
    return {d.name: d.address for d in replanner.cluster.devices if d.name not in names}


def _stages_text(devices, ranges) -> str:
    return " | ".join(f"{d} {a}-{b}" for d, (a, b) in zip(devices, ranges))


def _report_replan(replanner, step: int, reconf) -> None:
    """One line per re-plan on stderr: what ran where before and after, what moved, what was predicted."""
    applied = replanner.applied[-1]
    d = applied.decision
    print(f"re-plan after step {step}: {_stages_text(applied.old_devices, applied.old_ranges)} -> "
          f"{_stages_text(applied.devices, applied.ranges)}; moved {reconf.moved_bytes / 2**20:.2f} MiB; predicted "
          f"gain {d.gain:.1%} ({d.predicted_old_s:.4g} s -> {d.predicted_new_s:.4g} s per step); new plan "
          f"{applied.directory}", file=sys.stderr, flush=True)


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _replan_figures(replanner, result) -> dict:
    """--metrics-out: every re-plan applied (with what moved) and every check's reason."""
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
    return {"replans": applied, "replan_checks": checks}


def _device_figures(result, names, replanner) -> list[dict]:
    """Each device of the final plan with its blocks and peak RSS over every step it ran."""
    switches = {p.step: p.devices for p in (replanner.applied if replanner is not None else [])}
    devices, peak = list(names), {}
    for i, reports in enumerate(result.stage_reports):  # one per step (flush schedules), plans switch between
        for name, rep in zip(devices, reports):
            peak[name] = max(peak.get(name, 0), rep["peak_rss_bytes"])
        devices = switches.get(i + 1, devices)
    final = result.devices or names
    return [{"name": n, "blocks": list(r), "peak_rss_bytes": peak.get(n)} for n, r in zip(final, result.ranges)]
