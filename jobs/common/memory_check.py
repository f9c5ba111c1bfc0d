"""Every run says what it used (DESIGN: "a plan's memory is a promise"): each device's measured peak
beside its planned figure and its budget, in MiB, at the end of `train PLAN`, `train-pipeline` and
`train-local`; a device over its budget, or over a plan's figure by more than OVER_PLAN_SHARE, is a
warning and a `memory_over` event in the metrics document (the graph-derived figure of a run planned
in memory is shown, not held against it).

Planned figures: a plan's own (`train PLAN`); for runs planned in memory (`train-pipeline`,
`train-local`), the planner's memory model for the run's cuts on the graph-derived profile
(`planner.memory_defaults`), as `confidant estimate` gives them. Budgets: the plan's; for a run with
none, the memory this machine had available when the run started (`train-local`: its MemAvailable
plus the run's own resident memory) or none.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

from ir.documents import activations_mode
from ir.graph import Graph, block_signature
from jobs.common.metrics import DeviceFigures, TrainingMetrics
from jobs.common.report import Reporter
# the memory model's modules imported with this one, not on first use: a run's set-up, read before its
# check, then holds them (imported after, they rose `train-local`'s whole life ~1 MiB above its printed
# figure on the tiny BERT, helper h117)
from planner.cluster import DeviceSpec
from planner.cost import (fused_loss_hidden_bytes, holds_base_mapped, mapped_frozen_bytes, stage_memory_bytes,
                          table_state_delta_bytes)
from planner.memory_defaults import (DEFAULT_RUNTIME_BYTES, LOSS_CHUNK_BYTES, default_profile, memory_parts,
                                     mnn_forward_kept_bytes, mnn_held_bytes, mnn_kept_bytes, torch_kept_bytes,
                                     widened_bytes)

MIB = 2 ** 20
# measured above planned by more than this share: the memory model missed something worth a warning
OVER_PLAN_SHARE = 0.10
# what a warning tells a run over its memory to do: a plan's device (its profile priced it) ...
PLANNED_ADVICE = "re-profile the device, or give it more room"
# ... and a one-device run, which no profile priced: the flags that lower it (README, "How much memory a
# device needs")
ONE_DEVICE_ADVICE = ("lower it with --lora R, --base-dtype int4 or --activations per-block, or free memory on this "
                     "machine")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def _run_profile(graph: Graph, engine: str, per_stage: Sequence[str | None], runtime: int,
                 gradient_of_each: bool = False):
    return default_profile(graph, backend=f"{engine}:cpu:t1", runtime_overhead_bytes=runtime,
                           per_block=any(a is not None and a.startswith("per-block") for a in per_stage),
                           loss_chunk_bytes=LOSS_CHUNK_BYTES, gradient_of_each=gradient_of_each)


def default_planned_bytes(graph: Graph, ranges: Sequence[tuple[int, int]], schedule: str, microbatches: int,
                          optimizer: str, update_every: int = 1, engine: str = "mnn",
                          activations: str | None | Sequence[str | None] = None,
                          base_dtype: str = "float32", frozen_mapped: bool = False) -> list[int]:
    """Each stage's memory as the planner's memory model prices `ranges` with the graph-derived
    profile on `engine` (`planner.memory_defaults.default_profile`), as the run holds it: each
    stage's `activations` (one for all or one a stage; None: the engine's default), its frozen base
    at `base_dtype` (`graph`'s constants held so) with one block of it widened at a time
    (`planner.memory_defaults.widened_bytes`, as `estimate` charges it), a fused LM head's loss a
    chunk of logits at a time (a model with none: `confidant estimate`'s figure for these cuts);
    `frozen_mapped`: the run reads its float32 frozen base mapped (`DeviceSpec.frozen_mapped`)."""
    per_stage = list(activations) if isinstance(activations, (list, tuple)) else [activations] * len(ranges)
    profile = _run_profile(graph, engine, per_stage, DEFAULT_RUNTIME_BYTES + widened_bytes(graph, base_dtype))
    return [stage_memory_bytes(graph, DeviceSpec("run", "estimate://run", profile, 2 ** 62, activations=act,
                                                 frozen_mapped=frozen_mapped),
                               a, b, k, len(ranges), schedule, microbatches, optimizer, update_every)
            for k, ((a, b), act) in enumerate(zip(ranges, per_stage))]


def step_bytes(graph: Graph, optimizer: str, engine: str = "mnn", activations: str | None = None,
               base_dtype: str = "float32", microbatches: int = 1, frozen_mapped: bool = False) -> int:
    """What training the whole of `graph` on one device adds above the model as set up (its weights,
    frozen base and engine built): the memory model's gradients, optimizer state, activations and
    workspace of one stage of `microbatches` micro-batches an update, as `default_planned_bytes` prices
    them (one micro-batch, `tasks.trainer.train_steps`' step: no gradient sum beside the backward's own
    gradients, which the workspace holds, `planner.cost.gradient_copies`), and the one block of a
    quantized base widened at a time; a block's backward holds a gradient of each of its values
    (`default_block_cost`'s `gradient_of_each`). On MNN also what its programs hold as
    `runtime.engines.mnn` runs them (`planner.memory_defaults.mnn_held_bytes`, keeping per-op caches: the
    backward's reads held into the next step), and keeping per-op caches, every value but the views
    (`planner.memory_defaults.mnn_kept_bytes`; no evaluation runs on the training engine, helper h96); on
    PyTorch keeping, the tensors autograd saves (`planner.memory_defaults.torch_kept_bytes`). A float32 base
    read mapped (`frozen_mapped`, `planner.cost.maps_frozen`): the set-up holds none of it (its pages given back
    after each block), a step one block's (`planner.cost.mapped_frozen_bytes`)."""
    profile = _run_profile(graph, engine, [activations], 0, gradient_of_each=True)
    device = DeviceSpec("run", "estimate://run", profile, 2 ** 62, activations=activations, frozen_mapped=frozen_mapped)
    parts = memory_parts(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", microbatches, optimizer)
    keeping = not (activations or "").startswith("per-block")
    held = 0
    # what the engine keeping its activations holds of a block, where the graph-derived profile charges every
    # value: MNN no buffer of a view's own (`mnn_kept_bytes`), PyTorch's autograd only the tensors its
    # backwards read (`torch_kept_bytes`: MiniLM full fine-tuning 476 / 568, 0.84, where a layer held 6.0 of
    # its 14.6 MiB of values; helper h136)
    kept_bytes = {"mnn": mnn_kept_bytes, "torch": torch_kept_bytes}.get(engine) if keeping else None
    if engine == "torch" and (activations or "keep") != "keep":
        kept_bytes = None
    if kept_bytes is not None:
        costs = profile.backends[0].blocks
        held = sum((costs[block_signature(b)].kept_bytes or 0) - kept_bytes(graph, b) for b in _cached(graph))
    # AdamW's state of a table only looked up is the rows the data looks up (`graph.lookup_rows`), not dense
    rows = table_state_delta_bytes(graph, 0, len(graph.blocks) - 1, device, optimizer)
    mapped = mapped_frozen_bytes(graph, 0, len(graph.blocks) - 1, device) if holds_base_mapped(graph, device) else 0
    return (sum(parts[k] for k in ("gradients", "optimizer", "activations", "workspace")) - held + rows + mapped
            + widened_bytes(graph, base_dtype) + (mnn_held_bytes(graph, keeping=keeping) if engine == "mnn" else 0))


def _cached(graph: Graph) -> list:
    """The blocks whose per-op caches MNN keeping holds as values (`mnn_kept_bytes`): all but a fused LM head
    and its loss, whose chunks the workspace charges."""
    return graph.blocks[:-2] if fused_loss_hidden_bytes(graph) is not None else graph.blocks


def check_memory(metrics: TrainingMetrics, planned: Mapping[str, int | None], budgets: Mapping[str, int | None],
                 reporter: Reporter, basis: str = "the plan", over_plan: bool = True,
                 advice: str = PLANNED_ADVICE) -> TrainingMetrics:
    """`metrics` with each device's planned and budget figures filled in (by device name) and a
    `memory_over` event per device over its budget or (`over_plan`: the figures are a plan's promise,
    not the graph-derived guess of a run planned in memory) its plan; prints one line per device and
    a warning per overrun, ending in `advice`. `basis` says where the planned figures come from."""
    devices, events = [], []
    step = metrics.steps[-1].step if metrics.steps else 0
    for d in metrics.devices:
        d = dataclasses.replace(d, planned_bytes=planned.get(d.name), budget_bytes=budgets.get(d.name))
        devices.append(d)
        over = memory_overrun(d)
        if over == "plan" and not over_plan:
            over = None
        if over is not None:
            events.append({"event": "memory_over", "at": time.time(), "step": step, "device": d.name,
                           "peak_rss_bytes": d.peak_rss_bytes, "planned_bytes": d.planned_bytes,
                           "budget_bytes": d.budget_bytes, "over": over})
    reporter.note(f"memory per device, MiB (measured peak / planned by {basis} / budget):")
    for d in devices:
        reporter.note(f"  {d.name}: {_mib(d.peak_rss_bytes)} / {_mib(d.planned_bytes)} / {_mib(d.budget_bytes)}")
    for e in events:
        what = (f"its {_mib(e['budget_bytes'])} MiB budget" if e["over"] == "budget"
                else f"the {_mib(e['planned_bytes'])} MiB planned by {basis}")
        # planned over the budget too: the run was known not to fit, and the memory model missed nothing
        foreseen = e["over"] == "budget" and (e["planned_bytes"] or 0) > e["budget_bytes"]
        reporter.note(f"warning: {e['device']} used {_mib(e['peak_rss_bytes'])} MiB, over {what}"
                      + (f" (planned {_mib(e['planned_bytes'])} MiB)" if e["over"] == "budget" else "")
                      + ("; planned over it too" if foreseen else "; the memory model missed part of it")
                      + f": {advice}")
    return dataclasses.replace(metrics, devices=tuple(devices), events=tuple(metrics.events) + tuple(events))


def memory_overrun(d: DeviceFigures) -> str | None:
    """"budget" when the device's peak passed its budget, "plan" when it passed its planned figure by
    more than OVER_PLAN_SHARE (and had no budget it passed), else None."""
    if d.peak_rss_bytes is None:
        return None
    if d.budget_bytes is not None and d.peak_rss_bytes > d.budget_bytes:
        return "budget"
    if d.planned_bytes is not None and d.peak_rss_bytes > d.planned_bytes * (1 + OVER_PLAN_SHARE):
        return "plan"
    return None


def machine_room_bytes() -> int | None:
    """What this process can grow to now: its resident memory plus the machine's MemAvailable (the
    budget of a one-device run, which no plan gave one); None where /proc does not say."""
    from runtime.procfs import mem_available_bytes, rss_bytes

    available, own = mem_available_bytes(), rss_bytes()
    return None if available is None or own is None else available + own


def local_check(metrics: TrainingMetrics, graph: Graph, optimizer: str, engine: str, room: int | None,
                reporter: Reporter, activations: str | None = None, base_dtype: str = "float32",
                set_up_bytes: int | None = None, evaluation_bytes: int | None = None,
                microbatches: int = 1, forward_kept_bytes: int | None = None,
                frozen_mapped: bool = False) -> TrainingMetrics:
    """`check_memory` for a one-device run (`train-local`), its budget the room the machine had when
    the run started. Its planned figure: the run's own resident memory when its steps began
    (`set_up_bytes`: the process, the model and engine built, what an evaluation before left) with
    what the memory model says a step of `microbatches` micro-batches adds on top (`step_bytes`: the whole
    graph as one stage, with the run's `activations` and frozen base), or what the evaluation before training
    rose above its start where that is larger (`evaluation_bytes`, measured: its generation, which no term
    models, run beside no engine; the evaluation after training runs the same from the set-up, helper h96;
    the larger of the two's rises, helper h101). On MNN keeping its per-op caches, `forward_kept_bytes`: what a
    forward on the training engine measured it held above the set-up (its evaluation before training, the
    step's shape), charged in place of the step's own figure for it (`mnn_forward_kept_bytes`): it holds
    MNN's buffer pool too, its op temporaries kept for the process (the first forward's: a MiniLM-shaped layer
    at 8 x 32 4.5-5.5 MiB, the tiny BERT at 8 x 64 1.0, given back only by `mnn_kernels.release_memory`),
    which no graph term charges, and a small layer's caches MNN holds above `mnn_kept_bytes` (the tiny BERT's
    5.31 against 4.88 MiB; helper h137).
    No profile measured this process's set-up, and the graph's shapes cannot tell it (SmolLM2 int4: 281-327
    MiB held against the model's 164 for a worker's); without it, the memory model's whole figure
    (`default_planned_bytes`)."""
    if set_up_bytes is None:
        planned = default_planned_bytes(graph, [(0, len(graph.blocks) - 1)], "1f1b-flush", 1, optimizer, 1, engine,
                                        activations, base_dtype, frozen_mapped)[0]
        basis = "the memory model"
    else:
        step = step_bytes(graph, optimizer, engine, activations, base_dtype, microbatches, frozen_mapped)
        if forward_kept_bytes is not None and engine == "mnn" and activations_mode(activations)[0] != "per-block":
            step += forward_kept_bytes - mnn_forward_kept_bytes(graph, _cached(graph))
        planned = set_up_bytes + max(step, evaluation_bytes or 0)
        basis = ("the set-up as measured + a step by the memory model" if step >= (evaluation_bytes or 0) else
                 "the set-up + an evaluation as measured")
        if engine != "mnn" or activations_mode(activations)[1] > 0:
            # The step charge is measured within 0.95-1.00 of the run on MNN per block (SmolLM2 int4 and float32,
            # with and without an evaluation, helpers h87-h91) and keeping its per-op caches (SmolLM2 int4 1733
            # against 1799, float32 2115 against 2154 with the evaluation before the engine is built: helper
            # h114; 1722 against 1783 without one, helper h97). There the whole figure was the larger and read
            # 0.92 (int4: 1887) only by charging every value the caches hold, the views included, which MNN
            # holds no buffer of (`mnn_kept_bytes`: 304 MiB of SmolLM2's 30 layers), where its other terms charge
            # a worker's start-up for this process's measured set-up. PyTorch's runs go far over the step
            # (per block: SmolLM2 int4 891 against 616, the tiny chat Llama 408-415 against 319-350; keeping,
            # the tiny model 371 against 321: its first backward's growth above the set-up, not modelled), and
            # MNN's hybrids were not measured: those runs are charged the memory model's whole figure where it
            # is larger.
            whole = default_planned_bytes(graph, [(0, len(graph.blocks) - 1)], "1f1b-flush", 1, optimizer, 1,
                                          engine, activations, base_dtype, frozen_mapped)[0]
            if whole > planned:
                planned, basis = whole, "the memory model"
    name = metrics.devices[0].name
    return check_memory(metrics, {name: planned}, {name: room}, reporter, basis, over_plan=False,
                        advice=ONE_DEVICE_ADVICE)
