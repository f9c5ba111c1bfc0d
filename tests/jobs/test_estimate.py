"""`confidant estimate`: the memory a plan would promise, without planning; levers with their MiB.

References: a blockwise encoding made here in numpy (the bytes of a frozen element), the ONNX file's
own initializers (what LoRA trains), and `confidant plan` itself on the same cluster (the estimate
must be the figure the plan promises, cut the same way)."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from ir.bundle import load_plan
from ir.precision import bytes_per_frozen_element, frozen_tensor_bytes, lookup_tables, quantize, storage_for
from jobs.common.errors import JobError
from jobs.estimate import MAX_ADDED_DEVICES, EstimateSettings, estimate_memory, parse_devices
from jobs.planning import PlanSettings, plan_model
from planner.cluster import DeviceSpec
from planner.cost import stage_memory_bytes, stage_params_bytes
from planner.lora import LoraSettings
from planner.memory_defaults import PARTS, default_profile, memory_parts, with_frozen_precision
from planner.onnx_import import load_model
from support import best_cut_in_two_bytes, run_cli, whole_model_bytes, write_nominal_cluster

SHAPE = dict(batch=4, seq=16, microbatches=2)
MIB = 2 ** 20


@pytest.fixture(scope="module")
def tiny(tiny_onnx):
    return tiny_onnx["torchscript-17"]


@pytest.mark.parametrize("numel", [64, 1000, 4096 * 3 + 5])
def test_frozen_bytes_are_those_of_the_engines_blockwise_encoding(numel):
    """As `ir.precision.quantize` holds a weight (one row of `numel`): int8 one float16 scale per 32,
    int4 a float16 step and offset per 32, codes two a byte; a partial last block padded."""
    values = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    for dtype in ("int8", "int4", "bfloat16"):
        assert frozen_tensor_bytes(numel, dtype) == quantize(values[None], dtype, 1).nbytes
    assert frozen_tensor_bytes(numel, "float32") == values.nbytes
    assert bytes_per_frozen_element("int8") == 1 + 2 / 32 and bytes_per_frozen_element("int4") == 0.5 + 4 / 32
    with pytest.raises(ValueError, match="float32, bfloat16, int8, int4"):
        bytes_per_frozen_element("fp8")


def test_parts_sum_to_the_memory_model_and_weights_are_the_trainable_bytes(tiny):
    graph = load_model(tiny, 2, 16)
    profile = default_profile(graph)
    device = DeviceSpec("d", "estimate://d", profile, 2 ** 40)
    n = len(graph.blocks)
    for first, last, stage, stages in ((0, n - 1, 0, 1), (0, 1, 0, 2), (2, n - 1, 1, 2)):
        parts = memory_parts(graph, device, first, last, stage, stages, "1f1b-flush", 2, "adamw")
        assert list(parts) == list(PARTS)
        assert sum(parts.values()) == stage_memory_bytes(graph, device, first, last, stage, stages, "1f1b-flush", 2,
                                                         "adamw")
        in_range = {p for b in graph.blocks[first:last + 1] for p in b.params}
        trainable = sum(int(graph.constants[p].nbytes) for p in in_range)
        assert parts["weights"] == trainable == stage_params_bytes(graph, first, last)
        assert parts["optimizer"] == 2 * trainable and parts["gradients"] == trainable
        assert parts["workspace"] > 0 and parts["runtime"] == profile.runtime_overhead_bytes


def _lora_trainable_bytes(rank: int, hidden: int = 64, layers: int = 2, labels: int = 9) -> int:
    """What LoRA on q, k, v, o plus the new head trains in the tiny BERT (tests/conftest.py's config:
    hidden 64, 2 layers, a 9-label head), float32: PEFT's count, written out."""
    return 4 * (layers * 4 * rank * (hidden + hidden) + hidden * labels + labels)


def test_lora_variant_trains_only_the_adapters_and_the_head(tiny):
    est = estimate_memory(tiny, EstimateSettings(**SHAPE, lora=LoraSettings(4)), devices=(("a", 2 ** 34),))
    graph = load_model(tiny, 2, 16)
    assert sum(s.parts["weights"] for s in est.requested.stages) == _lora_trainable_bytes(4)
    full = next(v for v in est.alternatives if v.settings.lora is None)
    assert sum(s.parts["weights"] for s in full.stages) == sum(int(graph.constants[p].nbytes) for p in graph.params)
    # an int4 base: the frozen part is what the LoRA pass holds quantized (tables int8), priced
    # exactly as it charges its blocks (planner.lora with base_dtype)
    from planner.lora import add_lora

    q = estimate_memory(tiny, EstimateSettings(**SHAPE, lora=LoraSettings(4), base_dtype="int4"), devices=(("a", 2 ** 34),))
    frozen32 = sum(s.parts["frozen"] for s in est.requested.stages)
    held, _ = add_lora(graph, LoraSettings(4, base_dtype="int4"))
    assert sum(s.parts["frozen"] for s in q.requested.stages) == pytest.approx(
        sum(b.frozen_bytes for b in held.blocks), abs=16 * len(held.blocks))
    assert 0 < sum(s.parts["frozen"] for s in q.requested.stages) < frozen32 / 4


