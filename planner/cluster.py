"""The devices a plan may use and the links between them, read from a cluster file.

A cluster file (YAML, or JSON when its name ends in `.json`) lists each device with the address its
worker listens on, the profile `confidant profile` wrote for it (a path relative to the cluster
file), the memory the plan may use on it and, optionally, which profiled backend to run::

    devices:
      - {name: phone, address: "tcp://10.0.0.2:5555", profile: profiles/phone.json,
         memory_budget: 3GiB, backend: "mnn:cpu:t4"}
      - {name: laptop, address: "tcp://10.0.0.3:5555", profile: profiles/laptop.json,
         memory_budget: 1.5 GiB, key: "ed25519:3f9a...(64 hex digits)"}
    links:
      default: {bandwidth: 100Mbit/s, latency: 5ms}
      pairs:
        - {between: [phone, laptop], bandwidth: 12.5MB/s, latency: 200us}

Sizes, bandwidths and durations are plain numbers (bytes, bytes per second, seconds) or strings
with a unit (`parse_bytes`, `parse_bandwidth`, `parse_duration`). Everything is checked on load,
and every error names the file, the device or link, and the field.

Decisions (each is an error rather than a silent fix, because a wrong cluster file yields a plan
that fails on a device much later):
- `memory_budget` is required, and a budget above the profile's `memory_available_bytes` is an
  error: the profile measured what the device had free, and a plan built on more would be
  killed at run time. Lower the budget or re-profile the device.
- All profiles must be of the same model, batch and sequence length: block costs of different
  shapes cannot be compared, and block signatures of different models never match.
- `links` may be left out only for a one-device cluster (no boundary to cross).
- Unknown keys are errors, so a misspelt field is not silently ignored.
- `key` (optional) is the worker's public key, so the cluster file alone says whom to trust; a
  device without one is looked up as NAME.pub in the coordinator's --keys folder.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ir.address import AddressError, parse_address
from ir.documents import activations_mode
from ir.errors import InputFileError
from ir.profile import BackendProfile, DeviceProfile, Link

try:  # YAML is optional: JSON cluster files work without it
    import yaml as _yaml
except ImportError:  # pragma: no cover - depends on the environment
    _yaml = None


class ClusterError(InputFileError):
    """A cluster file that cannot be used; the message names file, device or link, and field (a
    bad input: the command line exits 2, as for any file that cannot be used)."""


# --- units -------------------------------------------------------------------------------------

_NUMBER = r"(?P<num>(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
_QUANTITY = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[A-Za-zµ/]*)\s*$")

_SIZE_UNITS = {"": 1, "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_BANDWIDTH_UNITS = {"": 1.0, "B/s": 1.0, "kB/s": 1e3, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9,
                    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
                    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8,
                    "bps": 1 / 8, "kbps": 1e3 / 8, "Kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8}
# durations divide (5ms = 5 / 1e3 s) so that "200us" is exactly 200e-6, not 200 * 1e-6
_DURATION_DIVISORS = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}

SIZE_EXAMPLES = "3GiB, 512MB, 1000000"
BANDWIDTH_EXAMPLES = "100Mbit/s, 12.5MB/s, 1Gbit/s, 12500000"
DURATION_EXAMPLES = "5ms, 200us, 0.01"


def _quantity(value: Any, units: Mapping[str, float], what: str, examples: str, divide: bool = False) -> float:
    """`value` (a number in the base unit, or a string with one of `units`) in the base unit;
    `divide`: the unit table holds divisors rather than multipliers."""
    bad = ValueError(f"{value!r} is not a {what} (examples: {examples})")
    if isinstance(value, bool) or value is None:
        raise bad
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise bad
        return value
    if not isinstance(value, str):
        raise bad
    match = _QUANTITY.match(value)
    if match is None or match["unit"] not in units:
        raise bad
    number, unit = float(match["num"]), units[match["unit"]]
    return number / unit if divide else number * unit


# A budget written without a unit below this is taken for a slip (512 meant 512 MiB), not bytes.
MIN_BARE_BUDGET_BYTES = 2 ** 20


def parse_bytes(value: Any) -> int:
    """Bytes from an int or a string such as "3GiB", "512MB", "1.5 GiB" or "1000000" (SI prefixes
    are powers of 1000, binary ones of 1024); rounds to whole bytes."""
    return int(round(_quantity(value, _SIZE_UNITS, "size", SIZE_EXAMPLES)))


def parse_bandwidth(value: Any) -> float:
    """Bytes per second from a number or a string such as "100Mbit/s", "12.5MB/s" or "1Gbps";
    must be more than zero."""
    out = _quantity(value, _BANDWIDTH_UNITS, "bandwidth", BANDWIDTH_EXAMPLES)
    if out <= 0:
        raise ValueError(f"{value!r} is not a bandwidth: it must be more than 0 (examples: {BANDWIDTH_EXAMPLES})")
    return float(out)


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as "5ms", "200us" or "0.5 s"."""
    return float(_quantity(value, _DURATION_DIVISORS, "duration", DURATION_EXAMPLES, divide=True))


