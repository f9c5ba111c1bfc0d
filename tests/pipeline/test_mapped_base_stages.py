"""Issue 31 target 4 for pipelines: a worker that holds the plan's float32 base file (`confidant worker --base`,
`train PLAN`'s local workers) and whose stage recomputes per block (PyTorch; MNN with no cached block) views its
frozen weights on a mapping of that file (`runtime.pipeline.bundles.rebuild_weights(mapped=True)`), which its
engine reads a block at a time, as train-local's over a mapped model file. The run must equal one whose workers
received every weight, bit for bit (losses and trained adapters); a stage that keeps its activations reads the
base into memory as before."""
from __future__ import annotations

import tempfile
from dataclasses import replace

import numpy as np
import pytest

from ir.bundle import PLAN_BASE, load_bundle_dir, load_plan
from ir.mapped_pages import mapping_of
from ir.partition import Partition, StageAssignment
from jobs.train.pipeline import train_pipeline
from planner.emit import emit_plan
from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.keys import COORDINATOR_KEY, KeyPair, signer
from runtime.pipeline import worker as worker_module
from runtime.pipeline.bundles import plan_base
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from support import M, ROWS, S, export_onnx, synthetic_batch

STEPS = 2
BOSS = KeyPair.generate(COORDINATOR_KEY)


def _plan(tiny_checkpoint, export_dir, out, engine: str, activations: dict):
    """A 2-device plan of the tiny BERT under LoRA on q and v, on `engine`, each device's `activations`."""
    graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)
    lora, _ = add_lora(graph, LoraSettings(4, 16.0, targets=("q", "v"), seed=1))
    rng = np.random.default_rng(9)
    lora = replace(lora, constants={p: (rng.normal(0, 0.05, c.shape).astype(np.float32) if p.endswith(".lora_B") else c)
                                    for p, c in lora.constants.items()})
    cut = next(b.index for b in lora.blocks if b.kind == "encoder") + 1
    emit_plan(out, lora, Partition((StageAssignment(0, "a", 0, cut - 1), StageAssignment(1, "b", cut, len(lora.blocks) - 1)),
                                   "manual"), make_schedule("1f1b-flush", 2, M),
              {"model": "tiny", "lr": 1e-3, "engine": engine, "activations": activations}, sign=signer(BOSS))
    return out


def _run(plan_dir, monkeypatch, held: bool, offered: bool = True):
    """(the run's result, per stage the number of its engine's graph constants lying on a mapping); `held`: the
    workers hold the plan's base file; `offered`: the coordinator offers to leave its tensors out (as `train PLAN`
    does where the plan has one)."""
    plan = load_plan(plan_dir)
    built = []
    make = worker_module.make_engine

    def recording(backend, spec, **kwargs):
        built.append(spec)
        return make(backend, spec, **kwargs)

    monkeypatch.setattr(worker_module, "make_engine", recording)
    bundles = [plan_dir / d.bundle for d in plan.devices]
    config = PipelineConfig(schedule=plan.schedule, microbatches=plan.microbatches, timeout_s=60)
    base_files = {plan.base_sha256: plan_dir / PLAN_BASE} if held else None
    with InProcessWorkers(2, timeout_s=30, base_files=base_files) as workers:
        result = train_pipeline(None, [synthetic_batch(i) for i in range(STEPS)], 9, workers.addresses, config, STEPS,
                                bundles=bundles, devices=plan.device_names,
                                stage_graphs=[load_bundle_dir(b) for b in bundles], schedule=plan.to_schedule(),
                                base=plan_base(plan_dir, plan) if offered else None, transport=workers.coordinator)
    mapped = sorted(sum(mapping_of(spec.graph.constants[n]) is not None for n in spec.graph.constants)
                    for spec in built)
    return result, mapped


@pytest.mark.parametrize("engine", ["torch", "mnn"])
def test_per_block_stages_read_the_held_base_mapped_and_train_as_those_sent_everything(
        engine, tiny_checkpoint, export_dir, tmp_path, monkeypatch):
    plan_dir = _plan(tiny_checkpoint, export_dir, tmp_path / "plan", engine, {"a": "per-block", "b": "per-block"})
    sent, sent_mapped = _run(plan_dir, monkeypatch, held=False, offered=False)
    held, held_mapped = _run(plan_dir, monkeypatch, held=True)
    assert sent_mapped == [0, 0]  # received over the wire: in memory, as ever
    assert held.base_bytes_held > 0 and all(held_mapped), held_mapped  # every stage views its base on the file
    assert held.losses == sent.losses
    for name in sent.weights:
        np.testing.assert_array_equal(held.weights[name], sent.weights[name], err_msg=name)


def test_a_stage_keeping_its_activations_reads_the_held_base_into_memory(tiny_checkpoint, export_dir, tmp_path,
                                                                           monkeypatch):
    plan_dir = _plan(tiny_checkpoint, export_dir, tmp_path / "plan", "mnn", {"a": "per-block", "b": "keep"})
    held, mapped = _run(plan_dir, monkeypatch, held=True)
    assert held.base_bytes_held > 0
    assert mapped[0] == 0 and mapped[1] > 0  # MNN keeping copies constants: mapped pages would stand beside them


def test_a_worker_without_the_base_file_maps_the_frozen_weights_it_received_from_its_spooled_copy(
        tiny_checkpoint, export_dir, tmp_path, monkeypatch, capfd):
    """A remote worker started without `--base` on a plan charged its frozen base mapped (PyTorch per block): the
    frozen weights come over the wire, and it views them on a mapping of the unlinked file it spools them to
    (`runtime.pipeline.held_weights`), so it trains within its plan; bit for bit as a run that offered no base at
    all, nothing left in its temporary folder. Its set-up writes the weights file to that file as its chunks arrive
    (`runtime.pipeline.bundles.recv_bundle_files(spool=)`), so nothing is over its plan and no line is printed (h168's
    workers received the file whole first and said so, one line each)."""
    plan_dir = _plan(tiny_checkpoint, export_dir, tmp_path / "plan", "torch", {"a": "per-block", "b": "per-block"})
    sent, sent_mapped = _run(plan_dir, monkeypatch, held=False, offered=False)
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    capfd.readouterr()
    unheld, unheld_mapped = _run(plan_dir, monkeypatch, held=False)
    assert sent_mapped == [0, 0]
    assert unheld.base_bytes_held == 0 and all(unheld_mapped), unheld_mapped  # sent, and viewed on the file
    assert unheld.losses == sent.losses
    for name in sent.weights:
        np.testing.assert_array_equal(unheld.weights[name], sent.weights[name], err_msg=name)
    assert "no copy of the plan's base file" not in capfd.readouterr().err
    assert list(spool.iterdir()) == []  # unlinked from the start: the kernel frees it with the worker


def test_a_worker_that_cannot_spool_warns_with_its_device_the_mib_over_and_the_fix(capfd):
    """Where the received frozen weights of a stage charged mapped end in memory (here: the weights left as the
    received bytes, as when no temporary folder is writable), one line names the device, the MiB over and the fix."""
    from ir.safetensors import encode_safetensors

    data = encode_safetensors({"frozen": np.zeros((1 << 18,), np.float32), "lora": np.ones((4,), np.float32)})
    assert worker_module._warn_unmapped(data, ["frozen"], "b", 1) == 1 << 20
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device b" in err[0] and "1.0 MiB over" in err[0] and "sets up and trains" in err[0], err
    assert "confidant worker --base plan/base.safetensors" in err[0]
