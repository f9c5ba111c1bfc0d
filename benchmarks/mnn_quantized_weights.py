"""Does MNN keep a frozen weight widened from int8 / int4 codes resident? (issue 31, lever 1)

Twelve independent one-op graphs y = x W^T (x [512, 576], W [1536, 576]: SmolLM2's feed-forward
shape), each with its own gradient program for dx, built with W as
  * ``f32``: a float32 constant Var (what the engine holds for a float32 base), or
  * ``q int8`` / ``q int4``: `mnn_kernels.widened_weight` over uint8 code constants and float32
    block scales (what the engine holds for --base-dtype int8 / int4),
then three rounds of forward + backward over all twelve, one thread. Printed: RSS (MiB, after
malloc_trim) once the weights exist and after each round, the peak, and the round's seconds. If MNN
kept each graph's widened weight, the quantized runs' growth from "weights" to "rss" would exceed the
float32 run's by about the twelve widened weights (~42 MiB); the measured growth is the same.

Usage: .venv/bin/python benchmarks/mnn_quantized_weights.py f32 | q int8 | q int4   (one mode a process)
"""
from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from ir.precision import quantize  # noqa: E402
from runtime.engines import mnn_kernels as K  # noqa: E402

ROWS, D_IN, D_OUT, GRAPHS = 512, 576, 1536, 12


def _rss_mib() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    mode, storage = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "int8")
    rng = np.random.default_rng(0)
    print("start", _rss_mib())
    xs = [K.placeholder((ROWS, D_IN)) for _ in range(GRAPHS)]
    ws = []
    for _ in range(GRAPHS):
        w = (rng.standard_normal((D_OUT, D_IN)) * 0.05).astype(np.float32)
        ws.append(K.constant(w) if mode == "f32" else K.widened_weight(quantize(w, storage, 1)))
    print("weights", _rss_mib())
    ys = [K.matmul(xs[k], ws[k], True) for k in range(GRAPHS)]
    seeds = [K.placeholder((ROWS, D_OUT)) for _ in range(GRAPHS)]
    programs = [K.GradientProgram().build([ys[k]], [seeds[k]], [xs[k]]) for k in range(GRAPHS)]
    x = rng.standard_normal((ROWS, D_IN)).astype(np.float32)
    for rnd in range(3):
        t0 = time.perf_counter()
        for k in range(GRAPHS):
            K.write(xs[k], x)
            y = K.read(ys[k])
            K.write(seeds[k], np.ones_like(y))
            programs[k].run()
        print(rnd, "rss", _rss_mib(), "peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
              f"{time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
