"""The plan's documents as typed data: plan.json (`PlanDocument`, one `DevicePlan` per stage) and each
bundle's stage.json (`StageDocument`), frozen dataclasses with JSON round trips.

`from_json` is the one place a document is checked: every field a document must have, its type and
range, and how fields agree (stage below stages, peers at the pipeline's ends, contiguous block
ranges, a schedule that verifies); the error names the document and the field. `to_json` writes the
same keys `from_json` reads, so a plan written by one build is read by the next, and bundles written
before an optional field existed stay valid.

The planner writes these (`planner.emit`), the device and the command line read them
(`runtime.pipeline.bundles`, `confidant show`); nobody indexes raw dicts.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ir.address import AddressError, parse_address
from ir.backend import BackendSpec
from ir.plan import FAILURE_POLICIES, Action, ActionKind, Schedule
from ir.precision import BASE_DTYPES
from ir.versioned import check_header
from ir.verify import verify_plan

PLAN_SCHEMA_VERSION = 1
PLAN_FORMAT = "confidant-plan"
SHA256 = re.compile(r"[0-9a-f]{64}")

# Device names become directory names on the planner's machine, so they are kept to characters
# that mean the same on every file system, and away from names some systems reserve.
_DEVICE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_RESERVED = {"con", "prn", "aux", "nul", "plan.json"} | {f"{p}{i}" for p in ("com", "lpt") for i in range(1, 10)}


class BundleError(ValueError):
    """A bundle or plan that cannot be used; the message starts with `bundle <where>:` (or
    `plan <where>:`) and names the file and the field."""


def check_device_name(name: Any) -> str:
    """`name` if it can name a bundle directory on any file system; BundleError otherwise."""
    if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name) or name.endswith(".") \
            or name.lower().split(".")[0] in _RESERVED or name.lower() in _RESERVED:
        raise BundleError(f"device name {name!r} cannot name a bundle directory: use 1 to 64 letters, digits, "
                          f"'.', '_' or '-', not starting with '.' or '-', not ending with '.', and not a "
                          f"reserved name (CON, NUL, COM1, plan.json, ...)")
    return name


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _head_split_problem(split: Any) -> str | None:
    if split is None:
        return None
    if (not isinstance(split, dict) or not split or not all(isinstance(b, str) and b for b in split)
            or not all(_is_int(h) and h >= 1 for h in split.values())):
        return f"head_split is {split!r}, not null or {{backend name: heads (an integer >= 1)}}"
    return None


# --- shared parts ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer every stage runs (`runtime.optim`): its name, learning rate and weight decay
    (None: the optimizer's default)."""

    name: str
    lr: float
    weight_decay: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "weight_decay": self.weight_decay}

    @staticmethod
    def problem(doc: Any) -> str | None:
        if not isinstance(doc, dict) or sorted(doc) != ["lr", "name", "weight_decay"]:
            return f"optimizer is {doc!r}, not {{\"name\", \"lr\", \"weight_decay\"}}"
        if not isinstance(doc["name"], str) or not doc["name"]:
            return f"optimizer.name is {doc['name']!r}, not a non-empty string"
        if isinstance(doc["lr"], bool) or not isinstance(doc["lr"], (int, float)) or not 0 < doc["lr"] < math.inf:
            return f"optimizer.lr is {doc['lr']!r}, not a positive finite number"
        wd = doc["weight_decay"]
        if wd is not None and (isinstance(wd, bool) or not isinstance(wd, (int, float)) or not 0 <= wd < math.inf):
            return f"optimizer.weight_decay is {wd!r}, not null or a non-negative finite number"
        return None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "OptimizerSettings":
        """A checked optimizer object (`problem` must have returned None)."""
        return cls(str(doc["name"]), float(doc["lr"]), None if doc["weight_decay"] is None else float(doc["weight_decay"]))


# --- stage.json --------------------------------------------------------------------------------------

