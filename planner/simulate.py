"""A costed timeline of a schedule: replay the per-stage action lists with measured durations.

`ir.verify.dry_run` runs a plan in lockstep unit ticks to prove it cannot deadlock; this module
answers the planner's other question, how long a step takes and where the time goes, by giving
every action the duration the cost model predicts (`ir.partition.StageCost`):

* F, B and UPDATE occupy their stage for `forward_s`, `backward_s`, `update_s` (a schedule that
  splits backwards gives W `StageCost.weight_pass_s` of the backward and B the rest); a stage runs its
  list strictly in order, one action at a time, as the executor does.
* A SEND is asynchronous for the sender (it costs the stage no time: the transport queues the
  bytes and its I/O thread moves them while the stage computes), but the transfer occupies its
  *directed link* for `send_act_s` / `send_grad_s` of the sending stage. A link carries one
  transfer at a time, in the order the sender posted them, so back-to-back sends queue behind
  each other; the two directions of a pair of stages are independent links.
* A RECV completes when its transfer has fully arrived; the stage waits until then.
* FREE is instant.

Each stage's timeline depends on the others only through arrival times, and each directed link
has exactly one sender that posts in list order, so the result does not depend on the order in
which the simulator happens to advance the stages: it is the unique earliest-start schedule.

`steps` replays the lists that many times back to back (the executor runs the same lists each
step), so a stage may start its next step while later stages still drain the previous one.

Memory: `peak_memory_bytes[s]` is `StageCost.memory_bytes` (taken as the static part: weights,
optimizer state, gradients, engine workspace) plus `activation_bytes[s]` for every micro-batch
whose forward has started on stage s and whose FREE has not run yet: what the engine stashes for
that micro-batch's backward. Transient buffers (a received activation before its F, a gradient
between its RECV and B) and older weight versions of asynchronous schedules are not added; put
them into the static part if they matter.
"""
from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ir.partition import StageCost
from ir.plan import SEND_FOR_RECV, ActionKind, Schedule

_F, _B, _W, _UPDATE, _FREE = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.UPDATE, ActionKind.FREE


@dataclass(frozen=True)
class Event:
    """One interval of the timeline, in seconds from the start of the run.

    `stage` ran the action (for a transfer: the sender); `link` is `(from, to)` for a transfer,
    which occupies that directed link from `start_s` to `end_s`, and None for work on a stage."""

    stage: int
    name: str            # the action's token, e.g. "s1.F.m3" or "s0.SEND_ACT.m3>s1"
    kind: str            # the ActionKind value
    microbatch: int | None
    step: int
    start_s: float
    end_s: float
    link: tuple[int, int] | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Simulation:
    schedule: str
    stages: int
    microbatches: int
    steps: int
    makespan_s: float
    per_stage_busy_s: tuple[float, ...]          # F + B + W + UPDATE seconds per stage, all steps
    peak_in_flight: tuple[int, ...]              # most micro-batches between F and FREE, per stage
    peak_memory_bytes: tuple[int, ...]           # static part + in-flight activations, per stage
    events: tuple[Event, ...]                    # stage work and link transfers, by start time

    @property
    def step_s(self) -> float:
        """Seconds per step: the makespan divided by the number of replayed steps."""
        return self.makespan_s / self.steps

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle: 1 - busy compute / (stages x makespan)."""
        if self.makespan_s <= 0:
            return 0.0
        return 1.0 - sum(self.per_stage_busy_s) / (self.stages * self.makespan_s)

    def throughput_samples_per_s(self, batch: int) -> float:
        """Samples per second when each micro-batch holds `batch` rows (the lowered batch size)."""
        if self.makespan_s <= 0:
            return float("inf")
        return batch * self.microbatches * self.steps / self.makespan_s


def _check_costs(schedule: Schedule, costs: Sequence[StageCost], activation_bytes: Sequence[int]) -> None:
    if len(costs) != schedule.stages:
        raise ValueError(f"schedule {schedule.name!r} has {schedule.stages} stages but {len(costs)} stage costs")
    for s, c in enumerate(costs):
        if c.stage != s:
            raise ValueError(f"stage costs must be in stage order: position {s} holds the cost of stage {c.stage}")
        for field_name in ("forward_s", "backward_s", "update_s", "send_act_s", "send_grad_s", "weight_grad_s"):
            v = getattr(c, field_name)
            if v is None and field_name == "weight_grad_s":
                continue
            if not v >= 0:  # also refuses NaN
                raise ValueError(f"stage {s}: {field_name} must be a non-negative number of seconds, got {v!r}")
        if c.weight_grad_s is not None and c.weight_grad_s > c.backward_s:
            raise ValueError(f"stage {s}: weight_grad_s {c.weight_grad_s!r} is part of backward_s and cannot exceed "
                             f"it ({c.backward_s!r})")
    if len(activation_bytes) != schedule.stages:
        raise ValueError(f"activation_bytes has {len(activation_bytes)} entries for {schedule.stages} stages")


def simulate(schedule: Schedule, costs: Sequence[StageCost], steps: int = 1,
             activation_bytes: Sequence[int] | None = None) -> Simulation:
    """Replay `schedule` `steps` times on a costed timeline; raise ValueError naming the stuck
    actions when no stage can move while actions remain (a receive whose send never runs).

    `costs[s]` is stage s's StageCost; `activation_bytes[s]` is what one micro-batch keeps on
    stage s from its forward to its FREE (default 0: peak memory is then `memory_bytes`)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    p = schedule.stages
    act_bytes = [0] * p if activation_bytes is None else [int(b) for b in activation_bytes]
    _check_costs(schedule, costs, act_bytes)

    lists = schedule.actions
    n = [len(row) for row in lists]
    ptr = [0] * p                    # position in the replay: step * len(row) + index
    clock = [0.0] * p                # when the stage is next free
    busy = [0.0] * p
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    # (send kind, from, to, micro-batch, step) -> arrival times, in posting order
    arrivals: dict[tuple, deque] = defaultdict(deque)
    live: list[set] = [set() for _ in range(p)]
    peak_live = [0] * p
    events: list[Event] = []

    split = schedule.splits_backward

    def duration(kind: ActionKind, c: StageCost) -> float:
        if kind is _W:
            return c.weight_pass_s
        if kind is _B and split:
            return max(0.0, c.backward_s - c.weight_pass_s)
        return {_F: c.forward_s, _B: c.backward_s, _UPDATE: c.update_s}[kind]

    progress = True
    while progress:
        progress = False
        for s in range(p):
            c = costs[s]
            while ptr[s] < n[s] * steps:
                step, i = divmod(ptr[s], n[s])
                a = lists[s][i]
                if a.kind.is_recv:
                    key = (SEND_FOR_RECV[a.kind], a.peer, s, a.microbatch, step)
                    if not arrivals[key]:
                        break  # its transfer has not been posted yet; another stage must move first
                    clock[s] = max(clock[s], arrivals[key].popleft())
                elif a.kind.is_send:
                    link = (s, a.peer)
                    d = c.send_act_s if a.kind is ActionKind.SEND_ACT else c.send_grad_s
                    start = max(clock[s], link_free[link])
                    link_free[link] = start + d
                    arrivals[(a.kind, s, a.peer, a.microbatch, step)].append(start + d)
                    events.append(Event(s, str(a), a.kind.value, a.microbatch, step, start, start + d, link))
                elif a.kind in (_F, _B, _W, _UPDATE):
                    d = duration(a.kind, c)
                    start = clock[s]
                    clock[s] = start + d
                    busy[s] += d
                    events.append(Event(s, str(a), a.kind.value, a.microbatch, step, start, start + d))
                    if a.kind is _F:
                        live[s].add((step, a.microbatch))
                        peak_live[s] = max(peak_live[s], len(live[s]))
                elif a.kind is _FREE:
                    live[s].discard((step, a.microbatch))
                ptr[s] += 1
                progress = True

    stuck = [s for s in range(p) if ptr[s] < n[s] * steps]
    if stuck:
        waits = []
        for s in stuck:
            step, i = divmod(ptr[s], n[s])
            a = lists[s][i]
            send = f"s{a.peer}.{SEND_FOR_RECV[a.kind].value}.m{a.microbatch}>s{s}"
            waits.append(f"stage {s} waits at {a} (step {step}, t={clock[s]:.6g} s) for {send}, which never runs")
        raise ValueError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(waits))

    makespan = max([clock[s] for s in range(p)] + [e.end_s for e in events], default=0.0)
    events.sort(key=lambda e: (e.start_s, e.link is not None, e.stage))
    peak_mem = tuple(int(costs[s].memory_bytes) + peak_live[s] * act_bytes[s] for s in range(p))
    return Simulation(schedule.name, p, schedule.microbatches, steps, makespan, tuple(busy),
                      tuple(peak_live), peak_mem, tuple(events))


