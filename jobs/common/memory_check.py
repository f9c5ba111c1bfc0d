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

from ir.graph import Graph
from jobs.common.metrics import DeviceFigures, TrainingMetrics
from jobs.common.report import Reporter

MIB = 2 ** 20
# measured above planned by more than this share: the memory model missed something worth a warning
OVER_PLAN_SHARE = 0.10


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def default_planned_bytes(graph: Graph, ranges: Sequence[tuple[int, int]], schedule: str, microbatches: int,
                          optimizer: str, update_every: int = 1, engine: str = "mnn") -> list[int]:
    """Each stage's memory as the planner's memory model prices `ranges` with the graph-derived
    profile on `engine` (what `confidant estimate` gives for these cuts)."""
    from planner.cluster import DeviceSpec
    from planner.cost import stage_memory_bytes
    from planner.memory_defaults import default_profile

    profile = default_profile(graph, backend=f"{engine}:cpu:t1")
    device = DeviceSpec("run", "estimate://run", profile, 2 ** 62)
    return [stage_memory_bytes(graph, device, a, b, k, len(ranges), schedule, microbatches, optimizer, update_every)
            for k, (a, b) in enumerate(ranges)]


def check_memory(metrics: TrainingMetrics, planned: Mapping[str, int | None], budgets: Mapping[str, int | None],
                 reporter: Reporter, basis: str = "the plan", over_plan: bool = True) -> TrainingMetrics:
    """`metrics` with each device's planned and budget figures filled in (by device name) and a
    `memory_over` event per device over its budget or (`over_plan`: the figures are a plan's promise,
    not the graph-derived guess of a run planned in memory) its plan; prints one line per device and
    a warning per overrun. `basis` says where the planned figures come from."""
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
        reporter.note(f"warning: {e['device']} used {_mib(e['peak_rss_bytes'])} MiB, over {what}"
                      + (f" (planned {_mib(e['planned_bytes'])} MiB)" if e["over"] == "budget" else "")
                      + "; the memory model missed part of it: re-profile the device, or give it more room")
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
                reporter: Reporter) -> TrainingMetrics:
    """`check_memory` for a one-device run (`train-local`): the whole graph as one stage of one
    micro-batch, its budget the room the machine had when the run started."""
    planned = default_planned_bytes(graph, [(0, len(graph.blocks) - 1)], "1f1b-flush", 1, optimizer, 1, engine)[0]
    name = metrics.devices[0].name
    return check_memory(metrics, {name: planned}, {name: room}, reporter, "the memory model", over_plan=False)
