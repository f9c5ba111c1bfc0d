"""Lowering holds each weight once (issue 31, lever 2): `load_model` reads the initializers straight
from the file into their arrays (planner/onnx_weights.py), never beside the file's bytes and a parsed
copy of them (`onnx.load` + `numpy_helper.to_array`: MiniLM 2.1x its weights at the peak, SmolLM2
1124 MiB for 513), and lowers to exactly what lowering onnx's own reading of the file gives."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from planner.onnx_import import ImportError_, ImportOptions, load_model, lower_model, read_onnx

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fixtures" / "corpus"
SMALL = CORPUS / "bert-ts17-sdpa-nofold.onnx"
MIB = 2 ** 20

_CHILD = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from planner.onnx_import import load_model
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes

load_model(sys.argv[3], 2, 8)  # onnx's and the passes' lazy imports, before the level peaks are read from
gc.collect()
release_free_heap()
assert reset_peak_rss()
before = rss_bytes()
graph = load_model(sys.argv[2], 2, 16)
print("PEAK " + json.dumps({"peak": peak_rss_bytes() - before,
                            "weights": sum(int(v.nbytes) for v in graph.constants.values())}))
"""


def test_lowering_peaks_at_its_weights_held_once(minilm_onnx):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), str(minilm_onnx), str(SMALL)], capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PEAK "))[5:])
    assert got["weights"] > 80 * MIB
    # measured: 98 MiB for 86 MiB of weights (onnx.load and to_array: 185)
    assert got["peak"] <= 1.25 * got["weights"], (got["peak"] / MIB, got["weights"] / MIB)


_ENGINE_CHILD = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes

