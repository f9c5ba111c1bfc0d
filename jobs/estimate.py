"""`confidant estimate`: will a model's training fit these devices, and what would make it fit.

Anchor: `accelerate estimate-memory`, which prices a model's training from its parameters alone.
Here the answer is the planner's own: the model is lowered at the micro-batch shape, adapted for
LoRA as `plan` would, its frozen weights charged at `--base-dtype` (`ir.precision`), priced by
planner.cost (from the devices' profiles, or without any from the graph's shapes:
`planner.memory_defaults`) and cut by the planner's partitioner (planner.partition), so each
device's figure is the one `plan` would promise. Nothing is written. Each lever (LoRA, base
precision, recompute, micro-batch size, the optimizer, more devices) is a re-estimate with that one
change, so its MiB are what the planner would give.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ir.errors import InputFileError
from ir.graph import Graph
from ir.partition import Partition, StageAssignment
from ir.precision import BASE_DTYPES, bytes_per_frozen_element
from ir.profile import DeviceProfile, Link
from ir.training import TRAINING
from jobs.common.errors import JobError
from jobs.common.lora import adapted
from jobs.common.lora import with_base_mapped
from jobs.planning import compile_within_reserve, snapshot_reserve
from planner.compile import PlanRequest, manual_cuts, search, with_head_splits
from planner.cluster import Cluster, DeviceSpec, load_cluster, parse_bytes, with_reserve
from planner.cost import activations_of, stage_costs
from planner.lora import LoraSettings
from planner.memory_defaults import (default_profile, memory_parts, widened_bytes, with_frozen_precision,
                                     with_profile_costs)
from planner.partition import PlanDoesNotFit, make_instance, solve_partition

MIB = 2 ** 20
# The link priced between devices given by --devices (no cluster file): a home Wi-Fi's order.
# Only the cut's placement depends on it, never a device's memory.
DEFAULT_LINK = Link(100e6 / 8, 5e-3)
DEFAULT_LORA_RANK = TRAINING.lora_rank
# seconds the partitioner may take per estimate (each lever is one more)
SOLVE_S = 1.0
# at most this many devices added by the "more devices" lever
MAX_ADDED_DEVICES = 8


def mib(n: float) -> str:
    """Bytes in MiB, the unit every message of the estimate leads with (whole from 10 MiB up)."""
    return f"{n / MIB:.0f} MiB" if abs(n) >= 10 * MIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class EstimateSettings:
    """The batch shape and the training to price: rows per batch in `microbatches` micro-batches of
    `seq` tokens, the schedule, optimizer, LoRA (None: full fine-tuning) and the frozen base's
    storage precision (`ir.precision.BASE_DTYPES`)."""

    batch: int = TRAINING.batch
    seq: int = TRAINING.seq
    microbatches: int = TRAINING.microbatches
    schedule: str = TRAINING.schedule
    optimizer: str = TRAINING.optimizer
    update_every: int = TRAINING.update_every
    lora: LoraSettings | None = None
    base_dtype: str = "float32"

    @property
    def label(self) -> str:
        if self.lora is None:
            return "full fine-tuning"
        return f"LoRA r={self.lora.rank}" + ("" if self.base_dtype == "float32" else f", {self.base_dtype} base")


@dataclass(frozen=True)
class StageEstimate:
    device: str
    first_block: int
    last_block: int
    memory_bytes: int
    budget_bytes: int  # what the stage may use: the device's budget less what `plan` keeps free of it
    parts: Mapping[str, int]

    @property
    def over_bytes(self) -> int:
        return max(0, self.memory_bytes - self.budget_bytes)


@dataclass(frozen=True)
class VariantEstimate:
    """One training's estimate: each used device's stage (the planner's cut, or when nothing fits
    its least-overflow attempt) and whether it fits."""

    settings: EstimateSettings
    stages: tuple[StageEstimate, ...]
    fits: bool
    idle: tuple[str, ...] = ()  # devices the plan leaves unused
    budgets: Mapping[str, int] = dataclasses.field(default_factory=dict)  # every device's, by name
    # each used device's backend as the planner picked it (None: the cluster file's or the only one) and
    # what it does with its activations (`planner.cost.activations_of`: the engine's default where not picked)
    choices: Mapping[str, tuple[str | None, str | None]] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(s.memory_bytes for s in self.stages)

    @property
    def tightest(self) -> StageEstimate:
        return max(self.stages, key=lambda s: (s.memory_bytes - s.budget_bytes, s.memory_bytes))


@dataclass(frozen=True)
class Lever:
    """One change and what it does: `flag` (how to ask for it), the MiB it saves over all devices
    (negative: it costs), whether the training then fits, and a note."""

    flag: str
    saves_bytes: int | None
    fits: bool | None
    note: str = ""


@dataclass(frozen=True)
class Estimate:
    model: str
    source: str                 # where the costs came from (profiles, or the graph's shapes)
    requested: VariantEstimate
    alternatives: tuple[VariantEstimate, ...]   # full fine-tuning and LoRA, where not the request
    levers: tuple[Lever, ...]
    notes: tuple[str, ...] = ()


def parse_devices(text: str) -> tuple[tuple[str, int], ...]:
    """--devices NAME=SIZE,... (e.g. phone=1.5GiB,laptop=3GiB) as (name, budget bytes) pairs."""
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not name.strip() or not size.strip():
            raise ValueError(f"--devices: {item.strip()!r} is not NAME=SIZE (e.g. phone=1.5GiB,laptop=3GiB)")
        try:
            budget = parse_bytes(size.strip())
        except ValueError as exc:
            raise ValueError(f"--devices {name.strip()}: {exc}") from None
        if budget < MIB:
            raise ValueError(f"--devices {name.strip()}={size.strip()}: that is {budget} bytes; write the unit "
                             f"(e.g. {size.strip()}MiB or {size.strip()}GiB)")
        if name.strip() in {n for n, _ in out}:
            raise ValueError(f"--devices: {name.strip()!r} appears twice; device names must be unique")
        out.append((name.strip(), budget))
    return tuple(out)


def _graph(model: Path, settings: EstimateSettings) -> Graph:
    from planner.onnx_import import load_model

    M = settings.microbatches
    if settings.batch % M:
        raise JobError(f"--batch {settings.batch} must be a multiple of --microbatches {M}")
    return load_model(model, settings.batch // M, settings.seq)


class _Pricer:
    """Estimates for one model and one set of devices; graphs per (micro-batch rows, LoRA) kept."""

    def __init__(self, model: Path, base: EstimateSettings, devices: Sequence[tuple[str, int]] | None,
                 cluster: Cluster | None, profile: DeviceProfile | None):
        self.model, self.base_settings = model, base
        self.named, self.cluster_file, self.profile = devices, cluster, profile
        self._graphs: dict = {}
        self.notes: list[str] = []

    def graph(self, settings: EstimateSettings, unadapted: bool = False) -> Graph:
        rows = settings.batch // settings.microbatches
        key = (rows, settings.seq)
        if key not in self._graphs:
            self._graphs[key] = _graph(self.model, settings)
        full = self._graphs[key]
        if unadapted or settings.lora is None:
            return full
        lkey = key + (settings.lora,)
        if lkey not in self._graphs:
            self._graphs[lkey] = adapted(full, settings.lora)
        return self._graphs[lkey]

    def cluster(self, graph: Graph, reference: Graph, extra: int = 0,
                activations: str | None = None) -> tuple[Cluster, dict[str, int]]:
        """The devices priced for `graph`, with `extra` copies of the largest-budget one added, and
        the reserve `plan` keeps on each device of a pipeline (`jobs.planning.snapshot_reserve`)."""
        if self.cluster_file is not None:
            devices = []
            for d in self.cluster_file.devices:
                self._check_shape(d.profile, graph, f"device {d.name!r}'s profile")
                profile, missing = with_profile_costs(graph, d.profile, reference)
                self._note_missing(missing, d.profile.name)
                devices.append(dataclasses.replace(d, profile=profile))
            cluster = dataclasses.replace(self.cluster_file, devices=tuple(devices))
        else:
            if self.profile is not None:
                self._check_shape(self.profile, graph, "--profile")
                profile, missing = with_profile_costs(graph, self.profile, reference)
                self._note_missing(missing, self.profile.name)
            else:
                profile = default_profile(graph)
            cluster = Cluster(tuple(DeviceSpec(name, f"estimate://{name}", profile, budget)
                                    for name, budget in self.named), DEFAULT_LINK)
        if extra:
            big = max(cluster.devices, key=lambda d: d.memory_budget_bytes)
            added = tuple(dataclasses.replace(big, name=f"{big.name}+{k}", address=f"estimate://{big.name}+{k}")
                          for k in range(1, extra + 1))
            cluster = dataclasses.replace(cluster, devices=cluster.devices + added)
        if activations is not None:
            cluster = dataclasses.replace(cluster, devices=tuple(
                dataclasses.replace(d, activations=activations) for d in cluster.devices))
        # as `plan` leaves it: each budget of a pipeline less what the fault policy's snapshot copies on
        # the workers hold (a device alone keeps its whole budget)
        reserve = snapshot_reserve(cluster)
        if any(reserve.values()):
            note = (f"each device of a pipeline must fit its figure within its budget less the "
                    f"{max(reserve.values()) / MIB:.0f} MiB `plan` keeps for the fault policy's snapshot copies on "
                    f"the workers (a device alone keeps none)")
            if note not in self.notes:
                self.notes.append(note)
        return cluster, reserve

    def _check_shape(self, profile: DeviceProfile, graph: Graph, what: str) -> None:
        if (profile.batch, profile.seq) != (graph.batch, graph.seq):
            raise InputFileError(f"{what} was measured at (micro-batch rows, seq) ({profile.batch}, {profile.seq}) "
                                 f"but this estimate uses ({graph.batch}, {graph.seq}) = --batch / --microbatches, "
                                 f"--seq; re-profile with `confidant profile --batch {graph.batch} --seq "
                                 f"{graph.seq}`, or drop the profile to estimate from the graph")

    def _note_missing(self, missing: tuple[int, ...], name: str) -> None:
        if missing:
            note = (f"profile {name!r} lacks {len(missing)} block(s) of the adapted model (profile with its --lora "
                    f"settings to price them as measured): priced as the same blocks without adapters (an upper "
                    f"bound) or from the graph")
            if note not in self.notes:
                self.notes.append(note)

    def estimate(self, settings: EstimateSettings, extra: int = 0, activations: str | None = None,
                 fixed: VariantEstimate | None = None) -> VariantEstimate:
        """The training's estimate: cut by the planner, or with `fixed` at that estimate's cuts and
        per-device choices (what one change costs where nothing else moves); `activations` forces
        every device's."""
        reference = self.graph(settings, unadapted=True)
        graph = with_frozen_precision(self.graph(settings), settings.base_dtype)
        cluster, reserve = self.cluster(graph, reference, extra, activations)
        # as `plan` marks them: its workers hold base.safetensors and read a float32 base mapped
        cluster = with_base_mapped(cluster, settings.lora is not None and settings.base_dtype == "float32")
        # as plan compiles it (planner.compile): attention heads split first where a profile's curves
        # say it is faster (a split device runs MNN and its split's child processes), then engines and cuts
        cluster, splits = with_head_splits(graph, cluster)
        widen = widened_bytes(self.graph(settings), settings.base_dtype)
        if widen:  # one block's base widened to float32 at a time: every device's runtime holds it
            cluster = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(
                d, profile=dataclasses.replace(d.profile, runtime_overhead_bytes=d.profile.runtime_overhead_bytes
                                               + widen)) for d in cluster.devices))
        args = (settings.schedule, settings.microbatches, settings.optimizer)
        request = PlanRequest(*args, settings.update_every)
        try:
            if fixed is not None:  # the reserve where `fixed` is a pipeline
                cluster = with_reserve(cluster, reserve) if len(fixed.stages) > 1 else cluster
                cluster = dataclasses.replace(cluster, devices=tuple(
                    dataclasses.replace(d, picked=fixed.choices[d.name][0],
                                        activations=activations or fixed.choices[d.name][1])
                    if d.name in fixed.choices else d for d in cluster.devices))
                partition = Partition(tuple(StageAssignment(k, st.device, st.first_block, st.last_block)
                                            for k, st in enumerate(fixed.stages)), "fixed")
                fits = all(c.memory_bytes <= c.memory_budget_bytes for c in stage_costs(
                    graph, cluster, partition, *args, settings.update_every))
            elif activations is None:  # the planner's own choice of engine and activations per device
                picks = compile_within_reserve(lambda over, req: _picks(graph, over, req, frozenset(splits)), cluster,
                                               reserve, request, step_of=lambda p: p.after_us)
                partition, cluster, fits = picks.partition, picks.cluster, True
            else:  # every device as told
                cluster = with_reserve(cluster, reserve)
                inst = make_instance(graph, cluster, *args, settings.update_every)
                partition, fits = solve_partition(inst, time_limit_s=SOLVE_S), True
        except PlanDoesNotFit as exc:
            partition, fits = exc.attempt, False
        except ValueError as exc:
            raise JobError(str(exc)) from None
        costs = stage_costs(graph, cluster, partition, settings.schedule, settings.microbatches, settings.optimizer,
                            settings.update_every)
        stages = []
        for k, (cost, (first, last)) in enumerate(zip(costs, partition.ranges)):
            spec = cluster.device(cost.device)
            parts = memory_parts(graph, spec, first, last, k, len(costs), settings.schedule, settings.microbatches,
                                 settings.optimizer, settings.update_every)
            stages.append(StageEstimate(cost.device, first, last, cost.memory_bytes, cost.memory_budget_bytes,
                                        parts))
        used = set(partition.devices)
        return VariantEstimate(settings, tuple(stages), fits, tuple(d.name for d in cluster.devices
                                                                    if d.name not in used),
                               {d.name: d.memory_budget_bytes for d in cluster.devices},
                               {d.name: (d.picked, activations_of(d)) for d in cluster.devices if d.name in used})


