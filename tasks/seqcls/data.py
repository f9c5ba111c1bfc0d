"""Sequence classification: GLUE-style files, a generated sample task, and the data of a run.

A file is TSV (tab-separated, `.tsv` or anything else) or CSV (comma-separated, `.csv`), one
example a row: `sentence,label` or `sentence,sentence2,label` (the label last). A first row naming
its columns (GLUE's `sentence\tlabel`, `sentence1\tsentence2\tlabel`, `text,label`, also with an
index column as in GLUE's test files) is read as a header; the columns are then found by name
(`label`; `sentence`, `sentence1`, `text`, `question`, `premise` for the first text;
`sentence2`, `question2`, `hypothesis` for the second). Quoting follows the csv module (a quoted
field may hold the delimiter). Errors name the file and line and are `ir.errors.InputFileError`s.

The generated task (`generate_reviews`) is three-way review sentiment (negative / neutral /
positive) from templates: what is reviewed, an opinion word and a frame, with the opinion words of
the evaluation split held out from training, so a model must learn what the words mean, not
memorise sentences. A fresh classifier head scores about one third; a few dozen steps of
fine-tuning of MiniLM get most sentences right.
"""
from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from ir.errors import InputFileError
from tasks.text_files import directory_given, read_utf8_text

__all__ = ["LabelledText", "SeqClsData", "generate_reviews", "label_order", "load_seqcls_data", "read_labelled",
           "write_labelled", "write_review_splits"]

FIRST = ("sentence", "sentence1", "text", "question", "question1", "premise", "text_a")
SECOND = ("sentence2", "question2", "hypothesis", "text_b")


@dataclass(frozen=True)
class LabelledText:
    """One example: a sentence (and an optional second one) with its label, as written."""

    text: str
    label: str
    text_pair: str | None = None


def _delimiter(path: Path, first_line: str) -> str:
    if path.suffix.lower() == ".csv":
        return ","
    if path.suffix.lower() == ".tsv" or "\t" in first_line:
        return "\t"
    return ","


def read_labelled(path: str | Path) -> list[LabelledText]:
    """Read a GLUE-style TSV/CSV file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        raise directory_given(path, "TSV/CSV")
    text = read_utf8_text(path)
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        raise InputFileError(f"{path}: no examples (the file is empty); write one `sentence<TAB>label` a line")
    delim = _delimiter(path, lines[0])
    rows, lines = _rows(text, delim)
    header = [c.strip().lower() for c in rows[0]]
    columns = None
    if "label" in header:
        label_at = header.index("label")
        first = next((header.index(c) for c in FIRST if c in header), None)
        second = next((header.index(c) for c in SECOND if c in header), None)
        if first is None:
            raise InputFileError(f"{path}:1: a header without a text column (one of {', '.join(FIRST)}): "
                                 f"{_shown(rows[0])}")
        columns, rows, lines = (first, second, label_at), rows[1:], lines[1:]
    start = lines[0] if lines else 1
    out: list[LabelledText] = []
    width = None
    for lineno, row in zip(lines, rows):
        if not row or all(not c.strip() for c in row):
            continue
        if columns is None:
            if width is None:
                width = len(row)
                if width not in (2, 3):
                    raise InputFileError(f"{path}:{lineno}: expected `sentence{delim!r}label` or "
                                         f"`sentence{delim!r}sentence2{delim!r}label`, got {len(row)} columns: {_shown(row)}")
            if len(row) != width:
                raise InputFileError(f"{path}:{lineno}: expected {width} columns like line {start}, got {len(row)}: "
                                     f"{_shown(row)} (quote a text that holds {delim!r})")
            a, b, label = (row[0], None, row[1]) if width == 2 else (row[0], row[1], row[2])
        else:
            need = max(c for c in columns if c is not None)
            if len(row) <= need:
                raise InputFileError(f"{path}:{lineno}: expected {len(header)} columns like the header, got "
                                     f"{len(row)}: {_shown(row)}")
            a, b, label = row[columns[0]], (row[columns[1]] if columns[1] is not None else None), row[columns[2]]
        label = label.strip()
        if not label:
            raise InputFileError(f"{path}:{lineno}: the label is empty: {_shown(row)}")
        if not a.strip():
            raise InputFileError(f"{path}:{lineno}: the sentence is empty: {_shown(row)}")
        out.append(LabelledText(a.strip(), label, b.strip() if b is not None else None))
    if not out:
        raise InputFileError(f"{path}: no examples after the header")
    return out


def _rows(text: str, delim: str) -> tuple[list[list[str]], list[int]]:
    """The file's rows and the line each starts on (a quoted field may hold line breaks). csv's
    field limit (128 KiB) is raised to the file's size for the read: a long text is a text."""
    reader = csv.reader(io.StringIO(text), delimiter=delim, quotechar='"')
    rows, lines, previous = [], [], 0
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))
    try:
        for row in reader:
            rows.append(row)
            lines.append(previous + 1)
            previous = reader.line_num
    finally:
        csv.field_size_limit(limit)
    return rows, lines


_SHOWN_CHARS = 160


def _shown(row: Sequence[str]) -> str:
    """A row for an error message, cut to a readable length (an unclosed quote can make one row of
    the rest of the file)."""
    text = repr(row)
    if len(text) <= _SHOWN_CHARS + 40:
        return text
    why = "; an unclosed quote takes the lines after it into one field" if any("\n" in c for c in row) else ""
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} characters{why})"


