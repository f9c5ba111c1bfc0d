"""An int4 base's per-block step against a float32 base's, with the int4 products built two ways, in one
process (issue 31 target 6; helper h73, benchmarks/MEMORY_NOTES.md).

What it measures
    Three SmolLM2-135M LoRA engines (per_block_cost.py's shape and settings, one thread) built in one
    process: a float32 base, an int4 base whose products are two half-depth GEMMs by x's even and odd
    columns (`mnn_int4_widening.split_product`: the engine before h73), and an int4 base as the engine
    builds it now (`mnn_kernels.int4_matmul`: one GEMM by the stacked halves). After a warm-up step each,
    they step in turn (A B C A B C ...), so the three run within seconds of each other under the same
    load; CPU seconds a step, each engine's loss, and the ratios.

    python benchmarks/mnn_int4_engines.py [--mode per-block] [--rounds 4]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import engine_step  # noqa: E402
from benchmarks.llm import smollm2_model  # noqa: E402
from benchmarks.lora import _lm_feeds, _lm_lora  # noqa: E402
from benchmarks.memory import LM_BATCH, LM_SEQ, M  # noqa: E402
from jobs.common.lora import adapted  # noqa: E402
from planner.onnx_import import load_model  # noqa: E402
from runtime.engines import mnn_kernels as K  # noqa: E402
from runtime.engines.factory import make_engine  # noqa: E402
from runtime.engines.stage import stage_spec  # noqa: E402
from runtime.optim import make_optimizer  # noqa: E402

from benchmarks import mnn_int4_widening  # noqa: E402


def split_matmul(x, halves, q, trans_b):
    """`mnn_kernels.int4_matmul` as it was before h73 (blocked along the contraction only: SmolLM2's case)."""
    if (q.axis == 0) == bool(trans_b):
        return int4_matmul(x, halves, q, trans_b)
    shape = [int(d) for d in x.shape]
    y = mnn_int4_widening.split_product(K.reshape(x, [-1, shape[-1]]), q, halves)
    return K.reshape(y, shape[:-1] + [int(y.shape[-1])])


int4_matmul = K.int4_matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="per-block")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    model = smollm2_model()
    feeds = _lm_feeds(model)
    engines = {}
    for name, dtype, product in (("float32", "float32", int4_matmul), ("int4 split", "int4", split_matmul),
                                 ("int4 stacked", "int4", int4_matmul)):
        K.int4_matmul = product  # the engine builds its int4 products through this name
        try:
            graph = adapted(load_model(model, LM_BATCH // M, LM_SEQ, loss="causal-lm"),
                            dataclasses.replace(_lm_lora(8), base_dtype=dtype))
            engine = make_engine("mnn:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), activations=args.mode)
        finally:
            K.int4_matmul = int4_matmul
        opt = make_optimizer("adamw", 1e-4)
        engine_step(engine, feeds, opt)  # warm-up
        engines[name] = (engine, opt)
    print(f"SmolLM2 LoRA r=8, {args.mode}, one thread, CPU s a step; {time.strftime('%H:%M:%S', time.gmtime())} UTC, "
          f"load {os.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        row = {}
        for name, (engine, opt) in engines.items():
            c = time.process_time()
            loss = engine_step(engine, feeds, opt)
            row[name] = (time.process_time() - c, loss)
        f, s, t = row["float32"][0], row["int4 split"][0], row["int4 stacked"][0]
        print(f"round {r} load {os.getloadavg()[0]:.1f}  " + "  ".join(f"{n} {c:.2f} ({lo:.5f})" for n, (c, lo) in row.items())
              + f"  split/f32 {s / f:.3f}  stacked/f32 {t / f:.3f}  stacked/split {t / s:.3f}", flush=True)


if __name__ == "__main__":
    main()
