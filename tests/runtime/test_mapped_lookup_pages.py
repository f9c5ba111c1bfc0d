"""Issue 31 target 3: an MNN stage streaming its mapped float32 base gathers a frozen table's rows a file span at a
time (`ir.mapped_pages.gather_rows`, `runtime.engines.mnn._BlockProgram.feed`), its pages given back after each,
because a read fault maps a page-cache folio whole: in a file written since boot (a plan's base.safetensors) up to
2 MiB, so one lookup of 128 ids read at once (`table[ids]`) made 46-87 MiB of a 108 MiB table resident (kernel
6.18, ext4; SmolLM2's first pipeline stage peaked there, 1.20 of its mapped charge, helpers h162 and h172). The
rows are the table's, bit for bit; while they are gathered the process rises at most the rows and two spans
(`planner.cost.LOOKUP_READ_SPANS`, what the cost model charges), read against the peak resident set (clear_refs)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from ir.mapped_pages import FAULT_SPAN_BYTES, drop_pages_under, gather_rows
from planner.cost import LOOKUP_READ_SPANS
from runtime.procfs import reset_peak_rss, status_bytes

ROWS, WIDTH = 8192, 1024  # a 32 MiB float32 table, rows of 4 KiB


@pytest.fixture
def table(tmp_path):
    """A freshly written 32 MiB table (rows 4 KiB) on a read-only mapping of its file, as a worker maps its base."""
    path = tmp_path / "table.bin"
    np.random.default_rng(0).standard_normal((ROWS, WIDTH), dtype=np.float32).tofile(path)
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    yield np.frombuffer(view, np.float32).reshape(ROWS, WIDTH)  # the mapping closes with its last view


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, ROWS, (1, 128))  # a micro-batch of one 128-token row


def test_gathered_rows_are_the_tables(table):
    for seed in range(3):
        ids = _ids(seed)
        rows = gather_rows(table, ids)
        assert rows.shape == (1, 128, WIDTH) and rows.flags.writeable
        assert np.array_equal(rows, np.array(table)[ids])
    held = np.array(table[:64])  # a table in memory of its own: indexed as it is
    assert np.array_equal(gather_rows(held, np.array([3, 1, 3])), held[[3, 1, 3]])


def test_a_lookup_holds_at_most_its_rows_and_two_spans_of_the_mapped_table(table):
    bound = 128 * WIDTH * 4 + LOOKUP_READ_SPANS * FAULT_SPAN_BYTES
    for seed in range(3):
        ids = _ids(seed)
        drop_pages_under([table])
        level, file_pages = status_bytes("VmRSS"), status_bytes("RssFile")
        if level is None or not reset_peak_rss():
            pytest.skip("needs /proc/self/status and clear_refs (Linux)")
        rows = gather_rows(table, ids)
        rise = status_bytes("VmHWM") - level
        assert rise <= bound + (1 << 20), f"{rise / 2**20:.1f} MiB above the level (bound {bound / 2**20:.1f})"
        assert status_bytes("RssFile") - file_pages < 1 << 20  # the last span's pages given back too
        del rows
