"""Models exported as people export them with `torch.onnx.export` (not `confidant export`).

Decoders: the
TorchScript exporter with its constant folding on (its default) writes `x @ W.T` as a MatMul by a new
initializer `W.T` (`onnx::MatMul_N`). For a decoder whose LM head is tied to the token embedding, that
initializer is a second copy of the table: trained on its own, the model would silently be untied
and its gradients no longer transformers'. The importer takes such a copy for the weight it
transposes (`planner.onnx_import.folded_transposes`); the trained weights go back into the file
(`write_weights`) and into ONNX Runtime's generation (`jobs.train.causal_lm.generation_weights`) with the
copy holding the trained table's transpose. A file without `NAME.lm.json` trains with
`train-local --task causal-lm` to the end and keeps its checkpoint.

A `position_ids` input (optimum exports one, and so does a plain export given positions) is bound to
0..S-1 on every row, transformers' default: BERT's position embeddings and Llama's rotary tables
then fold as without it, and ONNX Runtime fed those positions gives the lowered model's logits.

A file saved in half precision (`model.half()` before export) is widened to float32 as it is read:
it lowers, trains and goes back out in its own precision."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from planner.onnx_import import folded_transposes, load_model, with_folded_copies, write_weights
from runtime.engines.stage import stage_spec
from support import (Lazy, assert_grads_close, lm_step_feeds, scrambled_causal_lm, stage_engine,
                     transformers_lm_gradients)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, S, VOCAB = 2, 12, 256


def _config(family: str, vocab: int = VOCAB):
    import transformers as tf

    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=family == "llama-tied")


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _plain_export(model, path, vocab: int = VOCAB):
    """`torch.onnx.export` as its documentation shows it: TorchScript, constant folding on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(0))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "logits": {0: "batch", 1: "seq"}}
    with torch.no_grad():  # eval: the exporter restores the wrapper's mode, and with it the model's dropout
        torch.onnx.export(_Logits(model).eval(), (ids, torch.ones_like(ids)), str(path), dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamic_axes=axes)
    return path


def _model(family: str, vocab: int = VOCAB):
    return scrambled_causal_lm(_config(family, vocab))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (the transformers model, its plain ONNX export, the lowered graph)."""
    root = tmp_path_factory.mktemp("plain-decoders")

    def make(family):
        model = _model(family)
        path = _plain_export(model, root / family / "model.onnx")
        return model, path, load_model(path, B, S)

    return Lazy(make)


def _initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _by_value(graph, hf_params: dict[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
    """IR parameter -> (the transformers parameter of equal value, whether it is stored transposed):
    the plain export names its folded weights `onnx::MatMul_N`."""
    out = {}
    for p in graph.params:
        value = graph.constants[p]
        for name, ref in hf_params.items():
            if ref.shape == value.shape and np.array_equal(ref, value):
                out[p] = (name, False)
                break
            if ref.ndim == 2 and ref.T.shape == value.shape and np.array_equal(ref.T, value):
                out[p] = (name, True)
                break
    return out


@pytest.mark.parametrize("family", ["llama-tied", "gpt2"])
def test_the_folded_copy_of_a_tied_table_is_the_table_read_transposed(exported, family):
    model, path, graph = exported[family]
    files = _initializers(path)
    folded = folded_transposes(onnx.load(str(path)).graph, files)
    assert len(folded) == 1  # the LM head's copy of the token table, and nothing else
    (copy_name, table), = folded.items()
    assert copy_name.startswith("onnx::") and np.array_equal(files[copy_name], files[table].T)
    assert copy_name not in graph.params and table in graph.params
    hf = {n: p.detach().numpy() for n, p in model.named_parameters()}
    assert len(graph.params) == len(hf)  # one parameter per transformers parameter: the head is the table


def test_an_untied_head_stays_a_weight_of_its_own(exported):
    model, path, graph = exported["llama-untied"]
    assert folded_transposes(onnx.load(str(path)).graph, _initializers(path)) == {}
    hf = {n: p.detach().numpy() for n, p in model.named_parameters()}
    matched = _by_value(graph, hf)
    assert len(graph.params) == len(hf) and sorted(n for n, _ in matched.values()) == sorted(hf)


@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", ["llama-tied", "gpt2", "llama-untied"])
def test_every_gradient_of_a_plain_export_equals_transformers_in_float64(exported, family, engine):
    model, _, graph = exported[family]
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    run = stage_engine(engine, stage_spec(graph, 0, len(graph.blocks) - 1))
    run.forward(feeds, 0)
    got = run.backward(0).params
    matched = _by_value(graph, {n: p.detach().float().numpy() for n, p in model.named_parameters()})
    grads = transformers_lm_gradients(model, feeds)
    assert set(got) == set(graph.params) and len(matched) == len(graph.params) == len(grads)
    for p, (name, transposed) in matched.items():
        want = grads[name].T if transposed else grads[name]
        assert np.abs(got[p] - want).max() <= 1e-4 * (np.abs(want).max() + 1e-12), (p, name)


def test_trained_weights_go_back_into_the_folded_copy_too(exported, tmp_path):
    """The model out: a changed table reaches the file's head copy as its transpose, and ONNX Runtime
    on the written file gives the engine's logits with the changed weights."""
    _, path, graph = exported["llama-tied"]
    (copy_name, table), = folded_transposes(onnx.load(str(path)).graph, _initializers(path)).items()
    rng = np.random.default_rng(3)
    changed = {p: (graph.constants[p] + rng.normal(0, 0.05, graph.constants[p].shape)).astype(np.float32)
               for p in graph.params}
    out = write_weights(path, tmp_path / "trained.onnx", changed)
    written = _initializers(out)
    assert np.array_equal(written[copy_name], changed[table].T) and np.array_equal(written[table], changed[table])
    assert with_folded_copies(path, changed)[copy_name].tolist() == changed[table].T.tolist()
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    engine = stage_engine("mnn", stage_spec(graph, 0, len(graph.blocks) - 1))
    engine.set_parameters(changed)
    logits = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    inputs = {k: feeds[k] for k in ("input_ids", "attention_mask")}
    ref = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    assert np.abs(logits - ref).max() <= 2e-5 * np.abs(ref).max()


