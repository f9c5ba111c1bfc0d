"""Issue 31: activations recomputed per block on the PyTorch engine. A torch stage told `activations:
per-block` runs each block's forward under a checkpoint of its own (the engine's `_BlockRecompute`,
not `torch.utils.checkpoint`, which imports torch._dynamo): a micro-batch in flight holds its blocks' inputs, and each block's backward
runs that block's forward again. Its gradients are the keep mode's, MNN per-block's and float64
transformers' (LoRA: PEFT's); what autograd holds for a micro-batch in flight is a fraction of the
keep mode's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from support import (S, assert_grads_close, lm_step_feeds, one_f_one_b_gradients, peft_lora_reference,
                     tiny_tied_llama,
                     tiny_lora_graph, token_feeds, transformers_lm_gradients)

B = 2
VOCAB = 256


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny tied Llama (support.tiny_tied_llama), its export and graph."""
    model, path = tiny_tied_llama(tmp_path_factory.mktemp("tpbllama"), VOCAB)
    return model, path, load_model(path, B, S)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("update", [False, True], ids=["flush", "stash"])
def test_torch_per_block_gives_the_gradients_of_keeping_and_of_mnn_per_block(graph, tiny_onnx, lora, update):
    g = tiny_lora_graph(tiny_onnx["torchscript-17"]) if lora else graph
    spec = stage_spec(g, 0, 2)
    kept = one_f_one_b_gradients(make_engine("torch:cpu:t1", spec, activations="keep"), g, spec, update)
    engine = make_engine("torch:cpu:t1", spec, activations="per-block")
    assert isinstance(engine, TorchStageEngine) and engine.per_block
    per_block = one_f_one_b_gradients(engine, g, spec, update)
    mnn = one_f_one_b_gradients(make_engine("mnn:cpu:t1", spec, activations="per-block"), g, spec, update)
    for m in range(4):
        assert per_block[m].keys() == kept[m].keys() == mnn[m].keys()
        for k in kept[m]:
            np.testing.assert_array_equal(per_block[m][k], kept[m][k], err_msg=k)  # the same ops, bit for bit
        assert_grads_close(per_block[m], mnn[m])  # two engines' float32 rounding


def test_a_split_backward_per_block_on_torch_gives_the_gradients_of_one_backward(tiny_onnx):
    g = tiny_lora_graph(tiny_onnx["torchscript-17"])
    spec = stage_spec(g, 1, 2)
    dy = np.random.default_rng(4).standard_normal(g.values[spec.output].shape).astype(np.float32)
    x = np.random.default_rng(5).standard_normal(g.values[spec.activation_input].shape).astype(np.float32)
    feeds = {**token_feeds(B, S, vocab=500), spec.activation_input: x}
    whole = make_engine("torch:cpu:t1", spec, activations="keep")
    whole.forward(feeds, 0)
    want = whole.backward(0, dy)
    split = make_engine("torch:cpu:t1", spec, activations="per-block")
    split.split_backward = True
    split.forward(feeds, 0)
    got = split.backward_input(0, dy)
    got.params.update(split.backward_weight(0))
    assert got.params.keys() == want.params.keys()
    np.testing.assert_allclose(got.activation_input, want.activation_input, rtol=1e-6, atol=1e-7)
    for k in want.params:
        np.testing.assert_allclose(got.params[k], want.params[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _float64_engine(graph, weights=None) -> TorchStageEngine:
    return TorchStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), dtype=torch.float64, weights=weights,
                            per_block=True)


def test_torch_per_block_gradients_of_a_llama_equal_transformers_in_float64(tiny_llama):
    model, _, g = tiny_llama
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    engine = _float64_engine(g)
    engine.forward(feeds, 0)
    got = engine.backward(0).params
    want = transformers_lm_gradients(model, feeds)
    assert set(got) == set(want)
    assert_grads_close(got, want, rtol=1e-5)  # the export's float32 constants (rotary tables)


def test_torch_per_block_lora_gradients_of_a_llama_equal_pefts_in_float64(tiny_llama):
    model, path, _ = tiny_llama
    feeds, loss, lora, weights, want = peft_lora_reference(model, path, B, S, VOCAB)
    engine = _float64_engine(lora, weights={**lora.constants, **weights})
    assert float(engine.forward(feeds, 0)) == pytest.approx(loss, rel=1e-6)
    got = engine.backward(0).params
    assert set(got) == set(want)  # the frozen base gets no gradient
    assert_grads_close(got, want, rtol=1e-5)  # the export's float32 constants (rotary tables)


