"""Lowering: both exporters and several opsets give the same blocks and ONNX Runtime's outputs."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from support import token_feeds
from planner.onnx_import import ImportError_, load_model
from planner.passes import find_blocks
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec

B, S = 2, 12


def _forward_logits(graph, feeds):
    engine = TorchStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    return engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)


@pytest.mark.parametrize("variant", ["torchscript-14", "torchscript-17", "dynamo-18", "dynamo-20"])
def test_every_exporter_lowers_to_the_same_blocks_and_matches_onnxruntime(tiny_onnx, variant):
    path = tiny_onnx[variant]
    source_ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert ("Gelu" in source_ops) == (variant == "dynamo-20")
    assert ("LayerNormalization" in source_ops) == (variant != "torchscript-14")
    graph = load_model(path, B, S)
    assert [b.kind for b in graph.blocks] == ["embeddings", "encoder", "encoder", "head", "loss"]
    assert [(b.heads, b.head_size) for b in graph.blocks if b.kind == "encoder"] == [(4, 16), (4, 16)]
    ops = {n.op for n in graph.nodes if n.tier == "compute"}
    # decomposed LayerNorm (opset 14) and erf-GELU are fused whatever the exporter emitted
    assert {"LayerNorm", "Gelu"} <= ops and "Erf" not in ops and "ReduceMean" not in ops
    assert sum(1 for n in graph.nodes if n.op == "LayerNorm") == 5
    feeds = token_feeds(B, S, vocab=500)
    ref = ort.InferenceSession(str(path)).run(None, {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")})[0]
    np.testing.assert_allclose(_forward_logits(graph, feeds), ref, atol=1e-5)


def test_block_sizes_add_up(tiny_onnx):
    graph = load_model(tiny_onnx["torchscript-17"], B, S)
    assert sum(b.params_bytes for b in graph.blocks) == graph.param_bytes()
    layer = graph.blocks[1]
    hidden, inter = 64, 128
    expected_params = 4 * (hidden * hidden + hidden) + 2 * hidden * inter + inter + hidden + 4 * hidden
    assert layer.params_bytes == 4 * expected_params
    assert layer.activation_bytes == B * S * hidden * 4
    # Q, K, V, output projections + two FFN matmuls + the two attention batched matmuls
    matmul_flops = 2 * B * S * (4 * hidden * hidden + 2 * hidden * inter) + 2 * 2 * B * S * S * hidden
    assert matmul_flops <= layer.flops < matmul_flops * 1.1


def test_the_same_file_lowers_at_other_batch_and_sequence_sizes(tiny_onnx):
    for b, s in ((1, 5), (3, 20)):
        graph = load_model(tiny_onnx["dynamo-18"], b, s)
        assert graph.values[graph.blocks[0].output].shape == (b, s, 64)
        feeds = token_feeds(b, s, vocab=500)
        ref = ort.InferenceSession(str(tiny_onnx["dynamo-18"])).run(
            None, {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")})[0]
        np.testing.assert_allclose(_forward_logits(graph, feeds), ref, atol=1e-5)


def test_unsupported_operator_is_named(tiny_onnx, tmp_path):
    model = onnx.load(str(tiny_onnx["torchscript-17"]))
    victim = next(n for n in model.graph.node if n.op_type == "Erf")
    victim.op_type = "Sin"
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    with pytest.raises(ImportError_) as err:
        load_model(bad, B, S)
    assert str(err.value) == (
        f"{bad}: node {victim.name!r} (op Sin): not in Confidant's op set (compute tier); re-export the model "
        "with `confidant export` (opset 14-18, eval mode), or add the op to ir/ops.py with its MNN and PyTorch lowering"
    )


def test_malformed_file_and_unsupported_opset_are_refused(tiny_onnx, tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07not a protobuf at all" * 10)
    with pytest.raises(ImportError_, match=r"garbage.onnx: not a readable ONNX model"):
        load_model(garbage)
    with pytest.raises(FileNotFoundError, match="missing.onnx: no such ONNX file"):
        load_model(tmp_path / "missing.onnx")
    model = onnx.load(str(tiny_onnx["torchscript-17"]))
    model.opset_import[0].version = 9
    old = tmp_path / "old.onnx"
    onnx.save(model, str(old))
    with pytest.raises(ImportError_, match=r"ONNX opset 9 is not supported \(supported: 14-20\)"):
        load_model(old)


def test_block_finder_refuses_a_graph_without_layer_boundaries(tiny_onnx):
    graph = load_model(tiny_onnx["torchscript-17"], B, S)
    nodes = tuple(n for n in graph.nodes)
    renamed = tuple(n if n.op != "LayerNorm" else type(n)(n.name, "Add", n.inputs[:2], n.outputs, {}, n.tier)
                    for n in nodes)
    stripped = type(graph)(graph.name, graph.inputs, graph.outputs, renamed, graph.values, graph.constants,
                           graph.params)
    with pytest.raises(ValueError, match="no LayerNorm on the path to the output"):
        find_blocks(stripped)
