"""The partitioning problem as plain integers, and the evaluation of one assignment.

`PartitionInstance` holds everything a partitioner needs (microseconds and bytes, built by
`make_instance` from planner.cost); the helpers below price one assignment (an ordered list of
devices and one contiguous block range per stage) and turn it into an `ir.partition.Partition`,
so every partitioner (planner.partition.simple, planner.partition.cpsat) shares them.

The problem. Choose p (1 <= p <= min(devices, blocks)), an ordered list of p distinct devices
(the pipeline order) and contiguous block ranges, one per stage, covering every block in order,
such that every stage fits its device's memory budget, minimising the predicted step time of
planner.cost.predicted_step_s in integer microseconds. With C_s the stage's compute
(forward+backward of its blocks on its device, less MNN's forward re-run where the stage reuses
its forward: planner.cost.reuses_forward), U_s its optimizer step, and B_s one transfer of the
activation crossing boundary s (between stages s and s+1) over that device pair (bytes /
bandwidth + latency):
- flush schedules (gpipe, 1f1b-flush): t_s = C_s + B_s + B_{s-1};
  step = sum_s t_s + (m-1) max_s t_s + max_s U_s   (every stage updates at once after the flush)
- split backwards (zb-h1), with W_s the stage's weight-gradient pass (part of C_s, deferred into
  the bubbles): step = sum_s (t_s - W_s) + (m-1) max_s t_s + max_s (W_s + U_s); the flush form is
  this with every W_s = 0, so one objective covers both (planner.cost.predicted_step_s)
- 1f1b-stash and 2bw (asynchronous, transfers overlap compute, an update after every backward):
  step = m max(max_s (C_s + U_s), max_s 2 B_s)
They are planner.cost's objectives exactly, linear in sums and max variables (`_objective_us`
evaluates them; planner.partition.cpsat models them).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

from ir.graph import Graph
from ir.partition import Partition, StageAssignment
from ir.plan import ASYNC_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, check_optimizer_name, check_schedule_name
from planner.cluster import Cluster, runtime_bytes, setup_peak_bytes, update_rate
from planner.cost import (GRADIENT_COPIES, OPTIMIZER_STATE_COPIES, accumulated_share, activation_mode,
                          async_extra_copies, block_costs, block_transients,
                          block_input_bytes, block_weight_grads_s, check_blocks,
                          base_dtype_savings, block_engine_bytes, block_held_frozen_bytes, block_mapped_frozen_bytes,
                          engine_once_bytes, streamed_read_bytes,
                          in_flight_microbatches, joined_boundaries, kept_activation_bytes, keeps_activations,
                          phase_peak_bytes, update_only_bytes,
                          block_kept_once,
                          reuses_forward, row_gradient_delta_bytes, stage_memory_bytes, shared_current_bytes, stepped_gradient_bytes,
                          summed_head_gradient_bytes, unsummed_gradient_bytes,
                          table_state_delta_bytes, tied_sum_bytes, unversioned_bytes,
                          unversioned_copies, updates_per_microbatch, weight_copies)

US_PER_S = 1_000_000


@dataclass(frozen=True)
class PartitionInstance:
    """Everything a partitioner needs, as integers (times in microseconds, sizes in bytes).

    Indices: d, e over `devices`; k over blocks; p-1 and s over the (stages, stage) tables, which
    have one row per stage count p = 1..len(devices), of length p.
    """

    devices: tuple[str, ...]
    block_names: tuple[str, ...]
    compute_us: tuple[tuple[int, ...], ...]          # [d][k] forward+backward of one micro-batch
    params_bytes: tuple[int, ...]                    # [k]
    input_bytes: tuple[int, ...]                     # [k] activation block k reads, stashed per micro-batch
    workspace_bytes: tuple[tuple[int, ...], ...]     # [d][k] per-op caches of one micro-batch
    overhead_bytes: tuple[int, ...]                  # [d] resident runtime (and engine)
    memory_budget_bytes: tuple[int, ...]             # [d]
    boundary_bytes: tuple[int, ...]                  # [k], k < n-1: bytes crossing a cut after block k
    link_bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]  # [d][e]; the diagonal is unused
    link_latency_us: tuple[tuple[int, ...], ...]     # [d][e]; the diagonal is unused
    weight_copies: tuple[tuple[int, ...], ...]       # [p-1][s] bytes held per parameter byte
    in_flight: tuple[tuple[int, ...], ...]           # [p-1][s] micro-batches of activations held
    microbatches: int
    schedule: str
    optimizer: str = "sgd"
    # [d][k] the part of compute_us that is MNN's re-run of the forward, skipped where the stage
    # reuses its forward (`reuses`); [d][k] one optimizer step over block k's parameters (under
    # 1f1b-stash and 2bw: its share per micro-batch, one step per update_every backwards).
    # Empty: all zero (profiles without these measurements).
    recompute_us: tuple[tuple[int, ...], ...] = ()
    update_us: tuple[tuple[int, ...], ...] = ()
    # [d] whether device d's engine keeps every activation of each micro-batch in flight (PyTorch's
    # autograd, unless it recomputes): its workspace is then held once per micro-batch in flight.
    # Empty: none does (MNN keeps one micro-batch's caches and re-runs the forward for the others).
    keeps_activations: tuple[bool, ...] = ()
    # [d][k] the part of compute_us that a split backward's W runs (planner.cost.weight_grad_s);
    # empty: all zero (schedules that do not split backwards).
    weight_us: tuple[tuple[int, ...], ...] = ()
    # [p-1][s] the copies within weight_copies that an embedding table only looked up is not held in
    # (its old versions and, under 1f1b-stash and 2bw, a second current copy: planner.cost.
    # unversioned_copies), and [d][k] the bytes of block k's parameters that are such tables on
    # device d (planner.cost.unversioned_bytes). Empty: all zero.
    unversioned_copies: tuple[tuple[int, ...], ...] = ()
    unversioned_bytes: tuple[tuple[int, ...], ...] = ()
    # [p-1][s] the second current copy within weight_copies under 1f1b-stash and 2bw (planner.cost.
    # async_extra_copies), and [d][k] the bytes of block k's parameters device d holds no such copy
    # of (PyTorch: all but the unversioned tables, planner.cost.shared_current_bytes). Empty: all zero.
    async_copies: tuple[tuple[int, ...], ...] = ()
    shared_current_bytes: tuple[tuple[int, ...], ...] = ()
    # [d][k] what each micro-batch in flight after the first adds to block k's workspace on a device
    # that keeps its activations (planner.cost.workspace_of: the profile's `BlockCost.kept`).
    # Empty: the whole workspace again (the older model).
    kept_bytes: tuple[tuple[int, ...], ...] = ()
    # [d][k] what device d holds of block k's gradient and optimizer state otherwise than
    # weight_copies charges (negative: less): an embedding table only looked up has its gradient and
    # AdamW state as rows (planner.cost.row_gradient_delta_bytes, table_state_delta_bytes), and
    # PyTorch stepping in its backward never holds its weight gradients at once (planner.cost.
    # stepped_gradient_bytes); a tied table's gradient sum arrives dense at an update (planner.cost.
    # tied_sum_bytes). Empty: all zero.
    state_delta_bytes: tuple[tuple[int, ...], ...] = ()
    # the boundaries no plan cuts, ascending (k: blocks k and k+1 stay on one stage; planner.cost.
    # joined_boundaries: a decoder's LM head and its fused loss). Empty: any cut.
    joined: tuple[int, ...] = ()
    # [k] bytes `--base-dtype int8` and `int4` would save on block k's frozen weights: what "what
    # would make it fit" names (planner.cost.base_dtype_savings). Empty: none.
    base_dtype_savings: tuple[tuple[int, int], ...] = ()
    # [d][k] block k's transient on device d (planner.cost.block_transients: what its backward needs
    # only while it runs); a stage is charged the largest of its own blocks' once (`stage_bytes`),
    # not a sum. Empty: all zero.
    transient_bytes: tuple[tuple[int, ...], ...] = ()
    # [d][k] what each micro-batch in flight after the first holds once on a stage with block k on
    # device d, beside the blocks' kept parts (planner.cost.block_kept_once: PyTorch recomputing per
    # block); a stage is charged the largest of its own blocks' once per further micro-batch
    # (`stage_kept_once`), not a sum. Empty: all zero.
    kept_once_bytes: tuple[tuple[int, ...], ...] = ()
    # [d] what planner.cost charges the whole model on device d alone (one stage) beyond the per-block
    # sum (negative: a weight several blocks read, a tied table, is held once there, and its blocks
    # each count it). Every other stage of a decoder holds at most one reader of such a weight, so the
    # sum is exact there. Empty: all zero.
    whole_model_delta_bytes: tuple[int, ...] = ()
    # [d][k] what device d holds of block k at the stage's update only (planner.cost.update_only_bytes:
    # a tied sum received, on PyTorch under gpipe and 1f1b-flush; not in state_delta_bytes), and [d][k]
    # the part of workspace_bytes only its backwards hold (the profile's stacked part; frozen weights
    # and the engine stay): a stage is charged the larger of its update's part and its backwards'
    # (with the inputs, kept parts, transient and once part), not both (planner.cost.phase_peak_bytes).
    # Empty: all zero.
    update_bytes: tuple[tuple[int, ...], ...] = ()
    backward_workspace_bytes: tuple[tuple[int, ...], ...] = ()
    # [d] the least a stage on device d peaks at (planner.cluster.setup_peak_bytes: the runtime with its
    # engine's import at its own peak; planner.cost.phase_peak_bytes' `setup`). Empty: all zero.
    setup_peak_bytes: tuple[int, ...] = ()
    # [d][k] what a stage on device d holds of its frozen base while block k runs, where it holds the base mapped
    # one block resident (planner.cost.block_mapped_frozen_bytes: PyTorch per block over a float32 LoRA base its
    # workers map); a stage is charged the largest of its own blocks' throughout (`stage_mapped_frozen`), not a
    # sum, and such blocks' workspace_bytes hold none of their frozen weights (planner.cost.
    # block_held_frozen_bytes). Empty: all zero (every block's frozen weights summed, in workspace_bytes).
    mapped_frozen_bytes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        check_schedule_name(self.schedule)
        check_optimizer_name(self.optimizer)
        nd, n = len(self.devices), len(self.block_names)
        if nd < 1 or n < 1:
            raise ValueError(f"an instance needs at least one device and one block, got {nd} and {n}")
        if len(set(self.devices)) != nd:
            raise ValueError(f"device names repeat: {self.devices}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {self.microbatches!r}")
        shapes = {
            "compute_us": (self.compute_us, (nd, n)), "workspace_bytes": (self.workspace_bytes, (nd, n)),
            "params_bytes": (self.params_bytes, (n,)), "input_bytes": (self.input_bytes, (n,)),
            "overhead_bytes": (self.overhead_bytes, (nd,)), "memory_budget_bytes": (self.memory_budget_bytes, (nd,)),
            "boundary_bytes": (self.boundary_bytes, (n - 1,)),
            "link_bandwidth_bytes_per_s": (self.link_bandwidth_bytes_per_s, (nd, nd)),
            "link_latency_us": (self.link_latency_us, (nd, nd)),
        }
        for name, (value, shape) in shapes.items():
            rows = value if len(shape) == 2 else [value]
            if len(value) != shape[0] or (len(shape) == 2 and any(len(r) != shape[1] for r in rows)):
                raise ValueError(f"PartitionInstance.{name} must have shape {shape}")
            for r in rows:
                if any(x < 0 for x in r):
                    raise ValueError(f"PartitionInstance.{name} has a negative entry")
        for name in ("unversioned_copies", "async_copies"):
            if not getattr(self, name):
                object.__setattr__(self, name, tuple((0,) * p for p in range(1, nd + 1)))
        for name in ("recompute_us", "update_us", "weight_us", "unversioned_bytes", "shared_current_bytes",
                     "transient_bytes", "kept_once_bytes", "update_bytes", "backward_workspace_bytes",
                     "mapped_frozen_bytes"):
            table = getattr(self, name)
            if not table:
                object.__setattr__(self, name, tuple((0,) * n for _ in range(nd)))
            elif len(table) != nd or any(len(r) != n or any(x < 0 for x in r) for r in table):
                raise ValueError(f"PartitionInstance.{name} must have shape {(nd, n)} with entries >= 0")
        if any(b > w for br, wr in zip(self.backward_workspace_bytes, self.workspace_bytes) for b, w in zip(br, wr)):
            raise ValueError("PartitionInstance.backward_workspace_bytes exceeds workspace_bytes: it is a part of it")
        if not self.whole_model_delta_bytes:
            object.__setattr__(self, "whole_model_delta_bytes", (0,) * nd)
        elif len(self.whole_model_delta_bytes) != nd:
            raise ValueError(f"PartitionInstance.whole_model_delta_bytes needs one entry per device ({nd})")
        if not self.keeps_activations:
            object.__setattr__(self, "keeps_activations", (False,) * nd)
        elif len(self.keeps_activations) != nd:
            raise ValueError(f"PartitionInstance.keeps_activations needs one entry per device ({nd})")
        if not self.state_delta_bytes:
            object.__setattr__(self, "state_delta_bytes", tuple((0,) * n for _ in range(nd)))
        elif len(self.state_delta_bytes) != nd or any(len(r) != n for r in self.state_delta_bytes):
            raise ValueError(f"PartitionInstance.state_delta_bytes must have shape {(nd, n)}")
        if list(self.joined) != sorted(set(self.joined)) or any(not 0 <= k < n - 1 for k in self.joined):
            raise ValueError(f"PartitionInstance.joined must be ascending boundaries in 0..{n - 2}, got {self.joined}")
        most = GRADIENT_COPIES + OPTIMIZER_STATE_COPIES[self.optimizer]
        if any(-d > most * p for row in self.state_delta_bytes for d, p in zip(row, self.params_bytes)):
            raise ValueError(f"PartitionInstance.state_delta_bytes takes off more than {most}x a block's parameters: "
                             f"only their gradient and optimizer state can be charged otherwise")
        if not self.kept_bytes:
            object.__setattr__(self, "kept_bytes", self.workspace_bytes)
        elif len(self.kept_bytes) != nd or any(len(r) != n or any(x < 0 for x in r) for r in self.kept_bytes):
            raise ValueError(f"PartitionInstance.kept_bytes must have shape {(nd, n)} with entries >= 0")
        if any(r > c for rr, cr in zip(self.recompute_us, self.compute_us) for r, c in zip(rr, cr)):
            raise ValueError("PartitionInstance.recompute_us exceeds compute_us: the re-run is part of the backward")
        if any(w + r > c for wr, rr, cr in zip(self.weight_us, self.recompute_us, self.compute_us)
               for w, r, c in zip(wr, rr, cr)):
            raise ValueError("PartitionInstance.weight_us and recompute_us exceed compute_us: both are parts of the "
                             "backward")
        if any(u > b for row in self.unversioned_bytes for u, b in zip(row, self.params_bytes)):
            raise ValueError("PartitionInstance.unversioned_bytes exceeds params_bytes: they are parameters")
        if any(u + c > b for ur, cr in zip(self.unversioned_bytes, self.shared_current_bytes)
               for u, c, b in zip(ur, cr, self.params_bytes)):
            raise ValueError("PartitionInstance.shared_current_bytes and unversioned_bytes exceed params_bytes: "
                             "they are parameters apart")
        for name in ("weight_copies", "in_flight", "unversioned_copies", "async_copies"):
            table = getattr(self, name)
            if len(table) != nd or any(len(row) != p + 1 for p, row in enumerate(table)):
                raise ValueError(f"PartitionInstance.{name} needs one row per stage count 1..{nd}, of that length")
            # the solver numbers stages from the end (see planner.partition.cpsat), which is exact only
            # because these counts depend on p-1-s alone (true of every schedule in planner.cost)
            for p, row in enumerate(table, start=1):
                for s, x in enumerate(row):
                    if x != table[p - 1 - s][0]:
                        raise ValueError(f"PartitionInstance.{name}[{p - 1}][{s}] = {x} differs from "
                                         f"[{p - 1 - s}][0] = {table[p - 1 - s][0]}: the entry must depend "
                                         f"only on the distance p-1-s from the last stage")
        for d, e in itertools.permutations(range(nd), 2):
            if self.link_bandwidth_bytes_per_s[d][e] <= 0:
                raise ValueError("PartitionInstance.link_bandwidth_bytes_per_s must be more than 0 between devices")
            if (self.link_bandwidth_bytes_per_s[d][e] != self.link_bandwidth_bytes_per_s[e][d]
                    or self.link_latency_us[d][e] != self.link_latency_us[e][d]):
                raise ValueError(f"links must be symmetric: {self.devices[d]!r}-{self.devices[e]!r} differs "
                                 f"from {self.devices[e]!r}-{self.devices[d]!r}")

    @property
    def blocks(self) -> int:
        return len(self.block_names)

    def reuses(self, p: int, s: int) -> bool:
        """Whether stage s of p skips MNN's forward re-run (planner.cost.reuses_forward)."""
        return reuses_forward(self.schedule, p, s, self.microbatches)

    def weight_bytes(self, d: int, k: int, p: int, s: int) -> int:
        """Bytes of block k's parameters (weights, gradient, optimizer state, old versions) device d
        holds at stage s of p throughout (what its update alone holds, `update_bytes`, apart)."""
        return (self.params_bytes[k] * self.weight_copies[p - 1][s]
                - self.unversioned_bytes[d][k] * self.unversioned_copies[p - 1][s]
                - self.shared_current_bytes[d][k] * self.async_copies[p - 1][s] + self.state_delta_bytes[d][k]
                - self.update_bytes[d][k])

    def held_workspace(self, d: int, k: int, in_flight: int) -> int:
        """Bytes of block k's workspace device d holds with `in_flight` micro-batches in flight."""
        return self.workspace_bytes[d][k] + kept_activation_bytes(self.kept_bytes[d][k], in_flight,
                                                                  self.keeps_activations[d])

    def stage_transient(self, d: int, first: int, last: int) -> int:
        """The largest transient of blocks first..last on device d, charged once per stage
        (planner.cost.transient_bytes)."""
        return max(self.transient_bytes[d][first:last + 1], default=0)

    def stage_mapped_frozen(self, d: int, first: int, last: int) -> int:
        """The frozen base a stage of blocks first..last on device d holds mapped, the largest of its blocks'
        (`mapped_frozen_bytes`; planner.cost.mapped_frozen_bytes), held throughout."""
        return max(self.mapped_frozen_bytes[d][first:last + 1], default=0)

    def stage_kept_once(self, d: int, first: int, last: int, in_flight: int) -> int:
        """What the further micro-batches in flight hold once on a stage of blocks first..last on device
        d: the largest of its blocks' `kept_once_bytes`, `kept_copies` times (planner.cost.kept_once_bytes)."""
        return kept_activation_bytes(max(self.kept_once_bytes[d][first:last + 1], default=0), in_flight,
                                     self.keeps_activations[d])

    def block_backward_bytes(self, d: int, k: int, fl: int) -> int:
        """What only the backwards hold of block k on device d with `fl` micro-batches in flight: its
        stashed inputs and the backward part of its workspace (`held_workspace` less what is held
        throughout)."""
        return (self.input_bytes[k] * fl + self.held_workspace(d, k, fl) - self.workspace_bytes[d][k]
                + self.backward_workspace_bytes[d][k])

    def stage_phases(self, d: int, first: int, last: int, p: int, s: int) -> tuple[int, int, int]:
        """(held throughout, held by the backwards only, held by the update only) of stage s of p
        running blocks first..last on device d (planner.cost.phase_peak_bytes)."""
        fl = self.in_flight[p - 1][s]
        whole = self.whole_model_delta_bytes[d] if (first, last) == (0, self.blocks - 1) else 0
        blocks = range(first, last + 1)
        backward = (self.stage_transient(d, first, last) + self.stage_kept_once(d, first, last, fl)
                    + sum(self.block_backward_bytes(d, k, fl) for k in blocks))
        held = (self.overhead_bytes[d] + whole + self.stage_mapped_frozen(d, first, last)
                + sum(self.weight_bytes(d, k, p, s) + self.input_bytes[k] * fl + self.held_workspace(d, k, fl)
                      - self.block_backward_bytes(d, k, fl) for k in blocks))
        return held, backward, sum(self.update_bytes[d][k] for k in blocks)

    def stage_floor_bytes(self, d: int) -> int:
        """The least any stage on device d peaks at, whatever it holds: its set-up's peak (`setup_peak_bytes`;
        0 where not measured). The solvers state it as a device that cannot hold a stage where it is over
        the budget (CP-SAT, the DP, the greedy fill), as `stage_bytes` charges it."""
        return self.setup_peak_bytes[d] if self.setup_peak_bytes else 0

    def stage_bytes(self, d: int, first: int, last: int, p: int, s: int) -> int:
        """Memory of stage s of p running blocks first..last on device d: the instance's one form of
        planner.cost.stage_memory_bytes (the resident runtime, per block its weights and their copies,
        its stashed inputs and workspace, the stage's one transient and its once part per further
        micro-batch in flight; what only its update holds against what only its backwards hold, the
        larger of the two: `stage_phases`). The CP-SAT model and the DP state the same sums linearly
        (the transient and the once part as maxima, the update's part as a second bound), and tests
        hold all three to planner.cost."""
        return phase_peak_bytes(*self.stage_phases(d, first, last, p, s), self.stage_floor_bytes(d))

    def stage_compute_us(self, d: int, k: int, p: int, s: int) -> int:
        """Block k's forward+backward on device d at stage s of p."""
        return self.compute_us[d][k] - (self.recompute_us[d][k] if self.reuses(p, s) else 0)

    def transfer_us(self, d: int, e: int, k: int) -> int:
        """One transfer of the activation after block k between devices d and e."""
        return round(self.boundary_bytes[k] * US_PER_S / self.link_bandwidth_bytes_per_s[d][e]) + self.link_latency_us[d][e]


