"""Issue 31 target 4 on MNN: a per-block LoRA stage whose float32 base is read mapped from the model file
(`load_model(..., mapped=True)`) holds the frozen weights of `stream_sets` blocks, not all of them
(`runtime.engines.mnn._FrozenStream`): each block's are written into placeholders it shares with the
other blocks of its set just before it runs, and the mapping's pages given back. Its losses and
gradients are the resident engine's (the same MNN ops over the same values), also where the shared
placeholders are rewritten between a micro-batch's forward and its backward; its fresh process peaks
below the resident one's by most of the frozen bytes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from support import lm_step_feeds, lm_train, made_once, run_child, streamed_llama

ROWS, SEQ, VOCAB = 2, 12, 256
LORA = ("q", "k", "v", "o")


@pytest.fixture(scope="module")
def llama_onnx(export_dir):
    return made_once(export_dir / "streamed-llama", streamed_llama) / "m.onnx"


def _lora_graph(path, mapped: bool):
    from jobs.common.lora import adapted
    from planner.lora import LoraSettings

    graph = adapted(load_model(path, ROWS, SEQ, loss="causal-lm", mapped=mapped),
                    LoraSettings(4, 8.0, targets=LORA, train_also=(), seed=0))
    rng = np.random.default_rng(9)  # every B non-zero: the adapters' and inputs' gradients carry signal
    constants = dict(graph.constants)
    for p in graph.params:
        if p.endswith(".lora_B"):
            constants[p] = rng.normal(0, 0.05, constants[p].shape).astype(np.float32)
    return replace(graph, constants=constants)


def _engine(graph, **options) -> MnnStageEngine:
    return MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), per_block=True, **options)


def _feeds(step):
    return lm_step_feeds(step, ROWS, SEQ, 2, VOCAB)


@pytest.mark.parametrize("sets", [1, 2])
def test_a_streamed_base_trains_as_the_resident_one(llama_onnx, sets):
    """Two AdamW steps (2 micro-batches each), then forwards of two micro-batches before their backwards
    (F0 F1 B0 B1: the placeholders every block shares with 11 or 5 others are rewritten between each
    forward and its backward): the losses, the trained adapters and the gradients are the resident
    engine's bit for bit. One set for all 12 layers and two (6 a set)."""
    resident = _engine(_lora_graph(llama_onnx, mapped=False))
    streamed = _engine(_lora_graph(llama_onnx, mapped=True), stream_sets=sets)
    assert resident._stream is None and streamed._stream is not None
    held = [b for b in streamed._blocks if getattr(b, "streamed", None)]
    assert len(held) == 12 and all(len(b.streamed) == 7 for b in held)  # q k v o gate up down of every layer
    assert len({id(v) for b in held for v, _ in b.streamed}) == 7 * sets  # shared by the blocks of a set
    assert lm_train(streamed, _feeds, 2) == lm_train(resident, _feeds, 2)
    trained = resident.parameters()
    assert streamed.parameters().keys() == trained.keys()
    for k, v in streamed.parameters().items():
        np.testing.assert_array_equal(v, trained[k], err_msg=k)
    grads = []
    for engine in (resident, streamed):
        feeds = _feeds(5)
        for m in (0, 1):
            engine.forward(feeds[m], m)
        grads.append([engine.backward(m).params for m in (0, 1)])
    for m in (0, 1):
        assert grads[1][m].keys() == grads[0][m].keys()
        for k in grads[0][m]:
            np.testing.assert_array_equal(grads[1][m][k], grads[0][m][k], err_msg=k)


PEAK_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests/runtime")
from runtime.procfs import peak_rss_bytes
import test_mnn_streamed_frozen as t
graph = t._lora_graph(sys.argv[2], mapped=sys.argv[3] == "mapped")
frozen = sum(int(v.nbytes) for k, v in graph.constants.items()
             if k not in graph.params and getattr(v, "ndim", 0) == 2 and "embed" not in k)
engine = t._engine(graph, stream_sets=1)
t.lm_train(engine, t._feeds, 1)
print("PEAK", json.dumps({"peak": peak_rss_bytes(), "frozen": frozen, "streamed": engine._stream is not None}))
"""


def test_a_streamed_base_peaks_below_the_resident_one_by_most_of_its_frozen_bytes(llama_onnx):
    """Fresh processes (whole life, lowering included), one AdamW step: the mapped graph's per-block
    engine, one set of placeholders, peaks below the same graph read into memory by at least 60% of
    the 12 layers' 71 MiB of frozen projections (it holds one layer's 5.9 MiB of them). Before the
    stream both held every frozen weight as an MNN constant (the mapped run's file pages on top)."""
    resident = run_child(PEAK_CHILD, "PEAK", llama_onnx, "resident")
    streamed = run_child(PEAK_CHILD, "PEAK", llama_onnx, "mapped")
    assert resident["frozen"] > 70 << 20
    assert resident["peak"] - streamed["peak"] > 0.6 * resident["frozen"], (resident, streamed)
