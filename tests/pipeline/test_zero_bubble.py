"""Zero-bubble ZB-H1: the schedule (B split into B and W, verified, at 1F1B's memory, with its
analytic bubble in the dry run and the costed simulator), the verifier's rules for W, the
PyTorch engine's split backward (B + W equal the whole backward in float64, and nothing is
computed twice), and pipelines under zb-h1 equal single-device training."""
from __future__ import annotations

import numpy as np
import pytest

from ir.partition import StageCost
from ir.plan import Action, ActionKind, Schedule
from ir.verify import PlanError, dry_run, verify_plan
from planner.onnx_import import load_model
from planner.schedule import make_schedule, peak_in_flight, zero_bubble_h1
from planner.simulate import simulate
from runtime.engines.stage import stage_spec
from support import ROWS, S, export_onnx, single_device_training, synthetic_batch, token_feeds

GRID = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (3, 4), (4, 4), (4, 8), (5, 3), (3, 9)]
F, B, W, UPDATE, FREE = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.UPDATE, ActionKind.FREE


# --- the schedule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", GRID)
def test_zb_h1_verifies_and_holds_what_1f1b_holds(p, m):
    zb, flush = make_schedule("zb-h1", p, m), make_schedule("1f1b-flush", p, m)
    verify_plan(zb)
    assert zb.splits_backward and not flush.splits_backward
    assert peak_in_flight(zb) == peak_in_flight(flush) == tuple(min(p - s, m) for s in range(p))
    for s, row in enumerate(zb.actions):
        kinds = [a.kind for a in row]
        assert kinds.count(W) == kinds.count(B) == kinds.count(F) == m
        assert row[-1] == Action(UPDATE, s)
        # the gradient leaves before the weight gradients are computed
        if s > 0:
            for i, a in enumerate(row):
                if a.kind is B:
                    assert row[i + 1] == Action(ActionKind.SEND_GRAD, s, a.microbatch, s - 1)


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b(p, m, f, b, w):
    """The dry run's makespan is m(F+B+W) + (p-1)(F+B): the bubble of 1F1B, (p-1)(F+B+W), less the
    (p-1) W's it no longer waits for, since each stage sends its gradient before its W."""
    zb = make_schedule("zb-h1", p, m)
    assert dry_run(zb, f, b, w).ticks == m * (f + b + w) + (p - 1) * (f + b)
    # 1F1B with the same work in one backward of B+W ticks
    assert dry_run(make_schedule("1f1b-flush", p, m), f, b + w).ticks == (m + p - 1) * (f + b + w)


def test_costed_simulation_splits_the_backward_by_weight_grad_s():
    p, m = 3, 4
    costs = [StageCost(s, f"d{s}", 1.0, 3.0, weight_grad_s=1.0) for s in range(p)]
    sim = simulate(make_schedule("zb-h1", p, m), costs)
    # F=1, B=2, W=1: m(F+B+W) + (p-1)(F+B)
    assert sim.makespan_s == pytest.approx(m * 4.0 + (p - 1) * 3.0)
    durations = {(e.kind, e.stage, e.microbatch): e.duration_s for e in sim.events if e.link is None}
    assert durations[("B", 1, 0)] == pytest.approx(2.0) and durations[("W", 1, 0)] == pytest.approx(1.0)
    assert sim.per_stage_busy_s == pytest.approx((16.0,) * p)
    flush = simulate(make_schedule("1f1b-flush", p, m), costs)
    assert flush.makespan_s == pytest.approx((m + p - 1) * 4.0)  # the same costs, B whole
    # no weight_grad_s: half of the backward
    half = simulate(make_schedule("zb-h1", p, m), [StageCost(s, "d", 1.0, 2.0) for s in range(p)])
    assert half.makespan_s == pytest.approx(m * 3.0 + (p - 1) * 2.0)
    with pytest.raises(ValueError, match=r"stage 1: weight_grad_s 4.0 is part of backward_s and cannot exceed it"):
        simulate(make_schedule("zb-h1", 2, 2), [StageCost(0, "a", 1.0, 3.0), StageCost(1, "b", 1.0, 3.0, weight_grad_s=4.0)])


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("f,b,w,u", [(1.0, 3.0, 1.0, 0.0), (2.0, 2.0, 1.5, 0.5), (1.0, 1.0, 0.0, 2.0)])
def test_the_cost_models_zb_h1_step_is_the_simulated_one_on_even_stages(p, m, f, b, w, u):
    """planner.cost.predicted_step_s (what every partitioner minimises, through PartitionInstance's
    weight_us) prices zb-h1 as its schedule runs: with equal stages it equals the costed simulation
    (which times W, then each stage's update), and it is below 1f1b-flush's by (p-1) W's."""
    from planner.cost import predicted_step_s

    costs = [StageCost(s, f"d{s}", f, b, update_s=u, weight_grad_s=w) for s in range(p)]
    sim = simulate(make_schedule("zb-h1", p, m), costs)
    assert predicted_step_s(costs, "zb-h1", m) == pytest.approx(sim.makespan_s)
    assert predicted_step_s(costs, "1f1b-flush", m) - predicted_step_s(costs, "zb-h1", m) == pytest.approx((p - 1) * w)


