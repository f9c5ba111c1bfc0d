"""Part (a) of benchmarks/planner.py: predicted vs measured step time, local workers on loopback."""
from __future__ import annotations

import threading
from pathlib import Path

from benchmarks.common import NoiseMeter, make_batches
from benchmarks.planner_parts.minilm import (PRED_HEADER, _colocated_lines, _pred_meas_rows, compare_row,
                                             identical_cluster, measured_compute_cost, measured_compute_sim,
                                             measured_figures, plan_and_predict, profile_corun, profile_here,
                                             summarize_training)
from benchmarks.planner_parts.shared import (BACKEND, BATCH, CPUS, LR, NUM_LABELS, OPTIMIZER, SCHEDULES, SEQ, _log,
                                             _table)


def loopback_link():
    """measure_link against a link_probe_server thread on 127.0.0.1."""
    from runtime.profiling import link_probe_server, measure_link

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


def train_local(graph, batches, ranges, schedule: str, M: int, n_steps: int) -> dict:
    from jobs.train.pipeline import FaultPolicy, LocalWorkers, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig

    workers = LocalWorkers.start(len(ranges), threads=1)
    try:
        config = PipelineConfig(schedule=schedule, microbatches=M, optimizer=OPTIMIZER, lr=LR, timeout_s=300)
        cuts = [a for a, _ in ranges[1:]]
        res = train_pipeline(graph, batches, NUM_LABELS, workers.addresses, config, n_steps, cuts=cuts or None,
                             keys=workers.keys, faults=FaultPolicy(on_failure="stop"))
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
