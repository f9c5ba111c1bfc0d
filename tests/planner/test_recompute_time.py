"""The time of recomputing, as the planner's cost model prices it (`planner.cost.block_costs`): PyTorch
recomputing per block re-runs each checkpointed block's forward inside its backward, so its backward is
keeping's plus the forward, whatever a profile timed it at. A profile once timed a layer's per-block
backward below keeping's (a loaded machine), the model took max(keep, measured) = keep's, and a roomy
device then planned per block (equal time, less memory) instead of keeping: a plan, and its memory,
that moved from one profile to the next (the slow tests/jobs/test_torch_per_block_plan.py). Here a
profile with that noise, planned by real solves (the exact order search and CP-SAT)."""
from __future__ import annotations

import dataclasses

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from support import planned_by_both_solvers

MIB = 2 ** 20
SCHEDULE, MICROBATCHES, OPTIMIZER = "1f1b-flush", 4, "adamw"


def _torch_profile(graph, per_block_backward_s: float) -> DeviceProfile:
    """torch:cpu:t1, as `profile` measures it (lines fresh): every block 10 ms forward, 20 ms backward
    keeping, `per_block_backward_s` recomputing per block; 40 MiB of workspace of which 24 stay per
    further block and 16 more per further micro-batch kept; per block 30 MiB of which 2 stay."""
    costs = {block_signature(b): BlockCost(0.010, 0.020, workspace_bytes=40 * MIB, stacked_bytes=24 * MIB,
                                           kept_bytes=16 * MIB, per_block_workspace_bytes=30 * MIB,
                                           per_block_stacked_bytes=2 * MIB, per_block_backward_s=per_block_backward_s)
             for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq,
                         (BackendProfile("torch:cpu:t1", costs, fresh_lines=True),),
                         memory_available_bytes=16 << 30, runtime_overhead_bytes=100 * MIB)


def _runs_as_it_is(graph, index: int) -> bool:
    """The engine's rule (runtime.engines.pytorch: a block with a lookup, the loss, the LM head fused
    with it run without a checkpoint), restated from the graph: embeddings, LM head, loss."""
    nodes = [graph.node(n) for n in graph.blocks[index].nodes]
    return any(n.op in ("Gather", "TokenCrossEntropy") for n in nodes) or index == len(graph.blocks) - 2


@pytest.mark.parametrize("measured", [0.015, 0.020, 0.035])
def test_a_per_block_backward_is_keepings_plus_the_re_run_forward_whatever_it_was_timed(tiny_llama, measured):
    """Timed faster than keeping (15 ms), as fast (20) or slower (35): a checkpointed layer's backward is
    priced 20 + 10 ms, its re-run 10; a block the engine runs as it is (embeddings, the LM head with its
    fused loss, the loss) is priced as keeping, with no re-run."""
    from planner.cluster import DeviceSpec
    from planner.cost import block_costs, compute_s

    graph = tiny_llama
    device = DeviceSpec("a", "tcp://x:1", _torch_profile(graph, measured), 4 << 30, activations="per-block")
    as_is = [_runs_as_it_is(graph, k) for k in range(len(graph.blocks))]
    assert as_is == [True] + [False] * (len(graph.blocks) - 3) + [True, True]
    costs = block_costs(graph, device)
    assert [c.backward_s for c in costs] == pytest.approx([0.020 if a else 0.030 for a in as_is])
    assert [c.recompute_s for c in costs] == pytest.approx([0.0 if a else 0.010 for a in as_is])
    keep = dataclasses.replace(device, activations="keep")
    for first, last in ((0, len(graph.blocks) - 1), (1, 2)):
        kept, per_block = compute_s(graph, keep, first, last, True), compute_s(graph, device, first, last, True)
        rerun = sum(0.010 for k in range(first, last + 1) if not as_is[k])
        assert per_block[0] == kept[0] and per_block[1] == pytest.approx(kept[1] + rerun) and rerun > 0


def _planned(graph, cluster):
    return planned_by_both_solvers(graph, cluster, SCHEDULE, MICROBATCHES, OPTIMIZER)


@pytest.mark.parametrize("measured", [0.015, 0.020])
def test_a_roomy_device_keeps_though_its_profile_timed_per_block_no_slower(tiny_llama, measured):
    """One device, 4 GiB: keeping fits, and per block (timed at or below keeping's backward) would
    hold less; keeping does less work (no re-run), so the plan keeps, by either solver. Main's model
    (max(keep, measured) = keeping's time) planned per block here: the same time in less memory."""
    from planner.cluster import Cluster, DeviceSpec

    profile = _torch_profile(tiny_llama, measured)
    cluster = Cluster((DeviceSpec("d0", "tcp://x:1", profile, 4 << 30, backend="torch:cpu:t1"),), Link(1e9, 1e-4))
    got = _planned(tiny_llama, cluster)
    assert got["order search"] == got["cp-sat"]
    assert got["cp-sat"][0] == [("d0", "keep")]


def test_per_block_where_only_it_fits_and_keeping_where_it_does_on_two_devices(tiny_llama):
    """The noisy profile (per block timed 15 ms, below keeping's 20) on one device whose budget is 1 MiB
    under what keeping needs (recomputing the stage holds as much with one micro-batch in flight): per
    block. Then two devices, the first of a budget that fits no stage keeping (2 micro-batches in
    flight on the first stage of 1F1B) nor recomputing the stage, only per block, the second roomy:
    the solvers agree, the first recomputes per block and the second keeps (main's model: per block
    on both, the same cuts)."""
    from planner.cluster import Cluster, DeviceSpec
    from planner.cost import stage_memory_bytes

    graph, n = tiny_llama, len(tiny_llama.blocks)
    profile = _torch_profile(graph, 0.015)

    def memory(first, last, stage, stages, activations):
        device = DeviceSpec("p", "tcp://x:9", profile, 8 << 30, backend="torch:cpu:t1", activations=activations)
        return stage_memory_bytes(graph, device, first, last, stage, stages, SCHEDULE, MICROBATCHES, OPTIMIZER)

    budget = memory(0, n - 1, 0, 1, "keep") - MIB
    assert memory(0, n - 1, 0, 1, "recompute") > budget >= memory(0, n - 1, 0, 1, "per-block")
    one = Cluster((DeviceSpec("d0", "tcp://x:1", profile, budget, backend="torch:cpu:t1"),), Link(1e9, 1e-4))
    got = _planned(graph, one)
    assert got["order search"] == got["cp-sat"] and got["cp-sat"][0] == [("d0", "per-block")]

    # the first device fits up to the embeddings and every layer per block, nothing keeping
    tight = memory(0, n - 3, 0, 2, "per-block") + MIB
    assert memory(0, n - 3, 0, 2, "recompute") > tight and memory(0, 0, 0, 2, "keep") > tight
    two = Cluster((DeviceSpec("a", "tcp://x:1", profile, tight, backend="torch:cpu:t1"),
                   DeviceSpec("b", "tcp://x:2", profile, 4 << 30, backend="torch:cpu:t1")), Link(1e12, 0.0))
    got = _planned(graph, two)
    assert got["order search"] == got["cp-sat"]
    assert dict(got["cp-sat"][0]) == {"a": "per-block", "b": "keep"}
