"""Issue 14, lever 1: the engine per device is a planning decision. A device whose cluster entry
names no backend (auto) runs the fastest profiled backend whose engine fits its budget beside the
runtime (PyTorch's import is ~300 MB); the memory model charges that engine; `show` says what each
device runs and the runner-up with its time and memory."""
from __future__ import annotations

import json

import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile
from jobs.common.errors import JobError
from jobs.planning import PlanSettings, engine_choices, plan_model
from planner.cluster import DeviceSpec, device_backend, runtime_bytes
from planner.onnx_import import load_model
from support import S

MIB = 2 ** 20
TORCH_IMPORT = 300 * MIB
RUNTIME = 100 * MIB


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], 4, S)


def _profile(graph) -> DeviceProfile:
    """torch:cpu:t1 twice as fast as mnn:cpu:t1 on every block, at the cost of its import."""
    sigs = {block_signature(b) for b in graph.blocks}
    mnn = {s: BlockCost(0.010, 0.020, workspace_bytes=1 * MIB) for s in sigs}
    torch = {s: BlockCost(0.005, 0.010, workspace_bytes=1 * MIB) for s in sigs}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq,
                         (BackendProfile("mnn:cpu:t1", mnn), BackendProfile("torch:cpu:t1", torch, {}, TORCH_IMPORT)),
                         memory_available_bytes=8 << 30, runtime_overhead_bytes=RUNTIME)


def test_auto_takes_the_fastest_backend_whose_engine_fits_and_charges_its_import(graph):
    profile = _profile(graph)
    roomy, small = DeviceSpec("a", "tcp://x:1", profile, 1 << 30), DeviceSpec("b", "tcp://x:2", profile, 350 * MIB)
    assert device_backend(roomy).backend == "torch:cpu:t1" and runtime_bytes(roomy) == RUNTIME + TORCH_IMPORT
    assert device_backend(small).backend == "mnn:cpu:t1" and runtime_bytes(small) == RUNTIME  # 100 + 300 > 350
    given = DeviceSpec("c", "tcp://x:3", profile, 1 << 30, backend="mnn:cpu:t1")
    assert device_backend(given).backend == "mnn:cpu:t1" and runtime_bytes(given) == RUNTIME
    tight = DeviceSpec("d", "tcp://x:4", profile, 50 * MIB)  # nothing fits: the fastest, reported over budget
    assert device_backend(tight).backend == "torch:cpu:t1"


def _plan(graph, tmp_path, tiny_onnx, budget: str, backend: str | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    _profile(graph).save(tmp_path / "box.json")
    entry = {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": budget}
    if backend:
        entry["backend"] = backend
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [entry]}))
    settings = PlanSettings(schedule="1f1b-flush", batch=8, seq=S, microbatches=2, optimizer="adamw", lr=5e-5,
                            time_limit_s=5.0)
    out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json", settings, tmp_path / "plan")
    return out, json.loads((out / "plan.json").read_text())["devices"][0]


def test_the_plan_runs_the_chosen_engine_and_show_names_the_runner_up(graph, tiny_onnx, tmp_path, capsys):
    from confidant.commands import show_plan

    blocks = len(graph.blocks)
    fast_dir, fast = _plan(graph, tmp_path / "roomy", tiny_onnx, "2GiB")
    lean_dir, lean = _plan(graph, tmp_path / "small", tiny_onnx, "380MiB")
    given_dir, given = _plan(graph, tmp_path / "given", tiny_onnx, "2GiB", backend="mnn:cpu:t1")
    assert (fast["engine"], lean["engine"], given["engine"]) == ("torch", "mnn", "mnn")
    assert fast["memory_bytes"] - given["memory_bytes"] == TORCH_IMPORT  # the same stage, plus torch's import
    (choice,) = engine_choices(fast_dir)
    assert (choice.backend, choice.runner_up, choice.given) == ("torch:cpu:t1", "mnn:cpu:t1", False)
    assert choice.seconds == pytest.approx(blocks * 0.015) and choice.runner_up_seconds == pytest.approx(blocks * 0.03)
    assert choice.runner_up_extra_bytes == -TORCH_IMPORT
    (choice,) = engine_choices(lean_dir)
    assert (choice.backend, choice.runner_up, choice.runner_up_extra_bytes) == ("mnn:cpu:t1", "torch:cpu:t1",
                                                                                 TORCH_IMPORT)
    capsys.readouterr()
    show_plan(lean_dir)
    out = capsys.readouterr().out
    assert (f"  box: mnn:cpu:t1 (auto) {blocks * 30:.0f} ms; runner-up torch:cpu:t1 {blocks * 15:.0f} ms, "
            f"+300 MiB of engine") in out
    show_plan(given_dir)
    assert "  box: mnn:cpu:t1 (the cluster file's)" in capsys.readouterr().out


