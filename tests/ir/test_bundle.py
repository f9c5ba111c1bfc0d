"""Plan bundles: written, verified, read back and run the same; every kind of damage is refused by name."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import export_onnx, token_feeds
from ir.bundle import (ACTIONS, BUNDLE_FILES, GRAPH, MANIFEST, PLAN, STAGE, WEIGHTS, BundleError,
                       build_bundle_files, check_device_name, read_bundle_files, sha256_hex, verify_bundle_files,
                       write_bundle)
from ir.safetensors import assemble_safetensors, decode_safetensors, encode_safetensors, hash_tensors
from ir.partition import Partition, StageAssignment, StageCost
from ir.serialize import graph_to_json, slice_graph
from planner.emit import emit_plan, load_plan
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.pipeline.bundles import (bundle_to_wire, load_bundle, recv_bundle, send_bundle, send_bundle_file,
                                      wire_to_files)
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.transport.local import LocalHub, LocalTransport

DEVICES = ("pi-a", "jetson.b")
RANGES = ((0, 1), (2, 4))
CONFIG = {"model": "tiny-bert", "optimizer": "sgd", "lr": 1e-3, "threads": {"pi-a": 2, "jetson.b": 1},
          "addresses": {"pi-a": "tcp://10.0.0.2:5555"}}


def _partition(devices=DEVICES, ranges=RANGES) -> Partition:
    return Partition(tuple(StageAssignment(s, d, f, l, predicted_time_s=0.1 * (s + 1), memory_bytes=1000 + s,
                                           memory_budget_bytes=10 ** 9)
                           for s, (d, (f, l)) in enumerate(zip(devices, ranges))), "manual")


@pytest.fixture(scope="module")
def graph(export_dir, tiny_checkpoint):
    # The same file as tiny_onnx["torchscript-17"], without exporting the other variants when run alone.
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), 2, 12)


@pytest.fixture(scope="module")
def schedule():
    return make_schedule("1f1b-flush", 2, 4)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory, graph, schedule):
    out = tmp_path_factory.mktemp("plan")
    costs = [StageCost(s, d, 0.01, 0.02, 0.001, 0.003, 0.003) for s, d in enumerate(DEVICES)]
    path = emit_plan(out, graph, _partition(), schedule, CONFIG, costs, predicted_step_s=0.75)
    assert path == out / PLAN
    return out


@pytest.fixture
def files(plan_dir):
    """Stage 0's bundle as bytes by file name, for damaging in memory."""
    return read_bundle_files(plan_dir / DEVICES[0])


def _rehash(files: dict[str, bytes]) -> dict[str, bytes]:
    """A hand-edited bundle whose manifest was updated to match: only the semantic checks can catch it."""
    manifest = json.loads(files[MANIFEST])
    manifest["files"] = {n: sha256_hex(files[n]) for n in BUNDLE_FILES}
    return {**files, MANIFEST: json.dumps(manifest).encode()}


def _refused(files, source="B") -> str:
    with pytest.raises(BundleError) as info:
        verify_bundle_files(files, source)
    return str(info.value)


# Round trip -------------------------------------------------------------------------------------

def test_bundles_hold_exactly_their_files_and_no_onnx(plan_dir):
    assert sorted(p.name for p in plan_dir.iterdir()) == sorted([PLAN, *DEVICES])
    for d in DEVICES:
        assert sorted(p.name for p in (plan_dir / d).iterdir()) == sorted([MANIFEST, *BUNDLE_FILES])
    assert not list(plan_dir.rglob("*.onnx"))
    manifest = json.loads((plan_dir / DEVICES[1] / MANIFEST).read_text())
    assert manifest["schema_version"] == 1 and manifest["format"] == "confidant-bundle"
    assert (manifest["device"], manifest["stage"]) == (DEVICES[1], 1)
    assert manifest["files"] == {n: sha256_hex((plan_dir / DEVICES[1] / n).read_bytes()) for n in BUNDLE_FILES}


