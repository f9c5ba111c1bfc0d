"""A checkpoint on disk is whole or refused (runtime.pipeline.checkpoints).

A save replaces the folder as a whole: a writer killed (SIGKILL, a real process) at any moment of a
save leaves the complete old set or the complete new one, never stages of two saves. A folder that
mixes saves anyway (files copied by hand, a writer from before the swap), a hand-edited or foreign
meta.json, or the checkpoint of another model under the same file name is refused with one line
naming the checkpoint and the fix, exit status 2, before any worker starts; so is a --checkpoint
path no checkpoint can be written to, before any step is trained.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ir.errors import InputFileError
from runtime.pipeline.checkpoints import check_checkpoint_target, load_checkpoint, save_checkpoint
from support import make_tiny_tokenizer, run_cli, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _stages(step: int, value: float) -> list[dict[str, np.ndarray]]:
    """Two stages' tensors as a 2-stage AdamW run holds them after `step` updates."""
    return [{f"param/w{k}": np.full((2, 3), value, np.float32), f"opt/m/w{k}": np.full((2, 3), value, np.float32),
             "opt/steps": np.array(step)} for k in range(2)]


def _meta(step: int) -> dict:
    return {"model": "m.onnx", "step": step, "ranges": [[0, 1], [2, 3]], "schedule": "1f1b-flush"}


def _value_and_step(folder: Path) -> tuple[float, int]:
    """The one weight value and the step of a whole checkpoint (every tensor and count agree)."""
    meta, weights, opt = load_checkpoint(folder)
    values = {float(v) for w in weights.values() for v in w.ravel()} | {float(v) for s in opt.values()
                                                                          for k, w in s.items() if k != "steps"
                                                                          for v in w.ravel()}
    steps = {int(s["steps"]) for s in opt.values()} | {meta["step"], meta["optimizer_steps"]}
    assert len(values) == 1 and len(steps) == 1, (values, steps)
    return values.pop(), steps.pop()


# The writer: a first save (step 3, weights 1.0) completes, then a second (step 6, weights 2.0)
# is killed with SIGKILL at POINT, by a wrapper around the step the save takes there.
_KILLED_WRITER = r"""
import os, signal, sys
from pathlib import Path
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/tests", sys.argv[3] + "/tests/runtime"]  # this module
import runtime.pipeline.checkpoints as ck
from test_checkpoint_integrity import _meta, _stages

folder, point = Path(sys.argv[1]), sys.argv[2]
ck.save_checkpoint(folder, _stages(3, 1.0), _meta(3))
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
write, exchange, rename = ck._write_durably, ck._exchange, os.rename
if point.startswith("before "):  # before writing that file of the new set
    ck._write_durably = lambda path, data: (die() if path.name == point[7:] else None, write(path, data))
elif point == "after the exchange":  # the new set swapped in, the old not yet removed
    ck._exchange = lambda a, b: (exchange(a, b), die())
elif point == "between the fallback's renames":  # no RENAME_EXCHANGE: old renamed aside, new not yet in
    ck._exchange = lambda a, b: False
    renames = []
    def rename_then_die(a, b):
        renames.append(a)
        if len(renames) == 2:
            die()
        rename(a, b)
    ck.os.rename = rename_then_die
elif point == "after the swap, before the old set is removed":  # the real swap, whichever way it is done
    removals, rmtree = [], ck.shutil.rmtree
    def rmtree_then_die(path, *args, **kwargs):
        removals.append(path)
        if len(removals) == 3:  # the first two clear a killed save's leftovers, before writing
            die()
        rmtree(path, *args, **kwargs)
    ck.shutil.rmtree = rmtree_then_die
ck.save_checkpoint(folder, _stages(6, 2.0), _meta(6))
"""


@pytest.mark.parametrize("point, survivor", [
    ("before stage0.safetensors", (1.0, 3)),
    ("before stage1.safetensors", (1.0, 3)),   # the probe's (a): stage0 of the new save written
    ("before meta.json", (1.0, 3)),            # the probe's (b): every stage written, meta.json not
    ("after the exchange", (2.0, 6)),
    ("between the fallback's renames", (2.0, 6)),
    ("after the swap, before the old set is removed", (2.0, 6)),  # no hook on _exchange: the swap is real
])
def test_a_writer_killed_at_any_moment_of_a_save_leaves_one_whole_checkpoint(tmp_path, point, survivor):
    folder = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(folder), point, str(ROOT)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ck."))  # the killed save's leftover
    assert _value_and_step(folder) == survivor  # leftovers are never read; an interrupted swap is finished
    save_checkpoint(folder, _stages(9, 3.0), _meta(9))  # the next save cleans up after the killed one
    assert _value_and_step(folder) == (3.0, 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "stage0.safetensors", "stage1.safetensors"]


