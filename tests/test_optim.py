"""The numpy optimizers (runtime/optim.py) on tensors that span several of their cache-sized chunks:
the chunked step equals the same step over whole arrays bit for bit, and both equal torch.optim in
float64; a parameter that is not C-contiguous is updated in place too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import optim
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
