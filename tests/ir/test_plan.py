"""Plans as data (ir.plan) and their checks (ir.verify): text/JSON round trips, one broken list per
verify rule, the lockstep dry run's exact tick counts and its deadlock report."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ir.plan import SCHEMA_VERSION, Action, ActionKind, Schedule
from ir.verify import PlanError, dry_run, peak_weight_versions, verify_plan
from planner.schedule import make_schedule

# Strategies -------------------------------------------------------------------------------------

small = st.integers(min_value=0, max_value=40)


@st.composite
def actions(draw):
    kind = draw(st.sampled_from(list(ActionKind)))
    stage = draw(small)
    if kind is ActionKind.UPDATE:
        return Action(kind, stage, draw(st.none() | small))
    peer = draw(small) if (kind.is_send or kind.is_recv) else None
    return Action(kind, stage, draw(small), peer)


@st.composite
def schedules(draw):
    stages = draw(st.integers(1, 4))
    rows = tuple(tuple(draw(st.lists(actions(), max_size=6))) for _ in range(stages))
    return Schedule(draw(st.sampled_from(["gpipe", "1f1b-flush", "1f1b-stash", "x"])), stages,
                    draw(st.integers(1, 9)), rows, tuple(draw(st.lists(st.integers(1, 5), min_size=stages,
                                                                        max_size=stages))),
                    draw(st.integers(1, 4)))


# Action text form -------------------------------------------------------------------------------

@given(actions())
def test_action_text_round_trips(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text, token", [
    (Action(ActionKind.F, 1, 3), "s1.F.m3"),
    (Action(ActionKind.B, 1, 3), "s1.B.m3"),
    (Action(ActionKind.SEND_ACT, 1, 3, 2), "s1.SEND_ACT.m3>s2"),
    (Action(ActionKind.RECV_ACT, 2, 3, 1), "s2.RECV_ACT.m3<s1"),
    (Action(ActionKind.SEND_GRAD, 2, 3, 1), "s2.SEND_GRAD.m3>s1"),
    (Action(ActionKind.RECV_GRAD, 1, 3, 2), "s1.RECV_GRAD.m3<s2"),
    (Action(ActionKind.UPDATE, 1), "s1.UPDATE"),
    (Action(ActionKind.UPDATE, 1, 3), "s1.UPDATE.m3"),
    (Action(ActionKind.FREE, 1, 3), "s1.FREE.m3"),
])
def test_action_tokens_are_the_documented_ones(text, token):
    assert str(text) == token and Action.parse(token) == text


@pytest.mark.parametrize("bad, hint", [
    ("", "expected one of"),
    ("s1.F", "needs a micro-batch"),
    ("s1.F.m3>s2", "has no peer"),
    ("s1.SEND_ACT.m3", "SEND_ACT is written"),
    ("s1.SEND_ACT.m3<s2", "SEND_ACT is written"),
    ("s2.RECV_GRAD.m3>s1", "RECV_GRAD is written"),
    ("s1.JUMP.m3", "unknown kind 'JUMP'"),
    ("1.F.m3", "expected one of"),
    ("s1.F.m3 ", "expected one of"),
    ("s-1.F.m3", "expected one of"),
])
def test_malformed_tokens_are_refused_quoting_the_text(bad, hint):
    with pytest.raises(ValueError) as err:
        Action.parse(bad)
    assert repr(bad) in str(err.value) and hint in str(err.value)


def test_action_fields_are_checked_at_construction():
    with pytest.raises(ValueError, match="needs a micro-batch"):
        Action(ActionKind.B, 0)
    with pytest.raises(ValueError, match="needs a peer"):
        Action(ActionKind.RECV_ACT, 1, 0)
    with pytest.raises(ValueError, match="non-negative"):
        Action(ActionKind.F, -1, 0)
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("HOP", 0, 0)
    assert Action("F", 0, 0).kind is ActionKind.F


# Schedule JSON and text -------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(schedules())
def test_schedule_json_and_text_round_trip(schedule):
    assert Schedule.from_json(json.loads(json.dumps(schedule.to_json()))) == schedule
    assert Schedule.from_text(schedule.to_text()) == schedule


def test_save_load_round_trip(tmp_path):
    sch = make_schedule("1f1b-stash", 3, 5, update_every=2)
    path = tmp_path / "plan.json"
    sch.save(path)
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    assert Schedule.load(path) == sch
    verify_plan(Schedule.load(path))


def test_foreign_schema_version_is_refused(tmp_path):
    data = make_schedule("gpipe", 2, 2).to_json()
    data["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"schedule: schema_version {SCHEMA_VERSION + 1} is not supported by this build \(reads {SCHEMA_VERSION}\)"):
        Schedule.load(path)
    del data["schema_version"]
    with pytest.raises(ValueError, match="schedule has no integer schema_version \\(got None\\)"):
        Schedule.from_json(data)
    text = make_schedule("gpipe", 2, 2).to_text().replace(f"schema_version={SCHEMA_VERSION}", "schema_version=7")
    with pytest.raises(ValueError, match="schedule header: schema_version 7 is not supported"):
        Schedule.from_text(text)


def test_text_form_errors_are_clear():
    text = make_schedule("gpipe", 2, 2).to_text()
    with pytest.raises(ValueError, match="header line"):
        Schedule.from_text(text.split("\n", 1)[1])
    with pytest.raises(ValueError, match="3 stage lines, header says stages=2"):
        Schedule.from_text(text + "s0.F.m0\n")
    with pytest.raises(ValueError, match="'s0.X.m0'"):
        Schedule.from_text(text.replace("s0.F.m0", "s0.X.m0"))
    data = make_schedule("gpipe", 2, 2).to_json()
    data["actions"] = "s0.F.m0"
    with pytest.raises(ValueError, match="lists of action tokens"):
        Schedule.from_json(data)


def test_schedule_shape_is_checked():
    with pytest.raises(ValueError, match="2 stages but 1 action lists"):
        Schedule("gpipe", 2, 1, ((),), (1, 1), 1)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        Schedule("gpipe", 1, 0, ((),), (1,), 1)


# verify_plan: one broken list per rule ----------------------------------------------------------

def _edit(schedule: Schedule, stage: int, fn, **fields) -> Schedule:
    """Apply fn to one stage's list of tokens; the plan is edited as text, as a person would."""
    data = schedule.to_json()
    data["actions"][stage] = fn(list(data["actions"][stage]))
    data.update(fields)
    return Schedule.from_json(data)


