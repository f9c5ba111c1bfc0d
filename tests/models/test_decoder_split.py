"""The head splitter on decoders (issue 11): the lowering places the attention of pre-norm decoder
blocks (Llama: RMSNorm, rotary embeddings, grouped-query heads, no biases; GPT-2: LayerNorm, one
fused QKV projection cut by Slices, biases, Gemm reshapes), from both exporters; the split engine
gives the unsplit engine's loss, gradients and training with the key/value group as the unit;
the profiler times the attention per key/value group; a plan records a split of key/value groups
and a worker trains from its bundle; a pipeline of worker processes with a split stage and the
tied embedding across stages equals one device.

The models are jobs/export/llm.py's tiny seeded random Llama (4 query heads on 2 key/value heads)
and GPT-2 (4 heads)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from ir.graph import AttentionSite, block_signature
from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from planner.attention import PatternError, match_attention
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.split.engine import SplitStageEngine
from runtime.engines.stage import stage_spec
from support import Lazy, assert_grads_close, lm_single_device, lm_step_feeds, lm_train

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, S = 2, 12
ROWS, M, STEPS = B, 2, 3  # rows per micro-batch, micro-batches per step, steps
BACKENDS = ("mnn:cpu:t1", "torch:cpu:t1")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(family, exporter) -> the ONNX file of that family's tiny random model, exported on first use
    (the dynamo exports only for the slow tier's tests)."""
    root = tmp_path_factory.mktemp("decoder-split")

    def export(key):
        family, exporter = key
        options = LlmExportOptions(opset=18, dynamo=True) if exporter == "dynamo" else LlmExportOptions()
        return export_causal_lm(random_causal_lm(family), root / family / f"{exporter}.onnx", options,
                                kv_cache=False)

    return Lazy(export)


@pytest.fixture(scope="module")
def graphs(exports):
    return Lazy(lambda key: load_model(exports[key], B, S))


EXPORTERS = ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)]


def _step_feeds(step: int) -> list[dict[str, np.ndarray]]:
    return lm_step_feeds(step, ROWS, S, M)


def _alloc(counts) -> dict[str, int]:
    return {b: c for b, c in zip(BACKENDS, counts)}


# --- the lowering places the attention -------------------------------------------------------------

@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_lowering_places_every_llama_attention(graphs, exporter):
    graph = graphs["llama", exporter]
    decoders = [b for b in graph.blocks if b.kind == "decoder"]
    assert len(decoders) == 2
    for b in decoders:
        site = b.attention
        assert site is not None and site == match_attention(graph, b)
        assert (b.heads, b.kv_heads, b.head_size, b.split_units) == (4, 2, 16, 2)
        assert sorted(site.weight_of) == ["Wk", "Wo", "Wq", "Wv", "norm_w"]  # no biases
        assert all(cols is None for cols in site.columns_of.values())
        assert site.norm == "RMSNorm" and site.norm_epsilon == pytest.approx(1e-5)
        assert site.rotary is not None and all(t in graph.constants for t in site.rotary)
        assert site.scale == pytest.approx(0.25) and site.mask in b.inputs and site.x == b.inputs[0]
        assert AttentionSite.from_json(json.loads(json.dumps(site.to_json()))) == site


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_lowering_places_every_gpt2_attention_with_its_fused_projection(graphs, exporter):
    graph = graphs["gpt2", exporter]
    for b in (b for b in graph.blocks if b.kind == "decoder"):
        site = b.attention
        assert site is not None and b.split_units == 4 and site.rotary is None and site.norm == "LayerNorm"
        assert sorted(site.weight_of) == ["Wk", "Wo", "Wq", "Wv", "bk", "bo", "bq", "bv", "norm_b", "norm_w"]
        # Q, K and V are thirds of one c_attn weight and bias
        fused = {site.weight_of[r][0] for r in ("Wq", "Wk", "Wv")}
        assert len(fused) == 1 and "c_attn" in fused.pop()
        assert [site.columns_of[r] for r in ("Wq", "Wk", "Wv", "bq", "bk", "bv")] == \
            [(0, 64), (64, 128), (128, 192)] * 2
        assert site.columns_of["Wo"] is None
        assert AttentionSite.from_json(json.loads(json.dumps(site.to_json()))) == site