@pytest.mark.parametrize("stage", [0, 1])
def test_round_trip_runs_identically(plan_dir, graph, schedule, stage):
    b = load_bundle(plan_dir / DEVICES[stage])
    first, last = RANGES[stage]
    assert (b.stage, b.stages, b.device, b.first_block, b.last_block) == (stage, 2, DEVICES[stage], first, last)
    assert b.actions == schedule.actions[stage]
    assert (plan_dir / DEVICES[stage] / ACTIONS).read_text().split() == [str(a) for a in schedule.actions[stage]]
    doc = b.stage_doc.to_json()  # stage.json as written
    assert doc["peers"] == {"prev": DEVICES[0] if stage else None, "next": None if stage else DEVICES[1]}
    assert (doc["schedule"], doc["microbatches"], doc["update_every"], doc["batch"], doc["seq"]) == \
        ("1f1b-flush", 4, 4, 2, 12)
    assert doc["optimizer"] == {"name": "sgd", "lr": 1e-3, "weight_decay": None}
    assert doc["threads"] == CONFIG["threads"][DEVICES[stage]] and doc["engine"] == "mnn"
    part = slice_graph(graph, first, last)
    assert list(b.graph.constants) == list(part.constants)
    for name, arr in part.constants.items():
        assert b.graph.constants[name].dtype == arr.dtype
        np.testing.assert_array_equal(b.graph.constants[name], arr)
    feeds = token_feeds(2, 12, vocab=500)
    spec_a, spec_b = stage_spec(graph, first, last), stage_spec(b.graph, first, last)
    if spec_a.activation_input:
        feeds[spec_a.activation_input] = np.random.default_rng(0).standard_normal(
            graph.values[spec_a.activation_input].shape).astype(np.float32)
    np.testing.assert_array_equal(MnnStageEngine(spec_a).forward(feeds, 0), MnnStageEngine(spec_b).forward(feeds, 0))


def test_writing_is_deterministic_and_rewrites_a_bundle_in_place(plan_dir, graph, schedule, tmp_path):
    b = load_bundle(plan_dir / DEVICES[0])
    target = tmp_path / "again"
    for _ in range(2):  # the second write replaces the first bundle's files
        write_bundle(target, b.stage_doc, graph_to_json(b.graph), b.graph.constants, b.actions, plan_id=b.plan_id)
    assert b.plan_id is not None  # emit_plan binds its bundles to the plan
    assert read_bundle_files(target) == read_bundle_files(plan_dir / DEVICES[0])
    (target / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match=r"holds notes.txt, which are not bundle files"):
        write_bundle(target, b.stage_doc, graph_to_json(b.graph), b.graph.constants, b.actions)


