"""A plan bundle: everything one device needs to train its pipeline stage, as plain files.

The planner writes one bundle per device (`planner.emit`); the device's runtime verifies it before
using anything (`runtime.pipeline.bundles`). A bundle is a directory of five files:

    manifest.json        {"schema_version": 1, "format": "confidant-bundle", "device", "stage",
                          "files": {file name: sha256 hex}, "plan": the plan's identity}; written
                          last, so a bundle whose writing was interrupted has no manifest and is
                          refused
    stage.json           this stage's settings (`ir.documents.StageDocument`): stage index and count,
                          device, block range, neighbouring devices, schedule, optimizer, engine,
                          batch/seq, head split
    graph.json           `ir.serialize.graph_to_json` of the stage's graph slice
    weights.safetensors  every constant of the slice by name (parameters included); a frozen
                         weight held quantized as its storage arrays, never widened
                         (NAME.q_codes, NAME.q_scales, int4's NAME.q_mins: `ir.precision`),
                         its precision in graph.json's `quantized` table (`ir.serialize`)
    actions.txt          this stage's actions, one `Action` token per line

Verification (`verify_bundle_files`) runs when a bundle is written and again wherever it is
loaded, on the bytes: the manifest must be of this schema version and list exactly the four
files, each present with a matching SHA-256, and nothing else may be in the directory; then
every file is parsed and cross-checked (stage, device, block range, constants against weights,
actions all of this stage). Errors name the bundle, the file and what is wrong.

Signatures: a bundle may carry a sixth file, manifest.sig, written after the manifest by whoever
holds the coordinator's key (`write_bundle(..., sign=)`; `runtime.keys` makes the signer). The
manifest names every other file's SHA-256, so a signature over the manifest covers the bundle,
and it names the plan's identity (`plan_identity`, also in plan.json) and the bundle's stage, so a
signature binds the bundle to its plan: a bundle of another plan signed by the same key, swapped
into a plan folder, is refused by `load_plan` (issue 32).
`verify_bundle_files(..., check_signature=)` refuses a bundle whose signature the given check
rejects (a worker passes the check of the coordinator key it trusts); without a check the
signature is ignored. The cryptography is not here (`ir` imports only the standard library and
numpy): callers pass functions.

Weights are safetensors, read and written by `ir.safetensors` (the one codec of the project). A
worker that assembles weights.safetensors from pieces (the rest it received and its own copy of
the plan's base file) passes an `ir.safetensors.HashedTensors` in its place: the tensors and the
SHA-256 of the file they make, hashed piece by piece in file order, so the manifest still checks
every byte and no second copy of the file is made.

A bundle built in this process (`build_bundle_files`) or read and verified here
(`load_plan_folder`) comes as `CheckedFiles`: its files with the SHA-256 each was found to have,
carried with the bytes, so checking it again before it is shipped (`check_bundle_manifest`)
compares digests instead of hashing the bytes again (a SmolLM2-135M plan is 540 MB: each pass
over it cost seconds of a recovery). A worker receives plain bytes and hashes them itself.

Bundles written before the storage form (a quantized weight as its float32 values under graph.json's
`precisions`) still load: the reader quantizes them again to the same weight.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ir.documents import SHA256, BundleError, PlanDocument, StageDocument, check_device_name
from ir.graph import Graph
from ir.plan import Action, ActionKind, Schedule, SteadyState, unroll
from ir.precision import QuantizedTensor, storage_tensors
from ir.safetensors import HashedTensors, decode_safetensors, encode_safetensors, read_safetensors_hashed
from ir.serialize import constant_tensor_names, graph_from_json
from ir.verify import GraphError, verify_graph, verify_plan
from ir.versioned import check_header

__all__ = ["ACTIONS", "BUNDLE_FILES", "BUNDLE_FORMAT", "BUNDLE_SCHEMA_VERSION", "BundleContents", "BundleError", "GRAPH",
           "MANIFEST", "PLAN", "PLAN_BASE", "PLAN_CLUSTER", "SIGNATURE", "base_weights", "STAGE", "WEIGHTS", "build_bundle_files", "CheckedFiles", "check_bundle_manifest", "sign_bundle",
           "manifest_plan_id", "plan_identity", "check_device_name", "load_bundle_dir", "load_plan", "read_bundle_files",
           "sha256_hex", "verify_bundle_files", "write_bundle", "write_bundle_files", "schedule_of_bundles",
           "LoadedPlan", "load_plan_folder"]

BUNDLE_SCHEMA_VERSION = 1
BUNDLE_FORMAT = "confidant-bundle"

MANIFEST = "manifest.json"
STAGE = "stage.json"
GRAPH = "graph.json"
WEIGHTS = "weights.safetensors"
ACTIONS = "actions.txt"
BUNDLE_FILES = (STAGE, GRAPH, WEIGHTS, ACTIONS)  # what the manifest lists, besides itself
SIGNATURE = "manifest.sig"  # optional: the coordinator's signature of manifest.json
# sign(manifest bytes) -> signature file bytes; check(manifest bytes, signature bytes | None) raises
# ValueError saying why the bundle is not trusted
Signer = Callable[[bytes], bytes]
SignatureCheck = Callable[[bytes, "bytes | None"], None]

_MANIFEST_KEYS = ("schema_version", "format", "device", "stage", "files")
_PLAN_KEY = "plan"  # the plan's identity; absent in bundles written on their own or before it existed

@dataclass(frozen=True, eq=False)
class BundleContents:
    """A verified bundle, parsed: the runtime builds its stage from these and nothing else.

    `graph` is the stage's slice rebuilt with the bundle's weights (writable copies, owned by
    the graph); `manifest` maps each file name to its SHA-256, which identifies the bundle."""

    source: str
    stage_doc: StageDocument
    graph: Graph
    actions: tuple[Action, ...]
    manifest: dict[str, str]
    plan_id: str | None = None  # the identity of the plan the bundle was written for (signed with it)
    # asynchronous schedules: the actions each further step of a run without a flush adds before the
    # drain, which starts at actions[drain_at] (stage.json's `steady`; ir.plan.SteadyState)
    steady: tuple[Action, ...] | None = None
    drain_at: int | None = None

    def actions_for_steps(self, steps: int) -> tuple[Action, ...]:
        """This stage's actions for `steps` steps run as one (ir.plan.Schedule.for_steps)."""
        if steps == 1:
            return self.actions
        if self.steady is None:
            raise ValueError(f"bundle {self.source}: {self.stage_doc.schedule} has no steady state to run {steps} "
                             f"steps without a flush with")
        return unroll(self.actions, self.steady, self.drain_at, steps, self.stage_doc.microbatches)

    @property
    def stage(self) -> int:
        return self.stage_doc.stage

    @property
    def stages(self) -> int:
        return self.stage_doc.stages

    @property
    def device(self) -> str:
        return self.stage_doc.device

    @property
    def first_block(self) -> int:
        return self.stage_doc.first_block

    @property
    def last_block(self) -> int:
        return self.stage_doc.last_block


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class CheckedFiles(dict):
    """A bundle's files (name -> bytes) with the SHA-256 of each as computed in this process when
    the bytes were made or read (`digests`): checking them against their manifest again
    (`check_bundle_manifest`) compares the digests carried, without hashing the bytes again. Only
    this process's own builders and readers make one; bytes from the wire are a plain dict and
    are hashed (a worker checks every byte it loads)."""

    def __init__(self, files: Mapping[str, Any], digests: Mapping[str, str]):
        super().__init__(files)
        self.digests = dict(digests)


