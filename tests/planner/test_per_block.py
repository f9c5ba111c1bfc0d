"""Issue 31, lever 3: activations recomputed per block inside a stage. An MNN stage told
`activations: per-block` keeps no per-op caches: its forward holds only each block's input, and its
backward runs block by block from the last, each block's gradient program re-running that block's
forward (nothing of a block outlives its backward but its output). Its gradients are the other
modes' and PyTorch's float64 ones (full and LoRA, a tiny BERT and a tiny Llama); the memory model
charges such a device each block's measured `per_block_stacked` part (a hand-computed figure
below), and the planner picks it for a device too small to recompute with caches."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile
from planner.cluster import DeviceSpec
from planner.cost import activations_of, compute_s, stage_memory_terms
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from support import (S, assert_grads_close, gc_frozen, lm_step_feeds, one_f_one_b_gradients, peft_lora_reference,
                     tiny_tied_llama,
                     single_device_training, synthetic_batch, tiny_lora_graph, token_feeds, transformers_lm_gradients)

MIB = 2 ** 20
B = 2
VOCAB = 256


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny tied Llama (support.tiny_tied_llama), its export and graph."""
    model, path = tiny_tied_llama(tmp_path_factory.mktemp("pbllama"), VOCAB)
    return model, path, load_model(path, B, S)