def make_instance(graph: Graph, cluster: Cluster, schedule: str, microbatches: int, optimizer: str,
                  update_every: int = 1) -> PartitionInstance:
    """The instance for partitioning `graph` over all of `cluster`'s devices (planner.cost's numbers;
    memory with an update after every `update_every` backwards under 1f1b-stash and 2bw)."""
    check_schedule_name(schedule)
    check_optimizer_name(optimizer)
    blocks = check_blocks(graph)
    specs = cluster.devices
    costs = [block_costs(graph, spec) for spec in specs]
    if joined_boundaries(graph):  # the fused head's gradient added into the sum (planner.cost, as stage_memory_terms)
        head = len(blocks) - 2
        costs = [[_less_summed_head(c, min(c.stacked, summed_head_gradient_bytes(graph, spec, schedule, update_every,
                                                                                 microbatches)))
                  if k == head else c for k, c in enumerate(row)] for row, spec in zip(costs, specs)]
    share = accumulated_share(schedule, microbatches, update_every)  # gradient additions per micro-batch
    # update_us: one optimizer step under flush schedules (once per batch); under 1f1b-stash and 2bw
    # the steps per micro-batch (one per update_every backwards), as the step formula counts it m times
    per_update = updates_per_microbatch(schedule, microbatches, update_every) if schedule in ASYNC_SCHEDULES else 1.0
    nd = len(specs)

    def link(d: int, e: int):
        return None if d == e else cluster.link(specs[d].name, specs[e].name)

    inst = PartitionInstance(
        devices=tuple(s.name for s in specs),
        block_names=tuple(b.name for b in blocks),
        compute_us=tuple(tuple(round((c.forward_s + c.backward_s + b.params_bytes * share
                                      * s.profile.accumulate_s_per_param_byte) * US_PER_S)
                               for c, b in zip(row, blocks)) for row, s in zip(costs, specs)),
        params_bytes=tuple(b.params_bytes for b in blocks),
        input_bytes=block_input_bytes(graph),
        # frozen weights (LoRA's base) are held once wherever the block runs, like its workspace; a stage holding
        # its base mapped one block resident holds the largest of its blocks' instead (`mapped_frozen_bytes`); a table an
        # MNN stage streaming its mapped base only looks up not (`planner.cost.streamed_block_bound_bytes`)
        workspace_bytes=tuple(tuple(c.stacked + block_held_frozen_bytes(graph, k, spec) + block_engine_bytes(graph, spec, k, c)
                                    for k, c in enumerate(row)) for row, spec in zip(costs, specs)),
        mapped_frozen_bytes=tuple(block_mapped_frozen_bytes(graph, spec) for spec in specs),
        kept_bytes=tuple(tuple(c.kept for c in row) for row in costs),
        base_dtype_savings=base_dtype_savings(graph),
        # the runtime, and what its engine's build holds once a stage (planner.cost.engine_once_bytes); a stage
        # streaming its mapped base, one read of the mapping (planner.cost.streamed_read_bytes)
        overhead_bytes=tuple(runtime_bytes(s) + engine_once_bytes(s) + streamed_read_bytes(graph, s) for s in specs),
        setup_peak_bytes=tuple(setup_peak_bytes(s) for s in specs),
        # each stage pays the largest of its own blocks' transients (planner.cost.transient_bytes)
        transient_bytes=tuple(block_transients(graph, s) for s in specs),
        # and the largest of its blocks' once part per further micro-batch (planner.cost.kept_once_bytes)
        kept_once_bytes=tuple(block_kept_once(graph, s) for s in specs),
        memory_budget_bytes=tuple(s.plannable_bytes for s in specs),  # less what the job reserved
        boundary_bytes=tuple(b.activation_bytes for b in blocks[:-1]),
        link_bandwidth_bytes_per_s=tuple(tuple(math.inf if link(d, e) is None else link(d, e).bandwidth_bytes_per_s
                                               for e in range(nd)) for d in range(nd)),
        link_latency_us=tuple(tuple(0 if link(d, e) is None else round(link(d, e).latency_s * US_PER_S)
                                    for e in range(nd)) for d in range(nd)),
        weight_copies=tuple(tuple(weight_copies(schedule, optimizer, p, s, microbatches, update_every)
                                  for s in range(p)) for p in range(1, nd + 1)),
        in_flight=tuple(tuple(in_flight_microbatches(schedule, p, s, microbatches) for s in range(p))
                        for p in range(1, nd + 1)),
        microbatches=microbatches, schedule=schedule, optimizer=optimizer,
        # the re-run is part of the backward: a noisy profile may time it above the backward itself;
        # a device recomputing per block re-runs it in every backward (no forward reuse)
        recompute_us=tuple(tuple(0 if activation_mode(spec)[0] == "per-block" else round(min(c.recompute_s, c.backward_s)
                                                                                      * US_PER_S) for c in row)
                           for row, spec in zip(costs, specs)),
        update_us=tuple(tuple(round(b.params_bytes * update_rate(s, optimizer) * per_update * US_PER_S)
                              for b in blocks) for s in specs),
        weight_us=tuple(tuple(round(w * US_PER_S) for w in block_weight_grads_s(graph, s, schedule, microbatches))
                        for s in specs) if schedule in SPLIT_BACKWARD_SCHEDULES else (),
        keeps_activations=tuple(keeps_activations(s) for s in specs),
        unversioned_copies=tuple(tuple(unversioned_copies(schedule, p, s, microbatches, update_every)
                                       for s in range(p)) for p in range(1, nd + 1)),
        # a table goes with the first block that lists it (planner.cost.unversioned_bytes counts it
        # once per range; attributing it once keeps the instance's sum at most that)
        unversioned_bytes=tuple(_per_block(lambda k: unversioned_bytes(graph, 0, k, spec), len(blocks))
                                for spec in specs),
        async_copies=tuple(tuple(async_extra_copies(schedule, p, s) for s in range(p)) for p in range(1, nd + 1)),
        shared_current_bytes=tuple(_per_block(lambda k: shared_current_bytes(graph, 0, k, spec), len(blocks))
                                   for spec in specs),
        # what blocks' looked-up-only tables' gradients and AdamW state, held as rows, change
        # against their dense charge, less the gradients PyTorch steps in its backward, plus the
        # tied-gradient sums received at an update (planner.cost.tied_sum_bytes)
        state_delta_bytes=tuple(_per_block(lambda k: row_gradient_delta_bytes(graph, 0, k, spec, microbatches, schedule,
                                                                              update_every)
                                           + table_state_delta_bytes(graph, 0, k, spec, optimizer)
                                           - stepped_gradient_bytes(graph, 0, k, spec, schedule, update_every)
                                           + unsummed_gradient_bytes(graph, 0, k, spec, schedule, update_every, microbatches)
                                           + tied_sum_bytes(graph, 0, k),
                                           len(blocks))
                                for spec in specs),
        # ... of which the update alone holds the sums received, against the backwards' part
        # (planner.cost.phase_peak_bytes): per block as a stage of that block alone holds it (the
        # whole model, which holds every holder and so holds its sum throughout, is priced by
        # planner.cost itself: `whole_model_delta_bytes`)
        update_bytes=tuple(tuple(update_only_bytes(graph, k, k, spec, schedule) for k in range(len(blocks)))
                           for spec in specs),
        backward_workspace_bytes=tuple(tuple(c.stacked for c in row) for row in costs),
        joined=joined_boundaries(graph))
    # the one stage that holds every reader of a shared weight: priced by planner.cost itself
    n = len(blocks)
    whole = tuple(stage_memory_bytes(graph, spec, 0, n - 1, 0, 1, schedule, microbatches, optimizer, update_every)
                  - inst.stage_bytes(d, 0, n - 1, 1, 0) for d, spec in enumerate(specs))
    return dataclasses.replace(inst, whole_model_delta_bytes=whole)


