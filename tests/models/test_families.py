"""The BERT family (RoBERTa, DistilBERT, ELECTRA, ALBERT, XLM-RoBERTa, and BERT) through
`confidant export --checkpoint`: forward equal to ONNX Runtime, every weight's gradient equal to the
transformers model's own in float64, and ALBERT's one shared layer trained alike on one device and
across a pipeline cut through its layers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from support import FAMILIES, assert_grads_close, TINY, family_feeds, tiny_model
from ir.graph import tied_parameters
from jobs.export.encoder import ExportOptions, export_checkpoint, model_inputs, read_hf_sidecar
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer

ROOT = Path(__file__).resolve().parents[2]
B, S, LABELS = 2, 10, 3


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    """(family, the transformers model, its exported ONNX file, the sidecar): a scrambled tiny
    model saved as a checkpoint folder and exported as `confidant export --checkpoint` does."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = tiny_model(family, layers=3 if family == "albert" else 2, num_labels=LABELS, scramble=True)
    model.save_pretrained(root / "checkpoint")
    onnx_path = export_checkpoint(root / "checkpoint", root / "model.onnx",
                                  ExportOptions(num_labels=LABELS, opset=17, attention="sdpa"))
    return family, model, onnx_path, read_hf_sidecar(onnx_path)


def _feeds(model):
    return family_feeds(model_inputs(model), B, S, TINY["vocab"], LABELS, pad_id=model.config.pad_token_id or 0)


def test_forward_equals_onnxruntime(exported):
    family, model, path, sidecar = exported
    graph = load_model(path, B, S)
    layers = 3 if family == "albert" else 2
    assert [b.kind for b in graph.blocks] == ["embeddings"] + ["encoder"] * layers + ["head", "loss"]
    assert {(b.heads, b.head_size) for b in graph.blocks if b.kind == "encoder"} == {(4, 8)}
    feeds = _feeds(model)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(model_inputs(model)) == sidecar["inputs"]
    ref = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    logits = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    assert float(np.abs(logits - ref).max()) <= 1e-4
    with torch.no_grad():
        hf = model(**{k: torch.tensor(feeds[k]) for k in model_inputs(model)}).logits.numpy()
    assert float(np.abs(logits - hf).max()) <= 1e-4


def _hf_gradients(model, feeds, names):
    """d loss / d parameter of the transformers model itself in float64, by IR weight name."""
    model64 = tiny_model_like(model).double()
    inputs = {k: torch.tensor(feeds[k]) for k in model_inputs(model)}
    logits = model64(**inputs).logits
    loss = -(torch.tensor(feeds["targets"], dtype=torch.float64) * torch.log_softmax(logits, -1)).sum()
    params = dict(model64.named_parameters())
    keys = sorted({n["key"] for n in names.values()})
    grads = dict(zip(keys, torch.autograd.grad(loss, [params[k] for k in keys])))
    out = {}
    for ir_name, n in names.items():
        g = grads[n["key"]].numpy()
        out[ir_name] = g.T if n["transposed"] else g
    return float(loss.detach()), out


def tiny_model_like(model):
    import copy

    return copy.deepcopy(model).eval()


def test_every_gradient_equals_pytorch_float64(exported):
    family, model, path, sidecar = exported
    graph = load_model(path, B, S)
    names = sidecar["weights"]
    assert set(names) == set(graph.params)  # every weight is placed in the transformers model
    feeds = _feeds(model)
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    loss = float(engine.forward(feeds, 0))
    got = engine.backward(0).params
    ref_loss, ref = _hf_gradients(model, feeds, names)
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    assert_grads_close(got, ref)
    if family == "albert":  # one tensor per shared weight, read by all three layers
        shared = [p for p in graph.params if sum(p in b.params for b in graph.blocks) == 3]
        assert len(shared) == 16