@pytest.mark.slow  # a plain export at SmolLM2's vocabulary, trained and generated from
def test_train_local_causal_lm_on_a_file_without_lm_json_keeps_its_checkpoint(chat_llama, tmp_path):
    """Trained to the end: the evaluation after training generates with the trained weights checked
    against the file's own initializers (no `model.lm.json`), and the checkpoint is written first."""
    from confidant.cli import main

    source, train, dev = chat_llama
    vocab = len(json.loads((source.parent / "tokenizer.json").read_text())["model"]["vocab"])
    folder = tmp_path / "plain"
    _plain_export(_model("llama-tied", vocab), folder / "model.onnx", vocab)
    for name in ("tokenizer.json", "chat_template.json"):
        if (source.parent / name).is_file():
            shutil.copy(source.parent / name, folder / name)
    assert not (folder / "model.lm.json").exists()
    rc = main(["train-local", str(folder / "model.onnx"), "--task", "causal-lm", "--data", str(train),
               "--eval", str(dev), "--eval-limit", "2", "--steps", "2", "--batch", "2", "--seq", "128",
               "--checkpoint", str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "run.json")])
    assert rc == 0 and (tmp_path / "ckpt" / "meta.json").is_file()
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["eval"]["perplexity"] != doc["eval"]["perplexity_before"]  # scored with the trained weights


class _WithPositions(torch.nn.Module):
    def __init__(self, model, **options):
        super().__init__()
        self.model, self.options = model, options

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          **self.options).logits


def _export_with_positions(model, path, vocab: int, **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(0))
    names = ["input_ids", "attention_mask", "position_ids"]
    axes = {n: {0: "batch", 1: "seq"} for n in names + ["logits"]}
    positions = torch.arange(S).expand(B, S)
    with torch.no_grad():
        torch.onnx.export(_WithPositions(model, **options).eval(), (ids, torch.ones_like(ids), positions), str(path),
                          dynamo=False, opset_version=17, input_names=names, output_names=["logits"],
                          dynamic_axes=axes)
    return path


@pytest.mark.parametrize("family", ["bert", "llama-tied"])
def test_a_position_ids_input_is_bound_to_the_positions(family, tmp_path):
    from support import tiny_model

    if family == "bert":
        model, vocab, options = tiny_model("bert", attention="eager"), 120, {}
    else:
        model, vocab, options = _model(family), VOCAB, {"use_cache": False}
    path = _export_with_positions(model, tmp_path / "model.onnx", vocab, **options)
    graph = load_model(path, B, S)
    assert "position_ids" not in {v.name for v in graph.inputs}
    feeds = lm_step_feeds(0, B, S, 1, vocab=vocab)[0]
    inputs = {k: feeds[k] for k in ("input_ids", "attention_mask")}
    if family == "bert":
        inputs["input_ids"] = inputs["input_ids"] % vocab
        targets = next(v for v in graph.inputs if v.name == "targets")
        feeds = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                 "token_type_ids": np.zeros((B, S), np.int64), "targets": np.zeros(targets.shape, np.float32)}
    logits = stage_engine("mnn", stage_spec(graph, 0, len(graph.blocks) - 1)).forward(
        feeds, train=False, until_block=len(graph.blocks) - 2)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = session.run(None, {**inputs, "position_ids": np.broadcast_to(np.arange(S), (B, S)).astype(np.int64)})[0]
    assert np.abs(logits - ref).max() <= 2e-5 * np.abs(ref).max()
    if family != "bert":  # generation's full-sequence logits feed the positions the file asks for
        from tasks.causal_lm.generate import OnnxCausalLM

        got = OnnxCausalLM(path).logits(inputs["input_ids"], inputs["attention_mask"])
        assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()