# every key is required and no other is allowed...
STAGE_FIELDS = (
    "stage", "stages", "device", "blocks", "peers", "schedule", "microbatches", "update_every",
    "stash_depth", "engine", "backend", "threads", "optimizer", "batch", "seq",
)
# ...except these, which may be left out (bundles written before them stay valid):
# `head_split`: null, or {backend name: heads} when the stage's attention heads are split across
# backends (`runtime.engines.split.engine.SplitStageEngine`); `activations`: "keep" (every
# activation of each micro-batch in flight held until its backward: PyTorch's autograd, MNN with one
# set of block graphs per micro-batch in flight), "recompute" (only the inputs held, the forward run
# again in the backward; MNN keeps one micro-batch's per-op caches for a backward that follows its
# forward) or "per-block" (MNN: only each block's input held, each block's forward re-run inside its
# own backward, no per-op caches: the leanest) or "per-block+K" (MNN's hybrid: per block, but the
# stage's last K blocks keep their per-op caches), chosen by the planner; null or absent: the engine's
# default (PyTorch keeps, MNN recomputes).
STAGE_OPTIONAL_FIELDS = ("head_split", "activations", "steady")
ACTIVATION_CHOICES = ("keep", "recompute", "per-block")
HYBRID = "per-block+"  # "per-block+K": per block, the stage's last K blocks keeping their per-op caches


def activations_mode(value: str | None) -> tuple[str | None, int]:
    """(mode, cached blocks) of an activations choice: "per-block+6" is ("per-block", 6), any other
    choice (or None) itself with 0. ValueError for a value that is none of them."""
    if isinstance(value, str) and value.startswith(HYBRID):
        count = value[len(HYBRID):]
        if count.isdigit() and int(count) > 0 and str(int(count)) == count:
            return "per-block", int(count)
    elif value is None or value in ACTIVATION_CHOICES:
        return value, 0
    raise ValueError(f"activations is {value!r}: {', '.join(map(repr, ACTIVATION_CHOICES))}, "
                     f"'{HYBRID}K' (K > 0 blocks keeping their caches) or None")


def maps_frozen_base(engine: str, activations: str | None) -> bool:
    """Whether a stage of `engine` with `activations` reads a float32 frozen base from a mapping of its file,
    a few blocks' pages resident at a time, where the run has the file (train-local's model, a pipeline
    worker's copy of the plan's base weights): PyTorch recomputing per block gives each block's pages back
    after its use (`runtime.engines.pytorch`); MNN exactly "per-block" (no block keeping its caches) streams
    them through placeholder sets (`runtime.engines.mnn._FrozenStream`). The one rule the planner's charge
    (`planner.cost.maps_frozen`) and the worker's reading (`runtime.pipeline.bundles.rebuild_weights`) share."""
    mode, cached = activations_mode(activations)
    return mode == "per-block" and (engine == "torch" or (engine == "mnn" and cached == 0))


