"""What recomputing activations per block costs in step time, beside what it saves in memory.

What it measures
    SmolLM2-135M-Instruct as a causal LM (benchmarks/memory.py's shape: 4 entities-json conversations
    x 128 tokens in 4 micro-batches of one row, AdamW lr 1e-4, LoRA r=8 alpha 16 on q, k, v, o, one
    compute thread), one device, the MNN engine, in each activation mode:
      * ``recompute``: MNN's default (today's step): one set of block graphs whose per-op caches
        serve the backward that follows its forward;
      * ``per-block``: no per-op caches, each block's input held, its forward re-run in its backward;
      * ``per-block+K``: the hybrid, the stage's last K blocks keeping their per-op caches
        (`make_engine(..., activations="per-block", cached_blocks=K)`);
      * ``--base-dtype int4|int8`` (or a mode's ``@int4`` suffix, ``recompute@int4``): the same with
        the frozen base held quantized (widened inside the graphs at every forward, re-run and backward).
    Each mode runs in a child process of its own (its peak is its own), one warm-up step and then
    `--steps` timed ones; the modes are interleaved (A B C A B C ...) for `--passes` passes, and each
    mode's best pass is reported: ``step s`` wall seconds, ``cpu s`` the process's CPU seconds (one
    thread: the figure the machine's load disturbs least), ``train MiB`` the peak resident set of the
    steps above what the process held after setup (VmHWM reset after setup), ``peak MiB`` the whole
    process's. The ratio column is each mode's CPU seconds over ``recompute``'s.

    python benchmarks/per_block_cost.py [--steps 2] [--passes 2] [--modes recompute,per-block,per-block+6,recompute@int4]
                                        [--base-dtype int4]
    python benchmarks/per_block_cost.py --child per-block+6 --steps 2      (one mode's child alone: JSON)

    A mode may name the PyTorch engine ("torch:per-block", "torch:per-block@int4"); the ``x float32``
    column is each ``@int4``/``@int8`` mode's CPU seconds over the same mode's float32 run where it
    ran too (issue 31 target 6). ``PER_BLOCK_COST_PROFILE=FILE`` with ``--child`` writes a cProfile of
    the timed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LR, RANK = 1e-4, 8
DEFAULT_MODES = "recompute,per-block,per-block+4,per-block+6,per-block+10"


def parse_mode(mode: str) -> tuple[str, int, str | None]:
    """("recompute"|"keep"|"per-block", cached blocks, base dtype or None) of a mode's name
    ("per-block+6": 6 cached; "recompute@int4": the base held int4, whatever --base-dtype says;
    an engine prefix, "torch:per-block@int4", is `mode_engine`'s)."""
    mode = mode.partition(":")[2] if ":" in mode else mode
    mode, _, dtype = mode.partition("@")
    name, _, cached = mode.partition("+")
    return name, int(cached or 0), dtype or None


def mode_engine(mode: str) -> str:
    """The engine a mode runs on: "mnn" unless it says "torch:" before its activations."""
    return mode.partition(":")[0] if ":" in mode else "mnn"


def child(mode: str, steps: int, base_dtype: str) -> dict:
    import dataclasses

    from benchmarks.common import engine_step
    from benchmarks.llm import smollm2_model
    from benchmarks.lora import _lm_feeds, _lm_lora
    from benchmarks.memory import LM_BATCH, LM_SEQ, M, _peak_mib, _setup_done
    from jobs.common.lora import load_adapted
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.optim import make_optimizer

    activations, cached, dtype = parse_mode(mode)
    model = smollm2_model()
    feeds = _lm_feeds(model)
    settings = dataclasses.replace(_lm_lora(RANK), base_dtype=dtype or base_dtype)
    # as `train-local` sets up: a quantized base read from a mapping of the file a weight at a time
    graph = load_adapted(model, LM_BATCH // M, LM_SEQ, settings, loss="causal-lm")
    engine = make_engine(f"{mode_engine(mode)}:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), activations=activations,
                         cached_blocks=cached)
    opt = make_optimizer("adamw", LR)
    engine_step(engine, feeds, opt)  # warm-up: graphs planned, caches primed
    setup = _setup_done()
    wall, cpu, losses = [], [], []
    profiler = None
    if os.environ.get("PER_BLOCK_COST_PROFILE"):  # a cProfile of the timed steps, to that file
        import cProfile
        profiler = cProfile.Profile(time.process_time)  # CPU seconds, as the step's figure
        profiler.enable()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(engine_step(engine, feeds, opt))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.environ["PER_BLOCK_COST_PROFILE"])
    return {"mode": mode, "step_s": min(wall), "cpu_s": min(cpu), "train_mib": _peak_mib(),
            "peak_mib": max(setup, _peak_mib()), "setup_mib": setup, "losses": losses}


def _run_child(mode: str, steps: int, base_dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--steps", str(steps), "--base-dtype", base_dtype]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--base-dtype", default="float32", choices=("float32", "int8", "int4"))
    ap.add_argument("--child", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.base_dtype)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    best: dict[str, dict] = {}
    runs: list[dict] = []
    for p in range(args.passes):
        for mode in modes:
            row = _run_child(mode, args.steps, args.base_dtype)
            row["pass"] = p
            runs.append(row)
            print(f"pass {p} {mode:>22}: step {row['step_s']:.2f} s, cpu {row['cpu_s']:.2f} s, train "
                  f"{row['train_mib']:.0f} MiB, peak {row['peak_mib']:.0f} MiB, load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)
            if mode not in best or row["cpu_s"] < best[mode]["cpu_s"]:
                best[mode] = row
    base = best.get("recompute")
    # each mode also against its own engine's and activations' float32 run where there is one
    # (torch:per-block@int4 against torch:per-block): issue 31 target 6's ratio
    def float_twin(mode: str) -> dict | None:
        twin = mode.partition("@")[0]
        return best.get(twin) if twin != mode else None
    print(f"SmolLM2 LoRA r={RANK}, base {args.base_dtype}, one device, MNN, best of {args.passes} passes x "
          f"{args.steps} steps; load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':>22} {'step s':>7} {'cpu s':>7} {'x recompute':>11} {'x float32':>9} {'train MiB':>9} "
          f"{'peak MiB':>8}  losses")
    for mode in modes:
        r = best[mode]
        ratio = f"{r['cpu_s'] / base['cpu_s']:.2f}x" if base else "-"
        twin = float_twin(mode)
        own = f"{r['cpu_s'] / twin['cpu_s']:.2f}x" if twin else "-"
        print(f"{mode:>22} {r['step_s']:7.2f} {r['cpu_s']:7.2f} {ratio:>11} {own:>9} {r['train_mib']:9.0f} "
              f"{r['peak_mib']:8.0f}  " + ", ".join(f"{x:.5f}" for x in r["losses"]))
    if args.json:
        args.json.write_text(json.dumps({"best": best, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
