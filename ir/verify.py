"""Checks of the IR's two artefacts, graphs and pipeline schedules; pure functions.

`verify_graph` checks a lowered graph's structure. `verify_plan` checks a schedule's action lists
rule by rule and then dry-runs them in lockstep to find deadlocks, so a broken plan is refused
where it is written and again where it is loaded, before any device runs it. Plan errors show the
step x stage grid with the failing cell marked, because a wrong action is found by looking at its
neighbours on the same tick and the same stage.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ir.graph import BLOCK_KINDS, Graph
from ir.ops import COMPUTE_OPS, HOST_OPS, compute_output_shape
from ir.plan import RECV_FOR_SEND, SEND_FOR_RECV, Action, ActionKind, Schedule


class GraphError(ValueError):
    """A graph that breaks an IR invariant; the message names the node or block."""


def verify_graph(graph: Graph) -> None:
    known = set(graph.input_names()) | set(graph.constants)
    producers: dict[str, str] = {}
    for node in graph.nodes:
        ops = COMPUTE_OPS if node.tier == "compute" else HOST_OPS
        if node.op not in ops:
            raise GraphError(f"node {node.name!r}: op {node.op} is not a {node.tier} op of ir/ops.py")
        for i in node.inputs:
            if i and i not in known:
                raise GraphError(f"node {node.name!r} ({node.op}) reads {i!r}, which nothing before it produces")
        for o in node.outputs:
            if o in producers or o in graph.constants:
                raise GraphError(f"value {o!r} is produced twice (by {producers.get(o, 'a constant')!r} and {node.name!r})")
            producers[o] = node.name
            known.add(o)
            if o not in graph.values:
                raise GraphError(f"node {node.name!r}: output {o!r} has no Value entry")
        if node.tier == "compute":
            shapes = [graph.values[i].shape if i in graph.values else tuple(graph.constants[i].shape) for i in node.inputs]
            try:
                expected = compute_output_shape(node.op, dict(node.attrs), shapes)
            except ValueError as exc:
                raise GraphError(f"node {node.name!r} ({node.op}): {exc}") from None
            if tuple(expected) != tuple(graph.values[node.outputs[0]].shape):
                raise GraphError(f"node {node.name!r} ({node.op}): output shape {graph.values[node.outputs[0]].shape} "
                                 f"!= shape rule {expected}")
    for p in graph.params:
        if p not in graph.constants:
            raise GraphError(f"parameter {p!r} has no constant tensor")
    for v in graph.outputs:
        if v.name not in known:
            raise GraphError(f"graph output {v.name!r} is never produced")
    if graph.blocks:
        seen: dict[str, str] = {}
        for b in graph.blocks:
            if b.kind not in BLOCK_KINDS:
                raise GraphError(f"block {b.name!r}: unknown kind {b.kind!r}")
            for n in b.nodes:
                if n in seen:
                    raise GraphError(f"node {n!r} is in blocks {seen[n]!r} and {b.name!r}")
                seen[n] = b.name
        missing = [n.name for n in graph.nodes if n.tier == "compute" and n.name not in seen]
        if missing:
            raise GraphError(f"compute node {missing[0]!r} belongs to no block ({len(missing)} such nodes)")


# Pipeline schedules ---------------------------------------------------------------------------

class PlanError(ValueError):
    """A schedule that breaks a plan rule; the message is a one-line reason, then the grid.

    `rule` names the broken rule, `stage` and `action` (a token) the failing cell when there is
    one, `grid` the rendered step x stage grid.
    """

    def __init__(self, reason: str, grid: str, rule: str, stage: int | None = None, action: str | None = None):
        super().__init__(f"{reason}\n{grid}")
        self.reason, self.grid, self.rule, self.stage, self.action = reason, grid, rule, stage, action


@dataclass(frozen=True)
class DryRun:
    """The lockstep timeline of a schedule, in ticks (one tick = `forward_ticks` / `backward_ticks` units).

    `grid[t][s]` holds the tokens stage s started at tick t, space-separated; `..` while a multi-tick
    compute continues, empty when idle. A last row may hold only the zero-tick bookkeeping (sends,
    frees, updates) done at the instant the final compute ends, so `len(grid)` can be `ticks + 1`.
    """

    ticks: int
    per_stage_busy: tuple[int, ...]
    bubble_fraction: float
    grid: tuple[tuple[str, ...], ...]


@dataclass
class _Sim:
    rows: list[list[str]]
    tick_of: dict[tuple[int, int], int]
    busy: list[int]
    makespan: int
    stuck: dict[int, int] | None  # stage -> index of the action it waits at, when deadlocked


def _simulate(schedule: Schedule, forward_ticks: int, backward_ticks: int, weight_ticks: int = 1) -> _Sim:
    """Run the lists in lockstep; never raises, so error rendering can use it on broken plans."""
    lists = schedule.actions
    p = len(lists)
    ptr, busy_until, busy = [0] * p, [0] * p, [0] * p
    sent: Counter = Counter()
    rows: list[list[str]] = []
    tick_of: dict[tuple[int, int], int] = {}
    t = 0
    while True:
        row: list[list[str]] = [[] for _ in range(p)]
        progress = True
        # Zero-tick actions can unblock each other across stages within one tick (a send on one
        # stage lets the peer's receive and then its compute start at once), so sweep to a fixpoint.
        while progress:
            progress = False
            for s in range(p):
                while busy_until[s] <= t and ptr[s] < len(lists[s]):
                    a = lists[s][ptr[s]]
                    if a.kind.is_recv:
                        key = (SEND_FOR_RECV[a.kind], a.peer, s, a.microbatch)
                        if sent[key] == 0:
                            break
                        sent[key] -= 1
                    elif a.kind.is_send:
                        sent[(a.kind, s, a.peer, a.microbatch)] += 1
                    elif a.kind.is_compute:
                        d = {ActionKind.F: forward_ticks, ActionKind.B: backward_ticks}.get(a.kind, weight_ticks)
                        busy_until[s] = t + d
                        busy[s] += d
                    row[s].append(str(a))
                    tick_of[(s, ptr[s])] = t
                    ptr[s] += 1
                    progress = True
        rows.append([" ".join(c) if c else (".." if busy_until[s] > t else "") for s, c in enumerate(row)])
        done = all(ptr[s] == len(lists[s]) for s in range(p))
        if done or all(b <= t for b in busy_until):
            stuck = None if done else {s: ptr[s] for s in range(p) if ptr[s] < len(lists[s])}
            while rows and not any(rows[-1]) and len(rows) > 1:
                rows.pop()
            return _Sim(rows, tick_of, busy, max(busy_until, default=0), stuck)
        t += 1


def _render(cells: list[list[str]], labels: list[str], marks: dict[tuple[int, int], str], p: int) -> str:
    """A fixed-width table; marked cells show `>>token<<`, long grids are cut around the marks."""
    out_cells = []
    for r, row in enumerate(cells):
        new = []
        for s in range(p):
            c = row[s] if s < len(row) else ""
            tok = marks.get((r, s))
            if tok is not None:
                parts = c.split(" ") if c else []
                c = " ".join(f">>{x}<<" if x == tok else x for x in parts) if tok in parts else f">>{tok}<<"
            new.append(c or ".")
        out_cells.append(new)
    keep = set(range(len(out_cells)))
    if len(out_cells) > 80:
        marked_rows = {r for r, _ in marks}
        keep = {r for r in range(len(out_cells)) if r < 3 or r >= len(out_cells) - 3
                or any(abs(r - m) <= 10 for m in marked_rows)}
    header = ["step"] + [f"stage {s}" for s in range(p)]
    widths = [max([len(header[0])] + [len(labels[r]) for r in keep])]
    for s in range(p):
        widths.append(max([len(header[s + 1])] + [len(out_cells[r][s]) for r in keep]))
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines.append("-+-".join("-" * w for w in widths))
    skipped = False
    for r in range(len(out_cells)):
        if r not in keep:
            if not skipped:
                lines.append("...")
            skipped = True
            continue
        skipped = False
        lines.append(" | ".join(x.ljust(w) for x, w in zip([labels[r]] + out_cells[r], widths)).rstrip())
    return "\n".join(lines)


def _grid_for(schedule: Schedule, at: tuple[int, int] | None) -> str:
    """The tick grid when the dry run completes, else the list-position grid; `at` = (stage, index)."""
    p = schedule.stages
    sim = _simulate(schedule, 1, 1)
    if sim.stuck is None:
        marks = {}
        if at is not None and at in sim.tick_of:
            marks[(sim.tick_of[at], at[0])] = str(schedule.actions[at[0]][at[1]])
        return _render(sim.rows, [f"t{t}" for t in range(len(sim.rows))], marks, p) + \
            "\n(rows: ticks of the dry run with unit forward/backward)"
    n = max((len(r) for r in schedule.actions), default=0)
    cells = [[str(schedule.actions[s][i]) if i < len(schedule.actions[s]) else "" for s in range(p)]
             for i in range(n)]
    marks = {(at[1], at[0]): str(schedule.actions[at[0]][at[1]])} if at is not None else {}
    return _render(cells, [str(i) for i in range(n)], marks, p) + \
        "\n(rows: list positions; the dry run cannot run this plan)"


def _fail(schedule: Schedule, rule: str, detail: str, stage: int | None = None, index: int | None = None):
    token = str(schedule.actions[stage][index]) if stage is not None and index is not None else None
    where = f"stage {stage}" + (f", {token}" if token else "") if stage is not None else f"schedule {schedule.name!r}"
    at = (stage, index) if token is not None else None
    raise PlanError(f"{where}: rule '{rule}': {detail}", _grid_for(schedule, at), rule, stage, token)


def _index(row: tuple[Action, ...], kind: ActionKind) -> dict[int, int]:
    """micro-batch -> position of the first action of `kind` in a stage's list."""
    found: dict[int, int] = {}
    for i, a in enumerate(row):
        if a.kind is kind and a.microbatch not in found:
            found[a.microbatch] = i
    return found


