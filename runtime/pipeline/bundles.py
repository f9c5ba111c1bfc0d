"""The device side of plan bundles: load one from disk or from the wire, verified before any use.

A worker gets its bundle either as a directory (copied to the device) or from the coordinator over
the transport, each file as its size (an int64 tensor of kind "bundle", stage -1, micro-batch = its
position, named by its file name) and then its bytes in chunks of `BUNDLE_CHUNK_BYTES` (uint8 tensors
of kind "bundle_chunk", micro-batch = the chunk's index, the last shorter), so that the receiver can
write a weights file to its spool file as it arrives (`recv_bundle_files(spool=)`) and never hold it
whole (before, one message per file: a one-stage SmolLM2 worker without the base file peaked at
692 MiB setting up, its plan 423, 515 MiB of them the weights file held whole before it was spooled;
MEMORY_NOTES, h168). The receiver answers every `BUNDLE_WINDOW_CHUNKS` chunks written with a
"bundle_took" control message and the sender keeps at most two windows unanswered, so a sender
faster than the receiver's disk does not queue the file in the receiver's ZeroMQ pipe instead.
A chunk of another size, index or name than the announced size makes is refused by the transport
(`runtime.transport.wire.MessageError`, one line naming what was expected and what came); nothing
received is used before the verification below. Both paths end in `ir.bundle.verify_bundle_files` on the bytes, the same
check the planner ran when it wrote the bundle, so a worker refuses a damaged, incomplete, foreign
or stale bundle with an error naming the bundle, the file and the fault, before building anything.

The coordinator side: `bundle_to_wire` reads a bundle directory and checks its manifest and hashes
(it does not ship a bundle the planner would not recognise); `send_bundle` ships it.

Base weights held on the device (a plan with frozen weights, LoRA's: `ir.bundle.PLAN_BASE`): the
coordinator offers to leave out the stage's frozen weights, named, with the base file's SHA-256; a
worker started with a file of that SHA-256 (`confidant worker --base FILE`) accepts, receives
weights.safetensors without them (as `REST`), and takes its tensors from the two
(`rebuild_weights`), hashing them in the file's order without putting the file together. They then
go through the same verification as ever: that hash must be what the signed manifest says, so a
wrong or damaged base file is refused like a damaged bundle. A quantized base is in both files at
its storage precision (`ir.precision.storage_tensors`): nothing is widened on the way.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ir.bundle import (BUNDLE_FILES, MANIFEST, PLAN_BASE, SIGNATURE, WEIGHTS, BundleContents, BundleError,
                       SignatureCheck, check_bundle_manifest, load_bundle_dir, load_plan,
                       read_bundle_files, verify_bundle_files)
from ir.documents import PlanDocument
from ir.mapped_pages import RELEASE_EVERY, drop_mapped_pages
from ir.safetensors import (HashedTensors, assemble_safetensors, decode_safetensors, encode_safetensors, hash_tensors, load_safetensors_subset,
                            read_safetensors_hashed, safetensors_names)
from runtime.transport.wire import MAX_PAYLOAD_BYTES, Expected

__all__ = ["BUNDLE_KIND", "REST", "BaseWeights", "BundleContents", "BundleError", "load_bundle", "bundle_to_wire",
           "as_uint8", "wire_to_files", "send_bundle", "recv_bundle", "recv_bundle_files", "load_plan", "plan_base",
           "split_weights", "rebuild_weights", "held_offer", "without_tensors", "weights_tensors", "spool_weights", "file_bytes", "file_size",
           "BUNDLE_CHUNK_KIND", "BUNDLE_CHUNK_BYTES", "BUNDLE_WINDOW_CHUNKS", "SpooledFile", "send_bundle_file"]

BUNDLE_KIND = "bundle"
BUNDLE_CHUNK_KIND = "bundle_chunk"
# What a receiver holds of a file in flight: a chunk (4 frames of the wire's 1 MiB), and at most two windows of
# them unanswered in its queues (32 MiB), against a stage's weights file of hundreds of MiB.
BUNDLE_CHUNK_BYTES = 4 << 20
BUNDLE_WINDOW_CHUNKS = 4
TOOK = "bundle_took"
# Which names a sender may announce: the bundle's files, plus room for the unexpected ones that
# verification will then refuse by name, but not an unbounded list.
_MAX_WIRE_FILES = 2 * (len(BUNDLE_FILES) + 2)


# weights.safetensors less the tensors a device takes from its base file, as the wire names it
REST = "weights.rest.safetensors"


@dataclass(frozen=True)
class SpooledFile:
    """A received bundle file written to `file` as it arrived (`recv_bundle_files(spool=)`), `nbytes` long."""

    file: object
    nbytes: int


@dataclass(frozen=True)
class BaseWeights:
    """A plan's base weights file: its SHA-256 and the tensors it holds."""

    sha256: str
    names: frozenset[str]


