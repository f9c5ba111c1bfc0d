"""A plan bundle: everything one device needs to train its pipeline stage, as plain files.

The planner writes one bundle per device (`planner.emit`); the device's runtime verifies it before
using anything (`runtime.pipeline.bundles`). A bundle is a directory of five files:

    manifest.json        {"schema_version": 1, "format": "confidant-bundle", "device", "stage",
                          "files": {file name: sha256 hex}}; written last, so a bundle whose
                          writing was interrupted has no manifest and is refused
    stage.json           this stage's settings (see `STAGE_FIELDS`): stage index and count, device,
                          block range, neighbouring devices, schedule, optimizer, engine, batch/seq
    graph.json           `ir.serialize.graph_to_json` of the stage's graph slice
    weights.safetensors  every constant of the slice by name (parameters included)
    actions.txt          this stage's actions, one `Action` token per line

Verification (`verify_bundle_files`) runs when a bundle is written and again wherever it is
loaded, on the bytes: the manifest must be of this schema version and list exactly the four
files, each present with a matching SHA-256, and nothing else may be in the directory; then
every file is parsed and cross-checked (stage, device, block range, constants against weights,
actions all of this stage). Errors name the bundle, the file and what is wrong.

Weights are safetensors: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian bytes. The codec here is
written against that format with `json` and `numpy.frombuffer` only (no pickle, and `ir` keeps to
the standard library and numpy, as DESIGN.md requires); tests check it against the `safetensors`
package in both directions.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from ir.graph import Graph
from ir.plan import Action, ActionKind, Schedule
from ir.serialize import graph_from_json
from ir.verify import GraphError, verify_graph, verify_plan

BUNDLE_SCHEMA_VERSION = 1
BUNDLE_FORMAT = "confidant-bundle"

MANIFEST = "manifest.json"
STAGE = "stage.json"
GRAPH = "graph.json"
WEIGHTS = "weights.safetensors"
ACTIONS = "actions.txt"
BUNDLE_FILES = (STAGE, GRAPH, WEIGHTS, ACTIONS)  # what the manifest lists, besides itself

_MANIFEST_KEYS = ("schema_version", "format", "device", "stage", "files")
_SHA256 = re.compile(r"[0-9a-f]{64}")

# stage.json: every key is required and no other is allowed; the checks are in `_check_stage_doc`.
STAGE_FIELDS = (
    "stage", "stages", "device", "blocks", "peers", "schedule", "microbatches", "update_every",
    "stash_depth", "engine", "backend", "threads", "optimizer", "batch", "seq",
)
# ...except these, which may be left out (bundles written before them stay valid):
# `head_split`: null, or {backend name: heads} when the stage's attention heads are split across
# backends (`runtime.engines.split.engine.SplitStageEngine`).
STAGE_OPTIONAL_FIELDS = ("head_split",)

# Device names become directory names on the planner's machine, so they are kept to characters
# that mean the same on every file system, and away from names some systems reserve.
_DEVICE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_RESERVED = {"con", "prn", "aux", "nul", "plan.json"} | {f"{p}{i}" for p in ("com", "lpt") for i in range(1, 10)}


class BundleError(ValueError):
    """A bundle that cannot be used; the message starts with `bundle <where>:` and names the file."""


def check_device_name(name: Any) -> str:
    """`name` if it can name a bundle directory on any file system; BundleError otherwise."""
    if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name) or name.endswith(".") \
            or name.lower().split(".")[0] in _RESERVED or name.lower() in _RESERVED:
        raise BundleError(f"device name {name!r} cannot name a bundle directory: use 1 to 64 letters, digits, "
                          f"'.', '_' or '-', not starting with '.' or '-', not ending with '.', and not a "
                          f"reserved name (CON, NUL, COM1, plan.json, ...)")
    return name


@dataclass(frozen=True, eq=False)
class BundleContents:
    """A verified bundle, parsed: the runtime builds its stage from these and nothing else.

    `graph` is the stage's slice rebuilt with the bundle's weights (writable copies, owned by
    the graph); `manifest` maps each file name to its SHA-256, which identifies the bundle."""

    source: str
    stage_doc: dict[str, Any]
    graph: Graph
    actions: tuple[Action, ...]
    manifest: dict[str, str]

    @property
    def stage(self) -> int:
        return self.stage_doc["stage"]

    @property
    def stages(self) -> int:
        return self.stage_doc["stages"]

    @property
    def device(self) -> str:
        return self.stage_doc["device"]

    @property
    def first_block(self) -> int:
        return self.stage_doc["blocks"][0]

    @property
    def last_block(self) -> int:
        return self.stage_doc["blocks"][1]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# safetensors ------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
              "BOOL": "bool"}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
_ST_MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit


def encode_safetensors(tensors: Mapping[str, np.ndarray]) -> bytes:
    """The safetensors bytes of `tensors`; deterministic, so equal weights give equal hashes.

    Tensors are laid out widest dtype first, then by name (as the safetensors package does), so
    every tensor starts aligned to its item size; the header is padded with spaces to 8 bytes."""
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} cannot be stored in safetensors")
        arr = np.asarray(value)
        if arr.dtype.name not in _ST_CODES:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot hold "
                             f"(supported: {', '.join(sorted(_ST_CODES))})")
        arrays[name] = arr
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {}
    chunks, offset = [], 0
    for name in order:
        arr = arrays[name]
        # astype with an explicit little-endian dtype, not ascontiguousarray, which turns 0-d into 1-d.
        raw = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C").tobytes()
        header[name] = {"dtype": _ST_CODES[arr.dtype.name], "shape": [int(d) for d in arr.shape],
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def decode_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """Parse safetensors bytes strictly (header, dtypes, shapes, byte ranges that tile the data
    exactly); returns writable copies. ValueError says what is wrong."""
    data = bytes(data)
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(_ST_MAX_HEADER, len(data) - 8):
        raise ValueError(f"header length {n} exceeds the {len(data) - 8} bytes that follow it")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("header __metadata__ is not an object of strings")
    buffer = memoryview(data)[8 + n :]
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or sorted(entry) != ["data_offsets", "dtype", "shape"]:
            raise ValueError(f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(sorted(_ST_DTYPES))}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
        np_dtype = np.dtype(_ST_DTYPES[dtype]).newbyteorder("<")
        if offsets[1] - offsets[0] != math.prod(shape) * np_dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {dtype}{shape} needs {math.prod(shape) * np_dtype.itemsize} bytes, "
                             f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name, np_dtype, tuple(shape)))
    spans.sort()
    end = 0
    for begin, stop, name, _, _ in spans:
        if begin != end:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, expected {end} (gap or overlap)")
        end = stop
    if end != len(buffer):
        raise ValueError(f"tensors cover {end} data bytes, the file holds {len(buffer)}")
    out = {}
    for begin, stop, name, np_dtype, shape in spans:
        arr = np.frombuffer(buffer[begin:stop], dtype=np_dtype).reshape(shape)
        if np_dtype == np.bool_ and arr.size and not np.isin(buffer[begin:stop], (0, 1)).all():
            raise ValueError(f"tensor {name!r}: BOOL bytes other than 0 and 1")
        out[name] = arr.astype(np_dtype.newbyteorder("="), copy=True)
    return out


# stage.json -------------------------------------------------------------------------------------

def _check_stage_doc(doc: Any) -> str | None:
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
    opt = doc["optimizer"]
    if not isinstance(opt, dict) or sorted(opt) != ["lr", "name", "weight_decay"]:
        return f"optimizer is {opt!r}, not {{\"name\", \"lr\", \"weight_decay\"}}"
    if not isinstance(opt["name"], str) or not opt["name"]:
        return f"optimizer.name is {opt['name']!r}, not a non-empty string"
    if isinstance(opt["lr"], bool) or not isinstance(opt["lr"], (int, float)) or not 0 < opt["lr"] < math.inf:
        return f"optimizer.lr is {opt['lr']!r}, not a positive finite number"
    wd = opt["weight_decay"]
    if wd is not None and (isinstance(wd, bool) or not isinstance(wd, (int, float)) or not 0 <= wd < math.inf):
        return f"optimizer.weight_decay is {wd!r}, not null or a non-negative finite number"
    split = doc.get("head_split")
    if split is not None:
        if (not isinstance(split, dict) or not split
                or not all(isinstance(b, str) and b for b in split)
                or not all(_is_int(h) and h >= 1 for h in split.values())):
            return f"head_split is {split!r}, not null or {{backend name: heads (an integer >= 1)}}"
    return None


# Writing --------------------------------------------------------------------------------------

def _json_bytes(doc: Any, sort_keys: bool) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=sort_keys) + "\n").encode("utf-8")


def build_bundle_files(stage_doc: Mapping[str, Any], graph_doc: Mapping[str, Any],
                       constants: Mapping[str, np.ndarray], actions: Iterable[Action | str],
                       source: str = "<memory>") -> dict[str, bytes]:
    """The bytes of every bundle file, manifest included (not yet verified: `write_bundle` does)."""
    stage_doc = dict(stage_doc)
    problem = _check_stage_doc(stage_doc)
    if problem is not None:
        raise BundleError(f"bundle {source}: {STAGE} {problem}")
    try:
        tokens = [str(a if isinstance(a, Action) else Action.parse(a)) for a in actions]
        files = {STAGE: _json_bytes(stage_doc, sort_keys=True), GRAPH: _json_bytes(dict(graph_doc), sort_keys=False),
                 WEIGHTS: encode_safetensors(constants), ACTIONS: "".join(t + "\n" for t in tokens).encode("ascii")}
    except (TypeError, ValueError) as exc:
        raise BundleError(f"bundle {source}: cannot be written: {exc}") from None
    manifest = {"schema_version": BUNDLE_SCHEMA_VERSION, "format": BUNDLE_FORMAT, "device": stage_doc["device"],
                "stage": stage_doc["stage"], "files": {name: sha256_hex(files[name]) for name in BUNDLE_FILES}}
    files[MANIFEST] = _json_bytes(manifest, sort_keys=False)
    return files


def write_bundle(directory: str | Path, stage_doc: Mapping[str, Any], graph_doc: Mapping[str, Any],
                 constants: Mapping[str, np.ndarray], actions: Iterable[Action | str]) -> Path:
    """Verify the bundle's bytes, then write its files into `directory`, the manifest last.

    `directory` may be new, empty, or hold an earlier bundle (whose files are replaced); anything
    else in it is refused rather than deleted. Its manifest goes first, so an interrupted rewrite
    leaves a directory that no runtime accepts."""
    directory = Path(directory)
    files = build_bundle_files(stage_doc, graph_doc, constants, actions, source=str(directory))
    verify_bundle_files(files, str(directory))
    if directory.exists():
        if not directory.is_dir():
            raise BundleError(f"bundle {directory}: exists and is not a directory")
        ours = set(files) | {f".{name}.tmp" for name in files}  # .tmp: left by an interrupted write
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in ours or not p.is_file() or p.is_symlink())
        if foreign:
            raise BundleError(f"bundle {directory}: the directory holds {', '.join(foreign)}, which are not bundle "
                              f"files; choose an empty directory or remove them")
        (directory / MANIFEST).unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    for name in BUNDLE_FILES + (MANIFEST,):
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(files[name])
        os.replace(tmp, directory / name)
    return directory


def read_bundle_files(directory: str | Path) -> dict[str, bytes]:
    """Every file of a bundle directory by name, unchecked; anything but plain files is refused."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BundleError(f"bundle {directory}: no such directory")
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_symlink() or not path.is_file():
            kind = "a symbolic link" if path.is_symlink() else "not a plain file"
            raise BundleError(f"bundle {directory}: {path.name} is {kind}; a bundle holds only plain files")
        files[path.name] = path.read_bytes()
    return files


