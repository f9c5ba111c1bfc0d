"""The time of MNN's re-run of the forward, as the planner's cost model prices it (`planner.cost.
block_costs`, `mnn_rerun_floor`). A profile times a block's backward twice on MNN, after its own forward
(the per-op caches reused: what keeping pays) and after another micro-batch's (the forward re-run: what
recomputing per block pays), and takes the re-run as their difference, clamped at 0. A loaded machine
read it at 0.04 of the forward once (helper h139): keeping, recomputing and per block then cost the same
and the leanest, per block, was planned on a roomy device, a plan that moved from one profile to the
next. Without caches MNN runs a layer's MatMuls and Softmax again (0.66-0.95 of its forward in CPU
time), so the re-run is priced at least half the forward. Here a profile with that noise, planned by
real solves (the exact order search and CP-SAT)."""
from __future__ import annotations

import dataclasses

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from support import planned_by_both_solvers

MIB = 2 ** 20
SCHEDULE, MICROBATCHES, OPTIMIZER = "1f1b-flush", 4, "adamw"


def _mnn_profile(graph, recompute_s: float) -> DeviceProfile:
    """mnn:cpu:t1: every block 10 ms forward, 30 ms backward after another micro-batch's forward of which
    `recompute_s` was timed its re-run; 40 MiB of workspace of which 24 stay per further block and 16
    more per further micro-batch kept; per block 30 MiB of which 2 stay."""
    costs = {block_signature(b): BlockCost(0.010, 0.030, recompute_s, workspace_bytes=40 * MIB, stacked_bytes=24 * MIB,
                                           kept_bytes=16 * MIB, per_block_workspace_bytes=30 * MIB,
                                           per_block_stacked_bytes=2 * MIB)
             for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("mnn:cpu:t1", costs),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def _reruns(graph, index: int) -> bool:
    """Whether MNN re-runs cached ops of the block (MatMul, Softmax, an exact GELU's erf): the Llama's
    layers; not its embeddings (a lookup), nor the LM head (its projection fused with the loss, in
    numpy), nor the loss."""
    ops = {graph.node(n).op for n in graph.blocks[index].nodes}
    return bool(ops & {"MatMul", "Softmax"}) and index != len(graph.blocks) - 2


@pytest.mark.parametrize("measured", [0.0, 0.0004, 0.008])
def test_a_re_run_timed_near_zero_is_priced_half_the_forward_and_keeping_stays_as_measured(tiny_llama, measured):
    """Timed 0 (clamped), 0.4 ms (0.04 of the forward, as h139 saw) or 8 ms: a layer's re-run is priced
    max(timed, 5 ms), its backward recomputing per block keeping's (30 - timed) plus that; keeping's
    backward is 30 - timed whatever the floor; the embeddings, the fused head and the loss as timed."""
    from planner.cluster import DeviceSpec
    from planner.cost import block_costs, compute_s

    graph = tiny_llama
    device = DeviceSpec("a", "tcp://x:1", _mnn_profile(graph, measured), 4 << 30, activations="per-block")
    reruns = [_reruns(graph, k) for k in range(len(graph.blocks))]
    assert reruns == [False] + [True] * (len(graph.blocks) - 3) + [False, False]
    rerun = max(measured, 0.005)
    costs = block_costs(graph, device)
    assert [c.recompute_s for c in costs] == pytest.approx([rerun if r else measured for r in reruns])
    assert [c.backward_s for c in costs] == pytest.approx([0.030 - measured + (rerun if r else measured)
                                                           for r in reruns])
    keep = dataclasses.replace(device, activations="keep")
    assert [c.backward_s for c in block_costs(graph, keep)] == pytest.approx([0.030 - measured] * len(reruns))
    for first, last in ((0, len(graph.blocks) - 1), (1, 2)):
        kept, per_block = compute_s(graph, keep, first, last, True), compute_s(graph, device, first, last, True)
        extra = sum(rerun for k in range(first, last + 1) if reruns[k])
        assert per_block[0] == kept[0] and extra > 0
        assert per_block[1] == pytest.approx(kept[1] + extra + sum(measured for k in range(first, last + 1)
                                                                   if not reruns[k]))


def _planned(graph, cluster):
    return planned_by_both_solvers(graph, cluster, SCHEDULE, MICROBATCHES, OPTIMIZER)


def test_a_roomy_device_does_not_recompute_per_block_though_its_profile_timed_the_re_run_zero(tiny_llama):
    """One device, 4 GiB, the re-run timed 0 (clamped): everything fits. Its backwards follow their own
    forwards, so recomputing keeps one set of caches and reuses them, at keeping's time in less memory;
    per block re-runs every layer's MatMuls, so it is slower: the plan recomputes, by either solver.
    Main's model (the re-run taken at 0) planned per block caching all four layers (`per-block+4`)."""
    from planner.cluster import Cluster, DeviceSpec

    profile = _mnn_profile(tiny_llama, 0.0)
    cluster = Cluster((DeviceSpec("d0", "tcp://x:1", profile, 4 << 30, backend="mnn:cpu:t1"),), Link(1e9, 1e-4))
    got = _planned(tiny_llama, cluster)
    assert got["order search"] == got["cp-sat"]
    assert got["cp-sat"][0] == [("d0", "recompute")]

def test_two_roomy_devices_keep_though_the_profile_timed_the_re_run_zero(tiny_llama):
    """Two 4 GiB devices, 1F1B, the re-run timed 0: the first stage runs later micro-batches' forwards
    before each backward, so recomputing (one set of caches) and per block both re-run its layers'
    forwards there, and keeping does not: it keeps, and so does the last stage (its backwards follow
    their forwards: recomputing ties keeping's time and memory there). The devices are alike, so which
    takes the first stage is the solver's: the stages are compared. Main's model planned per block on
    the first stage and per block caching two layers (`per-block+2`) on the last."""
    from planner.cluster import Cluster, DeviceSpec

    profile = _mnn_profile(tiny_llama, 0.0)
    cluster = Cluster(tuple(DeviceSpec(d, f"tcp://x:{k}", profile, 4 << 30, backend="mnn:cpu:t1")
                            for k, d in enumerate(("a", "b"))), Link(1e12, 0.0))
    got = {name: ([a for _, a in stages], ranges, step) for name, (stages, ranges, step)
           in _planned(tiny_llama, cluster).items()}
    assert got["order search"] == got["cp-sat"]
    assert got["cp-sat"][0] == ["keep", "keep"]


def test_per_block_where_only_it_fits_beside_a_roomy_device(tiny_llama):
    """The noisy profile (the re-run timed 0) on one device whose budget fits the stage per block and
    nothing else: per block. Then two devices, the first of a budget that fits no stage keeping nor
    recomputing, only per block, the second roomy: the first recomputes per block, the second keeps (main's
    model: per block caching two layers, `per-block+2`)."""
    from planner.cluster import Cluster, DeviceSpec
    from planner.cost import stage_memory_bytes

    graph, n = tiny_llama, len(tiny_llama.blocks)
    profile = _mnn_profile(graph, 0.0)

    def memory(first, last, stage, stages, activations):
        device = DeviceSpec("p", "tcp://x:9", profile, 8 << 30, backend="mnn:cpu:t1", activations=activations)
        return stage_memory_bytes(graph, device, first, last, stage, stages, SCHEDULE, MICROBATCHES, OPTIMIZER)

    budget = memory(0, n - 1, 0, 1, "per-block") + MIB
    assert memory(0, n - 1, 0, 1, "recompute") > budget and memory(0, n - 1, 0, 1, "keep") > budget
    one = Cluster((DeviceSpec("d0", "tcp://x:1", profile, budget, backend="mnn:cpu:t1"),), Link(1e9, 1e-4))
    got = _planned(graph, one)
    assert got["order search"] == got["cp-sat"] and got["cp-sat"][0] == [("d0", "per-block")]

    tight = memory(0, n - 3, 0, 2, "per-block") + MIB
    assert memory(0, n - 3, 0, 2, "recompute") > tight and memory(0, 0, 0, 2, "keep") > tight
    two = Cluster((DeviceSpec("a", "tcp://x:1", profile, tight, backend="mnn:cpu:t1"),
                   DeviceSpec("b", "tcp://x:2", profile, 4 << 30, backend="mnn:cpu:t1")), Link(1e12, 0.0))
    got = _planned(graph, two)
    assert got["order search"] == got["cp-sat"]
    assert dict(got["cp-sat"][0]) == {"a": "per-block", "b": "keep"}


def test_a_bundles_slice_prices_the_layers_of_every_stage_as_the_whole_graph(tiny_llama):
    """`backend_times` (the plan's engine choices, `jobs.planning.engine_choices`) prices every stage from
    the first bundle's graph, a slice that keeps every block's metadata but only its stage's nodes: the
    layers of a later stage cost there what they cost on the whole graph, on MNN (the re-run floored) and
    on PyTorch recomputing per block (each layer's forward once more). h139's `checkpointed_blocks` read
    every block's nodes and raised KeyError on the slice (`confidant plan` failed after writing the
    bundles of tests/jobs/test_plan_train.py's plan once the MNN rule read nodes the same way)."""
    from ir.serialize import slice_graph
    from planner.cluster import DeviceSpec
    from planner.cost import compute_s

    graph, n = tiny_llama, len(tiny_llama.blocks)
    part = slice_graph(graph, 0, 1)
    torch_costs = {block_signature(b): BlockCost(0.010, 0.020, workspace_bytes=40 * MIB, per_block_workspace_bytes=30 * MIB,
                                                 per_block_backward_s=0.015) for b in graph.blocks}
    torch = DeviceProfile("box", graph.name, graph.batch, graph.seq,
                          (BackendProfile("torch:cpu:t1", torch_costs, fresh_lines=True),), 16 << 30, 100 * MIB)
    for profile in (_mnn_profile(graph, 0.0), torch):
        device = DeviceSpec("a", "tcp://x:1", profile, 4 << 30, activations="per-block")
        for reuse in (False, True):
            assert compute_s(part, device, 2, n - 3, reuse) == pytest.approx(compute_s(graph, device, 2, n - 3, reuse))
            assert compute_s(part, device, 0, 1, reuse) == pytest.approx(compute_s(graph, device, 0, 1, reuse))
    layers = compute_s(part, DeviceSpec("a", "tcp://x:1", torch, 4 << 30, activations="per-block"), 2, n - 3)
    assert layers[1] == pytest.approx((n - 4) * 0.030)
