"""`confidant profile`: measure this device for the planner (block times per backend, memory, attention
by heads) and write its profile, or measure a link to a peer."""
from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import Callable, Sequence

import runtime.profiling as prof
from ir.profile import DeviceProfile, Link
from jobs.common.lora import load_adapted
from jobs.common.report import Reporter, Silent
from planner.lora import LoraSettings


def profile_this_device(model: Path, batch: int, seq: int, output: Path | None = None, name: str | None = None,
                        backends: Sequence[str] | None = None, memory_bytes: int | None = None, reps: int = 3,
                        attention: bool = True, lora: LoraSettings | None = None,
                        reporter: Reporter = Silent(), fresh: bool = True) -> tuple[DeviceProfile, Path]:
    """Profile this device at (`batch` rows, `seq` tokens) for `model` (with LoRA adapters when
    `lora` is given: a LoRA plan needs its blocks profiled) and save it; (profile, file). `fresh`:
    as `runtime.profiling.profile_device` takes it. A LoRA base held below float32 is read from a
    mapping of a float32 file (`jobs.common.lora.read_mapped`): read into memory first, the file stood
    beside the quantized base, and a device profiling SmolLM2 int4 peaked at ~700 MiB (helper h76). The
    fresh children that measure stages are handed a copy written out (`runtime.profiling.fresh`), never
    the mapping."""
    graph = load_adapted(model, batch, seq, lora, reporter)
    name = name or socket.gethostname()
    profile = prof.profile_device(graph, name, backends=tuple(backends) if backends else prof.DEFAULT_BACKENDS,
                                  reps=reps, memory_bytes=memory_bytes, attention=attention, progress=reporter.note,
                                  fresh=fresh)
    profile = dataclasses.replace(profile, model=Path(model).name)
    output = Path(output) if output else Path(f"{name}.profile.json")
    profile.save(output)
    return profile, output


def measure_link_to(address: str, output: Path | None = None) -> Link:
    """Bandwidth and latency to a peer running `confidant profile --serve-link`, saved to `output`."""
    link = prof.measure_link(address)
    if output:
        Path(output).write_text(json.dumps({"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                                            "latency_s": link.latency_s}, indent=1))
    return link


def serve_link_probes(listen: str, ready: Callable[[str], None]) -> None:
    """Answer link probes from peers until interrupted; `ready` hears the bound address."""
    prof.link_probe_server(listen, sessions=None, ready=ready)
