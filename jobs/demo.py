"""`confidant demo`: the main job end to end on the bundled MiniLM and generated NER data: export,
data, fine-tuning on this one device, then profile -> plan over a three-device cluster -> training
from the plan's bundles on three local worker processes, for the same steps."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jobs.common.errors import JobError
from jobs.train.local import train_local
from jobs.common.metrics import TrainingMetrics
from jobs.common.report import Reporter, Silent
from jobs.common.settings import TrainingSettings
from tasks.ner.datagen import write_splits

DEMO_MICROBATCHES = 4


@dataclass(frozen=True)
class DemoResult:
    single: TrainingMetrics
    pipeline: TrainingMetrics
    plan_dir: Path


def move_export(partial: Path, model: Path) -> Path:
    """An export written under a temporary name moved to `model`, with the side file named after it
    (NAME.hf.json: left behind as NAME.partial.hf.json, `export-trained --hf` found none and asked
    for a re-export)."""
    from jobs.export.encoder import hf_sidecar_path

    sidecar = hf_sidecar_path(partial)
    if sidecar.is_file():
        sidecar.replace(hf_sidecar_path(model))
    Path(partial).replace(model)  # last: a model without its sidecar is never left under the final name
    return model


def run_demo(home: Path, settings: TrainingSettings, reporter: Reporter = Silent()) -> DemoResult:
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    model = home / "minilm-token-cls.onnx"
    if not model.is_file():
        reporter.note(f"[1/6] exporting all-MiniLM-L6-v2 to {model}")
        # a separate process, so torch's memory does not count in the training run's peak RSS
        partial = model.with_suffix(".partial.onnx")
        proc = subprocess.run([sys.executable, "-m", "confidant", "export", "-o", str(partial)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise JobError("exporting MiniLM failed (the demo needs the `export` extra: torch, transformers):\n"
                           + proc.stderr.strip()[-2000:])
        move_export(partial, model)
    else:
        reporter.note(f"[1/6] using {model}")
    data_dir = home / "data"
    reporter.note(f"[2/6] generating NER data in {data_dir}")
    train, dev = write_splits(data_dir, n_train=2000, n_dev=300, seed=0)
    reporter.note(f"[3/6] fine-tuning on this device ({settings.steps} steps)")
    single = train_local(model, train, dev, settings, reporter)
    # Imported only now: the planner's libraries (OR-Tools alone is ~50 MiB) must not count in the
    # one-device run's peak memory, which the table compares the pipeline's devices against.
    from ir.bundle import load_plan
    from jobs.train.from_plan import PlanRunSettings, train_from_plan

    plan_dir, keys = plan_demo(home, model, train, settings, reporter)
    reporter.note(f"[6/6] training from the plan on {len(load_plan(plan_dir).devices)} local worker processes "
                  f"({settings.steps} steps)")
    pipeline = train_from_plan(plan_dir, train, dev, PlanRunSettings(steps=settings.steps, seed=settings.seed,
                                                                     tokenizer=settings.tokenizer, local=True,
                                                                     keys=keys),
                               reporter)
    return DemoResult(single, pipeline, plan_dir)


def plan_demo(home: Path, model: Path, train: Path, settings: TrainingSettings,
              reporter: Reporter = Silent()) -> tuple[Path, Path]:
    """Steps 4 and 5 of the demo: profile this device and plan `model` over the demo's three devices
    (this machine's profile with laptop-, board- and phone-like budgets); the plan's folder and the
    coordinator's keys folder."""
    from jobs.common.workers import coordinator_pair
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from runtime.keys import signer

    rows_per_micro = settings.batch // DEMO_MICROBATCHES
    reporter.note(f"[4/6] profiling this device at micro-batch {rows_per_micro} x {settings.seq}")
    _, profile_path = profile_this_device(model, rows_per_micro, settings.seq, home / "device.profile.json",
                                          name="this-machine", backends=("mnn:cpu:t1",), reps=2, attention=False,
                                          reporter=reporter)
    cluster_path = home / "cluster.yaml"
    # three devices made of this machine's profile with laptop-, board- and phone-like memory
    # budgets, so that the planner must respect memory, not just balance time (the addresses are
    # placeholders: the demo starts its workers locally)
    cluster_path.write_text(
        "devices:\n"
        f"  - {{name: laptop, address: 'tcp://127.0.0.1:5556', profile: {profile_path.name}, memory_budget: 1GiB}}\n"
        f"  - {{name: board, address: 'tcp://127.0.0.1:5557', profile: {profile_path.name}, memory_budget: 320MiB}}\n"
        f"  - {{name: phone, address: 'tcp://127.0.0.1:5558', profile: {profile_path.name}, memory_budget: 256MiB}}\n"
        "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    plan_dir = home / "plan"
    reporter.note(f"[5/6] planning over {cluster_path} (1f1b-flush, {DEMO_MICROBATCHES} micro-batches)")
    keys = home / "keys"  # the coordinator's key signs the bundles and secures the links
    # with the training data: the word embeddings' AdamW state is charged for the rows it looks up
    plan_model(model, cluster_path, PlanSettings("1f1b-flush", settings.batch, settings.seq, DEMO_MICROBATCHES,
                                                 optimizer=settings.optimizer, lr=settings.lr, data=train,
                                                 tokenizer=settings.tokenizer), plan_dir, reporter,
               sign=signer(coordinator_pair(keys, note=reporter.note)))
    return plan_dir, keys


def demo_table(result: DemoResult) -> list[tuple[str, str, str]]:
    """The rows `confidant demo` prints: one device against the planned pipeline."""
    single, pipe = result.single, result.pipeline
    one = single.peak_rss_bytes or 0
    stages = [d.peak_rss_bytes or 0 for d in pipe.devices]
    single_sps = single.batch / single.measured_step_s
    pipe_sps = pipe.batch / pipe.measured_step_s
    f1 = (lambda m: f"{m.eval.after:.3f}" if m.eval is not None else "-")
    return [
        ("", "1 device", f"{len(stages)} devices (planned pipeline)"),
        ("peak memory per device", f"{one / 2**20:.0f} MiB",
         " / ".join(f"{b / 2**20:.0f}" for b in stages) + " MiB" + _promised(pipe)),
        ("largest device", f"{one / 2**20:.0f} MiB",
         f"{max(stages) / 2**20:.0f} MiB ({max(stages) / one:.0%} of 1 device)" if one else f"{max(stages) / 2**20:.0f} MiB"),
        ("samples/s", f"{single_sps:.1f}", f"{pipe_sps:.1f} (all workers share this machine's 2 cores)"),
        ("final loss", f"{single.steps[-1].loss:.3f}", f"{pipe.steps[-1].loss:.3f}"),
        ("entity F1", f1(single), f1(pipe)),
    ]


def _promised(pipe) -> str:
    """' (planned 184 / 150 / 120 of 256 / 320 / 1024 MiB)': each device's figure as `train PLAN`
    held the run against it (the plan's, with what it left free for the fault policy's snapshot
    copies on the workers: ir.documents.DevicePlan.promised_bytes) and its budget; '' without them."""
    devices = pipe.devices
    if not devices or any(d.planned_bytes is None or d.budget_bytes is None for d in devices):
        return ""
    return (" (planned incl. reserve " + " / ".join(f"{d.planned_bytes / 2**20:.0f}" for d in devices) + " of "
            + " / ".join(f"{d.budget_bytes / 2**20:.0f}" for d in devices) + " MiB)")


def f1_hint(f1_after: float | None, steps: int, default_steps: int) -> str | None:
    """Why the entity F1 came out near 0, when it did after fewer steps than the demo's default: the
    tagger first learns that most words are no entity (tag O), and finds entities only later."""
    if f1_after is None or f1_after >= 0.05 or steps >= default_steps:
        return None
    return (f"entity F1 {f1_after:.3f} after {steps} steps: a new tagger first learns that most words are no entity "
            f"and finds entities only later; the demo's default --steps {default_steps} reaches F1 ~0.8")

