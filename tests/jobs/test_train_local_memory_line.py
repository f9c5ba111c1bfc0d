"""`train-local` prints the memory it used beside what it planned (`jobs.common.memory_check.local_check`):
for a causal LM under LoRA on an int4 base recomputing per block, the planned figure is the run's set-up
as measured (the process, the model and engine built, what the evaluation before left) and what the
memory model says a step adds as this run trains: its activations choice, its base widened a block at a
time, its LM head + loss a chunk of logits at a time for the loss targets its data has
(`step_bytes`). It charged the whole model's per-op caches and every position's logits whole (the graph-
derived profile recomputing with caches, whatever --activations said, and a worker's runtime for this
process's): SmolLM2 int4 per-block "this-device: 553 / 2022" (0.27 of it), this test's model "161 / 112"
(1.43: the process's set-up uncharged). Issue 31 target 3: never under the measured peak, within 10% of it
(the training after an evaluation ran 1.03-1.04 over its figure on SmolLM2 while glibc's mmap and trim
thresholds rose with the evaluation's freed blocks: `runtime.heap.start_heap`, helper h90)."""
from __future__ import annotations

import json

import pytest

from support import run_child, run_cli_peaks

MIB = 2 ** 20


def test_train_local_plans_an_int4_per_block_causal_lm_within_ten_percent_of_its_peak(chat_llama, tmp_path):
    """The tiny chat Llama (SmolLM2's 49152-token vocabulary: the LM head + loss is most of a step), LoRA
    r=8 on an int4 base, 1 x 128 per step, per-block, two AdamW steps after an evaluation of one
    conversation, `confidant train-local` in a new interpreter: the printed peak is the process's whole
    life's (VmHWM read in the child, set-up and both evaluations included), at most the printed planned
    figure, at least 0.90 of it. The job reset VmHWM after the evaluation before training and printed its
    steps' peak: 158 MiB where the process peaked at 172 (the evaluation after training's generation), its
    planned 163 (helper h96). The same run is the CLI's causal-LM inference from the model's side file (it
    was tests/tasks/test_task_choice.py's own run of train-local, folded in here: helper h91)."""
    model, train, dev = chat_llama
    out = tmp_path / "run.json"
    run, life = run_cli_peaks("train-local", model, "--data", train, "--eval", dev, "--eval-limit", "1", "--steps",
                              "2", "--batch", "1", "--seq", "128", "--lr", "1e-4", "--optimizer", "adamw", "--threads",
                              "1", "--lora", "8", "--base-dtype", "int4", "--activations", "per-block",
                              "--metrics-out", out)
    assert "task: causal-lm (m.lm.json beside the model" in run.stdout
    doc = _checked_line(run, out, life)
    assert doc["eval"]["perplexity"] is not None  # scored as a causal LM


def test_train_local_plans_a_lora_int4_per_block_encoder_within_ten_percent_of_its_peak(minilm_onnx, tmp_path):
    """MiniLM NER under LoRA r=8 on an int4 base, recomputing per block on MNN (8 x 32, two steps after an
    evaluation on the training engine, the tiny BERT test's sentences), `confidant train-local` in a new
    interpreter: its whole life at most its planned figure and at least 0.90 of it. The step charged each
    layer's re-run as every value it makes (19.2 MiB) beside a gradient of each, where MNN keeps of a frozen
    base's layer only what its backward reads: 0.856 of its figure (149.9 / 175.1; the brief's 8-step run
    0.862-0.864), now 0.928 (`planner.memory_defaults.mnn_rerun_held_bytes`, helper h143)."""
    data = tmp_path / "d.txt"
    data.write_text("Kim B-PER\nleft O\nParis B-LOC\nfor O\nACME B-ORG\n\nLee B-PER\nsaw O\nRome B-LOC\n\n" * 4)
    out = tmp_path / "run.json"
    run, life = run_cli_peaks("train-local", minilm_onnx, "--data", data, "--eval", data, "--steps", "2", "--batch",
                              "8", "--seq", "32", "--threads", "1", "--lora", "8", "--base-dtype", "int4",
                              "--activations", "per-block", "--metrics-out", out)
    assert "the set-up as measured + a step by the memory model" in run.stdout + run.stderr
    _checked_line(run, out, life)