def _less_summed_head(cost, nbytes: int):
    """The fused head's cost without its weight gradient's `nbytes` (its workspace and stacked part alike)."""
    return replace(cost, workspace_bytes=cost.workspace_bytes - nbytes, stacked_bytes=cost.stacked - nbytes) \
        if nbytes else cost


def _per_block(prefix, n: int) -> tuple[int, ...]:
    """Block k's share of a figure counted once per range of blocks 0..k (`prefix(k)`): prefix(k) -
    prefix(k-1), each prefix computed once."""
    sums = [prefix(k) for k in range(n)]
    return tuple(b - a for a, b in zip([0] + sums[:-1], sums))


# --- evaluating one assignment (shared by brute force, the solver's answer and manual plans) ---

Assignment = tuple[tuple[int, ...], tuple[tuple[int, int], ...]]  # device indices, block ranges


def _memory_bytes(inst: PartitionInstance, d: int, first: int, last: int, s: int, p: int) -> int:
    return inst.stage_bytes(d, first, last, p, s)


def _times_us(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]):
    """(compute per stage, one transfer per boundary, optimizer step per stage)."""
    p = len(devs)
    compute = [sum(inst.stage_compute_us(d, k, p, s) for k in range(first, last + 1))
               for s, (d, (first, last)) in enumerate(zip(devs, ranges))]
    link = [inst.transfer_us(devs[s], devs[s + 1], ranges[s][1]) for s in range(p - 1)]
    update = [sum(inst.update_us[d][first:last + 1]) for d, (first, last) in zip(devs, ranges)]
    return compute, link, update


