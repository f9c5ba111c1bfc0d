"""The fine-tuned model out: `train-local --checkpoint`, `confidant predict` on new text, and
`confidant export-trained` to ONNX (ONNX Runtime gives the training graph's logits) and to a
transformers checkpoint (from_pretrained gives the same logits)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from support import TINY, family_feeds, make_tiny_tokenizer, run_cli, tiny_model
from jobs.export.encoder import ExportOptions, export_model, model_inputs
from jobs.train.local import write_single_device_checkpoint
from jobs.common.trained import open_trained
from jobs.export.trained import export_trained_hf, export_trained_onnx
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec

B, S = 2, 10


def _cli(*args, ok=True):
    proc = run_cli(*args)  # conftest sets HF_HUB_OFFLINE
    if ok:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _trained_checkpoint(root: Path, family: str, task: str, labels=None):
    """A tiny model exported by `confidant export`'s exporter, and a checkpoint of it whose every
    weight moved (as training moves them), written as train-local writes one."""
    model = tiny_model(family, task=task, layers=3 if family == "albert" else 2, num_labels=3, seed=1)
    path = export_model(model, root / f"{family}.onnx", ExportOptions(num_labels=3, task=task, attention="sdpa",
                                                                       labels=tuple(labels or ())))
    graph = load_model(path, B, S)
    rng = np.random.default_rng(0)
    weights = {p: (graph.constants[p] + 0.05 * rng.standard_normal(graph.constants[p].shape)).astype(np.float32)
               for p in graph.params}
    ckpt = write_single_device_checkpoint(root / f"{family}-ckpt", weights, {}, graph, {
        "command": "train-local", "model": path.name, "model_path": str(path.resolve()),
        "task": "seq-cls" if task == "seq-cls" else "ner", "labels": list(labels) if labels else None, "step": 1})
    return model, path, graph, weights, ckpt


CASES = [("bert", "seq-cls"), ("albert", "token-classification"), ("roberta", "seq-cls"),
         ("distilbert", "token-classification"), ("electra", "seq-cls"), ("xlm-roberta", "token-classification")]


@pytest.mark.parametrize("family, task", CASES)
def test_export_trained_round_trips_through_onnxruntime_and_transformers(tmp_path, family, task):
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    model, path, graph, weights, ckpt = _trained_checkpoint(tmp_path, family, task)
    feeds = family_feeds(model_inputs(model), B, S, TINY["vocab"], 3, task=task, pad_id=model.config.pad_token_id or 0)
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    ours = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)

    onnx_out = export_trained_onnx(ckpt, tmp_path / "trained.onnx")
    session = ort.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"])
    via_ort = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    assert float(np.abs(via_ort - ours).max()) <= 1e-4
    untrained = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    assert float(np.abs(untrained - ours).max()) > 1e-3  # the trained weights really went in

    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    folder = export_trained_hf(ckpt, tmp_path / "hf", tokenizer=tmp_path / "tokenizer.json")
    cls = AutoModelForSequenceClassification if task == "seq-cls" else AutoModelForTokenClassification
    reloaded = cls.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        via_hf = reloaded(**{k: torch.tensor(feeds[k]) for k in model_inputs(model)}).logits.numpy()
    assert float(np.abs(via_hf - ours).max()) <= 1e-4
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and len(config["id2label"]) == 3


def test_train_local_writes_a_checkpoint_that_predict_and_export_trained_read(tmp_path):
    """Train the tiny sequence classifier with a tokenizer of its own on a TSV file, then label new
    sentences from the checkpoint: the labels are the argmax of the exported trained model's logits."""
    tok = make_tiny_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    model = tiny_model("bert", task="seq-cls", num_labels=2, seed=2)
    path = export_model(model, tmp_path / "m.onnx", ExportOptions(num_labels=2, task="seq-cls", attention="sdpa"))
    rows = ["sentence\tlabel"] + [f"{'rome x' if k % 2 else 'unbelievable x'} .\t{'city' if k % 2 else 'feeling'}"
                                  for k in range(24)]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    _cli("train-local", path, "--task", "seq-cls", "--data", tmp_path / "train.tsv", "--eval", tmp_path / "train.tsv",
         "--steps", 4, "--batch", 4, "--seq", 8, "--lr", 1e-3, "--tokenizer", tmp_path / "tokenizer.json",
         "--checkpoint", tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["task"] == "seq-cls" and meta["labels"] == ["city", "feeling"] and meta["stages"] == 1
    trained = open_trained(tmp_path / "ckpt")
    assert set(trained.weights) == set(load_model(path, 4, 8).params)

    (tmp_path / "new.txt").write_text("rome x .\nunbelievable .\nx x x\n")
    proc = _cli("predict", tmp_path / "ckpt", "--input", tmp_path / "new.txt", "--seq", 8, "--batch", 4,
                "--tokenizer", tmp_path / "tokenizer.json")
    docs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["text"] for d in docs] == ["rome x .", "unbelievable .", "x x x"]
    assert all(set(d["scores"]) == {"city", "feeling"} and abs(sum(d["scores"].values()) - 1) < 1e-5 for d in docs)

    _cli("export-trained", tmp_path / "ckpt", "-o", tmp_path / "trained.onnx")
    session = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    for d in docs:
        enc = tok.encode(d["text"])
        ids = np.asarray([enc.ids], np.int64)
        logits = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                    "token_type_ids": np.zeros_like(ids)})[0][0]
        assert d["label"] == ["city", "feeling"][int(np.argmax(logits))]
        z = np.exp(logits - logits.max())
        assert abs(d["scores"]["city"] - z[0] / z.sum()) < 1e-4


