"""Re-planning while training from a plan folder (`confidant train plan/ --replan-every N`): the plan
folder carries its cluster (planner.emit's cluster.json, checked by plan.json's hash); a device that
runs slower than its profile makes the run re-plan, write the new plan with the current weights into
plan/replan-stepNNNN/ and switch to it between two steps, after which training goes on exactly like
a run that used the new plan from that step."""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ir.bundle import BundleError, load_bundle_dir, load_plan
from ir.graph import block_signature
from ir.partition import Partition, StageAssignment
from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.emit import cluster_from_json, cluster_to_json, emit_plan, load_plan_cluster
from planner.onnx_import import load_model
from planner.replan import scale_profile
from planner.schedule import make_schedule
from runtime.pipeline.checkpoints import load_checkpoint
from support import CliRun, run_cli

ROWS, SEQ, M = 2, 16, 4  # micro-batch rows, tokens, micro-batches per step
STEPS, EVERY = 4, 2      # re-plan check after step 2 (and none after the last)
# device "a" runs this many times slower than its profile says: far more than a loaded machine can
# slow b's sub-millisecond stage (at 8, one of three clean-clone CI runs here kept the plan; its
# checks were not recorded then, so the assertion below now prints them)
SLOWER = 50.0


def _cli(*args, cwd: Path, ok: bool = True) -> CliRun:
    proc = run_cli(*args, cwd=cwd)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _profile(graph, name: str, seconds_per_flop: float = 1e-9) -> DeviceProfile:
    forward = {block_signature(b): max(b.flops * seconds_per_flop, 1e-6) for b in graph.blocks}
    costs = {sig: BlockCost(f, 2 * f) for sig, f in forward.items()}
    return DeviceProfile(name, graph.name, graph.batch, graph.seq, (BackendProfile("mnn:cpu:t1", costs),), 2**33)


def _cluster(graph) -> Cluster:
    devices = tuple(DeviceSpec(n, f"tcp://127.0.0.1:{5550 + i}", _profile(graph, n, 1e-9 * (i + 1)), 2**30,
                               "mnn:cpu:t1") for i, n in enumerate(("a", "b", "c")))
    return Cluster(devices, Link(1e9, 1e-4), {("a", "c"): Link(1e8, 2e-4)})


# --- the cluster beside the plan -----------------------------------------------------------------

def test_a_plan_folder_carries_its_cluster_and_refuses_a_changed_one(tiny_onnx, tmp_path):
    graph = load_model(tiny_onnx["torchscript-17"], ROWS, SEQ)
    cluster = _cluster(graph)
    assert cluster_from_json(json.loads(json.dumps(cluster_to_json(cluster))), "x") == cluster
    partition = Partition((StageAssignment(0, "b", 0, 1), StageAssignment(1, "a", 2, 4)), "manual")
    emit_plan(tmp_path / "plan", graph, partition, make_schedule("1f1b-flush", 2, M), {"model": "tiny"},
              cluster=cluster)
    assert load_plan_cluster(tmp_path / "plan") == cluster  # profiles, budgets, backends and links
    doc = load_plan(tmp_path / "plan", verify_bundles=True)
    assert len(doc.cluster_sha256) == 64
    path = tmp_path / "plan" / "cluster.json"
    text = path.read_text()
    path.write_text(text.replace('"memory_budget_bytes": 1073741824', '"memory_budget_bytes": 1073741825', 1))
    with pytest.raises(BundleError, match=r"cluster.json is not the one plan.json was written with"):
        load_plan(tmp_path / "plan")
    path.unlink()
    with pytest.raises(BundleError, match=r"plan.json records a cluster.json, which is missing"):
        load_plan_cluster(tmp_path / "plan")
    # written without a cluster: re-planning says where to get one
    emit_plan(tmp_path / "bare", graph, partition, make_schedule("1f1b-flush", 2, M), {"model": "tiny"})
    assert not (tmp_path / "bare" / "cluster.json").exists()
    with pytest.raises(BundleError, match=r"it has no cluster.json .* re-run `confidant plan`"):
        load_plan_cluster(tmp_path / "bare")
    with pytest.raises(ValueError, match=r"the plan places stages on \['z'\], which the given cluster lacks"):
        emit_plan(tmp_path / "z", graph, Partition((StageAssignment(0, "z", 0, 4),), "manual"),
                  make_schedule("1f1b-flush", 1, M), {"model": "tiny"}, cluster=cluster)


