"""Why no plan fits: `PlanDoesNotFit` and its message.

When no assignment fits the memory budgets, the partitioners find the least-overflow assignment
(the brute force by enumeration, CP-SAT with memory made soft: minimise the largest overflow over
any device), and `_does_not_fit` reports its tightest device, by how much it is over, and what
would help.
"""
from __future__ import annotations

from typing import Sequence

from ir.partition import Partition
from ir.plan import ASYNC_SCHEDULES
from planner.cluster import format_bytes
from planner.cost import (OPTIMIZER_STATE_COPIES, async_extra_copies, gradient_copies, stashed_weight_versions,
                          weight_copies)
from planner.partition.instance import PartitionInstance, _overflows, _partition


class PlanDoesNotFit(ValueError):
    """No assignment fits the memory budgets. `over_bytes` is the least, over all assignments, of
    the largest overflow of any device: every plan overflows some device by at least that much.
    `device` is the tightest device of the assignment that attains it (`attempt`). When the
    search ran out of time, the message says the bound is not proven."""

    def __init__(self, message: str, device: str, over_bytes: int, attempt: Partition):
        super().__init__(message)
        self.device = device
        self.over_bytes = over_bytes
        self.attempt = attempt


def _nbytes(n: int) -> str:
    """A size for a message, MiB first from 1 MiB up (what a user compares with budgets)."""
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB ({n} bytes)"
    return f"{n} bytes" if abs(n) < 1024 else f"{n} bytes ({format_bytes(n)})"


def _blocks_text(first: int, last: int) -> str:
    return f"block {first}" if first == last else f"blocks {first}-{last}"


def _does_not_fit(inst: PartitionInstance, devs: Sequence[int], ranges: Sequence[tuple[int, int]],
                  proven: bool = True) -> PlanDoesNotFit:
    """The error for the least-overflow assignment (devs, ranges), with what would help on its
    tightest device; `proven`: no plan fits and no assignment overflows less (else: none found in time)."""
    p = len(devs)
    over = _overflows(inst, devs, ranges)
    s = max(range(p), key=lambda i: over[i])
    d, (first, last) = devs[s], ranges[s]
    name, budget, worst = inst.devices[d], inst.memory_budget_bytes[d], over[s]
    plan = ", ".join(f"{inst.devices[e]} {_blocks_text(a, b)}" for e, (a, b) in zip(devs, ranges))
    others = [f"{inst.devices[devs[i]]!r} by {_nbytes(over[i])}" for i in range(p) if i != s and over[i] > 0]
    params = sum(inst.params_bytes[first:last + 1])
    activations = sum(inst.input_bytes[first:last + 1])
    if first == last:  # one block no cut can split: another device only helps if its budget is larger
        hints = [f"larger memory budgets: block {first} alone needs {_nbytes(budget + worst)} where it runs, more "
                 f"than the {_nbytes(budget)} budget of {name!r}, and more devices cannot split one block (a device "
                 f"with at least that much, or less to hold: LoRA adapters, or `plan --data` for embedding tables "
                 f"charged for the rows the data looks up)"]
    else:
        hints = [f"more devices, or larger memory budgets (at least {_nbytes(worst)} more on {name!r})"]
    # against what 1f1b-flush holds at this position (no old version or second copy; a gradient sum)
    saved = 0
    if inst.schedule in ASYNC_SCHEDULES:
        saved = inst.weight_copies[p - 1][s] - weight_copies("1f1b-flush", inst.optimizer, p, s, inst.microbatches)
    versioned = params - sum(inst.unversioned_bytes[d][first:last + 1])  # tables only looked up keep none
    # what the device holds no second current copy of (PyTorch: its new weights are an old version's)
    shared_bytes = sum(inst.shared_current_bytes[d][first:last + 1])
    shared = shared_bytes * inst.async_copies[p - 1][s]
    if saved > 0 and versioned and saved * versioned > shared:
        old = stashed_weight_versions(inst.schedule, p, s, inst.microbatches)
        what = [f"{old} old weight version{'s' if old != 1 else ''}"] if old else []
        if async_extra_copies(inst.schedule, p, s) and shared_bytes < versioned:
            what.append("the current weights' second copy")
        if (gradient_copies("1f1b-flush", microbatches=inst.microbatches)
                > gradient_copies(inst.schedule, microbatches=inst.microbatches)):
            what.append("less the gradient sum it holds")
        hints.append(f"1f1b-flush instead of 1f1b-stash: saves {_nbytes(saved * versioned - shared)} on {name!r} "
                     f"({', '.join(what)})")
    in_flight = inst.in_flight[p - 1][s]
    if activations and in_flight:
        hints.append(f"fewer micro-batches in flight or smaller micro-batches: stashed activations take "
                     f"{_nbytes(in_flight * activations)} on {name!r} ({in_flight} micro-batches in flight"
                     + ("; 1f1b-flush keeps at most p-s of gpipe's m)" if inst.schedule == "gpipe" else ")"))
    # not where the device reads its float32 base mapped, a block's resident (`mapped_frozen_bytes`): a quantized
    # base is held whole, which saves nothing against that
    mapped = any(inst.mapped_frozen_bytes[d][first:last + 1])
    savings = inst.base_dtype_savings[first:last + 1] if inst.base_dtype_savings and not mapped else ()
    lower = [(t, sum(x[j] for x in savings)) for j, t in ((1, "int4"), (0, "int8"))]
    lower = [(t, b) for t, b in lower if b > 0]
    if lower:  # the frozen base held smaller (LoRA's base: QLoRA's 4-bit or 8-bit)
        hints.append("a quantized frozen base: " + ", ".join(f"--base-dtype {t} saves {_nbytes(b)}" for t, b in lower)
                     + f" on {name!r} (its frozen weights as they are held now; int4 keeps embedding tables int8)")
    if inst.optimizer == "adamw" and params:
        saving = (OPTIMIZER_STATE_COPIES["adamw"] - OPTIMIZER_STATE_COPIES["sgd"]) * params
        hints.append(f"sgd instead of adamw: saves {_nbytes(saving)} on {name!r} (one optimizer state copy less)")
    claim = (f"every plan overflows some device by at least {_nbytes(worst)}" if proven else
             f"the best attempt found in the time limit overflows a device by {_nbytes(worst)} (not proven: a "
             f"longer time_limit_s may find a plan)")
    message = (f"no plan fits the memory budgets ({inst.schedule}, {inst.microbatches} micro-batches, "
               f"{inst.optimizer}): {claim}. "
               f"Tightest device: {name!r}, which in the best attempt ({plan}) needs {_nbytes(budget + worst)} "
               f"of its {_nbytes(budget)} budget"
               + (f" (also over there: {', '.join(others)})" if others else "")
               + ". What would make it fit:\n" + "\n".join(f"  - {h}" for h in hints))
    return PlanDoesNotFit(message, name, worst, _partition(inst, devs, ranges, "least-overflow"))