def test_the_planner_gives_zb_h1_stages_their_weight_pass():
    """stage_cost's W for zb-h1: half the backward less MNN's re-run, plus the accumulation; none for
    schedules that keep the backward whole."""
    import dataclasses

    from planner.cost import accumulate_s, block_costs, stage_cost
    from support import tiny_cluster, tiny_graph

    graph, cluster = tiny_graph(), tiny_cluster()
    cluster = dataclasses.replace(cluster, devices=tuple(  # a profile that measured the accumulation
        dataclasses.replace(d, profile=dataclasses.replace(d.profile, accumulate_s_per_param_byte=1e-9))
        for d in cluster.devices))
    devices = ["a", "b"]
    ranges = [(0, 1), (2, len(graph.blocks) - 1)]
    for s in range(2):
        zb = stage_cost(graph, cluster, devices, ranges, s, "zb-h1", 4, "sgd")
        assert stage_cost(graph, cluster, devices, ranges, s, "1f1b-flush", 4, "sgd").weight_grad_s is None
        spec = cluster.device(devices[s])
        costs = block_costs(graph, spec)[ranges[s][0]:ranges[s][1] + 1]
        rerun_free = sum(c.backward_s - min(c.recompute_s, c.backward_s) for c in costs)
        accumulate = accumulate_s(graph, spec, *ranges[s], "zb-h1", 4)
        # a re-run on both stages: b's profile read none, priced at least half the forward of its encoder
        # and head (`planner.cost.mnn_rerun_floor`), a's its measured 5 ms
        assert accumulate > 0 and any(c.recompute_s > 0 for c in costs)
        assert zb.weight_grad_s == pytest.approx(0.5 * rerun_free + accumulate) and zb.weight_grad_s < zb.backward_s


def _with_row(schedule: Schedule, s: int, row: list[Action]) -> Schedule:
    rows = list(schedule.actions)
    rows[s] = tuple(row)
    return Schedule(schedule.name, schedule.stages, schedule.microbatches, tuple(rows), schedule.stash_depth,
                    schedule.update_every)


def _swap(row, a: Action, b: Action) -> list[Action]:
    row = list(row)
    i, j = row.index(a), row.index(b)
    row[i], row[j] = row[j], row[i]
    return row


def _w_before_b(zb):
    return _with_row(zb, 1, _swap(zb.actions[1], Action(B, 1, 0), Action(W, 1, 0)))


def _missing_w(zb):
    return _with_row(zb, 0, [a for a in zb.actions[0] if a != Action(W, 0, 1)])


