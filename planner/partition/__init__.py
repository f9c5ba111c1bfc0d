"""Cut a model into pipeline stages over the cluster's devices: CP-SAT, brute force, manual, even.

Every partitioner takes a fully prepared `PartitionInstance` (integers only: microseconds and
bytes, built by `make_instance` from planner.cost) and returns an `ir.partition.Partition` with
the predicted stage times and memory filled in, so everything downstream is shared.

The modules, by job (each imports only those above it):
- `instance`: the problem (its statement is that module's docstring), `PartitionInstance`,
  `make_instance`, the evaluation of one assignment, and `device_classes`;
- `explain`: `PlanDoesNotFit` and its message (tightest device, by how much, what would help);
- `simple`: brute force (the tests' oracle), manual, even and greedy partitions, `check_feasible`;
- `cpsat`: the CP-SAT model and `solve_partition`, the only module of the project importing ortools.
This package face re-exports their public names: import from `planner.partition`.
"""
from __future__ import annotations

from planner.partition.cpsat import LARGE_MODEL_TERMS, model_size, solve_partition
from planner.partition.explain import PlanDoesNotFit
from planner.partition.instance import (US_PER_S, Assignment, PartitionInstance, device_classes, make_instance,
                                        predicted_step_us)
from planner.partition.simple import (brute_force_partition, check_feasible, even_partition, greedy_partition,
                                      manual_partition)

__all__ = [
    "US_PER_S", "Assignment", "PartitionInstance", "make_instance", "predicted_step_us", "device_classes",
    "PlanDoesNotFit",
    "brute_force_partition", "manual_partition", "even_partition", "greedy_partition", "check_feasible",
    "solve_partition", "model_size", "LARGE_MODEL_TERMS",
]