def test_estimate_is_what_plan_promises_cut_the_same_way(tiny, tmp_path):
    graph = load_model(tiny, 2, 16)
    alone = estimate_memory(tiny, EstimateSettings(**SHAPE), devices=(("big", 2 ** 40),)).requested.stages[0]
    runtime = alone.parts["runtime"]
    # neither device holds the whole model beside the 16 MiB both `plan` and `estimate` keep free of each
    # budget for the snapshot copies on the workers
    budget = runtime + int((alone.memory_bytes - runtime) * 0.8) + 16 * MIB
    cluster = write_nominal_cluster(tmp_path, graph, [("phone", budget), ("laptop", budget)])
    plan_dir = plan_model(tiny, cluster, PlanSettings(**SHAPE), tmp_path / "plan")
    plan = load_plan(plan_dir)
    est = estimate_memory(tiny, EstimateSettings(**SHAPE),
                          cluster_file=write_nominal_cluster(tmp_path, graph, [("phone", budget), ("laptop", budget)],
                                                      addresses=False))
    assert est.requested.fits and len(est.requested.stages) == 2
    planned = {d.name: (d.first_block, d.last_block, d.memory_bytes) for d in plan.devices}
    assert {s.device: (s.first_block, s.last_block, s.memory_bytes) for s in est.requested.stages} == planned


def test_lora_is_a_lever_and_plan_offers_it_when_it_fits(tiny, tmp_path):
    graph = load_model(tiny, 2, 16)
    one = lambda lora: estimate_memory(tiny, EstimateSettings(**SHAPE, lora=lora),  # noqa: E731
                                       devices=(("a", 2 ** 40),)).requested.stages[0].memory_bytes
    full, lora = one(None), one(LoraSettings(8))
    assert lora < full
    budget = (full + lora) // 2
    est = estimate_memory(tiny, EstimateSettings(**SHAPE), devices=(("a", budget),))
    assert not est.requested.fits
    lever = next(lv for lv in est.levers if lv.flag == "--lora 8")
    assert lever.fits and lever.saves_bytes == full - lora
    assert [lv.flag.split()[0] for lv in est.levers][:1] == ["--lora"]
    # sgd keeps one state copy of every trainable weight where adamw keeps two: exactly the weights' bytes
    sgd = next(lv for lv in est.levers if lv.flag == "--optimizer sgd")
    assert sgd.saves_bytes == sum(int(graph.constants[p].nbytes) for p in graph.params)
    assert any(lv.flag.startswith("--microbatches 4") for lv in est.levers)
    # more devices like 'a' would each keep 16 MiB of the budget for the snapshot copies on the workers
    # (as `plan` does): beside the runtime the tiny model's parts never fit what is left, so the "more
    # devices" lever says so; two such devices with 16 MiB more each split the model
    more = next(lv for lv in est.levers if "more device" in lv.flag)
    assert not more.fits and more.note == f"{MAX_ADDED_DEVICES} more devices like the largest still do not fit"
    two = estimate_memory(tiny, EstimateSettings(**SHAPE), devices=(("a", budget + 16 * MIB), ("b", budget + 16 * MIB)))
    assert two.requested.fits and len(two.requested.stages) == 2
    # plan, on the same single device: does not fit, in MiB, and offers --lora
    cluster = write_nominal_cluster(tmp_path, graph, [("a", budget)])
    with pytest.raises(JobError) as exc:
        plan_model(tiny, cluster, PlanSettings(**SHAPE), tmp_path / "plan")
    text = str(exc.value)
    assert f"needs {full / MIB:.1f} MiB ({full} bytes) of its {budget / MIB:.1f} MiB ({budget} bytes) budget" in text
    assert "\n  - --lora 8: fits" in text


