"""Backend names (parse/str round trip, exact errors), discovery of what really runs here, and the
stage engines the factory `make_engine` builds (a forward and backward on a tiny attention stage)."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ir import backend as IB
from ir.backend import BackendSpec, parse_backend
from runtime.engines import mnn_kernels as K
from runtime.engines import single as single_engine_module
from runtime.engines.factory import make_engine as make_stage_engine
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.split.piece import attention_piece
from runtime.engines.stage import stage_spec
from runtime.profiling import backends as RB
from runtime.profiling.backends import discover, present_backends, thread_variants

EX = "(e.g. mnn:cpu:t1, mnn:opencl, torch:cpu:t2, torch:cuda:0)"


# Names -----------------------------------------------------------------------------------------

specs = st.one_of(
    st.builds(lambda e, t: BackendSpec(e, "cpu", threads=t), st.sampled_from(["mnn", "torch"]), st.integers(1, 512)),
    st.builds(lambda d: BackendSpec("mnn", d), st.sampled_from(["opencl", "vulkan", "metal", "cuda"])),
    st.builds(lambda i: BackendSpec("torch", "cuda", index=i), st.integers(0, 64)),
)


@given(specs)
def test_str_and_parse_round_trip(spec):
    assert BackendSpec.parse(str(spec)) == spec
    assert str(BackendSpec.parse(str(spec))) == str(spec) == spec.name


@pytest.mark.parametrize("name, fields", [
    ("mnn:cpu:t1", ("mnn", "cpu", 1, None)),
    ("mnn:cpu:t12", ("mnn", "cpu", 12, None)),
    ("mnn:opencl", ("mnn", "opencl", None, None)),
    ("mnn:cuda", ("mnn", "cuda", None, None)),
    ("torch:cpu:t2", ("torch", "cpu", 2, None)),
    ("torch:cuda:0", ("torch", "cuda", None, 0)),
    ("torch:cuda:3", ("torch", "cuda", None, 3)),
])
def test_documented_names_parse(name, fields):
    spec = BackendSpec.parse(name)
    assert (spec.engine, spec.device, spec.threads, spec.index) == fields
    assert str(spec) == name
    assert parse_backend(name) == spec and parse_backend(spec) is spec


@pytest.mark.parametrize("name, message", [
    ("mnn", f"backend 'mnn' is not engine:device[:setting] {EX}"),
    ("", f"backend '' is not engine:device[:setting] {EX}"),
    ("mnn:cpu:t1:x", f"backend 'mnn:cpu:t1:x' is not engine:device[:setting] {EX}"),
    ("mnn::t1", f"backend 'mnn::t1' is not engine:device[:setting] {EX}"),
    ("mnn:cpu:", f"backend 'mnn:cpu:' is not engine:device[:setting] {EX}"),
    ("tf:cpu:t1", "backend 'tf:cpu:t1': unknown engine 'tf' (engines: mnn, torch)"),
    ("MNN:cpu:t1", "backend 'MNN:cpu:t1': unknown engine 'MNN' (engines: mnn, torch)"),
    ("mnn:gpu", "backend 'mnn:gpu': engine mnn has no device 'gpu' (devices: cpu, opencl, vulkan, metal, cuda)"),
    ("mnn:gpu:t1", "backend 'mnn:gpu:t1': engine mnn has no device 'gpu' (devices: cpu, opencl, vulkan, metal, cuda)"),
    ("torch:opencl", "backend 'torch:opencl': engine torch has no device 'opencl' (devices: cpu, cuda)"),
    ("mnn:cpu", "backend 'mnn:cpu': a cpu backend needs a thread count, e.g. mnn:cpu:t1"),
    ("torch:cpu", "backend 'torch:cpu': a cpu backend needs a thread count, e.g. torch:cpu:t1"),
    ("mnn:cpu:2", f"backend 'mnn:cpu:2': the cpu setting is a thread count tN, not '2' {EX}"),
    ("mnn:cpu:t01", f"backend 'mnn:cpu:t01': the cpu setting is a thread count tN, not 't01' {EX}"),
    ("mnn:cpu:t-1", f"backend 'mnn:cpu:t-1': the cpu setting is a thread count tN, not 't-1' {EX}"),
    ("mnn:cpu:t²", f"backend 'mnn:cpu:t²': the cpu setting is a thread count tN, not 't²' {EX}"),
    ("mnn:cpu:t0", "backend 'mnn:cpu:t0': thread count must be an integer >= 1, not 0"),
    ("torch:cuda", "backend 'torch:cuda': torch:cuda needs a device index, e.g. torch:cuda:0"),
    ("torch:cuda:t1", f"backend 'torch:cuda:t1': the cuda setting is a device index N >= 0, not 't1' {EX}"),
    ("torch:cuda:-1", f"backend 'torch:cuda:-1': the cuda setting is a device index N >= 0, not '-1' {EX}"),
    ("mnn:opencl:t1", "backend 'mnn:opencl:t1': mnn:opencl takes no setting"),
    ("mnn:cuda:0", "backend 'mnn:cuda:0': mnn:cuda takes no setting"),
])
def test_bad_names_are_rejected_with_the_reason(name, message):
    with pytest.raises(ValueError) as err:
        BackendSpec.parse(name)
    assert str(err.value) == message


def test_non_string_names_and_bad_fields_are_rejected():
    with pytest.raises(TypeError, match="backend name must be a str, not int"):
        BackendSpec.parse(1)
    cases = [
        (dict(engine="mnn", device="cpu"), "backend mnn:cpu (threads=None, index=None): a cpu backend needs a "
                                           "thread count, e.g. mnn:cpu:t1"),
        (dict(engine="mnn", device="opencl", threads=2), "backend mnn:opencl (threads=2, index=None): mnn:opencl "
                                                        "has no thread setting (threads are for cpu backends)"),
        (dict(engine="torch", device="cpu", threads=1, index=0), "backend torch:cpu (threads=1, index=0): a cpu "
                                                                 "backend has no device index"),
        (dict(engine="torch", device="cuda", index=-2), "backend torch:cuda (threads=None, index=-2): device "
                                                        "index must be an integer >= 0, not -2"),
        (dict(engine="mnn", device="cpu", threads=True), "backend mnn:cpu (threads=True, index=None): thread "
                                                         "count must be an integer >= 1, not True"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError) as err:
            BackendSpec(**fields)
        assert str(err.value) == message


def test_mnn_devices_are_the_ones_mnn_kernels_probes():
    assert IB.DEVICES["mnn"] == tuple(K._BACKENDS) == tuple(K.available_backends())


# Discovery -------------------------------------------------------------------------------------

def test_thread_variants():
    assert thread_variants(1) == (1,)
    assert thread_variants(2) == (1, 2)
    assert thread_variants(6) == (1, 2, 4, 6)
    assert thread_variants(8) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="thread limit must be >= 1, got 0"):
        thread_variants(0)


def test_discover_lists_what_really_runs_here():
    found = discover()
    names = [str(b) for b in found]
    assert len(names) == len(set(names))
    assert "mnn:cpu:t1" in names and "torch:cpu:t1" in names
    # this wheel has MNN's CPU backend only: OpenCL and the rest fall back to the CPU with a log line,
    # so they must not be listed (the probe tells fallback from the real thing)
    assert "mnn:opencl" not in names and "mnn:vulkan" not in names and "mnn:cuda" not in names
    for device, present in K.available_backends().items():
        assert any(b.engine == "mnn" and b.device == device for b in found) == present, device
    torch_ok, gpus = RB.torch_devices()
    assert torch_ok
    assert [b.index for b in found if b.device == "cuda" and b.engine == "torch"] == list(range(gpus))
    cpus = os.cpu_count() or 1
    assert [b.threads for b in found if str(b).startswith("mnn:cpu")] == list(thread_variants(cpus))
    # every CPU backend found is one the profiler agrees is present
    cpu_names = [n for n in names if ":cpu:" in n]
    present, skipped = present_backends(cpu_names, cpus)
    assert [b.name for b in present] == cpu_names and not skipped


def test_discover_caps_the_thread_variants():
    found = discover(max_threads=1)
    assert [str(b) for b in found if b.device == "cpu"] == ["mnn:cpu:t1", "torch:cpu:t1"]
    assert discover(max_threads=10_000) == discover()  # never more threads than CPUs
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_threads must be an integer >= 1"):
            discover(max_threads=bad)


def test_discover_lists_torch_gpus_and_skips_a_missing_torch(monkeypatch):
    monkeypatch.setattr(RB, "torch_devices", lambda: (True, 2))
    names = [str(b) for b in discover(max_threads=1)]
    assert names[-3:] == ["torch:cpu:t1", "torch:cuda:0", "torch:cuda:1"]
    monkeypatch.setattr(RB, "torch_devices", lambda: (False, 0))
    assert not [b for b in discover(max_threads=1) if b.engine == "torch"]


def test_the_torch_probe_reads_its_child(monkeypatch):
    probe = RB.torch_devices.__wrapped__  # uncached
    monkeypatch.setattr(RB, "_TORCH_PROBE", "print('CONFIDANT_TORCH 1 2')")
    assert probe() == (True, 2)
    monkeypatch.setattr(RB, "_TORCH_PROBE", "print('CONFIDANT_TORCH 0 0')")
    assert probe() == (True, 0)
    monkeypatch.setattr(RB, "_TORCH_PROBE", "raise ImportError('broken torch')")
    assert probe() == (False, 0)
    monkeypatch.setattr(single_engine_module, "torch_installed", lambda: False)
    assert probe() == (False, 0)


def test_the_real_torch_probe_sees_no_gpu_in_this_cpu_build():
    assert RB.torch_devices.__wrapped__() == (True, 0)


# Engines ---------------------------------------------------------------------------------------

B, S, D, H, HS = 2, 8, 16, 2, 8


@pytest.fixture(scope="module")
def tiny_stage():
    mask = np.zeros((B, 1, 1, S), np.float32)
    mask[-1, ..., S // 2:] = -10000.0
    graph = attention_piece(B, S, D, H, HS, mask.shape, seed=3)
    x = np.random.default_rng(0).standard_normal((B, S, D)).astype(np.float32)
    return graph, stage_spec(graph, 1, 1), {"x": x, "mask": mask}


def _numpy_attention(graph, feeds):
    c = graph.constants
    x, mask = feeds["x"].astype(np.float64), feeds["mask"].astype(np.float64)

    def heads(p):
        y = x @ c[f"w{p}"] + c[f"b{p}"]
        return y.reshape(B, S, H, HS).transpose(0, 2, 1, 3)

    q, k, v = heads("q"), heads("k"), heads("v")
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HS) + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(B, S, H * HS)
    return ctx @ c["wo"]


@pytest.mark.parametrize("name", ["mnn:cpu:t1", "mnn:cpu:t2", "torch:cpu:t1"])
def test_make_stage_engine_runs_a_tiny_stage(tiny_stage, name):
    graph, spec, feeds = tiny_stage
    engine = make_stage_engine(name, spec)
    out = engine.forward(feeds, 0)
    np.testing.assert_allclose(out, _numpy_attention(graph, feeds), rtol=1e-4, atol=1e-5)
    grads = engine.backward(0, np.ones_like(out))
    assert set(grads.params) == set(spec.params)
    assert grads.activation_input.shape == feeds["x"].shape
    assert np.abs(grads.activation_input).sum() > 0


def test_make_stage_engine_picks_the_engine_and_threads(tiny_stage):
    _, spec, _ = tiny_stage
    mnn = make_stage_engine(BackendSpec.parse("mnn:cpu:t2"), spec)
    assert isinstance(mnn, MnnStageEngine) and mnn.threads == 2
    from runtime.engines.pytorch import TorchStageEngine, torch

    t = make_stage_engine("torch:cpu:t1", spec)
    assert isinstance(t, TorchStageEngine) and torch.get_num_threads() == 1


def test_the_two_engines_agree_on_gradients(tiny_stage):
    _, spec, feeds = tiny_stage
    grads = []
    for name in ("mnn:cpu:t1", "torch:cpu:t1"):
        engine = make_stage_engine(name, spec)
        out = engine.forward(feeds, 0)
        grads.append(engine.backward(0, np.full_like(out, 1e-2)))
    np.testing.assert_allclose(grads[0].activation_input, grads[1].activation_input, rtol=1e-3, atol=1e-6)
    for p in spec.params:
        np.testing.assert_allclose(grads[0].params[p], grads[1].params[p], rtol=1e-3, atol=1e-6, err_msg=p)


@pytest.mark.parametrize("name, message", [
    ("mnn:opencl", "mnn:opencl: the MNN stage engine drives MNN's cpu backend only"),
    ("mnn:cuda", "mnn:cuda: the MNN stage engine drives MNN's cpu backend only"),
    ("torch:cuda:0", "torch:cuda:0: the torch stage engine runs on the cpu only "
                     "(runtime.engines.pytorch has no device setting yet)"),
])
def test_make_stage_engine_refuses_devices_the_engines_cannot_drive(tiny_stage, name, message):
    with pytest.raises(NotImplementedError) as err:
        make_stage_engine(name, tiny_stage[1])
    assert str(err.value) == message


def test_make_stage_engine_says_when_torch_is_missing(tiny_stage, monkeypatch):
    monkeypatch.setattr(single_engine_module, "torch_installed", lambda: False)
    with pytest.raises(ModuleNotFoundError) as err:
        make_stage_engine("torch:cpu:t1", tiny_stage[1])
    assert str(err.value) == "torch:cpu:t1 needs PyTorch, which is not installed here (pip install torch==2.13.0)"
    with pytest.raises(ValueError, match="unknown engine"):
        make_stage_engine("tf:cpu:t1", tiny_stage[1])
