"""Fuzzing (issue 13): random and mutated frames into the transport, random bytes into bundle,
safetensors and graph.json parsing. Each must end in the one clear error of its layer (a
MessageError naming the peer, a BundleError naming the bundle and file, a ValueError from the
codec), never another exception, a crash or a hang. Example counts are small by default so the
suite stays fast; CONFIDANT_FUZZ_EXAMPLES raises them for a longer hunt."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ir.bundle import GRAPH, MANIFEST, STAGE, WEIGHTS, BundleError, verify_bundle_files
from ir.safetensors import decode_safetensors, encode_safetensors
from runtime.transport.local import LocalHub, LocalTransport
from runtime.transport.wire import Expected, MessageError, PeerTimeout, TensorHeader

EXAMPLES = int(os.environ.get("CONFIDANT_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _good_frames() -> list[bytes]:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    payload = x.tobytes()
    header = TensorHeader("act", 0, 3, -1, "float32", (3, 4), len(payload), zlib.crc32(payload))
    return [header.encode(), payload]


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    raw = bytearray(data)
    for pos, value in edits:
        if raw:
            raw[pos % len(raw)] = value
    return bytes(raw)


frames_strategy = st.one_of(
    st.lists(st.binary(max_size=300), min_size=0, max_size=4),
    st.tuples(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
              st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6)).map(
        lambda e: [_mutate(_good_frames()[0], e[0]), _mutate(_good_frames()[1], e[1])]),
)


@FUZZ
@given(frames=frames_strategy)
def test_random_and_mutated_frames_give_a_message_error_or_the_array(frames):
    hub = LocalHub()
    a, b = LocalTransport("a", hub), LocalTransport("b", hub)
    try:
        a._send_frames("b", frames)
        try:
            header, arr = b.recv_tensor("a", Expected("act", 0, 3), timeout=0.5)
            assert arr.shape == (3, 4)
        except PeerTimeout:
            assert len(frames) == 1  # a control frame waits on the control channel
            with pytest.raises(MessageError):
                b.recv_control("a", timeout=0.5)
        except MessageError as err:
            assert "peer 'a'" in str(err)
    finally:
        a.close()
        b.close()


@FUZZ
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_random_control_frames_give_a_message_error_or_a_dict(frames):
    hub = LocalHub()
    a, b = LocalTransport("a", hub), LocalTransport("b", hub)
    try:
        a._send_frames("b", frames[:1])
        try:
            _, msg = b.recv_control("a", timeout=0.5)
            assert isinstance(msg, dict)
        except MessageError as err:
            assert "peer 'a'" in str(err)
    finally:
        a.close()
        b.close()


def test_random_frames_over_zeromq_from_an_authenticated_peer_are_errors_and_from_strangers_noise():
    """The same garbage over CURVE: from the known peer a MessageError, from a stranger nothing."""
    from runtime.keys import KeyPair
    from runtime.transport.zeromq import ZmqTransport

    rng = np.random.default_rng(1)
    pa, pb = KeyPair.generate("a"), KeyPair.generate("b")
    b = ZmqTransport("b", "tcp://127.0.0.1:0", keys=pb.curve_keys(), accept={"a": pa.public.curve})
    a = ZmqTransport("a", None, {"b": b.address}, keys=pa.curve_keys(), peer_keys={"b": pb.public.curve})
    try:
        for _ in range(50):
            frames = [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 4)))]
            a._send_frames("b", frames)
            try:
                if len(frames) == 1:
                    b.recv_control("a", timeout=2)
                else:
                    b.recv_tensor("a", Expected("act", 0, 0), timeout=2)
            except MessageError:
                pass
            b.discard("a")
    finally:
        a.close()
        b.close()


# --- bundles, safetensors, graph.json ------------------------------------------------------------

@pytest.fixture(scope="module")
def bundle_files(tiny_checkpoint, export_dir, tmp_path_factory):
    """A real bundle (the tiny BERT's last two blocks), as the bytes a worker would receive."""
    from ir.bundle import read_bundle_files
    from ir.partition import Partition, StageAssignment
    from planner.emit import emit_plan
    from planner.onnx_import import load_model
    from planner.schedule import make_schedule
    from support import export_onnx

    graph = load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), 2, 12)
    n = len(graph.blocks)
    out = tmp_path_factory.mktemp("fuzz-plan")
    emit_plan(out, graph, Partition((StageAssignment(0, "a", 0, n - 3), StageAssignment(1, "b", n - 2, n - 1)),
                                    "manual"), make_schedule("1f1b-flush", 2, 2), {"model": "tiny"})
    return read_bundle_files(out / "b")


@FUZZ
@given(name=st.sampled_from([MANIFEST, STAGE, GRAPH, WEIGHTS]), data=st.binary(max_size=400))
def test_random_bytes_in_any_bundle_file_give_a_bundle_error(bundle_files, name, data):
    files = dict(bundle_files)
    files[name] = data
    with pytest.raises(BundleError) as err:
        verify_bundle_files(files, "fuzz")
    assert str(err.value).startswith("bundle fuzz:")


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 255)), min_size=1, max_size=8),
       name=st.sampled_from([STAGE, GRAPH, WEIGHTS]))
def test_mutated_bundle_files_give_a_bundle_error_or_verify(bundle_files, edits, name):
    files = dict(bundle_files)
    files[name] = _mutate(files[name], edits)
    try:
        verify_bundle_files(files, "fuzz")
    except BundleError as err:
        assert str(err).startswith("bundle fuzz:")


@FUZZ
@given(data=st.one_of(st.binary(max_size=300),
                      st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8).map(
                          lambda e: _mutate(encode_safetensors({"a": np.arange(6, dtype=np.float32),
                                                                "b": np.ones((2, 2), np.int64)}), e))))
def test_random_and_mutated_safetensors_give_a_value_error_or_tensors(data):
    try:
        out = decode_safetensors(data)
        assert all(isinstance(v, np.ndarray) for v in out.values())
    except ValueError:
        pass


@FUZZ
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                        max_leaves=20))
def test_random_graph_json_gives_a_bundle_error(bundle_files, doc):
    files = dict(bundle_files)
    files[GRAPH] = json.dumps(doc).encode()
    with pytest.raises(BundleError):
        verify_bundle_files(files, "fuzz")
