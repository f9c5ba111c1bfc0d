"""The `tasks.task.Task` of each family on real exports: what it feeds is what its lowered model reads
(its loss inputs among them, normalised by the whole batch, so micro-batches sum to the batch on a
real engine), what it scores, and the one whole-model engine (`runtime.engines.factory.whole_model_engine`)
against one built by hand."""
from __future__ import annotations

import numpy as np
import pytest

from ir.backend import BackendSpec
from ir.ops import LOSS_INPUTS
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine, whole_model_engine
from runtime.engines.stage import stage_spec
from support import make_tiny_tokenizer, tiny_model
from tasks.choice import TASK_NAMES, task_named, task_of

SEQ = 24


@pytest.fixture(scope="module")
def cases(tiny_onnx, chat_llama, tmp_path_factory):
    """(task name, model, train, dev, tokenizer) for each family: a tiny BERT token classifier on
    generated CoNLL, a tiny BERT sequence classifier on generated reviews, a tiny Llama on the
    entities-json conversations."""
    from jobs.export.encoder import ExportOptions, export_model
    from tasks.ner.datagen import write_splits
    from tasks.seqcls.data import write_review_splits

    root = tmp_path_factory.mktemp("task-protocol")
    tokenizer = root / "tokenizer.json"
    make_tiny_tokenizer().save(str(tokenizer))
    ner_train, ner_dev = write_splits(root / "ner", n_train=12, n_dev=6, seed=1)
    cls_train, cls_dev = write_review_splits(root / "cls", n_train=12, n_dev=6, seed=1)
    seqcls = export_model(tiny_model("bert", task="seq-cls", num_labels=3, seed=2), root / "seqcls.onnx",
                          ExportOptions(num_labels=3, task="seq-cls", attention="sdpa"))
    llama, lm_train, lm_dev = chat_llama
    return [("ner", tiny_onnx["torchscript-17"], ner_train, ner_dev, tokenizer),
            ("seq-cls", seqcls, cls_train, cls_dev, tokenizer),
            ("causal-lm", llama, lm_train, lm_dev, None)]


def test_a_task_by_name_and_an_unknown_name():
    assert [task_named(n).name for n in TASK_NAMES] == list(TASK_NAMES)
    with pytest.raises(ValueError, match=r"--task 'pos' is not one of ner, seq-cls, causal-lm"):
        task_named("pos")


def test_each_task_feeds_what_its_lowered_model_reads_and_micro_batches_sum_to_the_batch(cases):
    seq = {"causal-lm": 160}  # the conversations' answers start past token 100
    for name, model, train, dev, tokenizer in cases:
        task, length = task_named(name), seq.get(name, SEQ)
        run = task.read_data(model, train, dev, length, tokenizer=tokenizer, eval_limit=2)
        half, whole = (load_model(model, rows, length, loss=task.loss) for rows in (2, 4))
        task.check_graph(model, whole, run, dev)
        assert task_of(whole).task == name  # the lowered head says the task it was read for
        assert set(task.loss_inputs) <= set(LOSS_INPUTS) and set(task.loss_inputs) <= set(whole.input_names())
        batch = task.batches(run, 4, seed=0)[0]
        [one] = task.feeds(run, batch, 4, 1)
        two = task.feeds(run, batch, 4, 2)
        for feeds in [one, *two]:
            assert set(whole.input_names()) <= set(feeds), name
        weights = task.loss_inputs[-1]  # targets, or target_weights: 1 / the whole batch's count where counted
        assert sum(float(f[weights].sum()) for f in two) == pytest.approx(1.0, abs=1e-5), name
        assert float(one[weights].sum()) == pytest.approx(1.0, abs=1e-5), name
        loss = float(whole_model_engine(whole).forward(one, train=False))
        halves = whole_model_engine(half)
        assert sum(float(halves.forward(f, microbatch=m, train=False)) for m, f in enumerate(two)) == \
            pytest.approx(loss, rel=1e-5), name
        figures = task.evaluate(whole_model_engine(whole, cache_activations=False), whole, run, 4)
        assert figures.metric == {"ner": "entity_f1", "seq-cls": "accuracy", "causal-lm": "perplexity"}[name]
        if name == "causal-lm":
            assert figures.perplexity > 1 and task.headline(figures) == f"dev perplexity {figures.perplexity:.3f}"
        else:
            assert 0 <= figures.after <= 1 and task.headline(figures).startswith(
                {"ner": "entity F1 ", "seq-cls": "accuracy "}[name])
        both = task.with_before(figures, figures)
        assert both.before == figures.after and both.after == figures.after


def test_a_task_refuses_a_model_with_the_other_head(cases):
    from tasks.task import TaskMismatch

    (_, tokens, train, dev, tokenizer), (_, sequences, *_), (_, llama, *_) = cases
    run = task_named("ner").read_data(tokens, train, dev, SEQ, tokenizer=tokenizer)
    with pytest.raises(TaskMismatch, match="labels whole sequences"):
        task_named("ner").check_graph(sequences, load_model(sequences, 2, SEQ), run)
    with pytest.raises(TaskMismatch, match="is lowered without a causal-LM loss"):
        task_named("causal-lm").check_graph(tokens, load_model(tokens, 2, SEQ), run)
    with pytest.raises(TaskMismatch, match="is a causal language model: train it with --task causal-lm"):
        task_named("ner").check_graph(llama, load_model(llama, 2, SEQ, loss="causal-lm"), run)


def test_the_whole_model_engine_is_the_one_built_by_hand_and_takes_trained_weights(tiny_onnx):
    graph = load_model(tiny_onnx["torchscript-17"], 2, 8)
    feeds = {"input_ids": np.arange(16, dtype=np.int64).reshape(2, 8) % 500,
             "attention_mask": np.ones((2, 8), np.int64), "token_type_ids": np.zeros((2, 8), np.int64),
             "targets": np.full((2, 8, 9), 1 / 144, np.float32)}
    by_hand = make_engine(BackendSpec.cpu("mnn", 1), stage_spec(graph, 0, len(graph.blocks) - 1))
    loss = float(by_hand.forward(feeds, train=False))
    assert float(whole_model_engine(graph).forward(feeds, train=False)) == loss
    head = graph.blocks[-2].params[0]
    assert float(whole_model_engine(graph, weights={}).forward(feeds, train=False)) == loss
    doubled = whole_model_engine(graph, weights={head: 2 * graph.constants[head]}, cache_activations=False)
    assert float(doubled.forward(feeds, train=False)) != pytest.approx(loss)


def test_predict_says_a_causal_lm_is_no_classifier(cases, tmp_path):
    """A causal LM's head says its task (`task_of`); predict, which labels tokens or sequences, says
    so in one line instead of asking for 49152 label names."""
    from support import run_cli

    (_, _, _, dev, _), _, (_, llama, *_) = cases
    run = run_cli("predict", llama, "--input", dev)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"{llama} is a causal-lm model: predict labels tokens or sequences; `confidant generate` answers " \
           "prompts with a causal LM" in run.stderr
