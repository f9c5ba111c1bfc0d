"""A stage's one transient (issue 31, target 3): one block's backward runs at a time, so a stage needs
the largest transient of its OWN blocks once (`planner.cost.transient_bytes`), not the model's largest
on every stage, and not twice on a stage that ends at the last layer before a fused LM head (both
were charged: SmolLM2's middle stage planned 204 MiB, measured 159). The partitioners' instance
prices a stage by the same rule (`PartitionInstance.stage_bytes`: a max, not a sum), and every
partitioner's plan carries planner.cost's bytes for each of its stages.

By hand on a tiny Llama (embeddings, 4 layers, the LM head, its fused loss) with chosen figures (MiB):
a layer's workspace 40 (24 stacked, so 16 transient; 16 kept per further micro-batch on a device
that keeps activations), the fused head + loss's peak 100, the embeddings nothing."""
from __future__ import annotations

import itertools

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import stage_costs, stage_memory_bytes, stage_memory_terms, transient_bytes

MIB = 2 ** 20
B, S, LAYERS = 2, 12, 4
RUNTIME = 50 * MIB


def _costs(graph, layer_mib=(40, 24, 16), head_mib=100) -> dict[str, BlockCost]:
    workspace, stacked, kept = (m * MIB for m in layer_mib)
    blocks = graph.blocks
    out = {block_signature(blocks[0]): BlockCost(0.001, 0.002, 0.0, 0, stacked_bytes=0, kept_bytes=0)}
    for b in blocks[1:-2]:
        out[block_signature(b)] = BlockCost(0.01, 0.02, 0.005, workspace, stacked_bytes=stacked, kept_bytes=kept,
                                            per_block_workspace_bytes=30 * MIB, per_block_stacked_bytes=2 * MIB)
    out[block_signature(blocks[-2])] = BlockCost(0.004, 0.008, 0.0, head_mib * MIB, kept_bytes=0)
    out[block_signature(blocks[-1])] = BlockCost(0.001, 0.001, 0.0, 50 * MIB, kept_bytes=0)
    return out


def _device(graph, name="d", activations="keep", budget=4 << 30, **kw) -> DeviceSpec:
    profile = DeviceProfile(name, graph.name, B, S, (BackendProfile("mnn:cpu:t1", _costs(graph, **kw)),), 16 << 30,
                            RUNTIME)
    return DeviceSpec(name, f"tcp://{name}:1", profile, budget, "mnn:cpu:t1", activations=activations)


def test_the_layers_and_the_blocks_around_them(tiny_llama):
    n = len(tiny_llama.blocks)
    assert n == LAYERS + 3 and tiny_llama.blocks[-2].name != tiny_llama.blocks[1].name
    assert len({block_signature(b) for b in tiny_llama.blocks[1:-2]}) == 1


def test_a_keeping_stage_of_layers_pays_their_transient_once_by_hand(tiny_llama):
    """Stage 0 of 2 under 1f1b-flush with 4 micro-batches: 2 in flight. All four layers on a device
    that keeps activations: workspace 4 x 24 stacked + 16 transient = 112 MiB (the old model charged
    the model's largest transient, the head's, to every stage, and the layers' 16 once more to the
    block before the head); kept 4 x 16 x (2 - 1) = 64 MiB; nothing else moves with the workspace."""
    device = _device(tiny_llama)
    first, last = 1, LAYERS
    terms = stage_memory_terms(tiny_llama, device, first, last, 0, 2, "1f1b-flush", 4, "adamw")
    assert terms.workspace_bytes == 112 * MIB
    assert terms.kept_activation_bytes == 64 * MIB
    assert transient_bytes(tiny_llama, device, first, last) == 16 * MIB
    assert terms.head_loss_bytes == 0
    bare = _device(tiny_llama, layer_mib=(0, 0, 0), head_mib=0)
    assert (stage_memory_bytes(tiny_llama, device, first, last, 0, 2, "1f1b-flush", 4, "adamw")
            - stage_memory_bytes(tiny_llama, bare, first, last, 0, 2, "1f1b-flush", 4, "adamw")) == (112 + 64) * MIB
    # the same layers recomputed: one micro-batch's caches, the same one transient, nothing kept
    again = stage_memory_terms(tiny_llama, _device(tiny_llama, activations="recompute"), first, last, 0, 2,
                               "1f1b-flush", 4, "adamw")
    assert (again.workspace_bytes, again.kept_activation_bytes) == (112 * MIB, 0)
    # per block: 4 x 2 stacked + (30 - 2) transient, once
    per_block = stage_memory_terms(tiny_llama, _device(tiny_llama, activations="per-block"), first, last, 0, 2,
                                   "1f1b-flush", 4, "adamw")
    assert per_block.workspace_bytes == (4 * 2 + 28) * MIB


