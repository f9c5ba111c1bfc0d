"""A re-plan after a loss prefers, among plans predicted within a few % of the best step, the one that
leaves most of the survivors' trainable state where it is (issue 32; planner.replan.bytes_in_place,
KEEP_IN_PLACE_WITHIN). Before, `replan_without` took the fastest predicted plan whatever it moved: a
lost first stage shifted every range one worker down, so no survivor kept a block and the recovery
fetched and sent every block's weights and moments (runtime.pipeline.kept_state keeps only what
stays). Hand-made instances on FLOPs-only profiles (what `confidant train-pipeline` re-plans with)."""
from __future__ import annotations

from ir.graph import Graph
from planner.partition import make_instance, manual_partition, predicted_step_us
from planner.replan import (KEEP_IN_PLACE_WITHIN, best_cuts, bytes_in_place, flops_cluster, partition_of,
                            replan_without, without_devices)
from support import _block

DEVICES = ["x", "y", "z"]
RANGES = [(0, 1), (2, 2), (3, 4)]  # x: embeddings and layer0; y: layer1; z: layer2 and the head


def _graph(layer2_flops: int) -> Graph:
    """Embeddings, three encoder layers, a head; block k's trainable bytes 1000 x (k + 1)."""
    spec = [("embeddings", "embeddings", 10 ** 7), ("layer0", "encoder", 2 * 10 ** 7),
            ("layer1", "encoder", 2 * 10 ** 7), ("layer2", "encoder", layer2_flops), ("head", "head", 5 * 10 ** 6)]
    return Graph("t", (), (), (), {}, {}, (), tuple(_block(k, name, kind, 1000 * (k + 1), 400, flops)
                                                    for k, (name, kind, flops) in enumerate(spec)))


def _steps(graph: Graph) -> dict[tuple, float]:
    """Predicted step (us) of each cut of the blocks over y, z (x lost)."""
    inst = make_instance(graph, without_devices(flops_cluster(graph, DEVICES), "x"), "1f1b-flush", 4, "adamw")
    return {tuple(manual_partition(inst, ["y", "z"], [c]).ranges): predicted_step_us(inst, manual_partition(
        inst, ["y", "z"], [c])) for c in range(1, 5)}


def test_bytes_in_place_counts_the_blocks_a_plan_leaves_on_their_device():
    graph, current = _graph(2 * 10 ** 7), partition_of(RANGES, DEVICES)
    # y keeps layer1 (3000), z keeps layer2 and the head (4000 + 5000); x's blocks are gone with it
    assert bytes_in_place(graph, current, partition_of([(0, 2), (3, 4)], ["y", "z"])) == 12000
    # y takes embeddings and layer0 (x's), z layer1 too: only z's own stay
    assert bytes_in_place(graph, current, partition_of([(0, 1), (2, 4)], ["y", "z"])) == 9000
    assert bytes_in_place(graph, current, current) == 15000


def test_a_lost_first_stage_keeps_the_survivors_blocks_when_that_is_within_a_few_percent():
    """layer2 at 2.4e7 FLOPs: shifting every range ([(0, 1), (2, 4)]) is predicted 1.3% faster
    than leaving layer1 on y and layer2 + head on z ([(0, 2), (3, 4)]), which keeps 12000 bytes in
    place against 9000: the re-plan keeps them (before: the shifted plan)."""
    graph = _graph(24 * 10 ** 6)
    steps = _steps(graph)
    fastest, keeping = steps[((0, 1), (2, 4))], steps[((0, 2), (3, 4))]
    assert fastest < keeping <= fastest * (1 + KEEP_IN_PLACE_WITHIN), steps
    assert min(steps, key=steps.get) == ((0, 1), (2, 4))
    inst = make_instance(graph, without_devices(flops_cluster(graph, DEVICES), "x"), "1f1b-flush", 4, "adamw")
    assert best_cuts(inst, ["y", "z"]).ranges == [(0, 1), (2, 4)]  # no preference: the fastest
    assert replan_without(graph, RANGES, DEVICES, ["x"], "1f1b-flush", 4, "adamw") == [(0, 2), (3, 4)]


def test_a_plan_that_keeps_more_but_is_predicted_slower_by_more_than_that_is_not_taken():
    """layer2 at 2.1e7 FLOPs: the keeping plan is predicted 5.6% slower: the fastest stands."""
    graph = _graph(21 * 10 ** 6)
    steps = _steps(graph)
    assert steps[((0, 2), (3, 4))] > steps[((0, 1), (2, 4))] * (1 + KEEP_IN_PLACE_WITHIN), steps
    assert replan_without(graph, RANGES, DEVICES, ["x"], "1f1b-flush", 4, "adamw") == [(0, 1), (2, 4)]


def test_a_tie_keeps_the_blocks_in_place():
    """Blocks too cheap for their FLOPs to count (each at FLOPs-only profiles' 1 us floor): cutting
    after layer0 or after layer1 ties; the tie goes to the one that keeps layer1 on y."""
    graph = Graph("t", (), (), (), {}, {}, (), tuple(_block(k, f"b{k}", "encoder", 1000 * (k + 1), 400, 10)
                                                     for k in range(5)))
    inst = make_instance(graph, without_devices(flops_cluster(graph, DEVICES), "x"), "1f1b-flush", 4, "adamw")
    assert best_cuts(inst, ["y", "z"]).ranges == [(0, 1), (2, 4)]  # the first of the two found
    assert replan_without(graph, RANGES, DEVICES, ["x"], "1f1b-flush", 4, "adamw") == [(0, 2), (3, 4)]
