"""The head-split stage engine against the unsplit MNN engine: same loss, same gradients, same
training; plus the attention pattern matcher on both exporters and on a trans_b projection."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from planner.attention import PatternError, annotate_attention, match_attention
from runtime.engines.split.engine import SplitStageEngine
from runtime.optim import make_optimizer
from runtime.engines.stage import stage_spec
from tasks.trainer import accumulate_gradients
from support import assert_grads_close, synthetic_batch, token_feeds  # ROWS = B = 2 rows per micro-batch, S = 12, as here

B, S = 2, 12
BACKENDS = ("mnn:cpu:t1", "torch:cpu:t1")
ALLOCATIONS = [(4, 0), (1, 3), (2, 2)]


def _alloc(counts) -> dict[str, int]:
    return dict(zip(BACKENDS, counts))


@pytest.fixture(scope="module")
def tiny_graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-14"], B, S)


def _with_trans_b(graph):
    """The same model with every Q and V projection stored [out, in] and multiplied with trans_b,
    as the dynamo exporter may write a Linear."""
    nodes, consts = [], dict(graph.constants)
    targets = set()
    for b in graph.blocks:
        if b.kind == "encoder":
            m = match_attention(graph, b)
            targets |= {m.weight_of["Wq"][0], m.weight_of["Wv"][0]}
    for n in graph.nodes:
        if n.op == "MatMul" and n.inputs[1] in targets:
            n = replace(n, attrs={**n.attrs, "trans_b": True})
            consts[n.inputs[1]] = np.ascontiguousarray(graph.constants[n.inputs[1]].T)
        nodes.append(n)
    values = dict(graph.values)
    for t in targets:
        values[t] = replace(values[t], shape=tuple(reversed(values[t].shape)))
    # the planner finds the attention when it lowers a model: lower this one's sites again
    return annotate_attention(replace(graph, nodes=tuple(nodes), constants=consts, values=values))


def test_matcher_finds_every_encoder_attention(tiny_onnx):
    for key in ("torchscript-14", "dynamo-18"):
        graph = load_model(tiny_onnx[key], B, S)
        encoders = [b for b in graph.blocks if b.kind == "encoder"]
        assert len(encoders) == 2
        for b in encoders:
            m = match_attention(graph, b)
            assert m.x == b.inputs[0] and m.mask in b.inputs
            assert len(m.nodes) == 22  # 4 x (MatMul, Add) + 3 x (Reshape, Transpose) + 6 + residual Add
            assert b.attention == m  # lowering recorded it: the device only reads it
        with pytest.raises(PatternError, match="Softmax"):
            match_attention(graph, graph.blocks[3])


def _compare_with_unsplit(graph, counts, blocks=(0, 4)):
    spec = stage_spec(graph, *blocks)
    feeds = token_feeds(B, S, vocab=500)
    rng = np.random.default_rng(1)
    if spec.activation_input:
        feeds[spec.activation_input] = rng.standard_normal(graph.values[spec.activation_input].shape).astype(np.float32)
    ref = MnnStageEngine(spec)
    out_r = ref.forward(feeds, 0)
    grad_out = None if spec.is_last else rng.standard_normal(out_r.shape).astype(np.float32)
    want = ref.backward(0, grad_out)
    with SplitStageEngine(spec, _alloc(counts)) as eng:
        out = eng.forward(feeds, 0)
        got = eng.backward(0, grad_out)
        np.testing.assert_allclose(out, out_r, rtol=1e-5, atol=1e-6)
        assert_grads_close(got.params, want.params, rtol=1e-5)
        if spec.activation_input:
            assert_grads_close({"x": got.activation_input}, {"x": want.activation_input}, rtol=1e-5)
        else:
            assert got.activation_input is None
        assert eng.parameters().keys() == ref.parameters().keys()
    return out, out_r


@pytest.mark.parametrize("counts", ALLOCATIONS, ids=lambda c: f"{c[0]}+{c[1]}")
def test_whole_model_split_equals_unsplit(tiny_graph, counts):
    loss, ref = _compare_with_unsplit(tiny_graph, counts)
    assert abs(float(loss.reshape(-1)[0]) - float(ref.reshape(-1)[0])) <= 1e-5 * abs(float(ref.reshape(-1)[0]))


def test_middle_stage_split_equals_unsplit(tiny_graph):
    """A stage with an activation input and output (blocks 1-2): dx and the output too."""
    _compare_with_unsplit(tiny_graph, (1, 3), blocks=(1, 2))


def test_trans_b_projections_and_shared_constants(tiny_graph, tiny_onnx):
    """Weights stored [out, in] (trans_b) are transposed in and their gradients back; the dynamo
    export shares one constant between many places (all-zero biases), whose gradient is the sum."""
    _compare_with_unsplit(_with_trans_b(tiny_graph), (2, 2))
    _compare_with_unsplit(load_model(tiny_onnx["dynamo-18"], B, S), (1, 3))


def _train(engine, steps: int = 3, microbatches: int = 2) -> list[float]:
    opt, params, losses = make_optimizer("adamw", 1e-3), engine.parameters(), []
    for step in range(steps):
        loss, grads = accumulate_gradients(engine, synthetic_batch(step, microbatches), microbatches, 9)
        params = opt.step(params, grads)
        engine.set_parameters(params)
        losses.append(loss)
    return losses


@pytest.mark.parametrize("counts", [(1, 3), (2, 2)], ids=lambda c: f"{c[0]}+{c[1]}")
def test_training_steps_equal_unsplit(tiny_graph, counts):
    """Flush-style accumulation over 2 micro-batches, AdamW, 3 steps: the same losses, and
    set_parameters re-syncs the split weights (a stale slice would change the later losses)."""
    spec = stage_spec(tiny_graph, 0, len(tiny_graph.blocks) - 1)
    want = _train(MnnStageEngine(spec))
    with SplitStageEngine(spec, _alloc(counts)) as eng:
        got = _train(eng)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[0] != got[-1]


def _attention_update(graph, params: dict, block: int = 2) -> dict:
    """`params` with only the split attention weights of `block` changed: a backward that reads the
    new ones can only come from a backend's slice (every other part keeps its weights)."""
    m = match_attention(graph, graph.blocks[block])
    rng = np.random.default_rng(7)
    out = dict(params)
    for role in ("Wq", "Wk", "Wv", "Wo"):
        name = m.weight_of[role][0]
        out[name] = params[name] + rng.normal(0, 0.05, params[name].shape).astype(np.float32)
    return out