# Damage ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUNDLE_FILES)
def test_a_flipped_byte_in_any_file_is_refused_by_name(files, name):
    expected = json.loads(files[MANIFEST])["files"][name]
    data = bytearray(files[name])
    data[len(data) // 2] ^= 0xFF
    got = sha256_hex(bytes(data))
    assert _refused({**files, name: bytes(data)}, "out/pi-a") == (
        f"bundle out/pi-a: {name} is corrupted (sha256 mismatch: expected {expected[:12]}..., got {got[:12]}...)")


def test_any_change_to_the_manifest_is_refused(files):
    assert _refused({**files, MANIFEST: b"\xff" + files[MANIFEST][1:]}).startswith(
        "bundle B: manifest.json is not valid JSON")
    raw = files[MANIFEST]
    # the plan's identity is a hex digest that nothing inside one bundle repeats: a digit changed there
    # is still a digest, refused by the signature and by load_plan (the other bundles name the plan)
    plan_id = json.loads(raw)["plan"].encode()
    ours = range(raw.index(plan_id), raw.index(plan_id) + len(plan_id))
    for i in range(len(raw)):
        for bit in (0x01, 0x20):
            if i in ours and bit == 0x01:
                continue
            damaged = bytearray(raw)
            damaged[i] ^= bit
            with pytest.raises(BundleError):
                verify_bundle_files({**files, MANIFEST: bytes(damaged)}, "B")


def test_missing_extra_and_foreign_files(files, plan_dir, tmp_path):
    assert _refused({k: v for k, v in files.items() if k != WEIGHTS}) == \
        "bundle B: weights.safetensors is missing (manifest.json lists it)"
    assert _refused({k: v for k, v in files.items() if k != MANIFEST}) == \
        "bundle B: manifest.json is missing (not a bundle, or its writing was interrupted)"
    assert _refused({**files, "model.onnx": b"onnx"}) == (
        "bundle B: model.onnx is not listed in manifest.json (a bundle holds only its listed files; "
        "remove it or re-run `confidant plan`)")
    # The same from disk: a copied bundle with a stray file, a sub-directory.
    copy = tmp_path / "pi-a"
    shutil.copytree(plan_dir / DEVICES[0], copy)
    (copy / "extra.bin").write_bytes(b"x")
    with pytest.raises(BundleError, match=r"extra.bin is not listed in manifest.json"):
        load_bundle(copy)
    (copy / "extra.bin").unlink()
    (copy / "sub").mkdir()
    with pytest.raises(BundleError, match=r"sub is not a plain file"):
        load_bundle(copy)
    with pytest.raises(BundleError, match=r"no such directory"):
        load_bundle(tmp_path / "nowhere")


def test_foreign_schema_version_is_refused(files):
    manifest = json.loads(files[MANIFEST])
    manifest["schema_version"] = 2
    assert _refused({**files, MANIFEST: json.dumps(manifest).encode()}, "out/pi-a") == (
        "bundle out/pi-a: manifest.json: schema_version 2 is not supported by this build (reads 1); "
        "re-run `confidant plan` with this version")


def test_manifest_with_a_wrong_hash_is_refused(files):
    manifest = json.loads(files[MANIFEST])
    expected = manifest["files"][GRAPH] = sha256_hex(b"another graph")
    got = sha256_hex(files[GRAPH])
    assert _refused({**files, MANIFEST: json.dumps(manifest).encode()}) == (
        f"bundle B: graph.json is corrupted (sha256 mismatch: expected {expected[:12]}..., got {got[:12]}...)")
    del manifest["files"][ACTIONS]
    assert _refused({**files, MANIFEST: json.dumps(manifest).encode()}) == \
        "bundle B: manifest.json does not list actions.txt"


def test_actions_of_another_stage_are_refused(files, plan_dir, graph, schedule, tmp_path):
    other = "".join(f"{a}\n" for a in schedule.actions[1]).encode()
    assert _refused(_rehash({**files, ACTIONS: other})) == (
        f"bundle B: actions.txt line 1: {schedule.actions[1][0]} is an action of stage 1, this bundle is stage 0")
    b = load_bundle(plan_dir / DEVICES[0])
    with pytest.raises(BundleError, match=r"is an action of stage 1, this bundle is stage 0"):
        write_bundle(tmp_path / "x", b.stage_doc, graph_to_json(b.graph), b.graph.constants, schedule.actions[1])
    assert not (tmp_path / "x").exists()
    assert "cannot parse action 's0.JUMP.m1'" in _refused(_rehash({**files, ACTIONS: b"s0.F.m0\ns0.JUMP.m1\n"}))
    assert "names micro-batch 7, the schedule has 4" in _refused(_rehash({**files, ACTIONS: b"s0.F.m7\n"}))


def test_inconsistent_contents_are_refused_even_with_matching_hashes(files, graph):
    stage_doc = json.loads(files[STAGE])
    assert "stage.json says device 'other'" in _refused(_rehash(
        {**files, STAGE: json.dumps({**stage_doc, "device": "other"}).encode()}))
    assert "stage.json lacks optimizer" in _refused(_rehash(
        {**files, STAGE: json.dumps({k: v for k, v in stage_doc.items() if k != "optimizer"}).encode()}))
    assert "is bound to batch 2, seq 12; stage.json says batch 4" in _refused(_rehash(
        {**files, STAGE: json.dumps({**stage_doc, "batch": 4}).encode()}))
    weights = decode_safetensors(files[WEIGHTS])
    name = sorted(weights)[0]
    fewer = encode_safetensors({k: v for k, v in weights.items() if k != name})
    assert f"weights.safetensors does not match graph.json's constants: missing ['{name}']" in \
        _refused(_rehash({**files, WEIGHTS: fewer}))
    assert "weights.safetensors is not valid safetensors: header length" in \
        _refused(_rehash({**files, WEIGHTS: files[WEIGHTS][:100]}))


# safetensors --------------------------------------------------------------------------------------

def test_safetensors_codec_agrees_with_the_safetensors_package(graph):
    from safetensors.numpy import load, save

    tensors = dict(graph.constants) | {"scalar": np.array(2.5, np.float32), "flags": np.array([True, False])}
    ours = encode_safetensors(tensors)
    for got in (load(ours), decode_safetensors(save(tensors)), decode_safetensors(ours)):
        assert sorted(got) == sorted(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
    assert decode_safetensors(ours)["scalar"].flags.writeable
    # a file received over the wire: a read-only uint8 array, read where it lies (wire_to_files
    # keeps its buffer, no copy of what may be hundreds of MB), decoded into writable copies
    received = np.frombuffer(ours, np.uint8)
    files = wire_to_files({WEIGHTS: received})
    assert np.shares_memory(np.asarray(files[WEIGHTS]), received)
    got = decode_safetensors(files[WEIGHTS])
    assert all(np.array_equal(got[k], v) and got[k].flags.writeable for k, v in tensors.items())
    with pytest.raises(ValueError, match="starts at byte"):
        header_len = int.from_bytes(ours[:8], "little")
        header = json.loads(ours[8:8 + header_len])
        first = min(header, key=lambda n: header[n]["data_offsets"][0])
        header[first]["data_offsets"] = [4, 4 + header[first]["data_offsets"][1]]
        text = json.dumps(header).encode()
        decode_safetensors(len(text).to_bytes(8, "little") + text + ours[8 + header_len:] + b"\0" * 4)
    with pytest.raises(ValueError, match="cannot hold"):
        encode_safetensors({"x": np.zeros(2, np.complex64)})


@pytest.mark.parametrize("chunk", [4 << 20, 64])  # one read a tensor, and many (the last one short)
def test_a_checkpoints_float_tensors_read_one_at_a_time_as_float32_as_torch_widens_them(tmp_path, monkeypatch, chunk):
    """`safetensors_float_tensors`: the F32, F16 and BF16 tensors of a file the safetensors package wrote
    (transformers' checkpoints), each read alone and widened exactly: torch's `.float()` is the reference."""
    import torch
    from safetensors.torch import save_file

    import ir.precision
    import ir.safetensors
    from ir.safetensors import safetensors_float_tensors

    monkeypatch.setattr(ir.safetensors, "_READ_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1e-40, -3.5e38, float("inf"), float("-inf"), float("nan"), 65504.0])
    tensors = {"w.bf16": torch.randn(33, 7, generator=gen).to(torch.bfloat16), "b.bf16": special.to(torch.bfloat16),
               "w.f16": torch.randn(5, 9, generator=gen).to(torch.float16), "w.f32": torch.randn(4, 3, generator=gen),
               "ids": torch.arange(6), "scalar": torch.tensor(1.5, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    got = safetensors_float_tensors(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(k for k in tensors if k != "ids")
    assert {k: t.stored for k, t in got.items()} == {"w.bf16": "BF16", "b.bf16": "BF16", "w.f16": "F16",
                                                    "w.f32": "F32", "scalar": "BF16"}
    for name, t in got.items():
        value = t.read()
        assert value.dtype == np.float32 and value.shape == tuple(tensors[name].shape) == t.shape
        assert t.nbytes == value.nbytes
        assert value.tobytes() == tensors[name].float().numpy().tobytes(), name  # bitwise, NaN included
        if value.ndim == 2:  # a writer's chunks of rows: the same bits, every row once, in order
            chunks = t.row_chunks(max_bytes=5 * 4 * value.shape[1])
            assert chunks[0][0] == 0 and chunks[-1][1] == value.shape[0] and len(chunks) == -(-value.shape[0] // 5)
            rows = np.concatenate([t.read_rows(lo, hi) for lo, hi in chunks])
            assert rows.tobytes() == value.tobytes(), name
    # quantized from the file a chunk of rows at a time (blocked along its rows): what the whole array gives
    from ir.precision import dequantize, quantize

    monkeypatch.setattr(ir.precision, "_CHUNK_ELEMENTS", 64)
    for storage in ("int4", "int8", "bfloat16"):
        whole, streamed = quantize(got["w.bf16"].read(), storage, axis=1), quantize(got["w.bf16"], storage, axis=1)
        assert streamed.shape == whole.shape and np.array_equal(dequantize(streamed), dequantize(whole)), storage
        assert np.array_equal(streamed.codes, whole.codes) and np.array_equal(streamed.scales, whole.scales)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        (tmp_path / "bad.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0[]")
        safetensors_float_tensors(tmp_path / "bad.safetensors")


_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16",
           "uint8", "bool")


@st.composite
def _tensor_dicts(draw):
    out = {}
    for name in draw(st.lists(st.text(min_size=1, max_size=8).filter(lambda n: n != "__metadata__"),
                              max_size=5, unique=True)):
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        raw = draw(st.binary(min_size=64, max_size=64))
        dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
        n = int(np.prod(shape, dtype=np.int64))
        values = np.frombuffer((raw * 4)[: n * dtype.itemsize], np.uint8)
        out[name] = (values % 2).astype(bool).reshape(shape) if dtype == np.bool_ else values.view(dtype).reshape(shape)
    return out


@settings(max_examples=60, deadline=None)
@given(_tensor_dicts())
def test_safetensors_codec_round_trips_any_tensors(tensors):
    from safetensors.numpy import load

    data = encode_safetensors(tensors)
    assert data == encode_safetensors(dict(reversed(list(tensors.items()))))  # order-independent bytes
    # put together a tensor at a time (a weights file as the coordinator ships it): the same bytes,
    # the same SHA-256, told how far it got after each tensor
    copied = []
    assert assemble_safetensors(tensors, after_each=copied.append) == data
    assert hash_tensors(tensors).sha256 == hashlib.sha256(data).hexdigest()
    assert len(copied) == len(tensors) and copied == sorted(copied) and copied[-1:] in ([], [len(data)])
    for got in (decode_safetensors(data), load(data)):
        assert sorted(got) == sorted(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            assert got[k].tobytes() == v.tobytes()  # bitwise, NaNs included


# plan.json ------------------------------------------------------------------------------------------

def test_plan_json_fields(plan_dir, schedule):
    doc = load_plan(plan_dir, verify_bundles=True).to_json()  # plan.json as written
    assert doc["schema_version"] == 1 and doc["format"] == "confidant-plan"
    assert (doc["model"], doc["schedule"], doc["microbatches"], doc["batch"], doc["seq"]) == \
        ("tiny-bert", "1f1b-flush", 4, 2, 12)
    assert (doc["predicted_step_s"], doc["partition_method"]) == (0.75, "manual")
    assert doc["actions"] == [[str(a) for a in row] for row in schedule.actions]
    assert [d["name"] for d in doc["devices"]] == list(DEVICES)
    d0, d1 = doc["devices"]
    assert (d0["blocks"], d0["memory_bytes"], d0["memory_budget_bytes"], d0["predicted_time_s"]) == \
        ([0, 1], 1000, 10 ** 9, 0.1)
    assert d0["address"] == "tcp://10.0.0.2:5555" and "address" not in d1
    assert d1["blocks"] == [2, 4] and d1["cost"]["forward_s"] == 0.01
    assert d0["manifest_sha256"] == sha256_hex((plan_dir / DEVICES[0] / MANIFEST).read_bytes())


def test_load_plan_refuses_stale_bundles_and_foreign_versions(plan_dir, tmp_path):
    copy = tmp_path / "plan"
    shutil.copytree(plan_dir, copy)
    manifest = copy / DEVICES[1] / MANIFEST
    manifest.write_bytes(manifest.read_bytes() + b" ")
    with pytest.raises(BundleError, match=r"bundle jetson.b/ is not the one plan.json was written with"):
        load_plan(copy)
    doc = json.loads((copy / PLAN).read_text())
    (copy / PLAN).write_text(json.dumps({**doc, "schema_version": 2}))
    with pytest.raises(BundleError, match=r"schema_version 2 is not supported by this build \(reads 1\)"):
        load_plan(copy)
    (copy / PLAN).write_text(json.dumps({**doc, "devices": doc["devices"][::-1]}))
    with pytest.raises(BundleError, match=r"is stage 1 at position 0"):
        load_plan(copy)
    edited = json.loads(json.dumps(doc))
    edited["devices"][0]["address"] = "10.0.0.2:5555"
    (copy / PLAN).write_text(json.dumps(edited))
    with pytest.raises(BundleError, match=rf"device '{DEVICES[0]}' address '10.0.0.2:5555' is not of the form "
                                          r"tcp://HOST:PORT \(it does not start with tcp://\)"):
        load_plan(copy)


@pytest.mark.parametrize("bad", ["../evil", "a/b", "", ".hidden", "-x", "con", "NUL.txt", "plan.json", "x" * 65,
                                 "a b", "trailing.", "é"])
def test_unsafe_device_names_are_refused(graph, schedule, tmp_path, bad):
    with pytest.raises(BundleError, match="cannot name a bundle directory"):
        emit_plan(tmp_path, graph, _partition((bad, "ok")), schedule, {})
    assert not (tmp_path / PLAN).exists()


def test_duplicate_and_mismatched_plans_are_refused(graph, schedule, tmp_path):
    with pytest.raises(BundleError, match="used twice"):
        emit_plan(tmp_path, graph, _partition(("Pi", "pi")), schedule, {})
    with pytest.raises(ValueError, match="the schedule has 3 stages, the partition 2"):
        emit_plan(tmp_path, graph, _partition(), make_schedule("gpipe", 3, 2), {})
    with pytest.raises(ValueError, match="expected a range starting at block 2"):
        emit_plan(tmp_path, graph, _partition(ranges=((0, 1), (3, 4))), schedule, {})
    with pytest.raises(ValueError, match="unknown config key"):
        emit_plan(tmp_path, graph, _partition(), schedule, {"lerning_rate": 1})
    assert check_device_name("pi-4.local_2") == "pi-4.local_2"


# Over the wire ----------------------------------------------------------------------------------

def test_bundle_over_the_transport_is_verified_on_arrival(plan_dir, files, tmp_path):
    hub = LocalHub()
    coordinator, worker = LocalTransport("coordinator", hub), LocalTransport("stage0", hub)
    names = send_bundle(coordinator, "stage0", plan_dir / DEVICES[0])
    assert names[0] == MANIFEST and sorted(names) == sorted([MANIFEST, *BUNDLE_FILES])
    b = recv_bundle(worker, "coordinator", names, timeout=5)
    assert b.device == DEVICES[0] and b.manifest == json.loads(files[MANIFEST])["files"]
    # Bytes that pass the transport's own checksum but differ from the planner's are still refused.
    wire = bundle_to_wire(plan_dir / DEVICES[0])
    damaged = bytearray(wire[WEIGHTS])
    damaged[-1] ^= 0x01
    wire[WEIGHTS] = bytes(damaged)
    for i, (name, data) in enumerate(wire.items()):
        send_bundle_file(coordinator, "stage0", i, name, data)
    with pytest.raises(BundleError, match=r"bundle from coordinator: weights.safetensors is corrupted"):
        recv_bundle(worker, "coordinator", list(wire), timeout=5)
    # The coordinator does not ship a damaged bundle in the first place.
    copy = tmp_path / "pi-a"
    shutil.copytree(plan_dir / DEVICES[0], copy)
    (copy / STAGE).write_bytes((copy / STAGE).read_bytes().replace(b'"seq": 12', b'"seq": 13'))
    with pytest.raises(BundleError, match=rf"bundle {copy}: stage.json is corrupted"):
        send_bundle(coordinator, "stage0", copy)


def test_build_refuses_a_bad_stage_doc(files, graph):
    stage_doc = json.loads(files[STAGE])
    part = slice_graph(graph, 0, 1)
    with pytest.raises(BundleError, match=r"stage.json peers.next is None, not a device name"):
        build_bundle_files({**stage_doc, "peers": {"prev": None, "next": None}}, graph_to_json(part),
                           part.constants, [])


def test_a_stash_plan_carries_its_steady_state_and_its_bundles_run_any_number_of_steps(graph, tmp_path):
    """Issue 34: 1f1b-stash's steady state is emitted into each stage.json and verified with the
    bundle; the bundles' one-step actions and steady state unroll to exactly the schedule over k
    steps (what the coordinator once made and sent at run time), and a steady action of another
    stage is refused like one of actions.txt."""
    from ir.bundle import schedule_of_bundles

    stash = make_schedule("1f1b-stash", 2, 4)
    emit_plan(tmp_path / "plan", graph, _partition(), stash, CONFIG, predicted_step_s=0.5)
    contents = [load_bundle(tmp_path / "plan" / d) for d in DEVICES]
    assert all(c.steady for c in contents)
    assert json.loads((tmp_path / "plan" / DEVICES[0] / STAGE).read_text())["steady"]["drain_at"] == contents[0].drain_at
    plan = schedule_of_bundles(contents)
    for k in (1, 2, 5):
        want = make_schedule("1f1b-stash", 2, 4 * k).actions
        assert plan.for_steps(k).actions == want
        assert [c.actions_for_steps(k) for c in contents] == list(want)
    # a flush plan's stage.json has no steady state (its bytes as before)
    flush = tmp_path / "flush"
    emit_plan(flush, graph, _partition(), make_schedule("1f1b-flush", 2, 4), CONFIG, predicted_step_s=0.5)
    assert "steady" not in json.loads((flush / DEVICES[0] / STAGE).read_text())
    files = read_bundle_files(tmp_path / "plan" / DEVICES[0])
    doc = json.loads(files[STAGE])
    doc["steady"]["actions"][0] = "s1.F.m4"
    assert "stage.json steady action 1: s1.F.m4 is an action of stage 1, this bundle is stage 0" in _refused(
        _rehash({**files, STAGE: (json.dumps(doc) + "\n").encode()}))