def test_predict_tags_words_and_writes_conll_or_jsonl(tmp_path):
    tok = make_tiny_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    labels = ("O", "B-LOC", "I-LOC")
    *_, ckpt = _trained_checkpoint(tmp_path, "bert", "token-classification", labels)
    (tmp_path / "in.txt").write_text("Rome x unbelievable.\nx\n")
    conll = _cli("predict", ckpt, "--input", tmp_path / "in.txt", "--tokenizer", tmp_path / "tokenizer.json",
                 "--seq", 10).stdout
    sentences = [block.splitlines() for block in conll.strip().split("\n\n")]
    assert [[line.split("\t")[0] for line in s] for s in sentences] == [["Rome", "x", "unbelievable", "."], ["x"]]
    assert all(line.split("\t")[1] in labels for s in sentences for line in s)
    out = tmp_path / "tags.jsonl"
    _cli("predict", ckpt, "--input", tmp_path / "in.txt", "--tokenizer", tmp_path / "tokenizer.json", "--seq", 10,
         "--format", "jsonl", "-o", out)
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["tags"] for d in docs] == [[line.split("\t")[1] for line in s] for s in sentences]
    assert all(set(d) == {"words", "tags", "entities"} for d in docs)
    # a CoNLL file as input: its first column is read, its tags ignored
    (tmp_path / "in.conll").write_text("Rome B-LOC\nx O\n\nx O\n")
    again = _cli("predict", ckpt, "--input", tmp_path / "in.conll", "--tokenizer", tmp_path / "tokenizer.json",
                 "--seq", 10).stdout
    assert [line.split("\t")[0] for line in again.split("\n\n")[0].splitlines()] == ["Rome", "x"]


