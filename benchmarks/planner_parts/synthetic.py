"""Synthetic models and clusters, the watched solve and the PipeDream-style DP (parts b and c).

Part (b) times the solver on synthetic instances and compares it with the DP plan; part (c)
compares the solved plan with an even split and the DP plan on tight clusters: both build their
instances, solve and run the DP with the helpers here.
"""
from __future__ import annotations

import itertools
import math
import random
import time

from benchmarks.planner_parts.shared import BACKEND, BATCH, OPTIMIZER, SEQ

MINILM = {"emb_params": 47_674_368, "layer_params": 7_097_856, "head_params": 13_860, "act": 393_216,
          "head_act": 9_216, "emb_s": 0.032, "layer_s": 0.163, "head_s": 0.0004, "loss_s": 0.0001,
          "emb_ws": 52 << 20, "layer_ws": 53 << 20, "overhead": 47 << 20}


def synthetic_graph(n_blocks: int, rng: random.Random):
    """An IR graph with only blocks (no nodes): what the planner reads. Returns (graph, work_s, workspace)."""
    from ir.graph import Block, Graph

    if n_blocks < 4:
        raise ValueError("a synthetic model needs at least 4 blocks")
    blocks, work, ws = [], [], []
    for k in range(n_blocks):
        if k == 0:
            kind, params, act, w, wsb = "embeddings", MINILM["emb_params"], MINILM["act"], MINILM["emb_s"], MINILM["emb_ws"]
        elif k == n_blocks - 1:
            kind, params, act, w, wsb = "loss", 0, 4, MINILM["loss_s"], 100 << 10
        elif k == n_blocks - 2:
            kind, params, act, w, wsb = "head", MINILM["head_params"], MINILM["head_act"], MINILM["head_s"], 2 << 20
        else:
            scale = rng.uniform(0.5, 1.5)
            kind, params, act = "encoder", int(MINILM["layer_params"] * scale), MINILM["act"]
            w, wsb = MINILM["layer_s"] * scale, int(MINILM["layer_ws"] * scale)
        # flops = k + 1 keeps every block's signature distinct, so each has its own cost entry
        blocks.append(Block(k, f"{kind}.{k}", kind, (), (), (), f"act{k}", (), params, act, k + 1))
        work.append(w)
        ws.append(wsb)
    graph = Graph(f"synthetic-{n_blocks}", (), (), (), {}, {}, (), tuple(blocks), BATCH // 4, SEQ)
    return graph, work, ws


def model_memory_bytes(graph, ws, schedule: str, M: int, stages: int) -> int:
    """Memory of the whole model split over `stages` stages, each counted at stage 0's (worst) position."""
    from planner.cost import block_input_bytes, in_flight_microbatches, weight_copies

    wc = weight_copies(schedule, OPTIMIZER, stages, 0, M)
    fl = in_flight_microbatches(schedule, stages, 0, M)
    inputs = block_input_bytes(graph)
    return (stages * MINILM["overhead"]
            + sum(b.params_bytes * wc + i * fl + w for b, i, w in zip(graph.blocks, inputs, ws)))


def synthetic_cluster(graph, work, ws, n_devices: int, rng: random.Random, schedule: str, M: int,
                      budget_mode: str, kinds: int | None = None):
    """Devices with synthetic profiles: slowness log-uniform in 1..10 (1 and 10 both present),
    budgets 'loose' (0.8..4 equal shares each) or 'tight' (summing to TIGHT_SLACK x the model's memory).

    `kinds`: the devices are copies of that many device models (slowness and budget per model,
    one random link per pair of models), as in a household or lab of repeated phones and boards;
    None: every device and every link differs."""
    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
    from planner.cluster import Cluster, DeviceSpec

    k = n_devices if kinds is None else min(kinds, n_devices)
    slow_k = [1.0, 10.0][:k] + [math.exp(rng.uniform(0, math.log(10))) for _ in range(k - 2)]
    rng.shuffle(slow_k)
    kind = list(range(n_devices)) if kinds is None else [d % k for d in range(n_devices)]
    stages = min(n_devices, len(graph.blocks))
    need = model_memory_bytes(graph, ws, schedule, M, stages)
    if budget_mode == "loose":
        budget_k = [int(need / stages * rng.uniform(0.8, 4.0)) for _ in range(k)]
    else:
        shares = [rng.uniform(0.3, 1.7) for _ in range(k)]
        total = sum(shares[kind[d]] for d in range(n_devices))
        budget_k = [int(TIGHT_SLACK * need * s / total) for s in shares]
    slow = [slow_k[kind[d]] for d in range(n_devices)]
    budgets = [budget_k[kind[d]] for d in range(n_devices)]
    sigs = [block_signature(b) for b in graph.blocks]
    devices = []
    for d in range(n_devices):
        costs = {sig: BlockCost(w * slow[d] / 3, 2 * w * slow[d] / 3, 0.0, wsb) for sig, w, wsb in zip(sigs, work, ws)}
        prof = DeviceProfile(f"dev{d}", graph.name, graph.batch, graph.seq, (BackendProfile(BACKEND, costs),),
                             budgets[d], MINILM["overhead"])
        devices.append(DeviceSpec(f"dev{d}", f"tcp://dev{d}:5555", prof, budgets[d], BACKEND))
    link_k = {}
    for a in range(k):
        for b in range(a, k):
            link_k[(a, b)] = Link(rng.choice((100e6 / 8, 500e6 / 8, 1e9 / 8)), rng.uniform(0.2e-3, 3e-3))
    pairs = {(f"dev{a}", f"dev{b}"): link_k[tuple(sorted((kind[a], kind[b])))]
             for a, b in itertools.combinations(range(n_devices), 2)}
    return Cluster(tuple(devices), Link(100e6 / 8, 1e-3), pairs), slow, budgets


TIGHT_SLACK = 1.5  # part (c): the budgets add up to this multiple of the model's memory


def watched_solve(inst, time_limit_s: float, workers: int, solve=None):
    """`solve` (planner.partition.solve_partition by default; part (b) also passes cpsat_partition,
    the CP-SAT model alone) with its CP-SAT solvers recorded: (partition or error, wall s, per-call
    records)."""
    from planner.partition import PlanDoesNotFit, cpsat, solve_partition

    solve = solve or solve_partition

    records = []
    # solve_partition's searches look `_solver` up in planner.partition.cpsat, so it is wrapped there
    original = cpsat._solver

    def recording_solver(seconds, w, seed):
        solver = original(seconds, w, seed)
        rec = {"limit_s": seconds}
        inner = solver.solve

        def solve(model, *args, **kwargs):
            t0 = time.perf_counter()
            status = inner(model, *args, **kwargs)
            rec.update(status=solver.status_name(status), wall_s=time.perf_counter() - t0,
                       bound=solver.best_objective_bound,
                       objective=solver.objective_value if solver.status_name(status) in ("OPTIMAL", "FEASIBLE")
                       else None)
            return status

        solver.solve = solve
        records.append(rec)
        return solver

    cpsat._solver = recording_solver
    t0 = time.perf_counter()
    try:
        result = solve(inst, time_limit_s=time_limit_s, workers=workers)
    except (PlanDoesNotFit, TimeoutError, RuntimeError) as exc:
        # PlanDoesNotFit: no plan fits (or none found in time); TimeoutError: no assignment at all;
        # RuntimeError: solve_partition's own check caught an answer it disagrees with
        result = exc
    finally:
        cpsat._solver = original
    return result, time.perf_counter() - t0, records


def pipedream_dp(inst):
    """Contiguous block ranges over the devices in cluster order (devices may be skipped),
    minimising max(stage compute, 2 x boundary transfer); memory ignored. (devices, cuts)."""
    nd, n = len(inst.devices), inst.blocks
    prefix = [[0] * (n + 1) for _ in range(nd)]
    for d in range(nd):
        for k in range(n):
            prefix[d][k + 1] = prefix[d][k] + inst.compute_us[d][k]
    INF = float("inf")
    # best[d][j]: least bottleneck with blocks 0..j-1 placed, the last stage on device d ending at j-1
    best = [[INF] * (n + 1) for _ in range(nd)]
    back = [[None] * (n + 1) for _ in range(nd)]
    for e in range(nd):
        for j in range(1, n + 1):
            best[e][j] = prefix[e][j]  # one stage: blocks 0..j-1 on e
            for d in range(e):
                row = best[d]
                for i in range(1, j):
                    if row[i] == INF:
                        continue
                    value = max(row[i], 2 * inst.transfer_us(d, e, i - 1), prefix[e][j] - prefix[e][i])
                    if value < best[e][j]:
                        best[e][j], back[e][j] = value, (d, i)
    end = min(range(nd), key=lambda d: best[d][n])
    devs, cuts, d, j = [end], [], end, n
    while back[d][j] is not None:
        d, j = back[d][j]
        devs.append(d)
        cuts.append(j)
    return [inst.devices[x] for x in reversed(devs)], list(reversed(cuts))
