"""`confidant train-local MODEL --task causal-lm`: fine-tune a decoder LLM on one device and score it.

The model is an ONNX causal LM from `confidant export --task causal-lm` (tokenizer.json and
chat_template.json beside it). Training data: JSONL instructions (loss on the answers only) or plain
text (packed rows), `tasks.causal_lm.data`. The evaluation file (JSONL instructions) is scored before and
after training:
- perplexity of its answers, on the training engine itself (the lowered graph's causal-LM loss, so
  no vocabulary-sized logits are made);
- exact match of generated answers (greedy), by generating from the trained weights on ONNX Runtime
  over the exported file (`jobs.common.onnx_lm.evaluate_lm`, its weights replaced by the trained ones;
  LoRA adapters are merged into their base weights first), plus the entity task's JSON scores when
  the answers are its JSON.
`eval_limit` caps how many evaluation conversations are generated for (generation is the slow part).
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import inspect
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Collection, Mapping

import numpy as np

from ir.graph import Graph
from jobs.common.errors import JobError
from jobs.common.lora import base_on_mapping, read_mapped
from jobs.common.memory_check import local_check, machine_room_bytes
from jobs.common.metrics import DeviceFigures, EvalFigures, StepFigures, TrainingMetrics
from jobs.common.report import Reporter, Silent
from jobs.common.settings import TrainingSettings
from jobs.train.start_up import hand_back, torch_start_up
from planner.lora import Adapter, add_lora
from planner.onnx_import import load_model
from planner.onnx_weights import drop_mapped_pages
from planner.targets import most_target_positions
from ir.backend import BackendSpec
from ir.partition import even_ranges
from runtime.engines.factory import make_engine, whole_model_engine
from runtime.engines.stage import stage_spec
from runtime.heap import start_heap
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes
from tasks.causal_lm.data import make_lm_batches
from tasks.causal_lm.evaluation import InstructionScores, engine_nll, ranged_nll
from tasks.causal_lm.generate import GenerationSettings, lm_metadata
from tasks.causal_lm.task import CAUSAL_LM, LmData
from tasks.causal_lm.tokenizer import LmTokenizer, load_lm_tokenizer
from tasks.trainer import TrainConfig, train_steps

ANSWER_TOKENS = 48  # the longest entities-json answer is 37 SmolLM2 tokens with its end token
EVAL_RANGES = 4  # block ranges a pipeline's evaluation runs the perplexity in, one at a time


def lm_tokenizer(model: Path, settings: TrainingSettings) -> LmTokenizer:
    try:
        return load_lm_tokenizer(settings.tokenizer or model)
    except FileNotFoundError as exc:
        raise JobError(str(exc)) from None


def lm_graph(model: Path, settings: TrainingSettings, reporter: Reporter = Silent(), mapped: bool = False
             ) -> tuple[Graph, tuple[Adapter, ...]]:
    """The causal LM lowered at the training shape, with LoRA adapters when the settings ask (and
    the adapters, to merge them back for generation); `mapped`: its weights read-only views onto
    the file (`load_model`'s), for a graph nothing trains in place."""
    graph = load_model(model, settings.batch, settings.seq, loss=CAUSAL_LM.loss, mapped=mapped)
    if settings.lora is None:
        return graph, ()
    try:
        lora, adapters = add_lora(graph, settings.lora)
    except ValueError as exc:
        raise JobError(f"--lora-targets: {exc}") from None
    trainable = sum(int(lora.constants[p].nbytes) for p in lora.params)
    reporter.note(f"LoRA r={settings.lora.rank} alpha={settings.lora.alpha:g} on {len(adapters)} projections "
                  f"({', '.join(sorted({a.role for a in adapters}))}); trainable {trainable / 2**20:.2f} MiB, "
                  f"frozen {sum(b.frozen_bytes for b in lora.blocks) / 2**20:.1f} MiB"
                  + (f" (held {settings.lora.base_dtype})" if settings.lora.base_dtype != "float32" else ""))
    return lora, adapters


def generation_weights(model: Path, graph: Graph, weights: Mapping[str, np.ndarray], adapters, scale: float,
                       unmerged: Collection[str] = ()) -> dict[str, np.ndarray]:
    """The trained weights by the exported file's initializer names (adapters merged into their base
    weights): what ONNX Runtime generates with. Parameters that are no initializer of the file are
    left out (there are none in a `confidant export --task causal-lm` TorchScript file); a file exported
    elsewhere gets its folded transposed copies of them too (`planner.onnx_import.with_folded_copies`).
    Adapters on the bases in `unmerged` are left out, their bases too (`lora_branches` gives them)."""
    out = {p: weights[p] for p in graph.params if p in weights}
    for a in adapters:
        if a.base in unmerged:
            out.pop(a.a, None)
            out.pop(a.b, None)
            continue
        delta = scale * (weights[a.a].astype(np.float64) @ weights[a.b].astype(np.float64))
        base = graph.constants[a.base].astype(np.float64)
        out[a.base] = (base + (delta.T if a.base_transposed else delta)).astype(np.float32)
        out.pop(a.a, None)
        out.pop(a.b, None)
    meta = lm_metadata(model)
    if meta is None:
        # a file exported elsewhere may read a weight through a transposed copy the exporter folded
        # (a tied LM head): that copy must hold the trained weight too
        from planner.onnx_import import initializer_shapes, with_folded_copies

        names = initializer_shapes(model)
        return {k: v for k, v in with_folded_copies(model, out).items() if k in names}
    return {k: v for k, v in out.items() if k in set(meta["weights"])}


def lora_branches(graph: Graph, weights: Mapping[str, np.ndarray], adapters, scale: float
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The trained adapters on bases held (quantized, or float32 arrays) and read transposed ([out, in]) as base name ->
    (A [in, r], scale x B [r, out]) float32: what a held base's copy computes beside the base
    (`jobs.common.onnx_lm.held_quantized_copy`)."""
    from ir.precision import QuantizedTensor

    return {a.base: (np.asarray(weights[a.a], np.float32), (scale * np.asarray(weights[a.b], np.float32)))
            for a in adapters if a.base_transposed and isinstance(graph.constants.get(a.base), (QuantizedTensor, np.ndarray))}


def lm_data(model: Path, data: Path, eval_path: Path | None, settings: TrainingSettings,
            note: Callable[[str], None] | None = None) -> LmData:
    """The causal-LM task's data of a run (`tasks.causal_lm.task.CausalLmTask.read_data`): the
    tokenizer beside `model` (or --tokenizer's), the training rows, the first `settings.eval_limit`
    evaluation conversations."""
    return CAUSAL_LM.read_data(model, data, eval_path, settings.seq, tokenizer=settings.tokenizer,
                               eval_limit=settings.eval_limit, note=note)


def _scores(engine, model: Path, graph: Graph, adapters, settings: TrainingSettings, eval_path: Path, dev_batches,
            pad_id: int, weights: Mapping[str, np.ndarray] | None) -> tuple[float, InstructionScores]:
    """(dev perplexity on `engine`, which holds `weights`, generated answers' scores with them).
    `engine` may be a function `(batches, rows, pad_id) -> NllSum` instead, called once generation is
    done."""
    from jobs.common.onnx_lm import evaluate_lm

    # generation first: its ONNX Runtime sessions are the evaluation's largest part, and the engine's
    # evaluation keeps its activations' caches resident afterwards; the sessions' freed heap is
    # handed back before the engine runs
    scale = settings.lora.scale if settings.lora is not None else 1.0
    # a base held quantized (of a float32 file) generates as the engine holds it: ONNX Runtime over a copy
    # storing that base quantized, not over the float32 file, whose session held its weights twice
    # (SmolLM2 int4: the evaluation's peak 1410 -> 741 MiB; MEMORY_NOTES, helper h78); trained adapters
    # there beside their base, not merged into float32 weights (SmolLM2: q/k/v/o 106 MB; helper h84)
    # a float32 LoRA base the same way, its arrays read in place by the session (ONNX Runtime over the float32
    # file held its weights twice and their transposed copies: SmolLM2's generation 1742 MiB against
    # training's 888; helper h101)
    # a file stored quantized (`export --base-dtype`) too: its base as the file stores it, the adapters beside it
    # (its trained weights merged into float32 initializers, `stored_replaced`, SmolLM2 int4's generation read
    # 1.5 GiB against training's 555 MiB; helper h169)
    float_base = settings.lora is not None and settings.lora.base_dtype == "float32" and _float32_file(model)
    quantized_base = settings.lora is not None and settings.lora.base_dtype != "float32"
    held = graph.constants if (quantized_base or float_base) and lm_metadata(model) is not None else None
    branches = [None if held is None or weights is None else lora_branches(graph, weights, adapters, scale)]
    # lists popped into the call: not kept here, so a held base's copy lets them go once it is written
    merged = [None if weights is None else generation_weights(model, graph, weights, adapters, scale,
                                                               unmerged=set(branches[0] or ()))]
    drop_mapped_pages(graph.constants.values())  # the base weights the merge read (a mapped graph's)
    scores = evaluate_lm(model, eval_path, GenerationSettings(max_new_tokens=ANSWER_TOKENS),
                         batch=max(settings.batch, 8), limit=settings.eval_limit, threads=settings.threads,
                         initializers=merged.pop(), perplexity=False, prepack=False, held=held,
                         branches=branches.pop(), float_base=float_base)
    gc.collect()
    release_free_heap()
    if inspect.isfunction(engine):  # the perplexity's own function: run once generation's sessions are gone
        return engine(dev_batches, settings.batch, pad_id).perplexity, scores
    nll = engine_nll(engine, dev_batches, settings.batch, pad_id)
    return nll.perplexity, scores


def lm_scores(model: Path, settings: TrainingSettings, eval_path: Path, dev_rows, weights: Mapping[str, np.ndarray]
              ) -> tuple[float, InstructionScores]:
    """Dev perplexity and generated answers' scores of trained `weights` (a pipeline's, by name), on
    the whole model lowered at `settings.batch` rows, its perplexity a block range at a time."""
    # the weights mapped from the file, and the engines built only after generation: ONNX Runtime's
    # session and an engine's copy of the model are never held at once (measured on SmolLM2
    # LoRA: a 2393 MiB peak with the engine built first, 1052 of it the engine and the graph's pages)
    graph, adapters = lm_graph(model, settings, mapped=True)
    tokenizer = lm_tokenizer(model, settings)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    every = {**graph.constants, **weights}

    def range_engine(first: int, last: int):
        gc.collect()
        release_free_heap()  # the range before it: its engine's heap handed back
        built = make_engine(BackendSpec.cpu("mnn", settings.threads), stage_spec(graph, first, last), weights=every,
                            cache_activations=False)
        drop_mapped_pages(graph.constants.values())  # the engine holds its own copy
        return built

    def nll(batches, rows: int, pad: int):
        # a block range at a time (a quarter of the blocks): the engine of the whole model held the
        # whole model's weights a second time after generation (SmolLM2 LoRA: 1057 MiB at its build
        # against MNN workers of 600; FAULTS.md)
        ranges = even_ranges(len(graph.blocks), min(EVAL_RANGES, len(graph.blocks)))
        return ranged_nll(range_engine, ranges, batches, rows, pad)

    batches = make_lm_batches(dev_rows, settings.batch, settings.seq, pad_id, shuffle=False)
    return _scores(nll, model, graph, adapters, settings, eval_path, batches, pad_id, weights)


def train_causal_lm(model: Path, data: Path, eval_path: Path | None, settings: TrainingSettings,
                    reporter: Reporter = Silent(), checkpoint: Path | None = None) -> TrainingMetrics:
    """Fine-tune a causal LM on `data` for `settings.steps` steps; perplexity and exact match on
    `eval_path` (JSONL instructions) before and after (module docstring)."""
    from runtime.pipeline.checkpoints import check_checkpoint_target

    if checkpoint is not None:  # before training: a path no checkpoint can be written to loses the run
        check_checkpoint_target(checkpoint)
    # glibc's mmap and trim thresholds fixed at their start before anything of the run is allocated:
    # the evaluation before the steps frees ONNX Runtime's large blocks, which would raise them, and the
    # steps' large blocks then stay resident as free heap under their peak (`runtime.heap.start_heap`)
    start_heap()
    started, room = time.perf_counter(), machine_room_bytes()
    run = lm_data(model, data, eval_path, settings, reporter.note)
    pad_id, dev = run.pad_id, run.dev
    # a base held quantized is read from a mapping of the file, each float32 weight resident only
    # while it is quantized: read into memory first, the set-up held the float32 file beside the
    # quantized base (SmolLM2 int4: 739 MiB against training's 542; `jobs.common.lora.read_mapped`)
    # a float32 base on PyTorch recomputing per block the same: its engine gives each block's pages back after
    # use, one block of the base resident at a time (SmolLM2 LoRA: 848 -> 440 MiB training, helper h155)
    mapped = read_mapped(model, settings.lora, settings.engine, settings.activations)
    # asked before the set-up, not after the run: its walk of the file's header faults the file's pages in
    on_mapping = mapped and base_on_mapping(model, settings.lora, settings.engine, settings.activations)
    graph, adapters = lm_graph(model, settings, reporter, mapped=mapped)
    config = TrainConfig(steps=settings.steps, batch=settings.batch, seq=settings.seq, lr=settings.lr,
                         optimizer=settings.optimizer, seed=settings.seed, threads=settings.threads)
    batches = CAUSAL_LM.batches(run, config.batch, config.seed)
    dev_batches = CAUSAL_LM.dev_batches(run, config.batch)
    before = evaluation = None
    try:
        if dev:
            if settings.engine == "torch":
                # the engine's module (torch with it, 177-185 MiB) imported before the evaluation's start: the
                # set-up holds it and is charged it, so the evaluation's rise may not count it again (the tiny
                # chat Llama on PyTorch per block was charged it twice, 565 MiB against a 437 peak; helper h106)
                importlib.import_module("runtime.engines.pytorch")
            gc.collect()
            release_free_heap()  # the set-up's free heap handed back: the evaluation's rise measured from here
            start = rss_bytes()
            # the evaluation before training as the one after it runs, before the training engine is built:
            # generation with no engine beside it, then the perplexity on an engine of its own over the initial
            # weights (per block), let go before the training engine is built. Beside the training engine it
            # set the run's peak, which the run's measured figure then hid (helper h96)
            before = _scores(_evaluation_nll(graph, settings.engine, config.threads), model, graph, adapters,
                             settings, eval_path, dev_batches, pad_id, None)
            reporter.note(f"dev perplexity {before[0]:.3f}, exact match {before[1].exact_match:.3f} before "
                          "fine-tuning")
            # at least what it rose above its start (VmHWM, never reset: a set-up's earlier peak may count too)
            evaluation = peak_rss_bytes() - start if start is not None else None
            hand_back(settings.engine)
        # full fine-tuning: the engine takes the graph's arrays as its weights (held once, not twice;
        # the graph's parameters then follow training, read `engine.parameters()` for the trained ones)
        engine = whole_model_engine(graph, settings.engine, config.threads, take_weights=settings.lora is None,
                                    activations=settings.activations)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise JobError(f"--engine {settings.engine} needs PyTorch: pip install torch==2.13.0") from None
    if settings.engine == "torch":
        # PyTorch's one-time start-up (a decoder layer's kernels, autograd's engine and buffers, held for the
        # process's life; a profile charges it with the engine, `runtime.profiling.device`) paid once before the
        # set-up is read, so the set-up holds it: the tiny chat Llama's first step rose 113 MiB above the set-up
        # where the step charges 48 (helpers h97, h102, h106)
        torch_start_up(graph, settings.threads, settings.activations,
                       CAUSAL_LM.feeds(run, batches[0], config.batch, 1)[0])
    reporter.note(f"model {Path(model).name}: {len(graph.blocks)} blocks, {graph.param_bytes() / 2**20:.1f} MiB "
                  f"trainable; {len(run.train)} training rows, {len(dev)} eval conversations; engine "
                  f"{settings.engine}, {config.threads} thread(s); setup {time.perf_counter() - started:.1f}s")
    gc.collect()
    release_free_heap()
    # the run's measured figure is its whole life's peak (set-up and evaluations included; VmHWM is started again
    # only before the evaluation after training, the peak before it kept)
    set_up = rss_bytes()  # what the steps start from: the planned figure's measured part (`local_check`)
    reporter.start("train", config.steps)
    result = train_steps(engine, batches, config, 0,
                         on_step=lambda r: reporter.step(r.step, loss=r.loss, **{"tok/s": r.tokens_per_s}),
                         step_feeds=lambda b: CAUSAL_LM.feeds(run, b, config.batch, 1))
    trained = engine.parameters()
    if checkpoint is not None:
        # before the evaluation: the trained weights are on disk whatever the evaluation meets
        _write_checkpoint(checkpoint, trained, result.optimizer_state, graph, {
            "command": "train-local", "model": Path(model).name, "model_path": str(Path(model).resolve()),
            "task": "causal-lm", "labels": [], "schedule": None, "microbatches": 1, "batch": config.batch,
            "seq": config.seq, "optimizer": config.optimizer, "lr": config.lr, "seed": config.seed,
            "step": config.steps, "lora": None if settings.lora is None else asdict(settings.lora)})
        reporter.note(f"wrote checkpoint {checkpoint}")
    after = None
    if dev:
        # the evaluation on an engine of its own without per-op caches, the training engine (its
        # caches, its optimizer's state) let go first: evaluating beside them set the run's peak
        # (SmolLM2 LoRA: 3.4 GB against training's 2.2)
        del engine
        result.optimizer = None
        hand_back(settings.engine)
        # generation with no engine beside it, the perplexity's engine built after it (per block): built
        # first, it stood under the generation's peak (SmolLM2 int4 LoRA: 594-608 MiB against training's
        # 554-559; 540-554 against 550-566 now, helper h89)
        # its own peak read (VmHWM started again here, the whole life's so far kept): read unreset, it could
        # hold the steps' peak, which its charge would then cover whatever the step's charge said (helper h109)
        life = peak_rss_bytes()
        own = reset_peak_rss()
        start = rss_bytes()
        after = _scores(_evaluation_nll(graph, settings.engine, config.threads, trained), model, graph, adapters,
                        settings, eval_path, dev_batches, pad_id, trained)
        # charged too, the larger of the two: the perplexity engine's build after training rises above the one
        # before (SmolLM2 float32 LoRA: 424 MiB against 110, once the generation no longer peaked above both;
        # helper h101); and it rises from what training left above the set-up (SmolLM2 float32 on PyTorch per
        # block: 16-22 MiB), which the set-up does not hold: charged above the set-up, its perplexity's spread
        # (~35 MiB run to run) put it 1.005 over its figure in one run of three (helper h109)
        if start is not None and evaluation is not None:
            evaluation = max(evaluation, peak_rss_bytes() - start)
            if own and set_up is not None:
                evaluation = max(evaluation, peak_rss_bytes() - set_up)
        life = max(life, peak_rss_bytes())
    else:
        life = peak_rss_bytes()  # the whole life's peak: set-up, the evaluation before and the steps
    losses = [s.loss for s in result.steps]
    k = max(1, len(losses) // 5)
    scored = ""
    if after is not None:
        scored = (f"dev perplexity {before[0]:.3f} -> {after[0]:.3f}, exact match {before[1].exact_match:.3f} -> "
                  f"{after[1].exact_match:.3f}; ")
    reporter.note(f"loss {sum(losses[:k]) / k:.4f} (first steps) -> {sum(losses[-k:]) / k:.4f} (last steps); "
                  f"{scored}peak RSS {life / 2**20:.0f} MiB "
                  f"(by the last step {result.peak_rss_bytes / 2**20:.0f}); "
                  f"{sum(s.tokens_per_s for s in result.steps) / len(result.steps):.0f} tokens/s")
    steps = tuple(StepFigures(s.step, s.loss, s.seconds, config.batch / s.seconds if s.seconds > 0 else float("nan"),
                              s.tokens_per_s) for s in result.steps)
    figures = lm_figures(after, before) if after is not None else None
    metrics = TrainingMetrics("train-local", str(model), config.batch, config.seq, steps,
                              (DeviceFigures("this-device", 0, 0, len(graph.blocks) - 1, life),),
                              eval=figures, settings={**asdict(settings), "engine": settings.engine, "task": "causal-lm"})
    # the LM head + loss charged for the most loss targets a micro-batch of this run has, as `plan --data` does
    targets = most_target_positions(f for b in batches for f in CAUSAL_LM.feeds(run, b, config.batch, 1))
    charged = dataclasses.replace(graph, target_positions=targets) if targets is not None else graph
    return local_check(metrics, charged, config.optimizer, settings.engine, room, reporter, settings.activations,
                       settings.lora.base_dtype if settings.lora is not None else "float32", set_up,
                       evaluation_bytes=evaluation,
                       frozen_mapped=on_mapping)


def _float32_file(model: Path) -> bool:
    """Whether `model` stores its weights float32 (not `export --base-dtype`'s quantized storage)."""
    from planner.onnx_quantize import recorded_base_dtype

    return recorded_base_dtype(Path(model)) == "float32"


def _evaluation_nll(graph: Graph, engine: str, threads: int, trained: Mapping[str, np.ndarray] | None = None
                    ) -> Callable:
    """The dev perplexity's function of the trained weights (`_scores` calls it once generation is done):
    an engine of the whole model holding `trained` (None: the graph's own, before training), built only then,
    each block's buffers let go after its forward (per block: what MNN holds for the blocks before it is not
    kept, no per-op caches)."""

    def nll(batches, rows: int, pad_id: int):
        built = whole_model_engine(graph, engine, threads, weights=trained, cache_activations=False,
                                   activations="per-block")
        return engine_nll(built, batches, rows, pad_id)

    return nll


def _write_checkpoint(folder: Path, weights, optimizer_state, graph: Graph, meta: dict) -> Path:
    """The one-stage checkpoint `jobs.train.local.write_single_device_checkpoint` writes (the
    pipeline's format), without importing that module (which dispatches here)."""
    from runtime.pipeline.checkpoints import save_checkpoint

    tensors = {f"param/{k}": v for k, v in weights.items() if k in set(graph.params)}
    tensors.update({f"opt/{k}": v for k, v in optimizer_state.items()})
    save_checkpoint(Path(folder), [tensors], {**meta, "stages": 1, "ranges": [[0, len(graph.blocks) - 1]]})
    return Path(folder)


def lm_figures(after: tuple[float, InstructionScores], before: tuple[float, InstructionScores] | None = None
               ) -> EvalFigures:
    """The metrics document's eval for a causal LM: exact match (before, after), the dev perplexity
    before and after, and the entity task's JSON scores when it is that task (precision and recall
    after; per_type: valid_json, precision, recall, f1 after and each `_before`)."""
    ppl, scores = after
    task = scores.task or {}
    per_type = {k: float(v) for k, v in task.items() if isinstance(v, (int, float))}
    if before is not None and before[1].task:
        per_type.update({f"{k}_before": float(v) for k, v in before[1].task.items() if isinstance(v, (int, float))})
    return EvalFigures(scores.exact_match, task.get("precision"), task.get("recall"),
                       None if before is None else before[1].exact_match, per_type, metric="exact_match",
                       perplexity=ppl, perplexity_before=None if before is None else before[0])
