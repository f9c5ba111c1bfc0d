"""A device's runtime: bind, wait for a stage from the coordinator, run its bundle's action lists, report.

Protocol (JSON control messages; tensors as header + raw bytes, see runtime.transport.wire):
  coordinator -> worker  setup_bundle {stage, device, peers, bundle_files, optimizer_state, ...}
  worker -> coordinator  bundle_wants {stage, base?, held?}: every setup answered before any of the
                         bundle comes (what of its weights this worker holds, where offered); a
                         worker of another protocol version answers with its error instead
                         (runtime.transport.wire: ProtocolMismatch), and the run stops there
  coordinator -> worker  then per file a "bundle" tensor (its size) and its "bundle_chunk" tensors
                         (and "optstate" tensors on resume): the stage's graph slice, weights, engine,
                         optimizer and actions all come from the bundle, verified (and its signature
                         checked) before any use; the weights file is written to the file it is kept in
                         as it arrives (runtime.pipeline.bundles)
  worker -> coordinator  bundle_took {stage, file, bytes}: every few chunks of a large file, so that
                         the coordinator keeps at most two windows of them unanswered
  worker -> coordinator  ready {stage, pid, rss}
  coordinator -> worker  run {step, steps} ... and "batch" tensors for each micro-batch: the worker
                         runs its bundle's actions (for `steps` steps without a flush, an
                         asynchronous schedule's steady state unrolled); no action comes at run time
  worker -> coordinator  "loss" tensors (last stage), then done {stats, version, rss}
  coordinator -> worker  checkpoint  ->  worker sends "ckpt" tensors, then checkpoint_done {names, total,
                         rows, state_bytes}; with {first, start, bytes}: one window of them, chunks of
                         at most 1 MiB from element start of tensor first, at most `bytes` bytes (and at
                         most snapshots.FETCH_WINDOW_BYTES), the answer adding {parts, shapes, next}
  coordinator -> worker  snapshot {sid, holder, keep, spread_s}: copy the stage's state now and ship
                         it to the holder stage while the next step runs (runtime.pipeline.snapshots);
                         no answer (the coordinator does not wait); the holder, once it has the whole
                         copy, sends replica_held {stage, of, sid}
  coordinator -> worker  snapshot_keep {keep: [sids]}: drop every other snapshot copy (a newer one is
                         confirmed)
  coordinator -> worker  snapshot_send {sid, of: [stages], first, start, bytes} (after a loss): send one
                         window of the copies of snapshot sid of those stages (its own, or replicas
                         held) as "held" chunks, as checkpoint does, each copy's followed by held_done
                         {of, sid, first, start, parts, shapes, names, total, next, rows} (or {of, sid,
                         missing: true})
  coordinator -> worker  setup_bundle again (re-planning, at a flush boundary): the old stage is
                         dropped and the new one built from the new plan's bundle; the peers in
                         it replace the old neighbours
  coordinator -> worker  release: drop the stage (engine, weights, optimizer) and give up the name
  worker -> coordinator  released {stage}, the last message under the old name; then the worker
                         closes every outgoing connection and waits, nameless, for a setup under
                         any stage index (a re-plan that renumbers it) or for stop
  coordinator -> worker  reset: drop the stage but keep the name (and the connections)
  coordinator -> worker  abort {step, lost: [stage names]} (a device was lost mid-step): the worker
                         drops the step in flight (it notices while waiting for any message),
                         sends each live neighbour a fence, takes the neighbours' fences (so no
                         tensor of the aborted step is left to be mistaken for one of the next),
                         then answers aborted {stage, step}; the coordinator then restores every
                         stage from the state it holds (a re-plan over the survivors)
  coordinator -> worker  hello {reply_to, name} (the coordinator lost this worker and calls it back; it
                         waits in the queue of a new connection until the device is back): the worker
                         drops any stage left from before (a frozen device that thawed still holds
                         one), answers here {pid, rss, memory, battery} under the name the hello gives
                         (the coordinator admits its key under that name only) and waits,
                         nameless, for a setup (which closes that connection first) or stop
  coordinator -> worker  eval_forward {microbatches, end, until_block} (after training: an evaluation on
                         the trained weights, StageExecutor.forward_only), then "eval_batch" tensors
                         per micro-batch (and "eval_at" to stage `end` with until_block): forward
                         only, "eval_act" from stage to stage, stage `end` sending "eval_loss" or
                         "eval_next" tensors; each stage up to `end` answers eval_done {stage,
                         seconds, peak_rss_bytes}
  coordinator -> worker  stop {reason} (also read while a stage waits for a neighbour in the middle of a
                         step or a setup: one lost under --on-failure stop sends nothing more, so the
                         worker says so in one line, with the reason, and exits 0 there, as it does on a
                         stop between steps; `reason`, one printable line of at most
                         STOP_REASON_CHARS, is optional: a coordinator before it sent none)
Any failure is reported as error {stage, message} before the worker exits non-zero, so the
coordinator can name the device and the cause instead of timing out.

Trust: the worker knows its coordinator's public key from the start (`--keys DIR`:
coordinator.pub) and accepts nothing from anyone else until a setup (over that authenticated
link) names the neighbours and their keys; a bundle must be signed by that same key. A worker whose
coordinator is lost (its heartbeats stop) drops its stage and waits, nameless, for a coordinator
again, deaf to that coordinator's old connections (one that was frozen and thaws is ignored, not
obeyed: this worker no longer holds the stage its orders are for); one started by a coordinator as
a local process dies with it (`watch_parent`).

A worker's transport name is its stage ("stage<k>"): neighbours and the coordinator tell its
messages apart by it. A setup under another stage index than the one the worker holds is refused
unless it released its name first, so two processes never speak under one name (see
runtime.transport.zeromq on how a name changes hands).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ir.plan import unroll
from runtime.engines.factory import make_engine
from runtime.engines.single import import_engine
from runtime.pipeline.snapshots import (FETCH_WINDOW_BYTES, StateCopies, WindowEntry, row_shapes, send_window,
                                         state_tensors)
from runtime.pipeline.executor import COORDINATOR, StepAborted, StageExecutor, stage_peer
from runtime.pipeline.checkpoints import ROW_IDS
from runtime.pipeline.held_weights import HeldWeights, check_offer
from runtime.pipeline.kept_state import load_moments, moments_digest, read_writable, select_entries
from runtime.optim import make_optimizer
from runtime.engines.stage import stage_spec
from runtime.procfs import device_state, peak_rss_bytes, reset_peak_rss, rss_bytes
from runtime.transport.wire import Expected, PeerTimeout, ProtocolMismatch

# How often a worker waiting for the coordinator looks whether it is still there, and how long its
# link must stay down before the stage is dropped: far longer than the coordinator takes to find a
# lost worker, since a worker that gives up too early loses a run that was only slow (local workers
# end with their coordinator at once anyway, `watch_parent`).
_LIVENESS_POLL_S = 0.5
COORDINATOR_GRACE_S = 30.0


class StopOrdered(Exception):
    """The coordinator said stop while this worker was being set up, or waited for a neighbour in
    the middle of a step."""


# The longest reason a stop order may carry: the coordinator cuts a longer one (`stop_order`), a worker
# refuses one that is longer or not a line of printable text (`stop_reason`), as it refuses any order
# whose fields are not what they should be
STOP_REASON_CHARS = 400


def stop_order(reason: str) -> dict:
    """The coordinator's stop order, saying why the run stops (the stage lost, "the run ended"...), in one
    line of at most STOP_REASON_CHARS characters."""
    reason = "".join(c if c.isprintable() else " " for c in " ".join(reason.split())) or "no reason given"
    if len(reason) > STOP_REASON_CHARS:
        reason = reason[:STOP_REASON_CHARS - 3] + "..."
    return {"type": "stop", "reason": reason}


def stop_reason(msg: dict) -> str | None:
    """Why a stop order stops the run; None from a coordinator that does not say (one before reasons)."""
    reason = msg.get("reason")
    if reason is not None and not (isinstance(reason, str) and reason.isprintable()
                                   and 0 < len(reason) <= STOP_REASON_CHARS):
        raise ValueError(f"stop: expected reason a line of at most {STOP_REASON_CHARS} printable characters, got "
                         f"{msg!r:.120}")
    return reason


def _because(msg: dict) -> str:
    """A stop order's reason as a stopped worker's line says it: ": REASON", or nothing."""
    reason = stop_reason(msg)
    return f": {reason}" if reason is not None else ""


class CoordinatorLost(RuntimeError):
    """The coordinator's link is down (killed, frozen or unreachable): the stage is dropped."""


