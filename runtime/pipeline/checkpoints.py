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
