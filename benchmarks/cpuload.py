"""CPU accounting shared by the benchmarks: how busy the machine was with work other than ours.

This 2-core machine is often shared, and a ratio measured while another job ran means little; each
benchmark records the share of all CPUs that other processes used during each measurement.
"""
from __future__ import annotations

import os
import resource
import time


def machine_busy_s() -> float | None:
    """CPU seconds spent busy by the whole machine since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def own_cpu_s() -> float:
    """CPU seconds of this process plus its waited-for children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class NoiseMeter:
    """`with NoiseMeter() as n: ...` then `n.others`: the share of all CPUs used by processes other
    than this one and its waited-for children while the block ran (None where /proc is missing)."""

    def __enter__(self):
        self.busy0, self.own0, self.t0 = machine_busy_s(), own_cpu_s(), time.perf_counter()
        self.others = None
        return self

    def __exit__(self, *exc):
        busy1, own1, wall = machine_busy_s(), own_cpu_s(), time.perf_counter() - self.t0
        if self.busy0 is not None and busy1 is not None and wall > 0:
            self.others = max(0.0, (busy1 - self.busy0 - (own1 - self.own0)) / ((os.cpu_count() or 1) * wall))
        return False
