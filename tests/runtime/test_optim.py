"""The numpy optimizers (runtime/optim.py) on tensors that span several of their cache-sized chunks:
the chunked step equals the same step over whole arrays bit for bit, and both equal torch.optim in
float64; a parameter that is not C-contiguous is updated in place too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import optim
from runtime.engines.base import RowGradient
from runtime.optim import CHUNK, make_optimizer


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"table": rng.standard_normal((3 * CHUNK // 64 + 1, 64)).astype(np.float32),  # 3 chunks and a bit
           "bias": rng.standard_normal(7).astype(np.float32)}
    out["transposed"] = np.ascontiguousarray(rng.standard_normal((40, 30)).astype(np.float32)).T  # a view
    return out


def _grads(params, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {k: (1e-2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}


def _run(name: str, steps: int = 3, **kw) -> tuple[dict, dict]:
    params = _tensors()
    opt = make_optimizer(name, 1e-2, **kw)
    views = {k: v for k, v in params.items()}
    for step in range(steps):
        out = opt.step(params, _grads(params, step))
        assert out is params
    assert all(params[k] is views[k] for k in params)  # in place, the transposed view included
    return params, opt.state()


@pytest.mark.parametrize("name,kw", [("adamw", {}), ("adamw", {"weight_decay": 0.0}), ("sgd", {}),
                                     ("sgd", {"weight_decay": 0.01})])
def test_a_chunked_step_equals_the_whole_array_step_bit_for_bit(monkeypatch, name, kw):
    chunked, chunked_state = _run(name, **kw)
    monkeypatch.setattr(optim, "CHUNK", 1 << 40)  # one chunk per tensor: the plain whole-array passes
    whole, whole_state = _run(name, **kw)
    assert all(np.array_equal(chunked[k], whole[k]) for k in whole)
    assert chunked_state.keys() == whole_state.keys()
    assert all(np.array_equal(chunked_state[k], whole_state[k]) for k in whole_state)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_chunked_step_equals_torch_optim_in_float64(name):
    got, _ = _run(name, weight_decay=0.01)
    start = _tensors()
    tensors = {k: torch.tensor(np.array(v), dtype=torch.float64, requires_grad=True) for k, v in start.items()}
    opt = (torch.optim.AdamW(tensors.values(), lr=1e-2, weight_decay=0.01) if name == "adamw" else
           torch.optim.SGD(tensors.values(), lr=1e-2, momentum=0.9, weight_decay=0.01))
    for step in range(3):
        for k, g in _grads(start, step).items():
            tensors[k].grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    for k, t in tensors.items():
        np.testing.assert_allclose(got[k], t.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


# --- tables updated by rows: the step over the rows that ever had a gradient equals the dense step

def _row_steps(seed: int = 3, steps: int = 4, vocab: int = 500, width: int = 24, dtype=np.float32):
    """Per step, a table's gradient as rows (ids repeat, some rows appear once and never again)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        ids = rng.integers(0, vocab // (4 - min(step, 2)), size=40)
        ids[:3] = ids[3]  # one row summed several times in a step
        out.append(RowGradient(ids, (1e-2 * rng.standard_normal((ids.size, width))).astype(dtype),
                               (vocab, width)))
    return out


def _train_table(name: str, kw: dict, grads, dense: bool, start_state=None):
    rng = np.random.default_rng(7)
    table = rng.standard_normal(grads[0].shape).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    opt = make_optimizer(name, 1e-2, **kw)
    if start_state is not None:
        opt.load_state(start_state)
    for step, g in enumerate(grads):
        params = {"table": table, "bias": bias}
        opt.step(params, {"table": g.dense() if dense else g, "bias": np.full(5, 0.1 * step, np.float32)})
    return table, bias, opt


OPTIMIZERS = [("adamw", {}), ("adamw", {"weight_decay": 0.0}), ("sgd", {}), ("sgd", {"weight_decay": 0.01})]


@pytest.mark.parametrize("vocab,dtype,chunk", [(500, np.float32, None), (500, np.float32, 7 * 24),
                                               (60, np.float32, None),
                                               (500, np.float64, None)],
                         ids=["rows", "rows-in-runs-of-7", "goes-dense", "float64-rows"])  # 60: half the rows get state
@pytest.mark.parametrize("name,kw", OPTIMIZERS)
def test_a_table_stepped_by_its_rows_equals_the_dense_step_bit_for_bit(monkeypatch, name, kw, vocab, dtype, chunk):
    if chunk:  # the row step's runs of slots (and the dense step's chunks) a few rows long
        monkeypatch.setattr(optim, "CHUNK", chunk)
    grads = _row_steps(vocab=vocab, dtype=dtype)
    by_rows, bias_rows, opt_rows = _train_table(name, kw, grads, dense=False)
    dense, bias_dense, opt_dense = _train_table(name, kw, grads, dense=True)
    assert np.array_equal(by_rows, dense) and np.array_equal(bias_rows, bias_dense)
    a, b = opt_rows.state(), opt_dense.state()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in b)
    rows_path = name == "adamw" or not kw
    assert ("table" in opt_rows.dense_tables) == (rows_path and vocab == 60)
    if rows_path and vocab == 500:
        held = opt_rows.rows if name == "adamw" else opt_rows.row_buffers
        touched = np.unique(np.concatenate([g.ids for g in grads]))
        # state only for the rows that had a gradient: the point of the row path
        assert sorted(held["table"].ids[:held["table"].n]) == touched.tolist()
        assert "table" not in (opt_rows.m if name == "adamw" else opt_rows.buffers)


