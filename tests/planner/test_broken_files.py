"""A broken model file gets one line naming the file, the node where there is one, and what to do;
the command line exits with status 2 (bad input), never with a traceback or a bare KeyError."""
from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest

from planner.onnx_import import ImportError_, load_model
from support import run_cli

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "tests" / "fixtures" / "corpus" / "bert-ts17-sdpa-nofold.onnx"


def _edited(tmp_path: Path, name: str, edit) -> Path:
    model = onnx.load(str(GOOD))
    edit(model)
    out = tmp_path / f"{name}.onnx"
    onnx.save(model, str(out))
    return out


def _first(model, op: str):
    return next(n for n in model.graph.node if n.op_type == op)


def _unknown_op(model):
    _first(model, "Erf").op_type = "Sin"


def _no_input_ids(model):
    kept = [i for i in model.graph.input if i.name != "input_ids"]
    del model.graph.input[:]
    model.graph.input.extend(kept)


def _missing_node_input(model):
    _first(model, "MatMul").input[1] = ""


def _dangling(model):
    _first(model, "Softmax").input[0] = "val_from_nowhere"


def _dangling_output(model):
    model.graph.output[0].name = "logits_nobody_makes"


def _truncated(tmp_path):
    data = GOOD.read_bytes()
    out = tmp_path / "truncated.onnx"
    out.write_bytes(data[: len(data) // 2])
    return out


def _random(tmp_path):
    out = tmp_path / "random.onnx"
    out.write_bytes(os.urandom(4096))
    return out


def _empty(tmp_path):
    out = tmp_path / "empty.onnx"
    out.write_bytes(b"")
    return out


def _directory(tmp_path):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "model.onnx").write_bytes(GOOD.read_bytes())
    return out


def _case(tmp_path, kind):
    """(the broken file, what the message must say)"""
    edits = {"unknown-op": (_unknown_op, r"node '[^']*Erf[^']*' \(op Sin\): not in Confidant's op set"),
             "no-input-ids": (_no_input_ids, r"no graph input named 'input_ids'"),
             "missing-node-input": (_missing_node_input, r"node '[^']*MatMul[^']*' \(op MatMul\): has no input 'B'"),
             "dangling-name": (_dangling, r"node '[^']*Softmax[^']*' \(op Softmax\): reads value 'val_from_nowhere', "
                                          r"which no earlier node, initializer or graph input produces"),
             "dangling-output": (_dangling_output, r"graph output 'logits_nobody_makes' is produced by no node")}
    if kind in edits:
        edit, says = edits[kind]
        return _edited(tmp_path, kind, edit), says
    files = {"truncated": (_truncated, r"not a readable ONNX model"), "random-bytes": (_random, r"not a readable ONNX "
             r"model"), "empty": (_empty, r"the file is empty \(0 bytes\)"),
             "directory": (_directory, r"is a directory, not an ONNX file; give one of its ONNX files, "
                                       r"e.g. .*model.onnx")}
    make, says = files[kind]
    return make(tmp_path), says


KINDS = ["truncated", "random-bytes", "empty", "directory", "unknown-op", "no-input-ids", "missing-node-input",
         "dangling-name", "dangling-output"]


@pytest.mark.parametrize("kind", KINDS)
def test_lowering_a_broken_file_names_the_file_and_the_cause(tmp_path, kind):
    path, says = _case(tmp_path, kind)
    with pytest.raises(ImportError_, match=says) as err:
        load_model(path, 2, 8)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert "re-export" in message or "give" in message  # what to do


@pytest.mark.parametrize("kind", ["truncated", "directory", "unknown-op", "dangling-name", "missing-node-input"])
def test_the_cli_exits_2_with_one_line(tmp_path, kind):
    path, says = _case(tmp_path, kind)
    proc = run_cli("inspect", path, "--batch", 2, "--seq", 8)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith(f"confidant inspect: error: {path}: ")


def test_a_missing_file_is_bad_input_too(tmp_path):
    proc = run_cli("inspect", tmp_path / "nope.onnx")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"confidant inspect: error: {tmp_path / 'nope.onnx'}: no such ONNX file"
