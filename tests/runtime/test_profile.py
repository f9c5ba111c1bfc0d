"""The device profiler on the tiny BERT (every block kind, every present backend, JSON round trip),
the attention piece against numpy, and the link probe over real ZeroMQ sockets."""
from __future__ import annotations

import json
import math
import os
import queue
import threading

import numpy as np
import pytest

from support import export_onnx
from ir.graph import block_signature
from ir.profile import DeviceProfile, Link
from planner.onnx_import import load_model
from runtime.engines import mnn_kernels as K
from ir.backend import parse_backend
from runtime.engines.factory import make_engine
from runtime.engines.split.piece import attention_piece
from runtime.profiling import (DEFAULT_BACKENDS, PeakRss, SplitExtraCost, SplitRun, attention_curve,
                               link_from_round_trips, link_probe_server, measure_link, memory_available_bytes,
                               present_backends, profile_device, split_allocations, split_extra_cost, split_primary,
                               synthetic_feeds)
from runtime.engines.stage import stage_spec

B, S = 2, 16


@pytest.fixture(scope="module")
def tiny_graph(export_dir, tiny_checkpoint):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts14.onnx", opset=14), B, S)


@pytest.fixture(scope="module")
def tiny_profile(tiny_graph):
    lines: list[str] = []
    prof = profile_device(tiny_graph, "here", backends=DEFAULT_BACKENDS + ("mnn:opencl", "mnn:vulkan"),
                          reps=2, progress=lines.append)
    return prof, lines


def _expected_backends() -> list[str]:
    devices = K.available_backends()
    cpus = os.cpu_count() or 1
    names = [f"mnn:{d}:t{t}" for d in ("cpu",) if devices[d] for t in (1, 2) if t <= cpus]
    try:
        import runtime.engines.pytorch  # noqa: F401
        names += [f"torch:cpu:t{t}" for t in (1, 2) if t <= cpus]
    except ImportError:
        pass
    return names


@pytest.mark.slow  # a profile of every backend present (one module fixture, ~13 s)
def test_profile_covers_every_block_kind_on_every_present_backend(tiny_graph, tiny_profile):
    prof, lines = tiny_profile
    assert (prof.name, prof.model, prof.batch, prof.seq) == ("here", tiny_graph.name, B, S)
    assert [b.backend for b in prof.backends] == _expected_backends()
    signatures = {block_signature(b) for b in tiny_graph.blocks}
    assert len(signatures) < len(tiny_graph.blocks)          # the two encoder layers are one kind
    for backend in prof.backends:
        assert set(backend.blocks) == signatures, backend.backend
        for sig, cost in backend.blocks.items():
            assert cost.forward_s > 0 and cost.backward_s > 0, (backend.backend, sig)
            assert cost.recompute_s >= 0 and cost.workspace_bytes >= 0
            if backend.backend.startswith("torch"):
                assert cost.recompute_s == 0
            # what a further micro-batch in flight keeps: measured for every kind; what a further
            # block adds: for the kinds whose next block is of the same kind (the encoder layers)
            assert isinstance(cost.kept_bytes, int) and cost.kept_bytes >= 0, (backend.backend, sig)
            first = next(b for b in tiny_graph.blocks if block_signature(b) == sig)
            repeated = first.index + 1 < len(tiny_graph.blocks) and \
                block_signature(tiny_graph.blocks[first.index + 1]) == sig
            if repeated:
                assert 0 <= cost.stacked_bytes <= cost.workspace_bytes, (backend.backend, sig)
            else:
                assert cost.stacked_bytes is None, (backend.backend, sig)
            # what a further block holds recomputing per block: both engines measure it
            if repeated:
                assert isinstance(cost.per_block_stacked_bytes, int) and cost.per_block_stacked_bytes >= 0
            else:
                assert cost.per_block_stacked_bytes is None, (backend.backend, sig)
            # and PyTorch its backward that way (each block's forward re-run); MNN's backward re-runs already
            if backend.backend.startswith("torch"):
                assert cost.per_block_backward_s > 0 and cost.per_block_workspace_bytes is not None, sig
            else:
                assert cost.per_block_backward_s is None, (backend.backend, sig)
    assert prof.memory_available_bytes > 0 and prof.runtime_overhead_bytes > 10 * 2**20
    assert lines and any("layer.0" in line for line in lines)


