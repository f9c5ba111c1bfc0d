"""Pipeline schedules as plain data: per-stage action lists with a text form that round-trips.

A schedule is what every device's executor interprets, so it has to be readable, diffable and
hand-editable without running anything: each action prints as one token (`s1.F.m3`,
`s1.SEND_ACT.m3>s2`) that `Action.parse` reads back, a schedule prints as one line of tokens per
stage (`Schedule.to_text`) and saves as versioned JSON. Nothing here checks that a schedule makes
sense; `ir.verify.verify_plan` does, so a broken plan can still be loaded, printed and diagnosed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from ir.training import TRAINING
from ir.versioned import check_header

SCHEMA_VERSION = 1

# Every schedule by name (`planner.schedule` builds each), and the optimizers a plan may name
# (`runtime.optim` implements each): the one list every command and module checks against.
SCHEDULE_NAMES = ("gpipe", "1f1b-flush", "1f1b-stash", "zb-h1", "2bw")
OPTIMIZER_NAMES = ("sgd", "adamw")
# What a run does when a worker is lost (`--on-failure`; runtime.pipeline.session.FaultPolicy):
# "replan" over the survivors from snapshots copied between the workers (which a plan leaves room
# for, `DeviceSpec.reserved_bytes`), or "stop" with a resumable checkpoint (no snapshots). The
# first is the default; plan.json records the one a plan was made for.
FAILURE_POLICIES = ("replan", "stop")
# The learning rate of a run that names none (ir.training's spec owns it and every other default).
DEFAULT_LR = TRAINING.lr
# Schedules that never flush: weights update while other micro-batches are still in flight, so
# each stage keeps older weight versions (stashes) for their backwards.
ASYNC_SCHEDULES = frozenset({"1f1b-stash", "2bw"})
# Schedules that split each backward into B (input gradient, on the critical path) and W (weight
# gradients, deferred into the bubbles): planner.schedule builds their W actions.
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb-h1"})
# Schedules that drain the pipeline before every update: a step boundary where every stage holds
# the same weights (re-planning and exact checkpoints happen there).
FLUSH_SCHEDULES = tuple(s for s in SCHEDULE_NAMES if s not in ASYNC_SCHEDULES)


def default_update_every(schedule: str, microbatches: int) -> int:
    """Backwards per update when none is asked for: PipeDream-2BW updates once per batch of
    `microbatches`, 1f1b-stash after every backward, flush schedules once per batch (their
    `update_every` is not a setting)."""
    return microbatches if schedule == "2bw" else 1


def check_schedule_name(name: str) -> str:
    """`name` if it names a schedule; ValueError listing the valid names otherwise."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}")
    return name


def check_optimizer_name(name: str) -> str:
    """`name` if it names an optimizer; ValueError listing the valid names otherwise."""
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}: choose {' or '.join(OPTIMIZER_NAMES)}")
    return name


class ActionKind(str, Enum):
    F = "F"
    # A schedule either has no W (each B is the whole backward) or one W per micro-batch after its
    # B on every stage (zero-bubble schedules): B then computes only what the previous stage waits
    # for (the input gradient) and W the weight gradients, off the critical path.
    B = "B"
    W = "W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    UPDATE = "UPDATE"
    FREE = "FREE"

    def __str__(self) -> str:
        return self.value

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.W)


SEND_FOR_RECV = {ActionKind.RECV_ACT: ActionKind.SEND_ACT, ActionKind.RECV_GRAD: ActionKind.SEND_GRAD}
RECV_FOR_SEND = {v: k for k, v in SEND_FOR_RECV.items()}

_TOKEN = re.compile(r"s(\d+)\.([A-Z_]+)(?:\.m(\d+))?(?:([<>])s(\d+))?")
_FORMS = ("s<stage>.F.m<mb>, s<stage>.B.m<mb>, s<stage>.W.m<mb>, s<stage>.FREE.m<mb>, s<stage>.UPDATE[.m<mb>], "
          "s<stage>.SEND_ACT.m<mb>>s<peer>, s<stage>.RECV_ACT.m<mb><s<peer> (likewise SEND_GRAD/RECV_GRAD)")


