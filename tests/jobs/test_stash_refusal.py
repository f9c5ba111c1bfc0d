"""1f1b-stash with fewer micro-batches than stages - 1 has no steady state: it could train one step
only. `plan` and `train-pipeline` refuse it up front, through the command line: one line, exit 2,
naming the fix (more micro-batches, or 1f1b-flush)."""
from __future__ import annotations

from support import run_cli

FIX = "use --microbatches 2 or more, or --schedule 1f1b-flush"


def _cli(*args, cwd):
    """`confidant ARGS` in this process (`support.run_cli`: argparse's exit 2 included; a new interpreter
    costs ~2 s of imports a call): the local workers of the runs that are not refused are processes still."""
    return run_cli(*args, cwd=cwd)


def _error_line(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning: --insecure")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and lines[-1].count("error:") == 1
    return lines[-1]


def test_train_pipeline_refuses_a_stash_run_without_a_steady_state_before_any_worker_starts(tiny_onnx, tmp_path):
    from tasks.ner.datagen import write_splits

    train, _ = write_splits(tmp_path / "data", n_train=8, n_dev=2, seed=1)
    proc = _cli("train-pipeline", tiny_onnx["torchscript-17"], "--data", train, "--local", 3, "--schedule", "1f1b-stash",
                "--microbatches", 1, "--batch", 2, "--seq", 12, "--steps", 3, "--insecure", cwd=tmp_path)
    line = _error_line(proc)
    assert "1f1b-stash over 3 stages with 1 micro-batch per step has no steady state" in line
    assert "cannot train 3 steps" in line and line.endswith(FIX)
    assert "local worker" not in proc.stderr  # refused before any worker started
    # one step has no steady state to need, and more micro-batches have one: neither is refused this way
    for extra in (("--steps", 1), ("--microbatches", 2)):
        proc = _cli("train-pipeline", tiny_onnx["torchscript-17"], "--data", train, "--local", 3, "--schedule",
                    "1f1b-stash", "--microbatches", 1, "--batch", 2, "--seq", 12, "--steps", 3, *extra, "--insecure",
                    cwd=tmp_path)
        assert "no steady state" not in proc.stderr, proc.stderr[-2000:]


def test_plan_refuses_a_stash_plan_without_a_steady_state(tiny_onnx, tmp_path):
    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from planner.onnx_import import load_model

    graph = load_model(tiny_onnx["torchscript-17"], 2, 12)
    costs = {block_signature(b): BlockCost(1e-3, 2e-3) for b in graph.blocks}
    DeviceProfile("box", graph.name, 2, 12, (BackendProfile("mnn:cpu:t1", costs),), 2**33).save(tmp_path / "box.json")
    (tmp_path / "c.yaml").write_text("devices:\n" + "".join(
        f"  - {{name: {n}, address: 'tcp://127.0.0.1:{i + 1}', profile: box.json, memory_budget: 2GiB, "
        f"backend: 'mnn:cpu:t1'}}\n" for i, n in enumerate("abc")) + "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    common = (tiny_onnx["torchscript-17"], "--cluster", "c.yaml", "--schedule", "1f1b-stash", "--batch", 2, "--seq", 12,
              "--cuts", "2,3", "--devices", "a,b,c", "--insecure")
    line = _error_line(_cli("plan", *common, "--microbatches", 1, "-o", "p1", cwd=tmp_path))
    assert "1f1b-stash over 3 stages with 1 micro-batch per step has no steady state" in line and line.endswith(FIX)
    assert not (tmp_path / "p1").exists()
    proc = _cli("plan", *common, "--microbatches", 2, "--batch", 4, "-o", "p2", cwd=tmp_path)  # a steady state
    assert proc.returncode == 0, proc.stderr[-2000:]