# --- the command line ----------------------------------------------------------------------------

def _tokenizer(train: Path, out: Path) -> Path:
    """A WordPiece tokenizer over the training words that fits the tiny model's 500-token vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    from tasks.ner.conll import read_conll

    words = collections.Counter(w.lower() for s in read_conll(train) for w in s.tokens)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {t: i for i, t in enumerate(specials + sorted(w for w, _ in words.most_common(400)))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(specials)
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(out))
    return out


def _write_cluster(root: Path) -> None:
    """cluster.yaml over the profiles root/a.json (device a) and root/box.json (b and c)."""
    (root / "cluster.yaml").write_text(
        "devices:\n"
        "  - {name: a, address: 'tcp://127.0.0.1:1', profile: a.json, memory_budget: 1GiB}\n"
        "  - {name: b, address: 'tcp://127.0.0.1:2', profile: box.json, memory_budget: 1GiB}\n"
        "  - {name: c, address: 'tcp://127.0.0.1:3', profile: box.json, memory_budget: 1GiB}\n"
        "links:\n  default: {bandwidth: 10Gbit/s, latency: 50us}\n")


@pytest.fixture(scope="module")
def planned(tiny_onnx, tmp_path_factory):
    """A plan of the tiny model that gives device a the embeddings and both encoder layers and b the
    rest (c waits as a spare): a's profile says it is SLOWER times faster than it is (one real
    profile for all three, a's scaled), as for a device slowed since it was profiled."""
    from tasks.ner.datagen import write_splits

    root = tmp_path_factory.mktemp("replan-bundles")
    model = tiny_onnx["torchscript-17"]
    _cli("profile", "--model", model, "--batch", ROWS, "--seq", SEQ, "--backends", "mnn:cpu:t1", "--reps", 1,
         "--no-attention", "--name", "box", "-o", "box.json", cwd=root)
    scale_profile(DeviceProfile.load(root / "box.json"), 1 / SLOWER).save(root / "a.json")
    _write_cluster(root)
    _cli("plan", model, "--cluster", "cluster.yaml", "--batch", ROWS * M, "--seq", SEQ, "--microbatches", M,
         "--cuts", 3, "--devices", "a,b", "-o", "plan", cwd=root)
    train, _ = write_splits(root / "data", n_train=32, n_dev=4, seed=4)
    return root, train, _tokenizer(train, root / "tokenizer.json")


def _recalibration(before: DeviceProfile, after: DeviceProfile) -> float:
    """The one factor a re-plan scaled a device's block times by (planner.replan.recalibrate)."""
    ratios = {round(new.forward_s / old.forward_s, 6)
              for b_old, b_new in zip(before.backends, after.backends)
              for old, new in zip(b_old.blocks.values(), b_new.blocks.values())}
    assert len(ratios) == 1, ratios
    return ratios.pop()


