"""Measured device costs as plain data: what `confidant profile` writes and the planner reads.

All times are seconds for one micro-batch of the profiled shape (`batch` rows x `seq` tokens);
all sizes are bytes. A block kind is identified by `ir.graph.block_signature`, so the six
identical encoder layers of MiniLM are profiled once.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from ir.versioned import check_header

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BlockCost:
    """One block kind on one backend. `backward_s` is what the engine's backward really takes,
    including MNN's re-run of the forward when the engine does one; `recompute_s` says how much of
    it that re-run is, so the cost model can tell stashing from recomputation."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    workspace_bytes: int = 0  # peak memory above the weights while the block runs one micro-batch
    # What one more block of this kind adds to the peak of a stage that runs several (its per-op
    # caches, its gradients: what all the stage's blocks hold at once), measured on stages of 1-3
    # consecutive blocks of the kind (`runtime.profiling.device.measure_block`); the rest of
    # `workspace_bytes` is a transient one block's backward needs at a time. None: not measured (a
    # kind with no second block right after its first, or an older profile), taken as the whole
    # workspace.
    stacked_bytes: int | None = None
    # What each further micro-batch in flight adds to the peak when the engine keeps activations
    # (PyTorch's saved tensors; MNN's further set of block graphs with their caches). None: not
    # measured, taken as the whole workspace.
    kept_bytes: int | None = None
    # What building the block's engine holds beyond the weights it takes, as a worker builds it
    # (MNN's graphs of the block and their tensors; `runtime.profiling.compute.engine_setup_bytes`).
    # None: not measured (an older profile), taken as nothing. For a kind measured on a run of several
    # blocks, the build's step per further block; what it holds once a stage is `engine_once_bytes`.
    engine_bytes: int | None = None
    # The same two figures when the engine recomputes activations per block (`activations:
    # per-block`: MNN without per-op caches, each block's forward re-run inside its own backward):
    # the peak of one block's forward and backward, and what one more block of the kind adds to a
    # stage's peak, measured as `workspace_bytes` and `stacked_bytes` are. None: not measured,
    # taken as those (no saving claimed).
    per_block_workspace_bytes: int | None = None
    per_block_stacked_bytes: int | None = None
    # What a further micro-batch in flight adds per further block recomputing per block (PyTorch's
    # checkpoints hold more than the block inputs the activations term charges: a SmolLM2 int4 stage
    # of 12 layers, 1 x 128, ~19 MiB a further micro-batch against 12 x 0.28), the line's per-block
    # part, measured as a fresh worker runs (`runtime.profiling.device.measure_block`; its once part
    # is `per_block_kept_once_bytes`). None: not measured, taken as nothing.
    per_block_kept_bytes: int | None = None
    # The layer's trainable weights' gradient bytes the per-block line leaves out, where it was measured
    # as a worker's second step holds it (MNN, a kind with trainable and no frozen weights: full
    # fine-tuning; `runtime.profiling.compute.summed_workspace`): beside the running gradient sum and
    # AdamW's moments, which the gradient and optimizer terms charge, so the per-block workspace is
    # the rest. None: the line holds the layer's gradients (measured on a fresh engine's backward,
    # which returns a stage's whole set), as before.
    per_block_summed_bytes: int | None = None
    # A decoder's LM head fused with its loss (`runtime.engines.lm_loss`) computes logits only for
    # the positions that are targets, so its workspace depends on the data: `workspace_bytes` is
    # measured with every position a target (`target_positions` of them in the profile's
    # micro-batch: the worst case of any data), `sparse_workspace_bytes` with only
    # `sparse_target_positions` of them targets. None: not measured (another block, an older
    # profile), the worst case charged whatever the data (`workspace_at_targets`).
    target_positions: int | None = None
    sparse_target_positions: int | None = None
    sparse_workspace_bytes: int | None = None

    def workspace_at_targets(self, targets: int | None) -> int:
        """The workspace of a micro-batch with at most `targets` target positions (None: unknown, the
        worst case): the line through the two measured points, never below the sparse point's
        peak (no extrapolation under it) nor above the all-target one. The loss's logits grow with
        the targets up to a chunk of rows and stay there (`lm_loss.chunk_rows`), so the line is at or
        above the peaks between the points."""
        full, sparse, at = self.target_positions, self.sparse_target_positions, self.sparse_workspace_bytes
        if targets is None or full is None or sparse is None or at is None or full <= sparse:
            return self.workspace_bytes
        at = min(at, self.workspace_bytes)
        if targets <= sparse:
            return at
        if targets >= full:
            return self.workspace_bytes
        return at + -(-(self.workspace_bytes - at) * (targets - sparse) // (full - sparse))

    # The backward recomputing per block, where that is not `backward_s`: PyTorch's per-block stage
    # (`activations: per-block`, each block under a checkpoint of its own) re-runs a block's forward
    # inside its backward, which its keeping `backward_s` does not, except for the blocks it runs as
    # they are (a lookup, the LM head with its loss). None: not measured (MNN's `backward_s` already
    # re-runs the forward; an older profile). Shown by `profile`, not planned on: the planner prices the
    # re-run as the block's forward once more (`planner.cost.per_block_rerun_s`), since a timing below
    # keeping's (a loaded machine) is noise that flipped a roomy device's plan to per block.
    per_block_backward_s: float | None = None
    # The line's once part: what a further micro-batch in flight adds to a stage recomputing per block
    # beside its blocks' `per_block_kept_bytes` (PyTorch, SmolLM2 int4: ~13-24 MiB, the stage's output,
    # its checkpoints' bookkeeping), measured with it, charged once per stage per further micro-batch in
    # flight (`planner.cost.kept_once_bytes`: the largest of the stage's blocks'), so not at all where
    # one micro-batch is in flight. None: not measured; profiles made before hold it in
    # `per_block_workspace_bytes` (charged once on every stage, as then).
    per_block_kept_once_bytes: int | None = None
    # What building a stage's engine holds once whatever its length (MNN's executor, its shared
    # tensors), from the builds of one block and of a run of the kind, each first in a fresh process:
    # the one block's build less the step (`runtime.profiling.device.measure_block`; SmolLM2 int4
    # 5.73 MiB for one layer, 10.22 for three: 2.25 a layer, 3.48 once). The planner charges the
    # largest of the backend's once a stage (`planner.cost.engine_once_bytes`). None: not measured
    # (an older profile, a kind with no run), taken as nothing (its `engine_bytes` holds its once part).
    engine_once_bytes: int | None = None

    @property
    def stacked(self) -> int:
        """`stacked_bytes`, or the whole workspace where it was not measured."""
        return self.workspace_bytes if self.stacked_bytes is None else min(self.stacked_bytes, self.workspace_bytes)

    @property
    def kept(self) -> int:
        """`kept_bytes`, or the whole workspace where it was not measured."""
        return self.workspace_bytes if self.kept_bytes is None else self.kept_bytes

    @property
    def per_block_workspace(self) -> int:
        """`per_block_workspace_bytes`, or `workspace_bytes` where it was not measured."""
        return self.workspace_bytes if self.per_block_workspace_bytes is None else self.per_block_workspace_bytes

    @property
    def per_block_stacked(self) -> int:
        """`per_block_stacked_bytes`, or `stacked_bytes` (the whole workspace where neither was
        measured), at most `per_block_workspace`."""
        measured = self.per_block_stacked_bytes if self.per_block_stacked_bytes is not None else self.stacked_bytes
        return self.per_block_workspace if measured is None else min(measured, self.per_block_workspace)

    @property
    def transient(self) -> int:
        """The part of the workspace one block needs only while it runs (`workspace_bytes - stacked`)."""
        return self.workspace_bytes - self.stacked


@dataclass(frozen=True)
class AttentionCurve:
    """Forward+backward seconds of one attention block for h = 1..H heads (index h-1), the faster
    of computing the heads fused or one by one, as Confidant's head allocator needs."""

    seconds: tuple[float, ...]
    fused_faster: tuple[bool, ...] = ()


@dataclass(frozen=True)
class BackendProfile:
    backend: str  # engine:device[:settings], e.g. "mnn:cpu:t1", "torch:cpu:t2"
    blocks: Mapping[str, BlockCost] = field(default_factory=dict)
    attention: Mapping[str, AttentionCurve] = field(default_factory=dict)
    # resident memory this engine adds to the idle runtime (`DeviceProfile.runtime_overhead_bytes`,
    # which has MNN loaded): PyTorch's import (~185 MB here) and its first training run's one-time
    # start-up (~40 MB; profiles made before counted only the import); 0 for MNN or when not measured
    engine_overhead_bytes: int = 0
    # seconds per parameter byte of the optimizers this engine steps with a native kernel of its
    # own (PyTorch: AdamW's fused kernel), by optimizer name; an optimizer not here is stepped by
    # runtime.optim's numpy (`DeviceProfile.update_s_per_param_byte`). Empty in profiles made before.
    update_s_per_param_byte: Mapping[str, float] = field(default_factory=dict)
    # Whether the engine's start-up and each repeated block kind's per-layer lines (keeping, per
    # block) were measured as a worker runs, in fresh child interpreters (`runtime.profiling.fresh`);
    # False in profiles made before, measured in the warm profiling process, which a fresh PyTorch
    # worker recomputing per block outgrew (~3.5 MiB a layer against 0.5-3.1 measured).
    fresh_lines: bool = False
    # The part of the start-up in `engine_overhead_bytes` that only a stage holding per-op caches from a
    # forward to its backward pays (MNN keeping or recomputing: its first keeping run of a layer holds
    # ~6 MiB more than a repeat, SmolLM2 int4, each in a fresh child), not one recomputing per block
    # (MNN's first per-block run holds ~0.4 MiB more than a repeat; a fresh MNN process's per-block
    # stage peaks below the profile's warm workspace alone: benchmarks/MEMORY_NOTES.md, h54); charged
    # by `planner.cluster.runtime_bytes` to a device not recomputing per block. 0 on PyTorch (its
    # kernels of every mode are built process-wide: charged whatever the mode) and in profiles made
    # before (the whole start-up charged on every stage, as then).
    caches_start_up_bytes: int = 0
    # The engine's import's own peak above the idle runtime (`runtime.profiling.memory.engine_figures`: the
    # probe's VmHWM after the import and a first op, before any training): importing torch peaks ~48-54 MiB
    # above where it settles (`engine_overhead_bytes` charges the settled figure), which a worker pays on
    # its bare runtime before it reads its stage's weights (`runtime.engines.single.import_engine`). The
    # cost model charges a stage at least the runtime and this (`planner.cluster.setup_peak_bytes`). 0 for
    # MNN and in profiles made before (no set-up floor: the charge of then).
    engine_setup_peak_bytes: int = 0

    @property
    def seconds(self) -> float:
        """Forward+backward seconds over the profile's distinct blocks: how backends rank."""
        return sum(c.forward_s + c.backward_s for c in self.blocks.values())


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    model: str
    batch: int
    seq: int
    backends: tuple[BackendProfile, ...]
    memory_available_bytes: int
    runtime_overhead_bytes: int = 0  # resident memory of an idle runtime (interpreter, engine)
    # seconds of one optimizer step per byte of parameters, by optimizer name ("sgd", "adamw"):
    # the update is memory-bound numpy work, so it scales with the stage's parameter bytes
    update_s_per_param_byte: Mapping[str, float] = field(default_factory=dict)
    # peak resident bytes (VmHWM) of one head-split child process, by engine kind ("mnn", "torch"):
    # the whole process (interpreter, runtime, engine, its attention slice), extra memory on the
    # device for every backend a head split runs in a child (`runtime.engines.split.attention`). Empty in
    # profiles made before it was measured: unknown, not zero (`planner.heads` warns).
    split_child_bytes: Mapping[str, int] = field(default_factory=dict)
    # fixed seconds a head split pays beyond the attention curves, by block signature, then by
    # backend: for each backend measured running a real split (`runtime.engines.split.attention`) in a child
    # process next to the split's in-process backend, the worst over a few allocations of the
    # measured forward+backward minus the curves' prediction (launch, copies through shared memory,
    # the sum of partial outputs, and the slowdown the two backends cause each other), floored at 0;
    # the planner's `extra_cost_s` (`planner.heads`). Per signature, since the copies scale with the
    # shape. The in-process backend has no entry (0). Empty in profiles made before it was measured.
    split_extra_cost_s: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # seconds per parameter byte of adding one micro-batch's gradients into the running sum
    # (`runtime.pipeline.executor`, in place): paid m-1 times per step under flush schedules. 0 in profiles
    # made before it was measured.
    accumulate_s_per_param_byte: float = 0.0

    def backend(self, name: str | None = None) -> BackendProfile:
        """The named backend, or the fastest one by total block time."""
        if name is not None:
            for b in self.backends:
                if b.backend == name:
                    return b
            raise KeyError(f"profile of {self.name!r} has no backend {name!r} "
                           f"(it has {[b.backend for b in self.backends]})")
        if not self.backends:
            raise ValueError(f"profile of {self.name!r} has no backends")
        return min(self.backends, key=lambda b: b.seconds)

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: Mapping, source: str = "<profile>") -> "DeviceProfile":
        check_header(doc, format=None, versions=SCHEMA_VERSION, where=f"{source}: profile",
                     redo="re-run `confidant profile`")
        try:
            backends = tuple(
                BackendProfile(
                    b["backend"],
                    {k: _block_cost(v, f"{b.get('backend')} block {k}") for k, v in b.get("blocks", {}).items()},
                    {k: AttentionCurve(tuple(v["seconds"]), tuple(v.get("fused_faster", ())))
                     for k, v in b.get("attention", {}).items()},
                    int(b.get("engine_overhead_bytes", 0)),
                    {str(k): _seconds(v) for k, v in b.get("update_s_per_param_byte", {}).items()},
                    bool(b.get("fresh_lines", False)),
                    int(b.get("caches_start_up_bytes", 0)),
                    int(b.get("engine_setup_peak_bytes", 0)),
                ) for b in doc["backends"])
            return cls(doc["name"], doc["model"], int(doc["batch"]), int(doc["seq"]), backends,
                       int(doc["memory_available_bytes"]), int(doc.get("runtime_overhead_bytes", 0)),
                       {str(k): float(v) for k, v in doc.get("update_s_per_param_byte", {}).items()},
                       {str(k): int(v) for k, v in doc.get("split_child_bytes", {}).items()},
                       {str(sig): {str(b): _seconds(x) for b, x in per.items()}
                        for sig, per in doc.get("split_extra_cost_s", {}).items()},
                       _seconds(doc.get("accumulate_s_per_param_byte", 0.0)))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed profile ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "DeviceProfile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such profile (make one with `confidant profile`)")
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.from_json(doc, str(path))