def valid_activations(value) -> bool:
    """Whether `value` is an activations choice (`activations_mode`)."""
    try:
        activations_mode(value)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class StageDocument:
    """What one device runs: stage `stage` of `stages` on `device`, blocks first..last, its
    neighbouring devices, the schedule's settings, the engine (`engine` on device `backend` with
    `threads` threads), the optimizer, the bound shape, and the head split (None: unsplit)."""

    stage: int
    stages: int
    device: str
    first_block: int
    last_block: int
    prev_device: str | None
    next_device: str | None
    schedule: str
    microbatches: int
    update_every: int
    stash_depth: int
    engine: str
    backend: str
    threads: int
    optimizer: OptimizerSettings
    batch: int
    seq: int
    head_split: Mapping[str, int] | None = None
    activations: str | None = None
    # asynchronous schedules (ir.plan.SteadyState): where this stage's actions drain and the action
    # tokens one more step adds before the drain, so a run of several steps needs no other actions
    steady: "SteadyStage | None" = None

    @property
    def backend_spec(self) -> BackendSpec:
        """The backend the stage's engine runs on, e.g. mnn:cpu:t2."""
        return BackendSpec(self.engine, self.backend, threads=self.threads if self.backend == "cpu" else None)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "stages": self.stages, "device": self.device,
                "blocks": [self.first_block, self.last_block], "peers": {"prev": self.prev_device, "next": self.next_device},
                "schedule": self.schedule, "microbatches": self.microbatches, "update_every": self.update_every,
                "stash_depth": self.stash_depth, "engine": self.engine, "backend": self.backend, "threads": self.threads,
                "optimizer": self.optimizer.to_json(), "batch": self.batch, "seq": self.seq,
                "head_split": None if self.head_split is None else dict(self.head_split),
                "activations": self.activations,
                **({} if self.steady is None else {"steady": self.steady.to_json()})}

    @staticmethod
    def problem(doc: Any) -> str | None:
        """What is wrong with a stage document, or None."""
        if not isinstance(doc, dict):
            return f"is a JSON {type(doc).__name__}, not an object"
        missing = [k for k in STAGE_FIELDS if k not in doc]
        if missing:
            return f"lacks {', '.join(missing)}"
        extra = sorted(set(doc) - set(STAGE_FIELDS) - set(STAGE_OPTIONAL_FIELDS))
        if extra:
            return f"has unknown field(s) {', '.join(extra)}"
        for key, lowest in (("stage", 0), ("stages", 1), ("microbatches", 1), ("update_every", 1),
                            ("stash_depth", 1), ("threads", 1), ("batch", 1), ("seq", 1)):
            if not _is_int(doc[key]) or doc[key] < lowest:
                return f"{key} is {doc[key]!r}, not an integer >= {lowest}"
        if doc["stage"] >= doc["stages"]:
            return f"stage {doc['stage']} is not below stages {doc['stages']}"
        try:
            check_device_name(doc["device"])
        except BundleError as exc:
            return str(exc)
        blocks = doc["blocks"]
        if not (isinstance(blocks, list) and len(blocks) == 2 and all(_is_int(b) for b in blocks)
                and 0 <= blocks[0] <= blocks[1]):
            return f"blocks is {blocks!r}, not [first, last] with 0 <= first <= last"
        peers = doc["peers"]
        if not isinstance(peers, dict) or sorted(peers) != ["next", "prev"]:
            return f"peers is {peers!r}, not {{\"prev\": device or null, \"next\": device or null}}"
        for side, at_end in (("prev", doc["stage"] == 0), ("next", doc["stage"] == doc["stages"] - 1)):
            if at_end and peers[side] is not None:
                return f"peers.{side} is {peers[side]!r}, but stage {doc['stage']} of {doc['stages']} has none"
            if not at_end and not (isinstance(peers[side], str) and _DEVICE_NAME.fullmatch(peers[side])):
                return f"peers.{side} is {peers[side]!r}, not a device name"
        for key in ("schedule", "engine", "backend"):
            if not isinstance(doc[key], str) or not doc[key]:
                return f"{key} is {doc[key]!r}, not a non-empty string"
        problem = OptimizerSettings.problem(doc["optimizer"]) or _head_split_problem(doc.get("head_split"))
        if problem:
            return problem
        if "steady" in doc:
            problem = SteadyStage.problem(doc["steady"])
            if problem:
                return f"steady {problem}"
        if not valid_activations(doc.get("activations")):
            return (f"activations is {doc['activations']!r}, not one of {', '.join(ACTIVATION_CHOICES)}, "
                    f"{HYBRID}K (or null)")
        try:
            BackendSpec(doc["engine"], doc["backend"], threads=doc["threads"] if doc["backend"] == "cpu" else None)
        except ValueError as exc:
            return f"engine {doc['engine']!r} on {doc['backend']!r}: {exc}"
        return None

    @classmethod
    def from_json(cls, doc: Any, where: str = "stage.json") -> "StageDocument":
        """The checked document; BundleError `<where> <problem>` otherwise."""
        problem = cls.problem(doc)
        if problem is not None:
            raise BundleError(f"{where} {problem}")
        split = doc.get("head_split")
        return cls(doc["stage"], doc["stages"], doc["device"], doc["blocks"][0], doc["blocks"][1],
                   doc["peers"]["prev"], doc["peers"]["next"], doc["schedule"], doc["microbatches"], doc["update_every"],
                   doc["stash_depth"], doc["engine"], doc["backend"], doc["threads"],
                   OptimizerSettings.from_json(doc["optimizer"]), doc["batch"], doc["seq"],
                   None if split is None else {str(b): int(h) for b, h in split.items()},
                   doc.get("activations"), SteadyStage.from_json(doc["steady"]) if "steady" in doc else None)


@dataclass(frozen=True)
class SteadyStage:
    """One stage's part of an asynchronous schedule's steady state (ir.plan.SteadyState): its
    one-step actions drain from position `drain_at`, and `actions` (tokens) is what each further
    step of a run without a flush adds before the drain."""

    drain_at: int
    actions: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"drain_at": self.drain_at, "actions": list(self.actions)}

    @staticmethod
    def problem(doc: Any) -> str | None:
        if not isinstance(doc, dict) or sorted(doc) != ["actions", "drain_at"]:
            return f"is {doc!r:.80}, not {{\"drain_at\": position, \"actions\": [action tokens]}}"
        if not _is_int(doc["drain_at"]) or doc["drain_at"] < 0:
            return f"drain_at is {doc['drain_at']!r}, not an integer >= 0"
        if not isinstance(doc["actions"], list) or not all(isinstance(t, str) for t in doc["actions"]):
            return "actions is not a list of action tokens"
        return None

    @classmethod
    def from_json(cls, doc: Any) -> "SteadyStage":
        return cls(int(doc["drain_at"]), tuple(doc["actions"]))


