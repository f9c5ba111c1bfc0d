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
from runtime.heap import sparse_zeros


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
        """The dense gradient: the rows added into zeros of which only the rows' pages are resident
        (`runtime.heap.sparse_zeros`; numpy's own zeros of a table lie on huge pages, each row
        written faulting in 2 MiB of them)."""
        out = sparse_zeros(self.shape, self.rows.dtype)
        np.add.at(out, self.ids, self.rows)
        return out


Gradient = np.ndarray | RowGradient


def own_array(value, dtype, take: bool) -> np.ndarray:
    """An engine's own copy of a weight, in `dtype`; with `take` (the caller gives the array up,
    `make_engine(take_weights=True)`) the array itself where it can be written in place as it is
    (that dtype, C-contiguous, writable), so the stage holds its weights once, not twice."""
    arr = np.asarray(value)
    if take and arr.dtype == dtype and arr.flags.c_contiguous and arr.flags.writeable:
        return arr
    return np.array(arr, dtype=dtype)


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


def dense_gradient(g: Gradient) -> np.ndarray:
    """The gradient as a dense array (a row gradient scattered into zeros)."""
    return g.dense() if isinstance(g, RowGradient) else g


def accumulate(into: dict[str, Gradient], grads) -> None:
    """Add one backward's gradients into a running sum, in place: what the executor and the
    single-device trainer both do, in the same order, so their sums agree bit for bit.

    Row gradients are summed as rows (ids and rows joined: a few hundred rows a micro-batch instead
    of a dense copy of the table held from the first backward to the update, 47 MB for MiniLM's,
    113 MB for SmolLM2's); the sum becomes dense where a dense gradient joins it, or when its
    reader asks (`dense_gradient`: the optimizer, at the update). Either way every element gets its
    additions in the order of the backwards, starting from zero, as a dense running sum would, so
    the result is bit for bit the same."""
    for k, g in grads.items():
        acc = into.get(k)
        if acc is None:
            into[k] = g
        elif isinstance(acc, RowGradient):
            if isinstance(g, RowGradient):
                into[k] = RowGradient(np.concatenate([acc.ids, g.ids]), np.concatenate([acc.rows, g.rows]), acc.shape)
            else:
                total = acc.dense()
                total += g
                into[k] = total
        elif isinstance(g, RowGradient):
            np.add.at(acc, g.ids, g.rows)
        else:
            acc += g


@dataclass(frozen=True)
class StageGradients:
    params: dict[str, np.ndarray]
    activation_input: np.ndarray | None


def rows_at(positions) -> tuple[np.ndarray, np.ndarray]:
    """The index of each row's positions (int [rows] or [rows, k]) into a [rows, S, ...] array."""
    at = np.asarray(positions, np.int64)
    return np.arange(at.shape[0]).reshape((-1,) + (1,) * (at.ndim - 1)), at


