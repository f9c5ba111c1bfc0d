"""MNN's per-layer lines, warm (as `profile` measures them) against fresh (as a worker runs): issue 31 target 3.

`profile` measures PyTorch's keep and per-block lines of a repeated block kind (a decoder layer) in fresh
child processes (`runtime.profiling.fresh`), and MNN's in the profiling process, after it has built and
freed the other engines of the profile (warm). This compares the two on MNN for one model and LoRA shape:

  warm: `measure_block` as `profile_device` calls it (fresh=None: the MNN path), after the model's
        cheapest block kind ran (as in a profile), and the raw peaks of stages of 1..LEAN_RUN layers
        measured in this process right after;
  fresh: the same stages' peaks (`peak_workspace`), FRESH_PEAK_REPEATS each in a fresh child
        (`FreshProcesses`: a worker's first imports, nothing run), the line through their medians
        (`fresh_line`), and two micro-batches in flight (`fresh_in_flight`) for the kept bytes.

It prints both lines and what each charges a stage of N layers (workspace + (N - 1) x per further
layer; keeping: + (in flight - 1) x N x kept), MiB.

Usage
    python benchmarks/mnn_fresh_lines.py [--model PATH] [--base-dtype int4] [--layers 12] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

MIB = 2 ** 20


def measure(model: Path, base_dtype: str, seq: int = 128) -> dict:
    from ir.backend import parse_backend
    from jobs.common.lora import adapted
    from planner.lora import LoraSettings
    from planner.onnx_import import load_model
    from runtime.engines.stage import stage_spec
    from runtime.profiling.compute import peak_workspace
    from runtime.profiling.device import (FRESH_PEAK_REPEATS, LEAN_RUN, _most_repeated, distinct_blocks,
                                          measure_block)
    from runtime.profiling.fresh import FreshProcesses, fresh_in_flight, fresh_line, fresh_peaks
    from runtime.profiling.inputs import synthetic_feeds

    lora = LoraSettings(8, 16.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype=base_dtype)
    graph = adapted(load_model(model, 1, seq), lora)
    feeds = synthetic_feeds(graph, 0)
    backend = parse_backend("mnn:cpu:t1")
    kinds = distinct_blocks(graph)
    layer = _most_repeated(graph, kinds)
    i = layer.index
    lengths = range(1, LEAN_RUN + 1)
    scales = sorted(k for k in graph.constants if k.endswith(".q_scales"))[:1]
    dtype_before = [str(graph.constants[k].dtype) for k in scales]
    # fresh first: a warm MNN run widens the graph's int4 scales in place (float16 -> float32), which
    # the child's job file then refuses ("q_scales is float32, expected float16")
    with FreshProcesses(backend) as fresh:
        fresh_raw = {a: fresh_peaks(fresh, graph, feeds, i, lengths, a, FRESH_PEAK_REPEATS)
                     for a in ("keep", "per-block")}
        kept_fresh = fresh_in_flight(fresh, graph, feeds, i, fresh_raw["keep"], "keep", FRESH_PEAK_REPEATS)
        pb_kept_fresh = fresh_in_flight(fresh, graph, feeds, i, fresh_raw["per-block"], "per-block",
                                        FRESH_PEAK_REPEATS)
    # warm, as a profile does: the kinds in the profile's order (the layer after the embeddings)
    warm_cost = None
    for block in kinds.values():
        cost = measure_block(backend, graph, block, feeds, 1, None, 0)
        if block.index == i:
            warm_cost = cost
            break  # the LM head's kind comes after: not run before the layer in a profile either
    warm_raw = {a: [[peak_workspace(backend, stage_spec(graph, i, i + k - 1), feeds, a) for _ in range(3)]
                    for k in lengths] for a in ("keep", "per-block")}
    return {
        "model": str(model), "base_dtype": base_dtype, "layer": layer.name,
        "scale_dtype_before_after_warm": [dtype_before, [str(graph.constants[k].dtype) for k in scales]],
        "warm_profile": {"keep_workspace": warm_cost.workspace_bytes, "keep_stacked": warm_cost.stacked_bytes,
                         "kept": warm_cost.kept_bytes, "per_block_workspace": warm_cost.per_block_workspace_bytes,
                         "per_block_stacked": warm_cost.per_block_stacked_bytes},
        "warm_raw": warm_raw, "warm_raw_lines": {a: fresh_line(p) for a, p in warm_raw.items()},
        "fresh_raw": fresh_raw, "fresh_lines": {a: fresh_line(p) for a, p in fresh_raw.items()},
        "fresh_in_flight": {"keep": kept_fresh, "per-block": pb_kept_fresh},
    }


def report(r: dict, layers: int) -> str:
    w, (ks, kw), (ps, pw) = r["warm_profile"], r["fresh_lines"]["keep"], r["fresh_lines"]["per-block"]
    kept_f, _ = r["fresh_in_flight"]["keep"]

    def stage(ws, step):
        return (ws + (layers - 1) * step) / MIB

    out = [f"{r['model']} ({r['base_dtype']} LoRA), {r['layer']}, MiB:",
           "  medians of peaks by stage length 1..L (warm in this process | fresh children):"]
    for a in ("keep", "per-block"):
        warm = [f"{statistics.median(p) / MIB:.1f}" for p in r["warm_raw"][a]]
        fresh = [f"{statistics.median(p) / MIB:.1f}" for p in r["fresh_raw"][a]]
        out.append(f"    {a}: {' / '.join(warm)} | {' / '.join(fresh)}")
    out += [
        f"  keep: profile (warm) workspace {w['keep_workspace'] / MIB:.1f} + {w['keep_stacked'] / MIB:.1f} a further "
        f"layer, kept {w['kept'] / MIB:.1f}; fresh {kw / MIB:.1f} + {ks / MIB:.1f}, kept {kept_f / MIB:.1f}; "
        f"a {layers}-layer stage, one in flight: warm {stage(w['keep_workspace'], w['keep_stacked']):.1f}, fresh "
        f"{stage(kw, ks):.1f} ({stage(kw, ks) / stage(w['keep_workspace'], w['keep_stacked']):.2f}x)",
        f"  per-block: profile (warm) workspace {w['per_block_workspace'] / MIB:.1f} + "
        f"{(w['per_block_stacked'] or 0) / MIB:.1f} a further layer; fresh {pw / MIB:.1f} + {ps / MIB:.1f}; a "
        f"{layers}-layer stage: warm {stage(w['per_block_workspace'], w['per_block_stacked'] or 0):.1f}, fresh "
        f"{stage(pw, ps):.1f} ({stage(pw, ps) / stage(w['per_block_workspace'], w['per_block_stacked'] or 0):.2f}x)",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="an ONNX causal LM (default: SmolLM2-135M's export)")
    ap.add_argument("--base-dtype", default="int4")
    ap.add_argument("--layers", type=int, default=12, help="the stage length the lines are compared at")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.model is None:
        from benchmarks.llm import smollm2_model

        args.model = smollm2_model()
    r = measure(args.model, args.base_dtype)
    print(report(r, args.layers), flush=True)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
