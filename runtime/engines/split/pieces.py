"""The pieces of a head split: which heads each backend runs, their slices of the block's weights,
and one backend's piece on its stage engine (see `runtime.engines.split.attention` for why a split
is exact)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ir.backend import BackendSpec, parse_backend
from runtime.engines import mnn_kernels as K
from runtime.engines.base import StageEngine
from runtime.engines.single import single_engine
from runtime.engines.split.piece import attention_piece
from runtime.engines.stage import stage_spec

# Full weights, x @ W layout: W* are [hidden, hidden], b* are [hidden].
WEIGHT_NAMES = ("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo", "bo")
# The attention piece's parameter for each full weight (bo is added outside the pieces).
PIECE_PARAM = {"Wq": "wq", "bq": "bq", "Wk": "wk", "bk": "bk", "Wv": "wv", "bv": "bv", "Wo": "wo"}


@dataclass(frozen=True)
class HeadRange:
    """Heads [first, first + count) of the block, run by `backend`."""

    backend: str
    first: int
    count: int

    def columns(self, head_size: int) -> slice:
        """The columns of Wq/Wk/Wv (entries of their biases, rows of Wo) these heads own."""
        return slice(self.first * head_size, (self.first + self.count) * head_size)


def head_ranges(allocation: Mapping[str, int], heads: int) -> list[HeadRange]:
    """Contiguous head ranges in the allocation's order; backends given 0 heads get none."""
    if not allocation:
        raise ValueError("an allocation needs at least one backend")
    counts = dict(allocation)
    for name, count in counts.items():
        parse_backend(name)  # a readable error for a malformed name
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"backend {name!r} is given {count!r} heads; a head count is an int >= 0")
    if sum(counts.values()) != heads:
        raise ValueError(f"allocation {counts} covers {sum(counts.values())} heads, the block has {heads}")
    ranges, first = [], 0
    for name, count in counts.items():
        if count:
            ranges.append(HeadRange(name, first, int(count)))
            first += int(count)
    return ranges


def slice_weights(full: Mapping[str, np.ndarray], r: HeadRange, head_size: int) -> dict[str, np.ndarray]:
    """The piece parameters (wq, bq, ..., wo) of head range `r`, as contiguous float32 copies."""
    cols = r.columns(head_size)
    out = {}
    for name, param in PIECE_PARAM.items():
        w = np.asarray(full[name], np.float32)
        if name == "Wo":
            part = w[cols, :]
        elif w.ndim == 2:
            part = w[:, cols]
        else:
            part = w[cols]
        out[param] = np.ascontiguousarray(part)
    return out


@dataclass(frozen=True)
class PieceShapes:
    batch: int
    seq: int
    hidden: int
    head_size: int
    mask_shape: tuple[int, ...]


class Piece:
    """One backend's heads: the attention piece graph on that backend's stage engine."""

    def __init__(self, backend: str, count: int, shapes: PieceShapes, slices: Mapping[str, np.ndarray],
                 stash_weights: bool = True):
        self.backend: BackendSpec = parse_backend(backend)
        if self.backend.device != "cpu":
            raise ValueError(f"backend {backend!r}: the stage engines run on the CPU only")
        graph = attention_piece(shapes.batch, shapes.seq, shapes.hidden, count, shapes.head_size,
                                shapes.mask_shape)
        spec = stage_spec(graph, 1, 1)
        self.output = spec.output
        self.engine: StageEngine = single_engine(self.backend, spec, weights=slices, stash_weights=stash_weights)

    def _threads(self) -> None:
        # MNN's thread count is process-wide and a graph keeps the count of its first evaluation:
        # set ours before every call in case another engine in this process changed it.
        if self.backend.engine == "mnn" and K.get_threads() != self.backend.threads:
            K.set_threads(self.backend.threads)

    def forward(self, x: np.ndarray, mask: np.ndarray, microbatch: int, train: bool) -> np.ndarray:
        self._threads()
        return self.engine.forward({"x": x, "mask": mask}, microbatch, train=train)

    def backward(self, dy: np.ndarray, microbatch: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self._threads()
        g = self.engine.backward(microbatch, dy)
        return g.activation_input, g.params

    def set_weights(self, slices: Mapping[str, np.ndarray]) -> None:
        self.engine.set_parameters(slices)


class LocalWorker:
    """A backend's piece in this process, computed in the calling thread."""

    def __init__(self, r: HeadRange, shapes: PieceShapes, slices: Mapping[str, np.ndarray], stash_weights: bool = True):
        self.range = r
        self.piece = Piece(r.backend, r.count, shapes, slices, stash_weights)
        self.busy_s = 0.0
