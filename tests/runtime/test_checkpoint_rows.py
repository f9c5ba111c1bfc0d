"""A table's optimizer state crosses a checkpoint as rows (runtime.pipeline.checkpoints): the stage
sends its optimizer's own arrays, and the coordinator makes them dense, after checking everything a
worker declared, since it came over the network."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.optim import SparseRows
from runtime.pipeline.checkpoints import dense_from_wire, rows_on_wire

SOURCE = "stage 0's checkpoint"


def _wire(ids=(4, 1, 7), shape=(9, 3), param_shape=None):
    ids = np.asarray(ids, np.int64)
    rows = np.arange(ids.size * 3, dtype=np.float32).reshape(ids.size, 3) + 1
    sparse = SparseRows(ids, rows, shape)
    tensors = {"param/table": np.zeros(param_shape or shape, np.float32), "opt/m/bias": np.ones(3, np.float32)}
    tensors.update(rows_on_wire("opt/m/table", sparse))
    return tensors, {"opt/m/table": list(shape)}, sparse


def test_rows_on_the_wire_come_back_dense_and_leave_the_rest_alone():
    tensors, shapes, sparse = _wire()
    out = dense_from_wire(tensors, shapes, SOURCE)
    assert sorted(out) == ["opt/m/bias", "opt/m/table", "param/table"]
    assert np.array_equal(out["opt/m/table"], sparse.dense())
    assert np.count_nonzero(out["opt/m/table"].any(axis=1)) == 3 and out["opt/m/table"][7, 0] == 7
    assert out["opt/m/bias"] is tensors["opt/m/bias"]
    assert dense_from_wire(tensors, None, SOURCE) is tensors  # a worker with no row state declares none


def _case(change):
    tensors, shapes, _ = _wire()
    change(tensors, shapes)
    return tensors, shapes


CASES = {
    "bad key": (lambda t, s: s.update({"m/table": [9, 3]}),
                "stage 0's checkpoint: checkpoint row entry 'm/table' is not opt/<kind>/<parameter>"),
    "no parameter": (lambda t, s: t.pop("param/table"),
                     "stage 0's checkpoint: checkpoint row entry 'opt/m/table' names parameter 'table', which the "
                     "checkpoint does not hold"),
    "shape not the parameter's": (lambda t, s: s.update({"opt/m/table": [90000000, 3]}),
                                  "stage 0's checkpoint: checkpoint row entry 'opt/m/table' declares shape "
                                  "[90000000, 3], its parameter is [9, 3]"),
    "rows missing": (lambda t, s: t.pop("opt/m/table#rows"),
                     "stage 0's checkpoint: checkpoint row entry 'opt/m/table' came without its #ids and #rows "
                     "tensors"),
    "rows misshapen": (lambda t, s: t.update({"opt/m/table#rows": np.zeros((3, 4), np.float32)}),
                       "stage 0's checkpoint: checkpoint row entry 'opt/m/table': ids int64[3] and rows "
                       "float32[3, 4] do not make int64 [n] and float32 [n, 3]"),
    "ids float": (lambda t, s: t.update({"opt/m/table#ids": np.array([4.0, 1.0, 7.0])}),
                  "stage 0's checkpoint: checkpoint row entry 'opt/m/table': ids float64[3] and rows "
                  "float32[3, 3] do not make int64 [n] and float32 [n, 3]"),
    "id out of range": (lambda t, s: t.update({"opt/m/table#ids": np.array([4, 1, 9], np.int64)}),
                        "stage 0's checkpoint: checkpoint row entry 'opt/m/table' has row ids out of 0..8 or "
                        "repeated"),
    "id negative": (lambda t, s: t.update({"opt/m/table#ids": np.array([4, -1, 7], np.int64)}),
                    "stage 0's checkpoint: checkpoint row entry 'opt/m/table' has row ids out of 0..8 or repeated"),
    "id repeated": (lambda t, s: t.update({"opt/m/table#ids": np.array([4, 4, 7], np.int64)}),
                    "stage 0's checkpoint: checkpoint row entry 'opt/m/table' has row ids out of 0..8 or repeated"),
    "stray rows": (lambda t, s: t.update({"opt/v/table#ids": np.array([1], np.int64)}),
                   "stage 0's checkpoint: checkpoint tensors ['opt/v/table#ids'] are rows of no declared entry"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_row_entry_that_does_not_add_up_is_refused_by_name(name):
    change, message = CASES[name]
    tensors, shapes = _case(change)
    with pytest.raises(ValueError) as info:
        dense_from_wire(tensors, shapes, SOURCE)
    assert str(info.value) == message


def test_rows_declared_as_something_else_than_a_map_are_refused():
    tensors, _, _ = _wire()
    with pytest.raises(ValueError, match=r"^stage 0's checkpoint: checkpoint 'rows' must map entries to shapes, "
                                         r"got list$"):
        dense_from_wire(tensors, [[9, 3]], SOURCE)
