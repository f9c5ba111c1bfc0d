"""Encoders beyond the BERT family of tests/models/test_families.py, through `confidant export --checkpoint`
(token classification, eager attention): ModernBERT (pre-norm layers after a normed embedding, the
first layer without a norm of its own, rotary embeddings, a gated GELU, a sliding-window mask built
with Abs), MPNet (a relative-position bias computed once from a learned table and added to every
layer's scores), RoFormer (rotary tables gathered from a sinusoidal table stored as a weight, read by
every layer), DeBERTa-v2 (without relative attention: see the README) and Megatron-BERT (pre-norm).
A value computed from weights alone and read by several layers is computed again in each, so each
layer stays a block and the table is read by each, as a tied weight.

Each tiny model has scrambled weights: one block per layer, logits on MNN and PyTorch equal to ONNX
Runtime's and transformers', every weight's gradient equal to transformers' own model in float64
(ModernBERT's in float32: transformers' ModernBERT gives NaN in float64)."""
from __future__ import annotations

import copy
import os

import numpy as np
import onnxruntime as ort
import pytest
import torch

from jobs.export.encoder import ExportOptions, export_checkpoint, model_inputs, read_hf_sidecar
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from support import Lazy, assert_grads_close, family_feeds, scramble_weights, stage_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, S, VOCAB, LABELS, LAYERS = 2, 10, 120, 3, 3
FAMILIES = ("modernbert", "mpnet", "roformer", "deberta-v2", "megatron-bert")


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, num_labels=LABELS)
    if family == "modernbert":  # local attention every other layer, a window of 4 tokens
        return tf.ModernBertConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                   global_attn_every_n_layers=2, local_attention=4, **common)
    return {"deberta-v2": tf.DebertaV2Config, "megatron-bert": tf.MegatronBertConfig, "mpnet": tf.MPNetConfig,
            "roformer": tf.RoFormerConfig}[family](**common)


def _model(family: str):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(_config(family), attn_implementation="eager")
    return scramble_weights(model, unit_scale=lambda name: "norm" in name.lower() and name.endswith("weight")).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")

    def make(family):
        model = _model(family)
        model.save_pretrained(root / family / "checkpoint")
        path = export_checkpoint(root / family / "checkpoint", root / family / "model.onnx",
                                 ExportOptions(num_labels=LABELS, opset=17, attention="eager"))
        return model, path, load_model(path, B, S)

    return Lazy(make)


def _feeds(model) -> dict[str, np.ndarray]:
    return family_feeds(model_inputs(model), B, S, VOCAB, LABELS, pad_id=model.config.pad_token_id or 0)



@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_block_per_layer_and_logits_equal_onnxruntime_and_transformers(exported, family, engine):
    model, path, graph = exported[family]
    layers = [b for b in graph.blocks if b.kind in ("encoder", "decoder")]
    assert [b.name for b in layers] == [f"layer.{i}" for i in range(LAYERS)]
    assert graph.blocks[0].kind == "embeddings" and [b.kind for b in graph.blocks[-2:]] == ["head", "loss"]
    feeds = _feeds(model)
    logits = stage_engine(engine, stage_spec(graph, 0, len(graph.blocks) - 1)).forward(
        feeds, train=False, until_block=len(graph.blocks) - 2)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    with torch.no_grad():
        hf = model(**{k: torch.tensor(feeds[k]) for k in model_inputs(model)}).logits.numpy()
    assert float(np.abs(logits - ref).max()) <= 1e-4
    assert float(np.abs(logits - hf).max()) <= 1e-4


@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_gradient_equals_transformers_in_float64(exported, family, engine):
    model, _, graph = exported[family]
    feeds = _feeds(model)
    run = stage_engine(engine, stage_spec(graph, 0, len(graph.blocks) - 1))
    run.forward(feeds, 0)
    got = run.backward(0).params
    names = read_hf_sidecar(exported[family][1])["weights"]  # IR weight -> the state dict's key, transposed?
    assert set(names) == set(graph.params)
    # transformers' ModernBERT gives NaN logits in float64 (its masks are built for float32): float32 there
    model64 = copy.deepcopy(model) if family == "modernbert" else copy.deepcopy(model).double()
    logits = model64(**{k: torch.tensor(feeds[k]) for k in model_inputs(model)}).logits
    (-(torch.from_numpy(feeds["targets"]).to(logits.dtype) * torch.log_softmax(logits, -1)).sum()).backward()
    params = dict(model64.named_parameters())
    want = {ir: (params[n["key"]].grad.numpy().T if n["transposed"] else params[n["key"]].grad.numpy())
            for ir, n in names.items() if params[n["key"]].requires_grad}
    # RoFormer's sinusoidal table is a weight transformers keeps frozen (requires_grad=False), which
    # an ONNX file cannot say: it trains here (README), the one weight beyond transformers' own
    frozen = {ir for ir, n in names.items() if not params[n["key"]].requires_grad}
    assert frozen == ({p for p in graph.params if "embed_positions" in p} if family == "roformer" else set())
    assert all(np.abs(got[p]).max() > 0 for p in frozen)
    assert_grads_close({k: v for k, v in got.items() if k not in frozen}, want)


@pytest.mark.parametrize("family", ["mpnet", "roformer"])
def test_a_table_every_layer_reads_is_read_in_each_layer(exported, family):
    """MPNet's bias table and RoFormer's sinusoidal table: a lookup per layer that reads it (a copy of
    the first, named NAME@layer.i), so no block reads another block's value but its input."""
    _, _, graph = exported[family]
    table = next(p for p in graph.params if ("relative_attention_bias" if family == "mpnet" else "embed_positions") in p)
    readers = [b.name for b in graph.blocks if table in b.params]
    assert readers == [f"layer.{i}" for i in range(LAYERS)]
    copies = [n.name for n in graph.nodes if "@layer." in n.name]
    assert copies and all(n.split("@")[1] in readers for n in copies)


def test_mpnet_across_a_cut_sums_its_bias_tables_gradients_and_equals_one_device(exported):
    """The real pipeline (coordinator and workers over the in-process transport), cut between layer.0
    and layer.1: the relative-position bias table is on both stages, its gradients are summed before
    each update (as a tied weight's), and three SGD steps equal one device's."""
    from ir.graph import tied_parameters
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from runtime.optim import make_optimizer
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    model, _, graph = exported["mpnet"]
    feeds = _feeds(model)
    single = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    opt, params, single_losses = make_optimizer("sgd", 0.1), single.parameters(), []
    for _ in range(3):
        single_losses.append(float(single.forward(feeds, 0)))
        params = opt.step(params, single.backward(0).params)
        single.set_parameters(params)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=1, optimizer="sgd", lr=0.1, timeout_s=60)
    with InProcessWorkers(2, timeout_s=60) as workers:
        result = train_pipeline(graph, None, 0, workers.addresses, config, 3, cuts=[2], transport=workers.coordinator,
                                feeds_of_step=lambda k: [feeds], faults=FaultPolicy(on_failure="stop"))
    assert workers.codes == [0, 0], workers.errors
    table = next(p for p in graph.params if "relative_attention_bias" in p)
    assert tied_parameters(graph, result.ranges) == {table: (0, 1)}
    np.testing.assert_allclose(result.losses, single_losses, rtol=1e-5)
    for p in graph.params:
        np.testing.assert_allclose(result.weights[p], params[p], rtol=1e-4, atol=1e-6, err_msg=p)
    copies = [c[f"param/{table}"] for c in result.checkpoint]
    assert np.array_equal(copies[0], copies[1])
