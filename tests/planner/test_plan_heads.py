"""`confidant plan` records a per-device attention head split, writes it into plan.json and the
bundle's stage.json, and `confidant show` prints it; the partition and the predicted times see the
split device's speed (no training here besides one run from a split bundle)."""
from __future__ import annotations

import json

import pytest

from ir.graph import block_signature
from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile

# H = 4 heads: mnn t1 and torch t1 each take 2 heads in 20/22 ms; one backend alone takes 58/60 ms
CURVES = {"mnn:cpu:t1": (0.010, 0.020, 0.030, 0.058), "torch:cpu:t1": (0.012, 0.022, 0.032, 0.060)}


def _graph(tiny_onnx):
    from planner.onnx_import import load_model

    return load_model(tiny_onnx["torchscript-17"], 2, 12)


def _profile(graph, backends=("mnn:cpu:t1", "torch:cpu:t1", "mnn:cpu:t2"), curves=CURVES,
             encoder_s=(0.01, 0.02)) -> DeviceProfile:
    """Every block 10 + 20 ms, encoder blocks `encoder_s` (forward, backward), on every backend."""
    sigs = {block_signature(b) for b in graph.blocks}
    enc = [block_signature(b) for b in graph.blocks if b.kind == "encoder"]
    out = []
    for name in backends:
        blocks = {s: BlockCost(forward_s=0.01, backward_s=0.02, workspace_bytes=1 << 20) for s in sigs}
        blocks.update({s: BlockCost(*encoder_s, workspace_bytes=1 << 20) for s in enc})
        attention = {enc[0]: AttentionCurve(curves[name])} if name in curves else {}
        out.append(BackendProfile(name, blocks, attention))
    # head-split child processes as measured here (runtime.profiling.memory.split_child_bytes, tiny model)
    return DeviceProfile("box", "tiny", graph.batch, graph.seq, tuple(out), memory_available_bytes=8 << 30,
                         split_child_bytes={"mnn": 40 << 20, "torch": 340 << 20})


def _plan(tiny_onnx, tmp_path, profile: DeviceProfile, schedule: str):
    return _plan_devices(tiny_onnx, tmp_path, {"box": profile}, schedule)