@pytest.mark.slow  # a profile of every backend present (one module fixture, ~13 s)
def test_absent_mnn_devices_are_skipped_not_listed(tiny_profile):
    prof, lines = tiny_profile
    for device, ok in K.available_backends().items():
        if not ok:
            assert f"mnn:{device}" not in [b.backend for b in prof.backends]
    assert any(line.startswith("skip mnn:opencl") for line in lines) or K.available_backends()["opencl"]


@pytest.mark.slow  # a profile of every backend present (one module fixture, ~13 s)
def test_attention_curves_have_one_entry_per_head(tiny_graph, tiny_profile):
    prof, _ = tiny_profile
    encoders = {block_signature(b): b for b in tiny_graph.blocks if b.heads}
    assert encoders
    for backend in prof.backends:
        assert set(backend.attention) == set(encoders)
        for sig, curve in backend.attention.items():
            assert len(curve.seconds) == encoders[sig].heads == len(curve.fused_faster)
            assert all(t > 0 for t in curve.seconds)
            assert curve.fused_faster[0]                         # one head: fused and loop are the same


@pytest.mark.slow  # a profile of every backend present (one module fixture, ~13 s)
def test_profile_json_round_trip(tiny_profile, tmp_path):
    prof, _ = tiny_profile
    assert prof.split_child_bytes  # the measured figures travel too
    assert prof.accumulate_s_per_param_byte > 0
    if "torch:cpu:t1" in [b.backend for b in prof.backends]:
        assert prof.split_extra_cost_s
    prof.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == prof


def test_split_child_bytes_round_trip_and_old_profiles_load():
    import dataclasses

    from ir.profile import BackendProfile, BlockCost

    prof = DeviceProfile("d", "m", 2, 16, (BackendProfile("mnn:cpu:t1", {"b": BlockCost(0.1, 0.2)}),), 1 << 30,
                         47 << 20, {"sgd": 1e-9}, {"mnn": 48 << 20, "torch": 300 << 20})
    doc = prof.to_json()
    assert doc["split_child_bytes"] == {"mnn": 48 << 20, "torch": 300 << 20}
    assert DeviceProfile.from_json(doc) == prof
    # a profile written before the field existed loads, the figure unknown (empty), not zero
    old = {k: v for k, v in doc.items() if k != "split_child_bytes"}
    assert DeviceProfile.from_json(old) == dataclasses.replace(prof, split_child_bytes={})
    assert DeviceProfile.from_json(dataclasses.replace(prof, split_child_bytes={}).to_json()).split_child_bytes == {}
    with pytest.raises(ValueError, match="malformed profile"):
        DeviceProfile.from_json({**doc, "split_child_bytes": [1, 2]})


@pytest.mark.parametrize("field, value, says", [
    ("forward_s", "fast", r"mnn:cpu:t1 block b: forward_s 'fast' is not a time in seconds"),
    ("backward_s", float("nan"), r"mnn:cpu:t1 block b: backward_s nan is not a time in seconds"),
    ("recompute_s", -1.0, r"mnn:cpu:t1 block b: recompute_s -1.0 is not a time in seconds"),
    ("workspace_bytes", 1.5, r"mnn:cpu:t1 block b: workspace_bytes 1.5 is not a size in bytes"),
    ("kept_bytes", -4, r"mnn:cpu:t1 block b: kept_bytes -4 is not a size in bytes"),
    ("per_block_backward_s", "slow", r"mnn:cpu:t1 block b: per_block_backward_s 'slow' is not a time in seconds"),
    ("fast", 1, r"mnn:cpu:t1 block b: unknown field\(s\) \['fast'\]"),
])
def test_a_block_cost_that_is_no_measurement_is_refused_by_field(field, value, says):
    from ir.profile import BackendProfile, BlockCost

    prof = DeviceProfile("d", "m", 2, 16, (BackendProfile("mnn:cpu:t1", {"b": BlockCost(0.1, 0.2, 0.05, 1 << 20, 1 << 19,
                                                                                          1 << 18)}),), 1 << 30)
    doc = prof.to_json()
    assert DeviceProfile.from_json(doc) == prof
    doc["backends"][0]["blocks"]["b"][field] = value
    with pytest.raises(ValueError, match=f"p.json: malformed profile \\(ValueError: {says}"):
        DeviceProfile.from_json(doc, "p.json")
    with pytest.raises(ValueError, match=r"p.json: profile is a JSON list, not an object; re-run `confidant profile`"):
        DeviceProfile.from_json([doc], "p.json")


