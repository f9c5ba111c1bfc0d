"""An embedding stage's backward with the table's gradient dense or as the rows it touches.

What it measures
    MiniLM's first pipeline stage of the 2-stage benchmark split (blocks 0-4: embeddings and four
    encoder layers), lowered for micro-batches of 2 x 128, one thread (run it with
    ``OPENBLAS_NUM_THREADS=1``, as the workers are): four forwards, then four backwards whose
    gradients are summed with ``runtime.engines.base.accumulate`` (what a pipeline stage does), on
    MNN and on the PyTorch engine, with ``row_gradients`` off (a dense 30522 x 384 table gradient
    per backward) and on (``RowGradient``: the rows the micro-batch touches). Each setting is timed
    ``--reps`` times and twice, interleaved; medians in ms.

Usage
    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/embedding_grads.py [--reps 3] [--model PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

import numpy as np  # noqa: E402

from benchmarks.common import default_model  # noqa: E402

M = 4


def time_stage(engine, feeds, dy, reps: int) -> float:
    from runtime.engines.base import accumulate

    engine.forward(feeds, 0)
    engine.backward(0, dy)  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        total: dict = {}
        for m in range(M):
            engine.forward(feeds, m)
        for m in range(M):
            accumulate(total, engine.backward(m, dy).params)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (default: MiniLM, exported once)")
    args = ap.parse_args(argv)
    from planner.onnx_import import load_model
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec

    engines = {"mnn": MnnStageEngine}
    try:
        import torch

        from runtime.engines.pytorch import TorchStageEngine

        torch.set_num_threads(1)
        engines["torch"] = TorchStageEngine
    except ImportError:
        print("torch is not installed: MNN only", file=sys.stderr)
    graph = load_model(str(args.model or default_model()), batch=2, seq=128)
    spec = stage_spec(graph, 0, 4)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 30522, (2, 128)), "attention_mask": np.ones((2, 128), np.int64),
             "token_type_ids": np.zeros((2, 128), np.int64)}
    feeds = {k: v for k, v in feeds.items() if k in spec.graph_inputs}
    dy = rng.normal(size=graph.values[spec.output].shape).astype(np.float32)
    print(f"MiniLM blocks 0-4, {M} micro-batches of 2 x 128, F+B and the sums, median ms of {args.reps}")
    print(f"{'engine':8} {'dense':>8} {'rows':>8}")
    for name, make in engines.items():
        got = {False: [], True: []}
        for rows in (False, True, False, True):
            engine = make(spec)
            engine.row_gradients = rows
            got[rows].append(time_stage(engine, feeds, dy, args.reps))
        print(f"{name:8} {'/'.join(f'{t:.0f}' for t in got[False]):>8} {'/'.join(f'{t:.0f}' for t in got[True]):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
