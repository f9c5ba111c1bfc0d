"""A plan worker's resident set phase by phase (issue 31, lever 2): where a device's peak comes from.

What it measures
    One device of an emitted plan whose folder holds base.safetensors, in this process, the way
    `confidant worker --base` sets up (runtime.pipeline.worker.setup_bundle): the bundle read without
    its base weights, the weights assembled from the rest and the base file (`rebuild_weights`),
    verified and parsed (`load_bundle`), the engine built with `take_weights`; then the stage runs
    the 1f1b-flush pattern of a first stage with 3 micro-batches in flight on random tokens (forwards
    m0..m2, backwards m0..m2, then m3), the gradient it gets back a constant. A first stage only
    (its inputs are token ids).

Output
    One line a phase: resident set (VmRSS) and peak (VmHWM) in MiB, the peak reset after the bundle
    is read (so the figures are the setup's and the steps', not the reading's).

Run
    python benchmarks/worker_phases.py PLAN_DIR DEVICE

Measured (SmolLM2-135M LoRA r=8 --base-dtype int4, 3 x 320 MiB, the first stage, blocks 0-15; planned
306 MiB, of which frozen + trainable + runtime 124, activations 12.7, workspace 164): weights assembled
105 MiB, engine built 136; the first forward +173 MiB (MNN keeps each block graph's intermediates
allocated after it ran, ~10.8 MiB a block, though the stage recomputes: about the workspace charged),
each further forward +5 (its block inputs), the first backward +30; steady 348 MiB. The same worker
under `confidant train PLAN --local` peaks at 369 MiB.
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np

from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes


def mark(what: str) -> None:
    print(f"{what:28s} rss {rss_bytes() / 2**20:7.1f}  peak {peak_rss_bytes() / 2**20:7.1f} MiB", flush=True)


def main(plan_dir: Path, device: str) -> None:
    mark("start")
    from ir.bundle import PLAN_BASE, WEIGHTS, load_plan, read_bundle_files
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.pipeline.bundles import load_bundle, plan_base, rebuild_weights, split_weights

    mark("imports")
    plan = load_plan(plan_dir)
    base = plan_base(plan_dir, plan)
    if base is None:
        raise SystemExit(f"{plan_dir}: the plan has no {PLAN_BASE}")
    files = read_bundle_files(plan_dir / device)
    local, rest = split_weights(files, base)
    del files[WEIGHTS]
    gc.collect()
    reset_peak_rss()
    mark("bundle read (the rest)")
    files[WEIGHTS] = rebuild_weights(rest, plan_dir / PLAN_BASE, local)
    del rest
    mark("weights assembled")
    contents = load_bundle(files, device)
    del files
    gc.collect()
    mark("verified, graph built")
    doc = contents.stage_doc
    spec = stage_spec(contents.graph, contents.first_block, contents.last_block)
    engine = make_engine(doc.backend_spec, spec, head_split=doc.head_split, activations=doc.activations,
                         take_weights=True)
    del contents
    gc.collect()
    mark("engine built")
    if contents_first := spec.first_block:
        raise SystemExit(f"{device} is not a first stage (blocks from {contents_first}): feeds are token ids only")
    rng = np.random.default_rng(0)
    feeds = {}
    for name in spec.graph_inputs:
        v = spec.graph.values[name]
        feeds[name] = np.ones(v.shape, np.int64) if "mask" in name else rng.integers(0, 1000, v.shape).astype(np.int64)
    outs = []
    for m in range(3):
        outs.append(engine.forward(feeds, m))
        mark(f"forward m{m}")
    for m in range(3):
        engine.backward(m, np.full_like(outs[m], 1e-3))
        mark(f"backward m{m}")
    out = engine.forward(feeds, 3)
    mark("forward m3")
    engine.backward(3, np.full_like(out, 1e-3))
    mark("backward m3")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmarks/worker_phases.py PLAN_DIR DEVICE")
    main(Path(sys.argv[1]), sys.argv[2])
