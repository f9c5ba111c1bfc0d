"""The generated instruction task (tasks/causal_lm/entity_task.py) and the causal-LM metrics (tasks/causal_lm/metrics.py) on
hand-checkable cases."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tasks.ner.conll import Sentence
from tasks.causal_lm.entity_task import KEYS, answer_for, example_for, parse_answer, score_answers, sentence_text, \
    write_entity_splits
from tasks.causal_lm.data import LmBatch
from tasks.causal_lm.metrics import NllSum, exact_match, perplexity, token_cross_entropy


def test_a_sentence_becomes_a_prompt_and_its_json_answer():
    s = Sentence(("Maria", "Lopez", ",", "a", "spokesman", "for", "Acme", "Corp", ",", "said", "Maria", "Lopez",
                  "would", "visit", "Lyon", "and", "Leeds", "United", "'s", "French", "fans", "."),
                 ("B-PER", "I-PER", "O", "O", "O", "O", "B-ORG", "I-ORG", "O", "O", "B-PER", "I-PER",
                  "O", "O", "B-LOC", "O", "B-ORG", "I-ORG", "O", "B-MISC", "O", "O"))
    ex = example_for(s)
    assert ex.sentence == "Maria Lopez, a spokesman for Acme Corp, said Maria Lopez would visit Lyon and Leeds United's French fans."
    assert ex.answer == {"people": ["Maria Lopez"], "places": ["Lyon"], "organisations": ["Acme Corp", "Leeds United"]}
    assert ex.response == '{"people": ["Maria Lopez"], "places": ["Lyon"], "organisations": ["Acme Corp", "Leeds United"]}'
    assert ex.prompt.endswith("\nSentence: " + ex.sentence) and '"organisations"' in ex.prompt
    # two adjacent entities of one type stay two (IOB2's B- boundary)
    two = Sentence(("Acme", "Globex", "merger"), ("B-ORG", "B-ORG", "O"))
    assert answer_for(two)["organisations"] == ["Acme", "Globex"]
    assert answer_for(Sentence(("Hello", "."), ("O", "O"))) == {k: [] for k in KEYS}
    assert sentence_text(["(", "Kenya", ")", "did", "n't", "win", "?"]) == "(Kenya) didn't win?"


def test_the_task_files(tmp_path):
    train, dev = write_entity_splits(tmp_path, n_train=300, n_dev=60, seed=0)
    assert (train.name, dev.name) == ("train.jsonl", "dev.jsonl")
    rows = {p: [json.loads(line) for line in p.read_text().splitlines()] for p in (train, dev)}
    assert len(rows[train]) == 300 and len(rows[dev]) == 60
    for r in rows[train] + rows[dev]:
        assert set(r) == {"prompt", "response"}
        answer = parse_answer(r["response"])
        assert answer is not None
        sentence = r["prompt"].split("\nSentence: ", 1)[1]
        assert all(name in sentence for names in answer.values() for name in names)
    answers = [parse_answer(r["response"]) for r in rows[train]]
    assert all(any(a[k] for a in answers) for k in KEYS)  # every key is sometimes filled
    assert any(not any(a.values()) for a in answers)  # and some sentences name nobody
    # dev asks about names held out of train
    seen = {n for a in answers for names in a.values() for n in names}
    dev_names = {n for r in rows[dev] for names in parse_answer(r["response"]).values() for n in names}
    assert dev_names - seen
    # the same seed gives the same files
    again = write_entity_splits(tmp_path / "again", n_train=300, n_dev=60, seed=0)
    assert again[0].read_text() == train.read_text() and again[1].read_text() == dev.read_text()


def test_answer_scores():
    gold = '{"people": ["Ann Lee"], "places": ["Oslo"], "organisations": []}'
    assert parse_answer("  " + gold + "\n") == {"people": ["Ann Lee"], "places": ["Oslo"], "organisations": []}
    assert parse_answer('{"people": []}') is None and parse_answer("Ann Lee, Oslo") is None
    assert parse_answer('{"people": "Ann", "places": [], "organisations": []}') is None
    half = '{"people": ["Ann Lee"], "places": [], "organisations": ["Oslo"]}'
    scores = score_answers([gold, half, "no idea"], [gold, gold, gold])
    assert scores["exact_match"] == pytest.approx(1 / 3)
    assert scores["valid_json"] == pytest.approx(2 / 3)
    assert scores["precision"] == pytest.approx(3 / 4)  # 2 + 2 predicted pairs, 2 + 1 right
    assert scores["recall"] == pytest.approx(3 / 6)
    assert scores["f1"] == pytest.approx(2 * 0.75 * 0.5 / 1.25)
    empty = '{"people": [], "places": [], "organisations": []}'
    assert score_answers([empty], [empty])["f1"] == 1.0


def test_exact_match_strips_only_the_ends():
    assert exact_match(["Paris", " Paris\n", "paris", "Par is"], ["Paris"] * 4) == 0.5
    with pytest.raises(ValueError):
        exact_match(["a"], [])


def test_uniform_logits_have_the_vocabulary_as_perplexity():
    v = 7
    total = NllSum()
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.int64)
    batch = LmBatch(np.zeros((2, 3), np.int64), np.ones((2, 3), np.int64), np.array([[3, 5, 0], [6, 0, 0]]),
                    mask, 3)
    total.add(np.zeros((2, 3, v), np.float32), batch)
    assert total.n_targets == 3 and total.perplexity == pytest.approx(v)


def test_perplexity_of_known_probabilities():
    # position 0 gives its target probability 1/2, position 1 gives 1/4: ppl = exp(mean(ln 2, ln 4)) = sqrt(8)
    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.25, 0.25, 0.5]]]))
    target = np.array([[0, 1]])
    np.testing.assert_allclose(token_cross_entropy(logits, target), [[math.log(2), math.log(4)]])
    total = NllSum()
    total.add(logits, LmBatch(np.zeros((1, 2), np.int64), np.ones((1, 2), np.int64), target,
                              np.ones((1, 2), np.int64), 2))
    assert total.perplexity == pytest.approx(math.sqrt(8))
    # one sum over batches, not a mean of per-batch perplexities
    second = NllSum(nll=total.nll + math.log(2) * 2, n_targets=4)
    assert second.perplexity == pytest.approx(math.exp((math.log(2) * 3 + math.log(4)) / 4))
    assert perplexity(0.0, 5) == 1.0
    with pytest.raises(ValueError):
        perplexity(1.0, 0)
    # padding rows beyond the batch (a padded last batch's logits) are ignored
    padded = np.concatenate([logits, np.zeros_like(logits)])
    again = NllSum()
    again.add(padded, LmBatch(np.zeros((1, 2), np.int64), np.ones((1, 2), np.int64), target,
                              np.ones((1, 2), np.int64), 2))
    assert again.perplexity == pytest.approx(math.sqrt(8))
