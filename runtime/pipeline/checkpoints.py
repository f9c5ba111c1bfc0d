"""Training state at a flush boundary: gathered from the stages, merged, and kept on disk.

A checkpoint folder holds one safetensors file per stage (`param/<name>` and `opt/<kind>/<name>`
tensors, `opt/<scalar>` for the optimizer's step count) written with `ir.safetensors`, the
project's one codec (no pickle), and meta.json: a folder without it is not a checkpoint.

A folder is replaced as a whole, never file by file (`--checkpoint-every` writes the same folder
again and again, and a kill between two files used to leave stages of two different saves): the
new set is written into the sibling `.NAME.ckpt-new`, each file and the folder fsynced, then
swapped in by one rename(2) with RENAME_EXCHANGE, so at every instant NAME holds the complete old
set or the complete new one. Where the exchange is not available (not Linux, a file system without
it) the old folder is renamed aside (`.NAME.ckpt-old`) and the new one in; a kill between those two
renames leaves no NAME, and the next save or load finishes the swap (`_settle`). Leftover siblings
of a killed save are removed by the next save and never read.

meta.json is checked by one function (`check_meta`: types, ranges, required fields, each error
naming the file and the field), and a load checks that every stage's optimizer step count is the
one meta.json records, so a folder mixing saves (hand-copied files, a writer from before the
swap) is refused before anything runs on it. `check_tensors_fit` checks the tensors against the
model they are loaded into; `check_checkpoint_target` checks a folder to write before training.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.errors import InputFileError
from ir.plan import ASYNC_SCHEDULES
from ir.safetensors import encode_safetensors, load_safetensors
from runtime.optim import SparseRows


@dataclass
class TrainingState:
    """Every stage's training state gathered at a flush boundary and merged: parameters by name,
    optimizer state per kind and parameter ({"m": {name: array}, ...}), and the optimizer's
    scalars ({"steps": array}), which all stages share at a flush boundary."""

    weights: dict[str, np.ndarray]
    optimizer: dict[str, dict[str, np.ndarray]]
    scalars: dict[str, np.ndarray]

    def stage_optimizer_state(self, params: Sequence[str]) -> dict[str, np.ndarray]:
        """The optimizer state a stage running `params` loads (runtime.optim's keys)."""
        state = {f"{kind}/{x}": per_name[x] for kind, per_name in self.optimizer.items() for x in params
                 if x in per_name}
        return {**state, **self.scalars}

    def nbytes(self, param: str) -> int:
        """Bytes of one parameter and its optimizer state: what moving it costs."""
        return int(self.weights[param].nbytes) + sum(int(s[param].nbytes) for s in self.optimizer.values()
                                                     if param in s)


# A table's optimizer state kept by rows (runtime.optim.SparseRows) crosses the wire as two
# tensors, its row ids and those rows, and is made dense where it arrives: a stage does not build
# (and hold, until sent) a dense copy of every table's state for each snapshot.
ROW_IDS, ROW_VALUES = "#ids", "#rows"


def rows_on_wire(key: str, sparse) -> list[tuple[str, np.ndarray]]:
    """The two checkpoint tensors that carry state entry `key` (e.g. "opt/m/<table>") as rows."""
    return [(key + ROW_IDS, sparse.ids), (key + ROW_VALUES, sparse.rows)]


def dense_from_wire(tensors: dict[str, np.ndarray], row_shapes: object, source: str) -> dict[str, np.ndarray]:
    """`tensors` with each entry `rows_on_wire` split made dense again (`row_shapes`: entry key ->
    the dense shape, as the sender declared it). Everything is checked, since it came over the
    network: the shape must be the parameter's own (the same checkpoint's "param/<name>"), the
    ids in range and distinct, the rows shaped to match."""
    if not row_shapes:
        return tensors
    if not isinstance(row_shapes, dict):
        raise ValueError(f"{source}: checkpoint 'rows' must map entries to shapes, got {type(row_shapes).__name__}")
    out = dict(tensors)
    for key, shape in row_shapes.items():
        parts = key.split("/", 2) if isinstance(key, str) else []
        if len(parts) != 3 or parts[0] != "opt":
            raise ValueError(f"{source}: checkpoint row entry {key!r} is not opt/<kind>/<parameter>")
        param = out.get(f"param/{parts[2]}")
        if param is None:
            raise ValueError(f"{source}: checkpoint row entry {key!r} names parameter {parts[2]!r}, which the "
                             f"checkpoint does not hold")
        if list(param.shape) != shape:
            raise ValueError(f"{source}: checkpoint row entry {key!r} declares shape {shape}, its parameter is "
                             f"{list(param.shape)}")
        ids, rows = out.pop(key + ROW_IDS, None), out.pop(key + ROW_VALUES, None)
        if ids is None or rows is None:
            raise ValueError(f"{source}: checkpoint row entry {key!r} came without its {ROW_IDS} and {ROW_VALUES} "
                             f"tensors")
        if (ids.dtype != np.int64 or ids.ndim != 1 or rows.dtype != np.float32
                or rows.shape != (ids.size, *param.shape[1:])):
            raise ValueError(f"{source}: checkpoint row entry {key!r}: ids {ids.dtype}{list(ids.shape)} and rows "
                             f"{rows.dtype}{list(rows.shape)} do not make int64 [n] and float32 "
                             f"[n, {', '.join(map(str, param.shape[1:]))}]")
        if ids.size and (ids.min() < 0 or ids.max() >= param.shape[0] or np.unique(ids).size != ids.size):
            raise ValueError(f"{source}: checkpoint row entry {key!r} has row ids out of 0..{param.shape[0] - 1} "
                             f"or repeated")
        out[key] = SparseRows(ids, rows, param.shape).dense()
    stray = [k for k in out if k.endswith((ROW_IDS, ROW_VALUES))]
    if stray:
        raise ValueError(f"{source}: checkpoint tensors {stray} are rows of no declared entry")
    return out


def merge_checkpoint(per_stage: Sequence[Mapping[str, np.ndarray]]
                      ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """All stages' checkpoint tensors (`collect_checkpoint`) merged: parameters by name, optimizer
    state per kind and parameter ({"m": {name: array}, ...} from "opt/m/<name>"), and the
    optimizer's scalars ("opt/steps"), which every stage of a flush schedule must agree on."""
    weights: dict[str, np.ndarray] = {}
    states: dict[str, dict[str, np.ndarray]] = {}
    scalars: dict[str, np.ndarray] = {}
    for k, tensors in enumerate(per_stage):
        for key, arr in tensors.items():
            if key.startswith("param/"):
                name = key[len("param/"):]
                if name in weights and not np.array_equal(weights[name], arr):
                    raise RuntimeError(f"stage {k} holds a copy of tied weight {name!r} that differs from an earlier "
                                       f"stage's: the tied-gradient sums did not keep the copies equal")
                weights[name] = arr
            elif key.startswith("opt/"):
                entry = key[len("opt/"):]
                if "/" in entry:
                    kind, name = entry.split("/", 1)
                    states.setdefault(kind, {})[name] = arr
                elif entry in scalars and not np.array_equal(scalars[entry], arr):
                    raise RuntimeError(f"stages disagree on optimizer {entry!r} ({scalars[entry]} before stage {k}, "
                                       f"{arr} on stage {k}): not at a flush boundary")
                else:
                    scalars[entry] = arr
            else:
                raise RuntimeError(f"stage {k} sent checkpoint entry {key!r}, neither param/ nor opt/")
    return weights, states, scalars


# --- on disk ---------------------------------------------------------------------------------------

META = "meta.json"
# what a checkpoint folder may hold: meta.json, stage files, and the temporary files of the
# file-by-file writer that came before the whole-folder swap (a kill mid-file left one behind)
_CHECKPOINT_ENTRY = re.compile(r"meta\.json|\.?stage\d+\.safetensors(\.tmp)?|\.meta\.json\.tmp")
NEW_SUFFIX, OLD_SUFFIX = ".ckpt-new", ".ckpt-old"  # the siblings a save writes and swaps: .NAME.ckpt-new


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _at_least(n: int):
    return f"a whole number >= {n}", lambda v: _whole(v) and v >= n


def _or_null(rule):
    what, test = rule
    return f"{what} or null", lambda v: v is None or test(v)


_TEXT = ("a string", lambda v: isinstance(v, str))
_TEXTS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
# meta.json's fields: the required ones a load needs, then those the writers add (checked when present)
META_REQUIRED = {"stages": _at_least(1), "step": _at_least(0)}
# (each may be null: writers record None for what a run does not have, e.g. a plan run's labels)
META_OPTIONAL = {name: _or_null(rule) for name, rule in {
    "optimizer_steps": _at_least(0), "model": _TEXT, "model_path": _TEXT, "task": _TEXT, "command": _TEXT,
    "plan": _TEXT, "optimizer": _TEXT, "schedule": _TEXT, "labels": _TEXTS,
    "microbatches": _at_least(1), "batch": _at_least(1), "seq": _at_least(1), "seed": ("a whole number", _whole),
    "lr": ("a positive number", lambda v: _number(v) and v > 0),
    "lora": ("an object", lambda v: isinstance(v, dict)),
    "losses": ("a list of numbers", lambda v: isinstance(v, list) and all(_number(x) for x in v)),
    "checkpoint_every": _at_least(1), "devices": _TEXTS,
    "cuts": ("a list of whole numbers >= 1", lambda v: isinstance(v, list) and all(_whole(x) and x >= 1 for x in v)),
}.items()}
_META_FIX = "use a checkpoint folder as --checkpoint wrote it"


def check_meta(meta: object, source: Path | str) -> dict:
    """`meta` (meta.json as JSON read it) if it is a checkpoint's: an object with `stages` (>= 1),
    `step` (>= 0) and `ranges` (one [first, last] block pair per stage, from block 0, adjacent),
    and every other field it has of its type (META_OPTIONAL). InputFileError names `source` and
    the field."""
    if not isinstance(meta, dict):
        raise InputFileError(f"{source}: must hold a JSON object (a checkpoint's fields), not a "
                             f"{type(meta).__name__ if meta is not None else 'null'}; {_META_FIX}")
    for field_name, (what, test) in META_REQUIRED.items():
        if field_name not in meta:
            raise InputFileError(f"{source}: field '{field_name}' is missing; {_META_FIX}")
    for field_name, (what, test) in {**META_REQUIRED, **META_OPTIONAL}.items():
        if field_name in meta and not test(meta[field_name]):
            raise InputFileError(f"{source}: field '{field_name}' must be {what}, not {json.dumps(meta[field_name])}; "
                                 f"{_META_FIX}")
    ranges = meta.get("ranges")
    want = f"a list of {meta['stages']} [first, last] block pairs (one per stage, from block 0, adjacent)"
    if ranges is None:
        raise InputFileError(f"{source}: field 'ranges' is missing; {_META_FIX}")
    ok = isinstance(ranges, list) and len(ranges) == meta["stages"]
    ok = ok and all(isinstance(r, list) and len(r) == 2 and all(_whole(x) for x in r) and 0 <= r[0] <= r[1]
                    for r in ranges)
    ok = ok and ranges[0][0] == 0 and all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:]))
    if not ok:
        raise InputFileError(f"{source}: field 'ranges' must be {want}, not {json.dumps(ranges)}; {_META_FIX}")
    return meta


