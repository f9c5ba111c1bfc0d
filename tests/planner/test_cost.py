"""The cost model (planner.cost) on a hand-built four-block graph and two device profiles: every
number is checked against a hand computation, and the in-flight and weight-version counts
against the schedules' own action lists."""
from __future__ import annotations

import pytest

from ir.partition import Partition, StageAssignment, StageCost
from ir.profile import BackendProfile, DeviceProfile, Link
from ir.verify import peak_weight_versions
from planner.cluster import Cluster, DeviceSpec
from planner.cost import (block_input_bytes, boundary_link_s, compute_s, in_flight_microbatches, predicted_step_s, stage_costs,
                          stage_memory_bytes, stage_memory_terms, stage_time_s, stashed_weight_versions, weight_copies)
from planner.schedule import COMPUTE_ORDERS, peak_in_flight
from support import HEAD, tiny_cluster, tiny_graph


def _reversed() -> Partition:
    return Partition((StageAssignment(0, "b", 0, 1), StageAssignment(1, "a", 2, 3)), "manual")


def _two_stages() -> Partition:
    return Partition((StageAssignment(0, "a", 0, 1), StageAssignment(1, "b", 2, 3)), "manual")


def test_compute_uses_the_chosen_backend_and_sums_the_blocks():
    g, cl = tiny_graph(), tiny_cluster()
    assert compute_s(g, cl.device("a"), 0, 1) == pytest.approx((0.011, 0.022))
    # b's profile reads no re-run of the forward: its encoder's is priced half its forward (0.010), its task
    # head's half of 0.001 (`planner.cost.mnn_rerun_floor`); a's encoder re-run (0.005) is that already
    assert compute_s(g, cl.device("b"), 2, 3) == pytest.approx((0.021, 0.041 + 0.010 + 0.0005))
    assert block_input_bytes(g) == (0, 400, 400, 400)


def test_memory_by_hand():
    g, a, b = tiny_graph(), tiny_cluster().device("a"), tiny_cluster().device("b")
    # stage 0 of 2 on a, blocks 0-1: params 3000, stashed inputs 0 + 400, workspace 50 + 300, overhead 5000
    # 1f1b-flush, sgd: 1 weight + 1 gradient + 1 momentum = 3 copies; min(p-s, m) = 2 in flight
    assert stage_memory_bytes(g, a, 0, 1, 0, 2, "1f1b-flush", 4, "sgd") == 3 * 3000 + 2 * 400 + 350 + 5000 == 15150
    # 1f1b-stash holds the weights twice and one old version on stage 0 of 2 (p-s-1), and no gradient
    # sum (an update after every backward); adamw two moments
    assert stage_memory_bytes(g, a, 0, 1, 0, 2, "1f1b-stash", 4, "sgd") == 4 * 3000 + 800 + 350 + 5000
    assert stage_memory_bytes(g, a, 0, 1, 0, 2, "1f1b-stash", 4, "adamw") == 5 * 3000 + 800 + 350 + 5000
    # gpipe holds all m = 4 micro-batches
    assert stage_memory_bytes(g, a, 0, 1, 0, 2, "gpipe", 4, "sgd") == 3 * 3000 + 4 * 400 + 350 + 5000
    # the last stage: one micro-batch in flight, no old versions even under stash, and its weights
    # once (nothing in flight at its updates): weight and two moments
    assert stage_memory_bytes(g, b, 2, 3, 1, 2, "1f1b-stash", 4, "adamw") == 3 * 2100 + 800 + 310 + 7000


def test_stage_costs_and_step_times_by_hand():
    g, cl = tiny_graph(), tiny_cluster()
    costs = stage_costs(g, cl, _two_stages(), "1f1b-flush", 4, "sgd")
    link = 400 / 1e6 + 0.0005  # the a-b pair link, one direction
    expected = [StageCost(0, "a", 0.011, 0.022, 0.0, link, 0.0, 15150, 30_000),
                StageCost(1, "b", 0.021, 0.041, 0.0, 0.0, link, 3 * 2100 + 800 + 310 + 7000, 20_000)]
    for got, want in zip(costs, expected):
        assert (got.stage, got.device, got.memory_bytes, got.memory_budget_bytes) == \
            (want.stage, want.device, want.memory_bytes, want.memory_budget_bytes)
        assert (got.forward_s, got.backward_s, got.send_act_s, got.send_grad_s) == pytest.approx(
            (want.forward_s, want.backward_s, want.send_act_s, want.send_grad_s))
    t0, t1 = 0.033 + link, 0.062 + link
    assert [stage_time_s(c) for c in costs] == pytest.approx([t0, t1])
    # DESIGN: flush = sum of stage times + (m-1) x slowest; async = m x max(slowest f+b, slowest link)
    assert predicted_step_s(costs, "1f1b-flush", 4) == pytest.approx(t0 + t1 + 3 * t1)
    assert predicted_step_s(costs, "gpipe", 1) == pytest.approx(t0 + t1)
    assert predicted_step_s(costs, "1f1b-stash", 4) == pytest.approx(4 * 0.062)


def test_async_step_is_link_bound_on_a_slow_link():
    g, cl = tiny_graph(), tiny_cluster()
    part = Partition((StageAssignment(0, "b", 0, 1), StageAssignment(1, "c", 2, 3)), "manual")
    costs = stage_costs(g, cl, part, "1f1b-stash", 3, "sgd")
    link = 400 / 1e5 + 0.001  # b-c uses the default link
    assert (costs[0].send_act_s, costs[1].send_grad_s) == pytest.approx((link, link))
    # compute-bound: b's 0.066 s and its encoder's re-run, read 0 and priced half its forward (0.010 s)
    assert predicted_step_s(costs, "1f1b-stash", 3) == pytest.approx(3 * 0.076)
    slow = Cluster(cl.devices, Link(1e4, 0.01), cl.links)
    costs = stage_costs(g, slow, part, "1f1b-stash", 3, "sgd")
    link = 400 / 1e4 + 0.01
    assert predicted_step_s(costs, "1f1b-stash", 3) == pytest.approx(3 * 2 * link)  # link-bound: 0.1 s > 0.076 s
    one = stage_costs(g, cl, Partition((StageAssignment(0, "a", 0, 3),), "manual"), "1f1b-stash", 3, "sgd")
    assert (one[0].send_act_s, one[0].send_grad_s) == (0.0, 0.0)
    # a single stage runs each backward right after its forward: MNN's re-run (2 x 0.005 s) is skipped
    assert predicted_step_s(one, "1f1b-stash", 3) == pytest.approx(3 * (0.0215 + 0.0425 - 0.010))


def _order(name: str, p: int, m: int):
    # 2bw needs an update at most every p backwards: its smallest cadence
    return COMPUTE_ORDERS[name](p, m, p) if name == "2bw" else COMPUTE_ORDERS[name](p, m)


@pytest.mark.parametrize("name", sorted(COMPUTE_ORDERS))
def test_forward_reuse_matches_the_schedules_action_order(name):
    """reuses_forward(s) holds exactly when, in the stage's own action list, every backward comes
    right after the forward of the same micro-batch (what lets the MNN engine keep its caches)."""
    from planner.cost import reuses_forward

    for p in range(1, 5):
        for m in range(1, 7):
            sch = _order(name, p, m)
            for s in range(p):
                compute = [a for a in sch.actions[s] if a.kind in ("F", "B")]
                follows = all(i > 0 and compute[i - 1].kind == "F" and compute[i - 1].microbatch == a.microbatch
                              for i, a in enumerate(compute) if a.kind == "B")
                assert reuses_forward(name, p, s, m) == follows, (p, s, m)