def _picks(graph: Graph, cluster: Cluster, request: PlanRequest, splits: frozenset[str]):
    """The planner's engine picks and cut for `request` (as `plan` compiles it: planner.compile's
    search; cuts=() with one device: that device alone, PlanDoesNotFit when it does not fit)."""
    if request.cuts is None:
        return search(graph, cluster, request, lambda inst: solve_partition(inst, time_limit_s=SOLVE_S), fixed=splits)
    picks = search(graph, cluster, request, None, fixed=splits, partition=manual_cuts(graph, cluster, request))
    costs = stage_costs(graph, picks.cluster, picks.partition, *request.costing, request.update_every)
    over = [c for c in costs if c.memory_bytes > c.memory_budget_bytes]
    if over:
        raise PlanDoesNotFit(f"{over[0].device!r} alone does not fit", over[0].device,
                             over[0].memory_bytes - over[0].memory_budget_bytes, picks.partition)
    return picks


def estimate_memory(model: Path, settings: EstimateSettings, devices: Sequence[tuple[str, int]] | None = None,
                    cluster_file: Path | None = None, profile: Path | None = None) -> Estimate:
    """The estimate for `model` (see the module docstring): `devices` (name, budget bytes) priced by
    `profile` (one profile for all) or the graph's shapes, or the devices of `cluster_file` with their
    own profiles (addresses not needed)."""
    if (devices is None) == (cluster_file is None):
        raise JobError("give the devices: --devices NAME=SIZE,... or --cluster FILE")
    if cluster_file is not None and profile is not None:
        raise JobError("--profile prices --devices; a --cluster file names each device's own profile: drop one")
    if settings.base_dtype not in BASE_DTYPES:
        raise JobError(f"--base-dtype {settings.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}")
    if settings.base_dtype != "float32" and settings.lora is None:
        raise JobError(f"--base-dtype {settings.base_dtype} sets the precision of the frozen base of a LoRA run; "
                       f"full fine-tuning trains every weight in float32: add --lora R (e.g. --lora 8)")
    cluster = load_cluster(cluster_file, require_address=False) if cluster_file is not None else None
    try:
        prof = DeviceProfile.load(profile) if profile is not None else None
    except ValueError as exc:
        raise InputFileError(f"--profile {exc}") from None
    pricer = _Pricer(Path(model), settings, devices, cluster, prof)
    requested = pricer.estimate(settings)
    lora = settings.lora or LoraSettings(DEFAULT_LORA_RANK)
    alternatives = []
    for alt in (dataclasses.replace(settings, lora=None, base_dtype="float32"),
                dataclasses.replace(settings, lora=lora, base_dtype="float32")):
        if alt != settings:
            alternatives.append(pricer.estimate(alt))
    levers = _levers(pricer, settings, requested, alternatives)
    source = ("the devices' profiles" if cluster is not None else f"profile {prof.name!r}" if prof is not None
              else "the graph's shapes (no profile: MNN engine, nominal speeds; `confidant profile` measures)")
    return Estimate(str(model), source, requested, tuple(alternatives), tuple(levers), tuple(pricer.notes))