def _checked_line(run, out, life: int, least: float = 0.90) -> dict:
    """The run's metrics document, its printed "this-device" line the document's figures, the measured peak
    the process's whole life's (`life`: VmHWM read in the child) at most the planned figure and at least
    `least` of it."""
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    measured, planned = doc["devices"][0]["peak_rss_bytes"], doc["devices"][0]["planned_bytes"]
    said = run.stdout + run.stderr
    line = next((m for m in said.splitlines() if m.strip().startswith("this-device:")), None)
    assert line is not None and planned, said
    assert line.split(":")[1].split("/")[:2] == [f" {measured / MIB:.0f} ", f" {planned / MIB:.0f} "], line
    ratio = life / planned
    print(f"whole life {life / MIB:.1f} MiB, printed {measured / MIB:.1f}, planned {planned / MIB:.1f}, "
          f"ratio {ratio:.3f}")
    assert abs(measured - life) <= MIB, (line, f"the process peaked at {life / MIB:.1f} MiB")
    assert least <= ratio <= 1.00, (line, round(ratio, 3))
    return doc


def test_train_local_plans_mnns_default_mode_within_ten_percent_of_its_peak(chat_llama, tmp_path):
    """The same run on MNN's default (its per-op caches kept for each backward), 4 x 128 per step, two steps
    after the evaluation: the set-up holds the caches the evaluation's forward left; the step charges the
    backward's reads MNN still holds when the next step's loss makes its chunks (`mnn_held_bytes`'s
    `keeping`: the second step's peak is the run's). The printed peak at most the printed planned figure,
    at least 0.90 of it. (SmolLM2 likewise: 1733 / 1799 with the evaluation, helper h114; it was charged the
    memory model's whole figure, the larger there, 1733 / 1887.)"""
    model, train, dev = chat_llama
    out = tmp_path / "run.json"
    run, life = run_cli_peaks("train-local", model, "--data", train, "--eval", dev, "--eval-limit", "1", "--steps",
                              "2", "--batch", "4", "--seq", "128", "--lr", "1e-4", "--optimizer", "adamw", "--threads",
                              "1", "--lora", "8", "--base-dtype", "int4", "--metrics-out", out)
    assert "the set-up as measured + a step by the memory model" in run.stdout + run.stderr
    _checked_line(run, out, life)


def test_train_local_plans_a_torch_per_block_causal_lm_within_ten_percent_of_its_peak(chat_llama, tmp_path):
    """The same run on PyTorch per block (`--engine torch --activations per-block`), 4 x 128 per step, two steps
    after the evaluation: the printed peak the process's whole life's, at most the printed planned figure, at
    least 0.90 of it. The evaluation's rise counted torch's import (~180 MiB), which the set-up holds again, and
    the set-up did not hold torch's start-up (the first backward's kernels and buffers, ~65 MiB above the step's
    charge): "437 / 565" (0.77); the import is measured and taken out of the evaluation's rise, and one layer's
    forward and backward runs before the set-up is read (`jobs.train.start_up.torch_start_up`, helper h106)."""
    model, train, dev = chat_llama
    out = tmp_path / "run.json"
    run, life = run_cli_peaks("train-local", model, "--data", train, "--eval", dev, "--eval-limit", "1", "--steps",
                              "2", "--batch", "4", "--seq", "128", "--lr", "1e-4", "--optimizer", "adamw", "--threads",
                              "1", "--lora", "8", "--base-dtype", "int4", "--engine", "torch", "--activations",
                              "per-block", "--metrics-out", out)
    _checked_line(run, out, life)


# `jobs.train.causal_lm.train_causal_lm` without an evaluation (a caller's, not the CLI's: --eval is required there)
# in a new interpreter: argv model, training data, engine; prints JOB_RUN {"life": VmHWM at the end (the job never
# resets it), "planned": the job's planned figure}.
NO_EVALUATION_CHILD = r"""
import json, sys
from pathlib import Path
from jobs.common.settings import TrainingSettings
from jobs.train.causal_lm import train_causal_lm
from planner.lora import LoraSettings
from runtime.procfs import peak_rss_bytes

settings = TrainingSettings(steps=2, batch=4, seq=128, lr=1e-4, optimizer="adamw", seed=0, threads=1,
                            engine=sys.argv[4], lora=LoraSettings(8, base_dtype="int4"), activations="per-block")
metrics = train_causal_lm(Path(sys.argv[2]), Path(sys.argv[3]), None, settings)
print("JOB_RUN " + json.dumps({"life": peak_rss_bytes(), "planned": metrics.devices[0].planned_bytes}))
"""


