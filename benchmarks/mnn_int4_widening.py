"""Where an int4 base's extra step time goes on MNN: one weight's widening, how many times a micro-batch pays
it, and whether widening it a chunk at a time pays (issue 31 target 6; helper h66, benchmarks/MEMORY_NOTES.md).

What it measures
    For SmolLM2-135M's four int4 weight shapes (576 x 1536 gate / up, 1536 x 576 down, 576 x 576 q / o,
    576 x 192 k / v; blocked along the contraction, as `ir.precision.quantizable` holds them), x of 128
    tokens, one thread, CPU milliseconds (best of `--rounds` x `--reps`), each way of holding W:
      * ``float32``: W a float32 constant;
      * ``int4``: the engine's path (`mnn_kernels.int4_halves_parts` + `int4_matmul`), W widened whole,
        its halves stacked and multiplied by x's columns in even-then-odd order, one GEMM (h73);
      * ``int4-split``: the path before h73: the same halves, each multiplied by x's even or odd columns
        (two GEMMs of half the depth, summed);
      * ``int4/N``: the same, widened N chunks of whole blocks at a time (each chunk's codes, scales and
        offsets sliced from the one held constant, its halves multiplied by its slice of x, summed):
        the experiment h66 did not keep.
    Three programs each: ``fwd`` (x -> silu(x W), read), ``dx`` (the input gradient of x W alone, its
    product not needed: recompute mode's backward, the forward's product cached) and ``bwd+rerun`` (the
    input gradient of silu(x W) with no caches: a per-block backward, re-run and gradient in one program).
    ``extra`` columns are int4's time over float32's; ``bwd+rerun`` extra about ``fwd`` extra means the
    re-run's product and the gradient's share one widening.

    python benchmarks/mnn_int4_widening.py [--reps 20] [--rounds 5] [--chunks 2,4] [--kinds float32,int4,int4-split]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ir.precision import dequantize, quantize  # noqa: E402
from runtime.engines import mnn_kernels as K  # noqa: E402

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))
ROWS = 128


def chunked_product(x, q, parts: int):
    """x @ W for an int4 W ([K, N], blocked along K) widened `parts` chunks of whole blocks at a time."""
    R = K.R
    rows = q.codes.shape[0]
    codes_t = np.ascontiguousarray(q.codes.T)
    codes_held = R.const(codes_t, list(codes_t.shape), R.NCHW, R.uint8)
    scales = np.ascontiguousarray(q.scales.astype(np.float32).T[:, None, :])
    scale = R.const(scales, list(scales.shape), R.NCHW, R.float)
    mins = np.ascontiguousarray(q.mins.astype(np.float32).T[:, None, :])
    offset = R.const(mins, list(mins.shape), R.NCHW, R.float)
    blocks = scales.shape[0]
    edges = [blocks * p // parts for p in range(parts + 1)]
    y = None
    for b0, b1 in zip(edges, edges[1:]):
        lo, hi = b0 * q.block, b1 * q.block
        codes = R.cast(K.slice_axis(codes_held, 0, lo // 2, hi // 2), R.int)
        s, m = K.slice_axis(scale, 0, b0, b1), K.slice_axis(offset, 0, b0, b1)
        low = R.bitwise_and(codes, R.const(np.array([15], np.int32), [1], R.NCHW, R.int))
        high16 = R.bitwise_and(codes, R.const(np.array([240], np.int32), [1], R.NCHW, R.int))
        s16 = R.multiply(s, K.constant(np.float32(1 / 16)))
        lo_half, hi_half = (R.reshape(R.add(R.multiply(R.reshape(R.cast(v, R.float), [-1, q.block // 2, rows]), f), m),
                                      [-1, rows]) for v, f in ((low, s), (high16, s16)))
        width = hi - lo
        even, odd = R.split(R.reshape(K.slice_axis(x, 1, lo, hi), [-1, width // 2, 2]), [1, 1], 2)
        part = R.add(R.matmul(R.reshape(even, [-1, width // 2]), lo_half, False, False),
                     R.matmul(R.reshape(odd, [-1, width // 2]), hi_half, False, False))
        y = part if y is None else R.add(y, part)
    return y


def split_product(x, q, halves=None):
    """x @ W for an int4 W ([K, N], blocked along K) as before h73: x's even and odd columns, each by one
    of `int4_halves_parts`' halves (built here unless given), the two half-depth products summed."""
    R = K.R
    low, high = halves if halves is not None else K.int4_halves_parts(q)[0]
    k = int(x.shape[-1])
    even, odd = R.split(R.reshape(x, [-1, k // 2, 2]), [1, 1], 2)
    return R.add(R.matmul(R.reshape(even, [-1, k // 2]), low, False, False),
                 R.matmul(R.reshape(odd, [-1, k // 2]), high, False, False))


def timings(kind: str, w: np.ndarray, q, x_np: np.ndarray, reps: int, rounds: int) -> dict[str, float]:
    k, n = w.shape
    x = K.placeholder((ROWS, k))
    if kind == "float32":
        y = K.matmul(x, K.constant(w))
    elif kind == "int4":
        halves, _ = K.int4_halves_parts(q)
        y = K.int4_matmul(x, halves, q, False)
    elif kind == "int4-split":
        y = split_product(x, q)
    else:
        y = chunked_product(x, q, int(kind.partition("/")[2]))
    z = K.silu(y)
    seed = K.placeholder((ROWS, n))
    ones = np.ones((ROWS, n), np.float32)
    dx = K.GradientProgram().build([y], [seed], [x])
    rerun = K.GradientProgram().build([z], [seed], [x])

    def best(step) -> float:
        out = float("inf")
        for _ in range(rounds):
            c = time.process_time()
            for _ in range(reps):
                step()
            out = min(out, (time.process_time() - c) / reps)
        return out * 1e3

    K.write(seed, ones)
    K.write(x, x_np)  # each way computes the product by the weight it stands for (int4's: the dequantized one)
    np.testing.assert_allclose(K.read(y), x_np @ (w if kind == "float32" else dequantize(q)), rtol=1e-4, atol=1e-4)

    def fwd():
        K.write(x, x_np)
        K.read(z)

    def grad_only():  # the seed written too: x W's input gradient does not read x, MNN would keep it
        K.write(seed, ones)
        dx.run()

    def grad_rerun():
        K.write(x, x_np)
        K.write(seed, ones)
        rerun.run()

    return {"fwd": best(fwd), "dx": best(grad_only), "bwd+rerun": best(grad_rerun)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default="")
    ap.add_argument("--kinds", default="float32,int4,int4-split")
    args = ap.parse_args()
    K.set_threads(1)
    rng = np.random.default_rng(0)
    kinds = args.kinds.split(",") + [f"int4/{c}" for c in args.chunks.split(",") if c]
    if kinds[0] != "float32":
        ap.error("--kinds starts with float32 (the extra columns are over it)")
    print(f"one thread, x {ROWS} tokens, CPU ms best of {args.rounds} x {args.reps}; load {os.getloadavg()[0]:.2f}")
    print(f"{'W':>10} {'kind':>8} {'fwd':>7} {'dx':>7} {'bwd+rerun':>9}   extra over float32: fwd / dx / bwd+rerun")
    for k, n in SHAPES:
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        q = quantize(w, "int4", 0)
        x_np = rng.standard_normal((ROWS, k)).astype(np.float32)
        base = None
        for kind in kinds:
            t = timings(kind, w, q, x_np, args.reps, args.rounds)
            base = base or t
            extra = " / ".join(f"{t[p] - base[p]:+.2f}" for p in t) if kind != "float32" else ""
            print(f"{k:>4}x{n:<5} {kind:>8} {t['fwd']:7.2f} {t['dx']:7.2f} {t['bwd+rerun']:9.2f}   {extra}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