def sha256_file(path: str | Path) -> str:
    """A file's SHA-256, read in pieces (a base model's weights can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


# stage.json -------------------------------------------------------------------------------------

# Writing --------------------------------------------------------------------------------------

def _json_bytes(doc: Any, sort_keys: bool, indent: int | None = 1) -> bytes:
    """`doc` as JSON; indent None writes it on one line with json's C encoder (an indent makes json
    encode in Python: 1.8 s of a 64-device plan's 16 graph documents)."""
    separators = None if indent is not None else (",", ":")
    return (json.dumps(doc, indent=indent, sort_keys=sort_keys, separators=separators) + "\n").encode("utf-8")


def build_bundle_files(stage_doc: StageDocument | Mapping[str, Any], graph_doc: Mapping[str, Any],
                       constants: Mapping[str, np.ndarray], actions: Iterable[Action | str],
                       source: str = "<memory>", sign: Signer | None = None,
                       plan_id: str | None = None) -> "CheckedFiles":
    """The bytes of every bundle file, manifest included, and its signature with `sign` (not yet
    verified: `write_bundle` does), with each file's SHA-256 (`CheckedFiles`). `stage_doc` may be
    a StageDocument or its JSON (checked as a reader would). `plan_id` (`plan_identity`) goes into
    the manifest, under the signature. `constants` given as `ir.safetensors.HashedTensors` (hashed
    already, as `planner.emit` does for the plan's identity) stay so in the files: the weights
    file is neither hashed again nor put together here (`encode_safetensors(tensors)` makes its
    bytes when it is shipped or written; `verify_bundle_files` reads the tensors as they are)."""
    if not isinstance(stage_doc, StageDocument):
        stage_doc = StageDocument.from_json(stage_doc, f"bundle {source}: {STAGE}")
    try:
        tokens = [str(a if isinstance(a, Action) else Action.parse(a)) for a in actions]
        files = {STAGE: _json_bytes(stage_doc.to_json(), sort_keys=True),
                 GRAPH: _json_bytes(dict(graph_doc), sort_keys=False, indent=None),
                 WEIGHTS: constants if isinstance(constants, HashedTensors) else encode_safetensors(constants),
                 ACTIONS: "".join(t + "\n" for t in tokens).encode("ascii")}
    except (TypeError, ValueError) as exc:
        raise BundleError(f"bundle {source}: cannot be written: {exc}") from None
    digests = {name: files[name].sha256 if isinstance(files[name], HashedTensors) else sha256_hex(files[name])
               for name in BUNDLE_FILES}
    manifest = {"schema_version": BUNDLE_SCHEMA_VERSION, "format": BUNDLE_FORMAT, "device": stage_doc.device,
                "stage": stage_doc.stage, "files": digests}
    if plan_id is not None:
        manifest[_PLAN_KEY] = plan_id
    files[MANIFEST] = _json_bytes(manifest, sort_keys=False)
    if sign is not None:
        files[SIGNATURE] = bytes(sign(files[MANIFEST]))
    return CheckedFiles(files, digests)