def _saved_bytes(engine, feeds) -> int:
    """Bytes autograd saves for the backward of one training forward outside any checkpoint (what a
    micro-batch in flight holds beyond its output). A checkpoint's own hooks take the tensors saved
    inside it, so a per-block block's intermediates never reach this one."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward(feeds, 0)
    engine.backward(0)
    return sum(seen.values())


def test_a_per_block_torch_stage_holds_a_fraction_of_the_activations_keeping_holds(tiny_llama):
    _, _, g = tiny_llama
    spec = stage_spec(g, 0, len(g.blocks) - 1)
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    params = sum(int(np.asarray(g.constants[p]).nbytes) for p in g.params)
    kept = _saved_bytes(make_engine("torch:cpu:t1", spec, activations="keep"), feeds) - params
    per_block = _saved_bytes(make_engine("torch:cpu:t1", spec, activations="per-block"), feeds) - params
    hidden = B * S * 64 * 4
    # keeping: every layer's intermediates (dozens of hidden-sized tensors a layer); per block: the
    # inputs of the embedding lookup, the head's norm and the fused loss, a few hidden states
    assert kept > 20 * hidden
    assert per_block < 6 * hidden, (per_block / hidden, kept / hidden)


def test_an_int4_base_per_block_widens_each_weight_once_a_backward_with_keepings_gradients(tiny_llama, monkeypatch):
    """Issue 31 target 6's cost: per block, the forward's re-run inside a block's backward widens each
    int4 weight and its product's backward takes that widening (saved under the checkpoint, dropped
    as each product's backward ends), so a micro-batch widens a product's weight twice (forward and
    re-run), as keeping does where the product's input needs a gradient (forward and backward), not
    three times. The gradients stay keeping's, bit
    for bit, and the loss too."""
    from planner.lora import LoraSettings, add_lora
    from runtime.engines import pytorch as engine_module

    _, path, base = tiny_llama
    graph, _ = add_lora(base, LoraSettings(4, 8.0, ("q", "k", "v", "o"), (), base_dtype="int4"))
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    widened: list[int] = []
    widen = engine_module._FrozenWeight.widen

    def counted(self):
        widened.append(id(self))
        return widen(self)

    monkeypatch.setattr(engine_module._FrozenWeight, "widen", counted)
    runs = {}
    for mode in ("keep", "per-block"):
        widened.clear()
        engine = make_engine("torch:cpu:t1", spec, activations=mode)
        loss = float(engine.forward(feeds, 0))
        grads = engine.backward(0).params
        products = {name: id(w) for name, w in engine._frozen.items() if w.q.storage == "int4"}
        assert len(products) == 14  # 2 layers x 7 projections held int4
        runs[mode] = loss, grads, {name: widened.count(i) for name, i in products.items()}
    (keep_loss, keep_grads, keep_count), (loss, grads, count) = runs["keep"], runs["per-block"]
    # keeping: forward and backward (layer 0's q, k, v forward only: the frozen table's rows need no gradient)
    assert set(keep_count.values()) == {1, 2}
    # per block: the forward and its re-run (3 where the backward widened afresh)
    assert set(count.values()) == {2}, count
    assert loss == keep_loss and grads.keys() == keep_grads.keys()
    for k in grads:
        np.testing.assert_array_equal(grads[k], keep_grads[k], err_msg=k)


_NO_DYNAMO_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
# the planner's and the model hub's libraries, MNN: none is a torch worker's to run
HEAVY = ("onnx", "onnxruntime", "ortools", "google.protobuf", "transformers", "tokenizers", "huggingface_hub",
         "peft", "safetensors", "scipy", "MNN")
import confidant.commands, runtime.pipeline.worker  # what `confidant worker` imports before its first bundle
heavy = ["at start: " + m for m in HEAVY if m in sys.modules]
import numpy as np
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.optim import AdamW
from support import S, one_f_one_b_gradients, tiny_lora_graph, token_feeds

graph = load_model(sys.argv[2], 2, S)
lora = tiny_lora_graph(sys.argv[2])
loaded = set(sys.modules)  # the ONNX files read: what the test needs, not the worker (its bundle is the IR)
spec = stage_spec(graph, 0, 2)
one_f_one_b_gradients(make_engine("torch:cpu:t1", spec, activations="per-block"), graph, spec, update=True)
middle = stage_spec(lora, 1, 2)
feeds = {**token_feeds(2, S, vocab=500), middle.activation_input:
         np.ones(lora.values[middle.activation_input].shape, np.float32)}
dy = np.ones(lora.values[middle.output].shape, np.float32)
engine = make_engine("torch:cpu:t1", middle, activations="per-block")
engine.forward(feeds, 0)
engine.backward_and_step(0, AdamW(lr=1e-3), dy)
engine.split_backward = True
engine.forward(feeds, 1)
engine.backward_input(1, dy)
engine.backward_weight(1)
heavy += ["by training: " + m for m in HEAVY if m in sys.modules and m not in loaded]
print("MODULES " + json.dumps(sorted(m for m in ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy")
                                     if m in sys.modules) + heavy))
"""


def test_a_per_block_torch_worker_s_training_never_imports_dynamo_sympy_or_the_planner_s_libraries(tiny_onnx):
    """A worker recomputing per block on torch (1F1B with an update between, a step inside the
    backward, a split backward over LoRA's anchor) imports neither torch._dynamo nor sympy: the
    engine's own recompute (`_BlockRecompute`) where `torch.utils.checkpoint`'s first call imported
    torch._dynamo and sympy (~41-75 MiB of every per-block torch worker; MEMORY_NOTES.md, helper h110),
    and a scalar seed where a given seed's shape check imported sympy (helper h85). Nor does the
    worker's start (`confidant worker`'s modules) or its training import the planner's, the model
    hub's or MNN's libraries (onnx, onnxruntime, ortools, protobuf, transformers, scipy...): what a
    torch worker holds beyond `import torch` is ~5 MiB (zmq, PyNaCl, the runtime; helper h118)."""
    from support import run_child

    assert run_child(_NO_DYNAMO_CHILD, "MODULES", tiny_onnx["torchscript-17"], timeout=300) == []
