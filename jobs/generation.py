"""Jobs on an exported causal LM without training it: generate text, score it on instruction data, write
the generated instruction task's files.

The model runs on ONNX Runtime over its exported files (tasks/causal_lm/generate.py); `initializers` (initializer
name -> array) replaces the file's weights, which is how a fine-tuned model is tried before and after
training without writing a new file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from jobs.common.errors import JobError
from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM, generate_text, lm_metadata
from tasks.causal_lm.data import read_instructions
from tasks.causal_lm.evaluation import InstructionScores, evaluate_instructions
from tasks.causal_lm.tokenizer import load_lm_tokenizer

__all__ = ["evaluate_lm", "generate", "write_task_data"]


def _stored_replaced(model: Path, initializers) -> dict[Path, bytes] | None:
    """For a file `export --base-dtype` stored quantized whose stored weights are replaced (trained):
    it and its cache graph as bytes with those weights as plain initializers (ONNX Runtime cannot
    replace a weight that ops compute)."""
    meta = lm_metadata(model) or {}
    if not initializers or not set(meta.get("stored_quantized") or ()) & set(initializers):
        return None
    from planner.onnx_quantize import with_float_weights

    files = [model] + ([model.parent / meta["kv_model"]] if meta.get("kv_model") else [])
    return {f: with_float_weights(f, initializers) for f in files if f.is_file()}


def _open(model: Path, initializers, threads):
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
                          sources=_stored_replaced(model, initializers))
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return lm, tokenizer


def generate(model: Path, prompts: Sequence[str], settings: GenerationSettings = GenerationSettings(),
             raw: bool = False, system: str | None = None, threads: int | None = None,
             initializers: Mapping[str, np.ndarray] | None = None) -> list[str]:
    """`confidant generate`: one answer per prompt (chat template applied unless `raw`)."""
    lm, tokenizer = _open(Path(model), initializers, threads)
    if not raw and tokenizer.template is not None and not tokenizer.has_chat_template:
        raise JobError("this model's chat template moves or rewrites messages and cannot be rendered here: give "
                       "the prompt in the model's own format with --raw")
    if not raw and tokenizer.has_chat_template:
        head = [{"role": "system", "content": system}] if system else []
        chats = [head + [{"role": "user", "content": p}] for p in prompts]
        return generate_text(lm, tokenizer, chats, settings)
    if system:
        raise JobError("--system needs the chat template (drop --raw; a model without a template has none)")
    return generate_text(lm, tokenizer, list(prompts), settings, raw=True)


def evaluate_lm(model: Path, data: Path, settings: GenerationSettings = GenerationSettings(max_new_tokens=48),
                batch: int = 8, limit: int | None = None, threads: int | None = None,
                initializers: Mapping[str, np.ndarray] | None = None) -> InstructionScores:
    """Perplexity and exact match (and the entity task's scores) on a JSONL instruction file, the first
    `limit` conversations of it. The default 48 new tokens fit every entities-json answer (at most 37
    SmolLM2 tokens with its end token); a base model that rambles is cut there."""
    lm, tokenizer = _open(Path(model), initializers, threads)
    conversations = read_instructions(data)[:limit]
    if not conversations:
        raise JobError(f"{data}: no conversations")
    return evaluate_instructions(lm, tokenizer, conversations, settings, batch)


def write_task_data(out_dir: Path, n_train: int = 1000, n_dev: int = 100, seed: int = 0) -> tuple[Path, Path]:
    """`confidant datagen --task entities-json`: the generated instruction task's train/dev JSONL."""
    from tasks.causal_lm.entity_task import write_entity_splits

    return write_entity_splits(out_dir, n_train, n_dev, seed)