def format_bytes(n: int) -> str:
    """`n` bytes with a binary unit for messages, e.g. "1.50 GiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# --- the cluster -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSpec:
    """One device of the cluster. `backend` names one of the profile's backends; None means auto:
    the fastest one whose engine fits the budget (`device_backend`)."""

    name: str
    address: str
    profile: DeviceProfile
    memory_budget_bytes: int
    backend: str | None = None
    # the worker's public key as `confidant keys` writes it in NAME.pub ('ed25519:<64 hex>'); None:
    # NAME.pub in the coordinator's --keys folder. Checked as a key where it is used (runtime.keys)
    key: str | None = None
    # an auto device's backend as the planner picked it for the blocks it runs (`planner.engines`);
    # never read from a cluster file, and `backend` (the file's choice) wins over it
    picked: str | None = None
    # the planner's choice of what the device's engine does with the activations of the micro-batches
    # in flight (`planner.cost.activations_of`): "keep" them until their backwards, or "recompute"
    # them there from the stashed inputs; None: the engine's default (PyTorch keeps, MNN recomputes)
    activations: str | None = None
    # bytes of the budget held back for what a run holds beside the plan's figure (the fault
    # policy's snapshot copies on their way on the workers: runtime.pipeline.snapshots, whose figure
    # the job passes in, `with_reserve`); the planner plans within `plannable_bytes`, and a plan
    # records both (ir.documents.DevicePlan.reserved_bytes). Never read from a cluster file.
    reserved_bytes: int = 0
    # the run reads the stage's float32 frozen weights from a read-only mapping of the model file and its
    # engine gives each block's pages back after use (PyTorch per block, `runtime.engines.pytorch`; MNN per
    # block streaming them through placeholder sets, `runtime.engines.mnn._FrozenStream`): charged a block's
    # or the sets' frozen bytes, not the stage's (`planner.cost.mapped_frozen_bytes`). Set by a job that maps
    # (train-local; `plan` and `estimate` for a float32 LoRA base, whose workers hold base.safetensors and view
    # a stage's frozen weights on a mapping of it: `jobs.common.lora.with_base_mapped`). Never read from a cluster file.
    # On PyTorch also a base the model file stores quantized (its codes, scales, offsets mapped:
    # `planner.cost.maps_stored_base`).
    frozen_mapped: bool = False

    @property
    def plannable_bytes(self) -> int:
        """What the plan may charge the device: its budget less what is reserved beside the plan."""
        return self.memory_budget_bytes - self.reserved_bytes


def device_backend(device: DeviceSpec) -> BackendProfile:
    """The backend `device` trains with: the cluster file's `backend`; else the planner's pick for
    the blocks the device runs (`picked`, `planner.engines.pick_engines`); else (auto, before any
    pick) the fastest one over the whole model whose engine fits the device's budget beside the
    runtime (PyTorch's import alone, some 200-300 MB, can exceed a small device's), and the fastest
    of all when none does (the plan then names the device that is over budget)."""
    if device.backend is not None:
        return device.profile.backend(device.backend)
    if device.picked is not None:
        return device.profile.backend(device.picked)
    ranked = sorted(device.profile.backends, key=lambda b: b.seconds)
    if not ranked:
        raise ValueError(f"profile of {device.profile.name!r} has no backends")
    base = device.profile.runtime_overhead_bytes
    return next((b for b in ranked if base + b.engine_overhead_bytes <= device.plannable_bytes), ranked[0])


def update_rate(device: DeviceSpec, optimizer: str) -> float:
    """Seconds per parameter byte of one `optimizer` step on the device: its backend's native
    kernel where the profile measured one (PyTorch's fused AdamW), else runtime.optim's numpy
    step; 0 for a profile that measured neither."""
    native = device_backend(device).update_s_per_param_byte
    if optimizer in native:
        return native[optimizer]
    return device.profile.update_s_per_param_byte.get(optimizer, 0.0)


def runtime_bytes(device: DeviceSpec) -> int:
    """What the device holds before any stage: the idle runtime and its backend's engine (its import
    and start-up), less the start-up's part that only a stage keeping per-op caches pays
    (`BackendProfile.caches_start_up_bytes`) where the device recomputes per block (its planned
    `activations`, "per-block" or "per-block+K": SmolLM2 int4 on MNN, 5.2 MiB of a 5.2 MiB start-up
    charged on every stage, which a fresh MNN worker's first per-block run never held). The one
    formula of the term: the cost model and the partition instance (`overhead_bytes`) call it."""
    return device.profile.runtime_overhead_bytes + start_up_bytes(device)


def setup_peak_bytes(device: DeviceSpec) -> int:
    """The least a stage on the device peaks at, whatever it holds: the idle runtime and its engine's
    import at that import's own peak (`BackendProfile.engine_setup_peak_bytes`; a worker imports its
    engine on its bare runtime before it reads its weights, `runtime.engines.single.import_engine`).
    Torch's import peaks ~48-54 MiB above where it settles: a bare worker's ~227 MiB against 209.6
    charged as held (runtime 205.1 + engine 4.5, Gemma-3-shaped profile; benchmarks/MEMORY_NOTES.md, h151).
    0 where the profile did not measure it (made before, or MNN): no floor, the charge of then."""
    peak = device_backend(device).engine_setup_peak_bytes
    return device.profile.runtime_overhead_bytes + peak if peak else 0


def start_up_bytes(device: DeviceSpec) -> int:
    """The engine's part of `runtime_bytes`: its import and start-up (`BackendProfile.
    engine_overhead_bytes`), less what only a stage keeping per-op caches pays where the device
    recomputes per block."""
    backend = device_backend(device)
    start_up = backend.engine_overhead_bytes
    if activations_mode(device.activations)[0] == "per-block":
        start_up -= min(backend.caches_start_up_bytes, start_up)
    return start_up


@dataclass(frozen=True)
class Cluster:
    """Devices in file order, and links: `links` holds the pairs the file names (keys sorted), every
    other pair uses `default_link`."""

    devices: tuple[DeviceSpec, ...]
    default_link: Link
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    # devices by name, for `device` and `link` (the planner asks for every pair of 64 devices per
    # instance: a scan of the names each time was a second of a 64-device plan)
    _by_name: Mapping[str, DeviceSpec] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {d.name: d for d in reversed(self.devices)})  # the first of a name
        # a pair given as (b, a) must not be silently missed by `link`, which looks up (a, b)
        canonical: dict[tuple[str, str], Link] = {}
        for (a, b), link in self.links.items():
            key = _pair(a, b)
            if key in canonical and canonical[key] != link:
                raise ValueError(f"links {a!r}-{b!r} given twice with different values: {canonical[key]} and {link}")
            canonical[key] = link
        object.__setattr__(self, "links", canonical)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def device(self, name: str) -> DeviceSpec:
        d = self._by_name.get(name)
        if d is not None:
            return d
        raise KeyError(f"no device {name!r} in the cluster (devices: {', '.join(self.names)})")

    def link(self, a: str, b: str) -> Link:
        """The link between devices a and b, in either order; the default link unless the file named the pair."""
        for n in (a, b):
            if n not in self._by_name:
                raise KeyError(f"no device {n!r} in the cluster (devices: {', '.join(self.names)})")
        if a == b:
            raise ValueError(f"device {a!r} needs no link to itself")
        return self.links.get(_pair(a, b), self.default_link)


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def with_reserve(cluster: Cluster, reserved_bytes: Mapping[str, int]) -> Cluster:
    """The cluster with each named device's `reserved_bytes` set (bytes of its budget the plan must
    leave free; the job says how many and for what); a device not named keeps its own."""
    unknown = sorted(set(reserved_bytes) - set(cluster.names))
    if unknown:
        raise KeyError(f"no device {unknown[0]!r} in the cluster (devices: {', '.join(cluster.names)})")
    if any(int(b) < 0 for b in reserved_bytes.values()):
        raise ValueError(f"a reserve is a number of bytes >= 0, not {reserved_bytes}")
    devices = tuple(replace(d, reserved_bytes=int(reserved_bytes[d.name])) if d.name in reserved_bytes else d
                    for d in cluster.devices)
    return Cluster(devices, cluster.default_link, cluster.links)


def charged_reserve(cluster: Cluster, devices) -> Cluster:
    """`cluster` as a plan over `devices` is charged: each device's reserve (the snapshot copies'
    working bytes, which go to a neighbour) where the plan spans several devices; none where it runs
    on one, which has no peer to copy to. `plan`, `estimate` and every re-plan charge by this."""
    if len(set(devices)) > 1 or not any(d.reserved_bytes for d in cluster.devices):
        return cluster
    return Cluster(tuple(replace(d, reserved_bytes=0) for d in cluster.devices), cluster.default_link, cluster.links)


# --- reading a cluster file --------------------------------------------------------------------

_TOP_KEYS = {"devices", "links"}
_DEVICE_KEYS = {"name", "address", "profile", "memory_budget", "backend", "key"}
_LINKS_KEYS = {"default", "pairs"}
_PUBLIC_KEY = re.compile(r"ed25519:[0-9a-f]{64}")
_LINK_KEYS = {"bandwidth", "latency"}
_PAIR_KEYS = {"between", "bandwidth", "latency"}


def load_cluster(path: str | Path, require_address: bool = True) -> Cluster:
    """Read and check a cluster file; profiles are read relative to the file's folder.
    `require_address` False: a device may leave out its address (`confidant estimate` connects to
    nothing), which is then `estimate://NAME`."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ClusterError(f"{source}: no such cluster file")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterError(f"{source}: not JSON ({exc})") from None
    else:
        if _yaml is None:
            raise ClusterError(f"{source}: reading YAML needs PyYAML (pip install pyyaml); "
                               f"or write the cluster file as JSON with a .json name")
        try:
            doc = _yaml.safe_load(text)
        except _yaml.YAMLError as exc:
            raise ClusterError(f"{source}: not YAML ({exc})") from None
    return cluster_from_document(doc, source, path.parent, require_address=require_address)