def _swap(a: str, b: str):
    def fn(tokens):
        i, j = tokens.index(a), tokens.index(b)
        tokens[i], tokens[j] = tokens[j], tokens[i]
        return tokens
    return fn


def _replace(a: str, b: str | None):
    return lambda tokens: [b if t == a else t for t in tokens if not (t == a and b is None)]


def _rejects(schedule: Schedule, rule: str, *fragments: str) -> PlanError:
    with pytest.raises(PlanError) as err:
        verify_plan(schedule)
    e = err.value
    assert e.rule == rule, str(e)
    first_line = str(e).splitlines()[0]
    assert f"rule '{rule}'" in first_line
    for f in fragments:
        assert f in str(e), str(e)
    return e


FLUSH = make_schedule("1f1b-flush", 3, 4)
STASH = make_schedule("1f1b-stash", 3, 4)


def test_a_valid_plan_passes_and_returns_its_dry_run():
    assert verify_plan(FLUSH).ticks == 2 * (4 + 3 - 1)


def test_rule_stage_placement():
    e = _rejects(_edit(FLUSH, 0, _replace("s0.FREE.m0", "s1.FREE.m0")), "stage placement",
                 "stage 0, s1.FREE.m0", "sits in the list of stage 0")
    assert ">>s1.FREE.m0<<" in e.grid