def _check_structure(sch: Schedule) -> None:
    p, m = sch.stages, sch.microbatches
    for s, row in enumerate(sch.actions):
        for i, a in enumerate(row):
            if a.stage != s:
                _fail(sch, "stage placement", f"action of stage {a.stage} sits in the list of stage {s}", s, i)
            if a.microbatch is not None and not 0 <= a.microbatch < m:
                _fail(sch, "micro-batch range", f"micro-batch {a.microbatch} is outside 0..{m - 1}", s, i)
    # Activations flow down the pipeline, gradients flow back up, and only between neighbours.
    direction = {ActionKind.SEND_ACT: 1, ActionKind.RECV_ACT: -1, ActionKind.SEND_GRAD: -1, ActionKind.RECV_GRAD: 1}
    for s, row in enumerate(sch.actions):
        for i, a in enumerate(row):
            if a.kind in direction:
                want = s + direction[a.kind]
                if a.peer != want or not 0 <= want < p:
                    expect = f"stage {want}" if 0 <= want < p else "no stage (this end of the pipeline has none)"
                    _fail(sch, "adjacent stages", f"{a.kind.value} must go to/from {expect}, not stage {a.peer}", s, i)
    for s, row in enumerate(sch.actions):
        seen: dict[tuple[ActionKind, int], int] = {}
        for i, a in enumerate(row):
            if a.kind.is_compute:
                if (a.kind, a.microbatch) in seen:
                    _fail(sch, "F and B once", f"micro-batch {a.microbatch} has a second {a.kind.value} "
                          f"(first at position {seen[(a.kind, a.microbatch)]})", s, i)
                seen[(a.kind, a.microbatch)] = i
        for kind in (ActionKind.F, ActionKind.B) + ((ActionKind.W,) if sch.splits_backward else ()):
            missing = [mb for mb in range(m) if (kind, mb) not in seen]
            if missing:
                _fail(sch, "every micro-batch", f"stage {s} has no {kind.value} for micro-batch(es) "
                      f"{', '.join(map(str, missing))} of {m}", s, None)
        fpos, bpos = _index(row, ActionKind.F), _index(row, ActionKind.B)
        for mb in range(m):
            if bpos[mb] < fpos[mb]:
                _fail(sch, "F before B", f"micro-batch {mb}'s backward runs before its forward "
                      f"(position {fpos[mb]})", s, bpos[mb])
        if sch.splits_backward:
            wpos = _index(row, ActionKind.W)
            for mb in range(m):
                if wpos[mb] < bpos[mb]:
                    _fail(sch, "B before W", f"micro-batch {mb}'s weight gradients (W) run before its input "
                          f"gradient (B, position {bpos[mb]})", s, wpos[mb])


