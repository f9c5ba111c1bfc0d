"""A further micro-batch's once-a-stage part (issue 31, target 3): a PyTorch stage recomputing per block
holds, for each micro-batch in flight after the first, its blocks' checkpoints (`BlockCost.
per_block_kept_bytes`, per block) and a part that does not grow with the blocks (the stage's output,
its checkpoints' bookkeeping: ~13-24 MiB on SmolLM2 int4; `BlockCost.per_block_kept_once_bytes`). The
memory model charges the latter once a stage per further micro-batch in flight (`planner.cost.
kept_once_bytes`, the largest of the stage's blocks', `kept_copies` times): nothing where one
micro-batch is in flight, twice where three are. Profiles made before held it in the per-block
workspace (charged once on every stage, the last stage's ~0.89 of its plan); they keep that charge.
The partition instance and both solvers price it the same way (a max, as the stage's transient).

By hand on a tiny Llama (embeddings, 4 layers, the LM head, its fused loss), PyTorch: a layer per block
30 MiB of workspace of which 2 stay a further block, 1 MiB a further micro-batch per layer and 13 once."""
from __future__ import annotations

import itertools

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import kept_once_bytes, stage_costs, stage_memory_bytes, stage_memory_terms

MIB = 2 ** 20
B, S, LAYERS = 2, 12, 4
RUNTIME = 50 * MIB
ONCE = 13


def _costs(graph, once_mib: int | None = ONCE) -> dict[str, BlockCost]:
    blocks = graph.blocks
    out = {block_signature(blocks[0]): BlockCost(0.001, 0.002, 0.0, 0, stacked_bytes=0, kept_bytes=0)}
    for b in blocks[1:-2]:
        out[block_signature(b)] = BlockCost(
            0.01, 0.02, 0.0, 40 * MIB, stacked_bytes=24 * MIB, kept_bytes=16 * MIB, per_block_workspace_bytes=30 * MIB,
            per_block_stacked_bytes=2 * MIB, per_block_kept_bytes=MIB, per_block_backward_s=0.035,
            per_block_kept_once_bytes=None if once_mib is None else once_mib * MIB)
    out[block_signature(blocks[-2])] = BlockCost(0.004, 0.008, 0.0, 100 * MIB, kept_bytes=0, per_block_backward_s=0.008)
    out[block_signature(blocks[-1])] = BlockCost(0.001, 0.001, 0.0, 50 * MIB, kept_bytes=0)
    return out


def _device(graph, name="d", activations="per-block", budget=4 << 30, backend="torch:cpu:t1", **kw) -> DeviceSpec:
    profile = DeviceProfile(name, graph.name, B, S, (BackendProfile(backend, _costs(graph, **kw), fresh_lines=True),),
                            16 << 30, RUNTIME)
    return DeviceSpec(name, f"tcp://{name}:1", profile, budget, backend, activations=activations)


def test_a_stage_pays_the_once_part_per_further_micro_batch_in_flight_by_hand(tiny_llama):
    """The four layers under 1f1b-flush, 4 micro-batches, as stage s of 3: 3 - s in flight. Kept: 4 layers
    x 1 MiB and the once part 13 MiB, each (in flight - 1) times: 34 MiB at stage 0 (the once part twice),
    17 at stage 1, nothing at stage 2 (one in flight: no further micro-batch, so no once part either;
    before, 13 MiB of it sat in every stage's workspace). The workspace is the per-block line's alone."""
    device = _device(tiny_llama)
    first, last = 1, LAYERS
    terms = [stage_memory_terms(tiny_llama, device, first, last, s, 3, "1f1b-flush", 4, "adamw") for s in range(3)]
    assert [t.kept_activation_bytes for t in terms] == [2 * (4 + ONCE) * MIB, (4 + ONCE) * MIB, 0]
    assert [kept_once_bytes(tiny_llama, device, first, last, 3 - s) for s in range(3)] == \
        [2 * ONCE * MIB, ONCE * MIB, 0]
    assert all(t.workspace_bytes == (4 * 2 + 28) * MIB for t in terms)
    assert terms[0].by_name()["activations kept"] == 34 * MIB
    # the same profile without the measurement (the once part not split off): nothing per stage
    bare = _device(tiny_llama, once_mib=None)
    for s, want in enumerate((2 * ONCE, ONCE, 0)):
        assert (stage_memory_bytes(tiny_llama, device, first, last, s, 3, "1f1b-flush", 4, "adamw")
                - stage_memory_bytes(tiny_llama, bare, first, last, s, 3, "1f1b-flush", 4, "adamw")) == want * MIB
    # a max, not a sum: one layer pays it as four do; the embeddings alone, the head alone nothing
    assert kept_once_bytes(tiny_llama, device, 1, 1, 3) == 2 * ONCE * MIB
    assert kept_once_bytes(tiny_llama, device, 0, 0, 3) == 0
    assert kept_once_bytes(tiny_llama, device, LAYERS + 1, LAYERS + 2, 3) == 0
    # gpipe: all 4 in flight on every stage, three further micro-batches
    assert kept_once_bytes(tiny_llama, device, first, last, 4) == 3 * ONCE * MIB


