"""A quantized frozen base (issue 31, lever 1): SmolLM2-135M LoRA peak memory at --base-dtype float32, int8, int4.

What it measures
    SmolLM2-135M-Instruct (benchmarks/llm.py's export), LoRA r=8 alpha 16 on q, k, v, o (nothing else
    trained: the tied embedding / LM head is frozen too), batch 4 x 128 of the entities-json task in 4
    micro-batches of one row, AdamW lr 1e-4, one thread, on one device: each row is its own child process
    (this file with --child) that lowers the model with `--base-dtype` (jobs.common.lora.adapted, as
    train-local does), builds the engine, runs one warm-up step and `--steps` timed steps.

Columns
    ``setup MiB``   the child's peak resident set (VmHWM) once the engine is built (the ONNX file read,
                    lowered, the base quantized: the float32 model exists whole for a moment).
    ``held MiB``    resident set once the engine is built and the setup's freed heap handed back to the
                    system (glibc malloc_trim): the weights as the engine holds them, the runtime.
    ``train MiB``   the peak resident set of the training steps alone (VmHWM reset after that trim through
                    /proc/self/clear_refs; `runtime.procfs.reset_peak_rss`), what a device holds while it
                    trains; the figure the issue's targets are about once setup reads weights straight
                    into their held form (lever 2).
    ``rss MiB``     resident set after the steps.
    ``frozen MiB``  the frozen weights as `Block.frozen_bytes` charges them (ir.precision.bytes_per_element).
    ``step s``      median seconds per step; ``loss``: the first step's loss (the same batch each step),
                    to show the quantized base computes the same task.
    Ratios under the table: each quantized row's training peak against float32's on the same engine.

Usage
    .venv/bin/python benchmarks/memory_quantized.py [--engines mnn,torch] [--dtypes float32,int8,int4]
        [--steps 1] [--json OUT]
`quantized_base_rows()` returns the rows as dicts for benchmarks/memory.py to print beside its own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

RANK, ALPHA, LR, M, ROWS, SEQ = 8, 16.0, 1e-4, 4, 4, 128
MARKER = "CONFIDANT_QBASE "


def _child(engine_kind: str, base_dtype: str, steps: int) -> dict:
    from benchmarks.llm import _batch, smollm2_model
    from jobs.common.lora import adapted
    from planner.lora import LoraSettings
    from planner.onnx_import import load_model
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.optim import make_optimizer
    from benchmarks.common import engine_step
    from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
    from tasks.causal_lm.data import microbatch_feeds

    model = smollm2_model()
    feeds = microbatch_feeds(_batch(model, ROWS, SEQ), M)
    settings = LoraSettings(RANK, ALPHA, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype=base_dtype)
    graph = adapted(load_model(model, ROWS // M, SEQ, loss="causal-lm"), settings)
    frozen = sum(b.frozen_bytes for b in graph.blocks)
    engine = make_engine(f"{engine_kind}:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), take_weights=True)
    del graph
    setup_peak = peak_rss_bytes()
    settled = _trimmed_rss()
    reset = reset_peak_rss()
    opt, times, losses = make_optimizer("adamw", LR), [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        losses.append(engine_step(engine, feeds, opt))
        times.append(time.perf_counter() - t0)
    return {"engine": engine_kind, "base_dtype": base_dtype, "setup_mib": setup_peak / 2**20,
            "settled_mib": settled / 2**20,
            "train_mib": peak_rss_bytes() / 2**20 if reset else None, "rss_mib": (rss_bytes() or 0) / 2**20,
            "frozen_mib": frozen / 2**20, "step_s": statistics.median(times[1:]) if steps else times[0],
            "loss": losses[0]}


def _trimmed_rss() -> int:
    """RSS once glibc has handed the setup's freed heap back (malloc_trim): what the engine holds."""
    import ctypes

    from runtime.procfs import rss_bytes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return rss_bytes() or 0


def _run_child(engine_kind: str, base_dtype: str, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", engine_kind, base_dtype, "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine_kind} {base_dtype} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARKER):])


def quantized_base_rows(engines=("mnn", "torch"), dtypes=("float32", "int8", "int4"), steps: int = 1) -> list[dict]:
    """One row per (engine, base dtype), each from its own child process, one after another."""
    return [_run_child(e, d, steps) for e in engines for d in dtypes]


def format_rows(rows: list[dict]) -> str:
    head = ("engine", "base", "setup MiB", "held MiB", "train MiB", "rss MiB", "frozen MiB", "step s", "loss")
    table = [head] + [(r["engine"], r["base_dtype"], f"{r['setup_mib']:.0f}", f"{r['settled_mib']:.0f}",
                       "-" if r["train_mib"] is None else f"{r['train_mib']:.0f}", f"{r['rss_mib']:.0f}",
                       f"{r['frozen_mib']:.1f}", f"{r['step_s']:.2f}", f"{r['loss']:.4f}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    base = {r["engine"]: r for r in rows if r["base_dtype"] == "float32"}
    for r in rows:
        ref = base.get(r["engine"])
        if ref is not None and r is not ref and r["train_mib"] and ref["train_mib"]:
            lines.append(f"{r['engine']} {r['base_dtype']}: training peak {r['train_mib'] / ref['train_mib']:.2f}x "
                         f"float32's ({ref['train_mib'] - r['train_mib']:+.0f} MiB saved), setup peak "
                         f"{r['setup_mib'] / ref['setup_mib']:.2f}x, step {r['step_s'] / ref['step_s']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--engines", default="mnn,torch")
    ap.add_argument("--dtypes", default="float32,int8,int4")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step (default 1)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.child:
        print(MARKER + json.dumps(_child(args.child[0], args.child[1], args.steps)), flush=True)
        return 0
    rows = quantized_base_rows(tuple(args.engines.split(",")), tuple(args.dtypes.split(",")), args.steps)
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