def write_bundle(directory: str | Path, stage_doc: StageDocument | Mapping[str, Any], graph_doc: Mapping[str, Any],
                 constants: Mapping[str, np.ndarray], actions: Iterable[Action | str],
                 sign: Signer | None = None, plan_id: str | None = None) -> Path:
    """Verify the bundle's bytes, then write its files into `directory`, the manifest last (and
    its signature after it, with `sign`).

    `directory` may be new, empty, or hold an earlier bundle (whose files are replaced); anything
    else in it is refused rather than deleted. Its manifest goes first, so an interrupted rewrite
    leaves a directory that no runtime accepts."""
    directory = Path(directory)
    files = build_bundle_files(stage_doc, graph_doc, constants, actions, source=str(directory), sign=sign,
                               plan_id=plan_id)
    verify_bundle_files(files, str(directory))
    return write_bundle_files(directory, files)


def write_bundle_files(directory: str | Path, files: Mapping[str, bytes]) -> Path:
    """Write a verified bundle's files (`build_bundle_files`) into `directory` as `write_bundle` does."""
    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise BundleError(f"bundle {directory}: exists and is not a directory")
        ours = set(files) | {SIGNATURE} | {f".{name}.tmp" for name in (*files, SIGNATURE)}  # .tmp: interrupted
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in ours or not p.is_file() or p.is_symlink())
        if foreign:
            raise BundleError(f"bundle {directory}: the directory holds {', '.join(foreign)}, which are not bundle "
                              f"files; choose an empty directory or remove them")
        (directory / SIGNATURE).unlink(missing_ok=True)  # an old signature must not outlive its manifest
        (directory / MANIFEST).unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    for name in BUNDLE_FILES + (MANIFEST,) + ((SIGNATURE,) if SIGNATURE in files else ()):
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(files[name])
        os.replace(tmp, directory / name)
    return directory