@pytest.mark.parametrize("activations, backend", [("keep", "torch:cpu:t1"), ("recompute", "torch:cpu:t1"),
                                                  ("per-block", "mnn:cpu:t1"), ("keep", "mnn:cpu:t1")])
def test_only_pytorch_recomputing_per_block_holds_the_once_part(tiny_llama, activations, backend):
    """Keeping holds the whole of each further micro-batch (`BlockCost.kept`), recomputing the stage none,
    MNN per block no checkpoints: the once part is charged nowhere else, measured or not."""
    device = _device(tiny_llama, activations=activations, backend=backend)
    bare = _device(tiny_llama, activations=activations, backend=backend, once_mib=None)
    assert kept_once_bytes(tiny_llama, device, 1, LAYERS, 3) == 0
    assert (stage_memory_bytes(tiny_llama, device, 1, LAYERS, 0, 3, "1f1b-flush", 4, "adamw")
            == stage_memory_bytes(tiny_llama, bare, 1, LAYERS, 0, 3, "1f1b-flush", 4, "adamw"))


def test_an_older_profile_keeps_its_charge_and_loads(tiny_llama):
    """A profile from before the split has no `per_block_kept_once_bytes` (its once part is in its
    per-block workspace): it loads, charges nothing per stage, and round-trips the new field."""
    device = _device(tiny_llama, once_mib=None)
    doc = device.profile.to_json()
    for backend in doc["backends"]:
        for cost in backend["blocks"].values():
            cost.pop("per_block_kept_once_bytes")
    old = DeviceProfile.from_json(doc)
    assert all(c.per_block_kept_once_bytes is None for c in old.backends[0].blocks.values())
    assert DeviceProfile.from_json(_device(tiny_llama).profile.to_json()) == _device(tiny_llama).profile
    with pytest.raises(ValueError, match="per_block_kept_once_bytes"):
        bad = _device(tiny_llama).profile.to_json()
        next(iter(bad["backends"][0]["blocks"].values()))["per_block_kept_once_bytes"] = -1
        DeviceProfile.from_json(bad)


def _cluster(graph, budgets=(4 << 30,) * 3, once=(ONCE, 20, ONCE)) -> Cluster:
    modes = ("per-block", "per-block", "keep")
    return Cluster(tuple(_device(graph, f"d{k}", modes[k], budgets[k], once_mib=once[k]) for k in range(3)),
                   Link(1e8, 0.0005))


@pytest.mark.parametrize("kind, schedule", [("full", "1f1b-flush"), ("full", "gpipe"), ("lora", "1f1b-flush")])
def test_the_partition_instance_prices_every_stage_as_planner_cost(tiny_llama_of, kind, schedule):
    """Every cut of 1-3 stages that keeps the head with its loss, over PyTorch devices recomputing per
    block (two once parts) and keeping: the instance's stage bytes (what every partitioner reads) equal
    planner.cost's, the once part the stage's own largest, (in flight - 1) times."""
    from planner.partition import make_instance, manual_partition

    graph = tiny_llama_of(kind)
    n = len(graph.blocks)
    cluster = _cluster(graph)
    inst = make_instance(graph, cluster, schedule, 4, "adamw")
    assert inst.kept_once_bytes[1] == (0,) + (20 * MIB,) * LAYERS + (0, 0)
    assert inst.kept_once_bytes[2] == (0,) * n  # keeping: none
    cuts_of = [()] + [(c,) for c in range(1, n - 1)] + list(itertools.combinations(range(1, n - 1), 2))
    checked = 0
    for cuts in cuts_of:
        for names in itertools.permutations([d.name for d in cluster.devices], len(cuts) + 1):
            plan = manual_partition(inst, list(names), list(cuts))
            costs = stage_costs(graph, cluster, plan, schedule, 4, "adamw")
            assert [s.memory_bytes for s in plan.stages] == [c.memory_bytes for c in costs], (cuts, names)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_each_partitioner_plans_stages_whose_bytes_are_planner_costs_and_fit(tiny_llama, schedule):
    """The fixed-order program (solve_partition) and the CP-SAT model alone, on budgets that make the
    layers split, the once part large enough to matter (60 MiB): every stage they choose has
    planner.cost's bytes and fits its device by them; both find the same predicted step."""
    from planner.partition import cpsat_partition, make_instance, predicted_step_us, solve_partition

    n = len(tiny_llama.blocks)
    once = (60, 60, 60)
    loose = make_instance(tiny_llama, _cluster(tiny_llama, once=once), schedule, 4, "adamw")
    whole = max(loose.stage_bytes(d, 0, n - 1, 1, 0) for d in range(3))
    cluster = _cluster(tiny_llama, tuple(int(whole * f) for f in (0.7, 0.8, 0.75)), once)
    inst = make_instance(tiny_llama, cluster, schedule, 4, "adamw")
    plans = [solve_partition(inst, time_limit_s=10.0, workers=1, seed=0),
             cpsat_partition(inst, time_limit_s=10.0, workers=1, seed=0)]
    for plan in plans:
        assert len(plan.stages) > 1
        costs = stage_costs(tiny_llama, cluster, plan, schedule, 4, "adamw")
        for st, c in zip(plan.stages, costs):
            assert st.memory_bytes == c.memory_bytes <= cluster.device(st.device).memory_budget_bytes
    assert predicted_step_us(inst, plans[0]) == predicted_step_us(inst, plans[1])