def test_the_last_stage_is_charged_no_forward_re_run():
    g, cl = tiny_graph(), tiny_cluster()
    flush = stage_costs(g, cl, _reversed(), "1f1b-flush", 4, "sgd")
    gpipe = stage_costs(g, cl, _reversed(), "gpipe", 4, "sgd")
    # stage 1 (device a, blocks 2-3: one encoder with 0.005 s of re-run, the head read none and priced half
    # its forward, 0.00025 s) keeps them only under gpipe
    assert flush[1].backward_s == pytest.approx(0.020 + 0.0005 - 0.005)
    assert gpipe[1].backward_s == pytest.approx(0.020 + 0.0005 + 0.00025)
    assert flush[0].backward_s == gpipe[0].backward_s  # device b measured no re-run


@pytest.mark.parametrize("name", sorted(COMPUTE_ORDERS))
def test_in_flight_and_weight_versions_match_the_schedules(name):
    for p in range(1, 6):
        for m in range(1, 10):
            sch = _order(name, p, m)
            assert tuple(in_flight_microbatches(name, p, s, m) for s in range(p)) == peak_in_flight(sch), (p, m)
            model = tuple(stashed_weight_versions(name, p, s, m) + 1 for s in range(p))
            if name == "2bw" and m < 2 * p:
                # the model knows no cadence: it charges 2bw's two versions wherever micro-batches
                # are in flight, which a run shorter than two updates may not reach
                assert all(a >= b for a, b in zip(model, peak_weight_versions(sch))), (p, m)
            else:
                assert model == peak_weight_versions(sch), (p, m)


def test_weight_versions_reach_pipedreams_numbers_in_the_steady_state():
    assert [stashed_weight_versions("1f1b-stash", 4, s, 100) for s in range(4)] == [3, 2, 1, 0]
    # and the current weights twice where forwards are in flight at an update (not on the last
    # stage), and no gradient sum (an update after every backward)
    assert [weight_copies("1f1b-stash", "adamw", 4, s, 100) for s in range(4)] == [7, 6, 5, 3]
    assert [weight_copies("2bw", "adamw", 4, s, 100) for s in range(4)] == [6, 6, 6, 4]
    assert [weight_copies("1f1b-flush", "sgd", 4, s, 100) for s in range(4)] == [3, 3, 3, 3]


def test_errors_name_device_and_block():
    g, cl = tiny_graph(), tiny_cluster()
    prof = cl.device("b").profile
    blocks = dict(prof.backends[0].blocks)
    del blocks[HEAD]
    spec = DeviceSpec("b", "tcp://b:1", DeviceProfile("b", "tiny", 8, 32, (BackendProfile("mnn:cpu:t2", blocks),), 10**6),
                      1000)
    with pytest.raises(ValueError) as exc:
        compute_s(g, spec, 0, 3)
    assert str(exc.value) == (f"device 'b': its profile 'b' (backend 'mnn:cpu:t2') has no cost for block 3 'head' "
                              f"(signature {HEAD}); profile the device with model 'tiny' (`confidant profile`, with "
                              f"the plan's --lora settings if it has any)")
    with pytest.raises(ValueError, match="unknown schedule 'zb'; valid names: gpipe, 1f1b-flush, 1f1b-stash"):
        stage_costs(g, cl, _two_stages(), "zb", 4, "sgd")
    with pytest.raises(ValueError, match="unknown optimizer 'adam': choose sgd or adamw"):
        stage_costs(g, cl, _two_stages(), "gpipe", 4, "adam")
    with pytest.raises(ValueError, match="partition stage 1 runs blocks 3..3; expected it to start at block 2"):
        stage_costs(g, cl, Partition((StageAssignment(0, "a", 0, 1), StageAssignment(1, "b", 3, 3)), "manual"),
                    "gpipe", 4, "sgd")
    with pytest.raises(ValueError, match="partition covers blocks 0..1 of 4"):
        stage_costs(g, cl, Partition((StageAssignment(0, "a", 0, 1),), "manual"), "gpipe", 4, "sgd")


def test_optimizer_update_time_from_the_profile_enters_the_step():
    """update_s = stage parameter bytes x the profiled seconds per byte; flush schedules add the
    slowest update once per batch, 1f1b-stash adds it to every micro-batch's period."""
    import dataclasses

    g, cl = tiny_graph(), tiny_cluster()
    rate = 1e-6
    devices = tuple(dataclasses.replace(d, profile=dataclasses.replace(d.profile, update_s_per_param_byte={"adamw": rate}))
                    for d in cl.devices)
    cl2 = dataclasses.replace(cl, devices=devices)
    plain = stage_costs(g, cl, _two_stages(), "1f1b-flush", 4, "adamw")
    costs = stage_costs(g, cl2, _two_stages(), "1f1b-flush", 4, "adamw")
    assert [c.update_s for c in plain] == [0.0, 0.0]
    assert [c.update_s for c in costs] == pytest.approx([3000 * rate, 2100 * rate])
    assert predicted_step_s(costs, "1f1b-flush", 4) == pytest.approx(predicted_step_s(plain, "1f1b-flush", 4) + 3000 * rate)
    stash = stage_costs(g, cl2, _two_stages(), "1f1b-stash", 4, "adamw")
    slowest = max(c.forward_s + c.backward_s + c.update_s for c in stash)
    assert predicted_step_s(stash, "1f1b-stash", 4) == pytest.approx(4 * max(slowest, *boundary_link_s(stash)))


def test_a_backends_own_optimizer_kernel_sets_the_update_time():
    """A backend the profile measured a native AdamW step for (PyTorch's fused kernel) is charged
    that rate, on a fixed backend and on an auto device's pick alike; SGD, which it steps with
    numpy, keeps the device's rate; so does a backend without one."""
    import dataclasses

    from planner.cluster import update_rate
    from planner.partition.instance import make_instance

    g, cl = tiny_graph(), tiny_cluster()
    numpy_rate, native_rate = 4e-6, 1e-6

    def with_rates(d, backend, picked=None):
        b = d.profile.backends[0]
        fast = dataclasses.replace(b, backend="torch:cpu:t1", update_s_per_param_byte={"adamw": native_rate})
        plain = dataclasses.replace(b, backend="mnn:cpu:t1")
        prof = dataclasses.replace(d.profile, backends=(plain, fast),
                                   update_s_per_param_byte={"adamw": numpy_rate, "sgd": numpy_rate})
        return dataclasses.replace(d, profile=prof, backend=backend, picked=picked)

    for backend, picked, want in [("torch:cpu:t1", None, native_rate), ("mnn:cpu:t1", None, numpy_rate),
                                  (None, "torch:cpu:t1", native_rate), (None, "mnn:cpu:t1", numpy_rate)]:
        cl2 = dataclasses.replace(cl, devices=tuple(with_rates(d, backend, picked) for d in cl.devices))
        assert update_rate(cl2.devices[0], "adamw") == want
        assert update_rate(cl2.devices[0], "sgd") == numpy_rate
        costs = stage_costs(g, cl2, _two_stages(), "1f1b-flush", 4, "adamw")
        assert [c.update_s for c in costs] == pytest.approx([3000 * want, 2100 * want])
        inst = make_instance(g, cl2, "1f1b-flush", 4, "adamw")
        assert inst.update_us == tuple(tuple(round(b.params_bytes * want * 1e6) for b in g.blocks)
                                       for _ in cl2.devices)