warm = load_model(sys.argv[3], 2, 8)
make_engine("mnn:cpu:t1", stage_spec(warm, 0, len(warm.blocks) - 1), take_weights=True)
del warm
graph = load_model(sys.argv[2], 2, 16)
weights = sum(int(graph.constants[p].nbytes) for p in graph.params)
gc.collect()
release_free_heap()
assert reset_peak_rss()
before = rss_bytes()
engine = make_engine("mnn:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), take_weights=True)
print("PEAK " + json.dumps({"peak": peak_rss_bytes() - before, "held": rss_bytes() - before, "weights": weights}))
"""


def test_an_engine_that_takes_its_weights_never_holds_them_twice(minilm_onnx):
    """Full fine-tuning on MNN with `take_weights` (a worker's stage): each caller's array is let go
    as its trainable Var is built, so setting up adds one weight's copy at most, not the stage's
    (all Vars first, then the arrays: SmolLM2 1050 MiB at setup for 513 of weights, now 654)."""
    out = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, str(ROOT), str(minilm_onnx), str(SMALL)],
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PEAK "))[5:])
    assert got["weights"] > 80 * MIB
    # measured: 8 MiB for 86 MiB of weights (every Var built first: 46, the 41 MiB of weights MNN
    # holds twice; the embedding table, held in numpy, is taken as it is)
    assert got["peak"] <= 0.25 * got["weights"], (got["peak"] / MIB, got["held"] / MIB, got["weights"] / MIB)


def _assert_same_lowering(path: Path, reference) -> None:
    ours = load_model(path, 2, 12)
    theirs = lower_model(reference, ImportOptions(2, 12), source=str(path))
    assert ours.nodes == theirs.nodes and ours.params == theirs.params and ours.blocks == theirs.blocks
    assert ours.values == theirs.values and ours.constants.keys() == theirs.constants.keys()
    for name, value in theirs.constants.items():
        assert ours.constants[name].dtype == value.dtype and np.array_equal(ours.constants[name], value), name


@pytest.mark.parametrize("name", sorted(p.name for p in CORPUS.glob("*.onnx")))
def test_lowering_the_file_apart_equals_lowering_onnx_s_reading_of_it(name):
    _assert_same_lowering(CORPUS / name, read_onnx(CORPUS / name))


def _halved(model, dtype) -> None:
    for k, t in enumerate(model.graph.initializer):
        if t.data_type == onnx.TensorProto.FLOAT:
            value = numpy_helper.to_array(t)
            model.graph.initializer[k].CopyFrom(
                onnx.helper.make_tensor(t.name, dtype, value.shape, value.astype(np.float16).tobytes(), raw=True)
                if dtype == onnx.TensorProto.FLOAT16 else
                onnx.helper.make_tensor(t.name, dtype, value.shape,
                                        (value.view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True))


@pytest.mark.parametrize("kind", ["external-data", "float16", "bfloat16"])
def test_weights_beside_the_file_and_in_half_precision_lower_as_onnx_reads_them(tmp_path, kind):
    model = onnx.load(str(SMALL))
    path = tmp_path / "model.onnx"
    if kind == "external-data":
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
                  size_threshold=0)
        assert (tmp_path / "weights.bin").stat().st_size > path.stat().st_size  # the weights really are beside it
    else:
        _halved(model, onnx.TensorProto.FLOAT16 if kind == "float16" else onnx.TensorProto.BFLOAT16)
        onnx.save(model, str(path))
    _assert_same_lowering(path, read_onnx(path))
    if kind == "external-data":
        beside, inside = load_model(path, 2, 12), load_model(SMALL, 2, 12)
        assert beside.params == inside.params
        for name in inside.params:
            np.testing.assert_array_equal(beside.constants[name], inside.constants[name])


def test_external_data_outside_the_model_s_folder_is_refused(tmp_path):
    model = onnx.load(str(SMALL))
    inside = tmp_path / "model"
    inside.mkdir()
    onnx.save(model, str(inside / "model.onnx"), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    (inside / "weights.bin").rename(tmp_path / "weights.bin")
    model = onnx.load(str(inside / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../weights.bin"
    onnx.save(model, str(inside / "model.onnx"))
    with pytest.raises(ImportError_, match=r"model.onnx: the weights stored next to it \(external data, .*"
                                           r"not a file inside"):
        load_model(inside / "model.onnx", 2, 12)


def test_a_mapped_lowering_equals_the_read_one_and_gives_its_pages_back(minilm_onnx):
    """`load_model(mapped=True)` (a pipeline coordinator's, issue 32): the same graph, its weights
    of 64 KiB or more read-only views onto a mapping of the file, resident only while read:
    `drop_mapped_pages` after reading them all gives back about the weights' bytes of resident
    memory (the arrays of a plain lowering are the process's own: nothing to give back)."""
    from planner.onnx_weights import MAP_MIN_BYTES, drop_mapped_pages
    from runtime.procfs import rss_bytes

    read = load_model(minilm_onnx, 2, 16)
    mapped = load_model(minilm_onnx, 2, 16, mapped=True)
    assert mapped.nodes == read.nodes and mapped.params == read.params and mapped.constants.keys() == read.constants.keys()
    big = [n for n, v in mapped.constants.items() if v.nbytes >= MAP_MIN_BYTES]
    on_file = sum(mapped.constants[n].nbytes for n in big)
    assert on_file > 80 * MIB
    for name, value in read.constants.items():
        ours = mapped.constants[name]
        assert ours.dtype == value.dtype and np.array_equal(ours, value), name
        assert not ours.flags.writeable or name not in big, name
    assert drop_mapped_pages(read.constants.values()) == 0
    assert drop_mapped_pages(mapped.constants.values()) == 1
    before = rss_bytes()
    assert sum(float(mapped.constants[n].sum()) for n in big) != 0.0  # every page read
    touched = rss_bytes()
    drop_mapped_pages(mapped.constants.values())
    assert touched - before > 0.9 * on_file, ((touched - before) / MIB, on_file / MIB)
    assert touched - rss_bytes() > 0.9 * on_file, ((touched - rss_bytes()) / MIB, on_file / MIB)


def test_a_mapped_file_changed_since_it_was_mapped_is_one_error_naming_it(tmp_path):
    """Issue 32: the coordinator reads frozen weights through a mapping of the model file again
    (a re-plan, the evaluation); the file rewritten in place (`open(path, "wb")`: the same inode,
    truncated) or replaced is one ModelFileChanged naming it, seen on the mapped descriptor before
    any page is read. A file renamed over the path leaves the mapping on the old inode intact: only a
    reader opening the path again (`reopened`) is refused."""
    from planner.onnx_weights import ModelFileChanged, check_mapped_files, map_file, map_raw

    path = tmp_path / "w.bin"
    weights = np.arange(1 << 15, dtype=np.float32)  # 128 KiB: mapped, not read
    path.write_bytes(weights.tobytes())

    def mapped():
        return map_raw(map_file(path), 0, weights.nbytes, 1, weights.shape)

    same = mapped()
    assert check_mapped_files([same, np.zeros(3), "not an array"]) == 1
    assert check_mapped_files([same], reopened=True) == 1
    with open(path, "r+b") as f:  # the same size, other bytes
        f.write(b"\1" * 64)
    with pytest.raises(ModelFileChanged, match=f"^{path}: the model file changed while this run used it "
                                               r"\(it was written to\)"):
        check_mapped_files([same])
    path.write_bytes(weights.tobytes())
    view = mapped()
    with open(path, "wb") as f:  # truncated in place: a read of the mapping past the end would be SIGBUS
        f.write(weights[:10].tobytes())
    with pytest.raises(ModelFileChanged, match=f"its size went from {weights.nbytes} to 40 bytes"):
        check_mapped_files([view[5:]])  # a view of a mapped array finds its mapping too
    path.write_bytes(weights.tobytes())
    view = mapped()
    other = tmp_path / "new.bin"
    other.write_bytes((weights + 1).tobytes())
    other.replace(path)  # renamed over: the mapping still reads the old inode's weights
    assert check_mapped_files([view]) == 1 and float(view[7]) == 7.0
    with pytest.raises(ModelFileChanged, match="another file was put in its place"):
        check_mapped_files([view], reopened=True)
    path.unlink()
    with pytest.raises(ModelFileChanged, match="it was removed"):
        check_mapped_files([view], reopened=True)



def test_a_mapped_file_rewritten_at_its_size_with_its_mtime_set_back_is_refused_by_its_digest(tmp_path):
    """h28's check compared the file's identity (device, inode, size, mtime): a file rewritten in
    place at its size with its mtime restored passed it, and the run read other weights. The
    mapping keeps the file's SHA-256, and a check reads the file again (with pread: no page of the
    mapping is faulted in) and refuses it, one line naming the file."""
    from planner.onnx_weights import ModelFileChanged, check_mapped_files, map_file, map_raw
    from runtime.procfs import rss_bytes

    path = tmp_path / "w.bin"
    weights = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    path.write_bytes(weights.tobytes())
    view = map_raw(map_file(path), 0, weights.nbytes, 1, weights.shape)
    before = os.stat(path)
    rss = rss_bytes()
    assert check_mapped_files([view]) == 1
    assert rss_bytes() - rss < weights.nbytes // 2  # the digest read none of the mapping's pages in
    with open(path, "r+b") as f:  # the same size, other bytes, and the mtime set back
        f.seek(1 << 21)
        f.write(np.float32(-1).tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns
    with pytest.raises(ModelFileChanged) as refused:
        check_mapped_files([view])
    assert str(refused.value) == (
        f"{path}: the model file changed while this run used it (its bytes are not the ones mapped: their SHA-256 "
        "differs, at the same size and modification time); its frozen weights are read from that file again during "
        "the run (a re-plan after a lost device, the evaluation): leave the file unchanged until the run ends (write "
        "a new model to another path)")


_EMIT_AFTER_TRUNCATION = r"""
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[2]]
from ir.partition import Partition, StageAssignment
from planner.emit import emit_in_memory
from planner.onnx_import import load_model
from planner.schedule import make_schedule

path = Path(sys.argv[1])
graph = load_model(path, 2, 16, mapped=True)
size = path.stat().st_size
with open(path, "wb") as f:  # rewritten in place, shorter: the mapped pages past its end are gone
    f.write(b"\0" * (size // 4))
n = len(graph.blocks)
partition = Partition((StageAssignment(0, "a", 0, 1), StageAssignment(1, "b", 2, n - 1)), "manual")
try:
    emit_in_memory(graph, partition, make_schedule("1f1b-flush", 2, 2), {})
except ValueError as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
    sys.exit(0)
print("EMITTED", flush=True)
"""


def test_a_plan_emitted_from_a_model_file_truncated_since_it_was_mapped_is_refused_not_sigbus(tiny_onnx, tmp_path):
    """A re-plan's emission reads the frozen weights through the mapping again: the file truncated in
    place since is refused in one line naming it, where reading the mapping was SIGBUS (measured:
    the child killed by signal 7 with the check left out)."""
    import shutil

    path = tmp_path / "m.onnx"
    shutil.copy(tiny_onnx["torchscript-17"], path)
    done = subprocess.run([sys.executable, "-c", _EMIT_AFTER_TRUNCATION, str(path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith(f"REFUSED ModelFileChanged {path}: the model file changed while this run used it"), \
        done.stdout


def test_weights_beside_the_file_read_mapped_are_views_onto_that_file(tmp_path, export_dir):
    """`load_model(mapped=True)` views the weights an external data file holds as it views the model file's own
    (a model past protobuf's 2 GiB keeps them there: the Qwen2.5-0.5B-class export's 1884 MiB, which were read
    into anonymous memory whatever the run gave back, 3.9 GB at train-local's set-up; helper h165): the same
    weights are views, now onto a mapping of weights.bin, and hold what the file embedding them holds."""
    from ir.mapped_pages import mapping_of
    from support import wide_bert_onnx

    wide = wide_bert_onnx(export_dir)  # 25 MiB of weights, most over the 64 KiB a mapping views
    path = tmp_path / "model.onnx"
    onnx.save(onnx.load(str(wide)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    beside, inside = load_model(path, 2, 12, mapped=True), load_model(wide, 2, 12, mapped=True)
    viewed_inside = {k for k, v in inside.constants.items() if mapping_of(v) is not None}
    viewed_beside = {k for k, v in beside.constants.items() if mapping_of(v) is not None}
    assert viewed_inside and viewed_beside == viewed_inside
    assert {len(mapping_of(beside.constants[k])) for k in viewed_beside} == {(tmp_path / "weights.bin").stat().st_size}
    assert not any(beside.constants[k].flags.writeable for k in viewed_beside)
    for name in inside.constants:
        np.testing.assert_array_equal(np.asarray(beside.constants[name]), np.asarray(inside.constants[name]))
