"""Implementations of the `confidant` subcommands (side effects live here, not in ir/planner/runtime)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from confidant.cli import DEMO_DIR, CliError
from confidant.progress import Progress


def cmd_export(args) -> int:
    try:
        from confidant.export import ExportOptions, default_checkpoint_dir, export_checkpoint
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


def _default_tokenizer() -> Path:
    from confidant.export import default_checkpoint_dir

    return default_checkpoint_dir() / "tokenizer.json"


def _make_engine(kind: str, spec, threads: int):
    from runtime.engines.base import make_engine

    try:
        return make_engine(kind, spec, threads)
    except ModuleNotFoundError:
        raise CliError(f"--engine {kind} needs PyTorch: pip install torch==2.13.0") from None


def _label_set(found, standard) -> tuple[str, ...]:
    """The CoNLL-2003 labels when the data stays inside them, else O plus B-/I- of every type seen."""
    if set(found) <= set(standard):
        return tuple(standard)
    types = sorted({t[2:] for t in found if t != "O"})
    return ("O",) + tuple(f"{p}-{t}" for t in types for p in ("B", "I"))


def run_local_training(model: Path, data: Path, eval_path: Path, args) -> dict:
    """Fine-tune on one device; returns the figures that --metrics-out writes."""
    from planner.onnx_import import load_model
    from tasks.conll import read_conll
    from runtime.engines.stage import stage_spec
    from tasks.tokenize import CONLL_LABELS, encode_sentences, label_list, load_tokenizer, make_batches
    from tasks.trainer import TrainConfig, evaluate, train_steps

    for flag, value in (("--steps", args.steps), ("--batch", args.batch), ("--threads", args.threads)):
        if value < 1:
            raise CliError(f"{flag} must be at least 1, got {value}")
    if args.seq < 4:
        raise CliError(f"--seq must be at least 4 tokens, got {args.seq}")
    config = TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                         optimizer=args.optimizer, seed=args.seed, threads=args.threads)
    train_sents = read_conll(data)
    dev_sents = read_conll(eval_path)
    labels = _label_set(label_list(train_sents + dev_sents), CONLL_LABELS)
    label_to_id = {t: i for i, t in enumerate(labels)}

    started = time.perf_counter()
    graph = load_model(model, config.batch, config.seq)
    num_labels = graph.values[graph.blocks[-2].output].shape[-1]
    if num_labels != len(labels):
        raise CliError(f"{model} predicts {num_labels} labels but the data has {len(labels)} ({', '.join(labels)}); "
                       f"re-export with `confidant export --num-labels {len(labels)}`")
    tokenizer = load_tokenizer(args.tokenizer or _default_tokenizer())
    train_enc = encode_sentences(tokenizer, train_sents, label_to_id, config.seq)
    dev_enc = encode_sentences(tokenizer, dev_sents, label_to_id, config.seq)
    batches = make_batches(train_enc, config.batch, config.seq, seed=config.seed)
    engine = _make_engine(args.engine, stage_spec(graph, 0, len(graph.blocks) - 1), config.threads)
    head = len(graph.blocks) - 2
    print(f"model {model.name}: {len(graph.blocks)} blocks, {graph.param_bytes() / 2**20:.1f} MiB parameters; "
          f"{len(train_sents)} training sentences, {len(dev_sents)} eval sentences; engine {args.engine}, "
          f"{config.threads} thread(s); setup {time.perf_counter() - started:.1f}s", file=sys.stderr)

    before = evaluate(engine, dev_enc, [s.tags for s in dev_sents], labels, config, head)
    print(f"entity F1 before fine-tuning: {before.f1:.4f}", file=sys.stderr)
    bar = Progress(config.steps, "train")
    result = train_steps(engine, batches, config, len(labels),
                         on_step=lambda r: bar.update(r.step, loss=r.loss, **{"tok/s": r.tokens_per_s}))
    after = evaluate(engine, dev_enc, [s.tags for s in dev_sents], labels, config, head)
    losses = [s.loss for s in result.steps]
    tail = losses[-max(1, len(losses) // 5):]
    head_losses = losses[: max(1, len(losses) // 5)]
    print(f"loss {sum(head_losses) / len(head_losses):.4f} (first steps) -> {sum(tail) / len(tail):.4f} (last steps); "
          f"entity F1 {before.f1:.4f} -> {after.f1:.4f} (P {after.precision:.3f}, R {after.recall:.3f}); "
          f"peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB; "
          f"{sum(s.tokens_per_s for s in result.steps) / len(result.steps):.0f} tokens/s", file=sys.stderr)
    figures = {
        "command": "train-local", "model": str(model), "engine": args.engine, "config": vars(config),
        **result.to_json(), "f1_before": before.f1, "f1": after.f1, "precision": after.precision,
        "recall": after.recall, "per_type_f1": {k: v.f1 for k, v in after.per_type.items()},
    }
    if args.metrics_out:
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_out.write_text(json.dumps(figures, indent=1))
    return figures


def cmd_train_local(args) -> int:
    run_local_training(args.model, args.data, args.eval, args)
    return 0


def _load_training_data(args, seq: int):
    from tasks.conll import read_conll
    from tasks.tokenize import CONLL_LABELS, encode_sentences, label_list, load_tokenizer

    train_sents = read_conll(args.data)
    dev_sents = read_conll(args.eval) if getattr(args, "eval", None) else []
    labels = _label_set(label_list(train_sents + dev_sents), CONLL_LABELS)
    label_to_id = {t: i for i, t in enumerate(labels)}
    tokenizer = load_tokenizer(args.tokenizer or _default_tokenizer())
    train_enc = encode_sentences(tokenizer, train_sents, label_to_id, seq)
    dev_enc = encode_sentences(tokenizer, dev_sents, label_to_id, seq) if dev_sents else []
    return labels, train_sents, dev_sents, train_enc, dev_enc


def run_pipeline_training(model: Path, args) -> dict:
    from jobs.pipeline_training import LocalWorkers, train_pipeline
    from planner.onnx_import import load_model
    from runtime.pipeline.coordinator import PipelineConfig, WorkerFailed, load_checkpoint
    from runtime.engines.stage import stage_spec
    from tasks.tokenize import make_batches
    from tasks.trainer import TrainConfig, evaluate

    M = args.microbatches
    if M < 1 or args.batch % M:
        raise CliError(f"--batch {args.batch} must be a multiple of --microbatches {M}")
    if args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    replan_every = getattr(args, "replan_every", None)
    if replan_every is not None and (replan_every < 1 or args.schedule == "1f1b-stash"):
        raise CliError(f"--replan-every needs a whole number of steps >= 1 and a flush schedule (1f1b-flush or "
                       f"gpipe), got {replan_every} with {args.schedule}")
    cuts = [int(c) for c in args.cuts.split(",")] if args.cuts else None
    addresses = [a.strip() for a in args.workers.split(",")] if args.workers else None
    n_stages = len(addresses) if addresses else args.local
    if n_stages < 1:
        raise CliError("need at least one worker")
    labels, _, dev_sents, train_enc, dev_enc = _load_training_data(args, args.seq)
    graph = load_model(model, args.batch // M, args.seq)
    num_labels = graph.values[graph.blocks[-2].output].shape[-1]
    if num_labels != len(labels):
        raise CliError(f"{model} predicts {num_labels} labels but the data has {len(labels)}; "
                       f"re-export with `confidant export --num-labels {len(labels)}`")
    batches = make_batches(train_enc, args.batch, args.seq, seed=args.seed)
    config = PipelineConfig(schedule=args.schedule, microbatches=M, engine=args.engine, threads=args.threads,
                            optimizer=args.optimizer, lr=args.lr, timeout_s=args.timeout)
    start_step, weights, opt_state = 0, None, None
    meta = {"model": model.name, "schedule": args.schedule, "microbatches": M, "batch": args.batch, "seq": args.seq,
            "optimizer": args.optimizer, "lr": args.lr, "seed": args.seed, "cuts": cuts}
    if args.resume:
        saved, weights, opt_state = load_checkpoint(args.resume)
        for key in ("model", "schedule", "microbatches", "batch", "seq", "optimizer", "seed"):
            if saved.get(key) != meta[key]:
                raise CliError(f"--resume {args.resume}: checkpoint has {key}={saved.get(key)!r}, this run {meta[key]!r}")
        if saved["stages"] != n_stages:
            raise CliError(f"--resume {args.resume}: checkpoint has {saved['stages']} stages, this run {n_stages}")
        cuts = [r[0] for r in saved["ranges"][1:]]
        start_step = int(saved["step"])
        print(f"resuming from {args.resume} at step {start_step}", file=sys.stderr)

    local = None
    if args.local:
        local = LocalWorkers.start(args.local, args.threads)
        addresses = local.addresses
    bar = Progress(args.steps, f"train ({n_stages} stages, {args.schedule}, {M} micro-batches)")

    def on_step(step, loss, seconds, stage_seconds, done):
        busy = "/".join(f"{_busy_fraction(d):.0%}" for d in done)
        bar.update(step - start_step, loss=loss, **{"samples/s": args.batch / seconds, "busy": busy})

    replanner = None
    if replan_every is not None:
        from jobs.pipeline_training import stage_ranges
        from planner.replan import TimingReplanner

        replanner = TimingReplanner(graph, stage_ranges(len(graph.blocks), n_stages, cuts), args.schedule, M,
                                    args.optimizer, args.replan_threshold)
    try:
        result = train_pipeline(graph, batches, len(labels), addresses, config, args.steps, cuts=cuts,
                                update_every=args.update_every, start_step=start_step, weights=weights,
                                optimizer_state=opt_state, listen=args.listen, on_step=on_step,
                                checkpoint_dir=args.checkpoint, meta=meta, replan_every=replan_every,
                                on_replan=replanner)
    except WorkerFailed as exc:
        raise CliError(str(exc)) from None
    finally:
        if local:
            codes = local.wait(30.0)
            if any(codes):
                print(f"local workers exited with codes {codes}", file=sys.stderr)
    stage_rss = [max(d["peak_rss_bytes"] for d in [rep[k] for rep in result.stage_reports])
                 for k in range(n_stages)]
    figures = {
        "command": "train-pipeline", "model": str(model), "schedule": args.schedule, "microbatches": M,
        "stages": [{"blocks": list(r), "peak_rss_bytes": rss} for r, rss in zip(result.ranges, stage_rss)],
        "steps": [{"step": start_step + i + 1, "loss": l, "seconds": sec, "samples_per_s": args.batch / sec,
                   "stage_busy": result.stage_busy[min(i, len(result.stage_busy) - 1)]}
                  for i, (l, sec) in enumerate(zip(result.losses, result.step_seconds))],
        "coordinator_peak_rss_bytes": peak_rss_bytes_now(),
    }
    if replanner is not None:
        figures["replans"] = [{"step": step, "old_ranges": r.old_ranges, "new_ranges": r.new_ranges,
                               "moved_bytes": r.moved_bytes, "seconds": r.seconds} for step, r in result.replans]
        for step, decision in replanner.decisions:
            print(f"after step {step}: {decision.reason}", file=sys.stderr)
    print("per stage: " + "; ".join(f"stage {k} blocks {r[0]}-{r[1]} peak RSS {rss / 2**20:.0f} MiB"
                                     for k, (r, rss) in enumerate(zip(result.ranges, stage_rss))), file=sys.stderr)
    if dev_sents:
        full = load_model(model, args.batch, args.seq)
        from runtime.engines.mnn import MnnStageEngine

        engine = MnnStageEngine(stage_spec(full, 0, len(full.blocks) - 1), threads=args.threads, weights={
            **full.constants, **result.weights}, cache_activations=False)
        scores = evaluate(engine, dev_enc, [s.tags for s in dev_sents], labels,
                          TrainConfig(batch=args.batch, seq=args.seq), len(full.blocks) - 2)
        figures.update({"f1": scores.f1, "precision": scores.precision, "recall": scores.recall})
        print(f"entity F1 after pipeline training: {scores.f1:.4f}", file=sys.stderr)
    if args.metrics_out:
        args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_out.write_text(json.dumps(figures, indent=1))
    return figures


def _busy_fraction(done: dict) -> float:
    busy = sum(done["seconds"].get(k, 0.0) for k in ("F", "B", "UPDATE"))
    return busy / done["wall_s"] if done.get("wall_s") else 0.0


def peak_rss_bytes_now() -> int:
    from runtime.procfs import peak_rss_bytes

    return peak_rss_bytes()


def cmd_train_pipeline(args) -> int:
    run_pipeline_training(args.model, args)
    return 0


def cmd_worker(args) -> int:
    from runtime.pipeline.worker import serve

    return serve(args.listen, timeout=args.timeout)


def cmd_backends(args) -> int:
    import importlib.util

    from runtime.engines.mnn_kernels import available_backends

    found = {f"mnn:{name}": present for name, present in available_backends().items()}
    found["torch:cpu"] = importlib.util.find_spec("torch") is not None
    if args.json:
        print(json.dumps(found))
    else:
        for name, present in found.items():
            print(f"{name:12s} {'present' if present else 'absent'}")
    return 0


def cmd_demo(args) -> int:
    from tasks.datagen import write_splits

    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    model = DEMO_DIR / "minilm-token-cls.onnx"
    if not model.is_file():
        print(f"[1/6] exporting all-MiniLM-L6-v2 to {model}", file=sys.stderr)
        # a separate process, so torch's memory does not count in the training run's peak RSS
        partial = model.with_suffix(".partial.onnx")
        proc = subprocess.run([sys.executable, "-m", "confidant", "export", "-o", str(partial)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise CliError("exporting MiniLM failed (the demo needs the `export` extra: torch, transformers):\n"
                           + proc.stderr.strip()[-2000:])
        partial.rename(model)
    else:
        print(f"[1/6] using {model}", file=sys.stderr)
    data_dir = DEMO_DIR / "data"
    print(f"[2/6] generating NER data in {data_dir}", file=sys.stderr)
    train, dev = write_splits(data_dir, n_train=2000, n_dev=300, seed=0)
    print(f"[3/6] fine-tuning on this device ({args.steps} steps)", file=sys.stderr)
    single = run_local_training(model, train, dev, args)
    import argparse

    from confidant import planning

    rows_per_micro = args.batch // 4
    print(f"[4/6] profiling this device at micro-batch {rows_per_micro} x {args.seq}", file=sys.stderr)
    profile_path = DEMO_DIR / "device.profile.json"
    planning.cmd_profile(argparse.Namespace(
        serve_link=False, link=None, model=model, batch=rows_per_micro, seq=args.seq, name="this-machine",
        backends="mnn:cpu:t1", memory=None, reps=2, no_attention=True, output=profile_path))
    cluster_path = DEMO_DIR / "cluster.yaml"
    # three devices made of this machine's profile with laptop-, board- and phone-like memory
    # budgets, so that the planner must respect memory, not just balance time (the addresses are
    # placeholders: the demo starts its workers locally)
    cluster_path.write_text(
        "devices:\n"
        f"  - {{name: laptop, address: 'tcp://127.0.0.1:5556', profile: {profile_path.name}, memory_budget: 1GiB}}\n"
        f"  - {{name: board, address: 'tcp://127.0.0.1:5557', profile: {profile_path.name}, memory_budget: 320MiB}}\n"
        f"  - {{name: phone, address: 'tcp://127.0.0.1:5558', profile: {profile_path.name}, memory_budget: 256MiB}}\n"
        "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    plan_dir = DEMO_DIR / "plan"
    print(f"[5/6] planning over {cluster_path} (1f1b-flush, 4 micro-batches)", file=sys.stderr)
    planning.cmd_plan(argparse.Namespace(
        model=model, cluster=cluster_path, schedule="1f1b-flush", batch=args.batch, seq=args.seq, microbatches=4,
        update_every=1, optimizer=args.optimizer, lr=args.lr, cuts=None, devices=None, time_limit=10.0,
        output=plan_dir))
    print(f"[6/6] training from the plan on {len(json.loads((plan_dir / 'plan.json').read_text())['devices'])} "
          f"local worker processes ({args.steps} steps)", file=sys.stderr)
    pipe_metrics = DEMO_DIR / "pipeline-metrics.json"
    planning.cmd_train_plan(argparse.Namespace(**{**vars(args), "plan": plan_dir, "data": train, "eval": dev,
                                                  "local": True, "checkpoint": None, "listen": "tcp://127.0.0.1:0",
                                                  "timeout": 600.0, "metrics_out": pipe_metrics}))
    trained = json.loads(pipe_metrics.read_text())
    pipe = {"stages": [{"peak_rss_bytes": d["peak_rss_bytes"], "name": d["name"]} for d in trained["devices"]],
            "steps": [{"loss": l, "samples_per_s": args.batch / trained["measured_step_s"]} for l in trained["losses"]],
            "f1": trained.get("f1", float("nan"))}
    single_sps = args.batch / (sum(s.get("seconds", 0) for s in single["steps"]) / len(single["steps"]))
    pipe_sps = sum(s["samples_per_s"] for s in pipe["steps"]) / len(pipe["steps"])
    rows = [("", "1 device", f"{len(pipe['stages'])} devices (planned pipeline)")]
    rows.append(("peak memory per device",
                 f"{single['peak_rss_bytes'] / 2**20:.0f} MiB",
                 " / ".join(f"{st['peak_rss_bytes'] / 2**20:.0f}" for st in pipe["stages"]) + " MiB"))
    rows.append(("largest device", f"{single['peak_rss_bytes'] / 2**20:.0f} MiB",
                 f"{max(st['peak_rss_bytes'] for st in pipe['stages']) / 2**20:.0f} MiB "
                 f"({max(st['peak_rss_bytes'] for st in pipe['stages']) / single['peak_rss_bytes']:.0%} of 1 device)"))
    rows.append(("samples/s", f"{single_sps:.1f}", f"{pipe_sps:.1f} (all workers share this machine's 2 cores)"))
    rows.append(("final loss", f"{single['steps'][-1]['loss']:.3f}", f"{pipe['steps'][-1]['loss']:.3f}"))
    rows.append(("entity F1", f"{single['f1']:.3f}", f"{pipe.get('f1', float('nan')):.3f}"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    return 0


def cmd_plan(args) -> int:
    from confidant.planning import cmd_plan as run

    return run(args)


def cmd_show(args) -> int:
    from confidant.planning import cmd_show as run

    return run(args)


def cmd_train(args) -> int:
    from confidant.planning import cmd_train_plan

    return cmd_train_plan(args)


def cmd_profile(args) -> int:
    from confidant.planning import cmd_profile as run

    return run(args)


def cmd_simulate(args) -> int:
    from confidant.planning import cmd_simulate as run

    return run(args)