class Worker:
    """`trusted` is the coordinator's public key (runtime.keys.PublicKey): bundles must be signed
    by it, and the link to the coordinator is authenticated with it. None: an insecure worker,
    which checks no signature."""

    def __init__(self, transport, timeout: float = 600.0, trusted=None, base_files=None):
        self.transport = transport
        self.timeout = timeout
        self.trusted = trusted
        # base weights files this device holds (`--base FILE`): SHA-256 -> path
        self.base_files = dict(base_files or {})
        # the weights file of the last setup, kept on disk: a later setup (a recovery's) takes the
        # tensors of it the coordinator offers instead of receiving them again (runtime.pipeline.held_weights)
        self.held = HeldWeights()
        self.stage: int | None = None
        self.executor: StageExecutor | None = None
        self.doing = "no order"  # the order being carried out, as a stop in the middle of it names it
        # the bundle's program: (one-step actions, steady-state actions or None, drain position, micro-batches)
        self.bundle_actions: tuple | None = None
        self.device: str | None = None  # the plan's name of this device, from its bundle
        # snapshot copies: this stage's own and the replicas it holds for a neighbour
        self.copies = StateCopies(transport, lambda msg: self.transport.send_control(COORDINATOR, msg))
        # this stage's own snapshot copies (sid -> SpooledCopy) kept through a reset until the next
        # setup is done: a recovery's setup reads its unmoved blocks' optimizer state from the
        # restored one (`own_state`, runtime.pipeline.kept_state), not from the coordinator
        self.kept_own: dict = {}

    def _interrupt(self) -> None:
        """While a stage waits for a neighbour: stop when the coordinator aborted the step, stopped the
        run (a neighbour was lost under --on-failure stop, or failed: what this stage waits for will
        never come), or is gone."""
        self._take_in_copies()  # a neighbour's snapshot copy is filed while this stage has nothing to do
        pending = self.transport.peek_control(COORDINATOR)
        if pending is not None and pending.get("type") == "abort":
            raise StepAborted(f"stage {self.stage}: step {pending.get('step')} aborted by the coordinator")
        if pending is not None and pending.get("type") == "stop":
            raise StopOrdered(f"stage {self.stage}: the coordinator stopped the run in the middle of {self.doing}"
                              f"{_because(pending)}; exiting")
        if pending is not None and pending.get("type") == "hello":  # thawed: the pipeline went on without us
            raise StepAborted(f"stage {self.stage}: the coordinator lost this worker and calls it back")
        self._check_coordinator()

    def _check_coordinator(self) -> None:
        lost = self.transport.lost_peers(grace_s=COORDINATOR_GRACE_S).get(COORDINATOR)
        if lost is not None and lost.was_up:
            raise CoordinatorLost(f"the coordinator at {lost.address} is lost: {lost.reason}")

    def _recv_tensors(self, kind: str, names: list[str]) -> dict[str, np.ndarray]:
        return {name: self._from_coordinator(Expected(kind=kind, stage=-1, microbatch=i, name=name))
                for i, name in enumerate(names)}

    def _from_coordinator(self, expected: Expected) -> np.ndarray:
        """A setup's tensor from the coordinator. While it waits, a stop the coordinator sent instead
        (another worker failed, the run ends) ends this worker at once rather than after `timeout`."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.transport.recv_tensor(COORDINATOR, expected, timeout=_LIVENESS_POLL_S)[1]
            except PeerTimeout:
                pending = self.transport.peek_control(COORDINATOR)
                if pending is not None and pending.get("type") == "stop":
                    raise StopOrdered(f"the coordinator stopped the run during this setup{_because(pending)}") from None
                self._check_coordinator()
                if time.monotonic() >= deadline:
                    raise

    def reset(self) -> None:
        """Drop the stage this worker ran (engine, weights, optimizer state, buffers) before a new
        setup; only the name stays (`release` gives that up too)."""
        close = getattr(self.executor.engine, "close", None) if self.executor is not None else None
        if close is not None:  # a head-split engine's backend processes
            close()
        self.kept_own.update(self.copies.detach_own())
        self.copies.drop()
        self.executor = None
        self.bundle_actions = None
        self.device = None

    def _close_kept(self) -> None:
        for copy in self.kept_own.values():
            copy.close()
        self.kept_own.clear()

    def release(self) -> None:
        """Drop the stage and give up the name: acknowledge under the old name (the coordinator
        waits for this before anyone else takes it), then close every outgoing connection."""
        if self.stage is None:
            raise RuntimeError("release, but this worker holds no stage name (never set up, or already released)")
        self.reset()
        self.transport.send_control(COORDINATOR, {"type": "released", "stage": self.stage})
        for peer in list(getattr(self.transport, "peers", {})):
            self.transport.disconnect(peer)
        self.stage = None

    def _take_stage(self, stage: int) -> None:
        """Become stage `stage`: a nameless worker (new, or released by a re-plan) takes the name
        now; one that holds a name keeps it, since peers know it by it."""
        if self.stage is None:
            for peer in list(getattr(self.transport, "peers", {})):  # the answer to a hello: delivered by now
                self.transport.disconnect(peer)
            if hasattr(self.transport, "rename"):
                self.transport.rename(stage_peer(stage))
            self.stage = stage
            # the peak this worker reports is this stage's, not its lifetime's (an earlier run, a
            # stranger's traffic before it)
            reset_peak_rss()
        elif stage != self.stage:
            raise ValueError(f"this worker is stage {self.stage} (its name on the wire) and cannot be set up as stage "
                             f"{stage} without a release first: the coordinator must release a worker's name before "
                             f"giving it another")
        self.reset()

    def _key_of(self, peer: str, keys: dict) -> bytes | None:
        """The CURVE key `peer`'s link must be authenticated with: the trusted coordinator key for
        the coordinator (never one a message names), the setup's key for a neighbour."""
        if not getattr(self.transport, "secure", False):
            return None
        from runtime.keys import PublicKey

        if peer == COORDINATOR:
            return self.trusted.curve
        if not isinstance(keys, dict) or peer not in keys:
            raise ValueError(f"setup names neighbour {peer!r} without its public key (peer_keys); a secure worker "
                             f"talks only to peers whose key it knows")
        return PublicKey.parse(keys[peer], f"setup: key of {peer}").curve

    def _meet_peers(self, peers: dict[str, str], keys: dict | None = None) -> None:
        """Connect to this setup's peers (coordinator and neighbours, with their keys) and drop any
        old neighbour that is not one of them, so nothing is sent along a link the new plan does
        not have (and a secure transport admits no key the new plan does not name)."""
        for peer in list(getattr(self.transport, "peers", {})):
            if peer not in peers:
                self.transport.disconnect(peer)
        for peer, address in peers.items():
            key = self._key_of(peer, keys or {})
            if key is None:
                self.transport.connect(peer, address)
            else:
                self.transport.connect(peer, address, key=key)

    def setup_bundle(self, msg: dict) -> None:
        """Set up from a plan bundle: verify every file against its manifest before using any of it;
        the stage, graph slice, weights, actions and optimizer all come from the bundle (the
        optimizer's state from the coordinator, and, after a loss, that of the parameters the new
        plan left here from this worker's own copy of the restored snapshot: `own_state`). The own
        copies kept through the reset are let go once the setup is done, or failed."""
        try:
            self._setup_bundle(msg)
        finally:
            self._close_kept()

    def _setup_bundle(self, msg: dict) -> None:
        from ir.bundle import BundleError
        from runtime.pipeline.bundles import load_bundle

        self._take_stage(int(msg["stage"]))
        self._meet_peers(msg["peers"], msg.get("peer_keys"))
        check = None
        if self.trusted is not None:
            from runtime.keys import verifier

            check = verifier(self.trusted)
        source = f"{msg.get('device', 'bundle')} (from the coordinator)"
        if isinstance(msg.get("engine"), str):  # its import's transient peak before the weights, not on them
            import_engine(msg["engine"])
        files, held, reused = self._receive_bundle(msg, source, check)
        try:
            contents = load_bundle(files, source, check)
        except BundleError as exc:
            self.held.discard()
            if held is not None:
                raise BundleError(f"{exc} (its frozen weights were read from the base file {held}, taken for the "
                                  f"plan's by its hash when this worker started: was it changed since?)") from None
            if reused:
                raise BundleError(f"{exc} ({len(reused)} of its weights were this worker's own, kept from its last "
                                  f"setup and offered back by the coordinator: was the kept file changed since?)") \
                    from None
            raise
        if held is not None:  # its frozen weights lie in the base file: nothing of this setup's is kept
            self.held.forget()
        else:
            self.held.commit()
        # the received (or rebuilt) weights file: decoded into the graph by now, and one more copy of
        # every weight while the engine is built if kept
        del files
        if contents.stage != self.stage:
            raise ValueError(f"bundle is for stage {contents.stage}, the coordinator assigned stage {self.stage}")
        doc = contents.stage_doc
        self.device = contents.device
        spec = stage_spec(contents.graph, contents.first_block, contents.last_block)
        # the bundle's decoded arrays are this worker's own (ir.safetensors gives writable copies)
        engine = make_engine(doc.backend_spec, spec, head_split=doc.head_split, activations=doc.activations,
                             take_weights=True)
        optimizer = make_optimizer(doc.optimizer.name, doc.optimizer.lr, doc.optimizer.weight_decay)
        state = self._kept_moments(msg["own_state"]) if msg.get("own_state") is not None else {}
        if msg.get("optimizer_state"):
            state.update(self._recv_tensors("optstate", list(msg["optimizer_state"])))
        if state:
            optimizer.load_state(state)
        del state
        # the program: its one-step actions and, for an asynchronous schedule, its steady state
        self.bundle_actions = (contents.actions, contents.steady, contents.drain_at, doc.microbatches)
        self.executor = StageExecutor(self.stage, doc.stages, engine, self.transport, optimizer,
                                      spec.graph_inputs, timeout=self.timeout, interrupt=self._interrupt,
                                      tied=_tied_names(msg), between=self._between)
        # a stage waiting for a neighbour while its copy waits for its holder's word is woken by
        # that word; a neighbour's chunks are filed at its next action or look (several at a time)
        self.executor.wake_on_side = lambda: self.copies.awaiting_word
        self.executor.before_state_change = self.copies.settle
        self.transport.send_control(COORDINATOR, {"type": "ready", "stage": self.stage, "pid": os.getpid(),
                                                  "rss_bytes": peak_rss_bytes(), "device": contents.device,
                                                  **device_state()})

    def _kept_moments(self, own) -> dict[str, np.ndarray]:
        """The optimizer state of the parameters `own` {sid, params, sha256} names, read from this
        worker's own copy of snapshot `sid` (kept through the reset) and checked against `sha256`."""
        if not (isinstance(own, dict) and isinstance(own.get("sid"), int) and isinstance(own.get("params"), list)
                and all(isinstance(p, str) for p in own["params"]) and isinstance(own.get("sha256"), str)):
            raise ValueError(f"setup_bundle: 'own_state' must be {{sid, params, sha256}}, got {own!r:.80}")
        copy = self.kept_own.get(own["sid"])
        if copy is None:
            raise ValueError(f"setup_bundle: own_state names snapshot {own['sid']}, of which this worker kept no copy "
                             f"(it keeps {sorted(self.kept_own)})")
        return load_moments(copy, own["params"], own["sha256"], f"stage {self.stage}'s own copy of snapshot "
                                                                 f"{own['sid']}")

    def _receive_bundle(self, msg: dict, source: str, check=None):
        """The setup's bundle files, unverified but for the signature (`check`, before anything of
        the weights is parsed), the base file its weights were rebuilt with (None: not from one),
        and the names of the tensors taken from this worker's own kept weights. The coordinator
        may offer to leave out the weights a base file holds (with a file of that hash this worker
        takes them from it, runtime.pipeline.bundles), or the tensors this worker kept from its
        last setup (`held`: name -> [dtype, shape]; runtime.pipeline.held_weights)."""
        from ir.bundle import WEIGHTS
        from runtime.pipeline.bundles import REST, rebuild_weights, recv_bundle_files, spool_weights, wire_to_files

        names, held, local, reused = list(msg["bundle_files"]), None, [], []
        own: dict = {}  # trainable weights read from this worker's own snapshot copy
        if "base" in msg:
            offer = msg["base"]
            local = offer.get("names") if isinstance(offer, dict) else None
            if not (isinstance(local, list) and all(isinstance(n, str) for n in local)
                    and isinstance(offer.get("sha256"), str)):
                raise ValueError(f"setup_bundle: 'base' must be {{sha256, names}}, got {offer!r:.80}")
            held = self.base_files.get(offer["sha256"])
            self.transport.send_control(COORDINATOR, {"type": "bundle_wants", "stage": self.stage,
                                                      "base": held is not None})
            if held is not None:
                names = [REST if n == WEIGHTS else n for n in names]
        elif "held" in msg:
            offer = check_offer(msg["held"])
            # the trainable ones from the restored snapshot's copy (the kept weights file holds them
            # as of the last setup, trained since), the rest from the kept file
            own = self._own_weights(msg.get("own_state"), offer)
            own_state = msg.get("own_state")
            trained = {n for n in own_state.get("params", ()) if isinstance(n, str)} \
                if isinstance(own_state, dict) and isinstance(own_state.get("params"), list) else set()
            reused = self.held.matching({n: f for n, f in offer.items() if n not in trained})
            self.transport.send_control(COORDINATOR, {"type": "bundle_wants", "stage": self.stage,
                                                      "held": reused + sorted(own)})
            if reused or own:
                names = [REST if n == WEIGHTS else n for n in names]
        else:  # no offer: answered all the same, before any of the bundle comes (protocol 3)
            self.transport.send_control(COORDINATOR, {"type": "bundle_wants", "stage": self.stage})
        # the weights file (all of it, or the rest beside this worker's own) written to the file it is kept in as
        # its chunks arrive, never held whole (h168: a one-stage SmolLM2 set-up received 515 MiB whole, VmHWM 692
        # at ready against its plan's 423); REST beside a held base file is small and read from memory
        spool = None if held is not None else self._spool_file
        files = recv_bundle_files(self.transport, COORDINATOR, names, source=source, receive=self._from_coordinator,
                                  spool=spool, took=lambda answer: self.transport.send_control(
                                      COORDINATOR, {**answer, "stage": self.stage}))
        if held is not None:
            if REST not in files:
                raise ValueError(f"bundle {source}: {REST} did not come, though this worker holds the base file")
            files[WEIGHTS] = rebuild_weights(wire_to_files({REST: files.pop(REST)})[REST], held, local,
                                             mapped=_maps_base(files, source, check))
            return files, held, reused
        if (reused or own) and REST not in files:
            raise ValueError(f"bundle {source}: {REST} did not come, though this worker took its own weights")
        # written out, kept for the next setup, and read back tensor by tensor: never the received
        # file and its decoded copies at once; the signature checked before any of it is parsed
        # (the signed manifest's SHA-256 checks the weights taken from the snapshot copy too).
        # Frozen weights offered as the base's but sent (no base file here) of a stage charged
        # mapped: viewed on a mapping of the kept file, as a worker holding the base maps that
        mapped = local if local and _maps_base(files, source, check) else []
        try:
            spool_weights(files, source, check, held=self.held, local=reused, extra=own, mapped=mapped)
        except OSError as exc:  # no writable temporary folder: the received bytes are decoded in memory
            if reused or own:
                raise
            print(f"worker: cannot keep the received weights in a file ({exc})", file=sys.stderr, flush=True)
        if mapped:
            _warn_unmapped(files.get(WEIGHTS), mapped, msg.get("device"), self.stage)
        return files, held, reused + sorted(own)

    def _spool_file(self, name: str):
        """The file a received weights file is written to as it arrives (`HeldWeights.new_file`), None for
        the bundle's other files, or where no temporary folder is writable (then held in memory, as ever)."""
        from ir.bundle import WEIGHTS
        from runtime.pipeline.bundles import REST

        if name not in (WEIGHTS, REST):
            return None
        try:
            return self.held.new_file()
        except OSError:
            return None

    def _own_weights(self, own, offer) -> dict:
        """The trainable weights of the setup's `own_state` parameters offered in `offer` (name ->
        (dtype, shape)) that this worker's own copy of the restored snapshot holds in that form:
        name -> its reader (read once the received part of the weights is: never both whole at
        once; runtime.pipeline.kept_state)."""
        if not (isinstance(own, dict) and isinstance(own.get("sid"), int) and isinstance(own.get("params"), list)):
            return {}
        copy = self.kept_own.get(own["sid"])
        if copy is None:
            return {}
        entries = {e.name: e for e in copy.tensors if e.name.startswith("param/")}
        out = {}
        for name in own["params"]:
            e = entries.get(f"param/{name}") if isinstance(name, str) else None
            if e is not None and name in offer and offer[name] == (np.dtype(e.dtype).name, tuple(e.shape)):
                out[name] = lambda copy=copy, e=e: read_writable(copy, e)
        return out

    def _need_stage(self, what: str) -> None:
        if self.executor is None:
            raise RuntimeError(f"{what} but this worker has no stage (not set up, or reset by a re-plan)")

    def run(self, msg: dict) -> None:
        self._need_stage(f"run of step {msg.get('step')}")
        steps = msg.get("steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"run of step {msg.get('step')}: steps is {steps!r}, not a whole number >= 1")
        first = msg.get("step")
        if isinstance(first, int):  # counted from 1, as the coordinator's lines count them
            self.doing = f"step {first + 1}" if steps == 1 else f"steps {first + 1}-{first + steps}"
        actions, steady, drain_at, microbatches = self.bundle_actions
        if steps > 1:
            if steady is None:
                raise ValueError(f"run of {steps} steps without a flush, but this stage's bundle has no steady "
                                 f"state (a flush schedule runs one step at a time)")
            actions = unroll(actions, steady, drain_at, steps, microbatches)
        before = dict(self.executor.stats.seconds), self.executor.stats.wall_s
        try:
            self.executor.run(actions)
        except StepAborted:
            self.executor.drop_step()
            return  # the abort message itself is answered by `serve` next
        stats = self.executor.stats
        self.transport.send_control(COORDINATOR, {
            "type": "done", "stage": self.stage, "step": msg.get("step"),
            "seconds": {k: v - before[0].get(k, 0.0) for k, v in stats.seconds.items()},
            "wall_s": stats.wall_s - before[1], "updates_at_s": list(self.executor.updates_at_s),
            "version": getattr(self.executor.engine, "version", None),
            "updates": self.executor.updates, "peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes(),
            **self.copies.figures(), **device_state(),
        })

    def eval_forward(self, msg: dict) -> None:
        """An evaluation pass over this stage's trained weights (`StageExecutor.forward_only`: forward
        only, ending at stage `end`, at the block `until_block` or at the loss), then eval_done."""
        self._need_stage("evaluation pass")
        n, end, until = msg.get("microbatches"), msg.get("end"), msg.get("until_block")
        if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 4096 and isinstance(end, int)
                and not isinstance(end, bool) and (until is None or (isinstance(until, int) and not isinstance(until, bool)
                                                                     and until >= 0))):
            raise ValueError(f"eval_forward: expected microbatches (1..4096), end (a stage) and until_block (a block "
                             f"or null), got {msg!r:.120}")
        if until is not None and end == self.stage and not (self.executor.engine.spec.first_block <= until
                                      <= self.executor.engine.spec.last_block):
            raise ValueError(f"eval_forward: block {until} is not on this stage")
        started = time.perf_counter()
        self.executor.forward_only(n, end, until)
        self.transport.send_control(COORDINATOR, {"type": "eval_done", "stage": self.stage,
                                                  "seconds": time.perf_counter() - started,
                                                  "peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes()})

    def abort(self, msg: dict) -> None:
        """Answer the coordinator's abort: drop the step in flight, fence every live neighbour and
        take their fences (what each sent before its fence belongs to the aborted step and is
        dropped), then acknowledge. Neighbours lost meanwhile are not waited for."""
        if self.executor is not None:
            self.executor.drop_step()
        self.copies.stop()  # the copy being shipped: the snapshot it belongs to is not confirmed
        # the step's batches came before the abort on the same connection: all are here, and stale
        self.transport.discard(COORDINATOR, controls=False)
        lost = set(msg.get("lost") or ())
        self._take_in_copies()  # a copy a lost neighbour completed before it went is still good
        for peer in lost:  # what a lost neighbour sent, or sends if it thaws, is of no step to come
            self.transport.retire(peer)
            self.transport.discard(peer)
            self.transport.discard_side(peer)
            self.copies.forget_from(peer)
        neighbours = [p for p in getattr(self.transport, "peers", {}) if p != COORDINATOR and p not in lost]
        for peer in neighbours:
            self.transport.send_control(peer, {"type": "fence", "stage": self.stage, "step": msg.get("step")})
        deadline = time.monotonic() + self.timeout
        waiting = set(neighbours)
        while waiting:
            for peer in sorted(waiting):
                try:
                    _, fence = self.transport.recv_control(peer, timeout=0.05)
                except PeerTimeout:
                    if peer in self.transport.lost_peers():
                        waiting.discard(peer)
                    continue
                if fence.get("type") != "fence":
                    raise ValueError(f"stage {self.stage}: expected a fence from {peer} after an abort, got "
                                     f"{fence.get('type')!r}")
                self.transport.discard(peer, controls=False)
                waiting.discard(peer)
            self._check_coordinator()
            if waiting and time.monotonic() > deadline:
                raise PeerTimeout(sorted(waiting)[0], None, "a fence after an abort", self.timeout)
        self.transport.send_control(COORDINATOR, {"type": "aborted", "stage": self.stage, "step": msg.get("step")})

    def checkpoint(self, optimizer: bool = True, window: tuple[int, int, int] | None = None,
                   weights: bool = True, moments_of: list[str] | None = None) -> None:
        """Send the coordinator this stage's state: whole, tensor by tensor, or with `window` (first
        tensor, its first element, bytes) one window of it in chunks (`send_window`: the coordinator
        spooling a copy asks for one at a time, `Coordinator.collect_stages`). Without `weights`, no
        parameters nor scalars; with `moments_of`, the optimizer state of those parameters only
        (the coordinator's copy after a recovery holds the rest already: kept_state.select_entries)."""
        self._need_stage("checkpoint")
        # the engine's and optimizer's own arrays, no copies: the coordinator has them all before it
        # sends the next step, and a table's state goes as its rows (no dense copy built to send)
        tensors = state_tensors(self.executor)
        state_bytes = sum(int(arr.nbytes) for _, arr in tensors)
        if not optimizer:  # the run's final weights: the moments would only be dropped on arrival
            tensors = [(name, arr) for name, arr in tensors if name.startswith("param/")]
        if not weights or moments_of is not None:
            rows_of = row_shapes(tensors)  # a table's rows are declared by its parameter's shape
            chosen = {e.name for e in select_entries([_Named(n) for n, _ in tensors], weights, moments_of)}
            tensors = [(name, arr) for name, arr in tensors if name in chosen]
            done_rows = {k: v for k, v in rows_of.items() if k + ROW_IDS in chosen}
        else:
            done_rows = None
        done = {"type": "checkpoint_done", "stage": self.stage,
                "rows": row_shapes(tensors) if done_rows is None else done_rows, "state_bytes": state_bytes}
        if window is None:
            for i, (name, arr) in enumerate(tensors):
                self.transport.send_tensor(COORDINATOR, "ckpt", self.stage, i, np.asarray(arr, order="C"), name=name)
            done.update(first=0, total=len(tensors), names=[name for name, _ in tensors])
        else:
            first, start, budget = window
            done.update(send_window(self.transport, COORDINATOR, "ckpt", self.stage,
                                    [WindowEntry.of_array(name, arr) for name, arr in tensors], first, start,
                                    min(budget, FETCH_WINDOW_BYTES)))
        self.transport.send_control(COORDINATOR, done)

    def snapshot(self, msg: dict) -> None:
        """Copy this stage's state for snapshot `sid` and ship it to its holder while the next step
        runs (runtime.pipeline.snapshots); keep only the copies of the snapshots `keep` names."""
        self._need_stage("snapshot")
        sid, holder, keep, spread = msg.get("sid"), msg.get("holder"), msg.get("keep"), msg.get("spread_s", 0.0)
        if not (isinstance(sid, int) and isinstance(keep, list) and all(isinstance(k, int) for k in keep)
                and (holder is None or holder in getattr(self.transport, "peers", {}))
                and isinstance(spread, (int, float)) and 0 <= spread < 3600):
            raise ValueError(f"snapshot: expected sid, keep [sids], a neighbour as holder and spread_s, got "
                             f"{msg!r:.120}")
        self.copies.take(sid, self.stage, lambda: state_tensors(self.executor), holder, keep, float(spread))

    def snapshot_send(self, msg: dict) -> None:
        """Send the coordinator one window of the copies of snapshot `sid` of the stages `of` (after a
        loss): from element `start` of tensor `first` of each, at most `bytes` bytes (and at most
        `FETCH_WINDOW_BYTES`), read back from the copy's file a chunk at a time (`send_window`), so
        neither this worker nor the coordinator ever holds a whole copy, nor a whole large tensor
        of one (Coordinator.fetch_held_stages)."""
        sid, of, first, start, budget = (msg.get(k) for k in ("sid", "of", "first", "start", "bytes"))
        # what of each copy (optional): its parameters and scalars (`weights`, default true), and
        # the optimizer state of the parameters `moments_of` (absent: of all); a recovery fetches
        # only the moved blocks' (runtime.pipeline.kept_state)
        weights, moments_of = msg.get("weights", True), msg.get("moments_of")
        if not (isinstance(sid, int) and isinstance(of, list) and all(isinstance(k, int) for k in of)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (first, start, budget))
                and budget > 0 and isinstance(weights, bool)
                and (moments_of is None or (isinstance(moments_of, list) and all(isinstance(p, str) for p in moments_of)))):
            raise ValueError(f"snapshot_send: expected sid, of [stages], first, start and bytes, got {msg!r:.120}")
        self._take_in_copies()  # the chunks that arrived before the neighbours' fences: filed, not held
        for k in of:
            copy = self.copies.spooled(k, self.stage, sid)
            if copy is None:
                self.transport.send_control(COORDINATOR, {"type": "held_done", "of": k, "sid": sid, "missing": True})
                continue
            entries = select_entries(copy.tensors, weights, moments_of)
            sent = send_window(self.transport, COORDINATOR, "held", k,
                               [WindowEntry.of_spooled(copy, e) for e in entries], first, start,
                               min(budget, FETCH_WINDOW_BYTES))
            names = {e.name for e in entries}
            rows = {key: shape for key, shape in row_shapes([(e.name, e) for e in copy.tensors]).items()
                    if key + ROW_IDS in names}
            self.transport.send_control(COORDINATOR, {"type": "held_done", "of": k, "sid": sid, **sent, "rows": rows})

    def copy_digest(self, msg: dict) -> None:
        """Tell the coordinator the SHA-256 of the optimizer state of `params` in the copy of
        snapshot `sid` of stage `of` this worker holds (its own or a replica): what a survivor's
        setup that reads it from its own copy is checked against (runtime.pipeline.kept_state)."""
        sid, of, params = msg.get("sid"), msg.get("of"), msg.get("params")
        if not (isinstance(sid, int) and isinstance(of, int) and isinstance(params, list)
                and all(isinstance(p, str) for p in params)):
            raise ValueError(f"copy_digest: expected sid, of and params [names], got {msg!r:.120}")
        self._take_in_copies()
        copy = self.copies.spooled(of, self.stage, sid)
        answer = {"type": "copy_digest", "of": of, "sid": sid}
        if copy is None:
            answer["missing"] = True
        else:
            answer["sha256"] = moments_digest(copy, params)
        self.transport.send_control(COORDINATOR, answer)

    def _between(self) -> float | None:
        """Between a step's actions and while it waits: ship what is due of this stage's snapshot copy,
        and file what a neighbour's arrived (a write into the page cache: the received chunks are
        not held until the stage is idle). Returns the seconds until the next chunk is due."""
        due = self.copies.pump()
        self._take_in_copies()
        return due

    def _take_in_copies(self) -> None:
        if self.stage is None:
            return
        self.copies.take_in([p for p in getattr(self.transport, "peers", {}) if p != COORDINATOR], self.stage)

    def failure(self, exc: BaseException) -> str:
        """`exc` as the coordinator's WorkerFailed quotes it: which stage (or, with none, which
        worker) broke, on which device of the plan, in which action (its one-token text form, `s1.B.m3`,
        as the plan prints it), and how."""
        where = f"stage {self.stage}" if self.stage is not None else f"worker at {self.transport.address}"
        action = self.executor.in_flight if self.executor is not None else None
        where += (f" ({self.device})" if self.device else "") + (f" in {action}" if action is not None else "")
        return f"{where}: {type(exc).__name__}: {exc}"

    def report_failure(self, message: str) -> None:
        """Send the coordinator an error report, as far as the transport still can (a worker that
        was never set up, or was released, has no connection to it)."""
        try:
            self.transport.send_control(COORDINATOR, {"type": "error", "stage": self.stage, "message": message})
        except Exception:
            pass

    def _next_order(self) -> dict:
        """The coordinator's next message; while this worker holds a stage, its coordinator is
        watched, and a lost one raises CoordinatorLost, and a silent one PeerTimeout after `timeout`.
        A worker without a stage waits for a coordinator as long as it takes: it is a server (a
        device started by hand, a spare of the cluster, one whose coordinator was lost)."""
        deadline = time.monotonic() + self.timeout
        check_at = time.monotonic() + _LIVENESS_POLL_S
        while True:
            due = self.copies.pump()  # idle: what is due of this stage's snapshot copy goes now
            if self.stage is not None and self.transport.peek_control(COORDINATOR) is None:
                self._take_in_copies()  # idle: a neighbour's snapshot copy is filed now, off the step's path
            wait = max(0.0, check_at - time.monotonic())
            try:
                # a neighbour's snapshot chunk, or its word for more of this stage's copy, wakes
                # the wait: filed, or sent, at once
                return self.transport.recv_control(COORDINATOR, timeout=wait if due is None else min(wait, due),
                                                   wake_on_side=self.stage is not None)[1]
            except PeerTimeout:
                if time.monotonic() < check_at:
                    continue  # a chunk of the copy is due
                check_at = time.monotonic() + _LIVENESS_POLL_S
                self._check_coordinator()
                if self.stage is None:
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() >= deadline:
                    raise PeerTimeout(COORDINATOR, self.transport.address_of(COORDINATOR), "a control message",
                                      self.timeout) from None

    def drop_coordinator(self) -> None:
        """The coordinator is lost: drop the stage and the name, close every connection, and wait
        for a coordinator again, as a worker that was never set up.

        Nothing that comes over the old connections is taken from now on (`Transport.retire`): the
        coordinator's, should it come back (a frozen one that thaws reconnects under its old
        connection's routing id and sends the orders it had queued, which are of a pipeline this
        worker no longer holds; the transport logs and drops them), and the neighbours', which are
        of the same pipeline. A coordinator that calls this worker again does so over a new
        connection: a restarted one, or one that lost this worker and sends a hello."""
        for peer in {COORDINATOR, *getattr(self.transport, "peers", {})}:
            self.transport.retire(peer)
            self.transport.discard(peer)
        self.reset()
        self._close_kept()
        self.held.forget()  # a coordinator to come offers nothing it did not set up itself
        for peer in list(getattr(self.transport, "peers", {})):
            self.transport.disconnect(peer)
        self.stage = None

    def hello(self, msg: dict) -> None:
        """Answer a coordinator that lost this worker and calls it back: whatever stage is left from
        before is of a pipeline that went on without it, so drop it and the name; answer under the
        name the hello gives, then wait, nameless, for a setup."""
        name, reply_to = msg.get("name"), msg.get("reply_to")
        if not (isinstance(name, str) and name.startswith("probe ") and name.isprintable()
                and isinstance(reply_to, str) and reply_to):
            raise ValueError(f"hello: expected a 'probe ...' name and a reply_to address, got {name!r:.80}, "
                             f"{reply_to!r:.80}")
        # orders of the old pipeline may still arrive over the coordinator's old connections (the
        # hello's own among them), and neighbours' tensors over theirs: none is for whatever this
        # worker is given next, so drop_coordinator retires them all
        self.drop_coordinator()
        if hasattr(self.transport, "rename"):
            self.transport.rename(name)
        self._meet_peers({COORDINATOR: reply_to})
        # The link stays open until the coordinator's next order (a setup closes it before taking a
        # stage name): closing it now would drop the answer if the handshake outlasted the linger.
        self.transport.send_control(COORDINATOR, {"type": "here", "pid": os.getpid(), "rss_bytes": rss_bytes(),
                                                  **device_state()})

    def reach_coordinator(self, mismatch: ProtocolMismatch) -> None:
        """Connect back to a coordinator whose message this worker could not read (another protocol
        version), so that its error report reaches it: the name and address are those a setup_bundle
        (stage, peers) or a hello (name, reply_to) of every version has carried, read from the JSON
        it parsed and used for nothing else. A worker that holds a stage has that link already."""
        order = mismatch.control if isinstance(mismatch.control, dict) else {}
        if mismatch.peer != COORDINATOR or self.stage is not None:
            return
        if order.get("type") == "setup_bundle":
            stage, peers = order.get("stage"), order.get("peers")
            name = stage_peer(stage) if isinstance(stage, int) and not isinstance(stage, bool) and stage >= 0 else None
            address = peers.get(COORDINATOR) if isinstance(peers, dict) else None
        elif order.get("type") == "hello":
            name, address = order.get("name"), order.get("reply_to")
        else:
            return
        if not (isinstance(name, str) and name.isprintable() and isinstance(address, str)):
            return
        try:
            if hasattr(self.transport, "rename"):
                self.transport.rename(name)
            self._meet_peers({COORDINATOR: address})
        except Exception:  # the report cannot go; this worker's own log says why it stopped
            pass

    def serve(self) -> int:
        while True:
            try:
                if self._obey(self._next_order()):
                    return 0
            except StopOrdered as stop:  # in the middle of a setup or a step: said here, in one line
                print(f"worker: {stop}", file=sys.stderr, flush=True)
                return 0
            except CoordinatorLost as lost:
                print(f"worker: {lost}; dropping the stage and waiting for a coordinator", file=sys.stderr, flush=True)
                self.drop_coordinator()

    def _obey(self, msg: dict) -> bool:
        """Carry out one order of the coordinator; True for stop."""
        kind = msg.get("type")
        self.doing = {"setup_bundle": "a setup", "eval_forward": "an evaluation"}.get(kind, f"a {kind!r:.40} order")
        if kind not in ("run", "snapshot", "snapshot_keep", "snapshot_send", "copy_digest", "checkpoint", "abort",
                        "eval_forward"):
            self.copies.stop()  # the stage or its connections change: no thread may be sending on them
        if kind == "abort":
            self.abort(msg)
        elif kind == "setup_bundle":
            self.setup_bundle(msg)
        elif kind == "run":
            self.run(msg)
        elif kind == "eval_forward":
            self.eval_forward(msg)
        elif kind == "checkpoint":
            kwargs = {"optimizer": False} if msg.get("optimizer") is False else {}  # the run's final weights
            if "first" in msg or "bytes" in msg:  # a window of it (Coordinator.collect_stages)
                window = tuple(msg.get(k) for k in ("first", "start", "bytes"))
                if not (all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in window) and window[2] > 0):
                    raise ValueError(f"checkpoint: first, start and bytes must be whole numbers, got {msg!r:.120}")
                kwargs.update(window=window)
            weights, moments_of = msg.get("weights", True), msg.get("moments_of")  # what of it (optional)
            if not (isinstance(weights, bool) and (moments_of is None or (
                    isinstance(moments_of, list) and all(isinstance(p, str) for p in moments_of)))):
                raise ValueError(f"checkpoint: weights must be true or false, moments_of a list of names, got "
                                 f"{msg!r:.120}")
            if weights is not True or moments_of is not None:  # only then (tests stand in for checkpoint without them)
                kwargs.update(weights=weights, moments_of=moments_of)
            self.checkpoint(**kwargs)
        elif kind == "snapshot":
            self.snapshot(msg)
        elif kind == "snapshot_send":
            self.snapshot_send(msg)
        elif kind == "copy_digest":
            self.copy_digest(msg)
        elif kind == "snapshot_keep":
            keep = msg.get("keep")
            if not (isinstance(keep, list) and all(isinstance(k, int) for k in keep)):
                raise ValueError(f"snapshot_keep: expected keep [sids], got {msg!r:.120}")
            self.copies.forget_except(keep)
        elif kind == "reset":
            self.reset()
        elif kind == "release":
            self.release()
        elif kind == "hello":
            self.hello(msg)
        elif kind == "stop":
            stop_reason(msg)  # checked as any order's fields are
            return True
        else:
            raise ValueError(f"unknown control message type {kind!r} from the coordinator")
        return False


