"""Issue 14, lever 5: activation memory as a planning decision. Each engine either keeps the
activations of every micro-batch in flight until its backward (PyTorch's autograd; MNN with one set
of block graphs per micro-batch in flight, each keeping its per-op caches) or recomputes them there
from the stashed inputs (PyTorch runs the forward again; MNN's default re-run); the gradients are the
same bit for bit either way. The memory model charges a keeping device its workspace once per
micro-batch in flight (and MNN keeping no forward re-run); the planner keeps where that fits and
recomputes where only that fits; the plan's bundles tell the worker, which trains as one device does."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile
from planner.cluster import DeviceSpec
from planner.cost import keeps_activations, stage_memory_bytes
from planner.onnx_import import load_model
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from support import S, one_f_one_b_gradients, single_device_training, synthetic_batch, token_feeds

MIB = 2 ** 20
B = 2


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


def _engine_run(graph, recompute: bool):
    """Three micro-batches in flight on a middle stage, an update between the forwards and the
    backwards (the backwards must use the weights their forwards used): outputs and gradients."""
    spec = stage_spec(graph, 1, 2)
    engine = TorchStageEngine(spec, recompute=recompute)
    rng = np.random.default_rng(0)
    shape = graph.values[spec.activation_input].shape
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    feeds = token_feeds(B, S, vocab=500)
    outs = [engine.forward({**feeds, spec.activation_input: x}, m) for m, x in enumerate(xs)]
    engine.set_parameters({k: v * 1.5 for k, v in engine.parameters().items()})
    grads = [engine.backward(m, np.ones_like(outs[m])) for m in (2, 0, 1)]
    return outs, grads


def test_recomputing_gives_the_gradients_of_keeping_bit_for_bit(graph):
    kept_out, kept = _engine_run(graph, False)
    again_out, again = _engine_run(graph, True)
    assert all(np.array_equal(a, b) for a, b in zip(kept_out, again_out))
    for k, a in zip(kept, again):
        assert np.array_equal(k.activation_input, a.activation_input)
        assert k.params.keys() == a.params.keys()
        assert all(np.array_equal(k.params[n], a.params[n]) for n in k.params)


def _first_stage_run(graph, recompute: bool):
    """The first stage (the embedding tables with it) with rows for gradients, two micro-batches in
    flight and an AdamW step between them (1f1b-stash's F F B U B): the tables stepped in place,
    the second backward with the weights and rows its forward used."""
    from runtime.optim import make_optimizer

    spec = stage_spec(graph, 0, 2)
    engine = TorchStageEngine(spec, recompute=recompute)
    engine.row_gradients = True
    tables = {k: engine._params[k] for k in engine._stepped_in_place}
    feeds = [token_feeds(B, S, vocab=500, seed=m) for m in range(2)]
    outs = [engine.forward(f, m) for m, f in enumerate(feeds)]
    first = engine.backward(0, np.ones_like(outs[0]))
    engine.step(make_optimizer("adamw", 0.1), first.params)
    second = engine.backward(1, np.ones_like(outs[1]))
    assert tables and all(engine._params[k] is t for k, t in tables.items())  # stepped where they are
    return outs, [first, second]


def test_recomputing_with_the_tables_stepped_in_place_gives_the_gradients_of_keeping(graph):
    """A recomputed forward replays the rows its first run gathered: the table stepped since then
    holds other values (with lr 0.1, every row by about 0.1), which a lookup run again would read."""
    kept_out, kept = _first_stage_run(graph, False)
    again_out, again = _first_stage_run(graph, True)
    assert all(np.array_equal(a, b) for a, b in zip(kept_out, again_out))
    for k, a in zip(kept, again):
        assert k.activation_input is None and a.activation_input is None
        assert k.params.keys() == a.params.keys()
        for n in k.params:
            kg, ag = k.params[n], a.params[n]
            if hasattr(kg, "rows"):  # a table's gradient: the rows its lookups touched
                assert np.array_equal(kg.ids, ag.ids) and np.array_equal(kg.rows, ag.rows), n
            else:
                assert np.array_equal(kg, ag), n


def test_a_recomputing_engine_holds_no_graph_between_forward_and_backward(graph):
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    engine = TorchStageEngine(spec, recompute=True)
    engine.forward(token_feeds(B, S, vocab=500), 0)
    inputs, x_in, params, gathered = engine._saved[0]
    assert x_in is None and all(not t.requires_grad for t in inputs.values())
    assert all(v.grad_fn is None for v in inputs.values())  # only inputs: no activation is kept
    # and the rows of the tables it looked up (stepped in place, which a re-run must not read)
    assert gathered.keys() == {n.name for n in spec.compute_nodes
                               if n.op == "Gather" and n.inputs[0] in engine._stepped_in_place}
    assert gathered and all(v.grad_fn is None for v in gathered.values())
    with pytest.raises(ValueError, match="a training forward must run the whole stage"):
        engine.forward(token_feeds(B, S, vocab=500), 1, until_block=1)


# --- the memory model and the planner's choice -------------------------------------------------------

def _profile(graph, workspace_mib: int = 40) -> DeviceProfile:
    """torch:cpu:t1 only: every block 10 + 20 ms, `workspace_mib` of workspace."""
    costs = {block_signature(b): BlockCost(0.010, 0.020, workspace_bytes=workspace_mib * MIB) for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("torch:cpu:t1", costs),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def test_the_memory_model_charges_kept_activations_per_micro_batch_in_flight(graph):
    from planner.cost import compute_s

    keep = DeviceSpec("a", "tcp://x:1", _profile(graph), 4 << 30)
    again = DeviceSpec("a", "tcp://x:1", _profile(graph), 4 << 30, activations="recompute")
    assert keeps_activations(keep) and not keeps_activations(again)
    n = len(graph.blocks)
    # stage 0 of 2 under 1f1b-flush with 4 micro-batches: 2 in flight
    kept = stage_memory_bytes(graph, keep, 0, 2, 0, 2, "1f1b-flush", 4, "adamw")
    lean = stage_memory_bytes(graph, again, 0, 2, 0, 2, "1f1b-flush", 4, "adamw")
    assert kept - lean == 3 * 40 * MIB  # the second micro-batch's workspace of 3 blocks
    assert compute_s(graph, keep, 0, n - 1) == pytest.approx((0.010 * n, 0.020 * n))
    assert compute_s(graph, again, 0, n - 1) == pytest.approx((0.010 * n, 0.030 * n))  # one more forward


def _plan(graph, tiny_onnx, tmp_path, budget: str, schedule: str = "gpipe"):
    from jobs.planning import PlanSettings, plan_model

    tmp_path.mkdir(parents=True, exist_ok=True)
    _profile(graph).save(tmp_path / "box.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
        {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": budget}]}))
    settings = PlanSettings(schedule=schedule, batch=B * 4, seq=S, microbatches=4, optimizer="adamw", lr=1e-3,
                            time_limit_s=5.0)
    out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json", settings, tmp_path / "plan")
    return out, json.loads((out / "plan.json").read_text())


def test_the_planner_keeps_activations_where_they_fit_and_recomputes_where_only_that_fits(graph, tiny_onnx,
                                                                                            tmp_path, capsys):
    """One PyTorch device, GPipe, 4 micro-batches in flight, 5 blocks of 40 MiB workspace: keeping
    needs 4 x 200 MiB of workspace, recomputing 200 MiB; a 2 GiB budget keeps, a 600 MiB one
    recomputes (predicted slower: one more forward per backward), and the bundle says so."""
    from ir.bundle import load_bundle_dir

    roomy_dir, roomy = _plan(graph, tiny_onnx, tmp_path / "roomy", "2GiB")
    tight_dir, tight = _plan(graph, tiny_onnx, tmp_path / "tight", "600MiB")
    (r,), (t,) = roomy["devices"], tight["devices"]
    assert r["activations"] == "keep" and t["activations"] == "recompute"
    assert r["memory_bytes"] - t["memory_bytes"] == 3 * len(graph.blocks) * 40 * MIB
    assert t["memory_bytes"] <= t["memory_budget_bytes"] < r["memory_bytes"]
    assert tight["predicted_step_s"] > roomy["predicted_step_s"]
    assert load_bundle_dir(tight_dir / "box").stage_doc.activations == "recompute"
    assert load_bundle_dir(roomy_dir / "box").stage_doc.activations == "keep"
    from confidant.commands import show_plan

    capsys.readouterr()
    show_plan(tight_dir)
    assert "torch (recompute)" in capsys.readouterr().out


def test_a_pipeline_of_recomputing_torch_stages_trains_as_one_device(graph):
    """Two stages on the PyTorch engine, both told to recompute, 1F1B-flush: every stage's engine
    recomputes, and the losses are those of single-device training on the same engine."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    M, steps = 2, 2
    batches = [synthetic_batch(i, M) for i in range(steps)]
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60,
                            engine="torch", activations="recompute")
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, steps, cuts=[2],
                                transport=workers.coordinator, faults=FaultPolicy(on_failure="stop"))
        engines = [w.executor.engine for w in workers.workers]
    assert workers.codes == [0, 0], workers.errors
    assert [type(e).__name__ for e in engines] == ["TorchStageEngine"] * 2 and all(e.recompute for e in engines)
    reference = TorchStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    losses, _ = single_device_training(graph, batches, steps, M, reference)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


