"""The state a recovery restores, held by the coordinator without holding it whole (issue 32: the
coordinator's peak at most the largest worker's; on a user's devices the coordinator is a device
too).

A recovery re-plans over the survivors and sets every new stage up from its plan bundle, which is
written from the weights training has reached, and from the optimizer state of its parameters
(runtime.pipeline.coordinator.reconfigure). The weights must be at hand to write the bundles; the
optimizer state (AdamW's two moments: twice the weights) is only passed on, one stage's at a
time, one tensor at a time. So the state comes off the wire (`Coordinator.fetch_held_stages`, a
window of 1 MiB chunks at a time, a larger tensor put together as they come) into a `TrainingState` whose weights and scalars are in memory and whose
optimizer entries are `SpooledTensor`s: written to a folder of this run as they arrive and read
back one at a time when a setup sends them (`np.asarray` reads one). The coordinator's fallback
copy (`FallbackCopies`' spool) is read the same way, its files read back only as each tensor is
sent; a checkpoint one stage's file at a time, its optimizer state written here.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from runtime.pipeline.checkpoints import ROW_IDS, ROW_VALUES, TrainingState, dense_from_wire, merge_checkpoint


class SpooledTensor:
    """A tensor kept on disk: its shape, dtype and size known, its bytes read (`np.asarray`) only
    when it is used, and not kept after."""

    __slots__ = ("shape", "dtype", "nbytes", "_read")

    def __init__(self, shape, dtype, read: Callable[[], np.ndarray]):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._read = read

    def __array__(self, dtype=None, copy=None):
        arr = self._read()
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"a spooled tensor read back as {arr.dtype}{list(arr.shape)}, written as "
                             f"{self.dtype}{list(self.shape)}")
        return arr if dtype is None else arr.astype(dtype, copy=False)

    @classmethod
    def npy(cls, path: Path) -> "SpooledTensor":
        """The .npy file at `path` (its header read now, its data when used)."""
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = header(f)
        return cls(shape, dtype, lambda: np.load(path, allow_pickle=False))


def _kept_in_memory(name: str) -> bool:
    """Parameters (a bundle is written from them) and the optimizer's scalars ("opt/steps")."""
    return name.startswith("param/") or (name.startswith("opt/") and "/" not in name[len("opt/"):])


class RestoreSpool:
    """A folder of this run's where a recovery's optimizer state waits to be sent to the new stages
    (`state_of`); `clear` removes what the last recovery left, `close` the folder."""

    def __init__(self):
        self.folder: Path | None = None
        self._n = 0
        # bytes of state that came in since the last `state_of` (what a recovery fetched off the workers)
        self.bytes_in = 0

    def clear(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    close = clear

    def state_of(self, stages: Iterable, source: str) -> TrainingState:
        """The training state of `stages` ((stage, rows declaration, iterator of (name, tensor)) each,
        as `Coordinator.fetch_held_stages` yields them), merged: parameters and scalars kept, every
        other tensor written here as it comes and kept as a `SpooledTensor`. A table's rows
        (`rows_on_wire`) are made dense once the stage's copy is in (its parameter's shape is then
        known), and written away too."""
        self.clear()
        self.folder = Path(tempfile.mkdtemp(prefix="confidant-restore-"))
        self.bytes_in = 0
        per_stage = []
        for stage, rows, tensors in stages:
            kept: dict = {}
            pieces: dict[str, np.ndarray] = {}  # a table's rows, till its parameter's shape is known
            for name, arr in tensors:
                self.bytes_in += int(arr.nbytes)
                if _kept_in_memory(name):
                    kept[name] = np.asarray(arr)
                elif name.endswith((ROW_IDS, ROW_VALUES)):
                    pieces[name] = np.asarray(arr)
                else:  # a file already (the coordinator's own spool) stays where it is
                    kept[name] = arr if isinstance(arr, SpooledTensor) else self._write(arr)
                del arr
            if pieces or rows:
                params = {k: v for k, v in kept.items() if k.startswith("param/")}
                dense = dense_from_wire({**params, **pieces}, rows, f"{source}, stage {stage}")
                for name, arr in dense.items():
                    if name not in params:
                        kept[name] = self._write(arr)
                del dense, pieces
            per_stage.append(kept)
        return TrainingState(*merge_checkpoint(per_stage))

    def add_moments(self, state: TrainingState, stages: Iterable, source: str) -> None:
        """Add to `state` (from `state_of`) the optimizer tensors `stages` bring (as `state_of` takes
        them; no parameters among them: a recovery's second fetch, of the moved blocks' moments
        only, once the new plan says which moved: runtime.pipeline.kept_state), spooled here."""
        for stage, rows, tensors in stages:
            pieces: dict[str, np.ndarray] = {}
            for name, arr in tensors:
                self.bytes_in += int(arr.nbytes)
                entry = name[len("opt/"):] if name.startswith("opt/") else ""
                if "/" not in entry:
                    raise ValueError(f"{source}, stage {stage}: {name!r} is not an optimizer tensor of a parameter")
                if name.endswith((ROW_IDS, ROW_VALUES)):
                    pieces[name] = np.asarray(arr)
                else:
                    kind, param = entry.split("/", 1)
                    state.optimizer.setdefault(kind, {})[param] = self._write(arr)
                del arr
            if pieces or rows:
                # the rows are checked against their parameter's shape: stand-ins of the weights' shapes
                params = {f"param/{k.split('/', 2)[-1]}": np.broadcast_to(np.zeros((), np.float32),
                                                                          state.weights[k.split("/", 2)[-1]].shape)
                          for k in (rows or {}) if isinstance(k, str) and k.split("/", 2)[-1] in state.weights}
                dense = dense_from_wire({**params, **pieces}, rows, f"{source}, stage {stage}")
                for name, arr in dense.items():
                    if name not in params:
                        kind, param = name[len("opt/"):].split("/", 1)
                        state.optimizer.setdefault(kind, {})[param] = self._write(arr)
                del dense, pieces

    def _write(self, arr: np.ndarray) -> SpooledTensor:
        path = self.folder / f"{self._n}.npy"
        self._n += 1
        np.save(path, np.asarray(arr), allow_pickle=False)
        return SpooledTensor(arr.shape, arr.dtype, lambda: np.load(path, allow_pickle=False))


def whole(per_stage: Iterable[Mapping[str, object]]) -> list[dict[str, np.ndarray]]:
    """`per_stage` with every spooled tensor read back (a checkpoint written from it)."""
    return [{k: np.asarray(v) for k, v in stage.items()} for stage in per_stage]


@dataclass
class RestoredSnapshot:
    """A snapshot restored through a `RestoreSpool` (what session.Snapshot is, its state spooled):
    `per_stage` reads every stage's state back whole, for a checkpoint written from it only."""

    step: int
    state: TrainingState
    ranges: list[tuple[int, int]]
    read_whole: Callable[[], list[dict[str, np.ndarray]]]

    @property
    def per_stage(self) -> list[dict[str, np.ndarray]]:
        return self.read_whole()
