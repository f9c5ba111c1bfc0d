"""Linux /proc readings used for memory figures (None where /proc is not there)."""
from __future__ import annotations

import resource


def _kib_field(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def status_bytes(key: str) -> int | None:
    """A field of /proc/self/status in bytes, e.g. VmHWM (peak resident) or VmRSS."""
    return _kib_field("/proc/self/status", key)


def meminfo_bytes(key: str) -> int | None:
    """A field of /proc/meminfo in bytes, e.g. MemAvailable."""
    return _kib_field("/proc/meminfo", key)


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM first: ru_maxrss survives execve on Linux, so a
    worker started by a big parent would report the parent's peak as its own."""
    peak = status_bytes("VmHWM")
    if peak is not None:
        return peak
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
