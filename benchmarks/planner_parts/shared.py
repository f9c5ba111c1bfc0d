"""Constants and text helpers shared by every part of benchmarks/planner.py."""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BATCH, SEQ, NUM_LABELS, VOCAB = 8, 128, 9, 30522
LR = 1e-4
OPTIMIZER = "adamw"
SCHEDULES = ("1f1b-flush", "gpipe", "1f1b-stash")
MARKER = "CONFIDANT_BENCH "
BACKEND = "mnn:cpu:t1"
CPUS = os.cpu_count() or 1


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    allrows = [header] + rows
    widths = [max(len(r[i]) for r in allrows) for i in range(len(header))]
    lines = [" ".join(c.rjust(w) for c, w in zip(r, widths)) for r in allrows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