def plan_base(plan_dir: str | Path, plan: PlanDocument) -> BaseWeights | None:
    """The base weights of the plan at `plan_dir` (None when it has none, or the file is gone:
    then every stage gets its whole bundle, as before)."""
    path = Path(plan_dir) / PLAN_BASE
    if plan.base_sha256 is None or not path.is_file():
        return None
    try:
        return BaseWeights(plan.base_sha256, frozenset(safetensors_names(path)))
    except ValueError as exc:
        raise BundleError(f"plan {plan_dir}: {PLAN_BASE} is not valid safetensors: {exc}") from None


def split_weights(files: Mapping[str, bytes], base: BaseWeights) -> tuple[list[str], bytes]:
    """(the names of a bundle's weights that its base file holds, weights.safetensors without them)."""
    data = files[WEIGHTS]
    weights = dict(data.tensors) if isinstance(data, HashedTensors) else decode_safetensors(data)
    local = sorted(n for n in weights if n in base.names)
    return local, encode_safetensors({n: v for n, v in weights.items() if n not in set(local)})


def weights_tensors(data) -> dict[str, np.ndarray]:
    """A bundle's weights file (its bytes, or its hashed tensors) as its tensors, no copy made."""
    return dict(data.tensors) if isinstance(data, HashedTensors) else decode_safetensors(data, copy=False)


def held_offer(data, trainable) -> dict[str, list]:
    """What a setup offers a worker that may hold some of a bundle's weights from its last setup
    (runtime.pipeline.held_weights): every tensor of the weights file that training does not
    change (not in `trainable`), by name, as [dtype, shape]."""
    from runtime.pipeline.held_weights import tensor_form

    return {name: tensor_form(arr) for name, arr in weights_tensors(data).items() if name not in trainable}


def without_tensors(data, names) -> bytes:
    """The weights file `data` (bytes or hashed tensors) less the tensors `names`, as bytes; a
    tensor mapped from the model file is given back once copied (`ir.mapped_pages`)."""
    tensors = weights_tensors(data)
    left = set(names)
    rest = encode_safetensors({n: v for n, v in tensors.items() if n not in left})
    drop_mapped_pages(tensors.values())
    return rest


def rebuild_weights(rest: bytes | memoryview, base_path: str | Path, local: Sequence[str],
                    mapped: bool = False) -> HashedTensors:
    """weights.safetensors's tensors from `rest` and the tensors `local` read from the base file,
    with the SHA-256 of the file they make, hashed tensor by tensor (`ir.safetensors.hash_tensors`):
    the file itself is never put together, and each tensor is read once, at its storage precision.
    BundleError when the two do not make one set of weights; the manifest's check of the hash
    (`verify_bundle_files`) then covers every byte, the rest's and the base file's alike.

    `mapped` (a stage that reads its float32 frozen base a block at a time, `ir.documents.maps_frozen_base`):
    the base file's float32 tensors are read-only views onto a mapping of it, not read into memory, their
    pages given back as the hash reads them; the engine then reads them in place a few blocks at a time, as
    train-local's does over a mapped model file (a quantized base's pieces are read as before)."""
    try:
        tensors = decode_safetensors(rest)
    except ValueError as exc:
        raise BundleError(f"{REST} is not valid safetensors: {exc}") from None
    both = sorted(set(tensors) & set(local))
    if both:
        raise BundleError(f"{REST} holds {both[0]!r}, which the coordinator said comes from the base file")
    try:
        tensors.update(load_safetensors_subset(base_path, local, mapped=local if mapped else ()))
    except (OSError, ValueError) as exc:
        raise BundleError(f"the base weights file {exc}") from None
    return hash_tensors(tensors, give_back=mapped)


