"""Issue 31 target 3: a stage is charged at least its set-up's peak. A PyTorch worker imports torch on its
bare runtime before it reads a weight (`runtime.engines.single.import_engine`), and that import peaks
above where it settles (the profile's probe: runtime 56.0 MiB, settled +146.5, peak +179.2 here, helper
h153): a torch stage holding less than that difference beyond its runtime and engine read over its plan,
which charged only the settled figure. The profile records the import's peak
(`BackendProfile.engine_setup_peak_bytes`) and the cost model charges max(set-up peak, the trained peak)
(`planner.cost.phase_peak_bytes`); a profile made before (no field) is charged as then."""
from __future__ import annotations

import json

from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import stage_memory_terms
from support import EMB, ENC, HEAD, tiny_graph

MIB = 2 ** 20
RUNTIME, SETTLED, IMPORT_PEAK = 56 * MIB, 150 * MIB, 180 * MIB  # the probe's figures, rounded


def _device(encoder_workspace: int, setup_field: bool) -> DeviceSpec:
    """A torch device from a profile document (as `confidant profile` writes one), with or without
    the import's peak (a profile made before this field)."""
    costs = {EMB: BlockCost(0.001, 0.002, 0.0, MIB), ENC: BlockCost(0.01, 0.02, 0.0, encoder_workspace),
             HEAD: BlockCost(0.001, 0.001, 0.0, MIB)}
    profile = DeviceProfile("d", "tiny", 8, 32, (BackendProfile("torch:cpu:t1", costs, engine_overhead_bytes=SETTLED),),
                            4 << 30, RUNTIME)
    doc = json.loads(json.dumps(profile.to_json()))
    if setup_field:
        doc["backends"][0]["engine_setup_peak_bytes"] = IMPORT_PEAK
    else:
        doc["backends"][0].pop("engine_setup_peak_bytes", None)
    return DeviceSpec("d", "tcp://d:1", DeviceProfile.from_json(doc), 1 << 30, "torch:cpu:t1")


def test_a_stage_holding_less_than_the_imports_transient_is_charged_the_set_up_peak_by_hand():
    """The embeddings alone (1 MiB of workspace, a few KiB of weights): trained, the runtime and engine as
    settled and little more (206 MiB and change); the set-up peaked at runtime + import peak = 236 MiB by
    hand: that is the stage's figure, and its terms say so. A profile without the field: today's charge."""
    graph = tiny_graph()
    old = stage_memory_terms(graph, _device(MIB, False), 0, 0, 0, 2, "1f1b-flush", 2, "adamw")
    new = stage_memory_terms(graph, _device(MIB, True), 0, 0, 0, 2, "1f1b-flush", 2, "adamw")
    assert RUNTIME + SETTLED < old.total < RUNTIME + SETTLED + 4 * MIB
    assert new.total == RUNTIME + IMPORT_PEAK == 236 * MIB, (new.total / MIB, old.total / MIB)
    terms = new.by_name()
    assert sum(terms.values()) == new.total
    assert terms["engine import peak (set-up)"] == 236 * MIB - old.total
    assert "engine import peak (set-up)" not in old.by_name()
    # the partitioners' instance prices a stage as the cost model does (the whole model, on one device)
    from planner.partition.instance import make_instance

    device, n = _device(MIB, True), len(graph.blocks)
    inst = make_instance(graph, Cluster((device,), Link(1e9, 0.0)), "1f1b-flush", 2, "adamw")
    whole = stage_memory_terms(graph, device, 0, n - 1, 0, 1, "1f1b-flush", 2, "adamw").total
    assert inst.stage_bytes(0, 0, n - 1, 1, 0) == whole == 236 * MIB


def test_a_stage_whose_training_peaks_higher_is_not_moved():
    """The encoder's 100 MiB workspace puts the trained peak above the set-up's: the field changes nothing."""
    graph = tiny_graph()
    n = len(graph.blocks)
    old = stage_memory_terms(graph, _device(100 * MIB, False), 0, n - 1, 0, 1, "1f1b-flush", 2, "adamw")
    new = stage_memory_terms(graph, _device(100 * MIB, True), 0, n - 1, 0, 1, "1f1b-flush", 2, "adamw")
    assert old.total > RUNTIME + IMPORT_PEAK
    assert new.total == old.total and new.by_name() == old.by_name()
