"""Issue 12: a device that holds the base model's frozen weights (the plan's base.safetensors, its
SHA-256 in plan.json) builds its stage's weights from that file and receives only the rest; the
rebuilt file is checked against the signed bundle like one that came over the link."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ir.bundle import (PLAN_BASE, WEIGHTS, BundleError, base_weights, load_bundle_dir, load_plan, read_bundle_files,
                       sha256_file, sha256_hex)
from ir.partition import Partition, StageAssignment
from ir.safetensors import decode_safetensors, encode_safetensors, load_safetensors, save_safetensors
from jobs.train.pipeline import train_pipeline
from jobs.common.workers import LocalWorkers
from planner.emit import emit_plan
from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.pipeline.bundles import plan_base, rebuild_weights, split_weights
from runtime.pipeline.coordinator import PipelineConfig, WorkerFailed
from runtime.keys import COORDINATOR_KEY, KeyPair, signer
from runtime.pipeline.inprocess import InProcessWorkers
from support import M, ROWS, S, export_onnx, synthetic_batch

STEPS = 2
BOSS = KeyPair.generate(COORDINATOR_KEY)  # signs the plan; the worker processes trust it


@pytest.fixture(scope="module")
def plan_dir(tiny_checkpoint, export_dir, tmp_path_factory):
    """A 2-device plan of the tiny BERT with LoRA adapters on q and v (the rest frozen)."""
    graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)
    lora, _ = add_lora(graph, LoraSettings(4, 16.0, targets=("q", "v"), seed=1))
    rng = np.random.default_rng(9)
    constants = {p: (rng.normal(0, 0.05, c.shape).astype(np.float32) if p.endswith(".lora_B") else c)
                 for p, c in lora.constants.items()}
    lora = replace(lora, constants=constants)
    out = tmp_path_factory.mktemp("plans") / "lora"
    cut = next(b.index for b in lora.blocks if b.kind == "encoder") + 1
    emit_plan(out, lora, Partition((StageAssignment(0, "a", 0, cut - 1), StageAssignment(1, "b", cut, len(lora.blocks) - 1)),
                                   "manual"), make_schedule("1f1b-flush", 2, M), {"model": "tiny", "lr": 1e-3},
              sign=signer(BOSS))
    return out


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(STEPS)]


def _train(plan_dir, batches, workers, **kwargs):
    plan = load_plan(plan_dir)
    bundles = [plan_dir / d.bundle for d in plan.devices]
    config = PipelineConfig(schedule=plan.schedule, microbatches=plan.microbatches, timeout_s=60)
    return train_pipeline(None, batches, 9, workers.addresses[:len(bundles)], config, STEPS, bundles=bundles,
                          devices=plan.device_names, stage_graphs=[load_bundle_dir(b) for b in bundles],
                          schedule=plan.to_schedule(), base=plan_base(plan_dir, plan), **kwargs)


def test_the_plan_holds_every_frozen_weight_once_with_its_hash(plan_dir):
    plan = load_plan(plan_dir)
    base = load_safetensors(plan_dir / PLAN_BASE)
    assert plan.base_sha256 == sha256_file(plan_dir / PLAN_BASE)
    merged = {}
    for d in plan.devices:
        merged.update(decode_safetensors(read_bundle_files(plan_dir / d.bundle)[WEIGHTS]))
    trained = {p for d in plan.devices for p in load_bundle_dir(plan_dir / d.bundle).graph.params}
    assert set(base) == {n for n, v in merged.items() if n not in trained and v.nbytes >= 4096}
    adapted = {p[:-len(".lora_A")] for p in trained if p.endswith(".lora_A")}
    assert not set(base) & trained and adapted and adapted <= set(base)  # the weights under the adapters
    for name, value in base.items():  # what the bundles hold, bit for bit
        np.testing.assert_array_equal(value, merged[name], err_msg=name)


def test_a_model_that_trains_every_weight_has_no_base_file(tiny_checkpoint, export_dir):
    assert base_weights(load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)) == {}


def test_rebuilt_weights_are_the_bundles_bytes_and_a_wrong_split_is_refused(plan_dir):
    plan = load_plan(plan_dir)
    files = read_bundle_files(plan_dir / plan.devices[1].bundle)
    local, rest = split_weights(files, plan_base(plan_dir, plan))
    assert local and len(rest) < len(files[WEIGHTS]) / 2
    rebuilt = rebuild_weights(rest, plan_dir / PLAN_BASE, local)
    # the file's hash and every tensor, without the file ever being put together
    assert (rebuilt.sha256, rebuilt.nbytes) == (sha256_hex(files[WEIGHTS]), len(files[WEIGHTS]))
    whole = decode_safetensors(files[WEIGHTS])
    assert set(rebuilt.tensors) == set(whole)
    for name, value in whole.items():
        np.testing.assert_array_equal(rebuilt.tensors[name], value, err_msg=name)
    with pytest.raises(BundleError, match=r"the base weights file .*base.safetensors: it holds no tensor 'nope'"):
        rebuild_weights(rest, plan_dir / PLAN_BASE, [*local, "nope"])
    whole = encode_safetensors(whole)
    with pytest.raises(BundleError, match=rf"weights.rest.safetensors holds '{local[0]}', which the coordinator said"):
        rebuild_weights(whole, plan_dir / PLAN_BASE, local)


def test_in_process_workers_holding_the_base_file_train_as_those_sent_everything(plan_dir, batches):
    """The fast twin of the process test below: the same losses and adapters, the frozen bytes held."""
    plan = load_plan(plan_dir)
    with InProcessWorkers(2, timeout_s=30) as workers:
        sent = _train(plan_dir, batches, workers, transport=workers.coordinator)
    with InProcessWorkers(2, timeout_s=30, base_files={plan.base_sha256: plan_dir / PLAN_BASE}) as workers:
        held = _train(plan_dir, batches, workers, transport=workers.coordinator)
    assert (sent.base_bytes_held, held.base_bytes_held > 0) == (0, True)
    assert sent.setup_bytes - held.setup_bytes == held.base_bytes_held
    assert held.losses == sent.losses
    for name in sent.weights:
        np.testing.assert_array_equal(held.weights[name], sent.weights[name], err_msg=name)


@pytest.mark.slow  # three pairs of worker processes; twin on threads just above
def test_workers_holding_the_base_file_receive_only_the_rest_and_train_the_same(plan_dir, batches):
    """Real worker processes over CURVE, `confidant worker --base PLAN/base.safetensors`: the setup
    sends the frozen weights' bytes fewer, and the losses and adapters are those of workers that
    received everything. A base file of other weights (another hash) is not used."""
    runs = {}
    other = plan_dir.parent / "other-base.safetensors"
    tensors = load_safetensors(plan_dir / PLAN_BASE)
    first = sorted(tensors)[0]
    save_safetensors(other, {**tensors, first: tensors[first] + 1})
    for kind, files in (("sent", ()), ("held", [plan_dir / PLAN_BASE]), ("other", [other])):
        workers = LocalWorkers.start(2, threads=1, base_files=files, coordinator=BOSS)
        try:
            runs[kind] = _train(plan_dir, batches, workers, keys=workers.keys)
        finally:
            assert workers.wait(30.0) == [0, 0]
    sent, held, other_run = runs["sent"], runs["held"], runs["other"]
    frozen = sum(v.nbytes for v in tensors.values())
    assert sent.base_bytes_held == other_run.base_bytes_held == 0
    assert held.base_bytes_held >= frozen  # every frozen weight (plus its header entry) stayed home
    assert sent.setup_bytes - held.setup_bytes == held.base_bytes_held
    assert held.setup_bytes < sent.setup_bytes / 4
    assert held.losses == sent.losses == other_run.losses
    for name in sent.weights:
        np.testing.assert_array_equal(held.weights[name], sent.weights[name], err_msg=name)


def test_a_base_file_that_changed_after_it_was_hashed_is_refused_by_the_bundles_hash(plan_dir, batches, tmp_path):
    """A worker's base file edited after its hash was taken (the worker trusts its hash): the rebuilt
    weights do not hash to what the signed manifest says, and the worker refuses the stage, naming
    the file and the base file, before training anything."""
    tensors = load_safetensors(plan_dir / PLAN_BASE)
    first = sorted(tensors)[0]
    damaged = tmp_path / "base.safetensors"
    save_safetensors(damaged, {**tensors, first: np.zeros_like(tensors[first])})
    plan = load_plan(plan_dir)
    with InProcessWorkers(2, timeout_s=30, base_files={plan.base_sha256: damaged}) as workers:
        with pytest.raises(WorkerFailed, match=r"weights.safetensors is corrupted \(sha256 mismatch.*\(its frozen weights "
                                               r"were read from the base file " + str(damaged).replace(".", r"\.")
                                               + ", taken for the plan's by its hash when this worker started: was "
                                                 r"it changed since\?\)"):
            _train(plan_dir, batches, workers, transport=workers.coordinator)
    assert set(workers.codes) <= {0, 1}  # the other worker ended at the coordinator's stop, mid-setup or not
