"""The exact dynamic program for one device order: the best cuts when the pipeline order is fixed.

Given a device sequence E (E[0] runs the LAST stage, E[r] the stage at distance r from the end:
planner.partition.cpsat numbers positions the same way), the program chooses how many of its
devices to use (a suffix E[0..p-1], so the devices at the far end of E are the ones left out) and
the contiguous block ranges, under every device's memory budget, and prices exactly what
planner.partition.instance's `_objective_us` prices. Position r decides everything a stage costs
besides its device and blocks: weight copies and micro-batches in flight (tables that depend on r
alone), forward reuse (r = 0), whether there is a link out (r > 0), and a link in exists iff the
stage does not start at block 0 (then it comes from E[r+1]). So one pass from the end of the
pipeline covers every stage count at once.

The recurrence (PipeDream's, with the position-dependent terms). For position r, block range
[i, j) and its devices: w_r(i, j) = C_r(i, j) + [i > 0] B(E[r+1], E[r], i-1) + [r > 0] B(E[r],
E[r-1], j-1) (the flush stage time t_s), U_r(i, j) the optimizer step, a_r(i, j) = max(C_r + U_r,
[i > 0] 2 B(E[r+1], E[r], i-1)) (1f1b-stash; each boundary is charged to the stage after it).
F_0(i) = stage [i, n) on E[0]; F_r(i) = min over j of (w_r(i, j) (+) F_{r-1}(j)), with (+) = +
for sums and max for bottlenecks, over the (i, j) whose memory fits; F_{p-1}(0) is the best plan of
p stages. Ranges are stored as bands: position r on device d needs at most K(d, r) blocks (its
memory), so a pass costs O(p n K) and not O(p n^2).

The objectives.
- 1f1b-stash: m max(a): one min-max pass (`_pass` with max) is exact.
- flush: sum_s (w - W) + (m-1) max_s w + max_s (W + U), W the stage's split-backward weight pass
  (0 unless the schedule splits backwards; with W the objective is zb-h1's, see
  planner.partition.instance), U below stands for the tail W + U. Two bottleneck terms, so the
  pass is parametrised by thresholds: S(T, V) = least sum of w - W over plans with every w <= T and
  every U <= V (one min-sum pass with the stages above the thresholds removed). For every plan, with T = its max w and V =
  its max U, S(T, V) + (m-1) T + V <= its objective, and the plan S(T, V) returns costs at most
  S(T, V) + (m-1) T + V; so the optimum is min over (T, V) of S(T, V) + (m-1) T + V, exactly.
  `best_for_order` finds that minimum by branch and bound over integer boxes [T_lo, T_hi] x
  [V_lo, V_hi] of microseconds: S is non-increasing in both thresholds, so a box whose top is
  dominated by an evaluated point with sum S has the lower bound S + (m-1) T_lo + V_lo. One pass
  at (Te, Ve) returning a plan with max w T' and max U V' settles the box [T', Te] x [V', Ve] (the
  plan is optimal there: sum S everywhere in it, least at its lower corner, which is the plan's
  own objective), raises the bound of the part below to S, and leaves the part above with the
  old bound; an infeasible pass removes everything below (Te, Ve). Boxes start from [min-max of
  w, the unconstrained plan's max w] (a plan has max w >= the min-max pass's value) and the same
  for U; the search stops when no box's bound is below the incumbent, so the answer is proven for
  the order. Each pass halves the T range it explores, and (m-1) T prunes most of it.
`OrderSolver` holds the instance's tables as numpy arrays (prefix sums per device, memory
coefficients per position class, one transfer table per device pair) and the per (device,
position) stage bands, built once and reused by every order of a search.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ir.plan import ASYNC_SCHEDULES
from planner.cost import kept_copies
from planner.partition.instance import Assignment, PartitionInstance

INF = float("inf")


@dataclass(frozen=True)
class _Band:
    """Stages of one device at one non-last position class, as (n, K) arrays over (start i, length t+1)."""

    j: np.ndarray         # [i][t] int: the end (exclusive) i + t + 1, clipped to n-1 where invalid
    compute: np.ndarray   # [i][t] float: C, inf where the range is invalid or does not fit
    update: np.ndarray    # [i][t] float: the tail W + U, inf where invalid
    weight: np.ndarray    # [i][t] float: W (0 unless the schedule splits backwards), 0 where invalid


@dataclass(frozen=True)
class _Last:
    """The last stage (blocks [i, n)) of one device, as vectors over i."""

    compute: np.ndarray   # inf where it does not fit
    update: np.ndarray    # the tail W + U
    weight: np.ndarray    # W


@dataclass(frozen=True)
class OrderPlan:
    """A plan found by a pass: its assignment, the pass's value and its bottlenecks (microseconds)."""

    assignment: Assignment
    value: float          # what the pass minimised (sum of w, or the bottleneck)
    max_w: int            # largest flush stage time w (0 under 1f1b-stash)
    max_u: int            # largest tail (W + optimizer step)