@dataclass(frozen=True)
class Action:
    """One step of one stage.

    `microbatch` is None only for an UPDATE that closes a whole batch; an UPDATE may name the
    micro-batch whose backward it follows (asynchronous schedules update mid-run). `peer` is the
    other stage of a send or receive and None otherwise.
    """

    kind: ActionKind
    stage: int
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ActionKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of "
                             f"{', '.join(k.value for k in ActionKind)}") from None
        for field_name in ("stage", "microbatch", "peer"):
            v = getattr(self, field_name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"action {field_name} must be a non-negative int, got {v!r}")
        if self.microbatch is None and self.kind is not ActionKind.UPDATE:
            raise ValueError(f"a {self.kind.value} action needs a micro-batch")
        needs_peer = self.kind.is_send or self.kind.is_recv
        if needs_peer and self.peer is None:
            raise ValueError(f"a {self.kind.value} action needs a peer stage")
        if not needs_peer and self.peer is not None:
            raise ValueError(f"a {self.kind.value} action has no peer (got peer={self.peer})")

    def __str__(self) -> str:
        text = f"s{self.stage}.{self.kind.value}"
        if self.microbatch is not None:
            text += f".m{self.microbatch}"
        if self.peer is not None:
            text += f"{'>' if self.kind.is_send else '<'}s{self.peer}"
        return text

    def shifted(self, by: int) -> "Action":
        """This action `by` micro-batches later (an UPDATE closing a whole batch stays as it is)."""
        return self if self.microbatch is None or by == 0 else replace(self, microbatch=self.microbatch + by)

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _TOKEN.fullmatch(text)
        if m is None:
            raise ValueError(f"cannot parse action {text!r}: expected one of {_FORMS}")
        stage, kind_name, mb, arrow, peer = m.groups()
        try:
            kind = ActionKind(kind_name)
        except ValueError:
            raise ValueError(f"cannot parse action {text!r}: unknown kind {kind_name!r}, expected one of "
                             f"{', '.join(k.value for k in ActionKind)}") from None
        if kind.is_send and arrow != ">":
            raise ValueError(f"cannot parse action {text!r}: a {kind.value} is written "
                             f"s<stage>.{kind.value}.m<mb>>s<peer>")
        if kind.is_recv and arrow != "<":
            raise ValueError(f"cannot parse action {text!r}: a {kind.value} is written "
                             f"s<stage>.{kind.value}.m<mb><s<peer>")
        try:
            return cls(kind, int(stage), None if mb is None else int(mb), None if peer is None else int(peer))
        except ValueError as exc:
            raise ValueError(f"cannot parse action {text!r}: {exc}") from None


def unroll(actions: tuple[Action, ...], steady: tuple[Action, ...], drain_at: int, steps: int,
           microbatches: int) -> tuple[Action, ...]:
    """One stage's actions for `steps` steps without a flush (see SteadyState): `actions` up to
    `drain_at`, `steady` once per step after the first (shifted `microbatches` further each time),
    then the drain shifted to the last step."""
    out = list(actions[:drain_at])
    for k in range(steps - 1):
        out += [a.shifted(k * microbatches) for a in steady]
    return tuple(out + [a.shifted((steps - 1) * microbatches) for a in actions[drain_at:]])