def sign_bundle(directory: str | Path, sign: Signer) -> Path:
    """(Re-)sign a bundle directory's manifest, after checking the bundle is sound; returns the
    signature file. For a plan written without a key, or by another coordinator."""
    directory = Path(directory)
    files = read_bundle_files(directory)
    check_bundle_manifest(files, str(directory))
    path = directory / SIGNATURE
    tmp = directory / f".{SIGNATURE}.tmp"
    tmp.write_bytes(bytes(sign(files[MANIFEST])))
    os.replace(tmp, path)
    return path


def read_bundle_files(directory: str | Path, skip: Iterable[str] = ()) -> dict[str, bytes]:
    """Every file of a bundle directory by name (but those in `skip`, checked to be plain files all
    the same), unchecked; anything but plain files is refused."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BundleError(f"bundle {directory}: no such directory")
    files = {}
    skip = set(skip)
    for path in sorted(directory.iterdir()):
        if path.is_symlink() or not path.is_file():
            kind = "a symbolic link" if path.is_symlink() else "not a plain file"
            raise BundleError(f"bundle {directory}: {path.name} is {kind}; a bundle holds only plain files")
        if path.name not in skip:
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

    Cheap (hashing only; `CheckedFiles` compare the digests they carry): the coordinator runs it
    before shipping a bundle; `verify_bundle_files` runs it first and then parses everything."""
    if MANIFEST not in files:
        raise BundleError(f"bundle {source}: {MANIFEST} is missing (not a bundle, or its writing was interrupted)")
    manifest = _load_json(bytes(files[MANIFEST]), source, MANIFEST)
    check_header(manifest, format=BUNDLE_FORMAT, versions=BUNDLE_SCHEMA_VERSION, where=f"bundle {source}: {MANIFEST}",
                 redo="re-run `confidant plan` with this version", error=BundleError)
    if sorted(set(manifest) - {_PLAN_KEY}) != sorted(_MANIFEST_KEYS):
        raise BundleError(f"bundle {source}: {MANIFEST} has keys {sorted(manifest)}, expected "
                          f"{sorted(_MANIFEST_KEYS)} and optionally {_PLAN_KEY!r}")
    if _PLAN_KEY in manifest and not (isinstance(manifest[_PLAN_KEY], str) and SHA256.fullmatch(manifest[_PLAN_KEY])):
        raise BundleError(f"bundle {source}: {MANIFEST} plan is {manifest[_PLAN_KEY]!r:.80}, not a sha256 hex digest")
    try:
        check_device_name(manifest["device"])
    except BundleError as exc:
        raise BundleError(f"bundle {source}: {MANIFEST} {exc}") from None
    if not _is_int(manifest["stage"]) or manifest["stage"] < 0:
        raise BundleError(f"bundle {source}: {MANIFEST} stage is {manifest['stage']!r}, not an integer >= 0")
    listed = manifest["files"]
    if not isinstance(listed, dict) or not all(isinstance(v, str) and SHA256.fullmatch(v) for v in listed.values()):
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
    extra = sorted(set(files) - set(BUNDLE_FILES) - {MANIFEST, SIGNATURE})
    if extra:
        raise BundleError(f"bundle {source}: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not listed in "
                          f"{MANIFEST} (a bundle holds only its listed files; remove "
                          f"{'it' if len(extra) == 1 else 'them'} or re-run `confidant plan`)")
    carried = files.digests if isinstance(files, CheckedFiles) else {}
    for name in BUNDLE_FILES:
        data = files[name]
        got = (data.sha256 if isinstance(data, HashedTensors) else carried[name] if name in carried
               else sha256_hex(data))
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


def _parse_actions(data: bytes, source: str, stage_doc: StageDocument) -> tuple[Action, ...]:
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise BundleError(f"bundle {source}: {ACTIONS} is not ASCII text") from None
    lines = text.split("\n")
    if lines[-1] != "":
        raise BundleError(f"bundle {source}: {ACTIONS} does not end with a newline")
    actions = tuple(_stage_action(line, f"{ACTIONS} line {i}", source, stage_doc, stage_doc.microbatches)
                    for i, line in enumerate(lines[:-1], 1))
    if not any(a.kind is ActionKind.F for a in actions):
        raise BundleError(f"bundle {source}: {ACTIONS} has no forward action")
    return actions


