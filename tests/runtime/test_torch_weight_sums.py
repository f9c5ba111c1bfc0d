"""A whole backward summed into the running sums (every whole backward on PyTorch, `_backward_summed`) adds each
product's weight gradient straight into the weight's sum once there is one (`runtime.engines.pytorch._WeightSums`:
one GEMM with beta 1), and a GELU read by one product alone is differentiated inside that product, its gradient
written over the product's input gradient (`_GeluLinear`): no weight-gradient array beside the sum, no second
[rows, 4 x hidden] array in the GELU's backward (MiniLM zb-h1:torch stage 0, helper h149,
benchmarks/MEMORY_NOTES.md). The sums are the plain backward's (float64), and no product's weight gets a gradient
from autograd once its sum is there."""
from __future__ import annotations

import numpy as np
import pytest

from planner.onnx_import import load_model
from runtime.engines.base import RowGradient, accumulate
from runtime.engines.stage import stage_spec
from support import ROWS, S, export_onnx, token_feeds


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.mark.parametrize("first", [0, 1])
def test_a_summed_backward_adds_into_the_sums_and_equals_the_plain_backward(graph, first):
    """Three micro-batches of a stage (the embeddings' and a middle one), float64: the summed whole backward
    (`backward_into`) against `backward` then `accumulate` (autograd's own GELU and
    products). From the second micro-batch on, autograd gets no gradient for any 2-D weight (each went into its
    sum); on the code before it every one did."""
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, first, first + len(graph.blocks) // 2 - 1)
    assert any(n.op == "Gelu" for n in spec.compute_nodes)
    sums, handed = {}, {}
    for summed in (False, True):
        engine = TorchStageEngine(spec, dtype=torch.float64)
        engine.row_gradients = True
        if not summed:  # the reference: autograd's own GELU backward (`_GeluLinear` nowhere)
            engine._gelu_read_once = set()
        into, seen = {}, []
        for m in range(3):
            feeds = token_feeds(ROWS, S, vocab=500, seed=m)
            if spec.activation_input:
                shape = graph.values[spec.activation_input].shape
                feeds[spec.activation_input] = np.random.default_rng(10 + m).normal(size=shape)
            out = engine.forward(feeds, m)
            grad = None if spec.is_last else np.random.default_rng(m).normal(size=out.shape)
            weights = {k: t for k, t in engine._params.items() if t.dim() == 2 and k in engine._saved[m][2]}
            got: set[str] = set()

            def watch(name):
                def look(t):
                    if t.grad is not None:
                        got.add(name)
                return look

            # registered before the engine's own hooks (set inside the backward), so they see the gradient first
            hooks = [t.register_post_accumulate_grad_hook(watch(k)) for k, t in weights.items()]
            try:
                if summed:
                    engine.backward_into(m, into, grad)
                else:
                    accumulate(into, engine.backward(m, grad).params)
            finally:
                for h in hooks:
                    h.remove()
            seen.append((set(weights), got))
        sums[summed] = {k: v.dense() if isinstance(v, RowGradient) else v for k, v in into.items()}
        handed[summed] = seen
    assert sums[False].keys() == sums[True].keys()
    for k, want in sums[False].items():
        np.testing.assert_allclose(sums[True][k], want, rtol=1e-12, atol=1e-14, err_msg=k)
    products = {n.inputs[1] for n in spec.compute_nodes if n.op == "MatMul"} & handed[True][0][0]
    assert len(products) >= 6 and handed[True][0][1] >= products  # the first micro-batch's gradients start the sums
    for m in (1, 2):
        got = handed[True][m][1]
        assert not got & products, f"micro-batch {m}: autograd handed {sorted(got & products)[:3]}"