def cluster_from_document(doc: Any, source: str, base_dir: str | Path,
                          load_profile: Callable[[Path], DeviceProfile] = DeviceProfile.load,
                          require_address: bool = True) -> Cluster:
    """The cluster a parsed file describes; `source` names the file in messages."""
    if not isinstance(doc, Mapping):
        raise ClusterError(f"{source}: expected a mapping with 'devices' and 'links' at the top, got {type(doc).__name__}")
    _no_unknown_keys(doc, _TOP_KEYS, source, "")
    raw_devices = doc.get("devices")
    if not isinstance(raw_devices, list) or not raw_devices:
        raise ClusterError(f"{source}: 'devices' must be a non-empty list of devices")
    profiles: dict[Path, DeviceProfile] = {}
    devices: list[DeviceSpec] = []
    first_index: dict[str, int] = {}
    addresses: dict[str, str] = {}
    for i, raw in enumerate(raw_devices):
        spec = _device(raw, i, source, Path(base_dir), load_profile, profiles, require_address)
        if spec.name in first_index:
            raise ClusterError(f"{source}: device {spec.name!r} appears twice (devices[{first_index[spec.name]}] and "
                               f"devices[{i}]); device names must be unique")
        clash = next((n for n in first_index if n.lower() == spec.name.lower()), None)
        if clash is not None:
            # each device's bundle is a folder named after it: on a case-insensitive file system these collide
            raise ClusterError(f"{source}: devices {clash!r} (devices[{first_index[clash]}]) and {spec.name!r} "
                               f"(devices[{i}]) differ only in case; their bundle folders would collide on a "
                               f"case-insensitive file system: rename one")
        if spec.address in addresses:
            raise ClusterError(f"{source}: device {spec.name!r}: address {spec.address!r} is already device "
                               f"{addresses[spec.address]!r}'s; each worker needs its own address")
        first_index[spec.name] = i
        addresses[spec.address] = spec.name
        devices.append(spec)
    _check_same_model(devices, source)
    default, pairs = _links(doc.get("links"), [d.name for d in devices], source)
    return Cluster(tuple(devices), default, pairs)


