"""The planner against reality and against baselines: prediction error, solve time, plan quality.

What it measures (four parts, ``--parts a,b,c,d``; all by default)

(a) Predicted vs measured step time, MiniLM on this machine.
    MiniLM (all-MiniLM-L6-v2) token classification, 9 labels, batch 8, sequence 128, ``M``
    micro-batches (default 4, so micro-batches of 2 rows), AdamW, float32. This machine is profiled
    once (``runtime.profiling.compute.profile_device`` at the micro-batch shape, backend ``mnn:cpu:t1`` only,
    because every local worker runs one compute thread). The loopback link is measured with
    ``runtime.profiling.compute.measure_link`` against a ``link_probe_server`` thread. For N = 2 and 3, a
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
    Then ``jobs.pipeline_training.train_pipeline`` trains on N ``LocalWorkers`` (one thread each) with
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
    ``confidant plan`` builds it. ``solve_partition(inst, time_limit_s=--time-limit)`` (default
    10 s, default 8 CP-SAT workers, 1f1b-flush, 4 micro-batches) is timed; its CP-SAT solver is
    watched (planner.partition._solver is wrapped, nothing else changes) to read its status and
    best bound. ``gap`` = (objective - lower bound) / objective, the lower bound being the objective
    itself when proven optimal, CP-SAT's best bound otherwise. ``gap simple`` uses a simple bound
    instead (no links, no memory, perfectly divisible work: sum over blocks of the fastest device's
    time + (m-1) x total work / the devices' summed speed). Two kinds of cluster: every device and
    link different (the hardest case for the solver), and 16 or 64 devices that are copies of 8
    device models with one link value per pair of models (what a real group of edge devices looks
    like; the solver groups interchangeable devices into classes, so its model grows with the
    classes, not the devices). Building the CP-SAT model costs about 10 us per linear term
    (``planner.partition.model_size``); combinations whose estimate exceeds ``--max-build-s``
    (default 60 s) are skipped and listed.
    For reference, ``dp step s`` is the predicted step of part (c)'s memory-blind DP plan on the
    same instance (a valid plan, hence an upper bound on the optimum, when it fits).

(c) The solved plan vs an even split and vs PipeDream-style dynamic programming.
    Heterogeneous synthetic clusters (as in (b), speeds differing up to 10x) whose memories are
    tight: the budgets add up to 1.5x the model's memory, spread at random (0.3..1.7 shares)
    independently of speed. For 1f1b-flush, gpipe and 1f1b-stash, three plans:
      ``cp-sat``  ``solve_partition`` (memory-aware, link-aware, any device order);
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
    ``~/.cache/confidant/bench-minilm.onnx`` (shared with the other benchmarks). About 5 minutes
    on 2 idle cores with the defaults (7-8 minutes when other processes keep the CPUs busy).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where a sibling script named like a
# project package (benchmarks/planner.py) would shadow it, in this process and in every child
# started from this file: drop that entry and put the repository root first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

from benchmarks.common import NoiseMeter, default_model, machine_busy_s, make_batches, own_cpu_s  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

BATCH, SEQ, NUM_LABELS, VOCAB = 8, 128, 9, 30522
LR = 1e-4
OPTIMIZER = "adamw"
SCHEDULES = ("1f1b-flush", "gpipe", "1f1b-stash")
MARKER = "CONFIDANT_BENCH "
BACKEND = "mnn:cpu:t1"
CPUS = os.cpu_count() or 1


# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    allrows = [header] + rows
    widths = [max(len(r[i]) for r in allrows) for i in range(len(header))]
    lines = [" ".join(c.rjust(w) for c, w in zip(r, widths)) for r in allrows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Planning a MiniLM cluster and predicting its step (parts a and d)
# --------------------------------------------------------------------------

_PROFILE_CACHE: dict = {}


def profile_here(graph, reps: int = 5):
    """This machine's profile at the micro-batch shape, one compute thread (cached per run)."""
    from runtime.profiling.compute import profile_device

    key = (graph.batch, graph.seq)
    if key not in _PROFILE_CACHE:
        start = time.perf_counter()
        prof = profile_device(graph, "this-machine", backends=(BACKEND,), reps=reps, attention=False)
        _PROFILE_CACHE[key] = (prof, time.perf_counter() - start)
    return _PROFILE_CACHE[key]


