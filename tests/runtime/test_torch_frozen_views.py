"""Issue 31 target 3: a PyTorch stage on a float base holds its frozen weights once. The engine reads
each frozen float32 constant through a view of the graph's own array (`torch.from_numpy`), read-only
(mapped) arrays included, where it used to copy each (`torch.tensor`: 72 MiB of a 516 MiB per-block
stage, benchmarks/MEMORY_NOTES.md). The views change no figure of training: losses and gradients
equal the copying engine's bit for bit, and the graph's arrays are unchanged by the steps."""
from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from ir.precision import QuantizedTensor
from planner.lora import LoraSettings
from planner.onnx_import import load_model
from runtime.engines import pytorch as torch_engine
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss
from support import lm_step_feeds, lm_train, tiny_tied_llama

VOCAB = 32768  # hidden 64: an 8 MiB float32 table, well above an engine build's RSS noise
B, SEQ = 2, 12


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """The tiny tied Llama under LoRA r=4 on q, k, v, o over a float32 base, its frozen arrays read-only
    (as a worker's mapped weights are)."""
    from jobs.common.lora import adapted

    _, path = tiny_tied_llama(tmp_path_factory.mktemp("frozenviews"), VOCAB)
    g = adapted(load_model(path, B, SEQ), LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0,
                                                      base_dtype="float32"))
    constants = {}
    for k, v in g.constants.items():
        if k not in g.params and isinstance(v, np.ndarray):
            v = np.array(v)
            v.flags.writeable = False
        constants[k] = v
    return replace(g, constants=constants)


def _frozen_floats(graph, spec) -> dict[str, np.ndarray]:
    read = {i for n in spec.compute_nodes for i in n.inputs}
    return {k: v for k, v in graph.constants.items() if k in read and k not in graph.params
            and not isinstance(v, QuantizedTensor) and v.dtype == np.float32}


def test_a_float_bases_frozen_weights_are_views_of_the_graphs_arrays(graph):
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    frozen = _frozen_floats(graph, spec)
    frozen_bytes = sum(v.nbytes for v in frozen.values())
    assert frozen_bytes >= VOCAB * 64 * 4 and all(not v.flags.writeable for v in frozen.values())
    release_free_heap()
    assert reset_peak_rss()
    before = peak_rss_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only arrays' warning is silenced where the view is made
        engine = make_engine("torch:cpu:t1", spec, take_weights=True)
    rise = peak_rss_bytes() - before
    # the copy took the frozen bytes and more; the views take a fraction of them (the engine's own state)
    assert rise < frozen_bytes / 2, (rise / 2 ** 20, frozen_bytes / 2 ** 20)
    for k, v in frozen.items():
        assert np.shares_memory(engine._consts[k].numpy(), v), k


def test_the_views_train_as_the_copies_do_and_leave_the_base_unchanged(graph, monkeypatch):
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    frozen = {k: v.copy() for k, v in _frozen_floats(graph, spec).items()}
    feeds = lambda step: lm_step_feeds(step, rows=B, seq=SEQ, vocab=VOCAB)  # noqa: E731
    viewed = make_engine("torch:cpu:t1", spec)
    losses = lm_train(viewed, feeds, 3)
    with monkeypatch.context() as m:
        m.setattr(torch_engine, "_frozen_tensor",  # the engine before: a copy of every frozen constant
                  lambda v, dtype, _np: torch.tensor(v, dtype=dtype if v.dtype.kind == "f" else torch.int64))
        copied = make_engine("torch:cpu:t1", spec)
    assert not any(np.shares_memory(copied._consts[k].numpy(), graph.constants[k]) for k in frozen)
    assert lm_train(copied, feeds, 3) == losses
    for k, v in viewed.parameters().items():
        np.testing.assert_array_equal(v, copied.parameters()[k], err_msg=k)
    for k, v in frozen.items():
        np.testing.assert_array_equal(graph.constants[k], v, err_msg=k)
