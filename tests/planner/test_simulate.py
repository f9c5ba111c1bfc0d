"""The costed simulator against closed forms (DESIGN.md's numbers) and timelines worked out by hand."""
from __future__ import annotations

import json

import pytest

from ir.partition import StageCost
from ir.plan import Action, ActionKind, Schedule
from planner.schedule import make_schedule
from planner.simulate import chrome_trace, simulate, write_chrome_trace


def _costs(p, f=1.0, b=2.0, **kw) -> list[StageCost]:
    return [StageCost(s, f"d{s}", f, b, **kw) for s in range(p)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 4), (3, 4), (4, 8), (4, 3)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_equal_stages_match_the_flush_closed_form(name, p, m, f, b):
    sim = simulate(make_schedule(name, p, m), _costs(p, f, b))
    assert sim.step_s == pytest.approx((m + p - 1) * (f + b))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.per_stage_busy_s == pytest.approx([m * (f + b)] * p)


def test_repeated_steps_take_the_same_time_each():
    one = simulate(make_schedule("1f1b-flush", 3, 4), _costs(3))
    three = simulate(make_schedule("1f1b-flush", 3, 4), _costs(3), steps=3)
    assert three.step_s == pytest.approx(one.step_s)
    assert three.throughput_samples_per_s(8) == pytest.approx(8 * 4 / one.step_s)


def test_link_time_of_one_microbatch_adds_both_transfers():
    # s0 F [0,1], act on the wire [1,4], s1 F [4,6], B [6,9], grad on the wire [9,11], s0 B [11,13]
    costs = [StageCost(0, "a", 1.0, 2.0, send_act_s=3.0), StageCost(1, "b", 2.0, 3.0, send_grad_s=2.0)]
    sim = simulate(make_schedule("gpipe", 2, 1), costs)
    assert sim.makespan_s == pytest.approx(13.0)
    transfers = [(e.name, e.start_s, e.end_s, e.link) for e in sim.events if e.link]
    assert transfers == [("s0.SEND_ACT.m0>s1", 1.0, 4.0, (0, 1)), ("s1.SEND_GRAD.m0>s0", 9.0, 11.0, (1, 0))]


def test_a_link_carries_one_transfer_at_a_time():
    # f=1, b=2, 3 s per transfer each way, GPipe with 2 micro-batches:
    #   s0: F0 [0,1] F1 [1,2]; link 0->1: m0 [1,4], m1 queues behind it [4,7]
    #   s1: F0 [4,5] F1 [7,8] B0 [8,10] B1 [10,12]; link 1->0: m0 [10,13], m1 [13,16]
    #   s0: B0 [13,15] B1 [16,18]
    # (with unlimited parallel transfers it would be 15 s)
    costs = [StageCost(s, "d", 1.0, 2.0, send_act_s=3.0, send_grad_s=3.0) for s in range(2)]
    sim = simulate(make_schedule("gpipe", 2, 2), costs)
    assert sim.makespan_s == pytest.approx(18.0)
    spans = {e.name: (e.start_s, e.end_s) for e in sim.events}
    assert spans["s0.SEND_ACT.m1>s1"] == (4.0, 7.0)
    assert spans["s1.F.m1"] == (7.0, 8.0)
    assert spans["s1.SEND_GRAD.m1>s0"] == (13.0, 16.0)
    assert spans["s0.B.m1"] == (16.0, 18.0)
    assert sim.per_stage_busy_s == pytest.approx([6.0, 6.0])
    assert sim.bubble_fraction == pytest.approx(1 - 12 / 36)


@pytest.mark.parametrize("name", ["gpipe", "1f1b-flush"])
def test_unequal_stages_match_a_hand_timeline(name):
    # s0: f=1 b=2 update 0.5; s1: f=2 b=3 update 1; 2 micro-batches, no link time.
    # 1F1B: s0 F0 [0,1] F1 [1,2]; s1 F0 [1,3] B0 [3,6] F1 [6,8] B1 [8,11] U [11,12];
    #       s0 B0 [6,8] B1 [11,13] U [13,13.5].  GPipe: s1 F0 [1,3] F1 [3,5] B0 [5,8] B1 [8,11];
    #       s0 B0 [8,10] B1 [11,13]: the same 13.5 s, and DESIGN's sum + (m-1) x slowest = 8 + 5.
    costs = [StageCost(0, "a", 1.0, 2.0, update_s=0.5), StageCost(1, "b", 2.0, 3.0, update_s=1.0)]
    sim = simulate(make_schedule(name, 2, 2), costs)
    assert sim.makespan_s == pytest.approx(13.5)
    assert sim.per_stage_busy_s == pytest.approx([6.5, 11.0])
    assert sim.bubble_fraction == pytest.approx(1 - 17.5 / 27)
    spans = {e.name: (e.start_s, e.end_s) for e in sim.events}
    assert spans["s0.B.m1"] == (11.0, 13.0)
    assert spans["s0.UPDATE"] == (13.0, 13.5)


