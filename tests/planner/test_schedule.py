"""Schedule functions and lowering passes (planner.schedule): every plan verifies, compute orders are
the documented ones, and the in-flight and weight-version counts match the design numbers."""
from __future__ import annotations

import math

import pytest

from ir.plan import Action, ActionKind, Schedule
from ir.verify import peak_weight_versions, verify_plan
from planner.schedule import (COMPUTE_ORDERS, add_communication, add_frees, gpipe, make_schedule, one_f_one_b_flush,
                              one_f_one_b_stash, peak_in_flight)

GRID = [(p, m) for p in range(1, 5) for m in range(1, 9)]


def _compute(schedule: Schedule, stage: int) -> str:
    return " ".join(str(a) for a in schedule.actions[stage])


@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush", "1f1b-stash"])
def test_every_schedule_verifies(name):
    for p, m in GRID:
        sch = make_schedule(name, p, m)
        assert verify_plan(sch).ticks == 2 * (m + p - 1), (name, p, m)
        assert Schedule.from_text(sch.to_text()) == sch


@pytest.mark.parametrize("k", [2, 3, 5])
def test_stash_with_gradient_accumulation_verifies(k):
    for p, m in GRID:
        sch = make_schedule("1f1b-stash", p, m, update_every=k)
        verify_plan(sch)
        for row in sch.actions:
            updates = [a for a in row if a.kind is ActionKind.UPDATE]
            assert len(updates) == math.ceil(m / k)
            assert updates[-1].microbatch == m - 1 and row[-1] == updates[-1]


def test_compute_orders_for_three_stages_four_microbatches():
    g, f, s = gpipe(3, 4), one_f_one_b_flush(3, 4), one_f_one_b_stash(3, 4)
    assert _compute(g, 0) == "s0.F.m0 s0.F.m1 s0.F.m2 s0.F.m3 s0.B.m0 s0.B.m1 s0.B.m2 s0.B.m3 s0.UPDATE"
    # Warm-up of p-s-1 forwards, then one forward one backward, then the drain.
    assert _compute(f, 0) == "s0.F.m0 s0.F.m1 s0.F.m2 s0.B.m0 s0.F.m3 s0.B.m1 s0.B.m2 s0.B.m3 s0.UPDATE"
    assert _compute(f, 1) == "s1.F.m0 s1.F.m1 s1.B.m0 s1.F.m2 s1.B.m1 s1.F.m3 s1.B.m2 s1.B.m3 s1.UPDATE"
    assert _compute(f, 2) == "s2.F.m0 s2.B.m0 s2.F.m1 s2.B.m1 s2.F.m2 s2.B.m2 s2.F.m3 s2.B.m3 s2.UPDATE"
    assert _compute(s, 1) == ("s1.F.m0 s1.F.m1 s1.B.m0 s1.UPDATE.m0 s1.F.m2 s1.B.m1 s1.UPDATE.m1 s1.F.m3 "
                              "s1.B.m2 s1.UPDATE.m2 s1.B.m3 s1.UPDATE.m3")
    for sch in (g, f, s):
        assert {a.kind for row in sch.actions for a in row} <= {ActionKind.F, ActionKind.B, ActionKind.UPDATE}


def test_passes_place_communication_and_frees():
    sch = add_frees(add_communication(one_f_one_b_flush(3, 4)))
    assert _compute(sch, 1).startswith(
        "s1.RECV_ACT.m0<s0 s1.F.m0 s1.SEND_ACT.m0>s2 s1.RECV_ACT.m1<s0 s1.F.m1 s1.SEND_ACT.m1>s2 "
        "s1.RECV_GRAD.m0<s2 s1.B.m0 s1.SEND_GRAD.m0>s0 s1.FREE.m0 ")
    assert _compute(sch, 2).endswith("s2.B.m3 s2.SEND_GRAD.m3>s1 s2.FREE.m3 s2.UPDATE")
    one = add_frees(add_communication(gpipe(1, 2)))
    assert _compute(one, 0) == "s0.F.m0 s0.F.m1 s0.B.m0 s0.FREE.m0 s0.B.m1 s0.FREE.m1 s0.UPDATE"


def test_passes_refuse_to_run_twice():
    comm = add_communication(gpipe(2, 2))
    with pytest.raises(ValueError, match="add_communication expects a schedule without SEND_ACT"):
        add_communication(comm)
    with pytest.raises(ValueError, match="add_frees expects a schedule without FREE"):
        add_frees(add_frees(comm))