# --- MNN keeping: one set of block graphs per micro-batch in flight ---------------------------------


@pytest.mark.parametrize("update", [False, True], ids=["flush", "stash"])
def test_mnn_keeping_gives_the_gradients_of_recomputing_bit_for_bit(graph, update):
    from runtime.engines.mnn import MnnStageEngine

    spec = stage_spec(graph, 0, 2)
    kept_engine = MnnStageEngine(spec, cache_slots=None)
    constants = dict(kept_engine._constant_vars)
    kept = one_f_one_b_gradients(kept_engine, graph, spec, update)
    # the second graph set reads the first one's constants (a frozen base weight is held once)
    assert constants and kept_engine._constant_vars.keys() == constants.keys()
    assert all(kept_engine._constant_vars[k] is v for k, v in constants.items())
    again = one_f_one_b_gradients(MnnStageEngine(spec), graph, spec, update)
    assert kept_engine.cache_slots == 2  # at most two micro-batches in flight on this stage
    for m in range(4):
        assert kept[m].keys() == again[m].keys()
        assert all(np.array_equal(kept[m][k], again[m][k]) for k in again[m])


def _mnn_profile(graph, workspace_mib: int = 40) -> DeviceProfile:
    """mnn:cpu:t1 only: every block 10 + 30 ms, 10 ms of which re-runs the forward."""
    costs = {block_signature(b): BlockCost(0.010, 0.030, recompute_s=0.010, workspace_bytes=workspace_mib * MIB)
             for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("mnn:cpu:t1", costs),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def test_an_mnn_device_keeps_where_that_fits_and_skips_its_forward_re_run(graph, tiny_onnx, tmp_path):
    from planner.cost import compute_s

    n = len(graph.blocks)
    default = DeviceSpec("a", "tcp://x:1", _mnn_profile(graph), 4 << 30)
    keep = DeviceSpec("a", "tcp://x:1", _mnn_profile(graph), 4 << 30, activations="keep")
    assert not keeps_activations(default) and keeps_activations(keep)
    assert compute_s(graph, default, 0, n - 1) == pytest.approx((0.010 * n, 0.030 * n))
    assert compute_s(graph, keep, 0, n - 1) == pytest.approx((0.010 * n, 0.020 * n))
    kept = stage_memory_bytes(graph, keep, 0, 2, 0, 2, "1f1b-flush", 4, "adamw")
    assert kept - stage_memory_bytes(graph, default, 0, 2, 0, 2, "1f1b-flush", 4, "adamw") == 3 * 40 * MIB

    _mnn_profile(graph).save(tmp_path / "box.json")
    for budget, want in (("2GiB", "keep"), ("600MiB", "recompute")):
        (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
            {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": budget}]}))
        from jobs.planning import PlanSettings, plan_model

        out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json",
                         PlanSettings(schedule="gpipe", batch=B * 4, seq=S, microbatches=4, time_limit_s=5.0),
                         tmp_path / f"plan-{budget}")
        assert json.loads((out / "plan.json").read_text())["devices"][0]["activations"] == want


def test_a_pipeline_of_mnn_stages_keeping_activations_trains_as_one_device(graph):
    """1F1B-flush on two MNN stages told to keep: stage 0 builds a second set of block graphs (two
    micro-batches in flight), and the losses are single-device MNN training's."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    M, steps = 4, 2
    batches = [synthetic_batch(i, M) for i in range(steps)]
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60,
                            activations="keep")
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, steps, cuts=[2],
                                transport=workers.coordinator, faults=FaultPolicy(on_failure="stop"))
        slots = [w.executor.engine.cache_slots for w in workers.workers]
    assert workers.codes == [0, 0], workers.errors
    assert slots == [2, 1]  # 1F1B: stage 0 has two micro-batches in flight, the last stage one
    losses, _ = single_device_training(graph, batches, steps, M)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