# Verifying -------------------------------------------------------------------------------------

def _load_json(data: bytes, where: str, name: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError(f"bundle {where}: {name} is not valid JSON ({exc})") from None


def check_bundle_manifest(files: Mapping[str, bytes], source: str) -> dict[str, str]:
    """The manifest's file hashes once the manifest is sound and every file matches it exactly.

    Cheap (hashing only): the coordinator runs it before shipping a bundle; `verify_bundle_files`
    runs it first and then parses everything."""
    if MANIFEST not in files:
        raise BundleError(f"bundle {source}: {MANIFEST} is missing (not a bundle, or its writing was interrupted)")
    manifest = _load_json(bytes(files[MANIFEST]), source, MANIFEST)
    if not isinstance(manifest, dict):
        raise BundleError(f"bundle {source}: {MANIFEST} is a JSON {type(manifest).__name__}, not an object")
    version = manifest.get("schema_version")
    if not _is_int(version):
        raise BundleError(f"bundle {source}: {MANIFEST} has no integer schema_version (got {version!r})")
    if version != BUNDLE_SCHEMA_VERSION:
        raise BundleError(f"bundle {source}: schema_version {version} is not supported by this runtime "
                          f"(reads {BUNDLE_SCHEMA_VERSION}); re-run `confidant plan` with this version")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"bundle {source}: {MANIFEST} format is {manifest.get('format')!r}, "
                          f"expected {BUNDLE_FORMAT!r}")
    if sorted(manifest) != sorted(_MANIFEST_KEYS):
        raise BundleError(f"bundle {source}: {MANIFEST} has keys {sorted(manifest)}, expected "
                          f"{sorted(_MANIFEST_KEYS)}")
    try:
        check_device_name(manifest["device"])
    except BundleError as exc:
        raise BundleError(f"bundle {source}: {MANIFEST} {exc}") from None
    if not _is_int(manifest["stage"]) or manifest["stage"] < 0:
        raise BundleError(f"bundle {source}: {MANIFEST} stage is {manifest['stage']!r}, not an integer >= 0")
    listed = manifest["files"]
    if not isinstance(listed, dict) or not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in listed.values()):
        raise BundleError(f"bundle {source}: {MANIFEST} files must map each file name to a lowercase "
                          f"64-digit sha256 hex digest")
    unknown = sorted(set(listed) - set(BUNDLE_FILES))
    if unknown:
        raise BundleError(f"bundle {source}: {MANIFEST} lists {', '.join(unknown)}, which is not a bundle file "
                          f"(a bundle holds {', '.join(BUNDLE_FILES)})")
    unlisted = [n for n in BUNDLE_FILES if n not in listed]
    if unlisted:
        raise BundleError(f"bundle {source}: {MANIFEST} does not list {', '.join(unlisted)}")
    for name in BUNDLE_FILES:
        if name not in files:
            raise BundleError(f"bundle {source}: {name} is missing ({MANIFEST} lists it)")
    extra = sorted(set(files) - set(BUNDLE_FILES) - {MANIFEST})
    if extra:
        raise BundleError(f"bundle {source}: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not listed in "
                          f"{MANIFEST} (a bundle holds only its listed files; remove "
                          f"{'it' if len(extra) == 1 else 'them'} or re-run `confidant plan`)")
    for name in BUNDLE_FILES:
        got = sha256_hex(bytes(files[name]))
        if got != listed[name]:
            raise BundleError(f"bundle {source}: {name} is corrupted (sha256 mismatch: expected "
                              f"{listed[name][:12]}..., got {got[:12]}...)")
    return dict(listed)


