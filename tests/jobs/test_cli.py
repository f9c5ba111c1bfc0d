"""The command line as a user meets it: help, inspect --json schema, errors without tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return run_cli(*args)


def test_help_lists_every_command():
    # through the real entry point, `python -m confidant` (the other tests call confidant.cli.main)
    proc = subprocess.run([sys.executable, "-m", "confidant", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0
    for command in ("export", "inspect", "datagen", "train-local", "backends", "demo"):
        assert command in proc.stdout
    proc = _run("train-local", "--help")
    assert proc.returncode == 0
    for flag in ("--steps", "--batch", "--seq", "--lr", "--optimizer", "--seed", "--metrics-out"):
        assert flag in proc.stdout


def test_inspect_json_schema(tiny_onnx):
    proc = _run("inspect", tiny_onnx["dynamo-18"], "--batch", 2, "--seq", 16, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [b["kind"] for b in doc["blocks"]] == ["embeddings", "encoder", "encoder", "head", "loss"]
    for b in doc["blocks"]:
        assert set(b) == {"name", "kind", "params_bytes", "activation_bytes", "flops", "heads", "kv_heads", "head_size",
                          "split_units"}
        assert (b["heads"] is None) == (b["kind"] != "encoder") and b["kv_heads"] == b["heads"] == b["split_units"]
    assert doc["blocks"][1]["heads"] == 4 and doc["blocks"][1]["head_size"] == 16
    assert doc["totals"]["params_bytes"] == sum(b["params_bytes"] for b in doc["blocks"])
    assert doc["totals"]["flops"] == sum(b["flops"] for b in doc["blocks"])


def test_inspect_table(tiny_onnx):
    proc = _run("inspect", tiny_onnx["torchscript-14"], "--batch", 2, "--seq", 16)
    assert proc.returncode == 0, proc.stderr
    assert "layer.1" in proc.stdout and "4 x 16" in proc.stdout and "total" in proc.stdout


def test_bad_input_gives_one_line_errors(tmp_path):
    # a file that cannot be used exits 2, like a usage error; a run that fails exits 1
    proc = _run("inspect", tmp_path / "nope.onnx")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"confidant inspect: error: {tmp_path / 'nope.onnx'}: no such ONNX file"
    bad = tmp_path / "train.txt"
    bad.write_text("EU B-ORG\nrejects\n")
    proc = _run("train-local", tmp_path / "m.onnx", "--data", bad, "--eval", bad)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("confidant train-local: error: ") and "train.txt:2" in proc.stderr


def test_label_count_mismatch_says_how_to_fix(tiny_onnx, tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("Ann B-PER\nvisits O\nOslo B-LOC\non O\nMonday B-DATE\n\n")
    proc = _run("train-local", tiny_onnx["torchscript-17"], "--data", data, "--eval", data, "--steps", 1,
                "--seq", 16, "--batch", 2)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # the model and the data disagree: bad input
    assert proc.stderr.strip() == (
        f"confidant train-local: error: {tiny_onnx['torchscript-17']} predicts 9 labels but the data has 7 "
        "(O, B-DATE, I-DATE, B-LOC, I-LOC, B-PER, I-PER); re-export with `confidant export --num-labels 7`")
    dev = tmp_path / "dev.txt"  # a tag only the evaluation file has is named with that file
    dev.write_text("Ann B-PER\nvisits O\nIBM B-ORG\nin O\nMay B-DATE\nwith O\nGerman B-MISC\n\n")
    proc = _run("train-local", tiny_onnx["torchscript-17"], "--data", data, "--eval", dev, "--steps", 1,
                "--seq", 16, "--batch", 2)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith(
        f"re-export with `confidant export --num-labels 11`; ['B-MISC', 'B-ORG'] appear only in --eval {dev}, which the "
        "training never sees: drop them from it or add training sentences with them")


def test_backends_reports_cpu_present_and_fallbacks_absent():
    proc = _run("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["mnn:cpu"] is True
    # this MNN wheel has only the CPU backend: the others fall back silently and must read absent
    assert found["mnn:opencl"] is False and found["mnn:vulkan"] is False and found["mnn:cuda"] is False


def test_train_pipeline_argument_errors(tiny_onnx, tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("Ann B-PER\nvisits O\nOslo B-LOC\n\n")
    proc = _run("train-pipeline", tiny_onnx["torchscript-17"], "--data", data, "--local", 2, "--batch", 6,
                "--microbatches", 4)
    assert proc.returncode == 2  # a usage error, as argparse's
    assert proc.stderr.strip() == "confidant train-pipeline: error: --batch 6 must be a multiple of --microbatches 4"
    proc = _run("train-pipeline", tiny_onnx["torchscript-17"], "--data", data, "--local", 2, "--cuts", "9",
                "--batch", 4, "--microbatches", 2, "--seq", 16)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cuts [9] must be increasing block indices between 1 and 4" in proc.stderr


@pytest.mark.slow
def test_train_pipeline_end_to_end_with_resume(minilm_onnx, tmp_path):
    from tasks.ner.datagen import write_splits

    train, dev = write_splits(tmp_path / "data", n_train=64, n_dev=16, seed=2)
    common = ["--data", train, "--local", 3, "--schedule", "1f1b-flush", "--microbatches", 2, "--batch", 4,
              "--seq", 32, "--lr", "1e-4"]
    whole = tmp_path / "whole.json"
    proc = _run("train-pipeline", minilm_onnx, *common, "--steps", 3, "--metrics-out", whole)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _run("train-pipeline", minilm_onnx, *common, "--steps", 2, "--checkpoint", tmp_path / "ckpt")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = tmp_path / "resumed.json"
    proc = _run("train-pipeline", minilm_onnx, *common, "--steps", 1, "--resume", tmp_path / "ckpt",
                "--metrics-out", resumed, "--checkpoint", tmp_path / "ckpt2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from" in proc.stderr
    a, b = json.loads(whole.read_text()), json.loads(resumed.read_text())
    assert b["steps"][0]["step"] == 3
    assert b["steps"][0]["loss"] == a["steps"][2]["loss"]
    # the resumed run's checkpoint carries the loss of every step, the earlier run's first
    meta = json.loads((tmp_path / "ckpt2" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["losses"] == [s["loss"] for s in a["steps"]]
    assert len(a["devices"]) == 3 and all(d["peak_rss_bytes"] > 0 for d in a["devices"])


def test_a_path_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """`datagen -o FILE` and a CONFIDANT_HOME that is a file ended in FileExistsError tracebacks."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = _run("datagen", "-o", blocker)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"confidant datagen: error: {blocker}: a file is in the way of a folder to make "
                                   "there; give a path that can be written")
    monkeypatch.setenv("CONFIDANT_HOME", str(blocker))
    proc = _run("keys", blocker / "keys", "coordinator")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(blocker) in proc.stderr


