"""What the benchmarks share: CPU accounting (how busy the machine was with work other than ours),
the cached MiniLM export and synthetic batches.

This 2-core machine is often shared, and a ratio measured while another job ran means little; each
benchmark records the share of all CPUs that other processes used during each measurement.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path


# PyTorch held to AVX2, the ISA of the MNN wheel's GEMM (x86): side by side, what is left is MNN's own
# kernels, not the wheel's missing AVX-512 (read once at start-up, so only a child process can take it)
TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


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


# The model and data every benchmark measures -------------------------------------------------

BATCH, SEQ, NUM_LABELS, VOCAB = 8, 128, 9, 30522
# under $CONFIDANT_HOME, as the command line keeps its files (confidant.home)
CACHE_PATH = Path(os.environ.get("CONFIDANT_HOME") or Path.home() / ".cache" / "confidant") / "bench-minilm.onnx"


def default_model() -> Path:
    """MiniLM exported once into the user's cache and reused by every benchmark."""
    if CACHE_PATH.is_file():
        return CACHE_PATH
    from jobs.export.encoder import ExportOptions, default_checkpoint_dir, export_checkpoint

    print(f"exporting MiniLM to {CACHE_PATH} (once) ...", file=sys.stderr, flush=True)
    CACHE_PATH.parent.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_PATH.with_name(CACHE_PATH.stem + f".tmp{os.getpid()}.onnx")
    export_checkpoint(default_checkpoint_dir(), tmp, ExportOptions())
    os.replace(tmp, CACHE_PATH)
    return CACHE_PATH


def make_batches(n: int, seed: int = 0, batch: int = BATCH, seq: int = SEQ):
    """`n` batches: random ids, rows padded to random lengths, random labels."""
    import numpy as np

    from tasks.tokenize import Batch

    out = []
    for i in range(n):
        r = np.random.default_rng(seed + i)
        lengths = r.integers(seq // 4, seq + 1, size=batch)
        lengths[0] = seq
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        ids = r.integers(1000, VOCAB, size=(batch, seq)).astype(np.int64)
        ids[:, 0] = 101
        ids[np.arange(batch), lengths - 1] = 102
        ids *= mask
        labels = r.integers(0, NUM_LABELS, size=(batch, seq))
        labels[mask == 0] = -100
        out.append(Batch(ids, mask, np.zeros_like(mask), labels, n_labelled=int((labels != -100).sum())))
    return out


def engine_step(engine, feeds, optimizer) -> float:
    """One optimizer step of a whole-model `engine` over the micro-batch `feeds`: each forward and
    backward, the gradients summed, one update; the summed loss. The sum is `train-local`'s own
    (`tasks.trainer.accumulate_feeds`: each block's gradients added in place as they come)."""
    from tasks.trainer import accumulate_feeds

    loss, total = accumulate_feeds(engine, feeds)
    engine.step(optimizer, total)
    return loss