def test_cli_prints_mib_per_device_and_the_levers(tiny, tmp_path):
    proc = run_cli("estimate", tiny, "--devices", "phone=60MiB,laptop=1GiB", "--batch", 4, "--microbatches", 2,
                   "--seq", 16)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "budget 60 MiB" in out and "budget 1024 MiB" in out
    assert "requested: full fine-tuning" in out and "LoRA r=8" in out
    assert "what would make it fit" in out and "--lora 8 --base-dtype int4" in out
    doc = json.loads(run_cli("estimate", tiny, "--devices", "phone=60MiB", "--batch", 4, "--microbatches", 2,
                             "--seq", 16, "--lora", 4, "--base-dtype", "int8", "--json").stdout)
    assert doc["requested"]["lora_rank"] == 4 and doc["requested"]["base_dtype"] == "int8"
    assert [a["training"] for a in doc["alternatives"]] == ["full fine-tuning", "LoRA r=4"]
    dev = doc["requested"]["devices"][0]
    assert dev["memory_bytes"] == sum(dev["parts_bytes"].values())


@pytest.mark.parametrize("args, says", [
    (["--devices", "phone"], "'phone' is not NAME=SIZE"),
    (["--devices", "phone=512"], "write the unit"),
    (["--devices", "a=1GiB", "--base-dtype", "int4"], "add --lora R"),
    (["--devices", "a=1GiB", "--batch", 6], "--batch 6 must be a multiple of --microbatches 4"),
])
def test_cli_bad_input_is_one_line_exit_2(tiny, args, says):
    proc = run_cli("estimate", tiny, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_parse_devices():
    assert parse_devices("phone=1.5GiB, laptop=3GiB") == (("phone", 3 * 2 ** 29), ("laptop", 3 * 2 ** 30))
    with pytest.raises(ValueError, match="twice"):
        parse_devices("a=1GiB,a=2GiB")


def test_frozen_precision_leaves_a_float32_graph_alone(tiny):
    graph = load_model(tiny, 2, 16)
    assert with_frozen_precision(graph, "float32") is graph


def test_a_profile_prices_every_device_and_lora_blocks_it_lacks(tiny, tmp_path):
    graph = load_model(tiny, 2, 16)
    profile = default_profile(graph, "box")
    slow = dataclasses.replace(profile, runtime_overhead_bytes=100 * MIB)  # a measured runtime, say
    (tmp_path / "box.json").write_text(json.dumps(slow.to_json()))
    est = estimate_memory(tiny, EstimateSettings(**SHAPE, lora=LoraSettings(4)), devices=(("a", 2 ** 34),),
                          profile=tmp_path / "box.json")
    assert all(s.parts["runtime"] == 100 * MIB for v in (est.requested,) + est.alternatives for s in v.stages)
    assert est.notes and "lacks" in est.notes[0] and "box" in est.notes[0]
    assert "profile 'box'" in est.source
    # the profile holds one micro-batch shape: the micro-batch lever cannot be priced by it, and says so
    lever = next(lv for lv in est.levers if lv.flag.startswith("--microbatches"))
    assert lever.saves_bytes is None and "re-profile" in lever.note
    proc = run_cli("estimate", tiny, "--devices", "a=1GiB", "--profile", tmp_path / "box.json", "--seq", 32)
    assert proc.returncode == 2 and "measured at (micro-batch rows, seq) (2, 16)" in proc.stderr


def test_estimate_is_what_plan_promises_for_head_split_devices(tiny, tmp_path):
    """Devices whose attention heads run split over MNN and torch: plan and estimate both compile
    through planner.compile, so the estimate charges each split device as plan runs it (on MNN,
    recomputing: the split engine holds one graph set) even where keeping activations would be
    faster, and cuts the same way."""
    from ir.graph import block_signature
    from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile

    graph = load_model(tiny, 2, 16)
    enc = next(block_signature(b) for b in graph.blocks if b.attention is not None)
    curves = {"mnn:cpu:t1": (0.010, 0.020, 0.030, 0.058), "torch:cpu:t1": (0.012, 0.022, 0.032, 0.060)}
    backends = []
    for name in ("mnn:cpu:t1", "torch:cpu:t1", "mnn:cpu:t2"):
        # MNN re-runs each block's forward in its backward unless it keeps the activations
        blocks = {block_signature(b): BlockCost(0.01, 0.02, 0.005 if name.startswith("mnn") else 0.0, 1 << 20)
                  for b in graph.blocks}
        backends.append(BackendProfile(name, blocks, {enc: AttentionCurve(curves[name])} if name in curves else {}))
    DeviceProfile("box", graph.name, 2, 16, tuple(backends), 8 << 30,
                  split_child_bytes={"mnn": 40 << 20, "torch": 340 << 20}).save(tmp_path / "box.json")
    devices = [{"name": n, "address": f"tcp://127.0.0.1:{5610 + k}", "profile": "box.json", "memory_budget": "2GiB"}
               for k, n in enumerate(("phone", "laptop"))]
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": devices, "links": {
        "default": {"bandwidth": "100Mbit/s", "latency": "5ms"}}}))
    plan = load_plan(plan_model(tiny, tmp_path / "cluster.json", PlanSettings(**SHAPE, time_limit_s=5.0),
                                tmp_path / "plan"))
    assert all(d.head_split is not None and d.activations == "recompute" for d in plan.devices)
    est = estimate_memory(tiny, EstimateSettings(**SHAPE), cluster_file=tmp_path / "cluster.json")
    planned = {d.name: (d.first_block, d.last_block, d.memory_bytes) for d in plan.devices}
    assert {s.device: (s.first_block, s.last_block, s.memory_bytes) for s in est.requested.stages} == planned