def _free_before_w(zb):
    return _with_row(zb, 0, _swap(zb.actions[0], Action(W, 0, 0), Action(FREE, 0, 0)))


def _update_before_last_w(zb):
    row = list(zb.actions[1])
    row.insert(max(i for i, a in enumerate(row) if a.kind is W), row.pop())  # the UPDATE moved up
    return _with_row(zb, 1, row)


@pytest.mark.parametrize("broken,message", [
    (_w_before_b, r"stage 1, s1\.W\.m0: rule 'B before W': micro-batch 0's weight gradients \(W\) run before "
                  r"its input gradient \(B, position \d+\)"),
    (_missing_w, r"rule 'every micro-batch': stage 0 has no W for micro-batch\(es\) 1 of 2"),
    (_free_before_w, r"stage 0, s0\.FREE\.m0: rule 'FREE after B': micro-batch 0 is freed before its "
                     r"weight-gradient pass \(W, position \d+\) has used its activations"),
    (_update_before_last_w, r"rule 'UPDATE cadence'"),
])
def test_the_verifier_refuses_a_broken_split_backward(broken, message):
    zb = make_schedule("zb-h1", 2, 2)
    with pytest.raises(PlanError, match=message):
        verify_plan(broken(zb))


def test_zb_h1_round_trips_through_text_and_json():
    zb = make_schedule("zb-h1", 3, 4)
    assert Schedule.from_text(zb.to_text()) == zb
    assert Schedule.from_json(zb.to_json()) == zb
    assert Action.parse("s2.W.m3") == Action(W, 2, 3)


def test_the_compute_order_is_1f1b_with_each_backward_split():
    """With unit times W fills no gap 1F1B's order leaves at its memory cap: each stage's order is
    1F1B's with every B followed by its W."""
    for p, m in GRID:
        flush = make_schedule("1f1b-flush", p, m)
        for s in range(p):
            split = [(a.kind, a.microbatch) for a in zero_bubble_h1(p, m).actions[s] if a.kind in (F, B)]
            assert split == [(a.kind, a.microbatch) for a in flush.actions[s] if a.kind in (F, B)]


# --- engines ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


def _stage_and_feeds(graph, where: str):
    """The stage `where` names (the whole model, the first two, the middle or the last blocks) and
    its inputs, a random activation for any stage but the first."""
    n = len(graph.blocks)
    first, last = {"whole": (0, n - 1), "first": (0, 1), "middle": (1, n - 2), "last": (2, n - 1)}[where]
    spec = stage_spec(graph, first, last)
    feeds = token_feeds(ROWS, S, vocab=500)
    if spec.activation_input:
        shape = graph.values[spec.activation_input].shape
        feeds[spec.activation_input] = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    return spec, feeds


@pytest.mark.parametrize("where", ["whole", "first", "middle", "last"])
def test_torch_b_then_w_equals_the_whole_backward_in_float64(graph, where):
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec, feeds = _stage_and_feeds(graph, where)
    whole, split = TorchStageEngine(spec, dtype=torch.float64), TorchStageEngine(spec, dtype=torch.float64)
    split.split_backward = True
    out = whole.forward(feeds, 0)
    np.testing.assert_array_equal(split.forward(feeds, 0), out)
    seed = None if spec.is_last else np.random.default_rng(1).normal(size=out.shape)
    ref = whole.backward(0, seed)
    b = split.backward_input(0, seed)
    w = split.backward_weight(0)
    # the projections' weights and biases wait for W; nothing is computed in both
    assert w and not set(w) & set(b.params)
    projections = {n_.inputs[1] for n_ in spec.compute_nodes if n_.op == "MatMul" and n_.inputs[1] in spec.params}
    assert projections and projections <= set(w)
    assert all(graph.constants[k].ndim == 1 for k in set(w) - projections)  # the rest: their biases
    got = {**b.params, **w}
    assert set(got) == set(ref.params)
    for k in ref.params:
        np.testing.assert_allclose(got[k], ref.params[k], rtol=1e-10, atol=1e-12, err_msg=k)
    if spec.activation_input:
        np.testing.assert_allclose(b.activation_input, ref.activation_input, rtol=1e-10, atol=1e-12)
    assert split.backward_weight(0) == {}  # W ran once; nothing left


