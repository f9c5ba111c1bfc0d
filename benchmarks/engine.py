"""MNN vs PyTorch stage engines, side by side: time and peak memory of forward and forward+backward.

What it measures
    Two cases of the MiniLM (all-MiniLM-L6-v2) token classifier lowered for batch 8, sequence 128:
    ``layer`` (one encoder layer, ``stage_spec(g, 1, 1)``: activation in, activation out) and
    ``model`` (the whole model, ``stage_spec(g, 0, last)``: token ids in, loss out), each with 1 and
    2 threads on three engines, float32:
      * ``mnn``: ``MnnStageEngine`` as the runtime builds it (forward activations cached per op and
        reused by the backward);
      * ``mnn-recompute``: ``MnnStageEngine(cache_activations=False)``, whose backward re-runs the
        block's forward from the stashed block input (the low-memory path);
      * ``torch``: ``TorchStageEngine``.
    The attention mask is realistic (most rows padded to random lengths), because padded positions
    carry huge negative additive-mask values, which is where denormal floats would hurt.

    Every (engine, threads, case) runs in its own child process (this script with ``--child``), one
    after another: thread counts are process-wide in both engines, and each child's peak RSS
    (``getrusage(RUSAGE_SELF).ru_maxrss``) is then that configuration's alone.  A child builds the
    engine, runs one training step (forward(train=True) + backward) as warm-up (the first call
    builds and compiles the graphs), times ``reps`` training steps, then warms up and times
    ``forward(train=False)`` the same way, and prints one JSON line.  Training steps come first on
    purpose: with the MNN engine as of this writing, an inference forward before the first training
    forward leaves MNN's caches shaped so that every later backward re-runs the forward anyway.

How to read the output
    First table: ``fwd`` (inference forward) and ``fwd+bwd`` (one training step), median ms;
    ``ratio`` = MNN / PyTorch, above 1 means MNN is slower (or bigger).  ``peak MB``: the child's
    peak RSS, everything included (Python, numpy, the engine library, the lowered graph and its
    weights, the engine, activations, gradients); ``+eng MB`` = peak minus the child's RSS just
    before the engine was built, i.e. what the engine itself added (PyTorch's import alone costs a
    few hundred MB, which sits in its baseline, not in ``+eng``).
    Second table: the training step split into ``fwd`` (forward(train=True)) and ``bwd``
    (backward), with ``grad-run`` = the part of ``bwd`` spent in ``GradientProgram.run`` (MNN's
    evaluation of the gradient graph), for the default MNN engine and the recompute one, and
    ``re-run`` = bwd(recompute) - bwd(mnn): what the backward spends re-running the forward.
    Timings drift 10-20 % on a shared machine; the script reports, per child, the share of all CPUs
    used by other processes while it ran (``others_cpu`` in the JSON) and warns above 10 %: a busy
    core slows the 2-thread runs of both engines badly, PyTorch's most.

Usage
    .venv/bin/python benchmarks/engine.py [--reps N] [--model PATH] [--json OUT]
    ``--reps`` overrides the default 5 repetitions for the layer and 3 for the model.  Without
    ``--model`` the default checkpoint is exported once to ``~/.cache/confidant/bench-minilm.onnx``
    and reused.  About 70 s on 2 idle cores.

    .venv/bin/python benchmarks/engine.py --isa-matched ROUNDS [--reps N]
    only the ISA-matched comparison (issue 14's MNN target): the whole model, one thread, MNN and
    PyTorch held to AVX2 (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
    ONEDNN_MAX_CPU_ISA=AVX2``, the MNN wheel's GEMM ISA; the child checks PyTorch dispatched to
    AVX2) in alternating children, ROUNDS of each; the ratio of medians against the 1.15x target.
    ``benchmarks/pipeline.py`` prints the same line with its targets (``--isa-rounds``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where a sibling script named like a
# project package (benchmarks/planner.py) would shadow it, in this process and in every child
# started from this file: drop that entry and put the repository root first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

from benchmarks.common import TORCH_AVX2_ENV, default_model, machine_busy_s  # noqa: E402

BATCH, SEQ = 8, 128
ENGINES = ("mnn", "mnn-recompute", "torch")
# the same TorchStageEngine in a child held to AVX2 (TORCH_AVX2_ENV): the ISA-matched comparison
CHILD_ENGINES = ENGINES + ("torch-avx2",)
ISA_TARGET = 1.15  # issue 14: MNN's whole-model fwd+bwd within 1.15x of PyTorch at the same ISA
THREADS = (1, 2)
CASES = ("layer", "model")
DEFAULT_REPS = {"layer": 5, "model": 3}
MARKER = "CONFIDANT_BENCH "


# --------------------------------------------------------------------------
# Child: one (engine, threads, case)
# --------------------------------------------------------------------------

def _rss_mb() -> float:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def make_feeds(graph, spec, seed: int = 0) -> dict:
    """Token ids, a padded attention mask, token types, loss targets and (middle stage) an activation."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(SEQ // 4, SEQ + 1, size=BATCH)
    lengths[0] = SEQ  # one full row, the others padded to random lengths
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1000, 30000, size=(BATCH, SEQ)).astype(np.int64)
    ids[:, 0] = 101  # [CLS]
    ids[np.arange(BATCH), lengths - 1] = 102  # [SEP]
    ids *= mask  # [PAD] = 0
    num_labels = graph.values["targets"].shape[-1]
    labels = rng.integers(0, num_labels, size=(BATCH, SEQ))
    targets = np.zeros((BATCH, SEQ, num_labels), np.float32)
    targets[np.arange(BATCH)[:, None], np.arange(SEQ)[None, :], labels] = 1.0
    targets *= mask[..., None]
    targets /= mask.sum()
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids),
             "targets": targets}
    if spec.activation_input is not None:
        shape = graph.values[spec.activation_input].shape
        feeds[spec.activation_input] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _median_ms(xs) -> float:
    return 1000.0 * statistics.median(xs)


