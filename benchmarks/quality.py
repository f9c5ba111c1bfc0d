"""What a quantized frozen base costs in quality (issue 31, target 6): SmolLM2 LoRA on entities-json,
dev perplexity after the same steps at --base-dtype float32 and int4 (and any other), side by side.

What it measures
    SmolLM2-135M-Instruct (benchmarks/llm.py's export of the bundled GGUF), LoRA r=8 alpha 16 on q, k,
    v, o (the decoder's default: nothing else trains), the entities-json task of `confidant datagen
    --task entities-json` (`tasks.causal_lm.entity_task.write_entity_splits`, seed 0: --train conversations to train
    on, the first --dev of its held-out dev set to score), batch 4 x 128, AdamW lr 2e-4, seed 0, MNN
    at one thread: what `confidant train-local MODEL --task causal-lm --data train.jsonl --eval
    dev.jsonl --lora 8 --lora-alpha 16 --lr 2e-4 --steps N [--base-dtype D]` trains, each dtype in a
    child process of its own (this file with --child), the same batches in the same order.
    Generation (exact match, entity F1) is left out: it runs on ONNX Runtime, not on the held base.

Columns
    ``ppl before``  dev perplexity of the answers before training, on the training engine (the base at
                    that precision, the adapters' B zero): what the quantization alone costs.
    ``ppl after``   the same after --steps steps: the issue's figure.
    ``x float32``   ppl after / float32's ppl after (target: int4 within 5%, <= 1.05).
    ``loss``        mean training loss of the first and last fifth of the steps.
    ``step s``      median seconds a step; ``peak MiB`` the child's VmHWM (setup, both evaluations
                    and training together).

Usage
    .venv/bin/python benchmarks/quality.py [--steps 30] [--dtypes float32,int4] [--dev 64] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

RANK, ALPHA, LR, ROWS, SEQ = 8, 16.0, 2e-4, 4, 128
MARKER = "CONFIDANT_QUALITY "
TARGET = 1.05  # issue 31, target 6: int4's dev perplexity within 5% of float32's


def _child(base_dtype: str, steps: int, n_train: int, n_dev: int) -> dict:
    from benchmarks.llm import smollm2_model
    from tasks.causal_lm.entity_task import write_entity_splits
    from jobs.train.causal_lm import lm_data, lm_graph
    from jobs.common.settings import TrainingSettings
    from planner.lora import LoraSettings
    from runtime.engines.factory import whole_model_engine
    from runtime.procfs import peak_rss_bytes
    from tasks.causal_lm.evaluation import engine_nll
    from tasks.causal_lm.task import CAUSAL_LM
    from tasks.trainer import TrainConfig, train_steps

    model = smollm2_model()
    lora = LoraSettings(RANK, ALPHA, seed=0, base_dtype=base_dtype)
    settings = TrainingSettings(steps=steps, batch=ROWS, seq=SEQ, lr=LR, optimizer="adamw", seed=0, threads=1,
                                engine="mnn", lora=lora, eval_limit=n_dev)
    with tempfile.TemporaryDirectory() as d:
        train, dev = write_entity_splits(Path(d), n_train=n_train, n_dev=max(n_dev, 1), seed=0)
        run = lm_data(model, train, dev, settings)
    graph, _ = lm_graph(model, settings)
    engine = whole_model_engine(graph, "mnn", 1)
    config = TrainConfig(steps=steps, batch=ROWS, seq=SEQ, lr=LR, optimizer="adamw", seed=0, threads=1)
    batches = CAUSAL_LM.batches(run, ROWS, 0)
    dev_batches = CAUSAL_LM.dev_batches(run, ROWS)
    before = engine_nll(engine, dev_batches, ROWS, run.pad_id).perplexity
    result = train_steps(engine, batches, config, 0, step_feeds=lambda b: CAUSAL_LM.feeds(run, b, ROWS, 1))
    after = engine_nll(engine, dev_batches, ROWS, run.pad_id).perplexity
    losses = [s.loss for s in result.steps]
    return {"base_dtype": base_dtype, "ppl_before": before, "ppl_after": after, "losses": losses,
            "step_s": statistics.median(s.seconds for s in result.steps), "peak_mib": peak_rss_bytes() / 2**20,
            "dev_conversations": len(run.dev), "train_rows": len(run.train)}


def run_child(base_dtype: str, steps: int, n_train: int, n_dev: int, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", base_dtype, "--steps", str(steps),
           "--train", str(n_train), "--dev", str(n_dev)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"--base-dtype {base_dtype}: child failed (rc {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len(MARKER):])


def report(rows: list[dict], steps: int) -> str:
    base = next((r for r in rows if r["base_dtype"] == "float32"), None)
    out = [f"SmolLM2-135M LoRA r={RANK} alpha {ALPHA:g} (q,k,v,o) on entities-json, {steps} AdamW steps of "
           f"{ROWS} x {SEQ} at lr {LR:g}, MNN, 1 thread; dev perplexity of the answers "
           f"({rows[0]['dev_conversations']} dev conversations)", ""]
    header = ["base", "ppl before", "ppl after", "x float32", "loss first -> last", "step s", "peak MiB"]
    table = []
    for r in rows:
        k = max(1, len(r["losses"]) // 5)
        first, last = sum(r["losses"][:k]) / k, sum(r["losses"][-k:]) / k
        ratio = r["ppl_after"] / base["ppl_after"] if base else None
        table.append([r["base_dtype"], f"{r['ppl_before']:.5f}", f"{r['ppl_after']:.5f}",
                      "-" if ratio is None else f"{ratio:.4f}", f"{first:.4f} -> {last:.4f}", f"{r['step_s']:.2f}",
                      f"{r['peak_mib']:.0f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    for k, row in enumerate([header] + table):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            out.append("-" * len(out[-1]))
    q = next((r for r in rows if r["base_dtype"] == "int4"), None)
    if base and q:
        x = q["ppl_after"] / base["ppl_after"]
        out += ["", f"target 6 (quality): int4 dev perplexity after {steps} steps {x:.4f}x float32's "
                    f"(target <= {TARGET:.2f}x): {'met' if x <= TARGET else 'NOT met'}"]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per base precision (default 30)")
    ap.add_argument("--dtypes", default="float32,int4", help="comma-separated --base-dtype values (default float32,int4)")
    ap.add_argument("--train", type=int, default=1000, help="entities-json training conversations (default 1000)")
    ap.add_argument("--dev", type=int, default=64, help="dev conversations scored (default 64)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per precision (default 3600)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument("--child", metavar="DTYPE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.train < 1 or args.dev < 1:
        ap.error("--steps, --train and --dev must be at least 1")
    if args.child:
        print(MARKER + json.dumps(_child(args.child, args.steps, args.train, args.dev)), flush=True)
        return 0
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "int8", "int4")]
    if bad or not dtypes:
        ap.error(f"--dtypes: float32, bfloat16, int8 or int4, comma-separated, not {args.dtypes!r}")
    rows = []
    for d in dtypes:
        t = time.perf_counter()
        print(f"  --base-dtype {d} ...", file=sys.stderr, flush=True)
        rows.append(run_child(d, args.steps, args.train, args.dev, args.timeout))
        print(f"    ppl {rows[-1]['ppl_before']:.4f} -> {rows[-1]['ppl_after']:.4f} ({time.perf_counter() - t:.0f} s)",
              file=sys.stderr, flush=True)
    print(report(rows, args.steps))
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