@pytest.mark.slow  # the command line on every family
def test_confidant_export_takes_a_family_checkpoint(tmp_path):
    model = tiny_model("roberta", num_labels=LABELS, scramble=True)
    model.save_pretrained(tmp_path / "roberta")
    out = tmp_path / "roberta.onnx"
    proc = subprocess.run([sys.executable, "-m", "confidant", "export", "--checkpoint", str(tmp_path / "roberta"),
                           "--num-labels", str(LABELS), "-o", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    graph = load_model(out, B, S)
    assert [b.kind for b in graph.blocks].count("encoder") == 2
    assert "token_type_ids" not in graph.input_names()  # RoBERTa has one token type
    assert read_hf_sidecar(out)["architecture"] == "RobertaForTokenClassification"


def test_a_checkpoints_head_of_another_size_or_task_is_replaced_by_a_seeded_one(tmp_path):
    """A tagger's 3-label head is kept at --num-labels 3, replaced by a new seeded head at 5 or as a
    sequence classifier (before: transformers' size-mismatch traceback); the encoder is kept."""
    from jobs.export.encoder import load_classifier

    model = tiny_model("bert", num_labels=3, scramble=True)
    model.save_pretrained(tmp_path / "bert")
    same = load_classifier(tmp_path / "bert", num_labels=3)
    assert torch.equal(same.classifier.weight, model.classifier.weight)
    for task in ("token-classification", "seq-cls"):
        other = load_classifier(tmp_path / "bert", task, num_labels=5)
        assert other.classifier.weight.shape == (5, model.config.hidden_size)
        assert torch.equal(other.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)
        again = load_classifier(tmp_path / "bert", task, num_labels=5)
        assert torch.equal(again.classifier.weight, other.classifier.weight)  # seeded


# --- ALBERT: a shared layer across a pipeline cut --------------------------------------------------

def _albert_graph(tmp_path):
    model = tiny_model("albert", layers=3, num_labels=LABELS, scramble=True)
    model.save_pretrained(tmp_path / "albert")
    path = export_checkpoint(tmp_path / "albert", tmp_path / "albert.onnx",
                             ExportOptions(num_labels=LABELS, opset=17, attention="sdpa"))
    return model, load_model(path, B, S)


def _step_single(engine, feeds, opt, params):
    loss = float(engine.forward(feeds, 0))
    grads = engine.backward(0).params
    params = opt.step(params, grads)
    engine.set_parameters(params)
    return loss, params


def _step_cut(stages, feeds, opts, params, tied, sum_tied: bool):
    """One step of two stages run by hand as a flush pipeline does (forward 0, forward 1, backward 1,
    backward 0), then each stage's update; tied gradients summed across stages first when asked."""
    first, second = stages
    x = first.forward(feeds, 0)
    loss = float(second.forward({**feeds, first.spec.output: x}, 0))
    g1 = second.backward(0)
    g0 = first.backward(0, g1.activation_input)
    grads = [dict(g0.params), dict(g1.params)]
    if sum_tied:
        for p, holders in tied.items():
            total = sum(grads[h][p] for h in holders)
            for h in holders:
                grads[h][p] = total
    for k, (engine, opt) in enumerate(zip(stages, opts)):
        params[k] = opt.step(params[k], grads[k])
        engine.set_parameters(params[k])
    return loss, params


def test_albert_trains_the_same_on_one_device_and_across_a_cut_through_its_shared_layer(tmp_path):
    model, graph = _albert_graph(tmp_path)
    feeds = _feeds(model)
    n = len(graph.blocks)  # embeddings, layer.0-2, head, loss
    ranges = [(0, 2), (3, n - 1)]  # the cut falls between layer.1 and layer.2
    tied = tied_parameters(graph, ranges)
    assert len(tied) == 16 and set(tied.values()) == {(0, 1)}  # every shared weight is on both stages
    single = MnnStageEngine(stage_spec(graph, 0, n - 1))
    # SGD: an update proportional to the gradient, so float32 summation order cannot be amplified the
    # way Adam amplifies a gradient that is zero up to rounding (the key bias's)
    opt = make_optimizer("sgd", 0.1)
    params = single.parameters()
    results = {}
    for sum_tied in (True, False):
        stages = [MnnStageEngine(stage_spec(graph, a, b)) for a, b in ranges]
        opts = [make_optimizer("sgd", 0.1) for _ in stages]
        per_stage = [s.parameters() for s in stages]
        losses = [_step_cut(stages, feeds, opts, per_stage, tied, sum_tied)[0] for _ in range(3)]
        results[sum_tied] = (losses, per_stage)
    single_losses = []
    for _ in range(3):
        loss, params = _step_single(single, feeds, opt, params)
        single_losses.append(loss)
    losses, per_stage = results[True]
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    for p in graph.params:
        holders = [k for k, (a, b) in enumerate(ranges) if any(p in blk.params for blk in graph.blocks[a:b + 1])]
        for k in holders:
            np.testing.assert_allclose(per_stage[k][p], params[p], rtol=1e-4, atol=1e-6)
    for p, holders in tied.items():
        np.testing.assert_array_equal(per_stage[holders[0]][p], per_stage[holders[1]][p])  # the copies stay equal
    # without the sum the copies drift apart: the rule is what keeps them equal
    unsummed = results[False][1]
    assert any(not np.array_equal(unsummed[0][p], unsummed[1][p]) for p in tied)


@pytest.mark.parametrize("cuts", [[3], [2, 3]])
def test_albert_pipeline_sums_its_shared_layer_through_the_coordinator(tmp_path, cuts):
    """The real pipeline (Coordinator and Workers over the in-process transport): a cut through the
    shared layer puts its weights on 2 or 3 stages, the coordinator sums their gradients before each
    update, and the run equals one device (SGD, as above)."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    model, graph = _albert_graph(tmp_path)
    feeds = _feeds(model)
    n = len(graph.blocks)
    single = MnnStageEngine(stage_spec(graph, 0, n - 1))
    opt, params, single_losses = make_optimizer("sgd", 0.1), single.parameters(), []
    for _ in range(3):
        loss, params = _step_single(single, feeds, opt, params)
        single_losses.append(loss)
    stages = len(cuts) + 1
    config = PipelineConfig(schedule="1f1b-flush", microbatches=1, optimizer="sgd", lr=0.1, timeout_s=60)
    with InProcessWorkers(stages, timeout_s=60) as workers:
        result = train_pipeline(graph, None, 0, workers.addresses, config, 3, cuts=cuts, transport=workers.coordinator,
                                feeds_of_step=lambda k: [feeds], faults=FaultPolicy(on_failure="stop"))
    assert workers.codes == [0] * stages, workers.errors
    tied = tied_parameters(graph, result.ranges)
    assert len(tied) == 16 and set(tied.values()) == {tuple(range(stages))}
    np.testing.assert_allclose(result.losses, single_losses, rtol=1e-5)
    for p in graph.params:
        np.testing.assert_allclose(result.weights[p], params[p], rtol=1e-4, atol=1e-6, err_msg=p)
    for p in tied:
        copies = [c[f"param/{p}"] for c in result.checkpoint]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), p