def _no_unknown_keys(raw: Mapping, allowed: set[str], source: str, where: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ClusterError(f"{source}: {where}unknown field {unknown[0]!r} (fields: {', '.join(sorted(allowed))})")


def _device(raw: Any, index: int, source: str, base_dir: Path, load_profile: Callable[[Path], DeviceProfile],
            profiles: dict[Path, DeviceProfile], require_address: bool = True) -> DeviceSpec:
    where = f"devices[{index}]: "
    if not isinstance(raw, Mapping):
        raise ClusterError(f"{source}: {where}expected a mapping with {', '.join(sorted(_DEVICE_KEYS))}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ClusterError(f"{source}: {where}missing field 'name' (a non-empty string)" if name is None
                           else f"{source}: {where}name {name!r} is not a non-empty string")
    where = f"device {name!r}: "
    _no_unknown_keys(raw, _DEVICE_KEYS, source, where)

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ClusterError(f"{source}: {where}missing field {key!r}")
        return raw[key]

    if require_address or raw.get("address") is not None:
        address = need("address")
        if not isinstance(address, str) or not address.strip():
            raise ClusterError(f"{source}: {where}address {address!r} is not a non-empty string")
        try:
            parse_address(address)
        except AddressError as exc:
            raise ClusterError(f"{source}: {where}address {exc}") from None
    else:
        address = f"estimate://{name}"
    profile_field = need("profile")
    if not isinstance(profile_field, str) or not profile_field.strip():
        raise ClusterError(f"{source}: {where}profile {profile_field!r} is not a path")
    profile_path = (base_dir / profile_field).resolve()
    if profile_path not in profiles:
        if not profile_path.is_file():
            raise ClusterError(f"{source}: {where}profile {profile_field!r} not found (looked at {profile_path}); "
                               f"make it with `confidant profile`")
        try:
            profiles[profile_path] = load_profile(profile_path)
        except (ValueError, OSError) as exc:
            raise ClusterError(f"{source}: {where}profile {profile_field!r} cannot be read: {exc}") from None
    profile = profiles[profile_path]
    raw_budget = need("memory_budget")
    try:
        budget = parse_bytes(raw_budget)
    except ValueError as exc:
        raise ClusterError(f"{source}: {where}memory_budget {exc}") from None
    if budget <= 0:
        raise ClusterError(f"{source}: {where}memory_budget must be more than 0 bytes")
    bare = isinstance(raw_budget, (int, float)) or (isinstance(raw_budget, str) and raw_budget.strip().isdigit())
    if bare and budget < MIN_BARE_BUDGET_BYTES:
        # "memory_budget: 512" meant 512 MiB, not 512 bytes; read as bytes it would leave the device
        # silently out of every plan
        raise ClusterError(f"{source}: {where}memory_budget {raw_budget!r} has no unit and would be {budget} bytes, "
                           f"too little to hold any block; write the unit, e.g. {raw_budget}MiB or {raw_budget}GiB")
    if budget > profile.memory_available_bytes:
        raise ClusterError(
            f"{source}: {where}memory_budget {budget} bytes ({format_bytes(budget)}) is more than the "
            f"{profile.memory_available_bytes} bytes ({format_bytes(profile.memory_available_bytes)}) its profile "
            f"{profile_field!r} measured as available; lower the budget or re-profile the device")
    backend = raw.get("backend")
    if backend is not None:
        names = [b.backend for b in profile.backends]
        if not isinstance(backend, str) or backend not in names:
            raise ClusterError(f"{source}: {where}backend {backend!r} is not in its profile {profile_field!r} "
                               f"(profiled backends: {', '.join(names) or 'none'})")
    elif not profile.backends:
        raise ClusterError(f"{source}: {where}profile {profile_field!r} has no backends; re-run `confidant profile`")
    key = raw.get("key")
    if key is not None and (not isinstance(key, str) or not _PUBLIC_KEY.fullmatch(key.strip())):
        raise ClusterError(f"{source}: {where}key {str(key)[:40]!r} is not a public key ('ed25519:' and 64 lowercase "
                           f"hex digits: the first word of the NAME.pub `confidant keys` wrote for this device)")
    return DeviceSpec(name, address, profile, budget, backend, key.strip() if key else None)


def _check_same_model(devices: list[DeviceSpec], source: str) -> None:
    first = devices[0]
    for d in devices[1:]:
        for key in ("model", "batch", "seq"):
            a, b = getattr(first.profile, key), getattr(d.profile, key)
            if a != b:
                raise ClusterError(
                    f"{source}: device {d.name!r}: profile {key} {b!r} differs from device {first.name!r}'s {a!r}; "
                    f"profile every device with the same model, batch and sequence length")


def _link(raw: Any, source: str, where: str, allowed: set[str]) -> Link:
    if not isinstance(raw, Mapping):
        raise ClusterError(f"{source}: {where}expected a mapping with bandwidth and latency")
    _no_unknown_keys(raw, allowed, source, where)
    for key in ("bandwidth", "latency"):
        if raw.get(key) is None:
            raise ClusterError(f"{source}: {where}missing field {key!r}")
    try:
        bandwidth = parse_bandwidth(raw["bandwidth"])
    except ValueError as exc:
        raise ClusterError(f"{source}: {where}bandwidth {exc}") from None
    try:
        latency = parse_duration(raw["latency"])
    except ValueError as exc:
        raise ClusterError(f"{source}: {where}latency {exc}") from None
    return Link(bandwidth, latency)


def _links(raw: Any, names: list[str], source: str) -> tuple[Link, dict[tuple[str, str], Link]]:
    if raw is None:
        if len(names) > 1:
            raise ClusterError(f"{source}: missing field 'links' (a cluster of {len(names)} devices needs at least "
                               f"links.default with bandwidth and latency)")
        return Link(math.inf, 0.0), {}
    if not isinstance(raw, Mapping):
        raise ClusterError(f"{source}: links: expected a mapping with 'default' and optionally 'pairs'")
    _no_unknown_keys(raw, _LINKS_KEYS, source, "links: ")
    if raw.get("default") is None:
        raise ClusterError(f"{source}: links: missing field 'default'")
    default = _link(raw["default"], source, "links.default: ", _LINK_KEYS)
    raw_pairs = raw.get("pairs") or []
    if not isinstance(raw_pairs, list):
        raise ClusterError(f"{source}: links.pairs: expected a list of {{between: [a, b], bandwidth, latency}}")
    pairs: dict[tuple[str, str], Link] = {}
    for i, item in enumerate(raw_pairs):
        between = item.get("between") if isinstance(item, Mapping) else None
        if (not isinstance(between, list) or len(between) != 2
                or not all(isinstance(n, str) for n in between)):
            raise ClusterError(f"{source}: links.pairs[{i}]: between must be a list of two device names, "
                               f"got {between!r}")
        a, b = between
        where = f"link between {a!r} and {b!r}: "
        for n in (a, b):
            if n not in names:
                raise ClusterError(f"{source}: {where}{n!r} is not a device (devices: {', '.join(names)})")
        if a == b:
            raise ClusterError(f"{source}: {where}a link needs two different devices")
        if _pair(a, b) in pairs:
            raise ClusterError(f"{source}: {where}the pair is listed twice")
        pairs[_pair(a, b)] = _link(item, source, where, _PAIR_KEYS)
    return default, pairs
