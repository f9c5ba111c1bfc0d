"""A coordinator and a worker of two Confidant trees (issue 32). Seen: a coordinator whose setup
offered a worker its own kept weights (runtime.pipeline.held_weights, answered by bundle_wants)
against a worker of an older tree, which ignored the offer: the coordinator waited out its 300 s
timeout for an answer the worker could not give. Every frame carries its protocol version
(runtime.transport.wire), raised with that change; every setup is answered before a byte of its
bundle goes, so a worker of another version is found at the setup's first answer: one line naming
the worker and both versions and the fix, the command line's exit 2, the worker's too.

The older worker is a real worker process of this tree with its version constant set one lower
before it starts (what a worker of the previous protocol puts on every frame)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.keys import KeyPair, write_keypair
from runtime.transport.wire import PROTOCOL_VERSION, SAME_CONFIDANT
from support import make_tiny_tokenizer, run_cli, tiny_config

ROOT = Path(__file__).resolve().parents[2]
OLDER = PROTOCOL_VERSION - 1
WORKER_OF_VERSION = r"""
import sys
import runtime.transport.wire as wire
wire.PROTOCOL_VERSION = int(sys.argv[1])
from confidant.cli import main
sys.exit(main(sys.argv[2:]))
"""
CONLL = "\n\n".join("\n".join(f"{w}\t{t}" for w, t in zip(s.split(), tags.split()))
                    for s, tags in [("rome x .", "B-LOC O O"), ("x unbelievable rome .", "O O B-LOC O")] * 4) + "\n"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A tiny 9-label BERT token classifier, its tokenizer and CoNLL lines."""
    import torch
    import transformers as T

    from jobs.export.encoder import ExportOptions, export_model

    root = tmp_path_factory.mktemp("protocol")
    make_tiny_tokenizer().save(str(root / "tokenizer.json"))
    (root / "train.txt").write_text(CONLL)
    torch.manual_seed(0)
    model = export_model(T.AutoModelForTokenClassification.from_config(tiny_config("bert", 2, 9)).eval(),
                         root / "m.onnx", ExportOptions(num_labels=9))
    return root, model


def _worker(version: int, keys: Path, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", WORKER_OF_VERSION, str(version), "worker", "--listen",
                                 "tcp://127.0.0.1:0", "--keys", str(keys), "--name", name], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=err)
    return proc, proc.stdout.readline().split()[-1]


def test_a_worker_of_an_older_protocol_is_one_line_at_setup_and_exit_2(task, tmp_path):
    root, model = task
    keys = tmp_path / "keys"
    for name in ("coordinator", "w1", "w2"):
        write_keypair(keys, KeyPair.generate(name))
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    current, current_at = _worker(PROTOCOL_VERSION, keys, "w1", logs[0])
    older, older_at = _worker(OLDER, keys, "w2", logs[1])
    try:
        started = time.monotonic()
        proc = run_cli("train-pipeline", model, "--data", root / "train.txt", "--tokenizer", root / "tokenizer.json",
                       "--workers", f"w1={current_at},w2={older_at}", "--keys", keys, "--batch", 4, "--seq", 8,
                       "--microbatches", 2, "--steps", 2, "--timeout", 300, "--listen", "tcp://127.0.0.1:0")
        took = time.monotonic() - started
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"confidant train-pipeline: error: the worker at {older_at} (stage1) speaks protocol version {OLDER}, "
            f"this coordinator version {PROTOCOL_VERSION}: {SAME_CONFIDANT}")
        assert took < 60, f"{took:.0f} s: the mismatch was found by a timeout, not at the setup's answer"
        assert "Traceback" not in proc.stderr
        # the worker of the other version says so in its own log, and exits 2 as well
        assert older.wait(30) == 2, logs[1].read_text()
        assert (f"protocol version {PROTOCOL_VERSION}, this side speaks {OLDER}: {SAME_CONFIDANT}"
                in logs[1].read_text()), logs[1].read_text()
        assert current.wait(30) == 0, logs[0].read_text()  # stopped with the run, as any worker is
    finally:
        for worker in (current, older):
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            worker.stdout.close()