def test_torch_split_backward_with_recompute_equals_without(graph):
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = token_feeds(ROWS, S, vocab=500)
    grads = []
    for recompute in (False, True):
        engine = TorchStageEngine(spec, dtype=torch.float64, recompute=recompute)
        engine.split_backward = True
        engine.forward(feeds, 0)
        grads.append({**engine.backward_input(0).params, **engine.backward_weight(0)})
    for k in grads[0]:
        np.testing.assert_array_equal(grads[1][k], grads[0][k], err_msg=k)


@pytest.mark.parametrize("where", ["whole", "first", "middle", "last"])
def test_mnn_b_then_w_equals_the_whole_backward(graph, where):
    """MNN's B is one gradient program stopped at the projections' outputs; W multiplies their
    inputs by those gradients in numpy: together the whole backward's gradients (float32: to
    rounding), with no projection weight computed twice."""
    from runtime.engines.mnn import MnnStageEngine

    spec, feeds = _stage_and_feeds(graph, where)
    whole, split = MnnStageEngine(spec), MnnStageEngine(spec)
    split.split_backward = True
    out = whole.forward(feeds, 0)
    np.testing.assert_array_equal(split.forward(feeds, 0), out)
    seed = None if spec.is_last else np.random.default_rng(1).normal(size=out.shape).astype(np.float32)
    ref = whole.backward(0, seed)
    b = split.backward_input(0, seed)
    w = split.backward_weight(0)
    projections = {n_.inputs[1] for n_ in spec.compute_nodes if n_.op == "MatMul" and n_.inputs[1] in spec.params}
    assert projections and set(w) == projections and not set(w) & set(b.params)
    got = {**b.params, **w}
    assert set(got) == set(ref.params)
    for k in ref.params:
        scale = max(float(np.abs(ref.params[k]).max()), 1e-30)
        assert float(np.abs(got[k] - ref.params[k]).max()) <= 1e-5 * scale, k
    if spec.activation_input:
        np.testing.assert_allclose(b.activation_input, ref.activation_input, rtol=1e-5,
                                   atol=1e-6 * float(np.abs(ref.activation_input).max()))
    assert split.backward_weight(0) == {}


