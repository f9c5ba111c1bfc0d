"""Issue 31 target 4 for pipelines: `plan` for LoRA over a float32 base writes base.safetensors, whose copy its
workers hold and map (runtime.pipeline.bundles.rebuild_weights), so a stage whose engine reads the base a few
blocks at a time (`ir.documents.maps_frozen_base`: MNN exactly per block here) is charged the mapped term
(`planner.cost.STREAMED_FROZEN`) in plan.json, by hand: the stage's layers' frozen weights each in a placeholder
set of its own (a stage of fewer layers than `STREAM_SETS`), its norms' scales whole; a hybrid stage
(per-block+K, its base held as MNN constants) and a base held int4 are charged as before. The plan's figure is
the sum of its terms (the partition instance bounds the search with the whole base; the plan is re-costed)."""
from __future__ import annotations

import json

from ir.bundle import load_plan
from jobs.common.lora import adapted
from jobs.planning import PlanSettings, plan_model
from planner.cost import STREAM_SETS, STREAMED_FROZEN
from planner.lora import LoraSettings
from planner.memory_defaults import default_profile
from planner.onnx_import import load_model
from support import made_once, streamed_llama


def _plan(export_dir, tmp_path, base_dtype: str):
    model = made_once(export_dir / "streamed-llama", streamed_llama) / "m.onnx"
    lora = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype=base_dtype)
    graph = adapted(load_model(model, 1, 16), lora)
    (tmp_path / "p.json").write_text(json.dumps(default_profile(graph, "p", backend="mnn:cpu:t1", per_block=True)
                                                .to_json()))
    # 100 MiB each: MNN per block on the first two stages, the last keeps one block's caches (per-block+1)
    (tmp_path / "c.json").write_text(json.dumps({
        "devices": [{"name": n, "profile": "p.json", "memory_budget": "100MiB", "backend": "mnn:cpu:t1",
                     "address": f"tcp://127.0.0.1:{5600 + k}"} for k, n in enumerate("abc")],
        "links": {"default": {"bandwidth": "100Mbit/s", "latency": "5ms"}}}))
    plan_model(model, tmp_path / "c.json", PlanSettings("1f1b-flush", 2, 16, 2, lora=lora), tmp_path / "plan")
    return graph, load_plan(tmp_path / "plan")


def test_a_float32_lora_plan_charges_its_per_block_stages_their_mapped_base(export_dir, tmp_path):
    graph, plan = _plan(export_dir, tmp_path, "float32")
    modes = {d.activations for d in plan.devices}
    assert "per-block" in modes and any(m.startswith("per-block+") for m in modes), modes
    params = set(graph.params)
    for d in plan.devices:
        first, last = d.blocks
        frozen = {k: v for k, v in d.memory_terms.items() if k.startswith("frozen")}
        if d.activations != "per-block":
            assert set(frozen) == {"frozen float32"}, (d.name, frozen)  # held as MNN constants, as before
            continue
        assert last - first + 1 <= STREAM_SETS  # every layer a placeholder set of its own: its weights once each
        # by hand, off the graph's arrays: each frozen weight of a product (streamed) and each norm's scale (held);
        # not the word table (only looked up: its rows gathered, its pages given back) nor the rotary tables
        read = {i for b in graph.blocks[first:last + 1] for n in b.nodes
                if graph.node(n).op in ("MatMul", "RMSNorm") for i in graph.node(n).inputs[1:2]}
        by_hand = sum(int(graph.constants[i].nbytes) for i in read if i in graph.constants and i not in params)
        assert frozen == {"frozen " + STREAMED_FROZEN: by_hand}, (d.name, frozen, by_hand)
    for d in plan.devices:
        assert d.memory_bytes == sum(d.memory_terms.values()), d.name


def test_an_int4_lora_plan_is_charged_its_base_held(export_dir, tmp_path):
    _, plan = _plan(export_dir, tmp_path, "int4")
    assert not any(STREAMED_FROZEN in k for d in plan.devices for k in d.memory_terms)