def _check_pairing(sch: Schedule) -> None:
    posted: dict[tuple, list[tuple[int, int]]] = {}
    for s, row in enumerate(sch.actions):
        for i, a in enumerate(row):
            if a.kind.is_send:
                posted.setdefault((a.kind, s, a.peer, a.microbatch), []).append((s, i))
    for s, row in enumerate(sch.actions):
        for i, a in enumerate(row):
            if a.kind.is_recv:
                key = (SEND_FOR_RECV[a.kind], a.peer, s, a.microbatch)
                if not posted.get(key):
                    _fail(sch, "send/receive pairing", f"no {key[0].value} of micro-batch {a.microbatch} on stage "
                          f"{a.peer} matches this receive", s, i)
                posted[key].pop(0)
    for key, left in posted.items():
        if left:
            s, i = left[0]
            _fail(sch, "send/receive pairing", f"no {RECV_FOR_SEND[key[0]].value} of micro-batch {key[3]} on stage "
                  f"{key[2]} matches this send", s, i)


def _check_order(sch: Schedule) -> None:
    p, m = sch.stages, sch.microbatches
    last = p - 1
    for s, row in enumerate(sch.actions):
        f, b = _index(row, ActionKind.F), _index(row, ActionKind.B)
        # the last pass that reads a micro-batch's activations: W when backwards are split
        last_pass = _index(row, ActionKind.W) if sch.splits_backward else b
        last_name = "weight-gradient pass (W" if sch.splits_backward else "backward (B"
        rules = []
        if s > 0:
            rules.append(("RECV_ACT before F", ActionKind.RECV_ACT, "F", f, True))
            rules.append(("SEND_GRAD after B", ActionKind.SEND_GRAD, "B", b, False))
        if s < last:
            rules.append(("SEND_ACT after F", ActionKind.SEND_ACT, "F", f, False))
            rules.append(("RECV_GRAD before B", ActionKind.RECV_GRAD, "B", b, True))
        for rule, kind, ckind, compute, before in rules:
            comm = _index(row, kind)
            for mb in range(m):
                if mb not in comm:
                    _fail(sch, rule, f"micro-batch {mb} has no {kind.value} on this stage", s, compute[mb])
                if before and comm[mb] > compute[mb]:
                    _fail(sch, rule, f"{ckind} of micro-batch {mb} runs before its {kind.value} "
                          f"(position {comm[mb]})", s, compute[mb])
                if not before and comm[mb] < compute[mb]:
                    _fail(sch, rule, f"{kind.value} of micro-batch {mb} runs before its {ckind} "
                          f"(position {compute[mb]})", s, comm[mb])
        frees: dict[int, int] = {}
        for i, a in enumerate(row):
            if a.kind is ActionKind.FREE:
                if a.microbatch in frees:
                    _fail(sch, "FREE after B", f"micro-batch {a.microbatch} is freed twice", s, i)
                if i < last_pass[a.microbatch]:
                    _fail(sch, "FREE after B", f"micro-batch {a.microbatch} is freed before its {last_name}, "
                          f"position {last_pass[a.microbatch]}) has used its activations", s, i)
                frees[a.microbatch] = i
        for mb in range(m):
            if mb not in frees:
                _fail(sch, "FREE after B", f"micro-batch {mb}'s activations are never freed", s, last_pass[mb])