def test_rule_microbatch_range():
    _rejects(_edit(FLUSH, 0, _replace("s0.FREE.m0", "s0.FREE.m9")), "micro-batch range",
             "micro-batch 9 is outside 0..3", ">>s0.FREE.m9<<")


@pytest.mark.parametrize("stage, old, new, says", [
    (0, "s0.SEND_ACT.m0>s1", "s0.SEND_ACT.m0>s2", "SEND_ACT must go to/from stage 1, not stage 2"),
    (2, "s2.SEND_GRAD.m0>s1", "s2.SEND_ACT.m0>s1", "SEND_ACT must go to/from no stage"),
    (1, "s1.SEND_GRAD.m0>s0", "s1.SEND_GRAD.m0>s2", "SEND_GRAD must go to/from stage 0, not stage 2"),
])
def test_rule_adjacent_stages_in_the_right_direction(stage, old, new, says):
    _rejects(_edit(FLUSH, stage, _replace(old, new)), "adjacent stages", says, f">>{new}<<")


def test_rule_send_without_receive():
    _rejects(_edit(FLUSH, 1, _replace("s1.RECV_ACT.m2<s0", None)), "send/receive pairing",
             "stage 0, s0.SEND_ACT.m2>s1", "no RECV_ACT of micro-batch 2 on stage 1 matches this send")


def test_rule_receive_without_send():
    _rejects(_edit(FLUSH, 2, _replace("s2.SEND_GRAD.m1>s1", None)), "send/receive pairing",
             "stage 1, s1.RECV_GRAD.m1<s2", "no SEND_GRAD of micro-batch 1 on stage 2 matches this receive")


def test_rule_f_and_b_exactly_once():
    _rejects(_edit(FLUSH, 2, lambda t: t + ["s2.B.m1"]), "F and B once",
             "micro-batch 1 has a second B")


def test_rule_every_microbatch_has_f_and_b():
    _rejects(_edit(FLUSH, 2, _replace("s2.F.m3", None)), "every micro-batch",
             "stage 2 has no F for micro-batch(es) 3 of 4")


def test_rule_f_before_b():
    e = _rejects(_edit(FLUSH, 2, _swap("s2.F.m0", "s2.B.m0")), "F before B",
                 "stage 2, s2.B.m0", "backward runs before its forward")
    assert ">>s2.B.m0<<" in e.grid


def test_rule_recv_act_before_f():
    _rejects(_edit(FLUSH, 1, _swap("s1.RECV_ACT.m1<s0", "s1.F.m1")), "RECV_ACT before F",
             "stage 1, s1.F.m1", "F of micro-batch 1 runs before its RECV_ACT")


def test_rule_send_act_after_f():
    _rejects(_edit(FLUSH, 0, _swap("s0.F.m0", "s0.SEND_ACT.m0>s1")), "SEND_ACT after F",
             "stage 0, s0.SEND_ACT.m0>s1", "SEND_ACT of micro-batch 0 runs before its F",
             ">>s0.SEND_ACT.m0>s1<<")


def test_rule_recv_grad_before_b():
    _rejects(_edit(FLUSH, 0, _swap("s0.RECV_GRAD.m2<s1", "s0.B.m2")), "RECV_GRAD before B",
             "stage 0, s0.B.m2", "B of micro-batch 2 runs before its RECV_GRAD")


def test_rule_send_grad_after_b():
    _rejects(_edit(FLUSH, 2, _swap("s2.B.m0", "s2.SEND_GRAD.m0>s1")), "SEND_GRAD after B",
             "stage 2, s2.SEND_GRAD.m0>s1", "SEND_GRAD of micro-batch 0 runs before its B")


