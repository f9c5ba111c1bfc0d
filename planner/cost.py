"""The cost model: predicted time and memory of a pipeline stage, from profiles and the graph.

Pure functions of (graph, cluster, schedule, micro-batches, optimizer); the partitioner
(planner.partition) prepares its instance from them and the simulator replays their StageCosts.

Time, for one micro-batch on stage s of p (device d, blocks first..last):
- compute: the sum of `forward_s` and `backward_s` of the blocks' signatures on the device's
  backend (`planner.cluster.device_backend`; `backward_s` includes MNN's re-run of the
  forward). A stage whose every backward directly follows its own micro-batch's forward keeps
  MNN's per-op caches and skips that re-run (`reuses_forward`: the last stage under 1F1B, or any
  schedule with one micro-batch), so `recompute_s` is subtracted there; that re-run is at least
  half the forward of a block with ops MNN's caches save (`mnn_rerun_floor`: a loaded profile read it
  ~0, which tied keeping with per block). PyTorch recomputing per
  block pays keeping's backward and each checkpointed block's forward once more
  (`per_block_rerun_s`), never less than keeping, whatever a loaded profile timed it at.
- gradient accumulation, charged to the backward: parameter bytes x the profile's seconds per
  byte of `acc += g` x (m-1)/m under flush schedules (`accumulated_share`).
- optimizer step (`update_s`): parameter bytes x the profile's measured seconds per parameter
  byte of the optimizer; once per batch under flush schedules, after every backward under
  1f1b-stash.
- links (DESIGN: per boundary per micro-batch, 2 x activation bytes / bandwidth + 2 x latency):
  each boundary's two transfers are split between its two stages, `send_act_s` (the activation
  to s+1, charged to s) and `send_grad_s` (the gradient of the input back to s-1, charged to s;
  same bytes as that input activation). A boundary's link time is therefore
  `costs[s].send_act_s + costs[s+1].send_grad_s`.
- stage time `stage_time_s(cost)` = forward + backward + send_act + send_grad: the stage's share
  of one micro-batch with no overlap of compute and transfer (the conservative view).

Memory, peak bytes of stage s of p under the schedule (facts of runtime/engines/mnn.py,
runtime/pipeline/executor.py and runtime/optim.py; the constants below say which):
    params x (WEIGHT_COPIES, or ASYNC_WEIGHT_COPIES under 1f1b-stash and 2bw on a stage with
              forwards in flight at its updates (every stage but the last; not on PyTorch, whose
              new tensors are an old version's charge: `shared_current_bytes`), + GRADIENT_COPIES
              where backwards are summed (not 1f1b-stash) + OPTIMIZER_STATE_COPIES[opt] + old
              weight versions)
  + embedding tables MNN holds twice (`double_held_bytes`) and frozen weights, once (read mapped from
    the model file by a stage recomputing per block, `mapped_frozen_bytes`: on PyTorch its largest block's,
    on MNN its placeholder sets' and the fused LM head's table, `streamed_frozen_bytes`)
  + for an embedding table only looked up, its gradient as the rows an update sums instead of a
    dense copy (`row_gradient_delta_bytes`: MiniLM's 47 MB word table, 3 MiB of rows at 8 x 128)
  + in-flight micro-batches x (sum of the stage's block *input* activations)
  + the blocks' workspace (`workspace_of`): each block's `BlockCost.stacked` (what one more block
    of its kind adds to a stage's peak: per-op caches, gradients), plus on a device that keeps its
    activations each block's `BlockCost.kept` for every micro-batch in flight after the first
    (PyTorch's autograd holds every micro-batch's saved tensors until its backward, MNN with
    `activations: keep` one set of block graphs and their per-op caches per micro-batch in flight);
    one that recomputes holds one micro-batch's (`DeviceSpec.activations`, `block_costs`: PyTorch
    runs each block's forward once more in its backward, MNN keeping skips its re-run). Profiles
    without those two measurements charge the whole workspace for each (the older model).
  + on PyTorch recomputing per block, what each further micro-batch in flight holds once a stage
    beside its blocks' kept parts (`kept_once_bytes`: the largest of the stage's blocks'
    `BlockCost.per_block_kept_once_bytes`, x `kept_copies`; the partitioners take the same max)
  + the largest transient of the stage's own blocks (`transient_bytes`: workspace - stacked; one
    block's backward temporaries exist at a time), once per stage (the partitioners take the same
    max over a stage's blocks: `PartitionInstance.stage_bytes`)
  + the profile's `runtime_overhead_bytes`;
and never less than the set-up's peak (`phase_peak_bytes`' `setup`, `planner.cluster.setup_peak_bytes`):
the runtime and its engine's import at that import's own peak, which a worker pays before it reads a
weight (torch's: ~227 MiB against 209.6 charged as settled; profiles made before: no floor).
Under gpipe and 1f1b-flush (`phases_apart`, both engines) what only the update holds (a tied sum
received: `update_only_bytes`) and what only the backwards hold (the activations, kept parts,
workspace and transient above) are never held at once: a stage is charged the larger of the two
(`phase_peak_bytes`), everything else beside it.
Old weight versions (`stashed_weight_versions`) exist under 1f1b-stash and 2bw only; an embedding
table nothing but lookups read is held once under every schedule, stepped in place with no old
version (`unversioned_bytes` x `unversioned_copies` comes off); in-flight counts
(`in_flight_microbatches`) are DESIGN's min(p-s, m) for 1F1B and m for GPipe. Transient buffers
(the output until its send, gradients until theirs, host values such as the mask) are not counted,
except the one that is the model's largest activation (below).

Decoder LLMs:
- A weight several blocks read (a tied LM head: the embedding table) is held once per stage:
  `stage_params_bytes` counts it once, not once per block.
- The causal-LM loss with the LM head on the same stage runs fused (`runtime.engines.stage.
  fused_lm_head`): the vocabulary-sized logits are never held, the loss block stashes only the
  head's hidden state (`block_input_bytes`), and the profile charges the fused kernel's time and
  workspace to the head's signature (`runtime.profiling.device`), so the loss carries no workspace
  of its own (`block_costs`). No plan cuts between the two (`joined_boundaries`, which every
  partitioner honours). A plan from before that made the logits a boundary activation: sent and
  received, stashed on the loss's stage and held by the head's stage until its gradient returns;
  `stage_memory_bytes` still prices such a plan so (with the loss's own measured workspace).
- Tied weights across stages (the embedding on the first stage, the head on the last): each holder
  keeps a copy and, at every flush, sends its gradient for them and receives the sum before its
  update (docs/DESIGN.md; the runtime protocol: docs/llms.md, "Training"): time two transfers of
  those bytes per step (`tied_bytes`), charged to the stage's update (`stage_cost`); memory the
  table once more where the holder's gradient is rows (`tied_sum_bytes`: the lookup's stage, whose
  sum arrives dense; measured on SmolLM2 at the update, the peak of its first stage), none where
  its blocks made a dense gradient of it every backward (the head's, counted in its workspace). On
  PyTorch the lookup's stage holds that gradient as rows, not dense, until the sum replaces it
  (`_tied_lookup_delta_bytes`, within `row_gradient_delta_bytes`). An
  MNN device holds a table twice only where an MNN graph reads it (`double_held_bytes`: a tied head
  not fused). 1f1b-stash cannot keep the copies equal: `check_tied_schedule` refuses such a cut
  under it.
"""
from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Mapping, Sequence

from ir.backend import engine_of
from ir.documents import HYBRID, activations_mode, maps_frozen_base
from ir.graph import Block, Graph, block_signature, tied_parameters
from ir.mapped_pages import FAULT_SPAN_BYTES
from ir.partition import WEIGHT_GRAD_SHARE, Partition, StageCost
from ir.plan import ASYNC_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, check_optimizer_name, check_schedule_name
from ir.precision import BLOCK, QuantizedTensor, bytes_per_element, lookup_tables, quantizable, storage_for
from ir.profile import BlockCost
from ir.verify import peak_weight_versions
from planner.cluster import (Cluster, DeviceSpec, device_backend, runtime_bytes, setup_peak_bytes, start_up_bytes,
                             update_rate)
from planner.onnx_weights import MAP_MIN_BYTES
from planner.schedule import one_f_one_b_stash


# Weights a stage holds per parameter byte, besides gradients, optimizer state and old versions.
# Flush schedules: once (MNN's current weights are its Vars' own memory, `K.memory_of`; PyTorch's
# tensors share the arrays the worker received). Schedules that update with forwards in flight
# (1f1b-stash, 2bw): twice on MNN (its current weights apart from the Var set a forward in flight
# reads; PyTorch's new tensors are what an old version is charged, `shared_current_bytes`), except
# on the last stage, which runs each forward's backward at once and so updates with nothing in
# flight: both engines then step their weights where they are (`async_extra_copies`). An embedding
# table another op also reads (a tied LM head) is held once more on MNN (`double_held_bytes`).
WEIGHT_COPIES = 1
ASYNC_WEIGHT_COPIES = 2
# The executor's gradient sum (`StageExecutor.grad_sum`): one array per parameter. An embedding
# table nothing but lookups read has rows instead, never made dense (`row_gradient_delta_bytes`).
# Not under 1f1b-stash, which the cost model prices with an update after every backward (as
# `accumulated_share` does): each backward's gradient is stepped as it comes, and its arrays are
# part of the workspace the profile measured (`gradient_copies`).
GRADIENT_COPIES = 1
# A row gradient's sum is joined anew at each micro-batch's backward (`runtime.engines.base.
# accumulate`), the old sum alive while the new one is built: up to twice the rows of an update.
ROW_GRADIENT_COPIES = 2
# Placeholder sets an MNN per-block stage streams its mapped float32 base through (the engine's
# `runtime.engines.mnn.STREAM_SETS`, where its cost is measured; `streamed_frozen_bytes` charges it). The
# planner may not import the runtime, nor the engine the planner (+5.3 MiB in every worker, measured): a test
# holds the two equal.
STREAM_SETS = 10
# Optimizer state per parameter (runtime/optim.py): SGD one momentum buffer, AdamW two moments.
OPTIMIZER_STATE_COPIES = {"sgd": 1, "adamw": 2}
# AdamW keeps an embedding table's m and v only for the rows that ever had a gradient
# (runtime.optim's `_RowState`: an int64 slot per table row, then per held row an int64 id and a
# row of each moment, written in order into maps with room for every row, of which only the pages
# written are resident: the held rows' bytes and at most a page more per array) until more than
# ROWS_DENSE_SHARE of the rows have state; then they are dense for good.
# runtime.optim's figures (tests/planner/test_lookups.py holds the model to what it keeps).
ROWS_DENSE_SHARE = 0.4
ROW_STATE_PAGE = 4096
# Each old weight version kept under 1f1b-stash is one numpy copy (`MNNStageEngine._old_versions`).
STASHED_VERSION_COPIES = 1


def _check_position(stages: int, stage: int, microbatches: int) -> None:
    for name, v in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be an int in 0..{stages - 1}, got {stage!r}")


