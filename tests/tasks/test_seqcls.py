"""Sequence classification: GLUE-style files, accuracy and macro-F1, the generated review task,
pair encoding, and fine-tuning that lowers the loss and raises accuracy."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ir.errors import InputFileError
from ir.graph import is_sequence_classifier, logits_shape
from tasks.metrics import class_scores
from tasks.seqcls.data import (REVIEW_LABELS, LabelledText, generate_reviews, label_order, read_labelled, write_labelled,
                          _OPINIONS)

ROOT = Path(__file__).resolve().parents[2]


# --- files ---------------------------------------------------------------------------------------

def test_glue_tsv_with_a_header_and_pairs(tmp_path):
    f = tmp_path / "mrpc.tsv"
    f.write_text("sentence1\tsentence2\tlabel\nA man sings.\tSomeone sings.\t1\n\"Quoted\ttab\"\tno\t0\n")
    rows = read_labelled(f)
    assert rows == [LabelledText("A man sings.", "1", "Someone sings."), LabelledText("Quoted\ttab", "0", "no")]


def test_csv_without_a_header_and_the_label_last(tmp_path):
    f = tmp_path / "sst.csv"
    f.write_text('great film,positive\n"bad, really bad",negative\n\n')
    assert read_labelled(f) == [LabelledText("great film", "positive"), LabelledText("bad, really bad", "negative")]
    g = tmp_path / "idx.tsv"  # GLUE-style with an index column first
    g.write_text("index\tsentence\tlabel\n0\tfine\t1\n")
    assert read_labelled(g) == [LabelledText("fine", "1")]


@pytest.mark.parametrize("content, says", [
    ("a\tb\tc\td\n", r"bad.tsv:1: expected `sentence'\\t'label`"),
    ("good\tpos\nbad\tneg\textra\n", r"bad.tsv:2: expected 2 columns like line 1, got 3"),
    ("good\t\n", r"bad.tsv:1: the label is empty"),
    ("", r"bad.tsv: no examples \(the file is empty\)"),
    ("label\tother\n1\tx\n", r"bad.tsv:1: a header without a text column"),
])
def test_bad_files_name_the_line(tmp_path, content, says):
    f = tmp_path / "bad.tsv"
    f.write_text(content)
    with pytest.raises(InputFileError, match=says):
        read_labelled(f)


def test_a_text_longer_than_csvs_field_limit_is_read_and_an_unclosed_quote_is_shown_short(tmp_path):
    f = tmp_path / "long.tsv"
    f.write_text("sentence\tlabel\n" + "word " * 40_000 + "\tpos\nshort\tneg\n")  # 200 kB, csv's limit 128 KiB
    rows = read_labelled(f)
    assert [r.label for r in rows] == ["pos", "neg"] and len(rows[0].text) == 5 * 40_000 - 1
    g = tmp_path / "quote.tsv"
    g.write_text("sentence\tlabel\n" + '"unclosed quote here\tpos\n' + "".join(f"line {i}\tneg\n" for i in range(500)))
    with pytest.raises(InputFileError, match=r"quote.tsv:2: expected 2 columns like the header, got 1: "
                                             r"\['unclosed quote here.*\.\.\. \(\d+ characters; an unclosed quote "
                                             r"takes the lines after it into one field\)") as info:
        read_labelled(g)
    assert len(str(info.value)) < 400


def test_a_label_only_the_eval_file_has_is_named_with_that_file(tmp_path, tokenizer_path):
    from tasks.seqcls.data import load_seqcls_data

    train, dev = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    train.write_text("good\tpos\nbad\tneg\n")
    dev.write_text("fine\tpos\nodd\tweird\n")
    with pytest.raises(InputFileError, match=r"dev.tsv: labels \['weird'\] are not among the model's \['neg', 'pos'\]"):
        load_seqcls_data(train, dev, 16, tokenizer_path, labels=("neg", "pos"))


def test_integer_labels_are_the_indices_of_a_models_named_labels(tmp_path, tokenizer_path):
    """GLUE's files label by index (0, 1, 2): for a model exported with label names, id i is its
    i-th label, in training and in the dev labels its metrics compare; an id past the labels is refused."""
    from tasks.seqcls.data import load_seqcls_data

    train, dev = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    train.write_text("sentence\tlabel\ngood\t2\nbad\t0\nmeh\t1\n")
    dev.write_text("fine\t2\nawful\t0\n")
    data = load_seqcls_data(train, dev, 16, tokenizer_path, labels=("negative", "neutral", "positive"))
    assert [e.label for e in data.train] == ["positive", "negative", "neutral"]
    assert data.dev_labels == ["positive", "negative"]
    assert [int(row.labels[0]) for row in data.train_encoded] == [2, 0, 1]
    dev.write_text("fine\t3\n")
    with pytest.raises(InputFileError, match=r"dev.tsv: labels \['3'\] are not among the model's .* \(or their indices 0-2\)"):
        load_seqcls_data(train, dev, 16, tokenizer_path, labels=("negative", "neutral", "positive"))


def test_write_then_read_round_trips(tmp_path):
    rows = [LabelledText("one", "a"), LabelledText("two, with comma", "b", "second")]
    assert read_labelled(write_labelled(tmp_path / "x.tsv", rows)) == [LabelledText("one", "a", ""), rows[1]]
    assert label_order(["10", "2", "1"]) == ("1", "2", "10") and label_order(["b", "a"]) == ("a", "b")


# --- metrics -------------------------------------------------------------------------------------

def test_accuracy_and_macro_f1():
    gold = ["a", "a", "a", "b", "b", "c"]
    pred = ["a", "a", "b", "b", "c", "c"]
    s = class_scores(gold, pred)
    assert s.accuracy == pytest.approx(4 / 6)
    # a: P 1, R 2/3, F1 0.8; b: P 1/2, R 1/2, F1 0.5; c: P 1/2, R 1, F1 2/3
    assert s.per_label["a"].f1 == pytest.approx(0.8) and s.per_label["c"].f1 == pytest.approx(2 / 3)
    assert s.macro_f1 == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert s.macro_precision == pytest.approx((1 + 0.5 + 0.5) / 3)
    always_a = class_scores(gold, ["a"] * 6)  # accuracy 1/2, but macro-F1 sees the two labels never predicted
    assert always_a.accuracy == 0.5 and always_a.macro_f1 == pytest.approx((2 * 0.5 / 1.5) / 3)


# --- the generated task and its encoding -----------------------------------------------------------

def test_the_generated_reviews_hold_out_their_opinion_words():
    train, dev = generate_reviews(400, 0, "train"), generate_reviews(100, 0, "dev")
    assert {e.label for e in train} == {e.label for e in dev} == set(REVIEW_LABELS)
    words = lambda rows: {w.strip(".,:").lower() for e in rows for w in e.text.split()}
    opinions = {w for ws in _OPINIONS.values() for w in ws}
    assert not (words(train) & words(dev) & opinions)  # no opinion word of dev is seen in training
    assert generate_reviews(5, 3) == generate_reviews(5, 3)


def test_pairs_are_encoded_with_token_types_and_cut_longest_first(tokenizer_path):
    from tasks.tokenize import encode_texts, load_tokenizer, make_batches

    tok = load_tokenizer(tokenizer_path)
    enc = encode_texts(tok, [("a b", "c d e"), ("x " * 30, "y " * 5)], [2, 0], 12)
    first, cut = enc
    assert first.input_ids[0] == tok.token_to_id("[CLS]") and list(first.token_type_ids) == [0] * 4 + [1] * 4
    assert list(first.labels) == [2] + [-100] * 7
    assert len(cut) == 12 and list(cut.input_ids).count(tok.token_to_id("[SEP]")) == 2
    assert tok.padding is None and tok.truncation is None  # left as found
    batch = make_batches(enc, 2, 12, seed=0, shuffle=False, per_sequence=True)[0]
    from tasks.trainer import batch_feeds

    targets = batch_feeds(batch, 3)["targets"]
    np.testing.assert_array_equal(targets, [[0, 0, 0.5], [0.5, 0, 0]])  # one-hot / labelled rows


# --- fine-tuning -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_seqcls(tmp_path_factory):
    """A tiny random BERT sequence classifier (2 labels) through `confidant export`'s exporter."""
    from support import tiny_model

    from jobs.export.encoder import ExportOptions, export_model

    root = tmp_path_factory.mktemp("seqcls")
    return export_model(tiny_model("bert", task="seq-cls", num_labels=2, seed=3), root / "tiny-seqcls.onnx",
                        ExportOptions(num_labels=2, task="seq-cls", attention="sdpa"))


