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

What is kept: one stage's weights on the worker's disk for the run, in unlinked temporary files
(as the snapshot copies are, `runtime.pipeline.snapshots.SpooledCopy`: the kernel frees them with the
process, a SIGKILLed worker included); a recovery's new stage may span a kept file and a received
one, and a file no tensor of the stage lies in any more is closed at the setup's `commit`. Memory:
as before, each tensor read from a file into its own array once.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, Sequence

import numpy as np

from ir.safetensors import HashedTensors, hash_tensors, load_safetensors_subset, read_safetensors_hashed

# how many tensors a setup may offer (a bound on what a worker parses of the offer)
MAX_OFFERED = 1 << 16


@dataclass(frozen=True)
class HeldTensor:
    """Where a tensor a worker holds lies: its file, dtype and shape (as a setup offers them)."""

    file: BinaryIO
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
    """The weights files of a worker's last setup, kept on its disk as unlinked temporary files
    (under `directory`, default the system's temporary folder)."""

    def __init__(self, directory: str | Path | None = None):
        self._parent = directory
        self._held: dict[str, HeldTensor] = {}
        self._pending: tuple[dict[str, HeldTensor], BinaryIO] | None = None

    def new_file(self) -> BinaryIO:
        """An empty file (unlinked) for the next setup's received weights, to be written then `take`n."""
        self.discard()
        # unbuffered: what is read back is what the file holds (no buffer of it in this process)
        return tempfile.TemporaryFile(prefix="confidant-held-", dir=self._parent, buffering=0)

    def matching(self, offer: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
        """The offered names this worker holds in the offered form (dtype and shape), sorted."""
        return sorted(n for n, (dtype, shape) in offer.items()
                      if n in self._held and (self._held[n].dtype, self._held[n].shape) == (dtype, shape))

    @staticmethod
    def write(file: BinaryIO, data) -> None:
        """All of `data` (bytes, or a 1-D uint8 array) into `file`, unbuffered writes resumed where
        the system cut them short."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += file.write(view[done:])

    def take(self, file: BinaryIO, local: Sequence[str] = (),
             extra: Mapping[str, Callable[[], np.ndarray]] | None = None, mapped: Sequence[str] = ()) \
            -> HashedTensors | bytes:
        """A setup's weights: the received file written to `file` (`new_file`; the caller let its
        bytes go first, so a stage's weights are never held twice), and the tensors `local` read
        from the files kept before; with the SHA-256 of the weights file they make (hashed as
        the file is read when nothing is held; tensor by tensor otherwise). A received whole file
        that does not parse comes back as its bytes (the bundle's verification names the fault,
        as ever); ValueError when a partial one does not parse, names a tensor of `local`, or a
        kept file cannot be read. The new index waits for `commit` (the caller's verification first).
        `extra`: tensors of the weights the caller reads from elsewhere (name -> a reader: a
        survivor's trainable weights from its own snapshot copy, runtime.pipeline.kept_state), read
        once the received part is, hashed with the rest and not kept for a later setup.
        `mapped` (a whole received file only): its float32 tensors of those names are read-only views
        onto a mapping of `file`, not read into memory (`ir.safetensors.read_safetensors_hashed`): a
        stage charged its frozen base mapped (`ir.documents.maps_frozen_base`) holds it so without the
        plan's base file too. The file is unlinked: the kernel frees it with its last mapping."""
        extra = dict(extra or {})
        extra_names = set(extra)
        try:
            if not local and not extra:
                try:
                    weights = read_safetensors_hashed(file, mapped=mapped)
                except ValueError:  # left as its bytes, for the bundle's verification to name the fault
                    file.seek(0)
                    data = file.read()
                    file.close()
                    return data
            else:
                fresh = read_safetensors_hashed(file).tensors
                both = sorted(set(fresh) & (set(local) | set(extra)))
                if both:
                    raise ValueError(f"the received weights hold {both[0]!r}, which this worker was to take from "
                                     f"its own")
                tensors = dict(fresh)
                del fresh
                for kept, names in self._by_file(local).values():
                    tensors.update(load_safetensors_subset(kept, names))
                for name, read in extra.items():
                    tensors[name] = read()
                del extra
                weights = hash_tensors(tensors)
                del tensors
        except (OSError, ValueError):
            file.close()
            raise
        where = {name: self._held[name] for name in local}
        for name, arr in weights.tensors.items():
            if name not in where and name not in extra_names:
                dtype, shape = tensor_form(arr)
                where[name] = HeldTensor(file, dtype, tuple(shape))
        self._pending = (where, file)
        return weights

    def _by_file(self, names: Sequence[str]) -> dict[int, tuple[BinaryIO, list[str]]]:
        out: dict[int, tuple[BinaryIO, list[str]]] = {}
        for name in names:
            if name not in self._held:
                raise ValueError(f"this worker holds no tensor {name!r}")
            file = self._held[name].file
            out.setdefault(id(file), (file, []))[1].append(name)
        return out

    def _files(self, held: Mapping[str, HeldTensor]) -> dict[int, BinaryIO]:
        return {id(t.file): t.file for t in held.values()}

    def commit(self) -> None:
        """The setup `take` served was verified: its weights are what this worker holds now; kept
        files none of them lie in are closed (and so freed)."""
        if self._pending is None:
            return
        old = self._files(self._held)
        self._held, _ = self._pending
        self._pending = None
        used = self._files(self._held)
        for key, file in old.items():
            if key not in used:
                file.close()

    def discard(self) -> None:
        """Forget a `take` that was not committed (its setup failed): its new file is closed."""
        if self._pending is not None:
            _, file = self._pending
            self._pending = None
            if id(file) not in self._files(self._held):
                file.close()

    def forget(self) -> None:
        """Hold nothing (a setup whose weights came another way, from a base file; a coordinator lost)."""
        self.discard()
        for file in self._files(self._held).values():
            file.close()
        self._held = {}

    def close(self) -> None:
        self.forget()