def test_the_demos_defaults_yield_to_flags_however_spelled():
    """`demo --llm --step 3 --thread 1` ran 10 steps on 2 threads: the override looked for the literal
    `--steps` in sys.argv (and missed flags given through main(argv) too)."""
    from confidant.cli import build_parser
    from confidant.commands import demo_args

    def parsed(*argv):
        a = demo_args(build_parser().parse_args(["demo", *argv]))
        return a.steps, a.batch, a.seq, a.lr, a.threads, a.eval_limit

    assert parsed("--llm", "--step", "3", "--thread", "1") == (3, 4, 128, 2e-4, 1, 16)
    assert parsed("--llm", "--seq", "64", "--eval-limit", "2") == (10, 4, 64, 2e-4, 2, 2)
    assert parsed() == (60, 8, 32, 1e-4, 1, None)
    assert parsed("--steps", "5", "--batch", "2") == (5, 2, 32, 1e-4, 1, None)


@pytest.mark.parametrize("argv, says", [
    (("datagen", "--task", "seq-cls", "--train", "-5"), "argument --train: -5 is not at least 1"),
    (("plan", "m.onnx", "--cluster", "c.json", "--time-limit", "nan"), "argument --time-limit: nan is not a number of "
                                                                       "seconds > 0"),
    (("plan", "m.onnx", "--cluster", "c.json", "--microbatches", "0"), "argument --microbatches: 0 is not at least 1"),
])
def test_counts_and_time_limits_out_of_range_are_usage_errors(argv, says):
    """--train -5 wrote a header-only file, --time-limit nan/0/-1 was taken, --microbatches 0 said
    'must be a multiple of 0'."""
    proc = _run(*argv)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(says)


def test_version_and_the_train_commands_help_name_every_flag():
    from importlib.metadata import version

    from support import run_cli

    run = run_cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"confidant {version('confidant')}"
    text = run_cli("train", "--help").stdout
    for flag in ("--data DATA", "--eval EVAL", "--checkpoint CHECKPOINT"):
        described = text.split(flag, 2)[-1].split("\n  -", 1)[0]  # its help, up to the next flag
        assert len(described.split()) >= 4, f"train --help says nothing of {flag}"


def test_the_demo_explains_an_entity_f1_near_zero_after_few_steps():
    """`demo --steps 10` ended on entity F1 0.0000 with no word on why."""
    from confidant.defaults import DEMO_DEFAULTS
    from jobs.demo import f1_hint

    default = DEMO_DEFAULTS["steps"]
    hint = f1_hint(0.0, 10, default)
    assert hint.startswith("entity F1 0.000 after 10 steps") and f"--steps {default}" in hint
    assert f1_hint(0.0, default, default) is None and f1_hint(0.6, 10, default) is None and f1_hint(None, 10, default) is None


@pytest.mark.parametrize("command, teaches", [
    ("show", "without running anything"), ("simulate", "Chrome trace, one row per device"),
    ("estimate", "every lever with the MiB it saves"), ("report", "self-contained HTML page")])
def test_plan_commands_describe_themselves(command, teaches):
    proc = _run(command, "--help")
    assert proc.returncode == 0
    usage, _, rest = proc.stdout.partition("\n\n")
    assert teaches in " ".join(rest.split()), rest[:400]


def test_demo_llm_refuses_a_seq_its_conversations_cannot_fit_before_exporting(tmp_path, monkeypatch):
    """`demo --llm --seq 64` exported SmolLM2 for minutes, then failed on the data's length."""
    from support import run_cli

    monkeypatch.setenv("CONFIDANT_HOME", str(tmp_path))
    run = run_cli("demo", "--llm", "--seq", "64")
    assert run.returncode == 2 and "demo --llm --seq 64: the demo's conversations run 83-122 tokens" in run.stderr
    assert not any(tmp_path.rglob("*.onnx"))  # refused before the export