def read_meta(directory: Path) -> dict:
    """The checked meta.json of a checkpoint folder (`check_meta`)."""
    path = Path(directory) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputFileError(f"{path}: not valid JSON ({exc}); {_META_FIX}") from None
    return check_meta(meta, path)


def _siblings(directory: Path) -> tuple[Path, Path]:
    return (directory.parent / f".{directory.name}{NEW_SUFFIX}", directory.parent / f".{directory.name}{OLD_SUFFIX}")


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def check_checkpoint_target(directory: Path, flag: str = "--checkpoint") -> None:
    """Before training: can a checkpoint be written to `directory`? Not when it is a file, when a
    folder above it is a file, when it holds files that are not a checkpoint's (a save replaces the
    folder as a whole: they would go), or when the folder its swap renames in is not writable.
    InputFileError names `flag` and the path."""
    given = Path(directory)
    if given.exists() and not given.is_dir():
        raise InputFileError(f"{flag} {given}: is a file, not a folder; give the path of a folder to write the "
                             f"checkpoint in (it is made if missing)")
    above = _nearest_existing(given)
    if not above.is_dir():
        raise InputFileError(f"{flag} {given}: {above} is a file, so no folder can be made under it; give another path")
    if given.is_dir():
        foreign = sorted(e.name for e in given.iterdir() if not _CHECKPOINT_ENTRY.fullmatch(e.name))
        if foreign:
            raise InputFileError(f"{flag} {given}: the folder holds {', '.join(foreign[:3])}"
                                 f"{f' and {len(foreign) - 3} more' if len(foreign) > 3 else ''}, not a checkpoint's "
                                 f"files, and a checkpoint replaces its folder as a whole; give a new or empty folder")
    real = given.resolve()
    where = real.parent if real.exists() else _nearest_existing(real)
    if not os.access(where, os.W_OK | os.X_OK):
        raise InputFileError(f"{flag} {given}: cannot write in {where} (permission denied); give a folder in a "
                             f"writable place")


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100
_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders `a` and `b` in one step (Linux renameat2 RENAME_EXCHANGE); False where that
    is not available, so the caller renames in two steps."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(_libc, "renameat2", None)
    if call is None:
        return False
    if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # no exchange here
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _settle(directory: Path) -> None:
    """A swap a kill interrupted between its two renames (the fallback) left no `directory`: put
    the complete set back under its name (the new one if it was complete, else the old)."""
    if os.path.lexists(directory):
        return
    for candidate in _siblings(directory):
        if (candidate / META).is_file():
            os.rename(candidate, directory)
            _fsync_dir(directory.parent)
            return