def _with_boundary(graph: Graph, first: int) -> Graph:
    """The slice with its incoming activation declared as an input, so `verify_graph` applies."""
    if first == 0:
        return graph
    boundary = graph.values[graph.blocks[first].inputs[0]]
    return Graph(graph.name, graph.inputs + (boundary,), graph.outputs, graph.nodes, graph.values, graph.constants,
                 graph.params, graph.blocks, graph.batch, graph.seq)


def _parse_actions(data: bytes, source: str, stage_doc: Mapping[str, Any]) -> tuple[Action, ...]:
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise BundleError(f"bundle {source}: {ACTIONS} is not ASCII text") from None
    lines = text.split("\n")
    if lines[-1] != "":
        raise BundleError(f"bundle {source}: {ACTIONS} does not end with a newline")
    stage, stages, m = stage_doc["stage"], stage_doc["stages"], stage_doc["microbatches"]
    actions = []
    for i, line in enumerate(lines[:-1], 1):
        try:
            a = Action.parse(line)
        except ValueError as exc:
            raise BundleError(f"bundle {source}: {ACTIONS} line {i}: {exc}") from None
        if a.stage != stage:
            raise BundleError(f"bundle {source}: {ACTIONS} line {i}: {a} is an action of stage {a.stage}, "
                              f"this bundle is stage {stage}")
        if a.peer is not None and (a.peer not in (stage - 1, stage + 1) or a.peer >= stages):
            raise BundleError(f"bundle {source}: {ACTIONS} line {i}: {a} talks to stage {a.peer}, which is not a "
                              f"neighbour of stage {stage} of {stages}")
        if a.microbatch is not None and a.microbatch >= m:
            raise BundleError(f"bundle {source}: {ACTIONS} line {i}: {a} names micro-batch {a.microbatch}, "
                              f"the schedule has {m}")
        actions.append(a)
    if not any(a.kind is ActionKind.F for a in actions):
        raise BundleError(f"bundle {source}: {ACTIONS} has no forward action")
    return tuple(actions)


