"""An int4 frozen weight multiplied in its two widened halves (`mnn_kernels.int4_matmul`, issue 31's
int4 widening cost): the product and the input's gradient equal those by the whole widened weight, in
each orientation (blocked along the contraction or the output; W or its transpose), and the MNN engine
takes that path for a LoRA base held int4."""
from __future__ import annotations

import numpy as np
import pytest

from ir.precision import dequantize, quantize
from runtime.engines import mnn_kernels as K


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("stacked", [True, False])
def test_int4_matmul_equals_the_product_by_the_widened_weight(axis, trans_b, stacked, monkeypatch):
    """`stacked`: blocked along the contraction, the halves stacked and multiplied in one GEMM (a weight up
    to `INT4_STACKED_MAX_ELEMENTS`), else by x's even and odd columns in two (a larger one)."""
    monkeypatch.setattr(K, "INT4_STACKED_MAX_ELEMENTS", 1 << 40 if stacked else 0)
    rng = np.random.default_rng(axis * 2 + trans_b)
    shape = (96, 64) if trans_b else (64, 96)  # W: [K, N] or [N, K], K = 64
    q = quantize(rng.standard_normal(shape).astype(np.float32), "int4", axis=axis)
    assert K.int4_splits(q, trans_b)
    w = dequantize(q)
    x = K.placeholder([2, 5, 64])
    xs = rng.standard_normal((2, 5, 64)).astype(np.float32)
    halves, _ = K.int4_halves_parts(q)
    y = K.int4_matmul(x, halves, q, trans_b)
    K.write(x, xs)
    want = xs @ (w.T if trans_b else w)
    np.testing.assert_allclose(K.read(y), want, rtol=1e-5, atol=1e-5)
    seed = K.placeholder([2, 5, 96])
    dy = rng.standard_normal((2, 5, 96)).astype(np.float32)
    K.write(seed, dy)
    (dx,) = K.gradients([y], [seed], [x])
    np.testing.assert_allclose(dx, dy @ (w if trans_b else w.T), rtol=1e-5, atol=1e-5)


def test_a_padded_int4_weight_is_widened_whole():
    q = quantize(np.ones((40, 8), np.float32), "int4", axis=0)  # 40 rows: blocks of 32 padded to 64
    assert not K.int4_splits(q, False)


def test_the_mnn_engine_multiplies_an_int4_base_in_halves(tiny_onnx):
    from runtime.engines.mnn import HALVES
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from support import tiny_lora_graph

    g = tiny_lora_graph(tiny_onnx["torchscript-17"], "int4")
    engine = make_engine("mnn:cpu:t1", stage_spec(g, 0, len(g.blocks) - 1))
    assert any(k.startswith(HALVES) for k in engine._constant_vars)


def test_the_engine_holds_an_int4_weight_once_and_the_graph_keeps_its_values(tiny_onnx):
    """The halves' constants are held transposed (their scales broadcast faster so): the graph's
    QuantizedTensor becomes a view of them, each field still equal to what it was."""
    from ir.precision import QuantizedTensor
    from runtime.engines.mnn import HALVES
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from support import tiny_lora_graph

    g = tiny_lora_graph(tiny_onnx["torchscript-17"], "int4")
    before = {name: (v.codes.copy(), v.scales.astype(np.float32), v.mins.astype(np.float32))
              for name, v in g.constants.items() if isinstance(v, QuantizedTensor) and v.storage == "int4"}
    engine = make_engine("mnn:cpu:t1", stage_spec(g, 0, len(g.blocks) - 1))
    split = [k[len(HALVES):] for k in engine._constant_vars if k.startswith(HALVES)]
    assert split
    for name in split:
        q = g.constants[name]
        codes, scales, mins = before[name]
        assert not q.codes.flags.owndata and not q.codes.flags.c_contiguous, name  # a view of the held bytes
        np.testing.assert_array_equal(q.codes, codes, err_msg=name)
        np.testing.assert_array_equal(q.scales, scales, err_msg=name)
        np.testing.assert_array_equal(q.mins, mins, err_msg=name)
        np.testing.assert_array_equal(dequantize(q), dequantize(QuantizedTensor(**{
            **{f: getattr(q, f) for f in q.__dataclass_fields__}, "codes": codes})), err_msg=name)
