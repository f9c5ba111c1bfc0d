"""Lost devices and secure links: what a failure costs, and what CURVE costs.

What it measures
    MiniLM (all-MiniLM-L6-v2) token classification, 9 labels, batch ``--batch`` x sequence
    ``--seq``, AdamW, 4 micro-batches, 1f1b-flush, the even split over 3 worker processes
    (`jobs.workers.LocalWorkers`, one compute thread each), this process the coordinator
    (`jobs.pipeline_training.train_pipeline`), the state copied to the coordinator after every
    step (the default fault policy: a recovery replays at most the interrupted step).
      * ``curve`` / ``insecure``: ``--steps`` steps with CURVE on every link, then the same in
        plaintext (``--insecure``); the step-time cost of CURVE is their ratio (target: at most 5%).
      * ``kill``: ``--steps`` steps; at a random step (``--seed``) a random worker gets SIGKILL a
        moment after the step before it finished; the run re-plans over the other two and goes on.
      * ``survivors``: the re-planned optimum, i.e. a fresh run on 2 workers with the plan the
        recovery chose, for the throughput the recovered run should reach.

Columns
    ``step s``        median seconds of a training step (the first step is warm-up, left out);
                      the state copy after each step is not in it (``copy s`` is).
    ``copy s``        median seconds per step of copying every stage's state to the coordinator.
    ``detect s``      SIGKILL to the coordinator reporting the worker lost (target: at most 3 s).
    ``recover s``     SIGKILL to the first step completed after the recovery (target: at most 10 s).
    ``replayed``      steps run again (at most the interrupted one).
    ``after/optimum`` median step time after the recovery over the survivors' fresh run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import NUM_LABELS, NoiseMeter, default_model, make_batches  # noqa: E402

M = 4


def _run(graph, batches, steps: int, insecure: bool = False, kill: tuple[int, int] | None = None, cuts=None,
         workers_n: int = 3) -> dict:
    from jobs.pipeline_training import train_pipeline
    from jobs.workers import LocalWorkers
    from runtime.pipeline.coordinator import PipelineConfig

    config = PipelineConfig("1f1b-flush", M, optimizer="adamw", lr=1e-4, timeout_s=300)
    workers = LocalWorkers.start(workers_n, threads=1, insecure=insecure)
    sent: dict = {}

    def on_step(step, *_):
        if kill is not None and step == kill[0] and not sent:
            sent["at"] = time.time()
            threading.Timer(0.05, os.kill, (workers.procs[kill[1]].pid, signal.SIGKILL)).start()

    try:
        with NoiseMeter() as noise:
            result = train_pipeline(graph, batches, NUM_LABELS, workers.addresses, config, steps, cuts=cuts,
                                    keys=workers.keys, insecure=insecure, on_step=on_step)
    finally:
        workers.wait(60.0)
    copies = result.snapshot_seconds
    out = {"step_s": statistics.median(result.step_seconds[1:]), "copy_s": statistics.median(copies) if copies else None,
           "others": noise.others, "ranges": [list(r) for r in result.ranges], "events": result.events,
           "step_seconds": result.step_seconds}
    if kill is not None:
        lost = next(e for e in result.events if e["event"] == "lost")
        recovered = next(e for e in result.events if e["event"] == "recovered")
        out.update(detect_s=lost["at"] - sent["at"], recover_s=recovered["at"] - sent["at"],
                   replayed=recovered["steps_replayed"], killed=kill,
                   after_s=statistics.median(result.step_seconds[recovered["step"]:] or [float("nan")]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="rows per batch (default %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="chooses the step and the worker killed")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    from planner.onnx_import import load_model

    graph = load_model(default_model(), args.batch // M, args.seq)
    batches = make_batches(args.steps + 1, batch=args.batch, seq=args.seq)
    rng = random.Random(args.seed)
    kill = (rng.randint(2, max(2, args.steps - 3)), rng.randrange(3))
    rows = {}
    for name, kwargs in (("curve", {}), ("insecure", {"insecure": True}), ("kill", {"kill": kill})):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows[name] = _run(graph, batches, args.steps, **kwargs)
    survivors = rows["kill"]["ranges"]
    print("running survivors ...", file=sys.stderr, flush=True)
    rows["survivors"] = _run(graph, batches, max(4, args.steps // 2), cuts=[survivors[1][0]], workers_n=2)
    kill_row = rows["kill"]
    cost = rows["curve"]["step_s"] / rows["insecure"]["step_s"] - 1
    print(f"MiniLM, batch {args.batch} x {args.seq}, {M} micro-batches, 1f1b-flush, 3 workers; "
          f"killed worker {kill[1]} during step {kill[0] + 1}")
    print(f"{'run':10s} {'step s':>8s} {'copy s':>8s} {'others':>7s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['step_s']:8.3f} {r['copy_s'] or 0:8.3f} {r['others'] or 0:7.0%}")
    print(f"CURVE vs insecure step time: {cost:+.1%} (target <= +5%)")
    print(f"detect {kill_row['detect_s']:.2f} s (target <= 3), recover {kill_row['recover_s']:.2f} s (target <= 10), "
          f"replayed {kill_row['replayed']} step(s), after/optimum "
          f"{kill_row['after_s'] / rows['survivors']['step_s']:.2f} (survivors' plan {survivors})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "curve_cost": cost}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