def test_split_extra_cost_round_trip_and_old_profiles_load():
    import dataclasses

    from ir.profile import BackendProfile, BlockCost

    prof = DeviceProfile("d", "m", 2, 16, (BackendProfile("mnn:cpu:t1", {"b": BlockCost(0.1, 0.2)}),), 1 << 30,
                         47 << 20, {"sgd": 1e-9}, {"mnn": 48 << 20},
                         {"sigA": {"mnn:cpu:t1": 0.0049, "mnn:cpu:t2": 0.0}, "sigB": {"mnn:cpu:t1": 0.012}})
    doc = prof.to_json()
    assert doc["split_extra_cost_s"] == {"sigA": {"mnn:cpu:t1": 0.0049, "mnn:cpu:t2": 0.0},
                                         "sigB": {"mnn:cpu:t1": 0.012}}
    assert DeviceProfile.from_json(doc) == prof
    assert DeviceProfile.from_json(json.loads(json.dumps(doc))) == prof  # through real JSON text
    # a profile written before the field existed loads with no figures (the planner charges 0)
    old = {k: v for k, v in doc.items() if k != "split_extra_cost_s"}
    assert DeviceProfile.from_json(old) == dataclasses.replace(prof, split_extra_cost_s={})
    assert DeviceProfile.from_json(dataclasses.replace(prof, split_extra_cost_s={}).to_json()).split_extra_cost_s == {}
    for bad in ([1, 2], {"sigA": [0.1]}, {"sigA": {"mnn:cpu:t1": -0.001}}, {"sigA": {"mnn:cpu:t1": float("nan")}},
                {"sigA": {"mnn:cpu:t1": "5 ms"}}):
        with pytest.raises(ValueError, match="malformed profile"):
            DeviceProfile.from_json({**doc, "split_extra_cost_s": bad})


@pytest.mark.slow  # a profile of every backend present (one module fixture, ~13 s)
def test_profile_measures_the_fixed_cost_of_a_real_split(tiny_graph, tiny_profile):
    """Real SplitAttentions of the tiny BERT's attention (4 heads) between the in-process backend
    (torch:cpu:t1 where torch runs) and every other backend that fits beside it on this machine's
    CPUs: one finite figure >= 0 per such backend, none for the in-process one or one that would
    oversubscribe the CPUs (reported instead)."""
    prof, lines = tiny_profile
    names = [b.backend for b in prof.backends]
    primary = split_primary([parse_backend(n) for n in names])
    cpus = os.cpu_count() or 1
    expected = {n for n in names if n != primary.name and parse_backend(n).threads + primary.threads <= cpus}
    encoders = {block_signature(b) for b in tiny_graph.blocks if b.heads}
    if not expected:
        assert prof.split_extra_cost_s == {}
        return
    assert set(prof.split_extra_cost_s) == encoders
    for sig, costs in prof.split_extra_cost_s.items():
        assert set(costs) == expected, (sig, costs)
        assert all(math.isfinite(x) and x >= 0 for x in costs.values()), costs
    if "torch:cpu:t1" in names:
        assert primary.name == "torch:cpu:t1" and "mnn:cpu:t1" in expected
    measured = [line for line in lines if line.startswith("split extra cost ") and "not measured" not in line]
    assert len(measured) == len(expected) * len(encoders), lines
    skipped = [line for line in lines if line.startswith("split extra cost ") and "not measured" in line]
    assert len(skipped) == (len(names) - 1 - len(expected)) * len(encoders), lines


