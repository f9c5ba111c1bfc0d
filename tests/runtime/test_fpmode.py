"""Denormal flushing through ctypes/glibc (runtime.engines.fpmode).

Every check runs in a child process so the test process's own floating-point
mode stays as it was.
"""

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

x86_glibc = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
         and platform.libc_ver()[0] == "glibc"),
    reason="MXCSR flushing is implemented for x86-64 glibc only")


def run_child(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@x86_glibc
def test_enable_sets_ftz_daz_and_flushes():
    out = run_child("""
        import threading
        import numpy as np
        from runtime.engines import fpmode

        tiny, small = np.float32(1e-38), np.float32(1e-3)
        denormal = np.float32(1e-40)
        assert not fpmode.denormals_flushed()
        assert tiny * small != 0.0
        assert denormal + np.float32(0.0) != 0.0

        assert fpmode.enable_flush_denormals() is True
        assert fpmode.denormals_flushed()
        assert tiny * small == 0.0                  # FTZ: denormal results become 0
        assert denormal + np.float32(0.0) == 0.0    # DAZ: denormal inputs read as 0
        big = np.full(4096, 1e-38, np.float32) * small
        assert not big.any()                        # the vectorised path flushes too

        seen = []
        def worker():
            seen.append((fpmode.denormals_flushed(), float(tiny * small)))
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen == [(True, 0.0)], seen          # threads created later inherit it

        assert fpmode.enable_flush_denormals() is True  # idempotent
        print("ok")
    """)
    assert out.strip() == "ok"


@x86_glibc
def test_mxcsr_read_back_matches_fenv_layout():
    out = run_child("""
        from runtime.engines import fpmode
        lib = fpmode._libm()
        before = fpmode._mxcsr(fpmode._get_env(lib))
        assert before >> 16 == 0
        assert before & 0x1F80 == 0x1F80, hex(before)  # default: all exceptions masked
        assert fpmode.enable_flush_denormals()
        after = fpmode._mxcsr(fpmode._get_env(lib))
        status = 0x3F  # sticky exception flags; the self-check's underflow sets one
        assert after & ~status == (before | 0x8040) & ~status, (hex(before), hex(after))
        print("ok")
    """)
    assert out.strip() == "ok"


def test_unsupported_platform_is_a_no_op():
    out = run_child("""
        import platform
        import numpy as np
        platform.machine = lambda: "aarch64"
        from runtime.engines import fpmode
        assert fpmode.enable_flush_denormals() is False
        assert fpmode.denormals_flushed() is False
        assert np.float32(1e-38) * np.float32(1e-3) != 0.0
        print("ok")
    """)
    assert out.strip() == "ok"