@pytest.mark.slow  # twin on threads, without the command line: tests/pipeline/test_pipeline_inprocess.py
def test_train_replans_off_a_slowed_device_and_trains_like_the_new_plan_from_that_step(planned):
    root, train, tokenizer = planned
    common = ["--data", train, "--local", "--tokenizer", tokenizer]
    # any predicted gain re-plans: a is SLOWER times slower than its profile, but b's measured time
    # is inflated too when the other test worker loads the machine (a 6.6% gain was seen under -n 2)
    proc = _cli("train", "plan", *common, "--steps", STEPS, "--replan-every", EVERY, "--replan-threshold", 0,
                "--checkpoint", "live", "--metrics-out", "live.json", cwd=root)
    figures = json.loads((root / "live.json").read_text())
    assert len(figures["replans"]) == 1, (figures["replan_checks"], proc.stderr[-2000:])
    (replan,) = figures["replans"]
    assert replan["step"] == EVERY and replan["plan"] == f"plan/replan-step{EVERY:04d}"
    assert [c["step"] for c in figures["replan_checks"]] == [EVERY]  # none after the last step
    lines = [line for line in proc.stderr.splitlines() if line.startswith("re-plan after step")]
    assert len(lines) == 1 and f"new plan plan/replan-step{EVERY:04d}" in lines[0] and "MiB" in lines[0]
    # a gain, however small a loaded machine makes it (6.4% and 6.6% seen under -n 2): how far a was
    # slowed is asserted on the recalibration below
    assert replan["moved_bytes"] > 0 and replan["predicted_gain"] > 0

    # the new folder is a complete, verified plan, made for what was measured
    old, new_dir = load_plan(root / "plan"), root / "plan" / f"replan-step{EVERY:04d}"
    new = load_plan(new_dir, verify_bundles=True)
    assert [{"device": d.name, "blocks": list(d.blocks)} for d in new.devices] == replan["new"]
    assert [d["name"] for d in figures["devices"]] == new.device_names
    # the run's memory is held against the plan it ended on: its figures and the room it kept, as the
    # first plan did, for the snapshot copies on the workers (the reserve travels in cluster.json)
    assert {d.reserved_bytes for d in old.devices + new.devices} == {16 * 2**20}
    assert [d["planned_bytes"] for d in figures["devices"]] == [d.memory_bytes + d.reserved_bytes for d in new.devices]
    assert load_plan_cluster(new_dir).names == ("a", "b", "c")
    # the new plan's cluster records what was measured: a's blocks far slower than its profile said,
    # more so than b's (whose sub-millisecond stage a loaded machine slows too: which blocks the new
    # plan then gives a depends on that noise, so the plan's shape is not asserted), and c, a spare
    # that ran nothing, as profiled
    before, after = load_plan_cluster(root / "plan"), load_plan_cluster(new_dir)
    factor = {n: _recalibration(before.device(n).profile, after.device(n).profile) for n in ("a", "b", "c")}
    assert factor["a"] > 8 and factor["a"] > 2 * factor["b"] and factor["c"] == 1.0, factor
    assert [(d.name, d.blocks) for d in new.devices] != [(d.name, d.blocks) for d in old.devices]

    # the reference: the old plan for EVERY steps, then the new plan's bundles from that step
    _cli("train", "plan", *common, "--steps", EVERY, "--checkpoint", "before", cwd=root)
    meta, weights, per_stage = load_checkpoint(root / "before")
    losses = [s["loss"] for s in figures["steps"]]
    assert losses[:EVERY] == meta["losses"]
    bundles = [load_bundle_dir(new_dir / d.bundle) for d in new.devices]
    for c in bundles:  # written with the weights training had reached
        for name in c.graph.params:
            np.testing.assert_array_equal(c.graph.constants[name], weights[name], err_msg=name)
    rest = _train_from(new_dir, new, bundles, train, tokenizer, per_stage)
    assert losses[EVERY:] == rest.losses
    _, final, _ = load_checkpoint(root / "live")
    assert set(final) == set(rest.weights)
    for name in final:
        np.testing.assert_array_equal(final[name], rest.weights[name], err_msg=name)


def _train_from(plan_dir: Path, plan, bundles, train: Path, tokenizer: Path, per_stage):
    """Steps EVERY.. on fresh workers from `plan_dir`'s bundles, with the optimizer state saved at
    step EVERY, fed exactly as `confidant train` feeds them."""
    from jobs.train.pipeline import train_pipeline
    from jobs.common.workers import LocalWorkers
    from runtime.pipeline.coordinator import PipelineConfig
    from tasks.ner.data import load_ner_data
    from tasks.tokenize import make_batches

    data = load_ner_data(train, None, SEQ, tokenizer)
    labels = data.labels
    batches = make_batches(data.train_encoded, ROWS * M, SEQ, seed=0)
    union = {k: v for state in per_stage.values() for k, v in state.items()}  # each stage takes its own
    from confidant.home import DEMO_DIR
    from jobs.common.workers import coordinator_pair

    # the CLI signed the plan with the default coordinator key; the workers must trust that one
    local = LocalWorkers.start(len(bundles), threads=1, coordinator=coordinator_pair(DEMO_DIR / "keys"))
    try:
        return train_pipeline(None, batches, len(labels), local.addresses,
                              PipelineConfig(schedule=plan.schedule, microbatches=M, timeout_s=120),
                              STEPS - EVERY, keys=local.keys, start_step=EVERY, optimizer_state={k: union for k in range(len(bundles))},
                              bundles=[plan_dir / d.bundle for d in plan.devices],
                              devices=plan.device_names, stage_graphs=bundles, schedule=plan.to_schedule())
    finally:
        assert local.wait(30.0) == [0] * len(bundles)


