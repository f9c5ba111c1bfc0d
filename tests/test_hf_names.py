"""The value search of `jobs.hf_names`: the probe prefilter finds every parameter the whole-array
comparison accepts (as it is or transposed), so placing weights stays exact while it stops being
quadratic in the number of same-shaped parameters."""
from __future__ import annotations

import numpy as np

from jobs.hf_names import ATOL, _Candidates, _same


def _state(rng):
    square = {f"layer.{i}.q.weight": rng.standard_normal((6, 6)).astype(np.float32) for i in range(40)}
    wide = {f"layer.{i}.up.weight": rng.standard_normal((4, 10)).astype(np.float32) for i in range(10)}
    sym = rng.standard_normal((6, 6)).astype(np.float32)
    return {**square, **wide, "sym.weight": sym + sym.T, "bias": np.zeros(6, np.float32),
            "ids": np.arange(6)}  # an integer buffer is never a candidate


def test_probes_find_exactly_what_whole_arrays_accept():
    rng = np.random.default_rng(0)
    state = _state(rng)
    candidates = _Candidates(state)
    queries = [state["layer.3.q.weight"], state["layer.7.up.weight"].T, state["sym.weight"], state["bias"],
               state["layer.5.q.weight"] + np.float32(ATOL / 4)]
    off_one = state["layer.9.q.weight"].copy()
    off_one[2, 3] += 1.0  # differs in one element the probes may not read: the whole comparison decides
    queries.append(off_one)
    for query in queries:
        value = np.asarray(query, np.float64)
        brute = {(k, False) for k, v in state.items() if v.dtype.kind == "f" and _same(value, np.asarray(v, np.float64))}
        brute |= {(k, True) for k, v in state.items() if v.dtype.kind == "f" and value.ndim == 2
                  and (k, False) not in brute and _same(value.T, np.asarray(v, np.float64))}
        near = candidates.near(value)
        assert brute <= set(near)
        assert len({k for k, _ in near}) == len(near)  # each parameter once
    assert candidates.near(np.asarray(state["sym.weight"], np.float64)) == [("sym.weight", False)]
    assert candidates.near(np.asarray(state["layer.7.up.weight"].T, np.float64)) == [("layer.7.up.weight", True)]
    assert candidates.near(np.asarray(state["bias"], np.float64)) == [("bias", False)]
