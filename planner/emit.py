"""Write a plan to disk: `plan.json` plus one bundle per device (see `ir.bundle` for the layout).

    out_dir/plan.json         the plan's index: model, schedule, batch/seq, devices in pipeline
                              order (blocks, memory, predicted time, address, bundle manifest hash),
                              predicted step time, partition method, every stage's action list
    out_dir/<device>/...      that device's bundle: IR slice, weights, actions, manifest
    out_dir/cluster.json      (when the cluster is given) the cluster the plan was made for, every
                              device's profile embedded: what re-planning during training starts
                              from, so a plan folder is all a re-plan needs (`load_plan_cluster`)

Every bundle is verified in memory before it is written and read back from disk afterwards; the
schedule is verified (`verify_plan`) before anything is written; plan.json goes last and records
each bundle's manifest hash (and cluster.json's), so `load_plan` notices a bundle or cluster left
over from another plan.
Bundles hold IR slices and safetensors weights only, never the ONNX model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ir.bundle import (MANIFEST, WEIGHTS, BundleContents, LoadedPlan, schedule_of_bundles, PLAN, PLAN_BASE, PLAN_CLUSTER, BundleError, base_weights, build_bundle_files,
                       check_device_name, load_bundle_dir, load_plan, plan_identity, sha256_hex, verify_bundle_files,
                       write_bundle_files)
from ir.documents import (ACTIVATION_CHOICES, valid_activations, DevicePlan, OptimizerSettings, PlanDocument, PlannedCost, PlannedHeadSplit, PlannedLora,
                          StageDocument, SteadyStage)
from ir.graph import Graph
from ir.partition import Partition, StageCost
from ir.plan import DEFAULT_LR, FAILURE_POLICIES, Schedule
from ir.precision import base_dtype_of
from ir.profile import DeviceProfile, Link
from ir.safetensors import encode_safetensors, hash_tensors
from ir.serialize import graph_to_json, slice_graph, stored_constants
from ir.versioned import check_header
from ir.verify import verify_plan
from planner.cluster import Cluster, ClusterError, DeviceSpec
from planner.cost import stage_memory_terms
from planner.onnx_weights import check_mapped_files, drop_mapped_pages

__all__ = ["CONFIG_DEFAULTS", "EmittedPlan", "emit_in_memory", "emit_plan", "load_plan", "load_plan_cluster", "cluster_to_json", "cluster_from_json"]

# What `config` may set, with defaults. `threads` and `engine` are one value for all devices or
# {device: value} (devices may run different frameworks: MNN on phones, PyTorch on laptops);
# `optimizer` is a name (with `lr`, `weight_decay`) or {"name", "lr", "weight_decay"};
# `model_path` is the ONNX file planned (absolute; recorded in plan.json for the checkpoints of `train`);
# `lora` the LoRA settings the graph was adapted with ({"rank", "alpha", "targets", "train_also", "seed"},
# recorded in plan.json for the same checkpoints; None: full fine-tuning);
# `addresses` maps device names to the worker addresses written into plan.json;
# `head_split` maps device names to {"heads": {backend: n}, "predicted_s": s, "single_best": [backend, s]}
# for devices whose attention heads are split across backends (others: no split);
# `activations` maps device names to "keep" or "recompute" (what the engine does with the
# activations of the micro-batches in flight; devices not named: the engine's default);
# `on_failure` the fault policy the job left memory for (`ir.plan.FAILURE_POLICIES`; recorded in plan.json).
CONFIG_DEFAULTS: dict[str, Any] = {
    "model": None, "model_path": None, "lora": None, "engine": "mnn", "backend": "cpu", "threads": 1,
    "optimizer": "adamw", "lr": DEFAULT_LR, "weight_decay": None, "addresses": {}, "head_split": {}, "activations": {},
    "on_failure": "replan",
}


def _settings(config: Mapping[str, Any], devices: Sequence[str], graph: Graph) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"emit_plan: unknown config key(s) {', '.join(unknown)}; known: {', '.join(CONFIG_DEFAULTS)}")
    cfg = {**CONFIG_DEFAULTS, **config}
    opt = cfg["optimizer"]
    if isinstance(opt, Mapping):
        if "lr" in config or "weight_decay" in config:
            raise ValueError("emit_plan: give lr and weight_decay inside config['optimizer'] or beside it, not both")
        opt = {"name": opt.get("name"), "lr": opt.get("lr", cfg["lr"]), "weight_decay": opt.get("weight_decay")}
    else:
        opt = {"name": opt, "lr": cfg["lr"], "weight_decay": cfg["weight_decay"]}
    threads = cfg["threads"]
    per_device = dict(threads) if isinstance(threads, Mapping) else {d: threads for d in devices}
    if set(per_device) != set(devices):
        raise ValueError(f"emit_plan: config['threads'] names devices {sorted(per_device)}, "
                         f"the plan has {list(devices)}")
    addresses = dict(cfg["addresses"])
    stray = sorted(set(addresses) - set(devices))
    if stray:
        raise ValueError(f"emit_plan: config['addresses'] names {stray}, which are not devices of this plan "
                         f"({list(devices)})")
    head_split = {d: dict(v) for d, v in dict(cfg["head_split"] or {}).items() if v is not None}
    stray = sorted(set(head_split) - set(devices))
    if stray:
        raise ValueError(f"emit_plan: config['head_split'] names {stray}, which are not devices of this plan "
                         f"({list(devices)})")
    for d, v in head_split.items():
        heads = v.get("heads")
        if (not isinstance(heads, Mapping) or not heads
                or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in heads.values())):
            raise ValueError(f"emit_plan: config['head_split'][{d!r}]['heads'] is {heads!r}, "
                             f"not {{backend: heads >= 1}}")
    engine = cfg["engine"]
    engines = dict(engine) if isinstance(engine, Mapping) else {d: engine for d in devices}
    if set(engines) != set(devices):
        raise ValueError(f"emit_plan: config['engine'] names devices {sorted(engines)}, the plan has {list(devices)}")
    activations = dict(cfg["activations"] or {})
    stray = sorted(set(activations) - set(devices))
    if stray:
        raise ValueError(f"emit_plan: config['activations'] names {stray}, which are not devices of this plan "
                         f"({list(devices)})")
    if cfg["on_failure"] not in FAILURE_POLICIES:
        raise ValueError(f"emit_plan: config['on_failure'] is {cfg['on_failure']!r}, not one of "
                         f"{', '.join(FAILURE_POLICIES)}")
    bad = {d: a for d, a in activations.items() if a is None or not valid_activations(a)}
    if bad:
        raise ValueError(f"emit_plan: config['activations'] is {bad}; each is one of {', '.join(ACTIVATION_CHOICES)}")
    return {"activations": activations, "model": cfg["model"] if cfg["model"] is not None else graph.name, "engines": engines,
            "engine": next(iter(set(engines.values()))) if len(set(engines.values())) == 1 else "mixed",
            "backend": cfg["backend"], "optimizer": opt, "threads": per_device, "addresses": addresses,
            "head_split": head_split, "model_path": cfg["model_path"], "on_failure": cfg["on_failure"],
            "lora": None if cfg["lora"] is None else PlannedLora.from_json(
                {**cfg["lora"], "targets": list(cfg["lora"]["targets"]), "train_also": list(cfg["lora"]["train_also"])},
                lambda what: ValueError(f"emit_plan: config['lora']: {what}"))}


def _split_heads(cfg: Mapping[str, Any], device: str) -> dict[str, int] | None:
    split = cfg["head_split"].get(device)
    return {str(b): int(h) for b, h in split["heads"].items()} if split else None


def _planned_split(cfg: Mapping[str, Any], device: str) -> PlannedHeadSplit | None:
    split = cfg["head_split"].get(device)
    if not split:
        return None
    best = split.get("single_best")
    return PlannedHeadSplit(_split_heads(cfg, device),
                            None if split.get("predicted_s") is None else float(split["predicted_s"]),
                            None if best is None else (str(best[0]), float(best[1])))


def _check_inputs(graph: Graph, partition: Partition, schedule: Schedule, costs, predicted_step_s) -> None:
    stages = partition.stages
    if not stages:
        raise ValueError("emit_plan: the partition has no stages")
    if schedule.stages != len(stages):
        raise ValueError(f"emit_plan: the schedule has {schedule.stages} stages, the partition {len(stages)}")
    if graph.batch < 1 or graph.seq < 1:
        raise ValueError(f"emit_plan: the graph is not bound to a batch and sequence length "
                         f"(batch={graph.batch}, seq={graph.seq}); lower it with load_model(path, batch, seq)")
    seen: dict[str, str] = {}
    expect = 0
    for i, s in enumerate(stages):
        check_device_name(s.device)
        if s.device.lower() in seen:
            raise BundleError(f"device name {s.device!r} is used twice (as {seen[s.device.lower()]!r}); bundle "
                              f"directories must differ even on case-insensitive file systems")
        seen[s.device.lower()] = s.device
        if s.stage != i:
            raise ValueError(f"emit_plan: partition stage {i} says stage={s.stage}; stages must be in pipeline order")
        if s.first_block != expect or not s.first_block <= s.last_block < len(graph.blocks):
            raise ValueError(f"emit_plan: stage {i} ({s.device}) runs blocks {s.first_block}..{s.last_block}; "
                             f"expected a range starting at block {expect} within the model's "
                             f"{len(graph.blocks)} blocks")
        expect = s.last_block + 1
    if expect != len(graph.blocks):
        raise ValueError(f"emit_plan: the stages cover blocks 0..{expect - 1}, the model has {len(graph.blocks)}")
    if costs is not None:
        if len(costs) != len(stages) or any((c.stage, c.device) != (s.stage, s.device) for c, s in zip(costs, stages)):
            raise ValueError("emit_plan: costs must list one StageCost per stage, in stage order, for the same devices")
    if predicted_step_s is not None and not (math.isfinite(predicted_step_s) and predicted_step_s >= 0):
        raise ValueError(f"emit_plan: predicted_step_s is {predicted_step_s!r}, not a non-negative number")
    verify_plan(schedule)


def _steady_of(schedule: Schedule, stage: int) -> SteadyStage | None:
    """Stage `stage`'s part of an asynchronous schedule's steady state (None for flush schedules),
    so that its bundle alone runs any number of steps without a flush."""
    if schedule.flushes or schedule.steady is None:  # none: such a plan trains one step only (the run says so)
        return None
    return SteadyStage(schedule.steady.drain_at[stage], tuple(str(a) for a in schedule.steady.actions[stage]))


def _memory_terms(graph: Graph, cluster: Cluster | None, assignment, stage: int, stages: int, schedule: Schedule,
                  optimizer: str) -> dict[str, int] | None:
    """The memory model's terms of a stage's planned bytes (`show` prints them); a planned figure the
    terms do not make up (a partition costed elsewhere) shows its difference as `other`. None without
    the cluster the plan was made for."""
    if cluster is None or assignment.device not in {d.name for d in cluster.devices}:
        return None
    terms = stage_memory_terms(graph, cluster.device(assignment.device), assignment.first_block,
                               assignment.last_block, stage, stages, schedule.name, schedule.microbatches, optimizer,
                               schedule.update_every)
    out = terms.by_name()
    if terms.total != assignment.memory_bytes:
        out["other"] = assignment.memory_bytes - terms.total
    return out


@dataclass(frozen=True)
class EmittedPlan:
    """A plan in memory, as `emit_plan` writes it: plan.json's document, each device's bundle files
    (file name -> bytes, verified), and the bytes of cluster.json and of the base weights file (None
    when the plan has none). `train-pipeline` runs such a plan without writing it (issue 34)."""

    plan: PlanDocument
    bundles: dict[str, dict[str, bytes]]
    cluster_json: bytes | None = None
    base: bytes | None = None
    contents: dict[str, BundleContents] = field(default_factory=dict)  # each bundle as verified, parsed

    def loaded(self) -> LoadedPlan:
        """The plan as `ir.bundle.LoadedPlan` (no folder): what a run ships, verified once here."""
        devices = self.plan.device_names
        contents = [self.contents[d] for d in devices]
        return LoadedPlan(None, self.plan, tuple(self.bundles[d] for d in devices), tuple(contents),
                          schedule_of_bundles(contents))


def emit_plan(out_dir: str | Path, graph: Graph, partition: Partition, schedule: Schedule, config: Mapping[str, Any],
              costs: Sequence[StageCost] | None = None, predicted_step_s: float | None = None,
              cluster: Cluster | None = None, sign=None) -> Path:
    """Write plan.json and one verified bundle per device under `out_dir`, and cluster.json when
    `cluster` (the devices the plan was made for) is given; returns plan.json's path. `sign`
    (bytes -> signature file bytes; `runtime.keys.signer` of the coordinator's key, passed in by
    the job) signs every bundle's manifest, which workers then require (ir.bundle)."""
    out_dir = Path(out_dir)
    emitted = emit_in_memory(graph, partition, schedule, config, costs, predicted_step_s, cluster, sign,
                             source=str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    # A plan.json that outlives a failed re-emit would describe bundles it does not match, and a
    # cluster.json of an older plan would be taken for this one's.
    (out_dir / PLAN).unlink(missing_ok=True)
    (out_dir / PLAN_CLUSTER).unlink(missing_ok=True)
    (out_dir / PLAN_BASE).unlink(missing_ok=True)
    for device, files in emitted.bundles.items():
        directory = write_bundle_files(out_dir / device, files)
        load_bundle_dir(directory)  # read back from disk: what a device will receive
    if emitted.cluster_json is not None:
        (out_dir / PLAN_CLUSTER).write_bytes(emitted.cluster_json)
    if emitted.base is not None:  # written once per plan, any cut: a device holding a copy serves every re-plan too
        tmp = out_dir / f".{PLAN_BASE}.tmp"
        tmp.write_bytes(emitted.base)
        tmp.replace(out_dir / PLAN_BASE)
    path = out_dir / PLAN
    tmp = out_dir / f".{PLAN}.tmp"
    tmp.write_text(json.dumps(emitted.plan.to_json(), indent=1) + "\n")
    tmp.replace(path)
    load_plan(out_dir)
    return path


def emit_in_memory(graph: Graph, partition: Partition, schedule: Schedule, config: Mapping[str, Any],
                   costs: Sequence[StageCost] | None = None, predicted_step_s: float | None = None,
                   cluster: Cluster | None = None, sign=None, source: str = "<memory>",
                   with_base: bool = True, deferred: bool = False) -> EmittedPlan:
    """The plan `emit_plan` writes, in memory: every bundle built and verified, the schedule
    verified, plan.json's document checked as a reader would; nothing touches the disk.
    `with_base` False leaves out the base weights file (a plan run from memory ships whole bundles:
    no device holds a copy of a file that was never written). `deferred`: each bundle's weights
    file stays its tensors with their SHA-256 (`ir.safetensors.HashedTensors`), its bytes made
    when it is shipped, one stage at a time (`runtime.pipeline.bundles.send_bundle`), so the
    plan's bundles never lie in memory together as bytes."""
    _check_inputs(graph, partition, schedule, costs, predicted_step_s)
    devices = partition.devices
    cfg = _settings(config, devices, graph)
    cluster_doc = _cluster_for(cluster, devices)
    p = len(devices)
    optimizer = OptimizerSettings(str(cfg["optimizer"]["name"]), float(cfg["optimizer"]["lr"]),
                                  cfg["optimizer"]["weight_decay"])
    entries = []
    stage_docs = [StageDocument(
        s, p, a.device, a.first_block, a.last_block,
        devices[s - 1] if s > 0 else None, devices[s + 1] if s < p - 1 else None,
        schedule.name, schedule.microbatches, schedule.update_every, schedule.stash_depth[s],
        cfg["engines"][a.device], cfg["backend"], cfg["threads"][a.device], optimizer, graph.batch, graph.seq,
        _split_heads(cfg, a.device), cfg["activations"].get(a.device), _steady_of(schedule, s))
        for s, a in enumerate(partition.stages)]
    # weights mapped from the model file are read from it again here (a re-plan after a loss among
    # them): a file rewritten since it was mapped is one error naming it, not SIGBUS or other weights
    check_mapped_files(graph.constants.values())
    # each stage's weights hashed once, as the file they make (ir.safetensors.hash_tensors): the
    # digests name the plan (so they are needed before any manifest) and go into the manifests as
    # they are, so a bundle's weights are never hashed again here (issue 32: a 540 MB plan hashed
    # four times cost seconds of every recovery). Weights mapped from the model file
    # (planner.onnx_weights.map_raw) are resident only while read: given back after each stage's
    # hash and after its bundle, so emitting holds the bundles' bytes and one stage's weights, not
    # the model's weights besides.
    parts, hashed = [], []
    for assignment in partition.stages:
        part = slice_graph(graph, assignment.first_block, assignment.last_block)
        # quantized frozen weights go as their storage arrays, never widened (ir.precision)
        hashed.append(hash_tensors(stored_constants(part.constants)))
        drop_mapped_pages(part.constants.values())
        parts.append(part)
    # every bundle's signed manifest names it: a bundle of another plan is refused in this one's folder
    plan_id = plan_identity({"model": cfg["model"], "graph": graph.name, "stages": [d.to_json() for d in stage_docs],
                             "actions": [[str(a) for a in row] for row in schedule.actions]}, [h.sha256 for h in hashed])
    drop_mapped_pages(graph.constants.values())
    bundles, contents = {}, {}
    for s, (assignment, stage_doc, part) in enumerate(zip(partition.stages, stage_docs, parts)):
        device = assignment.device
        where = f"{source}/{device}"
        files = build_bundle_files(stage_doc, graph_to_json(part, stored=True), hashed[s], schedule.actions[s],
                                   source=where, sign=sign, plan_id=plan_id)
        # parsed from the tensors themselves (no second copy), their digests carried (CheckedFiles),
        # not computed again
        contents[device] = verify_bundle_files(files, where, copy=False)
        if not deferred:  # the weights file's bytes now; deferred: when shipped (runtime.pipeline.bundles)
            files[WEIGHTS] = encode_safetensors(hashed[s].tensors)
        bundles[device] = files
        drop_mapped_pages(part.constants.values())
        c = costs[s] if costs is not None else None
        blocks = graph.blocks[assignment.first_block:assignment.last_block + 1]
        # a priced partition's budget is what the plan may charge (planner.cluster.DeviceSpec.plannable_bytes):
        # plan.json records the device's own budget and, beside it, what the job reserved of it
        reserved = 0
        if cluster_doc is not None and assignment.memory_budget_bytes > 0:
            reserved = cluster.device(device).reserved_bytes
        entries.append(DevicePlan(
            device, s, assignment.first_block, assignment.last_block, assignment.memory_bytes,
            assignment.memory_budget_bytes + reserved, assignment.predicted_time_s, device,
            sha256_hex(files[MANIFEST]), cfg["threads"][device], cfg["engines"][device],
            _planned_split(cfg, device), cfg["addresses"].get(device),
            None if c is None else PlannedCost(c.forward_s, c.backward_s, c.update_s, c.send_act_s, c.send_grad_s,
                                            c.weight_grad_s),
            sum(b.params_bytes for b in blocks), sum(b.frozen_bytes for b in blocks), cfg["activations"].get(device),
            _memory_terms(graph, cluster, assignment, s, p, schedule, optimizer.name), reserved))
    cluster_json = cluster_sha256 = None
    if cluster_doc is not None:
        cluster_json = (json.dumps(cluster_doc, indent=1, allow_nan=False) + "\n").encode("utf-8")
        cluster_sha256 = sha256_hex(cluster_json)
    base_data = base_sha256 = None
    base = base_weights(graph) if with_base else None
    if base:
        base_data = encode_safetensors(base)
        base_sha256 = sha256_hex(base_data)
        drop_mapped_pages(base.values())
    plan = PlanDocument(cfg["model"], schedule.name, schedule.microbatches, schedule.update_every,
                        schedule.stash_depth, graph.batch, graph.seq, tuple(b.name for b in graph.blocks),
                        cfg["engine"], cfg["backend"], optimizer, tuple(entries), predicted_step_s, partition.method,
                        tuple(tuple(str(a) for a in row) for row in schedule.actions), graph.name, partition.optimal,
                        partition.bottleneck_s, cluster_sha256, base_sha256, dict(graph.lookup_rows),
                        cfg["model_path"], cfg["lora"], _base_dtype(graph), plan_id, graph.target_positions,
                        cfg["on_failure"])
    PlanDocument.from_json(plan.to_json(), source)  # what a reader will check, before anything is written
    return EmittedPlan(plan, bundles, cluster_json, base_data, contents)


# --- the cluster beside the plan ----------------------------------------------------------------
# One self-contained JSON file (profiles embedded, sizes in bytes, times in seconds) rather than a
# copy of the user's cluster file and its profile files: the plan folder must not depend on files
# that may change after planning, and one file is one hash in plan.json.

CLUSTER_SCHEMA_VERSION = 1
CLUSTER_FORMAT = "confidant-cluster"


def _link_to_json(link: Link) -> dict[str, Any]:
    # an unlimited link (a one-device cluster's default) has no JSON number: null
    bandwidth = link.bandwidth_bytes_per_s
    return {"bandwidth_bytes_per_s": None if math.isinf(bandwidth) else bandwidth, "latency_s": link.latency_s}


def _link_from_json(doc: Any, where: str) -> Link:
    if not isinstance(doc, Mapping) or sorted(doc) != ["bandwidth_bytes_per_s", "latency_s"]:
        raise ClusterError(f"{where}: expected {{bandwidth_bytes_per_s, latency_s}}, got {doc!r}")
    bandwidth = math.inf if doc["bandwidth_bytes_per_s"] is None else float(doc["bandwidth_bytes_per_s"])
    latency = float(doc["latency_s"])
    if not bandwidth > 0 or not (math.isfinite(latency) and latency >= 0):
        raise ClusterError(f"{where}: bandwidth must be > 0 and latency a finite number >= 0, got {doc!r}")
    return Link(bandwidth, latency)


def cluster_to_json(cluster: Cluster) -> dict[str, Any]:
    """The cluster as one JSON document, each device's profile embedded."""
    return {
        "schema_version": CLUSTER_SCHEMA_VERSION, "format": CLUSTER_FORMAT,
        "devices": [{"name": d.name, "address": d.address, "memory_budget_bytes": d.memory_budget_bytes,
                     "backend": d.backend, **({"key": d.key} if d.key else {}),
                     **({"reserved_bytes": d.reserved_bytes} if d.reserved_bytes else {}),
                     "profile": d.profile.to_json()} for d in cluster.devices],
        "default_link": _link_to_json(cluster.default_link),
        "links": [{"between": list(pair), **_link_to_json(link)} for pair, link in sorted(cluster.links.items())],
    }


def cluster_from_json(doc: Any, source: str) -> Cluster:
    """`cluster_to_json`'s document back; ClusterError names `source` and what is wrong."""
    check_header(doc, format=CLUSTER_FORMAT, versions=CLUSTER_SCHEMA_VERSION, where=source,
                 redo="re-run `confidant plan` with this version", error=ClusterError)
    try:
        devices = tuple(DeviceSpec(str(d["name"]), str(d["address"]),
                                   DeviceProfile.from_json(d["profile"], f"{source}: device {d['name']!r}"),
                                   int(d["memory_budget_bytes"]), d["backend"], d.get("key"),
                                   reserved_bytes=int(d.get("reserved_bytes", 0)))
                        for d in doc["devices"])
        default = _link_from_json(doc["default_link"], f"{source}: default_link")
        links = {}
        for item in doc["links"]:
            a, b = item["between"]
            links[(a, b) if a <= b else (b, a)] = _link_from_json(
                {k: v for k, v in item.items() if k != "between"}, f"{source}: link between {a!r} and {b!r}")
    except ClusterError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterError(f"{source}: malformed cluster ({type(exc).__name__}: {exc})") from None
    cluster = Cluster(devices, default, links)
    for d in devices:
        if d.backend is not None:
            d.profile.backend(d.backend)  # KeyError naming the profile's backends when absent
    return cluster


def _cluster_for(cluster: Cluster | None, devices: Sequence[str]) -> dict[str, Any] | None:
    if cluster is None:
        return None
    missing = [d for d in devices if d not in cluster.names]
    if missing:
        raise ValueError(f"emit_plan: the plan places stages on {missing}, which the given cluster lacks "
                         f"(devices: {list(cluster.names)})")
    if PLAN_CLUSTER in {d.lower() for d in devices}:
        raise BundleError(f"device name {PLAN_CLUSTER!r} would hide the plan's cluster file; rename the device")
    return cluster_to_json(cluster)


def load_plan_cluster(plan_dir: str | Path) -> Cluster:
    """The cluster a plan was made for, from its cluster.json, after checking it is the one plan.json
    was written with. A plan written without one is a BundleError that says how to get one."""
    plan_dir = Path(plan_dir)
    plan = load_plan(plan_dir)  # checks cluster.json's hash when plan.json records one
    if plan.cluster_sha256 is None:
        raise BundleError(f"plan {plan_dir}: it has no {PLAN_CLUSTER} (written by `confidant plan` since it records "
                          f"the cluster); re-run `confidant plan`, or give the cluster file to re-plan with")
    source = str(plan_dir / PLAN_CLUSTER)
    try:
        doc = json.loads((plan_dir / PLAN_CLUSTER).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ClusterError(f"{source}: not JSON ({exc})") from None
    return cluster_from_json(doc, source)


def _base_dtype(graph) -> str:
    """The precision the plan's frozen weights are held at (`--base-dtype`)."""
    return base_dtype_of(graph.constants)
