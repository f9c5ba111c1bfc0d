"""`confidant report`: a real plan and a real run of it (`train PLAN --local`, worker processes) drawn
on one page, read back in headless Chromium (Debian's `chromium`): its parts per device, the loss
polyline. The run's devices get budgets below what a worker really holds, so the run must say so:
a warning and a `memory_over` event (every run says what it used)."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from jobs.common.memory_check import check_memory, memory_overrun
from jobs.common.metrics import DeviceFigures, StepFigures, TrainingMetrics
from planner.memory_defaults import default_profile
from planner.onnx_import import load_model
from support import make_tiny_tokenizer, run_cli
from tasks.ner.datagen import write_splits

MIB = 2 ** 20
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Notes:
    def __init__(self):
        self.lines = []

    def note(self, text):
        self.lines.append(text)


def test_memory_check_warns_and_records_each_overrun():
    metrics = TrainingMetrics("train", "m.onnx", 8, 16, (StepFigures(1, 2.0, 0.5, 16.0),), (
        DeviceFigures("phone", 0, 0, 2, 600 * MIB), DeviceFigures("laptop", 1, 3, 5, 300 * MIB),
        DeviceFigures("board", 2, 6, 8, 450 * MIB), DeviceFigures("lost", 3, 9, 9, None)))
    notes = _Notes()
    out = check_memory(metrics, {"phone": 478 * MIB, "laptop": 290 * MIB, "board": 400 * MIB},
                       {"phone": 512 * MIB, "laptop": 512 * MIB}, notes)
    assert [(d.planned_bytes, d.budget_bytes) for d in out.devices] == [
        (478 * MIB, 512 * MIB), (290 * MIB, 512 * MIB), (400 * MIB, None), (None, None)]
    # phone over its budget; laptop within 10 % of its plan; board 12.5 % over its plan, no budget
    assert [(e["device"], e["over"]) for e in out.events] == [("phone", "budget"), ("board", "plan")]
    assert out.events[0]["peak_rss_bytes"] == 600 * MIB and out.events[0]["step"] == 1
    assert "  phone: 600 / 478 / 512" in notes.lines and "  board: 450 / 400 / -" in notes.lines
    assert any(line.startswith("warning: phone used 600 MiB, over its 512 MiB budget (planned 478 MiB)")
               for line in notes.lines)
    doc = out.to_json()
    assert doc["devices"][0]["planned_bytes"] == 478 * MIB and doc["events"][1]["event"] == "memory_over"
    assert memory_overrun(DeviceFigures("x", 0, 0, 0, 100, 100, 100)) is None
    # a run planned in memory shows the graph-derived figure but holds only its budget against it
    guessed = check_memory(metrics, {"board": 400 * MIB, "phone": 478 * MIB}, {"phone": 512 * MIB}, _Notes(),
                           "the memory model", over_plan=False)
    assert [(e["device"], e["over"]) for e in guessed.events] == [("phone", "budget")]


class _Parts(HTMLParser):
    """Elements with an id, class or data attributes, as the browser's DOM has them."""

    def __init__(self):
        super().__init__()
        self.elements = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))


