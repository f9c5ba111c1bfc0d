"""The weights a worker already holds, offered back to it at its next setup (issue 32).

A recovery re-plans over the survivors and sets each up again from a new bundle. The frozen
weights in it (a LoRA base, every constant that is not trained) are the ones the survivor received
at its last setup, byte for byte, for the blocks it keeps; before, the coordinator shipped them all
again (SmolLM2 LoRA 2 -> 1: the whole 628 MB model over CURVE, though the survivor held half).

Now a worker keeps the weights file of its last setup on disk (it writes it anyway: a received
weights file is spooled to a file and read back tensor by tensor, `runtime.pipeline.bundles.
spool_weights`; it is kept instead of deleted), indexed by tensor name, dtype and shape. At a
later setup the coordinator offers the names of the new bundle's untrained tensors with their
dtype and shape; the worker takes the ones it holds in that form, the coordinator leaves them out
of the weights file it ships (`runtime.pipeline.bundles.REST`), and the worker reads the weights
from the two (`HeldWeights.take`): held tensors from its kept files, the rest from the one it
received. Nothing is trusted on the worker's say-so: the SHA-256 of the file those tensors make
is computed tensor by tensor (`ir.safetensors.hash_tensors`) and must be what the signed manifest
says (`ir.bundle.verify_bundle_files`), so a held file changed on disk is refused like a damaged
bundle.

What is kept: one stage's weights on the worker's disk for the run (a recovery's new stage may
span a kept file and a received one; a file no tensor of the stage names any more is deleted at
the setup's `commit`). Memory: as before, each tensor read from a file into its own array once.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.safetensors import HashedTensors, hash_tensors, load_safetensors_subset, read_safetensors_hashed

# how many tensors a setup may offer (a bound on what a worker parses of the offer)
MAX_OFFERED = 1 << 16


@dataclass(frozen=True)
class HeldTensor:
    """Where a tensor a worker holds lies: its file, dtype and shape (as a setup offers them)."""

    path: Path
    dtype: str
    shape: tuple[int, ...]


def tensor_form(arr) -> list:
    """How a setup names a tensor's form in its offer: [dtype, shape]."""
    arr = np.asarray(arr) if not hasattr(arr, "dtype") else arr
    return [np.dtype(arr.dtype).name, [int(d) for d in arr.shape]]


def check_offer(offer) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A setup's `held` offer (name -> [dtype, shape]) checked for its form; ValueError otherwise."""
    if not isinstance(offer, dict) or len(offer) > MAX_OFFERED:
        raise ValueError(f"setup_bundle: 'held' must be a mapping of at most {MAX_OFFERED} names, got "
                         f"{type(offer).__name__}")
    out = {}
    for name, form in offer.items():
        if not (isinstance(name, str) and isinstance(form, list) and len(form) == 2 and isinstance(form[0], str)
                and isinstance(form[1], list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in form[1])):
            raise ValueError(f"setup_bundle: 'held' entry {name!r:.60} must be [dtype, [dims]], got {form!r:.60}")
        out[name] = (form[0], tuple(form[1]))
    return out


class HeldWeights:
    """The weights files of a worker's last setup, kept on its disk (under `directory`, default the
    system's temporary folder, in a folder of its own removed by `close`)."""

    def __init__(self, directory: str | Path | None = None):
        self._parent = directory
        self._folder: Path | None = None
        self._held: dict[str, HeldTensor] = {}
        self._pending: tuple[dict[str, HeldTensor], Path] | None = None
        self._count = 0

    def new_file(self) -> Path:
        """Where the next setup's received weights file is to be written (then `take`n)."""
        self.discard()
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="confidant-held-", dir=self._parent))
        self._count += 1
        return self._folder / f"weights-{self._count}.safetensors"

    def matching(self, offer: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
        """The offered names this worker holds in the offered form (dtype and shape), sorted."""
        return sorted(n for n, (dtype, shape) in offer.items()
                      if n in self._held and (self._held[n].dtype, self._held[n].shape) == (dtype, shape))

    def take(self, path: Path, local: Sequence[str] = ()) -> HashedTensors | bytes:
        """A setup's weights: the received file written at `path` (`new_file`; the caller let its
        bytes go first, so a stage's weights are never held twice), and the tensors `local` read
        from the files kept before; with the SHA-256 of the weights file they make (hashed as
        the file is read when nothing is held; tensor by tensor otherwise). A received whole file
        that does not parse comes back as its bytes (the bundle's verification names the fault,
        as ever); ValueError when a partial one does not parse, names a tensor of `local`, or a
        kept file lost one. The new index waits for `commit` (the caller's verification first)."""
        try:
            if not local:
                try:
                    weights = read_safetensors_hashed(path)
                except ValueError:  # left as its bytes, for the bundle's verification to name the fault
                    data = path.read_bytes()
                    path.unlink(missing_ok=True)
                    return data
            else:
                fresh = read_safetensors_hashed(path).tensors
                both = sorted(set(fresh) & set(local))
                if both:
                    raise ValueError(f"the received weights hold {both[0]!r}, which this worker was to take from "
                                     f"its own")
                tensors = dict(fresh)
                del fresh
                for file, names in self._by_file(local).items():
                    tensors.update(load_safetensors_subset(file, names))
                weights = hash_tensors(tensors)
                del tensors
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            raise
        where = {name: self._held[name] for name in local}
        for name, arr in weights.tensors.items():
            if name not in where:
                dtype, shape = tensor_form(arr)
                where[name] = HeldTensor(path, dtype, tuple(shape))
        self._pending = (where, path)
        return weights

    def _by_file(self, names: Sequence[str]) -> dict[Path, list[str]]:
        out: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._held:
                raise ValueError(f"this worker holds no tensor {name!r}")
            out.setdefault(self._held[name].path, []).append(name)
        return out

    def commit(self) -> None:
        """The setup `take` served was verified: its weights are what this worker holds now; kept
        files none of them lie in are deleted."""
        if self._pending is None:
            return
        self._held, _ = self._pending
        self._pending = None
        used = {t.path for t in self._held.values()}
        for path in sorted(self._folder.iterdir()) if self._folder is not None else ():
            if path not in used:
                path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Forget a `take` that was not committed (its setup failed): its new file is deleted."""
        if self._pending is not None:
            _, path = self._pending
            self._pending = None
            if path not in {t.path for t in self._held.values()}:
                path.unlink(missing_ok=True)

    def forget(self) -> None:
        """Hold nothing (a setup whose weights came another way, from a base file): every kept file
        deleted."""
        self.discard()
        self._held = {}
        if self._folder is not None:
            for path in self._folder.iterdir():
                path.unlink(missing_ok=True)

    def held_bytes(self) -> int:
        return sum(path.stat().st_size for path in {t.path for t in self._held.values()} if path.exists())

    def close(self) -> None:
        self._pending, self._held = None, {}
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
