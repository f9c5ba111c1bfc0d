"""The one dispatch loop over a stage's action list, for every schedule (DESIGN habit 3).

The executor interprets actions; nothing about order, communication or memory is decided here.
Peers are named "coordinator" and "stage<k>". Per micro-batch it keeps only what the plan says is
alive: the received activation until its F, the stage output until its SEND, the upstream gradient
until its B, the input gradient until its SEND, and drops the rest at FREE. Graph inputs (token ids,
mask, targets) for a micro-batch arrive from the coordinator just before the stage's F needs them;
the last stage reports each micro-batch's loss back.

Tied weights (a weight the blocks of several stages read: an LM head that is the input embedding,
ALBERT's one layer cut through): each holder keeps a copy, and at each UPDATE it sends its
accumulated gradient for them to the coordinator ("tied_grad") and steps with the sum that comes
back ("tied_sum", the same array on every holder), so the copies stay bit-identical and the
pipeline trains as one device does.

ZeroMQ queues incoming messages in its I/O thread while this loop computes, so receives are in
effect posted early and waited on late: a RECV only blocks if the peer has not sent yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ir.plan import Action, ActionKind
from runtime.engines.base import RowGradient, StageEngine, accumulate, dense_gradient
from runtime.procfs import release_free_heap
from runtime.transport.wire import Expected, PeerTimeout, Transport

COORDINATOR = "coordinator"
# How often a stage waiting for a neighbour looks whether the coordinator aborted the step (a
# neighbour was lost): waiting is in slices this long.
POLL_S = 0.1


class StepAborted(RuntimeError):
    """The coordinator aborted the step this stage was running (a device was lost); the stage
    drops what the step had in flight (`StageExecutor.drop_step`) and answers the abort."""


# The action kinds that compute (the rest move or drop data): a stage's busy time.
COMPUTE_KINDS = ("F", "B", "W", "UPDATE")


def stage_peer(stage: int) -> str:
    return f"stage{stage}"


def fused_backwards(actions: Sequence[Action]) -> list[Action]:
    """The B actions of a stage's list whose UPDATE follows with no other compute between and sums
    that backward alone (1f1b-stash updating after every backward): an engine may step each weight
    as its gradient comes (`StageEngine.backward_and_step`) instead of holding them all."""
    fused, since, last_b = [], 0, None
    for a in actions:
        if a.kind is ActionKind.B:
            since, last_b = since + 1, a
        elif a.kind is ActionKind.UPDATE:
            if since == 1 and last_b is not None:
                fused.append(last_b)
            since, last_b = 0, None
        elif a.kind in (ActionKind.F, ActionKind.W):
            last_b = None
    return fused


def summed_forwards(actions: Sequence[Action]) -> list[Action]:
    """The F actions of a stage's list whose micro-batch's B comes before the next UPDATE (wherever
    the action occurs): what such a forward's backward adds into is the running sum there at the
    forward, so an engine may add gradients its forward computes straight into it
    (`StageEngine.forward_into`: MNN's fused LM head + loss)."""
    summed, unsummed, waiting = [], set(), {}
    for a in actions:
        if a.kind is ActionKind.F:
            waiting[a.microbatch] = a
        elif a.kind is ActionKind.B and a.microbatch in waiting:
            summed.append(waiting.pop(a.microbatch))
        elif a.kind is ActionKind.UPDATE:
            unsummed.update(waiting.values())
            waiting.clear()
    unsummed.update(waiting.values())
    return [a for a in summed if a not in unsummed]


def joined_weight_passes(actions: Sequence[Action]) -> list[Action]:
    """The W actions of a stage's list that come right after their own micro-batch's B, nothing
    between (a first stage under zb-h1: `B.m W.m`, no gradient to send before the W). Splitting such
    a backward buys no time (nothing runs between the two halves) and costs memory: the B holds every
    deferred projection's input and output gradient for the W (MiniLM's four-layer stage 0 at 2 x 128:
    ~25 MiB beside the next micro-batch's activations, its peak)."""
    joined, before = [], None
    for a in actions:
        if (a.kind is ActionKind.W and before is not None and before.kind is ActionKind.B
                and before.microbatch == a.microbatch):
            joined.append(a)
        before = a
    return joined


def sent_on_without_pause(actions: Sequence[Action]) -> list[Action]:
    """The F and B actions of a stage's list whose result a neighbour waits for: a SEND of the same
    micro-batch follows with only compute of that micro-batch between (`F.m SEND_ACT.m`, and on the
    last stage `F.m B.m SEND_GRAD.m`). The executor runs nothing of its own between these and the
    send (`StageExecutor.between`: a snapshot copy's chunks filed or shipped): the neighbour's wait,
    and on a 2-stage pipeline the slowest stage's, would grow by it."""
    held = []
    for i, a in enumerate(actions):
        if a.kind not in (ActionKind.F, ActionKind.B):
            continue
        for later in actions[i + 1:]:
            if later.microbatch != a.microbatch:
                break
            if later.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                held.append(a)
                break
            if later.kind not in (ActionKind.F, ActionKind.B):
                break
    return held


def busy_fraction(seconds: Mapping[str, float], wall_s: float) -> float:
    """The share of `wall_s` a stage spent computing, from its seconds per action kind (a worker's
    'done' report carries both); 0 when no time passed."""
    busy = sum(seconds.get(k, 0.0) for k in COMPUTE_KINDS)
    return busy / wall_s if wall_s else 0.0


@dataclass
class ExecutorStats:
    """Seconds per action kind, plus counts; `busy_s` is compute (F, B, W, UPDATE) time."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.counts[kind] = self.counts.get(kind, 0) + 1

    @property
    def busy_s(self) -> float:
        return sum(self.seconds.get(k, 0.0) for k in COMPUTE_KINDS)

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "counts": self.counts, "wall_s": self.wall_s, "busy_s": self.busy_s}


class StageExecutor:
    """Runs one stage's actions with an engine, a transport and an optimizer."""

    def __init__(self, stage: int, stages: int, engine: StageEngine, transport: Transport, optimizer,
                 input_names: Sequence[str], timeout: float | None = 300.0, interrupt=None,
                 tied: Sequence[str] = (), between=None):
        self.stage = stage
        self.stages = stages
        self.engine = engine
        self.transport = transport
        self.optimizer = optimizer
        self.input_names = tuple(input_names)
        self.timeout = timeout
        # the weights live in the engine only (StageEngine.step updates them there)
        self.param_names = frozenset(engine.spec.params)
        unknown = sorted(set(tied) - self.param_names)
        if unknown:
            raise ValueError(f"stage {stage}: tied weights {unknown[:3]} are not trainable parameters of this stage")
        # this stage's tied weights, in the order they are exchanged (the coordinator's order)
        self.tied = tuple(sorted(tied))
        self.grad_sum: dict[str, np.ndarray] = {}
        self.backwards_since_update = 0
        self._heap_released = False  # this step's free heap given back (`_release_heap_once`)
        self.updates = 0
        self.updates_at_s: list[float] = []
        self._run_start = time.perf_counter()
        self._acts: dict[int, np.ndarray] = {}
        self._outs: dict[int, np.ndarray] = {}
        self._grads_in: dict[int, np.ndarray] = {}
        self._grads_out: dict[int, np.ndarray | None] = {}
        self.losses: dict[int, float] = {}
        # the B actions whose UPDATE follows them alone (`prepare`), run as the engine's
        # backward_and_step; `_stepped`: that UPDATE's step has been taken
        self._fused: frozenset[Action] = frozenset()
        # the F and B actions whose result goes to a neighbour next (`prepare`): no `between` after them
        self._sent_next: frozenset[Action] = frozenset()
        # the F actions whose backward adds into the running sum there at the forward (`prepare`)
        self._summed: frozenset[Action] = frozenset()
        # the W actions joined to the B before them (`prepare`): that B ran the whole backward
        self._joined: frozenset[Action] = frozenset()
        self._stepped = False
        self.stats = ExecutorStats()
        # the action being executed, kept when it raises: a worker's error report names it (`s1.B.m3`)
        self.in_flight: Action | None = None
        # called while waiting for a message, every POLL_S: raises (StepAborted) to stop waiting
        self.interrupt = interrupt
        # called between actions and while waiting for a message: sends what is due of a snapshot
        # copy (runtime.pipeline.snapshots.StateCopies.pump) from this thread: an engine that holds
        # the interpreter's lock through a whole graph (MNN) would leave a sender thread waiting,
        # and the thread would take the lock back from the stage each time a graph returned;
        # returns the seconds until more is due, None when nothing is left
        self.between = between
        # whether a wait for a neighbour ends as soon as a side-lane message arrives (the worker's
        # `StateCopies.awaiting_word`: its copy's shipping waits for its holder's word); None: never
        self.wake_on_side = None
        # called before the stage's state changes (an UPDATE, a backward that steps): waits until a
        # snapshot copy of the state being written on another thread is written (the worker's
        # `StateCopies.settle`), so the copy is the state before this step; None: nothing to wait for
        self.before_state_change = None

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _recv(self, peer: str, kind: str, stage: int, microbatch: int, name: str = "") -> np.ndarray:
        expected = Expected(kind=kind, stage=stage, microbatch=microbatch, name=name or None)
        if self.interrupt is None and self.between is None:
            return self.transport.recv_tensor(peer, expected, timeout=self.timeout)[1]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        poll_at = time.monotonic() + POLL_S
        while True:
            try:  # already here (or come while a chunk was filed): taken before anything of `between`
                return self.transport.recv_tensor(peer, expected, timeout=0)[1]
            except PeerTimeout:
                pass
            due = self.between() if self.between is not None else None
            now = time.monotonic()
            wait = max(0.0, poll_at - now) if due is None else min(max(0.0, poll_at - now), due)
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            try:
                # a snapshot chunk to file, or the holder's word for more of this stage's copy,
                # ends the wait at once (`between` takes it), with no looks every few ms between
                return self.transport.recv_tensor(peer, expected, timeout=wait,
                                                  wake_on_side=bool(self.wake_on_side and self.wake_on_side()))[1]
            except PeerTimeout:
                now = time.monotonic()
                if self.interrupt is not None and now >= poll_at:
                    self.interrupt()
                poll_at = poll_at + POLL_S if now >= poll_at else poll_at
                if deadline is not None and now >= deadline:
                    raise PeerTimeout(peer, self.transport.address_of(peer), str(expected), self.timeout) from None

    def drop_step(self) -> None:
        """Forget everything of the step in flight (activations, gradients, the accumulated weight
        gradient): an aborted step is replayed from the state before it, never half-applied."""
        for store in (self._acts, self._outs, self._grads_in, self._grads_out):
            store.clear()
        self.grad_sum = {}
        self.backwards_since_update = 0
        self._heap_released = False
        self._stepped = False
        self.losses.clear()
        self.in_flight = None

    def _graph_inputs(self, microbatch: int) -> dict[str, np.ndarray]:
        return {n: self._recv(COORDINATOR, "batch", -1, microbatch, n) for n in self.input_names}

    def prepare(self, actions: Sequence[Action]) -> None:
        """Tell the engine, before the first forward, whether this plan splits backwards into B and
        W (its training forwards then keep what a later W needs)."""
        # a list whose every W follows its B at once runs each pair as one backward (its W does
        # nothing): the split would only hold the B's deferred products until the W
        self._joined = frozenset(joined_weight_passes(actions) if self.engine.joins_weight_passes else ())
        split = any(a.kind is ActionKind.W and a not in self._joined for a in actions)
        if split != self.engine.split_backward:
            self.engine.split_backward = split
        # an UPDATE with a forward before it whose backward comes after it
        pending, in_flight = set(), False
        for a in actions:
            if a.kind is ActionKind.F:
                pending.add(a.microbatch)
            elif a.kind in (ActionKind.B, ActionKind.W):
                pending.discard(a.microbatch)
            elif a.kind is ActionKind.UPDATE and pending:
                in_flight = True
                break
        if in_flight and not self.engine.updates_in_flight:
            self.engine.updates_in_flight = True
        self.engine.row_gradients = True  # `_accumulate` sums them
        self._fused = frozenset(fused_backwards(actions)) if self.engine.steps_in_backward and not (
            split or self.tied) else frozenset()
        self._sent_next = frozenset(sent_on_without_pause(actions))
        stepping = {a.microbatch for a in self._fused}  # their B steps: nothing summed to add into
        self._summed = frozenset(a for a in summed_forwards(actions) if a.microbatch not in stepping)

    def run(self, actions: Sequence[Action]) -> ExecutorStats:
        self.prepare(actions)
        start = time.perf_counter()
        # seconds into this run at the end of each UPDATE: where a run of several batches (a
        # schedule without a flush) crossed each batch's end, for a steady-state time per batch
        self.updates_at_s = []
        self._run_start = start
        for action in actions:
            self.execute(action)
        self.stats.wall_s += time.perf_counter() - start
        return self.stats

    def execute(self, action: Action) -> None:
        if action.stage != self.stage:
            raise ValueError(f"action {action} is for stage {action.stage}, this executor runs stage {self.stage}")
        t0 = time.perf_counter()
        kind, m = action.kind, action.microbatch
        self.in_flight = action
        if kind is ActionKind.RECV_ACT:
            self._acts[m] = self._recv(stage_peer(action.peer), "act", action.peer, m)
        elif kind is ActionKind.F:
            feeds = self._graph_inputs(m)
            if self.stage > 0:
                if m not in self._acts:
                    raise RuntimeError(f"stage {self.stage}: {action} runs before its RECV_ACT")
                feeds[self.engine.spec.activation_input] = self._acts.pop(m)
            if action in self._summed:  # its backward adds into this sum: the engine may add some now
                out = self.engine.forward_into(feeds, m, self.grad_sum)
            else:
                out = self.engine.forward(feeds, microbatch=m, train=True)
            if self.is_last:
                loss = float(np.asarray(out).reshape(-1)[0])
                self.losses[m] = loss
                self.transport.send_tensor(COORDINATOR, "loss", self.stage, m, np.asarray([loss], np.float32))
            else:
                self._outs[m] = out
        elif kind is ActionKind.SEND_ACT:
            self.transport.send_tensor(stage_peer(action.peer), "act", self.stage, m, self._outs.pop(m))
        elif kind is ActionKind.RECV_GRAD:
            self._grads_in[m] = self._recv(stage_peer(action.peer), "grad", action.peer, m)
        elif kind is ActionKind.B:
            upstream = None if self.is_last else self._grads_in.pop(m)
            if action in self._fused:
                # its UPDATE sums this backward alone: each weight stepped as its gradient comes
                if self.grad_sum or self._stepped:
                    raise RuntimeError(f"stage {self.stage}: {action} steps in its backward with gradients "
                                       f"not yet stepped")
                if self.before_state_change is not None:
                    self.before_state_change()
                self._grads_out[m] = self.engine.backward_and_step(m, self.optimizer, upstream)
                self.backwards_since_update += 1
                self._stepped = True
            else:
                if self.engine.split_backward:
                    result = self.engine.backward_input_into(m, self.grad_sum, upstream)
                    self._accumulate(result.params)
                    self._grads_out[m] = result.activation_input
                else:  # summed into grad_sum block by block as the engine computes them
                    self._grads_out[m] = self.engine.backward_into(m, self.grad_sum, upstream)
                    self.backwards_since_update += 1
            self._release_heap_once()
        elif kind is ActionKind.W and not self.engine.split_backward and action in self._joined:
            pass  # its B computed the weight gradients (`joined_weight_passes`)
        elif kind is ActionKind.W:
            if not self.engine.split_backward:
                raise RuntimeError(f"stage {self.stage}: {action} in a plan the executor was not prepared for "
                                   f"(StageExecutor.prepare must see the actions before the first forward)")
            self.engine.backward_weight_into(m, self.grad_sum)
            self.backwards_since_update += 1
        elif kind is ActionKind.SEND_GRAD:
            self.transport.send_tensor(stage_peer(action.peer), "grad", self.stage, m, self._grads_out.pop(m))
        elif kind is ActionKind.UPDATE:
            self.update()
            self.updates_at_s.append(time.perf_counter() - self._run_start)
        elif kind is ActionKind.FREE:
            for store in (self._acts, self._outs, self._grads_in, self._grads_out):
                store.pop(m, None)
        else:  # pragma: no cover - ActionKind is closed
            raise ValueError(f"unknown action {action}")
        self.in_flight = None
        self.stats.add(kind.value, time.perf_counter() - t0)
        if self.between is not None and action not in self._sent_next:
            self.between()

    def forward_only(self, microbatches: int, end: int, until_block: int | None = None) -> None:
        """An evaluation pass over the stage's trained weights, outside any plan's action list:
        `microbatches` inference forwards (no backward, no stash, no optimizer), each micro-batch's
        graph inputs from the coordinator ("eval_batch"), its activation from the stage before
        ("eval_act"), its output to the stage after. Stage `end` ends the pass: with `until_block`
        None (a causal LM's perplexity) it sends the coordinator each micro-batch's loss
        ("eval_loss", float64 [1]); with `until_block` (the LM head's block) it stops there and
        sends the greedy next token of each row at the position the coordinator names for it
        ("eval_at", int64 [rows] -> "eval_next", int64 [rows]; or at k positions a row, [rows, k] ->
        [rows, k]: a drafted continuation checked in one pass): the logits never leave the stage.
        Stages after `end` take no part."""
        if not (0 <= self.stage <= end < self.stages):
            raise ValueError(f"stage {self.stage}: an evaluation pass ending at stage {end} of {self.stages}")
        for m in range(microbatches):
            self.in_flight = None
            feeds = {n: self._recv(COORDINATOR, "eval_batch", -1, m, n) for n in self.input_names}
            if self.stage > 0:
                feeds[self.engine.spec.activation_input] = self._recv(stage_peer(self.stage - 1), "eval_act",
                                                                      self.stage - 1, m)
            if self.stage < end:
                out = self.engine.forward(feeds, microbatch=m, train=False)
                self.transport.send_tensor(stage_peer(self.stage + 1), "eval_act", self.stage, m,
                                           np.ascontiguousarray(out, np.float32))
            elif until_block is None:
                loss = float(np.asarray(self.engine.forward(feeds, microbatch=m, train=False)).reshape(-1)[0])
                self.transport.send_tensor(COORDINATOR, "eval_loss", self.stage, m, np.asarray([loss], np.float64))
            else:
                at = np.asarray(self._recv(COORDINATOR, "eval_at", -1, m), np.int64)
                rows, seq = self.engine.spec.graph.batch, self.engine.spec.graph.seq
                if (at.ndim not in (1, 2) or at.shape[0] != rows or at.size > rows * seq or at.min(initial=0) < 0
                        or at.max(initial=0) >= seq):
                    raise ValueError(f"stage {self.stage}: eval_at {at.tolist()[:8]} for {rows} rows of {seq} "
                                     f"positions")
                picked = self.engine.logits_at(feeds, until_block, at).argmax(axis=-1).astype(np.int64)
                self.transport.send_tensor(COORDINATOR, "eval_next", self.stage, m, picked)

    def _accumulate(self, grads) -> None:
        accumulate(self.grad_sum, grads)

    def update(self) -> None:
        # A stage without parameters (e.g. only the loss block) still takes its UPDATE as a step
        # over nothing, so its optimizer's step count stays that of the other stages: re-planning
        # hands optimizer state between stages by that count.
        if self.before_state_change is not None:
            self.before_state_change()
        if self._stepped:  # taken in the backward (`prepare`'s fused B)
            self._stepped = False
        else:
            if self.param_names and not self.grad_sum:
                raise RuntimeError(f"stage {self.stage}: UPDATE with no accumulated gradient")
            if self.tied and self._step_untied_first():
                self._sum_tied()
                self.engine.step_part(self.optimizer, self.grad_sum)
            else:
                if self.tied:
                    self._sum_tied()
                self.engine.step(self.optimizer, self.grad_sum)
        self.grad_sum = {}
        self.backwards_since_update = 0
        self._heap_released = False
        self.updates += 1

    def _release_heap_once(self) -> None:
        """After a step's first backward, give the C library's free heap back, once a step, on an engine
        whose activations come from it (`StageEngine.releases_heap_each_step`): the backward has just let
        its micro-batch's activations go, and the holes they leave are not all filled whole by the next
        micro-batches' (hidden-sized values beside small saved tensors), so the step's peak would stack on
        them. Once a step, not after every backward: each release costs the pages faulted back in."""
        if self.engine.releases_heap_each_step and not self._heap_released:
            self._heap_released = True
            release_free_heap()

    def _step_untied_first(self) -> bool:
        """Before the tied sums are exchanged, step the weights that are not tied and let their
        gradient sums go (one optimizer step in two parts, the same step count and arithmetic: the
        optimizer steps each weight on its own), so the sum received, a whole table, arrives beside
        the tied gradients only. False (nothing done) where the engine cannot step in parts or
        nothing else is trained here. The embeddings' stage of tests/jobs/
        test_torch_full_finetune_plan.py held its two layers' sums (29.3 MiB) under the table's
        receive, its peak: 748.1-748.4 -> 722.4 MiB (benchmarks/MEMORY_NOTES.md, helper h129). A step
        aborted while the sum is awaited has these weights stepped: the coordinator restores every
        stage after an abort (runtime.pipeline.worker, `abort`), so none trains on from them."""
        untied = [k for k in self.grad_sum if k not in self.tied]
        if not untied or not self.engine.steps_in_parts():
            return False
        self.optimizer.begin_step()
        self.engine.step_part(self.optimizer, {k: self.grad_sum[k] for k in untied})
        for k in untied:
            del self.grad_sum[k]
        return True

    def _sum_tied(self) -> None:
        """Replace this stage's part of each tied weight's gradient by the sum over its holders.
        Everything is sent before anything is awaited, so holders never wait on one another; the
        update count tells this update's sums from those of an aborted step.

        The backwards' freed memory is given back first (`release_free_heap`): the plan charges the
        update as what the stage holds throughout + the sum received, the backwards' activations and
        workspace not held then (`planner.cost.phase_peak_bytes`), but their small blocks stay
        resident as free heap below the blocks allocated after them (the gradient sums), and the
        sum's table-sized receive came on top of it. The embeddings' stage of
        tests/jobs/test_torch_full_finetune_plan.py held 30-41 MiB of it at its update and peaked at
        0.988-0.995 of its plan; given back, its peak is the level after the trim + the sum (+108.8
        MiB for a 108.0 MiB table), 0.967 (benchmarks/MEMORY_NOTES.md, helper h116)."""
        release_free_heap()
        kinds = {}
        for name in self.tied:
            # the gradient's shape and dtype, not a dense copy of it (a row gradient's would be one
            # more table's worth of address space, its rows' pages resident, while the sum arrives)
            part = self.grad_sum.pop(name)
            kinds[name] = tuple(part.shape), (part.rows if isinstance(part, RowGradient) else part).dtype
            self.transport.send_tensor(COORDINATOR, "tied_grad", self.stage, self.updates,
                                       np.ascontiguousarray(dense_gradient(part)), name=name)
            # this stage's part is let go once sent (the transport holds it until it is out): the
            # coordinator answers once every part is in, so a dense part (the LM head's stage: SmolLM2's
            # whole table, 108 MiB) is not beside the sum that replaces it (h131)
            del part
        for name in self.tied:
            shape, dtype = kinds[name]
            total = self._recv(COORDINATOR, "tied_sum", -1, self.updates, name)
            if total.shape != shape or total.dtype != dtype:
                raise ValueError(f"stage {self.stage}: the coordinator's sum for tied weight {name!r} is "
                                 f"{total.dtype}{total.shape}, its gradient here {dtype}{shape}")
            self.grad_sum[name] = total

    def optimizer_state_parts(self):
        """The optimizer's state as its own arrays, tables' row state apart (runtime.optim's
        `state_parts`)."""
        return self.optimizer.state_parts()
