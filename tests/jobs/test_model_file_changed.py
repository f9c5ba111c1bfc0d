"""Issue 32: the coordinator of `confidant train-pipeline` maps the model file read-only and reads its
frozen weights through the mapping again when it re-plans after a lost device. The file rewritten in
place during the run (`open(path, "wb")`: the same inode, truncated) then a worker killed: the
command says in one line that the file changed and exits 2 (no SIGBUS, no plan of other weights),
and the metrics document is written with the steps done and the error."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The real command line in a child process (a SIGBUS would kill pytest), with two hooks: the local
# workers' processes are noted as they start, and after step 2 the model file is rewritten in place
# (a quarter of its length: the mapping's later pages are past its end) and worker 1 is killed.
_RUN = r"""
import os, signal, sys, threading
sys.path[:0] = [sys.argv[1]]
import jobs.common.workers as workers
import jobs.train.pipeline as pipeline
from confidant.cli import main

model = sys.argv[2]
started, real_start, real_progress = [], workers.LocalWorkers.start.__func__, pipeline.progress

def start(cls, *args, **kwargs):
    started.append(real_start(cls, *args, **kwargs))
    return started[-1]

def progress(*args, **kwargs):
    shown = real_progress(*args, **kwargs)

    def on_step(step, *rest):
        shown(step, *rest)
        if step == 2:
            size = os.path.getsize(model)
            with open(model, "wb") as f:
                f.write(b"\0" * (size // 4))
            print("REWRITTEN", flush=True)
            threading.Timer(0.05, os.kill, (started[0].procs[1].pid, signal.SIGKILL)).start()

    return on_step

workers.LocalWorkers.start = classmethod(start)
pipeline.progress = progress
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow  # worker processes, a recovery
def test_a_model_file_rewritten_under_a_run_is_named_when_a_loss_re_plans(chat_llama, tmp_path):
    source, train, _ = chat_llama
    folder = tmp_path / "model"
    shutil.copytree(source.parent, folder, ignore=shutil.ignore_patterns("*.jsonl"))
    model, metrics = folder / source.name, tmp_path / "m.json"
    args = ["train-pipeline", str(model), "--task", "causal-lm", "--data", str(train), "--local", "2",
            "--steps", "6", "--batch", "4", "--seq", "128", "--microbatches", "2", "--lora", "4", "--insecure",
            "--metrics-out", str(metrics)]
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "CONFIDANT_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", _RUN, str(ROOT), str(model), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert "REWRITTEN" in done.stdout, (done.returncode, done.stderr[-3000:])
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("confidant train-pipeline: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"confidant train-pipeline: error: {model}: the model file changed while this run used it "
        "(its size went from"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    document = json.loads(metrics.read_text())
    assert "the model file changed" in document["error"]
    assert len(document["steps"]) >= 2
    assert any(e["event"] == "lost" for e in document["events"])


def test_the_evaluation_after_a_run_skips_a_model_file_changed_since_it_was_mapped(chat_llama, tmp_path):
    """The evaluation after pipeline training opens the model file by its path again (lowering, ONNX
    Runtime): a file written to since the run mapped it (here a few weights' bytes, the same size)
    would score other weights than those trained, so it is not evaluated and a note says why; the
    run's trained weights stand."""
    from jobs.common.report import Silent
    from jobs.common.settings import TrainingSettings
    from jobs.train.pipeline_tasks import pipeline_task

    source, train, dev = chat_llama
    folder = tmp_path / "model"
    shutil.copytree(source.parent, folder, ignore=shutil.ignore_patterns("*.jsonl"))
    model = folder / source.name
    notes = []

    class Notes(Silent):
        def note(self, text: str) -> None:
            notes.append(text)

    settings = TrainingSettings(steps=1, batch=4, seq=128, seed=0, eval_limit=2)
    run = pipeline_task("causal-lm", model, train, dev, settings, 2, Notes())
    weights = {p: run.graph.constants[p] for p in run.graph.params}
    size = model.stat().st_size
    with open(model, "r+b") as f:  # bytes inside the weights (the tied embedding is most of the file)
        f.seek(size // 2)
        f.write(b"\x7f" * 4096)
    assert model.stat().st_size == size
    assert run.evaluate(weights) is None
    assert notes and notes[-1].startswith(f"not evaluated: {model}: the model file changed while this run used it "
                                          "(it was written to)")
