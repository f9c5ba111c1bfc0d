"""`confidant predict` with a token classifier: words in (a CoNLL file's first column, or plain text
one sentence a line), a tag per word out, written as CoNLL or as JSONL with the entities."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence, TextIO

from tasks.classification import Prediction, read_input_text

_WORD = re.compile(r"\w+(?:[-'.]\w+)*|[^\w\s]", re.UNICODE)


def read_sentences(path: Path) -> list[list[str]]:
    """Words per sentence: a CoNLL file (its first column), or plain text, one sentence a line."""
    from tasks.ner.conll import is_valid_tag, read_conll

    text = read_input_text(path)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("-DOCSTART-")]
    if lines and all(len(line.split()) >= 2 and is_valid_tag(line.split()[-1]) for line in lines):
        return [list(s.tokens) for s in read_conll(path)]
    return [_WORD.findall(line) for line in text.splitlines() if line.strip()]


def predict_words(engine, tok, sentences, names, batch: int, seq: int, head: int) -> list[Prediction]:
    """The tags of every non-empty sentence's words (the argmax of the head's logits, `head` the
    block that makes them; a long sentence in windows, stitched back)."""
    from tasks.ner.conll import Sentence
    from tasks.tokenize import decode_predictions, encode_sentences
    from tasks.trainer import TrainConfig, predict as run

    sentences = [s for s in sentences if s]
    sents = [Sentence(tuple(w), ("O",) * len(w)) for w in sentences]
    encoded = encode_sentences(tok, sents, {n: i for i, n in enumerate(names)}, seq)
    preds = run(engine, encoded, TrainConfig(batch=batch, seq=seq), len(names), head)
    tags = decode_predictions(encoded, preds, list(names))
    return [Prediction(words=tuple(w), tags=tuple(t)) for w, t in zip(sentences, tags)]


def write_tags(predictions: Sequence[Prediction], out: TextIO, fmt: str) -> None:
    """CoNLL (word TAB tag, a blank line between sentences) or JSONL (words, tags, entities)."""
    from tasks.metrics import extract_entities

    for p in predictions:
        if fmt == "jsonl":
            entities = [{"type": t, "start": a, "end": b, "text": " ".join(p.words[a:b])}
                        for t, a, b in sorted(extract_entities(p.tags), key=lambda e: e[1])]
            out.write(json.dumps({"words": list(p.words), "tags": list(p.tags), "entities": entities},
                                 ensure_ascii=False) + "\n")
        else:
            out.write("".join(f"{w}\t{t}\n" for w, t in zip(p.words, p.tags)) + "\n")
