"""Searching device orders around the exact fixed-order program (planner.partition.dp).

A plan is a device order plus its cuts, and for one order planner.partition.dp finds the best cuts
exactly (over every suffix of the order, so an order of all the devices also chooses which of
them to leave out: those at its far end). What remains is the order, searched here:

- `exhaustive`: every order, when there are few. Interchangeable devices (`device_classes`) make
  orders that differ only by swapping them equal, so the orders enumerated are the distinct
  sequences of classes (n! / prod(class sizes!)), each solved exactly with the incumbent as a
  cut-off. When it completes, its plan is proven optimal.
- `OrderSearch`: iterated local search for the rest, from seed orders (fastest device last,
  largest memory last, memory per unit of time, the greedy plan, orders read off the Lagrangian
  relaxation of planner.partition.bound). A move swaps two devices of different classes or moves
  one to another position, among the used positions and the next unused one, or reverses a
  segment of used positions; the neighbourhood is scanned in random order, taking the first
  improvement. A candidate is priced first by one pass at the current plan's largest stage time T
  over at most a few more stages than the current plan has (its plan is a real plan, so an
  improvement there is real) and, when that comes close, exactly
  (`best_for_order`, cut off at the current value). When a whole neighbourhood brings nothing,
  the best order is kicked (a few random swaps among its used positions) and the search goes on
  from there.
"""
from __future__ import annotations

import math
import random
import time
from typing import Iterator, Sequence

from planner.partition.dp import INF, OrderSolver
from planner.partition.instance import Assignment
from planner.partition.simple import greedy_partition


def class_orders(classes: Sequence[Sequence[int]]) -> int:
    """How many distinct sequences of classes order all the devices."""
    total = sum(len(c) for c in classes)
    count = math.factorial(total)
    for c in classes:
        count //= math.factorial(len(c))
    return count


def _sequences(counts: list[int]) -> Iterator[list[int]]:
    """Every distinct sequence of class labels using class c counts[c] times."""
    total = sum(counts)
    seq: list[int] = []

    def rec():
        if len(seq) == total:
            yield list(seq)
            return
        for c, k in enumerate(counts):
            if k:
                counts[c] -= 1
                seq.append(c)
                yield from rec()
                seq.pop()
                counts[c] += 1
    yield from rec()


def _devices_of(sequence: Sequence[int], classes: Sequence[Sequence[int]]) -> list[int]:
    free = [list(c) for c in classes]
    return [free[c].pop(0) for c in sequence]


def seed_orders(solver: OrderSolver) -> list[list[int]]:
    """Orders to start from (E[0] = the last stage): speed, memory and memory per time rankings
    (the preferred devices last, so that the shortest suffixes use them), and the greedy plan."""
    inst = solver.inst
    nd = solver.nd
    total = [sum(row) for row in inst.compute_us]
    budget = inst.memory_budget_bytes
    orders = [sorted(range(nd), key=lambda d: (total[d], -budget[d])),
              sorted(range(nd), key=lambda d: (-budget[d], total[d])),
              sorted(range(nd), key=lambda d: -budget[d] / max(1, total[d]))]
    start = greedy_partition(inst)
    if start is not None:
        used = list(reversed(start[0]))
        orders.append(used + [d for d in orders[0] if d not in used])
    out, seen = [], set()
    for o in orders:
        if tuple(o) not in seen:
            seen.add(tuple(o))
            out.append(o)
    return out


class Best:
    """The best plan found so far: its value, assignment, device order and who found it."""

    def __init__(self):
        self.value: float = INF
        self.assignment: Assignment | None = None
        self.order: list[int] | None = None
        self.source = "dp"

    def offer(self, value: float, assignment: Assignment | None, order: Sequence[int], source: str = "dp") -> bool:
        if assignment is not None and value < self.value:
            self.value, self.assignment, self.order, self.source = value, assignment, list(order), source
            return True
        return False


def exhaustive(solver: OrderSolver, classes, best: Best, deadline: float) -> bool:
    """Every distinct class sequence, solved exactly; True when all were (then `best` is optimal)."""
    counts = [len(c) for c in classes]
    for seq in _sequences(counts):
        if time.monotonic() >= deadline:
            return False
        order = _devices_of(seq, classes)
        got = solver.best_for_order(order, best.value)
        if got is not None:
            best.offer(got[0], got[1], order)
    return True


