"""Entity-level precision, recall and F1 with conlleval semantics.

Sequence classification is scored by accuracy and macro-F1 (``class_scores``, at the end).

NER systems are compared by the CoNLL-2003 shared task's ``conlleval``
script (reproduced by ``seqeval`` in its default mode): an entity counts as
correct only when its type, first token and last token all match the gold
entity exactly.  Token accuracy would reward a model for predicting ``O``
everywhere, so the fine-tuning runs report these scores instead.

Chunks are read the way conlleval reads them, which accepts IOB1 and IOB2
alike: ``B-X`` always starts an entity; ``I-X`` continues the current
entity when that entity has type X and otherwise starts a new one (a
"stray" ``I-`` after ``O`` or after another type is an entity start, not an
error).  Predictions therefore need no repair before scoring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tasks.ner.conll import is_valid_tag

__all__ = ["ClassScores", "Entity", "Scores", "TypeScores", "class_scores", "entity_f1", "extract_entities"]

# (type, start, end) with ``end`` exclusive, so ``tokens[start:end]`` are
# the entity's words.
Entity = tuple[str, int, int]


def extract_entities(tags: Sequence[str]) -> set[Entity]:
    """Return the entities in one sentence's tags as ``(type, start, end)``.

    ``end`` is exclusive.  Raises ValueError for a tag that is not ``O``,
    ``B-TYPE`` or ``I-TYPE``.
    """
    entities: set[Entity] = set()
    current_type: str | None = None
    start = 0
    for i, tag in enumerate(tags):
        prefix, entity_type = _split_tag(tag, i)
        continues = prefix == "I" and entity_type == current_type
        if continues:
            continue
        if current_type is not None:
            entities.add((current_type, start, i))
        if prefix == "O":
            current_type = None
        else:
            current_type, start = entity_type, i
    if current_type is not None:
        entities.add((current_type, start, len(tags)))
    return entities


def _split_tag(tag: str, position: int) -> tuple[str, str | None]:
    if tag == "O":
        return "O", None
    if is_valid_tag(tag):
        return tag[0], tag[2:]
    raise ValueError(
        f"position {position}: invalid NER tag {tag!r} (expected O, B-TYPE or I-TYPE)"
    )


@dataclass(frozen=True)
class TypeScores:
    """Scores for one entity type (or for all types together)."""

    precision: float
    recall: float
    f1: float
    n_gold: int
    n_pred: int
    n_correct: int


@dataclass(frozen=True)
class Scores:
    """Micro-averaged entity scores plus a per-type breakdown.

    ``per_type`` has an entry for every type seen in gold or predictions.
    Ratios with a zero denominator are 0.0, as in seqeval's default.
    """

    precision: float
    recall: float
    f1: float
    n_gold: int
    n_pred: int
    n_correct: int
    per_type: dict[str, TypeScores] = field(default_factory=dict)


def _ratios(n_gold: int, n_pred: int, n_correct: int) -> TypeScores:
    precision = n_correct / n_pred if n_pred else 0.0
    recall = n_correct / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return TypeScores(precision, recall, f1, n_gold, n_pred, n_correct)


def entity_f1(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> Scores:
    """Score predicted tag sequences against gold ones, sentence by sentence.

    Entities never cross sentence boundaries.  Raises ValueError when the
    number of sentences differs, or when a gold and predicted sentence
    differ in length (naming the sentence index), since scoring misaligned
    tags would give a meaningless number.
    """
    if len(gold) != len(pred):
        raise ValueError(f"gold has {len(gold)} sentences but pred has {len(pred)}")
    gold_by_type: dict[str, int] = {}
    pred_by_type: dict[str, int] = {}
    correct_by_type: dict[str, int] = {}
    for index, (g, p) in enumerate(zip(gold, pred)):
        if len(g) != len(p):
            raise ValueError(
                f"sentence {index}: gold has {len(g)} tags but pred has {len(p)}"
            )
        try:
            gold_entities = extract_entities(g)
            pred_entities = extract_entities(p)
        except ValueError as e:
            raise ValueError(f"sentence {index}: {e}") from None
        for entity_type, _, _ in gold_entities:
            gold_by_type[entity_type] = gold_by_type.get(entity_type, 0) + 1
        for entity_type, _, _ in pred_entities:
            pred_by_type[entity_type] = pred_by_type.get(entity_type, 0) + 1
        for entity_type, _, _ in gold_entities & pred_entities:
            correct_by_type[entity_type] = correct_by_type.get(entity_type, 0) + 1

    per_type = {
        t: _ratios(gold_by_type.get(t, 0), pred_by_type.get(t, 0), correct_by_type.get(t, 0))
        for t in sorted(gold_by_type.keys() | pred_by_type.keys())
    }
    total = _ratios(
        sum(gold_by_type.values()), sum(pred_by_type.values()), sum(correct_by_type.values())
    )
    return Scores(
        precision=total.precision,
        recall=total.recall,
        f1=total.f1,
        n_gold=total.n_gold,
        n_pred=total.n_pred,
        n_correct=total.n_correct,
        per_type=per_type,
    )


# --- sequence classification ------------------------------------------------------------------

@dataclass(frozen=True)
class ClassScores:
    """Accuracy and macro-averaged scores of a sequence classifier (GLUE's reporting).

    ``macro_f1`` is the unweighted mean over the labels of the gold set and the predictions of
    each label's F1 (a label never predicted nor present counts nowhere); ``per_label`` holds each
    label's precision, recall and F1 (``TypeScores``, counts of sentences)."""

    accuracy: float
    macro_f1: float
    macro_precision: float
    macro_recall: float
    n: int
    per_label: dict[str, TypeScores] = field(default_factory=dict)


def class_scores(gold: Sequence[str], pred: Sequence[str]) -> ClassScores:
    """Accuracy and macro precision / recall / F1 of predicted labels against gold ones."""
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold labels but {len(pred)} predictions")
    n = len(gold)
    correct = sum(g == p for g, p in zip(gold, pred))
    per_label = {}
    for label in sorted(set(gold) | set(pred)):
        n_gold = sum(g == label for g in gold)
        n_pred = sum(p == label for p in pred)
        n_correct = sum(g == p == label for g, p in zip(gold, pred))
        per_label[label] = _ratios(n_gold, n_pred, n_correct)
    k = len(per_label) or 1
    return ClassScores(correct / n if n else 0.0, sum(s.f1 for s in per_label.values()) / k,
                       sum(s.precision for s in per_label.values()) / k,
                       sum(s.recall for s in per_label.values()) / k, n, per_label)