# --- plan.json ---------------------------------------------------------------------------------------

PLAN_FIELDS = ("schema_version", "format", "model", "schedule", "stages", "microbatches", "update_every",
               "stash_depth", "batch", "seq", "blocks", "engine", "backend", "optimizer", "devices",
               "predicted_step_s", "partition_method", "actions")
PLAN_DEVICE_FIELDS = ("name", "stage", "blocks", "memory_bytes", "memory_budget_bytes", "predicted_time_s",
                      "bundle", "manifest_sha256")
_COST_FIELDS = ("forward_s", "backward_s", "update_s", "send_act_s", "send_grad_s")


@dataclass(frozen=True)
class PlannedCost:
    """What the cost model predicted for one stage and one micro-batch, in seconds (`confidant
    simulate` replays the plan with these)."""

    forward_s: float
    backward_s: float
    update_s: float = 0.0
    send_act_s: float = 0.0
    send_grad_s: float = 0.0
    # the part of backward_s a zero-bubble schedule's W takes (ir.partition.StageCost); optional
    # in plan.json, absent in plans written before it existed
    weight_grad_s: float | None = None

    def to_json(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in _COST_FIELDS}
        if self.weight_grad_s is not None:
            out["weight_grad_s"] = self.weight_grad_s
        return out


@dataclass(frozen=True)
class PlannedHeadSplit:
    """A device's attention heads split across its backends: `heads` per backend, the split's
    predicted forward+backward seconds of one attention block, and the fastest single backend with
    its time (what the split beat)."""

    heads: Mapping[str, int]
    predicted_s: float | None = None
    single_best: tuple[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"heads": dict(self.heads), "predicted_s": self.predicted_s,
                "single_best": None if self.single_best is None else [self.single_best[0], self.single_best[1]]}


@dataclass(frozen=True)
class DevicePlan:
    """One stage of a plan: the device that runs it, its blocks, predicted memory (against its
    budget) and time per micro-batch, engine and threads, head split, bundle folder and its
    manifest's SHA-256, and (optional) the worker address and the cost model's figures."""

    name: str
    stage: int
    first_block: int
    last_block: int
    memory_bytes: int
    memory_budget_bytes: int
    predicted_time_s: float
    bundle: str
    manifest_sha256: str
    threads: int = 1
    engine: str = "mnn"
    head_split: PlannedHeadSplit | None = None
    address: str | None = None
    cost: PlannedCost | None = None
    trainable_bytes: int | None = None  # the stage's trainable parameters (None: plans written before)
    frozen_bytes: int | None = None     # its frozen weights (LoRA's base), held once
    activations: str | None = None      # "keep" or "recompute" (None: the engine's default)
    # the memory model's terms of memory_bytes by name (planner.cost.MemoryTerms.by_name: trainable,
    # frozen <precision>, gradients, optimizer state, activations, workspace, runtime), which sum to
    # it; None: plans written before
    memory_terms: Mapping[str, int] | None = None
    # bytes of the budget the plan left free for what the run holds beside memory_bytes (the fault
    # policy's snapshot copies on their way on the workers), passed to the planner by the job;
    # memory_bytes + reserved_bytes <= memory_budget_bytes. 0: none (and plans written before)
    reserved_bytes: int = 0

    @property
    def blocks(self) -> tuple[int, int]:
        return (self.first_block, self.last_block)

    @property
    def promised_bytes(self) -> int:
        """What a run of the plan may hold on the device: the planned figure and the reserve."""
        return self.memory_bytes + self.reserved_bytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "stage": self.stage, "blocks": [self.first_block, self.last_block],
            "memory_bytes": self.memory_bytes, "memory_budget_bytes": self.memory_budget_bytes,
            "predicted_time_s": self.predicted_time_s, "threads": self.threads, "engine": self.engine,
            "head_split": None if self.head_split is None else self.head_split.to_json(),
            "bundle": self.bundle, "manifest_sha256": self.manifest_sha256,
        }
        if self.address is not None:
            out["address"] = self.address
        if self.cost is not None:
            out["cost"] = self.cost.to_json()
        if self.trainable_bytes is not None:
            out["trainable_bytes"], out["frozen_bytes"] = self.trainable_bytes, self.frozen_bytes or 0
        if self.memory_terms is not None:
            out["memory_terms"] = dict(self.memory_terms)
        if self.activations is not None:
            out["activations"] = self.activations
        if self.reserved_bytes:
            out["reserved_bytes"] = self.reserved_bytes
        return out