def test_train_refuses_replanning_a_stashing_plan_or_one_without_a_cluster(tiny_onnx, tmp_path):
    """The refusals come before any profile figure is read: the cluster's profiles are made from the
    graph's FLOPs (`_profile`), not measured (`planned`'s `confidant profile`, which the slow tests pay)."""
    from tasks.ner.datagen import write_splits

    root = tmp_path
    graph = load_model(tiny_onnx["torchscript-17"], ROWS, SEQ)
    _profile(graph, "a").save(root / "a.json")
    _profile(graph, "box").save(root / "box.json")
    _write_cluster(root)
    train, _ = write_splits(root / "data", n_train=32, n_dev=4, seed=4)
    _cli("plan", tiny_onnx["torchscript-17"], "--cluster", "cluster.yaml", "--batch", ROWS * M, "--seq", SEQ,
         "--microbatches", M, "--schedule", "1f1b-stash", "-o", "stash", cwd=root)
    proc = _cli("train", "stash", "--data", train, "--local", "--replan-every", 2, cwd=root, ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "--replan-every needs a whole number of steps >= 1 and a flush schedule" in proc.stderr
    assert "1f1b-stash" in proc.stderr and "confidant plan --schedule 1f1b-flush" in proc.stderr
    emit_plan(root / "bare", graph, Partition((StageAssignment(0, "a", 0, 4),), "manual"),
              make_schedule("1f1b-flush", 1, M), {"model": "tiny"})
    proc = _cli("train", "bare", "--data", train, "--local", "--replan-every", 2, cwd=root, ok=False)
    assert proc.returncode == 1
    assert "it has no cluster.json" in proc.stderr and "--cluster FILE" in proc.stderr


@pytest.mark.slow  # 3 worker processes through the command line; the stash-from-bundles path also runs in threads
def test_train_from_a_stashing_plan_runs_every_step(planned, tiny_onnx):
    """Issue 13: `confidant train PLAN` with a 1f1b-stash plan and --steps 3 failed after the first
    step (the last stage "sent no loss mb=4"); it runs all three, with its tokenizer's data."""
    root, train, tokenizer = planned
    _cli("plan", tiny_onnx["torchscript-17"], "--cluster", "cluster.yaml", "--batch", ROWS * M, "--seq", SEQ,
         "--microbatches", M, "--schedule", "1f1b-stash", "-o", "stash3", cwd=root)
    _cli("train", "stash3", "--data", train, "--tokenizer", tokenizer, "--local", "--steps", 3, "--metrics-out",
         "stash3.json", cwd=root)
    doc = json.loads((root / "stash3.json").read_text())
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3] and doc["events"] == []


def test_a_recovery_replan_of_a_stashing_plan_keeps_its_update_every(tiny_onnx, tmp_path):
    """A device lost under 1f1b-stash with an update per 2 backwards: the new plan folder runs the
    same schedule with the same update_every, and its predicted step counts one update per 2
    backwards (not one per backward, as re-plans priced it before)."""
    from planner.cost import predicted_step_s, stage_costs
    from planner.replan import PlanReplanner

    graph = load_model(tiny_onnx["torchscript-17"], ROWS, SEQ)
    rate = {"sgd": 1e-6}
    cluster = _cluster(graph)
    cluster = dataclasses.replace(cluster, devices=tuple(
        dataclasses.replace(d, profile=dataclasses.replace(d.profile, update_s_per_param_byte=rate))
        for d in cluster.devices))
    partition = Partition((StageAssignment(0, "b", 0, 1), StageAssignment(1, "a", 2, 4)), "manual")
    emit_plan(tmp_path / "plan", graph, partition, make_schedule("1f1b-stash", 2, M, update_every=2),
              {"model": "tiny", "optimizer": {"name": "sgd"}}, cluster=cluster)
    plan = load_plan(tmp_path / "plan", verify_bundles=True)
    assert plan.update_every == 2
    replanner = PlanReplanner(tmp_path / "plan", plan, graph, load_plan_cluster(tmp_path / "plan"))
    new = replanner.without(3, ["b"], {})
    assert new.schedule.name == "1f1b-stash" and new.schedule.update_every == 2
    doc = load_plan(new.directory, verify_bundles=True)
    assert doc.update_every == 2 and doc.schedule == "1f1b-stash"
    costs = stage_costs(graph, replanner.cluster, new.decision.new_partition, "1f1b-stash", M, "sgd", 2)
    assert any(c.update_s > 0 for c in costs)
    assert new.decision.predicted_new_s == pytest.approx(predicted_step_s(costs, "1f1b-stash", M, 2), rel=1e-4)
    assert new.decision.predicted_new_s < predicted_step_s(costs, "1f1b-stash", M, 1)
    assert load_bundle_dir(new.directory / new.devices[0]).graph is not None


