"""Lowering: both exporters and several opsets give the same blocks and ONNX Runtime's outputs."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from support import token_feeds
from planner.onnx_import import ImportError_, load_model
from planner.passes import find_blocks
from runtime.engines.mnn import MnnStageEngine
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
        "with `confidant export` (opset 14-20, eval mode), or add the op to ir/ops.py with its MNN and PyTorch lowering"
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
    with pytest.raises(ImportError_, match=r"ONNX opset 9 is not supported \(supported: 14-22\)"):
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


def test_sdpa_attention_lowers_like_eager_and_padding_rows_get_eager_weights(tiny_onnx):
    """The SDPA export guards its softmax as Where(IsNaN(p), 0, p), which only acts on a row whose
    every key is masked: ONNX Runtime gives it zero attention, the lowering gives it eager
    attention's uniform weights (planner/onnx_import.py). Every other row equals ONNX Runtime."""
    sdpa, eager = tiny_onnx["torchscript-17-sdpa"], tiny_onnx["torchscript-17"]
    assert "IsNaN" in {n.op_type for n in onnx.load(str(sdpa)).graph.node}
    feeds = token_feeds(B, S, vocab=500)
    feeds["attention_mask"][0] = 0  # row 0 is all padding
    graph = load_model(sdpa, B, S)
    assert [(b.heads, b.head_size) for b in graph.blocks if b.kind == "encoder"] == [(4, 16), (4, 16)]
    ours = _forward_logits(graph, feeds)
    inputs = {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    ort_sdpa = ort.InferenceSession(str(sdpa)).run(None, inputs)[0]
    ort_eager = ort.InferenceSession(str(eager)).run(None, inputs)[0]
    np.testing.assert_allclose(ours[1:], ort_sdpa[1:], atol=1e-5)
    np.testing.assert_allclose(ours, ort_eager, atol=1e-5)
    assert np.abs(ort_sdpa[0] - ort_eager[0]).max() > 1e-3  # the guard did act on the padding row
    assert np.isfinite(float(MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1)).forward(feeds, train=False)))


@pytest.fixture(scope="module")
def deep_onnx(tmp_path_factory):
    """A 48-layer tiny BERT through TorchScript opset 14 (LayerNorm decomposed, so the fusion passes
    rewrite 97 LayerNorms): lowering must stay linear in depth (issue 14)."""
    import torch
    from transformers import BertConfig, BertModel

    from support import export_onnx

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("deep") / "deep-bert"
    BertModel(BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=48, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32)).save_pretrained(folder)
    return export_onnx(folder, folder.parent / "deep48.onnx", opset=14, sidecar=False)


def test_a_48_layer_model_lowers_to_48_encoder_blocks(deep_onnx):
    graph = load_model(deep_onnx, 2, 8)
    assert [b.kind for b in graph.blocks] == ["embeddings"] + ["encoder"] * 48 + ["head", "loss"]
    assert [b.name for b in graph.blocks[1:-2]] == [f"layer.{i}" for i in range(48)]
    assert {(b.heads, b.head_size) for b in graph.blocks[1:-2]} == {(2, 8)}
    assert all(b.attention is not None for b in graph.blocks[1:-2])
    assert sum(1 for n in graph.nodes if n.op == "LayerNorm") == 97
    assert len({b.params_bytes for b in graph.blocks[1:-2]}) == 1
    assert sum(b.params_bytes for b in graph.blocks) == graph.param_bytes()
    for prev, nxt in zip(graph.blocks, graph.blocks[1:]):
        assert nxt.inputs[0] == prev.output


def test_masked_fill_on_the_compute_path_lowers_exactly(tmp_path):
    """Where(c, fill, x) with a host condition on an activation (masked_fill, as some attention code
    writes the mask) becomes x * float(not c) + where(c, fill, 0): ONNX Runtime's values, and the
    gradient through x equals float64 PyTorch's."""
    from pathlib import Path

    from onnx import helper, numpy_helper

    src = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "bert-ts16-eager.onnx"
    model = onnx.load(str(src))
    nodes = list(model.graph.node)
    softmax = next(n for n in nodes if n.op_type == "Softmax")
    add = next(n for n in nodes if softmax.input[0] in n.output)
    scores, mask = add.input  # scores + additive mask (0 or float32's lowest)
    lowest = numpy_helper.from_array(np.asarray(np.finfo(np.float32).min, np.float32), "fill_value")
    minus_one = numpy_helper.from_array(np.asarray(-1.0, np.float32), "minus_one")
    model.graph.initializer.extend([lowest, minus_one])
    cond = helper.make_node("Less", [mask, "minus_one"], ["masked_positions"], name="masked_fill/cond")
    fill = helper.make_node("Where", ["masked_positions", "fill_value", scores], [add.output[0]], name="masked_fill")
    at = nodes.index(add)
    model.graph.node.remove(add)
    model.graph.node.insert(at, fill)
    model.graph.node.insert(at, cond)
    path = tmp_path / "masked-fill.onnx"
    onnx.save(model, str(path))

    graph = load_model(path, B, S)
    assert any(n.name.startswith("masked_fill/") and n.tier == "compute" for n in graph.nodes)
    feeds = token_feeds(B, S, vocab=120, num_labels=3)
    ref = ort.InferenceSession(str(path)).run(None, {k: feeds[k] for k in ("input_ids", "attention_mask",
                                                                            "token_type_ids")})[0]
    np.testing.assert_allclose(_forward_logits(graph, feeds), ref, atol=1e-5)
    spec = stage_spec(graph, 1, 1)
    rng = np.random.default_rng(0)
    feeds[spec.activation_input] = rng.standard_normal(graph.values[spec.activation_input].shape).astype(np.float32)
    import torch

    mnn, ref64 = MnnStageEngine(spec), TorchStageEngine(spec, dtype=torch.float64)
    mnn.forward(feeds, 0), ref64.forward(feeds, 0)
    seed = rng.standard_normal(graph.values[spec.output].shape).astype(np.float32)
    got, want = mnn.backward(0, seed), ref64.backward(0, seed)
    scale = np.abs(want.activation_input).max()
    assert np.abs(got.activation_input - want.activation_input).max() <= 1e-4 * scale
