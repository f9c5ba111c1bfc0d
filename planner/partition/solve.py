"""`solve_partition`: the fixed-order program searched over device orders, CP-SAT, and a proven bound.

The approaches (each in its module) and how their time is shared, for a limit of L seconds:
- planner.partition.dp solves one device order exactly; planner.partition.search enumerates
  every order when there are few (the distinct sequences of device classes, when solving them
  all is expected to take at most half of L: the plan is then proven optimal and nothing else
  runs), and otherwise runs an iterated local search over orders.
- planner.partition.bound proves a lower bound over intervals of the largest stage time: device
  distinctness relaxed with prices (Lagrangian), or kept exactly on small clusters (a pass over
  how many devices of each class are used), links at their cheapest or exact where affordable;
  and it reads seed orders off its relaxed optima.
- planner.partition.cpsat, when its model is small enough to build in a fraction of L, runs
  from the best plan found so far (a hint: its answer is never worse) and may prove optimality;
  its own bound counts too.
Large instances: search to 30 % of L, bound to 50 %, CP-SAT (where it helps: few blocks, a small
model) or more search to 75 %, bound to 85 %, search to 97 %, each phase stopping early once the
plan is proven optimal.

The answer is the best plan any approach found (`method` says which: "dp" for the fixed-order
program, "cp-sat" where CP-SAT's plan was strictly better), `optimal` when proven (the search
was exhaustive, CP-SAT proved it, or the bound reaches it), and `solve_partition_report` also
returns the bound, so that the gap (value - bound) / value is proven.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ir.partition import Partition
from planner.partition.bound import BoundSearch
from planner.partition.cpsat import cpsat_plan, does_not_fit, estimated_build_s, model_size
from planner.partition.dp import INF, OrderSolver
from planner.partition.explain import PlanDoesNotFit
from planner.partition.instance import PartitionInstance, _objective_us, _partition, device_classes
from planner.partition.search import Best, OrderSearch, class_orders, exhaustive, seed_orders

# every device order is solved when that is expected to take at most this share of the time limit
EXHAUSTIVE_SHARE = 0.5
# CP-SAT runs when building its model should take at most this share of the time limit
CPSAT_BUILD_SHARE = 0.15
# and when the model has few blocks, where its search beats the order search (on part (b) of
# benchmarks/planner.py it improved on it at 12 blocks only, and never proved more above 48)
CPSAT_MAX_BLOCKS = 32
CPSAT_MAX_TERMS = 60_000
# the last phase ends here (a share of the time limit), leaving the rest for building the answer
FINISH = 0.97
# The seed orders stop once one has a plan and this share of the time limit is spent (where the
# search's first phase ends).
SEEDS_SHARE = 0.3


def _cp_sat_helps(inst: PartitionInstance) -> bool:
    return inst.blocks <= CPSAT_MAX_BLOCKS and model_size(inst)["terms"] <= CPSAT_MAX_TERMS


@dataclass(frozen=True)
class PartitionReport:
    """What `solve_partition_report` found: the plan, a proven lower bound on every plan's predicted
    step (microseconds), and how the time went."""

    partition: Partition
    step_us: int
    lower_bound_us: float
    exhaustive: bool                                   # every device order was solved exactly
    cp_sat: dict | None = None                         # CP-SAT's run: seconds, its plan's step, proven, bound
    seconds: dict[str, float] = field(default_factory=dict)  # per phase
    orders: int = 0                                    # device orders priced by the order search

    @property
    def optimal(self) -> bool:
        return self.partition.optimal

    @property
    def gap(self) -> float:
        """(step - bound) / step: how far from optimal the plan can be, proven."""
        return max(0.0, (self.step_us - self.lower_bound_us) / self.step_us) if self.step_us else 0.0


def _exhaustive_fits(classes, per_order_s: float, budget_s: float) -> bool:
    """Whether solving every order is expected to take at most `budget_s`."""
    count = class_orders(classes)
    return budget_s > 0 and (count <= 24 or count * per_order_s <= budget_s)


def solve_partition_report(inst: PartitionInstance, time_limit_s: float = 10.0, workers: int = 8,
                           seed: int = 0) -> PartitionReport:
    """The best plan found within `time_limit_s` with its proven bound (see the module docstring).

    Raises PlanDoesNotFit when no plan fits (a least-overflow search explains why; it may take up
    to another `time_limit_s`)."""
    start = time.monotonic()
    at = lambda share: start + share * time_limit_s  # noqa: E731
    seconds: dict[str, float] = {}

    def timed(name, t0):
        seconds[name] = seconds.get(name, 0.0) + time.monotonic() - t0

    solver = OrderSolver(inst)
    classes = device_classes(inst)
    best = Best()
    t0 = time.monotonic()
    seeds = seed_orders(solver)
    t_seeds = time.monotonic()
    solved = 0
    for order in seeds:
        # every seed while none has a plan; then only within the search's first share (an order of
        # 64 devices x 193 blocks costs ~0.6 s here: four of them outran a 1 s limit)
        if best.assignment is not None and time.monotonic() > at(SEEDS_SHARE):
            break
        got = solver.best_for_order(order, best.value)
        solved += 1
        if got is not None:
            best.offer(got[0], got[1], order)
    per_order = (time.monotonic() - t_seeds) / max(1, solved)  # the seeds time the orders
    complete = False
    if _exhaustive_fits(classes, per_order, EXHAUSTIVE_SHARE * time_limit_s):
        complete = exhaustive(solver, classes, best, at(FINISH))
    timed("search", t0)
    bound, cp = -INF, None
    search = OrderSearch(solver, classes, best, seed)
    if complete:
        bound = best.value
    else:
        bounds = BoundSearch(solver)

        def search_until(share):
            t = time.monotonic()
            search.run(at(share))
            timed("search", t)

        def bound_until(share):
            nonlocal bound
            t = time.monotonic()
            if t >= at(share):  # its first run does a fixed amount of work: none once the time is up
                return
            bound = max(bound, bounds.run(best.value, at(share)))
            timed("bound", t)

        def proven():
            return best.assignment is not None and _proves(bound, best.value)

        search_until(0.30)
        if not proven():
            bound_until(0.50)
        if not proven():
            t = time.monotonic()
            for order in bounds.relaxed_orders():
                if time.monotonic() > at(0.75):
                    break
                search.evaluate(order)
            timed("search", t)
            left = at(0.75) - time.monotonic()
            build = estimated_build_s(inst)
            if _cp_sat_helps(inst) and build <= CPSAT_BUILD_SHARE * time_limit_s and left - build > 0.05 * time_limit_s:
                t = time.monotonic()
                assignment, cp_proven, cp_bound = cpsat_plan(inst, left - build, workers, seed, best.assignment)
                cp = {"seconds": time.monotonic() - t, "proven": cp_proven, "bound_us": cp_bound,
                      "step_us": None if assignment is None else _objective_us(inst, *assignment)}
                timed("cp-sat", t)
                if assignment is not None and best.offer(cp["step_us"], assignment, _order_of(solver, assignment),
                                                         "cp-sat"):
                    search.evaluate(best.order)  # the exact cuts of CP-SAT's order can only be as good
                if cp_proven and assignment is not None:
                    bound = max(bound, float(best.value))
                else:
                    bound = max(bound, cp_bound)
            else:
                search_until(0.75)
        if not proven():
            bound_until(0.85)
        if not proven():
            search_until(FINISH)
    if best.assignment is None and not complete and bound < INF:
        # no order found a plan (and the relaxation did not prove that none fits): CP-SAT from
        # scratch, as before the fixed-order program, which may still find one
        left = max(0.05 * time_limit_s, at(FINISH) - time.monotonic())
        t = time.monotonic()
        assignment, cp_proven, _ = cpsat_plan(inst, left, workers, seed)
        cp = {"seconds": time.monotonic() - t, "proven": cp_proven, "bound_us": 0.0,
              "step_us": None if assignment is None else _objective_us(inst, *assignment)}
        timed("cp-sat", t)
        if assignment is not None:
            best.offer(cp["step_us"], assignment, _order_of(solver, assignment), "cp-sat")
    if best.assignment is None:
        # proven when every order was solved, the relaxation (exact on memory) has no plan either,
        # or CP-SAT proved it
        none_fits = complete or bound == INF or (cp is not None and cp["proven"])
        got = does_not_fit(inst, time_limit_s, workers, seed, none_fits=none_fits)
        if isinstance(got, PlanDoesNotFit):
            raise got
        return PartitionReport(got, _objective_us(inst, *_assignment_of(inst, got)), 0.0, complete, cp, seconds,
                               search.evaluations)
    value = best.value
    optimal = complete or _proves(bound, value)
    part = _partition(inst, *best.assignment, best.source, optimal)
    return PartitionReport(part, int(value), float(min(value, bound)) if bound > -INF else 0.0, complete, cp,
                           seconds, search.evaluations)


def _proves(bound: float, value: float) -> bool:
    """Whether a lower bound proves `value` optimal: steps are whole microseconds, so any plan
    costs at least the bound rounded up."""
    return bound >= value or (math.isfinite(bound) and math.ceil(bound - 1e-6) >= value)


def _order_of(solver: OrderSolver, assignment) -> list[int]:
    """The device order (E[0] = last stage) of an assignment, the unused devices after it."""
    used = list(reversed(assignment[0]))
    return used + [d for d in range(solver.nd) if d not in used]


def _assignment_of(inst: PartitionInstance, partition: Partition):
    index = {name: i for i, name in enumerate(inst.devices)}
    return tuple(index[d] for d in partition.devices), tuple(partition.ranges)


def solve_partition(inst: PartitionInstance, time_limit_s: float = 10.0, workers: int = 8, seed: int = 0) -> Partition:
    """The plan with the least predicted step time under every device's budget that the solvers
    find within `time_limit_s` (see the module docstring); `optimal` is True when proven.

    Raises PlanDoesNotFit when no plan fits (then a second search, also up to `time_limit_s`,
    finds the least-overflow assignment for the message)."""
    return solve_partition_report(inst, time_limit_s, workers, seed).partition
