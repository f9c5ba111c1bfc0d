"""Linux /proc readings used for memory figures (None where /proc is not there)."""
from __future__ import annotations

import resource

from runtime.heap import release_free_heap  # noqa: F401 (glibc's calls live in runtime.heap; callers import it here)


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


def reset_peak_rss() -> bool:
    """Start this process's peak resident memory (VmHWM) again from what it holds now (Linux:
    writing 5 to /proc/self/clear_refs), so a later `peak_rss_bytes` measures one phase (training)
    and not an earlier one (an evaluation that loaded another runtime). False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int | None:
    """This process's resident memory now (VmRSS): what a soak test watches stay flat."""
    return status_bytes("VmRSS")


def mem_available_bytes() -> int | None:
    """What the kernel says could be given to new work without swapping (MemAvailable)."""
    return meminfo_bytes("MemAvailable")


def battery_percent(root: str = "/sys/class/power_supply") -> float | None:
    """The charge of the first battery the OS exposes (0-100), or None where there is none (a
    desktop, a container, a phone whose OS hides it)."""
    import os

    try:
        supplies = sorted(os.listdir(root))
    except OSError:
        return None
    for name in supplies:
        try:
            with open(os.path.join(root, name, "type")) as f:
                if f.read().strip() != "Battery":
                    continue
            with open(os.path.join(root, name, "capacity")) as f:
                return float(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def device_state() -> dict:
    """What a worker reports with every answer, for the coordinator to re-plan before a device
    runs out: free memory and, where exposed, battery."""
    return {"mem_available_bytes": mem_available_bytes(), "battery_percent": battery_percent()}


def threads_cpu_s(name_prefix: str) -> float | None:
    """CPU seconds (user + system) this process's threads whose name starts with `name_prefix` have
    used (ZeroMQ's I/O threads: "ZMQbg/IO"), from /proc/self/task; None where there is no /proc."""
    import os

    try:
        tasks = os.listdir("/proc/self/task")
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    total = 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        if name.startswith(name_prefix):
            fields = stat[stat.rfind(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total
