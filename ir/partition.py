"""Where the model is cut and which device runs each piece: the output of every partitioner
(CP-SAT, manual `--cuts`, even split), so everything downstream is shared."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageAssignment:
    """Stage `stage` (pipeline order) runs blocks first..last (inclusive) on `device`."""

    stage: int
    device: str
    first_block: int
    last_block: int
    predicted_time_s: float = 0.0  # forward+backward of one micro-batch plus its link time
    memory_bytes: int = 0          # predicted peak under the chosen schedule
    memory_budget_bytes: int = 0


@dataclass(frozen=True)
class Partition:
    stages: tuple[StageAssignment, ...]
    method: str                    # "cp-sat", "manual", "even", "brute-force"
    bottleneck_s: float = 0.0      # max stage time: the steady-state time per micro-batch
    optimal: bool = False          # proven optimal by the solver

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.first_block, s.last_block) for s in self.stages]

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]


@dataclass(frozen=True)
class StageCost:
    """What the cost model predicts for one stage and one micro-batch; the simulator replays a
    schedule's action lists with these durations (planner.simulate) and the partitioner minimises
    over them (planner.partition)."""

    stage: int
    device: str
    forward_s: float
    backward_s: float
    update_s: float = 0.0          # one optimizer step over the stage's parameters
    send_act_s: float = 0.0        # link time to the next stage: bytes / bandwidth + latency
    send_grad_s: float = 0.0       # link time back to the previous stage
    memory_bytes: int = 0          # predicted peak under the schedule
    memory_budget_bytes: int = 0