def _optimizer_steps(per_stage: Sequence[Mapping[str, np.ndarray]]) -> int | None:
    counts = {k: int(np.asarray(t["opt/steps"]).reshape(-1)[0]) for k, t in enumerate(per_stage) if "opt/steps" in t}
    if len(set(counts.values())) > 1:
        raise RuntimeError(f"refusing to write a checkpoint whose stages disagree on the optimizer's step count "
                           f"({counts}): not at a flush boundary")
    return next(iter(counts.values()), None)


def save_checkpoint(directory: Path, per_stage: Sequence[Mapping[str, np.ndarray]], meta: dict) -> None:
    """Weights and optimizer state per stage in safetensors (no pickle), plus meta.json (with the
    optimizer's step count, `optimizer_steps`, which every stage's file must match), replacing
    `directory` as a whole (module docstring)."""
    check_checkpoint_target(directory, "checkpoint folder")
    directory = Path(directory).resolve()
    steps = _optimizer_steps(per_stage)
    meta = json.loads(json.dumps({**meta, "stages": len(per_stage),
                                  **({"optimizer_steps": steps} if steps is not None else {})}))
    try:  # what is written must load: a writer's slip is caught here, not at the resume
        check_meta(meta, f"the meta.json to write to {directory}")
    except InputFileError as exc:
        raise RuntimeError(str(exc)) from None
    directory.parent.mkdir(parents=True, exist_ok=True)
    _settle(directory)
    new, old = _siblings(directory)
    for leftover in (new, old):  # a killed save's, never read
        shutil.rmtree(leftover, ignore_errors=True)
    new.mkdir()
    for k, tensors in enumerate(per_stage):
        _write_durably(new / f"stage{k}.safetensors", encode_safetensors(tensors))
    _write_durably(new / META, json.dumps(meta, indent=1).encode())
    _fsync_dir(new)
    if not directory.exists():
        os.rename(new, directory)
    elif _exchange(new, directory):
        old = new  # it holds the old set now
    else:  # two renames: a kill between them leaves no `directory`, which `_settle` mends
        os.rename(directory, old)
        os.rename(new, directory)
    _fsync_dir(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(directory: Path) -> tuple[dict, dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """meta, all parameters by name, and optimizer state per stage, once meta.json passes
    `check_meta` and every stage's optimizer step count is the one it records (a folder mixing
    two saves is refused: InputFileError naming the folder)."""
    directory = Path(directory)
    if not os.path.lexists(directory):
        try:
            _settle(directory)
        except OSError:
            pass
    meta_path = directory / META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no meta.json")
    meta = read_meta(directory)
    weights: dict[str, np.ndarray] = {}
    opt: dict[int, dict[str, np.ndarray]] = {}
    for k in range(meta["stages"]):
        path = directory / f"stage{k}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} lacks {path.name}")
        try:
            tensors = load_safetensors(path)
        except ValueError as exc:
            raise InputFileError(f"checkpoint {directory}: {exc}") from None
        weights.update({n[len("param/"):]: v for n, v in tensors.items() if n.startswith("param/")})
        opt[k] = {n[len("opt/"):]: v for n, v in tensors.items() if n.startswith("opt/")}
    _check_steps(directory, meta, opt)
    return meta, weights, opt


def _check_steps(directory: Path, meta: dict, opt: Mapping[int, Mapping[str, np.ndarray]]) -> None:
    """Every stage's optimizer step count is meta.json's `optimizer_steps` (flush schedules and
    single-device runs without it: its `step`, one update per step; asynchronous schedules without
    it: the first stage's)."""
    field_name, want = "optimizer_steps", meta.get("optimizer_steps")
    if want is None and meta.get("schedule") not in ASYNC_SCHEDULES:
        field_name, want = "step", meta["step"]
    for k, state in opt.items():
        if "steps" not in state:
            continue
        got = np.asarray(state["steps"])
        if got.size != 1:
            raise InputFileError(f"checkpoint {directory}: stage{k}.safetensors holds opt/steps of shape "
                                 f"{list(got.shape)}, not one count; use an intact checkpoint")
        got = int(got.reshape(-1)[0])
        if want is None:
            field_name, want = f"stage{k}.safetensors's count", got
        elif got != want:
            raise InputFileError(f"checkpoint {directory} is torn: stage{k}.safetensors is at optimizer step {got}, "
                                 f"meta.json's {field_name} is {want} (its files come from different saves); use an "
                                 f"intact checkpoint, or train again without --resume")


def check_tensors_fit(source: Path | str, weights: Mapping[str, np.ndarray],
                      opt: Mapping[int, Mapping[str, np.ndarray]], params: Mapping[str, Sequence[int]],
                      model: Path | str, fix: str) -> None:
    """The checkpoint's trainable tensors are `params` (name -> shape of the model they are loaded
    into), by name and shape, and its optimizer state has their shapes: else InputFileError saying
    the checkpoint belongs to another model, and `fix`."""
    def shape(x) -> list[int]:
        return [int(d) for d in x]

    wrong = [(n, shape(weights[n].shape), shape(params[n])) for n in sorted(set(weights) & set(params))
             if shape(weights[n].shape) != shape(params[n])]
    wrong += [(f"opt/{key}", shape(arr.shape), shape(params[key.split("/", 1)[1]])) for state in opt.values()
              for key, arr in sorted(state.items())
              if "/" in key and key.split("/", 1)[1] in params
              and shape(arr.shape) != shape(params[key.split("/", 1)[1]])]
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if not (wrong or missing or extra):
        return
    if wrong:
        name, got, want = wrong[0]
        what = f"its tensor {name!r} is {got}, in {model} {want}"
        more = len(wrong) - 1
    elif missing:
        what, more = f"it lacks {model}'s parameter {missing[0]!r}", len(missing) - 1
    else:
        what, more = f"its tensor {extra[0]!r} is no parameter of {model}", len(extra) - 1
    raise InputFileError(f"checkpoint {source} belongs to another model: {what}"
                         f"{f' ({more} more like it)' if more > 0 else ''}; {fix}")