def test_fine_tuning_a_sequence_classifier_lowers_the_loss_and_raises_accuracy(tiny_seqcls):
    """Whether token 7 occurs decides the label: a fresh tiny model is at chance, 40 steps learn it."""
    from planner.onnx_import import load_model
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec
    from tasks.tokenize import Batch
    from tasks.trainer import TrainConfig, batch_feeds, train_steps

    rows, seq = 8, 10
    graph = load_model(tiny_seqcls, rows, seq)
    assert logits_shape(graph) == (rows, 2) and is_sequence_classifier(graph)

    def batch(seed):
        r = np.random.default_rng(seed)
        ids = r.integers(10, 100, (rows, seq))
        labels = np.full((rows, seq), -100)
        labels[:, 0] = np.arange(rows) % 2
        ids[labels[:, 0] == 1, r.integers(1, seq)] = 7
        mask = np.ones((rows, seq), np.int64)
        return Batch(ids.astype(np.int64), mask, np.zeros_like(mask), labels.astype(np.int64), rows, per_sequence=True)

    def accuracy(engine, b):
        logits = engine.forward(batch_feeds(b, 2), train=False, until_block=len(graph.blocks) - 2)
        return float(np.mean(np.argmax(logits, -1) == b.labels[:, 0]))

    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    held_out = [batch(1000 + k) for k in range(4)]
    before = np.mean([accuracy(engine, b) for b in held_out])
    result = train_steps(engine, [batch(k) for k in range(20)], TrainConfig(steps=40, batch=rows, seq=seq, lr=3e-3),
                         num_labels=2)
    losses = [s.loss for s in result.steps]
    after = np.mean([accuracy(engine, b) for b in held_out])
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert before <= 0.75 and after >= 0.95


