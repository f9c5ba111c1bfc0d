"""Part (c) of benchmarks/planner.py: the solved plan vs an even split and vs PipeDream-style DP."""
from __future__ import annotations

import random
import time

from benchmarks.planner_parts.shared import BATCH, OPTIMIZER, SCHEDULES, _log, _table
from benchmarks.planner_parts.synthetic import (TIGHT_SLACK, pipedream_dp, synthetic_cluster, synthetic_graph,
                                                watched_solve)


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
