"""Profile a device: `confidant profile` runs `profile_device` on each device and ships the JSON
(`ir.profile.DeviceProfile`).

`profile_device` times every distinct block kind of a lowered graph (`ir.graph.block_signature`:
MiniLM's six encoder layers are one kind) on every backend that really runs here, through the
same stage engines the pipeline uses, so the numbers include everything a stage pays (host
values, numpy embedding lookups, MNN's per-op caches, gradient reads). Backends are named
`engine:device:tN` (`mnn:cpu:t1`, `torch:cpu:t2`); thread variants count as separate backends.
A backend is profiled only when it is really present: MNN devices that `available_backends()`
finds (the MNN engine itself drives the CPU only, so other MNN devices are reported and skipped),
torch when it is importable, and never more threads than the machine has CPUs.

Side effects: profiling resets this process's peak-RSS mark (`runtime.procfs.peak_rss_bytes` afterwards
reports peaks since the profile), leaves torch's process-wide thread count at the last setting
an engine made (the split measurement's in-process backend, else the last profiled one; MNN's is
restored), and leaves head_split's fork server running (started to measure the split children
and the split costs; it ends with this process).

The measurements live by job: `runtime.profiling.compute` (block and attention times, optimizer
rates), `memory` (peak RSS, the runtime's overhead, head-split children), `split_costs` (what a
real head split costs beyond the curves), `links` (bandwidth and latency to a peer), `backends`
(which backends run here).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import time
from dataclasses import replace

import numpy as np
from typing import Sequence

from ir.graph import Block, Graph, block_signature
from ir.profile import AttentionCurve, BackendProfile, BlockCost, DeviceProfile
from runtime.engines import mnn_kernels as K
from runtime.engines.split.piece import attention_form
from runtime.engines.stage import fused_lm_head, stage_spec
from runtime.profiling.backends import present_backends
from runtime.profiling.compute import (accumulate_rate, attention_curve, engine_setup_bytes, engine_update_rates,
                                       kept_workspace, measure_stage, peak_workspace, start_up_bytes, update_rates)
from runtime.profiling.fresh import (ForkServers, FreshProcesses, agreeing_readings, fresh_in_flight, fresh_line,
                                     fresh_peaks, start_up_and_held, summed_line, summed_peaks)
from runtime.profiling.inputs import TARGET_WEIGHTS, Progress, block_mask, synthetic_feeds
from runtime.profiling.memory import (engine_figures, measure_split_children, memory_available_bytes,
                                      runtime_overhead_bytes)
from runtime.profiling.split_costs import measure_split_extra_costs

_log = logging.getLogger(__name__)

DEFAULT_BACKENDS = ("mnn:cpu:t1", "mnn:cpu:t2", "torch:cpu:t1", "torch:cpu:t2")
# Below this, a first run's excess over a repeat is page-level noise (MNN measures 0.2 MiB), not
# an engine's start-up.
START_UP_NOISE_BYTES = 1 << 20
# Peaks per stage length behind the per-block line (`measure_block`).
LEAN_PEAK_REPEATS = 5
# The longest stage of one block kind behind the per-block line (`measure_block`).
LEAN_RUN = 4
# MNN's fresh per-block line: one further point, a stage of up to this many blocks of the kind (`measure_block`).
FAR_RUN = 12
# New interpreters per stage length behind the summed per-block line (`_summed_line`), near and far: a profile's
# readings of one length agree within 0.2 MiB (h80), so one each (h88; h80's three at 1..4 layers, with the whole
# order of a worker's steps, made its profile 1.5-4.5x main's). The far point is a worker's steps of up to a whole
# model's layers (SmolLM2 full fine-tuning: 30 layers, ~1.7 GB).
SUMMED_REPEATS = 1
# Fresh child interpreters per stage length behind a repeated kind's lines, and behind the engine's
# start-up (`runtime.profiling.fresh`): the median is taken.
FRESH_PEAK_REPEATS = 3
# The fused LM head + loss's second memory point: 1/this of its target positions targets, each point's
# peak measured this many times (`_with_sparse_targets`).
SPARSE_TARGET_SHARE = 8
TARGET_PEAK_REPEATS = 3


def distinct_blocks(graph: Graph) -> dict[str, Block]:
    """The first block of each signature, in graph order."""
    out: dict[str, Block] = {}
    for b in graph.blocks:
        out.setdefault(block_signature(b), b)
    return out


def measure_block(backend, graph: Graph, block: Block, feeds, reps: int, fresh: FreshProcesses | None = None,
                  start_up: int = 0, builds: FreshProcesses | None = None, keep_start_up: int = 0,
                  memory_bytes: int | None = None) -> BlockCost:
    """One block kind's cost as a stage pays it. A decoder's LM head is measured as it runs, fused
    with the causal-LM loss on its stage (`runtime.engines.lm_loss`: no logits are made), minus the
    loss alone (which the loss's own signature carries): the head's time is the fused kernel's, its
    workspace the fused stage's.

    Memory besides the workspace: `kept_bytes`, what a second micro-batch in flight adds under an
    engine that keeps activations (`kept_workspace`, on the run of blocks of this kind described
    next, divided by its length: one block alone measured 27-28 MiB a MiniLM layer on MNN, three
    35), and, for a kind whose next block is of the same kind, `stacked_bytes`: what each further
    block of the kind adds to a stage. Peaks of
    stages of 1, 2 (and 3, where the model has three in a row) such blocks are measured
    (`peak_workspace`, freshly built engines after the timed run, so none pays the shape's first
    run), and the larger of the last step and the mean step is taken: a single block's peak
    carries a transient that several do not repeat (MiniLM on MNN: 64-68, 100.5, 139.5, 179 MiB
    for 1-4 layers: 39 a layer from two on, 33-37 from one to two), and PyTorch's steps are
    noisy (6 to 14 MiB a layer, about 11 on average). The workspace is raised, where needed, to
    what that line puts at one block, so its transient part (`BlockCost.transient`) is the
    line's intercept. The same peaks are measured once more with activations recomputed per block
    (`per_block_workspace_bytes`, `per_block_stacked_bytes`: MNN without per-op caches, each block's
    buffers let go after its forward and its backward; PyTorch with each block under a checkpoint
    of its own), and on PyTorch the backward that way too (`per_block_backward_s`: each block's
    forward re-run in it). The LM head fused with its loss is not (its per-block figures are its
    cached ones: PyTorch runs the pair as it is on a per-block stage).

    `fresh` given, on PyTorch: the per-block line of a repeated kind is measured as a worker runs
    instead, each peak in a fresh child process (`runtime.profiling.fresh`: FRESH_PEAK_REPEATS per
    length, the line through the medians), less `start_up` (what the engine's start-up is charged,
    `profile_device`: a fresh first run pays it, and the engine's charge carries it), and what a
    further micro-batch in flight adds per block that way (`per_block_kept_bytes`) and once a stage
    (`per_block_kept_once_bytes`); and the keep line the same way (`stacked_bytes`, the workspace,
    and `kept_bytes` from two in flight: warm, the middle stage of SmolLM2 int4 torch keeping ran
    1.04-1.09x its plan in five runs, with the line fresh 0.93-1.01 in three). MNN's keep and per-block
    lines are measured fresh in `builds`' children (h60, h62: the warm process read them 3-15 MiB above a
    fresh worker's, and moved that much between profiles; benchmarks/MEMORY_NOTES.md), the keep line less
    `keep_start_up` (the start-up a keeping stage is charged), what a further micro-batch keeps
    (`kept_bytes`) still here.

    On MNN a kind with trainable and no frozen weights (full fine-tuning) has its per-block line measured
    as a worker's second step holds it instead (`_summed_line`, as far as `memory_bytes` allows).

    `builds` given (`profile_device`'s `fresh`, every engine): the engine's build (`engine_bytes`) is
    measured as a worker builds it, first in a fresh child (`_engine_build`), not here after the block ran."""
    i = block.index
    if fused_lm_head(graph, i, i + 1) is not None and i == len(graph.blocks) - 2:
        both_spec, loss_spec = stage_spec(graph, i, i + 1), stage_spec(graph, i + 1, i + 1)
        both = measure_stage(backend, both_spec, feeds, reps)
        loss = measure_stage(backend, loss_spec, feeds, reps)
        # What a further micro-batch in flight holds of the pair, run as a stage with several in flight
        # runs it (GPipe's last): its backwards summed, so on MNN each forward adds the head's gradient
        # into the sum (`MnnStageEngine.forward_into`) and keeps none of its own. The whole pair's, as
        # its workspace is (`planner.cost.block_costs` charges the loss block none). Measured with
        # plain backwards less the loss alone's, it read each forward's own head gradient less the
        # loss's kept logits, which the pair never makes: 24.7 MiB a micro-batch for a 48 MiB head,
        # 74 MiB of a GPipe head stage's plan at 4 micro-batches where the stage holds ~1 (helper h142).
        kept = kept_workspace(backend, both_spec, feeds, summed=True)
        backward = max(0.0, both.backward_s - loss.backward_s)
        # The workspace: the stage's first run here, which carries what this process's heap held by then.
        # On PyTorch that first run read 125-158 MiB for a SmolLM2-width tied head + loss (1 x 128) across
        # profiles (24 MiB, one logits-sized buffer, apart), where its later runs repeat within 1 MiB
        # (133.5-135.5) and a head + loss worker held ~123 beyond its weights, state and start-up: a plan
        # charging 158 put that worker at 0.897 of it (the clean-clone CI of ebb907a). The lowest of the first
        # run and the repeats (`every`) is charged there; MNN's first run stays (its repeats peak higher) where
        # no fresh children are given, else the pair's fresh stage peak (`_fresh_pair_points`).
        fresh_pair = builds is not None and backend.engine == "mnn"
        every = 0 if fresh_pair else min(peak_workspace(backend, both_spec, feeds) for _ in range(TARGET_PEAK_REPEATS))
        workspace = min(both.workspace_bytes, every) if backend.engine == "torch" else both.workspace_bytes
        cost = BlockCost(max(0.0, both.forward_s - loss.forward_s), backward,
                         max(0.0, both.recompute_s - loss.recompute_s), workspace, kept_bytes=kept,
                         engine_bytes=_engine_build(backend, graph, i, i + 1, feeds, builds),
                         per_block_backward_s=backward if backend.engine == "torch" else None)
        if fresh_pair:
            return _fresh_pair_points(cost, builds, graph, i, feeds)
        return _with_sparse_targets(cost, backend, both_spec, feeds, every)
    spec = stage_spec(graph, i, i)
    cost = measure_stage(backend, spec, feeds, reps)
    run = 1  # blocks of this kind in a row from this one, up to three
    while run < 3 and i + run < len(graph.blocks) and block_signature(graph.blocks[i + run]) == block_signature(block):
        run += 1
    # per block of the run (one alone measured 1.1-1.7 MiB a SmolLM2 layer, three 1.7 each, fifteen 1.8: warm;
    # built first in fresh children 5.73 / 10.22 / 17.34 / 29.24 MiB for 1 / 3 / 6 / 11 layers, ~2.4 a layer and
    # ~3 once a stage, so a third of the once part rides on each layer: ~1 MiB a layer over, never under from
    # three layers on; Llama-3.2-1B-class int4 13.3 / 34.5 / 55.8 for 1 / 3 / 5, ~10.6 a layer and ~2.6 once)
    # Since h53 split the line through the builds of one block and of the run (each in its own child): the
    # step per further block in `engine_bytes`, the rest of one block's build in `engine_once_bytes`, which
    # the planner charges once a stage (`planner.cost.engine_bytes`): a stage of k blocks is charged
    # once + k x step, each build's figure at k = 1 and k = run.
    built = _engine_build(backend, graph, i, i + run - 1, feeds, builds)
    if run == 1:
        cost = replace(cost, engine_bytes=built)
    else:
        one = _engine_build(backend, graph, i, i, feeds, builds)
        step = max(0, built - one) // (run - 1)
        cost = replace(cost, engine_bytes=step, engine_once_bytes=max(0, one - step))
    kept = kept_workspace(backend, stage_spec(graph, i, i + run - 1), feeds) // run
    # The cached (keep) line through stages of up to LEAN_RUN blocks, each step between lengths one
    # vote: through 1-3 blocks, three profiles of one machine put a SmolLM2 int4 layer at 12.8 / 13.5 /
    # 17.6 MiB stacked (MNN's peaks sit at one of two levels ~10 MiB apart, as the per-block line's
    # do, and one jump within two steps moved the line), which moves a 12-layer keeping stage's charge
    # by tens of MiB. With three steps the median is taken (one jump outvoted) and the workspace
    # covers the highest peak less what stacks under it (a jump charged once, as a transient); with
    # fewer, the larger of the last and the mean step, as before (`_further_block_line`).
    keep_run = run
    while keep_run < LEAN_RUN and i + keep_run < len(graph.blocks) and \
            block_signature(graph.blocks[i + keep_run]) == block_signature(block):
        keep_run += 1
    if keep_run > 1 and fresh is not None and backend.engine == "torch":
        # As a keeping worker runs (`fresh`), as the per-block line below: the line through fresh peaks
        # of 1..keep_run layers less the start-up the engine is charged, and what a further micro-batch
        # in flight adds (`fresh_in_flight`): per layer the kept bytes, once into the workspace. Warm,
        # this process measured a SmolLM2 int4 LoRA layer 8.5 MiB stacked and 6.8 kept, where fresh
        # children of 1 / 4 / 12 layers peak ~72 / ~112 / 207-225 MiB (start-up included) and a second
        # micro-batch adds ~12 / ~30 / ~105 (benchmarks/MEMORY_NOTES.md, helper h26).
        # A kind whose weights all train (full fine-tuning) is measured beside a running gradient sum, less it
        # (`summed_torch_line`).
        summed = summed_torch_line(block)
        peaks = fresh_peaks(fresh, graph, feeds, i, range(1, keep_run + 1), "keep", FRESH_PEAK_REPEATS, summed)
        stacked, workspace = fresh_line(peaks, start_up)
        kept, once = fresh_in_flight(fresh, graph, feeds, i, peaks, "keep", FRESH_PEAK_REPEATS, summed)
        cost = replace(cost, workspace_bytes=workspace + once, stacked_bytes=stacked,
                       per_block_summed_bytes=block.params_bytes if summed else None)
    elif keep_run > 1 and builds is not None and backend.engine == "mnn":
        # As a worker runs (`builds`' fork-server children, a child per peak), as the per-block line below:
        # here, after the profile's other engines, the warm process read a SmolLM2 int4 layer's keep line
        # 25.9 MiB one layer + 15.1 a further one, 71.0 at four layers (beside 3.2 of start-up charged to
        # a keeping stage), where fresh children peak 21.0 / 33.0 / 48.8 / 59.8 MiB at 1-4 layers (three
        # each, identical to 0.01): a keeping last stage (its LM head + loss beside) ran 0.86 of its plan
        # (benchmarks/MEMORY_NOTES.md, helper h62). The line through the fresh medians (`fresh_line`),
        # less what a keeping stage is charged of the start-up (`keep_start_up`, in the runtime term);
        # a further block at least what a further micro-batch keeps per block (`kept`, below), and the
        # workspace the highest peak less what that stacks under it, so every measured stage is covered.
        peaks = fresh_peaks(builds, graph, feeds, i, range(1, keep_run + 1), "keep", FRESH_PEAK_REPEATS)
        stacked = max(fresh_line(peaks, keep_start_up)[0], kept)
        workspace = max(max(p) - keep_start_up - k * stacked for k, p in enumerate(peaks))
        cost = replace(cost, workspace_bytes=max(stacked, int(workspace)), stacked_bytes=stacked)
    elif keep_run > 1:
        peaks = [peak_workspace(backend, stage_spec(graph, i, i + k - 1), feeds) for k in range(1, keep_run + 1)]
        steps = sorted(b - a for a, b in zip(peaks, peaks[1:]))
        stacked = max(0, steps[len(steps) // 2]) if len(steps) >= 3 else _further_block_line(peaks)[0]
        workspace = max(p - k * stacked for k, p in enumerate(peaks))
        if backend.engine == "mnn":
            # A further block keeps its per-op caches of the micro-batch, what a further micro-batch
            # keeps per block (`kept`): the line's step, measured in this process after its other
            # engines, lands below a worker's fresh one (SmolLM2 int4: 8.6-9.4 MiB a layer against 10.8
            # in a worker-like fresh process; kept 12.5 in each of six profiles), and a stage keeping
            # 9 layers then peaked 11% over its plan.
            stacked = max(stacked, kept)
        cost = replace(cost, workspace_bytes=max(cost.workspace_bytes, stacked, workspace), stacked_bytes=stacked)
    cost = replace(cost, kept_bytes=kept)
    if backend.engine == "torch":
        # each block's forward re-run in its own backward (a lookup block runs as it is: no re-run)
        cost = replace(cost, per_block_backward_s=measure_stage(backend, spec, feeds, reps, "per-block").backward_s)
    elif backend.engine != "mnn":
        return cost
    # Both engines also recompute per block: the same peaks measured that way. Each length is
    # measured LEAN_PEAK_REPEATS times: what a further block adds is small (SmolLM2 int4 LoRA on
    # MNN: its stashed input and LoRA gradients, ~0.4 MiB), and the peaks sit at one of two
    # levels ~10 MiB apart, the higher one entered at any point of a process and kept (SmolLM2 layer
    # stages of 1, 2, 3 blocks: 24.5, 34.7, 34.4 | 35.0, 35.1, 35.4 | 35.6, 35.5, 35.5 MiB; another
    # profile 24.5-25.6 throughout), so one peak per length, and the mean step, put the jump into
    # every block (0.3, 5.4, 0.4, 6.0 MiB a further layer in four profiles, 5.4 x 15 layers charging
    # a stage 76 MiB it never used). What a further block adds is the median step between the
    # lengths' lowest peaks; the workspace is the highest peak less what that stacks under it: the
    # jump is charged once, as a transient, never per block, and every measured stage is covered.
    # Stages of up to LEAN_RUN blocks: the smallest of two steps ran 0.0-0.7 MiB a SmolLM2 layer (a
    # lowest peak can land low too), the median of three keeps to the ~0.5 a worker's stage shows.
    lean_run = run  # up to LEAN_RUN blocks: three steps, so one jump is outvoted
    while lean_run < LEAN_RUN and i + lean_run < len(graph.blocks) and \
            block_signature(graph.blocks[i + lean_run]) == block_signature(block):
        lean_run += 1
    if lean_run > 1 and fresh is not None and backend.engine == "torch":
        # As a worker runs (`fresh`): a fresh torch worker grew ~3.5 MiB a further SmolLM2 int4 layer
        # where this process measured 0.5-3.1. And a further micro-batch in flight holds more than the
        # block inputs the activations term charges: what it adds (the two-in-flight peak less the
        # one-in-flight one, medians) at one block and at lean_run is a line, ~13 MiB once (the
        # stage's output and its checkpoints' bookkeeping) and ~0.7 MiB a further SmolLM2 int4 layer
        # (fresh processes, 12 layers: 157 / 178 / 196 MiB with 1 / 2 / 3 in flight, 4 layers +15).
        # The per-block part is `per_block_kept_bytes`, charged per block per further micro-batch; the
        # once part `per_block_kept_once_bytes`, charged once a stage per further micro-batch
        # (`planner.cost.kept_once_bytes`: none where one is in flight; profiles made before put it
        # in the workspace, once on every stage, which left a 1-in-flight stage ~13-24 MiB over its
        # run and a 3-in-flight one ~13 MiB under).
        summed = summed_torch_line(block)
        peaks = fresh_peaks(fresh, graph, feeds, i, range(1, lean_run + 1), "per-block", FRESH_PEAK_REPEATS, summed)
        lean, workspace = fresh_line(peaks, start_up)
        what = "summed_peak2" if summed else "peak2"
        two = {k: statistics.median(agreeing_readings(
            lambda k=k: fresh.run(graph, feeds, [(what, i, i + k - 1, "per-block")])[0], FRESH_PEAK_REPEATS))
            for k in (1, lean_run)}
        kept_per_block, once = further_microbatch_parts(two[1] - statistics.median(peaks[0]),
                                                        two[lean_run] - statistics.median(peaks[lean_run - 1]),
                                                        lean_run)
        return replace(cost, per_block_workspace_bytes=workspace, per_block_stacked_bytes=lean,
                       per_block_kept_bytes=kept_per_block, per_block_kept_once_bytes=once,
                       per_block_summed_bytes=block.params_bytes if summed else None)
    if lean_run > 1 and builds is not None and backend.engine == "mnn":
        # As a worker runs (`builds`: MNN's fork-server children, a child per peak): the per-block line
        # through fresh peaks of 1..lean_run layers, less the start-up a per-block stage is charged
        # (`start_up`). Here, after the profile's other engines, the warm process read a SmolLM2 int4
        # layer's per-block workspace 30.4-35.2 MiB between two profiles of one machine (its heap's
        # level, not the layer's), where a fresh process peaks 27.5-27.9 above its build on stages of 1,
        # 6 and 12 layers (benchmarks/MEMORY_NOTES.md, helpers h54 and h60); the keep line the same way
        # since h62 (above). h22's fresh MNN lines ran 1.01x their plans when the engine build was
        # measured warm, ~20 MiB a stage low (h52); it is measured fresh since.
        # And one longer stage (up to FAR_RUN blocks of the kind in a row): the peaks sit at one of two
        # levels, the higher one entered at some length and then flat (SmolLM2 int4, fork-server children,
        # identical in three each: 21.4 / 22.1 / 22.8 / 28.8 MiB for 1-4 layers, 28.6 at 6, 28.7 at 12), so
        # the line through 1-4 layers (0.79 a layer) charged a 12-layer stage 35.1 MiB where it peaks 28.7.
        # What a further block adds is the smaller of that line's step and the step per block from the
        # longest of 1..lean_run to the longer stage; the workspace covers every measured peak less it.
        far = lean_run
        while far < FAR_RUN and i + far < len(graph.blocks) and \
                block_signature(graph.blocks[i + far]) == block_signature(block):
            far += 1
        if block.params_bytes > 0 and not block.frozen_bytes:
            return _summed_line(cost, backend, graph, block, feeds, builds, lean_run, far, start_up, memory_bytes)
        lengths = list(range(1, lean_run + 1)) + ([far] if far > lean_run else [])
        peaks = fresh_peaks(builds, graph, feeds, i, lengths, "per-block", FRESH_PEAK_REPEATS)
        lean, _ = fresh_line(peaks[:lean_run], start_up)
        if far > lean_run:
            lean = min(lean, max(0, int((statistics.median(peaks[-1]) - statistics.median(peaks[lean_run - 1]))
                                        / (far - lean_run))))
        workspace = max(max(p) - start_up - (k - 1) * lean for k, p in zip(lengths, peaks))
        return replace(cost, per_block_workspace_bytes=max(lean, int(workspace)), per_block_stacked_bytes=lean)
    lean_runs = [[peak_workspace(backend, stage_spec(graph, i, i + k - 1), feeds, "per-block")
                  for _ in range(LEAN_PEAK_REPEATS)] for k in range(1, lean_run + 1)]
    if lean_run == 1:
        return replace(cost, per_block_workspace_bytes=max(lean_runs[0]))
    lowest = [min(peaks) for peaks in lean_runs]
    steps = sorted(b - a for a, b in zip(lowest, lowest[1:]))
    lean = max(0, steps[(len(steps) - 1) // 2])  # the median step (of two, the smaller)
    workspace = max(p - k * lean for k, peaks in enumerate(lean_runs) for p in peaks)
    return replace(cost, per_block_workspace_bytes=max(lean, workspace), per_block_stacked_bytes=lean)


def summed_torch_line(block: Block) -> bool:
    """Whether PyTorch's keep and per-block lines of `block`'s kind are measured beside a running gradient sum,
    less it (`peak_workspace`'s `summed`; `BlockCost.per_block_summed_bytes`): a kind whose weights all train
    (full fine-tuning), as a worker's whole backward adds each weight's gradient into its sum as autograd
    completes it (`TorchStageEngine._backward_summed`). A fresh engine's `backward` returns the stage's whole
    gradient set, which those lines held beside the sum the gradient term charges: SmolLM2's per-block full
    fine-tuning stages ran 0.84-0.89 of their plans (benchmarks/MEMORY_NOTES.md, the 2026-12-07 merge, h150).
    Not LoRA's kinds (a frozen base: their gradients are the adapters', a few KiB a layer)."""
    return block.params_bytes > 0 and not block.frozen_bytes


def longest_summed_stage(graph: Graph, block: Block, memory_bytes: int | None) -> int:
    """The most blocks of `block`'s kind in a row from it that a stage can run where its weights, their
    gradient sum and AdamW's two moments (4 x the blocks' trainable weights) take at most half of
    `memory_bytes` (the device's; None: unknown, the whole run): the longest stage a plan can give the
    kind, at least one block."""
    i, sig = block.index, block_signature(block)
    run = 1
    while i + run < len(graph.blocks) and block_signature(graph.blocks[i + run]) == sig:
        run += 1
    if memory_bytes:
        run = min(run, max(1, int(memory_bytes // 2 // max(1, 4 * block.params_bytes))))
    return run


def _summed_line(cost: BlockCost, backend, graph: Graph, block: Block, feeds, builds: FreshProcesses, lean_run: int,
                 far: int, start_up: int, memory_bytes: int | None) -> BlockCost:
    """MNN's per-block line of a kind with trainable weights and no frozen ones (full fine-tuning) measured
    as a worker's second step holds it (`summed_workspace`: beside its gradient sum and AdamW's moments,
    which the gradient and optimizer terms charge, the 1f1b order of a middle stage), each point in a new
    interpreter (`FreshProcesses.run_new`). Measured on a fresh engine's backward (`peak_workspace`) the
    line held the layers' whole gradient set, which a worker holds once, as its sum, and the gradient term
    charges too: SmolLM2's full fine-tuning stages ran 0.85 / 0.85 / 0.92 of their plans
    (benchmarks/MEMORY_NOTES.md, h43, h56, h61, h69). Points at 2..`lean_run` blocks, at `far` and at the
    longest stage the device's memory allows (`longest_summed_stage`; FAR_RUN's point is not read apart from
    it, h80), one reading each (SUMMED_REPEATS, h88: a length's readings move between profiles, not within
    one, and `summed_line` outvotes one length read high; the steps `summed_workspace` runs are shorter than
    a worker's): a worker's second step grows faster past 12 SmolLM2 layers (0.31
    MiB a layer from 4 to 12, 0.9 from 12 to 16, h61), so the step per block is the steepest from lean_run
    to the far point; the line through 2..lean_run is robust to one length reading a layer's gradient high
    (`summed_line`, h80: h70's median of steps drew it once at a gradient a layer). Not for int4
    LoRA kinds: the same line charged SmolLM2 int4 LoRA's middle stage 0.88 of its run (h69)."""
    i = block.index
    longest = max(far, longest_summed_stage(graph, block, memory_bytes))
    # one far point: the longest stage (its step from lean_run blocks is the steepest seen: SmolLM2's 4 -> 30
    # layers ~0.56 MiB a layer against 0.31 from 4 to 12, h61, h70); FAR_RUN's too only where it is the longest
    fars = [longest] if longest > lean_run else []
    # not one block: a stage of one is charged the 2..lean_run level anyway (`summed_line`: the 1 -> 2 jump, ~28
    # MiB a SmolLM2 layer, once), and its reading sat under that level in every profile read (61.4-61.9 MiB
    # against 88.6-89.5; 16.0-16.1 against 21.2-21.4 on 4 hidden-256 layers, h80, h88): one new interpreter fewer
    lengths = list(range(2, lean_run + 1)) + fars
    peaks = summed_peaks(builds, graph, feeds, i, lengths, "per-block", SUMMED_REPEATS)
    lean, workspace = summed_line(peaks, lengths, lean_run, start_up)
    _log.info("summed per-block line of %s: readings MiB %s; step %.2f, workspace %.2f", block.name,
              {k: [round(v / 2**20, 2) for v in p] for k, p in zip(lengths, peaks)}, lean / 2**20, workspace / 2**20)
    return replace(cost, per_block_workspace_bytes=workspace, per_block_stacked_bytes=lean,
                   per_block_summed_bytes=block.params_bytes)


def _engine_build(backend, graph: Graph, first: int, last: int, feeds, builds: FreshProcesses | None) -> int:
    """What building the engine of blocks first..last holds (`engine_setup_bytes`): with `builds`, in a
    fresh child of its own, as a worker builds its engine before anything runs; else in this process.
    Here, after the block's runs, the build reuses heap they left and reads low: a Llama-3.2-1B-class int4
    layer 7.26 MiB against 10.85 built first (below MNN's widened scales, 7.25, so its stages were
    charged no engine and ran 1.01-1.03x their plans), SmolLM2's 1.8 against 3.4 in a fresh child; and a
    child per stage, since a build after another build in one child reads low too (SmolLM2's head
    0.05 MiB after the embeddings and three layers, 3.5 alone; benchmarks/MEMORY_NOTES.md, helper h52)."""
    if builds is None:
        return engine_setup_bytes(backend, stage_spec(graph, first, last))
    return builds.run(graph, feeds, [("engine", first, last, None)])[0]


def further_microbatch_parts(added_at_one: float, added_at_run: float, run: int) -> tuple[int, int]:
    """(per block, once a stage) of what a further micro-batch in flight adds to a stage recomputing per
    block, from what it added (two in flight less one) on stages of one block and of `run` blocks: the
    line through the two points, its step `BlockCost.per_block_kept_bytes` and the rest at one block
    `per_block_kept_once_bytes`, neither below 0. SmolLM2 int4 on PyTorch, fresh processes: ~0.7 MiB a
    further layer, ~13 once."""
    if run < 2:
        raise ValueError(f"run must be >= 2 blocks for a line, got {run!r}")
    one, most = max(0.0, added_at_one), max(0.0, added_at_run)
    per_block = max(0, int((most - one) / (run - 1)))
    return per_block, max(0, int(one - per_block))


def _sparse_target_feeds(feeds) -> tuple[int, int, dict] | None:
    """(target positions, the sparse point's count, the feeds with only that many targets) for the fused LM
    head + loss's second point (1/SPARSE_TARGET_SHARE of the targets); None without target weights or targets
    to thin."""
    weights = feeds.get(TARGET_WEIGHTS)
    if weights is None:
        return None
    flat = np.asarray(weights).reshape(-1)
    at = np.flatnonzero(flat)
    full = len(at)
    sparse = max(1, full // SPARSE_TARGET_SHARE)
    if full <= sparse:
        return None
    few = np.zeros_like(flat)
    few[at[:sparse]] = flat[at[:sparse]]
    return full, sparse, {**feeds, TARGET_WEIGHTS: few.reshape(np.shape(weights))}


def _with_sparse_targets(cost: BlockCost, backend, spec, feeds, every: int) -> BlockCost:
    """The fused LM head + loss's cost with its second point: the peak with only 1/SPARSE_TARGET_SHARE
    of the micro-batch's target positions targets (`BlockCost.workspace_at_targets`). The loss
    computes logits for target rows only (`runtime.engines.lm_loss`), so instruction data whose
    answers are a few dozen of 128 positions peaks lower (SmolLM2 int4: ~27 MiB below every position
    a target, in a worker). What the fewer targets save is `every` (the lowest of TARGET_PEAK_REPEATS
    peaks with every position a target, `measure_block`) less the highest of as many with few: a saving
    measured low, never high, so the line stays on or above a run's peak."""
    thinned = _sparse_target_feeds(feeds)
    if thinned is None:
        return cost
    full, sparse, sparse_feeds = thinned
    fewer = max(peak_workspace(backend, spec, sparse_feeds) for _ in range(TARGET_PEAK_REPEATS))
    saved = max(0, every - fewer)
    return replace(cost, target_positions=full, sparse_target_positions=sparse,
                   sparse_workspace_bytes=max(0, cost.workspace_bytes - saved))


def _fresh_pair_points(cost: BlockCost, builds: FreshProcesses, graph: Graph, i: int, feeds) -> BlockCost:
    """MNN's fused LM head + loss (blocks i, i + 1) with both its points (every position a target, and
    1/SPARSE_TARGET_SHARE of them: `_with_sparse_targets`) measured as a stage of the pair peaks in a fresh
    child (`builds`, `fresh_peaks`: the highest of FRESH_PEAK_REPEATS, two where they agree), as the keep and
    per-block lines are. The pair's first run in this process (what was charged before) takes whatever free
    heap the profile's earlier runs left, and moves with it: the same llama1b head read 39.4 and 46.9 MiB at 15
    targets in two profiles (h152), gemma3's 31.7 and 34.0 at 31 (h154), while fresh children of one profile
    agree within 0.1 (gemma3: 41.5 / 42.1 / 52.0 MiB at 15 / 31 / 127 targets, the first run here 48.4 at 127)
    and a worker's fused forward rises 37-39 MiB above a level that itself creeps ~8-10 MiB in its first two steps
    (the logits chunks' free heap, h154): charged at the warm figure, gemma3's head stage read 0.977-0.992 of its
    plan, llama1b's 0.99-1.00 (benchmarks/MEMORY_NOTES.md, helper h158)."""
    def peak(at_feeds) -> int:
        return max(fresh_peaks(builds, graph, at_feeds, i, [2], None, FRESH_PEAK_REPEATS)[0])

    cost = replace(cost, workspace_bytes=peak(feeds))
    thinned = _sparse_target_feeds(feeds)
    if thinned is None:
        return cost
    full, sparse, sparse_feeds = thinned
    return replace(cost, target_positions=full, sparse_target_positions=sparse,
                   sparse_workspace_bytes=min(peak(sparse_feeds), cost.workspace_bytes))


def _most_repeated(graph: Graph, kinds: dict[str, Block]) -> Block:
    """The first block of the kind the graph has most of (at a tie, the most flops)."""
    count: dict[str, int] = {}
    for b in graph.blocks:
        count[block_signature(b)] = count.get(block_signature(b), 0) + 1
    return max(kinds.values(), key=lambda b: (count[block_signature(b)], b.flops))


def _further_block_line(peaks: list[int]) -> tuple[int, int]:
    """(what each further block adds, the intercept) of the peaks of stages of 1, 2 (, 3) blocks of
    a kind: the larger of the last step and the mean step (`measure_block`)."""
    most = peaks[-1]
    stacked = max(0, most - peaks[-2], (most - peaks[0]) // (len(peaks) - 1))
    return stacked, max(0, most - len(peaks) * stacked)


def _per_block_backward(cost: BlockCost) -> str:
    return "" if cost.per_block_backward_s is None else f", per block {cost.per_block_backward_s * 1e3:.1f}"


def _memory_parts(cost: BlockCost) -> str:
    stacked = "" if cost.stacked_bytes is None else f"{cost.stacked_bytes / 2**20:.1f} per further block, "
    if cost.per_block_workspace_bytes is not None:
        further = ("" if cost.per_block_stacked_bytes is None
                   else f", {cost.per_block_stacked_bytes / 2**20:.1f} per further block")
        beside = "" if cost.per_block_summed_bytes is None else " (a worker's second step, beside its gradient sum)"
        stacked += f"recomputed per block {cost.per_block_workspace_bytes / 2**20:.1f}{further}{beside}; "
    if cost.per_block_kept_once_bytes is not None:
        stacked += (f"a further micro-batch per block: {(cost.per_block_kept_bytes or 0) / 2**20:.1f} a block, "
                    f"{cost.per_block_kept_once_bytes / 2**20:.1f} once a stage; ")
    engine = "" if not cost.engine_bytes else f", engine {cost.engine_bytes / 2**20:.1f}"
    if cost.engine_once_bytes is not None:
        engine += f" a block + {cost.engine_once_bytes / 2**20:.1f} once a stage"
    targets = ("" if cost.sparse_workspace_bytes is None else
               f", {cost.sparse_workspace_bytes / 2**20:.1f} with {cost.sparse_target_positions} of its "
               f"{cost.target_positions} target positions targets")
    return f"{stacked}{cost.kept / 2**20:.1f} per further micro-batch kept{engine}{targets}"


def profile_device(graph: Graph, name: str, backends: Sequence[str] = DEFAULT_BACKENDS, reps: int = 3,
                   progress: Progress | None = None, memory_bytes: int | None = None,
                   attention: bool = True, seed: int = 0, fresh: bool = True) -> DeviceProfile:
    """Profile every distinct block kind of `graph` on each requested backend that runs here.

    `memory_bytes` overrides the measured MemAvailable (a `--memory` flag); `attention=False`
    skips the per-head curves. `progress` receives one line per measured item. `fresh` (the
    default): the engine's start-up and each repeated kind's per-layer lines (keeping and per
    block) are measured as a worker runs, in fresh child interpreters (`runtime.profiling.fresh`), and
    on every engine each kind's engine build (`BlockCost.engine_bytes`: a child per kind);
    False: in this process, as before (warm: a fresh PyTorch worker outgrew those lines)."""
    if not graph.blocks:
        raise ValueError(f"graph {graph.name!r} has no blocks; run the block-finding pass first")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    # read before the blocks run: how long a stage `_summed_line` measures
    available = memory_bytes if memory_bytes is not None else memory_available_bytes()
    overhead = runtime_overhead_bytes()
    present, skipped = present_backends(backends)
    for b, why in skipped.items():
        say(f"skip {b}: {why}")
    engines = {}  # engine -> the memory its import adds to the runtime, measured once per engine
    setup_peaks: dict[str, int] = {}  # engine -> its import's peak above the runtime (the set-up's floor)
    start_up: dict[str, int] = {}  # engine -> what its first training run adds once (`start_up_bytes`)
    caches_start_up: dict[str, int] = {}  # engine -> the part of that only a stage keeping per-op caches pays
    # engine -> what a worker holds of that start-up beyond its engine's term (`start_up_and_held`; the
    # start-up itself where measured in this process): what the engine is charged
    held_start_up: dict[str, int] = {}
    for backend in present:
        if backend.engine not in engines:
            figures = engine_figures(backend.engine, overhead)
            engines[backend.engine] = figures.overhead_bytes
            setup_peaks[backend.engine] = figures.setup_peak_bytes
            if engines[backend.engine]:
                say(f"{backend.engine}: its import adds {engines[backend.engine] / 2**20:.0f} MiB to the runtime "
                    f"(peaking {figures.setup_peak_bytes / 2**20:.0f} MiB above it)")
    feeds = synthetic_feeds(graph, seed)
    kinds = distinct_blocks(graph)
    threads_before = K.get_threads()
    profiles = []
    # Each memory reading collects garbage first (`runtime.procfs`'s peaks: ~200 a profile), and each
    # collection walked every object this process held before the profile (torch, the runtime, the
    # planner, a test runner's: ~170k objects, ~0.1 s of CPU each; helpers h92, h93): they are frozen out
    # of the collections while the profile runs, after one collection of what is garbage now.
    gc.collect()
    gc.freeze()
    # one fork server per engine for every backend's fresh children (`ForkServers`: a thread variant's
    # children start from the same imports-only heap; torch's import paid once a profile, not once a backend)
    try:
        with ForkServers() as servers:
            for backend in present:
                costs: dict[str, BlockCost] = {}
                curves: dict[str, AttentionCurve] = {}
                # A first run of the cheapest block takes the engine's one-time, process-wide start-up
                # (torch: ~40 MiB of lazily built kernels, autograd's engine and threads) out of the
                # first block's workspace: every worker pays it once, beside its import, so it is the
                # engine's overhead (`start_up_bytes`), not a block's.
                cheapest = min(kinds.values(), key=lambda b: (b.flops, b.params_bytes))
                once = start_up_bytes(backend, stage_spec(graph, cheapest.index, cheapest.index), feeds)
                # and what the model's most repeated kind (a decoder layer) first builds beyond it, kept and
                # recomputed per block: torch's kernels and buffers of the layer's ops, held for the process's
                # life (a fresh process running SmolLM2 int4 LoRA layers 1 x 128 holds 46 MiB after its first
                # step keeping, 83 per block, whether 3 or 17 layers; the embeddings' first run 2)
                layer = _most_repeated(graph, kinds)
                by_mode = {}
                if layer.index != cheapest.index:
                    by_mode = {activations: start_up_bytes(backend, stage_spec(graph, layer.index, layer.index), feeds,
                                                           activations) for activations in ("keep", "per-block")}
                    once += sum(by_mode.values())
                with contextlib.ExitStack() as stack:
                    # PyTorch's only: MNN's start-up stays measured here (measured fresh, its start-up came out a
                    # noise-level 1.6 MiB where it has none); its keep and per-block lines are measured fresh in
                    # `builds` (`measure_block`)
                    fresh_here = fresh and backend.engine == "torch"
                    children = stack.enter_context(FreshProcesses(backend, servers=servers)) if fresh_here else None
                    if children is not None:
                        # Those runs warm this process (its later figures are repeats); what a worker pays
                        # is measured the same way in fresh children: here it moved 65-81 MiB between
                        # profiles of SmolLM2 int4 layers on torch (the heap this process had left by then).
                        runs = [("start_up", cheapest.index, cheapest.index, None)]
                        if layer.index != cheapest.index:
                            runs += [("start_up", layer.index, layer.index, a) for a in ("keep", "per-block")]
                        # what the children pay again (taken off their peaks), and what a worker holds of it beyond
                        # its engine's term: not the library pages those forked children map again (h120)
                        once, held = start_up_and_held(children, graph, feeds, runs, FRESH_PEAK_REPEATS)
                    else:
                        held = once
                    # every engine's build measured as a worker builds it, first in a fresh child (`_engine_build`)
                    builds = children if children is not None or not fresh else \
                        stack.enter_context(FreshProcesses(backend, servers=servers))
                    if once >= START_UP_NOISE_BYTES:
                        start_up[backend.engine] = max(start_up.get(backend.engine, 0), once)
                        held_start_up[backend.engine] = max(held_start_up.get(backend.engine, 0), held)
                        if backend.engine == "mnn":
                            # MNN's keeping run's first-use heap, which a stage recomputing per block never
                            # pays (BackendProfile.caches_start_up_bytes; PyTorch's kernels are process-wide)
                            caches_start_up[backend.engine] = max(caches_start_up.get(backend.engine, 0),
                                                                  min(once, by_mode.get("keep", 0)))
                    for sig, block in kinds.items():
                        # the start-up a stage recomputing per block is charged (`planner.cluster.runtime_bytes`),
                        # which a fresh child's first run pays again: taken off the fresh lines' peaks
                        charged = start_up.get(backend.engine, 0) - caches_start_up.get(backend.engine, 0)
                        cost = measure_block(backend, graph, block, feeds, reps, children, charged, builds,
                                             start_up.get(backend.engine, 0), available)
                        costs[sig] = cost
                        say(f"{backend.name} {block.name}: forward {cost.forward_s * 1e3:.1f} ms, backward "
                            f"{cost.backward_s * 1e3:.1f} ms (recompute {cost.recompute_s * 1e3:.1f}"
                            f"{_per_block_backward(cost)}), workspace "
                            f"{cost.workspace_bytes / 2**20:.1f} MiB ({_memory_parts(cost)}) "
                            f"[{time.perf_counter() - started:.1f} s]")
                if attention:
                    for sig, block in kinds.items():
                        if block.attention is None:  # no attention the lowering could place: not split
                            continue
                        batch, seq, hidden = graph.values[block.inputs[0]].shape
                        form = attention_form(graph, block)
                        curve = attention_curve(backend, batch, seq, hidden, form.units, block.head_size,
                                                block_mask(graph, block, feeds), reps, form=form)
                        curves[sig] = curve
                        unit = "heads" if form.group == 1 else "key/value groups"
                        say(f"{backend.name} {block.name} attention 1..{form.units} {unit}: "
                            f"{curve.seconds[0] * 1e3:.1f} .. {curve.seconds[-1] * 1e3:.1f} ms "
                            f"[{time.perf_counter() - started:.1f} s]")
                native = engine_update_rates(backend, stage_spec(graph, cheapest.index, cheapest.index))
                for optimizer, rate in native.items():
                    say(f"{backend.name}: its own {optimizer} step, {rate * 2**20 * 1e3:.2f} ms per MiB of weights")
                profiles.append(BackendProfile(backend.name, costs, curves, engines[backend.engine], native,
                                               fresh and backend.engine == "torch"))
        # an engine's start-up shows on the first of its backends to run here: charged to them all
        profiles = [replace(p, engine_overhead_bytes=p.engine_overhead_bytes + held_start_up.get(b.engine, 0),
                            caches_start_up_bytes=caches_start_up.get(b.engine, 0),
                            engine_setup_peak_bytes=setup_peaks.get(b.engine, 0))
                    for p, b in zip(profiles, present)]
        for engine, extra in start_up.items():
            if extra:
                held = held_start_up.get(engine, extra)
                beyond = "" if held == extra else f", {held / 2**20:.1f} MiB of it beyond the pages its import's term maps"
                say(f"{engine}: its first training run adds {extra / 2**20:.0f} MiB once (kernels and threads "
                    f"built on first use{beyond}), charged with its engine")
        children = measure_split_children(graph, kinds, feeds, present, say, started) if attention else {}
        extra = (measure_split_extra_costs(graph, kinds, feeds, present, profiles, reps, say, started)
                 if attention else {})
    finally:
        K.set_threads(threads_before)
        gc.unfreeze()
    return DeviceProfile(name, graph.name, graph.batch, graph.seq, tuple(profiles), int(available), overhead,
                         update_rates(), children, extra, accumulate_rate())