def verify_bundle_files(files: Mapping[str, bytes], source: str) -> BundleContents:
    """Check a bundle's bytes completely and parse them; BundleError names the file and the fault."""
    manifest = check_bundle_manifest(files, source)
    head = _load_json(bytes(files[MANIFEST]), source, MANIFEST)
    stage_doc = _load_json(bytes(files[STAGE]), source, STAGE)
    problem = _check_stage_doc(stage_doc)
    if problem is not None:
        raise BundleError(f"bundle {source}: {STAGE} {problem}")
    for key in ("device", "stage"):
        if stage_doc[key] != head[key]:
            raise BundleError(f"bundle {source}: {STAGE} says {key} {stage_doc[key]!r}, "
                              f"{MANIFEST} says {head[key]!r}")
    graph_doc = _load_json(bytes(files[GRAPH]), source, GRAPH)
    if not isinstance(graph_doc, dict) or not isinstance(graph_doc.get("constants"), dict):
        raise BundleError(f"bundle {source}: {GRAPH} is not a graph document (no constants table)")
    try:
        weights = decode_safetensors(bytes(files[WEIGHTS]))
    except ValueError as exc:
        raise BundleError(f"bundle {source}: {WEIGHTS} is not valid safetensors: {exc}") from None
    declared = set(graph_doc["constants"])
    missing, extra = sorted(declared - set(weights)), sorted(set(weights) - declared)
    if missing or extra:
        raise BundleError(f"bundle {source}: {WEIGHTS} does not match {GRAPH}'s constants: "
                          f"missing {missing[:5]}, unexpected {extra[:5]}")
    try:
        graph = graph_from_json(graph_doc, weights)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"bundle {source}: {GRAPH} cannot be rebuilt: {type(exc).__name__}: {exc}") from None
    first, last = stage_doc["blocks"]
    if last >= len(graph.blocks):
        raise BundleError(f"bundle {source}: {STAGE} blocks [{first}, {last}] is outside the model's "
                          f"{len(graph.blocks)} blocks")
    if (graph.batch, graph.seq) != (stage_doc["batch"], stage_doc["seq"]):
        raise BundleError(f"bundle {source}: {GRAPH} is bound to batch {graph.batch}, seq {graph.seq}; "
                          f"{STAGE} says batch {stage_doc['batch']}, seq {stage_doc['seq']}")
    present = {n.name for n in graph.nodes}
    absent = [n for b in graph.blocks[first : last + 1] for n in b.nodes + b.host_nodes if n not in present]
    if absent:
        raise BundleError(f"bundle {source}: {GRAPH} lacks node {absent[0]!r} of blocks {first}..{last} "
                          f"({len(absent)} missing)")
    try:
        verify_graph(_with_boundary(graph, first))
    except GraphError as exc:
        raise BundleError(f"bundle {source}: {GRAPH}: {exc}") from None
    actions = _parse_actions(bytes(files[ACTIONS]), source, stage_doc)
    return BundleContents(source, stage_doc, graph, actions, manifest)