def test_where_no_stage_fits_beside_torchs_import_the_plan_starts_from_the_leaner_engine(graph, tiny_onnx, tmp_path):
    """A budget 1 MiB over the runtime and torch's import: torch's engine fits beside the runtime,
    so the whole-model choice is torch, but no stage fits there (each block holds 1 MiB of workspace
    besides its weights), with or without its activations; on MNN the whole model does."""
    budget = RUNTIME + TORCH_IMPORT + MIB
    assert device_backend(DeviceSpec("box", "tcp://x:1", _profile(graph), budget)).backend == "torch:cpu:t1"
    _, device = _plan(graph, tmp_path, tiny_onnx, f"{budget // MIB}MiB")
    assert (device["engine"], tuple(device["blocks"])) == ("mnn", (0, len(graph.blocks) - 1))
    assert RUNTIME < device["memory_bytes"] <= budget
    with pytest.raises(JobError, match=r"^no plan fits the memory budgets .* 'box'"):
        _plan(graph, tmp_path / "tiny", tiny_onnx, f"{RUNTIME // MIB}MiB")  # not even MNN's stage


@pytest.mark.slow  # two fresh interpreters, one of them importing torch
def test_the_profile_measures_what_torchs_import_adds_to_the_runtime():
    pytest.importorskip("torch")
    from runtime.profiling.memory import engine_overhead_bytes, runtime_overhead_bytes

    runtime = runtime_overhead_bytes()
    assert runtime > 20 * MIB
    assert engine_overhead_bytes("torch", runtime) > 50 * MIB  # ~300 MB measured here
    assert engine_overhead_bytes("mnn", runtime) == 0  # MNN is in the runtime already


