"""A proven lower bound on the partitioning problem: relaxations of the order and of distinctness.

The exact program of planner.partition.dp needs a device order; the bound drops the order. Three
relaxations of the least sum of flush stage times w, each a pass of the same recurrence as the
exact program (over position and first block, the device class chosen per stage):

- prices (`Relaxation.run`): a plan is any sequence of at most min(devices, blocks) stages, each
  on any device class u, the class's capacity (its number of devices) enforced only through
  prices lambda_u >= 0:
      L(lambda) = min over relaxed sequences of sum_s (w_s + lambda_{u_s}) - sum_u cap_u lambda_u
  is at most the least sum of any real plan (which uses class u at most cap_u times, so its
  price term is <= 0). Links, which depend on the unknown neighbours, are priced at their
  cheapest (into device d at boundary k the least transfer from any other device, out of it
  likewise). Subgradient steps on lambda (uses - capacity, Polyak's step towards the upper bound,
  deflected by the previous direction, prices capped where they could only cost precision)
  raise L; every L(lambda) is a valid bound, so stopping early is safe.
- linked prices (`Relaxation.link`, where few classes and blocks make it cheap): the state also
  holds the class of the stage starting at the first block, so the sum counts every link exactly
  (two transfers per boundary) and each stage's w is checked with its link out exact.
- subset (`SubsetRelaxation`, on small clusters): the state holds how many devices of each class
  are used (prod(class size + 1) states), so distinctness is exact and only the order is relaxed;
  its linked form (`value_linked`) prices the links exactly too. Without links its value is the
  least sum exactly (tests/planner/test_partition.py checks that): the prices cannot see that one
  relaxed sequence uses a fast device twice and another none, this pass can.

The objectives. Flush: the step is sum w + (m-1) max w + max U. For a threshold T, a relaxation
restricted to stages with w <= T bounds the sum of every real plan whose max w is <= T, and can
only grow as T falls; so for the T-interval [a, b], L_b + (m-1) a + U_lb bounds every plan with
max w in [a, b], where U_lb = the larger of the largest cheapest update of one block and an equal
share of all blocks' cheapest updates over the most stages a plan can have (split backwards,
zb-h1: the update is the tail W + U, and U_lb also takes off every block's dearest W, which the
plan's first trip skips). The bound is the
least of these over intervals covering [T_min, T_top]: T_min from the relaxed min-max pass (no
plan has a smaller max w), T_top where the unconstrained relaxation alone reaches the upper bound.
`BoundSearch` works on the interval of lowest bound: it splits the interval when its width costs
more than the relaxation could gain (or the relaxation is settled there), and otherwise improves
the relaxation at its top (a subset pass settles a point at once; prices take steps). 1f1b-stash:
the step is m max a; the bound is m times the least bottleneck of the subset pass where
affordable, else the least T not proven infeasible by prices (a lambda with L(lambda) > 0 under
zero stage costs proves that no distinct-device plan has every a <= T), found by bisection. If
even a relaxation has no plan that fits, no plan fits (the memory terms are exact).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from planner.partition.dp import INF, OrderSolver
from planner.partition.instance import device_classes


@dataclass
class _Point:
    """Subgradient state at one threshold T."""

    T: float
    lam: np.ndarray
    best: float = -INF          # the best L found (a valid bound on the sum for every max w <= T)
    theta: float = 1.5
    stall: int = 0
    steps: int = 0
    done: bool = False          # lambda cannot be improved (a zero subgradient: L is the relaxed optimum)
    direction: np.ndarray | None = None  # the last (deflected) step direction
    exact: bool = False         # the subset relaxation has been run here


@dataclass(order=True)
class _Interval:
    bound: float
    a: float = field(compare=False)
    b: float = field(compare=False)
    point: _Point = field(compare=False)


class Relaxation:
    """The relaxed pass (see the module docstring) over one instance's device classes."""

    def __init__(self, solver: OrderSolver):
        self.solver = s = solver
        inst = s.inst
        self.classes = device_classes(inst)
        self.cap = np.array([len(c) for c in self.classes], dtype=np.float64)
        reps = [c[0] for c in self.classes]
        nd, n = s.nd, s.n
        self.n, self.positions = n, min(nd, n)
        tr = s.tr.copy()
        for d in range(nd):
            tr[d, d] = INF
        link_in = np.zeros((nd, n))    # [d][i]: the cheapest transfer into d's first block i (0 at i = 0)
        link_out = np.zeros((nd, n))   # [d][j]: the cheapest transfer out of d after block j-1
        if nd > 1 and n > 1:
            link_in[:, 1:] = tr.min(axis=0)
            link_out[:, 1:] = tr.min(axis=1)
        elif n > 1:
            link_in[:, 1:] = INF       # one device: no stage can start after block 0
        self.link_in = link_in[reps]
        U = len(reps)
        self.async_ = s.async_
        last = [s.last(d) for d in reps]
        # the last stage [i, n): w (flush) or a (1f1b-stash), inf where it does not fit
        if self.async_:
            self.last_cost = np.array([np.maximum(x.compute + x.update, 2 * li) for x, li in zip(last, self.link_in)])
        else:
            self.last_cost = np.array([x.compute for x in last]) + self.link_in
        # the non-last positions: one tensor per position class, padded to a common band width
        # (`compute` keeps the stages' compute alone, for the linked tables)
        self.tensors, self.compute = {}, {}
        self.compute_last = np.array([x.compute for x in last])
        for c in sorted({s.position_class(r) for r in range(1, self.positions)}):
            bands = [s.band(d, c) for d in reps]
            K = max([b.compute.shape[1] for b in bands if b is not None], default=0)
            if K == 0:
                self.tensors[c] = None
                continue
            W = np.full((U, n, K), INF)
            C = np.full((U, n, K), INF)
            for u, (b, d) in enumerate(zip(bands, reps)):
                if b is None:
                    continue
                k = b.compute.shape[1]
                C[u, :, :k] = b.compute
                if self.async_:
                    W[u, :, :k] = np.maximum(b.compute + b.update, 2 * self.link_in[u][:, None])
                else:
                    W[u, :, :k] = b.compute + self.link_in[u][:, None] + link_out[d][b.j]
            j = np.minimum(np.arange(n)[:, None] + 1 + np.arange(K)[None, :], n - 1)
            self.tensors[c] = (W, j)
            self.compute[c] = C
        self._masked: dict = {}
        self.passes = 0
        self.reps, self.link_out = reps, link_out[reps]
        self.pairs = None  # the linked tables, built by `link` when affordable
        links = s.tr.max(initial=0.0) if s.tr.size else 0.0
        self.lam_cap = 4.0 * (float(s._pc[:, -1].max()) + 2 * n * links + float(s._pu[:, -1].max()) + 1.0)

    def band_width(self) -> int:
        return max([t[0].shape[2] for t in self.tensors.values() if t is not None], default=1)

    def pair_link(self) -> np.ndarray:
        """[u'][u][k]: one transfer after block k from class u' to class u (two members of one
        class when it has them; inf for a one-device class to itself)."""
        s, U, n = self.solver, len(self.classes), self.n
        out = np.full((U, U, max(n - 1, 0)), INF)
        for a, first in enumerate(self.classes):
            for b, second in enumerate(self.classes):
                d, e = first[0], (second[1] if a == b and len(second) > 1 else second[0])
                if d != e:
                    out[a, b] = s.tr[d, e]
        return out

    def link(self) -> None:
        """Build the linked tables: with the class of the next stage known, the sum counts every
        link exactly (2 transfers per boundary) and a stage's w is checked with its link out exact
        and its link in at the cheapest. [c] = (cost (U', U, n, K), check (U', U, n, K), j)."""
        if self.pairs is not None or self.async_:
            return
        n = self.n
        pl = self.pair_link()
        first_in = self.link_in  # [u][i], 0 at i = 0
        self.pairs = {}
        for c, t in self.tensors.items():
            if t is None:
                self.pairs[c] = None
                continue
            _, j = t
            compute = self.compute[c]
            out = pl[:, :, j - 1] if n > 1 else np.zeros((len(self.classes),) * 2 + j.shape)
            cost = compute[:, None] + 2 * out
            check = compute[:, None] + out + first_in[:, None, :, None]
            self.pairs[c] = (cost, check, j)
        self.pair_last = (self.compute_last, self.last_cost)  # cost, check (its link in at the cheapest)
        self._pair_masked: dict = {}

    def _pairs_at(self, T: float):
        def make():
            cost, check = self.pair_last
            return (np.where(check <= T, cost, INF),
                    {c: None if t is None else (np.where(t[1] <= T, t[0], INF), t[2]) for c, t in self.pairs.items()})
        return _remembered(self._pair_masked, T, make, 4)

    def _at(self, T: float):
        """The stage tables with the stages above T removed (the last few thresholds are kept)."""
        def make():
            return (np.where(self.last_cost <= T, self.last_cost, INF),
                    {c: None if t is None else (np.where(t[0] <= T, t[0], INF), t[1]) for c, t in self.tensors.items()})
        return _remembered(self._masked, T, make, 6)

    def run(self, lam: np.ndarray, T: float = INF, zero_cost: bool = False) -> tuple[float, np.ndarray]:
        """(L(lambda), uses per class of the relaxed optimum) at threshold T; with `zero_cost`, the
        stages cost only their prices (the feasibility relaxation of 1f1b-stash)."""
        self.passes += 1
        if self.pairs is not None and not zero_cost:
            return self._run_linked(lam, T)
        last, tens = self._at(T)
        rows = np.arange(self.n)
        if zero_cost:
            last = np.where(np.isfinite(last), 0.0, INF)
        L0 = last + lam[:, None]
        u0 = L0.argmin(axis=0)
        F = L0[u0, rows]
        best, best_r = F[0], 0
        pick = {}
        backs = []
        for r in range(1, self.positions):
            c = self.solver.position_class(r)
            if c not in pick:
                t = tens.get(c)
                if t is None:
                    pick[c] = None
                else:
                    W, j = t
                    if zero_cost:
                        W = np.where(np.isfinite(W), 0.0, INF)
                    Wl = W + lam[:, None, None]
                    u = Wl.argmin(axis=0)
                    pick[c] = (np.take_along_axis(Wl, u[None], axis=0)[0], u, j)
            got = pick[c]
            if got is None:
                break
            Wm, u, j = got
            G = Wm + F[j]
            arg = G.argmin(axis=1)
            F = G[rows, arg]
            backs.append((u, arg, j))
            if F[0] < best:
                best, best_r = F[0], r
            if not np.isfinite(F).any():
                break
        counts = np.zeros(len(lam))
        path = []  # the relaxed optimum's classes, first stage first
        if np.isfinite(best):
            i = 0
            for r in range(best_r, 0, -1):
                u, arg, j = backs[r - 1]
                path.append(int(u[i, arg[i]]))
                i = int(j[i, arg[i]])
            path.append(int(u0[i]))
            for x in path:
                counts[x] += 1
        self.last_path = path
        return float(best - float(lam @ self.cap)), counts

    def _run_linked(self, lam: np.ndarray, T: float) -> tuple[float, np.ndarray]:
        """`run` with the linked tables: the state is (class of the stage, its first block)."""
        last, tens = self._pairs_at(T)
        U, n = len(self.classes), self.n
        F = last + lam[:, None]                      # [u][i]
        best_u = int(F[:, 0].argmin())
        best, best_r, backs = F[best_u, 0], 0, []
        for r in range(1, self.positions):
            t = tens.get(self.solver.position_class(r))
            if t is None:
                break
            cost, j = t
            K = j.shape[1]
            G = (cost + F[None, :, j]).transpose(0, 2, 1, 3).reshape(U, n, U * K)  # [u'][i][(u, t)]
            arg = G.argmin(axis=2)
            F = np.take_along_axis(G, arg[:, :, None], axis=2)[:, :, 0] + lam[:, None]
            backs.append((arg, j, K))
            u = int(F[:, 0].argmin())
            if F[u, 0] < best:
                best, best_r, best_u = F[u, 0], r, u
            if not np.isfinite(F).any():
                break
        counts, path = np.zeros(U), []
        if np.isfinite(best):
            u, i = best_u, 0
            for r in range(best_r, 0, -1):
                arg, j, K = backs[r - 1]
                path.append(u)
                u, t = divmod(int(arg[u, i]), K)
                i = int(j[i, t])
            path.append(u)
            for x in path:
                counts[x] += 1
        self.last_path = path
        return float(best - float(lam @ self.cap)), counts

    def order_of(self, path: list[int], lam: np.ndarray) -> list[int]:
        """A device order (E[0] = last stage) from a relaxed path (classes, first stage first):
        each class's members in turn, a class used more often than it has members skipped, then
        the devices left, the highest priced first."""
        free = [list(c) for c in self.classes]
        order = []
        for u in reversed(path):
            if free[u]:
                order.append(free[u].pop(0))
        rest = sorted(((lam[u], d) for u, members in enumerate(free) for d in members), key=lambda x: -x[0])
        return order + [d for _, d in rest]

    def step(self, p: _Point, target: float, zero_cost: bool = False, theta_stall: int = 8,
             deflect: float = 0.0) -> float:
        """One subgradient step at p's threshold (Polyak's step towards `target`, the direction
        deflected by the previous one); returns L."""
        L, counts = self.run(p.lam, p.T, zero_cost)
        p.steps += 1
        if not np.isfinite(p.best) or L > p.best + 1e-9 * max(1.0, abs(p.best)):
            p.best, p.stall = L, 0
        else:
            p.stall += 1
            if p.stall >= theta_stall:
                p.theta, p.stall = p.theta / 2, 0
        if not np.isfinite(L):
            p.done = True
            return L
        raw = counts - self.cap
        raw = np.where((p.lam <= 0) & (raw < 0), 0.0, raw)
        if not raw.any() or p.theta < 1e-4:
            p.done = True  # a zero subgradient: lambda is optimal for the dual
            return L
        g = raw + deflect * p.direction if deflect and p.direction is not None else raw
        g = np.where((p.lam <= 0) & (g < 0), 0.0, g)
        p.direction = g
        norm = float(g @ g)
        if norm == 0:
            p.done = True
            return L
        gap = max(target - L, 1e-3 * max(1.0, abs(L))) if np.isfinite(target) else 0.1 * max(1.0, abs(L))
        # prices beyond the cost of the dearest plan buy nothing, and huge ones cost float precision
        p.lam = np.clip(p.lam + p.theta * gap / norm * g, 0.0, self.lam_cap)
        return L


