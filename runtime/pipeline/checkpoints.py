"""Training state at a flush boundary: gathered from the stages, merged, and kept on disk.

A checkpoint folder holds one safetensors file per stage (`param/<name>` and `opt/<kind>/<name>`
tensors, `opt/<scalar>` for the optimizer's step count) written with `ir.safetensors`, the
project's one codec (no pickle), and meta.json, written last: a folder without it is not a
checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.safetensors import load_safetensors, save_safetensors
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


def save_checkpoint(directory: Path, per_stage: Sequence[Mapping[str, np.ndarray]], meta: dict) -> None:
    """Weights and optimizer state per stage in safetensors (no pickle), plus meta.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for k, tensors in enumerate(per_stage):
        save_safetensors(directory / f"stage{k}.safetensors", tensors)
    (directory / "meta.json").write_text(json.dumps(meta, indent=1))


def load_checkpoint(directory: Path) -> tuple[dict, dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """meta, all parameters by name, and optimizer state per stage."""
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no meta.json")
    meta = json.loads(meta_path.read_text())
    weights: dict[str, np.ndarray] = {}
    opt: dict[int, dict[str, np.ndarray]] = {}
    for k in range(int(meta["stages"])):
        path = directory / f"stage{k}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} lacks {path.name}")
        tensors = load_safetensors(path)
        weights.update({n[len("param/"):]: v for n, v in tensors.items() if n.startswith("param/")})
        opt[k] = {n[len("opt/"):]: v for n, v in tensors.items() if n.startswith("opt/")}
    return meta, weights, opt