def _whole(graph, activations, **kw):
    return make_engine("mnn:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), activations=activations, **kw)


# --- the engine ----------------------------------------------------------------------------------------

def test_a_per_block_engine_keeps_only_block_inputs_and_no_per_op_caches(graph):
    engine = _whole(graph, "per-block")
    assert isinstance(engine, MnnStageEngine) and engine.per_block and not engine.cache_activations
    engine.forward(token_feeds(B, S, vocab=500), 0)
    _, _, block_inputs, _, _ = engine._stash[0]
    programs = engine._blocks
    # one stashed input per block (the first block's is the token ids, a host value)
    assert len(block_inputs) == len(programs) and block_inputs[0] is None
    assert all(x.shape == tuple(graph.values[p.block.inputs[0]].shape) for x, p in zip(block_inputs[1:], programs[1:]))
    # each block let go of its buffers after its forward: its input placeholder shrunk, re-fed later
    shrunk = [p for p in programs if getattr(p, "activation", None)]
    assert shrunk and all(list(p.inputs[p.activation].shape)[:-1] == [1, 1] and p.fed_serial is None
                          for p in shrunk)
    engine.backward(0)
    assert not any(getattr(p, "_caching", False) for p in programs)  # no op ever cached its result
    assert all(list(p.inputs[p.activation].shape)[:-1] == [1, 1] for p in shrunk)  # and after its backward
    default = _whole(graph, None)
    default.forward(token_feeds(B, S, vocab=500), 0)
    assert all(p._caching for p in default._blocks if hasattr(p, "_caching"))  # what per-block leaves out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("update", [False, True], ids=["flush", "stash"])
def test_per_block_gives_the_gradients_of_recomputing_with_caches(graph, tiny_onnx, lora, update):
    g = tiny_lora_graph(tiny_onnx["torchscript-17"]) if lora else graph
    spec = stage_spec(g, 0, 2)
    cached = one_f_one_b_gradients(make_engine("mnn:cpu:t1", spec), g, spec, update)
    per_block = one_f_one_b_gradients(make_engine("mnn:cpu:t1", spec, activations="per-block"), g, spec, update)
    for m in range(4):
        assert per_block[m].keys() == cached[m].keys()
        for k in cached[m]:
            np.testing.assert_allclose(per_block[m][k], cached[m][k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_a_split_backward_per_block_gives_the_gradients_of_one_backward(tiny_onnx):
    """Zero bubble's B then W on a per-block LoRA stage: the projections' inputs W multiplies are
    read before each block lets go of its buffers."""
    g = tiny_lora_graph(tiny_onnx["torchscript-17"])
    spec = stage_spec(g, 1, 2)
    dy = np.random.default_rng(4).standard_normal(g.values[spec.output].shape).astype(np.float32)
    x = np.random.default_rng(5).standard_normal(g.values[spec.activation_input].shape).astype(np.float32)
    feeds = {**token_feeds(B, S, vocab=500), spec.activation_input: x}
    whole = make_engine("mnn:cpu:t1", spec)
    whole.forward(feeds, 0)
    want = whole.backward(0, dy)
    split = make_engine("mnn:cpu:t1", spec, activations="per-block")
    split.split_backward = True
    split.forward(feeds, 0)
    got = split.backward_input(0, dy)
    got.params.update(split.backward_weight(0))
    assert got.params.keys() == want.params.keys()
    np.testing.assert_allclose(got.activation_input, want.activation_input, rtol=1e-5, atol=1e-7)
    for k in want.params:
        np.testing.assert_allclose(got.params[k], want.params[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_per_block_gradients_of_a_llama_equal_transformers_in_float64(tiny_llama):
    model, _, g = tiny_llama
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    engine = _whole(g, "per-block")
    engine.forward(feeds, 0)
    got = engine.backward(0).params
    want = transformers_lm_gradients(model, feeds)
    assert set(got) == set(want)
    assert_grads_close(got, want)


def test_per_block_lora_gradients_of_a_llama_equal_pefts_in_float64(tiny_llama):
    """LoRA on q, k, v, o of the tied Llama: each adapter's x·A is recomputed in its block's
    backward like every other activation; the gradients are PEFT's (float64), A and B non-zero."""
    model, path, _ = tiny_llama
    feeds, loss, lora, weights, want = peft_lora_reference(model, path, B, S, VOCAB)
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    engine = _whole(lora, "per-block", weights={**lora.constants, **weights})
    assert float(engine.forward(feeds, 0)) == pytest.approx(loss, rel=1e-5)
    got = engine.backward(0).params
    assert set(got) == set(want)  # the frozen base gets no gradient
    assert_grads_close(got, want)


def test_the_hybrid_is_the_mnn_engines_and_other_values_are_refused(graph):
    spec = stage_spec(graph, 0, 1)
    with pytest.raises(ValueError, match="cached_blocks is the MNN engine's hybrid"):
        make_engine("torch:cpu:t1", spec, activations="per-block+1")
    with pytest.raises(ValueError, match="activations is 'blocks': 'keep', 'recompute', 'per-block', 'per-block[+]K'"):
        make_engine("mnn:cpu:t1", spec, activations="blocks")
    for bad in ("per-block+0", "per-block+", "per-block+01", "per-block+-1"):
        with pytest.raises(ValueError, match="activations is"):
            make_engine("mnn:cpu:t1", spec, activations=bad)


def test_a_pipeline_of_per_block_mnn_stages_trains_as_one_device(graph):
    """1F1B-flush on two MNN stages told to recompute per block: no stage caches an op, and the losses
    are single-device MNN training's (which keeps one micro-batch's caches)."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    M, steps = 4, 2
    batches = [synthetic_batch(i, M) for i in range(steps)]
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60,
                            activations="per-block")
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, steps, cuts=[2],
                                transport=workers.coordinator, faults=FaultPolicy(on_failure="stop"))
        engines = [w.executor.engine for w in workers.workers]
    assert workers.codes == [0, 0], workers.errors
    assert [(e.per_block, e.cache_activations) for e in engines] == [(True, False)] * 2
    losses, _ = single_device_training(graph, batches, steps, M)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


# --- the memory model and the planner's choice -------------------------------------------------------

def _mnn_profile(graph) -> DeviceProfile:
    """mnn:cpu:t1 only: every block 10 ms forward, 30 ms backward (10 of them its forward's re-run),
    a workspace of 40 MiB of which 24 stay per further block with per-op caches and 16 more per
    further micro-batch kept; recomputing per block, a workspace of 30 MiB of which 2 stay."""
    costs = {block_signature(b): BlockCost(0.010, 0.030, recompute_s=0.010, workspace_bytes=40 * MIB,
                                           stacked_bytes=24 * MIB, kept_bytes=16 * MIB,
                                           per_block_workspace_bytes=30 * MIB, per_block_stacked_bytes=2 * MIB)
             for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("mnn:cpu:t1", costs),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def test_the_memory_models_activation_and_workspace_terms_against_a_hand_computed_figure(graph):
    """Stage 0 of 2 under GPipe with 4 micro-batches (4 in flight), blocks 1-3 of the tiny BERT (its
    three inputs are hidden states of 2 x 12 x 64 float32: 6144 bytes each). By hand:
    keep:      activations 4 x 3 x 6144 + (4 - 1) x 3 x 16 MiB, workspace 3 x 24 MiB + (40 - 24) MiB
    recompute: activations 4 x 3 x 6144,                        workspace 3 x 24 MiB + (40 - 24) MiB
    per-block: activations 4 x 3 x 6144,                        workspace 3 x 2 MiB  + (30 - 2) MiB"""
    hidden = B * S * 64 * 4
    assert [graph.blocks[k].activation_bytes for k in (0, 1, 2)] == [hidden] * 3
    terms = {}
    for choice in ("keep", "recompute", "per-block"):
        device = DeviceSpec("a", "tcp://x:1", _mnn_profile(graph), 4 << 30, activations=choice)
        assert activations_of(device) == choice
        terms[choice] = stage_memory_terms(graph, device, 1, 3, 0, 2, "gpipe", 4, "adamw")
    stashed = 4 * 3 * hidden
    assert terms["keep"].activation_bytes == stashed and terms["keep"].kept_activation_bytes == 3 * 3 * 16 * MIB
    assert terms["recompute"].activation_bytes == terms["per-block"].activation_bytes == stashed
    assert terms["recompute"].kept_activation_bytes == terms["per-block"].kept_activation_bytes == 0
    assert terms["keep"].workspace_bytes == terms["recompute"].workspace_bytes == 3 * 24 * MIB + 16 * MIB
    assert terms["per-block"].workspace_bytes == 3 * 2 * MIB + 28 * MIB
    others = [{k: v for k, v in t.by_name().items() if k not in ("activations", "activations kept", "workspace")}
              for t in terms.values()]
    assert others[0] == others[1] == others[2]


def test_recomputing_per_block_never_skips_the_forward_re_run(graph):
    n = len(graph.blocks)
    default = DeviceSpec("a", "tcp://x:1", _mnn_profile(graph), 4 << 30)
    per_block = DeviceSpec("a", "tcp://x:1", _mnn_profile(graph), 4 << 30, activations="per-block")
    # a backward that follows its forward reuses the forward's caches, unless there are none
    assert compute_s(graph, default, 0, n - 1, reuse=True) == pytest.approx((0.010 * n, 0.020 * n))
    assert compute_s(graph, per_block, 0, n - 1, reuse=True) == pytest.approx((0.010 * n, 0.030 * n))


def test_the_planner_recomputes_per_block_only_where_nothing_faster_fits(graph, tiny_onnx, tmp_path, capsys):
    """One MNN device, 4 micro-batches of the tiny BERT (5 blocks). Under GPipe (4 in flight) keeping
    needs 100 + 5 x 24 + 16 + 3 x 5 x 16 MiB (and the weights), recomputing with caches 100 + 5 x 24
    + 16, per block 100 + 5 x 2 + 28: a roomy budget keeps; in 300 MiB both recomputations fit and
    cost the same re-run (no backward follows its own forward), so the leaner, per block, is taken.
    Under 1F1B one device's every backward follows its forward (one in flight): with caches it skips
    the re-run, so 300 MiB keeps them (or recomputes with caches: the same here), and only 200 MiB
    recomputes per block, keeping the caches of as many last blocks as the rest of its budget holds."""
    from confidant.commands import show_plan
    from ir.bundle import load_bundle_dir
    from jobs.planning import PlanSettings, plan_model

    _mnn_profile(graph).save(tmp_path / "box.json")
    got = {}
    for schedule, budget in (("gpipe", "2GiB"), ("gpipe", "300MiB"), ("1f1b-flush", "300MiB"),
                             ("1f1b-flush", "200MiB")):
        (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
            {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": budget}]}))
        out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json",
                         PlanSettings(schedule=schedule, batch=B * 4, seq=S, microbatches=4, time_limit_s=5.0),
                         tmp_path / f"plan-{schedule}-{budget}")
        (device,) = json.loads((out / "plan.json").read_text())["devices"]
        got[schedule, budget] = (device["activations"], device["memory_bytes"], out)
    assert [a for a, _, _ in got.values()][:2] == ["keep", "per-block"]
    assert got["1f1b-flush", "300MiB"][0] in ("keep", "recompute")  # the same time and memory with one in flight
    # per block, its spare ~62 MiB (200 less 100 + 5 x 2 + 28 and the weights) filled with the caches of
    # its last 2 blocks (22 MiB each: 24 with caches less 2 per block), as every backward follows its forward
    assert got["1f1b-flush", "200MiB"][0] == "per-block+2"
    lean = got["1f1b-flush", "200MiB"]
    assert lean[1] <= 200 * MIB < got["1f1b-flush", "300MiB"][1]
    assert load_bundle_dir(lean[2] / "box").stage_doc.activations == "per-block+2"
    capsys.readouterr()
    show_plan(lean[2])
    assert "mnn (per-block+2)" in capsys.readouterr().out


def test_one_high_peak_is_charged_once_per_stage_not_per_further_block(graph, monkeypatch):
    """The profile's per-block line over real peaks of stages of one and two encoder layers, one of
    the two-layer peaks made 64 MiB higher (a peak landing high now and then, as SmolLM2's do by
    ~10 MiB: one peak per length made 0.3, 5.4 and 0.4 MiB a further layer in three profiles, the
    5.4 charging a 15-layer stage 76 MiB it never used). What a further block adds comes from the
    steady peaks; the high one is charged once, in the workspace (a worker may meet it too)."""
    import runtime.profiling.device as dev
    from ir.backend import parse_backend
    from runtime.profiling.inputs import synthetic_feeds

    real = dev.peak_workspace
    raised = []

    def one_high(backend, spec, feeds, activations=None):
        got = real(backend, spec, feeds, activations)
        if activations == "per-block" and spec.last_block > spec.first_block and not raised:
            raised.append(got + 64 * MIB)
            return raised[0]
        return got

    monkeypatch.setattr(dev, "peak_workspace", one_high)
    layer = next(b for b in graph.blocks
                 if b.index + 1 < len(graph.blocks) and block_signature(graph.blocks[b.index + 1]) == block_signature(b))
    with gc_frozen():  # its collections walk only what the measurement makes (as in `profile_device`)
        cost = dev.measure_block(parse_backend("mnn:cpu:t1"), graph, layer, synthetic_feeds(graph, 0), reps=1)
    assert raised, "no two-layer per-block peak was measured"
    assert cost.per_block_stacked_bytes is not None and cost.per_block_stacked_bytes < 8 * MIB
    # the high peak is still covered: a two-layer stage is charged at least what it peaked at
    assert cost.per_block_workspace_bytes + cost.per_block_stacked_bytes >= raised[0]


# --- PyTorch recomputing per block: measured by `profile`, charged and picked as MNN's --------------------

def _torch_profile(graph, per_block: bool = True, fresh: bool = True) -> DeviceProfile:
    """torch:cpu:t1 only: every block 10 ms forward, 20 ms backward keeping (autograd's saved tensors),
    35 ms recomputing per block (its forward re-run under a checkpoint, measured); a workspace of 40 MiB
    of which 24 stay per further block and 16 more per further micro-batch kept; per block, 30 MiB of
    which 2 stay. `per_block=False`: a profile from before `profile` measured PyTorch per block;
    `fresh=False`: one that measured its lines in the warm profiling process (`BackendProfile.fresh_lines`)."""
    more = dict(per_block_workspace_bytes=30 * MIB, per_block_stacked_bytes=2 * MIB,
                per_block_backward_s=0.035) if per_block else {}
    costs = {block_signature(b): BlockCost(0.010, 0.020, workspace_bytes=40 * MIB, stacked_bytes=24 * MIB,
                                           kept_bytes=16 * MIB, **more)
             for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("torch:cpu:t1", costs, fresh_lines=fresh),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def test_torch_per_block_is_charged_its_measured_parts_and_keepings_backward_with_the_re_run(graph):
    """Stage 0 of 2 under GPipe with 4 micro-batches, blocks 1-3 (as the MNN figure above): recomputing
    per block on PyTorch holds 3 x 2 MiB + (30 - 2) MiB of workspace and no kept copies, and its
    backward is keeping's 20 ms a block and the forward's 10 once more (its re-run), as the whole
    stage's recompute, not the 35 the profile timed (`planner.cost.per_block_rerun_s`: structural, the
    timing's noise no part of the plan; tests/planner/test_recompute_time.py). The embedding block (a
    lookup) runs as it is: no re-run. A profile without the measurement prices it the same."""
    from planner.cost import block_costs

    hidden = B * S * 64 * 4
    terms, times = {}, {}
    for choice in ("keep", "recompute", "per-block"):
        device = DeviceSpec("a", "tcp://x:1", _torch_profile(graph), 4 << 30, activations=choice)
        terms[choice] = stage_memory_terms(graph, device, 1, 3, 0, 2, "gpipe", 4, "adamw")
        times[choice] = compute_s(graph, device, 1, 3)
    assert terms["per-block"].activation_bytes == 4 * 3 * hidden and terms["per-block"].kept_activation_bytes == 0
    assert terms["per-block"].workspace_bytes == 3 * 2 * MIB + 28 * MIB
    assert terms["recompute"].workspace_bytes == 3 * 24 * MIB + 16 * MIB
    assert times["keep"] == pytest.approx((0.030, 0.060))
    assert times["recompute"] == pytest.approx((0.030, 0.090))
    assert times["per-block"] == pytest.approx((0.030, 0.090))
    device = DeviceSpec("a", "tcp://x:1", _torch_profile(graph), 4 << 30, activations="per-block")
    assert [c.recompute_s for c in block_costs(graph, device)] == pytest.approx([0.0] + [0.010] * (len(graph.blocks) - 1))
    unmeasured = DeviceSpec("a", "tcp://x:1", _torch_profile(graph, per_block=False), 4 << 30, activations="per-block")
    assert compute_s(graph, unmeasured, 1, 3) == pytest.approx((0.030, 0.090))


def test_torch_per_block_is_offered_only_from_a_profile_that_measured_its_lines_as_a_fresh_worker_runs(graph):
    """Measured and charged (above), offered by the planner only where the profile measured the per-layer
    lines in fresh child interpreters (`BackendProfile.fresh_lines`): a fresh PyTorch worker grows more a
    further layer recomputing per block than the warm profiling process measured, and those plans ran
    over their figure (planner.cost.ENGINE_ACTIVATIONS). There recomputing the stage is the leanest."""
    from planner.cost import leanest_activations, offers_activations

    device = DeviceSpec("a", "tcp://x:1", _torch_profile(graph), 4 << 30)
    assert offers_activations(device, "per-block") and leanest_activations(device) == "per-block"
    for profile in (_torch_profile(graph, fresh=False), _torch_profile(graph, per_block=False)):
        device = DeviceSpec("a", "tcp://x:1", profile, 4 << 30)
        assert not offers_activations(device, "per-block") and leanest_activations(device) == "recompute"


def test_torch_per_block_charges_what_a_further_micro_batch_s_checkpoints_hold_as_measured(graph):
    """A PyTorch stage recomputing per block holds more of each further micro-batch in flight than its
    block inputs (SmolLM2 int4, 12 layers, 1 x 128, fresh processes: 157 / 178 / 196 MiB with 1 / 2 / 3
    in flight, ~1.6 MiB a layer against a 0.28 MiB input): `BlockCost.per_block_kept_bytes` is charged
    once per further micro-batch in flight, as keeping's kept bytes are; a profile without it, nothing."""
    from dataclasses import replace as _replace

    profile = _torch_profile(graph)
    backend = profile.backends[0]
    measured = _replace(profile, backends=(_replace(backend, blocks={
        k: _replace(c, per_block_kept_bytes=3 * MIB) for k, c in backend.blocks.items()}),))
    # stage 0 of 2 under 1F1B with 4 micro-batches: 2 in flight
    charged = {name: stage_memory_terms(graph, DeviceSpec("a", "tcp://x:1", p, 4 << 30, activations="per-block"),
                                        1, 3, 0, 2, "1f1b-flush", 4, "adamw")
               for name, p in (("measured", measured), ("unmeasured", profile))}
    assert charged["measured"].kept_activation_bytes == 3 * 3 * MIB * (2 - 1)
    assert charged["unmeasured"].kept_activation_bytes == 0
    assert charged["measured"].total - charged["unmeasured"].total == 9 * MIB