class SubsetRelaxation:
    """The relaxation with device distinctness kept exactly: a pass over (how many devices of each
    class are used, first block), links still priced at their cheapest. Its states number
    prod(class size + 1), so it serves small clusters (`affordable`), where it is far tighter
    than the prices: the Lagrangian dual cannot see that one relaxed sequence uses a fast device
    twice and another none. For a threshold T, `value` is the least sum of w over every real plan
    whose max w is <= T, up to the links (so at most the exact least sum)."""

    MAX_WORK = 60e6         # element operations per pass (about 5 ms per million here)
    MAX_LINKED_WORK = 20e6  # the linked pass is slower per operation (about 12 ms per million)

    def __init__(self, rx: Relaxation):
        self.rx = rx
        cap = [int(c) for c in rx.cap]
        self.cap = cap
        self.stride = np.cumprod([1] + [c + 1 for c in cap[:-1]]).astype(np.int64)
        self.states = int(np.prod([c + 1 for c in cap]))
        counts = np.zeros((self.states, len(cap)), dtype=np.int64)
        rest = np.arange(self.states)
        for u, c in enumerate(cap):
            counts[:, u] = rest % (c + 1)
            rest //= c + 1
        self.counts = counts
        self.level = counts.sum(axis=1)
        self.by_level = [np.nonzero(self.level == k)[0] for k in range(int(self.level.max()) + 1)]

    @staticmethod
    def work(rx: Relaxation) -> float:
        states = float(np.prod([c + 1 for c in rx.cap]))
        K = max([t[0].shape[2] for t in rx.tensors.values() if t is not None], default=1)
        return states * max(1.0, len(rx.cap) / 2) * rx.n * K

    @classmethod
    def affordable(cls, rx: Relaxation) -> bool:
        return cls.work(rx) <= cls.MAX_WORK

    @staticmethod
    def linked_work(rx: Relaxation) -> float:
        U = len(rx.cap)
        states = float(np.prod([c + 1 for c in rx.cap]))
        return states * U * max(1.0, U / 2) * rx.n * rx.band_width()

    @classmethod
    def linked_affordable(cls, rx: Relaxation) -> bool:
        states = float(np.prod([c + 1 for c in rx.cap]))
        return not rx.async_ and cls.linked_work(rx) <= cls.MAX_LINKED_WORK and states * len(rx.cap) * rx.n <= 4e6

    def value_linked(self, T: float) -> tuple[float, list[int]]:
        """`value` with the linked tables of Relaxation.link (state: counts, first block, its class)."""
        rx = self.rx
        rx.link()
        last, tens = rx._pairs_at(T)
        n, U = rx.n, len(self.cap)
        F = np.full((self.states, U, n), INF)
        for u in range(U):
            F[self.stride[u], u] = last[u]
        for k in range(1, min(rx.positions, len(self.by_level) - 1)):
            t = tens.get(rx.solver.position_class(k))
            if t is None:
                break
            cost, j = t
            src = self.by_level[k]
            src = src[np.isfinite(F[src]).any(axis=(1, 2))]
            if not len(src):
                break
            for u in range(U):
                can = src[self.counts[src, u] < self.cap[u]]
                if not len(can):
                    continue
                G = (cost[u][None] + F[can][:, :, j]).min(axis=(1, 3))   # [state][i]
                dst = can + self.stride[u]
                F[dst, u] = np.minimum(F[dst, u], G)
        best = F[:, :, 0].min()
        if not np.isfinite(best):
            return INF, []
        state, u = np.unravel_index(int(F[:, :, 0].argmin()), F[:, :, 0].shape)
        return float(best), self._path_linked(F, int(state), int(u), tens)

    def _path_linked(self, F, state: int, u: int, tens) -> list[int]:
        """The classes of an optimal linked sequence whose first stage is class u in `state`."""
        rx, path, i = self.rx, [], 0
        while True:
            path.append(u)
            k = int(self.level[state])
            if k == 1:
                return path
            cost, j = tens[rx.solver.position_class(k - 1)]
            prev = state - self.stride[u]
            got = cost[u, :, i, :] + F[prev][:, j[i]]        # [u2][t]
            u2, t = np.unravel_index(int(got.argmin()), got.shape)
            if not got[u2, t] <= F[state, u, i] * (1 + 1e-12) + 1e-9:
                return path  # float ties that cannot be retraced: stop with what was found
            state, u, i = prev, int(u2), int(j[i, t])

    def value(self, T: float, bottleneck: bool = False) -> tuple[float, list[int]]:
        """(least relaxed sum with every stage cost <= T, its classes first stage first; [] when
        none); with `bottleneck`, the least largest stage cost instead of the sum."""
        rx = self.rx
        last, tens = rx._at(T)
        n, U = rx.n, len(self.cap)
        F = np.full((self.states, n), INF)
        for u in range(U):
            F[self.stride[u]] = last[u]
        for k in range(1, min(rx.positions, len(self.by_level) - 1)):
            t = tens.get(rx.solver.position_class(k))
            if t is None:
                break
            W, j = t
            src = self.by_level[k]
            src = src[np.isfinite(F[src]).any(axis=1)]
            if not len(src):
                break
            for u in range(U):
                can = src[self.counts[src, u] < self.cap[u]]
                if not len(can):
                    continue
                if bottleneck:
                    G = np.maximum(W[u][None], F[can][:, j]).min(axis=2)
                else:
                    G = (W[u][None] + F[can][:, j]).min(axis=2)
                dst = can + self.stride[u]
                F[dst] = np.minimum(F[dst], G)
        best = F[:, 0].min()
        if not np.isfinite(best):
            return INF, []
        if bottleneck:
            return float(best), []
        return float(best), self._path(F, int(F[:, 0].argmin()), last, tens)

    def _path(self, F, state, last, tens) -> list[int]:
        """The classes of an optimal sequence ending in `state` (recomputed from F)."""
        rx, path, i = self.rx, [], 0
        while True:
            k = int(self.level[state])
            if k == 1:
                path.append(int(np.nonzero(self.counts[state])[0][0]))
                return path
            W, j = tens[rx.solver.position_class(k - 1)]
            target = F[state, i]
            for u in np.nonzero(self.counts[state])[0]:
                prev = state - self.stride[u]
                got = W[u, i] + F[prev, j[i]]
                t = int(got.argmin())
                if got[t] <= target * (1 + 1e-12) + 1e-9:
                    path.append(int(u))
                    state, i = prev, int(j[i, t])
                    break
            else:  # float ties that the search cannot retrace: stop with what was found
                return path