def test_mnn_split_backward_keeps_each_microbatch_apart(graph):
    """Two micro-batches in flight (1F1B's pattern on an early stage): each W gets its own B's
    inputs and gradients, although the block graphs were fed the other micro-batch in between."""
    from runtime.engines.mnn import MnnStageEngine

    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = [token_feeds(ROWS, S, vocab=500, seed=k) for k in range(2)]
    whole, split = MnnStageEngine(spec), MnnStageEngine(spec)
    split.split_backward = True
    refs = []
    for k in range(2):
        whole.forward(feeds[k], k)
        refs.append(whole.backward(k).params)
    for k in range(2):
        split.forward(feeds[k], k)
    parts = [split.backward_input(k).params for k in range(2)]
    weights = [split.backward_weight(k) for k in (1, 0)][::-1]  # W out of order
    for k in range(2):
        got = {**parts[k], **weights[k]}
        for name, want in refs[k].items():
            assert float(np.abs(got[name] - want).max()) <= 1e-5 * max(float(np.abs(want).max()), 1e-30), (k, name)
    assert any(not np.allclose(weights[0][name], weights[1][name]) for name in weights[0])


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """family -> a tiny random decoder LLM's graph (torchscript export), lowered on first use."""
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from support import Lazy

    root = tmp_path_factory.mktemp("zb-decoders")
    return Lazy(lambda family: load_model(export_causal_lm(random_causal_lm(family), root / f"{family}.onnx",
                                                           LlmExportOptions(), kv_cache=False), 2, 12))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_decoder_b_then_w_equals_the_whole_backward(decoders, family, engine):
    """A decoder's first and last stage (rotary, GQA, no-bias or fused-c_attn projections, the
    fused LM head and loss, a tied embedding): B + W are the whole backward's gradients."""
    from support import lm_step_feeds

    graph = decoders[family]
    n = len(graph.blocks)
    if engine == "torch":
        pytest.importorskip("torch")
        from runtime.engines.pytorch import TorchStageEngine as Engine
    else:
        from runtime.engines.mnn import MnnStageEngine as Engine
    for first, last in ((0, n // 2 - 1), (n // 2, n - 1)):
        spec = stage_spec(graph, first, last)
        feeds = lm_step_feeds(0)[0]
        if spec.activation_input:
            shape = graph.values[spec.activation_input].shape
            feeds[spec.activation_input] = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        whole, split = Engine(spec), Engine(spec)
        split.split_backward = True
        out = whole.forward(feeds, 0)
        split.forward(feeds, 0)
        seed = None if spec.is_last else np.random.default_rng(1).normal(size=out.shape).astype(np.float32)
        ref = whole.backward(0, seed)
        b = split.backward_input(0, seed)
        w = split.backward_weight(0)
        assert w and not set(w) & set(b.params)
        got = {**b.params, **w}
        assert set(got) == set(ref.params)
        for k in ref.params:
            scale = max(float(np.abs(ref.params[k]).max()), 1e-30)
            assert float(np.abs(got[k] - ref.params[k]).max()) <= 2e-5 * scale, (first, k)


# --- pipelines ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(2)]


@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_zb_h1_pipeline_equals_single_device_training(graph, batches, stages, engine):
    """Within 1e-5 of the same engine on one device: the deferred weight gradients are the same
    sums, computed apart (MNN's in numpy)."""
    from jobs.train.pipeline import train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    if engine == "torch":
        pytest.importorskip("torch")
        from runtime.engines.pytorch import TorchStageEngine
        one = TorchStageEngine(spec)
    else:
        from runtime.engines.mnn import MnnStageEngine
        one = MnnStageEngine(spec)
    config = PipelineConfig(schedule="zb-h1", microbatches=2, optimizer="adamw", lr=1e-3, timeout_s=30,
                            engine=engine)
    with InProcessWorkers(stages, timeout_s=30) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, 2, transport=workers.coordinator)
    assert workers.codes == [0] * stages, workers.errors
    assert all(d["seconds"].get("W", 0) > 0 for d in result.stage_reports[-1])  # W ran on every stage
    losses, weights = single_device_training(graph, batches, 2, engine=one)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    moved = 0
    for k, want in weights.items():
        # a bias whose true gradient is 0 gets float32 noise that AdamW scales to lr-sized steps
        bound = 2 * 1e-3 * 2 if k.endswith("attention.self.key.bias") else 1e-5 * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(result.weights[k] - want).max()) <= bound, k
        moved += not np.array_equal(result.weights[k], graph.constants[k])
    assert moved == len(weights)  # every parameter trained, the deferred ones included


# --- PipeDream-2BW ----------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m,k", [(2, 4, 2), (3, 6, 3), (3, 8, 4), (4, 8, 4), (4, 9, 5), (1, 3, 1)])
def test_2bw_verifies_with_two_weight_versions(p, m, k):
    from ir.verify import peak_weight_versions

    sch = make_schedule("2bw", p, m, update_every=k)
    verify_plan(sch)
    assert not sch.flushes and sch.update_every == k
    assert max(peak_weight_versions(sch)) <= 2 == max(sch.stash_depth) or p == 1
    stash = make_schedule("1f1b-stash", p, m, update_every=k)
    assert sch.actions == stash.actions  # the same order; what differs is how few versions it needs
    # PipeDream's rule (an update after every backward) needs p-s versions on stage s
    assert peak_weight_versions(make_schedule("1f1b-stash", p, m))[0] == min(p, m)