class StageEngine(ABC):
    spec: StageSpec
    # Set by the executor when the plan's schedule splits backwards into B and W (zero-bubble
    # schedules), before any forward: an engine that can defer weight gradients then prepares
    # its training forwards for it.
    split_backward: bool = False
    # Whether a B and the W right after it (nothing between) run better as one whole backward on this engine
    # (`runtime.pipeline.executor.joined_weight_passes`): PyTorch's, whose whole backward adds each weight's
    # gradient into the running sum as autograd completes it (helpers h134, h144).
    joins_weight_passes: bool = False
    # Whether the pipeline executor gives the C library's free heap back once a step, after the step's
    # first backward (`runtime.heap.release_free_heap`): where the engine's activations come from glibc's
    # heap, freed micro-batches leave holes the next ones do not fill whole, and the step's peak stacks on
    # them (PyTorch's; MNN's arrays come from its own pool).
    releases_heap_each_step: bool = False
    # Set by the executor before any forward when the plan updates this stage while its
    # micro-batches are in flight (1f1b-stash, 2bw): an engine may then hold weight versions apart.
    updates_in_flight: bool = False
    # Set by whoever sums the gradients with `accumulate` (the executor, the single-device
    # trainer): an engine may then give an embedding table's gradient as a RowGradient.
    row_gradients: bool = False

    @abstractmethod
    def forward(self, feeds: Mapping[str, np.ndarray], microbatch: int = 0, train: bool = True,
                until_block: int | None = None) -> np.ndarray:
        """Run the stage; `feeds` holds the activation input (if any) and the graph inputs it needs.

        `until_block` (inference only) stops after that block and returns its output, e.g. the
        head's logits for evaluation."""

    def logits_at(self, feeds: Mapping[str, np.ndarray], until_block: int, positions: np.ndarray) -> np.ndarray:
        """float32 [rows, V] (or [rows, k, V]): block `until_block`'s output (the LM head's logits) of
        each row at its position `positions[row]` (int [rows]; or its k positions, int [rows, k]: a
        greedy generation checking a drafted continuation), an inference forward (evaluation: greedy
        generation on a pipeline's workers). By default the forward's whole [rows, S, V] output, then
        those rows; an engine that fuses the head with its loss computes the logits of those
        positions only."""
        out = np.asarray(self.forward(feeds, train=False, until_block=until_block))
        return np.array(out[rows_at(positions)], np.float32)

    def forward_into(self, feeds: Mapping[str, np.ndarray], microbatch: int, into: dict) -> np.ndarray:
        """A training `forward` of `microbatch` whose backward will add its gradients into the running
        sum `into` (`backward_into`, `backward_input_into`) with no update between (the caller's
        promise) and seeded with 1 (None: a loss). An engine that computes some parameter gradients in
        the forward's own pass may add them straight into `into` there, starting their sum where `into`
        has none yet (then its backward leaves them out). By default the plain forward."""
        return self.forward(feeds, microbatch=microbatch, train=True)

    @abstractmethod
    def backward(self, microbatch: int, grad_output: np.ndarray | None = None) -> StageGradients:
        """Gradients for `microbatch` (its forward must have run with train=True); None seeds 1 for a loss."""

    def backward_input(self, microbatch: int, grad_output: np.ndarray | None = None) -> StageGradients:
        """B of a split backward: the gradient of the stage input (what the previous stage waits
        for) and whichever parameter gradients come with it; `backward_weight` gives the rest.
        By default the whole backward, leaving W nothing to do."""
        return self.backward(microbatch, grad_output)

    def backward_input_into(self, microbatch: int, into: dict, grad_output: np.ndarray | None = None
                            ) -> StageGradients:
        """`backward_input`, where an engine may add some parameter gradients straight into the running
        sum `into` (then left out of the result; the caller adds the rest). By default none."""
        return self.backward_input(microbatch, grad_output)

    def backward_weight(self, microbatch: int) -> dict[str, np.ndarray]:
        """W of a split backward: the parameter gradients `backward_input` left for later."""
        return {}

    def backward_weight_into(self, microbatch: int, into: dict) -> None:
        """`backward_weight` with its gradients added into the running sum `into` in place
        (`accumulate`). An engine that computes them one parameter at a time adds each as it comes,
        so the micro-batch's whole set of weight gradients never lives beside the sum (MiniLM's
        stage 0 under zb-h1: 27 MiB at each W). By default the whole W, then the sum."""
        accumulate(into, self.backward_weight(microbatch))

    def backward_into(self, microbatch: int, into: dict, grad_output: np.ndarray | None = None
                      ) -> np.ndarray | None:
        """`backward` with its parameter gradients added into the running sum `into` in place
        (`accumulate`); the gradient of the stage input (None on the first stage). An engine that
        computes its gradients a block at a time adds each block's as it comes, so no second whole
        set of gradients (the micro-batch's own) lives beside the sum during a backward (SmolLM2 full
        fine-tuning: 513 MiB). By default the whole backward, then the sum."""
        result = self.backward(microbatch, grad_output)
        accumulate(into, result.params)
        return result.activation_input

    # Whether `backward_and_step` steps each weight as its gradient comes (else it is `backward`
    # then `step`): the executor fuses a B with the UPDATE that follows it alone.
    steps_in_backward: bool = False

    def backward_and_step(self, microbatch: int, optimizer, grad_output: np.ndarray | None = None
                          ) -> np.ndarray | None:
        """`backward`, then `step` with its gradients (an update after this backward alone); the
        gradient of the stage input (None on the first stage)."""
        result = self.backward(microbatch, grad_output)
        self.step(optimizer, result.params)
        return result.activation_input

    @abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, by name."""

    def parameter_arrays(self) -> dict[str, np.ndarray]:
        """The current parameters by name, to be read before the engine runs again (a checkpoint
        sends them): the engine's own arrays where it holds its weights in arrays, so a stage's
        weights are not held twice to be sent; copies (`parameters`) otherwise."""
        return self.parameters()

    @abstractmethod
    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters (from a checkpoint, or a re-plan's move)."""

    def optimizer_kernel(self, optimizer):
        """The engine's native kernel for `optimizer`'s dense weights (`runtime.optim`'s
        `dense_kernel`: PyTorch's fused AdamW), or None where numpy's step is the engine's."""
        return None

    def step(self, optimizer, grads: Mapping[str, np.ndarray]) -> None:
        """One optimizer step (`runtime.optim`, which updates the arrays it is given in place) on this
        stage's parameters with the summed `grads`. The caller keeps no copy of the weights between
        steps: the engine's are the only ones. This default goes through a copy (`parameters`, then
        `set_parameters`); an engine that holds its weights in arrays of its own steps those in
        place, after making the current weights an old version where a micro-batch in flight still
        uses them (weight stashing), as `set_parameters` would."""
        params = self.parameters()
        optimizer.step(params, grads)
        self.set_parameters(params)

    def steps_in_parts(self) -> bool:
        """Whether `step_part` can step some of this stage's weights now: False (the default) where
        the engine cannot, or where a micro-batch in flight still reads the current weights."""
        return False

    def step_part(self, optimizer, grads: Mapping[str, np.ndarray]) -> None:
        """Step the weights named in `grads` only, in place, as a part of the step the caller began
        (`optimizer.begin_step()`); only where `steps_in_parts()` says so."""
        raise NotImplementedError(f"{type(self).__name__} steps all its weights at once")