@dataclass(frozen=True)
class PlannedLora:
    """The LoRA settings a plan's graph was adapted with (`planner.lora.LoraSettings`, as plain
    data: `ir` imports no planner): rank, alpha (the update is scaled by alpha / rank), the targeted
    projections, what else trains in full, and the seed of A's initialisation. `train PLAN`'s
    checkpoints carry them, so `export-adapter` can name the adapters and `predict` knows the run."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    train_also: tuple[str, ...]
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "train_also": list(self.train_also), "seed": self.seed}

    @classmethod
    def from_json(cls, doc: Any, fail) -> "PlannedLora":
        def texts(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(x, str) and x for x in v)

        ok = (isinstance(doc, dict) and _is_int(doc.get("rank")) and doc["rank"] >= 1
              and _number(doc.get("alpha")) and doc["alpha"] > 0 and texts(doc.get("targets")) and doc["targets"]
              and texts(doc.get("train_also")) and _is_int(doc.get("seed", 0)))
        if not ok:
            raise fail(f"lora is {doc!r:.120}, not null or {{\"rank\": an integer >= 1, \"alpha\": a number > 0, "
                       f"\"targets\": [names], \"train_also\": [names], \"seed\": an integer}}")
        return cls(doc["rank"], float(doc["alpha"]), tuple(doc["targets"]), tuple(doc["train_also"]),
                   int(doc.get("seed", 0)))


@dataclass(frozen=True)
class PlanDocument:
    """plan.json: the model and its block names, the schedule (name, micro-batches, stash depths and
    every stage's action tokens), the bound shape, the engine(s), the optimizer, the devices in
    pipeline order, the predicted step, how the partition was found, and the SHA-256 of the cluster
    file beside it (None: written without one) and of the base weights file (a model with frozen
    weights, LoRA's: every frozen weight in one file that a device may hold, so its stage's frozen
    weights need not cross the link; None: no such file), and the LoRA settings its graph was adapted
    with (None: full fine-tuning, or a plan written before plans recorded them)."""

    model: str
    schedule: str
    microbatches: int
    update_every: int
    stash_depth: tuple[int, ...]
    batch: int
    seq: int
    blocks: tuple[str, ...]
    engine: str
    backend: str
    optimizer: OptimizerSettings
    devices: tuple[DevicePlan, ...]
    predicted_step_s: float | None
    partition_method: str
    actions: tuple[tuple[str, ...], ...]
    graph: str | None = None
    partition_optimal: bool = False
    bottleneck_s: float = 0.0
    cluster_sha256: str | None = None
    base_sha256: str | None = None
    # distinct rows of each embedding table the data the plan was made for looks up (`plan --data`,
    # `ir.graph.Graph.lookup_rows`): the memory model holds those tables' AdamW state for that many
    # rows, so `train` refuses data that looks up more. Empty: tables charged whole.
    lookup_rows: Mapping[str, int] = field(default_factory=dict)
    # the ONNX file the plan was made from (absolute, as planned; None: not recorded): a checkpoint of
    # `train PLAN` names it, so predict and export-trained find the model the weights belong to
    model_path: str | None = None
    lora: PlannedLora | None = None  # absent from plan.json when None (full fine-tuning, older plans)
    # how the frozen base weights are held (`ir.precision`: float32, bfloat16, int8, int4; a LoRA
    # plan's `--base-dtype`): each bundle's graph records its weights' precisions, this is the
    # plan-wide choice `train PLAN` and `show` report. Plans from before it: float32.
    base_dtype: str = "float32"
    # the identity every bundle's signed manifest names (`ir.bundle.plan_identity`): a bundle of
    # another plan, signed by the same key, is refused in this plan's folder (None: written before)
    plan_id: str | None = None
    # the most loss-target positions one micro-batch of the data the plan was made for has (`plan
    # --data`, `ir.graph.Graph.target_positions`): the LM head + loss stage is charged for that many,
    # so `train` refuses data with more. None: every position charged (the worst case).
    target_positions: int | None = None
    # the fault policy the plan left memory for (`ir.plan.FAILURE_POLICIES`, `plan --on-failure`):
    # "replan" keeps each device of a pipeline's `reserved_bytes` free for the snapshot copies, "stop"
    # none; `train PLAN` runs with it and refuses another. Plans written before it: "replan".
    on_failure: str = "replan"

    @property
    def stages(self) -> int:
        return len(self.devices)

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    def device(self, name: str) -> DevicePlan:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"the plan has no device {name!r} (devices: {self.device_names})")

    def to_schedule(self) -> Schedule:
        """The plan's schedule: what every stage's executor runs."""
        return Schedule(self.schedule, self.stages, self.microbatches,
                        tuple(tuple(Action.parse(t) for t in row) for row in self.actions), self.stash_depth,
                        self.update_every)

    def compute_actions(self, stage: int) -> list[Action]:
        """Stage `stage`'s forwards, backwards and updates, in order (what `confidant show` prints)."""
        return [a for a in (Action.parse(t) for t in self.actions[stage])
                if a.kind.is_compute or a.kind is ActionKind.UPDATE]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema_version": PLAN_SCHEMA_VERSION, "format": PLAN_FORMAT, "model": self.model, "graph": self.graph,
            "schedule": self.schedule, "stages": self.stages, "microbatches": self.microbatches,
            "update_every": self.update_every, "stash_depth": list(self.stash_depth), "batch": self.batch,
            "seq": self.seq, "blocks": list(self.blocks), "engine": self.engine, "backend": self.backend,
            "optimizer": self.optimizer.to_json(), "devices": [d.to_json() for d in self.devices],
            "predicted_step_s": self.predicted_step_s, "partition_method": self.partition_method,
            "partition_optimal": self.partition_optimal, "bottleneck_s": self.bottleneck_s,
            "actions": [list(row) for row in self.actions],
        }
        if self.cluster_sha256 is not None:
            doc["cluster_sha256"] = self.cluster_sha256
        if self.base_sha256 is not None:
            doc["base_sha256"] = self.base_sha256
        if self.lookup_rows:
            doc["lookup_rows"] = dict(sorted(self.lookup_rows.items()))
        if self.model_path is not None:
            doc["model_path"] = self.model_path
        if self.lora is not None:
            doc["lora"] = self.lora.to_json()
        if self.base_dtype != "float32":
            doc["base_dtype"] = self.base_dtype
        if self.plan_id is not None:
            doc["plan_id"] = self.plan_id
        if self.target_positions is not None:
            doc["target_positions"] = self.target_positions
        doc["on_failure"] = self.on_failure
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "PlanDocument":
        """The checked plan of folder `where`: PlanError (from `ir.verify.verify_plan`) for a schedule
        that does not verify, BundleError for anything else."""
        def fail(what: str) -> BundleError:
            return BundleError(f"plan {where}: {what}")

        check_header(doc, format=PLAN_FORMAT, versions=PLAN_SCHEMA_VERSION, where=f"plan {where}: plan.json",
                     redo="re-run `confidant plan` with this version", error=BundleError)
        missing = [k for k in PLAN_FIELDS if k not in doc]
        if missing:
            raise fail(f"plan.json lacks {', '.join(missing)}")
        devices, blocks = doc["devices"], doc["blocks"]
        if not isinstance(blocks, list) or not blocks or not all(isinstance(b, str) for b in blocks):
            raise fail("plan.json blocks must list the model's block names")
        if not isinstance(devices, list) or not devices or len(devices) != doc["stages"]:
            raise fail(f"plan.json devices must list one device per stage ({doc['stages']!r} stages)")
        parsed = tuple(_device_plan(d, i, len(blocks), fail) for i, d in enumerate(devices))
        names, expect_first = set(), 0
        for d in parsed:
            if d.name.lower() in names:
                raise fail(f"device {d.name!r} appears twice (names must differ even ignoring case)")
            names.add(d.name.lower())
            if d.first_block != expect_first:
                raise fail(f"device {d.name!r} blocks {list(d.blocks)!r} do not continue at block {expect_first} "
                           f"(the model has {len(blocks)} blocks, cut into contiguous ranges)")
            expect_first = d.last_block + 1
        if expect_first != len(blocks):
            raise fail(f"the devices cover blocks 0..{expect_first - 1} of 0..{len(blocks) - 1}")
        cluster_digest, base_digest = doc.get("cluster_sha256"), doc.get("base_sha256")
        for key, digest in (("cluster_sha256", cluster_digest), ("base_sha256", base_digest),
                            ("plan_id", doc.get("plan_id"))):
            if digest is not None and not (isinstance(digest, str) and SHA256.fullmatch(digest)):
                raise fail(f"{key} is {digest!r}, not null or a sha256 hex digest")
        if doc["predicted_step_s"] is not None and not _number(doc["predicted_step_s"]):
            raise fail(f"predicted_step_s is {doc['predicted_step_s']!r}, not null or a non-negative number")
        problem = OptimizerSettings.problem(doc["optimizer"])
        if problem:
            raise fail(problem)
        for key in ("model", "schedule", "engine", "backend", "partition_method"):
            if not isinstance(doc[key], str):
                raise fail(f"{key} is {doc[key]!r}, not a string")
        try:
            schedule = Schedule.from_json({"schema_version": 1, "name": doc["schedule"], "stages": doc["stages"],
                                           "microbatches": doc["microbatches"], "update_every": doc["update_every"],
                                           "stash_depth": doc["stash_depth"], "actions": doc["actions"]})
        except (TypeError, ValueError) as exc:
            raise fail(f"plan.json schedule cannot be read: {exc}") from None
        verify_plan(schedule)
        for key in ("batch", "seq"):
            if not _is_int(doc[key]) or doc[key] < 1:
                raise fail(f"{key} is {doc[key]!r}, not an integer >= 1")
        lookup_rows = doc.get("lookup_rows", {})
        if not (isinstance(lookup_rows, dict)
                and all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in lookup_rows.items())):
            raise fail(f"lookup_rows is {lookup_rows!r:.80}, not an object of table names to row counts >= 0")
        target_positions = doc.get("target_positions")
        if target_positions is not None and not (_is_int(target_positions) and target_positions >= 0):
            raise fail(f"target_positions is {target_positions!r:.80}, not null or a count >= 0")
        model_path = doc.get("model_path")
        if model_path is not None and not (isinstance(model_path, str) and model_path):
            raise fail(f"model_path is {model_path!r:.80}, not null or a path")
        lora = None if doc.get("lora") is None else PlannedLora.from_json(doc["lora"], fail)
        base_dtype = doc.get("base_dtype", "float32")
        if base_dtype not in BASE_DTYPES:
            raise fail(f"base_dtype is {base_dtype!r:.80}, not one of {', '.join(BASE_DTYPES)}")
        on_failure = doc.get("on_failure", "replan")
        if on_failure not in FAILURE_POLICIES:
            raise fail(f"on_failure is {on_failure!r:.80}, not one of {', '.join(FAILURE_POLICIES)}")
        return cls(doc["model"], schedule.name, schedule.microbatches, schedule.update_every, schedule.stash_depth,
                   doc["batch"], doc["seq"], tuple(blocks), doc["engine"], doc["backend"],
                   OptimizerSettings.from_json(doc["optimizer"]), parsed, doc["predicted_step_s"],
                   doc["partition_method"], tuple(tuple(str(a) for a in row) for row in schedule.actions),
                   doc.get("graph"), bool(doc.get("partition_optimal", False)), float(doc.get("bottleneck_s", 0.0)),
                   cluster_digest, base_digest, dict(lookup_rows), model_path, lora, base_dtype,
                   doc.get("plan_id"), target_positions, on_failure)