def test_gradient_accumulation_is_charged_to_the_backward_under_flush_schedules():
    """m micro-batches' gradients are summed before one update: m-1 additions of the stage's
    parameter bytes per step, (m-1)/m per micro-batch; 1f1b-stash updates after every backward."""
    import dataclasses

    g, cl = tiny_graph(), tiny_cluster()
    rate = 2e-6
    cl2 = dataclasses.replace(cl, devices=tuple(
        dataclasses.replace(d, profile=dataclasses.replace(d.profile, accumulate_s_per_param_byte=rate))
        for d in cl.devices))
    for schedule, share in (("1f1b-flush", 3 / 4), ("gpipe", 3 / 4), ("1f1b-stash", 0.0)):
        plain = stage_costs(g, cl, _two_stages(), schedule, 4, "sgd")
        costs = stage_costs(g, cl2, _two_stages(), schedule, 4, "sgd")
        # stage 0 holds 1000 + 2000 parameter bytes, stage 1 2000 + 100
        assert [c.backward_s - q.backward_s for c, q in zip(costs, plain)] == pytest.approx(
            [3000 * rate * share, 2100 * rate * share])
        assert [c.forward_s for c in costs] == [q.forward_s for q in plain]
    one = stage_costs(g, cl2, _two_stages(), "1f1b-flush", 1, "sgd")
    assert [c.backward_s for c in one] == [c.backward_s for c in stage_costs(g, cl, _two_stages(), "1f1b-flush", 1, "sgd")]


def test_weight_stashing_keeps_no_old_version_of_a_table_only_looked_up(tiny_checkpoint, export_dir):
    """Under 1f1b-stash a stage holds its weights twice on MNN (once on PyTorch, whose new tensors
    are an old version's charge, and never all its weight gradients: it steps each as it comes)
    plus p-s-1 old versions, but its embedding tables once (no lookup
    backward reads them, both engines step them in place, and a forward re-run replays the rows its
    first run gathered): on MNN, and on PyTorch keeping or recomputing its activations.
    The partition instance (what every solver checks) says the same."""
    from ir.graph import block_signature
    from ir.profile import BlockCost
    from planner.cost import row_gradient_delta_bytes, stage_params_bytes, unversioned_bytes
    from planner.onnx_import import load_model
    from planner.partition import make_instance, manual_partition
    from support import export_onnx

    g = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), 2, 12)
    costs = {block_signature(b): BlockCost(1e-3, 2e-3, 0.0, 100) for b in g.blocks}
    tables = {n.inputs[0] for n in g.nodes if n.op == "Gather"} & set(g.blocks[0].params)
    nbytes = sum(int(g.constants[t].nbytes) for t in tables)
    params = stage_params_bytes(g, 0, 1)
    assert nbytes > 0 and params > nbytes

    def device(name, backend, activations):
        profile = DeviceProfile(name, g.name, g.batch, g.seq, (BackendProfile(backend, costs),), 10**12)
        return DeviceSpec(name, f"tcp://{name}:1", profile, 10**12, backend, activations=activations)

    # PyTorch holds no second current copy, and steps each weight as its gradient comes (the
    # workspace's gradients come off): `stepped`
    for backend, activations, second, stepped in (("mnn:cpu:t1", None, 1, 0), ("torch:cpu:t1", "keep", 0, 1),
                                                  ("torch:cpu:t1", "recompute", 0, 1)):
        dev = device("d0", backend, activations)
        assert unversioned_bytes(g, 0, 1, dev) == nbytes
        stash = stage_memory_bytes(g, dev, 0, 1, 0, 3, "1f1b-stash", 4, "sgd")
        flush = stage_memory_bytes(g, dev, 0, 1, 0, 3, "1f1b-flush", 4, "sgd")
        # a second current copy of the weights on MNN, and stage 0 of 3 holds two old versions; no
        # gradient sum (nor the table's rows summed, which the flush holds instead of its dense gradient)
        assert stashed_weight_versions("1f1b-stash", 3, 0, 4) == 2
        rows = row_gradient_delta_bytes(g, 0, 1, dev, 4, "1f1b-flush")
        assert stash - flush == (params - nbytes) * (second + 2 - stepped) - params - rows, backend
        cluster = Cluster(tuple(device(f"d{i}", backend, activations) for i in range(3)), Link(1e9, 0.0))
        inst = make_instance(g, cluster, "1f1b-stash", 4, "sgd")
        n = len(g.blocks)
        plan = manual_partition(inst, ["d0", "d1", "d2"], [2, n - 1])
        assert plan.stages[0].memory_bytes == stash, backend


def test_the_tables_of_a_block_range_are_those_its_blocks_list(chat_llama):
    """`_tables` finds a range's embedding tables by searching each table's blocks (it is asked for
    every prefix of the blocks, so a scan of the range's parameters made planning quadratic in
    depth): the same sets as that scan, for every range of a tied Llama (its table read by the LM
    head too) and of the tiny BERT, and the same as before for the memory model's figures."""
    from planner.cost import _graph_tables, _tables
    from planner.onnx_import import load_model

    llama = load_model(chat_llama[0], 1, 16)
    assert _graph_tables(llama)[1]  # a table another op reads too: the tied head
    for graph in (llama, tiny_graph()):
        tables, read = _graph_tables(graph)[:2]
        n = len(graph.blocks)
        for first in range(n):
            for last in range(first, n):
                scanned = {p for b in graph.blocks[first:last + 1] for p in b.params} & tables
                assert _tables(graph, first, last) == (scanned, scanned & read), (graph.name, first, last)


def test_stash_versions_and_gradient_sum_follow_update_every():
    """1f1b-stash updating every k backwards: the old versions each stage keeps are those of its
    compute schedule (`ir.verify.peak_weight_versions`; the closed form where k = 1), fewer as k
    grows, and a stage holds a gradient sum once k > 1 (2bw always does; flush schedules too)."""
    from planner.cost import gradient_copies
    from planner.schedule import one_f_one_b_stash

    for p in range(1, 5):
        for m in range(1, 9):
            for k in range(1, 5):
                peaks = peak_weight_versions(one_f_one_b_stash(p, m, k))
                assert [stashed_weight_versions("1f1b-stash", p, s, m, k) for s in range(p)] == [x - 1 for x in peaks]
    assert [stashed_weight_versions("1f1b-stash", 4, 0, 8, k) for k in (1, 2, 3, 4)] == [3, 2, 1, 1]
    assert (gradient_copies("1f1b-stash"), gradient_copies("1f1b-stash", 2), gradient_copies("2bw", 4),
            gradient_copies("1f1b-flush")) == (0, 1, 1, 1)
    with pytest.raises(ValueError, match="update_every must be an int >= 1, got 0"):
        gradient_copies("1f1b-stash", 0)