def _check_updates(sch: Schedule) -> None:
    k = sch.update_every
    if sch.flushes and k != sch.microbatches:
        _fail(sch, "UPDATE cadence", f"a flush schedule updates once per batch, so update_every must equal "
              f"microbatches={sch.microbatches}, not {k}")
    # a micro-batch's gradients are complete after its B, or after its W when backwards are split
    done_kind = ActionKind.W if sch.splits_backward else ActionKind.B
    for s, row in enumerate(sch.actions):
        pending, last_b = 0, None
        later_b = [0] * (len(row) + 1)
        for i in range(len(row) - 1, -1, -1):
            later_b[i] = later_b[i + 1] + (row[i].kind is done_kind)
        for i, a in enumerate(row):
            if a.kind is done_kind:
                if pending == k:
                    _fail(sch, "UPDATE cadence", f"an UPDATE is due after {k} backward(s) but none ran before "
                          f"this backward", s, i)
                pending, last_b = pending + 1, a.microbatch
            elif a.kind is ActionKind.UPDATE:
                if pending == 0:
                    _fail(sch, "UPDATE cadence", "UPDATE with no backward since the last one", s, i)
                if pending < k and later_b[i]:
                    _fail(sch, "UPDATE cadence", f"UPDATE after {pending} backward(s); this schedule updates "
                          f"after every {k} (only the last UPDATE of a run may take fewer)", s, i)
                if a.microbatch is not None and a.microbatch != last_b:
                    _fail(sch, "UPDATE cadence", f"UPDATE names micro-batch {a.microbatch} but follows the "
                          f"backward of micro-batch {last_b}", s, i)
                pending = 0
        if pending:
            _fail(sch, "UPDATE cadence", f"the list ends with {pending} backward(s) whose gradients no UPDATE "
                  f"applies", s, len(row) - 1)