def test_a_compiled_plan_over_a_devices_budget_is_refused_naming_the_device(tiny, tmp_path):
    """The last check before a plan is written: every stage's priced bytes within its device's
    budget, whatever the search and the engine picks returned (a starting partition once came back
    over its budget and was written). Here a real compiled plan passes, and the same plan with one
    device's budget a MiB short of its stage is refused with that device's name and MiB."""
    from ir.documents import OptimizerSettings
    from planner.cluster import load_cluster
    from planner.compile import PlanRequest, check_within_budgets, compile_plan
    from planner.partition import PlanDoesNotFit, solve_partition

    graph = load_model(tiny, 2, 16)
    cluster = load_cluster(write_nominal_cluster(tmp_path, graph, [("phone", 2 << 30), ("laptop", 2 << 30)]))
    compiled = compile_plan(graph, cluster, PlanRequest(microbatches=2), OptimizerSettings("adamw", 1e-3),
                            lambda inst: solve_partition(inst, time_limit_s=5.0))
    check_within_budgets(compiled)
    last = compiled.costs[-1]
    short = tuple(dataclasses.replace(c, memory_budget_bytes=c.memory_bytes - (1 << 20)) if c is last else c
                  for c in compiled.costs)
    with pytest.raises(PlanDoesNotFit) as exc:
        check_within_budgets(dataclasses.replace(compiled, costs=short))
    assert exc.value.device == last.device and exc.value.over_bytes == 1 << 20
    assert f"device {last.device!r}" in str(exc.value) and "(1.0 MiB over)" in str(exc.value)


def test_more_devices_is_the_lever_and_the_count_it_names_plans_and_fits(minilm_onnx, tmp_path):
    """MiniLM on one device whose budget holds half the model beside the runtime and the reserve a
    pipeline keeps, but not the whole: "more devices" is what makes it fit; the count it names,
    planned by `confidant plan` over that many devices like it, fits each budget with the reserve."""
    from planner.cluster import load_cluster

    graph = load_model(minilm_onnx, 2, 16)
    device = load_cluster(write_nominal_cluster(tmp_path / "probe", graph, [("a", 2 << 30)])).devices[0]
    alone, two = whole_model_bytes(graph, device, 2), best_cut_in_two_bytes(graph, device, 2)
    budget = two + 16 * MIB + 8 * MIB
    assert budget < alone, (two / MIB, alone / MIB)
    est = estimate_memory(minilm_onnx, EstimateSettings(**SHAPE), devices=(("a", budget),))
    assert not est.requested.fits
    more = next(lv for lv in est.levers if "more device" in lv.flag)
    added = re.fullmatch(r"(\d+) more device\(s\) like 'a' \((\d+) MiB each\)", more.flag)
    assert more.fits and added is not None, more
    assert int(added.group(2)) == round(budget / MIB), more  # the device's budget, not what the reserve leaves
    count = 1 + int(added.group(1))
    assert count == 2, more  # one more is enough: the best cut in two fits beside the reserve
    cluster = write_nominal_cluster(tmp_path, graph, [("a", budget)] + [(f"a{k}", budget) for k in range(1, count)])
    plan = load_plan(plan_model(minilm_onnx, cluster, PlanSettings(**SHAPE, time_limit_s=5.0), tmp_path / "plan"))
    figures = [(d.name, d.memory_bytes / MIB, d.reserved_bytes / MIB, d.memory_budget_bytes / MIB)
               for d in plan.devices]
    assert len(plan.devices) == count, figures
    assert all(d.reserved_bytes == 16 * MIB and d.memory_bytes + d.reserved_bytes <= budget for d in plan.devices), \
        figures
    # the lever's own cut is the plan's figures (estimate prices as plan compiles)
    assert sorted(int(m) for m in re.findall(r" (\d+) MiB", more.note)) == \
        sorted(round(d.memory_bytes / MIB) for d in plan.devices), (more.note, figures)