# Chrome trace ---------------------------------------------------------------------------------

_CATEGORY = {"F": "compute", "B": "compute", "W": "compute", "UPDATE": "update", "SEND_ACT": "transfer", "SEND_GRAD": "transfer"}


def chrome_trace(sim: Simulation, devices: Sequence[str] | None = None) -> dict:
    """The timeline in Chrome's trace event format (open it in https://ui.perfetto.dev or
    chrome://tracing): one track (thread) per stage, named `DEVICE (stage s)` when `devices` (one
    name per stage) are given, then one per directed link that carried a transfer; every action is
    a complete ("X") event with microseconds in `ts` and `dur`."""
    if devices is not None and len(devices) != sim.stages:
        raise ValueError(f"{len(devices)} device names for {sim.stages} stages")

    def stage_label(s: int) -> str:
        return f"stage {s}" if devices is None else f"{devices[s]} (stage {s})"

    def link_label(a: int, b: int) -> str:
        return f"link s{a} -> s{b}" if devices is None else f"link {devices[a]} -> {devices[b]}"

    links = sorted({e.link for e in sim.events if e.link is not None})
    tid = {("stage", s): s for s in range(sim.stages)}
    tid.update({("link", link): sim.stages + k for k, link in enumerate(links)})
    pid = 0
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"{sim.schedule}: {sim.stages} stages x {sim.microbatches} micro-batches"}}]
    for (what, key), t in sorted(tid.items(), key=lambda kv: kv[1]):
        label = stage_label(key) if what == "stage" else link_label(*key)
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": label}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": t, "args": {"sort_index": t}})
    spans = []
    for e in sim.events:
        track = ("link", e.link) if e.link is not None else ("stage", e.stage)
        spans.append({
            "name": e.name, "cat": _CATEGORY[e.kind], "ph": "X", "pid": pid, "tid": tid[track],
            "ts": e.start_s * 1e6, "dur": e.duration_s * 1e6,
            "args": {"stage": e.stage, "kind": e.kind, "microbatch": e.microbatch, "step": e.step},
        })
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}


def write_chrome_trace(sim: Simulation, path: str | Path, devices: Sequence[str] | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(sim, devices)) + "\n")
    return path
