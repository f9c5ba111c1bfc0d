"""Issue 31 target 6: the per-block hybrid. An MNN stage told `activations: per-block+K` recomputes per
block except its last K layers, which keep their per-op caches (the default mode's), so their backwards
skip the re-run of their forwards where a backward follows its forward. The gradients are the other
modes'; the memory model charges each cached block its measured caches (stacked with caches less
stacked per block) and credits its skipped re-run; the planner fills a per-block device's spare
budget with cached blocks, where a backward follows its forward."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ir.documents import activations_mode
from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import (cached_block_indices, compute_s, hybrid_count, stage_memory_bytes, stage_memory_terms,
                          with_cached_blocks)
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from support import S, one_f_one_b_gradients, tiny_lora_graph, token_feeds

MIB = 2 ** 20
B = 2


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


def test_the_activations_choice_spells_the_hybrid_with_its_count():
    assert activations_mode("per-block+6") == ("per-block", 6)
    assert activations_mode("per-block") == ("per-block", 0)
    assert activations_mode(None) == (None, 0)
    for bad in ("per-block+0", "per-block+x", "keep+2", "per-block+ 2"):
        with pytest.raises(ValueError):
            activations_mode(bad)


def test_a_hybrid_stage_keeps_the_caches_of_its_last_layers_only(graph):
    engine = make_engine("mnn:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), activations="per-block+2")
    assert isinstance(engine, MnnStageEngine) and engine.per_block and engine.cached_blocks == 2
    engine.forward(token_feeds(B, S, vocab=500), 0)
    layers = [p for p in engine._blocks if getattr(p, "activation", None)]
    cached = [p.block.index for p in engine._blocks if p.keeps_caches]
    assert cached == [p.block.index for p in layers[-2:]]
    for p in layers:
        shrunk = list(p.inputs[p.activation].shape)[:-1] == [1, 1]
        assert p._caching == p.keeps_caches and shrunk != p.keeps_caches  # the rest let go after the forward
    engine.backward(0)
    assert all(p.fed_serial is not None for p in layers[-2:])  # still holding their caches


@pytest.mark.parametrize("update", [False, True], ids=["flush", "stash"])
def test_the_hybrid_gives_the_gradients_of_recomputing_with_caches(tiny_onnx, update):
    g = tiny_lora_graph(tiny_onnx["torchscript-17"])
    spec = stage_spec(g, 0, 2)
    cached = one_f_one_b_gradients(make_engine("mnn:cpu:t1", spec), g, spec, update)
    hybrid = one_f_one_b_gradients(make_engine("mnn:cpu:t1", spec, activations="per-block+1"), g, spec, update)
    for m in range(4):
        assert hybrid[m].keys() == cached[m].keys()
        for k in cached[m]:
            np.testing.assert_allclose(hybrid[m][k], cached[m][k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_single_device_training_on_the_hybrid_equals_the_default(graph):
    from support import single_device_training, synthetic_batch

    batches = [synthetic_batch(i, 4) for i in range(2)]
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    want, want_params = single_device_training(graph, batches, 2, 4)
    got, got_params = single_device_training(graph, batches, 2, 4, engine=make_engine("mnn:cpu:t1", spec,
                                                                                   activations="per-block+3"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k in want_params:
        np.testing.assert_allclose(got_params[k], want_params[k], rtol=1e-4, atol=1e-6, err_msg=k)


# --- the memory model and the planner ----------------------------------------------------------------

def _profile(graph, per_mib: int = 24) -> DeviceProfile:
    """Every block 10 ms forward, 30 ms backward (10 the forward's re-run); with caches 40 MiB of
    workspace of which `per_mib` stay per further block, per block 30 MiB of which 2 stay."""
    costs = {block_signature(b): BlockCost(0.010, 0.030, recompute_s=0.010, workspace_bytes=40 * MIB,
                                           stacked_bytes=per_mib * MIB, per_block_workspace_bytes=30 * MIB,
                                           per_block_stacked_bytes=2 * MIB)
             for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("mnn:cpu:t1", costs),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def test_the_hybrids_charge_and_its_time_by_hand(graph):
    """One device, blocks 0-4 of the tiny BERT (embedding, 3 layers, head): per-block+2 caches blocks 2
    and 3 (the last two layers; block 4, the classifier head, is one too, so +2 means 3 and 4). By
    hand: each cached block adds 24 - 2 = 22 MiB of workspace, and its backward skips its 10 ms re-run
    where the backward follows its forward."""
    n = len(graph.blocks)
    assert cached_block_indices(graph, 0, n - 1, 2) == [n - 2, n - 1]
    assert cached_block_indices(graph, 0, n - 1, 99) == list(range(1, n))  # never the embedding
    assert cached_block_indices(graph, 0, n - 1, n - 1) == list(range(1, n))
    plain = DeviceSpec("a", "tcp://x:1", _profile(graph), 4 << 30, activations="per-block")
    hybrid = with_cached_blocks(plain, 2)
    assert hybrid.activations == "per-block+2"
    args = (0, n - 1, 0, 1, "1f1b-flush", 4, "adamw")
    got = stage_memory_terms(graph, hybrid, *args).workspace_bytes - stage_memory_terms(graph, plain, *args).workspace_bytes
    assert got == 2 * 22 * MIB
    assert compute_s(graph, plain, 0, n - 1, reuse=True) == pytest.approx((0.010 * n, 0.030 * n))
    assert compute_s(graph, hybrid, 0, n - 1, reuse=True) == pytest.approx((0.010 * n, 0.030 * n - 2 * 0.010))
    assert compute_s(graph, hybrid, 0, n - 1, reuse=False) == pytest.approx((0.010 * n, 0.030 * n))
    assert hybrid_count(graph, plain, 0, n - 1, 3 * 22 * MIB - 1) == 2
    assert hybrid_count(graph, plain, 0, n - 1, 100 * 22 * MIB) == n - 1


def test_a_hybrid_caching_every_block_of_its_stage_is_charged_as_keeping(graph):
    """Blocks 1-4 of the tiny BERT (3 layers and the head, the embedding left out: it is never cached).
    Per-block+3 leaves block 1 recomputing: per block 2 MiB each (8), the three cached blocks' caches
    3 x (24 - 2) = 66 and block 1's re-run transient 30 - 2 = 28: 102 MiB. Per-block+4 caches all four,
    so nothing re-runs: 8 + 4 x 22 = 96 and the cached blocks' keeping transient 40 - 24 = 16: 112 MiB,
    keeping's 4 x 24 + 16 (main charged the re-run's 28 there: 124)."""
    n = len(graph.blocks)
    plain = DeviceSpec("a", "tcp://x:1", _profile(graph), 4 << 30, activations="per-block")
    args = (1, n - 1, 0, 1, "1f1b-flush", 4, "adamw")
    workspace = {a: stage_memory_terms(graph, replace(plain, activations=a), *args).workspace_bytes
                 for a in ("per-block+3", "per-block+4", "keep")}
    assert workspace == {"per-block+3": 102 * MIB, "per-block+4": 112 * MIB, "keep": 112 * MIB}


def test_the_planner_fills_a_per_block_devices_spare_budget_with_cached_blocks(graph):
    """One device recomputing per block (the partition as given), 1F1B: the blocks cached are those
    whose caches fit in the budget beside the per-block stage, no more; a budget with room for none
    stays plain per-block; a stage whose backward does not follow its forward (GPipe, 4 micro-batches)
    caches nothing."""
    from planner.engines import hybrid_activations
    from planner.partition import make_instance, manual_partition

    n = len(graph.blocks)
    device = DeviceSpec("a", "tcp://x:1", _profile(graph), 4 << 30, activations="per-block")
    need = stage_memory_bytes(graph, device, 0, n - 1, 0, 1, "1f1b-flush", 4, "adamw")
    for room, want in ((0, "per-block"), (22 * MIB, "per-block+1"), (3 * 22 * MIB + MIB, "per-block+3"),
                       (1 << 30, f"per-block+{n - 1}")):
        cluster = Cluster((DeviceSpec("a", "tcp://x:1", _profile(graph), need + room, activations="per-block"),), Link(1e6, 0.001))
        partition = manual_partition(make_instance(graph, cluster, "1f1b-flush", 4, "adamw"), ["a"], [])
        got = hybrid_activations(graph, cluster, partition, "1f1b-flush", 4, "adamw").devices[0]
        assert got.activations == want, room
        assert stage_memory_bytes(graph, got, 0, n - 1, 0, 1, "1f1b-flush", 4, "adamw") <= need + room
    cluster = Cluster((DeviceSpec("a", "tcp://x:1", _profile(graph), 1 << 32, activations="per-block"),), Link(1e6, 0.001))
    partition = manual_partition(make_instance(graph, cluster, "gpipe", 4, "adamw"), ["a"], [])
    assert hybrid_activations(graph, cluster, partition, "gpipe", 4, "adamw").devices[0].activations == "per-block"


def test_a_pipeline_of_hybrid_stages_trains_as_one_device(graph):
    """1F1B-flush on two MNN stages told `per-block+1` (as a plan's stage documents carry it to the
    workers): each keeps one layer's caches, and the losses are single-device training's."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers
    from support import single_device_training, synthetic_batch

    M, steps = 4, 2
    batches = [synthetic_batch(i, M) for i in range(steps)]
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60,
                            activations="per-block+1")
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, steps, cuts=[2],
                                transport=workers.coordinator, faults=FaultPolicy(on_failure="stop"))
        engines = [w.executor.engine for w in workers.workers]
    assert workers.codes == [0, 0], workers.errors
    assert [(e.per_block, e.cached_blocks, sum(p.keeps_caches for p in e._blocks)) for e in engines] == [(True, 1, 1)] * 2
    losses, _ = single_device_training(graph, batches, steps, M)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


