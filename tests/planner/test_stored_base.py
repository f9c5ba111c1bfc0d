"""Issue 31, lever 2: a quantized frozen base is written to bundles and to the plan's base.safetensors
in its storage form (codes, scales, int4's offsets: `ir.precision.storage_tensors`), so a worker
rebuilds its QuantizedTensors from the very bytes the manifest hashes, never widening them; a worker
holding the base file assembles its weights from the pieces, hashing them as it reads them, without
putting a second weights file together. Bundles written before (float32 values re-quantized by the
reader) still load."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ir.bundle import (BASE_MIN_BYTES, GRAPH, PLAN_BASE, STAGE, WEIGHTS, ACTIONS, BundleError, load_bundle_dir, load_plan,
                       read_bundle_files, verify_bundle_files, write_bundle)
from ir.documents import StageDocument
from ir.partition import Partition, StageAssignment
from ir.precision import QuantizedTensor, storage_piece_names
from ir.safetensors import decode_safetensors, encode_safetensors, load_safetensors, save_safetensors
from ir.serialize import graph_to_json, slice_graph
from runtime.pipeline.bundles import plan_base, rebuild_weights, split_weights
from support import M, tiny_lora_graph

STEPS = 2


@pytest.fixture(scope="module")
def int4_lora(tiny_onnx):
    """The tiny BERT, adapters on q, v, up, its base held int4 (tables int8), B non-zero."""
    return tiny_lora_graph(tiny_onnx["torchscript-17"], "int4")


@pytest.fixture(scope="module")
def plan_dir(int4_lora, tmp_path_factory):
    from planner.emit import emit_plan
    from planner.schedule import make_schedule

    out = tmp_path_factory.mktemp("stored") / "plan"
    cut = next(b.index for b in int4_lora.blocks if b.kind == "encoder") + 1
    last = len(int4_lora.blocks) - 1
    emit_plan(out, int4_lora, Partition((StageAssignment(0, "a", 0, cut - 1), StageAssignment(1, "b", cut, last)),
                                        "manual"), make_schedule("1f1b-flush", 2, M), {"model": "tiny-int4", "lr": 1e-3})
    return out


def _quantized(graph):
    return {k: v for k, v in graph.constants.items() if isinstance(v, QuantizedTensor)}


def _same_weight(got, want, name):
    assert isinstance(got, QuantizedTensor) and (got.storage, got.axis, got.block, got.shape) == \
        (want.storage, want.axis, want.block, want.shape), name
    assert np.array_equal(got.codes, want.codes) and np.array_equal(got.scales, want.scales), name
    assert (got.mins is None) == (want.mins is None) and (got.mins is None or np.array_equal(got.mins, want.mins)), name


def test_the_base_file_and_the_bundles_hold_quantized_weights_as_their_codes_never_widened(int4_lora, plan_dir):
    held = _quantized(int4_lora)
    assert {v.storage for v in held.values()} == {"int4", "int8"}
    base = load_safetensors(plan_dir / PLAN_BASE)
    for name, q in held.items():
        assert name not in base  # no float32 copy of it anywhere in the file
        if q.nbytes < BASE_MIN_BYTES:  # too small to be worth a lookup: in its bundle
            continue
        pieces = storage_piece_names(name, q.storage)
        assert set(pieces) <= set(base), name
        np.testing.assert_array_equal(base[f"{name}.q_codes"], q.codes, err_msg=name)
        np.testing.assert_array_equal(base[f"{name}.q_scales"], q.scales, err_msg=name)
        if q.mins is not None:
            np.testing.assert_array_equal(base[f"{name}.q_mins"], q.mins, err_msg=name)
    stored = sum(q.nbytes for q in held.values()) + sum(v.nbytes for v in base.values() if v.dtype == np.float32)
    assert (plan_dir / PLAN_BASE).stat().st_size < stored + 16384  # storage bytes plus a header
    plan = load_plan(plan_dir, verify_bundles=True)
    seen = set()
    for d in plan.devices:
        weights = decode_safetensors(read_bundle_files(plan_dir / d.bundle)[WEIGHTS])
        graph = load_bundle_dir(plan_dir / d.bundle).graph
        for name, value in _quantized(graph).items():
            assert name not in weights
            _same_weight(value, held[name], name)  # codes equal, bit for bit
            seen.add(name)
    assert seen == set(held)


def test_a_worker_assembles_its_weights_from_the_rest_and_the_base_file_to_the_bundles_graph(plan_dir):
    plan = load_plan(plan_dir)
    base = plan_base(plan_dir, plan)
    for d in plan.devices:
        files = read_bundle_files(plan_dir / d.bundle)
        local, rest = split_weights(files, base)
        assert any(n.endswith(".q_codes") for n in local)
        rebuilt = rebuild_weights(rest, plan_dir / PLAN_BASE, local)
        contents = verify_bundle_files({**files, WEIGHTS: rebuilt}, d.bundle)
        whole = load_bundle_dir(plan_dir / d.bundle).graph
        assert set(contents.graph.constants) == set(whole.constants)
        for name, value in whole.constants.items():
            if isinstance(value, QuantizedTensor):
                _same_weight(contents.graph.constants[name], value, name)
            else:
                np.testing.assert_array_equal(contents.graph.constants[name], value, err_msg=name)


@pytest.mark.parametrize("piece", ["q_codes", "q_scales", "q_mins"])
def test_a_tampered_piece_is_refused_by_the_manifest_in_the_bundle_and_in_the_base_file(plan_dir, tmp_path, piece):
    plan = load_plan(plan_dir)
    d = plan.devices[1]
    files = read_bundle_files(plan_dir / d.bundle)
    # in the bundle's own weights file
    weights = decode_safetensors(files[WEIGHTS])
    rest_names = sorted(n for n in weights if n.endswith("." + piece))
    base = load_safetensors(plan_dir / PLAN_BASE)
    if rest_names:
        name = rest_names[0]
        flipped = weights[name].copy()
        flipped.reshape(-1).view(np.uint8)[0] ^= 1
        with pytest.raises(BundleError, match=r"weights\.safetensors is corrupted \(sha256 mismatch"):
            verify_bundle_files({**files, WEIGHTS: encode_safetensors({**weights, name: flipped})}, "b")
    # in the base file a worker holds: the assembled weights do not hash to the manifest's
    local, rest = split_weights(files, plan_base(plan_dir, plan))
    name = sorted(n for n in local if n.endswith("." + piece))[0]
    flipped = base[name].copy()
    flipped.reshape(-1).view(np.uint8)[-1] ^= 1
    damaged = tmp_path / "base.safetensors"
    save_safetensors(damaged, {**base, name: flipped})
    with pytest.raises(BundleError, match=r"weights\.safetensors is corrupted \(sha256 mismatch"):
        verify_bundle_files({**files, WEIGHTS: rebuild_weights(rest, damaged, local)}, "b")


def test_a_bundle_written_with_float32_values_of_a_quantized_base_still_loads(int4_lora, plan_dir, tmp_path):
    """The form before this one: graph.json's `precisions`, the weights widened to float32; the
    reader quantizes them again to the very same codes."""
    d = load_plan(plan_dir).devices[0]
    files = read_bundle_files(plan_dir / d.bundle)
    contents = load_bundle_dir(plan_dir / d.bundle)
    part = slice_graph(int4_lora, contents.first_block, contents.last_block)
    doc = graph_to_json(part)
    assert "precisions" in doc and "quantized" not in doc
    old = write_bundle(tmp_path / "old", StageDocument.from_json(__import__("json").loads(files[STAGE]), "s"), doc,
                       part.constants, files[ACTIONS].decode().split())
    widened = decode_safetensors(read_bundle_files(old)[WEIGHTS])
    assert all(widened[n].dtype == np.float32 for n in _quantized(part))
    graph = load_bundle_dir(old).graph
    for name, q in _quantized(part).items():
        _same_weight(graph.constants[name], q, name)
    assert GRAPH  # (the module's names are used)


def test_in_process_workers_holding_the_int4_base_file_train_as_one_device(int4_lora, plan_dir):
    """The workers' engines built from bundles whose frozen weights came from the base file at int4:
    the losses and adapters of those sent everything, and of one device on the in-memory graph."""
    from jobs.train.pipeline import train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers
    from support import single_device_training, synthetic_batch

    batches = [synthetic_batch(i) for i in range(STEPS)]
    plan = load_plan(plan_dir)
    bundles = [plan_dir / d.bundle for d in plan.devices]
    runs = {}
    for kind, held in (("sent", {}), ("held", {plan.base_sha256: plan_dir / PLAN_BASE})):
        config = PipelineConfig(schedule=plan.schedule, microbatches=plan.microbatches, timeout_s=60)
        with InProcessWorkers(2, timeout_s=30, base_files=held) as workers:
            runs[kind] = train_pipeline(None, batches, 9, workers.addresses[:2], config, STEPS, bundles=bundles,
                                        devices=plan.device_names,
                                        stage_graphs=[load_bundle_dir(b) for b in bundles],
                                        schedule=plan.to_schedule(), base=plan_base(plan_dir, plan),
                                        transport=workers.coordinator)
    sent, held = runs["sent"], runs["held"]
    assert held.base_bytes_held > 0 and held.losses == sent.losses
    for name in sent.weights:
        np.testing.assert_array_equal(held.weights[name], sent.weights[name], err_msg=name)
    losses, weights = single_device_training(int4_lora, batches, STEPS)
    np.testing.assert_allclose(held.losses, losses, rtol=1e-5)
    for k in weights:
        err = float(np.abs(held.weights[k] - weights[k]).max()) / max(float(np.abs(weights[k]).max()), 1e-12)
        assert err <= 1e-5, k


def test_mnn_holds_an_int4_weights_codes_once_the_graph_keeping_a_view_of_its_constant(int4_lora):
    """MNN's const copies what it is given: the graph's QuantizedTensor then holds read-only views of
    the consts in place of its own codes, scales and offsets (the same values), not second copies."""
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec

    graph = replace(int4_lora, constants=dict(int4_lora.constants))
    before = {k: v for k, v in _quantized(graph).items() if v.storage == "int4"}
    assert before  # (an engine built earlier on the fixture's graph may have given it views already)
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    for name, q in before.items():
        now = graph.constants[name]
        for field in ("codes", "scales", "mins"):  # MNN's scales and offsets are float32: the same values
            mine, theirs = getattr(now, field), getattr(q, field)
            assert not mine.flags.writeable and not np.shares_memory(mine, theirs), (name, field)
        _same_weight(now, q, name)
    assert engine is not None