def test_a_torch_per_block_run_without_an_evaluation_is_planned_within_ten_percent_of_its_peak(chat_llama):
    """The job called without an evaluation on PyTorch per block (the tiny chat Llama, 4 x 128, two steps): its
    whole life's peak at most its planned figure, at least 0.90 of it. The set-up did not hold torch's start-up
    (the first backward's kernels and buffers), which the step does not charge: 425 / 348 (1.22, helper h102)."""
    model, train, _ = chat_llama
    got = run_child(NO_EVALUATION_CHILD, "JOB_RUN", model, train, "torch")
    ratio = got["life"] / got["planned"]
    print(f"whole life {got['life'] / MIB:.1f} MiB, planned {got['planned'] / MIB:.1f}, ratio {ratio:.3f}")
    assert 0.90 <= ratio <= 1.00, round(ratio, 3)


def test_the_planner_charges_the_fused_loss_chunk_the_engines_compute_in():
    """The planner may not import the engines: its chunk of logits is theirs, held equal here."""
    from planner.memory_defaults import LOSS_CHUNK_BYTES
    from runtime.engines.lm_loss import CHUNK_BYTES

    assert LOSS_CHUNK_BYTES == CHUNK_BYTES


def test_mnn_keeping_its_caches_is_charged_its_set_up_and_step_and_torch_the_whole_figure_where_larger(chat_llama):
    """MNN per block or keeping its per-op caches is charged its set-up as measured + the step; a PyTorch run
    (its first backward's growth, not modelled) or an MNN hybrid, the memory model's whole figure where it
    is larger. The whole figure charges every value the caches hold, the views too, which MNN holds no buffer
    of (`mnn_kept_bytes`): where it was the larger, SmolLM2 int4 keeping with the brief's evaluation read
    1733 / 1887 (0.918) against set-up + step's 1799 (0.964), float32 2115 / 2256 (0.937) against 2154
    (0.982) (helper h114; without an evaluation int4 1722 against 1783, helper h97)."""
    from jobs.common.memory_check import default_planned_bytes, local_check, step_bytes
    from jobs.common.metrics import DeviceFigures, TrainingMetrics
    from jobs.common.report import Silent
    from planner.memory_defaults import default_block_cost, mnn_kept_bytes
    from planner.onnx_import import load_model

    graph = load_model(chat_llama[0], 1, 128)
    metrics = TrainingMetrics("train-local", "m", 1, 128, (), (DeviceFigures("this-device", 0, 0, len(graph.blocks) - 1,
                                                                              MIB),))

    def planned(engine, activations):
        got = local_check(metrics, graph, "adamw", engine, None, Silent(), activations, "float32", set_up_bytes=MIB)
        return got.devices[0].planned_bytes

    def whole(engine, activations):
        return default_planned_bytes(graph, [(0, len(graph.blocks) - 1)], "1f1b-flush", 1, "adamw", 1, engine,
                                     activations)[0]

    for activations in (None, "keep", "recompute", "per-block"):
        step = step_bytes(graph, "adamw", "mnn", activations, "float32")
        assert planned("mnn", activations) == MIB + step, activations
    assert whole("mnn", None) > MIB + step_bytes(graph, "adamw", "mnn", None, "float32")  # the case it is about
    assert planned("mnn", "per-block+2") >= whole("mnn", "per-block+2")
    assert planned("torch", None) >= whole("torch", None)
    assert planned("torch", "per-block") >= whole("torch", "per-block")
    layer = graph.blocks[1]
    assert 0 < mnn_kept_bytes(graph, layer) < default_block_cost(graph, layer).kept_bytes