def test_a_save_fsyncs_every_file_then_the_folder_before_the_swap_and_the_parent_after(tmp_path, monkeypatch):
    """Issue 32 (removing os.fsync passed every test here): each file of the new set, then its
    folder, are made durable while they still sit under the new set's temporary name, before it
    is swapped in; then the parent folder, so that the swap itself survives a power cut."""
    from runtime.pipeline.checkpoints import NEW_SUFFIX

    folder = tmp_path / "ck"
    save_checkpoint(folder, _stages(3, 1.0), _meta(3))
    synced, fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))  # where the file is when it is synced
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save_checkpoint(folder, _stages(6, 2.0), _meta(6))
    new = folder.resolve().parent / f".ck{NEW_SUFFIX}"
    assert synced == [new / "stage0.safetensors", new / "stage1.safetensors", new / "meta.json", new,
                      folder.resolve().parent], synced
    assert _value_and_step(folder) == (2.0, 6)


def _two_saves(tmp_path: Path) -> tuple[Path, Path]:
    save_checkpoint(tmp_path / "at3", _stages(3, 1.0), _meta(3))
    save_checkpoint(tmp_path / "at6", _stages(6, 2.0), _meta(6))
    return tmp_path / "at3", tmp_path / "at6"


def test_a_folder_mixing_two_saves_is_refused_naming_the_stage_and_the_fix(tmp_path):
    at3, at6 = _two_saves(tmp_path)
    mixed = shutil.copytree(at3, tmp_path / "mixed")  # (a) a later save's stage0 over an earlier one
    shutil.copy(at6 / "stage0.safetensors", mixed)
    stale = shutil.copytree(at6, tmp_path / "stale")  # (b) every stage of the later save, its meta.json not
    shutil.copy(at3 / "meta.json", stale)
    old = shutil.copytree(at6, tmp_path / "old")  # (b) as a writer without optimizer_steps left it
    meta = json.loads((at3 / "meta.json").read_text())
    del meta["optimizer_steps"]
    (old / "meta.json").write_text(json.dumps(meta))
    for folder, field, stage in ((mixed, "optimizer_steps", 0), (stale, "optimizer_steps", 0), (old, "step", 0)):
        with pytest.raises(InputFileError) as err:
            load_checkpoint(folder)
        assert str(err.value) == (f"checkpoint {folder} is torn: stage{stage}.safetensors is at optimizer step 6, "
                                  f"meta.json's {field} is 3 (its files come from different saves); use an intact "
                                  f"checkpoint, or train again without --resume")