@pytest.mark.slow  # a profile of every backend present (one module fixture, ~13 s)
def test_split_extra_cost_runs_real_splits(tiny_graph, tiny_profile):
    """The measurement itself: real SplitAttentions of 1+3, 2+2 and 3+1 heads (torch in this process,
    MNN in a child), each compared with the curves' max; busy times per backend lie within the wall."""
    pytest.importorskip("torch")
    prof, _ = tiny_profile
    block = next(b for b in tiny_graph.blocks if b.heads)
    sig = block_signature(block)
    curves = {b.backend: b.attention[sig] for b in prof.backends}
    batch, seq, hidden = tiny_graph.values[block.inputs[0]].shape
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[-1, ..., seq // 2:] = -10000.0
    torch1, mnn1 = parse_backend("torch:cpu:t1"), parse_backend("mnn:cpu:t1")
    got = split_extra_cost(torch1, mnn1, curves, batch, seq, hidden, block.heads, block.head_size, mask, reps=2)
    assert (got.backend, got.primary) == ("mnn:cpu:t1", "torch:cpu:t1")
    assert [(r.heads, r.primary_heads) for r in got.runs] == [(1, 3), (2, 2), (3, 1)]
    for r in got.runs:
        assert r.predicted_s == max(curves["torch:cpu:t1"].seconds[r.primary_heads - 1],
                                    curves["mnn:cpu:t1"].seconds[r.heads - 1])
        assert r.measured_s > 0 and set(r.busy_s) == {"mnn:cpu:t1", "torch:cpu:t1"}
        assert all(0 < b <= r.measured_s * 1.01 for b in r.busy_s.values()), r
    assert got.extra_s == max(0.0, max(r.measured_s - r.predicted_s for r in got.runs))
    with pytest.raises(ValueError, match="two different backends"):
        split_extra_cost(mnn1, mnn1, curves, batch, seq, hidden, block.heads, block.head_size, mask)


def test_split_extra_cost_is_the_worst_excess_over_the_curves_floored_at_zero():
    runs = (SplitRun(1, 3, 0.050, 0.040), SplitRun(2, 2, 0.030, 0.022), SplitRun(3, 1, 0.031, 0.033))
    assert SplitExtraCost("mnn:cpu:t1", "torch:cpu:t1", runs).extra_s == pytest.approx(0.010)
    faster = (SplitRun(2, 2, 0.020, 0.022),)  # measured below the curves (noise): no negative cost
    assert SplitExtraCost("mnn:cpu:t1", "torch:cpu:t1", faster).extra_s == 0.0
    assert split_allocations(12) == [1, 6, 11]
    assert split_allocations(4) == [1, 2, 3] and split_allocations(3) == [1, 2] and split_allocations(2) == [1]
    backends = [parse_backend(n) for n in ("mnn:cpu:t1", "torch:cpu:t2", "torch:cpu:t1")]
    assert split_primary(backends).name == "torch:cpu:t1"   # in-process torch, fewest threads
    assert split_primary(backends[:1] + [parse_backend("mnn:cpu:t2")]).name == "mnn:cpu:t1"


@pytest.mark.slow  # the module's profile of every backend (~13 s); profiling stays fast-tier in test_memory_override_and_attention_switch
def test_profile_measures_split_child_processes(tiny_profile):
    """A real head-split child of each present engine kind, holding H-1 heads of the tiny BERT's
    attention: the whole process is tens of MiB for MNN, and torch's import makes its child bigger."""
    prof, lines = tiny_profile
    engines = {b.backend.split(":")[0] for b in prof.backends}
    assert set(prof.split_child_bytes) == engines
    assert prof.split_child_bytes["mnn"] > 10 * 2**20
    if "torch" in engines:
        assert prof.split_child_bytes["torch"] > prof.split_child_bytes["mnn"]
    assert sum(line.startswith("split child ") for line in lines) == len(engines), lines


def test_memory_override_and_attention_switch(tiny_graph):
    # nothing read here comes from a fresh child (tests/runtime/test_fresh_*.py and test_decoder's profile hold those)
    prof = profile_device(tiny_graph, "x", backends=("mnn:cpu:t1",), reps=1, memory_bytes=123, attention=False,
                          fresh=False)
    assert prof.memory_available_bytes == 123
    assert prof.backends[0].attention == {}
    assert prof.split_child_bytes == {}  # no curves, no split: no child measured either
    assert prof.split_extra_cost_s == {}  # nor its fixed cost
    assert memory_available_bytes() > 0


@pytest.mark.parametrize("backend", ["mnn:cpu:t1", "torch:cpu:t1"])
def test_attention_time_grows_with_heads(backend):
    if backend.startswith("torch"):
        pytest.importorskip("torch")
    mask = np.zeros((4, 1, 1, 64), np.float32)
    mask[-1, ..., 32:] = -10000.0
    # Timings on a shared machine: one measurement of 1 head can land on a busy moment and come out
    # slower than 4 heads (CI saw 0.0503 s against 0.0500); four heads' work is measured more than
    # one's in at least one of three curves.
    for _ in range(3):
        curve = attention_curve(parse_backend(backend), 4, 64, 256, 4, 64, mask, reps=5)
        assert len(curve.seconds) == 4
        if curve.seconds[-1] > curve.seconds[0]:
            break
    assert curve.seconds[-1] > curve.seconds[0], curve.seconds


def test_attention_piece_computes_attention():
    b, s, d, h, hs = 2, 8, 16, 2, 4
    graph = attention_piece(b, s, d, h, hs, (b, 1, 1, s), seed=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, s, d)).astype(np.float32)
    mask = np.zeros((b, 1, 1, s), np.float32)
    mask[1, ..., 5:] = -10000.0
    c = graph.constants
    def heads(name, w, bias):
        return (x @ c[w] + c[bias]).reshape(b, s, h, hs).transpose(0, 2, 1, 3)
    q, k, v = heads("q", "wq", "bq"), heads("k", "wk", "bk"), heads("v", "wv", "bv")
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs) + mask
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, h * hs) @ c["wo"]
    engine = make_engine("mnn:cpu:t1", stage_spec(graph, 1, 1))
    out = engine.forward({"x": x, "mask": mask}, 0)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)
    grads = engine.backward(0, np.ones_like(out))
    assert grads.activation_input.shape == x.shape          # the piece's backward reaches its input
    assert set(grads.params) == {"wq", "bq", "wk", "bk", "wv", "bv", "wo"}