def load_bundle_dir(directory: str | Path) -> BundleContents:
    """Read and verify a bundle directory."""
    return verify_bundle_files(read_bundle_files(directory), str(directory))


# plan.json ---------------------------------------------------------------------------------------
# The plan's index, written by `planner.emit` next to the bundles. It is read here, in `ir`, because
# the coordinator (runtime, which never imports the planner) needs it as much as the command line.

PLAN = "plan.json"
# The cluster (devices, their profiles and budgets, links) the plan was made for, beside plan.json:
# what re-planning during training starts from. Optional (plans written before it stay valid);
# when present, plan.json records its SHA-256 as `cluster_sha256`.
PLAN_CLUSTER = "cluster.json"
PLAN_SCHEMA_VERSION = 1
PLAN_FORMAT = "confidant-plan"
PLAN_FIELDS = ("schema_version", "format", "model", "schedule", "stages", "microbatches", "update_every",
               "stash_depth", "batch", "seq", "blocks", "engine", "backend", "optimizer", "devices",
               "predicted_step_s", "partition_method", "actions")
PLAN_DEVICE_FIELDS = ("name", "stage", "blocks", "memory_bytes", "memory_budget_bytes", "predicted_time_s",
                      "bundle", "manifest_sha256")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def check_plan_doc(doc: Any, where: str) -> dict[str, Any]:
    """`doc` if it is a sound plan.json of this schema version whose schedule verifies; PlanError
    (from `ir.verify.verify_plan`) for a broken schedule, BundleError for anything else."""
    def fail(what: str) -> BundleError:
        return BundleError(f"plan {where}: {what}")

    if not isinstance(doc, dict):
        raise fail(f"{PLAN} is a JSON {type(doc).__name__}, not an object")
    version = doc.get("schema_version")
    if not _is_int(version):
        raise fail(f"{PLAN} has no integer schema_version (got {version!r})")
    if version != PLAN_SCHEMA_VERSION:
        raise fail(f"schema_version {version} is not supported by this build (reads {PLAN_SCHEMA_VERSION}); "
                   f"re-run `confidant plan` with this version")
    if doc.get("format") != PLAN_FORMAT:
        raise fail(f"{PLAN} format is {doc.get('format')!r}, expected {PLAN_FORMAT!r}")
    missing = [k for k in PLAN_FIELDS if k not in doc]
    if missing:
        raise fail(f"{PLAN} lacks {', '.join(missing)}")
    devices, blocks = doc["devices"], doc["blocks"]
    if not isinstance(blocks, list) or not blocks or not all(isinstance(b, str) for b in blocks):
        raise fail(f"{PLAN} blocks must list the model's block names")
    if not isinstance(devices, list) or not devices or len(devices) != doc["stages"]:
        raise fail(f"{PLAN} devices must list one device per stage ({doc['stages']!r} stages)")
    names, expect_first = set(), 0
    for i, d in enumerate(devices):
        if not isinstance(d, dict):
            raise fail(f"{PLAN} devices[{i}] is not an object")
        lacking = [k for k in PLAN_DEVICE_FIELDS if k not in d]
        if lacking:
            raise fail(f"{PLAN} devices[{i}] lacks {', '.join(lacking)}")
        try:
            check_device_name(d["name"])
        except BundleError as exc:
            raise fail(f"devices[{i}]: {exc}") from None
        if d["name"].lower() in names:
            raise fail(f"device {d['name']!r} appears twice (names must differ even ignoring case)")
        names.add(d["name"].lower())
        if d["stage"] != i:
            raise fail(f"device {d['name']!r} is stage {d['stage']!r} at position {i}; devices are in pipeline order")
        b = d["blocks"]
        if not (isinstance(b, list) and len(b) == 2 and all(_is_int(x) for x in b) and b[0] == expect_first
                and b[0] <= b[1] < len(blocks)):
            raise fail(f"device {d['name']!r} blocks {b!r} do not continue at block {expect_first} "
                       f"(the model has {len(blocks)} blocks, cut into contiguous ranges)")
        expect_first = b[1] + 1
        for key in ("memory_bytes", "memory_budget_bytes", "predicted_time_s"):
            if not _number(d[key]):
                raise fail(f"device {d['name']!r} {key} is {d[key]!r}, not a non-negative number")
        digest = d["manifest_sha256"]
        if d["bundle"] != d["name"] or not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise fail(f"device {d['name']!r}: bundle must be its name and manifest_sha256 a sha256 hex digest")
        if "address" in d and not isinstance(d["address"], str):
            raise fail(f"device {d['name']!r} address is {d['address']!r}, not a string")
    if expect_first != len(blocks):
        raise fail(f"the devices cover blocks 0..{expect_first - 1} of 0..{len(blocks) - 1}")
    cluster_digest = doc.get("cluster_sha256")
    if cluster_digest is not None and not (isinstance(cluster_digest, str) and _SHA256.fullmatch(cluster_digest)):
        raise fail(f"cluster_sha256 is {cluster_digest!r}, not null or a sha256 hex digest")
    if doc["predicted_step_s"] is not None and not _number(doc["predicted_step_s"]):
        raise fail(f"predicted_step_s is {doc['predicted_step_s']!r}, not null or a non-negative number")
    try:
        schedule = Schedule.from_json({"schema_version": 1, "name": doc["schedule"], "stages": doc["stages"],
                                       "microbatches": doc["microbatches"], "update_every": doc["update_every"],
                                       "stash_depth": doc["stash_depth"], "actions": doc["actions"]})
    except (TypeError, ValueError) as exc:
        raise fail(f"{PLAN} schedule cannot be read: {exc}") from None
    verify_plan(schedule)
    return doc


