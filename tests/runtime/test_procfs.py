"""runtime.procfs on this Linux machine: freed heap given back to the OS."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_freed_heap_is_given_back_to_the_os():
    """80 MB of 4 KB buffers freed under one still held (which pins glibc's heap top, as an engine's
    arrays pin it after an evaluation's ONNX Runtime sessions are gone) stay resident until
    `release_free_heap`. In a fresh process, so the test process's own heap does not blur it."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1])\n"
            "from runtime.procfs import release_free_heap, rss_bytes\n"
            "chunks = [bytearray(4000) for _ in range(20000)]\n"
            "pin = bytearray(4000)\n"
            "del chunks\n"
            "freed = rss_bytes()\n"
            "ok = release_free_heap()\n"
            "print(json.dumps([ok, freed, rss_bytes()]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60, check=True)
    ok, freed, trimmed = json.loads(out.stdout)
    assert ok
    assert freed - trimmed > 50 * 2**20, (freed, trimmed)
