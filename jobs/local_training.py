"""`confidant train-local`: fine-tune the whole model on this one device and score it.

Three tasks: token classification (NER on CoNLL files, entity F1), sequence classification
(`task="seq-cls"`, GLUE-style TSV/CSV, accuracy and macro-F1) and causal language modelling
(`task="causal-lm"`, a decoder LLM on JSONL instructions or plain text, perplexity and exact match of
generated answers: `jobs.lm_training`). With `checkpoint` the trained
weights and optimizer state go to a checkpoint folder in the one format the pipeline writes
(`runtime.pipeline.checkpoints`: one stage), which `confidant predict` and `confidant
export-trained` read.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from ir.backend import BackendSpec
from ir.graph import is_causal_lm, is_sequence_classifier, logits_shape
from jobs.errors import JobError
from jobs.evaluation import class_figures, eval_figures, score, score_classes
from jobs.lora import adapted
from jobs.memory_check import local_check, machine_room_bytes
from jobs.metrics import DeviceFigures, StepFigures, TrainingMetrics
from jobs.report import Reporter, Silent
from jobs.settings import TrainingSettings
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.pipeline.checkpoints import check_checkpoint_target, save_checkpoint
from tasks.ner import check_label_count, eval_only_labels, load_ner_data
from tasks.tokenize import make_batches
from tasks.trainer import TrainConfig, train_steps

TASKS = ("ner", "seq-cls", "causal-lm")


def check_task_shape(model: Path, graph, task: str) -> None:
    """A JobError when the model's logits do not fit the task (token vs sequence classification)."""
    logits = logits_shape(graph)
    if task == "seq-cls" and not is_sequence_classifier(graph):
        raise JobError(f"{model} labels tokens (logits {list(logits)}); for --task seq-cls export a sequence "
                       "classifier: `confidant export --task seq-cls --num-labels N`")
    if task in ("ner", "seq-cls") and is_causal_lm(graph):
        raise JobError(f"{model} is a causal language model: train it with --task causal-lm")
    if task == "ner" and len(logits) != 3:
        raise JobError(f"{model} labels whole sequences (logits {list(logits)}); train it with --task seq-cls, or "
                       "export a token classifier for NER")


def _task_data(task: str, model: Path, data: Path, eval_path: Path | None, settings: TrainingSettings):
    if task == "seq-cls":
        from jobs.export import read_hf_sidecar
        from tasks.seqcls import load_seqcls_data

        sidecar = read_hf_sidecar(model) if Path(model).is_file() else None
        labels = (sidecar or {}).get("labels")
        return load_seqcls_data(data, eval_path, settings.seq, settings.tokenizer, labels)
    return load_ner_data(data, eval_path, settings.seq, settings.tokenizer)