def test_rule_missing_comm_on_both_ends_is_named_by_the_order_rule():
    both = _edit(_edit(FLUSH, 0, _replace("s0.SEND_ACT.m3>s1", None)), 1, _replace("s1.RECV_ACT.m3<s0", None))
    _rejects(both, "SEND_ACT after F", "stage 0, s0.F.m3", "micro-batch 3 has no SEND_ACT on this stage")


def test_rule_free_after_b():
    def free_early(tokens):
        tokens.remove("s2.FREE.m1")
        tokens.insert(tokens.index("s2.B.m1"), "s2.FREE.m1")
        return tokens
    _rejects(_edit(FLUSH, 2, free_early), "FREE after B",
             "stage 2, s2.FREE.m1", "freed before its backward")
    _rejects(_edit(FLUSH, 2, _replace("s2.FREE.m1", None)), "FREE after B",
             "stage 2, s2.B.m1", "activations are never freed")


def test_rule_update_cadence_flush():
    _rejects(_edit(FLUSH, 1, lambda t: t[:8] + ["s1.UPDATE"] + t[8:]), "UPDATE cadence",
             "UPDATE after 1 backward(s); this schedule updates after every 4")
    _rejects(_edit(FLUSH, 1, _replace("s1.UPDATE", None)), "UPDATE cadence",
             "ends with 4 backward(s) whose gradients no UPDATE applies")
    _rejects(_edit(FLUSH, 1, lambda t: t + ["s1.UPDATE"]), "UPDATE cadence", "no backward since the last one")
    _rejects(_edit(FLUSH, 1, lambda t: t, update_every=1), "UPDATE cadence",
             "update_every must equal microbatches=4")


def test_rule_update_cadence_stash():
    _rejects(_edit(STASH, 2, _replace("s2.UPDATE.m0", None)), "UPDATE cadence",
             "stage 2, s2.B.m1", "an UPDATE is due after 1 backward(s)")
    _rejects(_edit(STASH, 2, _replace("s2.UPDATE.m1", "s2.UPDATE.m0")), "UPDATE cadence",
             "names micro-batch 0 but follows the backward of micro-batch 1")


def test_rule_stash_depth():
    e = _rejects(_edit(STASH, 0, lambda t: t, stash_depth=[2, 2, 1]), "stash depth",
                 "stage 0, s0.UPDATE.m1", "3 weight versions alive here (v0, v1, v2) but stash_depth[0] = 2")
    assert "rows: ticks of the dry run" in e.grid and ">>s0.UPDATE.m1<<" in e.grid


def test_weight_versions_replay():
    assert peak_weight_versions(STASH) == (3, 2, 1)
    assert peak_weight_versions(FLUSH) == (1, 1, 1)


# Dry run ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, m", [(1, 1), (1, 5), (2, 1), (2, 4), (3, 4), (4, 8), (4, 2), (5, 3)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush", "1f1b-stash"])
def test_dry_run_ticks_and_bubble_match_the_analytic_counts(name, p, m):
    run = dry_run(make_schedule(name, p, m))
    assert run.ticks == 2 * (m + p - 1)
    assert run.per_stage_busy == (2 * m,) * p
    assert run.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, f, b", [(3, 4, 1, 2), (4, 2, 2, 3), (2, 5, 3, 1)])
def test_gpipe_with_unequal_forward_and_backward(p, m, f, b):
    run = dry_run(make_schedule("gpipe", p, m), forward_ticks=f, backward_ticks=b)
    assert run.ticks == (m + p - 1) * (f + b)
    assert run.per_stage_busy == (m * (f + b),) * p


def test_dry_run_grid_of_a_two_stage_pipeline():
    run = dry_run(make_schedule("gpipe", 2, 1))
    assert run.grid == (
        ("s0.F.m0", ""),
        ("s0.SEND_ACT.m0>s1", "s1.RECV_ACT.m0<s0 s1.F.m0"),
        ("", "s1.B.m0"),
        ("s0.RECV_GRAD.m0<s1 s0.B.m0", "s1.SEND_GRAD.m0>s0 s1.FREE.m0 s1.UPDATE"),
        ("s0.FREE.m0 s0.UPDATE", ""),
    )
    slow = dry_run(make_schedule("gpipe", 2, 1), forward_ticks=2)
    assert slow.grid[1] == ("..", "") and slow.ticks == 6