def test_an_update_reading_one_backward_holds_no_gradient_sum():
    """A step of one micro-batch updated after it (a flush schedule with m = 1, `train-local`'s step) is
    1f1b-stash's update after every backward: the sum the backward starts is its own gradients
    (`runtime.engines.base.accumulate` takes the first as it is), which the workspace charges. Hand-computed:
    AdamW, one stage, per parameter byte 1 (weights) + 2 (moments) + 0 (no sum) = 3 at m = 1, 4 from m = 2;
    SGD 1 + 1 + 0 = 2."""
    from planner.cost import gradient_copies, summed_backwards, weight_copies

    assert [summed_backwards(s, 4, 2) for s in ("gpipe", "1f1b-flush", "1f1b-stash", "2bw")] == [4, 4, 2, 2]
    assert [gradient_copies(s, microbatches=1) for s in ("gpipe", "1f1b-flush", "zb-h1", "1f1b-stash")] == [0, 0, 0, 0]
    assert [gradient_copies(s, microbatches=2) for s in ("gpipe", "1f1b-flush", "zb-h1")] == [1, 1, 1]
    assert gradient_copies("1f1b-stash", 2, microbatches=1) == 1  # two backwards an update, across steps
    assert gradient_copies("2bw", 1, microbatches=1) == 1  # charged its sum, as before
    assert gradient_copies("1f1b-flush") == 1  # micro-batches not given: more than one
    assert [weight_copies("1f1b-flush", "adamw", 1, 0, m) for m in (1, 2, 8)] == [3, 4, 4]
    assert weight_copies("gpipe", "sgd", 2, 1, 1) == 2


def test_stash_time_counts_one_update_per_update_every_backwards():
    """1f1b-stash and 2bw with an update after every k backwards: a micro-batch costs its forward,
    its backward with (k-1)/k gradient additions, and 1/k of an optimizer step; the partition
    instance (what the solvers and the DP price) says the same as stage_costs + predicted_step_s."""
    import dataclasses

    from planner.cost import accumulate_s, accumulated_share, stage_params_bytes, update_s
    from planner.partition import make_instance, manual_partition, predicted_step_us

    g, cl = tiny_graph(), tiny_cluster()
    cl = dataclasses.replace(cl, devices=tuple(dataclasses.replace(d, profile=dataclasses.replace(
        d.profile, update_s_per_param_byte={"sgd": 2e-6}, accumulate_s_per_param_byte=1e-6)) for d in cl.devices))
    assert [accumulated_share(s, 4, k) for s, k in (("1f1b-stash", 1), ("1f1b-stash", 4), ("2bw", 2),
                                                     ("1f1b-flush", 1))] == [0.0, 0.75, 0.5, 0.75]
    a = cl.device("a")
    params = stage_params_bytes(g, 0, 1)
    assert accumulate_s(g, a, 0, 1, "1f1b-stash", 4, 4) == pytest.approx(params * 1e-6 * 0.75)
    one = stage_costs(g, cl, _two_stages(), "1f1b-stash", 8, "sgd")
    for k in (1, 2, 4):
        costs = stage_costs(g, cl, _two_stages(), "1f1b-stash", 8, "sgd", k)
        for c, c1 in zip(costs, one):
            first, last = _two_stages().ranges[c.stage]
            added = stage_params_bytes(g, first, last) * 1e-6 * (k - 1) / k
            assert c.backward_s == pytest.approx(c1.backward_s + added)
            assert c.update_s > 0 and c.update_s == pytest.approx(update_s(g, cl.device(c.device), first, last, "sgd"))
        period = max(max(c.forward_s + c.backward_s + c.update_s / k for c in costs), *boundary_link_s(costs))
        assert predicted_step_s(costs, "1f1b-stash", 8, k) == pytest.approx(8 * period)
        inst = make_instance(g, cl, "1f1b-stash", 8, "sgd", k)
        assert predicted_step_us(inst, manual_partition(inst, ["a", "b"], [2])) / 1e6 == pytest.approx(
            predicted_step_s(costs, "1f1b-stash", 8, k), rel=1e-4)
    assert (predicted_step_s(stage_costs(g, cl, _two_stages(), "1f1b-stash", 8, "sgd", 4), "1f1b-stash", 8, 4)
            < predicted_step_s(one, "1f1b-stash", 8))