def test_2bw_refuses_updates_too_frequent_for_two_versions():
    with pytest.raises(ValueError, match=r"2bw keeps two weight versions, which needs an update at most every "
                                         r"stages=3 backwards: update_every=2 is fewer \(use update_every >= 3, "
                                         r"or 1f1b-stash, which keeps p-s versions\)"):
        make_schedule("2bw", 3, 6, update_every=2)
    # and a hand-edited 2bw plan claiming depth 2 with updates every backward fails the stash rule
    stash = make_schedule("1f1b-stash", 3, 6)
    forged = Schedule("2bw", 3, 6, stash.actions, (2, 2, 1), 1)
    with pytest.raises(PlanError, match=r"rule 'stash depth': 3 weight versions alive here"):
        verify_plan(forged)


def test_the_memory_model_charges_2bw_one_old_version():
    from planner.cost import stashed_weight_versions

    assert [stashed_weight_versions("2bw", 4, s, 8) for s in range(4)] == [1, 1, 1, 0]
    assert [stashed_weight_versions("1f1b-stash", 4, s, 8) for s in range(4)] == [3, 2, 1, 0]


def test_the_cli_defaults_2bw_to_one_update_per_batch():
    from confidant.cli import build_parser
    from confidant.commands import _update_every

    parser = build_parser()
    args = parser.parse_args(["train-pipeline", "m.onnx", "--data", "d.conll", "--local", "2", "--schedule", "2bw", "--microbatches", "4"])
    assert _update_every(args) == 4
    args = parser.parse_args(["train-pipeline", "m.onnx", "--data", "d.conll", "--local", "2", "--schedule", "1f1b-stash"])
    assert _update_every(args) == 1
    args = parser.parse_args(["train-pipeline", "m.onnx", "--data", "d.conll", "--local", "2", "--schedule", "2bw", "--update-every", "3"])
    assert _update_every(args) == 3


def test_a_2bw_pipeline_equals_its_sequential_replay(graph):
    """Three stages over ZeroMQ-free in-process workers, 2 steps of 3 micro-batches, an update per
    3 backwards: the same losses and weights as the same schedule replayed in one thread, and not
    those of the flush schedule (the updates really happen mid-run, on stashed versions)."""
    from jobs.train.pipeline import train_pipeline
    from runtime.engines.mnn import MnnStageEngine
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers
    from runtime.pipeline.local_replay import LocalPipeline
    from tasks.tokenize import split_microbatches
    from tasks.trainer import batch_feeds

    M, steps, stages = 3, 2, 3
    batches = [synthetic_batch(i, M) for i in range(steps)]
    config = PipelineConfig(schedule="2bw", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=30)
    with InProcessWorkers(stages, timeout_s=30) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, steps, transport=workers.coordinator,
                                update_every=M)
    assert workers.codes == [0] * stages, workers.errors
    from ir.partition import even_ranges

    replay = LocalPipeline(graph, even_ranges(len(graph.blocks), stages), MnnStageEngine, "adamw", 1e-3)
    feeds = [batch_feeds(mb, 9, b.n_labelled) for b in batches for mb in split_microbatches(b, M)]
    losses = replay.run(make_schedule("2bw", stages, steps * M, update_every=M), feeds)
    # the run reports each step's loss, the sum of its micro-batches'
    np.testing.assert_allclose(result.losses, np.asarray(losses).reshape(steps, M).sum(axis=1), rtol=1e-6)
    want = replay.parameters()
    for k in want:
        np.testing.assert_array_equal(result.weights[k], want[k], err_msg=k)
    _, flush = single_device_training(graph, batches, steps, microbatches=M)
    assert any(not np.array_equal(result.weights[k], flush[k]) for k in flush)
