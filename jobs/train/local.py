"""`confidant train-local`: fine-tune the whole model on this one device and score it.

Three tasks: token classification (NER on CoNLL files, entity F1), sequence classification
(`task="seq-cls"`, GLUE-style TSV/CSV, accuracy and macro-F1) and causal language modelling
(`task="causal-lm"`, a decoder LLM on JSONL instructions or plain text, perplexity and exact match of
generated answers: `jobs.train.causal_lm`). With `checkpoint` the trained
weights and optimizer state go to a checkpoint folder in the one format the pipeline writes
(`runtime.pipeline.checkpoints`: one stage), which `confidant predict` and `confidant
export-trained` read.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import asdict
from pathlib import Path

from jobs.common.errors import JobError
from jobs.common.lora import base_on_mapping, load_adapted
from jobs.common.memory_check import local_check, machine_room_bytes
from jobs.common.metrics import DeviceFigures, StepFigures, TrainingMetrics
from jobs.common.report import Reporter, Silent
from jobs.common.settings import TrainingSettings
from jobs.common.task_choice import check_graph, task_for
from jobs.train.start_up import torch_start_up, update_start_up
from planner.lookups import lookup_rows
from runtime.engines.factory import whole_model_engine
from runtime.pipeline.checkpoints import check_checkpoint_target, save_checkpoint
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes
from tasks.trainer import TrainConfig, train_steps


def train_local(model: Path, data: Path, eval_path: Path, settings: TrainingSettings,
                reporter: Reporter = Silent(), task: str = "ner", checkpoint: Path | None = None) -> TrainingMetrics:
    """Fine-tune `model` on `data` for `settings.steps` steps on one engine; the task's metric on
    `eval_path` before and after (entity F1, or accuracy and macro-F1 for `task="seq-cls"`)."""
    settings.check()
    the_task = task_for(task)
    if checkpoint is not None:  # before training: a path no checkpoint can be written to loses the run
        check_checkpoint_target(checkpoint)
    if the_task.loss == "causal-lm":  # scored by generating from the exported file too
        from jobs.train.causal_lm import train_causal_lm

        return train_causal_lm(model, data, eval_path, settings, reporter, checkpoint)
    config = TrainConfig(steps=settings.steps, batch=settings.batch, seq=settings.seq, lr=settings.lr,
                         optimizer=settings.optimizer, seed=settings.seed, threads=settings.threads)
    run = the_task.read_data(model, data, eval_path, settings.seq, tokenizer=settings.tokenizer, note=reporter.note)
    started, room = time.perf_counter(), machine_room_bytes()
    # a quantized base read from a mapping of the file, a weight at a time (`load_adapted`); the frozen base left
    # on the mapping while training (a float32 one, or one the file stores quantized: `base_on_mapping`), asked
    # here: its walk of the file's header faults the file's pages in, which after the steps set a new peak (MiniLM
    # int4: 149 -> 185 MiB, the file walked again by the memory check after the run)
    on_mapping = base_on_mapping(model, settings.lora, settings.engine, settings.activations)
    graph = load_adapted(model, config.batch, config.seq, settings.lora, reporter, engine=settings.engine,
                         activations=settings.activations)
    check_graph(the_task, model, graph, run, eval_path)
    batches = the_task.batches(run, config.batch, config.seed)
    try:
        # full fine-tuning: the engine takes the graph's arrays as its weights (held once, not twice;
        # the graph's parameters then follow training, read `engine.parameters()` for the trained ones)
        engine = whole_model_engine(graph, settings.engine, config.threads, take_weights=settings.lora is None,
                                    activations=settings.activations)
    except ModuleNotFoundError:
        raise JobError(f"--engine {settings.engine} needs PyTorch: pip install torch==2.13.0") from None
    reporter.note(f"model {Path(model).name}: {len(graph.blocks)} blocks, {graph.param_bytes() / 2**20:.1f} MiB "
                  f"parameters; {len(run.train)} training {the_task.examples}, {len(run.dev)} eval {the_task.examples}; engine "
                  f"{settings.engine}, {config.threads} thread(s); setup {time.perf_counter() - started:.1f}s")
    if settings.engine == "torch":
        # PyTorch's one-time start-up (the first backward's kernels and autograd's buffers) paid before the
        # set-up is read, so the set-up holds it, as the causal-LM job pays it: MiniLM NER LoRA int4 per block
        # rose ~97 MiB above what the evaluation left, 381.5 / 376.7 (helpers h117, h123)
        torch_start_up(graph, config.threads, settings.activations,
                       the_task.feeds(run, batches[0], config.batch, config.microbatches)[0])
    else:  # numpy's update kernels mapped before the set-up is read (`update_start_up`)
        update_start_up(config.optimizer)
    gc.collect()
    release_free_heap()  # the set-up's free heap handed back: what the steps and the evaluation rise from
    # the planned figure's measured part (`local_check`): the process, data, model and engine built, as the
    # causal-LM job reads it (`jobs.train.causal_lm`); the memory model's whole figure charged a worker's
    # start-up for it (MiniLM, the demo's run: 571 / 491, helper h117)
    set_up = rss_bytes()
    before = the_task.evaluate(engine, graph, run, config.batch)
    # the evaluation runs on the training engine: what it rose above the set-up (at least; VmHWM is never
    # reset, the set-up's own earlier peak may count too) charged where larger than a step. MNN keeping its
    # per-op caches keeps the forward's, which a step charges (MiniLM: +89 MiB, its caches 88)
    evaluation = peak_rss_bytes() - set_up if set_up is not None and before is not None else None
    # that forward's rise is what a training forward holds (the same shape on the same engine): MNN keeping
    # charges it as measured, its buffer pool included (`local_check`'s `forward_kept_bytes`, helper h137)
    forward_kept = evaluation
    if before is not None:
        reporter.note(f"{the_task.headline(before)} before fine-tuning")
    reporter.start("train", config.steps)
    result = train_steps(engine, batches, config, len(run.labels),
                         on_step=lambda r: reporter.step(r.step, loss=r.loss, **{"tok/s": r.tokens_per_s}),
                         step_feeds=lambda b: the_task.feeds(run, b, config.batch, config.microbatches))
    gc.collect()
    release_free_heap()  # what the steps let go of handed back before the evaluation after them
    # the evaluation after training: its own peak read (VmHWM started again, the whole life's so far kept) and
    # charged above the set-up where larger, as the causal-LM job does (helper h109): it rises from what the
    # evaluation before and the steps left resident, which the set-up does not hold (MiniLM NER, PyTorch LoRA
    # int4 per block: 396.8 against the evaluation before's 393.5, its planned figure; helper h123)
    life = peak_rss_bytes()
    own = reset_peak_rss()
    after = the_task.evaluate(engine, graph, run, config.batch)
    if own and evaluation is not None and after is not None:
        evaluation = max(evaluation, peak_rss_bytes() - set_up)
    life = max(life, peak_rss_bytes())  # the whole life's peak (set-up, both evaluations, the steps)
    losses = [s.loss for s in result.steps]
    tail, head = losses[-max(1, len(losses) // 5):], losses[: max(1, len(losses) // 5)]
    scored = f"{the_task.headline(before)} -> {the_task.headline(after)}; " if after is not None else ""
    reporter.note(f"loss {sum(head) / len(head):.4f} (first steps) -> {sum(tail) / len(tail):.4f} (last steps); "
                  f"{scored}peak RSS {life / 2**20:.0f} MiB; "
                  f"{sum(s.tokens_per_s for s in result.steps) / len(result.steps):.0f} tokens/s")
    if checkpoint is not None:
        write_single_device_checkpoint(checkpoint, engine.parameters(), result.optimizer_state, graph, {
            "command": "train-local", "model": Path(model).name, "model_path": str(Path(model).resolve()),
            "task": the_task.name, "labels": list(run.labels), "schedule": None, "microbatches": 1, "batch": config.batch,
            "seq": config.seq, "optimizer": config.optimizer, "lr": config.lr, "seed": config.seed,
            "step": config.steps, "lora": None if settings.lora is None else asdict(settings.lora)})
        reporter.note(f"wrote checkpoint {checkpoint}")
    steps = tuple(StepFigures(s.step, s.loss, s.seconds, config.batch / s.seconds if s.seconds > 0 else float("nan"),
                              s.tokens_per_s) for s in result.steps)
    figures = None if after is None else (after if before is None else the_task.with_before(after, before))
    metrics = TrainingMetrics("train-local", str(model), config.batch, config.seq, steps,
                              (DeviceFigures("this-device", 0, 0, len(graph.blocks) - 1, life),),
                              eval=figures, settings={**asdict(settings), "engine": settings.engine, "task": the_task.name})
    # the table rows the steps looked up (`planner.lookups.lookup_rows`, as `plan --data` counts them): AdamW
    # holds their state alone (`planner.cost.table_state_delta_bytes`); distinct rows, so each batch the steps
    # cycled through is read once, not once a step
    used = sorted({k % len(batches) for k in range(config.steps)})
    looked_up = lookup_rows(graph, (f for k in used for f in the_task.feeds(run, batches[k], config.batch,
                                                                          config.microbatches)))
    graph = dataclasses.replace(graph, lookup_rows=looked_up)
    return local_check(metrics, graph, config.optimizer, settings.engine, room, reporter, settings.activations,
                       settings.lora.base_dtype if settings.lora is not None else "float32", set_up,
                       evaluation_bytes=evaluation, microbatches=config.microbatches,
                       forward_kept_bytes=forward_kept if settings.engine == "mnn" else None,
                       frozen_mapped=on_mapping)


def write_single_device_checkpoint(folder: Path, weights, optimizer_state, graph, meta: dict) -> Path:
    """A one-stage checkpoint folder: the trainable weights (`param/`), the optimizer state (`opt/`)
    and meta.json with the stage's block range, as `runtime.pipeline.checkpoints` writes them."""
    tensors = {f"param/{k}": v for k, v in weights.items() if k in set(graph.params)}
    tensors.update({f"opt/{k}": v for k, v in optimizer_state.items()})
    save_checkpoint(Path(folder), [tensors], {**meta, "stages": 1, "ranges": [[0, len(graph.blocks) - 1]]})
    return Path(folder)