def test_peak_memory_counts_microbatches_between_forward_and_free():
    costs = [StageCost(s, "d", 1.0, 2.0, memory_bytes=1000) for s in range(3)]
    gpipe = simulate(make_schedule("gpipe", 3, 4), costs, activation_bytes=[10, 20, 30])
    assert gpipe.peak_in_flight == (4, 4, 4)
    assert gpipe.peak_memory_bytes == (1040, 1080, 1120)
    flush = simulate(make_schedule("1f1b-flush", 3, 4), costs, activation_bytes=[10, 20, 30])
    assert flush.peak_in_flight == (3, 2, 1)          # min(p - s, m)
    assert flush.peak_memory_bytes == (1030, 1040, 1030)
    assert simulate(make_schedule("gpipe", 3, 4), costs).peak_memory_bytes == (1000, 1000, 1000)


def test_async_schedule_runs():
    sim = simulate(make_schedule("1f1b-stash", 3, 6, update_every=2), _costs(3, 1.0, 1.0))
    assert sim.makespan_s > 6 * 2
    assert sim.peak_in_flight == (3, 2, 1)


def test_chrome_trace_is_valid_json_with_one_event_per_compute(tmp_path):
    costs = _costs(3, send_act_s=0.25, send_grad_s=0.25)
    sched = make_schedule("1f1b-flush", 3, 4)
    sim = simulate(sched, costs)
    path = write_chrome_trace(sim, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["dur"] >= 0 and e["ts"] >= 0
    compute = [a for row in sched.actions for a in row if a.kind.is_compute]
    assert sorted(e["name"] for e in spans if e["cat"] == "compute") == sorted(str(a) for a in compute)
    sends = [a for row in sched.actions for a in row if a.kind.is_send]
    assert len([e for e in spans if e["cat"] == "transfer"]) == len(sends)
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"stage 0", "stage 1", "stage 2", "link s0 -> s1", "link s1 -> s2",
                      "link s1 -> s0", "link s2 -> s1"}
    last = max(e["ts"] + e["dur"] for e in spans)
    assert last == pytest.approx(sim.makespan_s * 1e6)
    assert chrome_trace(sim) == doc
    # rows carry the devices' names when given (`confidant simulate` gives the plan's)
    named = write_chrome_trace(sim, tmp_path / "named.json", ["phone", "laptop", "board"])
    tracks = {e["args"]["name"]: e["tid"] for e in json.loads(named.read_text())["traceEvents"]
              if e["name"] == "thread_name"}
    assert tracks == {"phone (stage 0)": 0, "laptop (stage 1)": 1, "board (stage 2)": 2, "link phone -> laptop": 3,
                      "link laptop -> phone": 4, "link laptop -> board": 5, "link board -> laptop": 6}
    with pytest.raises(ValueError, match="2 device names for 3 stages"):
        chrome_trace(sim, ["a", "b"])


def test_deadlock_names_the_stuck_receives():
    # Both stages receive before they send: each waits for the other forever.
    A = ActionKind
    rows = [
        (Action(A.F, 0, 0), Action(A.RECV_GRAD, 0, 0, 1), Action(A.SEND_ACT, 0, 0, 1), Action(A.B, 0, 0),
         Action(A.FREE, 0, 0), Action(A.UPDATE, 0)),
        (Action(A.RECV_ACT, 1, 0, 0), Action(A.F, 1, 0), Action(A.B, 1, 0), Action(A.SEND_GRAD, 1, 0, 0),
         Action(A.FREE, 1, 0), Action(A.UPDATE, 1)),
    ]
    sched = Schedule("broken", 2, 1, rows, (1, 1), 1)
    with pytest.raises(ValueError, match="deadlock") as err:
        simulate(sched, _costs(2))
    assert "s0.RECV_GRAD.m0<s1" in str(err.value) and "s1.RECV_ACT.m0<s0" in str(err.value)


def test_receive_without_any_send_is_a_deadlock():
    A = ActionKind
    rows = [(Action(A.F, 0, 0), Action(A.B, 0, 0), Action(A.FREE, 0, 0), Action(A.UPDATE, 0)),
            (Action(A.RECV_ACT, 1, 0, 0), Action(A.F, 1, 0), Action(A.B, 1, 0), Action(A.FREE, 1, 0),
             Action(A.UPDATE, 1))]
    with pytest.raises(ValueError, match=r"s1\.RECV_ACT\.m0<s0.*s0\.SEND_ACT\.m0>s1"):
        simulate(Schedule("lonely", 2, 1, rows, (1, 1), 1), _costs(2))


def test_bad_costs_are_refused():
    sched = make_schedule("gpipe", 2, 2)
    with pytest.raises(ValueError, match="2 stages but 1"):
        simulate(sched, _costs(1))
    with pytest.raises(ValueError, match="non-negative"):
        simulate(sched, [StageCost(0, "a", -1.0, 1.0), StageCost(1, "b", 1.0, 1.0)])
    with pytest.raises(ValueError, match="stage order"):
        simulate(sched, list(reversed(_costs(2))))