def _lever(pricer: "_Pricer", flag: str, before: VariantEstimate, settings: EstimateSettings, note: str = "",
           activations: str | None = None) -> Lever:
    """The lever `settings` (or `activations`) against the request `before`: the MiB it saves over all
    devices at the request's cuts and picks (the change alone), and whether the planner, free to cut
    again, then makes it fit."""
    same_cuts = pricer.estimate(settings, activations=activations, fixed=before)
    replanned = pricer.estimate(settings, activations=activations)
    return Lever(flag, before.total_bytes - same_cuts.total_bytes, replanned.fits or same_cuts.fits, note)


def _levers(pricer: _Pricer, settings: EstimateSettings, requested: VariantEstimate,
            alternatives: Sequence[VariantEstimate]) -> list[Lever]:
    """Every lever, each a re-estimate with one change from the request."""
    out = []
    if settings.lora is None:
        lora = next(a for a in alternatives if a.settings.lora is not None)
        out.append(_lever(pricer, f"--lora {lora.settings.lora.rank}", requested, lora.settings,
                          "adapters only: the base weights stay frozen (no gradients or optimizer state)"))
        base = lora.settings
    else:
        base = settings
    lower = BASE_DTYPES[BASE_DTYPES.index(base.base_dtype) + 1:]
    for dtype in lower:
        alt = dataclasses.replace(base, base_dtype=dtype)
        flag = ("" if settings.lora is not None else f"--lora {base.lora.rank} ") + f"--base-dtype {dtype}"
        out.append(_lever(pricer, flag, requested, alt,
                          f"frozen base at {bytes_per_frozen_element(dtype):g} bytes an element"))
    out.append(_lever(pricer, "recompute on every device", requested, settings,
                      "each block's forward re-run in its backward instead of its caches kept per micro-batch in "
                      "flight (the planner keeps them only where they fit: train-pipeline --activations)",
                      activations="recompute"))
    out.append(_lever(pricer, "recompute per block on every device", requested, settings,
                      "only each block's input held per micro-batch in flight, each block's forward re-run inside "
                      "its own backward (train-pipeline --activations per-block; the planner picks it where nothing "
                      "faster fits, on MNN; on PyTorch by request only: its fresh workers outgrow the profile)",
                      activations="per-block"))
    if settings.batch % (2 * settings.microbatches) == 0:
        smaller = dataclasses.replace(settings, microbatches=2 * settings.microbatches)
        try:
            out.append(_lever(pricer, f"--microbatches {smaller.microbatches}", requested, smaller,
                              f"micro-batches of {settings.batch // smaller.microbatches} row(s) instead of "
                              f"{settings.batch // settings.microbatches}"))
        except InputFileError:  # profiles hold one shape
            rows = settings.batch // smaller.microbatches
            out.append(Lever(f"--microbatches {smaller.microbatches}", None, None,
                             f"not priced: the profiles were measured at micro-batches of "
                             f"{settings.batch // settings.microbatches} x {settings.seq}; re-profile at {rows} x "
                             f"{settings.seq} (`confidant profile --batch {rows} --seq {settings.seq}`) to price it"))
    else:
        out.append(Lever("--microbatches", None, None, f"--batch {settings.batch} has no smaller micro-batch of "
                                                       f"{settings.microbatches} x 2 equal parts"))
    if settings.optimizer == "adamw":
        out.append(_lever(pricer, "--optimizer sgd", requested, dataclasses.replace(settings, optimizer="sgd"),
                          "one optimizer state copy instead of two"))
    out.append(_more_devices(pricer, settings, requested))
    return out