def _stage_action(token: str, where: str, source: str, stage_doc: StageDocument, microbatches: int) -> Action:
    """One action token of this stage, talking only to its neighbours, within `microbatches`."""
    stage, stages = stage_doc.stage, stage_doc.stages
    try:
        a = Action.parse(token)
    except ValueError as exc:
        raise BundleError(f"bundle {source}: {where}: {exc}") from None
    if a.stage != stage:
        raise BundleError(f"bundle {source}: {where}: {a} is an action of stage {a.stage}, this bundle is stage {stage}")
    if a.peer is not None and (a.peer not in (stage - 1, stage + 1) or a.peer >= stages):
        raise BundleError(f"bundle {source}: {where}: {a} talks to stage {a.peer}, which is not a neighbour of "
                          f"stage {stage} of {stages}")
    if a.microbatch is not None and a.microbatch >= microbatches:
        raise BundleError(f"bundle {source}: {where}: {a} names micro-batch {a.microbatch}, the schedule has "
                          f"{microbatches}")
    return a


def _parse_steady(source: str, stage_doc: StageDocument, actions: tuple[Action, ...]):
    """stage.json's steady state, parsed: (its actions, where the drain starts), or (None, None)."""
    if stage_doc.steady is None:
        return None, None
    if stage_doc.steady.drain_at > len(actions):
        raise BundleError(f"bundle {source}: {STAGE} steady drain_at {stage_doc.steady.drain_at} is past the "
                          f"{len(actions)} actions of {ACTIONS}")
    # written with the second step's micro-batches
    steady = tuple(_stage_action(t, f"{STAGE} steady action {i}", source, stage_doc, 2 * stage_doc.microbatches)
                   for i, t in enumerate(stage_doc.steady.actions, 1))
    return steady, stage_doc.steady.drain_at


def check_bundle_signature(files: Mapping[str, bytes], source: str, check_signature: SignatureCheck) -> None:
    """Raise BundleError, with the check's reason, unless the bundle's signature passes."""
    if MANIFEST not in files:
        raise BundleError(f"bundle {source}: {MANIFEST} is missing (not a bundle, or its writing was interrupted)")
    signature = files.get(SIGNATURE)
    try:
        check_signature(bytes(files[MANIFEST]), None if signature is None else bytes(signature))
    except ValueError as exc:
        raise BundleError(f"bundle {source}: refused: {exc}") from None


def stage_document(files: Mapping[str, bytes], source: str) -> StageDocument:
    """A bundle's stage.json, parsed and checked (BundleError names the file and the fault)."""
    return StageDocument.from_json(_load_json(bytes(files[STAGE]), source, STAGE), f"bundle {source}: {STAGE}")


