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
from runtime.engines.split.piece import PIECE_PARAM, AttentionForm, attention_piece, bert_form
from runtime.engines.stage import stage_spec

# BERT's full weights, x @ W layout: W* are [hidden, hidden], b* are [hidden] (other forms:
# `AttentionForm.roles` and `weight_shape`).
WEIGHT_NAMES = ("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo", "bo")


@dataclass(frozen=True)
class HeadRange:
    """Units [first, first + count) of the block (heads; key/value groups under grouped-query
    attention), run by `backend`."""

    backend: str
    first: int
    count: int

    def columns(self, head_size: int) -> slice:
        """The columns of Wq/Wk/Wv (entries of their biases, rows of Wo) these heads own, for
        multi-head attention (`AttentionForm.columns` for any form)."""
        return slice(self.first * head_size, (self.first + self.count) * head_size)


def head_ranges(allocation: Mapping[str, int], heads: int, unit: str = "heads") -> list[HeadRange]:
    """Contiguous ranges in the allocation's order; backends given 0 units get none. `unit` names
    what is counted in errors ("key/value groups" under grouped-query attention)."""
    if not allocation:
        raise ValueError("an allocation needs at least one backend")
    counts = dict(allocation)
    for name, count in counts.items():
        parse_backend(name)  # a readable error for a malformed name
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"backend {name!r} is given {count!r} heads; a head count is an int >= 0")
    if sum(counts.values()) != heads:
        raise ValueError(f"allocation {counts} covers {sum(counts.values())} {unit}, the block has {heads}")
    ranges, first = [], 0
    for name, count in counts.items():
        if count:
            ranges.append(HeadRange(name, first, int(count)))
            first += int(count)
    return ranges


def slice_weights(full: Mapping[str, np.ndarray], r: HeadRange, head_size: int,
                  form: AttentionForm | None = None) -> dict[str, np.ndarray]:
    """The piece parameters (wq, bq, ..., wo, norm weights) of range `r`, as contiguous float32
    copies (`form`: BERT's when not given)."""
    form = form or bert_form(1, head_size, int(np.shape(full["Wq"])[0]))
    out = {}
    for role in form.piece_roles():
        w = np.asarray(full[role], np.float32)
        cols = form.columns(role, r.first, r.count)
        if role == "Wo":
            part = w[cols, :]
        elif w.ndim == 2:
            part = w[:, cols]
        else:
            part = w[cols]
        out[PIECE_PARAM[role]] = np.ascontiguousarray(part)
    return out


@dataclass(frozen=True)
class PieceShapes:
    batch: int
    seq: int
    hidden: int
    head_size: int
    mask_shape: tuple[int, ...]
    form: AttentionForm | None = None  # None: BERT's

    @property
    def attention(self) -> AttentionForm:
        return self.form or bert_form(1, self.head_size, self.hidden)


class Piece:
    """One backend's heads: the attention piece graph on that backend's stage engine."""

    def __init__(self, backend: str, count: int, shapes: PieceShapes, slices: Mapping[str, np.ndarray],
                 stash_weights: bool = True):
        self.backend: BackendSpec = parse_backend(backend)
        if self.backend.device != "cpu":
            raise ValueError(f"backend {backend!r}: the stage engines run on the CPU only")
        graph = attention_piece(shapes.batch, shapes.seq, shapes.hidden, count, shapes.head_size,
                                shapes.mask_shape, form=shapes.attention)
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
