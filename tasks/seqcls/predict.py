"""`confidant predict` with a sequence classifier: texts (or pairs) in, a label and the label
probabilities per text out, written as JSONL or as TSV (text TAB label)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, TextIO

import numpy as np

from tasks.classification import Prediction, read_input_text


def read_texts(path: Path) -> list[tuple[str, str | None]]:
    """Texts (or pairs) to label: TSV/CSV `sentence[,sentence2][,label]` with a header, or one a line."""
    import csv
    import io

    from tasks.seqcls.data import FIRST, SECOND

    text = read_input_text(path)
    if path.suffix.lower() in (".tsv", ".csv"):
        rows = list(csv.reader(io.StringIO(text), delimiter="," if path.suffix.lower() == ".csv" else "\t"))
        header = [c.strip().lower() for c in rows[0]] if rows else []
        first = next((header.index(c) for c in FIRST if c in header), None)
        if first is not None:
            second = next((header.index(c) for c in SECOND if c in header), None)
            return [(r[first], r[second] if second is not None else None) for r in rows[1:]
                    if any(c.strip() for c in r)]
        return [(r[0], r[1] if len(r) > 2 else None) for r in rows if r and r[0].strip()]
    return [(line.strip(), None) for line in text.splitlines() if line.strip()]


def predict_texts(engine, tok, texts, names, batch: int, seq: int, head: int) -> list[Prediction]:
    """The label of every text (the argmax of the head's logits, `head` the block that makes them)
    and the softmax over the labels, rounded to 6 places."""
    from tasks.tokenize import encode_texts, make_batches
    from tasks.trainer import batch_feeds, pad_batch

    encoded = encode_texts(tok, texts, [0] * len(texts), seq)
    out: list[Prediction] = []
    rows = iter(texts)
    for b in make_batches(encoded, batch, seq, seed=0, shuffle=False, per_sequence=True):
        logits = engine.forward(batch_feeds(pad_batch(b, batch), len(names)), train=False, until_block=head)[:b.size]
        z = np.exp(logits - logits.max(-1, keepdims=True))
        probs = z / z.sum(-1, keepdims=True)
        for p in probs:
            a, pair = next(rows)
            out.append(Prediction(text=a, text_pair=pair, label=names[int(np.argmax(p))],
                                  scores={n: round(float(x), 6) for n, x in zip(names, p)}))
    return out


def write_labels(predictions: Sequence[Prediction], out: TextIO, fmt: str) -> None:
    """JSONL (text, text_pair, label, scores) or TSV (text [TAB text_pair] TAB label)."""
    for p in predictions:
        if fmt == "jsonl":
            doc = {"text": p.text, **({"text_pair": p.text_pair} if p.text_pair is not None else {}),
                   "label": p.label, "scores": dict(p.scores)}
            out.write(json.dumps(doc, ensure_ascii=False) + "\n")
        else:
            cells = [p.text or ""] + ([p.text_pair] if p.text_pair is not None else []) + [p.label or ""]
            out.write("\t".join(cells) + "\n")
