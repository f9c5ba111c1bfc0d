"""`confidant train-local`: fine-tune the whole model on this one device and score it."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from ir.backend import BackendSpec
from jobs.errors import JobError
from jobs.lora import adapted
from jobs.evaluation import eval_figures, score
from jobs.metrics import DeviceFigures, StepFigures, TrainingMetrics
from jobs.report import Reporter, Silent
from jobs.settings import TrainingSettings
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from tasks.ner import check_label_count, load_ner_data
from tasks.tokenize import make_batches
from tasks.trainer import TrainConfig, train_steps


def train_local(model: Path, data: Path, eval_path: Path, settings: TrainingSettings,
                reporter: Reporter = Silent()) -> TrainingMetrics:
    """Fine-tune `model` on `data` for `settings.steps` steps on one engine; entity F1 on `eval_path`
    before and after."""
    settings.check()
    config = TrainConfig(steps=settings.steps, batch=settings.batch, seq=settings.seq, lr=settings.lr,
                         optimizer=settings.optimizer, seed=settings.seed, threads=settings.threads)
    ner = load_ner_data(data, eval_path, settings.seq, settings.tokenizer)
    started = time.perf_counter()
    graph = adapted(load_model(model, config.batch, config.seq), settings.lora, reporter)
    check_label_count(model, graph.values[graph.blocks[-2].output].shape[-1], ner.labels)
    batches = make_batches(ner.train_encoded, config.batch, config.seq, seed=config.seed)
    try:
        engine = make_engine(BackendSpec.cpu(settings.engine, config.threads), stage_spec(graph, 0, len(graph.blocks) - 1))
    except ModuleNotFoundError:
        raise JobError(f"--engine {settings.engine} needs PyTorch: pip install torch==2.13.0") from None
    reporter.note(f"model {Path(model).name}: {len(graph.blocks)} blocks, {graph.param_bytes() / 2**20:.1f} MiB "
                  f"parameters; {len(ner.train)} training sentences, {len(ner.dev)} eval sentences; engine "
                  f"{settings.engine}, {config.threads} thread(s); setup {time.perf_counter() - started:.1f}s")
    before = score(engine, graph, ner, config.batch)
    reporter.note(f"entity F1 before fine-tuning: {before.f1:.4f}")
    reporter.start("train", config.steps)
    result = train_steps(engine, batches, config, len(ner.labels),
                         on_step=lambda r: reporter.step(r.step, loss=r.loss, **{"tok/s": r.tokens_per_s}))
    after = score(engine, graph, ner, config.batch)
    losses = [s.loss for s in result.steps]
    tail, head = losses[-max(1, len(losses) // 5):], losses[: max(1, len(losses) // 5)]
    reporter.note(f"loss {sum(head) / len(head):.4f} (first steps) -> {sum(tail) / len(tail):.4f} (last steps); "
                  f"entity F1 {before.f1:.4f} -> {after.f1:.4f} (P {after.precision:.3f}, R {after.recall:.3f}); "
                  f"peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB; "
                  f"{sum(s.tokens_per_s for s in result.steps) / len(result.steps):.0f} tokens/s")
    steps = tuple(StepFigures(s.step, s.loss, s.seconds, config.batch / s.seconds if s.seconds > 0 else float("nan"),
                              s.tokens_per_s) for s in result.steps)
    return TrainingMetrics("train-local", str(model), config.batch, config.seq, steps,
                           (DeviceFigures("this-device", 0, 0, len(graph.blocks) - 1, result.peak_rss_bytes),),
                           eval=eval_figures(after, before), settings={**asdict(settings), "engine": settings.engine})
