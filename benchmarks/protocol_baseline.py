"""The losses of `train-pipeline` and `train PLAN` on a fixed model, split, seed and data, for every
schedule, written to a file: the record that a change of the training protocol (issue 34: "every run is
a plan") leaves them bit for bit as they were.

    python benchmarks/protocol_baseline.py WORK_DIR -o losses.json          # record
    python benchmarks/protocol_baseline.py WORK_DIR --check losses.json     # compare (exit 1 if any differ)

WORK_DIR keeps the tiny model (a 2-layer BERT with MiniLM's vocabulary, so that the bundled tokenizer
reads the CoNLL data) and the plan folders between runs. `train_pipeline` runs on in-process workers
(runtime.pipeline.inprocess) over synthetic batches; `train PLAN` is `jobs.train.from_plan.train_from_plan`
on local worker processes over generated CoNLL data. Losses are kept as `repr` of the floats.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

# Run as a script, Python puts benchmarks/ first on sys.path, where benchmarks/planner.py would hide the
# planner package: the repository root goes first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

SCHEDULES = ("1f1b-flush", "1f1b-stash", "gpipe", "zb-h1")
ROWS, SEQ, M, STEPS, CUT = 2, 16, 2, 3, 2  # micro-batch rows, tokens, micro-batches, steps, first block of stage 1


def tiny_model(work: Path) -> Path:
    """A randomly initialised 2-layer BERT token classifier (seed 0) exported to ONNX, made once."""
    onnx = work / "tiny.onnx"
    if onnx.exists():
        return onnx
    import torch
    from transformers import BertConfig, BertModel

    from jobs.export.encoder import ExportOptions, export_checkpoint

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    BertModel(config).save_pretrained(work / "tiny-bert")
    return export_checkpoint(work / "tiny-bert", onnx, ExportOptions(opset=17))


def synthetic_batches(n: int):
    from tasks.tokenize import Batch

    out = []
    for seed in range(n):
        r = np.random.default_rng(seed)
        rows = ROWS * M
        mask = np.ones((rows, SEQ), np.int64)
        mask[-1, SEQ // 2:] = 0
        labels = r.integers(0, 9, (rows, SEQ))
        labels[mask == 0] = -100
        out.append(Batch(r.integers(0, 500, (rows, SEQ)).astype(np.int64), mask, np.zeros_like(mask), labels,
                         n_labelled=int((labels != -100).sum())))
    return out


def pipeline_losses(onnx: Path, schedule: str, work: Path | None = None, segment: int | None = None) -> list[float]:
    """`segment`: 1f1b-stash drains every `segment` steps (checkpoints there, in work/ckpt)."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from planner.onnx_import import load_model
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    graph = load_model(onnx, ROWS, SEQ)
    config = PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)
    steps = STEPS if segment is None else 2 * segment + 1
    extra = {} if segment is None else {"faults": FaultPolicy(checkpoint_every=segment),
                                        "checkpoint_dir": work / "ckpt"}
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, synthetic_batches(steps), 9, workers.addresses, config, steps, cuts=[CUT],
                                transport=workers.coordinator, **extra)
    return list(result.losses)


def plan_losses(onnx: Path, work: Path, schedule: str) -> list[float]:
    from ir.partition import Partition, StageAssignment
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from planner.emit import emit_plan
    from planner.onnx_import import load_model
    from planner.schedule import make_schedule
    from tasks.ner.datagen import write_splits

    graph = load_model(onnx, ROWS, SEQ)
    n = len(graph.blocks)
    plan = work / f"plan-{schedule}"
    emit_plan(plan, graph, Partition((StageAssignment(0, "a", 0, CUT - 1), StageAssignment(1, "b", CUT, n - 1)),
                                     "manual"),
              make_schedule(schedule, 2, M), {"model": "tiny", "lr": 1e-3}, predicted_step_s=1.0)
    train, _ = write_splits(work / "data", n_train=24, n_dev=4, seed=4)
    metrics = train_from_plan(plan, train, None, PlanRunSettings(steps=STEPS, seed=0, local=True, insecure=True))
    return [s.loss for s in metrics.steps]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("-o", "--out", type=Path)
    parser.add_argument("--check", type=Path)
    parser.add_argument("--only", default=None, help="comma-separated keys (e.g. pipeline/gpipe,plan/zb-h1)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    onnx = tiny_model(args.work)
    wanted = None if args.only is None else set(args.only.split(","))
    got = {}
    runs = [("pipeline/1f1b-stash-segments", lambda: pipeline_losses(onnx, "1f1b-stash", args.work, segment=2))]
    for key, run in runs:
        if wanted is None or key in wanted:
            got[key] = [repr(float(x)) for x in run()]
            print(key, " ".join(got[key]), flush=True)
    for schedule in SCHEDULES:
        for kind, run in (("pipeline", lambda: pipeline_losses(onnx, schedule)),
                          ("plan", lambda: plan_losses(onnx, args.work, schedule))):
            key = f"{kind}/{schedule}"
            if wanted is None or key in wanted:
                got[key] = [repr(float(x)) for x in run()]
                print(key, " ".join(got[key]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(got, indent=1) + "\n")
    if args.check is not None:
        want = json.loads(args.check.read_text())
        bad = [k for k in got if want.get(k) != got[k]]
        for k in bad:
            print(f"DIFFERS {k}: was {want.get(k)}, now {got[k]}", file=sys.stderr)
        print("bit-identical" if not bad else f"{len(bad)} differ")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
