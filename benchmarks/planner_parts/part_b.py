"""Part (b) of benchmarks/planner.py: planning time and optimality gap on synthetic models.

Each case is planned twice in the same run: by ``cpsat_partition`` (the CP-SAT model alone, as
``solve_partition`` was before the fixed-order program of planner.partition.dp) and by
``solve_partition_report`` (the program searched over device orders, CP-SAT where it helps, and a
proven lower bound), so that the ratio of their plans and the two gaps are measured side by side.
"""
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


def _cp_sat_row(inst, time_limit: float, workers: int) -> dict:
    """The CP-SAT model alone (today's plan before the fixed-order program), watched for its bound."""
    from planner.partition import PlanDoesNotFit, cpsat_partition, predicted_step_us

    with NoiseMeter() as noise:
        result, wall, recs = watched_solve(inst, time_limit, workers, cpsat_partition)
    first = recs[0] if recs else {}
    row = {"wall_s": wall, "others_cpu": noise.others, "solve_s": sum(r.get("wall_s", 0.0) for r in recs),
           "solver_status": first.get("status")}
    if isinstance(result, PlanDoesNotFit):
        row.update(status="none found" if "not proven" in str(result) else "none fits", objective_us=None,
                   error=str(result))
    elif isinstance(result, Exception):
        row.update(status="ERROR", objective_us=None, error=f"{type(result).__name__}: {result}")
    else:
        obj = predicted_step_us(inst, result)
        lb = obj if result.optimal else min(obj, int(first.get("bound", 0)))
        row.update(status="optimal" if result.optimal else "feasible", objective_us=obj, stages=len(result.stages),
                   lower_bound_us=lb, gap=(obj - lb) / obj if obj else 0.0)
    return row


def _new_row(inst, time_limit: float, workers: int) -> dict:
    """solve_partition_report: the plan, its proven bound, and where the time went."""
    from planner.partition import PlanDoesNotFit, check_feasible, solve_partition_report

    t0 = time.perf_counter()
    with NoiseMeter() as noise:
        try:
            report = solve_partition_report(inst, time_limit_s=time_limit, workers=workers)
        except (PlanDoesNotFit, TimeoutError, RuntimeError) as exc:
            report = exc
    row = {"wall_s": time.perf_counter() - t0, "others_cpu": noise.others}
    if isinstance(report, Exception):
        row.update(status="none fits" if isinstance(report, PlanDoesNotFit) else "ERROR", objective_us=None,
                   error=f"{type(report).__name__}: {report}")
        return row
    problems = check_feasible(report.partition, inst)
    row.update(status="optimal" if report.optimal else "feasible", objective_us=report.step_us,
               stages=len(report.partition.stages), method=report.partition.method,
               lower_bound_us=report.lower_bound_us, gap=report.gap, exhaustive=report.exhaustive,
               seconds=report.seconds, orders=report.orders, cp_sat=report.cp_sat,
               problems=problems)
    return row


def part_b(time_limit: float, workers: int, max_build_s: float, blocks=(12, 48, 96, 192),
           devices=(4, 8, 16, 64), kinds=(None, 8), M: int = 4, schedule: str = "1f1b-flush", seed: int = 0,
           baseline: bool = True) -> dict:
    """Every (devices, kinds, blocks) case, planned by the new solver and (with `baseline`) by the
    CP-SAT model alone; the latter is skipped where building its model would exceed `max_build_s`."""
    from planner.partition import check_feasible, make_instance, manual_partition, model_size, predicted_step_us

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
                       "build_terms": size["terms"], "simple_bound_us": simple_lower_bound_us(inst)}
                _log(f"(b) {nd} devices ({label}, {size['classes']} classes) x {n} blocks (limit {time_limit:.0f} s)")
                row["new"] = _new_row(inst, time_limit, workers)
                new = row["new"]
                _log(f"    new: {new['status']} in {new['wall_s']:.1f} s"
                     + (f", step {new['objective_us'] / 1e6:.3f} s, proven gap {new['gap']:.1%}"
                        if new.get("objective_us") else ""))
                if not baseline:
                    pass
                elif est > max_build_s:
                    row["cp_sat"] = {"skipped": f"~{size['terms'] / 1e6:.1f}M model terms, ~{est:.0f} s of building"}
                else:
                    row["cp_sat"] = _cp_sat_row(inst, time_limit, workers)
                    cp = row["cp_sat"]
                    _log(f"    cp-sat alone: {cp['status']} in {cp['wall_s']:.1f} s"
                         + (f", step {cp['objective_us'] / 1e6:.3f} s" if cp.get("objective_us") else ""))
                t0 = time.perf_counter()
                dp_devs, dp_cuts = pipedream_dp(inst)
                dp = manual_partition(inst, dp_devs, dp_cuts)
                row["dp"] = {"objective_us": predicted_step_us(inst, dp), "fits": not check_feasible(dp, inst),
                             "stages": len(dp.stages), "wall_s": time.perf_counter() - t0}
                rows.append(row)
    return {"time_limit_s": time_limit, "solver_workers": workers, "schedule": schedule, "microbatches": M,
            "max_build_s": max_build_s, "rows": rows}