@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (3, 4), (4, 2), (4, 8)])
def test_peak_in_flight_matches_the_design_numbers(p, m):
    for name in ("1f1b-flush", "1f1b-stash"):
        assert peak_in_flight(make_schedule(name, p, m)) == tuple(min(p - s, m) for s in range(p))
    assert peak_in_flight(make_schedule("gpipe", p, m)) == (m,) * p


@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (3, 4), (4, 2), (4, 8)])
def test_weight_stash_depths(p, m):
    stash = make_schedule("1f1b-stash", p, m)
    assert stash.stash_depth == tuple(p - s for s in range(p))
    assert peak_weight_versions(stash) == tuple(min(p - s, m) for s in range(p))
    for name in ("gpipe", "1f1b-flush"):
        sch = make_schedule(name, p, m)
        assert sch.stash_depth == (1,) * p and peak_weight_versions(sch) == (1,) * p
        assert sch.update_every == m and sch.flushes
    assert not stash.flushes


def test_make_schedule_argument_errors():
    with pytest.raises(ValueError, match="unknown schedule 'zb-h2'; valid names: gpipe, 1f1b-flush, 1f1b-stash, zb-h1, 2bw"):
        make_schedule("zb-h2", 2, 2)
    with pytest.raises(ValueError, match="stages must be an int >= 1, got 0"):
        make_schedule("gpipe", 0, 2)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 0"):
        one_f_one_b_flush(2, 0)
    with pytest.raises(ValueError, match="update_every must be an int >= 1"):
        make_schedule("1f1b-stash", 2, 2, update_every=0)
    with pytest.raises(ValueError, match="applies to 1f1b-stash and 2bw only"):
        make_schedule("gpipe", 2, 2, update_every=2)
    assert set(COMPUTE_ORDERS) == {"gpipe", "1f1b-flush", "1f1b-stash", "zb-h1", "2bw"}


def test_schedules_are_pure_and_deterministic():
    assert make_schedule("1f1b-stash", 4, 6, 2) == make_schedule("1f1b-stash", 4, 6, 2)
    assert hash(make_schedule("gpipe", 2, 3)) == hash(make_schedule("gpipe", 2, 3))
    assert isinstance(make_schedule("gpipe", 2, 3).actions[0][0], Action)


@pytest.mark.parametrize("name", ["1f1b-stash", "2bw"])
def test_an_async_schedule_runs_many_steps_from_its_one_step_lists_and_steady_state(name):
    """Issue 34: the plan's one-step lists and steady state make exactly the schedule written over k
    steps' micro-batches, for every k (nothing is scheduled at run time); a flush schedule has none."""
    from planner.schedule import _lowered

    for p, m, u in [(1, 1, 1), (2, 2, 1), (3, 2, 1), (3, 4, 2), (4, 3, 1), (4, 4, 4), (5, 6, 3)]:
        if name == "2bw" and u < p:
            continue
        one = make_schedule(name, p, m, u)
        assert one.steady is not None, (p, m, u)
        for k in range(1, 7):
            many = one.for_steps(k)
            assert many.actions == _lowered(name, p, k * m, u).actions, (p, m, u, k)
            verify_plan(many)
    # the steady state is part of no comparison: the plan's JSON form carries the one-step lists alone
    assert Schedule.from_json(make_schedule(name, 3, 2, 1 if name == "1f1b-stash" else 3).to_json()) \
        == make_schedule(name, 3, 2, 1 if name == "1f1b-stash" else 3)
    # fewer micro-batches than stages less one: the warm-up of a longer run is not the one-step one's
    if name == "1f1b-stash":
        short = make_schedule(name, 4, 2)
        assert short.steady is None and short.for_steps(1) is short
        with pytest.raises(ValueError, match="no steady state"):
            short.for_steps(2)
    with pytest.raises(ValueError, match="a flush schedule runs one step at a time"):
        make_schedule("1f1b-flush", 2, 2).for_steps(2)


def test_a_stash_run_without_a_steady_state_is_refused_before_any_worker_starts():
    """Issue 34: 1f1b-stash over 4 stages with 2 micro-batches per step has no steady state in its one-step
    lists, so a run of several steps is refused up front, naming the fix (it was scheduled at run time)."""
    from jobs.train.pipeline import train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from support import tiny_graph

    graph = tiny_graph()
    with pytest.raises(ValueError, match=r"1f1b-stash over 4 stages with 2 micro-batches per step has no steady "
                                         r"state .* cannot train 3 steps: use --microbatches 3 or more, or --schedule "
                                         r"1f1b-flush$"):
        train_pipeline(graph, [], 9, [f"tcp://127.0.0.1:{p}" for p in range(1, 5)],
                       PipelineConfig("1f1b-stash", 2), 3, transport=object())
