"""The `confidant` subcommands: each turns its flags into a job's settings, calls the job (`jobs/`) and
prints what it returns. Nothing here decides anything the planner or the runtime decides."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from confidant.errors import CliError
from confidant.progress import TerminalReporter


def _lora_settings(args):
    """The LoRA settings of `--lora R ...`, or None (full fine-tuning) without it."""
    if getattr(args, "lora", None) is None:
        return None
    from planner.lora import LoraSettings

    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    also = tuple(t.strip() for t in args.train_also.split(",") if t.strip() and t.strip() != "none")
    try:
        return LoraSettings(args.lora, args.lora_alpha, targets, also, seed=getattr(args, "seed", 0))
    except ValueError as exc:
        raise CliError(f"--lora: {exc}") from None


def _training_settings(args):
    from jobs.settings import TrainingSettings

    return TrainingSettings(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, optimizer=args.optimizer,
                            seed=args.seed, threads=args.threads, engine=args.engine, tokenizer=args.tokenizer,
                            lora=_lora_settings(args))


def _write_metrics(metrics, path: Path | None) -> None:
    if path is not None:
        metrics.write(path)


def _cuts(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise CliError(f"--cuts {text!r} is not a comma-separated list of block indices, e.g. 3 or 2,5") from None


# --- models and data -------------------------------------------------------------------------------

def cmd_export(args) -> int:
    try:
        from jobs.export import ExportOptions, default_checkpoint_dir, export_checkpoint
    except ModuleNotFoundError as exc:
        raise CliError(f"export needs the `export` extra ({exc.name} is missing): "
                       "pip install 'confidant[export]' torch==2.13.0") from None
    if not 14 <= args.opset <= 18:
        raise CliError(f"--opset {args.opset} is outside the supported 14-18")
    checkpoint = args.checkpoint or default_checkpoint_dir()
    print(f"exporting {checkpoint} -> {args.output} (opset {args.opset}, "
          f"{'dynamo' if args.dynamo else 'torchscript'} exporter, {args.num_labels} labels)", file=sys.stderr)
    options = ExportOptions(num_labels=args.num_labels, opset=args.opset, dynamo=args.dynamo, seed=args.seed)
    export_checkpoint(checkpoint, args.output, options)
    print(args.output)
    return 0


def _inspect_json(graph) -> dict:
    blocks = [{"name": b.name, "kind": b.kind, "params_bytes": b.params_bytes,
               "activation_bytes": b.activation_bytes, "flops": b.flops, "heads": b.heads,
               "head_size": b.head_size} for b in graph.blocks]
    totals = {"blocks": len(blocks), "params_bytes": sum(b["params_bytes"] for b in blocks),
              "activation_bytes": sum(b["activation_bytes"] for b in blocks),
              "flops": sum(b["flops"] for b in blocks), "batch": graph.batch, "seq": graph.seq}
    return {"blocks": blocks, "totals": totals}


def cmd_inspect(args) -> int:
    from ir.graph import format_table
    from planner.onnx_import import load_model

    graph = load_model(args.model, args.batch, args.seq)
    if args.json:
        print(json.dumps(_inspect_json(graph), indent=1))
    else:
        print(f"{args.model}: {len(graph.blocks)} blocks at batch {args.batch}, sequence {args.seq}")
        print(format_table(graph))
    return 0


def cmd_datagen(args) -> int:
    from tasks.datagen import write_splits

    train, dev = write_splits(args.output, n_train=args.train, n_dev=args.dev, seed=args.seed)
    print(f"wrote {train} ({args.train} sentences) and {dev} ({args.dev} sentences)")
    return 0


# --- training --------------------------------------------------------------------------------------

def cmd_train_local(args) -> int:
    from jobs.local_training import train_local

    metrics = train_local(args.model, args.data, args.eval, _training_settings(args), TerminalReporter())
    _write_metrics(metrics, args.metrics_out)
    return 0


def cmd_train_pipeline(args) -> int:
    from jobs.pipeline_training import train_pipeline_job
    from jobs.settings import PipelineSettings

    workers = [a.strip() for a in args.workers.split(",")] if args.workers else None
    pipeline = PipelineSettings(schedule=args.schedule, microbatches=args.microbatches,
                                update_every=args.update_every, cuts=_cuts(args.cuts), checkpoint=args.checkpoint,
                                resume=args.resume, replan_every=args.replan_every,
                                replan_threshold=args.replan_threshold, listen=args.listen, timeout_s=args.timeout)
    metrics = train_pipeline_job(args.model, args.data, args.eval, _training_settings(args), pipeline,
                                 workers=workers, local=args.local, reporter=TerminalReporter())
    _write_metrics(metrics, args.metrics_out)
    return 0


def cmd_train(args) -> int:
    from jobs.plan_training import PlanRunSettings, train_from_plan

    settings = PlanRunSettings(steps=args.steps, seed=args.seed, tokenizer=args.tokenizer, local=args.local,
                               checkpoint=args.checkpoint, replan_every=args.replan_every,
                               replan_threshold=args.replan_threshold, cluster=args.cluster, listen=args.listen,
                               timeout_s=args.timeout)
    metrics = train_from_plan(args.plan, args.data, args.eval, settings, TerminalReporter())
    _write_metrics(metrics, args.metrics_out)
    return 0


def cmd_worker(args) -> int:
    from runtime.pipeline.worker import serve

    return serve(args.listen, timeout=args.timeout)


def cmd_demo(args) -> int:
    from confidant.home import DEMO_DIR
    from jobs.demo import demo_table, run_demo

    result = run_demo(DEMO_DIR, _training_settings(args), TerminalReporter())
    rows = demo_table(result)
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    return 0


# --- devices and plans -----------------------------------------------------------------------------

def cmd_backends(args) -> int:
    from ir.backend import DEVICES
    from runtime.profiling.backends import discover

    found = discover()
    present = {f"{engine}:{device}": any(b.engine == engine and b.device == device for b in found)
               for engine, devices in DEVICES.items() for device in devices}
    if args.json:
        print(json.dumps(present))
    else:
        for name, here in present.items():
            print(f"{name:12s} {'present' if here else 'absent'}")
        print("backends: " + ", ".join(str(b) for b in found))
    return 0


def cmd_profile(args) -> int:
    from jobs.profiling import measure_link_to, profile_this_device, serve_link_probes

    if args.serve_link:
        serve_link_probes(args.listen, ready=lambda addr: print(f"listening {addr}", flush=True))
        return 0
    if args.link:
        link = measure_link_to(args.link, args.output)
        print(f"link to {args.link}: {link.bandwidth_bytes_per_s * 8 / 1e6:.1f} Mbit/s, "
              f"latency {link.latency_s * 1000:.2f} ms")
        return 0
    if args.model is None:
        raise CliError("give --model (to profile compute) or --link ADDRESS (to profile a link)")
    from planner.cluster import parse_bytes

    profile, output = profile_this_device(
        args.model, args.batch, args.seq, args.output, name=args.name,
        backends=args.backends.split(",") if args.backends else None,
        memory_bytes=parse_bytes(args.memory) if args.memory else None, reps=args.reps,
        attention=not args.no_attention, lora=_lora_settings(args), reporter=TerminalReporter())
    print(f"wrote {output}: backends {', '.join(b.backend for b in profile.backends)}; "
          f"fastest {profile.backend().backend}")
    return 0


def cmd_plan(args) -> int:
    from jobs.planning import PlanSettings, plan_model

    settings = PlanSettings(schedule=args.schedule, batch=args.batch, seq=args.seq, microbatches=args.microbatches,
                            update_every=args.update_every, optimizer=args.optimizer, lr=args.lr,
                            cuts=_cuts(args.cuts), devices=tuple(args.devices.split(",")) if args.devices else None,
                            time_limit_s=args.time_limit, lora=_lora_settings(args))
    show_plan(plan_model(args.model, args.cluster, settings, args.output, TerminalReporter()))
    return 0


def cmd_show(args) -> int:
    show_plan(args.plan)
    return 0


def _heads_cell(split) -> str:
    """'mnn:cpu:t1 1 + torch:cpu:t1 3 (pred 41 ms vs 58 ms single)', or '-' without a split."""
    if split is None:
        return "-"
    text = " + ".join(f"{b} {h}" for b, h in split.heads.items())
    if split.predicted_s is not None and split.single_best:
        text += f" (pred {split.predicted_s * 1000:.0f} ms vs {split.single_best[1] * 1000:.0f} ms single)"
    return text


def show_plan(plan_dir: Path) -> None:
    """Print a plan: devices, blocks, memory against budget, predicted step, each stage's compute."""
    from ir.bundle import load_plan

    plan = load_plan(plan_dir)
    rows = [("stage", "device", "address", "blocks", "memory / budget", "trainable / frozen", "time/micro-batch",
             "engine", "threads", "heads")]
    for d in plan.devices:
        weights = "-" if d.trainable_bytes is None else \
            f"{d.trainable_bytes / 2**20:.1f} / {(d.frozen_bytes or 0) / 2**20:.1f} MiB"
        rows.append((str(d.stage), d.name, d.address or "-", f"{d.first_block}-{d.last_block}",
                     f"{d.memory_bytes / 2**20:.0f} / {d.memory_budget_bytes / 2**20:.0f} MiB", weights,
                     f"{d.predicted_time_s * 1000:.0f} ms", d.engine, str(d.threads), _heads_cell(d.head_split)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"plan {plan_dir}: model {plan.model}, schedule {plan.schedule}, {plan.microbatches} micro-batches "
          f"of {plan.batch} x {plan.seq}, partition {plan.partition_method}"
          f"{' (optimal)' if plan.partition_optimal else ''}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if plan.predicted_step_s:
        print(f"predicted step: {plan.predicted_step_s:.3f} s "
              f"({plan.batch * plan.microbatches / plan.predicted_step_s:.1f} samples/s)")
    print("schedule (one row per stage):")
    for stage in range(plan.stages):
        print("  " + " ".join(str(a).split(".", 1)[1] for a in plan.compute_actions(stage)))


def cmd_simulate(args) -> int:
    from jobs.planning import simulate_plan

    plan, sim = simulate_plan(args.plan, args.steps, args.output)
    print(f"simulated {args.steps} step(s): {sim.step_s:.3f} s per step, "
          f"{sim.throughput_samples_per_s(plan.batch):.1f} samples/s, bubble {sim.bubble_fraction:.1%}; "
          f"peak memory " + ", ".join(f"{d.name} {m / 2**20:.0f} MiB" for d, m in zip(plan.devices,
                                                                                   sim.peak_memory_bytes)))
    print(f"wrote {args.output} (open in Perfetto / chrome://tracing)")
    return 0


def cmd_export_adapter(args) -> int:
    from jobs.export_adapter import export_adapter_for

    try:
        out = export_adapter_for(args.checkpoint, args.output, args.base, args.num_labels, args.seed)
    except ModuleNotFoundError as exc:
        raise CliError(f"export-adapter needs the `export` extra ({exc.name} is missing): "
                       "pip install 'confidant[export]' torch==2.13.0") from None
    print(f"wrote {out}: load it with peft.PeftModel.from_pretrained(model, {str(out)!r})")
    return 0