def test_synthetic_feeds_fit_the_graph(tiny_graph):
    feeds = synthetic_feeds(tiny_graph)
    for v in tiny_graph.inputs:
        assert feeds[v.name].shape == tuple(v.shape) and feeds[v.name].dtype == np.dtype(v.dtype)
    assert 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < 500
    assert feeds["attention_mask"][-1, -1] == 0 and feeds["attention_mask"][0].all()


def test_backend_names_and_skips():
    # the profiler reads backend names with the one parser (ir.backend; its own tests give the exact errors)
    assert parse_backend("torch:cpu:t2").threads == 2
    for bad, why in (("mnn:cpu", "needs a thread count"), ("onnx:cpu:t1", "unknown engine"),
                     ("mnn:cpu:2", "thread count tN"), ("mnn:cpu:t0", "integer >= 1")):
        with pytest.raises(ValueError, match=why):
            present_backends([bad], cpus=2)
    present, skipped = present_backends(["mnn:cpu:t1", "mnn:cpu:t4", "mnn:cuda"], cpus=2)
    assert [b.name for b in present] == ["mnn:cpu:t1"]
    assert "2 CPUs" in skipped["mnn:cpu:t4"]
    assert "mnn:cuda" in skipped


def test_peak_rss_sees_a_transient_allocation():
    with PeakRss() as peak:
        block = np.ones(64 * 2**20 // 8)
        del block
    assert peak.bytes >= 60 * 2**20


def test_link_from_round_trips_inverts_the_link_model():
    link = Link(bandwidth_bytes_per_s=100e6, latency_s=2e-4)
    rtts = {n: 2 * link.transfer_s(n) for n in (1024, 1 << 20, 8 << 20)}
    got = link_from_round_trips(rtts)
    assert got.bandwidth_bytes_per_s == pytest.approx(100e6)
    assert got.latency_s == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="two sizes"):
        link_from_round_trips({1024: 1e-3})


def test_measure_link_over_zeromq():
    addresses: queue.Queue = queue.Queue()
    errors: list[BaseException] = []

    def serve():
        try:
            link_probe_server("tcp://127.0.0.1:0", ready=addresses.put, timeout_s=20)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            addresses.put(None)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    address = addresses.get(timeout=20)
    assert address is not None, errors
    link = measure_link(address, sizes=(1024, 1 << 20, 4 << 20), reps=3, timeout_s=20)
    server.join(timeout=20)
    assert not server.is_alive() and not errors
    assert link.latency_s > 0 and link.bandwidth_bytes_per_s > 1e6
    assert link.transfer_s(4 << 20) > link.transfer_s(1024)


def test_profile_measures_the_optimizer_update_rate():
    from runtime.profiling import update_rates

    rates = update_rates(nbytes=4 << 20, reps=1)
    assert set(rates) == {"sgd", "adamw"}
    # Seconds per parameter byte, not per step: a step over 4 MiB runs between 10 MB/s and 10 TB/s
    # on any machine, so a rate outside these bounds has the wrong unit. (Which optimizer is faster
    # is a timing, and timings on a shared CI core are not asserted: one run measured SGD slower.)
    assert all(1e-13 < r < 1e-7 for r in rates.values()), rates