@pytest.mark.parametrize("schedule, in_flight, want", [
    ("1f1b-flush", ((1,), (2, 1)), (["roomy", "fast"], [(0, 0), (1, 2)], [15, 15])),
    ("gpipe", ((2,), (2, 2)), (["fast", "roomy"], [(0, 0), (1, 2)], [15, 45]))])
def test_the_solvers_honour_a_once_part_that_alone_decides_the_fit(schedule, in_flight, want):
    """Two devices whose engines hold a further micro-batch's once part, three blocks over two stages;
    block 1 has a once part of 30 and no size, blocks 0 and 2 hold 15 each. The fast device (budget 25)
    cannot hold all three, so a plan needs the slow, roomy one too. 1f1b-flush, 4 micro-batches: the
    first stage has 2 in flight, the last 1. The quickest plan, the fast device first with blocks 0-1
    (15 + 30 x (2 - 1) = 45), does not fit; the roomy one first with block 0 and the fast one last with
    blocks 1-2 (15: block 1's once part not held with one in flight) does. gpipe, 2 micro-batches: both
    stages have 2 in flight, so block 1 fits only on the roomy device (the last stage's once part too:
    the DP's last-stage table). The DP and CP-SAT choose that plan, every stage at the instance's bytes,
    none over its budget, and the greedy start's plan fits too."""
    from planner.partition import PartitionInstance, cpsat_partition, solve_partition
    from planner.partition.instance import _overflows
    from planner.partition.simple import greedy_partition

    inst = PartitionInstance(
        devices=("fast", "roomy"), block_names=("b0", "b1", "b2"),
        compute_us=((10, 10, 50), (100, 100, 100)), params_bytes=(0, 0, 0), input_bytes=(0, 0, 0),
        workspace_bytes=((15, 0, 15), (15, 0, 15)), overhead_bytes=(0, 0), memory_budget_bytes=(25, 100),
        boundary_bytes=(1, 1), link_bandwidth_bytes_per_s=((0.0, 1e9), (1e9, 0.0)),
        link_latency_us=((0, 0), (0, 0)), weight_copies=((1,), (1, 1)), in_flight=in_flight,
        microbatches=4 if schedule == "1f1b-flush" else 2, schedule=schedule,
        keeps_activations=(True, True), kept_bytes=((0, 0, 0), (0, 0, 0)), kept_once_bytes=((0, 30, 0), (0, 30, 0)))
    assert inst.stage_bytes(0, 0, 1, 2, 0) == 45
    assert inst.stage_bytes(0, 1, 2, 2, 1) == (15 if schedule == "1f1b-flush" else 45)
    for plan in (solve_partition(inst, time_limit_s=10.0, workers=1, seed=0),
                 cpsat_partition(inst, time_limit_s=10.0, workers=1, seed=0)):
        got = (list(plan.devices), [tuple(r) for r in plan.ranges], [st.memory_bytes for st in plan.stages])
        assert got == want, plan
        assert max(_overflows(inst, tuple(inst.devices.index(d) for d in plan.devices), plan.ranges)) <= 0
    greedy = greedy_partition(inst)
    assert greedy is not None and max(_overflows(inst, *greedy)) <= 0