def test_the_model_out_refuses_what_it_cannot_do(tmp_path):
    *_, path, graph, weights, ckpt = _trained_checkpoint(tmp_path, "bert", "seq-cls")
    proc = _cli("export-trained", ckpt, ok=False)
    assert proc.returncode == 1 and "give -o FILE.onnx, --hf DIR, or both" in proc.stderr
    proc = _cli("predict", ckpt, "--input", tmp_path / "missing.txt", ok=False)
    assert proc.returncode == 2 and "missing.txt: no such file" in proc.stderr
    (tmp_path / "binary.txt").write_bytes(b"\x8f\x00\x01")
    proc = _cli("predict", ckpt, "--input", tmp_path / "binary.txt", ok=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"confidant predict: error: --input {tmp_path / 'binary.txt'}: not UTF-8 text (invalid start byte at "
        "byte 0); give a text, CoNLL or TSV/CSV file saved as UTF-8")
    proc = _cli("export-trained", ckpt, "--hf", tmp_path / "out", ok=False)  # a model in memory, a 120-token vocabulary
    assert proc.returncode == 1 and proc.stderr.strip().endswith(
        "no tokenizer found for it (its bert.hf.json names no checkpoint with tokenizer files, and the bundled "
        "MiniLM's does not fit its 120 tokens): pass --tokenizer (the tokenizer.json or Hugging Face folder it was "
        "trained with)")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    (path.with_name(path.stem + ".hf.json")).unlink()
    proc = _cli("export-trained", ckpt, "--hf", tmp_path / "out", ok=False)
    assert proc.returncode == 1 and "has no bert.hf.json next to it" in proc.stderr
    (tmp_path / "in.txt").write_text("x\n")
    proc = _cli("predict", ckpt, "--input", tmp_path / "in.txt", ok=False)  # --seq 128 > its 40 positions
    assert proc.returncode == 2 and "the model may not take sequences this long" in proc.stderr
    proc = _cli("predict", ckpt, "--input", tmp_path / "in.txt", "--seq", 10, ok=False)
    assert proc.returncode == 1 and "pass --labels" in proc.stderr


REVIEWS = ("The food was wonderful and the staff were kind .", "Terrible service , cold soup , never again .",
           "It was fine , nothing special .", "I loved every minute of the show !",
           "The hotel room smelled and the bed was broken .", "An average film with a few good scenes .")


@pytest.fixture(scope="module")
def minilm_reviews(tmp_path_factory):
    """MiniLM exported as a 3-label review classifier (`confidant export --task seq-cls --labels ...`)."""
    from jobs.export.encoder import default_checkpoint_dir, export_checkpoint

    return export_checkpoint(default_checkpoint_dir(), tmp_path_factory.mktemp("minilm-reviews") / "minilm-cls.onnx",
                             ExportOptions(num_labels=3, task="seq-cls", labels=("negative", "neutral", "positive")))