def train_local(model: Path, data: Path, eval_path: Path, settings: TrainingSettings,
                reporter: Reporter = Silent(), task: str = "ner", checkpoint: Path | None = None) -> TrainingMetrics:
    """Fine-tune `model` on `data` for `settings.steps` steps on one engine; the task's metric on
    `eval_path` before and after (entity F1, or accuracy and macro-F1 for `task="seq-cls"`)."""
    settings.check()
    if task not in TASKS:
        raise JobError(f"--task {task!r} is not one of {', '.join(TASKS)}")
    if checkpoint is not None:  # before training: a path no checkpoint can be written to loses the run
        check_checkpoint_target(checkpoint)
    if task == "causal-lm":
        from jobs.lm_training import train_causal_lm

        return train_causal_lm(model, data, eval_path, settings, reporter, checkpoint)
    config = TrainConfig(steps=settings.steps, batch=settings.batch, seq=settings.seq, lr=settings.lr,
                         optimizer=settings.optimizer, seed=settings.seed, threads=settings.threads)
    run = _task_data(task, model, data, eval_path, settings)
    started, room = time.perf_counter(), machine_room_bytes()
    graph = adapted(load_model(model, config.batch, config.seq), settings.lora, reporter)
    check_task_shape(model, graph, task)
    check_label_count(model, logits_shape(graph)[-1], run.labels, eval_only_labels(run),
                      eval_path)
    batches = make_batches(run.train_encoded, config.batch, config.seq, seed=config.seed,
                           per_sequence=task == "seq-cls")
    try:
        # full fine-tuning: the engine takes the graph's arrays as its weights (held once, not twice;
        # the graph's parameters then follow training, read `engine.parameters()` for the trained ones)
        engine = make_engine(BackendSpec.cpu(settings.engine, config.threads), stage_spec(graph, 0, len(graph.blocks) - 1),
                             take_weights=settings.lora is None)
    except ModuleNotFoundError:
        raise JobError(f"--engine {settings.engine} needs PyTorch: pip install torch==2.13.0") from None
    what = "examples" if task == "seq-cls" else "sentences"
    reporter.note(f"model {Path(model).name}: {len(graph.blocks)} blocks, {graph.param_bytes() / 2**20:.1f} MiB "
                  f"parameters; {len(run.train)} training {what}, {len(run.dev)} eval {what}; engine "
                  f"{settings.engine}, {config.threads} thread(s); setup {time.perf_counter() - started:.1f}s")
    measure = (lambda: score_classes(engine, graph, run, config.batch)) if task == "seq-cls" else \
        (lambda: score(engine, graph, run, config.batch))
    headline = (lambda s: f"accuracy {s.accuracy:.4f}, macro-F1 {s.macro_f1:.4f}") if task == "seq-cls" else \
        (lambda s: f"entity F1 {s.f1:.4f}")
    before = measure() if run.dev else None
    if before is not None:
        reporter.note(f"{headline(before)} before fine-tuning")
    reporter.start("train", config.steps)
    result = train_steps(engine, batches, config, len(run.labels),
                         on_step=lambda r: reporter.step(r.step, loss=r.loss, **{"tok/s": r.tokens_per_s}))
    after = measure() if run.dev else None
    losses = [s.loss for s in result.steps]
    tail, head = losses[-max(1, len(losses) // 5):], losses[: max(1, len(losses) // 5)]
    scored = f"{headline(before)} -> {headline(after)}; " if after is not None else ""
    reporter.note(f"loss {sum(head) / len(head):.4f} (first steps) -> {sum(tail) / len(tail):.4f} (last steps); "
                  f"{scored}peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB; "
                  f"{sum(s.tokens_per_s for s in result.steps) / len(result.steps):.0f} tokens/s")
    if checkpoint is not None:
        write_single_device_checkpoint(checkpoint, engine.parameters(), result.optimizer_state, graph, {
            "command": "train-local", "model": Path(model).name, "model_path": str(Path(model).resolve()),
            "task": task, "labels": list(run.labels), "schedule": None, "microbatches": 1, "batch": config.batch,
            "seq": config.seq, "optimizer": config.optimizer, "lr": config.lr, "seed": config.seed,
            "step": config.steps, "lora": None if settings.lora is None else asdict(settings.lora)})
        reporter.note(f"wrote checkpoint {checkpoint}")
    steps = tuple(StepFigures(s.step, s.loss, s.seconds, config.batch / s.seconds if s.seconds > 0 else float("nan"),
                              s.tokens_per_s) for s in result.steps)
    figures = None
    if after is not None:
        figures = class_figures(after, before) if task == "seq-cls" else eval_figures(after, before)
    metrics = TrainingMetrics("train-local", str(model), config.batch, config.seq, steps,
                              (DeviceFigures("this-device", 0, 0, len(graph.blocks) - 1, result.peak_rss_bytes),),
                              eval=figures, settings={**asdict(settings), "engine": settings.engine, "task": task})
    return local_check(metrics, graph, config.optimizer, settings.engine, room, reporter)


def write_single_device_checkpoint(folder: Path, weights, optimizer_state, graph, meta: dict) -> Path:
    """A one-stage checkpoint folder: the trainable weights (`param/`), the optimizer state (`opt/`)
    and meta.json with the stage's block range, as `runtime.pipeline.checkpoints` writes them."""
    tensors = {f"param/{k}": v for k, v in weights.items() if k in set(graph.params)}
    tensors.update({f"opt/{k}": v for k, v in optimizer_state.items()})
    save_checkpoint(Path(folder), [tensors], {**meta, "stages": 1, "ranges": [[0, len(graph.blocks) - 1]]})
    return Path(folder)
