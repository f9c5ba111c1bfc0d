"""The optimizer state a survivor keeps through a recovery (issue 32: state kept on a peer instead of
the coordinator).

A recovery restores the snapshot every survivor holds a copy of (its own, in a file:
runtime.pipeline.snapshots.SpooledCopy) and re-plans. A block the new plan leaves on the same
worker needs the same parameters' optimizer state (AdamW's moments: twice the weights) that this
worker's own copy holds, so the coordinator neither fetches nor sends it: the new setup names the
parameters (`own_state` {sid, params, sha256}) and the worker reads their moments from its copy,
which it keeps through the reset before the setup (`Worker.kept_own`). Only the moved blocks'
moments cross the wire, fetched from their old worker (or a lost stage's holder).

Nothing is taken on trust: the setup carries the SHA-256 of those entries (`moments_digest`: each
entry's name, dtype, shape and bytes, in the copy's order) as the copy's holder made it from its
replica (an independent device's copy of the same bytes), or, where that holder was lost, as the
survivor itself said at the recovery; the worker hashes what it reads and refuses a mismatch.

Entry names are the copies' own (`opt/<kind>/<param>`, a table's rows as `...#ids` and `...#rows`:
runtime.pipeline.checkpoints.rows_on_wire), keyed by parameter, never by stage number: a survivor
that changes stage number still finds them."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Sequence

import numpy as np

from runtime.pipeline.checkpoints import ROW_IDS, ROW_VALUES, dense_from_wire

# bytes read from a copy's file at a time while hashing (a large tensor is not read whole twice)
_READ_BYTES = 1 << 20


def moment_param(name: str) -> str | None:
    """The parameter a copy entry is optimizer state of (`opt/<kind>/<param>`, or one of its rows'
    two tensors); None for a parameter (`param/...`) or the optimizer's scalars (`opt/steps`)."""
    if not name.startswith("opt/"):
        return None
    kind, sep, param = name[len("opt/"):].partition("/")
    if not sep or not kind:
        return None
    for suffix in (ROW_IDS, ROW_VALUES):
        if param.endswith(suffix):
            return param[:-len(suffix)]
    return param


def read_writable(copy, entry) -> np.ndarray:
    """Tensor `entry` of `copy` read straight into an array of its own, writable (an engine given a
    setup's weights trains them in place), with no second copy of it on the way."""
    arr = np.empty(entry.shape, np.dtype(entry.dtype))
    view = memoryview(arr.reshape(-1)).cast("B")
    done = 0
    while done < arr.nbytes:
        got = os.preadv(copy.file.fileno(), [view[done:]], entry.offset + done)
        if got <= 0:
            raise OSError(f"a spooled snapshot copy is short: {done} of {arr.nbytes} bytes of {entry.name!r}")
        done += got
    return arr


def select_entries(entries: Sequence, weights: bool = True, moments_of: Iterable[str] | None = None) -> list:
    """The entries (anything with a `.name`) of a copy to send, in the copy's order: with `weights`
    its parameters and scalars; the moments of the parameters `moments_of` (None: of every one)."""
    wanted = None if moments_of is None else set(moments_of)
    out = []
    for e in entries:
        param = moment_param(e.name)
        if param is None:
            if weights:
                out.append(e)
        elif wanted is None or param in wanted:
            out.append(e)
    return out


def _update(digest, entry) -> None:
    head = json.dumps([entry.name, np.dtype(entry.dtype).name, [int(d) for d in entry.shape]], separators=(",", ":"))
    digest.update(head.encode("utf-8") + b"\0")


def moments_digest(copy, params: Iterable[str]) -> str:
    """SHA-256 of the moments of `params` in `copy` (a runtime.pipeline.snapshots.SpooledCopy, a
    worker's own or a replica it holds): each entry's name, dtype, shape and bytes, in file order,
    read a MiB at a time."""
    digest = hashlib.sha256()
    for e in select_entries(copy.tensors, weights=False, moments_of=params):
        _update(digest, e)
        for at in range(e.offset, e.offset + e.nbytes, _READ_BYTES):
            digest.update(copy.read_bytes(at, min(at + _READ_BYTES, e.offset + e.nbytes)))
    return digest.hexdigest()


def load_moments(copy, params: Sequence[str], sha256: str, where: str) -> dict[str, np.ndarray]:
    """The optimizer state of `params` read from `copy`, as `runtime.optim` loads it
    (`<kind>/<param>`, a table's rows made dense), after checking its SHA-256 against `sha256`
    (what the coordinator was told); a mismatch is refused (ValueError naming `where`)."""
    digest = hashlib.sha256()
    entries = select_entries(copy.tensors, weights=False, moments_of=params)
    tensors = {}
    for e in entries:
        _update(digest, e)
        arr = copy.read(e)
        digest.update(memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B"))
        tensors[e.name] = arr
    if digest.hexdigest() != sha256:
        raise ValueError(f"{where}: the optimizer state this worker kept of {len(params)} parameters hashes to "
                         f"{digest.hexdigest()[:16]}..., the coordinator was told {str(sha256)[:16]}...: its snapshot "
                         f"copy changed since (or is not the one meant); refused")
    shapes = {e.name[len("param/"):]: tuple(e.shape) for e in copy.tensors if e.name.startswith("param/")}
    rows = {}
    for name in list(tensors):
        if name.endswith(ROW_IDS):
            key = name[:-len(ROW_IDS)]
            param = key.split("/", 2)[-1]
            if param not in shapes:
                raise ValueError(f"{where}: kept rows {key!r} of a parameter its copy does not hold")
            rows[key] = list(shapes[param])
            # dense_from_wire checks the rows against their parameter's shape: a stand-in of that shape
            tensors[f"param/{param}"] = np.broadcast_to(np.zeros((), np.float32), shapes[param])
    dense = dense_from_wire(tensors, rows, where)
    return {name[len("opt/"):]: arr for name, arr in dense.items() if name.startswith("opt/")}


def survivors_moments(old_params: Sequence[set], old_addresses: Sequence[str], new_params: Sequence[set],
                      new_addresses: Sequence[str], lost: Iterable[int]
                      ) -> tuple[dict[int, tuple[int, list[str]]], dict[int, list[str]]]:
    """For a recovery from stages holding `old_params` on `old_addresses` (the `lost` among them)
    to new stages holding `new_params` on `new_addresses`: (new stage -> (the old stage its worker
    ran, the parameters of both, whose optimizer state it reads from its own copy), old surviving
    stage -> the parameters whose optimizer state the coordinator must fetch from its copy: those
    a new stage needs and does not keep, and no lost stage's copy, fetched whole, brings)."""
    lost = set(lost)
    at = {a: s for s, a in enumerate(old_addresses) if s not in lost}
    kept = {}
    for k, (address, params) in enumerate(zip(new_addresses, new_params)):
        s = at.get(address)
        stay = set(params) & set(old_params[s]) if s is not None else set()
        if stay:
            kept[k] = (s, sorted(stay))
    needed = set().union(*(set(p) - set(kept[k][1] if k in kept else ()) for k, p in enumerate(new_params)))
    taken = set().union(*(set(old_params[s]) for s in lost)) if lost else set()
    fetch = {}
    for s, params in enumerate(old_params):
        if s in lost:
            continue
        mine = (needed & set(params)) - taken
        if mine:
            fetch[s] = sorted(mine)
            taken |= mine
    return kept, fetch
