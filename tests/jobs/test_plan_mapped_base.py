"""Issue 31 target 4 for pipelines: `plan` for LoRA over a float32 base writes base.safetensors, whose copy its
workers hold and map (runtime.pipeline.bundles.rebuild_weights), so a PyTorch stage recomputing per block is
charged the mapped term in plan.json (`planner.cost.MAPPED_FROZEN`), by hand off the graph's arrays: its
largest block's frozen weights (a tied table charged to the embeddings' block and the head's alike); an MNN stage (its worker maps it too) and a
base held int4 are charged their whole base, as before. The plan's figure is the sum of its terms (the
partition instance charges a PyTorch stage the same mapped term: tests/jobs/test_plan_mapped_search.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from ir.bundle import load_plan
from jobs.common.lora import adapted
from jobs.planning import PlanSettings, plan_model
from planner.cost import MAPPED_FROZEN
from planner.lora import LoraSettings
from planner.memory_defaults import default_profile
from planner.onnx_import import load_model
from support import made_once, streamed_llama


def _plan(export_dir, tmp_path, base_dtype: str, engine: str, budget: str):
    model = made_once(export_dir / "streamed-llama", streamed_llama) / "m.onnx"
    lora = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype=base_dtype)
    graph = adapted(load_model(model, 1, 16), lora)
    profile = default_profile(graph, "p", backend=f"{engine}:cpu:t1", per_block=True)
    # a PyTorch profile whose per-block lines were measured in fresh workers: the planner offers per block there
    profile = dataclasses.replace(profile, backends=tuple(dataclasses.replace(b, fresh_lines=True)
                                                          for b in profile.backends))
    (tmp_path / "p.json").write_text(json.dumps(profile.to_json()))
    (tmp_path / "c.json").write_text(json.dumps({
        "devices": [{"name": n, "profile": "p.json", "memory_budget": budget, "backend": f"{engine}:cpu:t1",
                     "address": f"tcp://127.0.0.1:{5600 + k}"} for k, n in enumerate("abc")],
        "links": {"default": {"bandwidth": "100Mbit/s", "latency": "5ms"}}}))
    plan_model(model, tmp_path / "c.json", PlanSettings("1f1b-flush", 2, 16, 2, lora=lora), tmp_path / "plan")
    return graph, load_plan(tmp_path / "plan")


def _frozen(device) -> dict:
    return {k: v for k, v in device.memory_terms.items() if k.startswith("frozen")}


def test_a_float32_lora_plan_charges_its_torch_per_block_stages_their_mapped_base(export_dir, tmp_path):
    graph, plan = _plan(export_dir, tmp_path, "float32", "torch", "100MiB")
    assert len(plan.devices) > 1 and {d.activations for d in plan.devices} == {"per-block"}
    params = set(graph.params)
    n = len(graph.blocks)
    for d in plan.devices:
        first, last = d.blocks
        looked_up = {graph.node(x).inputs[0] for x in graph.blocks[0].nodes if graph.node(x).op == "Gather"}

        def frozen(b) -> int:  # the block's frozen weights (products' and norms'), by hand
            read = {i for x in b.nodes if graph.node(x).op in ("MatMul", "RMSNorm") for i in graph.node(x).inputs[1:2]}
            if b.index in (0, n - 2):  # the tied table: looked up by the one, read whole by the other
                read |= looked_up
            return sum(int(graph.constants[i].nbytes) for i in read if i in graph.constants and i not in params)

        by_hand = max(frozen(b) for b in graph.blocks[first:last + 1])
        assert _frozen(d) == {"frozen " + MAPPED_FROZEN: by_hand}, (d.name, _frozen(d), by_hand)
        assert d.memory_bytes == sum(d.memory_terms.values()), d.name


@pytest.mark.parametrize("base_dtype,engine,budget", [("float32", "mnn", "100MiB"), ("int4", "torch", "100MiB")])
def test_an_mnn_plan_and_an_int4_base_are_charged_their_base_held(export_dir, tmp_path, base_dtype, engine, budget):
    _, plan = _plan(export_dir, tmp_path, base_dtype, engine, budget)
    assert not any(MAPPED_FROZEN in k or "mapped" in k for d in plan.devices for k in d.memory_terms)
    assert all(_frozen(d) for d in plan.devices)