# --- a re-plan compiles as plan does: engines and head splits decided again ------------------------

# H = 4 heads: mnn t1 and torch t1 each take 2 heads in 20/22 ms; one backend alone takes 58/60 ms
SPLIT_CURVES = {"mnn:cpu:t1": (0.010, 0.020, 0.030, 0.058), "torch:cpu:t1": (0.012, 0.022, 0.032, 0.060)}


def _engines_profile(graph, name: str, torch_body: float, torch_head: float, curves: bool = False) -> DeviceProfile:
    """mnn:cpu:t1: 10 + 20 ms a block, the last (the head with its loss) 50 + 100 ms; torch:cpu:t1:
    the body `torch_body` x and the head `torch_head` x that; mnn:cpu:t2 as mnn:cpu:t1 (a device of
    two cores). With `curves`, attention curves on which splitting the heads pays."""
    last = block_signature(graph.blocks[-1])
    attention = block_signature(next(b for b in graph.blocks if b.attention is not None))

    def costs(body: float, head: float) -> dict:
        out = {block_signature(b): BlockCost(0.010 * body, 0.020 * body, 0.0, 1 << 20) for b in graph.blocks}
        out[last] = BlockCost(0.050 * head, 0.100 * head, 0.0, 1 << 20)
        return out

    backends = []
    for backend, body, head in (("mnn:cpu:t1", 1.0, 1.0), ("torch:cpu:t1", torch_body, torch_head),
                                ("mnn:cpu:t2", 1.0, 1.0)):
        curve = {attention: AttentionCurve(SPLIT_CURVES[backend])} if curves and backend in SPLIT_CURVES else {}
        backends.append(BackendProfile(backend, costs(body, head), curve))
    return DeviceProfile(name, graph.name, graph.batch, graph.seq, tuple(backends), 2**33,
                         split_child_bytes={"mnn": 40 << 20, "torch": 340 << 20})


def _engines_plan(tiny_onnx, tmp_path, profiles: dict, rows: int = ROWS, seq: int = SEQ, m: int = M,
                  optimizer: str = "sgd", lr: float = 5e-5) -> Path:
    """`confidant plan` (jobs.planning.plan_model) with manual cuts: a runs the embeddings and both
    encoder layers, b the rest; every device auto (no backend in the cluster file)."""
    from jobs.planning import PlanSettings, plan_model

    devices = []
    for i, (name, profile) in enumerate(profiles.items()):
        profile.save(tmp_path / f"{name}.json")
        devices.append({"name": name, "address": f"tcp://127.0.0.1:{5570 + i}", "profile": f"{name}.json",
                        "memory_budget": "8GiB"})
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": devices, "links": {
        "default": {"bandwidth": "1GB/s", "latency": "0.1ms"}}}))
    settings = PlanSettings(schedule="1f1b-flush", batch=rows * m, seq=seq, microbatches=m, optimizer=optimizer,
                            lr=lr, cuts=(3,), devices=("a", "b"), time_limit_s=5.0)
    return plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json", settings, tmp_path / "plan")


def _replanner(plan_dir: Path):
    """The re-planner `confidant train PLAN` makes for a lost device (jobs.train.from_plan), over the
    plan folder's own cluster.json."""
    from ir.serialize import merge_slices
    from planner.replan import PlanReplanner

    plan = load_plan(plan_dir)
    graph = merge_slices([load_bundle_dir(plan_dir / d.bundle).graph for d in plan.devices])
    return PlanReplanner(plan_dir, plan, graph, load_plan_cluster(plan_dir), workers=1)


def test_a_device_that_takes_over_a_lost_ones_blocks_moves_to_the_engine_fastest_for_them(tiny_onnx, tmp_path):
    """a's torch runs the encoder layers 1.4x slower than its MNN but the vocabulary-sized head 50x
    faster: the plan gives a the embeddings and encoders, on MNN; when b (the head) is lost, the
    recovery plan gives a every block, and a re-pick for them moves a to torch (2 x 14 + 1 ms
    beats 2 x 10 + 50 ms), in the plan folder the workers load."""
    graph = load_model(tiny_onnx["torchscript-17"], ROWS, SEQ)
    plan_dir = _engines_plan(tiny_onnx, tmp_path, {"a": _engines_profile(graph, "a", 1.4, 0.02),
                                                   "b": _engines_profile(graph, "b", 1.0, 1.0)})
    plan = load_plan(plan_dir)
    assert [(d.name, d.blocks, d.engine) for d in plan.devices] == [("a", (0, 2), "mnn"), ("b", (3, 4), "mnn")]
    new = _replanner(plan_dir).without(3, ["b"], {})
    after = load_plan(new.directory, verify_bundles=True)
    assert [(d.name, d.blocks, d.engine, d.threads) for d in after.devices] == [("a", (0, 4), "torch", 1)]
    assert load_bundle_dir(new.directory / new.devices[0]).stage_doc.backend_spec.engine == "torch"
    assert new.decision.forced and new.decision.engine_moves["a"][0].startswith("mnn:cpu:")
    assert new.decision.engine_moves["a"][1].startswith("torch:cpu:t1")
    assert "engine per device for its new blocks: a: mnn:cpu:" in new.decision.reason


