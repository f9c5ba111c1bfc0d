"""The restore spool (runtime.pipeline.restore): a recovery's state off the wire, the weights in
memory and the optimizer state on disk, equal to the whole state merged in memory."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.optim import SparseRows
from runtime.pipeline.checkpoints import TrainingState, dense_from_wire, merge_checkpoint, rows_on_wire
from runtime.pipeline.restore import RestoreSpool, SpooledTensor


def _stages():
    """Two stages' checkpoint tensors as they cross the wire: a table whose AdamW moments are kept
    by rows on stage 0, a weight tied across both stages, the shared step count."""
    r = np.random.default_rng(0)
    table, tied, w = (r.standard_normal(s).astype(np.float32) for s in ((10, 4), (4, 4), (4, 3)))
    ids = np.array([7, 2, 5], np.int64)
    stage0 = [("param/table", table), ("param/tied", tied), ("opt/steps", np.array([3], np.int64)),
              ("opt/m/tied", r.standard_normal((4, 4)).astype(np.float32)),
              *rows_on_wire("opt/m/table", SparseRows(ids, r.standard_normal((3, 4)).astype(np.float32), (10, 4))),
              *rows_on_wire("opt/v/table", SparseRows(ids, r.random((3, 4)).astype(np.float32), (10, 4)))]
    stage1 = [("param/tied", tied.copy()), ("param/w", w), ("opt/steps", np.array([3], np.int64)),
              ("opt/m/w", r.standard_normal((4, 3)).astype(np.float32)), ("opt/v/w", r.random((4, 3)).astype(np.float32))]
    rows0 = {"opt/m/table": [10, 4], "opt/v/table": [10, 4]}
    return [(0, rows0, stage0), (1, None, stage1)]


def test_the_spooled_state_equals_the_state_merged_in_memory(tmp_path):
    stages = _stages()
    want = TrainingState(*merge_checkpoint([dense_from_wire(dict(t), rows, f"stage {k}") for k, rows, t in stages]))
    spool = RestoreSpool()
    try:
        got = spool.state_of(((k, rows, iter(t)) for k, rows, t in stages), "a test")
        assert set(got.weights) == set(want.weights) and set(got.scalars) == set(want.scalars)
        for name, arr in want.weights.items():
            assert isinstance(got.weights[name], np.ndarray)  # the bundles are written from them
            np.testing.assert_array_equal(got.weights[name], arr)
        np.testing.assert_array_equal(got.scalars["steps"], want.scalars["steps"])
        assert {k: set(v) for k, v in got.optimizer.items()} == {k: set(v) for k, v in want.optimizer.items()}
        for kind, per_name in want.optimizer.items():
            for name, arr in per_name.items():
                held = got.optimizer[kind][name]
                assert isinstance(held, SpooledTensor), (kind, name)  # on disk, not in memory
                assert held.nbytes == arr.nbytes and held.shape == arr.shape
                np.testing.assert_array_equal(np.asarray(held), arr)
        assert got.nbytes("table") == want.nbytes("table")
        sent = got.stage_optimizer_state(["w", "tied"])
        assert sorted(sent) == sorted(want.stage_optimizer_state(["w", "tied"]))
        folder = spool.folder
        assert folder is not None and any(folder.iterdir())
    finally:
        spool.close()
    assert not folder.exists()


def test_a_table_row_out_of_range_is_refused():
    (k, rows, t), other = _stages()
    t = [(n, np.array([7, 2, 10], np.int64)) if n == "opt/m/table#ids" else (n, a) for n, a in t]
    spool = RestoreSpool()
    try:
        with pytest.raises(ValueError, match="row ids out of"):
            spool.state_of([(k, rows, iter(t)), other], "a test")
    finally:
        spool.close()
