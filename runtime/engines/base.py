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