def in_flight_microbatches(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak (= planner.schedule.peak_in_flight)."""
    check_schedule_name(schedule)
    _check_position(stages, stage, microbatches)
    if schedule == "gpipe":
        return microbatches
    return min(stages - stage, microbatches)


@lru_cache(maxsize=None)
def stashed_weight_versions(schedule: str, stages: int, stage: int, microbatches: int, update_every: int = 1) -> int:
    """Weight versions stage `stage` keeps besides the current one, at its peak (an update after
    every `update_every` backwards). PipeDream's p-s-1 in the steady state with an update after
    every backward; fewer when the run is too short to reach it, or with updates further apart
    (the forwards in flight then span fewer updates). Equals `ir.verify.peak_weight_versions` of
    the compute schedule minus one, which is what 1f1b-stash with `update_every` > 1 is priced by.

    Derivation for 1f1b-stash: stage s runs w = min(p-s-1, m) warm-up forwards on version 0, then
    F(w+i), B(i), UPDATE for i < m-w; forward w+i uses version i. Right after UPDATE i the
    micro-batches i+1..w+i are in flight on min(w, i+1) distinct older versions, so the peak is
    min(w, m-w). When m <= w there is no steady state: all forwards use version 0, which stays
    alive (1 old version) after the first update if a second micro-batch is in flight.
    """
    check_schedule_name(schedule)
    _check_position(stages, stage, microbatches)
    _check_update_every(update_every)
    if schedule not in ASYNC_SCHEDULES:
        return 0
    if schedule == "1f1b-stash" and update_every > 1:
        return peak_weight_versions(one_f_one_b_stash(stages, microbatches, update_every))[stage] - 1
    w = min(stages - stage - 1, microbatches)
    if microbatches > w:
        old = min(w, microbatches - w)
    else:
        old = 1 if microbatches >= 2 else 0
    # PipeDream-2BW: two versions at most (planner.schedule.pipedream_2bw), whatever its update_every
    return min(1, old) if schedule == "2bw" else old


def _check_update_every(update_every: int) -> None:
    if not isinstance(update_every, int) or isinstance(update_every, bool) or update_every < 1:
        raise ValueError(f"update_every must be an int >= 1, got {update_every!r}")


def async_extra_copies(schedule: str, stages: int, stage: int) -> int:
    """Current weights held besides WEIGHT_COPIES: ASYNC_WEIGHT_COPIES - WEIGHT_COPIES where the
    schedule updates with forwards in flight (1f1b-stash and 2bw, every stage but the last; the
    last runs F B F B, so nothing is in flight at its updates and neither engine separates its
    current weights: PyTorch's `step` writes new tensors only while `_saved` holds a forward, MNN's
    `_keep_old_version` copies only for a stashed forward of the current version), else 0."""
    check_schedule_name(schedule)
    if schedule not in ASYNC_SCHEDULES or stage == stages - 1:
        return 0
    return ASYNC_WEIGHT_COPIES - WEIGHT_COPIES


def unversioned_copies(schedule: str, stages: int, stage: int, microbatches: int, update_every: int = 1) -> int:
    """Copies within `weight_copies` that an embedding table nothing but lookups read
    (`unversioned_bytes`) is not held in: its old versions, and under 1f1b-stash and 2bw its
    second current copy, since both engines step such a table in place (PyTorch's `_new_version`,
    MNN's numpy tables): no forward in flight reads it again."""
    return (STASHED_VERSION_COPIES * stashed_weight_versions(schedule, stages, stage, microbatches, update_every)
            + async_extra_copies(schedule, stages, stage))


def summed_backwards(schedule: str, microbatches: int, update_every: int = 1) -> int:
    """Backwards whose weight gradients one update reads: a flush schedule's `microbatches` (one update a
    batch), 1f1b-stash's and 2bw's `update_every`."""
    check_schedule_name(schedule)
    _check_update_every(update_every)
    _check_position(1, 0, microbatches)
    return update_every if schedule in ASYNC_SCHEDULES else microbatches


def gradient_copies(schedule: str, update_every: int = 1, microbatches: int | None = None) -> int:
    """Gradient sums a stage holds per byte of its parameters: GRADIENT_COPIES where an update reads
    the sum of several backwards (`summed_backwards` > 1; `microbatches` None: as many as a flush
    schedule's batch is split into, taken as more than one), none where it reads one backward's own
    (1f1b-stash updating after every backward, a flush schedule of one micro-batch: the sum a backward
    starts is its own gradients, `runtime.engines.base.accumulate` taking the first as it is, which the
    profile's workspace holds, each block's `stacked` part). 2bw is charged its sum always (one backward an
    update not measured there)."""
    check_schedule_name(schedule)
    _check_update_every(update_every)
    if schedule == "2bw":
        return GRADIENT_COPIES
    return 0 if summed_backwards(schedule, 2 if microbatches is None else microbatches, update_every) == 1 \
        else GRADIENT_COPIES


def weight_copies(schedule: str, optimizer: str, stages: int, stage: int, microbatches: int,
                  update_every: int = 1) -> int:
    """Bytes a stage holds per byte of its parameters: weights, gradient, optimizer state, old versions."""
    check_optimizer_name(optimizer)
    return (WEIGHT_COPIES + async_extra_copies(schedule, stages, stage)
            + gradient_copies(schedule, update_every, microbatches) + OPTIMIZER_STATE_COPIES[optimizer]
            + STASHED_VERSION_COPIES * stashed_weight_versions(schedule, stages, stage, microbatches, update_every))


def check_blocks(graph: Graph) -> tuple[Block, ...]:
    """The graph's blocks, which must be indexed 0..n-1 in order."""
    if not graph.blocks:
        raise ValueError(f"graph {graph.name!r} has no blocks; run the block pass first")
    for i, b in enumerate(graph.blocks):
        if b.index != i:
            raise ValueError(f"graph {graph.name!r}: block {b.name!r} at position {i} has index {b.index}")
    return graph.blocks


# What an engine does with the activations of the micro-batches in flight, unless the planner
# chooses (`DeviceSpec.activations`): PyTorch's autograd keeps them all; MNN keeps one micro-batch's
# per-op caches and re-runs the forward in the backward of any other.
DEFAULT_ACTIVATIONS = {"torch": "keep", "mnn": "recompute"}
ACTIVATIONS = ("keep", "recompute", "per-block")
# The choices each engine offers: both also recompute per block ("per-block": only each block's input
# held, each block's forward re-run inside its own backward; MNN keeps no per-op caches, PyTorch runs
# each block under a checkpoint of its own), charged each block's `BlockCost.per_block_stacked`
# instead of its `stacked` part. PyTorch's per-block only where its profile measured it
# (`measured_per_block`).
# On PyTorch only from a profile that measured its lines as a worker runs (`BackendProfile.fresh_lines`):
# a fresh torch worker grows ~3.5-4 MiB a further layer recomputing per block (glibc's dynamic mmap
# threshold keeps the layers' temporaries in a growing heap), where `profile`, warm in its own process,
# measured 0.5-3.1, and those plans ran 1.01-1.21x their figure (benchmarks/MEMORY_NOTES.md).
ENGINE_ACTIVATIONS = {"torch": ("keep", "recompute", "per-block"), "mnn": ("keep", "recompute", "per-block")}


def device_engine(device: DeviceSpec) -> str | None:
    """The engine of the device's backend (None for a nominal profile's, which names none)."""
    try:
        return engine_of(device_backend(device).backend)
    except ValueError:
        return None


def activations_of(device: DeviceSpec) -> str | None:
    """"keep", "recompute" or "per-block": the planner's choice, else the engine's default (None: an
    engine the model knows nothing of, costed as measured)."""
    engine = device_engine(device)
    if engine not in DEFAULT_ACTIVATIONS:
        return None
    return device.activations or DEFAULT_ACTIVATIONS[engine]


def activation_mode(device: DeviceSpec) -> tuple[str | None, int]:
    """(mode, cached blocks) of the device's activations (`activations_of`): "per-block+6" (MNN's
    hybrid, `hybrid_activations`) is ("per-block", 6); any other choice itself with 0."""
    return activations_mode(activations_of(device))


def cached_block_indices(graph: Graph, first: int, last: int, count: int) -> list[int]:
    """The blocks of first..last whose per-op caches a per-block stage with `count` cached blocks
    keeps (`runtime.engines.mnn.cached_programs`): the last `count` that read an activation, never the
    embedding (block 0), nor the loss or an LM head fused with it (the pair's charge is its own)."""
    n = len(graph.blocks)
    fused = fused_loss_hidden_bytes(graph) is not None
    skip = {0}
    if fused:
        skip.add(n - 1)
        if last == n - 1:
            skip.add(n - 2)
    candidates = [i for i in range(first, last + 1) if i not in skip]
    return candidates[max(0, len(candidates) - count):] if count > 0 else []


def cache_bytes_per_block(graph: Graph, device: DeviceSpec) -> list[int]:
    """Per block, what keeping its per-op caches adds to a per-block stage: its measured stacked
    workspace with caches less that recomputing per block (`BlockCost.stacked`, `per_block_stacked`),
    less the layer's gradients where the per-block line leaves them out and the keep line holds them
    (`BlockCost.per_block_summed_bytes`: the gradient term charges them, not the caches)."""
    backend = device_backend(device)
    # PyTorch measures both lines beside the sum (`runtime.profiling.device.summed_torch_line`), MNN only the
    # per-block one
    summed_apart = device_engine(device) == "mnn"
    return [max(0, c.stacked - c.per_block_stacked - ((c.per_block_summed_bytes or 0) if summed_apart else 0))
            if (c := backend.blocks.get(block_signature(b))) else 0 for b in check_blocks(graph)]


def hybrid_cache_bytes(graph: Graph, device: DeviceSpec, first: int, last: int) -> int:
    """The caches a hybrid per-block device keeps over blocks first..last (0 for any other choice)."""
    mode, count = activation_mode(device)
    if mode != "per-block" or not count:
        return 0
    per_block = cache_bytes_per_block(graph, device)
    return sum(per_block[i] for i in cached_block_indices(graph, first, last, count))


def hybrid_count(graph: Graph, device: DeviceSpec, first: int, last: int, room: int) -> int:
    """How many blocks of first..last a per-block device can keep the caches of in `room` bytes (the
    last ones first, as the engine does): the most whose caches fit."""
    per_block = cache_bytes_per_block(graph, device)
    candidates = cached_block_indices(graph, first, last, last - first + 1)
    count, used = 0, 0
    for i in reversed(candidates):
        if used + per_block[i] > room:
            break
        used += per_block[i]
        count += 1
    return count


def with_cached_blocks(device: DeviceSpec, count: int) -> DeviceSpec:
    """The device recomputing per block with its stage's last `count` blocks cached (0: plain per-block)."""
    return replace(device, activations=f"{HYBRID}{count}" if count > 0 else "per-block")


def measured_per_block(device: DeviceSpec) -> bool:
    """Whether the device's profile measured its backend recomputing per block (some block with
    `BlockCost.per_block_workspace_bytes`). PyTorch profiles made before `profile` measured it have
    none: per-block would be priced as recomputing the whole stage (no saving claimed, a guessed
    time), so it is not offered there and their plans stay as they were; nor where they measured it
    in the warm profiling process (not `BackendProfile.fresh_lines`), which a fresh worker outgrew."""
    backend = device_backend(device)
    if device_engine(device) == "torch" and not backend.fresh_lines:
        return False
    return any(c.per_block_workspace_bytes is not None for c in backend.blocks.values())


def engine_activations(device: DeviceSpec) -> tuple[str, ...]:
    """The choices the device's engine offers (`ENGINE_ACTIVATIONS`), PyTorch's per-block only where
    measured (`measured_per_block`)."""
    engine = device_engine(device)
    offered = ENGINE_ACTIVATIONS.get(engine, ())
    if engine == "torch" and not measured_per_block(device):
        offered = tuple(a for a in offered if a != "per-block")
    return offered


def offers_activations(device: DeviceSpec, activations: str) -> bool:
    """Whether the device's engine can do `activations` (`engine_activations`)."""
    return activations in engine_activations(device)


def leanest_activations(device: DeviceSpec) -> str:
    """The choice that holds the fewest activations on the device's engine (the last it offers)."""
    return (engine_activations(device) or ("recompute",))[-1]


def keeps_activations(device: DeviceSpec) -> bool:
    """Whether the device holds something of each further micro-batch in flight beyond the block
    inputs (`BlockCost.kept` under `block_costs`): keeping every activation until its backward
    (PyTorch by default; MNN with one set of block graphs per micro-batch in flight), or PyTorch
    recomputing per block (a further micro-batch's checkpoints: ~13-19 MiB a SmolLM2 int4 stage,
    of which `BlockCost.per_block_kept_bytes` is the per-layer part and `per_block_kept_once_bytes`
    the once-a-stage part, `kept_once_bytes`; profiles made before hold the latter in the per-block
    workspace)."""
    policy = activations_of(device)
    return policy == "keep" or (policy == "per-block" and device_engine(device) == "torch")


def kept_copies(in_flight: int, keeps: bool) -> int:
    """How many more times than once a block's kept activations (`BlockCost.kept`) are held with
    `in_flight` micro-batches in flight on a device that keeps activations (`keeps_activations`):
    once per further micro-batch. The one formula of that term: the cost model, the partition
    instance and the solvers all call it."""
    return in_flight - 1 if keeps else 0


def kept_activation_bytes(kept_bytes: int, in_flight: int, keeps: bool) -> int:
    """Bytes of kept activations held beyond the block's own workspace (`kept_copies`)."""
    return kept_bytes * kept_copies(in_flight, keeps)


def block_kept_once(graph: Graph, device: DeviceSpec) -> tuple[int, ...]:
    """Per block, what a further micro-batch in flight holds once on a stage with the block beside the
    blocks' kept parts (`BlockCost.per_block_kept_once_bytes` under `block_costs`: PyTorch recomputing
    per block; 0 elsewhere and where not measured)."""
    return tuple(c.per_block_kept_once_bytes or 0 for c in block_costs(graph, device))


def kept_once_bytes(graph: Graph, device: DeviceSpec, first: int, last: int, in_flight: int) -> int:
    """What the further micro-batches in flight hold once a stage running blocks first..last: the
    largest of its blocks' `block_kept_once`, once per further micro-batch (`kept_copies`: none with
    one in flight). A max, not a sum: the stage's output and its checkpoints' bookkeeping are one a
    micro-batch whatever the blocks (the partitioners take the same max, as for `transient_bytes`)."""
    once = max(block_kept_once(graph, device)[first:last + 1], default=0)
    return kept_activation_bytes(once, in_flight, keeps_activations(device))


def per_block_rerun_s(cost: BlockCost, checkpointed: bool) -> float:
    """What recomputing per block on PyTorch adds to a block's keeping backward (`backward_s`): its
    forward once more where the engine runs it under a checkpoint of its own (`checkpointed_blocks`),
    nothing where it runs it as it is. Structural, not the profile's `per_block_backward_s`: the
    re-run does strictly more work than keeping (the block's forward again, then the same backward),
    and a timing that says otherwise is noise. A loaded machine once timed a layer's per-block
    backward below keeping's; priced max(keeping, measured), per block then cost keeping's time in
    less memory, and a 4 GiB device (tests/jobs/test_torch_per_block_plan.py) planned per block
    instead of keeping: a plan, and its memory, that moved from one profile to the next. Priced so,
    per block costs the same time as recomputing the whole stage for the blocks both re-run (the
    same work), and the leaner of the two is taken at that tie, never on a timing's noise."""
    return cost.forward_s if checkpointed else 0.0


def checkpointed_blocks(graph: Graph) -> tuple[bool, ...]:
    """Per block, whether PyTorch recomputing per block runs it under a checkpoint of its own (its
    forward re-run in its backward): every block but one with a lookup (a table stepped in place
    would give a re-run other rows), the loss, and an LM head fused with its loss
    (`fused_loss_hidden_bytes`), which the engine runs as they are. The engine's rule
    (`runtime.engines.pytorch`, `TorchStageEngine._block_runs`), which the planner may not import,
    restated on the graph."""
    def derive(graph: Graph) -> tuple[bool, ...]:
        head = len(graph.blocks) - 2 if fused_loss_hidden_bytes(graph) is not None else None
        return tuple(b.index != head and not _runs_as_it_is(graph, b) for b in graph.blocks)

    return _remembered(_CHECKPOINT_FACTS, graph, derive)


def _remembered(facts: list, graph: Graph, derive):
    """`derive(graph)`, kept in `facts` for the last few graphs asked about (weak references: asking keeps
    no graph alive): `block_costs` and the stage terms ask on every call, and each answer is a pass over
    the graph's nodes."""
    for known, value in facts:
        if known() is graph:
            return value
    value = derive(graph)
    facts[:] = [(weakref.ref(graph), value)] + [e for e in facts if e[0]() is not None][:3]
    return value


def mnn_rerun_floor(cost: BlockCost, reruns: bool) -> BlockCost:
    """A block's MNN cost with its re-run of the forward (`recompute_s`: the forced backward, `backward_s`,
    less the one after its own forward, which reuses the per-op caches) at least `MNN_RERUN_FLOOR` of its
    forward where MNN re-runs cached ops (`mnn_rerun_blocks`); the backward after its own forward (what
    keeping pays) stays as measured. The two backwards are timed apart, so a loaded profile can read the
    re-run ~0 (clamped at 0; h139 saw 0.04 of the forward once): keeping, recomputing and recomputing per
    block then cost the same and the leanest, per block, was planned on a roomy device, a plan that moved
    from one profile to the next. The re-run is structural: without caches MNN's gradient program runs
    the block's MatMuls, Softmaxes and exact GELU's erf again, which the caches save; measured in CPU time
    (one thread, 2 x 128, modes interleaved in one process) that is 0.66-0.74 of the forward on a Llama
    layer of hidden 256 and 0.76-0.95 on a BERT layer of hidden 256 (per block's backward less keeping's;
    the wall-clock rounds of h139's profile ran 0.47-0.91 in 9 of 11, 0.04 and 2.14 the others).
    Floored at 0.5, below every CPU reading: never above what MNN re-runs, and keeping is strictly faster
    than per block (and than recomputing where a backward does not follow its forward) on every stage
    that holds such a block, so the pick between them no longer turns on a timing's noise."""
    if not reruns:
        return cost
    own = cost.backward_s - min(cost.recompute_s, cost.backward_s)
    rerun = max(cost.recompute_s, MNN_RERUN_FLOOR * cost.forward_s)
    return replace(cost, backward_s=own + rerun, recompute_s=rerun)


def mnn_rerun_blocks(graph: Graph) -> tuple[bool, ...]:
    """Per block, whether MNN re-runs ops of it that its per-op caches save (`runtime.engines.mnn.
    CACHED_OPS`: MatMul, Softmax, an exact GELU's erf; the planner may not import the engine): every
    layer (the lowering makes a layer of an attention's MatMuls and Softmax and a feed-forward's
    MatMuls) and a task head (its projection); not the embeddings (lookups in numpy, a LayerNorm the
    backward after its own forward runs again too: BERT's, per block's backward 0.05-0.08 ms over
    keeping's, 0.11-0.13 of the forward), the loss, nor an LM head fused with its loss (its projection
    runs in numpy with the loss, `fused_loss_hidden_bytes`). By the blocks' kinds, not their nodes: a
    bundle's graph is a slice that keeps every block's metadata but only its stage's nodes
    (`ir.serialize.slice_graph`), and `backend_times` prices any stage from it."""
    head = len(graph.blocks) - 2 if fused_loss_hidden_bytes(graph) is not None else None
    return tuple(b.kind in _LAYER_KINDS or (b.kind == "head" and b.index != head) for b in graph.blocks)


# The kinds of block the lowering makes of a transformer's layers (`planner.passes`)
_LAYER_KINDS = frozenset({"encoder", "decoder"})


# The least of its forward that a block's MNN re-run is priced (`mnn_rerun_floor`)
MNN_RERUN_FLOOR = 0.5


def _runs_as_it_is(graph: Graph, block) -> bool:
    """Whether PyTorch runs the block without a checkpoint for a reason of its ops (`_RUN_AS_THEY_ARE`);
    on a bundle's slice that lacks the block's nodes (`ir.serialize.slice_graph`: every block's metadata,
    only its stage's nodes; `backend_times` prices any stage from it), by its kind: embeddings (a lookup)
    and the loss."""
    try:
        return any(graph.node(n).op in _RUN_AS_THEY_ARE for n in block.nodes)
    except KeyError:
        return block.kind in ("embeddings", "loss")


# The ops whose block PyTorch runs without a checkpoint (`checkpointed_blocks`)
_RUN_AS_THEY_ARE = frozenset({"Gather", "TokenCrossEntropy"})
# The graphs last asked about, with their answer (as `_FUSED_FACTS`: `block_costs` asks on every call)
_CHECKPOINT_FACTS: list[tuple[weakref.ref, tuple[bool, ...]]] = []


def block_costs(graph: Graph, device: DeviceSpec) -> tuple[BlockCost, ...]:
    """Per block of the graph, its measured cost on the device's backend, under its activation
    choice: PyTorch recomputing runs each block's forward once more in its backward; MNN keeping
    skips its measured re-run of the forward (`recompute_s`, at least `mnn_rerun_floor`'s share of the
    forward where MNN re-runs cached ops), as the last stage of 1F1B does; MNN
    recomputing per block has the workspace measured that way (`per_block_workspace`, of which each
    block holds its `per_block_stacked` part and the rest is the one-block transient), and never
    skips the re-run (`reuses_forward` does not apply: no caches outlive a block's backward).
    PyTorch recomputing per block has those workspace figures too, and its backward is keeping's
    plus each checkpointed block's forward once more (`per_block_rerun_s`), which is `recompute_s`."""
    backend = device_backend(device)
    engine, policy = device_engine(device), activation_mode(device)[0]
    again = engine == "torch" and policy == "recompute"
    kept = engine == "mnn" and policy == "keep"
    per_block = engine in ("mnn", "torch") and policy == "per-block"
    reruns = checkpointed_blocks(graph) if per_block and engine == "torch" else ()
    mnn_reruns = mnn_rerun_blocks(graph) if engine == "mnn" else ()
    out = []
    for b in check_blocks(graph):
        sig = block_signature(b)
        cost = backend.blocks.get(sig)
        if cost is None:
            raise ValueError(f"device {device.name!r}: its profile {device.profile.name!r} (backend "
                             f"{backend.backend!r}) has no cost for block {b.index} {b.name!r} (signature {sig}); "
                             f"profile the device with model {graph.name!r} (`confidant profile`, with the plan's "
                             f"--lora settings if it has any)")
        if engine == "mnn":
            cost = mnn_rerun_floor(cost, mnn_reruns[b.index])
        if again:
            cost = replace(cost, backward_s=cost.backward_s + cost.forward_s)
        elif kept:
            cost = replace(cost, backward_s=cost.backward_s - min(cost.recompute_s, cost.backward_s), recompute_s=0.0)
        elif per_block:
            cost = replace(cost, workspace_bytes=cost.per_block_workspace, stacked_bytes=cost.per_block_stacked)
            if engine == "mnn" and cost.per_block_summed_bytes:
                cost = replace(cost, workspace_bytes=cost.workspace_bytes + mnn_gradient_read_bytes(graph, b.index))
            if engine == "torch":
                # a further micro-batch's checkpoints (`keeps_activations`): as measured, else nothing;
                # its once-a-stage part stays (`kept_once_bytes`)
                cost = replace(cost, kept_bytes=cost.per_block_kept_bytes or 0)
                rerun = per_block_rerun_s(cost, reruns[b.index])
                cost = replace(cost, backward_s=cost.backward_s + rerun, recompute_s=rerun)
        if cost.per_block_kept_once_bytes is not None and not (per_block and engine == "torch"):
            cost = replace(cost, per_block_kept_once_bytes=None)  # held only recomputing per block on PyTorch
        out.append(cost)
    if joined_boundaries(graph):
        # the head's measured workspace is the head and its loss run fused on one stage (runtime.
        # profiling.device.measure_block), which no plan separates: the loss's own figure, measured
        # alone on the logits, is no part of the pair's peak (SmolLM2: 72 MiB counted twice)
        out[-1] = replace(out[-1], workspace_bytes=0, stacked_bytes=0, kept_bytes=0, engine_bytes=0,
                          per_block_kept_once_bytes=None)
        # The fused pair's measured peak (the profile's, a stage of the two alone) is held beside the
        # other blocks' transient on a stage that also runs them, not instead of it: MNN keeps the
        # blocks' pooled buffers while the loss's numpy chunks come (SmolLM2 int4, per block, every
        # position a target: the head + loss alone 137 MiB above the weights, with two layers before
        # them 163-165, the two layers alone 25-26). So the pair's peak is all stacked (no transient
        # of its own) and the stage's transient, the largest of its blocks' (`transient_bytes`),
        # comes on top once: the pair alone pays its peak, with layers both, and a stage ending at
        # the last layer the layers' transient once.
        # The pair computes logits only for target positions: charged for the most a micro-batch of
        # the plan's data has (`Graph.target_positions`, `plan --data`), else for every position.
        head = out[-2]
        workspace = head.workspace_at_targets(graph.target_positions)
        if engine == "mnn":
            # MNN's first-use heap is in the pair's figure (the first run of its own fresh engine,
            # `runtime.profiling.device.measure_block`) and in the engine's start-up that `runtime_bytes`
            # charges every stage, but a worker pays it once: SmolLM2 int4, a stage of the pair alone
            # peaks 41.4 MiB above its built engine in a new process where 40.8 + 8.2 were charged, and
            # the last stage (6 layers + the pair) held 6.8-7.4 MiB under its charge recomputing per
            # block and keeping, the first two stages (no pair) 2.5-3.8 over theirs (helper h107). So
            # the pair's stage pays the start-up inside the pair's figure, not beside it.
            workspace -= min(workspace, start_up_bytes(device))
        out[-2] = replace(head, workspace_bytes=workspace, stacked_bytes=workspace)
    return tuple(out)


def mnn_gradient_read_bytes(graph: Graph, k: int) -> int:
    """One read of block k's backward on MNN: its weights' gradients and its input's gradient as one
    array (`runtime.engines.mnn_kernels.GradientProgram.run`, `planner.memory_defaults.mnn_held_bytes`),
    which a block recomputing per block lets go into MNN's pool after its backward. Charged once more in
    the transient of a layer whose per-block line was measured beside the gradient sum and AdamW's
    moments (`BlockCost.per_block_summed_bytes`, full fine-tuning): that line's steps run two backwards
    (`runtime.profiling.compute.SUMMED_ORDER`), a worker four, and in a worker's second step one backward
    now and then holds a third read where the line's peak holds two: SmolLM2 full fine-tuning's middle
    stage (14 layers, per block), step 2's backwards peaked 27.5 MiB above the level between them (two
    reads of 13.78: a layer's 13.50 of weights and its 0.28 input) and its third 41.3 (three), 935.6 MiB
    against 935.0 planned, where the same plan's other run peaked 27.5 above at every backward, 922.3;
    the head's per-block stage of that run 27.5 at each, never three (benchmarks/MEMORY_NOTES.md,
    helper h147). Not a rule of the shapes (the heap's layout with the moments in it): the most measured.
    Charged, the planner gave that stage a 15th layer at the same budget: 991.6 / 1005.2 (0.986) with the
    third read, 976.8-977.7 / 1005.0-1005.1 (0.972-0.973) without."""
    return block_input_bytes(graph)[k] + graph.blocks[k].params_bytes


def _loss_alone_bytes(graph: Graph, device: DeviceSpec) -> int:
    """The workspace of a fusable loss alone on a stage as its profile measured it (a plan cut between
    the head and its loss before `joined_boundaries` existed), which `block_costs` leaves out."""
    cost = device_backend(device).blocks.get(block_signature(graph.blocks[-1]))
    return 0 if cost is None else cost.workspace_bytes


def block_input_bytes(graph: Graph) -> tuple[int, ...]:
    """Per block, the bytes of the activation it reads from the block before (stashed per
    micro-batch in flight); 0 for the first block, which reads only graph inputs. A causal-LM loss
    fused with its head (the usual stage) stashes the head's hidden state, not the logits."""
    blocks = check_blocks(graph)
    out = [0] + [b.activation_bytes for b in blocks[:-1]]
    fused = fused_loss_hidden_bytes(graph)
    if fused is not None:
        out[-1] = fused
    return tuple(out)


def fused_loss_hidden_bytes(graph: Graph) -> int | None:
    """Bytes of the hidden state a fused LM head + causal-LM loss stashes (None: not a decoder's fusable
    loss). The test is the engines' (`runtime.engines.stage.fused_lm_head`, which the planner may not
    import): the loss block's one TokenCrossEntropy reads the head's output, made by a MatMul of a
    2-D weight that nothing else reads."""
    return _remembered(_FUSED_FACTS, graph, _fused_loss_hidden_bytes)


# The graphs last asked about, with their answer (`block_costs` asks on every call, and the scan of
# the nodes that finds the loss's readers is the planner's to avoid, as `_TABLE_FACTS` below)
_FUSED_FACTS: list[tuple[weakref.ref, int | None]] = []


def _fused_loss_hidden_bytes(graph: Graph) -> int | None:
    blocks = graph.blocks
    if len(blocks) < 2 or len(blocks[-1].nodes) != 1 or not graph.nodes:
        return None
    head, loss = blocks[-2], blocks[-1]
    try:
        node, last = graph.node(loss.nodes[0]), graph.node(head.nodes[-1]) if len(head.nodes) >= 2 else None
    except KeyError:
        return None
    if node.op != "TokenCrossEntropy" or last is None or last.op != "MatMul" or last.outputs[0] != head.output \
            or node.inputs[0] != head.output or getattr(graph.constants.get(last.inputs[1]), "ndim", 0) != 2:
        return None
    if [n.name for n in graph.nodes if head.output in n.inputs] != [node.name]:
        return None
    return int(graph.values[last.inputs[0]].nbytes)


def joined_boundaries(graph: Graph) -> tuple[int, ...]:
    """The block boundaries no plan cuts (k: blocks k and k+1 stay on one stage): a decoder's LM head
    and its causal-LM loss, which the engines run fused (`fused_loss_hidden_bytes`: no logits are
    made). The profile measures the head fused with its loss, so the pair's memory is the head's
    measured workspace (`block_costs`); cut apart, the head would make the vocabulary-sized logits,
    hold them, send them and take their gradient back, which no plan gains from."""
    return (len(graph.blocks) - 2,) if fused_loss_hidden_bytes(graph) is not None else ()


# The graphs whose tied-table readers were last looked at, as `_TABLE_FACTS` (below) for tables.
_READER_FACTS: list[tuple[weakref.ref, tuple]] = []


def _table_readers(graph: Graph) -> tuple[dict[str, set[int]], frozenset[str]]:
    """(per embedding table, the blocks with an op other than a lookup that reads it; the tables an
    MNN graph reads somewhere, i.e. read otherwise than by lookups and by an LM head fused with its
    loss, whose weight the engine keeps in numpy), from one pass over the nodes, kept for the last
    few graphs."""
    return _remembered(_READER_FACTS, graph, _table_readers_pass)


def _table_readers_pass(graph: Graph) -> tuple[dict[str, set[int]], frozenset[str]]:
    """`_table_readers`'s pass over the nodes."""
    tables = _graph_tables(graph)[0]
    block_of = {name: k for k, b in enumerate(graph.blocks) for name in b.nodes}
    fused = graph.blocks[-2].nodes[-1] if fused_loss_hidden_bytes(graph) is not None else None
    dense: dict[str, set[int]] = {t: set() for t in tables}
    var_read = set()
    for n in graph.nodes:
        if n.op == "Gather":
            continue
        for t in tables.intersection(n.inputs):
            if n.name in block_of:
                dense[t].add(block_of[n.name])
            if n.name != fused and n.op != "TokenCrossEntropy":
                var_read.add(t)
    facts = (dense, frozenset(var_read))
    return facts


def stage_params_bytes(graph: Graph, first: int, last: int) -> int:
    """Trainable parameter bytes of blocks first..last, a weight several of them read counted once."""
    blocks = graph.blocks[first:last + 1]
    total = sum(b.params_bytes for b in blocks)
    seen: set[str] = set()
    for b in blocks:
        for p in b.params:
            if p in seen and p in graph.constants:
                total -= int(graph.constants[p].nbytes)
            seen.add(p)
    return total


# The graphs whose tables were last looked at (weakly: a graph holds its weights), with what
# `_graph_tables` found: the planner asks for every block range of every device (make_instance: 2 x
# blocks calls per device), and a scan of the nodes each time cost 7-9 ms a device on SmolLM2's 1063.
_TABLE_FACTS: list[tuple[weakref.ref, tuple]] = []


def _graph_tables(graph: Graph) -> tuple[frozenset[str], frozenset[str], dict[str, int | None], dict[str, list[int]]]:
    """(every embedding table of the graph, those an op other than a lookup also reads, lookups per
    micro-batch of each table: the elements of its index inputs, None where a shape is unknown, the
    blocks whose parameters list each table, ascending), from one pass over the nodes, kept for the
    last few graphs."""
    return _remembered(_TABLE_FACTS, graph, _graph_tables_pass)


def _graph_tables_pass(graph: Graph
                       ) -> tuple[frozenset[str], frozenset[str], dict[str, int | None], dict[str, list[int]]]:
    """`_graph_tables`'s pass over the nodes."""
    tables = frozenset(n.inputs[0] for n in graph.nodes if n.op == "Gather") & frozenset(graph.constants)
    read = frozenset(i for n in graph.nodes if n.op != "Gather" for i in n.inputs) & tables
    lookups: dict[str, int | None] = {t: 0 for t in tables}
    for n in graph.nodes:
        if n.op == "Gather" and n.inputs[0] in tables and lookups[n.inputs[0]] is not None:
            shape = graph.values[n.inputs[1]].shape if n.inputs[1] in graph.values else None
            ok = shape and all(isinstance(d, int) and d >= 0 for d in shape)
            lookups[n.inputs[0]] = lookups[n.inputs[0]] + math.prod(shape) if ok else None
    listed: dict[str, list[int]] = {t: [] for t in tables}
    for k, b in enumerate(graph.blocks):
        for t in tables.intersection(b.params):
            listed[t].append(k)
    facts = (tables, read, lookups, listed)
    return facts


def _tables(graph: Graph, first: int, last: int) -> tuple[set[str], set[str]]:
    """(the embedding tables among the parameters of blocks first..last, those of them an op other
    than a lookup also reads anywhere in the model)."""
    _, all_read, _, listed = _graph_tables(graph)
    # a table is in the range when a block of the range lists it: a search per table, not a scan of
    # the range's parameters (the planner asks for every prefix of the blocks: quadratic in depth)
    tables = {t for t, ks in listed.items() if (i := bisect.bisect_left(ks, first)) < len(ks) and ks[i] <= last}
    return tables, tables & all_read


def looked_up_only(graph: Graph) -> frozenset[str]:
    """The embedding tables of the model that nothing but lookups read (not a tied LM head's weight):
    their gradients are rows, and AdamW's state of them is kept as rows (`table_state_delta_bytes`)."""
    tables, read, _, _ = _graph_tables(graph)
    return tables - read


def double_held_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """Bytes of the parameters of blocks first..last the device holds once more than other weights:
    on MNN, an embedding table that an op of an MNN graph also reads anywhere in the model (a tied LM
    head not fused with its loss: MNN looks tables up in numpy and reads such a head's weight from a
    Var). A head fused with its loss reads the table from numpy (`runtime.engines.mnn`: no Var), and
    no stage holds a second copy (SmolLM2, measured: its last stage at the charge without it). Each
    table counted once per range."""
    if device_engine(device) != "mnn":
        return 0
    tables, _ = _tables(graph, first, last)
    return sum(int(graph.constants[t].nbytes) for t in tables & _table_readers(graph)[1])


def shared_frozen_bytes(graph: Graph, first: int, last: int) -> int:
    """Bytes `Block.frozen_bytes` counts more than once among blocks first..last though the stage
    holds them once: a frozen embedding table another block of the range also reads (a tied LM head
    under LoRA: the embeddings' block and the head's each count it; SmolLM2 on one device, 108 MiB
    charged twice). Only looked-up tables, which are weights whatever their readers (a folded
    constant shared by blocks is counted by none of them). A range-wide correction: the partition
    instance's block-by-block sum keeps the over-charge, which only a stage holding both the first
    and the last blocks (all of a decoder) sees."""
    blocks = graph.blocks[first:last + 1]
    if not any(b.frozen_bytes for b in blocks):
        return 0
    tables = {n.inputs[0] for n in graph.nodes if n.op == "Gather" and n.inputs[0] in graph.constants
              and n.inputs[0] not in graph.params}
    out = 0
    for t in tables:
        size = int(graph.constants[t].nbytes)
        counted = [b for b in blocks if b.frozen_bytes >= size
                   and any(t in graph.node(n).inputs for n in b.nodes)]
        out += size * max(0, len(counted) - 1)
    return out


# `MemoryTerms.frozen_bytes`' key (`show`: "frozen <key>") for a stage whose float32 frozen weights are mapped
MAPPED_FROZEN = "weights mapped, one block resident"
# the same for an MNN stage streaming them (`streamed_frozen_bytes`: a few blocks' weights resident, not one)
STREAMED_FROZEN = "weights mapped, streamed through placeholder sets"


def maps_frozen(device: DeviceSpec) -> bool:
    """Whether the device's stage holds its float32 frozen weights mapped, a few blocks' resident at a time: the
    run maps them (`DeviceSpec.frozen_mapped`) and its engine recomputes per block with no block keeping its
    caches. PyTorch gives each block's pages back after the block's forward and before its re-run
    (`runtime.engines.pytorch`); MNN writes each block's weights into placeholders shared by the blocks of a set
    before each use (`runtime.engines.mnn._FrozenStream`; a hybrid "per-block+K" holds them as constants)."""
    return device.frozen_mapped and maps_frozen_base(device_engine(device), activations_of(device))


def maps_stored_base(device: DeviceSpec) -> bool:
    """Whether a `maps_frozen` stage also holds a base the model file stores quantized (`export --base-dtype
    int4`: codes, scales, offsets) mapped, one block's resident at a time: on PyTorch, whose engine widens each
    product's weight from the mapping's pieces and gives a block's pages back as for a float32 base (a run
    sets `DeviceSpec.frozen_mapped` for such a base only where the file stores it at the run's precision:
    `jobs.common.lora.base_on_mapping`); MNN copies a quantized weight's parts into its constants."""
    return maps_frozen(device) and device_engine(device) == "torch"


def holds_base_mapped(graph: Graph, device: DeviceSpec) -> bool:
    """Whether the device's stage is charged its frozen base as mapped (`mapped_frozen_bytes`), not held: it maps
    (`maps_frozen`) a float32 base, or a quantized one on PyTorch (`maps_stored_base`); a quantized base on MNN
    is held as its constants. The one test every term of the mapped base asks (`stage_memory_terms`,
    `planner.memory_defaults.memory_parts`, `jobs.common.memory_check.step_bytes`)."""
    if not maps_frozen(device):
        return False
    return maps_stored_base(device) or not any(isinstance(v, QuantizedTensor) for v in graph.constants.values())


def mapped_frozen_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """Frozen bytes a stage whose float32 frozen weights are mapped (`maps_frozen`) holds at once. PyTorch: its
    largest block's (a block's pages are given back after its forward and before the next block's re-run; the
    LM head's table from the head's forward through its backward to the last layer's re-run, the head's own
    block; SmolLM2 LoRA on one device: 108 MiB, the tied table, where the whole base is 513), a table only looked
    up left out (`looked_up_only`: the rows gathered, the embeddings block's pages given back after its forward;
    MiniLM NER LoRA per block at 8 x 64 was charged its 45 MiB word table and read 0.85-0.88 of its plan on the merge
    tree of helper h161, 0.79-0.81 once the local trainer gave its free heap back). MNN: `streamed_frozen_bytes`."""
    if device_engine(device) == "mnn":
        return streamed_frozen_bytes(graph, first, last, STREAM_SETS)
    return max(_resident_frozen_bytes(graph)[first:last + 1], default=0)


def _resident_frozen_bytes(graph: Graph) -> tuple[int, ...]:
    """Per block, its frozen weights a PyTorch stage holds mapped while the block runs (`mapped_frozen_bytes`):
    `Block.frozen_bytes` less a table it only looks up (`looked_up_only`)."""
    looked_up = looked_up_only(graph)
    params = set(graph.params)
    head = head_table_chunk(graph)

    def resident(b) -> int:
        tables = {i for name in b.nodes for i in graph.node(name).inputs
                  if i in looked_up and i in graph.constants and i not in params}
        # a tied table's lookup gathers its rows (the block's pages given back after it), and the fused head reads
        # it a vocabulary chunk at a time, each chunk's pages given back (`_FrozenLinearCrossEntropy`)
        chunk = 0
        for name in b.nodes:
            node = graph.node(name)
            if head is not None and node.op == "Gather" and node.inputs[0] == head[0]:
                tables.add(head[0])
            elif head is not None and name == head[2]:
                tables.add(head[0])
                chunk = head[1]
        return b.frozen_bytes - sum(int(graph.constants[t].nbytes) for t in tables) + chunk

    return tuple(resident(b) for b in graph.blocks)


def holds_one_block_mapped(graph: Graph, device: DeviceSpec) -> bool:
    """Whether a stage on the device is charged its frozen base as the largest of its blocks' resident parts
    (`holds_base_mapped` on PyTorch: `mapped_frozen_bytes`), a max over its blocks, not a sum: what the partition
    instance charges such a device per stage (`block_mapped_frozen_bytes`) in place of each block's whole frozen
    weights (`block_held_frozen_bytes`). MNN's streamed term is keyed by placeholder sets, not a block's max: the
    instance bounds an MNN stage with its whole base less the tables it only looks up, and the plan is re-costed
    (`planner.engines`)."""
    return holds_base_mapped(graph, device) and device_engine(device) == "torch"


def block_mapped_frozen_bytes(graph: Graph, device: DeviceSpec) -> tuple[int, ...]:
    """Per block, what a stage on the device holds of its frozen base while the block runs where it holds the base
    mapped one block resident (`holds_one_block_mapped`; the stage is charged the largest of its blocks'); all zero
    where it does not (its blocks' frozen weights are summed: `block_held_frozen_bytes`)."""
    if not holds_one_block_mapped(graph, device):
        return (0,) * len(graph.blocks)
    return _resident_frozen_bytes(graph)


def block_held_frozen_bytes(graph: Graph, k: int, device: DeviceSpec) -> int:
    """Block k's frozen bytes a stage on the device holds throughout, as the partition instance sums them per
    block: its frozen weights with the engine's further copies (`double_held_bytes`, `frozen_storage_extra_bytes`,
    as `stage_memory_terms`); none where the stage holds its base mapped one block resident
    (`holds_one_block_mapped`: then `block_mapped_frozen_bytes`, a stage's max); on an MNN device streaming its
    mapped base, less a table the block only looks up (`streamed_block_bound_bytes`)."""
    if holds_one_block_mapped(graph, device):
        return 0
    return (streamed_block_bound_bytes(graph, device, k) + double_held_bytes(graph, k, k, device)
            + frozen_storage_extra_bytes(graph, k, k, device))


# What the LM head fused with its causal-LM loss holds of its logits at a time, and a frozen float head of its
# vocabulary rows: one chunk (the engines' `runtime.engines.lm_loss.CHUNK_BYTES`, which the planner may not import;
# tests/jobs/test_train_local_memory_line.py holds the two equal; `planner.memory_defaults` charges the logits)
LOSS_CHUNK_BYTES = 32 << 20


def head_table_chunk(graph: Graph) -> tuple[str, int, str] | None:
    """(the table, the bytes of one vocabulary chunk of it, the head's MatMul) of a frozen float32 head fused
    with its loss, which both engines read a chunk of vocabulary rows at a time
    (`runtime.engines.lm_loss.vocabulary_chunk_rows`, for PyTorch and MNN alike: so many rows
    that the larger of the rows and their logits for the micro-batch's targets is `LOSS_CHUNK_BYTES`); None for
    any other graph."""
    n = len(graph.blocks)
    if fused_loss_hidden_bytes(graph) is None:
        return None
    node = graph.node(graph.blocks[n - 2].nodes[-1])
    weight = graph.constants.get(node.inputs[1])
    if weight is None or node.inputs[1] in graph.params or isinstance(weight, QuantizedTensor) or weight.ndim != 2:
        return None
    logits = graph.values[node.outputs[0]]
    vocab = int(logits.shape[-1])
    hidden = int(weight.size) // vocab
    targets = graph.target_positions or int(math.prod(logits.shape[:-1]))
    rows = min(vocab, max(64, LOSS_CHUNK_BYTES // (weight.itemsize * max(targets, hidden, 1))))
    return node.inputs[1], rows * hidden * weight.itemsize, node.name


def streamed_frozen_bytes(graph: Graph, first: int, last: int, sets: int) -> int:
    """Frozen bytes an MNN per-block stage streaming its mapped float32 base (`runtime.engines.mnn._FrozenStream`)
    holds once every block of it has run: each frozen float32 weight an MNN graph's product reads lies in a
    placeholder keyed (block index modulo `sets`, its place among its block's streamed weights, its
    shape), shared by the blocks of that set, so each such key's bytes once; a block's other frozen weights
    (`Block.frozen_bytes`' norm scales, biases) as constants, whole; a table the engine reads in numpy: an LM head fused with
    its loss one vocabulary chunk of it where frozen (`head_table_chunk`: the pass reads a chunk of rows at a time,
    each chunk's pages given back), whole where trained, a table only looked up nothing (the rows gathered, its
    pages given back at once). SmolLM2 LoRA on one device: 10 sets x 13.5 MiB of a layer's projections + 32 MiB
    of the tied head's chunk (108 MiB whole before helper h171) = 167 MiB, where the whole base is 513. Plus what
    reading the mapping holds for a moment (`mapped_read_bytes`): the file pages of the largest weight a block
    writes into its placeholders, or a lookup's two spans, whichever is more (the engine gives them back after
    each)."""
    keys, tables, rest, read = _streamed_parts(graph, first, last, sets)
    return keys + tables + rest + read


def streamed_read_bytes(graph: Graph, device: DeviceSpec) -> int:
    """What one read of the mapping holds beside a streamed stage's sets (`streamed_frozen_bytes`' last part) for
    the device's stages, at most (any block range: the model's largest), 0 where the device is not charged its
    base so: the partition instance's once-a-stage bound, with which a stage's streamed charge stays under its
    bound of every block's frozen weights (a stage of up to `STREAM_SETS` layers streams them all, plus this)."""
    if device_engine(device) != "mnn" or not holds_base_mapped(graph, device):
        return 0
    return _streamed_parts(graph, 0, len(graph.blocks) - 1, STREAM_SETS)[3]


def streamed_block_bound_bytes(graph: Graph, device: DeviceSpec, k: int) -> int:
    """Block k's frozen bytes as the partition instance bounds them on the device, block by block: its whole
    `Block.frozen_bytes`, less on an MNN device streaming its mapped base (`holds_base_mapped`) a frozen table
    it only looks up (its rows gathered a span at a time: `streamed_frozen_bytes` charges none of it). Summed over
    a stage, at least its streamed charge less the one read (the sets hold one block's weights per key; the
    fused head's table is its block's): SmolLM2's first stage is bounded without its 108 MiB table, which the
    search then has for layers."""
    b = graph.blocks[k]
    if device_engine(device) != "mnn" or not holds_base_mapped(graph, device):
        return b.frozen_bytes
    params = set(graph.params)
    looked_up = {graph.node(x).inputs[0] for x in b.nodes if graph.node(x).op == "Gather"}
    return b.frozen_bytes - sum(int(graph.constants[t].nbytes) for t in looked_up
                                if t in graph.constants and t not in params
                                and graph.constants[t].nbytes >= MAP_MIN_BYTES)


def _streamed_parts(graph: Graph, first: int, last: int, sets: int) -> tuple[int, int, int, int]:
    """`streamed_frozen_bytes`' parts: (the placeholder sets, the fused head's table, the other frozen constants,
    one read of the mapping)."""
    n = len(graph.blocks)
    fused = fused_loss_hidden_bytes(graph) is not None and first <= n - 2 and last == n - 1
    head = graph.node(graph.blocks[n - 2].nodes[-1]) if fused else None
    chunk = head_table_chunk(graph) if fused else None
    params = set(graph.params)
    keys: dict[tuple, int] = {}
    tables: dict[str, int] = {}  # read in numpy: charged only as the fused head's weight
    rest = 0
    read = 0  # the most file pages one read of the mapping holds (`mapped_read_bytes`)
    for b in graph.blocks[first:last + 1]:
        streamed: dict[str, int] = {}
        numpy_read: set[str] = set()
        for x in b.nodes:
            node = graph.node(x)
            if node.op == "Gather" and node.inputs[0] in graph.constants:
                if graph.constants[node.inputs[0]].nbytes >= MAP_MIN_BYTES:  # a smaller one is read into memory
                    numpy_read.add(node.inputs[0])
                    if node.inputs[0] not in params:  # a frozen table's lookup: its rows a span at a time
                        read = max(read, LOOKUP_READ_SPANS * FAULT_SPAN_BYTES)
            elif head is not None and node.name == head.name:
                numpy_read.add(node.inputs[1])
                # a frozen float table one vocabulary chunk (`head_table_chunk`, each chunk's pages given back
                # once read: `runtime.engines.lm_loss.frozen_linear_cross_entropy`), a trained one whole
                tables[node.inputs[1]] = chunk[1] if chunk is not None else int(graph.constants[node.inputs[1]].nbytes)
            elif node.op == "MatMul" and node.inputs[1] in graph.constants and node.inputs[1] not in params:
                # a weight of the file on its mapping, which the engine streams (one under MAP_MIN_BYTES is read
                # into memory, and a constant the lowering folded, as a rotary table, lies in memory: held as
                # MNN constants)
                value = graph.constants[node.inputs[1]]
                if (value.dtype == "float32" and value.ndim >= 2 and value.nbytes >= MAP_MIN_BYTES
                        and node.inputs[1] not in streamed):
                    keys[(b.index % sets, len(streamed), tuple(value.shape))] = int(value.nbytes)
                    streamed[node.inputs[1]] = int(value.nbytes)
                    read = max(read, mapped_read_bytes(int(value.nbytes)))
        # the block's other frozen weights (norm scales, biases) held as MNN constants, whole
        rest += max(0, b.frozen_bytes - sum(streamed.values())
                    - sum(int(graph.constants[t].nbytes) for t in numpy_read))
    return sum(keys.values()), sum(tables.values()), rest, read


# A lookup in a mapped frozen table reads its rows a file span at a time, the table's pages given back after each
# (`ir.mapped_pages.gather_rows`): at most two spans resident (a row may straddle two).
LOOKUP_READ_SPANS = 2


def mapped_read_bytes(nbytes: int) -> int:
    """File pages resident while a mapped weight of `nbytes` is read whole before its pages are given back (an MNN
    block writing it into its placeholder, `runtime.engines.mnn._BlockProgram.load_frozen`): a fault maps up to a
    `ir.mapped_pages.FAULT_SPAN_BYTES` span of the file, so every span the weight lies in, one more than its
    size in spans where it does not start at one (SmolLM2's 3.4 MiB gate / up / down: 6 MiB; a layer's 13.5 MiB
    read before one give-back set its pipeline stage's peak at 18 MiB of file pages, helper h172)."""
    return (-(-int(nbytes) // FAULT_SPAN_BYTES) + 1) * FAULT_SPAN_BYTES


def frozen_storage_extra_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """Bytes of the quantized frozen weights of blocks first..last beyond `Block.frozen_bytes`'
    charge (`ir.precision.bytes_per_element`) on the device: MNN's graphs hold an int8 / int4
    weight's block scales (and int4's offsets) as float32 (it has no float16 Var: 2 more bytes
    each, a block) and a bfloat16
    one as float32 (no bfloat16 Var); the weights MNN reads in numpy (tables, a fused LM head, kept
    in `ir.precision`'s form) cost none more. Each weight counted once per range."""
    if device_engine(device) != "mnn":
        return 0
    nodes = [graph.node(n) for b in graph.blocks[first:last + 1] for n in b.nodes]
    in_numpy = {n.inputs[0] for n in graph.nodes if n.op == "Gather"}
    losses = {n.inputs[0] for n in graph.nodes if n.op == "TokenCrossEntropy"}
    in_numpy |= {n.inputs[1] for n in graph.nodes if n.op == "MatMul" and n.outputs[0] in losses}
    extra = 0
    for name in {i for n in nodes for i in n.inputs if i not in in_numpy}:
        q = graph.constants.get(name)
        if isinstance(q, QuantizedTensor):
            extra += 2 * (q.size if q.storage == "bfloat16" else int(q.scales.size) * (1 if q.mins is None else 2))
    return extra


def engine_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """What the device's engine holds for blocks first..last beyond their weights, from its build
    (a setup term: MNN's graphs of each block and their tensors, SmolLM2 int4 ~1.6 MiB a decoder
    layer, before charged nowhere: the profile's workspace is measured from a built engine, its
    runtime before any): each block's `BlockCost.engine_bytes` (measured per block kind as a worker
    builds it, `runtime.profiling.compute.engine_setup_bytes`), less what `frozen_storage_extra_bytes`
    already charges of it (the frozen storage MNN widens) and what several blocks' figures count of one
    copy the engine makes once a stage (`shared_engine_bytes`); and once a stage what the build holds
    whatever the stage's length (`engine_once_bytes`: a SmolLM2 int4 stage of 11 layers was charged
    11 x 3.4 MiB, a third of the once part on each layer, against 29.2 built fresh). Nothing for a
    profile without it. The partition instance charges the same: `block_engine_bytes` per block and
    `engine_once_bytes` with the device's runtime, once a stage."""
    costs = block_costs(graph, device)
    blocks = sum(block_engine_bytes(graph, device, k, costs[k]) for k in range(first, last + 1))
    return max(0, blocks - shared_engine_bytes(graph, first, last, device)) + engine_once_bytes(device)


def block_engine_bytes(graph: Graph, device: DeviceSpec, k: int, cost: BlockCost) -> int:
    """Block k's engine build's step (`BlockCost.engine_bytes`; `cost` its `block_costs` entry, which
    every caller holds) less the frozen storage `frozen_storage_extra_bytes` already charges of it, at
    least 0. One rule for a figure not measured (None: a profile made before the engine term): nothing,
    as such a profile has always been planned (its once part, `engine_once_bytes`, None too: nothing).
    A kind with no run of its own (`engine_once_bytes` None: the embeddings, the LM head) was built
    alone in a fresh child, so its figure holds a stage's once part too, which `engine_once_bytes`
    charges once a stage: it comes off here where the backend has one (SmolLM2 int4, MNN: the head's
    3.45 MiB and the embeddings' 2.11 beside a once part of 3.32; their end stages were charged 5.0-5.5
    MiB over the build a worker made, a middle stage 3.1: benchmarks/MEMORY_NOTES.md, h54). The one
    formula of the per-block term: the cost model (`engine_bytes`) and the partition instance both
    call it."""
    if cost.engine_bytes is None:
        return 0
    own = cost.engine_bytes - (engine_once_bytes(device) if cost.engine_once_bytes is None else 0)
    return max(0, own - frozen_storage_extra_bytes(graph, k, k, device))


def engine_once_bytes(device: DeviceSpec) -> int:
    """What building a stage's engine holds once whatever its length on the device's backend: the
    largest of its block kinds' `BlockCost.engine_once_bytes` (one executor a stage, whatever kinds it
    runs; 0 for a profile made before, whose per-block figures hold it)."""
    return max((c.engine_once_bytes or 0 for c in device_backend(device).blocks.values()), default=0)


def shared_engine_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """Bytes the blocks' `BlockCost.engine_bytes` count more than once among blocks first..last though
    the stage's engine holds them once: a frozen float embedding table another block of the range also
    reads (a tied LM head under LoRA on a float base). PyTorch copies each frozen float constant
    (`torch.tensor`, one per name a stage), so the embeddings' figure and the head's (measured apart,
    `runtime.profiling.compute.engine_setup_bytes`) each hold the table's copy, which a stage of both
    builds once: a hidden-256 Llama with SmolLM2's 49152-token table, 48.5 + 8 x 3.0 + 48.0 MiB by
    blocks, 72.1 built as one stage (one device's per-block plan 10-16% above its run). Counted only
    where every reader's figure holds a copy of the table (MNN looks tables up in numpy and a quantized
    table is shared, not copied: their figures hold none, and nothing comes off). A range-wide
    correction as `shared_frozen_bytes` is (the partition instance prices the whole model, the one
    range holding both readers of a decoder's tied table, by this module). Since h42 the PyTorch engine
    reads frozen float weights through views of the graph's arrays (`runtime.engines.pytorch._frozen_tensor`):
    its figures hold no copy either, so this takes nothing off them; kept for figures that do (an
    engine that copies, an older profile)."""
    blocks = graph.blocks[first:last + 1]
    if first == last or not any(b.frozen_bytes for b in blocks):  # one block: one reader (the partitioners' case)
        return 0
    costs = block_costs(graph, device)
    tables = {t for t in _graph_tables(graph)[0] if t not in graph.params
              and not isinstance(graph.constants[t], QuantizedTensor)}
    out = 0
    for t in tables:
        size = int(graph.constants[t].nbytes)
        readers = [b.index for b in blocks if any(t in graph.node(n).inputs for n in b.nodes)]
        if len(readers) > 1 and all((costs[k].engine_bytes or 0) >= size for k in readers):
            out += size * (len(readers) - 1)
    return out


def base_dtype_savings(graph: Graph) -> tuple[tuple[int, int], ...]:
    """[k] (bytes saved with `--base-dtype int8`, with `int4`) on the frozen weights block k reads,
    against how they are held now (`ir.precision`: their storage bytes; int4 keeps tables at int8),
    counted in every block that reads one as `Block.frozen_bytes` counts it (a tied table: the
    embeddings' and the head's): what `plan`'s "what would make it fit" names. Zeros for a model
    without frozen weights (full fine-tuning)."""
    if not any(b.frozen_bytes for b in graph.blocks):
        return tuple((0, 0) for _ in graph.blocks)
    can = quantizable(graph.nodes, graph.constants, graph.params)
    tables = lookup_tables(graph.nodes)
    out = []
    for b in graph.blocks:
        saved = [0, 0]
        for i in {i for n in b.nodes for i in graph.node(n).inputs if i in can}:
            value = graph.constants[i]
            for j, target in enumerate(("int8", "int4")):
                held = bytes_per_element(storage_for(target, i in tables), BLOCK) * value.size
                saved[j] += max(0, int(value.nbytes) - int(held))
        out.append((saved[0], saved[1]))
    return tuple(out)


def unversioned_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """Bytes of the parameters of blocks first..last that weight stashing keeps no old version of on
    the device: embedding tables nothing but lookups read anywhere in the model (neither engine's
    lookup backward reads its table, and both feed a forward they re-run the rows that forward
    gathered), except on engines the model knows nothing of."""
    if device_engine(device) not in ("mnn", "torch"):
        return 0
    tables, read = _tables(graph, first, last)
    return sum(int(graph.constants[t].nbytes) for t in tables - read)


def shared_current_bytes(graph: Graph, first: int, last: int, device: DeviceSpec) -> int:
    """Bytes of the parameters of blocks first..last whose current weights the device does not hold
    apart from its old versions where `async_extra_copies` charges a second copy: on PyTorch every
    parameter but the tables stepped in place (`unversioned_bytes`, which come off already). Its
    step with forwards in flight writes new tensors (or a retired version's) while autograd keeps the
    ones those forwards ran with: the copy an old version is charged (`stashed_weight_versions`),
    none besides. MNN holds its current weights in its Vars apart from the numpy copies of its
    versions (`MnnStageEngine._keep_old_version`): 0, as on engines the model knows nothing of."""
    if device_engine(device) != "torch":
        return 0
    return stage_params_bytes(graph, first, last) - unversioned_bytes(graph, first, last, device)


def stepped_gradient_bytes(graph: Graph, first: int, last: int, device: DeviceSpec, schedule: str,
                           update_every: int = 1) -> int:
    """Weight gradients of blocks first..last that the profile's workspace holds (a block's backward
    keeps them until the update) and the device never holds at once: PyTorch under 1f1b-stash with
    an update after every backward steps each weight as soon as its gradient is complete and lets
    it go (`TorchStageEngine.backward_and_step`): its dense weights' gradients come off (the
    tables' are rows, `row_gradient_delta_bytes`). 0 elsewhere."""
    if schedule != "1f1b-stash" or update_every != 1:
        return 0
    return shared_current_bytes(graph, first, last, device)


def summed_head_gradient_bytes(graph: Graph, device: DeviceSpec, schedule: str, update_every: int = 1,
                               microbatches: int | None = None) -> int:
    """The fused LM head's weight gradient that the head's measured workspace holds (the profile's
    fresh forward and backward make it a new vocabulary x hidden array) and neither engine makes
    where a gradient sum is kept: each adds the head's gradient into the running sum a chunk at a
    time (PyTorch in its backward, `TorchStageEngine.backward_into`; MNN in the training forward's
    pass that computes it, `MnnStageEngine.forward_into`, or a backward that recomputes it; the first
    micro-batch's becomes the sum, which the gradient term charges). Taken off the head's block
    (`block_costs`' index len - 2) by `stage_memory_terms` and the partition instance. The head +
    loss stage of tests/jobs/test_torch_full_finetune_plan.py peaked during its backwards with
    SmolLM2's 108 MiB head's new gradient beside the sum (benchmarks/MEMORY_NOTES.md, h129, h131),
    that of tests/jobs/test_full_finetune_plan.py (MNN) from a forward to its backward with a 48 MiB
    one (h135). 0 where no sum is kept (`gradient_copies`: 1f1b-stash updating after every backward,
    a flush schedule of one micro-batch: the backward's own gradient is the one set, which the
    workspace holds), for a frozen head (LoRA), no fused head, or an engine the model knows nothing
    of."""
    if device_engine(device) not in ("mnn", "torch") or not gradient_copies(schedule, update_every, microbatches):
        return 0
    if fused_loss_hidden_bytes(graph) is None:
        return 0
    weight = graph.node(graph.blocks[-2].nodes[-1]).inputs[1]
    return int(graph.constants[weight].nbytes) if weight in graph.params else 0


def unsummed_gradient_bytes(graph: Graph, first: int, last: int, device: DeviceSpec, schedule: str,
                            update_every: int = 1, microbatches: int | None = None) -> int:
    """Weight gradients of blocks first..last that a stage holds where nothing is summed (1f1b-stash
    updating after every backward: `gradient_copies` 0, the backward's own set held in its workspace)
    and its per-block workspace leaves out: MNN's per-block line measured beside a gradient sum
    (`BlockCost.per_block_summed_bytes`: full fine-tuning's layers) charges none, so they are charged
    back here. 0 elsewhere (the line holds them, or the gradient term charges them as the sum)."""
    # PyTorch's keep line is measured beside the sum too (`runtime.profiling.device.summed_torch_line`)
    lines = ("per-block", "keep") if device_engine(device) == "torch" else ("per-block",)
    if gradient_copies(schedule, update_every, microbatches) or activation_mode(device)[0] not in lines:
        return 0
    return sum(c.per_block_summed_bytes or 0 for c in block_costs(graph, device)[first:last + 1])


def row_gradient_delta_bytes(graph: Graph, first: int, last: int, device: DeviceSpec, microbatches: int,
                             schedule: str = "1f1b-flush", update_every: int = 1) -> int:
    """What the gradients of the embedding tables of blocks first..last that nothing but lookups read
    hold, less their dense charge (`gradient_copies` x the table; negative where rows take less):
    both engines give such a table's gradient as the rows its lookups touched (`RowGradient`), the
    executor sums them as rows (ROW_GRADIENT_COPIES x one row, its float32 values and an int64 id,
    per lookup of every micro-batch of an update) and the optimizer steps them without a dense
    copy (`runtime.optim`). 0 for engines the model knows nothing of, or a lookup of unknown shape,
    and where nothing is summed (1f1b-stash updating after every backward: no dense charge, no sum
    of rows). An update sums the micro-batches of a batch (flush schedules) or `update_every`
    backwards (1f1b-stash, 2bw)."""
    if device_engine(device) not in ("mnn", "torch") or gradient_copies(schedule, update_every, microbatches) == 0:
        return 0
    summed = min(update_every, microbatches) if schedule in ASYNC_SCHEDULES else microbatches
    tables, read = _tables(graph, first, last)
    lookups = _graph_tables(graph)[2]
    delta = 0
    for t in sorted(tables - read):
        if lookups[t] is None:
            return 0
        delta += _rows_less_dense_bytes(graph.constants[t], lookups[t], summed)
    if device_engine(device) == "torch":
        delta += _tied_lookup_delta_bytes(graph, first, last, read, summed)
    return delta


def _tied_lookup_delta_bytes(graph: Graph, first: int, last: int, read: set[str], summed: int) -> int:
    """On PyTorch, what the gradient of a tied table (one another block reads otherwise: the LM
    head) holds on a block of first..last that only looks it up, less its dense charge: per such
    block (where `tied_sum_bytes` charges the sum received), rows as `row_gradient_delta_bytes`
    counts them. Its backwards give rows (a sparse embedding gradient, `RowGradient`), summed as
    rows; the exchange's dense copy is `np.zeros` with the rows added (pages of zeros never
    written stay unmapped), so only the sum received at the update is a resident table, which
    `tied_sum_bytes` charges. SmolLM2's first stage (embeddings + 7 layers, full fine-tuning): the
    worker's backward adds the layers' gradients and no table, its update one table (106 MiB
    above the level before it, the table 108); charged dense and summed, the stage ran 0.84-0.85
    of its plan (benchmarks/MEMORY_NOTES.md, helper h64). Per block, so the partitioners' sums
    match: on a stage that also holds the head (every holder: no exchange) the table's dense
    gradient is the head's, and the sum `tied_sum_bytes` charges there, which no exchange
    receives, is what covers it."""
    _, _, lookups, listed = _graph_tables(graph)
    dense = _table_readers(graph)[0]
    delta = 0
    for t in sorted(read):
        blocks = listed[t]
        if len(blocks) < 2 or lookups[t] is None:
            continue
        for k in blocks:
            if first <= k <= last and k not in dense[t]:
                delta += _rows_less_dense_bytes(graph.constants[t], lookups[t], summed)
    return delta


def _rows_less_dense_bytes(table, lookups: int, summed: int) -> int:
    """A table's gradient summed as rows (ROW_GRADIENT_COPIES x one row, its float32 values and an
    int64 id, per lookup of each of `summed` backwards) less its dense charge."""
    row = int(table.nbytes) // table.shape[0] + 8
    return ROW_GRADIENT_COPIES * lookups * summed * row - GRADIENT_COPIES * int(table.nbytes)


def table_state_delta_bytes(graph: Graph, first: int, last: int, device: DeviceSpec, optimizer: str) -> int:
    """What the AdamW state of the embedding tables of blocks first..last that nothing but lookups
    read holds, less its dense charge (`OPTIMIZER_STATE_COPIES` x the table; negative where rows
    take less), for the tables whose rows the training data looks up are known
    (`Graph.lookup_rows`, `confidant plan --data`) and stay at most ROWS_DENSE_SHARE of the table:
    runtime.optim keeps m and v for those rows only. 0 for a table whose rows are unknown, for SGD
    (whose momentum goes dense with any weight decay, which the plan does not know), and for engines
    the model knows nothing of."""
    if optimizer != "adamw" or device_engine(device) not in ("mnn", "torch") or not graph.lookup_rows:
        return 0
    tables, read = _tables(graph, first, last)
    states = OPTIMIZER_STATE_COPIES[optimizer]
    delta = 0
    for t in sorted(tables - read):
        rows = graph.lookup_rows.get(t)
        table = graph.constants[t]
        if rows is None or rows > ROWS_DENSE_SHARE * table.shape[0]:
            continue
        row = int(table.nbytes) // table.shape[0]
        held = row_state_bytes(rows, table.shape[0], row, states)
        delta += min(0, held - states * int(table.nbytes))
    return delta


def row_state_bytes(rows: int, table_rows: int, row_bytes: int, states: int) -> int:
    """What runtime.optim's `_RowState` holds resident for `rows` held rows of a table of
    `table_rows` rows of `row_bytes` each, with `states` moments: the slot per table row, then the
    ids and moments of the held rows, each array's last page whole."""
    return 8 * table_rows + (8 + states * row_bytes) * rows + (1 + states) * ROW_STATE_PAGE


def tied_bytes(graph: Graph, first: int, last: int) -> int:
    """Bytes of the trainable weights blocks first..last share with blocks outside the range (tied
    weights cut by the stage's boundaries: a copy on each holder, gradients summed every step)."""
    inside = {p for b in graph.blocks[first:last + 1] for p in b.params}
    outside = {p for k, b in enumerate(graph.blocks) if not first <= k <= last for p in b.params}
    return sum(int(graph.constants[p].nbytes) for p in inside & outside if p in graph.constants)


def tied_sum_bytes(graph: Graph, first: int, last: int) -> int:
    """Memory the tied-gradient exchange adds to a stage running blocks first..last, block by block
    (an additive charge, as the partitioners need): for each block that reads an embedding table
    another block also holds only through lookups, the table's bytes. That block's gradient is rows,
    made dense for the exchange, and the sum comes back dense: new memory at the update (SmolLM2's
    first stage, measured: its peak at the update, about the table above the steps before). A block
    that reads it otherwise (the LM head) held a dense gradient of it in every backward, which its
    measured workspace counts and which is gone by the update (its last stage measured without the
    charge). A stage holding every holder exchanges nothing: this over-charges a one-stage plan."""
    _, _, _, listed = _graph_tables(graph)
    dense = _table_readers(graph)[0]
    return sum(received_sum_bytes(int(graph.constants[t].nbytes)) for t, blocks in listed.items() if len(blocks) > 1
               for k in blocks if first <= k <= last and k not in dense[t])


# The transport's frames (runtime.transport.wire: PART_BYTES, RELEASE_EVERY_PARTS), restated here (the
# planner imports no runtime); tests/runtime/test_tied_sum_receive.py checks they agree.
RECEIVE_PART_BYTES = 1 << 20
RECEIVE_RELEASE_EVERY_PARTS = 4


def received_sum_bytes(nbytes: int) -> int:
    """What receiving a tied gradient's sum of `nbytes` holds at its peak: the sum, and the frames it
    came in that are copied into it but not yet given back. `runtime.transport.wire.join_payload`
    copies the frames last first into one buffer and trims the freed ones every RELEASE_EVERY_PARTS,
    so that many frames, the one being copied and what the trim leaves lie freed-but-resident beside
    the joined buffer: measured 4.9-6.0 MiB above the level after the join in a fresh process joining
    108 frames (tests/runtime/test_tied_sum_receive.py), and 4.6-6.1 MiB above the sum received in the
    embeddings' stage of tests/jobs/test_torch_full_finetune_plan.py, whose VmRSS rose by the table
    (107.6-112.1 MiB) from its trimmed level (benchmarks/MEMORY_NOTES.md, helper h124): charged
    RELEASE_EVERY_PARTS + 3 frames, one above the most measured. A one-frame sum is used as it came.
    Charged as the table alone, that stage read 0.993-0.994 of its plan once the start-up's double
    charge of library pages was gone (helper h120)."""
    frames = max(1, -(-nbytes // RECEIVE_PART_BYTES))
    return nbytes + (min(frames, RECEIVE_RELEASE_EVERY_PARTS + 3) * RECEIVE_PART_BYTES if frames > 1 else 0)


def phases_apart(device: DeviceSpec, schedule: str) -> bool:
    """Whether a stage's update holds nothing its backwards held (`phase_peak_bytes`): under the flush
    schedules gpipe and 1f1b-flush, whose update comes after every backward of the batch, each
    micro-batch's saved tensors, block workspace and transients gone with it, on either engine (the
    device is not asked). MNN's lookup stage once held more at its update than the sum it receives
    (+166.6 MiB, helper h43): the row gradient's dense copy on huge pages, made sparse since
    (`runtime.heap.sparse_zeros`, h71); `smollm2-full`'s stage 0 then peaked 37 MiB above what it
    holds throughout, under both phases' charges (benchmarks/MEMORY_NOTES.md, helper h77). Not the
    asynchronous schedules (forwards in flight at each update) and not zb-h1 (not measured)."""
    return schedule in ("gpipe", "1f1b-flush")


def update_only_bytes(graph: Graph, first: int, last: int, device: DeviceSpec, schedule: str) -> int:
    """What a stage running blocks first..last holds at its update only, where its phases are apart
    (`phases_apart`; 0 elsewhere, those bytes charged with the rest): the tied sums the exchange
    returns (`tied_sum_bytes`), for each table whose holders are not all in the range (a stage
    holding them all exchanges nothing, and its charge stands for the head's dense gradient, held
    from the head's first backward on). The embeddings' stage of `smollm2-torch-full` and of
    tests/jobs/test_torch_full_finetune_plan.py peak at that update: its level after the last
    backward + the sum received (the row gradient's dense copy the exchange sends holds only its
    rows' pages: `runtime.heap.sparse_zeros`; benchmarks/MEMORY_NOTES.md, helper h71; 0.54-0.61 MiB
    there, unmapped before the sum's frames are all in: not at the peak, not charged, helper h129).
    On PyTorch the executor steps the stage's other weights first and lets their gradient sums go
    before the sum arrives (`StageExecutor._step_untied_first`): those sums, in what the stage holds
    throughout, are gone at the receive (29.3 MiB on that stage), and not credited here: the margin
    that stage's peak keeps (0.947-0.949 of its plan; 0.980-0.983 with them held, helper h129)."""
    if not phases_apart(device, schedule):
        return 0
    _, _, _, listed = _graph_tables(graph)
    dense = _table_readers(graph)[0]
    return sum(received_sum_bytes(int(graph.constants[t].nbytes)) for t, blocks in listed.items()
               if len(blocks) > 1 and not all(first <= k <= last for k in blocks)
               for k in blocks if first <= k <= last and k not in dense[t])


def phase_peak_bytes(held: int, backward: int, update: int, setup: int = 0) -> int:
    """A stage's peak from its phases: what it holds throughout (`held`: weights, gradient sums,
    optimizer state, runtime, engine) + the larger of what only its backwards hold (`backward`: the
    micro-batches' activations, kept parts, workspace and transient) and what only its update holds
    (`update`: `update_only_bytes`), not both; and never less than its set-up's peak (`setup`: the
    runtime with its engine's import at that import's own peak, before a weight is read:
    `planner.cluster.setup_peak_bytes`; 0 where not measured): the one formula behind
    `MemoryTerms.total` and the partitioners' `PartitionInstance.stage_bytes`."""
    return max(setup, held + max(backward, update))


def check_tied_schedule(graph: Graph, ranges: Sequence[tuple[int, int]], schedule: str) -> None:
    """ValueError when a cut puts a tied weight on several stages under an asynchronous schedule:
    1f1b-stash updates each stage on its own clock, so the copies would drift apart."""
    check_schedule_name(schedule)
    if schedule not in ASYNC_SCHEDULES:
        return
    tied = tied_parameters(graph, ranges)
    if tied:
        name, stages = next(iter(tied.items()))
        raise ValueError(f"{schedule} cannot train weights tied across stages ({len(tied)} of them, e.g. {name!r} on "
                         f"stages {list(stages)}): their copies would drift apart between updates; use 1f1b-flush or "
                         "gpipe, or keep the tied blocks on one stage")


def _check_range(graph: Graph, first: int, last: int) -> None:
    n = len(check_blocks(graph))
    if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last < n):
        raise ValueError(f"block range {first}..{last} is not within 0..{n - 1} of graph {graph.name!r}")


def reuses_forward(schedule: str, stages: int, stage: int, microbatches: int) -> bool:
    """Whether every backward of the stage directly follows the forward of its own micro-batch,
    so that the MNN engine reuses the forward's caches instead of re-running it
    (runtime/engines/mnn.py). True for the last stage under 1F1B (F0 B0 F1 B1 ...) and for every
    stage with one micro-batch; GPipe's last stage runs all forwards first (B0 follows F(m-1)),
    and any other 1F1B stage runs a later micro-batch's forward before each backward."""
    check_schedule_name(schedule)
    _check_position(stages, stage, microbatches)
    return microbatches == 1 or (stage == stages - 1 and schedule != "gpipe")


def compute_s(graph: Graph, device: DeviceSpec, first: int, last: int, reuse: bool = False) -> tuple[float, float]:
    """(forward_s, backward_s) of blocks first..last for one micro-batch on the device; with
    `reuse` (see `reuses_forward`) the backward skips MNN's re-run of the forward."""
    _check_range(graph, first, last)
    costs = block_costs(graph, device)[first:last + 1]
    mode, count = activation_mode(device)
    # recomputing per block, only a hybrid's cached blocks skip the re-run
    cached = set(range(first, last + 1)) if mode != "per-block" else set(cached_block_indices(graph, first, last, count))
    return (sum(c.forward_s for c in costs),
            sum(c.backward_s - (min(c.recompute_s, c.backward_s) if reuse and i in cached else 0.0)
                for i, c in enumerate(costs, start=first)))


def accumulated_share(schedule: str, microbatches: int, update_every: int = 1) -> float:
    """Gradient additions per micro-batch: flush schedules sum m micro-batches' gradients before
    one update (m-1 additions: the first gradient is taken as it is); 1f1b-stash and 2bw sum
    `update_every` backwards before each update (k-1 additions per k; none updating after every
    backward)."""
    check_schedule_name(schedule)
    _check_update_every(update_every)
    if schedule in ASYNC_SCHEDULES:
        return (update_every - 1) / update_every
    return (microbatches - 1) / microbatches


def updates_per_microbatch(schedule: str, microbatches: int, update_every: int = 1) -> float:
    """Optimizer steps per micro-batch: one per batch of `microbatches` under flush schedules, one
    per `update_every` backwards under 1f1b-stash and 2bw (which run the batches as one stream)."""
    check_schedule_name(schedule)
    _check_update_every(update_every)
    return 1 / update_every if schedule in ASYNC_SCHEDULES else 1 / microbatches


def accumulate_s(graph: Graph, device: DeviceSpec, first: int, last: int, schedule: str, microbatches: int,
                 update_every: int = 1) -> float:
    """Seconds per micro-batch of adding gradients into the running sum, for blocks first..last."""
    _check_range(graph, first, last)
    params = stage_params_bytes(graph, first, last)
    return (params * device.profile.accumulate_s_per_param_byte
            * accumulated_share(schedule, microbatches, update_every))


def block_weight_grads_s(graph: Graph, device: DeviceSpec, schedule: str, microbatches: int) -> tuple[float, ...] | None:
    """Per block, seconds of its part of a W action (the weight gradients of a split backward), or
    None where the schedule does not split backwards. W is WEIGHT_GRAD_SHARE of the backward less
    MNN's re-run of the forward (the re-run belongs to B, which needs the activations first), plus
    the gradient accumulation, which only W does."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None
    per_byte = device.profile.accumulate_s_per_param_byte * accumulated_share(schedule, microbatches)
    return tuple(WEIGHT_GRAD_SHARE * (c.backward_s - min(c.recompute_s, c.backward_s)) + b.params_bytes * per_byte
                 for c, b in zip(block_costs(graph, device), check_blocks(graph)))


def weight_grad_s(graph: Graph, device: DeviceSpec, first: int, last: int, schedule: str,
                  microbatches: int) -> float | None:
    """Seconds of one W action of blocks first..last (`block_weight_grads_s`), or None."""
    _check_range(graph, first, last)
    per_block = block_weight_grads_s(graph, device, schedule, microbatches)
    return None if per_block is None else sum(per_block[first:last + 1])


def update_s(graph: Graph, device: DeviceSpec, first: int, last: int, optimizer: str) -> float:
    """Seconds of one optimizer step over the parameters of blocks first..last on the device
    (0 for a profile that did not measure the optimizer)."""
    _check_range(graph, first, last)
    check_optimizer_name(optimizer)
    params = stage_params_bytes(graph, first, last)
    return params * update_rate(device, optimizer)


@dataclass(frozen=True)
class MemoryTerms:
    """A stage's predicted peak bytes by what holds them (`stage_memory_terms`); `total` is the
    stage's memory (`stage_memory_bytes`), and `confidant show` prints the terms in MiB."""

    trainable_bytes: int      # trainable weights and their old versions (under LoRA: the adapters)
    frozen_bytes: Mapping[str, int]  # frozen weights held once, by storage precision
    gradient_bytes: int       # gradient sums (dense, row-wise, a tied weight's sum)
    optimizer_state_bytes: int
    activation_bytes: int     # stashed block inputs per micro-batch in flight, held logits
    workspace_bytes: int      # the blocks' stacked workspace and the stage's largest one-block transient
    runtime_bytes: int        # the idle runtime and its engine
    engine_bytes: int = 0     # what building the stage's engine holds beyond its weights (`engine_bytes`)
    # on a device that keeps its activations, each block's kept part once more per further micro-batch
    # in flight (`kept_activation_bytes`), and as often the stage's once part (`kept_once_bytes`)
    kept_activation_bytes: int = 0
    # of the workspace, the fused LM head + loss's measured peak (the profile's, at the most target
    # positions a micro-batch of the plan's data has, `plan --data`; without it every position a
    # target, the worst case of any data; the loss skips positions of weight 0)
    head_loss_bytes: int = 0
    # held at the update only (`update_only_bytes`: tied sums received; not in gradient_bytes), against
    # the backwards' part (activations, kept activations, workspace) of which only the larger counts
    update_bytes: int = 0
    # the set-up's peak (`planner.cluster.setup_peak_bytes`: the runtime and its engine's import at its
    # own peak, before the weights): the stage's floor; 0 where the profile did not measure it
    setup_peak_bytes: int = 0

    @property
    def backward_bytes(self) -> int:
        """What only the stage's backwards hold (`phase_peak_bytes`)."""
        return self.activation_bytes + self.kept_activation_bytes + self.workspace_bytes

    @property
    def total(self) -> int:
        held = (self.trainable_bytes + sum(self.frozen_bytes.values()) + self.gradient_bytes
                + self.optimizer_state_bytes + self.runtime_bytes + self.engine_bytes)
        return phase_peak_bytes(held, self.backward_bytes, self.update_bytes, self.setup_peak_bytes)

    def by_name(self) -> dict[str, int]:
        """The terms as plan.json records them (`ir.documents.DevicePlan.memory_terms`): frozen
        weights as one entry per precision, `frozen <precision>`."""
        return {"trainable": self.trainable_bytes, **{f"frozen {p}": b for p, b in self.frozen_bytes.items()},
                "gradients": self.gradient_bytes, "optimizer state": self.optimizer_state_bytes,
                "activations": self.activation_bytes,
                **({"activations kept": self.kept_activation_bytes} if self.kept_activation_bytes else {}),
                "workspace": self.workspace_bytes - self.head_loss_bytes,
                **({"LM head + loss": self.head_loss_bytes} if self.head_loss_bytes else {}),
                "runtime": self.runtime_bytes,
                **({"engine": self.engine_bytes} if self.engine_bytes else {}),
                # the update's part and the backwards' are not held at once: the smaller comes off
                **({"gradient sum received (update)": self.update_bytes,
                    "not held at once": -min(self.update_bytes, self.backward_bytes)} if self.update_bytes else {}),
                # a stage holding less than its engine's import peaked at: that peak is its figure
                **({"engine import peak (set-up)": self.total - self._trained_bytes}
                   if self.total > self._trained_bytes else {})}

    @property
    def _trained_bytes(self) -> int:
        """The stage's peak without the set-up's floor."""
        return replace(self, setup_peak_bytes=0).total


def stage_memory_bytes(graph: Graph, device: DeviceSpec, first: int, last: int, stage: int, stages: int,
                       schedule: str, microbatches: int, optimizer: str, update_every: int = 1) -> int:
    """Predicted peak bytes of stage `stage` of `stages` running blocks first..last on the device,
    with an update after every `update_every` backwards (1f1b-stash and 2bw): `stage_memory_terms`' total."""
    return stage_memory_terms(graph, device, first, last, stage, stages, schedule, microbatches, optimizer,
                              update_every).total


def _frozen_by_precision(graph: Graph, first: int, last: int, frozen: int) -> dict[str, int]:
    """The frozen bytes `frozen` by storage precision: the quantized weights the blocks read
    (`ir.precision.QuantizedTensor`) at their own, the rest (float32 weights, MNN's widened scales)
    as float32. Labels only: the total is the memory model's. (Full fine-tuning freezes nothing: no walk.)"""
    if not frozen:
        return {}
    by: dict[str, int] = {}
    seen: set[str] = set()
    for block in graph.blocks[first:last + 1]:
        for name in block.nodes:
            for i in graph.node(name).inputs:
                value = graph.constants.get(i)
                if i not in seen and getattr(value, "storage", None) is not None:
                    seen.add(i)
                    by[value.storage] = by.get(value.storage, 0) + int(value.nbytes)
    quantized = min(sum(by.values()), frozen)
    out = {k: v for k, v in by.items()} if quantized == sum(by.values()) else {"quantized": quantized}
    if frozen - quantized > 0:
        out["float32"] = out.get("float32", 0) + frozen - quantized
    return {k: v for k, v in out.items() if v}


def stage_memory_terms(graph: Graph, device: DeviceSpec, first: int, last: int, stage: int, stages: int,
                       schedule: str, microbatches: int, optimizer: str, update_every: int = 1) -> MemoryTerms:
    """`stage_memory_bytes` term by term (module docstring): what each byte of the peak is for."""
    _check_range(graph, first, last)
    check_optimizer_name(optimizer)
    blocks = graph.blocks[first:last + 1]
    params = stage_params_bytes(graph, first, last)
    frozen = sum(b.frozen_bytes for b in blocks)  # held once: never stashed, stepped or accumulated
    frozen -= shared_frozen_bytes(graph, first, last)
    frozen += double_held_bytes(graph, first, last, device)
    frozen += frozen_storage_extra_bytes(graph, first, last, device)
    by_precision = _frozen_by_precision(graph, first, last, frozen)
    if holds_base_mapped(graph, device):
        key = STREAMED_FROZEN if device_engine(device) == "mnn" else MAPPED_FROZEN
        by_precision = {key: mapped_frozen_bytes(graph, first, last, device)}
    inputs = list(block_input_bytes(graph)[first:last + 1])
    in_flight = in_flight_microbatches(schedule, stages, stage, microbatches)
    held = 0
    n = len(graph.blocks)
    fused = bool(joined_boundaries(graph))  # the LM head and its loss run fused on their stage
    if fused_loss_hidden_bytes(graph) is not None:
        if first == n - 1:  # the loss alone: it stashes the logits it receives (a plan from before
            inputs[0] = graph.blocks[n - 2].activation_bytes  # `joined_boundaries`)
            held = _loss_alone_bytes(graph, device)
        if last == n - 2:  # the head without its loss: its logits wait for their gradient
            held = graph.blocks[last].activation_bytes * in_flight
    costs = block_costs(graph, device)[first:last + 1]
    kept = (kept_activation_bytes(sum(c.kept for c in costs), in_flight, keeps_activations(device))
            + kept_once_bytes(graph, device, first, last, in_flight))
    stacked = sum(c.stacked for c in costs)  # `workspace_of` less the kept part, charged as activations
    head_loss = costs[n - 2 - first].stacked if fused and first <= n - 2 <= last else 0
    if head_loss:  # the head's gradient added into the sum, not made beside it (`summed_head_gradient_bytes`)
        summed_head = min(head_loss, summed_head_gradient_bytes(graph, device, schedule, update_every, microbatches))
        head_loss -= summed_head
        stacked -= summed_head
    copies = weight_copies(schedule, optimizer, stages, stage, microbatches, update_every)
    state = OPTIMIZER_STATE_COPIES[optimizer]
    gradients = gradient_copies(schedule, update_every, microbatches)
    update = update_only_bytes(graph, first, last, device, schedule)
    return MemoryTerms(
        trainable_bytes=(params * (copies - state - gradients)
                         - unversioned_bytes(graph, first, last, device)
                         * unversioned_copies(schedule, stages, stage, microbatches, update_every)
                         - shared_current_bytes(graph, first, last, device) * async_extra_copies(schedule, stages, stage)),
        frozen_bytes=by_precision,
        gradient_bytes=(params * gradients
                        + row_gradient_delta_bytes(graph, first, last, device, microbatches, schedule, update_every)
                        - stepped_gradient_bytes(graph, first, last, device, schedule, update_every)
                        + unsummed_gradient_bytes(graph, first, last, device, schedule, update_every, microbatches)
                        + tied_sum_bytes(graph, first, last) - update),
        update_bytes=update,
        optimizer_state_bytes=params * state + table_state_delta_bytes(graph, first, last, device, optimizer),
        activation_bytes=sum(inputs) * in_flight + held,
        kept_activation_bytes=kept,
        # the fused pair's peak, all stacked on the head's block (`block_costs`)
        head_loss_bytes=head_loss,
        workspace_bytes=stacked + transient_bytes(graph, device, first, last) + hybrid_cache_bytes(graph, device, first, last),
        runtime_bytes=runtime_bytes(device),
        engine_bytes=engine_bytes(graph, first, last, device),
        setup_peak_bytes=setup_peak_bytes(device))


def backend_times(graph: Graph, device: DeviceSpec, first: int, last: int,
                  reuse: bool = False) -> list[tuple[str, float, int]]:
    """(backend, forward+backward seconds per micro-batch of blocks first..last as `compute_s`
    prices them, the memory its engine adds) for each of the device's profiled backends that
    measured all of them, fastest first: what `show` explains an engine choice with."""
    out = []
    for backend in device.profile.backends:
        try:
            forward, backward = compute_s(graph, replace(device, backend=backend.backend), first, last, reuse)
        except ValueError:  # this backend lacks a block
            continue
        out.append((backend.backend, forward + backward, backend.engine_overhead_bytes))
    return sorted(out, key=lambda t: t[1])


def workspace_of(graph: Graph, device: DeviceSpec, first: int, last: int, in_flight: int = 1) -> int:
    """Workspace blocks first..last hold together with `in_flight` micro-batches in flight, besides
    the stage's one transient (`transient_bytes`): each block's `stacked` part, and on a device that keeps
    activations its `kept` part once more for every further micro-batch in flight, and the stage's
    once part as often (`kept_once_bytes`)."""
    costs = block_costs(graph, device)[first:last + 1]
    return (sum(c.stacked for c in costs)
            + kept_activation_bytes(sum(c.kept for c in costs), in_flight, keeps_activations(device))
            + kept_once_bytes(graph, device, first, last, in_flight))


def transient_bytes(graph: Graph, device: DeviceSpec, first: int, last: int) -> int:
    """The largest transient (`BlockCost.transient`) of blocks first..last on the device: one block's
    backward runs at a time, so a stage needs the largest of its own blocks' once. Not a sum over
    blocks: the partitioners take this max per stage (`PartitionInstance.stage_bytes`, the CP-SAT
    model's transient variable, the DP's running max), from the per-block figures `block_transients`
    gives them. On a hybrid (`per-block+K`) a cached block runs as a keeping one, with its per-op
    caches: its transient is its keeping one (`workspace - stacked`), not the re-run's, so a stage
    whose every block is cached is charged as keeping (SmolLM2 int4, a last stage of six layers + the
    LM head and loss, all six cached: a step held 122.8 MiB above the built engine, keeping 124.0, and
    the re-run's transient charged it 17.5 MiB above keeping; helper h107). The partition instance, which prices a
    per-block device before its cached blocks are chosen (`planner.engines.hybrid_activations`),
    keeps the per-block figures."""
    transients = block_transients(graph, device)
    mode, count = activation_mode(device)
    cached = set(cached_block_indices(graph, first, last, count)) if mode == "per-block" and count else set()
    if cached:
        keeping = block_transients(graph, replace(device, activations="keep"))
        transients = tuple(keeping[i] if i in cached else t for i, t in enumerate(transients))
    return max(transients[first:last + 1], default=0)


def block_transients(graph: Graph, device: DeviceSpec) -> tuple[int, ...]:
    """Per block, its transient on the device (`BlockCost.transient` under `block_costs`)."""
    return tuple(c.transient for c in block_costs(graph, device))


def transfer_s(nbytes: int, cluster: Cluster, a: str, b: str) -> float:
    """One transfer of `nbytes` between devices a and b: bytes / bandwidth + latency."""
    return cluster.link(a, b).transfer_s(nbytes)


def stage_cost(graph: Graph, cluster: Cluster, devices: Sequence[str], ranges: Sequence[tuple[int, int]],
               stage: int, schedule: str, microbatches: int, optimizer: str, update_every: int = 1) -> StageCost:
    """The StageCost of stage `stage` of the pipeline devices[i] runs ranges[i] (inclusive), with an
    update after every `update_every` backwards under 1f1b-stash and 2bw: its memory (the gradient
    sum, the versions) and its backward (the additions into the sum, `accumulated_share`); `update_s`
    stays one optimizer step (`predicted_step_s` counts how many a micro-batch takes)."""
    if len(devices) != len(ranges):
        raise ValueError(f"{len(devices)} devices for {len(ranges)} block ranges")
    p = len(devices)
    _check_position(p, stage, microbatches)
    first, last = ranges[stage]
    spec = cluster.device(devices[stage])
    forward, backward = compute_s(graph, spec, first, last, reuses_forward(schedule, p, stage, microbatches))
    backward += accumulate_s(graph, spec, first, last, schedule, microbatches, update_every)
    send_act = send_grad = 0.0
    if stage < p - 1:
        send_act = transfer_s(graph.blocks[last].activation_bytes, cluster, devices[stage], devices[stage + 1])
    if stage > 0:
        send_grad = transfer_s(graph.blocks[first - 1].activation_bytes, cluster, devices[stage], devices[stage - 1])
    memory = stage_memory_bytes(graph, spec, first, last, stage, p, schedule, microbatches, optimizer, update_every)
    update = update_s(graph, spec, first, last, optimizer)
    tied = tied_bytes(graph, first, last)
    if tied and p > 1:  # its gradient for the tied weights out, the sum back, before the update
        others = [d for k, d in enumerate(devices) if k != stage and tied_bytes(graph, *ranges[k])]
        peer = others[0] if others else devices[(stage + 1) % p]
        update += 2 * transfer_s(tied, cluster, devices[stage], peer)
    return StageCost(stage, spec.name, forward, backward, update, send_act, send_grad, memory, spec.plannable_bytes,
                     weight_grad_s(graph, spec, first, last, schedule, microbatches))


def stage_time_s(cost: StageCost) -> float:
    """A stage's time per micro-batch: forward + backward + its two transfers (no overlap)."""
    return cost.forward_s + cost.backward_s + cost.send_act_s + cost.send_grad_s


def stage_costs(graph: Graph, cluster: Cluster, partition: Partition, schedule: str, microbatches: int,
                optimizer: str, update_every: int = 1) -> list[StageCost]:
    """The StageCost of every stage of `partition` (whose ranges must cover the graph's blocks in order)."""
    ranges = partition.ranges
    n = len(check_blocks(graph))
    expected = 0
    for s, (first, last) in enumerate(ranges):
        if first != expected or last < first:
            raise ValueError(f"partition stage {s} runs blocks {first}..{last}; expected it to start at block {expected}")
        expected = last + 1
    if expected != n:
        raise ValueError(f"partition covers blocks 0..{expected - 1} of {n}")
    check_tied_schedule(graph, ranges, schedule)
    return [stage_cost(graph, cluster, partition.devices, ranges, s, schedule, microbatches, optimizer, update_every)
            for s in range(len(ranges))]


def boundary_link_s(costs: Sequence[StageCost]) -> list[float]:
    """Per boundary s (between stages s and s+1), its link time per micro-batch (both directions)."""
    return [costs[s].send_act_s + costs[s + 1].send_grad_s for s in range(len(costs) - 1)]


def predicted_step_s(costs: Sequence[StageCost], schedule: str, microbatches: int, update_every: int = 1) -> float:
    """Seconds per step of `microbatches` micro-batches (DESIGN's numbers).

    Flush schedules (gpipe, 1f1b-flush): the sum of stage times (the first micro-batch's trip
    through the pipeline and back) + (m-1) x the slowest stage time + the slowest optimizer step.
    Split backwards (zb-h1): each stage's W (`StageCost.weight_pass_s`) leaves the first
    micro-batch's trip and runs in the bubbles, and a stage's last W and its update close the step:
    the sum of stage times less the W's + (m-1) x the slowest stage time + the slowest W + update
    (uniform stages F, B, W, no update: m (F+B+W) + (p-1)(F+B), ZB-H1's makespan).
    Asynchronous schedules (1f1b-stash, 2bw; steady state, transfers overlapped with compute): m x
    the larger of the slowest stage's forward+backward+update/`update_every` (an update after every
    `update_every` backwards) and the slowest boundary's link time.
    """
    check_schedule_name(schedule)
    if not costs:
        raise ValueError("no stages")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    # The optimizer step (update_s, from the profile; 0 for profiles without it) runs once per batch
    # on every stage at once under flush schedules, and after every update_every-th backward under
    # 1f1b-stash and 2bw.
    if schedule in ASYNC_SCHEDULES:
        per_microbatch = updates_per_microbatch(schedule, microbatches, update_every)
        period = max([c.forward_s + c.backward_s + c.update_s * per_microbatch for c in costs]
                     + boundary_link_s(costs))
        return microbatches * period
    times = [stage_time_s(c) for c in costs]
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        return (sum(times) - sum(c.weight_pass_s for c in costs) + (microbatches - 1) * max(times)
                + max(c.weight_pass_s + c.update_s for c in costs))
    return sum(times) + (microbatches - 1) * max(times) + max(c.update_s for c in costs)
