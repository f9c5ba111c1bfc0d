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


def make_engine(kind: str, spec: StageSpec, threads: int = 1, head_split: Mapping[str, int] | None = None) -> StageEngine:
    """The stage engine for `kind` ("mnn" or "torch"), imported only when chosen so a device without
    torch never loads it; with `head_split` each encoder block's heads are split across backends."""
    if head_split:
        if kind != "mnn":
            raise ValueError(f"a head split runs its stage on MNN; engine {kind!r} was asked for")
        from runtime.engines.split.engine import SplitStageEngine

        return SplitStageEngine(spec, dict(head_split), threads=threads)
    if kind == "torch":
        from runtime.engines.pytorch import TorchStageEngine

        return TorchStageEngine(spec, threads=threads)
    if kind != "mnn":
        raise ValueError(f"unknown engine {kind!r}: choose mnn or torch")
    from runtime.engines.mnn import MnnStageEngine

    return MnnStageEngine(spec, threads=threads)
