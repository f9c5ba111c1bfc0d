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

    @abstractmethod
    def forward(self, feeds: Mapping[str, np.ndarray], microbatch: int = 0, train: bool = True,
                until_block: int | None = None) -> np.ndarray:
        """Run the stage; `feeds` holds the activation input (if any) and the graph inputs it needs.

        `until_block` (inference only) stops after that block and returns its output, e.g. the
        head's logits for evaluation."""

    @abstractmethod
    def backward(self, microbatch: int, grad_output: np.ndarray | None = None) -> StageGradients:
        """Gradients for `microbatch` (its forward must have run with train=True); None seeds 1 for a loss."""

    @abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, by name."""

    @abstractmethod
    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters (after an optimizer step, or from a checkpoint)."""
