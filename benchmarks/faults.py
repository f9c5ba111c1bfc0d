"""Lost devices and secure links: what the fault policy costs, what a failure costs, what CURVE costs.

What it measures
    MiniLM (all-MiniLM-L6-v2) token classification, 9 labels, batch ``--batch`` x sequence
    ``--seq``, AdamW, 4 micro-batches, ``--schedule`` on ``--engine``, the even split over
    ``--workers`` worker processes (`jobs.common.workers.LocalWorkers`, one compute thread each), this
    process the coordinator (`jobs.train.pipeline.train_pipeline`). Every step time is wall
    clock from the step's start to the next step's start: the copies of the state to the
    coordinator, the fault policy's cost, are in it.
      * ``default`` / ``stop`` / ``coordinator`` / ``every-step``, side by side in alternating
        passes (``--passes``; ``--policies`` picks some): the command line's default fault policy
        (each worker copies its state at the step boundary and ships it to a neighbour while the
        next step runs, runtime.pipeline.snapshots; as often as the last copy is confirmed, K from
        `jobs.train.pipeline.AUTO_SNAPSHOTS`), ``--on-failure stop`` (no copy at all), the
        previous default (every stage's state copied to the coordinator every K steps), and the
        one before it (to the coordinator after every step). ``default`` over ``stop`` is the
        policy's cost (target: at most +5%).
      * ``curve`` / ``insecure``: the default policy with CURVE on every link, then in plaintext
        (``--insecure``); the step-time cost of CURVE is their ratio (target: at most 5%).
      * ``kill``: the default policy; at a random step (``--seed``) a random worker gets SIGKILL a
        moment after the step before it finished; the run re-plans over the others and goes on.

Columns
    ``step s``        median wall-clock seconds of a training step (the first step is warm-up, left out).
    ``state``         the share of the steps' wall clock spent copying the state to the coordinator.
    ``copy s``        median seconds of one copy of every stage's state.
    ``copies``        copies taken during the run (the one before the first step included).
    ``MiB``           what one copy carries: every stage's trainable parameters and optimizer state.
    ``coord MiB``     the coordinator's peak resident memory over the run; ``(train)`` until the last
                      step (before the final state comes to it as the run's result).
    ``worker MiB``    the largest worker's peak.
    ``wCPU/step``     the workers' CPU seconds (all their threads, user + system, from their start to
                      their exit: setup included) per step: what the policy costs on devices with no
                      core to spare, and a figure a loaded machine disturbs far less than wall clock.
    ``snap cpu``      one snapshot's CPU seconds on the busiest worker (its copy, shipping it,
                      filing its neighbour's copy, the transport's I/O threads, CURVE's): what
                      the policy's K is chosen from.

``--model smollm2`` measures SmolLM2-135M as a causal LM with LoRA adapters (``--lora`` rank) on
q, k, v, o instead (benchmarks/lora.py's batch and sequence): a copy then carries the adapters and
their optimizer state only, never the frozen base weights.
    ``detect s``      SIGKILL to the coordinator reporting the worker lost (target: at most 3 s).
    ``recover s``     SIGKILL to the first step completed after the recovery (target: at most 10 s).
    ``replayed``      steps run again (at most the copy interval K).
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
from ir.plan import ASYNC_SCHEDULES  # noqa: E402

M = 4


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _policy(name: str):
    from jobs.train.pipeline import AUTO_SNAPSHOTS, FaultPolicy

    return {"default": FaultPolicy(snapshot_every=AUTO_SNAPSHOTS, state_on="peers"),
            "stop": FaultPolicy(on_failure="stop"),
            "coordinator": FaultPolicy(snapshot_every=AUTO_SNAPSHOTS),
            "every-step": FaultPolicy(snapshot_every=1)}[name]


POLICIES = ("default", "stop", "coordinator", "every-step")


def _run(graph, batches, steps: int, args, policy: str = "default", insecure: bool = False,
         kill: tuple[int, int] | None = None, feeds_of_step=None) -> dict:
    from jobs.train.pipeline import train_pipeline
    from jobs.common.workers import LocalWorkers
    from runtime.pipeline.coordinator import PipelineConfig

    config = PipelineConfig(args.schedule, M, engine=args.engine, optimizer="adamw", lr=1e-4, timeout_s=300)
    workers = LocalWorkers.start(args.workers, threads=1, insecure=insecure)
    sent: dict = {}
    from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes

    reset_peak_rss()
    peaks: dict = {}
    children_cpu = _children_cpu_s()

    def on_step(step, *_):
        if step == steps:  # the peak while training, before the final state comes here (the run's result)
            peaks["train"] = peak_rss_bytes()
            peaks["threads"] = _threads_cpu_s([p.pid for p in workers.procs])
        if kill is not None and step == kill[0] and not sent:
            sent["at"] = time.time()
            peaks["before_kill"] = peak_rss_bytes()
            peaks["at_kill"] = rss_bytes()
            reset_peak_rss()  # from here the peak is the recovery's (and the steps after it)
            threading.Timer(0.05, os.kill, (workers.procs[kill[1]].pid, signal.SIGKILL)).start()

    try:
        with NoiseMeter() as noise:
            result = train_pipeline(graph, batches, NUM_LABELS, workers.addresses, config, steps,
                                    keys=workers.keys, insecure=insecure, on_step=on_step, faults=_policy(policy),
                                    feeds_of_step=feeds_of_step, update_every=args.update_every)
    finally:
        workers.wait(60.0)
    workers_cpu = _children_cpu_s() - children_cpu  # the workers were waited for: their CPU is counted
    last = result.stage_reports[-1] if result.stage_reports else []
    snap_cpu = [d["snapshot_cpu_s"] / d["snapshots_taken"] for d in last if d.get("snapshots_taken")]
    copies = result.snapshot_seconds
    steady = slice(1, None)
    out = {"step_s": statistics.median(result.step_seconds[steady]),
           "state_share": sum(result.state_seconds[steady]) / sum(result.step_seconds[steady]),
           "copy_s": statistics.median(copies) if copies else None, "copies": len(copies),
           # what one copy carries: every stage's trainable parameters and optimizer state (LoRA: the adapters)
           "state_mib": result.state_bytes / 2**20,
           "others": noise.others, "coord_train_mib": peaks.get("train", 0) / 2**20,
           "coord_mib": peak_rss_bytes() / 2**20,
           "worker_mib": max(result.peak_rss_bytes.values(), default=0) / 2**20, "ranges": [list(r) for r in result.ranges], "events": result.events,
           "workers_cpu_step_s": workers_cpu / max(1, len(result.step_seconds)),
           "snapshot_cpu_s": max(snap_cpu, default=None),
           # per snapshot, summed over the workers: the copies, shipping them, filing them, the I/O threads
           "snapshot_cpu_parts_s": {part: sum(d.get("snapshot_cpu_parts_s", {}).get(part, 0.0) for d in last)
                                    / max(1, max((d.get("snapshots_taken", 0) for d in last), default=0))
                                    for part in ("copy", "send", "file", "io")},
           "threads_cpu_s": peaks.get("threads", {}),
           # each stage's compute seconds (F, B, W, UPDATE) a step, median over the steps after the
           # first: a stage held up by the snapshots' shipping shows here
           "busy_s": [statistics.median(sum(r[k]["seconds"].get(a, 0.0) for a in ("F", "B", "W", "UPDATE"))
                                        for r in result.stage_reports[1:]) for k in range(len(result.ranges))]
           if len(result.stage_reports) > 1 else [],
           # the snapshots the first stage had taken by each step's report (the last REPORTS_KEPT steps)
           "snapshots_by_step": [r[0].get("snapshots_taken", 0) for r in result.stage_reports if r],
           "snapshots_on_peers": max((d.get("snapshots_taken", 0) for d in last), default=0),
           "step_seconds": result.step_seconds, "state_seconds": result.state_seconds, "losses": result.losses}
    if kill is not None:
        lost = next(e for e in result.events if e["event"] == "lost")
        recovered = next(e for e in result.events if e["event"] == "recovered")
        out.update(detect_s=lost["at"] - sent["at"], recover_s=recovered["at"] - sent["at"],
                   replayed=recovered["steps_replayed"], killed=kill,
                   # what the recovery's setup sent the survivors (bundles, optimizer state) and the
                   # weights they took from their own kept files instead (runtime.pipeline.held_weights)
                   recovery_sent_mib=result.replans[0][1].sent_bytes / 2**20,
                   recovery_kept_mib=getattr(result.replans[0][1], "kept_bytes", 0) / 2**20,
                   # the state the coordinator fetched off the survivors' copies for the recovery (the
                   # weights, the lost stage's state, the moved blocks' moments: runtime.pipeline.kept_state)
                   recovery_fetched_mib=next((e.get("state_fetched_bytes", 0) for e in result.events
                                              if e["event"] == "new_plan"), 0) / 2**20,
                   # the coordinator's peak before the kill, and from the kill to the last step (the
                   # recovery: the survivors' state restored, the stages set up again)
                   coord_before_kill_mib=peaks.get("before_kill", 0) / 2**20,
                   coord_at_kill_mib=peaks.get("at_kill", 0) / 2**20,
                   coord_recovery_mib=peaks.get("train", 0) / 2**20)
    return out


def _threads_cpu_s(pids) -> dict[str, float]:
    """CPU seconds (user + system) of the processes `pids`' threads so far, summed by thread name
    (the interpreter's, ZeroMQ's I/O threads, the snapshot sender, ...), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            out[name] = out.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / tick
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps per run (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="rows per batch (default %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row (default %(default)s)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default %(default)s)")
    parser.add_argument("--schedule", default="1f1b-flush", help="pipeline schedule (default %(default)s)")
    parser.add_argument("--engine", default="mnn", help="the workers' engine, mnn or torch (default %(default)s)")
    parser.add_argument("--passes", type=int, default=2, help="alternating passes of the policy runs (default 2)")
    parser.add_argument("--only-policies", action="store_true", help="skip the CURVE and kill runs")
    parser.add_argument("--kill", action="store_true", help="with --only-policies: the kill run all the same")
    parser.add_argument("--seed", type=int, default=0, help="chooses the step and the worker killed")
    parser.add_argument("--update-every", type=int, default=1,
                        help="backwards between weight updates (default 1; 2bw needs at least the stages)")
    parser.add_argument("--model", choices=("minilm", "smollm2"), default="minilm",
                        help="minilm (token classification, trained in full) or smollm2 (causal LM with LoRA "
                             "adapters on q,k,v,o: benchmarks/lora.py's batch and sequence)")
    parser.add_argument("--lora", type=int, default=8, help="smollm2: the LoRA rank (default %(default)s)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"the policy runs, comma-separated, of {', '.join(POLICIES)} (default all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    from planner.onnx_import import load_model

    feeds_of_step, batches = None, None
    if args.model == "smollm2":
        from benchmarks.llm import smollm2_model
        from benchmarks.lora import LM_BATCH, LM_SEQ, _lm_feeds, _lm_graph

        args.batch, args.seq = LM_BATCH, LM_SEQ
        # mapped, as train-pipeline's coordinator loads it (jobs.train.pipeline_tasks)
        graph = _lm_graph(smollm2_model(), LM_BATCH // M, args.lora, mapped=True)
        feeds = _lm_feeds(smollm2_model())
        feeds_of_step = lambda k: feeds  # noqa: E731 (one batch every step: the timing, not the learning)
    else:
        graph = load_model(default_model(), args.batch // M, args.seq, mapped=True)
        batches = make_batches(args.steps + 1, batch=args.batch, seq=args.seq)
    rows: dict[str, list[dict]] = {}
    for p in range(args.passes):
        for name in args.policies.split(","):
            print(f"running {name} (pass {p + 1}) ...", file=sys.stderr, flush=True)
            rows.setdefault(name, []).append(_run(graph, batches, args.steps, args, policy=name,
                                                  feeds_of_step=feeds_of_step))
    kill = None
    if not args.only_policies or args.kill:
        rng = random.Random(args.seed)
        kill = (rng.randint(2, max(2, args.steps - 3)), rng.randrange(args.workers))
        extra = (("curve", {}), ("insecure", {"insecure": True})) if not args.only_policies else ()
        for name, kwargs in (*extra, ("kill", {"kill": kill})):
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows[name] = [_run(graph, batches, args.steps, args, feeds_of_step=feeds_of_step, **kwargs)]
    best = {name: min(runs, key=lambda r: r["step_s"]) for name, runs in rows.items()}
    what = "MiniLM" if args.model == "minilm" else f"SmolLM2-135M LoRA r{args.lora}"
    print(f"{what}, batch {args.batch} x {args.seq}, {M} micro-batches, {args.schedule}, {args.engine}, "
          f"{args.workers} workers, {args.steps} steps; wall-clock steps, best of {args.passes} pass(es)")
    print(f"{'run':11s} {'step s':>8s} {'state':>6s} {'copy s':>8s} {'copies':>6s} {'MiB':>6s} {'others':>7s} "
          f"{'coord MiB':>9s} {'(train)':>8s} {'worker MiB':>10s} {'wCPU/step':>9s} {'snap cpu':>8s}")
    for name, r in best.items():
        print(f"{name:11s} {r['step_s']:8.3f} {r['state_share']:6.1%} {r['copy_s'] or 0:8.3f} {r['copies']:6d} "
              f"{r['state_mib']:6.1f} {r['others'] or 0:7.0%} {r['coord_mib']:9.0f} {r['coord_train_mib']:8.0f} "
              f"{r['worker_mib']:10.0f} {r['workers_cpu_step_s']:9.3f} {r['snapshot_cpu_s'] or 0:8.3f}")
    for name, runs in rows.items():  # per pass, against stop's of the same pass
        if name != "stop" and "stop" in rows and len(runs) == len(rows["stop"]):
            print(f"{name} / stop per pass: " + ", ".join(f"{r['step_s'] / s['step_s']:.3f}"
                                                         for r, s in zip(runs, rows["stop"])))
    for name, runs in rows.items():  # the workers' CPU per step, against stop's of the same pass
        if name != "stop" and "stop" in rows and len(runs) == len(rows["stop"]):
            print(f"{name} / stop workers' CPU per step, per pass: " + ", ".join(
                f"{r['workers_cpu_step_s'] / s['workers_cpu_step_s']:.3f}" for r, s in zip(runs, rows["stop"])))
    for name, r in best.items():
        if r["snapshots_on_peers"]:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["snapshot_cpu_parts_s"].items())
            print(f"{name}: {r['snapshots_on_peers']} snapshots on the workers; CPU-s per snapshot, all workers: {parts}")
    for name, runs in rows.items():
        print(f"{name}: each stage's compute seconds a step, per pass: "
              + "; ".join(" ".join(f"{x:.3f}" for x in r["busy_s"]) for r in runs))
    for name, r in best.items():
        print(f"{name}: the workers' CPU-s by thread until the last step: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["threads_cpu_s"].items())))
    cost = best["default"]["step_s"] / best["stop"]["step_s"] - 1 if "default" in best and "stop" in best else None
    old = best["every-step"]["step_s"] / best["stop"]["step_s"] - 1 if "every-step" in best and "stop" in best else None
    if cost is not None:
        print(f"default fault policy vs --on-failure stop: {cost:+.1%} (target <= +5%)"
              + (f"; a copy after every step on the coordinator: {old:+.1%}" if old is not None else ""))
    # The first policy's first pass is the reference (stop's where it ran: the runs without copies).
    # Not for the schedules that never flush (1f1b-stash, 2bw): the default policy drains them every
    # few steps to copy one consistent state, which changes their weight versions, so their losses
    # differ from `stop`'s by design (runtime/pipeline/session.py, `Session.stash`).
    reference = next(iter(rows.get("stop") or next(iter(rows.values()))))["losses"]
    same = all(r["losses"] == reference for runs in rows.values() for r in runs
               if "killed" not in r) if args.schedule not in ASYNC_SCHEDULES else None
    if same is not None:
        print(f"losses identical across policies: {same}")
    figures = {"rows": rows, "policy_cost": cost, "every_step_cost": old}
    if kill is not None:
        kill_row = best["kill"]
        if "curve" in best:
            curve = best["curve"]["step_s"] / best["insecure"]["step_s"] - 1
            figures["curve_cost"] = curve
            print(f"CURVE vs insecure step time: {curve:+.1%} (target <= +5%)")
        print(f"killed worker {kill[1]} during step {kill[0] + 1}: detect {kill_row['detect_s']:.2f} s (target <= 3), "
              f"recover {kill_row['recover_s']:.2f} s (target <= 10), replayed {kill_row['replayed']} step(s); "
              f"the recovery fetched {kill_row['recovery_fetched_mib']:.1f} MiB of state off the workers and "
              f"sent {kill_row['recovery_sent_mib']:.1f} MiB, the survivors kept "
              f"{kill_row['recovery_kept_mib']:.1f} MiB of their own; "
              f"coordinator's peak before the kill {kill_row['coord_before_kill_mib']:.0f} MiB, from the kill to the "
              f"last step {kill_row['coord_recovery_mib']:.0f} MiB (+{kill_row['coord_recovery_mib'] - kill_row['coord_at_kill_mib']:.0f} "
              f"over its {kill_row['coord_at_kill_mib']:.0f} MiB at the kill), the largest worker's {kill_row['worker_mib']:.0f} MiB; "
              f"losses equal the stop runs': {kill_row['losses'] == rows['stop'][0]['losses'] if 'stop' in rows else None}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