def _weights_us(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The W pass per stage (all 0 unless the schedule splits backwards)."""
    return [sum(inst.weight_us[d][first:last + 1]) for d, (first, last) in zip(devs, ranges)]


def _stage_times_us(compute: list[int], link: list[int]) -> list[int]:
    p = len(compute)
    return [compute[s] + (link[s] if s < p - 1 else 0) + (link[s - 1] if s > 0 else 0) for s in range(p)]


def _objective_us(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]) -> int:
    compute, link, update = _times_us(inst, devs, ranges)
    if inst.schedule in ASYNC_SCHEDULES:
        return inst.microbatches * max([c + u for c, u in zip(compute, update)] + [2 * b for b in link])
    times, weight = _stage_times_us(compute, link), _weights_us(inst, devs, ranges)
    return sum(times) - sum(weight) + (inst.microbatches - 1) * max(times) + max(w + u for w, u in zip(weight, update))


def _cuts_joined(inst: PartitionInstance, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The joined boundaries (PartitionInstance.joined) the ranges cut."""
    return [last for _, last in ranges[:-1] if last in inst.joined]


def _overflows(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[int]:
    p = len(devs)
    return [_memory_bytes(inst, d, first, last, s, p) - inst.memory_budget_bytes[d]
            for s, (d, (first, last)) in enumerate(zip(devs, ranges))]


def _partition(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]], method: str,
               optimal: bool = False) -> Partition:
    p = len(devs)
    compute, link, _ = _times_us(inst, devs, ranges)
    times = _stage_times_us(compute, link)
    stages = tuple(StageAssignment(s, inst.devices[d], first, last, times[s] / US_PER_S,
                                   _memory_bytes(inst, d, first, last, s, p), inst.memory_budget_bytes[d])
                   for s, (d, (first, last)) in enumerate(zip(devs, ranges)))
    return Partition(stages, method, max(times) / US_PER_S, optimal)