class OrderSolver:
    """The exact fixed-order program over one instance (see the module docstring)."""

    def __init__(self, inst: PartitionInstance):
        self.inst = inst
        nd, n, m = len(inst.devices), inst.blocks, inst.microbatches
        self.nd, self.n, self.m = nd, n, m
        self.async_ = inst.schedule in ASYNC_SCHEDULES
        comp = np.array(inst.compute_us, dtype=np.float64)
        recomp = np.array(inst.recompute_us, dtype=np.float64)
        zero = np.zeros((nd, 1))
        self._pc = np.hstack([zero, np.cumsum(comp, axis=1)])
        self._pc_reuse = np.hstack([zero, np.cumsum(comp - recomp, axis=1)])
        weight = np.array(inst.weight_us, dtype=np.float64)
        self._pwt = np.hstack([zero, np.cumsum(weight, axis=1)])
        self._pu = np.hstack([zero, np.cumsum(np.array(inst.update_us, dtype=np.float64) + weight, axis=1)])
        self._pw = np.hstack([zero, np.cumsum(np.array(inst.workspace_bytes, dtype=np.float64), axis=1)])
        self._pk = np.hstack([zero, np.cumsum(np.array(inst.kept_bytes, dtype=np.float64), axis=1)])
        self._pv = np.hstack([zero, np.cumsum(np.array(inst.unversioned_bytes, dtype=np.float64), axis=1)])
        self._ps = np.hstack([zero, np.cumsum(np.array(inst.shared_current_bytes, dtype=np.float64), axis=1)])
        # position-independent, like the workspace (PartitionInstance.weight_bytes)
        self._pw += np.hstack([zero, np.cumsum(np.array(inst.state_delta_bytes, dtype=np.float64), axis=1)])
        # what a stage's update alone holds comes off the sum and is a second bound (held + the
        # update's part: PartitionInstance.stage_phases); the backwards' part per block for that bound
        update = np.array(inst.update_bytes, dtype=np.float64)
        self.phases = bool(update.any())
        self._pup = np.hstack([zero, np.cumsum(update, axis=1)])
        self._pw -= self._pup
        self._pbw = np.hstack([zero, np.cumsum(np.array(inst.backward_workspace_bytes, dtype=np.float64), axis=1)])
        self._pin = np.concatenate([[0.0], np.cumsum(np.array(inst.input_bytes, dtype=np.float64))])
        self.has_update = bool(np.any(self._pu[:, -1] > 0))
        params = np.array(inst.params_bytes, dtype=np.float64)
        inputs = np.array(inst.input_bytes, dtype=np.float64)
        # positions r >= R share every table (weight copies, in flight, forward reuse): one class R
        wc = [inst.weight_copies[r][0] for r in range(nd)]
        fl = [inst.in_flight[r][0] for r in range(nd)]
        reuse = [inst.reuses(r + 1, 0) for r in range(nd)]
        sv = [inst.unversioned_copies[r][0] for r in range(nd)]
        ac = [inst.async_copies[r][0] for r in range(nd)]
        R = nd - 1
        tables = list(zip(wc, fl, reuse, sv, ac))
        while R > 0 and tables[R - 1] == tables[R]:
            R -= 1
        self.R = R
        self._sv = sv[:R + 1]
        self._ac = ac[:R + 1]
        self._reuse = reuse[:R + 1]
        self._fl = fl[:R + 1]
        self._pm = [np.concatenate([[0.0], np.cumsum(params * wc[c] + inputs * fl[c])]) for c in range(R + 1)]
        # a device whose engine keeps every activation of each micro-batch in flight holds its kept
        # part once more per further micro-batch in flight (PartitionInstance.held_workspace)
        self._further = [[kept_copies(fl[c], inst.keeps_activations[d]) for c in range(R + 1)] for d in range(nd)]
        self._overhead = np.array(inst.overhead_bytes, dtype=np.float64)
        # a stage's one transient, the largest of its blocks' (PartitionInstance.stage_bytes): not a
        # prefix sum, so the bands take a running max over each range and `last` a suffix max
        self._transient = np.array(inst.transient_bytes, dtype=np.float64).reshape(nd, n)
        # and its once part, the largest of its blocks', per further micro-batch in flight
        # (PartitionInstance.stage_kept_once): the same running max, times `_further`
        self._once = np.array(inst.kept_once_bytes, dtype=np.float64).reshape(nd, n)
        # and its frozen base held mapped, the largest of its blocks', in both phases
        # (PartitionInstance.stage_mapped_frozen): the same running max
        self._mapped = np.array(inst.mapped_frozen_bytes, dtype=np.float64).reshape(nd, n)
        self._budget = np.array(inst.memory_budget_bytes, dtype=np.float64)
        # one transfer of the activation after block k between d and e, exactly as instance.transfer_us
        sizes = sorted(set(inst.boundary_bytes))
        at = {b: inst.boundary_bytes.index(b) for b in sizes}
        which = np.array([sizes.index(b) for b in inst.boundary_bytes], dtype=np.int64)
        tr = np.zeros((nd, nd, n - 1))
        if n > 1:
            per_size = np.zeros((nd, nd, len(sizes)))
            for d in range(nd):
                for e in range(nd):
                    if d != e:
                        per_size[d, e] = [inst.transfer_us(d, e, at[b]) for b in sizes]
            tr = per_size[:, :, which]
        self.tr = tr
        self._bands: dict[tuple[int, int], _Band | None] = {}
        self._lasts: dict[int, _Last] = {}

    # --- stage tables -----------------------------------------------------------------------

    def position_class(self, r: int) -> int:
        return min(r, self.R)

    def _memory_prefix(self, d: int, c: int) -> np.ndarray:
        # old versions (and second current copies) leave out what device d keeps none of
        # (PartitionInstance.weight_bytes)
        return (self._pm[c] + self._pw[d] + self._pk[d] * self._further[d][c] - self._pv[d] * self._sv[c]
                - self._ps[d] * self._ac[c])

    def _update_prefix(self, d: int, c: int) -> np.ndarray:
        """What a stage holds at its update, as a prefix over blocks: `_memory_prefix` less the
        backwards' part (stashed inputs, the workspace's backward part, the kept parts), plus what the
        update alone holds (PartitionInstance.stage_phases)."""
        return (self._memory_prefix(d, c) - self._pin * self._fl[c] - self._pbw[d] - self._pk[d] * self._further[d][c]
                + self._pup[d])

    def last(self, d: int) -> _Last:
        """Blocks [i, n) on device d at the last position."""
        got = self._lasts.get(d)
        if got is None:
            n = self.n
            pc = self._pc_reuse[d] if self._reuse[0] else self._pc[d]
            mp = self._memory_prefix(d, 0)
            transient = np.maximum.accumulate(self._transient[d][::-1])[::-1]  # [i] max over blocks i..n-1
            transient = transient + np.maximum.accumulate(self._once[d][::-1])[::-1] * self._further[d][0]
            mapped = np.maximum.accumulate(self._mapped[d][::-1])[::-1]
            over = self._overhead[d] + mp[n] - mp[:n] + mapped + transient - self._budget[d]
            if self.phases:  # the update's bound beside the backwards' (PartitionInstance.stage_bytes)
                up = self._update_prefix(d, 0)
                over = np.maximum(over, self._overhead[d] + up[n] - up[:n] + mapped - self._budget[d])
            over[0] += self.inst.whole_model_delta_bytes[d]  # blocks [0, n): the whole model on one stage
            over = np.maximum(over, self.inst.stage_floor_bytes(d) - self._budget[d])  # the set-up's peak
            compute = pc[n] - pc[:n]
            got = _Last(np.where(over <= 0, compute, INF), self._pu[d][n] - self._pu[d][:n],
                        self._pwt[d][n] - self._pwt[d][:n])
            self._lasts[d] = got
        return got

    def band(self, d: int, c: int) -> _Band | None:
        """Blocks [i, j) (j < n) on device d at any position r > 0 of class c (`position_class`);
        None when not one block fits there."""
        key = (d, c)
        if key in self._bands:
            return self._bands[key]
        n = self.n
        got = None
        # a device whose set-up alone peaks over its budget holds no stage (PartitionInstance.stage_floor_bytes)
        if n > 1 and self.inst.stage_floor_bytes(d) <= self._budget[d]:
            mp = self._memory_prefix(d, c)
            cap = self._budget[d] - self._overhead[d]
            # the longest range from each i that fits without its transient (memory grows with j;
            # an upper bound), ends j <= n-1; each range is then checked with its transient below
            jmax = np.minimum(np.searchsorted(mp, mp[:n] + cap, side="right") - 1, n - 1)
            length = jmax - np.arange(n)
            K = int(length.max(initial=0))
            if K > 0:
                i = np.arange(n)[:, None]
                j = i + 1 + np.arange(K)[None, :]
                valid = j <= jmax[:, None]
                # the stage's transient: the running max of its blocks' over the range [i, j)
                transient = np.maximum.accumulate(self._transient[d][np.minimum(j - 1, n - 1)], axis=1)
                mapped = np.maximum.accumulate(self._mapped[d][np.minimum(j - 1, n - 1)], axis=1)
                if self._further[d][c]:  # the once part likewise (PartitionInstance.stage_kept_once)
                    transient = transient + self._further[d][c] * np.maximum.accumulate(
                        self._once[d][np.minimum(j - 1, n - 1)], axis=1)
                valid &= mp[np.minimum(j, n)] - mp[i] + mapped + transient <= cap
                if self.phases:  # and the update's bound (PartitionInstance.stage_bytes)
                    up = self._update_prefix(d, c)
                    valid &= up[np.minimum(j, n)] - up[i] + mapped <= cap
                if self.inst.joined:  # a stage may not end before a joined boundary
                    ends = np.ones(n, dtype=bool)
                    ends[list(self.inst.joined)] = False
                    valid &= ends[np.minimum(j, n - 1) - 1]
                jc = np.where(valid, j, n - 1)
                pc = self._pc_reuse[d] if self._reuse[c] else self._pc[d]
                compute = np.where(valid, pc[jc] - pc[i], INF)
                update = np.where(valid, self._pu[d][jc] - self._pu[d][i], INF)
                got = _Band(jc, compute, update, np.where(valid, self._pwt[d][jc] - self._pwt[d][i], 0.0))
        self._bands[key] = got
        return got

    def _link_in(self, order: Sequence[int], r: int) -> np.ndarray:
        """[i] the transfer into position r's first block i from E[r+1] (0 at i = 0; inf when r is the
        far end of the order, where only i = 0 can start the pipeline)."""
        out = np.empty(self.n)
        out[0] = 0.0
        if r + 1 < len(order):
            out[1:] = self.tr[order[r + 1], order[r]]
        else:
            out[1:] = INF
        return out

    # --- the passes -------------------------------------------------------------------------

    def _pass(self, order: Sequence[int], kind: str, T: float = INF, V: float = INF, stages: int | None = None):
        """One pass from the end of the pipeline. kind: 'sum' (flush: least sum of w - W with w <= T
        and tail W + U <= V), 'max-w', 'max-u' (least max w, least max tail over plans that fit),
        'async' (least max of a). Returns (value, stage count, back-pointers) or None when no plan
        fits. `stages` caps the stage count (the order's longer suffixes are left out: a quicker,
        inexact pass)."""
        add = kind == "sum"
        d0 = order[0]
        last = self.last(d0)
        link = self._link_in(order, 0)
        if kind in ("sum", "max-w"):
            F = last.compute + link
        elif kind == "max-u":
            F = np.where(np.isfinite(last.compute + link), last.update, INF)
        else:
            F = np.maximum(last.compute + last.update, 2 * link)
        if add:
            if T < INF or V < INF:
                F = np.where((F <= T) & (last.update <= V), F, INF)
            F = F - last.weight  # a split backward's W runs outside the first micro-batch's trip
        best, best_r, backs = F[0], 0, []
        rows = np.arange(self.n)
        for r in range(1, len(order) if stages is None else min(len(order), stages)):
            d = order[r]
            band = self.band(d, self.position_class(r))
            if band is None:
                break
            link = self._link_in(order, r)
            if kind == "async":
                W = np.maximum(band.compute + band.update, 2 * link[:, None])
            else:
                out = self.tr[d, order[r - 1]][band.j - 1]
                W = band.compute + out + link[:, None]
                if kind == "max-u":
                    W = np.where(np.isfinite(W), band.update, INF)
                elif add:
                    if T < INF or V < INF:
                        W = np.where((W <= T) & (band.update <= V), W, INF)
                    W = W - band.weight
            G = W + F[band.j] if add else np.maximum(W, F[band.j])
            arg = G.argmin(axis=1)
            F = G[rows, arg]
            backs.append((band, arg))
            if F[0] < best:
                best, best_r = F[0], r
            if not np.isfinite(F).any():
                break
        if not np.isfinite(best):
            return None
        return best, best_r + 1, backs

    def _extract(self, order: Sequence[int], p: int, backs) -> Assignment:
        ranges, i = [], 0
        for r in range(p - 1, 0, -1):
            band, arg = backs[r - 1]
            j = int(band.j[i, arg[i]])
            ranges.append((i, j - 1))
            i = j
        ranges.append((i, self.n - 1))
        return tuple(order[r] for r in range(p - 1, -1, -1)), tuple(ranges)

    def plan(self, order: Sequence[int], kind: str, T: float = INF, V: float = INF,
             stages: int | None = None) -> OrderPlan | None:
        """The plan of one pass (see `_pass`), with its bottlenecks recomputed from the assignment."""
        got = self._pass(order, kind, T, V, stages)
        if got is None:
            return None
        value, p, backs = got
        assignment = self._extract(order, p, backs)
        max_w, max_u = self.bottlenecks(assignment)
        return OrderPlan(assignment, float(value), max_w, max_u)

    def price(self, assignment: Assignment) -> tuple[int, int, int]:
        """(objective, largest flush stage time w, largest tail W + U) of an assignment in
        microseconds: `_objective_us` from the prefix sums (the same integers, summed exactly in
        float64), fast enough to price every plan the search meets."""
        devs, ranges = assignment
        p = len(devs)
        compute, update, weight, link = [], [], [], []
        for s, (d, (first, last)) in enumerate(zip(devs, ranges)):
            pc = self._pc_reuse[d] if self._reuse[self.position_class(p - 1 - s)] else self._pc[d]
            compute.append(pc[last + 1] - pc[first])
            update.append(self._pu[d][last + 1] - self._pu[d][first])
            weight.append(self._pwt[d][last + 1] - self._pwt[d][first])
            if s < p - 1:
                link.append(self.tr[d, devs[s + 1], last])
        if self.async_:
            value = self.m * max([c + u for c, u in zip(compute, update)] + [2 * b for b in link])
            return int(value), 0, int(max(update))
        w = [compute[s] + (link[s] if s < p - 1 else 0) + (link[s - 1] if s > 0 else 0) for s in range(p)]
        value = sum(w) - sum(weight) + (self.m - 1) * max(w) + max(update)
        return int(value), int(max(w)), int(max(update))

    def bottlenecks(self, assignment: Assignment) -> tuple[int, int]:
        """(largest flush stage time w, largest tail W + U) of an assignment, in microseconds."""
        return self.price(assignment)[1:]

    def objective(self, assignment: Assignment) -> int:
        """The predicted step of an assignment (= `_objective_us`, faster)."""
        return self.price(assignment)[0]

    # --- the exact optimum of one order ---------------------------------------------------

    def best_for_order(self, order: Sequence[int], incumbent: float = INF, max_passes: int | None = None):
        """(objective, assignment, lower bound) of the best plan over `order`'s suffixes, or None when
        no plan fits; without an early stop the objective is the order's optimum and equals the
        bound. With `incumbent` (a value to beat) the search stops once it is proven that the order
        cannot beat it: the plan returned is then the best found, and the bound (at most the order's
        optimum) is at least min(incumbent, that plan's objective). With `max_passes` it may stop
        earlier still; the bound is always what is proven."""
        if self.async_:
            found = self.plan(order, "async")
            if found is None:
                return None
            value = self.objective(found.assignment)
            return value, found.assignment, value
        first = self.plan(order, "sum")
        if first is None:
            return None
        m1, use_v = self.m - 1, self.has_update
        best_value, best = self.objective(first.assignment), first.assignment
        if not m1 and not use_v:
            return best_value, best, best_value
        # integer boxes [a, b] x [c, d] of (T, V) with a bound s on S inside; a dimension that does
        # not matter (T when m = 1, V when no device updates) is the one point 0, passes leave it open
        t_lo = int(self.plan(order, "max-w").value) if m1 else 0
        t_hi = int(max(self._pc[:, -1]) + 2 * self.tr.max(initial=0)) + 1 if m1 else 0
        v_lo = int(self.plan(order, "max-u").value) if use_v else 0
        v_hi = int(max(self._pu[:, -1])) if use_v else 0
        heap: list = []

        def push(a, b, c, d, s):
            if a <= b and c <= d:
                heapq.heappush(heap, (s + m1 * a + c, a, b, c, d, s))

        def split(a, b, c, d, s_old, te, ve, found):
            """Box [a, b] x [c, d] after a pass at (te, ve): above it keeps s_old; below, the found
            plan (max w T', max U V', sum S) settles [T', te] x [V', ve] and bounds the rest by S."""
            push(te + 1, b, c, d, s_old)
            push(a, te, ve + 1, d, s_old)
            if found is not None:  # (clipped to the box: the pieces stay inside it, so the search ends)
                if (m1 and found.max_w > te) or (use_v and found.max_u > ve):
                    raise RuntimeError(f"a pass at thresholds ({te}, {ve}) returned a plan with ({found.max_w}, "
                                       f"{found.max_u}): the program does not price what _objective_us prices")
                tw, uv = max(a, found.max_w if m1 else 0), max(c, found.max_u if use_v else 0)
                push(a, tw - 1, c, ve, found.value)
                push(tw, te, c, uv - 1, found.value)

        split(t_lo, t_hi, v_lo, v_hi, first.value, t_hi, v_hi, first)
        limit, passes = min(incumbent, best_value), 0
        while heap and heap[0][0] < limit and (max_passes is None or passes < max_passes):
            _, a, b, c, d, s = heapq.heappop(heap)
            te, ve = ((a + b) // 2, d) if a < b else (a, (c + d) // 2)
            found = self.plan(order, "sum", te if m1 else INF, ve if use_v else INF)
            passes += 1
            if found is not None:
                value = self.objective(found.assignment)
                if value < best_value:
                    best_value, best = value, found.assignment
                    limit = min(incumbent, best_value)
            split(a, b, c, d, s, te, ve, found)
        bound = min(best_value, heap[0][0]) if heap else best_value
        return best_value, best, bound