def spool_weights(files: dict, source: str, check_signature: SignatureCheck | None = None,
                  directory: str | Path | None = None, held=None, local: Sequence[str] = (),
                  extra=None, mapped: Sequence[str] = ()) -> None:
    """Replace the received weights file in `files` (its bytes, the only reference to them) by its
    tensors, by way of a file: the bytes are written out and let go, then each tensor is read
    straight into its own array and the file's SHA-256 streamed as it is read
    (`ir.safetensors.read_safetensors_hashed`), so a worker never holds the received file and its
    decoded copies at once (a stage's weights twice: the setup's peak). `check_signature` is
    checked first (nothing of an untrusted bundle is parsed); a file that does not parse is
    left as its bytes, for `load_bundle`'s verification to name the fault as ever. The spool file
    (under `directory`, default the system's temporary folder) is gone on return.

    With `held` (a worker's `runtime.pipeline.held_weights.HeldWeights`) the file is written into it
    instead and kept there for a later setup; `local` then names the tensors taken from what it
    kept before, and the file received is `REST`, the weights less those and less `extra` (tensors
    the caller read elsewhere: `HeldWeights.take`). `mapped`: the received float32 tensors of those
    names are views onto a mapping of the kept file (`HeldWeights.take`), not read into memory.
    A file received straight into its spool file (`SpooledFile`, from `held.new_file()`) is taken as it is."""
    received = REST if local or extra else WEIGHTS
    if received not in files or isinstance(files[received], HashedTensors):
        return
    if check_signature is not None:
        from ir.bundle import check_bundle_signature

        check_bundle_signature(wire_to_files({k: v for k, v in files.items() if k != received}), source,
                               check_signature)
    data = files.pop(received)
    if held is not None:
        if isinstance(data, SpooledFile):
            kept = data.file
        else:
            try:
                kept = held.new_file()
            except OSError:  # no writable folder: the caller decides what to do with the bytes, left in `files`
                files[received] = data
                raise
            held.write(kept, data)  # bytes, or a received 1-D uint8 array: its own buffer, not a copy
        del data  # the only reference: let go before the weights are read back
        try:
            files[WEIGHTS] = held.take(kept, local, extra, mapped=mapped)
        except (OSError, ValueError) as exc:
            own = f" (with {len(local)} of its weights this worker's own, kept from its last setup)" if local else ""
            raise BundleError(f"bundle {source}: {received}{own}: {exc}") from None
        return
    if isinstance(data, SpooledFile):
        raise ValueError(f"bundle {source}: {received} was spooled by the receiver; pass the `held` it came from")
    with tempfile.TemporaryDirectory(prefix="confidant-weights-", dir=directory) as folder:
        path = Path(folder) / WEIGHTS
        with open(path, "wb") as f:
            f.write(data)  # bytes, or a received 1-D uint8 array: its own buffer, not a copy
        del data
        try:
            files[WEIGHTS] = read_safetensors_hashed(path)
        except ValueError:
            files[WEIGHTS] = path.read_bytes()


def as_uint8(data: bytes) -> np.ndarray:
    """`data` as a read-only 1-D uint8 array, without a copy: what `Transport.send_tensor` ships."""
    arr = np.frombuffer(data, dtype=np.uint8)
    arr.flags.writeable = False
    return arr


def wire_to_files(arrays: Mapping[str, np.ndarray | bytes]) -> dict[str, bytes | memoryview]:
    """Received uint8 tensors (or bytes) back to file bytes by name: a received array's own
    (read-only) buffer, not a copy, since a stage's weights file can be hundreds of MB."""
    files = {}
    for name, value in arrays.items():
        if isinstance(value, HashedTensors):  # weights assembled on this device (rebuild_weights)
            files[name] = value
            continue
        if isinstance(value, (bytes, bytearray, memoryview)):
            files[name] = bytes(value)
            continue
        arr = np.asarray(value)
        if arr.dtype != np.uint8 or arr.ndim != 1:
            raise BundleError(f"bundle file {name!r} arrived as {arr.dtype}{list(arr.shape)}, not 1-D uint8 bytes")
        files[name] = memoryview(np.ascontiguousarray(arr))
    return files