@dataclass(frozen=True)
class _Named:
    """A state tensor's name, as kept_state.select_entries takes entries."""

    name: str


def _maps_base(files: dict, source: str, check=None) -> bool:
    """Whether the stage the bundle `files` sets up reads its frozen base from this worker's copy of the
    base file mapped (`ir.documents.maps_frozen_base`: PyTorch per block, MNN per block with no cached
    block), by its stage document (signature first, where one is required: nothing of an untrusted bundle
    is parsed); the whole bundle is verified after, as ever."""
    from ir.bundle import BundleError, check_bundle_signature, stage_document
    from ir.documents import maps_frozen_base

    try:
        if check is not None:
            check_bundle_signature(files, source, check)
        doc = stage_document(files, source)
    except (BundleError, KeyError):
        return False  # refused by name by the verification to come
    return maps_frozen_base(doc.engine, doc.activations)


def _warn_unmapped(weights, mapped: Sequence[str], device, stage: int) -> int:
    """One line on stderr for a stage its plan charges its float32 frozen base mapped (one block resident) whose
    frozen weights (`mapped`: the base file's tensors) were sent because this worker has no copy of the base file,
    and are held in memory (no writable temporary folder, a big-endian host): its training then exceeds its plan
    by up to their bytes (a one-stage SmolLM2 plan: 784 MiB trained against 410-468 planned, h168). Names the
    device, the MiB over and the fix; returns those bytes (0: every one mapped from the spooled file, nothing
    printed: the set-up receives the file in chunks written to that file as they arrive, within the plan).
    The line goes out in one write: the in-process workers of a test share one stderr, and `print`'s text and
    its newline as two writes interleaved between two workers' lines once (two texts on one line, one line
    counted)."""
    from ir.mapped_pages import mapping_of
    from ir.safetensors import HashedTensors, decode_safetensors

    try:
        tensors = weights.tensors if isinstance(weights, HashedTensors) else decode_safetensors(weights, copy=False)
    except (TypeError, ValueError):
        return 0  # refused by name by the verification to come
    names = set(mapped)
    held = [v for n, v in tensors.items() if n in names and v.dtype == np.float32 and mapping_of(v) is None]
    whole = sum(int(v.nbytes) for v in held)
    if whole:
        sys.stderr.write(f"worker: device {device or f'of stage {stage}'} has no copy of the plan's base file: up to "
                         f"{whole / 2 ** 20:.1f} MiB over its plan, which charges its frozen weights mapped (one block "
                         f"resident), while it sets up and trains (held in memory); start it with `confidant worker "
                         f"--base plan/base.safetensors`\n")
        sys.stderr.flush()
    return whole