def _mnn_has_cache_option() -> bool:
    import inspect

    from runtime.engines.mnn import MnnStageEngine

    return "cache_activations" in inspect.signature(MnnStageEngine.__init__).parameters


def run_child(engine: str, threads: int, case: str, model: str, reps: int) -> dict:
    import numpy as np

    from planner.onnx_import import load_model
    from runtime.engines.stage import stage_spec

    options = {}
    if engine.startswith("mnn"):
        from runtime.engines import mnn_kernels as K
        from runtime.engines.mnn import MnnStageEngine as Engine
        if engine == "mnn-recompute":
            if not _mnn_has_cache_option():
                return {"engine": engine, "threads": threads, "case": case, "skipped":
                        "MnnStageEngine has no cache_activations option"}
            options["cache_activations"] = False
    else:
        from runtime.engines.pytorch import TorchStageEngine as Engine
    from runtime.engines import fpmode

    graph = load_model(model, batch=BATCH, seq=SEQ)
    spec = stage_spec(graph, 1, 1) if case == "layer" else stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = make_feeds(graph, spec)
    rng = np.random.default_rng(1)
    rss_base = _rss_mb()

    # Time spent inside GradientProgram.run (MNN only): a pure timing wrapper, same behaviour.
    grad_run: list[float] = []
    if engine.startswith("mnn"):
        original_run = K.GradientProgram.run

        def timed_run(self):
            t = time.perf_counter()
            try:
                return original_run(self)
            finally:
                grad_run.append(time.perf_counter() - t)

        K.GradientProgram.run = timed_run

    t = time.perf_counter()
    eng = Engine(spec, threads=threads, **options)
    build_s = time.perf_counter() - t
    rss_built = _rss_mb()

    grad_output = None
    if not spec.is_last:
        grad_output = rng.standard_normal(graph.values[spec.output].shape).astype(np.float32)

    def train_step():
        grad_run.clear()
        t0 = time.perf_counter()
        eng.forward(feeds, microbatch=0, train=True)
        t1 = time.perf_counter()
        eng.backward(0, grad_output)
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0, t2 - t1, sum(grad_run)

    def forward():
        t0 = time.perf_counter()
        eng.forward(feeds, microbatch=0, train=False)
        return time.perf_counter() - t0

    # Training steps first, as in a training loop: with the MNN engine of this writing, an
    # inference forward run before the first training forward changes how MNN caches the graph
    # and makes every later backward re-run the forward (see the module docstring).
    fb_warm = train_step()[0]
    steps = [train_step() for _ in range(reps)]
    rss_train = _rss_mb()
    fwd_warm = forward()
    fwd = [forward() for _ in range(reps)]
    rss_peak = _rss_mb()

    result = {
        "engine": engine, "threads": threads, "case": case, "reps": reps,
        "cpu_capability": _torch_cpu_capability(),
        "blocks": [spec.first_block, spec.last_block], "options": options,
        "build_ms": 1000 * build_s,
        "fb_warm_ms": 1000 * fb_warm,
        "fb_ms": _median_ms([s[0] for s in steps]),
        "fb_samples_ms": [1000 * s[0] for s in steps],
        "fwd_train_ms": _median_ms([s[1] for s in steps]),
        "bwd_ms": _median_ms([s[2] for s in steps]),
        "fwd_warm_ms": 1000 * fwd_warm,
        "fwd_ms": _median_ms(fwd),
        "fwd_samples_ms": [1000 * x for x in fwd],
        "rss_base_mb": rss_base,
        "rss_built_mb": rss_built,
        "rss_train_mb": rss_train,
        "rss_peak_mb": rss_peak,
        "denormals_flushed": fpmode.denormals_flushed(),
    }
    if engine.startswith("mnn"):
        result["grad_run_ms"] = _median_ms([s[3] for s in steps])
    return result