def test_the_engine_built_after_training_lets_go_of_each_frozen_weight_it_replaces(chat_llama):
    """A float32 LoRA base (the tiny chat Llama, r=4 on q/k/v/o): the training engine leaves the graph's frozen
    weights as views of its constant Vars (`runtime.engines.mnn._hold_once`); the dev perplexity's engine built
    over the trained weights after it (`whole_model_engine(..., weights=trained)`, as `jobs.train.causal_lm`'s
    `_evaluation_nll`) replaces each by a view of its own Var, and the one replaced (the old Var's memory) must
    be let go then, not at the build's end: a copy of the graph's constants merged with the trained weights held
    them all, so the build held the frozen base twice (SmolLM2 float32 LoRA: +424 MiB, the whole life's peak 1095
    MiB against training's 878; the same build before training +47; helper h103). Its forward is the training
    engine's over the same weights."""
    import dataclasses
    import gc
    import weakref

    import numpy as np

    from jobs.common.lora import adapted
    from planner.lora import LoraSettings
    from planner.onnx_import import load_model
    from runtime.engines.factory import whole_model_engine

    class Watched(dict):
        """The graph's constants, noting at each replacement how many arrays replaced before are still alive."""

        def __init__(self, *a):
            super().__init__(*a)
            self.replaced, self.alive = [], []

        def __setitem__(self, key, value):
            if key in self:
                self.alive.append(sum(r() is not None for r in self.replaced))
                self.replaced.append(weakref.ref(self[key]))
            super().__setitem__(key, value)

    graph = adapted(load_model(chat_llama[0], 1, 128),
                    LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="float32"))
    ids = (np.arange(1, 130, dtype=np.int64) * 37 % 1000)[None]
    feeds = {"input_ids": ids[:, :-1], "attention_mask": np.ones((1, 128), np.int64), "target_ids": ids[:, 1:],
             "target_weights": np.ones((1, 128), np.float32)}
    feeds = {v.name: feeds[v.name].astype(v.dtype) for v in graph.inputs}
    training = whole_model_engine(graph, "mnn", 1, activations="per-block")
    want = float(np.asarray(training.forward(feeds, train=False)))
    trained = training.parameters()
    del training
    gc.collect()
    graph = dataclasses.replace(graph, constants=Watched(graph.constants))
    built = whole_model_engine(graph, "mnn", 1, weights=trained, cache_activations=False, activations="per-block")
    watched = graph.constants
    assert len(watched.alive) >= 8, len(watched.alive)  # the blocks' frozen float32 weights, one by one
    assert max(watched.alive) == 0, f"{max(watched.alive)} of {len(watched.alive)} replaced weights still held"
    assert float(np.asarray(built.forward(feeds, train=False))) == want


@pytest.mark.parametrize("activations", ["per-block", None])
def test_train_local_plans_a_token_classifier_from_its_measured_set_up(tiny_onnx, tmp_path, activations):
    """Token classification (the tiny BERT, full fine-tuning on MNN per block and in its default mode, keeping
    its per-op caches, 8 x 64, two steps after an evaluation on the training engine), `confidant train-local`
    in a new interpreter: the printed peak is the process's whole life's, at most the printed planned figure
    and at least 0.85 of it. The planned figure was the memory model's whole figure, a worker's start-up for
    this process's set-up (here "97 / 70"; the demo's MiniLM run "571 / 491", 1.16 over it); it is the set-up
    as measured and a step (helper h117). The default mode read 1.007-1.014 over it: MNN's buffer pool of op
    temporaries (1.0 MiB here) and a small layer's caches above `mnn_kept_bytes` uncharged, numpy's update
    kernels mapped after the set-up (0.6); the step charges the forward the evaluation before measured, and
    those pages are mapped before the set-up (helpers h128, h137)."""
    from support import make_tiny_tokenizer

    data = tmp_path / "d.txt"
    data.write_text("Kim B-PER\nleft O\nParis B-LOC\nfor O\nACME B-ORG\n\nLee B-PER\nsaw O\nRome B-LOC\n\n" * 4)
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "run.json"
    run, life = run_cli_peaks("train-local", tiny_onnx["torchscript-17"], "--data", data, "--eval", data, "--steps",
                              "2", "--batch", "8", "--seq", "64", "--lr", "1e-3", "--threads", "1", "--tokenizer",
                              tmp_path / "tokenizer.json", *(["--activations", activations] if activations else []),
                              "--metrics-out", out)
    assert "the set-up as measured + a step by the memory model" in run.stdout + run.stderr
    _checked_line(run, out, life, least=0.85)