class OrderSearch:
    """Iterated local search over device orders (see the module docstring); resumable."""

    REACH = 4  # stages beyond the current plan's that the quick pass considers
    EXACT_PASSES = 8  # passes of the threshold search per candidate (its plan is real when cut short)

    def __init__(self, solver: OrderSolver, classes, best: Best, seed: int = 0):
        self.solver, self.best = solver, best
        self.rng = random.Random(seed)
        self.klass = {d: c for c, members in enumerate(classes) for d in members}
        self.current: list[int] | None = None
        self.value = INF
        self.stages = 1
        self.T = INF
        self.evaluations = 0
        self.exact = 0
        self._scanned = False  # the current neighbourhood has been generated once already
        self._pending: list = []  # its moves not tried yet
        # the margin within which a candidate is priced exactly: wide where passes are cheap
        self.margin = 0.02 if solver.nd * solver.n <= 2000 else 0.005

    def evaluate(self, order: Sequence[int]) -> bool:
        """Solve `order` exactly and offer it; True when it is the best so far."""
        got = self.solver.best_for_order(order, self.best.value)
        self.exact += 1
        return got is not None and self.best.offer(got[0], got[1], order)

    def _adopt(self, order: list[int], value: float, assignment: Assignment) -> None:
        self.current, self.value = order, value
        self.stages = len(assignment[0])
        self.T = self.solver.bottlenecks(assignment)[0] if not self.solver.async_ else INF

    def _restart(self) -> None:
        got = self.solver.best_for_order(self.best.order)
        self._adopt(list(self.best.order), got[0], got[1])

    def _moves(self) -> list[tuple[str, int, int]]:
        """Every move from the current order, shuffled: swap a used (or the next unused) position
        with any other of a different class, move a device to such a position, reverse a segment
        of used positions (links are symmetric, so only the two at its ends change)."""
        order, nd = self.current, len(self.current)
        span = min(nd, self.stages + 1)
        moves = [(kind, a, b) for a in range(span) for b in range(nd) if a != b
                 and self.klass[order[a]] != self.klass[order[b]] for kind in ("swap", "move")]
        moves += [("reverse", a, b) for a in range(span) for b in range(a + 2, span)]
        self.rng.shuffle(moves)
        return moves

    @staticmethod
    def _apply(order: list[int], move: tuple[str, int, int]) -> list[int]:
        kind, a, b = move
        cand = list(order)
        if kind == "swap":
            cand[a], cand[b] = cand[b], cand[a]
        elif kind == "move":
            cand.insert(a, cand.pop(b))
        else:
            cand[a:b + 1] = cand[a:b + 1][::-1]
        return cand

    def _kick(self) -> None:
        order = list(self.best.order)
        span = min(len(order), self.stages + 2)
        for _ in range(self.rng.randint(2, 3)):
            a, b = self.rng.randrange(span), self.rng.randrange(len(order))
            order[a], order[b] = order[b], order[a]
        got = self.solver.best_for_order(order)
        if got is None:
            self._restart()
        else:
            self.best.offer(got[0], got[1], order)
            self._adopt(order, got[0], got[1])

    def run(self, deadline: float) -> None:
        """Search until `deadline` (time.monotonic()): first improvement over the shuffled
        neighbourhood of the current order; a kick from the best order once a whole neighbourhood
        brought nothing (a local optimum)."""
        if self.best.order is None or time.monotonic() >= deadline:
            return
        if self.current is None:
            self._restart()
        s = self.solver
        moves = self._pending
        while time.monotonic() < deadline:
            if not moves:
                if self._scanned:
                    self._kick()
                moves, self._scanned = self._moves(), True
                self._pending = moves
                if not moves:
                    return
            cand = self._apply(self.current, moves.pop())
            self.evaluations += 1
            improved = None
            if s.async_:
                got = s.best_for_order(cand, self.value + 1)
                if got is not None and got[0] <= self.value:
                    improved = got
            else:
                # the quick pass looks a few stages beyond the current plan's only (its plan is real)
                quick = s.plan(cand, "sum", self.T, stages=self.stages + self.REACH)
                if quick is not None:
                    v = s.objective(quick.assignment)
                    if v <= self.value * (1 + self.margin):
                        got = s.best_for_order(cand, self.value + 1, self.EXACT_PASSES)
                        self.exact += 1
                        if got is not None and got[0] <= self.value:
                            improved = got
                        elif v <= self.value:
                            improved = (v, quick.assignment, v)
            if improved is not None:
                better = improved[0] < self.value
                self._adopt(cand, improved[0], improved[1])
                self.best.offer(improved[0], improved[1], cand)
                if better:
                    moves, self._scanned = [], False
                    self._pending = moves