class BoundSearch:
    """The flush bound over T-intervals, resumable: `run(upper, deadline)` refines it from where the
    last call stopped and returns the bound proven so far (at most `upper`, the best plan's value)."""

    THETA, STALL, DEFLECT = 1.5, 15, 0.6   # subgradient: initial step factor, stall to halve it, deflection
    LINKED_WORK = 1e6                      # element operations per linked Lagrangian pass

    def __init__(self, solver: OrderSolver, relaxation: Relaxation | None = None, min_width: float = 1e-3):
        self.rx = rx = relaxation or Relaxation(solver)
        self.solver, self.m1 = solver, solver.m - 1
        # the largest tail (W + optimizer step): at least one block's cheapest, and at least an equal
        # share of every block's cheapest over the most stages a plan can have; less the most the
        # plan's W passes can take off the sum of w (each block's dearest W: 0 unless the schedule
        # splits backwards), since the relaxations bound the sum of w, not of w - W
        weight = np.array(solver.inst.weight_us, dtype=np.float64)
        cheapest = (np.array(solver.inst.update_us, dtype=np.float64) + weight).min(axis=0)
        self.u_lb = float(max(cheapest.max(initial=0.0), cheapest.sum() / rx.positions)) - float(weight.max(axis=0).sum())
        self.top = _Point(INF, np.zeros(len(rx.cap)))
        self.t_min = None if rx.async_ else _relaxed_min_max(rx)
        self.heap: list[_Interval] = []
        self.min_width = min_width
        self.proven = -INF
        self.subset = SubsetRelaxation(rx) if SubsetRelaxation.affordable(rx) else None
        self.linked_subset = self.subset is not None and SubsetRelaxation.linked_affordable(rx)
        # links exact in the Lagrangian pass too where that is cheap (few classes, few blocks)
        if not rx.async_ and not self.linked_subset and \
                len(rx.cap) ** 2 * rx.n * rx.band_width() * rx.positions <= self.LINKED_WORK:
            rx.link()
        self.paths: list[tuple[float, list[int]]] = []  # (T, classes) of exact subset optima

    def _bound(self, iv: _Interval) -> float:
        return max(iv.point.best, self.top.best) + self.m1 * iv.a + self.u_lb

    def _push(self, a: float, b: float, p: _Point) -> None:
        iv = _Interval(0.0, a, b, p)
        iv.bound = self._bound(iv)
        heapq.heappush(self.heap, iv)

    def _step(self, p: _Point, target: float) -> None:
        if self.subset is not None and not p.exact:
            # the subset relaxations are exact at their threshold: one pass each settles them
            value, path = self.subset.value(p.T)
            if self.linked_subset:
                linked, linked_path = self.subset.value_linked(p.T)
                if linked >= value:
                    value, path = linked, linked_path or path
            if path:
                self.paths.append((p.T, path))
            p.best, p.exact, p.steps = max(p.best, value), True, p.steps + 1
            p.done = self.linked_subset or self.rx.pairs is None
            return
        self.rx.step(p, target, theta_stall=self.STALL, deflect=self.DEFLECT)

    def run(self, upper: float, deadline: float) -> float:
        rx, m1, u_lb = self.rx, self.m1, self.u_lb
        if rx.async_:
            if self.subset is not None:  # the least bottleneck over distinct devices, in one pass
                got = self.rx.solver.m * self.subset.value(INF, bottleneck=True)[0]
            else:
                got = _async_bound(rx, upper, deadline)
            self.proven = max(self.proven, got)
            return min(upper, self.proven)
        if self.top.steps < 3:
            for _ in range(3):
                self._step(self.top, upper - u_lb)
        if not np.isfinite(self.top.best) or not np.isfinite(self.t_min):
            return INF  # not even the relaxation fits: no plan does
        if not np.isfinite(upper):
            return self.top.best + m1 * self.t_min + u_lb
        if m1 == 0:
            while not self.top.done and self.top.best + u_lb < upper and time.monotonic() < deadline:
                self._step(self.top, upper - u_lb)
            return min(upper, self.top.best + u_lb)
        t_top = (upper - u_lb - self.top.best) / m1  # above it the unconstrained relaxation reaches upper
        if not self.heap and t_top > self.t_min:
            # a coarse grid from the top down, lambda warm-started from the interval above
            points = np.geomspace(self.t_min, t_top, 9)
            prev = self.top
            for a, b in zip(points[-2::-1], points[:0:-1]):
                p = _Point(float(b), prev.lam.copy(), best=prev.best)  # L only grows as T falls
                self._step(p, upper - u_lb - m1 * a)
                self._push(float(a), float(b), p)
                prev = p
        live = [iv for iv in self.heap if iv.a < t_top]
        for iv in live:
            iv.bound = self._bound(iv)
        self.heap = live
        heapq.heapify(self.heap)
        while self.heap and time.monotonic() < deadline:
            iv = self.heap[0]
            if iv.bound >= upper:
                break
            heapq.heappop(self.heap)
            p, a, b = iv.point, iv.a, iv.b
            wide = (b - a) > self.min_width * b
            if wide and (p.done or m1 * (b - a) > 0.5 * (upper - iv.bound)):
                mid = (a + b) / 2
                q = _Point(mid, p.lam.copy(), best=p.best, theta=p.theta)
                self._step(q, upper - u_lb - m1 * a)
                self._push(a, mid, q)
                self._push(mid, b, p)
                continue
            if not p.done:
                self._step(p, upper - u_lb - m1 * a)
            self._push(a, b, p)
            if p.done and not wide:
                break  # the lowest interval can gain nothing more
        low = min([iv.bound for iv in self.heap], default=upper)
        self.proven = float(min(upper, low, self.top.best + m1 * max(t_top, self.t_min) + u_lb))
        return self.proven

    def relaxed_orders(self, limit: int = 4) -> list[list[int]]:
        """Device orders read off the relaxed optima at the lowest intervals (repeated classes
        dropped, the unused devices appended by price): seeds for the order search."""
        out = []
        if self.subset is not None:
            for _, path in self.paths[-limit:]:
                out.append(self.rx.order_of(path, np.zeros(len(self.rx.cap))))
            return out
        for iv in sorted(self.heap)[:limit]:
            self.rx.run(iv.point.lam, iv.point.T)
            out.append(self.rx.order_of(self.rx.last_path, iv.point.lam))
        return out