def _device_plan(d: Any, i: int, n_blocks: int, fail) -> DevicePlan:
    if not isinstance(d, dict):
        raise fail(f"plan.json devices[{i}] is not an object")
    lacking = [k for k in PLAN_DEVICE_FIELDS if k not in d]
    if lacking:
        raise fail(f"plan.json devices[{i}] lacks {', '.join(lacking)}")
    try:
        check_device_name(d["name"])
    except BundleError as exc:
        raise fail(f"devices[{i}]: {exc}") from None
    name = d["name"]
    if d["stage"] != i:
        raise fail(f"device {name!r} is stage {d['stage']!r} at position {i}; devices are in pipeline order")
    b = d["blocks"]
    if not (isinstance(b, list) and len(b) == 2 and all(_is_int(x) for x in b) and 0 <= b[0] <= b[1] < n_blocks):
        raise fail(f"device {name!r} blocks {b!r} are not [first, last] within the model's {n_blocks} blocks")
    for key in ("memory_bytes", "memory_budget_bytes", "predicted_time_s"):
        if not _number(d[key]):
            raise fail(f"device {name!r} {key} is {d[key]!r}, not a non-negative number")
    digest = d["manifest_sha256"]
    if d["bundle"] != name or not (isinstance(digest, str) and SHA256.fullmatch(digest)):
        raise fail(f"device {name!r}: bundle must be its name and manifest_sha256 a sha256 hex digest")
    if d.get("address") is not None:
        try:
            parse_address(d["address"])
        except AddressError as exc:
            raise fail(f"device {name!r} address {exc}") from None
    threads = d.get("threads", 1)
    if not _is_int(threads) or threads < 1:
        raise fail(f"device {name!r} threads is {threads!r}, not an integer >= 1")
    engine = d.get("engine", "mnn")
    if not isinstance(engine, str) or not engine:
        raise fail(f"device {name!r} engine is {engine!r}, not a non-empty string")
    sizes = {}
    for key in ("trainable_bytes", "frozen_bytes"):
        if d.get(key) is not None and not (_is_int(d[key]) and d[key] >= 0):
            raise fail(f"device {name!r} {key} is {d[key]!r}, not an integer >= 0")
        sizes[key] = d.get(key)
    if not valid_activations(d.get("activations")):
        raise fail(f"device {name!r} activations is {d['activations']!r}, not one of {', '.join(ACTIVATION_CHOICES)} "
                   f"or {HYBRID}K")
    reserved = d.get("reserved_bytes", 0)
    if not (_is_int(reserved) and reserved >= 0):
        raise fail(f"device {name!r} reserved_bytes is {reserved!r}, not an integer >= 0")
    terms = d.get("memory_terms")
    if terms is not None and not (isinstance(terms, dict) and all(isinstance(k, str) and _is_int(v)
                                                                   for k, v in terms.items())):
        raise fail(f"device {name!r} memory_terms must map term names to integer bytes, got {terms!r:.80}")
    return DevicePlan(name, i, b[0], b[1], int(d["memory_bytes"]), int(d["memory_budget_bytes"]),
                      float(d["predicted_time_s"]), d["bundle"], digest, threads, engine,
                      _planned_split(d.get("head_split"), name, fail), d.get("address"),
                      _planned_cost(d.get("cost"), name, fail), sizes["trainable_bytes"], sizes["frozen_bytes"],
                      d.get("activations"), None if terms is None else dict(terms), int(reserved))