META_EDITS = [
    (lambda m: "", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (lambda m: [1, 2], "must hold a JSON object (a checkpoint's fields), not a list"),
    (lambda m: {k: v for k, v in m.items() if k != "stages"}, "field 'stages' is missing"),
    (lambda m: {**m, "stages": "two"}, "field 'stages' must be a whole number >= 1, not \"two\""),
    (lambda m: {**m, "stages": True}, "field 'stages' must be a whole number >= 1, not true"),
    (lambda m: {**m, "step": -5}, "field 'step' must be a whole number >= 0, not -5"),
    (lambda m: {**m, "ranges": [[0, 1]]}, "field 'ranges' must be a list of 2 [first, last] block pairs (one per "
                                          "stage, from block 0, adjacent), not [[0, 1]]"),
    (lambda m: {**m, "ranges": [[0, 1], [3, 4]]}, "field 'ranges' must be a list of 2 [first, last] block pairs "
                                                  "(one per stage, from block 0, adjacent), not [[0, 1], [3, 4]]"),
    (lambda m: {**m, "lr": "fast"}, "field 'lr' must be a positive number or null, not \"fast\""),
    (lambda m: {**m, "labels": "O,B-LOC"}, "field 'labels' must be a list of strings or null, not \"O,B-LOC\""),
]


@pytest.mark.parametrize("edit, message", META_EDITS)
def test_a_hand_edited_meta_json_is_refused_naming_the_file_and_the_field(tmp_path, edit, message):
    at3, _ = _two_saves(tmp_path)
    meta = json.loads((at3 / "meta.json").read_text())
    edited = edit(meta)
    (at3 / "meta.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(InputFileError) as err:
        load_checkpoint(at3)
    assert str(err.value) == f"{at3 / 'meta.json'}: {message}; use a checkpoint folder as --checkpoint wrote it"


def test_a_checkpoint_path_no_checkpoint_can_be_written_to_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    cases = {tmp_path / "afile": "is a file, not a folder; give the path of a folder to write the checkpoint in (it "
                                 "is made if missing)",
             tmp_path / "afile" / "sub": f"{tmp_path / 'afile'} is a file, so no folder can be made under it; give "
                                         f"another path",
             tmp_path / "notes": "the folder holds todo.txt, not a checkpoint's files, and a checkpoint replaces its "
                                 "folder as a whole; give a new or empty folder"}
    for path, message in cases.items():
        with pytest.raises(InputFileError) as err:
            check_checkpoint_target(path)
        assert str(err.value) == f"--checkpoint {path}: {message}"
    at3, _ = _two_saves(tmp_path)
    for fine in (tmp_path / "new" / "deeper", tmp_path / "notes" / "ck", at3):  # new, or a checkpoint again
        check_checkpoint_target(fine)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_checkpoint_in_a_folder_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    try:
        with pytest.raises(InputFileError, match=r"cannot write in .*ro \(permission denied\)"):
            check_checkpoint_target(tmp_path / "ro" / "ck")
    finally:
        os.chmod(tmp_path / "ro", 0o755)


# --- the command line: a real train-pipeline over local worker processes ---------------------------

CONLL = "\n\n".join("\n".join(f"{w}\t{t}" for w, t in zip(s.split(), tags.split()))
                    for s, tags in [("rome x .", "B-LOC O O"), ("x unbelievable rome .", "O O B-LOC O"),
                                    ("x x .", "O O O"), ("rome rome x .", "B-LOC I-LOC O O")] * 4) + "\n"


def _export(folder: Path, hidden: int) -> Path:
    """A tiny 9-label BERT token classifier (CoNLL's labels) of width `hidden`, as folder/m.onnx."""
    import torch
    import transformers as T

    from jobs.export.encoder import ExportOptions, export_model

    torch.manual_seed(0)
    cfg = tiny_config("bert", 2, 9, hidden_size=hidden)
    folder.mkdir(parents=True, exist_ok=True)
    return export_model(T.AutoModelForTokenClassification.from_config(cfg).eval(), folder / "m.onnx",
                        ExportOptions(num_labels=9))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, the common flags, a real 2-stage checkpoint after 4 steps and one after 2, written
    by --checkpoint-every 2 into the same folder as training went on)."""
    root = tmp_path_factory.mktemp("ckpt-cli")
    make_tiny_tokenizer().save(str(root / "tokenizer.json"))
    (root / "train.txt").write_text(CONLL)
    model = _export(root / "model", 32)
    _export(root / "other", 48)
    common = ("--data", root / "train.txt", "--local", 2, "--batch", 4, "--seq", 8, "--microbatches", 2,
              "--tokenizer", root / "tokenizer.json")
    proc = run_cli("train-pipeline", model, *common, "--steps", 2, "--checkpoint", root / "at2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("train-pipeline", model, *common, "--steps", 4, "--checkpoint", root / "at4",
                   "--checkpoint-every", 2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((root / "at4" / "meta.json").read_text())["optimizer_steps"] == 4
    return root, common


@pytest.fixture
def no_workers(monkeypatch):
    """Every refusal below comes before a worker is started (or a step trained)."""
    from jobs.train.pipeline import LocalWorkers

    def started(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(LocalWorkers, "start", started)
    monkeypatch.setattr("jobs.train.local.train_steps", started)


def test_resuming_a_torn_edited_or_foreign_checkpoint_is_refused_before_any_worker_starts(trained, tmp_path,
                                                                                          no_workers):
    root, common = trained
    mixed = shutil.copytree(root / "at2", tmp_path / "mixed")
    shutil.copy(root / "at4" / "stage0.safetensors", mixed)
    stale = shutil.copytree(root / "at4", tmp_path / "stale")
    shutil.copy(root / "at2" / "meta.json", stale)
    negative = shutil.copytree(root / "at2", tmp_path / "negative")
    meta = json.loads((negative / "meta.json").read_text())
    (negative / "meta.json").write_text(json.dumps({**meta, "step": -5}))
    torn = ("is torn: stage0.safetensors is at optimizer step 4, meta.json's optimizer_steps is 2 (its files come "
            "from different saves); use an intact checkpoint, or train again without --resume")
    cases = [(root / "model" / "m.onnx", mixed, f"checkpoint {mixed} {torn}"),
             (root / "model" / "m.onnx", stale, f"checkpoint {stale} {torn}"),
             (root / "model" / "m.onnx", negative, f"{negative / 'meta.json'}: field 'step' must be a whole number "
                                                   f">= 0, not -5; use a checkpoint folder as --checkpoint wrote it"),
             (root / "other" / "m.onnx", root / "at4",
              f"checkpoint {root / 'at4'} belongs to another model: its tensor 'inner.bert.embeddings.LayerNorm.bias' "
              f"is [32], in {root / 'other' / 'm.onnx'} [48] (107 more like it); resume with the model it was trained "
              f"from ({root / 'model' / 'm.onnx'}), or train without --resume")]
    for model, folder, message in cases:
        proc = run_cli("train-pipeline", model, *common, "--steps", 1, "--resume", folder)
        assert (proc.returncode, proc.stderr) == (2, f"confidant train-pipeline: error: {message}\n")


def test_an_unusable_checkpoint_path_is_refused_before_training(trained, tmp_path, no_workers):
    root, common = trained
    (tmp_path / "afile").write_text("x")
    proc = run_cli("train-pipeline", root / "model" / "m.onnx", *common, "--steps", 3, "--checkpoint",
                   tmp_path / "afile")
    assert (proc.returncode, proc.stderr) == (2, f"confidant train-pipeline: error: --checkpoint {tmp_path / 'afile'}: "
                                                 f"is a file, not a folder; give the path of a folder to write the "
                                                 f"checkpoint in (it is made if missing)\n")
    proc = run_cli("train-local", root / "model" / "m.onnx", "--data", root / "train.txt", "--eval",
                   root / "train.txt", "--steps", 3, "--batch", 4, "--seq", 8, "--tokenizer", root / "tokenizer.json",
                   "--checkpoint", tmp_path / "afile" / "sub")
    assert (proc.returncode, proc.stderr) == (2, f"confidant train-local: error: --checkpoint "
                                                 f"{tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file, so no "
                                                 f"folder can be made under it; give another path\n")


def test_predict_refuses_a_broken_meta_json_and_a_checkpoint_of_another_model(trained, tmp_path):
    root, _ = trained
    (tmp_path / "in.txt").write_text("rome x .\n")
    listed = shutil.copytree(root / "at2", tmp_path / "listed")
    (listed / "meta.json").write_text("[1, 2]")
    proc = run_cli("predict", listed, "--input", tmp_path / "in.txt", "--tokenizer", root / "tokenizer.json",
                   "--seq", 8)
    assert (proc.returncode, proc.stderr) == (2, f"confidant predict: error: {listed / 'meta.json'}: must hold a JSON "
                                                 f"object (a checkpoint's fields), not a list; use a checkpoint folder "
                                                 f"as --checkpoint wrote it\n")
    moved = shutil.copytree(root / "at2", tmp_path / "moved")  # its model_path now holds the wider model
    meta = json.loads((moved / "meta.json").read_text())
    (moved / "meta.json").write_text(json.dumps({**meta, "model_path": str(root / "other" / "m.onnx")}))
    proc = run_cli("predict", moved, "--input", tmp_path / "in.txt", "--tokenizer", root / "tokenizer.json",
                   "--seq", 8)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"confidant predict: error: checkpoint {moved} belongs to another model: its tensor ")
    assert proc.stderr.endswith(f"; put the ONNX file it was trained from back at {root / 'other' / 'm.onnx'}\n")


def test_a_resume_from_a_checkpoint_written_as_training_went_on_continues(trained, tmp_path):
    """The whole-folder save keeps what --resume reads: 2 steps, then 2 more from that checkpoint,
    end where 4 straight steps end (the folder rewritten in place by --checkpoint-every 2)."""
    root, common = trained
    proc = run_cli("train-pipeline", root / "model" / "m.onnx", *common, "--steps", 2, "--resume", root / "at2",
                   "--checkpoint", tmp_path / "again")
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, want, want_opt = load_checkpoint(root / "at4")
    meta, got, got_opt = load_checkpoint(tmp_path / "again")
    assert meta["step"] == meta["optimizer_steps"] == 4
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