def test_a_spare_device_a_recovery_plan_runs_gets_its_head_split(tiny_onnx, tmp_path):
    """c, whose attention heads run faster split over MNN and torch, is left out of the plan (the cuts
    name a and b); when a and b are lost, the recovery plan runs every block on c, split as plan
    would split it (the cluster.json beside the plan costs c split: its bundle must run so)."""
    graph = load_model(tiny_onnx["torchscript-17"], ROWS, SEQ)
    plan_dir = _engines_plan(tiny_onnx, tmp_path, {"a": _engines_profile(graph, "a", 1.4, 1.0),
                                                   "b": _engines_profile(graph, "b", 1.0, 1.0),
                                                   "c": _engines_profile(graph, "c", 1.4, 1.0, curves=True)})
    assert "c" not in load_plan(plan_dir).device_names
    new = _replanner(plan_dir).without(3, ["a", "b"], {})
    (c,) = load_plan(new.directory, verify_bundles=True).devices
    assert (c.name, c.blocks, c.engine, c.activations) == ("c", (0, 4), "mnn", "recompute")
    assert c.head_split is not None and dict(c.head_split.heads) == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    assert load_bundle_dir(new.directory / new.devices[0]).stage_doc.head_split == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}


def test_a_run_that_loses_a_device_goes_on_with_the_survivor_on_its_new_engine(tiny_onnx, tmp_path):
    """As `confidant train PLAN` runs (in-process workers): b is lost after step 1, the recovery plan
    (PlanReplanner.without through jobs.train.from_plan's plan_over) moves a to torch for all the
    blocks, a's worker loads that bundle and training goes on; with a flush schedule the losses stay
    single-device training's, to float32 rounding across the two frameworks."""
    pytest.importorskip("torch")
    from jobs.train.pipeline import train_pipeline
    from jobs.train.from_plan import _plan_over
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers
    from support import M as m, ROWS as rows, S as seq, kill_then_restart, single_device_training, synthetic_batch

    graph = load_model(tiny_onnx["torchscript-17"], rows, seq)
    plan_dir = _engines_plan(tiny_onnx, tmp_path, {"a": _engines_profile(graph, "a", 1.4, 0.02),
                                                   "b": _engines_profile(graph, "b", 1.0, 1.0)},
                             rows, seq, m, "adamw", 1e-3)
    plan = load_plan(plan_dir, verify_bundles=True)
    assert [d.engine for d in plan.devices] == ["mnn", "mnn"]
    batches, steps = [synthetic_batch(i) for i in range(3)], 3
    bundles = [plan_dir / d.bundle for d in plan.devices]
    with InProcessWorkers(2, timeout_s=30) as workers:
        result = train_pipeline(None, batches, 9, workers.addresses, PipelineConfig(
            schedule=plan.schedule, microbatches=plan.microbatches, timeout_s=30), steps, bundles=bundles,
            devices=plan.device_names, stage_graphs=[load_bundle_dir(b) for b in bundles], schedule=plan.to_schedule(),
            transport=workers.coordinator, on_step=kill_then_restart(workers, 1, lost_after=1, back_after=steps + 1),
            plan_over=_plan_over(_replanner(plan_dir), dict(zip("ab", workers.addresses))))
    assert workers.codes[0] == 0, workers.errors
    kinds = [e["event"] for e in result.events]
    assert kinds == ["lost", "new_plan", "recovered"], kinds
    recovery = load_plan(result.events[1]["plan"], verify_bundles=True)
    assert [(d.name, d.engine) for d in recovery.devices] == [("a", "torch")]
    assert len(result.losses) == steps
    losses, _ = single_device_training(graph, batches, steps)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-4)
