"""The planner against reality and against baselines: prediction error, solve time, plan quality.

What it measures (four parts, ``--parts a,b,c,d``; all by default)

(a) Predicted vs measured step time, MiniLM on this machine.
    MiniLM (all-MiniLM-L6-v2) token classification, 9 labels, batch 8, sequence 128, ``M``
    micro-batches (default 4, so micro-batches of 2 rows), AdamW, float32. This machine is profiled
    once (``runtime.profiling.profile_device`` at the micro-batch shape, backend ``mnn:cpu:t1`` only,
    because every local worker runs one compute thread). The loopback link is measured with
    ``runtime.profiling.measure_link`` against a ``link_probe_server`` thread. For N = 2 and 3, a
    cluster of N identical devices (that profile, that link, a memory budget of a third of what
    the machine has free) is planned with ``solve_partition`` for each schedule (1f1b-flush, gpipe,
    1f1b-stash); if the solver prefers fewer than N stages, the best N-stage plan (all cut
    positions enumerated with ``manual_partition``) is used instead, so that N workers really run.
    The plan's step time is predicted two ways:
      ``cost``  ``planner.cost.predicted_step_s`` (DESIGN's formula: no compute/transfer overlap
                for flush schedules; the steady state m x bottleneck for 1f1b-stash);
      ``sim``   ``planner.simulate`` of the schedule's action lists with the same StageCosts
                (sends asynchronous, links busy one transfer at a time);
      ``sim×c`` the simulation with compute scaled by max(1, N / CPUs): a "contention-aware"
                figure for N single-threaded workers sharing this machine's CPUs (the planner
                assumes one device per stage, so with N > CPUs it must under-predict).
    Then ``jobs.train.pipeline.train_pipeline`` trains on N ``LocalWorkers`` (one thread each) with
    the plan's block ranges. Measured: flush schedules run ``--steps`` + 1 steps, the first is
    warm-up (MNN builds its sessions), the figure is the median of the rest. 1f1b-stash has no
    flush: train_pipeline runs all steps as one schedule, so it runs twice (1 and ``--steps`` + 1
    batches, fresh workers each) and the figure is the difference / ``--steps``: the marginal
    time per batch, warm-up and pipeline fill/drain cancelled, which is what m x bottleneck
    predicts (``sim`` is then the same difference of two simulations). ``err`` = measured /
    predicted - 1 (target: within 10 %). ``upd`` is the measured optimizer update per step of the
    slowest stage (the cost model predicts it from the profile's seconds per parameter byte); ``F+B`` lists, per stage, measured /
    predicted forward+backward ms per micro-batch. ``err cost|mc`` and ``err sim|mc`` compare with
    the cost formula and the simulation rerun on the *measured* per-stage forward, backward and
    update times (links as modelled; the formula gets the update added, the simulation runs it as
    the UPDATE actions): they separate the compute figures (profile, contention) from the schedule
    and transfer model, since the load of a shared machine moves the former by tens of percent.
    Co-located profile: local workers are not separate devices; two processes on this machine
    slow each other's blocks (shared caches and memory bandwidth: an encoder block's F+B 90 ms
    alone, 94-111 ms with a second profile running). So the same plans are also priced with a
    profile measured by min(N, CPUs) ``confidant profile`` processes at once, block times averaged
    (``cost·L``, ``sim·L``, ``sim·L×c``): the device as the worker really sees it here. On separate
    devices the plain profile is the right one.

(b) Planning time and optimality gap on synthetic models.
    Synthetic BERT-like models (an embedding block of MiniLM's size, then encoder-like blocks of
    random size, ±50 % around a MiniLM layer, then a head and a loss block) of 12, 48, 96 and 192
    blocks over 4, 8, 16 and 64 simulated devices. Each device gets a synthetic ``DeviceProfile``:
    every block's MiniLM-like time multiplied by the device's slowness, log-uniform in 1..10 (the
    fastest device is 1, the slowest 10), and a random memory budget (0.8x to 4x an equal share of
    the model's memory); links are random pairs of 100 Mbit/s, 500 Mbit/s or 1 Gbit/s with 0.2-3 ms
    latency. The instance comes from ``planner.partition.make_instance`` over a real ``Cluster``, as
    ``confidant plan`` builds it. Each case is planned twice, side by side in the same run, with
    ``--time-limit`` (default 10 s) and ``--solver-workers`` (default 8 CP-SAT workers), 1f1b-flush,
    4 micro-batches:
      ``new``     ``solve_partition_report``: the exact fixed-order DP (planner.partition.dp)
                  searched over device orders (every order when few, else iterated local search),
                  CP-SAT from the best plan where the model is small and has few blocks, and a
                  proven lower bound (Lagrangian relaxation of device distinctness, or the exact
                  subset relaxation on small clusters; planner.partition.bound). ``gap`` =
                  (step - that bound) / step is proven; ``how`` says who found the plan.
      ``cp-sat``  ``cpsat_partition``: the CP-SAT model alone from the greedy start (what
                  ``solve_partition`` was before the DP), its solver watched
                  (planner.partition.cpsat._solver is wrapped) for its status and best bound:
                  ``gap`` uses that bound (the objective itself when proven optimal).
    ``new/cp`` is the ratio of the two plans' predicted steps (at most 1: never worse), ``simple``
    the new plan's gap to a simple bound (no links, no memory, perfectly divisible work: sum over
    blocks of the fastest device's time + (m-1) x total work / the devices' summed speed). Two kinds
    of cluster: every device and link different (the hardest case for the solver), and 16 or 64
    devices that are copies of 8 device models with one link value per pair of models (what a real
    group of edge devices looks like; the solvers group interchangeable devices into classes).
    Building the CP-SAT model costs about 10 us per linear term (``planner.partition.model_size``);
    the CP-SAT-alone baseline is skipped where that estimate exceeds ``--max-build-s`` (default 60
    s); ``--no-b-baseline`` skips it everywhere (half the time).
    For reference, ``dp step s`` is the predicted step of part (c)'s memory-blind DP plan on the
    same instance (a valid plan, hence an upper bound on the optimum, when it fits).

(c) The solved plan vs an even split and vs PipeDream-style dynamic programming.
    Heterogeneous synthetic clusters (as in (b), speeds differing up to 10x) whose memories are
    tight: the budgets add up to 1.5x the model's memory, spread at random (0.3..1.7 shares)
    independently of speed. For 1f1b-flush, gpipe and 1f1b-stash, three plans:
      ``cp-sat``  ``solve_partition`` (memory-aware, link-aware, any device order: the fixed-order
                  DP searched over device orders, with CP-SAT where it helps; the label is kept
                  from when it was CP-SAT alone);
      ``even``    ``even_partition``: equal block counts over all devices in cluster order;
      ``dp``      PipeDream's partitioning DP without its memory term: contiguous block ranges over
                  the devices in cluster order (a device may be skipped), minimising the
                  bottleneck max(stage compute, 2 x boundary transfer), memory ignored.
    Each plan is checked with ``check_feasible`` (``fits``: no device over budget) and simulated
    (``planner.simulate`` with ``planner.cost.stage_costs``): throughput in samples/s for M = 4
    micro-batches of 2 rows (flush schedules: one step; 1f1b-stash: a run of 4M micro-batches, fill
    and drain included). A plan that does not fit would not run; its throughput is shown in
    parentheses for what it would be if memory did not matter. When CP-SAT finds no plan within the
    limit without proving that none exists, the first such schedule of each cluster is solved
    again with 6x the limit, to tell "none fits" from "none found in time".

(d) A real slow link: workers in network namespaces joined by a delayed, shaped link.
    N = 2 (and 3) workers each in its own network namespace, the coordinator in another. Every
    worker has a control interface on a bridge in the coordinator's namespace (unshaped: weights,
    inputs, losses and the final checkpoint travel there, which the cost model does not count).
    This kernel has no netem, so latency comes from a userspace delay line
    (``benchmarks/linkdelay.py``): each pair of workers gets two TUN devices, one in each
    namespace, and one relay process forwards every packet between them after a fixed one-way
    delay (``--d-delay``, default 5 ms, like home Wi-Fi; ``off``: a plain veth pair, latency only
    what veth and TCP give), with ``tc qdisc ... tbf rate R`` on each TUN's egress for the
    bandwidth (``--d-configs``, default ``2:100mbit,2:20mbit,3:100mbit``: N workers at rate R).
    The kernel's TCP runs over the delayed link unchanged (slow start included); the relay runs at
    real-time priority and reports its CPU (not counted in ``others``). /32 routes send
    worker-to-worker traffic over the pair. The link is measured through it (``confidant profile
    --serve-link`` in one worker namespace, ``--link`` from another), the cluster planned with that
    measured bandwidth and latency and the profile of (a), and ``confidant worker --listen
    tcp://<addr>:<port>`` runs in each namespace (``ip netns exec``); 1f1b-flush, ``--steps`` + 1
    steps, the first warm-up. Columns as in (a). Namespaces are removed at the end, also on
    failure. Needs root, ``ip`` and ``tc`` (iproute2); otherwise the part is skipped with a message.
    ``.venv/bin/python benchmarks/linkdelay.py --selftest`` checks the delay line alone (RTT,
    TCP throughput, order, loss, relay CPU).

Noise
    Every configuration records the share of all CPUs used by other processes while it ran
    (``others``, as benchmarks/engine.py and benchmarks/pipeline.py do); a warning is printed when
    it exceeds 10 %.

Usage
    .venv/bin/python benchmarks/planner.py [--parts a,b,c,d] [--json OUT] [--steps N]
        [--microbatches M] [--time-limit S] [--model PATH] [--d-delay 5ms|off] [--d-configs N:RATE,...]
    Without ``--model`` the default checkpoint is exported once to
    ``~/.cache/confidant/bench-minilm.onnx`` (shared with the other benchmarks). Part (b) takes
    about 9 minutes with its CP-SAT-alone baseline (about 4 with ``--no-b-baseline``); the other
    parts about 5 minutes together on 2 idle cores (more when other processes keep the CPUs busy).

Code
    This file is the command line; each part is one module of ``benchmarks/planner_parts/``
    (``part_a.py`` .. ``part_d.py``), with the helpers of parts (a) and (d) in ``minilm.py``, those
    of (b) and (c) in ``synthetic.py``, and constants and text helpers in ``shared.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where a sibling script named like a
# project package (benchmarks/planner.py) would shadow it, in this process and in every child
# started from this file: drop that entry and put the repository root first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

from benchmarks.common import NoiseMeter, default_model  # noqa: E402
from benchmarks.planner_parts.part_a import format_a, part_a  # noqa: E402
from benchmarks.planner_parts.part_b import format_b, part_b  # noqa: E402
from benchmarks.planner_parts.part_c import format_c, part_c  # noqa: E402
from benchmarks.planner_parts.part_d import child_d, format_d, part_d  # noqa: E402
from benchmarks.planner_parts.shared import BATCH, CPUS  # noqa: E402


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # run the finally blocks (namespaces, workers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c,d", help="comma-separated parts to run (default a,b,c,d)")
    ap.add_argument("--json", type=Path, default=None, help="also write all figures to this JSON file")
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (default: export MiniLM once)")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per configuration (default 3)")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch of 8 (default 4)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per case in (b) and (c) (default 10)")
    ap.add_argument("--solver-workers", type=int, default=8, help="CP-SAT workers in (b) and (c) (default 8)")
    ap.add_argument("--max-build-s", type=float, default=60.0,
                    help="(b): skip the CP-SAT-alone baseline where its estimated model building exceeds this "
                         "(default 60)")
    ap.add_argument("--b-baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="(b): also plan every case with the CP-SAT model alone, side by side (default on)")
    ap.add_argument("--d-configs", default="2:100mbit,2:20mbit,3:100mbit",
                    help="(d): WORKERS:TBF_RATE,... (default 2:100mbit,2:20mbit,3:100mbit)")
    ap.add_argument("--d-delay", default="5ms",
                    help="(d): one-way delay of the worker-to-worker links, added by the userspace delay line of "
                         "benchmarks/linkdelay.py (this kernel has no netem), e.g. 5ms, 0ms; 'off': plain veth "
                         "pairs, no delay line (default 5ms)")
    ap.add_argument("--child-d", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_d:
        return child_d(args.child_d)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in "abcd" or len(p) != 1 for p in parts):
        ap.error("--parts takes letters among a,b,c,d")
    if args.steps < 1 or args.microbatches < 1 or BATCH % args.microbatches:
        ap.error(f"--steps >= 1 and --microbatches dividing {BATCH}")
    from benchmarks.linkdelay import parse_delay

    try:
        d_delay = None if args.d_delay.strip().lower() in ("off", "none") else parse_delay(args.d_delay)
        d_configs = tuple((int(n), rate.strip()) for n, rate in (c.split(":") for c in args.d_configs.split(",")))
    except ValueError as e:
        ap.error(f"--d-delay/--d-configs: {e}")
    if not d_configs or any(n < 2 for n, _ in d_configs):
        ap.error("--d-configs needs entries WORKERS:RATE with WORKERS >= 2")
    signal.signal(signal.SIGTERM, _on_sigterm)
    model = args.model or (default_model() if {"a", "d"} & set(parts) else None)

    start = time.perf_counter()
    doc: dict = {"cpus": CPUS, "machine": platform.machine(), "python": platform.python_version(),
                 "parts": parts}
    out: list[str] = []
    runners = {
        "a": lambda: part_a(model, args.microbatches, args.steps, args.time_limit),
        "b": lambda: part_b(args.time_limit, args.solver_workers, args.max_build_s, baseline=args.b_baseline),
        "c": lambda: part_c(args.time_limit, args.solver_workers),
        "d": lambda: part_d(model, args.microbatches, args.steps, args.time_limit, d_configs, d_delay),
    }
    formatters = {"a": format_a, "b": format_b, "c": format_c, "d": format_d}
    for p in parts:
        t0 = time.perf_counter()
        with NoiseMeter() as noise:
            result = runners[p]()
        result["elapsed_s"] = time.perf_counter() - t0
        result["others_cpu"] = noise.others
        doc[p] = result
        text = formatters[p](result) + f"\n    [{result['elapsed_s']:.0f} s; other processes used " \
                                       f"{(noise.others or 0):.0%} of the CPUs]"
        print(text + "\n", flush=True)
        out.append(text)
    doc["elapsed_s"] = time.perf_counter() - start
    busy = []
    for p in ("a", "d"):
        for r in (doc.get(p) or {}).get("rows", []):
            if (r.get("others_cpu") or 0) > 0.10:
                busy.append(f"({p}) {r['workers']} workers {r['schedule']} {r['others_cpu']:.0%}")
    if busy:
        print("WARNING: other processes used more than 10 % of the CPUs during: " + ", ".join(busy)
              + "; those measured times are inflated.")
    print(f"total {doc['elapsed_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