def load_bundle(source: str | Path | Mapping[str, bytes | np.ndarray], name: str | None = None,
                check_signature: SignatureCheck | None = None) -> BundleContents:
    """Verify and parse a bundle given as a directory or as its files' bytes (or uint8 arrays) by name;
    with `check_signature` (`runtime.keys.verifier` of the trusted coordinator key) a bundle it does
    not sign is refused before anything else is read.

    `name` is how errors refer to the bundle (default: the directory, or '<memory>')."""
    if isinstance(source, (str, Path)):
        # the weights read tensor by tensor, the file's bytes never held beside them
        return load_bundle_dir(source, check_signature, name)
    return verify_bundle_files(wire_to_files(source), name or "<memory>", check_signature)


def bundle_to_wire(directory: str | Path | Mapping[str, bytes]) -> dict[str, bytes]:
    """A bundle's files, manifest first (its signature, if any, last), after checking the manifest
    and every hash: a bundle directory's, or a bundle in memory (file name -> bytes, as
    `planner.emit.emit_in_memory` makes it)."""
    if isinstance(directory, (str, Path)):
        files = read_bundle_files(directory)
    else:
        files, directory = directory, "<memory>"
    # a plan emitted or read in this process carries its files' digests (CheckedFiles): compared,
    # not hashed again
    check_bundle_manifest(files, str(directory))
    signature = {SIGNATURE: files[SIGNATURE]} if SIGNATURE in files else {}
    return {MANIFEST: files[MANIFEST], **{k: files[k] for k in BUNDLE_FILES}, **signature}


def file_bytes(data) -> bytes | bytearray:
    """A bundle file's bytes: a weights file left as its hashed tensors (`planner.emit`'s deferred
    bundles, `ir.safetensors.HashedTensors`) is put together now, the one copy of it, bytes for
    which its SHA-256 stands (`hash_tensors` hashes exactly what `encode_safetensors` writes).
    Tensors mapped from the model file are given back as they are read (`ir.mapped_pages`, every
    RELEASE_EVERY bytes copied): the coordinator holds one stage's weights file while it ships it,
    not that stage's pages of the model file besides."""
    if not isinstance(data, HashedTensors):
        return data
    released = [0]

    def release(copied: int) -> None:
        if copied - released[0] >= RELEASE_EVERY:
            drop_mapped_pages(data.tensors.values())
            released[0] = copied

    out = assemble_safetensors(data.tensors, after_each=release)
    drop_mapped_pages(data.tensors.values())
    return out


def file_size(data) -> int:
    return int(data.nbytes) if isinstance(data, HashedTensors) else len(data)


def send_bundle(transport, peer: str, directory: str | Path | Mapping[str, bytes], await_took=None) -> list[str]:
    """Ship a checked bundle (a directory, or `bundle_to_wire`'s files) to `peer`, each file as its size and
    its chunks (`send_bundle_file`); returns the file names in the order sent, which the receiver needs
    (send them in the setup control message). A weights file given as its tensors is put together here, as
    it is sent, and this returns once the transport has let go of it (`Transport.wait_sent`): a setup that
    ships stage after stage holds one stage's weights file at a time, not the last one still queued
    beside the next one being put together (issue 32: a 2-stage SmolLM2 setup peaked at 1039 MiB
    on the coordinator, three stage-sized buffers, against 600 MiB on its largest worker).
    `await_took()` returns the receiver's next "bundle_took" answer (default: the transport's next
    control message from `peer`; the coordinator's own wait, which also watches for lost workers)."""
    files = bundle_to_wire(directory) if isinstance(directory, (str, Path)) else directory
    built = False
    for i, (name, data) in enumerate(files.items()):
        built = built or isinstance(data, HashedTensors)
        data = file_bytes(data)
        send_bundle_file(transport, peer, i, name, data, await_took)
        del data
    if built:
        transport.wait_sent(peer)
    return list(files)