@pytest.mark.slow  # a fresh interpreter profiling both engines, and the import probe's two more
def test_the_profile_charges_torchs_start_up_with_its_engine(tiny_onnx):
    """A worker pays PyTorch's first training run once (kernels, autograd's engine, threads) beside its
    import: the profile charges what of it a worker holds beyond the import's term with the engine. Measured in a fresh interpreter,
    since a process that already trained with torch shows no start-up; MNN's is nothing."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys; sys.path.insert(0, sys.argv[2])\n"
             "from planner.onnx_import import load_model\n"
             "from runtime.profiling.device import profile_device\n"
             "p = profile_device(load_model(sys.argv[1], 2, 16), 't', ('mnn:cpu:t1', 'torch:cpu:t1'), reps=1,"
             " attention=False)\n"
             "print('OVERHEAD', p.runtime_overhead_bytes, *(b.engine_overhead_bytes for b in p.backends))\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", probe, str(tiny_onnx["torchscript-17"]), str(root)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    runtime, mnn, torch = (int(x) for x in out.split("OVERHEAD", 1)[1].split())
    from runtime.profiling.memory import engine_overhead_bytes

    assert mnn == 0
    # the import alone, and what a worker holds of the start-up beyond it: not the library pages the profile's
    # forked children map again, which the import's probe charges (h120; ~4-6 MiB here, 6.3 in a clean-clone CI
    # run; main charged them twice, ~20 MiB; tests/runtime/test_torch_start_up.py bounds it from both sides)
    import_only = engine_overhead_bytes("torch", runtime)
    assert torch > import_only + 2 * MIB, ((torch - import_only) / MIB)
    print(f"start-up charged beyond the import: {(torch - import_only) / MIB:.1f} MiB")


# --- the engine per device for the blocks it runs (planner.engines) ---------------------------------

def _split_profile(graph) -> DeviceProfile:
    """MNN runs the encoder layers 4x faster than torch, torch runs the head 8x faster than MNN
    (as on this machine for a decoder's LM head); embeddings and loss cost both the same. Over
    the whole model torch is faster, so the whole-model choice is torch everywhere."""
    per_kind = {"encoder": ((0.005, 0.010), (0.020, 0.040)), "head": ((0.040, 0.080), (0.005, 0.010))}
    sigs = {block_signature(b): b.kind for b in graph.blocks}

    def costs(engine: int) -> dict[str, BlockCost]:
        return {s: BlockCost(*per_kind.get(kind, ((0.001, 0.002),) * 2)[engine], workspace_bytes=1 * MIB)
                for s, kind in sigs.items()}

    return DeviceProfile("box", graph.name, graph.batch, graph.seq,
                         (BackendProfile("mnn:cpu:t1", costs(0)), BackendProfile("torch:cpu:t1", costs(1), {},
                                                                                  TORCH_IMPORT)),
                         memory_available_bytes=8 << 30, runtime_overhead_bytes=RUNTIME)


def _two_device_plan(graph, tmp_path, tiny_onnx, backend: str | None = None, cuts=None, notes=None):
    from jobs.common.report import Silent

    tmp_path.mkdir(parents=True, exist_ok=True)
    _split_profile(graph).save(tmp_path / "box.json")
    devices = []
    for i, name in enumerate(("a", "b")):
        entry = {"name": name, "address": f"tcp://127.0.0.1:{i + 1}", "profile": "box.json", "memory_budget": "2GiB"}
        if backend:
            entry["backend"] = backend
        devices.append(entry)
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": devices, "links": {
        "default": {"bandwidth": "1GB/s", "latency": "0.1ms"}}}))
    settings = PlanSettings(schedule="1f1b-flush", batch=8, seq=S, microbatches=2, optimizer="adamw", lr=5e-5,
                            time_limit_s=5.0, cuts=cuts, devices=("a", "b") if cuts else None)

    class Notes(Silent):
        def note(self, text):
            if notes is not None:
                notes.append(text)

    out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json", settings, tmp_path / "plan", Notes())
    return json.loads((out / "plan.json").read_text())


def test_each_device_runs_the_engine_fastest_for_its_own_blocks(graph, tiny_onnx, tmp_path):
    """Cut after the encoders: the stage of embeddings and encoders runs MNN (no torch import in its
    memory), the head's stage runs torch, and the step is predicted faster than torch everywhere
    (the whole-model choice, here forced by the cluster file)."""
    notes: list[str] = []
    head = next(b.index for b in graph.blocks if b.kind == "head")
    auto = _two_device_plan(graph, tmp_path / "auto", tiny_onnx, cuts=(head,), notes=notes)
    forced = _two_device_plan(graph, tmp_path / "torch", tiny_onnx, backend="torch:cpu:t1", cuts=(head,))
    assert [d["engine"] for d in auto["devices"]] == ["mnn", "torch"]
    assert [d["engine"] for d in forced["devices"]] == ["torch", "torch"]
    assert [tuple(d["blocks"]) for d in auto["devices"]] == [(0, head - 1), (head, len(graph.blocks) - 1)]
    assert auto["predicted_step_s"] < forced["predicted_step_s"]
    # the same stage on torch: its import. Both keep the second micro-batch in flight's activations (1 MiB
    # per block): the first stage's backwards follow another micro-batch's forward, where MNN recomputing
    # re-runs its encoders' forwards (priced at least half the forward, `planner.cost.mnn_rerun_floor`, though
    # this profile reads no re-run) and keeping does not
    assert forced["devices"][0]["memory_bytes"] - auto["devices"][0]["memory_bytes"] == TORCH_IMPORT
    assert any(line.startswith("engine per device for the blocks it runs: a: torch:cpu:t1 (keep) -> mnn:cpu:t1 (keep) ")
               for line in notes)


def test_the_partition_is_solved_again_for_the_picked_engines(graph, tiny_onnx, tmp_path):
    """Without cuts: the solved plan with engines picked per stage is predicted no slower than the
    whole-model choice's, and one of its devices runs MNN where the whole-model choice is torch."""
    auto = _two_device_plan(graph, tmp_path / "auto", tiny_onnx)
    forced = _two_device_plan(graph, tmp_path / "torch", tiny_onnx, backend="torch:cpu:t1")
    assert auto["predicted_step_s"] < forced["predicted_step_s"]
    assert "mnn" in {d["engine"] for d in auto["devices"]}


def test_pick_engines_keeps_what_the_cluster_file_chose_and_never_predicts_slower(graph):
    from ir.profile import Link
    from planner.cluster import Cluster
    from planner.engines import pick_engines
    from planner.partition import make_instance, solve_partition

    profile = _split_profile(graph)

    def cluster(backend):
        return Cluster(tuple(DeviceSpec(n, f"tcp://x:{i}", profile, 2 << 30, backend=backend)
                             for i, n in enumerate("ab")), Link(1e9, 1e-4))

    def solve(inst):
        return solve_partition(inst, time_limit_s=2.0)

    def first(c):
        return solve(make_instance(graph, c, "1f1b-flush", 2, "adamw"))

    fixed = cluster("torch:cpu:t1")
    picks = pick_engines(graph, fixed, first(fixed), "1f1b-flush", 2, "adamw", solve)
    assert picks.changed == {} and picks.cluster == fixed and picks.after_us == picks.before_us
    auto = cluster(None)
    picks = pick_engines(graph, auto, first(auto), "1f1b-flush", 2, "adamw", solve)
    assert picks.changed and all(before == "torch:cpu:t1 (keep)" for before, _ in picks.changed.values())
    assert picks.after_us < picks.before_us
    assert {d.picked for d in picks.cluster.devices if d.name in picks.changed} == {"mnn:cpu:t1"}


def _keeping_profile(graph) -> DeviceProfile:
    """torch:cpu:t1 only, every block 10 + 20 ms; keeping its activations costs a block 40 MiB
    more per further micro-batch in flight (1 MiB otherwise)."""
    costs = {block_signature(b): BlockCost(0.010, 0.020, workspace_bytes=41 * MIB, stacked_bytes=1 * MIB,
                                           kept_bytes=40 * MIB) for b in graph.blocks}
    return DeviceProfile("box", graph.name, graph.batch, graph.seq, (BackendProfile("torch:cpu:t1", costs),),
                         memory_available_bytes=8 << 30, runtime_overhead_bytes=RUNTIME)


def test_a_cut_that_fits_only_recomputing_on_one_device_is_found(graph):
    """PyTorch only, 1f1b-flush with 2 micro-batches: stage 0 holds a second micro-batch's
    activations where it keeps them (40 MiB a block), which its budget fits for one block only.
    From the whole-model choice (keeping everywhere) the cut after block 0 is all that fits, and
    re-picking per stage changes nothing (keeping is faster for the blocks each stage has); from
    every device recomputing, the solver cuts later and the last stage then keeps its activations
    (nothing else in flight there): a shorter step, which `best_picks` returns."""
    from ir.profile import Link
    from planner.cluster import Cluster
    from planner.cost import stage_memory_bytes
    from planner.engines import best_picks, pick_engines
    from planner.partition import make_instance, solve_partition

    profile = _keeping_profile(graph)
    n = len(graph.blocks)

    def memory(first, last, stage, activations):
        device = DeviceSpec("p", "tcp://x:9", profile, 8 << 30, activations=activations)
        return stage_memory_bytes(graph, device, first, last, stage, 2, "1f1b-flush", 2, "adamw")

    budget = memory(0, 0, 0, "keep") + 20 * MIB
    cut = n // 2
    assert memory(0, 1, 0, "keep") > budget >= max(memory(0, cut - 1, 0, "recompute"), memory(cut, n - 1, 1, "keep"))
    cluster = Cluster(tuple(DeviceSpec(name, f"tcp://x:{i}", profile, budget) for i, name in enumerate("ab")),
                      Link(1e9, 1e-4))

    def solve(inst):
        return solve_partition(inst, time_limit_s=2.0)

    whole = pick_engines(graph, cluster, solve(make_instance(graph, cluster, "1f1b-flush", 2, "adamw")),
                         "1f1b-flush", 2, "adamw", solve)
    assert whole.partition.ranges == [(0, 0), (1, n - 1)] and whole.changed == {}
    best = best_picks(graph, cluster, "1f1b-flush", 2, "adamw", solve)
    assert best.after_us < whole.after_us and best.before_us == whole.before_us
    assert best.partition.ranges[0][1] > 0
    first, rest = (best.cluster.device(name) for name in best.partition.devices)
    assert (first.activations, rest.activations) == ("recompute", "keep")
    assert best.changed == {first.name: ("torch:cpu:t1 (keep)", "torch:cpu:t1 (recompute)")}


def test_a_stage_keeps_what_it_recomputed_where_that_costs_no_memory(graph):
    """PyTorch only, 1f1b-stash (its step: m x the slowest stage), 4 micro-batches, the cuts fixed: stage 0 (blocks 0-2, the slowest)
    must recompute (keeping does not fit its budget); stage 1 could keep (two micro-batches in
    flight: 40 MiB more) and stage 2, the last, keeps at no cost (one in flight). Neither shortens
    the step; keeping on stage 1 costs memory, so that pick is dropped, and the last stage's is
    taken alone: the same step and memory, less work."""
    from ir.profile import Link
    from planner.cluster import Cluster
    from planner.cost import stage_memory_bytes
    from planner.engines import pick_engines, recompute_everywhere
    from planner.partition import make_instance, manual_partition

    profile = _keeping_profile(graph)
    n = len(graph.blocks)
    assert n == 5

    def memory(first, last, stage, activations):
        device = DeviceSpec("p", "tcp://x:9", profile, 8 << 30, activations=activations)
        return stage_memory_bytes(graph, device, first, last, stage, 3, "1f1b-stash", 4, "adamw")

    budget = memory(0, 2, 0, "recompute") + MIB
    assert memory(0, 2, 0, "keep") > budget
    assert memory(3, 3, 1, "keep") > memory(3, 3, 1, "recompute") and memory(4, 4, 2, "keep") == memory(4, 4, 2, "recompute")
    cluster = recompute_everywhere(Cluster((DeviceSpec("a", "tcp://x:1", profile, budget),
                                            DeviceSpec("b", "tcp://x:2", profile, 8 << 30),
                                            DeviceSpec("c", "tcp://x:3", profile, 8 << 30)), Link(1e9, 1e-4)))
    partition = manual_partition(make_instance(graph, cluster, "1f1b-stash", 4, "adamw"), ["a", "b", "c"], [3, 4])
    picks = pick_engines(graph, cluster, partition, "1f1b-stash", 4, "adamw")
    assert picks.after_us == picks.before_us and picks.partition.ranges == partition.ranges
    assert [picks.cluster.device(name).activations for name in "abc"] == ["recompute", "recompute", "keep"]
    assert picks.changed == {"c": ("torch:cpu:t1 (recompute)", "torch:cpu:t1 (keep)")}


def test_devices_with_the_same_engine_move_are_named_together():
    from planner.compile import engine_moves as _devices_moved

    moves = {f"d{i}": ("mnn:cpu:t1 (recompute)", "mnn:cpu:t1 (keep)") for i in range(6)}
    moves["laptop"] = ("mnn:cpu:t2 (recompute)", "torch:cpu:t2 (keep)")
    assert _devices_moved(moves) == ["d0, d1, d2, d3, ... (6 devices): mnn:cpu:t1 (recompute) -> mnn:cpu:t1 (keep)",
                                     "laptop: mnn:cpu:t2 (recompute) -> torch:cpu:t2 (keep)"]


def test_a_stash_plan_updating_every_few_backwards_charges_its_gradient_sum(graph, tiny_onnx, tmp_path):
    """1f1b-stash with --update-every 2 sums two backwards' gradients before each update: the plan
    charges each stage that sum (one copy of its weights, the tables' rows instead where they are
    only looked up), which an update after every backward does not hold; nor does PyTorch then
    hold its weight gradients at once (it steps each as it comes: `stepped_gradient_bytes`)."""
    from planner.cost import row_gradient_delta_bytes, stage_params_bytes, stepped_gradient_bytes

    _profile(graph).save(tmp_path / "box.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
        {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "box.json", "memory_budget": "2GiB"}]}))
    memory = {}
    for every in (1, 2):
        settings = PlanSettings(schedule="1f1b-stash", batch=8, seq=S, microbatches=2, optimizer="adamw", lr=5e-5,
                                time_limit_s=5.0, update_every=every)
        out = plan_model(tiny_onnx["torchscript-17"], tmp_path / "cluster.json", settings, tmp_path / f"plan{every}")
        plan = json.loads((out / "plan.json").read_text())
        assert plan["update_every"] == every
        (device,) = plan["devices"]
        assert device["engine"] == "torch"
        memory[every] = device["memory_bytes"]
    n = len(graph.blocks)
    spec = DeviceSpec("box", "tcp://127.0.0.1:1", _profile(graph), 2 << 30, backend="torch:cpu:t1")
    rows = row_gradient_delta_bytes(graph, 0, n - 1, spec, 2, "1f1b-stash", update_every=2)
    stepped = stepped_gradient_bytes(graph, 0, n - 1, spec, "1f1b-stash")
    assert rows < 0 < stepped  # the word table's rows, not a dense copy of it; the dense weights' gradients
    assert stepped_gradient_bytes(graph, 0, n - 1, spec, "1f1b-stash", update_every=2) == 0
    assert memory[2] - memory[1] == stage_params_bytes(graph, 0, n - 1) + rows + stepped