def test_a_hybrid_stage_s_planned_bytes_are_its_memory_model_charge_with_its_caches(graph):
    """The engine search picks the hybrid after the partition was costed plain per block: the stage's
    planned bytes (what plan.json promises and `train` checks) are the memory model's charge with the
    caches, not the plain per-block figure (SmolLM2 int4, 1f1b-stash, per-block+5: planned 190.9 MiB,
    its terms 252.8, measured 231.3)."""
    from planner.engines import pick_engines
    from planner.partition import make_instance, manual_partition

    n = len(graph.blocks)
    device = DeviceSpec("a", "tcp://x:1", _profile(graph), 4 << 30, activations="per-block")
    need = stage_memory_bytes(graph, device, 0, n - 1, 0, 1, "1f1b-flush", 4, "adamw")
    cluster = Cluster((DeviceSpec("a", "tcp://x:1", _profile(graph), need + 3 * 22 * MIB + MIB,
                                  activations="per-block"),), Link(1e6, 0.001))
    partition = manual_partition(make_instance(graph, cluster, "1f1b-flush", 4, "adamw"), ["a"], [])
    assert partition.stages[0].memory_bytes == need
    picks = pick_engines(graph, cluster, partition, "1f1b-flush", 4, "adamw", solve=None,
                         fixed=frozenset({"a"}))
    hybrid = picks.cluster.devices[0]
    assert hybrid.activations == "per-block+3"
    charged = stage_memory_bytes(graph, hybrid, 0, n - 1, 0, 1, "1f1b-flush", 4, "adamw")
    assert picks.partition.stages[0].memory_bytes == charged == need + 3 * 22 * MIB