def verify_bundle_files(files: Mapping[str, bytes], source: str,
                        check_signature: SignatureCheck | None = None, copy: bool = True) -> BundleContents:
    """Check a bundle's bytes completely and parse them; BundleError names the file and the fault.
    With `check_signature`, the signature is checked first: nothing of an untrusted bundle is parsed.
    `copy` False: the parsed weights are read-only views onto `files`' weights bytes, not copies
    (a plan emitted in memory holds its bundles' bytes beside their parsed contents until shipped:
    copies would hold its weights twice)."""
    if check_signature is not None:
        check_bundle_signature(files, source, check_signature)
    manifest = check_bundle_manifest(files, source)
    head = _load_json(bytes(files[MANIFEST]), source, MANIFEST)
    stage_doc = stage_document(files, source)
    for key in ("device", "stage"):
        if getattr(stage_doc, key) != head[key]:
            raise BundleError(f"bundle {source}: {STAGE} says {key} {getattr(stage_doc, key)!r}, "
                              f"{MANIFEST} says {head[key]!r}")
    graph_doc = _load_json(bytes(files[GRAPH]), source, GRAPH)
    if not isinstance(graph_doc, dict) or not isinstance(graph_doc.get("constants"), dict):
        raise BundleError(f"bundle {source}: {GRAPH} is not a graph document (no constants table)")
    if isinstance(files[WEIGHTS], HashedTensors):  # assembled from pieces, hashed as it was (above)
        weights = dict(files[WEIGHTS].tensors)
    else:
        try:
            weights = decode_safetensors(files[WEIGHTS], copy=copy)
        except ValueError as exc:
            raise BundleError(f"bundle {source}: {WEIGHTS} is not valid safetensors: {exc}") from None
    try:
        declared = constant_tensor_names(graph_doc)
    except ValueError as exc:
        raise BundleError(f"bundle {source}: {GRAPH} cannot be rebuilt: {exc}") from None
    missing, extra = sorted(declared - set(weights)), sorted(set(weights) - declared)
    if missing or extra:
        raise BundleError(f"bundle {source}: {WEIGHTS} does not match {GRAPH}'s constants: "
                          f"missing {missing[:5]}, unexpected {extra[:5]}")
    try:
        graph = graph_from_json(graph_doc, weights)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"bundle {source}: {GRAPH} cannot be rebuilt: {type(exc).__name__}: {exc}") from None
    first, last = stage_doc.first_block, stage_doc.last_block
    if last >= len(graph.blocks):
        raise BundleError(f"bundle {source}: {STAGE} blocks [{first}, {last}] is outside the model's "
                          f"{len(graph.blocks)} blocks")
    if (graph.batch, graph.seq) != (stage_doc.batch, stage_doc.seq):
        raise BundleError(f"bundle {source}: {GRAPH} is bound to batch {graph.batch}, seq {graph.seq}; "
                          f"{STAGE} says batch {stage_doc.batch}, seq {stage_doc.seq}")
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
    steady, drain_at = _parse_steady(source, stage_doc, actions)
    return BundleContents(source, stage_doc, graph, actions, manifest, head.get(_PLAN_KEY), steady, drain_at)


def schedule_of_bundles(contents: "list[BundleContents] | tuple[BundleContents, ...]") -> Schedule:
    """The schedule a plan's bundles (one per stage, in order) run, with the steady state of an
    asynchronous one, verified (`verify_plan`, one step and, for an asynchronous one, two steps
    without a flush): the program the workers execute, as the coordinator must drive it."""
    first = contents[0].stage_doc
    steady = None
    if all(c.steady is not None for c in contents):
        steady = SteadyState(tuple(c.drain_at for c in contents), tuple(c.steady for c in contents))
    schedule = Schedule(first.schedule, first.stages, first.microbatches, tuple(c.actions for c in contents),
                        tuple(c.stage_doc.stash_depth for c in contents), first.update_every, steady)
    try:
        verify_plan(schedule)
        if steady is not None:
            verify_plan(schedule.for_steps(2))
    except ValueError as exc:
        raise BundleError(f"the bundles {', '.join(c.source for c in contents)} do not make one plan: {exc}") from None
    return schedule


def plan_identity(settings: Any, weights_sha256: Iterable[str]) -> str:
    """A plan's identity, named by every bundle's signed manifest and by plan.json: the SHA-256 of
    its settings (any JSON: the stages' documents and actions) and of each stage's weights file's
    SHA-256, in stage order (which covers every constant a stage holds by name, dtype, shape and
    bytes). Plans that differ in any setting or weight differ in it; the same plan written twice
    has the same one. From the weights files' digests, not the weights again: those digests go into
    the manifests anyway, so a plan's weights are hashed once when it is emitted."""
    digest = hashlib.sha256(_json_bytes(settings, sort_keys=True, indent=None))
    for sha in weights_sha256:
        digest.update(f"\0{sha}".encode("ascii"))
    return digest.hexdigest()


def manifest_plan_id(manifest_bytes: bytes, source: str) -> str | None:
    """The plan identity a manifest names (None: none)."""
    head = _load_json(manifest_bytes, source, MANIFEST)
    return head.get(_PLAN_KEY) if isinstance(head, dict) else None


