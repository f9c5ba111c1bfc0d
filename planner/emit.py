"""Write a plan to disk: `plan.json` plus one bundle per device (see `ir.bundle` for the layout).

    out_dir/plan.json         the plan's index: model, schedule, batch/seq, devices in pipeline
                              order (blocks, memory, predicted time, address, bundle manifest hash),
                              predicted step time, partition method, every stage's action list
    out_dir/<device>/...      that device's bundle: IR slice, weights, actions, manifest

Every bundle is verified in memory before it is written and read back from disk afterwards; the
schedule is verified (`verify_plan`) before anything is written; plan.json goes last and records
each bundle's manifest hash, so `load_plan` notices a bundle left over from another plan.
Bundles hold IR slices and safetensors weights only, never the ONNX model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from ir.bundle import (MANIFEST, PLAN, PLAN_FORMAT, PLAN_SCHEMA_VERSION, BundleError, check_device_name,
                       check_plan_doc, load_bundle_dir, load_plan, sha256_hex, write_bundle)
from ir.graph import Graph
from ir.partition import Partition, StageCost
from ir.plan import Schedule
from ir.serialize import graph_to_json, slice_graph
from ir.verify import verify_plan

__all__ = ["CONFIG_DEFAULTS", "emit_plan", "load_plan"]

# What `config` may set, with defaults. `threads` and `engine` are one value for all devices or
# {device: value} (devices may run different frameworks: MNN on phones, PyTorch on laptops);
# `optimizer` is a name (with `lr`, `weight_decay`) or {"name", "lr", "weight_decay"};
# `addresses` maps device names to the worker addresses written into plan.json;
# `head_split` maps device names to {"heads": {backend: n}, "predicted_s": s, "single_best": [backend, s]}
# for devices whose attention heads are split across backends (others: no split).
CONFIG_DEFAULTS: dict[str, Any] = {
    "model": None, "engine": "mnn", "backend": "cpu", "threads": 1,
    "optimizer": "adamw", "lr": 5e-5, "weight_decay": None, "addresses": {}, "head_split": {},
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
    return {"model": cfg["model"] if cfg["model"] is not None else graph.name, "engines": engines,
            "engine": next(iter(set(engines.values()))) if len(set(engines.values())) == 1 else "mixed",
            "backend": cfg["backend"], "optimizer": opt, "threads": per_device, "addresses": addresses,
            "head_split": head_split}


def _split_heads(cfg: Mapping[str, Any], device: str) -> dict[str, int] | None:
    split = cfg["head_split"].get(device)
    return {str(b): int(h) for b, h in split["heads"].items()} if split else None


def _split_entry(cfg: Mapping[str, Any], device: str) -> dict[str, Any] | None:
    split = cfg["head_split"].get(device)
    if not split:
        return None
    best = split.get("single_best")
    return {"heads": _split_heads(cfg, device),
            "predicted_s": None if split.get("predicted_s") is None else float(split["predicted_s"]),
            "single_best": None if best is None else [str(best[0]), float(best[1])]}


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


def emit_plan(out_dir: str | Path, graph: Graph, partition: Partition, schedule: Schedule, config: Mapping[str, Any],
              costs: Sequence[StageCost] | None = None, predicted_step_s: float | None = None) -> Path:
    """Write plan.json and one verified bundle per device under `out_dir`; returns plan.json's path."""
    out_dir = Path(out_dir)
    _check_inputs(graph, partition, schedule, costs, predicted_step_s)
    devices = partition.devices
    cfg = _settings(config, devices, graph)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A plan.json that outlives a failed re-emit would describe bundles it does not match.
    (out_dir / PLAN).unlink(missing_ok=True)
    p = len(devices)
    entries = []
    for s, assignment in enumerate(partition.stages):
        part = slice_graph(graph, assignment.first_block, assignment.last_block)
        stage_doc = {
            "stage": s, "stages": p, "device": assignment.device,
            "blocks": [assignment.first_block, assignment.last_block],
            "peers": {"prev": devices[s - 1] if s > 0 else None, "next": devices[s + 1] if s < p - 1 else None},
            "schedule": schedule.name, "microbatches": schedule.microbatches, "update_every": schedule.update_every,
            "stash_depth": schedule.stash_depth[s], "engine": cfg["engines"][assignment.device],
            "backend": cfg["backend"],
            "threads": cfg["threads"][assignment.device], "optimizer": cfg["optimizer"],
            "batch": graph.batch, "seq": graph.seq,
            "head_split": _split_heads(cfg, assignment.device),
        }
        directory = write_bundle(out_dir / assignment.device, stage_doc, graph_to_json(part), part.constants,
                                 schedule.actions[s])
        load_bundle_dir(directory)  # read back from disk: what a device will receive
        entry = {
            "name": assignment.device, "stage": s, "blocks": [assignment.first_block, assignment.last_block],
            "memory_bytes": assignment.memory_bytes, "memory_budget_bytes": assignment.memory_budget_bytes,
            "predicted_time_s": assignment.predicted_time_s, "threads": cfg["threads"][assignment.device],
            "engine": cfg["engines"][assignment.device],
            "head_split": _split_entry(cfg, assignment.device),
            "bundle": assignment.device, "manifest_sha256": sha256_hex((directory / MANIFEST).read_bytes()),
        }
        if assignment.device in cfg["addresses"]:
            entry["address"] = cfg["addresses"][assignment.device]
        if costs is not None:
            c = costs[s]
            entry["cost"] = {"forward_s": c.forward_s, "backward_s": c.backward_s, "update_s": c.update_s,
                             "send_act_s": c.send_act_s, "send_grad_s": c.send_grad_s}
        entries.append(entry)
    doc = {
        "schema_version": PLAN_SCHEMA_VERSION, "format": PLAN_FORMAT, "model": cfg["model"], "graph": graph.name,
        "schedule": schedule.name, "stages": p, "microbatches": schedule.microbatches,
        "update_every": schedule.update_every, "stash_depth": list(schedule.stash_depth),
        "batch": graph.batch, "seq": graph.seq, "blocks": [b.name for b in graph.blocks],
        "engine": cfg["engine"], "backend": cfg["backend"], "optimizer": cfg["optimizer"],
        "devices": entries, "predicted_step_s": predicted_step_s,
        "partition_method": partition.method, "partition_optimal": partition.optimal,
        "bottleneck_s": partition.bottleneck_s,
        "actions": [[str(a) for a in row] for row in schedule.actions],
    }
    check_plan_doc(doc, str(out_dir))
    path = out_dir / PLAN
    tmp = out_dir / f".{PLAN}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    load_plan(out_dir)
    return path