def _tied_names(msg: dict) -> list[str]:
    """The setup's `tied`: this stage's weights that other stages hold too (their gradients are
    summed through the coordinator before every update)."""
    names = msg.get("tied", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"setup: 'tied' must be a list of parameter names, got {names!r:.80}")
    return names


def watch_parent(pid: int) -> None:
    """End this process when process `pid` (the coordinator that started it) ends: the kernel's
    parent-death signal where Linux offers it, and a watcher thread everywhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != pid:  # it died before the signal was armed
        os._exit(3)

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="confidant-parent-watch", daemon=True).start()


def serve(listen: str, threads_hint: int | None = None, timeout: float = 600.0, keys=None, insecure: bool = False,
          heartbeat_s: float | None = 3.0, parent_pid: int | None = None, base_files=None) -> int:
    """`confidant worker --listen ADDR --keys DIR --name NAME`: print the bound address, then
    serve until told to stop. `keys` is a runtime.keys.KeyDir holding this worker's pair and the
    coordinator's public key; `insecure` runs without (plaintext, no signature checks)."""
    from runtime.heap import one_arena
    from runtime.keys import COORDINATOR_KEY
    from runtime.transport.zeromq import ZmqTransport

    # before any thread (the parent watch, the transport's): one heap for the stage's arrays and the
    # transport's messages, freed memory reused whichever thread frees it (runtime.heap.one_arena)
    one_arena()
    if parent_pid is not None:
        watch_parent(parent_pid)
    if keys is not None:
        trusted = keys.key_of(COORDINATOR_KEY)
        transport = ZmqTransport("worker", listen, keys=keys.own.curve_keys(), accept={COORDINATOR: trusted.curve},
                                 heartbeat_s=heartbeat_s)
    elif insecure:
        trusted = None
        transport = ZmqTransport("worker", listen, insecure=True, accept=(COORDINATOR,), heartbeat_s=heartbeat_s)
    else:
        raise ValueError("a worker needs --keys DIR (its NAME.key and the coordinator's coordinator.pub) or, on a "
                         "network nobody else can reach, --insecure")
    print(f"listening {transport.address}", flush=True)
    worker = Worker(transport, timeout=timeout, trusted=trusted, base_files=base_files)
    try:
        return worker.serve()
    except Exception as exc:  # report, then fail: the coordinator must learn which device broke and why
        message = worker.failure(exc)
        print(message, file=sys.stderr)
        if os.environ.get("CONFIDANT_DEBUG"):
            traceback.print_exc()
        if isinstance(exc, ProtocolMismatch):  # a coordinator of another Confidant: told in this version's
            worker.reach_coordinator(exc)      # frame, which it finds is not its own (bad setup: exit 2)
            worker.report_failure(message)
            return 2
        worker.report_failure(message)
        return 1
    finally:
        worker.copies.drop()  # a snapshot sender must not use a socket that is being closed; its files go
        worker.held.close()
        transport.close()
