"""Flush denormal floats to zero on x86-64 Linux, without a compiled extension.

Why: MNN's CPU kernels slow down by 4x or more when they meet denormal floats,
and a BERT attention mask of -10000 produces plenty of them (``exp(-10000 +
...)`` underflows through the denormal range in softmax and its gradient).
The x86 MXCSR register has two bits that make the SSE/AVX units treat
denormals as zero: FTZ (flush-to-zero, bit 15) for results and DAZ
(denormals-are-zero, bit 6) for inputs.  Values that small are far below
float32 training noise, so flushing them does not change training.

How: glibc's ``fegetenv``/``fesetenv`` (called through ctypes) read and write
the whole floating-point environment.  On x86-64 glibc ``fenv_t`` is 32
bytes: the 28-byte x87 environment followed by the 32-bit ``__mxcsr``.  The
layout is checked at run time (the reserved upper MXCSR bits must be zero and
a denormal product must really flush); if anything is off, the previous
environment is restored and nothing is claimed.

Thread caveat: MXCSR is per thread.  A new POSIX thread starts with a copy of
its creator's floating-point state, and threads that already exist are not
affected.  So this must run in the main thread *before* MNN (or anything else
whose worker threads should flush) creates its thread pool: MNN creates its
workers when a thread count above one is configured, which is why
``runtime.engines.mnn_kernels`` calls this at import, before it touches MNN.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

__all__ = ["enable_flush_denormals", "denormals_flushed"]

_FTZ = 1 << 15
_DAZ = 1 << 6
_FENV_SIZE = 32
_MXCSR_OFFSET = 28

# The smallest normal float64; half of it is denormal.  Kept as data so the
# products below run on the SSE unit at call time instead of being folded
# into constants by the compiler.
_TINY = float.fromhex("0x1.0p-1022")
_HALF = 0.5


def _libm():
    if not sys.platform.startswith("linux"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    for fn in (lib.fegetenv, lib.fesetenv):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return lib


def _get_env(lib) -> ctypes.Array | None:
    env = (ctypes.c_uint8 * _FENV_SIZE)()
    if lib.fegetenv(env) != 0:
        return None
    return env


def _mxcsr(env) -> int:
    return int.from_bytes(bytes(env[_MXCSR_OFFSET:_MXCSR_OFFSET + 4]), "little")


def _with_mxcsr(env, value: int):
    new = (ctypes.c_uint8 * _FENV_SIZE).from_buffer_copy(env)
    new[_MXCSR_OFFSET:_MXCSR_OFFSET + 4] = list(value.to_bytes(4, "little"))
    return new


def _flush_observed() -> bool:
    tiny, half = _TINY, _HALF
    denormal = tiny * half
    return denormal == 0.0


def denormals_flushed() -> bool:
    """Whether FTZ and DAZ are both set for the calling thread (False where unsupported)."""
    lib = _libm()
    if lib is None:
        return False
    env = _get_env(lib)
    if env is None:
        return False
    mxcsr = _mxcsr(env)
    return mxcsr >> 16 == 0 and mxcsr & (_FTZ | _DAZ) == (_FTZ | _DAZ)


def enable_flush_denormals() -> bool:
    """Set FTZ and DAZ for the calling thread; return True if they are now in effect.

    Returns False and changes nothing on platforms other than x86-64 glibc
    Linux.  Call it from the main thread before any library starts worker
    threads (see the module docstring): threads created afterwards inherit the
    setting, threads created before do not.
    """
    lib = _libm()
    if lib is None:
        return False
    old = _get_env(lib)
    if old is None:
        return False
    mxcsr = _mxcsr(old)
    if mxcsr >> 16 != 0:
        return False
    if lib.fesetenv(_with_mxcsr(old, mxcsr | _FTZ | _DAZ)) != 0:
        lib.fesetenv(old)
        return False
    if not (denormals_flushed() and _flush_observed()):
        lib.fesetenv(old)
        return False
    return True
