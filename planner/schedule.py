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

from ir.plan import ASYNC_SCHEDULES, Action, ActionKind, Schedule, SteadyState, check_schedule_name
from ir.verify import verify_plan

F, B, W, UPDATE = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.UPDATE


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


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) at 1F1B's memory: each
    backward split into B (the input gradient, which the previous stage waits for) and W (the
    weight gradients, which nothing waits for), then one UPDATE.

    The order is the earliest-start list schedule of unit-time F, B and W (each stage, whenever it
    is free, starts the first of: its next B whose gradient has arrived, its next F whose input
    has arrived if fewer than min(p-s, m) micro-batches sit between their F and their W, its oldest
    pending W), so a W runs exactly where the stage would otherwise wait. A micro-batch's
    activations stay until its W (W reads the layers' inputs), and the cap keeps the peak number
    held at 1F1B's p-s: the same activation memory. Sending the gradient before W shortens the
    trip back up the pipeline: with F = B = W the bubble is (p-1)(F+B) against 1F1B's (p-1)(F+B+W)
    (the paper's ZB-H1 reaches (p-1)(F+B-W) by letting micro-batches waiting only for their W go
    past the cap).
    """
    _check_args(stages, microbatches)
    p, m = stages, microbatches
    cap = [min(p - s, m) for s in range(p)]
    never = p * m * 3 + 1
    f_end = [[never] * m for _ in range(p)]
    b_end = [[never] * m for _ in range(p)]
    next_f, next_b, held = [0] * p, [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    free_at = [0] * p
    t = 0
    while any(len(r) < 3 * m for r in rows):
        for s in range(p):
            if free_at[s] > t:
                continue
            mb_b, mb_f = next_b[s], next_f[s]
            if mb_b < m and f_end[s][mb_b] <= t and (s == p - 1 or b_end[s + 1][mb_b] <= t):
                rows[s].append(Action(B, s, mb_b))
                b_end[s][mb_b] = t + 1
                next_b[s] += 1
                pending_w[s].append(mb_b)
            elif mb_f < m and held[s] < cap[s] and (s == 0 or f_end[s - 1][mb_f] <= t):
                rows[s].append(Action(F, s, mb_f))
                f_end[s][mb_f] = t + 1
                next_f[s] += 1
                held[s] += 1
            elif pending_w[s]:
                rows[s].append(Action(W, s, pending_w[s].pop(0)))
                held[s] -= 1
            else:
                continue
            free_at[s] = t + 1
        t += 1
    actions = tuple(tuple(row) + (Action(UPDATE, s),) for s, row in enumerate(rows))
    return Schedule("zb-h1", stages, microbatches, actions, (1,) * stages, microbatches)


def pipedream_2bw(stages: int, microbatches: int, update_every: int) -> Schedule:
    """PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML
    2021): 1F1B without a flush, every stage accumulating `update_every` backwards per update, and
    only two weight versions (the newest and the one its micro-batches in flight started on)
    instead of PipeDream's p-s. Two suffice when `update_every` >= stages: stage s holds at most
    p-s <= update_every micro-batches in flight, which then span at most one update."""
    _check_args(stages, microbatches, update_every)
    if update_every < stages:
        raise ValueError(f"2bw keeps two weight versions, which needs an update at most every stages={stages} "
                         f"backwards: update_every={update_every} is fewer (use update_every >= {stages}, "
                         f"or 1f1b-stash, which keeps p-s versions)")
    stash = one_f_one_b_stash(stages, microbatches, update_every)
    return Schedule("2bw", stages, microbatches, stash.actions, tuple(min(2, d) for d in stash.stash_depth),
                    update_every)


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
    """Requires lists without FREE; ensures one FREE per micro-batch right after its backward
    (after its W when backwards are split: W reads the activations too).

    The FREE goes after the backward's gradient send, so the executor never frees a buffer a
    transfer may still read, and before any UPDATE, so the update runs with the activations gone.
    """
    for row in schedule.actions:
        for a in row:
            if a.kind is ActionKind.FREE:
                raise ValueError(f"add_frees expects a schedule without FREE actions; found {a} "
                                 f"(was the pass already run?)")
    last_pass = W if schedule.splits_backward else B
    actions = []
    for s, row in enumerate(schedule.actions):
        out: list[Action] = []
        pending: int | None = None
        for a in row:
            if pending is not None and a.kind is not ActionKind.SEND_GRAD:
                out.append(Action(ActionKind.FREE, s, pending))
                pending = None
            out.append(a)
            if a.kind is last_pass:
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
    "zb-h1": zero_bubble_h1,
    "2bw": pipedream_2bw,
}


def _lowered(name: str, stages: int, microbatches: int, update_every: int) -> Schedule:
    """The named schedule with communication and frees added, verified and dry-run."""
    if name in ASYNC_SCHEDULES:
        compute = COMPUTE_ORDERS[name](stages, microbatches, update_every)
    else:
        compute = COMPUTE_ORDERS[name](stages, microbatches)
    schedule = add_frees(add_communication(compute))
    verify_plan(schedule)
    return schedule


def make_schedule(name: str, stages: int, microbatches: int, update_every: int = 1) -> Schedule:
    """The named schedule with communication and frees added, verified and dry-run; an asynchronous
    one (1f1b-stash, 2bw) with its steady state (`steady_state`), so that it runs any number of
    steps without a flush from these lists alone (`Schedule.for_steps`)."""
    check_schedule_name(name)
    if name not in ASYNC_SCHEDULES and update_every != 1:
        raise ValueError(f"update_every={update_every} applies to 1f1b-stash and 2bw only; {name} updates once "
                         f"per batch")
    schedule = _lowered(name, stages, microbatches, update_every)
    if name in ASYNC_SCHEDULES:
        schedule = replace(schedule, steady=steady_state(schedule))
    return schedule


def steady_state(one: Schedule) -> SteadyState | None:
    """Where each stage's one-step list of an asynchronous schedule drains, and the actions one more
    step adds before the drain (ir.plan.SteadyState), such that `for_steps(k)` is exactly the
    schedule written over k steps' micro-batches, for k = 2 and 3, each of which is verified and
    dry-run here. The lists of k steps are warm-up, k*m - w one-forward-one-backward pairs and a
    drain of w backwards (w = the stage's warm-up, fixed once k*m >= p - s - 1): past the first
    step each step adds the same m pairs, shifted by m, so agreement at k = 2 and 3 holds for every
    k. None when the one-step lists are no such prefix (fewer micro-batches than stages less one,
    or updates every `update_every` backwards with `update_every` not dividing a step's)."""
    m = one.microbatches
    if m % one.update_every:  # the last backward's extra update would fall mid-step past the first
        return None
    longer = {k: _lowered(one.name, one.stages, k * m, one.update_every) for k in (2, 3)}
    drain_at, steady = [], []
    for s, row in enumerate(one.actions):
        two = longer[2].actions[s]
        common = 0
        while common < len(row) and row[common] == two[common]:
            common += 1
        for a in range(common, -1, -1):  # the longest prefix that works (a drain may begin like a pair)
            tail = len(row) - a
            piece = two[a:len(two) - tail]
            if all(x.shifted(m) == y for x, y in zip(row[a:], two[len(two) - tail:])) and len(piece) + a + tail == len(two):
                drain_at.append(a)
                steady.append(piece)
                break
        else:
            return None
    state = SteadyState(tuple(drain_at), tuple(steady))
    candidate = replace(one, steady=state)
    for k, want in longer.items():
        if candidate.for_steps(k).actions != want.actions:
            return None
    return state


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and whose backward (its W, when
    backwards are split) has not: activations held."""
    last_pass = W if schedule.splits_backward else B
    peaks = []
    for row in schedule.actions:
        live, peak = set(), 0
        for a in row:
            if a.kind is F:
                live.add(a.microbatch)
                peak = max(peak, len(live))
            elif a.kind is last_pass:
                live.discard(a.microbatch)
        peaks.append(peak)
    return tuple(peaks)
