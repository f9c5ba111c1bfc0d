"""Pipeline schedules as pure functions that write action lists; the executor only interprets them.

Each schedule function writes compute-only actions (F, B, UPDATE) per stage. Two lowering passes
then make the plan complete: `add_communication` puts the activation and gradient transfers
around each compute, `add_frees` releases each micro-batch's stashed activations after its
backward. Keeping communication and memory out of the schedule functions means GPipe, 1F1B-flush
and asynchronous 1F1B differ only in the order of their computes, and one executor loop runs them
all. `make_schedule` chains function, passes and `verify_plan`, so every plan it hands out has
been checked and dry-run.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ir.plan import Action, ActionKind, Schedule, check_schedule_name
from ir.verify import verify_plan

F, B, UPDATE = ActionKind.F, ActionKind.B, ActionKind.UPDATE


def _check_args(stages: int, microbatches: int, update_every: int = 1) -> None:
    for name, v in (("stages", stages), ("microbatches", microbatches), ("update_every", update_every)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _one_f_one_b_order(stages: int, microbatches: int, s: int) -> list[tuple[ActionKind, int]]:
    # Warm-up: stage s runs p-s-1 forwards before its first backward, exactly the number of
    # micro-batches still travelling down and back up through the stages after it, so that its
    # first backward's gradient arrives just as its steady state wants it. The steady state then
    # alternates one forward and one backward, keeping min(p-s, m) micro-batches in flight; the
    # drain runs the remaining backwards.
    warmup = min(stages - s - 1, microbatches)
    order = [(F, mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(F, warmup + i), (B, i)]
    order += [(B, mb) for mb in range(microbatches - warmup, microbatches)]
    return order


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards, then one UPDATE per stage.

    Backwards run in micro-batch order (0 first), the same first-in first-out order 1F1B uses, so
    every schedule frees activations and receives gradients in the same order; with equal stage
    times the makespan is the same as in reverse order.
    """
    _check_args(stages, microbatches)
    actions = []
    for s in range(stages):
        row = [Action(F, s, mb) for mb in range(microbatches)]
        row += [Action(B, s, mb) for mb in range(microbatches)]
        row.append(Action(UPDATE, s))
        actions.append(tuple(row))
    return Schedule("gpipe", stages, microbatches, tuple(actions), (1,) * stages, microbatches)


def one_f_one_b_flush(stages: int, microbatches: int) -> Schedule:
    """PipeDream-Flush (1F1B with a flush): warm-up, one-forward-one-backward, drain, one UPDATE."""
    _check_args(stages, microbatches)
    actions = []
    for s in range(stages):
        row = [Action(k, s, mb) for k, mb in _one_f_one_b_order(stages, microbatches, s)]
        row.append(Action(UPDATE, s))
        actions.append(tuple(row))
    return Schedule("1f1b-flush", stages, microbatches, tuple(actions), (1,) * stages, microbatches)


def one_f_one_b_stash(stages: int, microbatches: int, update_every: int = 1) -> Schedule:
    """PipeDream asynchronous 1F1B with weight stashing, over a whole run of `microbatches`.

    No flush: each stage updates after every `update_every`-th backward (and once more after the
    last backward if gradients are left over) while later micro-batches are still in flight. A
    forward uses the newest weights and its backward must use the same ones, so stage s keeps
    up to p-s versions (its micro-batches in flight plus the current one overlap that far).
    """
    _check_args(stages, microbatches, update_every)
    actions = []
    for s in range(stages):
        row, done = [], 0
        for k, mb in _one_f_one_b_order(stages, microbatches, s):
            row.append(Action(k, s, mb))
            if k is B:
                done += 1
                if done % update_every == 0 or done == microbatches:
                    row.append(Action(UPDATE, s, mb))
        actions.append(tuple(row))
    return Schedule("1f1b-stash", stages, microbatches, tuple(actions),
                    tuple(stages - s for s in range(stages)), update_every)


def _require_compute_only(schedule: Schedule, pass_name: str) -> None:
    for row in schedule.actions:
        for a in row:
            if a.kind.is_send or a.kind.is_recv:
                raise ValueError(f"{pass_name} expects a schedule without {a.kind.value} actions; found {a} "
                                 f"(was the pass already run?)")


def add_communication(schedule: Schedule) -> Schedule:
    """Requires compute-only lists; ensures every transfer a compute needs sits next to it.

    A receive goes just before the compute that consumes it and a send right after the compute
    that produces it: activations from s to s+1, gradients from s+1 to s.
    """
    _require_compute_only(schedule, "add_communication")
    last = schedule.stages - 1
    actions = []
    for s, row in enumerate(schedule.actions):
        out: list[Action] = []
        for a in row:
            if a.kind is F:
                if s > 0:
                    out.append(Action(ActionKind.RECV_ACT, s, a.microbatch, s - 1))
                out.append(a)
                if s < last:
                    out.append(Action(ActionKind.SEND_ACT, s, a.microbatch, s + 1))
            elif a.kind is B:
                if s < last:
                    out.append(Action(ActionKind.RECV_GRAD, s, a.microbatch, s + 1))
                out.append(a)
                if s > 0:
                    out.append(Action(ActionKind.SEND_GRAD, s, a.microbatch, s - 1))
            else:
                out.append(a)
        actions.append(tuple(out))
    return replace(schedule, actions=tuple(actions))


def add_frees(schedule: Schedule) -> Schedule:
    """Requires lists without FREE; ensures one FREE per micro-batch right after its backward.

    The FREE goes after the backward's gradient send, so the executor never frees a buffer a
    transfer may still read, and before any UPDATE, so the update runs with the activations gone.
    """
    for row in schedule.actions:
        for a in row:
            if a.kind is ActionKind.FREE:
                raise ValueError(f"add_frees expects a schedule without FREE actions; found {a} "
                                 f"(was the pass already run?)")
    actions = []
    for s, row in enumerate(schedule.actions):
        out: list[Action] = []
        pending: int | None = None
        for a in row:
            if pending is not None and a.kind is not ActionKind.SEND_GRAD:
                out.append(Action(ActionKind.FREE, s, pending))
                pending = None
            out.append(a)
            if a.kind is B:
                pending = a.microbatch
        if pending is not None:
            out.append(Action(ActionKind.FREE, s, pending))
        actions.append(tuple(out))
    return replace(schedule, actions=tuple(actions))


# The compute-only action order of each schedule in `ir.plan.SCHEDULE_NAMES` (a test keeps the two
# in step); `make_schedule` adds communication and frees.
COMPUTE_ORDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b-flush": one_f_one_b_flush,
    "1f1b-stash": one_f_one_b_stash,
}


def make_schedule(name: str, stages: int, microbatches: int, update_every: int = 1) -> Schedule:
    """The named schedule with communication and frees added, verified and dry-run."""
    check_schedule_name(name)
    if name == "1f1b-stash":
        compute = one_f_one_b_stash(stages, microbatches, update_every)
    else:
        if update_every != 1:
            raise ValueError(f"update_every={update_every} applies to 1f1b-stash only; {name} updates once per batch")
        compute = COMPUTE_ORDERS[name](stages, microbatches)
    schedule = add_frees(add_communication(compute))
    verify_plan(schedule)
    return schedule


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not (activations held)."""
    peaks = []
    for row in schedule.actions:
        live, peak = set(), 0
        for a in row:
            if a.kind is F:
                live.add(a.microbatch)
                peak = max(peak, len(live))
            elif a.kind is B:
                live.discard(a.microbatch)
        peaks.append(peak)
    return tuple(peaks)