def _assignment(inst: PartitionInstance, partition: Partition) -> Assignment:
    index = {name: i for i, name in enumerate(inst.devices)}
    return tuple(index[n] for n in partition.devices), tuple(partition.ranges)


def predicted_step_us(inst: PartitionInstance, partition: Partition) -> int:
    """The objective every partitioner minimises: predicted step time in integer microseconds."""
    devs, ranges = _assignment(inst, partition)
    return _objective_us(inst, devs, ranges)


# --- interchangeable devices -----------------------------------------------------------------

def device_classes(inst: PartitionInstance) -> tuple[tuple[int, ...], ...]:
    """Groups of devices the solver may treat as interchangeable, each in index order.

    Two devices are interchangeable when their measured costs, memory figures and budgets are equal
    and every other device reaches them over equal links, so that a plan stays as good when the two
    swap. Clusters of edge devices repeat a few device models (eight phones of one kind), and the
    model grows with the number of classes, not of devices. Found by partition refinement: start
    from equal costs and budgets, split by the multiset of link values towards each class until
    stable, and split a class into single devices where one member sees different links towards
    the members of one class (refinement alone cannot see that).
    """
    nd = len(inst.devices)
    bw, lat = inst.link_bandwidth_bytes_per_s, inst.link_latency_us
    keys: dict = {}
    label = [keys.setdefault((inst.compute_us[d], inst.recompute_us[d], inst.update_us[d], inst.weight_us[d],
                              inst.workspace_bytes[d], inst.kept_bytes[d], inst.state_delta_bytes[d],
                              inst.overhead_bytes[d], inst.memory_budget_bytes[d], inst.keeps_activations[d],
                              inst.transient_bytes[d], inst.kept_once_bytes[d], inst.whole_model_delta_bytes[d],
                              inst.update_bytes[d], inst.backward_workspace_bytes[d]),
                             len(keys)) for d in range(nd)]

    def towards(d: int) -> dict[int, list]:
        out: dict[int, list] = {}
        for e in range(nd):
            if e != d:
                out.setdefault(label[e], []).append((bw[d][e], lat[d][e]))
        return out

    while True:
        while True:
            sigs: dict = {}
            new = [sigs.setdefault((label[d], tuple(sorted((c, tuple(sorted(v))) for c, v in towards(d).items()))),
                                   len(sigs)) for d in range(nd)]
            stable = len(sigs) == len(set(label))
            label = new
            if stable:
                break
        mixed = {label[d] for d in range(nd) if any(len(set(v)) > 1 for v in towards(d).values())}
        if not mixed:
            break
        label = [label[d] if label[d] not in mixed else len(label) + d for d in range(nd)]
    groups: dict[int, list[int]] = {}
    for d in range(nd):
        groups.setdefault(label[d], []).append(d)
    return tuple(tuple(g) for g in sorted(groups.values()))