def _s(us) -> str:
    return "-" if us is None else f"{us / 1e6:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_b(b: dict) -> str:
    lines = [f"(b) planning time and optimality gap: synthetic models, {b['schedule']}, M={b['microbatches']}, "
             f"time limit {b['time_limit_s']:.0f} s per case and solver, {b['solver_workers']} CP-SAT workers on "
             f"{CPUS} CPUs",
             "    kinds = device models the devices are copies of ('-': all differ); classes = interchangeable groups;",
             "    new = solve_partition (the fixed-order DP searched over device orders, CP-SAT where it helps, a "
             "proven bound); how = who found the plan (* = every device order solved exactly);",
             "    cp-sat = the CP-SAT model alone (solve_partition before the DP), build s = its model building;",
             "    gap = (step - lower bound) / step with each solver's own proven bound; simple = the same with the "
             "simple bound (no links, no memory, divisible work);",
             "    new/cp = the new step over CP-SAT's (<= 1: never worse); dp step = part (c)'s memory-blind "
             "PipeDream DP (an upper bound when it fits)"]
    rows, worse = [], []
    for r in b["rows"]:
        head = [str(r["devices"]), "-" if r.get("kinds") is None else str(r["kinds"]), str(r["classes"]),
                str(r["blocks"])]
        new, cp = r["new"], r.get("cp_sat") or {}
        new_obj, cp_obj = new.get("objective_us"), cp.get("objective_us")
        ratio = None if not (new_obj and cp_obj) else new_obj / cp_obj
        if ratio is not None and ratio > 1:
            worse.append(f"{r['devices']}x{r['blocks']}")
        simple = None if not new_obj else (new_obj - r["simple_bound_us"]) / new_obj
        cp_cells = (["skipped", "-", "-", "-", "-"] if cp.get("skipped") else ["-"] * 5 if not cp else
                    [cp["status"], f"{cp['wall_s']:.1f}", f"{cp['wall_s'] - cp['solve_s']:.1f}", _s(cp_obj),
                     _pct(cp.get("gap"))])
        rows.append(head + [new["status"], new.get("method", "-") + ("*" if new.get("exhaustive") else ""),
                            f"{new['wall_s']:.1f}", _s(new_obj), str(new.get("stages", "-")), _pct(new.get("gap")),
                            _pct(simple)] + cp_cells
                    + ["-" if ratio is None else f"{ratio:.4f}",
                       f"{r['dp']['objective_us'] / 1e6:.3f}" + ("" if r["dp"]["fits"] else " (no fit)"),
                       "-" if new.get("others_cpu") is None else f"{new['others_cpu']:.0%}",
                       (new.get("error") or cp.get("error") or cp.get("skipped") or "")[:60]])
    lines += _table(rows, ["devs", "kinds", "classes", "blocks", "new", "how", "wall s", "step s", "stages", "gap",
                           "simple", "cp-sat", "wall s", "build s", "step s", "gap", "new/cp", "dp step s", "others",
                           "note"])
    if worse:
        lines.append(f"    WORSE THAN CP-SAT ALONE: {', '.join(worse)}")
    return "\n".join(lines)
