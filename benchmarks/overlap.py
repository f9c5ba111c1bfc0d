"""Can a stage's optimizer step run on a second thread while its engine computes? (issue 14, lever 3)

What it measures
    Stage 0 of the pipeline benchmark's 2-process cut (MiniLM token classification, blocks 0-4,
    one micro-batch of 2 x 128) on one engine thread, and an AdamW step (runtime.optim, numpy)
    over that stage's dense weights (the embedding table left out: it is stepped by rows). Three
    figures, each for ``--reps`` forwards and ``--reps`` steps: the forwards alone, the steps alone,
    and both at once, the steps on a second Python thread. ``overlap`` = (serial - together) /
    (serial - the longer alone): 1 when the two run side by side, 0 when they take turns. A
    second thread can only overlap where both the engine's call and numpy release Python's GIL
    during their work; numpy does for large arrays.

Usage
    .venv/bin/python benchmarks/overlap.py [--engine mnn:cpu:t1] [--reps 6] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BATCH, NUM_LABELS, SEQ, default_model, make_batches  # noqa: E402

M = 4  # micro-batches per batch of 8, as benchmarks/pipeline.py


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--engine", default="mnn:cpu:t1", help="backend of the stage (default %(default)s)")
    parser.add_argument("--reps", type=int, default=6, help="forwards and steps per figure (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="the three figures this many times (default %(default)s)")
    parser.add_argument("--last-block", type=int, default=4, help="the stage's last block (default %(default)s)")
    args = parser.parse_args(argv)

    import numpy as np

    from planner.onnx_import import load_model
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.optim import make_optimizer
    from tasks.trainer import batch_feeds

    graph = load_model(str(default_model()), batch=BATCH // M, seq=SEQ)
    engine = make_engine(args.engine, stage_spec(graph, 0, args.last_block), take_weights=False)
    feeds = {k: v[:BATCH // M] for k, v in batch_feeds(make_batches(1)[0], NUM_LABELS).items()}
    tables = {n.inputs[0] for n in graph.nodes if n.op == "Gather"}
    params = {k: np.array(v, np.float32) for k, v in engine.parameters().items() if k not in tables}
    grads = {k: np.full_like(v, 1e-3) for k, v in params.items()}
    optimizer = make_optimizer("adamw", 1e-4)

    def forwards():
        for _ in range(args.reps):
            engine.forward(feeds, 0, train=False)

    def steps():
        for _ in range(args.reps):
            optimizer.step(params, grads)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def together() -> None:
        thread = threading.Thread(target=steps)
        thread.start()
        forwards()
        thread.join()

    forwards(), steps()  # warm-up: the engine builds its graphs, the optimizer its state
    n = sum(p.size for p in params.values())
    print(f"{args.engine}, blocks 0-{args.last_block}, {BATCH // M} x {SEQ}; AdamW over {n / 1e6:.1f} M dense "
          f"parameters; {args.reps} of each")
    print(f"{'forwards s':>11} {'steps s':>8} {'together s':>11} {'serial s':>9} {'overlap':>8}")
    shares = []
    for _ in range(args.rounds):
        f, u, b = timed(forwards), timed(steps), timed(together)
        share = (f + u - b) / min(f, u) if min(f, u) > 0 else 0.0
        shares.append(share)
        print(f"{f:11.2f} {u:8.2f} {b:11.2f} {f + u:9.2f} {share:8.0%}", flush=True)
    print(f"median overlap {statistics.median(shares):.0%} (100%: the step hides behind the forwards; 0%: they take "
          f"turns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