def write_labelled(path: str | Path, examples: Sequence[LabelledText]) -> Path:
    """Write examples as TSV with a GLUE header (`sentence\tlabel`, or with `sentence2`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pair = any(e.text_pair is not None for e in examples)
    buf = io.StringIO()
    w = csv.writer(buf, delimiter="\t", lineterminator="\n")
    w.writerow(["sentence", "sentence2", "label"] if pair else ["sentence", "label"])
    for e in examples:
        w.writerow([e.text, e.text_pair or "", e.label] if pair else [e.text, e.label])
    path.write_text(buf.getvalue())
    return path


def label_order(labels: Sequence[str]) -> tuple[str, ...]:
    """The label set in a stable order: numerically when every label is an integer (GLUE's 0/1),
    else alphabetically."""
    found = set(labels)
    try:
        return tuple(sorted(found, key=int))
    except ValueError:
        return tuple(sorted(found))


# --- the generated review-sentiment task -----------------------------------------------------

_THINGS = ("the film", "this movie", "the hotel", "the restaurant", "the service", "this phone", "the book",
           "the concert", "the app", "the meal", "our room", "the staff", "the show", "this laptop", "the trip",
           "the game", "the coffee", "the museum", "the course", "the update")
_OPINIONS = {
    "positive": ("wonderful", "excellent", "great", "fantastic", "superb", "delightful", "brilliant", "lovely",
                 "amazing", "outstanding", "charming", "impressive", "terrific", "perfect", "enjoyable", "marvelous"),
    "negative": ("terrible", "awful", "horrible", "dreadful", "poor", "disappointing", "boring", "bad", "miserable",
                 "lousy", "annoying", "useless", "unpleasant", "painful", "mediocre", "disgusting"),
    "neutral": ("okay", "average", "ordinary", "standard", "typical", "acceptable", "fine", "normal", "plain",
                "regular", "moderate", "usual", "adequate", "common", "so-so", "passable"),
}
_FRAMES = ("{thing} was {opinion}.", "honestly, {thing} was {opinion}.", "i found {thing} {opinion}.",
           "{thing} is {opinion}, as expected.", "we thought {thing} was {opinion}.",
           "all in all, {thing} felt {opinion}.", "my friends said {thing} was {opinion}.",
           "{thing} turned out {opinion}.", "in short: {opinion}. that is {thing} for you.",
           "after a week, {thing} still seems {opinion}.")
REVIEW_LABELS = ("negative", "neutral", "positive")


def generate_reviews(n: int, seed: int, split: str = "train") -> list[LabelledText]:
    """`n` review sentences with their sentiment; `split` "dev" uses the held-out opinion words."""
    rng = random.Random(f"{seed}/{split}")
    held = {label: words[-4:] for label, words in _OPINIONS.items()}
    pools = {label: (held[label] if split == "dev" else words[:-4]) for label, words in _OPINIONS.items()}
    out = []
    for _ in range(n):
        label = rng.choice(REVIEW_LABELS)
        sentence = rng.choice(_FRAMES).format(thing=rng.choice(_THINGS), opinion=rng.choice(pools[label]))
        out.append(LabelledText(sentence[0].upper() + sentence[1:], label))
    return out


def write_review_splits(folder: str | Path, n_train: int = 2000, n_dev: int = 300, seed: int = 0
                        ) -> tuple[Path, Path]:
    """folder/train.tsv and folder/dev.tsv of the generated review task."""
    folder = Path(folder)
    return (write_labelled(folder / "train.tsv", generate_reviews(n_train, seed, "train")),
            write_labelled(folder / "dev.tsv", generate_reviews(n_dev, seed, "dev")))


# --- the data of a run -------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class SeqClsData:
    """Training (and evaluation) examples, the label set and their encodings at `seq` tokens."""

    labels: tuple[str, ...]
    train: list[LabelledText]
    dev: list[LabelledText]
    train_encoded: list
    dev_encoded: list
    seq: int

    @property
    def dev_labels(self) -> list[str]:
        return [e.label for e in self.dev]


def load_seqcls_data(train: Path, dev: Path | None, seq: int, tokenizer: Path | None = None,
                     labels: Sequence[str] | None = None) -> SeqClsData:
    """Read `train` (and `dev`) and encode both with `tokenizer` (default: the bundled MiniLM's);
    `labels` fixes the label order (a model's own, from its export), else `label_order`."""
    from tasks.models import default_tokenizer_path
    from tasks.tokenize import encode_texts, load_tokenizer

    train_rows = read_labelled(train)
    dev_rows = read_labelled(dev) if dev is not None else []
    found = label_order([e.label for e in train_rows + dev_rows])
    order = tuple(labels) if labels else found
    if labels and set(found) - set(order) and all(label.isdigit() for label in found):
        # GLUE-style ids (0..N-1) for a model whose labels have names: id i is the model's i-th label
        # (an id past them stays as written, and is refused below)
        def named(e: LabelledText) -> LabelledText:
            return replace(e, label=order[int(e.label)]) if int(e.label) < len(order) else e
        train_rows, dev_rows = [named(e) for e in train_rows], [named(e) for e in dev_rows]
    for path, rows in ((train, train_rows), (dev, dev_rows)):
        unknown = sorted({e.label for e in rows} - set(order))
        if unknown:
            raise InputFileError(f"{path}: labels {unknown} are not among the model's {list(order)} (or their "
                                 f"indices 0-{len(order) - 1})")
    index = {label: i for i, label in enumerate(order)}
    tok = load_tokenizer(tokenizer or default_tokenizer_path())

    def encode(rows):
        return encode_texts(tok, [(e.text, e.text_pair) for e in rows], [index[e.label] for e in rows], seq)

    return SeqClsData(order, train_rows, dev_rows, encode(train_rows), encode(dev_rows) if dev_rows else [], seq)