@dataclass(frozen=True)
class SteadyState:
    """How the one-step lists of an asynchronous schedule (1f1b-stash, 2bw) continue without a flush:
    stage s runs its list up to `drain_at[s]` (warm-up and the first step's one-forward-one-backward),
    then `actions[s]` once per further step (the steady state, written with the second step's
    micro-batches; each further step shifts them by the micro-batches of a step), then the rest of
    its list, the drain, shifted to the last step. `Schedule.for_steps` joins them."""

    drain_at: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "drain_at", tuple(self.drain_at))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        if len(self.drain_at) != len(self.actions):
            raise ValueError(f"a steady state has {len(self.drain_at)} drain positions for {len(self.actions)} stages")


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists for one pipeline run; stage s runs on device s for now.

    `microbatches` counts micro-batches per batch for flush schedules and in the whole run for
    `1f1b-stash`. `stash_depth[s]` is how many weight versions stage s must be able to hold.
    `update_every` is how many backwards a stage accumulates before an UPDATE: k for `1f1b-stash`,
    and `microbatches` for flush schedules (one update per batch).
    """

    name: str
    stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    stash_depth: tuple[int, ...]
    update_every: int = 1
    # asynchronous schedules: how the one-step lists run for several steps without a flush
    # (`for_steps`); None for flush schedules, which run their lists once per step
    steady: "SteadyState | None" = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen here so schedules stay hashable and immutable.
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        object.__setattr__(self, "stash_depth", tuple(self.stash_depth))
        for field_name in ("stages", "microbatches", "update_every"):
            v = getattr(self, field_name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"schedule {field_name} must be an int >= 1, got {v!r}")
        if len(self.actions) != self.stages:
            raise ValueError(f"schedule {self.name!r} has {self.stages} stages but {len(self.actions)} action lists")
        if len(self.stash_depth) != self.stages:
            raise ValueError(f"schedule {self.name!r} has {self.stages} stages but {len(self.stash_depth)} "
                             f"stash depths")
        for row in self.actions:
            for a in row:
                if not isinstance(a, Action):
                    raise ValueError(f"schedule {self.name!r}: {a!r} is not an Action")

    @property
    def splits_backward(self) -> bool:
        """True when backwards are split into B (input gradient) and W (weight gradients)."""
        return any(a.kind is ActionKind.W for row in self.actions for a in row)

    @property
    def flushes(self) -> bool:
        """True when the pipeline drains before each UPDATE, so every stage keeps one weight version."""
        return self.name not in ASYNC_SCHEDULES

    def for_steps(self, steps: int) -> "Schedule":
        """The lists that run `steps` steps as one, without a flush in between: this schedule itself
        for one step; for an asynchronous schedule, each stage's one-step list up to its drain, the
        steady actions `steps - 1` times (micro-batches shifted a step further each time), then the
        drain shifted to the last step (`SteadyState`). Nothing is scheduled here: the pieces are the
        plan's, emitted and verified with it (planner.schedule.make_schedule)."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if steps == 1:
            return self
        if self.steady is None:
            raise ValueError(f"schedule {self.name!r} of {self.microbatches} micro-batches has no steady state to run "
                             f"{steps} steps without a flush with" + (" (a flush schedule runs one step at a time)"
                                                                       if self.flushes else ""))
        rows = tuple(unroll(row, steady, drain_at, steps, self.microbatches)
                     for row, drain_at, steady in zip(self.actions, self.steady.drain_at, self.steady.actions))
        return Schedule(self.name, self.stages, steps * self.microbatches, rows, self.stash_depth, self.update_every)

    # JSON ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "update_every": self.update_every,
            "stash_depth": list(self.stash_depth),
            "actions": [[str(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Schedule":
        check_header(data, format=None, versions=SCHEMA_VERSION, where="schedule")
        missing = [k for k in ("name", "stages", "microbatches", "update_every", "stash_depth", "actions")
                   if k not in data]
        if missing:
            raise ValueError(f"schedule JSON lacks {', '.join(missing)}")
        rows = data["actions"]
        if not isinstance(rows, list) or not all(isinstance(r, list) and all(isinstance(t, str) for t in r)
                                                 for r in rows):
            raise ValueError("schedule JSON 'actions' must be a list (one per stage) of lists of action tokens")
        return cls(str(data["name"]), data["stages"], data["microbatches"],
                   tuple(tuple(Action.parse(t) for t in row) for row in rows),
                   tuple(data["stash_depth"]), data["update_every"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON schedule ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a schedule file holds a JSON object, got {type(data).__name__}")
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    # Text grid ----------------------------------------------------------------------------------

    def to_text(self) -> str:
        """A header line with the scalar fields, then one line of action tokens per stage."""
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"schedule name {self.name!r} cannot be written in the text form (empty or has spaces)")
        header = (f"# schedule name={self.name} stages={self.stages} microbatches={self.microbatches} "
                  f"update_every={self.update_every} stash_depth={','.join(map(str, self.stash_depth))} "
                  f"schema_version={SCHEMA_VERSION}")
        return "\n".join([header] + [" ".join(str(a) for a in row) for row in self.actions]) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = text.split("\n")
        if not lines or not lines[0].startswith("# schedule "):
            raise ValueError("schedule text must start with a '# schedule name=... stages=...' header line")
        fields = {}
        for item in lines[0][len("# schedule "):].split():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"schedule header item {item!r} is not key=value")
            fields[key] = value
        need = ("name", "stages", "microbatches", "update_every", "stash_depth", "schema_version")
        missing = [k for k in need if k not in fields]
        if missing:
            raise ValueError(f"schedule header lacks {', '.join(missing)}")
        version = fields["schema_version"]
        check_header({"schema_version": int(version) if version.isdigit() else version}, format=None,
                     versions=SCHEMA_VERSION, where="schedule header")
        try:
            stages = int(fields["stages"])
            microbatches = int(fields["microbatches"])
            update_every = int(fields["update_every"])
            stash = tuple(int(x) for x in fields["stash_depth"].split(",") if x)
        except ValueError as exc:
            raise ValueError(f"schedule header has a non-integer field ({exc})") from None
        rows = lines[1:]
        # An empty stage is an empty line, so only blank lines past the last stage are dropped.
        while len(rows) > stages and not rows[-1].strip():
            rows.pop()
        if len(rows) != stages:
            raise ValueError(f"schedule text has {len(rows)} stage lines, header says stages={stages}")
        actions = tuple(tuple(Action.parse(t) for t in row.split()) for row in rows)
        return cls(fields["name"], stages, microbatches, actions, stash, update_every)