def test_a_worker_answers_an_order_it_does_not_know_with_an_error_at_once(tmp_path):
    """The other half of "no request waits for an answer a worker cannot give": a real worker set up
    from a real bundle, sent an order of a kind it does not know, reports an error naming it at once
    (and every setup is answered, `bundle_wants`, before its bundle is sent)."""
    from ir.partition import Partition, StageAssignment
    from jobs.common.workers import LocalWorkers
    from planner.emit import emit_plan
    from planner.onnx_import import load_model
    from planner.schedule import make_schedule
    from runtime.keys import signer
    from runtime.pipeline.bundles import bundle_to_wire, send_bundle
    from runtime.pipeline.executor import COORDINATOR
    from runtime.transport.zeromq import ZmqTransport

    import transformers as T
    import torch

    from jobs.export.encoder import ExportOptions, export_model

    torch.manual_seed(0)
    model = export_model(T.AutoModelForTokenClassification.from_config(tiny_config("bert", 2, 9)).eval(),
                         tmp_path / "m.onnx", ExportOptions(num_labels=9))
    graph = load_model(model, 2, 8)
    boss = KeyPair.generate("coordinator")
    emit_plan(tmp_path / "plan", graph, Partition((StageAssignment(0, "a", 0, len(graph.blocks) - 1),), "manual"),
              make_schedule("1f1b-flush", 1, 2), {"model": "tiny"}, sign=signer(boss))
    files = bundle_to_wire(tmp_path / "plan" / "a")
    worker = LocalWorkers.start(1, threads=1, coordinator=boss)
    coord = ZmqTransport(COORDINATOR, "tcp://127.0.0.1:0", keys=boss.curve_keys())
    try:
        coord.connect("stage0", worker.addresses[0], key=worker.keys.workers[worker.addresses[0]].curve)
        coord.send_control("stage0", {"type": "setup_bundle", "stage": 0, "device": "a",
                                      "peers": {COORDINATOR: coord.address}, "bundle_files": list(files)})
        assert coord.recv_control("stage0", timeout=60)[1] == {"type": "bundle_wants", "stage": 0}
        send_bundle(coord, "stage0", files)
        assert coord.recv_control("stage0", timeout=60)[1]["type"] == "ready"
        started = time.monotonic()
        coord.send_control("stage0", {"type": "frobnicate", "step": 3})
        answer = coord.recv_control("stage0", timeout=30)[1]
        assert time.monotonic() - started < 10
        assert answer["type"] == "error"
        assert answer["message"] == ("stage 0 (a): ValueError: unknown control message type 'frobnicate' from the "
                                     "coordinator")
    finally:
        coord.close()
    assert worker.wait(30.0) == [1]


WORKER_BEFORE_VERSION_3 = r"""
import sys
import runtime.transport.wire as wire
import runtime.pipeline.worker as worker
wire.PROTOCOL_VERSION = int(sys.argv[1])
worker.Worker.reach_coordinator = lambda self, mismatch: None  # as before protocol 3: no way back to say why
from confidant.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_worker_of_a_tree_that_cannot_say_why_is_lost_before_its_first_answer_with_the_likely_cause(task, tmp_path):
    """A worker of a tree before this change exits at the coordinator's first frame without a word
    to it (it has no link back before its setup): the coordinator finds it lost within the
    heartbeat, and says what that most likely means (seen: `worker stage 0 ... lost after 0.4 s`,
    nothing more, from a worker of /work/main's tree): a version mismatch, so a bad input, exit 2
    (it was exit 1, a failed run, though the line named the likely cause)."""
    from runtime.pipeline.coordinator import LOST_BEFORE_FIRST_ANSWER

    root, model = task
    keys = tmp_path / "keys"
    for name in ("coordinator", "w1"):
        write_keypair(keys, KeyPair.generate(name))
    log = tmp_path / "w1.log"
    with log.open("w") as err:
        older = subprocess.Popen([sys.executable, "-c", WORKER_BEFORE_VERSION_3, str(OLDER), "worker", "--listen",
                                  "tcp://127.0.0.1:0", "--keys", str(keys), "--name", "w1"], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=err)
    address = older.stdout.readline().split()[-1]
    try:
        proc = run_cli("train-pipeline", model, "--data", root / "train.txt", "--tokenizer", root / "tokenizer.json",
                       "--workers", f"w1={address}", "--keys", keys, "--batch", 4, "--seq", 8, "--microbatches", 2,
                       "--steps", 2, "--timeout", 300, "--listen", "tcp://127.0.0.1:0")
        assert proc.returncode == 2, proc.stderr[-3000:]  # bad input: most likely a version mismatch
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"confidant train-pipeline: error: worker stage 0 ({address}) lost after "), last
        assert last.endswith(f" ({LOST_BEFORE_FIRST_ANSWER})"), last
        assert older.wait(30) == 2 and "this side speaks" in log.read_text()
    finally:
        if older.poll() is None:
            older.kill()
        older.wait()
        older.stdout.close()