def _relaxed_min_max(rx: Relaxation) -> float:
    """The least max w (flush) of any relaxed sequence: no real plan has a smaller largest stage."""
    last = rx.last_cost.min(axis=0)
    F = last
    best = F[0]
    s = rx.solver
    for r in range(1, rx.positions):
        t = rx.tensors.get(s.position_class(r))
        if t is None:
            break
        W, j = t
        G = np.maximum(W.min(axis=0), F[j])
        F = G.min(axis=1)
        best = min(best, F[0])
    return float(best)


def _remembered(cache: dict, T: float, make, size: int):
    """`make()` for threshold T, kept among the `size` most recently used thresholds (a pass at the
    same T reuses the masked tables)."""
    got = cache.pop(T, None)
    if got is None:
        got = make()
        if len(cache) >= size:
            cache.pop(next(iter(cache)))
    cache[T] = got
    return got


def _async_bound(rx: Relaxation, upper_us: float, deadline: float) -> float:
    """m x the least T not proven infeasible (bisection on T; see the module docstring)."""
    m = rx.solver.m
    lo = _relaxed_min_max(rx)  # a <= T infeasible below this even with repeated devices
    if not np.isfinite(lo):
        return INF
    hi = upper_us / m if np.isfinite(upper_us) else None
    if hi is None or hi <= lo:
        return min(upper_us, m * lo)
    lam = np.zeros(len(rx.cap))
    # invariant: every T < lo is proven infeasible; T = hi is feasible (the upper bound's plan)
    for _ in range(30):
        if time.monotonic() >= deadline or hi - lo <= 1:
            break
        mid = (lo + hi) / 2
        p = _Point(mid, lam.copy())
        proven = False
        while not p.done and time.monotonic() < deadline and p.steps < 60:
            # L is a sum of prices, so rounding alone can lift an L of zero just above it: a
            # proof needs L clear of the rounding of that sum
            margin = 1e-9 * (1.0 + float(rx.cap @ p.lam)) * rx.positions
            if rx.step(p, 1.0, zero_cost=True) > margin:
                proven = True
                break
        if proven:
            lo, lam = mid, p.lam
        else:
            hi = mid
    return float(min(upper_us, m * lo))
