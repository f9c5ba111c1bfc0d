"""Issue 31 target 3: a local step on PyTorch gives the C library's free heap back after its first backward, as a
pipeline stage does (`runtime.pipeline.executor`'s `_release_heap_once`), whose figures the memory model charges.
Held, the backward's small blocks stood as free heap under the next micro-batch's forward: SmolLM2 LoRA per block,
4 micro-batches of 1 x 128, the step read 1.007-1.015 of its plan (helper h161, benchmarks/MEMORY_NOTES.md).
The reference is glibc's own `malloc_trim`: at the second micro-batch's forward, trimming gives back almost
nothing more."""
from __future__ import annotations

import pytest

from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.procfs import release_free_heap, status_bytes
from support import gc_frozen, lm_step_feeds, tiny_tied_llama
from tasks.trainer import accumulate_feeds

ROWS, SEQ, VOCAB = 8, 64, 256


@pytest.fixture(scope="module")
def llama_graph(tmp_path_factory):
    _, path = tiny_tied_llama(tmp_path_factory.mktemp("heap"), VOCAB)
    return load_model(path, ROWS, SEQ, loss="causal-lm")


def _anon() -> int:
    return status_bytes("RssAnon")


@pytest.mark.parametrize("activations", ["per-block", "keep"])
def test_the_free_heap_is_given_back_before_the_second_micro_batch(llama_graph, activations):
    engine = make_engine("torch:cpu:t1", stage_spec(llama_graph, 0, len(llama_graph.blocks) - 1),
                         activations=activations)
    forward = engine.forward_into
    seen = {}

    def forward_into(feeds, m, into):
        if m == 1:  # what a trim now gives back: the free heap the first backward left resident
            before = _anon()
            release_free_heap()
            seen["left"] = before - _anon()
        return forward(feeds, m, into)

    engine.forward_into = forward_into
    feeds = lm_step_feeds(0, rows=ROWS, seq=SEQ, microbatches=2, vocab=VOCAB)
    with gc_frozen():
        accumulate_feeds(engine, feeds)  # warm: the engine's first step allocates its own state
        # the same step without the trainer's give-back leaves this much for a trim (the reference)
        engine.releases_heap_each_step, was = False, engine.releases_heap_each_step
        accumulate_feeds(engine, feeds)
        held = seen["left"]
        engine.releases_heap_each_step = was
        accumulate_feeds(engine, feeds)
    assert held > 1 << 20, f"the first backward left {held} bytes of free heap: no case to test"
    assert seen["left"] < held / 4, (seen["left"], held)
