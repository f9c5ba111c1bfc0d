"""Read and write NER data in the CoNLL-2003 column layout.

CoNLL-2003 is the benchmark layout for English named-entity recognition:
one token per line (``word POS chunk NER``), blank lines between
sentences, and ``-DOCSTART-`` lines between documents.  Everything the
fine-tuning pipeline consumes (the public benchmark files and this
project's synthetic data) goes through this module, so it is strict about
malformed input and reports the file and line of every problem: a silently
mis-parsed line would otherwise show up only as a mysteriously low F1.

The original CoNLL-2003 files use IOB1 (an entity may start with ``I-``;
``B-`` only separates two adjacent entities of the same type), while most
re-distributions use IOB2 (every entity starts with ``B-``).  Both are
accepted; by default the reader normalises to IOB2 so the rest of the
pipeline sees a single tagging scheme.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ir.errors import InputFileError

__all__ = [
    "DOCSTART",
    "PLACEHOLDER_POS",
    "PLACEHOLDER_CHUNK",
    "Sentence",
    "is_valid_tag",
    "read_conll",
    "to_iob2",
    "write_conll",
]

DOCSTART = "-DOCSTART-"

# Sentence carries no POS or chunk annotation, so the writer fills those
# columns with "-X-": the same marker CoNLL-2003 itself uses on its
# -DOCSTART- lines, so no tool mistakes it for a real Penn Treebank tag,
# and readers that take the NER tag from the last column are unaffected.
PLACEHOLDER_POS = "-X-"
PLACEHOLDER_CHUNK = "-X-"

_TAG_RE = re.compile(r"O|[BI]-\S+")
# BIOES (S- single, E- end) and BILOU (U- unit, L- last) tags, read as IOB2 when normalising
_SPAN_END_RE = re.compile(r"[SEUL]-\S+")
_AS_IOB2 = {"S": "B", "U": "B", "E": "I", "L": "I"}
# CoNLL columns are separated by ASCII spaces (tabs tolerated).  Splitting
# on str.split()'s Unicode whitespace would break words that contain, e.g.,
# a non-breaking space.
_COLUMN_SEP = re.compile(r"[ \t]+")


def is_valid_tag(tag: str) -> bool:
    """True for ``O``, ``B-TYPE`` and ``I-TYPE`` (TYPE non-empty, no whitespace)."""
    return isinstance(tag, str) and _TAG_RE.fullmatch(tag) is not None


@dataclass(frozen=True)
class Sentence:
    """One sentence: its words and one NER tag per word.

    Lists are accepted and stored as tuples so a Sentence is hashable and
    cannot be changed behind the back of code that already encoded it.
    """

    tokens: tuple[str, ...]
    tags: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "tags", tuple(self.tags))
        if len(self.tokens) != len(self.tags):
            raise ValueError(
                f"sentence has {len(self.tokens)} tokens but {len(self.tags)} tags"
            )
        # An empty sentence cannot be represented in CoNLL (it would be a
        # second blank line) and has nothing to label, so it is refused
        # here rather than vanishing on a write/read round trip.
        if not self.tokens:
            raise ValueError("sentence has no tokens")
        for i, tag in enumerate(self.tags):
            if not is_valid_tag(tag):
                raise ValueError(
                    f"token {i} ({self.tokens[i]!r}): invalid NER tag {tag!r} "
                    "(expected O, B-TYPE or I-TYPE)"
                )


def to_iob2(tags: Sequence[str]) -> tuple[str, ...]:
    """Convert IOB1 tags to IOB2; IOB2 input comes back unchanged.

    An ``I-X`` that does not continue an entity of type X (it follows
    ``O``, another type, or starts the sentence) begins a new entity, so it
    becomes ``B-X``.  ``B-`` tags already mark entity starts in both
    schemes and are kept.
    """
    out: list[str] = []
    prev = "O"
    for i, tag in enumerate(tags):
        if not is_valid_tag(tag):
            raise ValueError(
                f"position {i}: invalid NER tag {tag!r} (expected O, B-TYPE or I-TYPE)"
            )
        if tag.startswith("I-") and (prev == "O" or prev[2:] != tag[2:]):
            tag = "B-" + tag[2:]
        out.append(tag)
        prev = tag
    return tuple(out)


def read_conll(
    path: str | os.PathLike[str],
    tag_column: int = -1,
    *,
    iob2: bool = True,
    encoding: str = "utf-8",
) -> list[Sentence]:
    """Read a CoNLL-2003 style file into sentences.

    ``tag_column`` selects the NER column (default: last), the word is
    always column 0.  Every token line of a file must have the same number
    of columns, which catches lines damaged by stray spaces.
    ``-DOCSTART-`` lines are skipped and end the current sentence; blank
    lines end sentences; trailing whitespace, CRLF line ends, a UTF-8 BOM
    and a missing final blank line are tolerated.

    With ``iob2=True`` (the default) tags are normalised to IOB2 so IOB1
    files (the original CoNLL-2003 release), IOB2 files and BIOES / BILOU
    files (``S-``/``U-`` a one-token entity, ``E-``/``L-`` its last token)
    give the same result; ``iob2=False`` returns the tags exactly as
    written (O, B- and I- only).

    Raises ``ir.errors.InputFileError`` (a ValueError) naming ``path:line`` for malformed lines, and when
    the file holds no sentence at all.
    """
    name = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()

    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    n_columns: int | None = None
    n_columns_line = 0

    def flush() -> None:
        if words:
            sentence_tags = to_iob2(tags) if iob2 else tuple(tags)
            sentences.append(Sentence(tuple(words), sentence_tags))
            words.clear()
            tags.clear()

    # bytes.splitlines() breaks only on \n, \r\n and \r, so each physical
    # line keeps its number even when the text contains Unicode separators.
    for lineno, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode(encoding)
        except UnicodeDecodeError as e:
            raise InputFileError(f"{name}:{lineno}: not valid {encoding}: {e.reason}") from None
        if lineno == 1:
            line = line.lstrip("\ufeff")
        line = line.strip(" \t")
        if not line:
            flush()
            continue
        columns = _COLUMN_SEP.split(line)
        if columns[0] == DOCSTART:
            flush()
            continue
        if len(columns) < 2:
            raise InputFileError(
                f"{name}:{lineno}: expected at least 2 columns, got {len(columns)}: {line!r}"
            )
        if n_columns is None:
            n_columns, n_columns_line = len(columns), lineno
        elif len(columns) != n_columns:
            raise InputFileError(
                f"{name}:{lineno}: expected {n_columns} columns like line "
                f"{n_columns_line}, got {len(columns)}: {line!r}"
            )
        try:
            tag = columns[tag_column]
        except IndexError:
            raise InputFileError(
                f"{name}:{lineno}: tag_column {tag_column} is out of range for "
                f"{len(columns)} columns: {line!r}"
            ) from None
        if tag_column % len(columns) == 0:
            raise InputFileError(
                f"{name}:{lineno}: tag_column {tag_column} selects the word column"
            )
        if iob2 and _SPAN_END_RE.fullmatch(tag):
            tag = _AS_IOB2[tag[0]] + tag[1:]
        if not is_valid_tag(tag):
            raise InputFileError(
                f"{name}:{lineno}: invalid NER tag {tag!r} "
                f"(expected O, B-TYPE or I-TYPE; BIOES and BILOU tags are read as IOB2): {line!r}"
            )
        words.append(columns[0])
        tags.append(tag)
    flush()

    if not sentences:
        raise InputFileError(
            f"{name}: no sentences found (the file is empty or holds only "
            f"{DOCSTART} lines and blank lines)"
        )
    return sentences


def write_conll(
    path: str | os.PathLike[str],
    sentences: Iterable[Sentence],
    *,
    encoding: str = "utf-8",
) -> None:
    """Write sentences as a single CoNLL-2003 document.

    Layout: a ``-DOCSTART- -X- -X- O`` header and a blank line, then one
    ``word -X- -X- TAG`` line per token (see PLACEHOLDER_POS) with a blank
    line after every sentence.  Tags are written as given, so
    ``read_conll(path, iob2=False)`` returns exactly ``sentences``, and so
    does plain ``read_conll(path)`` when the tags are IOB2.

    Words that the reader could not give back unchanged (empty, containing
    whitespace, or equal to ``-DOCSTART-``) are refused with ValueError
    before anything is written.
    """
    lines = [f"{DOCSTART} -X- -X- O", ""]
    n = 0
    for index, sentence in enumerate(sentences):
        for i, (word, tag) in enumerate(zip(sentence.tokens, sentence.tags)):
            if not word or _has_separator(word) or word == DOCSTART:
                raise ValueError(
                    f"sentence {index}, token {i}: cannot write word {word!r} in "
                    f"CoNLL layout (it must be non-empty, contain no whitespace and "
                    f"not be {DOCSTART})"
                )
            lines.append(f"{word} {PLACEHOLDER_POS} {PLACEHOLDER_CHUNK} {tag}")
        lines.append("")
        n += 1
    if n == 0:
        raise ValueError("no sentences to write")
    with open(path, "w", encoding=encoding, newline="\n") as f:
        f.write("\n".join(lines) + "\n")


def _has_separator(word: str) -> bool:
    # Exactly the characters the reader treats as column or line breaks.
    return any(c in " \t\n\r" for c in word)