def load_bundle_dir(directory: str | Path, check_signature: SignatureCheck | None = None,
                    name: str | None = None) -> BundleContents:
    """Read and verify a bundle directory. The weights file is read tensor by tensor straight into
    the arrays the graph keeps, its SHA-256 streamed as it is read (`read_safetensors_hashed`), once
    the signature (with `check_signature`) and the manifest's entries are known good: a stage's
    weights are held once, not as the file's bytes and their decoded copies at once. A weights file
    that does not parse is read whole, for verification to name the fault as it always has. `name`:
    how errors refer to the bundle (default: the directory)."""
    directory = Path(directory)
    source = name or str(directory)
    files: dict[str, Any] = read_bundle_files(directory, skip=(WEIGHTS,))
    if check_signature is not None:
        check_bundle_signature(files, source, check_signature)
    path = directory / WEIGHTS
    if path.is_file():
        try:
            files[WEIGHTS] = read_safetensors_hashed(path)
        except (OSError, ValueError):
            files[WEIGHTS] = path.read_bytes()
    return verify_bundle_files(files, source, check_signature)


# plan.json ---------------------------------------------------------------------------------------
# The plan's index, written by `planner.emit` next to the bundles. It is read here, in `ir`, because
# the coordinator (runtime, which never imports the planner) needs it as much as the command line.

PLAN = "plan.json"
# The cluster (devices, their profiles and budgets, links) the plan was made for, beside plan.json:
# what re-planning during training starts from. Optional (plans written before it stay valid);
# when present, plan.json records its SHA-256 as `cluster_sha256`.
PLAN_CLUSTER = "cluster.json"
# A model with frozen weights (LoRA's base) has them all in one file beside plan.json, whose SHA-256
# plan.json records as `base_sha256`: a device that holds a copy (`confidant worker --base FILE`)
# builds its stage's weights from it and receives only the rest (runtime.pipeline.bundles).
PLAN_BASE = "base.safetensors"
# The frozen weights that go into it: constants no stage trains, of at least this many bytes (the
# small ones, shapes and scales, are not worth a lookup).
BASE_MIN_BYTES = 4096
def base_weights(graph: Graph) -> dict[str, np.ndarray]:
    """The frozen weights of a model that has any (LoRA's base, `Block.frozen_bytes`), as the
    tensors the bundles' weights files hold them: every constant no stage trains of at least
    BASE_MIN_BYTES held, a quantized one as its storage arrays (`ir.precision.storage_tensors`,
    never widened); empty for a model that trains them all."""
    if not any(b.frozen_bytes for b in graph.blocks):
        return {}
    trained = set(graph.params)
    out: dict[str, np.ndarray] = {}
    for name, value in graph.constants.items():
        held = value.nbytes if isinstance(value, QuantizedTensor) else np.asarray(value).nbytes
        if name not in trained and held >= BASE_MIN_BYTES:
            out.update(storage_tensors(name, value))
    return out


def _short(plan_id: str | None) -> str:
    return "(none)" if plan_id is None else plan_id[:12] + "..."


def load_plan(out_dir: str | Path, verify_bundles: bool = False) -> PlanDocument:
    """plan.json of an emitted plan, validated, with each device's bundle checked to be the one the
    plan was written with (its manifest's SHA-256); `verify_bundles` also verifies each bundle fully."""
    out_dir = Path(out_dir)
    path = out_dir / PLAN
    if not path.is_file():
        raise BundleError(f"plan {out_dir}: {PLAN} is missing (run `confidant plan` first)")
    doc = PlanDocument.from_json(_load_json(path.read_bytes(), str(out_dir), PLAN), str(out_dir))
    if doc.cluster_sha256 is not None:
        cluster = out_dir / PLAN_CLUSTER
        if not cluster.is_file():
            raise BundleError(f"plan {out_dir}: {PLAN} records a {PLAN_CLUSTER}, which is missing; re-run "
                              f"`confidant plan`")
        got = sha256_hex(cluster.read_bytes())
        if got != doc.cluster_sha256:
            raise BundleError(f"plan {out_dir}: {PLAN_CLUSTER} is not the one {PLAN} was written with (sha256 "
                              f"expected {doc.cluster_sha256[:12]}..., got {got[:12]}...); re-run `confidant plan`")
    for d in doc.devices:
        manifest = out_dir / d.bundle / MANIFEST
        if not manifest.is_file():
            raise BundleError(f"plan {out_dir}: the bundle of device {d.name!r} has no "
                              f"{manifest.relative_to(out_dir)}")
        data = manifest.read_bytes()
        bound = manifest_plan_id(data, str(out_dir / d.bundle))
        if bound != doc.plan_id:
            raise BundleError(f"plan {out_dir}: bundle {d.bundle}/ belongs to another plan (its signed {MANIFEST} "
                              f"names plan {_short(bound)}, {PLAN} plan {_short(doc.plan_id)}); a plan's bundles "
                              f"are used only together: re-run `confidant plan`")
        got = sha256_hex(data)
        if got != d.manifest_sha256:
            raise BundleError(f"plan {out_dir}: bundle {d.bundle}/ is not the one {PLAN} was written with "
                              f"({MANIFEST} sha256 expected {d.manifest_sha256[:12]}..., got {got[:12]}...); "
                              f"re-run `confidant plan`")
        if verify_bundles:
            contents = load_bundle_dir(out_dir / d.bundle)
            if (contents.stage, contents.first_block, contents.last_block) != (d.stage, d.first_block, d.last_block):
                raise BundleError(f"plan {out_dir}: bundle {d.bundle}/ is stage {contents.stage} blocks "
                                  f"{[contents.first_block, contents.last_block]}, {PLAN} says stage {d.stage} "
                                  f"blocks {list(d.blocks)}")
    return doc


