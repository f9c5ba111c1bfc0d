"""The PyTorch engine saves a projection's input as what makes it, where that is a GELU's or a
LayerNorm's output: the node's own backward saves its input (and a LayerNorm's weights) anyway, so the
projection's backward makes the output again from them (`runtime.engines.pytorch._Remade`) rather than
autograd holding it from the forward to the backward too (MiniLM's stage 0 at 2 x 128 under zb-h1:
18.6 -> 15.6 MiB a micro-batch; helper h144). The gradients are the plain path's, checked in float64
against the same engine with nothing made again."""
from __future__ import annotations

import numpy as np
import pytest

from ir.ops import REMADE_FROM_INPUTS
from planner.onnx_import import load_model
from runtime.engines.stage import stage_spec
from support import ROWS, S, autograd_saved_bytes, token_feeds


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    from support import export_onnx

    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


def _remade_bytes(spec, graph) -> int:
    """float64 bytes of the values a projection reads that a GELU or LayerNorm of the stage makes."""
    compute = {n.name: n for n in spec.compute_nodes}
    made = {o: n for n in compute.values() if n.op in REMADE_FROM_INPUTS for o in n.outputs}
    read = {n.inputs[0] for n in compute.values() if n.op == "MatMul" and n.inputs[0] in made}
    return sum(8 * int(np.prod(graph.values[v].shape)) for v in read)


@pytest.mark.parametrize("split", [False, True], ids=["whole-backward", "zb-split"])
def test_a_projection_of_a_gelu_or_layernorm_output_saves_what_makes_it_with_the_plain_gradients(graph, split):
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    remade_bytes = _remade_bytes(spec, graph)
    assert remade_bytes > 0
    feeds = token_feeds(ROWS, S, vocab=500)
    engines = {}
    for kind in ("plain", "remade"):
        engine = TorchStageEngine(spec, dtype=torch.float64)
        engine.split_backward = split
        if kind == "plain":
            engine._remade_from = {}  # nothing made again: autograd holds every projection's input
        engines[kind] = engine
    saved = {kind: autograd_saved_bytes(e, feeds) for kind, e in engines.items()}
    # the tiny BERT (float64): 329184 -> 218592 bytes, both ways, where the values made again are 110592
    assert saved["remade"] <= saved["plain"] - remade_bytes, saved
    grads = {}
    for kind, e in engines.items():
        if split:
            grads[kind] = {**e.backward_input(0).params, **e.backward_weight(0)}
        else:
            grads[kind] = e.backward(0).params
    assert grads["plain"].keys() == grads["remade"].keys()
    for k, want in grads["plain"].items():
        got = grads["remade"][k]
        got = got.to_dense() if hasattr(got, "to_dense") else got
        want = want.to_dense() if hasattr(want, "to_dense") else want
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14, err_msg=k)