def _more_devices(pricer: _Pricer, settings: EstimateSettings, requested: VariantEstimate) -> Lever:
    """The fewest copies of the largest-budget device that make the request fit (up to MAX_ADDED_DEVICES)."""
    if requested.fits:
        return Lever("more devices", 0, True, "not needed")
    if any(s.first_block == s.last_block and s.over_bytes for s in requested.stages):
        one = next(s for s in requested.stages if s.first_block == s.last_block and s.over_bytes)
        return Lever("more devices", None, False,
                     f"block {one.first_block} alone needs {mib(one.memory_bytes)} on {one.device!r}: more devices "
                     f"cannot split one block")
    for extra in range(1, MAX_ADDED_DEVICES + 1):
        after = pricer.estimate(settings, extra=extra)
        if after.fits:
            big = max((s for s in after.stages), key=lambda s: s.budget_bytes)
            name = big.device.split("+")[0]
            # the device's own budget (a stage's `budget_bytes` is what is left of it beside the reserve)
            return Lever(f"{extra} more device(s) like {name!r} ({mib(after.budgets[big.device])} each)",
                         requested.total_bytes - after.total_bytes, True,
                         "the model cut over " + ", ".join(f"{s.device} {mib(s.memory_bytes)}" for s in after.stages))
    return Lever("more devices", None, False, f"{MAX_ADDED_DEVICES} more devices like the largest still do not fit")


