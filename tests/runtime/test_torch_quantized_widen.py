"""The PyTorch engine's frozen quantized weight widened (`runtime.engines.pytorch._FrozenWeight.widen`:
each int4 nibble cast straight into the one float array, the block scale and offset applied in place;
issue 31 target 6's cost): the same bits as the numpy widening every other reader uses
(`ir.precision.dequantize`), for each storage, orientation and a padded last block, and in float64
the exact q * d + m of the stored codes."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ir.precision import dequantize, quantize  # noqa: E402
from runtime.engines.pytorch import _FrozenWeight  # noqa: E402


def _codes(q) -> np.ndarray:
    """The stored integer codes [rows, padded cols], int4's nibbles unpacked lower first."""
    if q.storage == "int4":
        c = np.empty((q.codes.shape[0], q.codes.shape[1] * 2), np.int64)
        c[:, 0::2], c[:, 1::2] = q.codes & 0x0F, q.codes >> 4
        return c
    return q.codes.astype(np.int64)


@pytest.mark.parametrize("storage", ["int4", "int8", "bfloat16"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(576, 192), (70, 100)])  # (70, 100): a padded last block either way
def test_a_frozen_weight_widens_to_the_bits_numpy_widens_it_to(storage, axis, shape):
    rng = np.random.default_rng(len(storage) * 7 + axis)
    q = quantize((rng.standard_normal(shape) * 0.37).astype(np.float32), storage, axis=axis)
    got = _FrozenWeight(q, torch.float32).widen()
    want = dequantize(q)
    assert tuple(got.shape) == shape and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
    if storage == "bfloat16":
        return
    # float64: q * d (+ m) of the stored codes, each product and sum rounded once to float64
    wide = _FrozenWeight(q, torch.float64).widen().numpy()
    rows = q.codes.shape[0]
    blocks = _codes(q).reshape(rows, -1, q.block).astype(np.float64) * q.scales.astype(np.float64)[:, :, None]
    if q.mins is not None:
        blocks += q.mins.astype(np.float64)[:, :, None]
    stored = blocks.reshape(rows, -1)[:, :q.cols]
    np.testing.assert_array_equal(wide, stored if axis == 1 else stored.T)


def test_each_widening_is_a_fresh_array():
    """The in-place scale and offset must not reach the held codes or a widening handed out before."""
    rng = np.random.default_rng(3)
    q = quantize(rng.standard_normal((64, 96)).astype(np.float32), "int4", axis=0)
    codes = q.codes.copy()
    frozen = _FrozenWeight(q, torch.float32)
    first = frozen.widen().clone()
    again = frozen.widen()
    second = frozen.widen()
    assert not np.shares_memory(again.numpy(), second.numpy())
    np.testing.assert_array_equal(q.codes, codes)
    assert torch.equal(first, second) and torch.equal(again, second)
