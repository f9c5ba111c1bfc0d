"""The `confidant` subcommands: each turns its flags into a job's settings, calls the job (`jobs/`) and
prints what it returns. Nothing here decides anything the planner or the runtime decides."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from confidant.errors import CliError, UsageError
from confidant.progress import TerminalReporter
from ir.training import TRAINING


def _lora_settings(args):
    """The LoRA settings of `--lora R ...`, or None (full fine-tuning) without it."""
    given = [f for f in ("lora_alpha", "lora_targets", "train_also") if getattr(args, f, None) is not None]
    base_dtype = _base_dtype_of_file(args, getattr(args, "base_dtype", None) or "float32")
    if getattr(args, "lora", None) is None:
        if base_dtype != "float32":
            raise UsageError(f"--base-dtype {base_dtype} holds the frozen base weights at lower precision, but "
                             "without --lora R every weight trains in full (and a trained weight stays float32); "
                             "add --lora R (e.g. --lora 8), or drop --base-dtype")
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise UsageError(f"{flags} set LoRA's adapters, but without --lora R every weight trains in full; "
                           "add --lora R (e.g. --lora 8), or drop them")
        return None
    from planner.lora import DEFAULT_TARGETS, LoraSettings

    text = args.lora_targets if args.lora_targets is not None else ",".join(DEFAULT_TARGETS)
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    also_text = args.train_also if args.train_also is not None else "auto"
    also = tuple(t.strip() for t in also_text.split(",") if t.strip() and t.strip() != "none")
    alpha = args.lora_alpha if args.lora_alpha is not None else TRAINING.lora_alpha
    try:
        return LoraSettings(args.lora, alpha, targets, also, seed=getattr(args, "seed", 0), base_dtype=base_dtype)
    except ValueError as exc:
        raise CliError(f"--lora: {exc}") from None


def _base_dtype_of_file(args, asked: str) -> str:
    """The frozen base's precision for a model `confidant export --base-dtype` stored quantized: the
    file's own (its weights are those rounded values: holding them so is exact, while another
    precision would round them a second time, so that is refused); `asked` for any other file."""
    model = getattr(args, "model", None)
    if not (isinstance(model, Path) and model.suffix == ".onnx" and model.is_file()):
        return asked
    from planner.onnx_quantize import recorded_base_dtype

    stored = recorded_base_dtype(model)
    if stored == "float32" or asked == stored:
        return asked
    if asked != "float32":
        raise UsageError(f"--base-dtype {asked}: {model.name} stores its frozen weights {stored} (exported with "
                         f"--base-dtype {stored}), and holding them {asked} would round them a second time; drop "
                         f"--base-dtype (the file's {stored} is used) or export the model again")
    if getattr(args, "lora", None) is None:
        return asked  # full fine-tuning: every weight trains in float32 from the stored values
    print(f"{model.name} stores its frozen weights {stored}: the LoRA base is held {stored}", file=sys.stderr)
    return stored


def _float32_base(lora):
    """LoRA settings with the base left float32: the estimate prices --base-dtype without quantizing."""
    import dataclasses

    return None if lora is None else dataclasses.replace(lora, base_dtype="float32")


def _training_settings(args):
    from jobs.common.settings import TrainingSettings

    return TrainingSettings(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, optimizer=args.optimizer,
                            seed=args.seed, threads=args.threads, engine=args.engine, tokenizer=args.tokenizer,
                            lora=_lora_settings(args), eval_limit=getattr(args, "eval_limit", None))


INSECURE_WARNING = ("warning: --insecure: links are plaintext and unauthenticated and bundles are not signature-"
                    "checked; anyone who can reach these ports can read the traffic and steer training")


def _security(args) -> tuple[Path | None, bool]:
    """(--keys, --insecure), warning on stderr when insecure."""
    if args.insecure:
        print(INSECURE_WARNING, file=sys.stderr)
    return args.keys, args.insecure


def _home_keys(args) -> Path:
    """--keys, or $CONFIDANT_HOME/keys: where `plan` signs and `train` ships from by default."""
    from confidant.home import DEMO_DIR

    return args.keys if args.keys is not None else DEMO_DIR / "keys"


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

def _export_causal_lm(args) -> int:
    try:
        from jobs.export.llm import LlmExportOptions, export_llm, export_random_causal_lm, smollm2_gguf_path
    except ModuleNotFoundError as exc:
        raise CliError(f"export needs the `export` extra ({exc.name} is missing): "
                       "pip install 'confidant[export]' torch==2.13.0") from None
    if not 14 <= args.opset <= 20:
        raise CliError(f"--opset {args.opset} is outside the supported 14-20")
    _check_base_dtype_flags(args)
    base = getattr(args, "base_dtype", "float32")
    try:
        from ir.precision import check_base_dtype

        check_base_dtype(base)
    except ValueError as exc:
        raise UsageError(f"--base-dtype: {exc}") from None
    options = LlmExportOptions(opset=args.opset, dynamo=args.dynamo, seed=args.seed, base_dtype=base)
    exporter = "dynamo" if args.dynamo else "torchscript"
    if args.random:
        if args.checkpoint:
            raise CliError("--random builds a model: drop --checkpoint")
        try:
            tokenizer = smollm2_gguf_path()
        except Exception:  # noqa: BLE001 - no package: a random model without a tokenizer
            tokenizer = None
        print(f"exporting a random {args.random} (seed {args.seed}) -> {args.output} ({exporter} exporter)",
              file=sys.stderr)
        export_random_causal_lm(args.random, args.output, options, tokenizer, kv_cache=not args.no_kv_cache)
    else:
        source = args.checkpoint or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)"
        print(f"exporting {source} -> {args.output} (opset {args.opset}, {exporter} exporter, causal LM)",
              file=sys.stderr)
        export_llm(args.checkpoint, args.output, options, kv_cache=not args.no_kv_cache)
    if base != "float32":  # written quantized tensor by tensor by the exporter itself (planner/onnx_quantize.py, the lean export)
        meta = json.loads(Path(args.output).with_suffix(".lm.json").read_text())
        print(f"stored {len(meta.get('stored_quantized', []))} weights {base}", file=sys.stderr)
    print(args.output)
    return 0


def _check_base_dtype_flags(args) -> None:
    if getattr(args, "base_dtype", "float32") != "float32" and args.dynamo:
        raise UsageError(f"--base-dtype {args.base_dtype} rewrites the TorchScript exporter's files (the dynamo "
                         "exporter renames and pre-transposes weights): drop --dynamo")


def _store_base(args) -> None:
    """--base-dtype: the written files with their frozen weights stored at that precision."""
    base = getattr(args, "base_dtype", "float32")
    if base == "float32":
        return
    from jobs.export.quantized import quantize_export

    done = quantize_export(args.output, base, keep_head=args.task != "causal-lm")
    print(f"stored {done.weights} weights {base}: {done.float_bytes / 2**20:.1f} MiB as float32 -> "
          f"{done.stored_bytes / 2**20:.1f} MiB ({', '.join(p.name for p in done.files)})", file=sys.stderr)


def cmd_export(args) -> int:
    if getattr(args, "task", "token-classification") == "causal-lm":
        return _export_causal_lm(args)
    if getattr(args, "random", None) or getattr(args, "no_kv_cache", False):
        raise CliError("--random and --no-kv-cache are for --task causal-lm")
    try:
        from jobs.export.encoder import ExportOptions, default_checkpoint_dir, export_checkpoint
    except ModuleNotFoundError as exc:
        raise CliError(f"export needs the `export` extra ({exc.name} is missing): "
                       "pip install 'confidant[export]' torch==2.13.0") from None
    labels = tuple(x.strip() for x in args.labels.split(",")) if getattr(args, "labels", None) else ()
    num_labels = len(labels) if labels and args.num_labels == 9 else args.num_labels
    try:
        options = ExportOptions(num_labels=num_labels, opset=args.opset, dynamo=args.dynamo, seed=args.seed,
                                task=args.task, attention=getattr(args, "attention", "eager"), labels=labels).check()
    except ValueError as exc:
        raise CliError(f"{exc} (--opset, --num-labels, --labels)") from None
    _check_base_dtype_flags(args)
    checkpoint = args.checkpoint or default_checkpoint_dir()
    print(f"exporting {checkpoint} -> {args.output} ({args.task}, opset {args.opset}, "
          f"{'dynamo' if args.dynamo else 'torchscript'} exporter, {num_labels} labels)", file=sys.stderr)
    export_checkpoint(checkpoint, args.output, options)
    _store_base(args)
    print(args.output)
    return 0


def _inspect_json(graph) -> dict:
    blocks = [{"name": b.name, "kind": b.kind, "params_bytes": b.params_bytes,
               "activation_bytes": b.activation_bytes, "flops": b.flops, "heads": b.heads,
               "kv_heads": b.kv_heads, "head_size": b.head_size,
               # what a head split deals out (heads, or key/value groups); null where it cannot split
               "split_units": b.split_units if b.attention is not None else None} for b in graph.blocks]
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


def _or(value, default):
    return default if value is None else value


def cmd_datagen(args) -> int:
    if getattr(args, "task", "ner") == "entities-json":
        from tasks.causal_lm.entity_task import write_entity_splits

        n_train, n_dev = _or(args.train, 1000), _or(args.dev, 100)
        train, dev = write_entity_splits(args.output, n_train=n_train, n_dev=n_dev, seed=args.seed)
        print(f"wrote {train} ({n_train} instructions) and {dev} ({n_dev} instructions)")
        return 0
    if getattr(args, "task", "ner") == "seq-cls":
        from tasks.seqcls.data import write_review_splits

        n_train, n_dev = _or(args.train, 2000), _or(args.dev, 300)
        train, dev = write_review_splits(args.output, n_train=n_train, n_dev=n_dev, seed=args.seed)
        print(f"wrote {train} ({n_train} reviews) and {dev} ({n_dev} reviews): negative / neutral / positive")
        return 0
    from tasks.ner.datagen import write_splits

    n_train, n_dev = _or(args.train, 3000), _or(args.dev, 500)
    train, dev = write_splits(args.output, n_train=n_train, n_dev=n_dev, seed=args.seed)
    print(f"wrote {train} ({n_train} sentences) and {dev} ({n_dev} sentences)")
    return 0


def cmd_generate(args) -> int:
    from jobs.generation import generate
    from tasks.causal_lm.generate import GenerationSettings

    try:
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_k=args.top_k, seed=args.seed, kv_cache=not args.no_kv_cache)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    answers = generate(args.model, args.prompt, settings, raw=args.raw, system=args.system, threads=args.threads)
    for answer in answers:
        print(answer)
    return 0


# --- training --------------------------------------------------------------------------------------

def _task(args) -> str:
    """--task, or the task the model's side files (or the data's kind) name, said on a line of its own."""
    from tasks.choice import task_of

    if getattr(args, "task", None):
        return args.task
    choice = task_of(model=args.model, data=args.data)
    print(f"task: {choice.task} ({choice.reason}; --task to choose another)")
    return choice.task


@contextmanager
def _metrics_on_failure(path):
    """A run that fails once started still writes its metrics document (the steps it did, its events,
    the error), then fails as it would: lost beyond recovery or stopped by `--on-failure stop`
    (RunFailed), interrupted (Ctrl-C) or broken by any other error (the job's `metrics` on it)."""
    from jobs.common.errors import RunFailed

    try:
        yield
    except RunFailed as exc:
        if exc.metrics is not None:
            _write_metrics(exc.metrics, path)
        raise
    except BaseException as exc:  # Ctrl-C or a fault of no known kind: the job attached what it did
        metrics = getattr(exc, "metrics", None)
        if metrics is not None:
            _write_metrics(metrics, path)
        raise


def cmd_train_local(args) -> int:
    import dataclasses

    from jobs.train.local import train_local

    settings = dataclasses.replace(_training_settings(args), activations=args.activations)
    metrics = train_local(args.model, args.data, args.eval, settings, TerminalReporter(),
                          task=_task(args), checkpoint=getattr(args, "checkpoint", None))
    _write_metrics(metrics, args.metrics_out)
    return 0


def _update_every(args) -> int:
    from ir.plan import default_update_every

    if args.update_every is not None:
        return args.update_every
    return default_update_every(args.schedule, args.microbatches)


def cmd_train_pipeline(args) -> int:
    from jobs.train.pipeline import train_pipeline_job
    from jobs.common.settings import PipelineSettings

    workers = [a.strip() for a in args.workers.split(",")] if args.workers else None
    keys, insecure = _security(args)
    pipeline = PipelineSettings(schedule=args.schedule, microbatches=args.microbatches,
                                update_every=_update_every(args), cuts=_cuts(args.cuts), checkpoint=args.checkpoint,
                                resume=args.resume, replan_every=args.replan_every,
                                replan_threshold=args.replan_threshold, listen=args.listen, timeout_s=args.timeout,
                                keys=keys, insecure=insecure, on_failure=args.on_failure,
                                failure_timeout_s=args.failure_timeout, checkpoint_every=args.checkpoint_every,
                                activations=args.activations)
    with _metrics_on_failure(args.metrics_out):
        metrics = train_pipeline_job(args.model, args.data, args.eval, _training_settings(args), pipeline,
                                     workers=workers, local=args.local, reporter=TerminalReporter(), task=_task(args))
    _write_metrics(metrics, args.metrics_out)
    return 0


def cmd_train(args) -> int:
    from confidant.defaults import PLAN_FIXED
    from jobs.train.from_plan import PlanRunSettings, planned_values, train_from_plan

    given = {f: getattr(args, f) for f in PLAN_FIXED if getattr(args, f, None) is not None}
    if given:  # a value the plan was not made for would be ignored: its bundles fix it
        planned = planned_values(args.plan)
        differ = [f"--{f} {v} (the plan's: {', '.join(str(x) for x in sorted(planned[f], key=str))})"
                  for f, v in given.items() if planned[f] != {v}]
        if differ:
            raise UsageError(f"{'; '.join(differ)}: the plan fixes {'these' if len(differ) > 1 else 'this'} (its bundles "
                           f"were compiled for {'them' if len(differ) > 1 else 'it'}); re-plan with `confidant plan` to "
                           "change it, or drop the flag")
    _, insecure = _security(args)
    settings = PlanRunSettings(steps=args.steps, seed=args.seed, tokenizer=args.tokenizer, local=args.local,
                               checkpoint=args.checkpoint, replan_every=args.replan_every,
                               replan_threshold=args.replan_threshold, cluster=args.cluster, listen=args.listen,
                               timeout_s=args.timeout, keys=_home_keys(args), insecure=insecure,
                               on_failure=args.on_failure, failure_timeout_s=args.failure_timeout,
                               checkpoint_every=args.checkpoint_every)
    with _metrics_on_failure(args.metrics_out):
        metrics = train_from_plan(args.plan, args.data, args.eval, settings, TerminalReporter())
    _write_metrics(metrics, args.metrics_out)
    return 0


def cmd_worker(args) -> int:
    import socket

    from runtime.keys import KeyDir, KeyFileError
    from runtime.pipeline.worker import serve

    keys_dir, insecure = _security(args)
    keys = None
    if keys_dir is not None and not insecure:
        try:
            keys = KeyDir.load(keys_dir, args.name or socket.gethostname())
        except KeyFileError as exc:
            raise CliError(str(exc)) from None
    elif not insecure:
        raise CliError("a worker needs --keys DIR (its NAME.key and the coordinator's coordinator.pub; "
                       "`confidant keys DIR coordinator NAME`) or, on a network nobody else can reach, --insecure")
    return serve(args.listen, timeout=args.timeout, keys=keys, insecure=insecure, heartbeat_s=args.failure_timeout,
                 parent_pid=args.exit_with, base_files=_base_files(args.base))


def _base_files(paths) -> dict:
    """--base FILE...: SHA-256 -> path, each hashed once now (what a coordinator's offer names)."""
    from ir.bundle import sha256_file

    held = {}
    for path in paths:
        if not path.is_file():
            raise CliError(f"--base {path}: no such file (give a plan's base.safetensors copied to this device)")
        held[sha256_file(path)] = path
        print(f"base weights {path}: sha256 {next(reversed(held))[:12]}...", file=sys.stderr, flush=True)
    return held


def cmd_keys(args) -> int:
    from runtime.keys import KeyFileError, KeyPair, write_keypair

    try:
        for name in args.names:
            secret, public = write_keypair(args.dir, KeyPair.generate(name))
            print(f"{public.read_text().split()[0]}  {name}  ({secret} stays on {name}; {public.name} is public)")
    except KeyFileError as exc:
        raise CliError(str(exc)) from None
    return 0


def demo_args(args):
    """`args` of `demo` with the flags the user left unset (None) given this demo's defaults (the
    NER demo's, or with --llm SmolLM2's)."""
    from confidant.defaults import DEMO_DEFAULTS

    if getattr(args, "llm", False):
        from jobs.llm_demo import LLM_DEMO_DEFAULTS as defaults
    else:
        defaults = DEMO_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def cmd_demo(args) -> int:
    from confidant.home import DEMO_DIR

    args = demo_args(args)
    if args.llm:
        from jobs.llm_demo import llm_demo_table, run_llm_demo

        rows = llm_demo_table(run_llm_demo(DEMO_DIR, _training_settings(args), TerminalReporter()))
    else:
        from confidant.defaults import DEMO_DEFAULTS
        from jobs.demo import demo_table, f1_hint, run_demo

        result = run_demo(DEMO_DIR, _training_settings(args), TerminalReporter())
        rows = demo_table(result)
        hint = f1_hint(result.single.eval.after if result.single.eval is not None else None, args.steps,
                       DEMO_DEFAULTS["steps"])
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    if not args.llm and hint is not None:
        print(hint)
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
    started = time.monotonic()  # --time-limit counts the whole command, its imports too
    from jobs.planning import PlanSettings, plan_model

    settings = PlanSettings(schedule=args.schedule, batch=args.batch, seq=args.seq, microbatches=args.microbatches,
                            update_every=_update_every(args), optimizer=args.optimizer, lr=args.lr,
                            cuts=_cuts(args.cuts), devices=tuple(args.devices.split(",")) if args.devices else None,
                            time_limit_s=args.time_limit, started_s=started, lora=_lora_settings(args), data=args.data,
                            tokenizer=args.tokenizer, on_failure=args.on_failure)
    if args.tokenizer is not None and args.data is None:
        raise CliError("--tokenizer is the tokenizer of --data: give the training data with it")
    _, insecure = _security(args)
    reporter = TerminalReporter()
    sign = None
    if not insecure:
        from jobs.common.workers import coordinator_pair
        from runtime.keys import signer

        sign = signer(coordinator_pair(_home_keys(args), note=reporter.note))
    into = _plan_folder_to_write(args.output, getattr(args, "force", False))
    try:
        plan_model(args.model, args.cluster, settings, into, reporter, sign=sign)
        if into != args.output:
            _swap_in(into, args.output)
            reporter.note(f"replaced the plan in {args.output} (--force)")
    finally:
        if into != args.output and into.exists():
            shutil.rmtree(into, ignore_errors=True)
    show_plan(args.output)
    return 0


def _plan_folder_to_write(output: Path, force: bool) -> Path:
    """Where `plan` writes: `output` itself when it is new or empty; a plan already there is refused
    unless --force, and then the new plan is written beside it and swapped in whole once it is made
    (a plan that does not fit leaves the old one as it was, and no bundle of the old plan stays)."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return output
    if not output.is_dir():
        raise UsageError(f"-o {output}: a file is in the way; give a folder for the plan")
    if not (output / "plan.json").is_file():
        raise UsageError(f"-o {output}: the folder holds files that are not a plan; give a new or empty folder")
    if not force:
        raise UsageError(f"-o {output} already holds a plan: give another -o, or --force to replace it")
    return output.with_name(f".{output.name}.new-{os.getpid()}")


def _swap_in(new: Path, output: Path) -> None:
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    output.rename(old)
    new.rename(output)
    shutil.rmtree(old, ignore_errors=True)


def cmd_estimate(args) -> int:
    from jobs.estimate import EstimateSettings, estimate_json, estimate_lines, estimate_memory, parse_devices

    if args.profile is not None and args.cluster is not None:
        raise UsageError("--profile prices --devices; a --cluster file names each device's own profile: drop one")
    try:
        devices = parse_devices(args.devices) if args.devices is not None else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.batch < 1 or args.seq < 1:
        raise UsageError(f"--batch {args.batch} and --seq {args.seq} must be at least 1")
    if args.batch % args.microbatches:
        raise UsageError(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    if args.base_dtype != "float32" and args.lora is None:
        raise UsageError(f"--base-dtype {args.base_dtype} sets the precision of a LoRA run's frozen base; full "
                         "fine-tuning trains every weight in float32: add --lora R (e.g. --lora 8)")
    from ir.plan import default_update_every

    settings = EstimateSettings(batch=args.batch, seq=args.seq, microbatches=args.microbatches,
                                schedule=args.schedule, optimizer=args.optimizer,
                                lora=_float32_base(lora := _lora_settings(args)),
                                base_dtype=args.base_dtype if lora is None else lora.base_dtype,  # a file's own
                                update_every=default_update_every(args.schedule, args.microbatches))
    est = estimate_memory(args.model, settings, devices, args.cluster, args.profile)
    if args.json:
        print(json.dumps(estimate_json(est), indent=1))
    else:
        print("\n".join(estimate_lines(est)))
    return 0


def cmd_show(args) -> int:
    show_plan(args.plan)
    return 0


def _term_label(name: str, lora) -> str:
    """A plan.json memory term as `show` names it (the trainable weights are the adapters under LoRA)."""
    return "adapters" if name == "trainable" and lora is not None else name


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
    from ir.bundle import PLAN_BASE, load_plan
    from jobs.planning import engine_choices

    plan = load_plan(plan_dir)
    rows = [("stage", "device", "address", "blocks", "memory / budget", "trainable / frozen", "time/micro-batch",
             "engine", "threads", "heads")]
    for d in plan.devices:
        weights = "-" if d.trainable_bytes is None else \
            f"{d.trainable_bytes / 2**20:.1f} / {(d.frozen_bytes or 0) / 2**20:.1f} MiB"
        rows.append((str(d.stage), d.name, d.address or "-", f"{d.first_block}-{d.last_block}",
                     f"{d.memory_bytes / 2**20:.0f}"
                     + (f" + {d.reserved_bytes / 2**20:.0f}" if d.reserved_bytes else "")
                     + f" / {d.memory_budget_bytes / 2**20:.0f} MiB", weights,
                     f"{d.predicted_time_s * 1000:.0f} ms", d.engine + (f" ({d.activations})" if d.activations else ""),
                     str(d.threads), _heads_cell(d.head_split)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"plan {plan_dir}: model {plan.model}, schedule {plan.schedule}, {plan.microbatches} micro-batches "
          f"of {plan.batch} x {plan.seq}, partition {plan.partition_method}"
          f"{' (optimal)' if plan.partition_optimal else ''}"
          + (f", frozen base held {plan.base_dtype}" if plan.base_dtype != "float32" else "")
          + f", --on-failure {plan.on_failure}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if any(d.reserved_bytes for d in plan.devices):
        print("memory: what the plan charges + what it left free of the budget for the fault policy's snapshot "
              "copies on the workers (their chunks on the way; the copies lie in files)")
    if any(d.memory_terms for d in plan.devices):
        print("memory per device (the memory model's terms, MiB; frozen weights by the precision held; activations: "
              "the stashed block inputs, kept: what a device keeping activations holds per further micro-batch; "
              "workspace: the blocks' caches and the stage's largest one-block transient):")
        for d in plan.devices:
            if d.memory_terms:
                print(f"  {d.name}: " + ", ".join(f"{_term_label(name, plan.lora)} {b / 2**20:.1f}"
                                                  for name, b in d.memory_terms.items())
                      + f" = {d.memory_bytes / 2**20:.1f}"
                      + (f", reserve {d.reserved_bytes / 2**20:.1f}" if d.reserved_bytes else "")
                      + f" of {d.memory_budget_bytes / 2**20:.0f} budget")
        if any("LM head + loss" in (d.memory_terms or {}) for d in plan.devices):
            if plan.target_positions is None:
                print("  (LM head + loss: the fused head and loss's peak with every position of a micro-batch a "
                      "target, the worst case of any data; positions that are no target (prompts, padding) cost less)")
            else:
                print(f"  (LM head + loss: the fused head and loss's peak at {plan.target_positions} target positions "
                      f"a micro-batch, the most the data it was planned for has (plan --data); train refuses data "
                      f"with more)")
    if plan.predicted_step_s:
        print(f"predicted step: {plan.predicted_step_s:.3f} s "
              f"({plan.batch * plan.microbatches / plan.predicted_step_s:.1f} samples/s)")
    choices = engine_choices(plan_dir)
    if choices:
        print("engine per device (forward+backward per micro-batch of its stage; auto: the fastest backend whose "
              "engine fits the budget):")
        split = {d.name for d in plan.devices if d.head_split is not None}
        for c in choices:
            why = "the head split's base" if c.device in split else "the cluster file's" if c.given else "auto"
            line = f"  {c.device}: {c.backend} ({why})" + (f" {c.seconds * 1000:.0f} ms" if c.seconds is not None else "")
            if c.runner_up is not None:
                extra = (f", {'+' if c.runner_up_extra_bytes >= 0 else '-'}{abs(c.runner_up_extra_bytes) / 2**20:.0f} MiB "
                         f"of engine" if c.runner_up_extra_bytes else "")
                line += f"; runner-up {c.runner_up} {c.runner_up_seconds * 1000:.0f} ms{extra}"
            print(line)
    if plan.lookup_rows:
        print("embedding rows the data it was planned for looks up (plan --data; their AdamW state is charged as "
              "rows, and train refuses data that looks up more): "
              + ", ".join(f"{table} {rows}" for table, rows in sorted(plan.lookup_rows.items())))
    if plan.base_sha256 is not None:
        print(f"base weights: {plan_dir / PLAN_BASE} (sha256 {plan.base_sha256[:12]}...): a device started with "
              f"`confidant worker --base` on a copy reads its frozen weights there instead of over the link")
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
    predicted = plan.predicted_step_s
    if predicted and abs(sim.step_s - predicted) > 0.05 * predicted:
        print(f"the plan's predicted step (`show`) is {predicted:.3f} s: the planner's closed form for the schedule "
              f"(stage times, the slowest stage once per further micro-batch, the update), which the solver "
              f"minimises; this simulation replays every action and transfer in order, waits included")
    print(f"wrote {args.output} (open in Perfetto / chrome://tracing)")
    return 0


def cmd_report(args) -> int:
    from jobs.report_page import write_report

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be at least 1")
    path = write_report(args.plan, args.output, args.metrics, args.steps)
    print(f"wrote {path} (one self-contained page: open it in any browser, no network needed)")
    return 0


def cmd_export_adapter(args) -> int:
    from jobs.export.adapter import export_adapter_for, export_merged, loading_lines

    if args.merged:
        print(f"wrote {export_merged(args.checkpoint, args.output)} (adapters merged into the base weights)")
        return 0
    try:
        out = export_adapter_for(args.checkpoint, args.output, args.base, args.num_labels, args.seed, args.tokenizer)
    except ModuleNotFoundError as exc:
        raise CliError(f"export-adapter needs the `export` extra ({exc.name} is missing): "
                       "pip install 'confidant[export]' torch==2.13.0") from None
    print(f"wrote {out}; load it in Python with:")
    for line in loading_lines(out):
        print(f"    {line}")
    return 0


# --- the model out ---------------------------------------------------------------------------------

def cmd_predict(args) -> int:
    from jobs.predict import predict_to

    labels = tuple(x.strip() for x in args.labels.split(",")) if args.labels else None
    n = predict_to(args.model, args.input, args.output, args.format, labels=labels, batch=args.batch, seq=args.seq,
                   threads=args.threads, tokenizer=args.tokenizer)
    if args.output is not None:
        print(f"labelled {n} inputs -> {args.output}", file=sys.stderr)
    return 0


def cmd_export_trained(args) -> int:
    from jobs.export.trained import export_trained_hf, export_trained_onnx

    if args.output is None and args.hf is None:
        raise CliError("give -o FILE.onnx, --hf DIR, or both")
    if args.output is not None:
        print(export_trained_onnx(args.checkpoint, args.output))
    if args.hf is not None:
        print(export_trained_hf(args.checkpoint, args.hf, getattr(args, "tokenizer", None)))
    return 0