def _plan_devices(tiny_onnx, tmp_path, profiles: dict[str, DeviceProfile], schedule: str):
    """Plan over one device per profile (named by its key), each running mnn:cpu:t1."""
    from confidant.commands import show_plan
    from jobs.planning import PlanSettings, plan_model

    tmp_path.mkdir(parents=True, exist_ok=True)
    devices = []
    for i, (name, profile) in enumerate(profiles.items()):
        profile.save(tmp_path / f"{name}.json")
        devices.append({"name": name, "address": f"tcp://127.0.0.1:{i + 1}", "profile": f"{name}.json",
                        "memory_budget": "1GiB", "backend": "mnn:cpu:t1"})
    links = {"links": {"default": {"bandwidth": "1GB/s", "latency": "0.1ms"}}} if len(devices) > 1 else {}
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": devices, **links}))
    settings = PlanSettings(schedule=schedule, batch=4, seq=12, microbatches=2, optimizer="adamw", lr=5e-5,
                            time_limit_s=5.0)
    show_plan(plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json", settings, tmp_path / "plan"))
    return json.loads((tmp_path / "plan" / "plan.json").read_text())


def test_plan_records_a_head_split_and_show_prints_it(tiny_onnx, tmp_path, capsys):
    from ir.bundle import load_bundle_dir
    from runtime.pipeline.bundles import load_bundle

    graph = _graph(tiny_onnx)
    heads = next(b.heads for b in graph.blocks if b.kind == "encoder")
    assert heads == 4
    plan = _plan(tiny_onnx, tmp_path, _profile(graph), "1f1b-flush")
    (entry,) = plan["devices"]
    split = entry["head_split"]
    assert split["heads"] == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    assert sum(split["heads"].values()) == heads
    assert split["predicted_s"] == pytest.approx(0.022)
    assert split["single_best"] == ["mnn:cpu:t1", pytest.approx(0.058)]
    assert entry["engine"] == "mnn"
    stage = load_bundle_dir(tmp_path / "plan" / entry["bundle"]).stage_doc
    assert stage.head_split == split["heads"]
    load_bundle(tmp_path / "plan" / entry["bundle"])
    out = capsys.readouterr().out
    assert "heads" in out and "mnn:cpu:t1 2 + torch:cpu:t1 2 (pred 22 ms vs 58 ms single)" in out
    assert "  box: mnn:cpu:t1 (the head split's base)" in out


def test_no_split_where_the_mnn_base_it_needs_is_slower_than_torch_unsplit(tiny_onnx, tmp_path):
    """The split engine runs the rest of the stage on MNN: when PyTorch runs every block 10x faster
    than MNN, what splitting the attention saves cannot make up for it, so the device runs torch
    unsplit (the decision SmolLM2 needed here: its split layer on an MNN base measured slower than
    torch alone)."""
    import dataclasses

    from ir.profile import BlockCost

    graph = _graph(tiny_onnx)
    profile = _profile(graph)
    fast = tuple(dataclasses.replace(b, blocks={k: BlockCost(0.001, 0.002, workspace_bytes=1 << 20)
                                                for k in b.blocks})
                 if b.backend == "torch:cpu:t1" else b for b in profile.backends)
    from jobs.planning import PlanSettings, plan_model
    from jobs.common.report import Silent

    class Notes(Silent):
        def __init__(self):
            self.lines: list[str] = []

        def note(self, text):
            self.lines.append(text)

    dataclasses.replace(profile, backends=fast).save(tmp_path / "box.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [  # no backend: auto
        {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": "2GiB"}]}))
    notes = Notes()
    out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json",
                     PlanSettings(schedule="1f1b-flush", batch=4, seq=12, microbatches=2, time_limit_s=5.0),
                     tmp_path / "plan", notes)
    (entry,) = json.loads((out / "plan.json").read_text())["devices"]
    assert entry["head_split"] is None and entry["engine"] == "torch"
    assert any(line.startswith("box: no head split: the model on mnn:cpu:t1 with its attention split (")
               and "slower than on torch:cpu:t1 unsplit" in line for line in notes.lines)
    # with the cluster file fixing MNN, the split pays and is kept
    assert _plan(tiny_onnx, tmp_path / "mnn", dataclasses.replace(profile, backends=fast),
                 "1f1b-flush")["devices"][0]["head_split"]["heads"] == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}


def test_a_split_is_planned_under_a_stashing_schedule_too(tiny_onnx, tmp_path):
    """The split engine stashes weight versions (tests/pipeline/test_split_stash.py), so 1f1b-stash gets the split."""
    from ir.bundle import load_bundle_dir

    graph = _graph(tiny_onnx)
    plan = _plan(tiny_onnx, tmp_path, _profile(graph), "1f1b-stash")
    (entry,) = plan["devices"]
    assert entry["head_split"]["heads"] == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    assert load_bundle_dir(tmp_path / "plan" / entry["bundle"]).stage_doc.head_split == entry["head_split"]["heads"]


def test_a_split_device_is_predicted_faster(tiny_onnx, tmp_path):
    """Encoder blocks of 40 + 80 ms whose attention takes 58 ms alone and 22 ms split: each loses
    36 ms, so a one-device plan's stage time falls by 2 x 36 ms per micro-batch against the same
    device with one engine (no split), and its step (one stage, 2 micro-batches, 1f1b-flush) by 2x that."""
    graph = _graph(tiny_onnx)
    assert sum(b.kind == "encoder" for b in graph.blocks) == 2
    split = _plan(tiny_onnx, tmp_path / "split", _profile(graph, encoder_s=(0.04, 0.08)), "1f1b-flush")
    alone = _plan(tiny_onnx, tmp_path / "alone", _profile(graph, backends=("mnn:cpu:t1", "mnn:cpu:t2"),
                                                          encoder_s=(0.04, 0.08)), "1f1b-flush")
    assert split["devices"][0]["head_split"] is not None and alone["devices"][0]["head_split"] is None
    saved = alone["devices"][0]["predicted_time_s"] - split["devices"][0]["predicted_time_s"]
    assert saved == pytest.approx(2 * 0.036)
    assert alone["predicted_step_s"] - split["predicted_step_s"] == pytest.approx(2 * 2 * 0.036)


def test_the_partition_gives_a_split_device_more_blocks(tiny_onnx, tmp_path):
    """Blocks cost 30 ms; encoders 120 ms on device "plain" and 150 ms on device "fast", whose
    split lowers them to 150 - 36 = 114 ms. Unsplit, "fast" is the slower device and takes only the
    embeddings and one encoder (stages fast 180 | plain 180 ms rather than plain 150 | fast 210);
    with the split's speed seen it takes the second encoder, the head and the loss (plain 150 |
    fast 174 ms rather than fast 144 | plain 180)."""
    graph = _graph(tiny_onnx)
    assert [b.kind for b in graph.blocks].count("encoder") == 2 and len(graph.blocks) == 5
    plain = _profile(graph, backends=("mnn:cpu:t1", "mnn:cpu:t2"), encoder_s=(0.04, 0.08))

    def blocks(plan):
        return {d["name"]: d["blocks"][1] - d["blocks"][0] + 1 for d in plan["devices"]}

    # the control: "fast" without its second engine, so no split
    unsplit = _plan_devices(tiny_onnx, tmp_path / "unsplit", {
        "plain": plain, "fast": _profile(graph, backends=("mnn:cpu:t1", "mnn:cpu:t2"), encoder_s=(0.05, 0.10))},
        "1f1b-flush")
    assert blocks(unsplit) == {"plain": 3, "fast": 2}
    split = _plan_devices(tiny_onnx, tmp_path / "split", {
        "plain": plain, "fast": _profile(graph, encoder_s=(0.05, 0.10))}, "1f1b-flush")
    assert blocks(split) == {"plain": 2, "fast": 3}
    assert {d["name"]: d["head_split"] is not None for d in split["devices"]} == {"plain": False, "fast": True}
    assert split["predicted_step_s"] < unsplit["predicted_step_s"]


def test_no_split_when_the_backends_would_share_cores_or_not_help(tiny_onnx):
    from planner.heads import choose_head_split

    graph = _graph(tiny_onnx)
    # profiled at one thread at most: mnn t1 + torch t1 need two cores
    assert choose_head_split(graph, _profile(graph, backends=("mnn:cpu:t1", "torch:cpu:t1"))) is None
    assert choose_head_split(graph, _profile(graph)) is not None
    # one engine only: nothing to run concurrently
    assert choose_head_split(graph, _profile(graph, backends=("mnn:cpu:t1", "mnn:cpu:t2"),
                                           curves={"mnn:cpu:t1": CURVES["mnn:cpu:t1"],
                                                   "mnn:cpu:t2": CURVES["torch:cpu:t1"]})) is None
    # a split that is not faster than one backend alone (linear curves, torch slow) is not recorded
    slow = {"mnn:cpu:t1": (0.01, 0.02, 0.03, 0.04), "torch:cpu:t1": (0.05, 0.10, 0.15, 0.20)}
    assert choose_head_split(graph, _profile(graph, curves=slow)) is None


def test_no_split_when_a_single_backend_on_more_threads_beats_it(tiny_onnx):
    """On two cores, mnn t1 + torch t1 split in 22 ms; torch t2 alone, using both cores, takes 20 ms:
    no split, although it beats every backend the allocator was given. At 30 ms for torch t2 the
    split is recorded, compared with torch t2 (the fastest single backend, not a candidate: mnn t1 +
    torch t2 would need three cores)."""
    from planner.heads import choose_head_split

    graph = _graph(tiny_onnx)
    backends = ("mnn:cpu:t1", "torch:cpu:t1", "torch:cpu:t2")
    fast = {**CURVES, "torch:cpu:t2": (0.006, 0.011, 0.016, 0.020)}
    assert choose_head_split(graph, _profile(graph, backends=backends, curves=fast)) is None
    slower = {**CURVES, "torch:cpu:t2": (0.009, 0.017, 0.024, 0.030)}
    split = choose_head_split(graph, _profile(graph, backends=backends, curves=slower))
    assert split is not None
    assert split.heads == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    assert split.predicted_s == pytest.approx(0.022)
    assert split.single_best == ("torch:cpu:t2", pytest.approx(0.030))
    # the fastest backend per engine alone (mnn t2 + torch t2 = 4 threads) does not fit two cores,
    # so the one-core backends are the candidates even with faster two-core ones profiled
    both = {**slower, "mnn:cpu:t2": (0.008, 0.015, 0.023, 0.040)}
    split = choose_head_split(graph, _profile(graph, backends=backends + ("mnn:cpu:t2",), curves=both))
    assert split is not None and split.heads == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    assert split.single_best == ("torch:cpu:t2", pytest.approx(0.030))


def test_a_measured_extra_cost_changes_the_split_and_can_cancel_it(tiny_onnx):
    """Hand numbers (CURVES, H = 4). No extra cost: mnn 2 + torch 2 in max(20, 22) = 22 ms. The split
    runs mnn in a child process (torch stays in-process), so the measured cost lands on mnn:
    15 ms makes 2 + 2 take max(35, 22) = 35 ms but 1 + 3 max(25, 32) = 32 ms, so a head moves to
    torch; 50 ms makes even one head on mnn (60 ms) slower than mnn alone (58 ms): no split. A figure
    for the in-process backend is not charged (it holds the activations), nor one of another block
    signature."""
    import dataclasses

    from planner.heads import choose_head_split

    graph = _graph(tiny_onnx)
    sig = next(block_signature(b) for b in graph.blocks if b.kind == "encoder")
    base = _profile(graph)

    def with_extra(extra):
        return dataclasses.replace(base, split_extra_cost_s=extra)

    assert choose_head_split(graph, base).heads == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    moved = choose_head_split(graph, with_extra({sig: {"mnn:cpu:t1": 0.015}}))
    assert moved.heads == {"mnn:cpu:t1": 1, "torch:cpu:t1": 3}
    assert moved.predicted_s == pytest.approx(0.032)
    assert moved.single_best == ("mnn:cpu:t1", pytest.approx(0.058))
    assert choose_head_split(graph, with_extra({sig: {"mnn:cpu:t1": 0.050}})) is None
    for ignored in ({sig: {"torch:cpu:t1": 0.050}}, {"another/signature": {"mnn:cpu:t1": 0.050}}):
        split = choose_head_split(graph, with_extra(ignored))
        assert split.heads == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
        assert split.predicted_s == pytest.approx(0.022)


def test_training_from_a_split_bundle_gives_the_unsplit_losses(tiny_onnx, tmp_path, capsys):
    """A worker builds the split engine from the bundle (MNN in a child process, torch in-process)
    and trains; the losses equal one unsplit MNN engine on the same micro-batches."""
    import numpy as np

    from jobs.train.pipeline import LocalWorkers, train_pipeline
    from ir.bundle import load_bundle_dir
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.engines.mnn import MnnStageEngine
    from runtime.optim import make_optimizer
    from runtime.engines.stage import stage_spec
    from tasks.tokenize import Batch
    from tasks.trainer import accumulate_gradients

    graph = _graph(tiny_onnx)
    plan = _plan(tiny_onnx, tmp_path, _profile(graph), "1f1b-flush")
    assert plan["devices"][0]["head_split"]["heads"] == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    bundle = tmp_path / "plan" / plan["devices"][0]["bundle"]
    rng = np.random.default_rng(0)
    rows, M, seq = plan["batch"], plan["microbatches"], plan["seq"]

    def batch():
        mask = np.ones((rows * M, seq), np.int64)
        mask[0, seq // 2:] = 0
        labels = rng.integers(0, 9, (rows * M, seq))
        labels[mask == 0] = -100
        return Batch(rng.integers(0, 500, (rows * M, seq)).astype(np.int64), mask, np.zeros_like(mask), labels,
                     n_labelled=int((labels != -100).sum()))

    batches = [batch() for _ in range(2)]
    workers = LocalWorkers.start(1, threads=1)
    from ir.bundle import sign_bundle
    from runtime.keys import signer

    sign_bundle(bundle, signer(workers.keys.coordinator))  # a worker takes only bundles its coordinator signed
    try:
        result = train_pipeline(None, batches, 9, workers.addresses,
                                PipelineConfig(schedule="1f1b-flush", microbatches=M, lr=5e-5, timeout_s=120), 2,
                                keys=workers.keys,
                                bundles=[bundle], devices=["box"], stage_graphs=[load_bundle_dir(bundle)])
    finally:
        assert workers.wait(30.0) == [0]
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    opt, params, losses = make_optimizer("adamw", 5e-5), engine.parameters(), []
    for b in batches:
        loss, grads = accumulate_gradients(engine, b, M, 9)
        params = opt.step(params, grads)
        engine.set_parameters(params)
        losses.append(loss)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
