"""Cut a model into pipeline stages over the cluster's devices: the fixed-order DP searched over
device orders, CP-SAT, brute force, manual, even.

Every partitioner takes a fully prepared `PartitionInstance` (integers only: microseconds and
bytes, built by `make_instance` from planner.cost) and returns an `ir.partition.Partition` with
the predicted stage times and memory filled in, so everything downstream is shared.

The modules, by job (each imports only those above it):
- `instance`: the problem (its statement is that module's docstring), `PartitionInstance`,
  `make_instance`, the evaluation of one assignment, and `device_classes`;
- `explain`: `PlanDoesNotFit` and its message (tightest device, by how much, what would help);
- `simple`: brute force (the tests' oracle), manual, even and greedy partitions, `check_feasible`;
- `dp`: the exact program for one device order (`OrderSolver`);
- `bound`: the Lagrangian lower bound (device distinctness relaxed);
- `search`: device orders around the program (every order when few, else iterated local search);
- `cpsat`: the CP-SAT model (`cpsat_partition` alone), the only module of the project importing ortools;
- `solve`: `solve_partition` and `solve_partition_report`, the best of them with a proven bound.
This package face re-exports their public names: import from `planner.partition`.
"""
from __future__ import annotations

from planner.partition.cpsat import LARGE_MODEL_TERMS, cpsat_partition, model_size
from planner.partition.dp import OrderSolver
from planner.partition.explain import PlanDoesNotFit
from planner.partition.instance import (US_PER_S, Assignment, PartitionInstance, device_classes, make_instance,
                                        predicted_step_us)
from planner.partition.simple import (brute_force_partition, check_feasible, even_partition, greedy_partition,
                                      manual_partition)
from planner.partition.solve import PartitionReport, solve_partition, solve_partition_report

__all__ = [
    "US_PER_S", "Assignment", "PartitionInstance", "make_instance", "predicted_step_us", "device_classes",
    "PlanDoesNotFit",
    "brute_force_partition", "manual_partition", "even_partition", "greedy_partition", "check_feasible",
    "solve_partition", "solve_partition_report", "PartitionReport", "cpsat_partition", "OrderSolver",
    "model_size", "LARGE_MODEL_TERMS",
]
