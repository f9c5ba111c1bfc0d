"""Planning a MiniLM cluster and predicting its step, and the measured figures of a run (parts a and d).

Both parts profile this machine (alone and co-located), plan N identical devices with that
profile, price the plan with the cost formula and the simulation, train, and compare: the helpers
for all of that, and the table of predicted against measured figures, live here.
"""
from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.planner_parts.shared import BACKEND, CPUS, OPTIMIZER, ROOT, _median, _ms, _pct, _s, _table

_PROFILE_CACHE: dict = {}


def profile_here(graph, reps: int = 5):
    """This machine's profile at the micro-batch shape, one compute thread (cached per run)."""
    from runtime.profiling import profile_device

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