def _dom(page):
    """The page as headless Chromium parsed it (its DOM after loading, not the file's text)."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parser = _Parts()
    parser.feed(proc.stdout)
    return proc.stdout, parser.elements


@pytest.fixture(scope="module")
def planned_run(tiny_onnx, tmp_path_factory):
    """A plan of the tiny BERT over two devices with budgets a real worker exceeds, and a 3-step run."""
    tmp = tmp_path_factory.mktemp("report")
    model = tiny_onnx["torchscript-17"]
    graph = load_model(model, 2, 16)
    # a profile that under-counts the idle runtime (4 MiB; a worker holds ~55 MiB here): the plan
    # fits its 32 MiB budgets on paper (16 of them kept for the snapshot copies on the workers), the
    # run cannot (the 478 planned, 1141 used)
    profile = dataclasses.replace(default_profile(graph, "p"), runtime_overhead_bytes=4 * MIB)
    (tmp / "p.json").write_text(json.dumps(profile.to_json()))
    budget = "32MiB"
    (tmp / "cluster.json").write_text(json.dumps({"devices": [
        {"name": "phone", "address": "tcp://127.0.0.1:5701", "profile": "p.json", "memory_budget": budget},
        {"name": "laptop", "address": "tcp://127.0.0.1:5702", "profile": "p.json", "memory_budget": budget}],
        "links": {"default": {"bandwidth": "1Gbit/s", "latency": "1ms"}}}))
    proc = run_cli("plan", model, "--cluster", tmp / "cluster.json", "--batch", 4, "--microbatches", 2, "--seq", 16,
                   "--cuts", 2, "--devices", "phone,laptop", "--insecure", "-o", tmp / "plan")
    assert proc.returncode == 0, proc.stderr[-2000:]
    train, dev = write_splits(tmp / "data", n_train=24, n_dev=8, seed=3)
    make_tiny_tokenizer().save(str(tmp / "tokenizer.json"))  # the tiny BERT's 500-row vocabulary holds it
    proc = run_cli("train", tmp / "plan", "--data", train, "--eval", dev, "--local", "--steps", 3, "--insecure",
                   "--tokenizer", tmp / "tokenizer.json", "--metrics-out", tmp / "run.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc


def test_a_run_over_its_budget_says_so(planned_run):
    tmp, proc = planned_run
    doc = json.loads((tmp / "run.json").read_text())
    plan = json.loads((tmp / "plan" / "plan.json").read_text())
    # the run is held against the plan's figure and what it left free for the snapshot copies
    assert all(d["reserved_bytes"] == 16 * MIB for d in plan["devices"])
    planned = {d["name"]: (d["memory_bytes"] + d["reserved_bytes"], d["memory_budget_bytes"]) for d in plan["devices"]}
    assert {d["name"]: (d["planned_bytes"], d["budget_bytes"]) for d in doc["devices"]} == planned
    over = [e for e in doc["events"] if e["event"] == "memory_over"]
    peaks = {d["name"]: d["peak_rss_bytes"] for d in doc["devices"]}
    assert {e["device"] for e in over} == {n for n, p in peaks.items() if p > 32 * MIB} == {"phone", "laptop"}
    assert "memory per device, MiB (measured peak / planned by the plan + reserve / budget):" in proc.stderr
    for name, peak in peaks.items():
        assert f"warning: {name} used {peak / MIB:.0f} MiB, over its 32 MiB budget" in proc.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium; "
                                             ".ci/run installs it)")
def test_report_page_in_chromium(planned_run):
    tmp, _ = planned_run
    page = tmp / "report.html"
    proc = run_cli("report", tmp / "plan", "--metrics", tmp / "run.json", "-o", page)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", text), "the page must fetch nothing"
    dom, elements = _dom(page)
    run = json.loads((tmp / "run.json").read_text())
    by_id = {a["id"]: (t, a) for t, a in elements if "id" in a}
    for part in ("memory", "timeline", "loss", "metric", "loss-curve", "measured-steps"):
        assert part in by_id, part
    memory = {a["data-device"]: a for t, a in elements if a.get("class") == "device-memory"}
    assert set(memory) == {"phone", "laptop"}
    for d in run["devices"]:
        assert int(memory[d["name"]]["data-measured-bytes"]) == d["peak_rss_bytes"]
        assert int(memory[d["name"]]["data-planned-bytes"]) + int(memory[d["name"]]["data-reserved-bytes"]) \
            == d["planned_bytes"]
        assert int(memory[d["name"]]["data-budget-bytes"]) == d["budget_bytes"]
    parts = [a["data-part"] for t, a in elements if t == "rect" and "data-part" in a]
    assert {"weights", "optimizer", "runtime", "reserve"} <= set(parts)
    rows = [a["data-device"] for t, a in elements if a.get("class") == "timeline-row"]
    assert rows == ["phone", "laptop"]
    kinds = [a["data-kind"] for t, a in elements if t == "rect" and "data-kind" in a]
    assert kinds.count("F") == kinds.count("B") == 2 * 2 * 2  # 2 simulated steps x 2 micro-batches x 2 stages
    curve = by_id["loss-curve"][1]
    assert int(curve["data-points"]) == len(run["steps"]) == 3
    assert len(curve["points"].split()) == 3
    assert by_id["metric"][1]["data-metric"] == "entity_f1"
    assert "phone (stage 0)" in dom and "over its budget" in dom
    shot = tmp / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1000,900", page.as_uri()], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 5000


def test_train_local_and_train_pipeline_say_what_they_used(tiny_onnx, tmp_path):
    """Runs planned in memory: each pipeline device's planned figure is the memory model's for the run's
    cuts; a one-device run's is its set-up as measured + a step (it was `confidant estimate`'s figure, a
    worker's start-up for this process's: helper h117), its budget the room it had."""

    model = tiny_onnx["torchscript-17"]
    train, dev = write_splits(tmp_path / "data", n_train=16, n_dev=4, seed=5)
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    common = ("--data", train, "--steps", 2, "--batch", 4, "--seq", 16, "--tokenizer", tmp_path / "tokenizer.json")
    proc = run_cli("train-local", model, *common, "--eval", dev, "--metrics-out", tmp_path / "local.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "local.json").read_text())
    [device] = doc["devices"]
    # the set-up + a step, or + the evaluation's rise where that is larger (which one moves with the heap)
    assert "planned by the set-up" in proc.stderr and "planned by the memory model" not in proc.stderr
    assert device["budget_bytes"] > device["peak_rss_bytes"] > 0 and device["planned_bytes"] > 0
    assert (f"  this-device: {device['peak_rss_bytes'] / MIB:.0f} / {device['planned_bytes'] / MIB:.0f} / "
            f"{device['budget_bytes'] / MIB:.0f}") in proc.stderr
    proc = run_cli("train-pipeline", model, *common, "--local", 2, "--microbatches", 2, "--cuts", 2,
                   "--metrics-out", tmp_path / "pipe.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "pipe.json").read_text())
    assert [d["name"] for d in doc["devices"]] == ["stage0", "stage1"]
    assert all(d["planned_bytes"] > 0 and d["budget_bytes"] is None for d in doc["devices"])
    assert "memory per device, MiB (measured peak / planned by the memory model + snapshot copies / budget):" \
        in proc.stderr


def test_report_of_a_plan_alone_and_a_bad_metrics_file(planned_run):
    tmp, _ = planned_run
    proc = run_cli("report", tmp / "plan", "-o", tmp / "plan-only.html")
    assert proc.returncode == 0, proc.stderr
    page = (tmp / "plan-only.html").read_text()
    assert "id='loss-curve'" not in page and "give --metrics RUN.json" in page
    assert page.count("class='timeline-row'") == 2 and "data-measured-bytes=''" in page
    (tmp / "not-metrics.json").write_text("{}")
    proc = run_cli("report", tmp / "plan", "--metrics", tmp / "not-metrics.json", "-o", tmp / "x.html")
    assert proc.returncode == 2 and "not a confidant-metrics document" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp / "x.html").exists()
