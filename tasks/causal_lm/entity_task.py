"""A generated instruction task for causal LMs: list a sentence's people, places and organisations as JSON.

The sentences are the NER generator's (tasks/ner/datagen.py: its templates and name lists, with the same
held-out names: train draws only from the names that survive the seeded holdout, dev from all names,
so dev asks about people, places and organisations never seen in training). Each example is

    prompt:   List the people, places and organisations in this sentence as JSON with the keys "people",
              "places" and "organisations".
              Sentence: Maria Lopez, a spokesman for Acme Corp, said the company would cut 40 jobs in Lyon.
    response: {"people": ["Maria Lopez"], "places": ["Lyon"], "organisations": ["Acme Corp"]}

(names in order of first appearance, each once; MISC entities are not asked for; a sentence without any
gives three empty lists). The answer's exact form is learnable from a few dozen examples, while a base
model answers in its own words or its own JSON, so exact match starts near 0; the entities themselves
need the sentence's context ("Jordan" is a person or a place, "Leeds United" an organisation).

Scores of generated answers (`score_answers`): exact match (tasks/causal_lm/metrics.py), the share of answers
that parse as a JSON object with the three keys, and entity precision / recall / F1 over (key, name)
pairs, which credits an answer that is right but for one name.
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tasks.ner.conll import Sentence
# The generator's private pieces, used so that this task's train/dev split holds out exactly the names
# write_splits holds out (the generator offers no public sentence-level split).
from tasks.ner.datagen import _FULL_POOLS, _generate, _train_pools
from tasks.causal_lm.metrics import exact_match

__all__ = ["KEYS", "PROMPT", "EntityExample", "answer_for", "example_for", "parse_answer", "score_answers",
           "sentence_text", "write_entity_splits"]

KEYS = ("people", "places", "organisations")
_TYPE_KEY = {"PER": "people", "LOC": "places", "ORG": "organisations"}
PROMPT = ('List the people, places and organisations in this sentence as JSON with the keys "people", '
          '"places" and "organisations".\nSentence: {sentence}')

_NO_SPACE_BEFORE = re.compile(r" ([,.;:!?)]|'s\b|n't\b)")
_NO_SPACE_AFTER = re.compile(r"([(]) ")


def sentence_text(tokens: Sequence[str]) -> str:
    """CoNLL tokens as running text: no space before , . ; : ! ? ) 's n't, none after (."""
    text = " ".join(tokens)
    text = _NO_SPACE_BEFORE.sub(r"\1", text)
    return _NO_SPACE_AFTER.sub(r"\1", text)


def answer_for(sentence: Sentence) -> dict[str, list[str]]:
    """{"people": [...], "places": [...], "organisations": [...]} of an IOB2-tagged sentence."""
    out: dict[str, list[str]] = {k: [] for k in KEYS}
    span: list[str] = []
    kind = None

    def close():
        if kind in _TYPE_KEY and span:
            name = " ".join(span)
            if name not in out[_TYPE_KEY[kind]]:
                out[_TYPE_KEY[kind]].append(name)

    for token, tag in zip(sentence.tokens, sentence.tags):
        if tag.startswith("I-") and kind == tag[2:]:
            span.append(token)
            continue
        close()
        span, kind = ([token], tag[2:]) if tag != "O" else ([], None)
    close()
    return out


@dataclass(frozen=True)
class EntityExample:
    sentence: str
    answer: dict[str, list[str]]

    @property
    def prompt(self) -> str:
        return PROMPT.format(sentence=self.sentence)

    @property
    def response(self) -> str:
        return json.dumps(self.answer, ensure_ascii=False)

    def to_json(self) -> dict[str, str]:
        return {"prompt": self.prompt, "response": self.response}


def example_for(sentence: Sentence) -> EntityExample:
    return EntityExample(sentence_text(sentence.tokens), answer_for(sentence))


def write_entity_splits(out_dir: str | os.PathLike[str], n_train: int = 1000, n_dev: int = 100,
                        seed: int = 0) -> tuple[Path, Path]:
    """Write `train.jsonl` and `dev.jsonl` ({"prompt", "response"} per line) into `out_dir`; train
    from the names that survive datagen's holdout, dev from all names (module docstring)."""
    if n_train < 1 or n_dev < 1:
        raise ValueError(f"n_train and n_dev must be at least 1, got {n_train} and {n_dev}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = _generate(n_train, random.Random(f"confidant-entities:{seed}:train"), _train_pools(seed))
    dev = _generate(n_dev, random.Random(f"confidant-entities:{seed}:dev"), _FULL_POOLS)
    paths = out / "train.jsonl", out / "dev.jsonl"
    for path, sentences in zip(paths, (train, dev)):
        lines = [json.dumps(example_for(s).to_json(), ensure_ascii=False) for s in sentences]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def parse_answer(text: str) -> dict[str, list[str]] | None:
    """The answer as {key: [names]}, or None unless it is one JSON object with exactly the three keys,
    each a list of strings."""
    try:
        value = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) != set(KEYS):
        return None
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in value.values()):
        return None
    return value


def score_answers(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """exact_match, valid_json, precision, recall, f1 (entity pairs; an answer that does not parse
    predicts nothing). F1 is 1.0 when neither side names anything."""
    em = exact_match(predictions, references)
    valid = n_pred = n_gold = n_correct = 0
    for p, r in zip(predictions, references):
        gold = parse_answer(r)
        if gold is None:
            raise ValueError(f"reference answer {r!r} is not the task's JSON")
        pred = parse_answer(p)
        valid += pred is not None
        gold_pairs = {(k, n) for k in KEYS for n in gold[k]}
        pred_pairs = {(k, n) for k in KEYS for n in pred[k]} if pred is not None else set()
        n_pred, n_gold, n_correct = n_pred + len(pred_pairs), n_gold + len(gold_pairs), \
            n_correct + len(pred_pairs & gold_pairs)
    precision = n_correct / n_pred if n_pred else float(n_gold == 0)
    recall = n_correct / n_gold if n_gold else float(n_pred == 0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"exact_match": em, "valid_json": valid / len(references), "precision": precision,
            "recall": recall, "f1": f1}