# --- printing ----------------------------------------------------------------------------------------

def estimate_lines(est: Estimate) -> list[str]:
    """The estimate as text: a table per training (MiB per device against its budget), the requested
    one's parts, then what would make it fit."""
    s = est.requested.settings
    lines = [f"{est.model}: batch {s.batch} = {s.microbatches} micro-batches of {s.batch // s.microbatches} x {s.seq} "
             f"tokens, {s.schedule}, {s.optimizer}; memory from {est.source}"]
    variants = (est.requested,) + est.alternatives
    names = _device_order(variants)
    header = ["training"] + names + ["total", "fits"]
    rows = [header, [""] + [f"budget {mib(_budget(variants, n))}" for n in names] + ["", ""]]
    for k, v in enumerate(variants):
        cells = {st.device: f"{mib(st.memory_bytes)} (blocks {st.first_block}-{st.last_block})" for st in v.stages}
        label = ("requested: " if k == 0 else "") + v.settings.label
        rows.append([label] + [cells.get(n, "-") for n in names] + [mib(v.total_bytes), "yes" if v.fits else "NO"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    from planner.memory_defaults import PART_TITLES, PARTS

    lines.append(f"requested ({s.label}), by part (MiB):")
    for st in est.requested.stages:
        shown = [f"{PART_TITLES[p].split(' (')[0]} {st.parts[p] / MIB:.0f}" for p in PARTS if st.parts[p]]
        lines.append(f"  {st.device}{_choice_text(est.requested.choices.get(st.device))}: " + ", ".join(shown))
    if est.requested.fits:
        tight = est.requested.tightest
        lines.append(f"fits: tightest {tight.device!r} needs {mib(tight.memory_bytes)} of its "
                     f"{mib(tight.budget_bytes)} budget")
    else:
        tight = est.requested.tightest
        lines.append(f"does not fit: {tight.device!r} needs {mib(tight.memory_bytes)} of its "
                     f"{mib(tight.budget_bytes)} budget ({mib(tight.over_bytes)} over)")
    lines.append("what would make it fit (each a change to the request alone: the MiB it saves over all devices at "
                 "these cuts; whether it fits once the planner cuts again):")
    for lv in est.levers:
        saved = "" if lv.saves_bytes is None else (f"saves {mib(lv.saves_bytes)}" if lv.saves_bytes >= 0
                                                   else f"costs {mib(-lv.saves_bytes)}")
        verdict = "" if lv.fits is None else ("fits" if lv.fits else "still does not fit")
        lines.append("  - " + "; ".join(x for x in (lv.flag, saved, verdict, lv.note) if x))
    lines += [f"note: {n}" for n in est.notes]
    return lines


def _choice_text(choice: tuple[str | None, str | None] | None) -> str:
    """" (torch:cpu:t1, activations per-block)": the backend the planner picked (none where the
    cluster file fixed it) and what the device does with its activations (none: the engine's default)."""
    picked, activations = choice or (None, None)
    said = [x for x in (picked, None if activations is None else f"activations {activations}") if x]
    return f" ({', '.join(said)})" if said else ""


def _device_order(variants: Sequence[VariantEstimate]) -> list[str]:
    names: list[str] = []
    for v in variants:
        for n in [st.device for st in v.stages] + list(v.idle):
            if n not in names:
                names.append(n)
    return names


def _budget(variants: Sequence[VariantEstimate], name: str) -> int:
    return next((v.budgets[name] for v in variants if name in v.budgets), 0)


def estimate_json(est: Estimate) -> dict:
    """The estimate as one JSON object (bytes and MiB)."""
    def variant(v: VariantEstimate) -> dict:
        return {"training": v.settings.label, "lora_rank": v.settings.lora.rank if v.settings.lora else None,
                "base_dtype": v.settings.base_dtype, "optimizer": v.settings.optimizer, "fits": v.fits,
                "devices": [{"name": st.device, "blocks": [st.first_block, st.last_block],
                             "memory_mib": round(st.memory_bytes / MIB, 1), "budget_mib": round(st.budget_bytes / MIB, 1),
                             "memory_bytes": st.memory_bytes, "budget_bytes": st.budget_bytes,
                             "parts_bytes": dict(st.parts)} for st in v.stages],
                "idle": list(v.idle)}

    return {"model": est.model, "source": est.source, "requested": variant(est.requested),
            "alternatives": [variant(v) for v in est.alternatives],
            "levers": [{"flag": lv.flag, "saves_mib": None if lv.saves_bytes is None else round(lv.saves_bytes / MIB, 1),
                        "fits": lv.fits, "note": lv.note} for lv in est.levers],
            "notes": list(est.notes)}