@pytest.mark.parametrize("name,kw", OPTIMIZERS)
def test_row_steps_resume_from_a_dense_checkpoint_and_go_back_to_dense_gradients(name, kw):
    grads = _row_steps(steps=6)
    _, _, first = _train_table(name, kw, grads[:3], dense=True)
    saved = first.state()  # as a checkpoint holds it: dense arrays
    whole_dense, _, _ = _train_table(name, kw, grads, dense=True)
    # the table's state is rebuilt from the dense checkpoint, then rows, then a dense gradient again
    rng = np.random.default_rng(7)
    table = rng.standard_normal(grads[0].shape).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    opt = make_optimizer(name, 1e-2, **kw)
    for step, g in enumerate(grads):
        if step == 3:
            resumed = make_optimizer(name, 1e-2, **kw)
            resumed.load_state(opt.state())
            opt = resumed
        feed = g if step in (3, 4) else g.dense()
        opt.step({"table": table, "bias": bias}, {"table": feed, "bias": np.full(5, 0.1 * step, np.float32)})
    assert np.array_equal(table, whole_dense)
    assert saved.keys() == opt.state().keys()


@pytest.mark.parametrize("name,kw", OPTIMIZERS)
def test_state_parts_are_the_optimizers_own_arrays_and_make_its_state(name, kw):
    """What a checkpoint sends (`state_parts`): the dense state and the tables' row state, apart,
    as the optimizer's own arrays (no copy built to send) and together exactly `state()`."""
    _, _, opt = _train_table(name, kw, _row_steps(), dense=False)
    dense, rows = opt.state_parts()
    whole = opt.state()
    assert dense.keys() | rows.keys() == whole.keys() and not dense.keys() & rows.keys()
    assert all(np.array_equal(dense[k], whole[k]) for k in dense)
    assert all(np.array_equal(r.dense(), whole[k]) and r.dense().shape == (500, 24) for k, r in rows.items())
    by_rows = name == "adamw" or not kw
    kinds = ("m", "v") if name == "adamw" else ("momentum",)
    assert sorted(rows) == ([f"{k}/table" for k in kinds] if by_rows else [])
    if by_rows:
        held = (opt.rows if name == "adamw" else opt.row_buffers)["table"]
        for i, kind in enumerate(kinds):
            part = rows[f"{kind}/table"]
            assert np.shares_memory(part.rows, held.arrays[i]) and np.shares_memory(part.ids, held.ids)
            assert sorted(part.ids) == sorted(np.unique(np.concatenate([g.ids for g in _row_steps()])))
    own = {f"{kind}/{k}": a for kind in ("m", "v") for k, a in getattr(opt, kind, {}).items()}
    own.update({f"momentum/{k}": a for k, a in getattr(opt, "buffers", {}).items()})
    assert all(dense[k] is own[k] for k in dense if k != "steps")


@pytest.mark.parametrize("name,kw", OPTIMIZERS)
def test_a_table_with_dense_state_takes_its_row_gradient_without_a_dense_copy(name, kw):
    """Once a table's state is dense (or SGD decays it, which steps every row), its row gradient is
    scattered one chunk of rows at a time: the step allocates a small fraction of the table (traced
    by tracemalloc, which sees numpy's buffers), and gives the dense gradient's step bit for bit
    (repeated ids included, added in the same order)."""
    import tracemalloc

    rng = np.random.default_rng(3)
    shape = (20000, 64)  # 5 MB
    ids = rng.integers(0, shape[0], 600)
    ids[::7] = ids[0]  # one row many times over
    g = RowGradient(ids, rng.standard_normal((ids.size, shape[1])).astype(np.float32), shape)
    start = rng.standard_normal(shape).astype(np.float32)
    by_rows, dense = start.copy(), start.copy()
    opt_rows, opt_dense = make_optimizer(name, 1e-2, **kw), make_optimizer(name, 1e-2, **kw)
    for opt in (opt_rows, opt_dense):
        opt.dense_tables.add("table")  # as after ROWS_DENSE_SHARE of the rows had state
    for step in range(3):
        tracemalloc.start()
        try:
            opt_rows.step({"table": by_rows}, {"table": g})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        opt_dense.step({"table": dense}, {"table": g.dense()})
        # the first step allocates the state (m and v, or the momentum), nothing more
        state = start.nbytes * (2 if name == "adamw" else 1) if step == 0 else 0
        assert peak < state + start.nbytes // 8, (step, peak)
        assert np.array_equal(by_rows, dense), step
    a, b = opt_rows.state(), opt_dense.state()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in b)
