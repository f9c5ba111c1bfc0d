"""Part (b) of benchmarks/planner.py: planning time and optimality gap on synthetic models."""
from __future__ import annotations

import random
import time

from benchmarks.common import NoiseMeter
from benchmarks.planner_parts.shared import CPUS, OPTIMIZER, _log, _table
from benchmarks.planner_parts.synthetic import pipedream_dp, synthetic_cluster, synthetic_graph, watched_solve

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