def send_bundle_file(transport, peer: str, position: int, name: str, data, await_took=None) -> None:
    """One bundle file to `peer`: its size, then its bytes in chunks (views of `data`, never a copy of it),
    at most two windows of `BUNDLE_WINDOW_CHUNKS` chunks ahead of the receiver's "bundle_took" answers."""
    payload = as_uint8(data)
    if await_took is None:
        def await_took():
            return transport.recv_control(peer, timeout=None)[1]
    transport.send_tensor(peer, BUNDLE_KIND, -1, position, np.array([payload.size], np.int64), name=name)
    for j, start in enumerate(range(0, payload.size, BUNDLE_CHUNK_BYTES)):
        if j >= 2 * BUNDLE_WINDOW_CHUNKS and j % BUNDLE_WINDOW_CHUNKS == 0:
            took = await_took()
            want = (j - BUNDLE_WINDOW_CHUNKS) * BUNDLE_CHUNK_BYTES
            if not (isinstance(took, dict) and took.get("type") == TOOK and took.get("file") == name
                    and took.get("bytes") == want):
                raise BundleError(f"{peer} answered {name}'s chunks with {took!r:.120}, not "
                                  f"{{'type': {TOOK!r}, 'file': {name!r}, 'bytes': {want}}}")
        transport.send_tensor(peer, BUNDLE_CHUNK_KIND, -1, j, payload[start:start + BUNDLE_CHUNK_BYTES], name=name)
    del payload


def recv_bundle(transport, peer: str, names: Sequence[str], source: str | None = None,
                timeout: float | None = None, check_signature: SignatureCheck | None = None) -> BundleContents:
    """Receive the files `names` (in order) from `peer` and verify them; nothing is used before."""
    return load_bundle(recv_bundle_files(transport, peer, names, source, timeout), source or f"from {peer}",
                       check_signature)


def recv_bundle_files(transport, peer: str, names: Sequence[str], source: str | None = None,
                      timeout: float | None = None, receive=None, spool=None, took=None) -> dict[str, object]:
    """The files `names` (in order) from `peer`, unverified: `load_bundle` must check them.
    `receive(expected)` takes each message (default: `transport.recv_tensor` with `timeout`); a worker
    passes one that also watches for its coordinator's stop. `spool(name)`: a writable file (unbuffered,
    empty) to write that file into as its chunks arrive, or None to hold it in memory: such a file
    comes back as a `SpooledFile`, the others as 1-D uint8 arrays. `took(message)` sends the sender its
    "bundle_took" answers (default: a control message to `peer`)."""
    names = list(names)
    where = f"bundle {source or 'from ' + peer}"
    if not names or len(names) > _MAX_WIRE_FILES or not all(isinstance(n, str) for n in names) \
            or len(set(names)) != len(names):
        raise BundleError(f"{where}: announced files {names!r} are not a list of "
                          f"1 to {_MAX_WIRE_FILES} distinct names")
    if receive is None:
        def receive(expected):
            return transport.recv_tensor(peer, expected, timeout=timeout)[1]
    if took is None:
        def took(message):
            transport.send_control(peer, message)
    files = {}
    try:
        for i, name in enumerate(names):
            size = receive(Expected(kind=BUNDLE_KIND, stage=-1, microbatch=i, dtype="int64", shape=(1,), name=name))
            nbytes = int(size[0])
            if not 0 <= nbytes <= MAX_PAYLOAD_BYTES:
                raise BundleError(f"{where}: {name} announced as {nbytes} bytes, not 0 to {MAX_PAYLOAD_BYTES}")
            out = spool(name) if spool is not None else None
            files[name] = SpooledFile(out, nbytes) if out is not None else np.empty(nbytes, np.uint8)
            chunks = -(-nbytes // BUNDLE_CHUNK_BYTES)
            for j, start in enumerate(range(0, nbytes, BUNDLE_CHUNK_BYTES)):
                length = min(BUNDLE_CHUNK_BYTES, nbytes - start)
                chunk = receive(Expected(kind=BUNDLE_CHUNK_KIND, stage=-1, microbatch=j, dtype="uint8",
                                         shape=(length,), name=name))
                if out is None:
                    files[name][start:start + length] = chunk
                else:
                    _write_all(out, chunk)
                del chunk
                if j + 1 + BUNDLE_WINDOW_CHUNKS < chunks and (j + 1) % BUNDLE_WINDOW_CHUNKS == 0:
                    took({"type": TOOK, "file": name, "bytes": start + length})
            if out is None:
                files[name].flags.writeable = False
    except BaseException:
        for data in files.values():
            if isinstance(data, SpooledFile):
                data.file.close()
        raise
    return files


def _write_all(file, data) -> None:
    """All of `data` into `file`, unbuffered writes resumed where the system cut them short."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += file.write(view[done:])