def test_dry_run_rejects_bad_tick_lengths():
    with pytest.raises(ValueError, match="backward_ticks must be an int >= 1"):
        dry_run(FLUSH, backward_ticks=0)


def test_deadlock_is_reported_with_the_grid():
    # Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1's activations, while
    # stage 1 wants micro-batch 1's activations before it runs micro-batch 0's backward.
    s0 = ("s0.F.m0 s0.SEND_ACT.m0>s1 s0.RECV_GRAD.m0<s1 s0.B.m0 s0.FREE.m0 "
          "s0.F.m1 s0.SEND_ACT.m1>s1 s0.RECV_GRAD.m1<s1 s0.B.m1 s0.FREE.m1 s0.UPDATE")
    s1 = ("s1.RECV_ACT.m0<s0 s1.F.m0 s1.RECV_ACT.m1<s0 s1.F.m1 s1.B.m1 s1.SEND_GRAD.m1>s0 s1.FREE.m1 "
          "s1.B.m0 s1.SEND_GRAD.m0>s0 s1.FREE.m0 s1.UPDATE")
    text = f"# schedule name=1f1b-flush stages=2 microbatches=2 update_every=2 stash_depth=1,1 schema_version=1\n{s0}\n{s1}\n"
    sch = Schedule.from_text(text)
    with pytest.raises(PlanError) as err:
        verify_plan(sch)
    e = err.value
    assert e.rule == "deadlock"
    assert "stage 0 waits at s0.RECV_GRAD.m0<s1" in e.reason and "stage 1 waits at s1.RECV_ACT.m1<s0" in e.reason
    lines = str(e).splitlines()
    stuck = [ln for ln in lines if ln.startswith("stuck")]
    assert stuck and ">>s0.RECV_GRAD.m0<s1<<" in stuck[0] and ">>s1.RECV_ACT.m1<s0<<" in stuck[0]
    assert any(ln.startswith("t1 ") and "s1.F.m0" in ln for ln in lines)
    with pytest.raises(PlanError, match="rule 'deadlock'"):
        dry_run(sch)


def test_errors_fall_back_to_list_positions_when_the_dry_run_cannot_run():
    e = _rejects(_edit(FLUSH, 2, _replace("s2.SEND_GRAD.m1>s1", None)), "send/receive pairing")
    assert "rows: list positions" in e.grid and ">>s1.RECV_GRAD.m1<s2<<" in e.grid
    e = _rejects(_edit(FLUSH, 1, _replace("s1.RECV_ACT.m2<s0", None)), "send/receive pairing")
    assert "rows: ticks of the dry run" in e.grid and ">>s0.SEND_ACT.m2>s1<<" in e.grid


def test_the_time_limit_is_shared_by_the_whole_plan():
    """`--time-limit` counts from the command's start: each search gets its share of what is left
    before the reserve for writing the plan, and at least MIN_SEARCH_S once the time is spent."""
    import time

    from planner.compile import Deadline as _Deadline

    fresh = _Deadline(10.0)
    assert 0.6 * 8.0 - 0.1 <= fresh.search_s(0.6) <= 0.6 * 8.0  # 8 s before the 20% reserve
    started_earlier = _Deadline(10.0, started_s=time.monotonic() - 6.0)
    assert 0.5 * 2.0 - 0.1 <= started_earlier.search_s(0.5) <= 0.5 * 2.0
    spent = _Deadline(10.0, started_s=time.monotonic() - 60.0)
    assert spent.search_s(0.5) == _Deadline.MIN_SEARCH_S