@pytest.mark.parametrize("sidecar_names_its_checkpoint", [True, False])
def test_an_hf_export_loads_with_the_models_own_tokenizer_and_predicts_as_predict_does(
        minilm_reviews, tmp_path, sidecar_names_its_checkpoint):
    """export-trained --hf of a MiniLM review classifier: transformers' own AutoTokenizer and
    AutoModelForSequenceClassification, from the folder alone, give `predict`'s labels and
    probabilities (before: no tokenizer files, so AutoTokenizer built a 5-token tokenizer and every
    review came out the same). The tokenizer is the checkpoint's the export recorded, or for an
    export from before it recorded one, the bundled MiniLM's that train and predict default to."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import shutil

    from jobs.export.encoder import hf_sidecar_path
    from jobs.predict import predict

    labels = ("negative", "neutral", "positive")
    path = Path(shutil.copy(minilm_reviews, tmp_path / minilm_reviews.name))
    shutil.copy(hf_sidecar_path(minilm_reviews), hf_sidecar_path(path))
    if not sidecar_names_its_checkpoint:
        sidecar = json.loads(hf_sidecar_path(path).read_text())
        hf_sidecar_path(path).write_text(json.dumps({k: v for k, v in sidecar.items() if k != "checkpoint"}))
    graph = load_model(path, B, S)
    rng = np.random.default_rng(0)
    head = set(graph.blocks[-2].params)  # moved far, so that the reviews get different labels
    weights = {p: (graph.constants[p] + (3.0 if p in head else 0.02) * rng.standard_normal(graph.constants[p].shape)
                   ).astype(np.float32) for p in graph.params}
    ckpt = write_single_device_checkpoint(tmp_path / "ckpt", weights, {}, graph, {
        "command": "train-local", "model": path.name, "model_path": str(path.resolve()), "task": "seq-cls",
        "labels": list(labels), "step": 1})
    (tmp_path / "reviews.txt").write_text("\n".join(REVIEWS) + "\n")
    _, ours = predict(ckpt, tmp_path / "reviews.txt", seq=32)

    folder = export_trained_hf(ckpt, tmp_path / "hf")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    assert len(tokenizer) == 30522 and tokenizer.cls_token == "[CLS]" and tokenizer.pad_token == "[PAD]"
    with torch.no_grad():
        probs = torch.softmax(model(**tokenizer(list(REVIEWS), padding=True, return_tensors="pt")).logits, -1).numpy()
    theirs = [model.config.id2label[int(i)] for i in probs.argmax(-1)]
    assert theirs == [p.label for p in ours]
    assert len(set(theirs)) > 1  # the reviews are told apart (a wrong tokenizer made them all one label)
    np.testing.assert_allclose(probs, [[p.scores[n] for n in labels] for p in ours], atol=1e-4)


def test_the_demos_export_moves_its_sidecar_with_it(tmp_path):
    """The demo exports under a temporary name and moves the file: its NAME.hf.json goes with it
    (before: left as minilm-token-cls.partial.hf.json, and export-trained --hf asked for a re-export)."""
    from jobs.demo import move_export

    model = tiny_model("bert", task="seq-cls", num_labels=3, seed=1)
    partial = export_model(model, tmp_path / "m.partial.onnx", ExportOptions(num_labels=3, task="seq-cls"))
    path = move_export(partial, tmp_path / "m.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.hf.json", "m.onnx"]
    graph = load_model(path, B, S)
    ckpt = write_single_device_checkpoint(tmp_path / "ck", {p: graph.constants[p] for p in graph.params}, {}, graph,
                                          {"model": path.name, "model_path": str(path), "task": "seq-cls", "step": 0})
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert (export_trained_hf(ckpt, tmp_path / "hf", tokenizer=tmp_path / "tokenizer.json") / "config.json").is_file()


def test_a_fine_tuned_causal_lm_goes_out_as_a_transformers_folder_with_its_tokenizer(chat_llama, tmp_path):
    """export-trained --hf of a causal LM's checkpoint (before: refused, advising a re-export that
    writes no NAME.hf.json for a causal LM): the model it was exported from with the trained weights
    and its tokenizer; AutoModelForCausalLM gives the engine's logits, AutoTokenizer renders chats
    as training did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobs.common.hf_tokenizer import load_hf_tokenizer
    from jobs.export.llm import LlmExportOptions, export_llm, random_causal_lm
    from jobs.train.causal_lm import _write_checkpoint
    from support import lm_step_feeds
    from tasks.causal_lm.tokenizer import load_lm_tokenizer

    tokenizer = load_hf_tokenizer(chat_llama[0].parent / "tokenizer.json")  # SmolLM2's, with its chat template
    model = random_causal_lm("llama", 2, vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    path = export_llm(tmp_path / "src", tmp_path / "onnx" / "m.onnx", LlmExportOptions(), kv_cache=False)
    graph = load_model(path, 2, 12)
    rng = np.random.default_rng(0)
    weights = {p: (graph.constants[p] + 0.05 * rng.standard_normal(graph.constants[p].shape)).astype(np.float32)
               for p in graph.params}
    ckpt = _write_checkpoint(tmp_path / "ck", weights, {}, graph, {"model": path.name, "model_path": str(path),
                                                                   "task": "causal-lm", "step": 1})
    folder = export_trained_hf(ckpt, tmp_path / "hf")
    feeds = lm_step_feeds(0, 2, 12, 1, vocab=len(tokenizer))[0]
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    ours = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.tensor(feeds["input_ids"]),
                          attention_mask=torch.tensor(feeds["attention_mask"])).logits.numpy()
    assert float(np.abs(theirs - ours).max()) <= 1e-4 * float(np.abs(ours).max())
    chat = [{"role": "user", "content": "Where is Oslo?"}]
    assert AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True) == load_lm_tokenizer(path).render_chat(chat)