@pytest.mark.slow
def test_the_review_demo_raises_accuracy_on_minilm(tmp_path):
    """The demo-style run a user makes: export MiniLM as a 3-label sequence classifier, generate the
    review task, fine-tune; accuracy on the held-out opinion words rises from chance."""
    import json

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "confidant", *map(str, args)], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    run("export", "--task", "seq-cls", "--num-labels", 3, "--labels", ",".join(REVIEW_LABELS),
        "-o", tmp_path / "sc.onnx")
    run("datagen", "--task", "seq-cls", "-o", tmp_path / "data", "--train", 400, "--dev", 90)
    run("train-local", tmp_path / "sc.onnx", "--task", "seq-cls", "--data", tmp_path / "data" / "train.tsv",
        "--eval", tmp_path / "data" / "dev.tsv", "--steps", 30, "--batch", 8, "--seq", 24, "--lr", 1e-4,
        "--metrics-out", tmp_path / "m.json")
    doc = json.loads((tmp_path / "m.json").read_text())
    ev = doc["eval"]
    assert ev["metric"] == "accuracy" and ev["before"] < 0.6 and ev["after"] > 0.85 and ev["macro_f1"] > 0.8
    assert np.mean([s["loss"] for s in doc["steps"][-5:]]) < 0.5 * np.mean([s["loss"] for s in doc["steps"][:5]])


def test_the_logits_shape_tells_a_sequence_from_a_token_classifier(tiny_seqcls, tiny_onnx, tmp_path):
    """`ir.graph.is_sequence_classifier`, `tasks.choice.task_of` a lowered graph, and train-local's check
    of --task against the model with it (`Task.check_graph`)."""
    from types import SimpleNamespace

    from jobs.common.errors import JobError
    from jobs.common.task_choice import check_graph
    from planner.onnx_import import load_model
    from tasks.choice import task_named, task_of

    sequences, tokens = load_model(tiny_seqcls, 4, 10), load_model(tiny_onnx["dynamo-18"], 4, 10)
    assert is_sequence_classifier(sequences) and not is_sequence_classifier(tokens)
    assert logits_shape(tokens)[:2] == (4, 10)
    assert (task_of(sequences).task, task_of(tokens).task) == ("seq-cls", "ner")

    def data(graph):  # as many labels as the head has: only the shape is checked here
        return SimpleNamespace(labels=[str(i) for i in range(logits_shape(graph)[-1])], train=[], dev=[])

    seqcls, ner = task_named("seq-cls"), task_named("ner")
    check_graph(seqcls, tmp_path / "m.onnx", sequences, data(sequences))
    check_graph(ner, tmp_path / "m.onnx", tokens, data(tokens))
    with pytest.raises(JobError, match=r"labels tokens \(logits \[4, 10, "):
        check_graph(seqcls, tmp_path / "m.onnx", tokens, data(tokens))
    with pytest.raises(JobError, match=r"labels whole sequences \(logits \[4, 2\]\)"):
        check_graph(ner, tmp_path / "m.onnx", sequences, data(sequences))
