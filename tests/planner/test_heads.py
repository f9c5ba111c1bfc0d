"""The head allocator against the exhaustive oracle on synthetic non-decreasing time curves, its drop
rule, its guarantee of never predicting worse than the best single backend, and its input checks."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ir.profile import AttentionCurve
from planner.heads import HeadSplit, allocate_heads, exhaustive_split, split_time


@st.composite
def instances(draw, min_backends=2, max_backends=4, max_heads=16):
    """Backends with non-decreasing curves (a first head, then increments that may be 0, as when a
    fused kernel absorbs a head for free) and fixed extra costs, 0 for the first (the primary)."""
    heads = draw(st.integers(1, max_heads))
    n = draw(st.integers(min_backends, max_backends))
    # no subnormals: MNN, once imported (another test file, same process), flushes them to zero,
    # and hypothesis refuses to draw them then
    time = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    curves, extra = {}, {}
    for i in range(n):
        name = f"b{i}"
        first = draw(st.floats(1e-4, 1.0))
        steps = draw(st.lists(time, min_size=heads - 1, max_size=heads - 1))
        curves[name] = tuple(itertools.accumulate([first] + steps))
        extra[name] = 0.0 if i == 0 else draw(time)
    return curves, extra, heads


def _check_split(split: HeadSplit, curves, extra, heads: int) -> None:
    assert split.total_heads == heads
    assert all(h >= 1 for h in split.heads.values())
    assert list(split.heads) == [b for b in curves if b in split.heads]  # the order curves were given
    assert split.predicted_s == split_time(split.heads, curves, extra)
    assert split.predicted_s <= split.single_best[1]
    name, seconds = split.single_best
    assert seconds == min(curves[b][heads - 1] + extra[b] for b in curves) == curves[name][heads - 1] + extra[name]


@settings(max_examples=300, deadline=None)
@given(instances())
def test_allocator_matches_the_exhaustive_optimum(inst):
    curves, extra, heads = inst
    split = allocate_heads(curves, extra)
    oracle = exhaustive_split(curves, extra)
    _check_split(split, curves, extra, heads)
    assert split.predicted_s == oracle.predicted_s
    # as few backends as the oracle's best split uses (it breaks ties by fewest backends)
    assert len(split.heads) == len(oracle.heads)


@settings(max_examples=200, deadline=None)
@given(instances(max_backends=3), st.floats(1.01, 10.0))
def test_a_slow_backend_is_dropped_and_changes_nothing(inst, slowness):
    curves, extra, heads = inst
    best = min(curves[b][heads - 1] + extra[b] for b in curves)
    # one head on it takes longer than the best backend alone needs for all heads
    slow_first = best * slowness + 1e-3
    slow = dict(curves, slow=tuple(slow_first + 0.1 * h for h in range(heads)))
    slow_extra = dict(extra, slow=0.0)
    split = allocate_heads(slow, slow_extra)
    assert "slow" in split.dropped and "slow" not in split.heads
    assert set(split.dropped) - {"slow"} == set(allocate_heads(curves, extra).dropped)
    _check_split(split, slow, slow_extra, heads)
    assert split.predicted_s == allocate_heads(curves, extra).predicted_s == exhaustive_split(slow, slow_extra).predicted_s


@settings(max_examples=200, deadline=None)
@given(instances(), st.floats(0.05, 1.0))
def test_an_aggressive_drop_factor_never_predicts_worse_than_one_backend(inst, factor):
    curves, extra, heads = inst
    split = allocate_heads(curves, extra, drop_factor=factor)
    _check_split(split, curves, extra, heads)
    assert split.predicted_s >= exhaustive_split(curves, extra).predicted_s
    threshold = factor * split.single_best[1]
    assert set(split.dropped) == {b for b in curves if curves[b][0] + extra[b] > threshold} - set(split.heads)


@settings(max_examples=100, deadline=None)
@given(instances(min_backends=1, max_backends=4, max_heads=8),
       st.lists(st.floats(-0.3, 0.3, allow_subnormal=False), min_size=8, max_size=8))
def test_noisy_curves_are_handled_safely(inst, noise):
    """Measured curves can dip; the allocator works on running maxima, so it may miss a split that
    exploits a dip, but it still returns a valid split no slower than the best single backend."""
    curves, extra, heads = inst
    noisy = {b: tuple(max(0.0, s * (1 + noise[i % len(noise)])) for i, s in enumerate(c)) for b, c in curves.items()}
    split = allocate_heads(noisy, extra)
    _check_split(split, noisy, extra, heads)
    assert split.predicted_s >= exhaustive_split(noisy, extra).predicted_s


def test_two_equal_backends_split_evenly_and_halve_the_time():
    line = tuple(float(h) for h in range(1, 13))  # 1 s per head
    split = allocate_heads({"mnn:cpu:t1": AttentionCurve(line), "torch:cpu:t1": AttentionCurve(line)})
    assert split == HeadSplit({"mnn:cpu:t1": 6, "torch:cpu:t1": 6}, 6.0, ("mnn:cpu:t1", 12.0), ())
    assert split.speedup == 2.0


def test_extra_cost_shifts_heads_to_the_primary():
    line = tuple(float(h) for h in range(1, 13))
    split = allocate_heads({"cpu": line, "gpu": line}, {"gpu": 2.0})
    # cpu h + gpu (12-h) + 2: balanced at cpu 7 (7 s), gpu 5 (7 s)
    assert split.heads == {"cpu": 7, "gpu": 5} and split.predicted_s == 7.0


def test_an_expensive_extra_cost_keeps_one_backend():
    line = tuple(float(h) for h in range(1, 5))
    split = allocate_heads({"cpu": line, "gpu": tuple(0.1 * h for h in range(1, 5))}, {"gpu": 10.0})
    assert split == HeadSplit({"cpu": 4}, 4.0, ("cpu", 4.0), ("gpu",))


def test_an_explicit_threshold_drops_what_it_says():
    line = tuple(float(h) for h in range(1, 9))
    split = allocate_heads({"a": line, "b": tuple(2 * x for x in line), "c": tuple(3 * x for x in line)},
                           drop_threshold_s=2.5)
    assert split.dropped == ("c",)
    # a 6 + b 2 and a 5 + b 3 both take 6 s; the surplus head is taken from the last-listed backend
    assert split.heads == {"a": 6, "b": 2} and split.predicted_s == 6.0


def test_when_every_backend_is_dropped_the_best_single_one_runs_everything():
    split = allocate_heads({"a": (1.0, 2.0), "b": (0.5, 3.0)}, drop_threshold_s=0.1)
    assert split == HeadSplit({"a": 2}, 2.0, ("a", 2.0), ("b",))


def test_a_single_backend_takes_all_heads():
    assert allocate_heads({"only": (1.0, 1.5, 2.0)}) == HeadSplit({"only": 3}, 2.0, ("only", 2.0), ())


def test_exhaustive_split_enumerates_every_composition():
    from planner.heads import _compositions

    got = list(_compositions(4, 3))
    assert len(got) == len(set(got)) == 15  # C(6, 2)
    assert all(sum(c) == 4 and min(c) >= 0 for c in got)


@pytest.mark.parametrize("curves, extra, message", [
    ({}, None, "no backends to split heads across"),
    ({"a": (1.0, 2.0), "b": (1.0,)}, None,
     "attention curves must cover the same heads; lengths per backend: {'a': 2, 'b': 1}"),
    ({"a": ()}, None, "attention curves are empty (need seconds for h = 1..H)"),
    ({"a": (1.0, float("nan"))}, None, "attention curve of 'a' has a negative or non-finite time: (1.0, nan)"),
    ({"a": (1.0,)}, {"z": 1.0}, "extra_cost_s names backends without a curve: ['z'] (curves: ['a'])"),
    ({"a": (1.0,)}, {"a": -1.0}, "extra_cost_s['a'] must be a finite time >= 0, got -1.0"),
])
def test_bad_inputs_are_rejected(curves, extra, message):
    with pytest.raises(ValueError) as err:
        allocate_heads(curves, extra)
    assert str(err.value) == message


def test_bad_drop_factor_and_bad_splits_are_rejected():
    with pytest.raises(ValueError, match=r"drop_factor must be a finite number > 0, got 0"):
        allocate_heads({"a": (1.0,)}, drop_factor=0)
    with pytest.raises(ValueError, match=r"head counts must be integers >= 1, got \{'a': 0\}"):
        HeadSplit({"a": 0}, 1.0, ("a", 1.0))
    with pytest.raises(ValueError, match="both dropped and given heads"):
        HeadSplit({"a": 1}, 1.0, ("a", 1.0), ("a",))


# profile_with_head_split: what the partitioner sees of a split device ------------------------------

def _split_profile():
    """H = 4. On mnn:cpu:t1 the encoder takes 30 + 60 ms (20 ms of it MNN's re-run of the forward),
    its attention alone 58 ms; 2 + 2 heads over mnn and torch take max(20, 22) = 22 ms."""
    from ir.profile import BackendProfile, BlockCost, DeviceProfile

    mnn = BackendProfile("mnn:cpu:t1", {"enc": BlockCost(0.030, 0.060, 0.020, 1000), "emb": BlockCost(0.010, 0.020)},
                         {"enc": AttentionCurve((0.010, 0.020, 0.030, 0.058))})
    torch = BackendProfile("torch:cpu:t1", {"enc": BlockCost(0.040, 0.080), "emb": BlockCost(0.001, 0.002)},
                           {"enc": AttentionCurve((0.012, 0.022, 0.032, 0.060))})
    small = BackendProfile("mnn:cpu:t2", {"enc": BlockCost(0.010, 0.020), "emb": BlockCost(0.010, 0.020)},
                           {"enc": AttentionCurve((0.010, 0.020, 0.030, 0.058))})
    return DeviceProfile("box", "tiny", 2, 12, (mnn, torch, small), memory_available_bytes=1 << 30,
                         runtime_overhead_bytes=47 * MIB, split_child_bytes={"mnn": 50 * MIB, "torch": 300 * MIB})


MIB = 2**20


def _costs(profile, backend):
    return {sig: (c.forward_s, c.backward_s, c.recompute_s, c.workspace_bytes)
            for sig, c in profile.backend(backend).blocks.items()}


def test_profile_with_head_split_lowers_the_attention_blocks_in_proportion():
    from planner.heads import profile_with_head_split

    profile = _split_profile()
    before = _costs(profile, "mnn:cpu:t1")
    got = profile_with_head_split(profile, "mnn:cpu:t1", {"mnn:cpu:t1": 2, "torch:cpu:t1": 2})
    # saving 58 - 22 = 36 ms of the block's 90 ms: 54 ms stay, forward and backward keep 60% each
    f, b, r, ws = _costs(got, "mnn:cpu:t1")["enc"]
    assert (f, b, r, ws) == (pytest.approx(0.018), pytest.approx(0.036), pytest.approx(0.012), 1000)
    assert _costs(got, "mnn:cpu:t1")["emb"] == before["emb"]  # no attention: unchanged
    for other in ("torch:cpu:t1", "mnn:cpu:t2"):  # only the device's own backend changes
        assert _costs(got, other) == _costs(profile, other)
    assert _costs(profile, "mnn:cpu:t1") == before  # pure: the input is untouched
    assert got.memory_available_bytes == profile.memory_available_bytes and got.name == profile.name
    # the allocator's own answer gives the same: its predicted_s is the 22 ms used above
    split = allocate_heads({b: profile.backend(b).attention["enc"] for b in ("mnn:cpu:t1", "torch:cpu:t1")})
    assert split.heads == {"mnn:cpu:t1": 2, "torch:cpu:t1": 2} and split.predicted_s == pytest.approx(0.022)
    assert _costs(profile_with_head_split(profile, "mnn:cpu:t1", split), "mnn:cpu:t1") == _costs(got, "mnn:cpu:t1")


def test_profile_with_head_split_extra_costs_clamping_and_no_raise():
    from planner.heads import profile_with_head_split

    profile = _split_profile()
    split = {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}
    # 5 ms extra on torch: split time max(20, 27) = 27 ms, saving 31 ms of 90: 59/90 stays
    f, b, r, _ = _costs(profile_with_head_split(profile, "mnn:cpu:t1", split, {"torch:cpu:t1": 0.005}),
                        "mnn:cpu:t1")["enc"]
    assert (f, b, r) == (pytest.approx(0.030 * 59 / 90), pytest.approx(0.060 * 59 / 90), pytest.approx(0.020 * 59 / 90))
    # a block of 30 ms on mnn:cpu:t2 cannot lose 36 ms: it goes to 0, not below
    assert _costs(profile_with_head_split(profile, "mnn:cpu:t2", split), "mnn:cpu:t2")["enc"] == (0.0, 0.0, 0.0, 0)
    # a "split" slower than the backend alone (torch 60 ms vs mnn 58 ms) never raises the cost
    slower = profile_with_head_split(profile, "mnn:cpu:t1", {"torch:cpu:t1": 4})
    assert _costs(slower, "mnn:cpu:t1") == _costs(profile, "mnn:cpu:t1")
    # zero-head entries are ignored; backend None is the profile's fastest (mnn:cpu:t2 here)
    fastest = profile_with_head_split(profile, None, {"mnn:cpu:t1": 2, "torch:cpu:t1": 2, "mnn:cpu:t2": 0})
    assert _costs(fastest, "mnn:cpu:t2")["enc"] == (0.0, 0.0, 0.0, 0)
    assert _costs(fastest, "mnn:cpu:t1") == _costs(profile, "mnn:cpu:t1")


def test_profile_with_head_split_without_curves_or_with_bad_input():
    import dataclasses

    from planner.heads import profile_with_head_split

    profile = _split_profile()
    # torch has no curve for the block: no measurement, no credit
    bare = dataclasses.replace(profile, backends=tuple(
        dataclasses.replace(b, attention={}) if b.backend == "torch:cpu:t1" else b for b in profile.backends))
    assert _costs(profile_with_head_split(bare, "mnn:cpu:t1", {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}),
                  "mnn:cpu:t1") == _costs(profile, "mnn:cpu:t1")
    with pytest.raises(ValueError, match=r"names backends \['gpu:0'\] that profile 'box' lacks"):
        profile_with_head_split(profile, "mnn:cpu:t1", {"mnn:cpu:t1": 2, "gpu:0": 2})
    with pytest.raises(ValueError, match="gives no backend a head"):
        profile_with_head_split(profile, "mnn:cpu:t1", {"mnn:cpu:t1": 0})
    with pytest.raises(ValueError, match=r"block signature enc: the attention curves cover \[4\] heads but the split"):
        profile_with_head_split(profile, "mnn:cpu:t1", {"mnn:cpu:t1": 2, "torch:cpu:t1": 3})
    with pytest.raises(KeyError, match="has no backend 'mnn:cpu:t9'"):
        profile_with_head_split(profile, "mnn:cpu:t9", {"mnn:cpu:t1": 4})


# profile_with_head_split: the memory of the split's child processes -------------------------------

@pytest.mark.parametrize("split, children, added_mib", [
    # torch stays in the worker's process, mnn runs in a child: 47 + 50 MiB, and the worker now
    # imports torch: + (300 - 50) MiB, a torch child's bytes less an MNN child's
    ({"mnn:cpu:t1": 2, "torch:cpu:t1": 2}, ["mnn:cpu:t1"], 50 + 250),
    # no torch: the first backend stays, the second is a child
    ({"mnn:cpu:t1": 2, "mnn:cpu:t2": 2}, ["mnn:cpu:t2"], 50),
    # two MNN children around the in-process torch one: 2 x 50
    ({"mnn:cpu:t1": 1, "torch:cpu:t1": 2, "mnn:cpu:t2": 1}, ["mnn:cpu:t1", "mnn:cpu:t2"], 100 + 250),
    # one backend (the zero-head ones do not run): nothing runs apart
    ({"torch:cpu:t1": 4, "mnn:cpu:t1": 0}, [], 0),
])
def test_profile_with_head_split_charges_each_child_process(split, children, added_mib):
    import warnings

    from planner.heads import profile_with_head_split, split_child_processes

    profile = _split_profile()
    assert split_child_processes(split) == children
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every needed figure is in the profile: no warning
        got = profile_with_head_split(profile, "mnn:cpu:t1", split)
    assert got.runtime_overhead_bytes == (47 + added_mib) * MIB
    assert profile.runtime_overhead_bytes == 47 * MIB  # pure
    assert got.split_child_bytes == profile.split_child_bytes


def test_profile_with_head_split_charges_a_torch_child():
    """Two torch backends: the first stays in the process, the second is a torch child (300 MiB),
    and the MNN one is a child too (50 MiB), and the worker imports torch (300 - 50 MiB)."""
    import dataclasses

    from ir.profile import BackendProfile, BlockCost
    from planner.heads import profile_with_head_split, split_child_processes

    base = _split_profile()
    torch2 = BackendProfile("torch:cpu:t2", {"enc": BlockCost(0.050, 0.090)},
                            {"enc": AttentionCurve((0.012, 0.022, 0.032, 0.060))})
    profile = dataclasses.replace(base, backends=base.backends + (torch2,))
    split = {"mnn:cpu:t1": 1, "torch:cpu:t1": 2, "torch:cpu:t2": 1}
    assert split_child_processes(split) == ["mnn:cpu:t1", "torch:cpu:t2"]
    assert profile_with_head_split(profile, "mnn:cpu:t1", split).runtime_overhead_bytes == (47 + 50 + 300 + 250) * MIB


def test_a_profile_without_the_child_figure_warns_and_counts_zero():
    import dataclasses

    from planner.heads import profile_with_head_split

    old = dataclasses.replace(_split_profile(), split_child_bytes={"torch": 300 * MIB})  # no "mnn"
    with pytest.warns(UserWarning, match=r"profile 'box' has no measured memory of a 'mnn' head-split child "
                                         r"process .* Re-run `confidant profile` on device 'box'"):
        got = profile_with_head_split(old, "mnn:cpu:t1", {"mnn:cpu:t1": 2, "torch:cpu:t1": 2})
    assert got.runtime_overhead_bytes == 47 * MIB
    # the block costs are lowered as with the figure
    assert _costs(got, "mnn:cpu:t1") == _costs(profile_with_head_split(_split_profile(), "mnn:cpu:t1",
                                                                       {"mnn:cpu:t1": 2, "torch:cpu:t1": 2}),
                                               "mnn:cpu:t1")


def test_split_child_processes_matches_the_runtime():
    """The planner's restatement of which backends run in child processes against the placement
    `runtime.engines.split.attention.SplitAttention` really makes (tiny shapes; MNN children start in ~0.1 s)."""
    import numpy as np

    pytest.importorskip("torch")
    from planner.heads import split_child_processes
    from runtime.engines.split.attention import WEIGHT_NAMES, SplitAttention

    heads, head_size, batch, seq = 3, 4, 1, 4
    hidden = heads * head_size
    w = {n: np.zeros((hidden, hidden) if n.startswith("W") else (hidden,), np.float32) for n in WEIGHT_NAMES}
    for alloc in ({"mnn:cpu:t1": 2, "mnn:cpu:t2": 1},
                  {"mnn:cpu:t1": 1, "torch:cpu:t1": 1, "mnn:cpu:t2": 1},
                  {"mnn:cpu:t1": 3, "torch:cpu:t1": 0}):
        with SplitAttention(w, heads, head_size, alloc, batch, seq, (batch, 1, 1, seq)) as sa:
            placement = sa.placement
        assert sorted(b for b, where in placement.items() if where == "child") == sorted(split_child_processes(alloc))