# --------------------------------------------------------------------------
# Parent: run every configuration in its own child, print the tables
# --------------------------------------------------------------------------

def _torch_cpu_capability() -> str | None:
    """The ISA PyTorch's kernels dispatch to in this process (None where torch was not imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:  # an older torch
        return None


def spawn_child(engine: str, threads: int, case: str, model: Path, reps: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, str(threads), case,
           "--model", str(model), "--reps", str(reps)]
    env = dict(os.environ)
    # Let each engine set its own thread count; an inherited OMP/MKL setting would override neither
    # consistently, so drop them.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.pop(var, None)
    for var in TORCH_AVX2_ENV:
        env.pop(var, None)
    if engine == "torch-avx2":
        env.update(TORCH_AVX2_ENV)
    busy0, own0, t0 = machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    busy1, own1, wall = machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"child {engine}/{threads}/{case} failed (rc {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(MARKER):])
    # CPU used by other processes while the child ran, as a fraction of all CPUs.
    if busy0 is not None and busy1 is not None and wall > 0:
        own = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
        result["others_cpu"] = max(0.0, (busy1 - busy0 - own) / ((os.cpu_count() or 1) * wall))
    return result


def isa_matched(model: Path, pairs: int = 3, reps: int = 3, timeout: float = 300.0) -> dict:
    """MNN against PyTorch held to AVX2 on the whole model (token ids to loss), one thread each:
    `pairs` rounds, each one MNN child then one PyTorch-AVX2 child (alternating, so drift in the
    machine's speed falls on both), each timing `reps` training steps. The figure is the ratio of
    the medians of the rounds' fwd+bwd medians (above 1: MNN slower); `pairwise` the rounds' own."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    mnn, avx2, others = [], [], []
    for k in range(pairs):
        for engine, into in (("mnn", mnn), ("torch-avx2", avx2)):
            print(f"  ISA-matched round {k + 1}/{pairs}: {engine} ...", file=sys.stderr, flush=True)
            r = spawn_child(engine, 1, "model", Path(model), reps, timeout)
            if engine == "torch-avx2" and r.get("cpu_capability") not in (None, "AVX2"):
                raise RuntimeError(f"PyTorch ran at {r['cpu_capability']} with {TORCH_AVX2_ENV}: the comparison "
                                   f"would not be ISA-matched")
            into.append(r["fb_ms"])
            others.append(r.get("others_cpu"))
    ratio = statistics.median(mnn) / statistics.median(avx2)
    return {"mnn_fb_ms": mnn, "torch_avx2_fb_ms": avx2, "ratio": ratio,
            "pairwise": [a / b for a, b in zip(mnn, avx2)], "target": ISA_TARGET, "met": ratio <= ISA_TARGET,
            "others_cpu": [x for x in others if x is not None]}


def isa_matched_lines(doc: dict) -> list[str]:
    """The ISA-matched comparison as report lines."""
    busy = max(doc["others_cpu"], default=0.0)
    return [f"MNN whole-model fwd+bwd vs PyTorch held to AVX2 (1 thread, {len(doc['mnn_fb_ms'])} alternating "
            f"rounds, ms): MNN {' / '.join(f'{x:.0f}' for x in doc['mnn_fb_ms'])}, PyTorch AVX2 "
            f"{' / '.join(f'{x:.0f}' for x in doc['torch_avx2_fb_ms'])}: {doc['ratio']:.2f}x (ratio of medians; "
            f"rounds {min(doc['pairwise']):.2f}-{max(doc['pairwise']):.2f}); target <= {doc['target']:.2f}x: "
            f"{'met' if doc['met'] else 'NOT met'}"
            + (f" (others used up to {busy:.0%} of the CPUs meanwhile)" if busy > 0.10 else "")]


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _f(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _table(rows: list[list[str]], header: list[list[str]]) -> list[str]:
    """Right-aligned columns; a cell "|" is a separator."""
    allrows = header + rows
    widths = [max(len(r[i]) for r in allrows) for i in range(len(allrows[0]))]
    lines = []
    for k, r in enumerate(allrows):
        lines.append(" ".join(c.rjust(w) if c != "|" else "|" for c, w in zip(r, widths)))
        if k == len(header) - 1:
            lines.append("-" * len(lines[-1]))
    return lines


def format_tables(results: list[dict]) -> str:
    by = {(r["engine"], r["threads"], r["case"]): r for r in results if not r.get("skipped")}
    out = ["Time (median ms) and peak RSS (MB); ratio = MNN / PyTorch (>1: MNN slower or bigger); "
           "'+eng' = peak RSS minus the child's RSS before the engine was built."]
    header = [["", "", "|", "", "fwd", "", "|", "", "fwd+bwd", "", "|", "", "peak MB", "", "|", "", "+eng MB"],
              ["case", "thr", "|", "MNN", "torch", "ratio", "|", "MNN", "torch", "ratio", "|",
               "MNN", "torch", "ratio", "|", "MNN", "torch"]]
    rows = []
    for case in CASES:
        for t in THREADS:
            m, p = by.get(("mnn", t, case)), by.get(("torch", t, case))
            if not m or not p:
                continue
            rows.append([case, str(t), "|", _f(m["fwd_ms"]), _f(p["fwd_ms"]), _ratio(m["fwd_ms"], p["fwd_ms"]), "|",
                         _f(m["fb_ms"]), _f(p["fb_ms"]), _ratio(m["fb_ms"], p["fb_ms"]), "|",
                         _f(m["rss_peak_mb"]), _f(p["rss_peak_mb"]), _ratio(m["rss_peak_mb"], p["rss_peak_mb"]), "|",
                         _f(m["rss_peak_mb"] - m["rss_base_mb"]), _f(p["rss_peak_mb"] - p["rss_base_mb"])])
    out += _table(rows, header)
    out.append("")
    out.append("The training step split (median ms). MNN = default engine (forward activations cached per op "
               "and reused by the backward);")
    out.append("recompute = MnnStageEngine(cache_activations=False), whose backward re-runs the forward; "
               "grad-run = time in GradientProgram.run;")
    out.append("re-run = bwd(recompute) - bwd(MNN), the time the backward spends re-running the forward.")
    header = [["", "", "|", "", "", "MNN", "", "|", "", "", "", "recompute", "|", "", "|", "", "torch"],
              ["case", "thr", "|", "fwd", "bwd", "grad-run", "step", "|", "bwd", "grad-run", "step", "+eng MB", "|",
               "re-run", "|", "fwd", "bwd"]]
    rows = []
    for case in CASES:
        for t in THREADS:
            m, r, p = by.get(("mnn", t, case)), by.get(("mnn-recompute", t, case)), by.get(("torch", t, case))
            if not m:
                continue
            rows.append([case, str(t), "|", _f(m["fwd_train_ms"]), _f(m["bwd_ms"]), _f(m.get("grad_run_ms")),
                         _f(m["fb_ms"]), "|",
                         _f(r and r["bwd_ms"]), _f(r and r.get("grad_run_ms")), _f(r and r["fb_ms"]),
                         _f(r and r["rss_peak_mb"] - r["rss_base_mb"]), "|",
                         _f(r and r["bwd_ms"] - m["bwd_ms"]), "|",
                         _f(p and p["fwd_train_ms"]), _f(p and p["bwd_ms"])])
    out += _table(rows, header)
    skipped = [f"{r['engine']} {r['threads']}T {r['case']}: {r['skipped']}" for r in results if r.get("skipped")]
    if skipped:
        out.append("skipped: " + "; ".join(skipped))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per measurement (default 5 for the layer, 3 for the model)")
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (default: export MiniLM once)")
    ap.add_argument("--json", type=Path, default=None, help="also write all figures to this JSON file")
    ap.add_argument("--child", nargs=3, metavar=("ENGINE", "THREADS", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per child (default 300)")
    ap.add_argument("--isa-matched", type=int, default=None, metavar="ROUNDS",
                    help="only compare MNN with PyTorch held to AVX2 (the MNN wheel's GEMM ISA) on the whole "
                         "model, one thread, ROUNDS alternating rounds (issue 14's target: <= 1.15x)")
    args = ap.parse_args(argv)

    if args.child:
        engine, threads, case = args.child[0], int(args.child[1]), args.child[2]
        if engine not in CHILD_ENGINES or case not in CASES:
            ap.error(f"--child: engine in {CHILD_ENGINES}, case in {CASES}")
        reps = args.reps or DEFAULT_REPS[case]
        result = run_child(engine, threads, case, str(args.model), reps)
        sys.stdout.flush()
        print(MARKER + json.dumps(result), flush=True)
        return 0

    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    model = args.model if args.model is not None else default_model()
    if not Path(model).is_file():
        ap.error(f"model {model} does not exist")

    if args.isa_matched is not None:
        if args.isa_matched < 1:
            ap.error("--isa-matched needs at least 1 round")
        doc = isa_matched(Path(model), args.isa_matched, args.reps or DEFAULT_REPS["model"], args.timeout)
        print("\n".join(isa_matched_lines(doc)))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"model": str(model), "isa_matched": doc}, indent=2) + "\n")
        return 0

    results = []
    start = time.perf_counter()
    for case in CASES:
        reps = args.reps or DEFAULT_REPS[case]
        for threads in THREADS:
            for engine in ENGINES:
                print(f"  {case} {engine} {threads} thread(s) ...", file=sys.stderr, flush=True)
                results.append(spawn_child(engine, threads, case, Path(model), reps, args.timeout))
    elapsed = time.perf_counter() - start

    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    print(f"MiniLM {model}, batch {BATCH}, seq {SEQ}, float32; {os.cpu_count()} CPUs; "
          f"MNN {version('MNN')}, torch {version('torch')}; {elapsed:.0f} s")
    print(format_tables(results))
    busy = [(r["case"], r["engine"], r["threads"], r["others_cpu"]) for r in results
            if r.get("others_cpu") is not None and r["others_cpu"] > 0.10]
    if busy:
        print("\nWARNING: other processes used the CPUs during these runs (share of all CPUs): "
              + ", ".join(f"{c} {e} {t}T {b:.0%}" for c, e, t, b in busy)
              + ". Their times are inflated, the 2-thread ones most (a busy core stalls both "
              "engines' thread pools); rerun on an idle machine.")
    if args.json:
        doc = {"model": str(model), "batch": BATCH, "seq": SEQ, "cpus": os.cpu_count(),
               "machine": platform.machine(), "python": platform.python_version(),
               "mnn": version("MNN"), "torch": version("torch"), "elapsed_s": elapsed,
               "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
