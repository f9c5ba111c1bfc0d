"""Issue 31 target 4 for pipelines: `plan` for LoRA over a float32 base writes base.safetensors, whose copy its
workers hold and map (runtime.pipeline.bundles.rebuild_weights), so a PyTorch stage recomputing per block is
charged the mapped term in plan.json (`planner.cost.MAPPED_FROZEN`), by hand off the graph's arrays: its
largest block's frozen weights (a tied table charged to the embeddings' block and the head's alike); an MNN stage
recomputing exactly per block the streamed term (`planner.cost.STREAMED_FROZEN`): per placeholder set one layer's
projections, the norms, the fused head's table chunk where it holds the head, and one read of the mapping (a fault
maps up to a 2 MiB span of the file: a feed-forward weight's two spans, or a lookup's two); a hybrid MNN stage and a
base held int4 are charged their whole base, as before. The plan's figure is the sum of its terms (the partition
instance charges a PyTorch stage the same mapped term, tests/jobs/test_plan_mapped_search.py, and bounds an MNN
stage with its whole base less a table it only looks up; the plan is re-costed)."""
from __future__ import annotations

import dataclasses
import json

from ir.bundle import load_plan
from jobs.common.lora import adapted
from jobs.planning import PlanSettings, plan_model
from planner.cost import MAPPED_FROZEN, STREAMED_FROZEN
from planner.lora import LoraSettings
from planner.memory_defaults import default_profile
from planner.onnx_import import load_model
from support import made_once, streamed_llama


def _plan(export_dir, tmp_path, base_dtype: str, engine: str, budget: str, batch: int = 2, seq: int = 16):
    model = made_once(export_dir / "streamed-llama", streamed_llama) / "m.onnx"
    lora = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype=base_dtype)
    graph = adapted(load_model(model, batch // 2, seq), lora)
    profile = default_profile(graph, "p", backend=f"{engine}:cpu:t1", per_block=True)
    # a PyTorch profile whose per-block lines were measured in fresh workers: the planner offers per block there
    profile = dataclasses.replace(profile, backends=tuple(dataclasses.replace(b, fresh_lines=True)
                                                          for b in profile.backends))
    (tmp_path / "p.json").write_text(json.dumps(profile.to_json()))
    (tmp_path / "c.json").write_text(json.dumps({
        "devices": [{"name": n, "profile": "p.json", "memory_budget": budget, "backend": f"{engine}:cpu:t1",
                     "address": f"tcp://127.0.0.1:{5600 + k}"} for k, n in enumerate("abc")],
        "links": {"default": {"bandwidth": "100Mbit/s", "latency": "5ms"}}}))
    plan_model(model, tmp_path / "c.json", PlanSettings("1f1b-flush", batch, seq, 2, lora=lora), tmp_path / "plan")
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


SPAN = 2 << 20  # the most of a file one read fault maps (a page-cache folio of a PMD, 4 KiB pages)


def test_a_float32_lora_plan_charges_its_mnn_per_block_stages_their_streamed_base(export_dir, tmp_path):
    """Micro-batches of 4 x 64, 144 MiB a device: the first two stages per block, the last a hybrid (its last
    block's caches kept)."""
    graph, plan = _plan(export_dir, tmp_path, "float32", "mnn", "144MiB", batch=8, seq=64)
    params = set(graph.params)
    n = len(graph.blocks)
    frozen = {k: v for k, v in graph.constants.items() if k not in params and k.startswith("model.")}
    table = int(frozen["model.embed_tokens.weight"].nbytes)
    layer = sum(int(v.nbytes) for k, v in frozen.items() if ".layers.0." in k and v.ndim == 2)  # 5.9 MiB
    largest = max(int(v.nbytes) for v in frozen.values() if v.ndim == 2 and v.nbytes != table)
    assert largest == 1024 * 384 * 4  # a feed-forward weight: 1.5 MiB, two spans at most
    streamed = [d for d in plan.devices if d.activations == "per-block"]
    assert len(plan.devices) > 1 and streamed and len(streamed) < len(plan.devices)
    for d in plan.devices:
        first, last = d.blocks
        if d not in streamed:  # a hybrid keeping its last blocks' caches holds its base as constants
            assert set(_frozen(d)) == {"frozen float32"}, (d.name, d.activations, _frozen(d))
            continue
        layers = [k for k in range(first, last + 1) if 1 <= k <= n - 3]  # blocks 1-12: the decoder layers
        norms = sum(int(graph.constants[i].nbytes) for b in graph.blocks[first:last + 1] for x in b.nodes
                    for i in graph.node(x).inputs if i in frozen and frozen[i].ndim == 1)
        by_hand = (len({k % 10 for k in layers}) * layer  # a layer's projections per placeholder set
                   + norms
                   + (table if first <= n - 2 and last == n - 1 else 0)  # the fused head reads its table whole
                   + (max(2 * SPAN, (-(-largest // SPAN) + 1) * SPAN) if layers or first == 0 else 0))  # one read
        assert _frozen(d) == {"frozen " + STREAMED_FROZEN: by_hand}, (d.name, d.blocks, _frozen(d), by_hand)
        assert d.memory_bytes == sum(d.memory_terms.values()), d.name


def test_an_int4_base_is_charged_its_base_held(export_dir, tmp_path):
    _, plan = _plan(export_dir, tmp_path, "int4", "torch", "100MiB")
    assert not any(MAPPED_FROZEN in k or "mapped" in k for d in plan.devices for k in d.memory_terms)
    assert all(_frozen(d) for d in plan.devices)
