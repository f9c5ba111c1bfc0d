"""Head splitting inside one device: one attention block's heads on MNN and PyTorch at once.

What it measures
    For one MiniLM attention block (hidden 384, 12 heads of 32) and one BERT-base attention block
    (hidden 768, 12 heads of 64), batch 8, sequence 128, a realistic additive mask (the last rows
    padded), float32, forward+backward (`runtime.engines.split.attention.SplitAttention`, median of `--reps`
    after one warm-up):
      * each single backend with all heads: mnn:cpu:t1, mnn:cpu:t2, torch:cpu:t1, torch:cpu:t2
        (backends absent here are skipped);
      * the attention curves (h = 1..12 heads, `runtime.profiling.compute.attention_curve`) of the two
        backends that share the two cores, mnn:cpu:t1 and torch:cpu:t1, and the split a simple
        allocator chooses from them: `planner.heads.allocate_heads` when it can be imported, else
        heads proportional to the single-head speeds (the output says which);
      * that split, run concurrently (MNN in a child process, torch in this one; see the
        head_split docstring for why) and, for reference, the same split run one backend after
        the other in this process (`concurrent=False`);
      * the allocator's predicted time (the curves' time of the slower share; the child process's
        copy and command costs are not in the curves);
      * the fixed cost of a real split beyond the curves, as `confidant profile` measures it
        (`runtime.profiling.split_costs.split_extra_cost`: SplitAttentions of 1, 6 and 11 heads on the child
        backend mnn:cpu:t1 beside torch:cpu:t1 in this process; the worst excess of the measured
        time over the curves, floored at 0), and the allocator's split and prediction with that
        cost (`extra_cost_s`) next to the one without; a changed split is timed too;
      * what `confidant plan` would decide for this machine (`planner.heads.choose_head_split`
        on a profile of the curves of every present backend and the measured fixed cost): a split,
        or which single backend; and whether a split pays here at all, by the measured times;
      * when the allocator gives all heads to one backend, also the best split that uses both
        (by the same curves), so that the two-core comparison below always exists.
    Speedups: the allocator's choice over the best single backend of all four, and the honest
    two-core one: MNN 1 thread + PyTorch 1 thread (two cores in all) against the faster of the
    engines alone on 2 threads.

Reading the numbers
    The split can only beat a single backend when the two halves really run at the same time:
    before the blocks, the script measures the machine's parallel capacity (how many copies of a
    one-thread numpy loop run at full speed together: ~2.0 on an idle two-core machine), and for
    every measurement the share of all CPUs that other processes used (`others_cpu`, from
    /proc/stat minus this process and its children). On a shared machine both drift; the script
    warns when others used more than 10 %.

Usage
    .venv/bin/python benchmarks/heads.py [--reps N] [--json OUT]
    About 1-2 minutes on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where a sibling script named like a
# project package (benchmarks/planner.py) would shadow it, in this process and in every child
# started from this file: drop that entry and put the repository root first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

from benchmarks.common import machine_busy_s  # noqa: E402

import numpy as np


from planner.heads import choose_head_split  # noqa: E402
from ir.graph import block_signature  # noqa: E402
from ir.profile import AttentionCurve, BackendProfile, DeviceProfile  # noqa: E402
from runtime.engines.split.attention import WEIGHT_NAMES, SplitAttention  # noqa: E402
from runtime.engines.split.pool import context  # noqa: E402
from ir.backend import parse_backend  # noqa: E402
from runtime.engines.split.piece import attention_piece  # noqa: E402
from runtime.profiling import (attention_curve, present_backends, split_extra_cost, split_primary,  # noqa: E402
                               time_split_attention)

BATCH, SEQ = 8, 128
MODELS = {"minilm": (12, 32), "bert-base": (12, 64)}  # heads, head size
SINGLES = ("mnn:cpu:t1", "mnn:cpu:t2", "torch:cpu:t1", "torch:cpu:t2")
PAIR = ("mnn:cpu:t1", "torch:cpu:t1")  # one core each


# Machine state --------------------------------------------------------------------------------

def _ticks(path: str) -> float:
    """utime + stime + cutime + cstime of a /proc/<pid>/stat file (the process and its children
    that have ended and been waited for), in seconds (0 if the process is gone)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _descendants(pid: int) -> set[int]:
    """Every living process below `pid` (the fork server and the split's children under it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


class OthersCpu:
    """`with OthersCpu(pids) as o: ...` then `o.share`: the share of all CPUs used by processes
    other than this one, its descendants (the fork server, split children started meanwhile: those
    that ended count through their parent's cutime) and `pids` while the block ran (None where
    /proc is missing)."""

    def __init__(self, pids=()):
        self.pids = list(pids)
        self.share: float | None = None

    def _own(self) -> float:
        try:
            pids = set(self.pids) | _descendants(os.getpid())
        except OSError:
            pids = set(self.pids)
        return _ticks("/proc/self/stat") + sum(_ticks(f"/proc/{p}/stat") for p in pids)

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), machine_busy_s(), self._own()
        return self

    def __exit__(self, *exc):
        wall, busy1 = time.perf_counter() - self.t0, machine_busy_s()
        if self.busy0 is not None and busy1 is not None and wall > 0:
            others = (busy1 - self.busy0) - (self._own() - self.own0)
            self.share = max(0.0, others / ((os.cpu_count() or 1) * wall))


def _spin(n: int) -> float:
    """A one-thread, pure-Python loop (no BLAS threads to muddle the count)."""
    t = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i * i
    return time.perf_counter() - t


def parallel_capacity(n: int = 3_000_000) -> float:
    """How many one-thread workers run at full speed together: 2 x (solo time / pair time)."""
    with context().Pool(2) as pool:
        pool.map(_spin, [n // 10] * 2)
        solo = statistics.median(pool.apply(_spin, (n,)) for _ in range(3))
        pair = statistics.median(max(pool.map(_spin, [n, n])) for _ in range(3))
    return 2 * solo / pair


# Measuring --------------------------------------------------------------------------------------

def _weights(hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.normal(0, 0.02, (hidden, hidden) if k.startswith("W") else (hidden,)).astype(np.float32)
            for k in WEIGHT_NAMES}


def _inputs(hidden: int):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SEQ, hidden)).astype(np.float32)
    dy = (1e-3 * rng.standard_normal((BATCH, SEQ, hidden))).astype(np.float32)
    mask = np.zeros((BATCH, 1, 1, SEQ), np.float32)
    lengths = rng.integers(SEQ // 4, SEQ + 1, BATCH)
    for i, n in enumerate(lengths):
        mask[i, ..., n:] = -10000.0
    return x, mask, dy


def time_split(model: str, allocation: dict[str, int], reps: int, concurrent: bool = True) -> dict:
    heads, hs = MODELS[model]
    hidden = heads * hs
    x, mask, dy = _inputs(hidden)
    with SplitAttention(_weights(hidden), heads, hs, allocation, BATCH, SEQ, mask.shape,
                        concurrent=concurrent) as sa:
        sa.forward(x, mask)
        sa.backward(dy)
        pids = [w.proc.pid for w in sa._workers if hasattr(w, "proc")]
        with OthersCpu(pids) as others:
            times, busy = time_split_attention(sa, x, mask, dy, reps)
        placement = sa.placement
    return {"allocation": {b: h for b, h in allocation.items() if h}, "seconds": statistics.median(times),
            "busy_s": {b: statistics.median(r[b] for r in busy) for b in busy[0]},
            "placement": placement, "others_cpu": others.share, "concurrent": concurrent}


def allocate(curves: dict[str, tuple[float, ...]], heads: int,
             extra_cost_s: dict[str, float] | None = None) -> tuple[str, dict[str, int], float]:
    """(allocator name, allocation, predicted seconds); `extra_cost_s` as in `allocate_heads`."""
    try:
        from planner.heads import allocate_heads
    except ImportError:
        allocate_heads = None
    if allocate_heads is not None:
        split = allocate_heads(curves, extra_cost_s)
        return "planner.heads.allocate_heads", dict(split.heads), split.predicted_s
    # proportional to the single-head speeds, largest remainders first
    speed = {b: 1.0 / c[0] for b, c in curves.items()}
    share = {b: heads * s / sum(speed.values()) for b, s in speed.items()}
    alloc = {b: int(v) for b, v in share.items()}
    for b in sorted(share, key=lambda b: share[b] - alloc[b], reverse=True)[: heads - sum(alloc.values())]:
        alloc[b] += 1
    predicted = max(curves[b][h - 1] for b, h in alloc.items() if h)
    return "proportional to single-head speed (planner.heads not importable)", alloc, predicted


def best_pair(curves: dict[str, tuple[float, ...]], heads: int) -> tuple[dict[str, int], float]:
    """The best split that really uses both backends of PAIR, by the curves (every h tried)."""
    a, b = PAIR
    h = min(range(1, heads), key=lambda h: max(curves[a][h - 1], curves[b][heads - h - 1]))
    return {a: h, b: heads - h}, max(curves[a][h - 1], curves[b][heads - h - 1])


def planner_decision(model: str, curves: dict[str, tuple[float, ...]], extra: dict[str, float]) -> dict:
    """What `choose_head_split` records for a device profiled with these curves (every present
    backend) and split fixed costs: {"split": allocation, "predicted_s", "single_best"} or
    {"split": None, "single": fastest backend by its curve, "single_s"}."""
    heads, hs = MODELS[model]
    graph = attention_piece(BATCH, SEQ, heads * hs, heads, hs, (BATCH, 1, 1, SEQ))  # block 1: an encoder
    sig = block_signature(graph.blocks[1])
    profile = DeviceProfile("this machine", model, BATCH, SEQ,
                            tuple(BackendProfile(b, {}, {sig: AttentionCurve(tuple(c))}) for b, c in curves.items()),
                            0, split_extra_cost_s={sig: dict(extra)} if extra else {})
    split = choose_head_split(graph, profile)
    if split is not None:
        return {"split": dict(split.heads), "predicted_s": split.predicted_s, "single_best": list(split.single_best)}
    best = min(curves, key=lambda b: curves[b][-1])
    return {"split": None, "single": best, "single_s": curves[best][-1]}


def run_model(model: str, singles: list[str], pair_present: bool, reps: int, say) -> dict:
    heads, hs = MODELS[model]
    hidden = heads * hs
    out: dict = {"model": model, "hidden": hidden, "heads": heads, "head_size": hs, "single": {}, "splits": []}
    for b in singles:
        out["single"][b] = r = time_split(model, {b: heads}, reps)
        say(f"{model} {b}: {r['seconds'] * 1e3:.1f} ms")
    if not pair_present:
        return out
    _, mask, _ = _inputs(hidden)
    all_curves = {}
    with OthersCpu() as others:
        for b in list(PAIR) + [b for b in singles if b not in PAIR]:  # the others for choose_head_split
            all_curves[b] = attention_curve(parse_backend(b), BATCH, SEQ, hidden, heads, hs, mask, reps=3).seconds
            say(f"{model} curve {b}: " + " ".join(f"{s * 1e3:.0f}" for s in all_curves[b]) + " ms")
    curves = {b: all_curves[b] for b in PAIR}
    name, alloc, predicted = allocate(curves, heads)
    out.update(curves=curves, curves_others_cpu=others.share, allocator=name,
               other_curves={b: c for b, c in all_curves.items() if b not in PAIR})
    # the fixed cost of a real split beyond the curves, measured as `confidant profile` does
    primary = split_primary([parse_backend(b) for b in PAIR])
    child = next(b for b in PAIR if b != primary.name)
    with OthersCpu() as others:
        cost = split_extra_cost(primary, parse_backend(child), {b: AttentionCurve(c) for b, c in curves.items()},
                                BATCH, SEQ, hidden, heads, hs, mask, reps)
    extra = {child: cost.extra_s}
    out["extra_cost"] = {"backend": child, "beside": primary.name, "extra_s": cost.extra_s,
                         "others_cpu": others.share,
                         "runs": [{"heads": {child: r.heads, primary.name: r.primary_heads},
                                   "measured_s": r.measured_s, "predicted_s": r.predicted_s, "busy_s": dict(r.busy_s),
                                   "curves_s": {child: curves[child][r.heads - 1],
                                                primary.name: curves[primary.name][r.primary_heads - 1]}}
                                  for r in cost.runs]}
    say(f"{model} split fixed cost of {child} beside {primary.name}: {cost.extra_s * 1e3:.1f} ms ("
        + ", ".join(f"{r.heads}+{r.primary_heads} heads {r.measured_s * 1e3:.1f} vs curves {r.predicted_s * 1e3:.1f}"
                    for r in cost.runs) + " ms)")
    _, alloc_x, predicted_x = allocate(curves, heads, extra)
    out["with_extra"] = {"allocation": {b: h for b, h in alloc_x.items() if h}, "predicted_s": predicted_x,
                         "predicted_without_s": split_time_by_curves(alloc_x, curves)}
    out["planner"] = planner_decision(model, all_curves, extra)
    out["planner_without_extra"] = planner_decision(model, all_curves, {})
    say(f"{model} allocator with the fixed cost: {out['with_extra']['allocation']} predicted {predicted_x * 1e3:.1f} ms "
        f"(without: {alloc} {predicted * 1e3:.1f} ms); choose_head_split: {_decision(out['planner'])}")
    plans = [("allocator", alloc, predicted)]
    if {b: h for b, h in alloc_x.items() if h} != {b: h for b, h in alloc.items() if h}:
        plans.append(("allocator with fixed cost", alloc_x, predicted_x))
    if sum(1 for h in alloc.values() if h) < 2:
        # the honest two-core comparison needs both backends working, chosen or not
        pair_alloc, pair_predicted = best_pair(curves, heads)
        plans.append(("best pair by curves", pair_alloc, pair_predicted))
    for label, allocation, predicted_s in plans:
        run = {"label": label, "allocation": {b: h for b, h in allocation.items() if h}, "predicted_s": predicted_s,
               "concurrent": time_split(model, allocation, reps)}
        say(f"{model} split ({label}) {run['allocation']}: {run['concurrent']['seconds'] * 1e3:.1f} ms "
            f"(predicted {predicted_s * 1e3:.1f})")
        if len(run["allocation"]) > 1:
            run["sequential"] = time_split(model, allocation, reps, concurrent=False)
        out["splits"].append(run)
    t = {b: r["seconds"] for b, r in out["single"].items()}
    best = min(t, key=t.get)
    out["best_single"] = (best, t[best])
    chosen = out["splits"][0]["concurrent"]["seconds"]
    out["speedup_vs_best_single"] = t[best] / chosen
    pair = next(r for r in out["splits"] if len(r["allocation"]) == 2)
    two = {b: s for b, s in t.items() if b.endswith(":t2")}
    if two:
        b2 = min(two, key=two.get)
        out["two_core"] = {"split": pair["allocation"], "split_s": pair["concurrent"]["seconds"],
                           "against": b2, "against_s": two[b2], "speedup": two[b2] / pair["concurrent"]["seconds"]}
    for run in out["splits"]:  # each timed split's prediction with the measured fixed cost
        run["predicted_with_extra_s"] = split_time_by_curves(run["allocation"], curves, extra)
    fastest = min(out["splits"], key=lambda r: r["concurrent"]["seconds"])
    out["split_pays"] = {"best_split": fastest["allocation"], "best_split_s": fastest["concurrent"]["seconds"],
                         "best_single": best, "best_single_s": t[best],
                         "pays": fastest["concurrent"]["seconds"] < t[best]}
    return out


def split_time_by_curves(allocation: dict[str, int], curves: dict[str, tuple[float, ...]],
                         extra: dict[str, float] | None = None) -> float:
    """The allocator's model: the slowest used backend's curve time plus its fixed cost."""
    extra = extra or {}
    return max(curves[b][h - 1] + extra.get(b, 0.0) for b, h in allocation.items() if h)


def _decision(d: dict) -> str:
    if d["split"] is not None:
        return (f"split {_alloc(d['split'])} predicted {_ms(d['predicted_s'])} ms "
                f"(fastest single {d['single_best'][0]} {_ms(d['single_best'][1])} ms)")
    return f"no split: single {d['single']} ({_ms(d['single_s'])} ms by its curve)"


# Output -------------------------------------------------------------------------------------------

def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _alloc(a: dict[str, int]) -> str:
    return " + ".join(f"{b}:{h}" for b, h in a.items())


def print_tables(results: list[dict], capacity: tuple[float, float]) -> None:
    print(f"\nparallel capacity of this machine (one-thread workers at full speed together; 2.0 = two "
          f"idle cores): {capacity[0]:.2f} before, {capacity[1]:.2f} after")
    print(f"\nforward+backward of one attention block, batch {BATCH}, seq {SEQ}, median ms "
          "(others: CPU share used by other processes meanwhile)")
    rows = [["model", "run", "heads", "ms", "busy ms per backend", "others"]]
    for r in results:
        for b, s in r["single"].items():
            rows.append([r["model"], b, str(r["heads"]), _ms(s["seconds"]), "", _pct(s["others_cpu"])])
        for run in r["splits"]:
            alloc = _alloc(run["allocation"])
            rows.append([r["model"], f"{run['label']}: predicted", alloc, _ms(run["predicted_s"]), "", ""])
            rows.append([r["model"], f"{run['label']}: predicted + fixed cost", alloc,
                         _ms(run.get("predicted_with_extra_s")), "", ""])
            for key, how in (("concurrent", "concurrent"), ("sequential", "one after other")):
                if key in run:
                    s = run[key]
                    busy = " ".join(_ms(v) for v in s["busy_s"].values())
                    rows.append([r["model"], f"{run['label']}: {how}", alloc, _ms(s["seconds"]), busy,
                                 _pct(s["others_cpu"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    for r in results:
        if not r["splits"]:
            continue
        chosen = r["splits"][0]
        print(f"{r['model']}: allocator {r['allocator']} chose {_alloc(chosen['allocation'])}")
        b, s = r["best_single"]
        print(f"  allocator's choice {_ms(chosen['concurrent']['seconds'])} ms vs best single backend {b} "
              f"{_ms(s)} ms: speedup {r['speedup_vs_best_single']:.2f}x")
        if "two_core" in r:
            c = r["two_core"]
            print(f"  two cores: split {_alloc(c['split'])} {_ms(c['split_s'])} ms vs {c['against']} alone "
                  f"{_ms(c['against_s'])} ms: speedup {c['speedup']:.2f}x")
        x = r["extra_cost"]
        print(f"  fixed cost of a split, {x['backend']} in a child beside {x['beside']}: {_ms(x['extra_s'])} ms "
              f"(others {_pct(x['others_cpu'])}); per allocation measured vs curves: "
              + ", ".join(f"{_alloc(run['heads'])} {_ms(run['measured_s'])} vs {_ms(run['predicted_s'])}"
                          for run in x["runs"]))
        for run in x["runs"]:
            print(f"    {_alloc(run['heads'])}: busy " + ", ".join(
                f"{b} {_ms(run['busy_s'].get(b))} (curve {_ms(c)})" for b, c in run["curves_s"].items()))
        w = r["with_extra"]
        print(f"  allocator with it: {_alloc(w['allocation'])} predicted {_ms(w['predicted_s'])} ms; without it: "
              f"{_alloc(chosen['allocation'])} predicted {_ms(chosen['predicted_s'])} ms, measured "
              f"{_ms(chosen['concurrent']['seconds'])} ms")
        print(f"  confidant plan (choose_head_split) on this machine's profile: {_decision(r['planner'])}"
              f"; without the fixed cost it would say: {_decision(r['planner_without_extra'])}")
        p = r["split_pays"]
        print(f"  does splitting pay here? {'yes' if p['pays'] else 'no'}: fastest timed split {_alloc(p['best_split'])} "
              f"{_ms(p['best_split_s'])} ms vs fastest single {p['best_single']} {_ms(p['best_single_s'])} ms (measured)")
    busy = [f"{r['model']} {label} {s['others_cpu']:.0%}" for r in results
            for label, s in list(r["single"].items())
            + [(f"{run['label']} {k}", run[k]) for run in r["splits"] for k in ("concurrent", "sequential") if k in run]
            if s.get("others_cpu") and s["others_cpu"] > 0.10]
    if busy:
        print("\nWARNING: other processes used the CPUs during: " + ", ".join(busy)
              + ". Those times are inflated, concurrent splits the most; rerun on an idle machine.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    started = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)

    present, skipped = present_backends(SINGLES)
    for b, why in skipped.items():
        say(f"skip {b}: {why}")
    names = [b.name for b in present]
    pair_present = all(b in names for b in PAIR)
    capacity_before = parallel_capacity()
    say(f"parallel capacity {capacity_before:.2f}, load average {os.getloadavg()[0]:.2f}")
    results = [run_model(m, names, pair_present, args.reps, say) for m in args.models]
    capacity_after = parallel_capacity()
    print_tables(results, (capacity_before, capacity_after))
    if args.json:
        doc = {"batch": BATCH, "seq": SEQ, "cpus": os.cpu_count(), "machine": platform.machine(),
               "python": platform.python_version(), "parallel_capacity": [capacity_before, capacity_after],
               "skipped": skipped, "elapsed_s": time.perf_counter() - started, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