def test_the_head_stage_pays_its_peak_and_beside_layers_their_transient_once(tiny_llama):
    """The last stage (1 in flight): the fused head + loss alone its peak of 100; with two layers
    2 x 24 + 16 + 100 = 164 MiB, of which `show` names 100 'LM head + loss'; and a head smaller than
    the layers' transient alone is charged its own 10, not the layers' 16. Each less the head's weight
    gradient, which the profile's figure holds and the engine adds into the sum the plan's 4 micro-batches
    keep (`planner.cost.summed_head_gradient_bytes`); at one micro-batch (no sum) the figures themselves."""
    n = len(tiny_llama.blocks)
    device = _device(tiny_llama)
    weight = tiny_llama.node(tiny_llama.blocks[-2].nodes[-1]).inputs[1]
    assert weight in tiny_llama.params
    head = int(tiny_llama.constants[weight].nbytes)

    def terms(first, dev=device, microbatches=4):
        return stage_memory_terms(tiny_llama, dev, first, n - 1, 1, 2, "1f1b-flush", microbatches, "adamw")

    assert terms(n - 2).workspace_bytes == 100 * MIB - head
    assert terms(n - 2, microbatches=1).workspace_bytes == 100 * MIB
    both = terms(n - 4)
    assert both.workspace_bytes == (2 * 24 + 16 + 100) * MIB - head and both.head_loss_bytes == 100 * MIB - head
    assert both.by_name()["LM head + loss"] == 100 * MIB - head and both.by_name()["workspace"] == 64 * MIB
    assert terms(n - 2, _device(tiny_llama, head_mib=10)).workspace_bytes == 10 * MIB - head


def _cluster(graph, budgets=(4 << 30,) * 3) -> Cluster:
    modes = ("keep", "recompute", "per-block")
    return Cluster(tuple(_device(graph, f"d{k}", modes[k], budgets[k]) for k in range(3)), Link(1e8, 0.0005))


@pytest.mark.parametrize("kind, schedule", [("full", "1f1b-flush"), ("full", "gpipe"), ("lora", "1f1b-flush"),
                                            ("lora", "1f1b-stash")])
def test_the_partition_instance_prices_every_stage_as_planner_cost(tiny_llama_of, kind, schedule):
    """Every cut of 1-3 stages that keeps the head with its loss, over devices that keep, recompute
    and recompute per block: the instance's stage bytes (what every partitioner reads) equal
    planner.cost's one formula, the transient being the stage's own largest."""
    from planner.partition import make_instance, manual_partition

    graph = tiny_llama_of(kind)
    n = len(graph.blocks)
    cluster = _cluster(graph)
    inst = make_instance(graph, cluster, schedule, 4, "adamw")
    assert inst.transient_bytes[0] == (0,) + (16 * MIB,) * LAYERS + (0, 0)
    cuts_of = [()] + [(c,) for c in range(1, n - 1)] + list(itertools.combinations(range(1, n - 1), 2))
    checked = 0
    for cuts in cuts_of:
        for names in itertools.permutations([d.name for d in cluster.devices], len(cuts) + 1):
            plan = manual_partition(inst, list(names), list(cuts))
            costs = stage_costs(graph, cluster, plan, schedule, 4, "adamw")
            assert [s.memory_bytes for s in plan.stages] == [c.memory_bytes for c in costs], (cuts, names)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("kind, schedule", [("full", "1f1b-flush"), ("lora", "1f1b-stash")])