@dataclass(eq=False)
class LoadedPlan:
    """A plan read and verified once, to be shipped as it is: plan.json's document, each device's
    bundle files as read (what the coordinator sends the workers, byte for byte), those bundles
    parsed (verified), and the schedule they make (verified, steady state included). Nothing of
    the folder is read or decoded again for the run. `directory` None: a plan emitted in memory
    (`planner.emit.emit_in_memory`), never written.

    Once shipped, the bytes and the parsed bundles are let go (`release`; the coordinator empties
    each bundle's files as it sends them): a model's worth of bytes is not held for the whole run.
    What a later recovery needs is read from the folder again (and verified again) or comes from
    the workers."""

    directory: Path | None
    plan: PlanDocument
    files: tuple[dict[str, bytes], ...]
    contents: tuple[BundleContents, ...]
    schedule: Schedule

    @property
    def devices(self) -> list[str]:
        return self.plan.device_names

    def check_signatures(self, check_signature: SignatureCheck) -> None:
        """BundleError unless every bundle is signed as `check_signature` wants (its manifest only:
        the manifest names every other file's hash, checked when the plan was loaded)."""
        for d, files in zip(self.plan.devices, self.files):
            where = d.bundle if self.directory is None else str(self.directory / d.bundle)
            check_bundle_signature(files, where, check_signature)

    def release(self) -> None:
        """Let the bundles' bytes and parsed contents go (they have been shipped); the document and
        the schedule stay."""
        for files in self.files:
            files.clear()
        self.files, self.contents = (), ()

    @property
    def released(self) -> bool:
        return not any(self.files) and not self.contents


def load_plan_folder(out_dir: str | Path) -> LoadedPlan:
    """`load_plan` (plan.json, its cluster.json, each bundle bound to the plan), then each bundle's
    files read once and verified, and the plan's schedule from them (`schedule_of_bundles`)."""
    out_dir = Path(out_dir)
    plan = load_plan(out_dir)
    files, contents = [], []
    for d in plan.devices:
        where = out_dir / d.bundle
        read = read_bundle_files(where)
        got = sha256_hex(read[MANIFEST]) if MANIFEST in read else None
        if got != d.manifest_sha256:  # changed since load_plan looked
            raise BundleError(f"plan {out_dir}: bundle {d.bundle}/ is not the one {PLAN} was written with; re-run "
                              f"`confidant plan`")
        c = verify_bundle_files(read, str(where))
        if (c.stage, c.first_block, c.last_block) != (d.stage, d.first_block, d.last_block):
            raise BundleError(f"plan {out_dir}: bundle {d.bundle}/ is stage {c.stage} blocks "
                              f"{[c.first_block, c.last_block]}, {PLAN} says stage {d.stage} blocks {list(d.blocks)}")
        files.append(CheckedFiles(read, c.manifest))  # hashed once: shipping it compares the digests
        contents.append(c)
    return LoadedPlan(out_dir, plan, tuple(files), tuple(contents), schedule_of_bundles(contents))
