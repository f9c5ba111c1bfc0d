"""Fixtures of the planner's tests of per-stage memory terms (`test_kept_once.py`,
`test_stage_transient.py`): the tiny Llama they price by hand, made once a test session."""
from __future__ import annotations

import pytest

from support import int4_lora_of, tiny_llama_graph

# embeddings, 4 layers, the LM head and its fused loss, lowered at micro-batches of 2 x 12 tokens
TINY_LLAMA_LAYERS, TINY_LLAMA_ROWS, TINY_LLAMA_SEQ = 4, 2, 12


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A randomly initialised Llama of 4 layers, exported without a cache, lowered at 2 x 12."""
    return tiny_llama_graph(tmp_path_factory.mktemp("llama"), TINY_LLAMA_LAYERS, TINY_LLAMA_ROWS, TINY_LLAMA_SEQ)


@pytest.fixture(scope="session")
def tiny_llama_int4_lora(tiny_llama):
    """The same Llama under LoRA on q, k, v, o with its frozen base held int4 (issue 31's plans): the
    tied table frozen, counted by both its readers' blocks."""
    return int4_lora_of(tiny_llama)


@pytest.fixture
def tiny_llama_of(request):
    """The tiny Llama by kind: "full" (every weight trained) or "lora" (int4 LoRA on q, k, v, o)."""
    return lambda kind: request.getfixturevalue("tiny_llama" if kind == "full" else "tiny_llama_int4_lora")
