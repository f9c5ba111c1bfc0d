"""The PyTorch engine's MatMul + bias fusion (one F.linear per projection): found for every
projection of a BERT stage and of GPT-2's Gemms, never for a product read twice, and the engine's
loss and gradients equal the same engine without it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ir.graph import Node

from planner.onnx_import import load_model
from runtime.engines import pytorch as torch_engine
from runtime.engines.pytorch import TorchStageEngine, _bias_fusions
from runtime.engines.stage import stage_spec
from support import assert_grads_close, token_feeds

B, S = 2, 12


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


def test_every_projection_with_a_bias_is_fused(graph):
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    engine = TorchStageEngine(spec)
    fused = {f.matmul.name for f in engine._linear.values()}
    encoders = [b for b in graph.blocks if b.kind == "encoder"]
    # q, k, v, output, intermediate, output dense per layer, and the classifier
    assert len(fused) == 6 * len(encoders) + 1
    products = {graph.node(n).outputs[0] for n in fused}
    readers = [i for n in spec.compute_nodes for i in n.inputs if i in products]
    assert sorted(readers) == sorted(products)  # each product is read once, by its bias Add


def test_a_product_read_twice_is_not_fused(graph):
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    fusions = _bias_fusions(spec, set(spec.params))
    mm = next(f.matmul for f in fusions.values())
    product = mm.outputs[0]
    # a second reader of the product: the fusion would lose it
    extra = Node("extra_reader", "Relu", (product,), ("extra_out",))
    twice = replace(spec, compute_nodes=tuple(spec.compute_nodes) + (extra,))
    assert mm.name not in _bias_fusions(twice, set(spec.params))


def test_the_fused_engine_equals_the_unfused_one(graph, monkeypatch):
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = token_feeds(B, S, vocab=500)
    fused = TorchStageEngine(spec)
    monkeypatch.setattr(torch_engine, "_bias_fusions", lambda *_: {})
    plain = TorchStageEngine(spec)
    assert fused._linear and not plain._linear
    losses, grads = [], []
    for engine in (fused, plain):
        losses.append(float(np.asarray(engine.forward(feeds, 0)).reshape(-1)[0]))
        grads.append(engine.backward(0).params)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert_grads_close(grads[0], grads[1], rtol=1e-5)