def load_plan(out_dir: str | Path, verify_bundles: bool = False) -> dict[str, Any]:
    """plan.json of an emitted plan, validated, with each device's bundle checked to be the one the
    plan was written with (its manifest's SHA-256); `verify_bundles` also verifies each bundle fully."""
    out_dir = Path(out_dir)
    path = out_dir / PLAN
    if not path.is_file():
        raise BundleError(f"plan {out_dir}: {PLAN} is missing (run `confidant plan` first)")
    doc = check_plan_doc(_load_json(path.read_bytes(), str(out_dir), PLAN), str(out_dir))
    if doc.get("cluster_sha256") is not None:
        cluster = out_dir / PLAN_CLUSTER
        if not cluster.is_file():
            raise BundleError(f"plan {out_dir}: {PLAN} records a {PLAN_CLUSTER}, which is missing; re-run "
                              f"`confidant plan`")
        got = sha256_hex(cluster.read_bytes())
        if got != doc["cluster_sha256"]:
            raise BundleError(f"plan {out_dir}: {PLAN_CLUSTER} is not the one {PLAN} was written with (sha256 "
                              f"expected {doc['cluster_sha256'][:12]}..., got {got[:12]}...); re-run `confidant plan`")
    for d in doc["devices"]:
        manifest = out_dir / d["bundle"] / MANIFEST
        if not manifest.is_file():
            raise BundleError(f"plan {out_dir}: the bundle of device {d['name']!r} has no "
                              f"{manifest.relative_to(out_dir)}")
        got = sha256_hex(manifest.read_bytes())
        if got != d["manifest_sha256"]:
            raise BundleError(f"plan {out_dir}: bundle {d['bundle']}/ is not the one {PLAN} was written with "
                              f"({MANIFEST} sha256 expected {d['manifest_sha256'][:12]}..., got {got[:12]}...); "
                              f"re-run `confidant plan`")
        if verify_bundles:
            contents = load_bundle_dir(out_dir / d["bundle"])
            if contents.stage != d["stage"] or [contents.first_block, contents.last_block] != d["blocks"]:
                raise BundleError(f"plan {out_dir}: bundle {d['bundle']}/ is stage {contents.stage} blocks "
                                  f"{[contents.first_block, contents.last_block]}, {PLAN} says stage {d['stage']} "
                                  f"blocks {d['blocks']}")
    return doc
