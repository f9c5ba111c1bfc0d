"""Resident memory by phase of one-device training on MNN (issue 31, lever 4): where a peak comes from.

SmolLM2-135M-Instruct as benchmarks/memory.py trains it (4 micro-batches of 1 x 128, AdamW), in this
process: after the imports, the lowering, the engine's setup, each forward and backward, and each
step, the resident set (VmRSS, after a garbage collection) and the peak since the phase before
(VmHWM, restarted after each reading). Also the lowering alone (`--lowering-only`).

    python benchmarks/memory_phases.py [--lora 8] [--take-weights] [--steps 2] [--lowering-only]

Run one at a time on a quiet machine: full fine-tuning holds ~4.6 GB.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning, the default)")
    parser.add_argument("--take-weights", action="store_true",
                        help="the engine takes the lowered graph's arrays (as a worker does)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lowering-only", action="store_true", help="only lower the export and report its peak")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes

    def mark(what: str) -> None:
        gc.collect()
        print(f"{what:24s} resident {rss_bytes() / MIB:7.0f} MiB   peak since the last line {peak_rss_bytes() / MIB:7.0f}",
              flush=True)
        reset_peak_rss()

    from benchmarks.llm import smollm2_model
    from benchmarks.memory import M, LR, _graph

    model = smollm2_model()
    if args.lowering_only:
        import onnx  # noqa: F401  (its import is not the lowering's)

        from planner.onnx_import import load_model

        mark("imports")
        t0 = time.perf_counter()
        graph = load_model(model, 1, 128)
        mark(f"lowered ({time.perf_counter() - t0:.1f} s)")
        print(f"weights {sum(int(v.nbytes) for v in graph.constants.values()) / MIB:.0f} MiB")
        return
    from benchmarks.lora import _lm_feeds
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.optim import make_optimizer

    feeds = _lm_feeds(model)
    mark("imports and feeds")
    graph = _graph(model, args.lora or None)
    mark("lowered")
    engine = make_engine("mnn:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), take_weights=args.take_weights)
    mark("engine")
    optimizer = make_optimizer("adamw", LR)
    for step in range(args.steps):
        total: dict = {}
        for m, f in enumerate(feeds[:M]):
            engine.forward(f, m)
            mark(f"step {step} forward {m}")
            engine.backward_into(m, total)
            mark(f"step {step} backward {m}")
        engine.step(optimizer, total)
        del total
        mark(f"step {step} update")


if __name__ == "__main__":
    main()