def test_memory_by_hand_on_a_device_that_keeps_activations():
    """A device that keeps every activation of each micro-batch in flight holds each block's kept part
    once more per further micro-batch: checked against a figure computed by hand, through both the
    cost model and the partition instance the solvers read (one formula, `planner.cost.kept_copies`;
    dropping the term fails both)."""
    from dataclasses import replace

    from ir.profile import BlockCost
    from planner.partition.instance import _memory_bytes, make_instance
    from support import EMB, ENC

    costs = {EMB: BlockCost(0.001, 0.002, 0.0, 50, stacked_bytes=40, kept_bytes=30),
             ENC: BlockCost(0.010, 0.020, 0.005, 300, stacked_bytes=200, kept_bytes=120),
             HEAD: BlockCost(0.0005, 0.0005, 0, 10, stacked_bytes=10, kept_bytes=10)}
    profile = DeviceProfile("k", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", costs),), 10**6, 5000)
    keep = DeviceSpec("k", "tcp://k:1", profile, 10**6, "mnn:cpu:t1", activations="keep")
    g = tiny_graph()
    # stage 0 of 2, blocks 0-1, 1f1b-flush with 4 micro-batches: min(p-s, m) = 2 in flight; sgd: 3 copies
    # of 3000 parameter bytes; stashed inputs 2 x (0 + 400); workspace stacked 40 + 200; kept
    # (30 + 120) x (2 - 1) further micro-batch; the largest transient of the stage's blocks 300 - 200; runtime 5000
    want = 3 * 3000 + 2 * 400 + (40 + 200) + (30 + 120) * 1 + 100 + 5000
    assert want == 15290
    assert stage_memory_bytes(g, keep, 0, 1, 0, 2, "1f1b-flush", 4, "sgd") == want
    terms = stage_memory_terms(g, keep, 0, 1, 0, 2, "1f1b-flush", 4, "sgd")
    assert (terms.trainable_bytes, terms.gradient_bytes, terms.optimizer_state_bytes) == (3000, 3000, 3000)
    assert (terms.activation_bytes, terms.kept_activation_bytes, terms.workspace_bytes, terms.runtime_bytes) \
        == (800, 150, 240 + 100, 5000)
    assert terms.by_name()["activations kept"] == 150
    assert terms.total == want and not terms.frozen_bytes
    # gpipe: all 4 in flight, the kept part 3 more times
    assert stage_memory_bytes(g, keep, 0, 1, 0, 2, "gpipe", 4, "sgd") == want + 2 * 400 + 2 * (30 + 120)
    # the same device recomputing holds no kept part
    recompute = replace(keep, activations="recompute")
    assert stage_memory_bytes(g, recompute, 0, 1, 0, 2, "1f1b-flush", 4, "sgd") == want - (30 + 120)
    inst = make_instance(g, Cluster((keep, replace(recompute, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                         "1f1b-flush", 4, "sgd")
    assert _memory_bytes(inst, 0, 0, 1, 0, 2) == want
    assert _memory_bytes(inst, 1, 0, 1, 0, 2) == want - (30 + 120)


def test_the_engines_own_memory_is_charged_per_block_by_hand_through_the_cost_model_and_the_instance():
    """What building a stage's engine holds beyond its weights (`BlockCost.engine_bytes`: MNN's
    graphs of each block, ~1.4 MiB a SmolLM2 layer, charged nowhere before) is a term of its own,
    summed over the stage's blocks, in `stage_memory_terms`, plan.json's terms and the partition
    instance alike; a profile without it charges nothing (older profiles plan as before)."""
    from dataclasses import replace

    from ir.profile import BlockCost
    from planner.cost import block_costs, block_engine_bytes
    from planner.partition.instance import _memory_bytes, make_instance
    from support import EMB, ENC

    costs = {EMB: BlockCost(0.001, 0.002, 0.0, 50, stacked_bytes=40, kept_bytes=30, engine_bytes=7),
             ENC: BlockCost(0.010, 0.020, 0.005, 300, stacked_bytes=200, kept_bytes=120, engine_bytes=11),
             HEAD: BlockCost(0.0005, 0.0005, 0, 10, stacked_bytes=10, kept_bytes=10, engine_bytes=3)}
    profile = DeviceProfile("k", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", costs),), 10**6, 5000)
    dev = DeviceSpec("k", "tcp://k:1", profile, 10**6, "mnn:cpu:t1", activations="recompute")
    g = tiny_graph()
    assert [b.name for b in g.blocks][:2] == ["embeddings", "layer0"]
    # stage 0 of 2, blocks 0-1 (the embeddings and one encoder layer): the figure of the test above
    # on a device that recomputes, plus 7 + 11 of the engine's own
    want = 15290 - (30 + 120) + 7 + 11
    terms = stage_memory_terms(g, dev, 0, 1, 0, 2, "1f1b-flush", 4, "sgd")
    assert terms.engine_bytes == 18 and terms.total == want
    assert stage_memory_bytes(g, dev, 0, 1, 0, 2, "1f1b-flush", 4, "sgd") == want
    assert terms.by_name()["engine"] == 18
    inst = make_instance(g, Cluster((dev, replace(dev, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                         "1f1b-flush", 4, "sgd")
    assert _memory_bytes(inst, 0, 0, 1, 0, 2) == want
    older = DeviceProfile("k", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", {k: replace(c, engine_bytes=None)
                                                                              for k, c in costs.items()}),), 10**6, 5000)
    terms = stage_memory_terms(g, replace(dev, profile=older), 0, 1, 0, 2, "1f1b-flush", 4, "sgd")
    assert terms.engine_bytes == 0 and terms.total == want - 18 and "engine" not in terms.by_name()
    # one rule for a figure not measured, per block and in the instance alike: nothing
    old = replace(dev, profile=older)
    assert [block_engine_bytes(g, old, k, c) for k, c in enumerate(block_costs(g, old))] == [0, 0, 0, 0]
    inst = make_instance(g, Cluster((old, replace(old, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                         "1f1b-flush", 4, "sgd")
    assert _memory_bytes(inst, 0, 0, 1, 0, 2) == want - 18
    # the profile's file keeps the figure
    assert DeviceProfile.from_json(profile.to_json()).backends[0].blocks[ENC].engine_bytes == 11


def _engine_costs_device(embeddings: int, once: int, head: int):
    """The tiny graph's block costs with engine figures (a layer's step 11, its once part `once`, the
    embeddings' and the head's builds as given), their MNN profile and a recomputing device of it."""
    from ir.profile import BlockCost
    from support import EMB, ENC

    costs = {EMB: BlockCost(0.001, 0.002, 0.0, 50, stacked_bytes=40, kept_bytes=30, engine_bytes=embeddings),
             ENC: BlockCost(0.010, 0.020, 0.005, 300, stacked_bytes=200, kept_bytes=120, engine_bytes=11,
                            engine_once_bytes=once),
             HEAD: BlockCost(0.0005, 0.0005, 0, 10, stacked_bytes=10, kept_bytes=10, engine_bytes=head)}
    profile = DeviceProfile("k", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", costs),), 10**6, 5000)
    return costs, profile, DeviceSpec("k", "tcp://k:1", profile, 10**6, "mnn:cpu:t1", activations="recompute")


def test_the_engines_once_a_stage_part_is_charged_once_a_stage_by_hand_through_the_cost_model_and_the_instance():
    """A stage's engine build is a line in its length, measured first in fresh processes (SmolLM2 int4
    5.73 MiB for one layer, 10.22 for three, 29.24 for eleven: ~2.4 a layer and ~3.1 once a stage):
    the profile carries the step per block (`BlockCost.engine_bytes`) and the once part
    (`engine_once_bytes`), and the planner charges a stage of k blocks once + the blocks' steps. Charged
    (three layers' build) / 3 on each layer, an 11-layer stage was ~9 MiB above its build (h52). The
    partition instance charges the same (the once part with the runtime, once a stage); a profile
    without the once part charges what it did."""
    from dataclasses import replace

    from planner.cost import engine_bytes, engine_once_bytes
    from planner.partition.instance import _memory_bytes, make_instance
    from support import ENC

    costs, profile, dev = _engine_costs_device(embeddings=7, once=40, head=3)
    g = tiny_graph()
    assert [b.name for b in g.blocks] == ["embeddings", "layer0", "layer1", "head"]
    assert engine_once_bytes(dev) == 40
    # one layer: its build (40 + 11); two: once + 2 steps, not twice one layer's build
    assert engine_bytes(g, 1, 1, dev) == 40 + 11
    assert engine_bytes(g, 1, 2, dev) == 40 + 2 * 11
    # the embeddings' 7 and the head's 3, each built alone, hold a once part of their own (below 40:
    # nothing of them beyond it; the next test charges what is)
    assert engine_bytes(g, 0, 3, dev) == 40 + 2 * 11
    # the stage of the test above (the embeddings and one layer), its once part on top
    want = 15290 - (30 + 120) + 11 + 40
    terms = stage_memory_terms(g, dev, 0, 1, 0, 2, "1f1b-flush", 4, "sgd")
    assert terms.engine_bytes == 51 and terms.total == want and terms.by_name()["engine"] == 51
    # the instance: each stage of a plan charged the once part once, as the cost model does
    inst = make_instance(g, Cluster((dev, replace(dev, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                         "1f1b-flush", 4, "sgd")
    assert _memory_bytes(inst, 0, 0, 1, 0, 2) == want
    for first, last, s, p in ((2, 3, 1, 2), (1, 2, 0, 2), (0, 3, 0, 1), (1, 1, 0, 2)):
        assert _memory_bytes(inst, 1, first, last, s, p) == stage_memory_bytes(g, dev, first, last, s, p, "1f1b-flush",
                                                                                4, "sgd"), (first, last)
    # a profile made before (no once part): each block's figure as it was, nothing once
    older = DeviceProfile("k", "tiny", 8, 32, (BackendProfile("mnn:cpu:t1", {k: replace(c, engine_once_bytes=None)
                                                                              for k, c in costs.items()}),), 10**6, 5000)
    assert engine_bytes(g, 1, 2, replace(dev, profile=older)) == 2 * 11
    # (the embeddings' 7 charged again: with no once part there is none to come off it)
    assert stage_memory_terms(g, replace(dev, profile=older), 0, 1, 0, 2, "1f1b-flush", 4, "sgd").total == want - 40 + 7
    old = replace(dev, profile=older)
    inst = make_instance(g, Cluster((old, replace(old, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                         "1f1b-flush", 4, "sgd")
    assert _memory_bytes(inst, 0, 0, 1, 0, 2) == want - 40 + 7
    # the profile's file keeps the once part; one written before it loads as not measured
    doc = profile.to_json()
    assert DeviceProfile.from_json(doc).backends[0].blocks[ENC].engine_once_bytes == 40
    del doc["backends"][0]["blocks"][ENC]["engine_once_bytes"]
    assert DeviceProfile.from_json(doc).backends[0].blocks[ENC].engine_once_bytes is None


def test_a_kind_built_alone_is_charged_its_build_less_the_stages_once_part_by_hand_through_the_cost_model_and_the_instance():
    """The embeddings and the LM head have no run of their kind: each is built alone in a fresh child,
    so its figure holds a stage's once part too, which the stage pays once already (SmolLM2 int4 on MNN:
    the head 3.45 MiB, the embeddings 2.11, beside a layer's once part of 3.32; the end stages were
    charged 5.0-5.5 MiB above what a worker built, a middle stage 3.1: benchmarks/MEMORY_NOTES.md, h54).
    By hand: once 4, a layer's step 11, the embeddings built alone 3 (all of it the once part: 0), the
    head 6 (2 beyond it); the instance charges each stage the same."""
    from dataclasses import replace

    from planner.cost import block_costs, block_engine_bytes, engine_bytes
    from planner.partition.instance import _memory_bytes, make_instance

    costs, profile, dev = _engine_costs_device(embeddings=3, once=4, head=6)
    g = tiny_graph()
    assert [block_engine_bytes(g, dev, k, c) for k, c in enumerate(block_costs(g, dev))] == [0, 11, 11, 2]
    assert engine_bytes(g, 0, 0, dev) == 4          # the embeddings alone: the once part (>= its 3)
    assert engine_bytes(g, 3, 3, dev) == 4 + 2      # the head alone: its own build, 6
    assert engine_bytes(g, 0, 1, dev) == 4 + 11     # not 4 + 3 + 11: the once part once
    assert engine_bytes(g, 2, 3, dev) == 4 + 11 + 2
    assert engine_bytes(g, 0, 3, dev) == 4 + 2 * 11 + 2
    inst = make_instance(g, Cluster((dev, replace(dev, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                         "1f1b-flush", 4, "sgd")
    for first, last, s, p in ((0, 1, 0, 2), (2, 3, 1, 2), (0, 0, 0, 2), (3, 3, 1, 2), (0, 3, 0, 1)):
        assert _memory_bytes(inst, 0, first, last, s, p) == stage_memory_bytes(g, dev, first, last, s, p, "1f1b-flush",
                                                                                4, "sgd"), (first, last)
    # a profile without the once part: each figure as measured
    older = replace(dev, profile=DeviceProfile("k", "tiny", 8, 32, (BackendProfile(
        "mnn:cpu:t1", {k: replace(c, engine_once_bytes=None) for k, c in costs.items()}),), 10**6, 5000))
    assert engine_bytes(g, 0, 3, older) == 3 + 2 * 11 + 6


def test_a_device_recomputing_per_block_is_not_charged_the_start_up_only_keeping_pays_by_hand():
    """MNN's profiled start-up (`engine_overhead_bytes`: the first run of the cheapest block and of a layer
    keeping and per block, each less a repeat) is almost all the keeping run's (SmolLM2 int4, each in a
    fresh child: 0.40 / 6.25 / 0.43 MiB), and a fresh MNN worker's first per-block run peaks below the
    profile's warm workspace alone (27.5-27.9 MiB above its build against 30.4): a device recomputing per
    block (or per block with some blocks' caches kept) is charged the runtime and the start-up less
    `caches_start_up_bytes`; keeping or recomputing, all of it; the partition instance the same."""
    from dataclasses import replace

    from ir.profile import BlockCost
    from planner.cluster import runtime_bytes
    from planner.partition.instance import make_instance
    from support import EMB, ENC

    costs = {EMB: BlockCost(0.001, 0.002, 0.0, 50, stacked_bytes=40, kept_bytes=30),
             ENC: BlockCost(0.010, 0.020, 0.005, 300, stacked_bytes=200, kept_bytes=120),
             HEAD: BlockCost(0.0005, 0.0005, 0, 10, stacked_bytes=10, kept_bytes=10)}
    backend = BackendProfile("mnn:cpu:t1", costs, engine_overhead_bytes=9, caches_start_up_bytes=6)
    profile = DeviceProfile("k", "tiny", 8, 32, (backend,), 10**6, 5000)
    dev = DeviceSpec("k", "tcp://k:1", profile, 10**6, "mnn:cpu:t1")
    g = tiny_graph()
    for activations, want in ((None, 5009), ("recompute", 5009), ("keep", 5009), ("per-block", 5003),
                              ("per-block+2", 5003)):
        d = replace(dev, activations=activations)
        assert runtime_bytes(d) == want, activations
        assert stage_memory_terms(g, d, 0, 1, 0, 2, "1f1b-flush", 4, "sgd").runtime_bytes == want
        inst = make_instance(g, Cluster((d, replace(d, name="r", address="tcp://r:1")), Link(1e6, 0.001)),
                             "1f1b-flush", 4, "sgd")
        assert inst.overhead_bytes == (want, want), activations
    # never below the runtime: a part larger than the start-up comes off only up to it
    big = replace(dev, activations="per-block", profile=replace(profile, backends=(replace(backend, caches_start_up_bytes=20),)))
    assert runtime_bytes(big) == 5000
    # the profile's file keeps the part; one written before it loads as 0 (all charged, as then)
    doc = profile.to_json()
    assert DeviceProfile.from_json(doc).backends[0].caches_start_up_bytes == 6
    del doc["backends"][0]["caches_start_up_bytes"]
    assert DeviceProfile.from_json(doc).backends[0].caches_start_up_bytes == 0


def test_a_torch_stage_that_only_looks_up_a_tied_table_is_charged_its_rows_and_the_sum_not_a_dense_gradient(chat_llama):
    """PyTorch's backward of a lookup gives the table's gradient as rows, and the tied exchange's dense
    copy of them is zeroed pages it never writes: a stage holding the embeddings but not the LM head holds
    one dense table beyond its weights and state, the sum it receives (`tied_sum_bytes`), where MNN's
    charge stays the dense gradient and the sum. SmolLM2's torch full fine-tuning ran that stage 0.84-0.85
    of its plan charged dense (benchmarks/MEMORY_NOTES.md, h64). The head's stage (a dense gradient every
    backward) keeps its dense charge; the whole model on one stage (nothing exchanged) is charged the
    head's dense gradient and the rows; the partition instance says what the memory model says."""
    from ir.graph import block_signature
    from ir.profile import BlockCost
    from planner.cost import ROW_GRADIENT_COPIES, _graph_tables, received_sum_bytes, stage_memory_terms, tied_sum_bytes
    from planner.onnx_import import load_model
    from planner.partition import make_instance, manual_partition

    g = load_model(chat_llama[0], 1, 16)
    _, read, lookups, listed = _graph_tables(g)
    (table,) = [t for t in read if len(listed[t]) > 1]
    assert listed[table][0] == 0 and lookups[table] == 16
    nbytes = int(g.constants[table].nbytes)
    rows = ROW_GRADIENT_COPIES * 16 * 4 * (nbytes // g.constants[table].shape[0] + 8)
    costs = {block_signature(b): BlockCost(1e-3, 2e-3, 0.0, 100) for b in g.blocks}
    n, head = len(g.blocks), len(g.blocks) - 2

    def device(name, backend):
        profile = DeviceProfile(name, g.name, g.batch, g.seq, (BackendProfile(backend, costs),), 10**12)
        return DeviceSpec(name, f"tcp://{name}:1", profile, 10**12, backend, activations="keep")

    def gradients(dev, first, last, stage, stages):  # the sum received at the update included (`update_bytes`)
        terms = stage_memory_terms(g, dev, first, last, stage, stages, "1f1b-flush", 4, "adamw")
        return terms.gradient_bytes + terms.update_bytes

    mnn, torch = device("d0", "mnn:cpu:t1"), device("d0", "torch:cpu:t1")
    assert tied_sum_bytes(g, 0, 1) == received_sum_bytes(nbytes) and tied_sum_bytes(g, head, n - 1) == 0
    assert gradients(torch, 0, 1, 0, 2) == gradients(mnn, 0, 1, 0, 2) - nbytes + rows
    assert gradients(torch, head, n - 1, 1, 2) == gradients(mnn, head, n - 1, 1, 2)
    assert gradients(torch, 0, n - 1, 0, 1) == gradients(mnn, 0, n - 1, 0, 1) - nbytes + rows
    cluster = Cluster(tuple(device(f"d{i}", "torch:cpu:t1") for i in range(2)), Link(1e9, 0.0))
    inst = make_instance(g, cluster, "1f1b-flush", 4, "adamw")
    for cut in (2, head):
        plan = manual_partition(inst, ["d0", "d1"], [cut])
        for s, (first, last) in enumerate(((0, cut - 1), (cut, n - 1))):
            assert plan.stages[s].memory_bytes == stage_memory_bytes(g, torch, first, last, s, 2, "1f1b-flush", 4,
                                                                     "adamw"), (cut, s)


@pytest.mark.parametrize("stacked", [1, 64 * 2**20])
def test_a_flush_stage_is_charged_the_larger_of_its_update_and_its_backwards_not_both(chat_llama, stacked):
    """Under 1f1b-flush a stage's update comes after every backward of its batch: the embeddings'
    stage holds the tied sum it receives there (`update_only_bytes`) and nothing its backwards held
    (stashed inputs, kept parts, workspace), so it is charged what it holds throughout + the larger of
    the two (`phase_peak_bytes`), not their sum: summed, tests/jobs/test_torch_full_finetune_plan.py's
    embeddings' stage ran 0.90-0.96 of its plan and `smollm2-torch-full`'s 0.90-0.93 (benchmarks/
    MEMORY_NOTES.md, helpers h64, h67, h71). [1]: the update's part is the larger, [64 MiB a block]: the
    backwards'. MNN's lookup stage the same (its update once measured above the sum, h43: the dense copy on
    huge pages, sparse since h71; `smollm2-full`'s stage 0 under both parts, h77); the head's stage and the
    whole model on one stage (the sum held throughout there) are charged as before, and every partitioner
    charges what the memory model does, so a budget between the two charges fits only with the max."""
    from ir.graph import block_signature
    from ir.profile import BlockCost
    from planner.cost import stage_memory_terms, tied_sum_bytes, update_only_bytes
    from planner.onnx_import import load_model
    from planner.partition import (OrderSolver, brute_force_partition, cpsat_partition, greedy_partition,
                                   make_instance, manual_partition)
    from planner.partition.instance import _partition

    g = load_model(chat_llama[0], 1, 16)
    n, head = len(g.blocks), len(g.blocks) - 2
    table = tied_sum_bytes(g, 0, 0)
    assert table > 0
    costs = {block_signature(b): BlockCost(1e-3, 2e-3, 0.0, stacked) for b in g.blocks}

    def device(name, backend, budget=10**12):
        profile = DeviceProfile(name, g.name, g.batch, g.seq, (BackendProfile(backend, costs),), 10**12)
        return DeviceSpec(name, f"tcp://{name}:1", profile, budget, backend, activations="keep")

    torch, mnn = device("d0", "torch:cpu:t1"), device("d0", "mnn:cpu:t1")
    cut = 2
    for dev, first, last, stage, stages in ((torch, 0, cut - 1, 0, 2), (torch, cut, n - 1, 1, 2), (torch, 0, n - 1, 0, 1),
                                            (mnn, 0, cut - 1, 0, 2)):
        t = stage_memory_terms(g, dev, first, last, stage, stages, "1f1b-flush", 4, "adamw")
        held = (t.trainable_bytes + sum(t.frozen_bytes.values()) + t.gradient_bytes + t.optimizer_state_bytes
                + t.runtime_bytes + t.engine_bytes)
        summed = held + t.backward_bytes + t.update_bytes
        if (first, last) == (0, cut - 1):
            assert t.update_bytes == update_only_bytes(g, first, last, dev, "1f1b-flush") == table
            assert t.total == held + max(t.backward_bytes, table) < summed
            assert (t.update_bytes > t.backward_bytes) == (stacked == 1)
            assert sum(t.by_name().values()) == t.total
            assert stage_memory_terms(g, dev, first, last, stage, stages, "gpipe", 4, "adamw").update_bytes == table
        else:  # the sum charged with the rest, or none
            assert t.update_bytes == 0 and t.total == summed
    # the partitioners: every plan's stages as the memory model prices them, and a budget between the
    # summed charge and the max fits the cut
    cluster = Cluster(tuple(device(f"d{i}", "torch:cpu:t1") for i in range(2)), Link(1e9, 0.0))
    inst = make_instance(g, cluster, "1f1b-flush", 4, "adamw")
    for c in (cut, head):
        plan = manual_partition(inst, ["d0", "d1"], [c])
        for s, (first, last) in enumerate(((0, c - 1), (c, n - 1))):
            assert plan.stages[s].memory_bytes == stage_memory_bytes(g, torch, first, last, s, 2, "1f1b-flush", 4,
                                                                     "adamw"), (c, s)
    assert inst.stage_bytes(0, 0, n - 1, 1, 0) == stage_memory_bytes(g, torch, 0, n - 1, 0, 1, "1f1b-flush", 4, "adamw")
    need = [stage_memory_bytes(g, torch, 0, cut - 1, 0, 2, "1f1b-flush", 4, "adamw"),
            stage_memory_bytes(g, torch, cut, n - 1, 1, 2, "1f1b-flush", 4, "adamw")]
    t = stage_memory_terms(g, torch, 0, cut - 1, 0, 2, "1f1b-flush", 4, "adamw")
    budget = max(need) + min(t.backward_bytes, t.update_bytes) // 2  # under the summed charge of the first stage
    assert budget < need[0] + min(t.backward_bytes, t.update_bytes)
    tight = Cluster(tuple(device(f"d{i}", "torch:cpu:t1", budget) for i in range(2)), Link(1e9, 0.0))
    inst = make_instance(g, tight, "1f1b-flush", 4, "adamw")
    found = [brute_force_partition(inst), cpsat_partition(inst, time_limit_s=10.0)]
    for order in ((0, 1), (1, 0)):  # the fixed-order program
        solved = OrderSolver(inst).plan(order, "sum")
        assert solved is not None, order
        found.append(_partition(inst, *solved.assignment, "dp"))
    found.append(_partition(inst, *greedy_partition(inst), "greedy"))
    for plan in found:
        assert plan is not None and len(plan.stages) >= 1
        for st in plan.stages:
            assert st.memory_bytes <= budget
            assert st.memory_bytes == inst.stage_bytes(inst.devices.index(st.device), st.first_block, st.last_block,
                                                       len(plan.stages), st.stage)


def test_a_per_block_line_measured_beside_the_gradient_sum_leaves_the_layers_gradients_to_their_term():
    """MNN's per-block line measured as a worker's second step (`BlockCost.per_block_summed_bytes`: full
    fine-tuning's layers, helper h70) holds none of the layers' gradients: the gradient term charges them
    once, as the running sum, and where nothing is summed (1f1b-stash updating after every backward, the
    backward's set held in the workspace an older line measured) charges them back
    (`unsummed_gradient_bytes`); a hybrid stage's caches are the keep line less the per-block line less
    those gradients (`cache_bytes_per_block`); such a line's transient is charged one more read of a
    layer's backward (`mnn_gradient_read_bytes`), a fresh engine's line none. By hand, through the cost
    model and the partition instance (dropping the charge-back fails both; main before h147 fails the read)."""
    from dataclasses import replace

    from planner.cost import cache_bytes_per_block, mnn_gradient_read_bytes, stage_memory_bytes, stage_memory_terms
    from planner.partition.instance import _memory_bytes, make_instance

    def device(name: str, summed: int | None) -> DeviceSpec:
        return _summed_line_device(name, summed, "mnn:cpu:t1", "per-block")

    g = tiny_graph()
    summed, fresh = device("s", 2000), device("f", None)  # the encoders' 2000 parameter bytes each
    # blocks 1-2 (two encoders, 4000 parameter bytes), the last stage of 2
    for dev in (summed, fresh):  # a sum is held: the gradient term's 4000 either way
        assert stage_memory_terms(g, dev, 1, 2, 1, 2, "1f1b-flush", 4, "sgd").gradient_bytes == 4000
    assert stage_memory_terms(g, fresh, 1, 2, 1, 2, "1f1b-stash", 4, "sgd").gradient_bytes == 0
    stash = stage_memory_terms(g, summed, 1, 2, 1, 2, "1f1b-stash", 4, "sgd")
    # the line's 2 x 20 + 130, and one more read of an encoder's backward (`mnn_gradient_read_bytes`: its
    # 2000 bytes of weights' gradients and its 400-byte input's, one array), which a worker's backward
    # held a third of where the line's two backwards held two (helper h147)
    read = 400 + 2000
    assert mnn_gradient_read_bytes(g, 1) == read
    assert stash.gradient_bytes == 4000 and stash.workspace_bytes == 2 * 20 + 130 + read
    flush = stage_memory_terms(g, summed, 1, 2, 1, 2, "1f1b-flush", 4, "sgd")
    assert flush.workspace_bytes == 2 * 20 + 130 + read
    assert stage_memory_terms(g, fresh, 1, 2, 1, 2, "1f1b-flush", 4, "sgd").workspace_bytes == 2 * 20 + 130
    assert stage_memory_terms(g, summed, 1, 2, 1, 2, "1f1b-stash", 4, "sgd", 2).gradient_bytes == 4000
    assert stage_memory_terms(g, replace(summed, activations="keep"), 1, 2, 1, 2, "1f1b-stash", 4,
                              "sgd").gradient_bytes == 0  # the keep line holds them
    # a hybrid's cache of an encoder: keep line 2200 less per-block 20 less its gradients 2000
    assert cache_bytes_per_block(g, summed)[1:3] == [180, 180]
    assert cache_bytes_per_block(g, fresh)[1:3] == [2180, 2180]
    inst = make_instance(g, Cluster((summed, fresh), Link(1e6, 0.001)), "1f1b-stash", 4, "sgd")
    for d, dev in enumerate((summed, fresh)):
        assert _memory_bytes(inst, d, 1, 2, 1, 2) == stage_memory_bytes(g, dev, 1, 2, 1, 2, "1f1b-stash", 4, "sgd")
    assert (stage_memory_bytes(g, summed, 1, 2, 1, 2, "1f1b-stash", 4, "sgd")
            - stage_memory_bytes(g, fresh, 1, 2, 1, 2, "1f1b-stash", 4, "sgd")) == 4000 + read


def test_pytorch_lines_measured_beside_the_sum_charge_the_layers_gradients_back_where_none_is_kept():
    """PyTorch's keep and per-block lines of a full fine-tuning kind are measured beside a running gradient sum,
    less it (`runtime.profiling.device.summed_torch_line`: a whole backward adds each weight's gradient as
    autograd completes it, helper h150): the gradient term charges the layers' gradients once, as the sum, and
    where none is kept (1f1b-stash updating after every backward) charges them back under both lines, less what
    that schedule steps as completed (`stepped_gradient_bytes`); a hybrid's caches take nothing off (both lines
    left them out). By hand, through the cost model (main charges the keep line none back: 0 != 4000 fails)."""
    from planner.cost import cache_bytes_per_block, stage_memory_terms, stepped_gradient_bytes, unsummed_gradient_bytes

    def device(name: str, summed: int | None, activations: str) -> DeviceSpec:
        return _summed_line_device(name, summed, "torch:cpu:t1", activations)

    g = tiny_graph()
    for activations in ("keep", "per-block"):
        summed, fresh = device("s", 2000, activations), device("f", None, activations)
        for dev in (summed, fresh):  # a sum is held: the gradient term's 4000 either way, nothing back
            assert stage_memory_terms(g, dev, 1, 2, 1, 2, "1f1b-flush", 4, "sgd").gradient_bytes == 4000
            assert unsummed_gradient_bytes(g, 1, 2, dev, "1f1b-flush") == 0
        assert unsummed_gradient_bytes(g, 1, 2, summed, "1f1b-stash") == 4000, activations
        assert unsummed_gradient_bytes(g, 1, 2, fresh, "1f1b-stash") == 0
        # stash steps the layers' weights as their gradients complete: the old line's set off, the summed line's back
        assert stepped_gradient_bytes(g, 1, 2, summed, "1f1b-stash") == 4000
        assert stage_memory_terms(g, summed, 1, 2, 1, 2, "1f1b-stash", 4, "sgd").gradient_bytes == 0
        assert stage_memory_terms(g, fresh, 1, 2, 1, 2, "1f1b-stash", 4, "sgd").gradient_bytes == -4000
    assert cache_bytes_per_block(g, device("h", 2000, "per-block"))[1:3] == [2180, 2180]


def _summed_line_device(name: str, summed: int | None, backend: str, activations: str) -> DeviceSpec:
    """A device of the tiny graph on `backend` whose encoder line was measured beside a running gradient sum
    of `summed` bytes (`BlockCost.per_block_summed_bytes`; None: measured without one)."""
    from ir.profile import BlockCost
    from support import EMB, ENC

    costs = {EMB: BlockCost(0.001, 0.002, 0.0, 50, stacked_bytes=40, kept_bytes=30),
             ENC: BlockCost(0.010, 0.020, 0.005, 2400, stacked_bytes=2200, kept_bytes=120,
                            per_block_workspace_bytes=150, per_block_stacked_bytes=20, per_block_summed_bytes=summed),
             HEAD: BlockCost(0.0005, 0.0005, 0, 10, stacked_bytes=10, kept_bytes=10)}
    profile = DeviceProfile(name, "tiny", 8, 32, (BackendProfile(backend, costs),), 10**6, 5000)
    return DeviceSpec(name, f"tcp://{name}:1", profile, 10**6, backend, activations=activations)