def test_each_partitioner_plans_stages_whose_bytes_are_planner_costs_and_fit(tiny_llama_of, kind, schedule):
    """The fixed-order program (solve_partition) and the CP-SAT model alone, on budgets tight enough
    that the layers must be split: every stage they choose has planner.cost's bytes and fits its
    device by them; the two find plans of the same predicted step (the exact optimum)."""
    from planner.partition import cpsat_partition, make_instance, predicted_step_us, solve_partition

    graph = tiny_llama_of(kind)
    n = len(graph.blocks)
    loose = make_instance(graph, _cluster(graph), schedule, 4, "adamw")
    # each device fits about half of the model at its position's worst
    whole = max(loose.stage_bytes(d, 0, n - 1, 1, 0) for d in range(3))
    budgets = tuple(int(whole * f) for f in (0.55, 0.7, 0.6))
    cluster = _cluster(graph, budgets)
    inst = make_instance(graph, cluster, schedule, 4, "adamw")
    plans = [solve_partition(inst, time_limit_s=10.0, workers=1, seed=0),
             cpsat_partition(inst, time_limit_s=10.0, workers=1, seed=0)]
    for plan in plans:
        assert len(plan.stages) > 1
        costs = stage_costs(graph, cluster, plan, schedule, 4, "adamw")
        for st, c in zip(plan.stages, costs):
            assert st.memory_bytes == c.memory_bytes <= cluster.device(st.device).memory_budget_bytes
    assert predicted_step_us(inst, plans[0]) == predicted_step_us(inst, plans[1])


def test_the_dp_and_cp_sat_honour_a_transient_that_alone_decides_the_fit():
    """Two devices, three blocks of no size but one transient each (block 1: 60), budgets where a
    stage holding block 1 fits only the device with room for that transient: both partitioners put
    block 1 there, though the other device is faster, and neither plans a stage over its budget."""
    from planner.partition import PartitionInstance, cpsat_partition, solve_partition
    from planner.partition.instance import _overflows

    inst = PartitionInstance(
        devices=("fast", "roomy"), block_names=("b0", "b1", "b2"),
        compute_us=((10, 10, 10), (100, 100, 100)), params_bytes=(0, 0, 0), input_bytes=(0, 1, 1),
        workspace_bytes=((0, 0, 0), (0, 0, 0)), overhead_bytes=(0, 0), memory_budget_bytes=(50, 100),
        boundary_bytes=(1, 1), link_bandwidth_bytes_per_s=((0.0, 1e9), (1e9, 0.0)), link_latency_us=((0, 0), (0, 0)),
        weight_copies=((1,), (1, 1)), in_flight=((1,), (1, 1)), microbatches=1, schedule="1f1b-flush",
        transient_bytes=((5, 60, 5), (5, 60, 5)))
    for plan in (solve_partition(inst, time_limit_s=10.0, workers=1, seed=0),
                 cpsat_partition(inst, time_limit_s=10.0, workers=1, seed=0)):
        devs = tuple(inst.devices.index(d) for d in plan.devices)
        assert max(_overflows(inst, devs, plan.ranges)) <= 0
        holder = next(s for s in plan.stages if s.first_block <= 1 <= s.last_block)
        assert holder.device == "roomy"
        assert holder.memory_bytes == 60 + sum(inst.input_bytes[holder.first_block:holder.last_block + 1])
        fast = [s for s in plan.stages if s.device == "fast"]
        assert fast and all(s.memory_bytes <= 50 for s in fast)
