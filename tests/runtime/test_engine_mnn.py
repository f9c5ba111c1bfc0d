"""The MNN stage engine against independent oracles: ONNX Runtime (forward), PyTorch float64
autograd (gradients) and torch.optim (updates)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from support import token_feeds
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.pytorch import TorchStageEngine
from runtime.optim import SGD, AdamW
from runtime.engines.stage import stage_spec

B, S = 2, 12


def _assert_grads_close(got: dict, ref: dict, rtol: float = 1e-4) -> None:
    assert got.keys() == ref.keys()
    if not ref:
        return
    # A few gradients are exactly zero in exact arithmetic (the key bias: softmax ignores a constant
    # added to a row); float32 leaves ~1e-7 noise there, so errors are measured against the largest
    # gradient of the set as well as against each tensor's own.
    scale = max(float(np.abs(v).max()) for v in ref.values())
    for name, r in ref.items():
        err = float(np.abs(got[name] - r).max())
        bound = rtol * max(float(np.abs(r).max()), 1e-2 * scale)
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def test_mnn_forward_equals_onnxruntime_on_minilm(minilm_onnx):
    graph = load_model(minilm_onnx, B, S)
    feeds = token_feeds(B, S, vocab=30522)
    ref = ort.InferenceSession(str(minilm_onnx)).run(
        None, {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")})[0]
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    logits = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    assert float(np.abs(logits - ref).max()) <= 1e-4


@pytest.fixture(scope="module")
def tiny_graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-14"], B, S)


@pytest.mark.parametrize("blocks", [(0, 0), (1, 1), (3, 3), (4, 4), (0, 4), (2, 4)],
                         ids=["embeddings", "encoder", "head", "loss", "whole-model", "encoder-head-loss"])
def test_mnn_gradients_equal_torch_float64(tiny_graph, blocks):
    spec = stage_spec(tiny_graph, *blocks)
    feeds = token_feeds(B, S, vocab=500)
    rng = np.random.default_rng(1)
    if spec.activation_input:
        feeds[spec.activation_input] = rng.standard_normal(tiny_graph.values[spec.activation_input].shape).astype(np.float32)
    mnn, ref = MnnStageEngine(spec), TorchStageEngine(spec, dtype=torch.float64)
    out_m, out_r = mnn.forward(feeds, 0), ref.forward(feeds, 0)
    np.testing.assert_allclose(out_m, out_r, rtol=1e-4, atol=1e-5)
    grad_out = None if spec.is_last else rng.standard_normal(out_m.shape).astype(np.float32)
    got, want = mnn.backward(0, grad_out), ref.backward(0, grad_out)
    _assert_grads_close(got.params, want.params)
    if spec.activation_input:
        _assert_grads_close({"input": got.activation_input}, {"input": want.activation_input})
    else:
        assert got.activation_input is None


def test_interleaved_microbatches_keep_their_own_activations(tiny_graph):
    """Two forwards before two backwards (what 1F1B does) give each micro-batch its own gradients."""
    spec = stage_spec(tiny_graph, 0, 4)
    a, b = token_feeds(B, S, vocab=500, seed=1), token_feeds(B, S, vocab=500, seed=2)
    engine = MnnStageEngine(spec)
    engine.forward(a, 0)
    engine.forward(b, 1)
    got_b, got_a = engine.backward(1), engine.backward(0)
    ref = TorchStageEngine(spec, dtype=torch.float64)
    ref.forward(a, 0)
    _assert_grads_close(got_a.params, ref.backward(0).params)
    ref.forward(b, 0)
    _assert_grads_close(got_b.params, ref.backward(0).params)
    with pytest.raises(KeyError, match="backward of micro-batch 0 before its forward"):
        engine.backward(0)


def _torch_step(opt_name, params, grads, steps=2):
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    opt = (torch.optim.SGD(tensors.values(), lr=0.1, momentum=0.9, weight_decay=0.01) if opt_name == "sgd"
           else torch.optim.AdamW(tensors.values(), lr=0.01, weight_decay=0.01))
    for g in grads[:steps]:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k], dtype=torch.float64)
        opt.step()
    return {k: t.detach().numpy() for k, t in tensors.items()}


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_optimizer_steps_equal_torch_optim(tiny_graph, opt_name):
    """Two steps with real MNN gradients update the weights exactly as torch.optim does."""
    spec = stage_spec(tiny_graph, 0, 4)
    engine = MnnStageEngine(spec)
    params0 = engine.parameters()
    opt = SGD(lr=0.1, momentum=0.9, weight_decay=0.01) if opt_name == "sgd" else AdamW(lr=0.01, weight_decay=0.01)
    grads_seen = []
    params = {k: v.copy() for k, v in params0.items()}  # the optimizer updates in place
    for step in range(2):
        engine.forward(token_feeds(B, S, vocab=500, seed=step), 0)
        grads = engine.backward(0).params
        grads_seen.append(grads)
        params = opt.step(params, grads)
        engine.set_parameters(params)
    want = _torch_step(opt_name, params0, grads_seen)
    after = engine.parameters()
    for k in want:
        np.testing.assert_allclose(after[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.allclose(after[k], params0[k]) for k in want)


def test_op_caches_change_speed_not_gradients(tiny_graph):
    """Reusing the forward's per-op caches in the backward gives the same gradients as re-running it,
    also when a weight update lands between two steps (the caches must go stale, not be reused)."""
    spec = stage_spec(tiny_graph, 0, 4)
    cached, rerun = MnnStageEngine(spec, cache_activations=True), MnnStageEngine(spec, cache_activations=False)
    for step in range(2):
        feeds = token_feeds(B, S, vocab=500, seed=10 + step)
        grads = []
        for engine in (cached, rerun):
            engine.forward(feeds, 0)
            grads.append(engine.backward(0).params)
        for k in grads[1]:
            np.testing.assert_allclose(grads[0][k], grads[1][k], rtol=1e-6, atol=1e-9, err_msg=k)
        new = {k: v - 0.5 * grads[1][k] for k, v in rerun.parameters().items()}
        cached.set_parameters(new)
        rerun.set_parameters(new)


def test_weight_stashing_runs_each_backward_on_its_forwards_weights(tiny_graph):
    """forward m0, update, forward m1, backward m0: m0's gradients must be those of the old weights
    (PipeDream stashing); without stashing MNN's in-place Vars would silently use the new ones."""
    spec = stage_spec(tiny_graph, 1, 2)
    rng = np.random.default_rng(5)
    act = tiny_graph.values[spec.activation_input].shape
    feeds = [dict(token_feeds(B, S, vocab=500, seed=20 + i), **{spec.activation_input: rng.standard_normal(act).astype(np.float32)})
             for i in range(2)]
    grad_out = rng.standard_normal(act).astype(np.float32)
    ref = TorchStageEngine(spec, dtype=torch.float64)
    results = {}
    for stash in (True, False):
        engine = MnnStageEngine(spec, stash_weights=stash)
        w0 = engine.parameters()
        engine.forward(feeds[0], 0)
        engine.set_parameters({k: v * 0.5 for k, v in w0.items()})
        engine.forward(feeds[1], 1)
        assert engine.stashed_versions() == (1 if stash else 0)
        results[stash] = engine.backward(0, grad_out).params
        assert engine.stashed_versions() == 0
        engine.backward(1, grad_out)
    ref.forward(feeds[0], 0)
    want = ref.backward(0, grad_out).params  # the reference never saw the update
    _assert_grads_close(results[True], want)
    with pytest.raises(AssertionError):
        _assert_grads_close(results[False], want)


