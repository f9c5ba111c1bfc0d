"""Shared memory between a head split and its child processes: named float32 arrays packed into
one block (x, mask and dy going out; each child's partial output, dx, slice gradients and weights
coming back), and their release."""
from __future__ import annotations

from multiprocessing import shared_memory
from typing import Sequence

import numpy as np

from runtime.engines.split.piece import PIECE_PARAM
from runtime.engines.split.pieces import PieceShapes

class Layout:
    """Named float32 arrays packed into one buffer."""

    def __init__(self, fields: Sequence[tuple[str, tuple[int, ...]]]):
        self.fields = [(name, tuple(int(d) for d in shape)) for name, shape in fields]
        self.offsets, off = {}, 0
        for name, shape in self.fields:
            self.offsets[name] = off
            off += 4 * int(np.prod(shape, dtype=np.int64))
        self.nbytes = max(off, 4)

    def views(self, buf) -> dict[str, np.ndarray]:
        return {name: np.ndarray(shape, np.float32, buf, self.offsets[name]) for name, shape in self.fields}


def inputs_layout(s: PieceShapes) -> Layout:
    act = (s.batch, s.seq, s.hidden)
    return Layout([("x", act), ("mask", s.mask_shape), ("dy", act)])


def worker_layout(s: PieceShapes, count: int) -> Layout:
    act = (s.batch, s.seq, s.hidden)
    form = s.attention
    params = [(PIECE_PARAM[role], form.weight_shape(role, count)) for role in form.piece_roles()]
    return Layout([("y", act), ("dx", act)] + [("g_" + n, sh) for n, sh in params]
                   + [("w_" + n, sh) for n, sh in params])


def release(shm: shared_memory.SharedMemory) -> None:
    """Unlink a block this process created. If numpy views of it are still alive (an object being
    collected), the mapping stays until they die; the name is gone either way."""
    try:
        shm.close()
    except BufferError:
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
