"""Plans written by `confidant plan` for MiniLM and a SmolLM2 LoRA run, reduced to what must not change
when the planner is reorganised: plan.json and every bundle's manifest (which hashes the bundle's
graph, weights, actions and stage document).

    python tools/plan_snapshot.py MINILM.onnx SMOLLM2.onnx WORK_DIR > before.json
    ... change the planner ...
    python tools/plan_snapshot.py MINILM.onnx SMOLLM2.onnx WORK_DIR > after.json
    diff before.json after.json      # no output: the plans are identical

The clusters are made here from profiles derived from the graphs' shapes (`planner.memory_defaults`),
on two backends with different speeds per block kind and with attention curves on one device, so
that the plans exercise the engine search (a device's engine picked for its blocks), keeping or
recomputing activations, a head split, and for MiniLM manual cuts as well as the solver. Unsigned
(--insecure) so that the bytes do not depend on a key, and with PYTHONHASHSEED=0: the order of the
values in a bundle's graph.json follows a set's (ir.serialize.slice_graph), so it changes from run to run."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from ir.graph import block_signature
from ir.profile import AttentionCurve, BackendProfile, DeviceProfile
from planner.memory_defaults import default_profile
from planner.onnx_import import load_model

MIB = 2 ** 20


def _profile(graph, name: str, torch_factor: float, head_factor: float, curves: bool) -> DeviceProfile:
    """mnn:cpu:t1 as the shapes say, mnn:cpu:t2 at 0.6x, torch:cpu:t2 at `torch_factor` x (its
    head and loss at `head_factor` x), torch's import priced at 250 MiB; with `curves`, attention
    curves on mnn:cpu:t1 and torch:cpu:t1 that make splitting the heads pay."""
    base = default_profile(graph, name, memory_available_bytes=8 << 30, backend="mnn:cpu:t1").backends[0]
    head_sigs = {block_signature(b) for b in graph.blocks if b.kind not in ("encoder", "decoder", "embeddings")}

    def scaled(backend: str, factor: float, head: float, overhead: int = 0) -> BackendProfile:
        blocks = {s: dataclasses.replace(c, forward_s=c.forward_s * (head if s in head_sigs else factor),
                                         backward_s=c.backward_s * (head if s in head_sigs else factor),
                                         recompute_s=c.recompute_s * (head if s in head_sigs else factor))
                  for s, c in base.blocks.items()}
        return BackendProfile(backend, blocks, {}, overhead)

    backends = [scaled("mnn:cpu:t1", 1.0, 1.0), scaled("mnn:cpu:t2", 0.6, 0.6),
                scaled("torch:cpu:t2", torch_factor, head_factor, 250 * MIB)]
    site = next((b for b in graph.blocks if b.attention is not None), None)
    if curves and site is not None:  # (LoRA-adapted blocks have no attention site to split)
        # a split device runs its non-attention work on MNN: on mnn:cpu:t1, its only MNN backend here
        sig, units = block_signature(site), site.split_units
        attention = (base.blocks[sig].forward_s + base.blocks[sig].backward_s) * 0.8

        def curve(f):
            return {sig: AttentionCurve(tuple(attention * f * h / units + 1e-4 for h in range(1, units + 1)))}

        backends = [dataclasses.replace(backends[0], attention=curve(1.0)), backends[2],
                    BackendProfile("torch:cpu:t1", dict(base.blocks), curve(1.1), 250 * MIB)]
    return dataclasses.replace(default_profile(graph, name, 8 << 30), backends=tuple(backends))


def _cluster(graph, folder: Path, budgets: dict[str, str], factors: dict[str, tuple[float, float, bool]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    devices = []
    for i, (name, budget) in enumerate(budgets.items()):
        _profile(graph, name, *factors[name]).save(folder / f"{name}.json")
        devices.append({"name": name, "address": f"tcp://127.0.0.1:{5600 + i}", "profile": f"{name}.json",
                        "memory_budget": budget})
    (folder / "cluster.json").write_text(json.dumps({"devices": devices, "links": {
        "default": {"bandwidth": "1GB/s", "latency": "0.1ms"}}}))
    return folder / "cluster.json"


def _plan(model: Path, cluster: Path, out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, "-m", "confidant", "plan", str(model), "--cluster", str(cluster), "-o", str(out),
                    "--force", "--insecure", *args], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONHASHSEED": "0"})
    plan = json.loads((out / "plan.json").read_text())
    manifests = {}
    for d in plan["devices"]:
        manifest = (out / d["bundle"] / "manifest.json").read_bytes()
        manifests[d["name"]] = {"sha256": hashlib.sha256(manifest).hexdigest(), "manifest": json.loads(manifest)}
    return {"plan": plan, "manifests": manifests}


def main(minilm: Path, smollm2: Path, work: Path) -> dict:
    out = {}
    seq, batch, m = 32, 8, 2
    graph = load_model(minilm, batch // m, seq)
    cluster = _cluster(graph, work / "minilm", {"a": "2GiB", "b": "1GiB", "c": "600MiB"},
                       {"a": (0.9, 0.3, True), "b": (0.5, 0.5, False), "c": (1.5, 1.2, False)})
    common = ("--batch", str(batch), "--seq", str(seq), "--microbatches", str(m), "--time-limit", "20")
    out["minilm-solver"] = _plan(minilm, cluster, work / "minilm" / "plan", *common)
    out["minilm-cuts"] = _plan(minilm, cluster, work / "minilm" / "plan-cuts", *common, "--cuts", "3,6",
                               "--devices", "c,b,a", "--lr", "2e-4")
    out["minilm-stash"] = _plan(minilm, cluster, work / "minilm" / "plan-stash", *common, "--schedule", "1f1b-stash",
                                "--optimizer", "sgd")

    from jobs.common.lora import adapted
    from planner.lora import LoraSettings

    seq, batch, m = 32, 4, 2
    lm = adapted(load_model(smollm2, batch // m, seq), LoraSettings(8))
    cluster = _cluster(lm, work / "smollm2", {"a": "3GiB", "b": "2GiB"},
                       {"a": (0.7, 0.2, True), "b": (0.9, 0.9, False)})
    out["smollm2-lora"] = _plan(smollm2, cluster, work / "smollm2" / "plan", "--batch", str(batch), "--seq", str(seq),
                                "--microbatches", str(m), "--lora", "8", "--time-limit", "30")
    return out


if __name__ == "__main__":
    json.dump(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])), sys.stdout, indent=1, sort_keys=True)
    print()