@pytest.mark.slow  # the module's profile of every backend (~13 s)
def test_profile_measures_the_gradient_accumulation_rate_and_old_profiles_load(tiny_profile):
    from runtime.profiling import accumulate_rate

    rate = accumulate_rate(nbytes=4 << 20, reps=1)
    # seconds per parameter byte (10 MB/s to 10 TB/s), not per addition; which of the accumulation
    # and an optimizer step is faster is a timing, left to the profile, not asserted here
    assert 1e-13 < rate < 1e-7, rate
    prof, _ = tiny_profile
    doc = prof.to_json()
    del doc["accumulate_s_per_param_byte"]
    assert DeviceProfile.from_json(doc).accumulate_s_per_param_byte == 0.0
    with pytest.raises(ValueError, match="malformed profile"):
        DeviceProfile.from_json({**prof.to_json(), "accumulate_s_per_param_byte": -1.0})


@pytest.mark.slow  # the module's profile of every backend (~13 s)
def test_a_backend_with_its_own_optimizer_kernel_has_its_rate_measured(tiny_profile):
    """PyTorch's backends step AdamW with its fused kernel, so the profile measures that kernel's
    rate for them (and only for AdamW); MNN's are runtime.optim's numpy step, the device's rate.
    The rates survive JSON, and a profile made before them loads with none."""
    prof, lines = tiny_profile
    for b in prof.backends:
        if b.backend.startswith("torch:"):
            assert set(b.update_s_per_param_byte) == {"adamw"}, b.backend
            assert 1e-13 < b.update_s_per_param_byte["adamw"] < 1e-7  # seconds per byte, as update_rates
            assert any(line.startswith(f"{b.backend}: its own adamw step, ") for line in lines)
        else:
            assert b.update_s_per_param_byte == {}, b.backend
    assert DeviceProfile.from_json(prof.to_json()) == prof
    doc = prof.to_json()
    for b in doc["backends"]:
        del b["update_s_per_param_byte"]
    assert all(b.update_s_per_param_byte == {} for b in DeviceProfile.from_json(doc).backends)
    doc["backends"][0]["update_s_per_param_byte"] = {"adamw": float("nan")}
    with pytest.raises(ValueError, match="malformed profile"):
        DeviceProfile.from_json(doc)


@pytest.mark.parametrize("backend", ["mnn:cpu:t1", "torch:cpu:t1"])
def test_a_stage_is_timed_with_its_table_gradient_as_rows(tiny_graph, backend, monkeypatch):
    """The profile times the embeddings' backward as pipelines and the trainer run it (the table's
    gradient as the rows it touches), not with a zero-filled table per backward."""
    from runtime.engines.base import RowGradient
    from runtime.profiling import compute
    from runtime.profiling.inputs import synthetic_feeds

    seen = []
    real = compute.make_engine

    def spying(*args, **kwargs):
        engine = real(*args, **kwargs)
        backward = engine.backward

        def recorded(m, g=None):
            out = backward(m, g)
            seen.extend(type(v) for v in out.params.values())
            return out

        engine.backward = recorded
        return engine

    monkeypatch.setattr(compute, "make_engine", spying)
    compute.measure_stage(parse_backend(backend), stage_spec(tiny_graph, 0, 0), synthetic_feeds(tiny_graph), reps=1)
    assert RowGradient in seen


@pytest.mark.parametrize("backend", ["mnn:cpu:t1", "torch:cpu:t1"])
def test_a_frozen_first_block_under_lora_is_profiled(tiny_graph, backend):
    """`profile --lora R` times the embeddings block, which LoRA leaves with no trainable weight and
    no stage input: nothing to differentiate, so its backward gives no gradients (PyTorch's autograd
    was asked for the gradients of an empty list and raised after a minute of profiling)."""
    from planner.lora import LoraSettings, add_lora
    from runtime.profiling import compute
    from runtime.profiling.inputs import synthetic_feeds

    lora, _ = add_lora(tiny_graph, LoraSettings(4))
    spec = stage_spec(lora, 0, 0)
    assert not spec.params, "the embeddings block should hold only frozen weights under LoRA"
    cost = compute.measure_stage(parse_backend(backend), spec, synthetic_feeds(lora), reps=1)
    assert cost.forward_s > 0 and cost.backward_s >= 0
    engine = make_engine(parse_backend(backend), spec)
    engine.forward(synthetic_feeds(lora), 0)
    grads = engine.backward(0, np.ones(lora.values[spec.blocks[-1].output].shape, np.float32))
    assert grads.params == {} and grads.activation_input is None