def test_a_stashed_backward_leaves_the_current_weights_in_place(tiny_graph):
    """The embedding stage: after a backward on an old version, the lookup table and every other
    weight are the current version again, so the next forward (with no update in between, as with
    --update-every > 1) computes what a fresh engine with the current weights computes."""
    spec = stage_spec(tiny_graph, 0, 1)
    feeds = [token_feeds(B, S, vocab=500, seed=40 + i) for i in range(3)]
    engine = MnnStageEngine(spec, stash_weights=True)
    w0 = engine.parameters()
    new = {k: v * 0.5 + 0.01 for k, v in w0.items()}
    y0 = engine.forward(feeds[0], 0)
    engine.set_parameters(new)
    engine.forward(feeds[1], 1)
    engine.backward(0, np.ones_like(y0))  # on version 0
    got = engine.parameters()
    assert all(np.array_equal(got[k], new[k]) for k in new)
    fresh = MnnStageEngine(spec, weights={**spec.graph.constants, **new})
    assert np.array_equal(engine.forward(feeds[2], 2), fresh.forward(feeds[2], 2))
    # the old version stays intact while it is in flight: a second update keeps micro-batch 1's weights
    engine.set_parameters({k: v * 2 for k, v in new.items()})
    assert engine.stashed_versions() == 1
    engine.backward(1, np.ones_like(y0))
    engine.backward(2, np.ones_like(y0))
    assert engine.stashed_versions() == 0


def test_an_inference_forward_first_still_primes_the_op_caches(tiny_graph):
    """Evaluating before training (F1 before fine-tuning) must not switch the cache reuse off."""
    engine = MnnStageEngine(stage_spec(tiny_graph, 0, 4))
    engine.forward(token_feeds(B, S, vocab=500), train=False, until_block=3)
    assert all(prog._caching for prog in engine._blocks[:4])


@pytest.mark.parametrize("blocks", [(0, 4), (1, 1)], ids=["whole-model", "encoder"])
def test_torch_float32_engine_passes_the_same_gradient_check(tiny_graph, blocks):
    """Every engine meets the same bar: the optional PyTorch engine in float32, like MNN, against
    float64 autograd."""
    spec = stage_spec(tiny_graph, *blocks)
    feeds = token_feeds(B, S, vocab=500)
    rng = np.random.default_rng(3)
    if spec.activation_input:
        feeds[spec.activation_input] = rng.standard_normal(tiny_graph.values[spec.activation_input].shape).astype(np.float32)
    engine, ref = TorchStageEngine(spec, dtype=torch.float32), TorchStageEngine(spec, dtype=torch.float64)
    out = engine.forward(feeds, 0)
    ref.forward(feeds, 0)
    grad_out = None if spec.is_last else rng.standard_normal(out.shape).astype(np.float32)
    _assert_grads_close(engine.backward(0, grad_out).params, ref.backward(0, grad_out).params)