def profile_corun(model: Path, graph, copies: int, reps: int = 5):
    """This machine's profile measured by `copies` `confidant profile` processes at once (one
    compute thread each), block times averaged over them: what one of `copies` co-located workers
    sees, since workers that share a machine share its caches and memory bandwidth (two MNN
    processes slow each other's encoder block by 4-23 % here). Separate devices would not."""
    import dataclasses

    from ir.profile import BackendProfile, BlockCost, DeviceProfile

    key = (graph.batch, graph.seq, copies)
    if key in _PROFILE_CACHE:
        return _PROFILE_CACHE[key]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"p{i}.json" for i in range(copies)]
        procs = [subprocess.Popen([sys.executable, "-m", "confidant", "profile", "--model", str(model),
                                   "--batch", str(graph.batch), "--seq", str(graph.seq), "--backends", BACKEND,
                                   "--no-attention", "--reps", str(reps), "--name", f"corun{i}", "-o", str(out)],
                                  cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i, out in enumerate(outs)]
        for proc in procs:
            _, err = proc.communicate(timeout=900)
            if proc.returncode:
                raise RuntimeError(f"co-run profile failed: {err[-2000:]}")
        profs = [DeviceProfile.from_json(json.loads(out.read_text()), str(out)) for out in outs]
    first = profs[0]
    blocks = {}
    for sig in first.backends[0].blocks:
        cs = [pr.backends[0].blocks[sig] for pr in profs]
        mean = lambda f: statistics.fmean(getattr(c, f) for c in cs)  # noqa: E731
        blocks[sig] = BlockCost(mean("forward_s"), mean("backward_s"), mean("recompute_s"),
                                max(c.workspace_bytes for c in cs))
    rates = {k: statistics.fmean(pr.update_s_per_param_byte.get(k, 0.0) for pr in profs)
             for k in first.update_s_per_param_byte}
    merged = dataclasses.replace(first, name=f"this-machine-x{copies}",
                                 backends=(BackendProfile(BACKEND, blocks),), update_s_per_param_byte=rates,
                                 accumulate_s_per_param_byte=statistics.fmean(
                                     pr.accumulate_s_per_param_byte for pr in profs))
    _PROFILE_CACHE[key] = (merged, time.perf_counter() - start)
    return _PROFILE_CACHE[key]


def loopback_link():
    """measure_link against a link_probe_server thread on 127.0.0.1."""
    from runtime.profiling.compute import link_probe_server, measure_link

    ready = threading.Event()
    box = {}

    def serve():
        link_probe_server("tcp://127.0.0.1:0", sessions=1, ready=lambda a: (box.update(addr=a), ready.set()))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    if not ready.wait(30):
        raise RuntimeError("link probe server did not start")
    link = measure_link(box["addr"])
    t.join(30)
    return link


def identical_cluster(profile, n: int, link, budget: int):
    from planner.cluster import Cluster, DeviceSpec

    devices = tuple(DeviceSpec(f"w{i}", f"tcp://w{i}", profile, budget, BACKEND) for i in range(n))
    return Cluster(devices, link, {})


def plan_n_stages(inst, n: int, time_limit_s: float):
    """solve_partition's plan; when it uses fewer than n stages, the best n-stage plan instead
    (every cut position, devices in cluster order: they are identical here)."""
    from planner.partition import check_feasible, manual_partition, predicted_step_us, solve_partition

    t0 = time.perf_counter()
    solved = solve_partition(inst, time_limit_s=time_limit_s)
    solve_s = time.perf_counter() - t0
    if len(solved.stages) == n:
        return solved, solved, solve_s
    best = None
    for cuts in itertools.combinations(range(1, inst.blocks), n - 1):
        part = manual_partition(inst, list(inst.devices[:n]), list(cuts))
        if check_feasible(part, inst):
            continue
        value = predicted_step_us(inst, part)
        if best is None or value < best[0]:
            best = (value, part)
    return (best[1] if best else solved), solved, solve_s


def _scaled(costs, factor: float):
    from dataclasses import replace

    return [replace(c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor) for c in costs]


def simulated_step_s(costs, schedule: str, M: int, steps: int) -> float:
    """planner.simulate's step; for 1f1b-stash the marginal time per batch, (steps+1 batches - 1) / steps,
    as measured. UPDATE actions take `update_s` (under 1f1b-stash one follows every backward)."""
    from planner.schedule import make_schedule
    from planner.simulate import simulate

    p = len(costs)
    if schedule == "1f1b-stash":
        long = simulate(make_schedule(schedule, p, (steps + 1) * M), costs).makespan_s
        short = simulate(make_schedule(schedule, p, M), costs).makespan_s
        return (long - short) / steps
    return simulate(make_schedule(schedule, p, M), costs).step_s


def measured_compute_sim(graph, cluster, partition, schedule: str, M: int, steps: int, meas: dict) -> float:
    """The simulation again, with each stage's forward, backward and update as measured in the run
    (links still the model's): what is left of the error is the schedule/transfer model's."""
    from dataclasses import replace

    from planner.cost import stage_costs

    costs = stage_costs(graph, cluster, partition, schedule, M, OPTIMIZER)
    per_update = M if schedule == "1f1b-stash" else 1  # update_every=1: one UPDATE per backward
    costs = [replace(c, forward_s=f, backward_s=b, update_s=u / per_update)
             for c, f, b, u in zip(costs, meas["stage_f_s"], meas["stage_b_s"], meas["update_s"])]
    return simulated_step_s(costs, schedule, M, steps)


def measured_compute_cost(graph, cluster, partition, schedule: str, M: int, meas: dict) -> float:
    """planner.cost.predicted_step_s on the measured per-stage forward and backward, plus the measured
    update (flush: the slowest stage's one update per step; 1f1b-stash: each stage's M updates folded
    into its per-micro-batch compute)."""
    from dataclasses import replace

    from planner.cost import predicted_step_s, stage_costs

    costs = stage_costs(graph, cluster, partition, schedule, M, OPTIMIZER)
    if schedule == "1f1b-stash":
        costs = [replace(c, forward_s=f, backward_s=b + u / M)
                 for c, f, b, u in zip(costs, meas["stage_f_s"], meas["stage_b_s"], meas["update_s"])]
        return predicted_step_s(costs, schedule, M)
    costs = [replace(c, forward_s=f, backward_s=b) for c, f, b in zip(costs, meas["stage_f_s"], meas["stage_b_s"])]
    return predicted_step_s(costs, schedule, M) + max(meas["update_s"])


def predictions(graph, cluster, partition, schedule: str, M: int, steps: int, workers: int) -> dict:
    """cost-model and simulated step seconds (and the contention-aware simulation)."""
    from planner.cost import predicted_step_s, stage_costs

    costs = stage_costs(graph, cluster, partition, schedule, M, OPTIMIZER)
    factor = max(1.0, workers / CPUS)

    def sim(cs) -> float:
        return simulated_step_s(cs, schedule, M, steps)

    return {"cost_s": predicted_step_s(costs, schedule, M), "sim_s": sim(costs),
            "stage_f_s": [c.forward_s for c in costs], "stage_b_s": [c.backward_s for c in costs],
            "sim_contention_s": sim(_scaled(costs, factor)), "contention_factor": factor,
            "stage_fb_s": [c.forward_s + c.backward_s for c in costs],
            "stage_link_s": [c.send_act_s + c.send_grad_s for c in costs]}


def plan_and_predict(graph, profile, loaded, n: int, link, schedule: str, M: int, steps: int, time_limit: float):
    """Plan N identical devices (`profile`, `link`, a third of free memory each) and price the plan
    with that profile and, under "colocated", with the co-located one (`profile_corun`).
    Returns (partition, the solver's own plan, solve seconds, predictions)."""
    from planner.partition import make_instance

    budget = profile.memory_available_bytes // 3
    cluster = identical_cluster(profile, n, link, budget)
    part, solved, solve_s = plan_n_stages(make_instance(graph, cluster, schedule, M, OPTIMIZER), n, time_limit)
    pred = predictions(graph, cluster, part, schedule, M, steps, n)
    pred["colocated"] = predictions(graph, identical_cluster(loaded, n, link, budget), part, schedule, M, steps, n)
    return part, solved, solve_s, pred


def summarize_training(res, schedule: str, M: int) -> dict:
    """Per-step figures of one train_pipeline result (flush schedules: per step; stash: totals)."""
    reports = res.stage_reports if schedule != "1f1b-stash" else res.stage_reports[:1]
    per_step = []
    for done in reports:
        per_step.append([{"F": d["seconds"].get("F", 0.0), "B": d["seconds"].get("B", 0.0),
                          "UPDATE": d["seconds"].get("UPDATE", 0.0), "wall_s": d["wall_s"],
                          "seconds": d["seconds"]} for d in done])
    return {"step_seconds": res.step_seconds, "losses": res.losses, "per_step": per_step,
            "peak_rss_mb": [d["peak_rss_bytes"] / 2**20 for d in res.stage_reports[-1]]}


def measured_figures(runs: list[dict], schedule: str, M: int, steps: int) -> dict:
    """The measured step time and per-stage F+B per micro-batch / update per step."""
    if schedule == "1f1b-stash":
        short, long = runs
        t_short, t_long = sum(short["step_seconds"]), sum(long["step_seconds"])
        step = (t_long - t_short) / steps
        pairs = list(zip(long["per_step"][0], short["per_step"][0]))
        f = [(a["F"] - b["F"]) / (steps * M) for a, b in pairs]
        b_ = [(a["B"] - b["B"]) / (steps * M) for a, b in pairs]
        upd = [(a["UPDATE"] - b["UPDATE"]) / steps for a, b in pairs]
        return {"step_s": step, "stage_fb_s": [x + y for x, y in zip(f, b_)], "stage_f_s": f, "stage_b_s": b_,
                "update_s": upd, "whole_run_s": {"short": t_short, "long": t_long}}
    run = runs[0]
    timed = run["per_step"][1:] or run["per_step"]
    p = len(timed[0])
    return {"step_s": _median(run["step_seconds"][1:] or run["step_seconds"]),
            "stage_fb_s": [_median([(st[s]["F"] + st[s]["B"]) / M for st in timed]) for s in range(p)],
            "stage_f_s": [_median([st[s]["F"] / M for st in timed]) for s in range(p)],
            "stage_b_s": [_median([st[s]["B"] / M for st in timed]) for s in range(p)],
            "update_s": [_median([st[s]["UPDATE"] for st in timed]) for s in range(p)],
            "all_steps_s": run["step_seconds"]}


def compare_row(pred: dict, meas: dict) -> dict:
    m = meas["step_s"]
    return {"err_cost": m / pred["cost_s"] - 1, "err_sim": m / pred["sim_s"] - 1,
            "err_sim_contention": m / pred["sim_contention_s"] - 1,
            "err_sim_measured_compute": m / pred["sim_measured_compute_s"] - 1,
            "err_cost_measured_compute": m / pred["cost_measured_compute_s"] - 1}


def _fb_text(meas: dict, pred: dict) -> str:
    return ",".join(f"{m * 1000:.0f}/{p * 1000:.0f}" for m, p in zip(meas["stage_fb_s"], pred["stage_fb_s"]))


# --------------------------------------------------------------------------
# Part (a): local workers on loopback
# --------------------------------------------------------------------------

def train_local(graph, batches, ranges, schedule: str, M: int, n_steps: int) -> dict:
    from jobs.pipeline_training import LocalWorkers, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig

    workers = LocalWorkers.start(len(ranges), threads=1)
    try:
        config = PipelineConfig(schedule=schedule, microbatches=M, optimizer=OPTIMIZER, lr=LR, timeout_s=300)
        cuts = [a for a, _ in ranges[1:]]
        res = train_pipeline(graph, batches, NUM_LABELS, workers.addresses, config, n_steps, cuts=cuts or None)
    finally:
        codes = workers.wait(60.0)
    if any(codes):
        raise RuntimeError(f"workers exited with {codes}")
    return summarize_training(res, schedule, M)


def part_a(model: Path, M: int, steps: int, time_limit: float, stages=(2, 3)) -> dict:
    from planner.onnx_import import load_model

    graph = load_model(str(model), BATCH // M, SEQ)
    _log(f"(a) profiling this machine ({BACKEND}, micro-batch {graph.batch} x {graph.seq}) ...")
    with NoiseMeter() as prof_noise:
        profile, prof_s = profile_here(graph)
    copies = min(max(stages), CPUS)
    _log(f"(a) profiling this machine with {copies} profiles at once (co-located workers) ...")
    with NoiseMeter() as corun_noise:
        loaded, corun_s = profile_corun(model, graph, copies)
    link = loopback_link()
    _log(f"(a) profile {prof_s:.1f} s; loopback link {link.bandwidth_bytes_per_s * 8 / 1e9:.2f} Gbit/s, "
         f"latency {link.latency_s * 1e6:.0f} us")
    batches = make_batches(steps + 1)
    rows = []
    for n in stages:
        cluster = identical_cluster(profile, n, link, profile.memory_available_bytes // 3)
        for schedule in SCHEDULES:
            part, solved, solve_s, pred = plan_and_predict(graph, profile, loaded, n, link, schedule, M, steps,
                                                           time_limit)
            ranges = [tuple(r) for r in part.ranges]
            _log(f"(a) {n} workers {schedule}: ranges {ranges}, predicted {pred['cost_s']:.3f} s; training ...")
            with NoiseMeter() as noise:
                if schedule == "1f1b-stash":
                    runs = [train_local(graph, batches, ranges, schedule, M, 1),
                            train_local(graph, batches, ranges, schedule, M, steps + 1)]
                else:
                    runs = [train_local(graph, batches, ranges, schedule, M, steps + 1)]
            meas = measured_figures(runs, schedule, M, steps)
            pred["sim_measured_compute_s"] = measured_compute_sim(graph, cluster, part, schedule, M, steps, meas)
            pred["cost_measured_compute_s"] = measured_compute_cost(graph, cluster, part, schedule, M, meas)
            row = {"workers": n, "schedule": schedule, "ranges": ranges, "solver_stages": len(solved.stages),
                   "solver_optimal": solved.optimal, "solve_s": solve_s, "predicted": pred, "measured": meas,
                   **compare_row(pred, meas), "others_cpu": noise.others, "runs": runs}
            _log(f"    measured {meas['step_s']:.3f} s ({row['err_cost']:+.1%} vs cost, {row['err_sim']:+.1%} vs sim); "
                 f"others {noise.others or 0:.0%}")
            rows.append(row)
    return {"model": str(model), "batch": BATCH, "seq": SEQ, "microbatches": M, "steps": steps,
            "profile": profile.to_json(), "profile_s": prof_s, "profile_others_cpu": prof_noise.others,
            "colocated_profile": loaded.to_json(), "colocated_copies": copies, "colocated_profile_s": corun_s,
            "colocated_others_cpu": corun_noise.others,
            "loopback_link": {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
            "rows": rows}


def _pred_meas_rows(rows: list[dict], extra=lambda r: []) -> list[list[str]]:
    out = []
    for r in rows:
        p, m = r["predicted"], r["measured"]
        out.append([str(r["workers"]), *extra(r), r["schedule"], " ".join(f"{a}-{b}" for a, b in r["ranges"]),
                    _s(p["cost_s"]), _s(p["sim_s"]), _s(p["sim_contention_s"]), _s(m["step_s"]),
                    _pct(r["err_cost"]), _pct(r["err_sim"]), _pct(r["err_sim_contention"]),
                    _pct(r["err_cost_measured_compute"]), _pct(r["err_sim_measured_compute"]),
                    _ms(max(m["update_s"])), _fb_text(m, p),
                    "-" if r.get("others_cpu") is None else f"{r['others_cpu']:.0%}"])
    return out


PRED_HEADER = ["cost s", "sim s", "sim×c s", "meas s", "err cost", "err sim", "err sim×c", "err cost|mc", "err sim|mc",
               "upd ms",
               "F+B ms/mb meas/pred per stage", "others"]


def _colocated_lines(rows: list[dict]) -> list[str]:
    """The same plans priced with the co-located profile (profile_corun), next to the measurement."""
    rows = [r for r in rows if r["predicted"].get("colocated")]
    if not rows:
        return []
    lines = [f"    the same plans priced with a co-located profile (min(N, {CPUS}) profiles measured at once, block "
             f"times averaged: workers on one machine share its caches and memory bandwidth): cost·L, sim·L, and "
             f"sim·L×c (compute x max(1, N/{CPUS}) for time-sharing when workers outnumber CPUs)"]
    table = []
    for r in rows:
        c, m = r["predicted"]["colocated"], r["measured"]["step_s"]
        table.append([str(r["workers"]), r["schedule"], r.get("rate", "-"), _s(c["cost_s"]), _s(c["sim_s"]),
                      _s(c["sim_contention_s"]), _s(m), _pct(m / c["cost_s"] - 1), _pct(m / c["sim_s"] - 1),
                      _pct(m / c["sim_contention_s"] - 1), " ".join(f"{x * 1e3:.0f}" for x in c["stage_fb_s"])])
    return lines + _table(table, ["N", "schedule", "link", "cost·L s", "sim·L s", "sim·L×c s", "meas s", "err cost·L",
                                  "err sim·L", "err sim·L×c", "F+B ms/mb pred·L"])


def format_a(a: dict) -> str:
    link = a["loopback_link"]
    lines = [f"(a) predicted vs measured step time: MiniLM, batch {a['batch']} x seq {a['seq']}, "
             f"M={a['microbatches']} micro-batches, {OPTIMIZER}, {a['steps']} timed steps, local workers on "
             f"{CPUS} CPUs",
             f"    loopback link measured {link['bandwidth_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, "
             f"{link['latency_s'] * 1e6:.0f} us; profile {BACKEND} in {a['profile_s']:.0f} s "
             f"(others {a['profile_others_cpu'] or 0:.0%}); "
             f"sim×c = compute x max(1, N/{CPUS}); err = measured / predicted - 1",
             "    cost|mc, sim|mc = the cost formula and the simulation on each stage's measured F, B and update "
             "(links as modelled): the error left to the schedule/link model once the compute figures are right"]
    lines += _table(_pred_meas_rows(a["rows"]), ["N", "schedule", "blocks", *PRED_HEADER])
    lines += _colocated_lines(a["rows"])
    forced = [r for r in a["rows"] if r["solver_stages"] != r["workers"]]
    for r in forced:
        lines.append(f"    note: for {r['workers']} workers / {r['schedule']} the solver chose {r['solver_stages']} "
                     f"stage(s); the best {r['workers']}-stage plan was run")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Synthetic clusters (parts b and c)
# --------------------------------------------------------------------------

MINILM = {"emb_params": 47_674_368, "layer_params": 7_097_856, "head_params": 13_860, "act": 393_216,
          "head_act": 9_216, "emb_s": 0.032, "layer_s": 0.163, "head_s": 0.0004, "loss_s": 0.0001,
          "emb_ws": 52 << 20, "layer_ws": 53 << 20, "overhead": 47 << 20}


def synthetic_graph(n_blocks: int, rng: random.Random):
    """An IR graph with only blocks (no nodes): what the planner reads. Returns (graph, work_s, workspace)."""
    from ir.graph import Block, Graph

    if n_blocks < 4:
        raise ValueError("a synthetic model needs at least 4 blocks")
    blocks, work, ws = [], [], []
    for k in range(n_blocks):
        if k == 0:
            kind, params, act, w, wsb = "embeddings", MINILM["emb_params"], MINILM["act"], MINILM["emb_s"], MINILM["emb_ws"]
        elif k == n_blocks - 1:
            kind, params, act, w, wsb = "loss", 0, 4, MINILM["loss_s"], 100 << 10
        elif k == n_blocks - 2:
            kind, params, act, w, wsb = "head", MINILM["head_params"], MINILM["head_act"], MINILM["head_s"], 2 << 20
        else:
            scale = rng.uniform(0.5, 1.5)
            kind, params, act = "encoder", int(MINILM["layer_params"] * scale), MINILM["act"]
            w, wsb = MINILM["layer_s"] * scale, int(MINILM["layer_ws"] * scale)
        # flops = k + 1 keeps every block's signature distinct, so each has its own cost entry
        blocks.append(Block(k, f"{kind}.{k}", kind, (), (), (), f"act{k}", (), params, act, k + 1))
        work.append(w)
        ws.append(wsb)
    graph = Graph(f"synthetic-{n_blocks}", (), (), (), {}, {}, (), tuple(blocks), BATCH // 4, SEQ)
    return graph, work, ws


def model_memory_bytes(graph, ws, schedule: str, M: int, stages: int) -> int:
    """Memory of the whole model split over `stages` stages, each counted at stage 0's (worst) position."""
    from planner.cost import block_input_bytes, in_flight_microbatches, weight_copies

    wc = weight_copies(schedule, OPTIMIZER, stages, 0, M)
    fl = in_flight_microbatches(schedule, stages, 0, M)
    inputs = block_input_bytes(graph)
    return (stages * MINILM["overhead"]
            + sum(b.params_bytes * wc + i * fl + w for b, i, w in zip(graph.blocks, inputs, ws)))


def synthetic_cluster(graph, work, ws, n_devices: int, rng: random.Random, schedule: str, M: int,
                      budget_mode: str, kinds: int | None = None):
    """Devices with synthetic profiles: slowness log-uniform in 1..10 (1 and 10 both present),
    budgets 'loose' (0.8..4 equal shares each) or 'tight' (summing to TIGHT_SLACK x the model's memory).

    `kinds`: the devices are copies of that many device models (slowness and budget per model,
    one random link per pair of models), as in a household or lab of repeated phones and boards;
    None: every device and every link differs."""
    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
    from planner.cluster import Cluster, DeviceSpec

    k = n_devices if kinds is None else min(kinds, n_devices)
    slow_k = [1.0, 10.0][:k] + [math.exp(rng.uniform(0, math.log(10))) for _ in range(k - 2)]
    rng.shuffle(slow_k)
    kind = list(range(n_devices)) if kinds is None else [d % k for d in range(n_devices)]
    stages = min(n_devices, len(graph.blocks))
    need = model_memory_bytes(graph, ws, schedule, M, stages)
    if budget_mode == "loose":
        budget_k = [int(need / stages * rng.uniform(0.8, 4.0)) for _ in range(k)]
    else:
        shares = [rng.uniform(0.3, 1.7) for _ in range(k)]
        total = sum(shares[kind[d]] for d in range(n_devices))
        budget_k = [int(TIGHT_SLACK * need * s / total) for s in shares]
    slow = [slow_k[kind[d]] for d in range(n_devices)]
    budgets = [budget_k[kind[d]] for d in range(n_devices)]
    sigs = [block_signature(b) for b in graph.blocks]
    devices = []
    for d in range(n_devices):
        costs = {sig: BlockCost(w * slow[d] / 3, 2 * w * slow[d] / 3, 0.0, wsb) for sig, w, wsb in zip(sigs, work, ws)}
        prof = DeviceProfile(f"dev{d}", graph.name, graph.batch, graph.seq, (BackendProfile(BACKEND, costs),),
                             budgets[d], MINILM["overhead"])
        devices.append(DeviceSpec(f"dev{d}", f"tcp://dev{d}:5555", prof, budgets[d], BACKEND))
    link_k = {}
    for a in range(k):
        for b in range(a, k):
            link_k[(a, b)] = Link(rng.choice((100e6 / 8, 500e6 / 8, 1e9 / 8)), rng.uniform(0.2e-3, 3e-3))
    pairs = {(f"dev{a}", f"dev{b}"): link_k[tuple(sorted((kind[a], kind[b])))]
             for a, b in itertools.combinations(range(n_devices), 2)}
    return Cluster(tuple(devices), Link(100e6 / 8, 1e-3), pairs), slow, budgets


TIGHT_SLACK = 1.5  # part (c): the budgets add up to this multiple of the model's memory


BUILD_US_PER_TERM = 10.0  # measured on this machine (5-15 us per term)


def simple_lower_bound_us(inst) -> int:
    """No links, no memory, perfectly divisible work."""
    nd, n, m = len(inst.devices), inst.blocks, inst.microbatches
    fastest = [min(inst.compute_us[d][k] for d in range(nd)) for k in range(n)]
    fluid = 1.0 / sum(1.0 / max(1, sum(inst.compute_us[d])) for d in range(nd))
    bottleneck = max(fluid, max(fastest))
    if inst.schedule == "1f1b-stash":
        return int(m * bottleneck)
    return int(sum(fastest) + (m - 1) * bottleneck)


def watched_solve(inst, time_limit_s: float, workers: int):
    """solve_partition with its CP-SAT solvers recorded: (partition or error, wall s, per-p records)."""
    from planner import partition as P

    records = []
    original = P._solver

    def recording_solver(seconds, w, seed):
        solver = original(seconds, w, seed)
        rec = {"limit_s": seconds}
        inner = solver.solve

        def solve(model, *args, **kwargs):
            t0 = time.perf_counter()
            status = inner(model, *args, **kwargs)
            rec.update(status=solver.status_name(status), wall_s=time.perf_counter() - t0,
                       bound=solver.best_objective_bound,
                       objective=solver.objective_value if solver.status_name(status) in ("OPTIMAL", "FEASIBLE")
                       else None)
            return status

        solver.solve = solve
        records.append(rec)
        return solver

    P._solver = recording_solver
    t0 = time.perf_counter()
    try:
        result = P.solve_partition(inst, time_limit_s=time_limit_s, workers=workers)
    except (P.PlanDoesNotFit, TimeoutError, RuntimeError) as exc:
        # PlanDoesNotFit: no plan fits (or none found in time); TimeoutError: no assignment at all;
        # RuntimeError: solve_partition's own check caught an answer it disagrees with
        result = exc
    finally:
        P._solver = original
    return result, time.perf_counter() - t0, records


# --------------------------------------------------------------------------
# Part (b): planning time and optimality gap
# --------------------------------------------------------------------------

def part_b(time_limit: float, workers: int, max_build_s: float, blocks=(12, 48, 96, 192),
           devices=(4, 8, 16, 64), kinds=(None, 8), M: int = 4, schedule: str = "1f1b-flush", seed: int = 0) -> dict:
    from planner.partition import (PlanDoesNotFit, check_feasible, make_instance, manual_partition, model_size,
                                   predicted_step_us)

    rows = []
    for kind in kinds:
        for nd in devices:
            if kind is not None and nd <= kind:
                continue  # as many kinds as devices: the distinct rows already cover it
            for n in blocks:
                rng = random.Random(seed * 1000 + nd * 7 + n)
                graph, work, ws = synthetic_graph(n, rng)
                cluster, slow, budgets = synthetic_cluster(graph, work, ws, nd, rng, schedule, M, "loose", kind)
                inst = make_instance(graph, cluster, schedule, M, OPTIMIZER)
                size = model_size(inst)
                label = "all distinct" if kind is None else f"{kind} kinds"
                est = size["terms"] * BUILD_US_PER_TERM / 1e6
                row = {"devices": nd, "kinds": kind, "blocks": n, "classes": size["classes"],
                       "build_terms": size["terms"]}
                if est > max_build_s:
                    row["skipped"] = f"~{size['terms'] / 1e6:.1f}M model terms, ~{est:.0f} s of model building"
                    rows.append(row)
                    _log(f"(b) {nd} devices ({label}) x {n} blocks: skipped ({row['skipped']})")
                    continue
                _log(f"(b) {nd} devices ({label}, {size['classes']} classes) x {n} blocks: solving "
                     f"(limit {time_limit:.0f} s) ...")
                with NoiseMeter() as noise:
                    result, wall, recs = watched_solve(inst, time_limit, workers)
                first = recs[0] if recs else {}
                row.update(wall_s=wall, others_cpu=noise.others, solve_s=sum(r.get("wall_s", 0.0) for r in recs),
                           solver_status=first.get("status"), simple_bound_us=simple_lower_bound_us(inst))
                t0 = time.perf_counter()
                dp_devs, dp_cuts = pipedream_dp(inst)
                dp = manual_partition(inst, dp_devs, dp_cuts)
                row["dp"] = {"objective_us": predicted_step_us(inst, dp), "fits": not check_feasible(dp, inst),
                             "stages": len(dp.stages), "wall_s": time.perf_counter() - t0}
                if isinstance(result, PlanDoesNotFit):
                    row.update(status="none found" if "not proven" in str(result) else "none fits", objective_us=None,
                               error=str(result))
                elif isinstance(result, Exception):
                    row.update(status="ERROR", objective_us=None, error=f"{type(result).__name__}: {result}")
                else:
                    obj = predicted_step_us(inst, result)
                    lb = obj if result.optimal else min(obj, int(first.get("bound", 0)))
                    row.update(status="optimal" if result.optimal else "feasible", objective_us=obj,
                               stages=len(result.stages), lower_bound_us=lb, gap=(obj - lb) / obj if obj else 0.0,
                               simple_gap=(obj - row["simple_bound_us"]) / obj if obj else 0.0)
                _log(f"    {row['status']} in {wall:.1f} s" + (f", gap {row['gap']:.1%}" if row.get("gap") is not None else ""))
                rows.append(row)
    return {"time_limit_s": time_limit, "solver_workers": workers, "schedule": schedule, "microbatches": M,
            "max_build_s": max_build_s, "rows": rows}


def format_b(b: dict) -> str:
    lines = [f"(b) planning time and optimality gap: synthetic models, {b['schedule']}, M={b['microbatches']}, "
             f"time limit {b['time_limit_s']:.0f} s per case, {b['solver_workers']} CP-SAT workers on {CPUS} CPUs",
             "    kinds = device models the devices are copies of ('-': all differ); classes = interchangeable groups "
             "the solver found;",
             "    build s = wall minus the CP-SAT solve calls (model building in Python); gap = (step - lower bound) / "
             "step, with CP-SAT's bound or the simple one;",
             "    dp step s = the predicted step of part (c)'s memory-blind PipeDream-style DP plan (an upper bound "
             "on the optimum when it fits)"]
    rows = []
    for r in b["rows"]:
        head = [str(r["devices"]), "-" if r.get("kinds") is None else str(r["kinds"]), str(r["classes"]),
                str(r["blocks"])]
        if r.get("skipped"):
            rows.append(head + ["skipped", "-", "-", "-", "-", "-", "-", "-", "-", r["skipped"]])
            continue
        rows.append(head + [r["status"], f"{r['wall_s']:.1f}", f"{r['wall_s'] - r['solve_s']:.1f}",
                            "-" if r.get("objective_us") is None else f"{r['objective_us'] / 1e6:.3f}",
                            str(r.get("stages", "-")),
                            "-" if r.get("gap") is None else f"{r['gap']:.1%}",
                            "-" if r.get("simple_gap") is None else f"{r['simple_gap']:.1%}",
                            f"{r['dp']['objective_us'] / 1e6:.3f}" + ("" if r["dp"]["fits"] else " (no fit)"),
                            "-" if r.get("others_cpu") is None else f"{r['others_cpu']:.0%}",
                            "" if r["status"] != "ERROR" else r["error"][:90]])
    lines += _table(rows, ["devs", "kinds", "classes", "blocks", "status", "wall s", "build s", "step s", "stages",
                           "gap cp-sat", "gap simple", "dp step s", "others", "note"])
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Part (c): CP-SAT vs even split vs PipeDream-style DP
# --------------------------------------------------------------------------

def pipedream_dp(inst):
    """Contiguous block ranges over the devices in cluster order (devices may be skipped),
    minimising max(stage compute, 2 x boundary transfer); memory ignored. (devices, cuts)."""
    nd, n = len(inst.devices), inst.blocks
    prefix = [[0] * (n + 1) for _ in range(nd)]
    for d in range(nd):
        for k in range(n):
            prefix[d][k + 1] = prefix[d][k] + inst.compute_us[d][k]
    INF = float("inf")
    # best[d][j]: least bottleneck with blocks 0..j-1 placed, the last stage on device d ending at j-1
    best = [[INF] * (n + 1) for _ in range(nd)]
    back = [[None] * (n + 1) for _ in range(nd)]
    for e in range(nd):
        for j in range(1, n + 1):
            best[e][j] = prefix[e][j]  # one stage: blocks 0..j-1 on e
            for d in range(e):
                row = best[d]
                for i in range(1, j):
                    if row[i] == INF:
                        continue
                    value = max(row[i], 2 * inst.transfer_us(d, e, i - 1), prefix[e][j] - prefix[e][i])
                    if value < best[e][j]:
                        best[e][j], back[e][j] = value, (d, i)
    end = min(range(nd), key=lambda d: best[d][n])
    devs, cuts, d, j = [end], [], end, n
    while back[d][j] is not None:
        d, j = back[d][j]
        devs.append(d)
        cuts.append(j)
    return [inst.devices[x] for x in reversed(devs)], list(reversed(cuts))


def simulated_throughput(graph, cluster, partition, schedule: str, M: int) -> float:
    from planner.cost import stage_costs
    from planner.schedule import make_schedule
    from planner.simulate import simulate

    costs = stage_costs(graph, cluster, partition, schedule, M, OPTIMIZER)
    mb = 4 * M if schedule == "1f1b-stash" else M
    sim = simulate(make_schedule(schedule, len(costs), mb), costs)
    return sim.throughput_samples_per_s(graph.batch)


def part_c(time_limit: float, workers: int, cases=((4, 12), (8, 48), (16, 48)), M: int = 4, seed: int = 1,
           retry_factor: float = 6.0) -> dict:
    from planner.partition import (PlanDoesNotFit, check_feasible, even_partition, make_instance,
                                   manual_partition)

    rows = []
    for nd, n in cases:
        retried = False
        for schedule in SCHEDULES:
            rng = random.Random(seed * 1000 + nd * 7 + n)
            graph, work, ws = synthetic_graph(n, rng)
            cluster, slow, budgets = synthetic_cluster(graph, work, ws, nd, rng, schedule, M, "tight")
            inst = make_instance(graph, cluster, schedule, M, OPTIMIZER)
            _log(f"(c) {nd} devices x {n} blocks, {schedule} ...")
            plans = {}
            t0 = time.perf_counter()
            solved, wall, _ = watched_solve(inst, time_limit, workers)
            plans["cp-sat"] = (None if isinstance(solved, Exception) else solved, time.perf_counter() - t0)
            retry = None
            if isinstance(solved, PlanDoesNotFit) and "not proven" in str(solved) and not retried:
                # once per cluster: does a longer search find a plan? (the budget of a default run
                # allows one retry per cluster, not one per schedule)
                retried = True
                _log(f"    no plan in {time_limit:.0f} s (not proven); retrying with {retry_factor * time_limit:.0f} s ...")
                again, wall2, _ = watched_solve(inst, retry_factor * time_limit, workers)
                retry = {"time_limit_s": retry_factor * time_limit, "wall_s": wall2,
                         "found": not isinstance(again, Exception)}
                if retry["found"]:
                    retry.update(stages=len(again.stages), optimal=again.optimal,
                                 throughput=simulated_throughput(graph, cluster, again, schedule, M))
            t0 = time.perf_counter()
            plans["even"] = (even_partition(inst), time.perf_counter() - t0)
            t0 = time.perf_counter()
            devs, cuts = pipedream_dp(inst)
            plans["dp"] = (manual_partition(inst, devs, cuts), time.perf_counter() - t0)
            entry = {"devices": nd, "blocks": n, "schedule": schedule, "slowness": slow, "budgets": budgets,
                     "plans": {}, "cp_sat_retry": retry,
                     "cp_sat_error": (None if not isinstance(solved, Exception) else str(solved)
                                      if isinstance(solved, PlanDoesNotFit) else f"{type(solved).__name__}: {solved}")}
            for name, (part, secs) in plans.items():
                if part is None:
                    entry["plans"][name] = {"fits": False, "throughput": None, "plan_s": secs,
                                            "note": "solver: no plan fits"}
                    continue
                problems = check_feasible(part, inst)
                entry["plans"][name] = {
                    "fits": not problems, "problems": problems, "plan_s": secs, "stages": len(part.stages),
                    "throughput": simulated_throughput(graph, cluster, part, schedule, M),
                    "devices": part.devices, "ranges": [list(r) for r in part.ranges], "optimal": part.optimal,
                    "over_budget": [max(0, s.memory_bytes - s.memory_budget_bytes) for s in part.stages]}
            rows.append(entry)
    return {"microbatches": M, "time_limit_s": time_limit, "rows": rows}


def format_c(c: dict) -> str:
    lines = [f"(c) simulated throughput (samples/s, M={c['microbatches']} micro-batches of {BATCH // 4} rows) of "
             f"three plans on heterogeneous clusters (speeds 1-10x) with tight memory (budgets sum to {TIGHT_SLACK}x the model)",
             "    no fit = some device over its budget (check_feasible): the plan would not run; in parentheses what it "
             "would do if memory did not matter, and how many devices are over; stg = stages; vs = throughput / cp-sat's; "
             "* = proven optimal"]
    rows = []
    for r in c["rows"]:
        ref = r["plans"]["cp-sat"].get("throughput")
        cells = [str(r["devices"]), str(r["blocks"]), r["schedule"]]
        for name in ("cp-sat", "even", "dp"):
            p = r["plans"][name]
            if p.get("throughput") is None:
                err = r.get("cp_sat_error") or ""
                cells += ["ERROR" if not err.startswith("no plan fits") else
                          "none found" if "not proven" in err else "none fits", "-", "-"]
                continue
            over = sum(1 for x in p["over_budget"] if x > 0)
            t = f"{p['throughput']:.2f}" if p["fits"] else f"no fit ({p['throughput']:.2f}; {over} over)"
            if name == "cp-sat":
                t += "*" if p.get("optimal") else ""
            cells += [t, str(p["stages"]),
                      "-" if not ref else f"{p['throughput'] / ref:.2f}"]
        rows.append(cells)
    lines += _table(rows, ["devs", "blocks", "schedule", "cp-sat", "stg", "vs", "even", "stg", "vs", "dp (no memory)",
                           "stg", "vs"])
    for r in c["rows"]:
        if r.get("cp_sat_error"):
            err = r["cp_sat_error"]
            why = (f"error: {err[:200]}" if not err.startswith("no plan fits") else "proven: no plan fits"
                   if "not proven" not in err else f"no plan found in {c['time_limit_s']:.0f} s, infeasibility not proven")
            lines.append(f"    {r['devices']} devices x {r['blocks']} blocks, {r['schedule']}: cp-sat {why}")
            rt = r.get("cp_sat_retry")
            if rt:
                lines.append(f"      retried with {rt['time_limit_s']:.0f} s ({rt['wall_s']:.0f} s wall): " + (
                    f"found a {rt['stages']}-stage plan ({'optimal' if rt['optimal'] else 'not proven optimal'}), "
                    f"{rt['throughput']:.2f} samples/s" if rt["found"] else "still none"))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Part (d): network namespaces joined by shaped veth pairs
# --------------------------------------------------------------------------

NS_PREFIX = "cbplan"
SUBNET = "10.231.77"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {proc.stderr.strip()}")


class Netns:
    """A coordinator namespace with a bridge, one namespace per worker on that bridge (unshaped
    control), and a tbf-shaped link between every two workers (/32 routes send worker-to-worker
    traffic over it): a veth pair when `delay_s` is None, else a TUN pair joined by the userspace
    delay line of benchmarks/linkdelay.py (`delay_s` one way; this kernel has no netem), whose
    statistics (packets, CPU seconds) land in `relay_stats` at `close`. Everything is removed by
    `close` (the relay first, then the namespaces, which takes their interfaces along)."""

    def __init__(self, workers: int, rate: str, delay_s: float | None = None):
        self.coord = f"{NS_PREFIX}-c"
        self.workers = [f"{NS_PREFIX}-w{i}" for i in range(workers)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(workers)]
        self.coord_address = f"{SUBNET}.254"
        self.created: list[str] = []
        self.rate = rate
        self.delay_s = delay_s
        self.line = None  # the DelayLine, when delay_s is set
        self.relay_stats: dict | None = None

    def __enter__(self):
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        c = self.coord
        self._add_ns(c)
        _ip("-n", c, "link", "add", "br0", "type", "bridge")
        _ip("-n", c, "addr", "add", f"{self.coord_address}/24", "dev", "br0")
        _ip("-n", c, "link", "set", "br0", "up")
        for i, (w, addr) in enumerate(zip(self.workers, self.addresses)):
            self._add_ns(w)
            _ip("-n", c, "link", "add", f"ctl{i}", "type", "veth", "peer", "name", "ctl", "netns", w)
            _ip("-n", c, "link", "set", f"ctl{i}", "master", "br0")
            _ip("-n", c, "link", "set", f"ctl{i}", "up")
            _ip("-n", w, "addr", "add", f"{addr}/24", "dev", "ctl")
            _ip("-n", w, "link", "set", "ctl", "up")
        if self.delay_s is not None:
            from benchmarks.linkdelay import DelayLine, Pair

            pairs = [Pair(self.workers[i], f"d{j}", self.addresses[i], self.workers[j], f"d{i}", self.addresses[j])
                     for i, j in itertools.combinations(range(len(self.workers)), 2)]
            self.line = DelayLine(pairs, self.delay_s, self.rate)  # TUN devices up, tbf, /32 routes
            self.line.start()
            return
        for i, j in itertools.combinations(range(len(self.workers)), 2):
            wi, wj = self.workers[i], self.workers[j]
            _ip("-n", wi, "link", "add", f"d{j}", "type", "veth", "peer", "name", f"d{i}", "netns", wj)
            for ns, dev, peer_addr in ((wi, f"d{j}", self.addresses[j]), (wj, f"d{i}", self.addresses[i])):
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "route", "add", f"{peer_addr}/32", "dev", dev)
                _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "32kb",
                    "latency", "400ms")

    def relay_cpu_s(self) -> float:
        """CPU seconds the delay line's relay has used so far (0 without one)."""
        return self.line.cpu_s() if self.line is not None and self.line.proc is not None else 0.0

    def close(self) -> None:
        if self.line is not None:
            self.relay_stats = self.line.close()
            self.line = None
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def popen(self, ns: str, argv: list[str], **kwargs) -> subprocess.Popen:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=str(ROOT), env=env, **kwargs)


def netns_available() -> str | None:
    """None when part (d) can run, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install iproute2: apt-get update && apt-get install -y iproute2)"
    probe = f"{NS_PREFIX}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (a throw-away namespace and dummy veth)."""
    ns = f"{NS_PREFIX}-nt"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        return False
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "x0", "type", "veth", "peer", "name", "x1"], capture_output=True)
        proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "x0", "root", "netem",
                               "delay", "1ms"], capture_output=True)
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure_netns_link(net: Netns, port: int, sizes=(1 << 10, 1 << 18, 1 << 20), reps: int = 4):
    """measure_link from worker 0's namespace to a probe server in worker 1's, through the shaped veth."""
    from ir.profile import Link

    server = net.popen(net.workers[1], [sys.executable, "-m", "confidant", "profile", "--serve-link", "--listen",
                                        f"tcp://{net.addresses[1]}:{port}"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"link probe server did not start: {line!r}")
        code = ("import json, sys; from runtime.profiling.compute import measure_link; "
                f"l = measure_link('tcp://{net.addresses[1]}:{port}', sizes={tuple(sizes)!r}, reps={reps}); "
                "print(json.dumps([l.bandwidth_bytes_per_s, l.latency_s]))")
        client = net.popen(net.workers[0], [sys.executable, "-c", code], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        out, err = client.communicate(timeout=300)
        if client.returncode != 0:
            raise RuntimeError(f"measure_link failed: {err[-2000:]}")
        bw, lat = json.loads(out.strip().splitlines()[-1])
        return Link(bw, lat)
    finally:
        _stop([server])


def child_d(config_path: str) -> int:
    """The coordinator, run inside the coordinator's namespace: train, print figures as JSON."""
    from jobs.pipeline_training import train_pipeline
    from planner.onnx_import import load_model
    from runtime.pipeline.coordinator import PipelineConfig

    cfg = json.loads(Path(config_path).read_text())
    M, steps = cfg["microbatches"], cfg["steps"]
    graph = load_model(cfg["model"], BATCH // M, SEQ)
    batches = make_batches(steps)
    config = PipelineConfig(schedule=cfg["schedule"], microbatches=M, optimizer=OPTIMIZER, lr=LR, timeout_s=300)
    cuts = [a for a, _ in cfg["ranges"][1:]]
    res = train_pipeline(graph, batches, NUM_LABELS, cfg["addresses"], config, steps, cuts=cuts or None,
                         listen=cfg["listen"])
    print(MARKER + json.dumps(summarize_training(res, cfg["schedule"], M)), flush=True)
    return 0


def train_netns(net: Netns, model: Path, ranges, schedule: str, M: int, n_steps: int, port: int) -> dict:
    n = len(ranges)
    workers = []
    try:
        for i in range(n):
            workers.append(net.popen(net.workers[i], [sys.executable, "-m", "confidant", "worker", "--listen",
                                                      f"tcp://{net.addresses[i]}:{port}"],
                                     stdout=subprocess.PIPE, text=True))
        addresses = []
        for w in workers:
            line = w.stdout.readline()
            if not line.startswith("listening "):
                raise RuntimeError(f"worker did not start: {line!r}")
            addresses.append(line.split()[1])
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"model": str(model), "microbatches": M, "steps": n_steps, "schedule": schedule,
                       "ranges": [list(r) for r in ranges], "addresses": addresses,
                       "listen": f"tcp://{net.coord_address}:{port + 100}"}, f)
            cfg = f.name
        try:
            coord = net.popen(net.coord, [sys.executable, str(Path(__file__).resolve()), "--child-d", cfg],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = coord.communicate(timeout=900)
        finally:
            os.unlink(cfg)
        lines = [ln for ln in out.splitlines() if ln.startswith(MARKER)]
        if coord.returncode != 0 or not lines:
            raise RuntimeError(f"coordinator failed (rc {coord.returncode}): {(out + err)[-3000:]}")
        codes = [w.wait(60) for w in workers]
        if any(codes):
            raise RuntimeError(f"workers exited with {codes}")
        return json.loads(lines[-1][len(MARKER):])
    finally:
        _stop(workers)


def part_d(model: Path, M: int, steps: int, time_limit: float,
           configs=((2, "100mbit"), (2, "20mbit"), (3, "100mbit")), delay_s: float | None = 0.005) -> dict:
    """`delay_s`: one-way delay of every worker-to-worker link, added by the userspace delay line
    (benchmarks/linkdelay.py: TUN pairs, tbf on their egress); None: plain tbf-shaped veth pairs."""
    from planner.onnx_import import load_model

    why = netns_available()
    if why:
        _log(f"(d) skipped: {why}")
        return {"skipped": why}
    netem = netem_available()
    graph = load_model(str(model), BATCH // M, SEQ)
    profile, _ = profile_here(graph)
    loaded, _ = profile_corun(model, graph, min(max(n for n, _ in configs), CPUS))
    rows = []
    port = 26000
    schedule = "1f1b-flush"
    for n, rate in configs:
        how = "veths" if delay_s is None else f"TUN pairs through the delay line ({delay_s * 1e3:g} ms one way)"
        _log(f"(d) {n} workers in namespaces, worker-to-worker {how} shaped to {rate} ...")
        with Netns(n, rate, delay_s) as net:
            port += 10
            link = measure_netns_link(net, port)
            _log(f"    measured link {link.bandwidth_bytes_per_s * 8 / 1e6:.1f} Mbit/s, "
                 f"latency {link.latency_s * 1e3:.2f} ms")
            cluster = identical_cluster(profile, n, link, profile.memory_available_bytes // 3)
            part, solved, solve_s, pred = plan_and_predict(graph, profile, loaded, n, link, schedule, M, steps,
                                                           time_limit)
            ranges = [tuple(r) for r in part.ranges]
            _log(f"    ranges {ranges}, predicted {pred['cost_s']:.3f} s; training ...")
            port += 10
            relay0, t0 = net.relay_cpu_s(), time.perf_counter()
            with NoiseMeter() as noise:
                run = train_netns(net, model, ranges, schedule, M, steps + 1, port)
            relay_cpu, train_wall = net.relay_cpu_s() - relay0, time.perf_counter() - t0
        others = noise.others
        relay = None
        if delay_s is not None:
            # the relay is our own child but not yet waited for, so NoiseMeter counted it as another process
            if others is not None:
                others = max(0.0, others - relay_cpu / (CPUS * train_wall))
            relay = {"cpu_s": relay_cpu, "wall_s": train_wall, "core_share": relay_cpu / train_wall,
                     "stats": net.relay_stats}
        meas = measured_figures([run], schedule, M, steps)
        pred["sim_measured_compute_s"] = measured_compute_sim(graph, cluster, part, schedule, M, steps, meas)
        pred["cost_measured_compute_s"] = measured_compute_cost(graph, cluster, part, schedule, M, meas)
        row = {"workers": n, "rate": rate, "delay_s": delay_s, "schedule": schedule, "ranges": ranges,
               "link": {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
               "solver_stages": len(solved.stages), "solve_s": solve_s, "predicted": pred, "measured": meas,
               **compare_row(pred, meas), "others_cpu": others, "relay": relay, "runs": [run]}
        _log(f"    measured {meas['step_s']:.3f} s ({row['err_cost']:+.1%} vs cost, {row['err_sim']:+.1%} vs sim)"
             + ("" if relay is None else f"; delay line relay used {relay['core_share']:.0%} of a core"))
        rows.append(row)
    return {"netem": netem, "delay_s": delay_s, "microbatches": M, "steps": steps, "rows": rows}


def format_d(d: dict) -> str:
    if d.get("skipped"):
        return f"(d) skipped: {d['skipped']}"
    delay_s = d.get("delay_s")
    netem = "netem is available in this kernel" if d["netem"] else "this kernel has no netem"
    if delay_s is None:
        how = (f"worker-to-worker veth pairs shaped with tbf, no delay added ({netem}): latency is the bare "
               "veth's")
    else:
        how = (f"worker-to-worker links are TUN pairs joined by a USERSPACE DELAY LINE (benchmarks/linkdelay.py, "
               f"{delay_s * 1e3:g} ms one way, {'used for comparability' if d['netem'] else 'because ' + netem}), "
               "bandwidth shaped with tbf on each TUN's egress")
    lines = [f"(d) predicted vs measured over a shaped link: workers in network namespaces; {how}; "
             f"MiniLM, 1f1b-flush, M={d['microbatches']}, {d['steps']} timed steps",
             "    link = bandwidth/latency measured by measure_link through that link (the prediction uses these); "
             "link ms = predicted transfer time per stage and micro-batch (both directions)"]

    def extra(r):
        l = r["link"]
        return [r["rate"] + ("" if r.get("delay_s") is None else f"+{r['delay_s'] * 1e3:g}ms"),
                f"{l['bandwidth_bytes_per_s'] * 8 / 1e6:.1f}Mb/{l['latency_s'] * 1e3:.2f}ms",
                ",".join(f"{x * 1000:.0f}" for x in r["predicted"]["stage_link_s"])]

    lines += _table(_pred_meas_rows(d["rows"], extra), ["N", "tbf+delay", "link", "link ms", "schedule", "blocks",
                                                        *PRED_HEADER])
    lines += _colocated_lines(d["rows"])
    for r in d["rows"]:
        relay = r.get("relay")
        if relay:
            st = relay.get("stats") or {}
            dirs = st.get("dirs", [])
            lines.append(f"    delay line, {r['workers']} workers {r['rate']}: relay used {relay['cpu_s']:.1f} s CPU in "
                         f"{relay['wall_s']:.0f} s of training ({relay['core_share']:.0%} of one core, not counted in "
                         f"'others'); {sum(x['packets'] for x in dirs)} packets, "
                         f"{sum(x['bytes'] for x in dirs) / 1e6:.0f} MB forwarded, write errors "
                         f"{sum(x['write_errors'] for x in dirs)}, lateness mean "
                         f"{max((x['late_mean_us'] for x in dirs), default=0):.0f} us, max "
                         f"{max((x['late_max_us'] for x in dirs), default=0) / 1e3:.1f} ms")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

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
                    help="(b): skip combinations whose estimated CP-SAT model building exceeds this (default 60)")
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
        "b": lambda: part_b(args.time_limit, args.solver_workers, args.max_build_s),
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
