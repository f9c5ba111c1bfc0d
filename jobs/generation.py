"""`confidant generate`: answers from an exported causal LM (a fine-tuned one's weights given as
`initializers`), on ONNX Runtime (jobs.common.onnx_lm), the chat template applied unless `raw`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from jobs.common.errors import JobError
from jobs.common.onnx_lm import open_lm
from tasks.causal_lm.generate import GenerationSettings, generate_text

__all__ = ["generate"]


def generate(model: Path, prompts: Sequence[str], settings: GenerationSettings = GenerationSettings(),
             raw: bool = False, system: str | None = None, threads: int | None = None,
             initializers: Mapping[str, np.ndarray] | None = None) -> list[str]:
    """`confidant generate`: one answer per prompt (chat template applied unless `raw`)."""
    lm, tokenizer = open_lm(Path(model), initializers, threads)
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