def test_a_site_written_before_fused_roles_still_reads():
    doc = {"x": "x", "mask": "m", "output": "o", "residual": "r", "nodes": ["n"],
           "weights": [["Wq", "q", False], ["Wk", "k", True]], "scale": 0.125}
    site = AttentionSite.from_json(doc)
    assert site.weight_of == {"Wq": ("q", False), "Wk": ("k", True)}
    assert site.columns_of == {"Wq": None, "Wk": None} and site.norm is None and site.rotary is None


def test_a_broken_key_value_repeat_is_named(graphs):
    """A repeat whose Expand does not give heads / kv_heads copies is not split, and the reason
    names the node and the shapes."""
    graph = graphs["llama", "torchscript"]
    block = graph.blocks[1]
    expand = next(graph.node(n) for n in block.nodes if graph.node(n).op == "Expand")
    broken = replace(expand, attrs={**expand.attrs, "shape": [B, 2, 3, S, 16]})
    graph = replace(graph, nodes=tuple(broken if n.name == expand.name else n for n in graph.nodes))
    with pytest.raises(PatternError, match=rf"block 1 \(layer.0\): .*key/value repeat '{expand.name}' has shapes "
                                           r".* expected \(2, 2, 1, 12, 16\) -> \(2, 2, 2, 12, 16\)"):
        match_attention(graph, block)


# --- the split engine equals the unsplit one -------------------------------------------------------

@pytest.mark.parametrize("family,counts", [("llama", (1, 1)), ("llama", (2, 0)), ("gpt2", (1, 3)), ("gpt2", (2, 2))],
                         ids=lambda v: v if isinstance(v, str) else f"{v[0]}+{v[1]}")
def test_a_split_decoder_equals_the_unsplit_engine(graphs, family, counts):
    """The whole model (embeddings, both decoder blocks split, the tied head and the causal-LM
    loss): the loss, every gradient (within 1e-5) and the parameters read back (bit for bit)."""
    graph = graphs[family, "torchscript"]
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = lm_step_feeds(0, B, S, 1)[0]
    ref = MnnStageEngine(spec)
    want_loss = float(np.asarray(ref.forward(feeds, 0)).reshape(-1)[0])
    want = ref.backward(0)
    with SplitStageEngine(spec, _alloc(counts)) as eng:
        assert len([s for s in eng.segments if hasattr(s, "attention")]) == 2
        loss = float(np.asarray(eng.forward(feeds, 0)).reshape(-1)[0])
        got = eng.backward(0)
        assert loss == pytest.approx(want_loss, rel=1e-6)
        assert_grads_close(got.params, want.params, rtol=1e-5)
        params, ref_params = eng.parameters(), ref.parameters()
        assert params.keys() == ref_params.keys()
        assert all(np.array_equal(params[k], ref_params[k]) for k in ref_params)


def test_a_split_decoder_trains_as_the_unsplit_engine(graphs):
    """Three AdamW steps of two micro-batches on GPT-2, whose fused c_attn weight is written back
    from its three roles at every update: the losses equal the unsplit engine's."""
    graph = graphs["gpt2", "torchscript"]
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)

    def train(engine) -> list[float]:
        return lm_train(engine, lambda step: lm_step_feeds(step, B, S, 2), 3)

    want = train(MnnStageEngine(spec))
    with SplitStageEngine(spec, _alloc((1, 3))) as eng:
        got = train(eng)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]


# --- profile, plan, train --------------------------------------------------------------------------

@pytest.mark.slow  # profiles two engines (torch imported in a split child)
def test_the_profile_times_a_decoder_attention_per_key_value_group(exports):
    """`profile` with attention on MNN and torch: one curve point per key/value group (2, not 4
    heads), a split child's memory, and the split's measured extra cost. None of those is read from the
    fresh child interpreters that measure the blocks' memory lines as a worker runs (`fresh=False`;
    tests/runtime/test_fresh_*.py hold those); with the objects this process held before frozen out of
    the profile's ~200 garbage collections (`profile_device` does it now: each walked the test process's
    heap, which pytest, torch and transformers fill): 87 -> 15 CPU s (benchmarks/MEMORY_NOTES.md, helper h93)."""
    from runtime.profiling.device import profile_device

    graph = load_model(exports["llama", "torchscript"], B, S)
    lines: list[str] = []
    profile = profile_device(graph, "dev", BACKENDS, reps=1, progress=lines.append, fresh=False)
    sig = block_signature(graph.blocks[1])
    for backend in profile.backends:
        assert len(backend.attention[sig].seconds) == 2
    assert any("attention 1..2 key/value groups" in line for line in lines)
    assert set(profile.split_child_bytes) == {"mnn", "torch"}
    assert set(profile.split_extra_cost_s[sig]) == {"mnn:cpu:t1"}  # the child beside torch in the process