def _export_classifier(model, path, vocab: int = 120):
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(0))
    names = ["input_ids", "attention_mask"]
    with torch.no_grad():
        torch.onnx.export(model.eval(), (ids, torch.ones_like(ids)), str(path), dynamo=False, opset_version=17,
                          input_names=names, output_names=["logits"],
                          dynamic_axes={n: {0: "batch", 1: "seq"} for n in names + ["logits"]})
    return path


def test_a_half_precision_file_trains_as_its_weights_widened_and_goes_out_in_half(tmp_path):
    """The float16 file lowers to what the float32 export of the same (rounded) weights lowers to:
    equal losses and gradients on both engines, to the half-precision rounding of the file's own
    constants (its attention scale 1/sqrt(8) is 0.35351562, 1e-4 off); export-trained writes
    float16 weights back."""
    from support import tiny_model, token_feeds

    model = tiny_model("bert", attention="eager", scramble=True).half()
    half = _export_classifier(model, tmp_path / "half" / "model.onnx")
    full = _export_classifier(model.float(), tmp_path / "full" / "model.onnx")
    g16, g32 = load_model(half, B, S), load_model(full, B, S)
    assert sorted(g16.params) == sorted(g32.params)
    assert all(g16.constants[p].dtype == np.float32 for p in g16.params)
    feeds = token_feeds(B, S, 120, num_labels=3)
    for engine in ("mnn", "torch"):
        runs = [stage_engine(engine, stage_spec(g, 0, len(g.blocks) - 1)) for g in (g16, g32)]
        losses = [float(np.asarray(r.forward(feeds, 0)).reshape(-1)[0]) for r in runs]
        grads = [r.backward(0).params for r in runs]
        assert losses[0] == pytest.approx(losses[1], rel=1e-4)
        assert_grads_close(grads[0], grads[1], rtol=1e-3)
    out = write_weights(half, tmp_path / "trained.onnx", {p: g16.constants[p] + 1 for p in g16.params})
    written = onnx.load(str(out))
    assert {t.data_type for t in written.graph.initializer if t.name in g16.params} == {onnx.TensorProto.FLOAT16}


@pytest.mark.parametrize("family, opset", [("bert", 21), ("bert", 22), ("llama-tied", 22)])
def test_the_dynamo_exporter_at_opsets_past_20_is_read(family, opset, tmp_path):
    """Opsets 21 and 22 add element types (int4, bfloat16) to ops the lowering reads, nothing else:
    a dynamo export at either lowers to ONNX Runtime's logits."""
    from support import tiny_model

    model = tiny_model("bert", attention="sdpa", scramble=True) if family == "bert" else _model(family)
    model.config.use_cache = False  # the logits only, no key/value cache out
    ids = torch.randint(3, 100, (B, S), generator=torch.Generator().manual_seed(0))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", min=2, max=64)
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (), str(path), kwargs=example, dynamo=True, opset_version=opset,
                      dynamic_shapes={n: {0: batch, 1: seq} for n in example}, output_names=["logits"])
    graph = load_model(path, B, S)
    feeds = {k: v.numpy() for k, v in example.items()}
    full = {**feeds, **{v.name: np.zeros(v.shape, np.float32 if v.dtype == "float32" else np.int64)
                        for v in graph.inputs if v.name not in feeds}}
    logits = stage_engine("mnn", stage_spec(graph, 0, len(graph.blocks) - 1)).forward(
        full, train=False, until_block=len(graph.blocks) - 2)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(logits - ref).max() <= 2e-5 * np.abs(ref).max()


def test_lora_on_a_tied_head_is_refused_and_a_fused_qkv_is_its_own_role(exported):
    """An adapter on a head tied to the token table would adapt the head only, while merged into the
    one weight (or loaded by PEFT, which adapts the lookup) it changes the embedding too: refused.
    GPT-2's fused c_attn answers to q, k, v and to its own role name, qkv."""
    from planner.lora import LoraSettings, add_lora

    llama = exported["llama-tied"][2]
    table = next(n.inputs[0] for n in llama.nodes if n.op == "Gather")
    with pytest.raises(ValueError, match=rf"LoRA target 'embed_tokens' chose '{table}', the LM head tied to the token "
                                         r"embedding table: .* train the head in full \(--train-also head\)"):
        add_lora(llama, LoraSettings(2, targets=("embed_tokens", "up")))
    gpt2 = exported["gpt2"][2]
    for targets in (("qkv",), ("q", "k", "v", "o")):
        _, adapters = add_lora(gpt2, LoraSettings(2, targets=targets))
        assert sum(a.role == "qkv" for a in adapters) == 2  # one fused projection per layer
