"""Embedding tables' gradients as the rows they touch (runtime.engines.base.RowGradient): the
same values as the dense gradient on both engines, summed by `accumulate` as the dense ones are,
and never handed to a caller that did not ask for them."""
from __future__ import annotations

import numpy as np
import pytest

from planner.onnx_import import load_model
from runtime.engines.base import RowGradient, accumulate, add_gradient
from runtime.engines.stage import stage_spec
from support import ROWS, S, export_onnx, token_feeds


def _rows(seed: int = 0, n: int = 7, shape=(5, 3)) -> RowGradient:
    r = np.random.default_rng(seed)
    return RowGradient(r.integers(0, shape[0], n), r.normal(size=(n, shape[1])).astype(np.float32), shape)


def test_a_row_gradient_is_its_dense_form_under_every_sum():
    a, b = _rows(0), _rows(1)
    d = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32)
    dense_a = np.zeros((5, 3), np.float32)
    for i, row in zip(a.ids, a.rows):
        dense_a[i] += row
    np.testing.assert_array_equal(a.dense(), dense_a)
    np.testing.assert_allclose(add_gradient(a, b).dense(), a.dense() + b.dense(), rtol=1e-6)
    np.testing.assert_allclose(add_gradient(d, a), d + a.dense(), rtol=1e-6)
    np.testing.assert_allclose(add_gradient(a, d), d + a.dense(), rtol=1e-6)
    before = d.copy()
    add_gradient(d, a)
    np.testing.assert_array_equal(d, before)  # a new value: neither input changed
    total: dict = {}
    accumulate(total, {"t": a})
    accumulate(total, {"t": d})
    accumulate(total, {"t": b})
    np.testing.assert_allclose(total["t"], a.dense() + d + b.dense(), rtol=1e-6)
    assert isinstance(total["t"], np.ndarray)


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_the_engines_give_the_tables_rows_only_when_asked(graph, engine):
    if engine == "torch":
        pytest.importorskip("torch")
        from runtime.engines.pytorch import TorchStageEngine as Engine
    else:
        from runtime.engines.mnn import MnnStageEngine as Engine
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = token_feeds(ROWS, S, vocab=500)
    plain, rows = Engine(spec), Engine(spec)
    rows.row_gradients = True
    plain.forward(feeds, 0)
    rows.forward(feeds, 0)
    want, got = plain.backward(0).params, rows.backward(0).params
    tables = {n.inputs[0] for n in spec.compute_nodes if n.op == "Gather" and n.inputs[0] in spec.params}
    assert tables and all(isinstance(want[k], np.ndarray) for k in want)
    assert {k for k, g in got.items() if isinstance(g, RowGradient)} == tables
    for k in want:
        g = got[k].dense() if isinstance(got[k], RowGradient) else got[k]
        if engine == "mnn":
            np.testing.assert_array_equal(g, want[k], err_msg=k)  # the same scatter, in the same order
        else:
            np.testing.assert_allclose(g, want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    word = max(tables, key=lambda k: graph.constants[k].shape[0])
    assert len(got[word].ids) == ROWS * S  # one row per token, not one per vocabulary entry