def test_a_plan_splits_key_value_groups_and_a_worker_trains_from_its_bundle(exports, tmp_path):
    """A hand-made profile where MNN and torch each take one key/value group in 20 ms against 50 ms
    for one backend alone: the plan records the split, and a worker built from its bundle trains
    three steps with the unsplit engine's losses."""
    from ir.bundle import load_bundle_dir, sign_bundle
    from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile
    from jobs.train.pipeline import FaultPolicy, LocalWorkers, train_pipeline
    from jobs.planning import PlanSettings, plan_model
    from runtime.keys import signer
    from runtime.pipeline.coordinator import PipelineConfig

    path = exports["llama", "torchscript"]
    graph = load_model(path, ROWS, S)
    sigs = {block_signature(b) for b in graph.blocks}
    dec = block_signature(graph.blocks[1])
    curves = {"mnn:cpu:t1": (0.020, 0.050), "torch:cpu:t1": (0.020, 0.050)}
    costs = {s: BlockCost(0.01, 0.02, workspace_bytes=1 << 20) for s in sigs}
    # mnn:cpu:t2 (no curve) says the device has the two cores a split of two one-thread backends needs
    backends = tuple(BackendProfile(name, costs, {dec: AttentionCurve(c)}) for name, c in curves.items()) + \
        (BackendProfile("mnn:cpu:t2", costs, {}),)
    DeviceProfile("box", "tiny", ROWS, S, backends, memory_available_bytes=8 << 30,
                  split_child_bytes={"mnn": 40 << 20, "torch": 340 << 20}).save(tmp_path / "box.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
        {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": "2GiB",
         "backend": "mnn:cpu:t1"}]}))
    plan_dir = plan_model(path, tmp_path / "cluster.json",
                          PlanSettings(schedule="1f1b-flush", batch=ROWS * M, seq=S, microbatches=M, optimizer="adamw",
                                       lr=1e-3, time_limit_s=5.0), tmp_path / "plan")
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["devices"][0]["head_split"]["heads"] == {"mnn:cpu:t1": 1, "torch:cpu:t1": 1}
    bundle = plan_dir / plan["devices"][0]["bundle"]
    workers = LocalWorkers.start(1, threads=1)
    sign_bundle(bundle, signer(workers.keys.coordinator))
    try:
        result = train_pipeline(None, None, 0, workers.addresses,
                                PipelineConfig(schedule="1f1b-flush", microbatches=M, lr=1e-3, timeout_s=120), STEPS,
                                keys=workers.keys, bundles=[bundle], devices=["box"],
                                stage_graphs=[load_bundle_dir(bundle)], feeds_of_step=_step_feeds,
                                faults=FaultPolicy(on_failure="stop"))
    finally:
        assert workers.wait(30.0) == [0]
    losses, _ = lm_single_device(graph, _step_feeds, STEPS)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


def test_a_pipeline_with_a_split_decoder_stage_equals_one_device(exports):
    """Two worker processes, 1F1B-flush, the tied embedding on both stages and stage 1's decoder
    block split over torch (in the worker) and MNN (in a child of it): the losses and weights of
    single-device training."""
    from jobs.train.pipeline import FaultPolicy, LocalWorkers, StageChoice, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig

    graph = load_model(exports["llama", "torchscript"], ROWS, S)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)
    split = (None, StageChoice(head_split=_alloc((1, 1))))
    workers = LocalWorkers.start(2, threads=1)
    try:
        result = train_pipeline(graph, None, 0, workers.addresses, config, STEPS, cuts=[2], keys=workers.keys,
                                feeds_of_step=_step_feeds, faults=FaultPolicy(on_failure="stop"), per_stage=split)
    finally:
        assert workers.wait(30.0) == [0, 0]
    assert tuple(result.ranges[1])[0] == 2  # stage 1 holds decoder block 2
    losses, weights = lm_single_device(graph, _step_feeds, STEPS)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    assert result.weights.keys() == weights.keys()
    for k, want in weights.items():
        err = float(np.abs(result.weights[k] - want).max()) / float(np.abs(want).max())
        assert err <= 1e-4, f"{k}: relative error {err:.3g}"