def _planned_split(doc: Any, device: str, fail) -> PlannedHeadSplit | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or "heads" not in doc or _head_split_problem(doc["heads"]):
        raise fail(f"device {device!r} head_split is {doc!r}, not null or {{\"heads\": {{backend: heads}}, ...}}")
    predicted, best = doc.get("predicted_s"), doc.get("single_best")
    if predicted is not None and not _number(predicted):
        raise fail(f"device {device!r} head_split.predicted_s is {predicted!r}, not a non-negative number")
    if best is not None and not (isinstance(best, list) and len(best) == 2 and isinstance(best[0], str)
                                 and _number(best[1])):
        raise fail(f"device {device!r} head_split.single_best is {best!r}, not [backend, seconds]")
    return PlannedHeadSplit({str(b): int(h) for b, h in doc["heads"].items()},
                            None if predicted is None else float(predicted),
                            None if best is None else (best[0], float(best[1])))


def _planned_cost(doc: Any, device: str, fail) -> PlannedCost | None:
    if doc is None:
        return None
    if (not isinstance(doc, dict) or not set(_COST_FIELDS) <= set(doc) <= set(_COST_FIELDS) | {"weight_grad_s"}
            or not all(_number(v) for v in doc.values())):
        raise fail(f"device {device!r} cost is {doc!r}, not {{{', '.join(_COST_FIELDS)}}} (and optionally "
                   f"weight_grad_s) in seconds")
    weight = doc.get("weight_grad_s")
    return PlannedCost(**{k: float(doc[k]) for k in _COST_FIELDS}, weight_grad_s=None if weight is None else float(weight))


__all__ = ["BundleError", "DevicePlan", "OptimizerSettings", "PLAN_FIELDS", "PLAN_DEVICE_FIELDS", "PLAN_FORMAT",
           "PLAN_SCHEMA_VERSION", "PlanDocument", "PlannedCost", "PlannedLora", "PlannedHeadSplit", "STAGE_FIELDS",
           "STAGE_OPTIONAL_FIELDS", "StageDocument", "SteadyStage", "check_device_name"]
