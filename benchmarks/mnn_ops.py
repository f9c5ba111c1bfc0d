"""Where MNN's backward spends its time: one encoder layer's ops, MNN against PyTorch, per op.

What it measures
    The ops of one MiniLM encoder layer at the shapes the pipeline trains (batch 8 x 128 tokens,
    hidden 384, 12 heads of 32, feed-forward 1536), each alone, forward and forward+backward, on
    one thread, median of ``--reps`` runs after two warm-ups:
      * ``mnn``: the op built from ``runtime.engines.mnn_kernels`` exactly as the engine builds it
        (2-D weights, raw bindings), run as the engine runs a training step: write the inputs, read
        the output (the forward; MNN caches the result of the Var read, as the engine's op caches
        keep MatMul and Softmax results), write the output gradient, read the gradients with
        respect to the input and the weights through one ``GradientProgram``. ``bwd`` = fwd+bwd -
        fwd: the gradient program, including whatever of the forward it evaluates again (a
        composite op's intermediates: layer norm's statistics, erf).
      * ``torch-avx2``: the same op in PyTorch with ``ATEN_CPU_CAPABILITY=avx2
        MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` (the ISA of this MNN wheel's GEMM);
      * ``torch``: PyTorch with its native ISA (AVX-512 here).
    Each engine runs in its own child process (this script with ``--child``): the ISA variables
    must be set before torch is imported, and thread counts are process-wide.

    Ops: ``linear HxH`` (one of Q, K, V, O: [1024, 384] @ [384, 384] + bias), ``linear Hx4H`` and
    ``linear 4HxH`` (the feed-forward), ``scores QK^T`` and ``probs @ V`` (batched [96, 128, 32]
    products), ``softmax`` (with the additive mask), ``layer norm`` ([1024, 384], composed from
    reductions as the engine composes it), ``gelu (erf)`` ([1024, 1536]) and ``add`` (a residual).
    ``layer`` sums each op times its count in one layer (4 HxH, one of the rest, two layer norms,
    two residual adds).

How to read the output
    ms per op; ``mnn/avx2`` = MNN's time over PyTorch's at the same ISA (the part of MNN's gap that
    is MNN's own kernels, not the wheel's missing AVX-512), ``avx2/native`` = what AVX-512 buys
    PyTorch. The ``share`` column is each op's part of MNN's layer fwd+bwd, so the rows to work on
    are those with a large share and a large ratio. Timings drift 10-20% on a shared machine.

Usage
    .venv/bin/python benchmarks/mnn_ops.py [--reps 20] [--json out.json]
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
B, S, H, HEADS, FF = 8, 128, 384, 12, 1536
D = H // HEADS
# (name, count in one layer)
OPS = [("linear HxH", 4), ("linear Hx4H", 1), ("linear 4HxH", 1), ("scores QK^T", 1), ("probs @ V", 1),
       ("softmax", 1), ("layer norm", 2), ("gelu (erf)", 1), ("add", 2)]


def _inputs(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The op's operands (float32), the same in every engine."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    rows = B * S
    if name.startswith("linear"):
        k, n = {"linear HxH": (H, H), "linear Hx4H": (H, FF), "linear 4HxH": (FF, H)}[name]
        return {"x": f(rows, k), "w": f(k, n) * np.float32(0.05), "b": f(n)}
    if name == "scores QK^T":
        return {"q": f(B * HEADS, S, D), "k": f(B * HEADS, S, D)}
    if name == "probs @ V":
        return {"p": np.abs(f(B * HEADS, S, S)) / np.float32(S), "v": f(B * HEADS, S, D)}
    if name == "softmax":
        mask = np.zeros((B, 1, 1, S), np.float32)
        mask[:, :, :, S // 2:] = -10000.0
        return {"x": f(B, HEADS, S, S), "mask": mask}
    if name == "layer norm":
        return {"x": f(rows, H), "g": 1 + f(H) * np.float32(0.1), "b": f(H) * np.float32(0.1)}
    if name == "gelu (erf)":
        return {"x": f(rows, FF)}
    if name == "add":
        return {"x": f(rows, H), "y": f(rows, H)}
    raise ValueError(name)


def _time(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


# --- MNN ---------------------------------------------------------------------------------------

def _mnn_op(K, name: str, x: dict):
    """(output Var, (placeholder, value) pairs to feed, Vars to differentiate, intermediates the engine
    caches besides the output) of one op, built as the engine builds it."""
    if name.startswith("linear"):
        inp = K.placeholder(x["x"].shape)
        w, b = K.trainable(x["w"]), K.trainable(x["b"])
        return K.add(K.matmul(inp, w), b), [(inp, x["x"])], [inp, w, b], []
    if name == "scores QK^T":
        q, k = K.placeholder(x["q"].shape), K.placeholder(x["k"].shape)
        return K.matmul(q, k, trans_b=True), [(q, x["q"]), (k, x["k"])], [q, k], []
    if name == "probs @ V":
        p, v = K.placeholder(x["p"].shape), K.placeholder(x["v"].shape)
        return K.matmul(p, v), [(p, x["p"]), (v, x["v"])], [p, v], []
    if name == "softmax":
        s = K.placeholder(x["x"].shape)
        return K.softmax(K.add(s, K.constant(x["mask"])), -1), [(s, x["x"])], [s], []
    if name == "layer norm":
        inp = K.placeholder(x["x"].shape)
        g, b = K.trainable(x["g"]), K.trainable(x["b"])
        return K.layer_norm(inp, g, b), [(inp, x["x"])], [inp, g, b], []
    if name == "gelu (erf)":  # the engine caches the erf term too (runtime.engines.mnn.CACHED_OPS)
        inp = K.placeholder(x["x"].shape)
        y, erf = K.erf_gelu(inp)
        return y, [(inp, x["x"])], [inp], [erf]
    if name == "add":
        a, c = K.placeholder(x["x"].shape), K.placeholder(x["y"].shape)
        return K.add(a, c), [(a, x["x"]), (c, x["y"])], [a, c], []
    raise ValueError(name)


def _run_mnn(reps: int) -> dict:
    from runtime.engines import mnn_kernels as K

    K.set_threads(1)
    out = {}
    for name, _ in OPS:
        x = _inputs(name, np.random.default_rng(0))
        y, feeds, wrt, cached = _mnn_op(K, name, x)
        dy = K.placeholder(list(y.shape))
        grad = K.GradientProgram().build([y], [dy], wrt)
        for var, value in feeds:
            K.write(var, value)
        for var in cached:  # as the engine's enable_op_caches: each read once gets its own cache
            K.read(var)
        seed = np.random.default_rng(1).standard_normal([int(s) for s in y.shape]).astype(np.float32)

        def feed():
            for var, value in feeds:
                K.write(var, value)  # marks the graph stale: every read below evaluates again

        def forward():
            feed()
            K.read(y)

        def forward_backward():
            feed()
            K.read(y)
            K.write(dy, seed)
            grad.run()

        out[name] = {"fwd": _time(forward, reps), "fwd+bwd": _time(forward_backward, reps)}
    return out


# --- PyTorch -----------------------------------------------------------------------------------

def _torch_op(torch, name: str, x: dict):
    F = torch.nn.functional
    t = {k: torch.from_numpy(v).requires_grad_(k not in ("mask",)) for k, v in x.items()}
    if name.startswith("linear"):
        return (lambda: F.linear(t["x"], t["w"].T, t["b"])), t
    if name == "scores QK^T":
        return (lambda: torch.bmm(t["q"], t["k"].transpose(1, 2))), t
    if name == "probs @ V":
        return (lambda: torch.bmm(t["p"], t["v"])), t
    if name == "softmax":
        return (lambda: torch.softmax(t["x"] + t["mask"], -1)), t
    if name == "layer norm":
        return (lambda: F.layer_norm(t["x"], (H,), t["g"], t["b"], 1e-12)), t
    if name == "gelu (erf)":
        return (lambda: F.gelu(t["x"])), t
    if name == "add":
        return (lambda: t["x"] + t["y"]), t
    raise ValueError(name)


def _run_torch(reps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, _ in OPS:
        x = _inputs(name, np.random.default_rng(0))
        op, tensors = _torch_op(torch, name, x)
        with torch.no_grad():
            y = op()
        seed = torch.from_numpy(np.random.default_rng(1).standard_normal(list(y.shape)).astype(np.float32))

        def forward():
            with torch.no_grad():
                op()

        def forward_backward():
            for v in tensors.values():
                v.grad = None
            op().backward(seed)

        out[name] = {"fwd": _time(forward, reps), "fwd+bwd": _time(forward_backward, reps)}
    return out


# --- driver ------------------------------------------------------------------------------------

def _child(engine: str, reps: int) -> dict:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import TORCH_AVX2_ENV

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(TORCH_AVX2_ENV if engine == "torch-avx2" else {})}
    proc = subprocess.run([sys.executable, __file__, "--child", engine, "--reps", str(reps)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the {engine} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _layer(result: dict, key: str) -> float:
    return sum(result[name][key] * count for name, count in OPS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20, help="timed runs per op (median; default 20)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--child", choices=("mnn", "torch", "torch-avx2"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(_run_mnn(args.reps) if args.child == "mnn" else _run_torch(args.reps)))
        return 0
    results = {}
    for engine in ("mnn", "torch-avx2", "torch"):
        print(f"measuring {engine} ...", file=sys.stderr, flush=True)
        results[engine] = _child(engine, args.reps)
    mnn, avx2, native = results["mnn"], results["torch-avx2"], results["torch"]
    layer_mnn = _layer(mnn, "fwd+bwd")
    header = (f"{'op (x count in a layer)':<26}{'mnn fwd':>9}{'mnn f+b':>9}{'mnn bwd':>9}{'avx2 f+b':>10}"
              f"{'torch f+b':>10}{'mnn/avx2':>10}{'avx2/nat':>10}{'share':>8}")
    print(header)
    print("-" * len(header))
    rows = [(f"{name} x{count}", count, mnn[name], avx2[name], native[name]) for name, count in OPS]
    rows.append(("layer (sum)", 1, {k: _layer(mnn, k) for k in ("fwd", "fwd+bwd")},
                 {k: _layer(avx2, k) for k in ("fwd", "fwd+bwd")}, {k: _layer(native, k) for k in ("fwd", "fwd+bwd")}))
    for label, count, m, a, t in rows:
        share = m["fwd+bwd"] * count / layer_mnn
        print(f"{label:<26}{m['fwd']:>9.2f}{m['fwd+bwd']:>9.2f}{m['fwd+bwd'] - m['fwd']:>9.2f}"
              f"{a['fwd+bwd']:>10.2f}{t['fwd+bwd']:>10.2f}{m['fwd+bwd'] / a['fwd+bwd']:>10.2f}"
              f"{a['fwd+bwd'] / t['fwd+bwd']:>10.2f}{share:>8.1%}")
    print("ms per op (one thread, median); rows x count = times per layer; share: of MNN's layer fwd+bwd")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