_BLOCK_TIMES = ("forward_s", "backward_s", "recompute_s", "per_block_backward_s")
_BLOCK_BYTES = ("workspace_bytes", "stacked_bytes", "kept_bytes", "engine_bytes", "engine_once_bytes",
                "per_block_workspace_bytes",
                "per_block_stacked_bytes", "per_block_kept_bytes", "per_block_kept_once_bytes",
                "per_block_summed_bytes", "sparse_workspace_bytes")
# counts, checked as sizes are (whole numbers >= 0)
_BLOCK_COUNTS = ("target_positions", "sparse_target_positions")


def _block_cost(doc, where: str) -> BlockCost:
    """A BlockCost from JSON, every field checked (times finite and >= 0, sizes whole and >= 0)."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: expected an object of {_BLOCK_TIMES + _BLOCK_BYTES + _BLOCK_COUNTS}, got {doc!r}")
    unknown = sorted(set(doc) - set(_BLOCK_TIMES + _BLOCK_BYTES + _BLOCK_COUNTS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}")
    fields = {}
    for key, value in doc.items():
        try:
            if key in _BLOCK_TIMES and (value is not None or key != "per_block_backward_s"):
                fields[key] = _seconds(value)
            elif key in _BLOCK_TIMES:
                fields[key] = None
            elif value is not None or key == "workspace_bytes":
                fields[key] = _bytes(value)
            else:
                fields[key] = None
        except ValueError as exc:
            raise ValueError(f"{where}: {key} {exc}") from None
    missing = [k for k in ("forward_s", "backward_s") if k not in fields]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    return BlockCost(**fields)


def _bytes(x) -> int:
    """A size from JSON: a whole number >= 0."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 or x != int(x):
        raise ValueError(f"{x!r} is not a size in bytes (a whole number >= 0)")
    return int(x)


def _seconds(x) -> float:
    """A measured time from JSON: a finite number >= 0."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{x!r} is not a time in seconds (a finite number >= 0)")
    return float(x)


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_per_s + self.latency_s
