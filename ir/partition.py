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
    memory_budget_bytes: int = 0   # what the plan may charge the device: its budget less any reserve


@dataclass(frozen=True)
class Partition:
    stages: tuple[StageAssignment, ...]
    method: str                    # "dp", "cp-sat", "manual", "even", "brute-force"
    bottleneck_s: float = 0.0      # max stage time: the steady-state time per micro-batch
    optimal: bool = False          # proven optimal by the solver

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.first_block, s.last_block) for s in self.stages]

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]


# The share of a stage's backward that is weight gradients when nothing measured says otherwise.
WEIGHT_GRAD_SHARE = 0.5


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
    memory_budget_bytes: int = 0   # what the plan may charge the device: its budget less any reserve
    # the part of backward_s that is weight gradients (a schedule's W when it splits backwards);
    # None: half of it (a linear layer's input and weight gradients are GEMMs of the same size)
    weight_grad_s: float | None = None

    @property
    def weight_pass_s(self) -> float:
        """Seconds of a W action; the B of a split backward takes backward_s minus this."""
        return self.backward_s * WEIGHT_GRAD_SHARE if self.weight_grad_s is None else self.weight_grad_s


def even_ranges(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """The one even split every command uses when no cuts are given: equal block counts, the
    first stages taking one more when `stages` does not divide `n_blocks` (9 blocks on 2 stages:
    0-4, 5-8)."""
    if not 1 <= stages <= n_blocks:
        raise ValueError(f"{stages} stages for {n_blocks} blocks: each stage needs at least one block")
    sizes = [n_blocks // stages + (1 if i < n_blocks % stages else 0) for i in range(stages)]
    ranges, first = [], 0
    for size in sizes:
        ranges.append((first, first + size - 1))
        first += size
    return ranges


def ranges_at_cuts(n_blocks: int, cuts) -> list[tuple[int, int]]:
    """`cuts` are the first block of every stage after the first, e.g. [3] -> [0..2], [3..n-1]."""
    cuts = list(cuts)
    if any(not isinstance(c, int) or isinstance(c, bool) or not 0 < c < n_blocks for c in cuts) \
            or cuts != sorted(set(cuts)):
        raise ValueError(f"cuts {cuts} must be increasing block indices between 1 and {n_blocks - 1}")
    starts = [0] + cuts
    ends = cuts + [n_blocks]
    return [(a, b - 1) for a, b in zip(starts, ends)]