def _weight_versions(sch: Schedule, s: int):
    """Yield (index, versions alive) after each F and UPDATE of stage s.

    A forward uses the current version and its backward must use the same one, so a version
    stays alive while the current one or any pending backward needs it.
    """
    version, used_by = 0, {}
    done_kind = ActionKind.W if sch.splits_backward else ActionKind.B
    for i, a in enumerate(sch.actions[s]):
        if a.kind is ActionKind.F:
            used_by[a.microbatch] = version
        elif a.kind is done_kind:
            used_by.pop(a.microbatch, None)
        elif a.kind is ActionKind.UPDATE:
            version += 1
        else:
            continue
        yield i, {version} | set(used_by.values())


def peak_weight_versions(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most weight versions alive at once (what `stash_depth` must cover)."""
    return tuple(max((len(v) for _, v in _weight_versions(schedule, s)), default=1) for s in range(schedule.stages))


def _check_stash(sch: Schedule) -> None:
    for s in range(sch.stages):
        depth = sch.stash_depth[s]
        if not isinstance(depth, int) or depth < 1:
            _fail(sch, "stash depth", f"stash_depth[{s}] must be an int >= 1, got {depth!r}", s)
        for i, alive in _weight_versions(sch, s):
            if len(alive) > depth:
                _fail(sch, "stash depth", f"{len(alive)} weight versions alive here (v{', v'.join(map(str, sorted(alive)))}) "
                      f"but stash_depth[{s}] = {depth}", s, i)


def dry_run(schedule: Schedule, forward_ticks: int = 1, backward_ticks: int = 1, weight_ticks: int = 1) -> DryRun:
    """Lockstep timeline: each tick, every stage whose next action can run executes it.

    F, B and W take `forward_ticks` / `backward_ticks` / `weight_ticks`; sends, receives, FREE and UPDATE take none.
    Sends are buffered (never wait); a receive completes once its matching send has run, earlier
    or in the same tick. Raises PlanError when no stage can move while actions remain.
    """
    for name, v in (("forward_ticks", forward_ticks), ("backward_ticks", backward_ticks),
                    ("weight_ticks", weight_ticks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    p = schedule.stages
    sim = _simulate(schedule, forward_ticks, backward_ticks, weight_ticks)
    if sim.stuck is not None:
        stuck_at = len(sim.rows) - 1
        waits = []
        for s in range(p):
            if s in sim.stuck:
                waits.append(f"stage {s} waits at {schedule.actions[s][sim.stuck[s]]}")
            else:
                waits.append(f"stage {s} is done")
        cells = [list(r) for r in sim.rows] + [[str(schedule.actions[s][sim.stuck[s]]) if s in sim.stuck else ""
                                                for s in range(p)]]
        marks = {(len(cells) - 1, s): str(schedule.actions[s][i]) for s, i in sim.stuck.items()}
        labels = [f"t{t}" for t in range(len(sim.rows))] + ["stuck"]
        first = min(sim.stuck)
        raise PlanError(f"stage {first}, {schedule.actions[first][sim.stuck[first]]}: rule 'deadlock': no stage can "
                        f"move after tick {stuck_at}: {'; '.join(waits)} (each receive waits for a send that "
                        f"never runs)", _render(cells, labels, marks, p), "deadlock", first,
                        str(schedule.actions[first][sim.stuck[first]]))
    ticks = sim.makespan
    bubble = 1.0 - sum(sim.busy) / (p * ticks) if ticks else 0.0
    return DryRun(ticks, tuple(sim.busy), bubble, tuple(tuple(r) for r in sim.rows))


def verify_plan(schedule: Schedule) -> DryRun:
    """Check every plan rule; return the unit-tick dry run of a valid plan, raise PlanError otherwise.

    Structural rules come first because the dry run of a plan with an unmatched receive would only
    report a deadlock, hiding the cause.
    """
    _check_structure(schedule)
    _check_pairing(schedule)
    _check_order(schedule)
    _check_updates(schedule)
    run = dry_run(schedule)
    _check_stash(schedule)
    return run
