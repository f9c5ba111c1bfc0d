"""The NER task's data for a training run: CoNLL files read, the label set chosen, sentences
tokenised and aligned, checked against what the model predicts.

Every training command (one device, a pipeline, a plan) loads its data here, so they agree on the
label set and on the errors a user sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tasks.ner.conll import Sentence, read_conll
from tasks.models import default_tokenizer_path
from tasks.text_files import directory_given
from tasks.tokenize import CONLL_LABELS, Encoded, encode_sentences, label_list, load_tokenizer


def label_set(found: Sequence[str], standard: Sequence[str] = CONLL_LABELS) -> tuple[str, ...]:
    """The CoNLL-2003 labels when the data stays inside them, else O plus B-/I- of every type seen."""
    if set(found) <= set(standard):
        return tuple(standard)
    types = sorted({t[2:] for t in found if t != "O"})
    return ("O",) + tuple(f"{p}-{t}" for t in types for p in ("B", "I"))


@dataclass(frozen=True, eq=False)
class NerData:
    """Training (and optional evaluation) sentences with their encodings at `seq` tokens."""

    labels: tuple[str, ...]
    train: list[Sentence]
    dev: list[Sentence]
    train_encoded: list[Encoded]
    dev_encoded: list[Encoded]
    seq: int

    @property
    def dev_tags(self) -> list[list[str]]:
        return [list(s.tags) for s in self.dev]


def load_ner_data(train: Path, dev: Path | None, seq: int, tokenizer: Path | None = None) -> NerData:
    """Read `train` (and `dev`, when given) in the CoNLL-2003 layout and encode both at `seq`
    tokens with `tokenizer` (default: the bundled MiniLM's tokenizer.json)."""
    for what, path in (("--data", train), ("--eval", dev)):
        if path is not None and Path(path).is_dir():
            raise directory_given(path, "CoNLL", what)
    train_sents = read_conll(train)
    dev_sents = read_conll(dev) if dev is not None else []
    labels = label_set(label_list(train_sents + dev_sents))
    label_to_id = {t: i for i, t in enumerate(labels)}
    tok = load_tokenizer(tokenizer or default_tokenizer_path())
    train_enc = encode_sentences(tok, train_sents, label_to_id, seq)
    dev_enc = encode_sentences(tok, dev_sents, label_to_id, seq) if dev_sents else []
    return NerData(labels, train_sents, dev_sents, train_enc, dev_enc, seq)

