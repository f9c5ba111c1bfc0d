"""The stage interface every engine implements (MNN by default; PyTorch optional).

An engine holds the parameters of one stage, runs forward for a micro-batch (keeping what that
micro-batch's backward needs), and backward given the gradient of the stage output, returning the
parameter gradients and the gradient of the stage input for the previous stage. Updates are done
outside the engine by `runtime.optim` on numpy arrays, so every engine updates identically.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from runtime.engines.stage import StageSpec


@dataclass(frozen=True, eq=False)
class RowGradient:
    """An embedding table's gradient from one backward, as the rows it touches: row `ids[i]` gets
    `rows[i]` added (ids may repeat), every other row zero. A micro-batch touches a few hundred of a
    vocabulary's tens of thousands of rows, so a dense copy per backward (47 MB for MiniLM's table)
    would be mostly zeros written and added."""

    ids: np.ndarray        # int [n]
    rows: np.ndarray       # float [n, width]
    shape: tuple[int, ...]

    def dense(self) -> np.ndarray:
        out = np.zeros(self.shape, self.rows.dtype)
        np.add.at(out, self.ids, self.rows)
        return out


Gradient = np.ndarray | RowGradient


def add_gradient(a: Gradient, b: Gradient) -> Gradient:
    """a + b (a new value; neither is changed) for dense and row gradients alike."""
    if isinstance(a, RowGradient) and isinstance(b, RowGradient):
        return RowGradient(np.concatenate([a.ids, b.ids]), np.concatenate([a.rows, b.rows]), a.shape)
    if isinstance(a, RowGradient):
        a, b = b, a
    if isinstance(b, RowGradient):
        out = a.copy()
        np.add.at(out, b.ids, b.rows)
        return out
    return a + b


def accumulate(into: dict[str, np.ndarray], grads) -> None:
    """Add one backward's gradients into a dense sum, in place: what the executor and the
    single-device trainer both do, in the same order, so their sums agree bit for bit. A row
    gradient is scattered into the sum (materialised once, at its first backward)."""
    for k, g in grads.items():
        acc = into.get(k)
        if isinstance(g, RowGradient):
            if acc is None:
                into[k] = acc = np.zeros(g.shape, g.rows.dtype)
            np.add.at(acc, g.ids, g.rows)
        elif acc is None:
            into[k] = g
        else:
            acc += g


@dataclass(frozen=True)
class StageGradients:
    params: dict[str, np.ndarray]
    activation_input: np.ndarray | None


class StageEngine(ABC):
    spec: StageSpec
    # Set by the executor when the plan's schedule splits backwards into B and W (zero-bubble
    # schedules), before any forward: an engine that can defer weight gradients then prepares
    # its training forwards for it.
    split_backward: bool = False
    # Set by whoever sums the gradients with `accumulate` (the executor, the single-device
    # trainer): an engine may then give an embedding table's gradient as a RowGradient.
    row_gradients: bool = False

    @abstractmethod
    def forward(self, feeds: Mapping[str, np.ndarray], microbatch: int = 0, train: bool = True,
                until_block: int | None = None) -> np.ndarray:
        """Run the stage; `feeds` holds the activation input (if any) and the graph inputs it needs.

        `until_block` (inference only) stops after that block and returns its output, e.g. the
        head's logits for evaluation."""

    @abstractmethod
    def backward(self, microbatch: int, grad_output: np.ndarray | None = None) -> StageGradients:
        """Gradients for `microbatch` (its forward must have run with train=True); None seeds 1 for a loss."""

    def backward_input(self, microbatch: int, grad_output: np.ndarray | None = None) -> StageGradients:
        """B of a split backward: the gradient of the stage input (what the previous stage waits
        for) and whichever parameter gradients come with it; `backward_weight` gives the rest.
        By default the whole backward, leaving W nothing to do."""
        return self.backward(microbatch, grad_output)

    def backward_weight(self, microbatch: int) -> dict[str, np.ndarray]:
        """W of a split backward: the parameter gradients `backward_input` left for later."""
        return {}

    @abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, by name."""

    @abstractmethod
    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters (after an optimizer step, or from a checkpoint)."""