def _gradients_across_an_update(engine, graph, feeds):
    """Two forwards, an update of the attention weights, then both backwards."""
    for m, f in enumerate(feeds):
        engine.forward(f, m)
    engine.set_parameters(_attention_update(graph, engine.parameters()))
    held = engine.stashed_versions()
    grads = [engine.backward(m).params for m in range(len(feeds))]
    return grads, held


def test_backward_after_an_update_uses_the_stashed_slices(tiny_graph):
    """Weight stashing: forwards of micro-batches 0 and 1, an update of block 2's attention weights
    only, then their backwards give the gradients of the old weights (the unsplit engine without
    an update). The MNN heads run in a child process (torch in this one), so this is the child's
    own stash at work: without it (stash_weights=False) the gradients change."""
    spec = stage_spec(tiny_graph, 0, 4)
    feeds = [token_feeds(B, S, vocab=500, seed=s) for s in (0, 1)]
    ref = MnnStageEngine(spec)
    want = []
    for m, f in enumerate(feeds):
        ref.forward(f, m)
        want.append(ref.backward(m).params)
    with SplitStageEngine(spec, _alloc((1, 3))) as eng:
        assert eng.segments[2].attention.placement == {"mnn:cpu:t1": "child", "torch:cpu:t1": "process"}
        got, held = _gradients_across_an_update(eng, tiny_graph, feeds)
        assert held == 1 and eng.stashed_versions() == 0 and eng.version == 1
        for g, w in zip(got, want):
            assert_grads_close(g, w, rtol=1e-5)
        # a forward after the update uses the new weights
        ref.set_parameters(eng.parameters())
        np.testing.assert_allclose(eng.forward(feeds[0], 2), ref.forward(feeds[0], 2), rtol=1e-5)
        eng.backward(2)
    with SplitStageEngine(spec, _alloc((1, 3)), stash_weights=False) as eng:
        got, held = _gradients_across_an_update(eng, tiny_graph, feeds)
        assert held == 0
        with pytest.raises(AssertionError):
            assert_grads_close(got[0], want[0], rtol=1e-5)


def test_pipeline_with_head_split_on_one_stage_equals_single_device(tiny_onnx):
    """A pipeline run with head splitting on one stage gives the same losses as without it (flush
    schedule): 2 worker processes, 1F1B-flush, stage 1's encoder block split 1 + 3 over MNN and
    torch (the torch backend in the worker, the MNN one in a child of it), against single-device
    MNN training, which tests/pipeline/test_pipeline.py shows equals the unsplit pipeline."""
    from jobs.train.pipeline import LocalWorkers, StageChoice, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig

    graph = load_model(tiny_onnx["torchscript-17"], B, S)
    M, steps = 2, 2
    batches = [synthetic_batch(i, M) for i in range(steps)]
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)
    split = (None, StageChoice(head_split=_alloc((1, 3))))
    workers = LocalWorkers.start(2, threads=1)
    try:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, steps, cuts=[2], keys=workers.keys,
                                per_stage=split)
    finally:
        assert workers.wait(60.0) == [0, 0]
    assert result.ranges[1][0] <= 2 <= result.ranges[1][1]  # stage 1 holds an encoder block
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    opt, params, losses = make_optimizer("adamw", 1e-3), engine.parameters(), []
    for step in range(steps):
        loss, grads = accumulate_gradients(engine, batches[step], M, 9)
        params = opt.step(params, grads)
        engine.set_parameters(params)
        losses.append(loss)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    # the key bias's true gradient is zero: AdamW turns float32 noise there into lr-sized steps
    for k, want in engine.parameters().items():
        err = float(np.abs(result.weights[k] - want).max())
        bound = 2 * 1e-3 * steps if k.endswith("attention.self.key.bias") else 1e-4 * float(np.abs(want).max())
        assert err <= bound, f"{k}: {err:.3g} > {bound:.3g}"
