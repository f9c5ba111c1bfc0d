"""An exported causal LM run on ONNX Runtime over its files (tasks/causal_lm/generate.py), as the jobs
that use one open it: `confidant generate` (jobs.generation) and training's before/after scores
(jobs.train.causal_lm). `initializers` (initializer name -> array) replaces the file's weights, which is
how a fine-tuned model is tried before and after training without writing a new file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from jobs.common.errors import JobError
from tasks.causal_lm.data import read_instructions
from tasks.causal_lm.evaluation import InstructionScores, evaluate_instructions
from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM, lm_metadata
from tasks.causal_lm.tokenizer import load_lm_tokenizer

__all__ = ["evaluate_lm", "open_lm", "stored_replaced"]


def stored_replaced(model: Path, initializers) -> dict[Path, bytes] | None:
    """For a file `export --base-dtype` stored quantized whose stored weights are replaced (trained):
    it and its cache graph as bytes with those weights as plain initializers (ONNX Runtime cannot
    replace a weight that ops compute)."""
    meta = lm_metadata(model) or {}
    if not initializers or not set(meta.get("stored_quantized") or ()) & set(initializers):
        return None
    from planner.onnx_quantize import with_float_weights

    files = [model] + ([model.parent / meta["kv_model"]] if meta.get("kv_model") else [])
    return {f: with_float_weights(f, initializers) for f in files if f.is_file()}


def open_lm(model: Path, initializers, threads, prepack: bool = True):
    """The exported LM at `model` on ONNX Runtime (its weights replaced by `initializers`) and its tokenizer."""
    if not model.is_file():
        raise FileNotFoundError(f"{model}: no such ONNX file")
    try:
        tokenizer = load_lm_tokenizer(model)
    except FileNotFoundError as exc:
        raise JobError(str(exc)) from None
    try:
        shapes = None
        if initializers and model.is_file() and lm_metadata(model) is None:
            # a file exported elsewhere: replacement weights are checked against its own initializers
            from planner.onnx_import import initializer_shapes

            shapes = initializer_shapes(model)
        lm = OnnxCausalLM(model, initializers, threads, weight_shapes=shapes,
                          sources=stored_replaced(model, initializers), prepack=prepack)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return lm, tokenizer


def evaluate_lm(model: Path, data: Path, settings: GenerationSettings = GenerationSettings(max_new_tokens=48),
                batch: int = 8, limit: int | None = None, threads: int | None = None,
                initializers: Mapping[str, np.ndarray] | None = None, perplexity: bool = True,
                prepack: bool = True) -> InstructionScores:
    """Perplexity and exact match (and the entity task's scores) on a JSONL instruction file, the first
    `limit` conversations of it. The default 48 new tokens fit every entities-json answer (at most 37
    SmolLM2 tokens with its end token); a base model that rambles is cut there. `perplexity` False:
    the answers generated and scored only (`InstructionScores.perplexity` None), so ONNX Runtime holds
    one session (the cache graph's), never the whole-sequence graph's beside it; `prepack` False: no
    pre-packed copy of the weights (`OnnxCausalLM`)."""
    lm, tokenizer = open_lm(Path(model), initializers, threads, prepack)
    conversations = read_instructions(data)[:limit]
    if not conversations:
        raise JobError(f"{data}: no conversations")
    return evaluate_instructions(lm, tokenizer, conversations, settings, batch, perplexity)
