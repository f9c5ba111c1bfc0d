"""WordPiece encoding of NER sentences with word-level labels aligned to sub-tokens.

A BERT-class model sees sub-word pieces, while NER data and its metrics are
word-level.  The usual convention, used here, is to train and predict on
each word's first piece and to ignore (label -100, the ignore index of
cross-entropy losses) special tokens, continuation pieces and padding.
Tokenisation uses the model's own ``tokenizer.json`` through the
HuggingFace ``tokenizers`` library, so ids match the model's vocabulary
exactly.

Long sentences: ``encode_sentence`` truncates at a word boundary, so the
words past ``max_len`` get no label; ``decode_predictions`` then predicts
``O`` for them, which scores their entities as missed, never as spurious.
``encode_sentences`` avoids that loss by splitting an over-long sentence
into consecutive windows (preferring cuts outside entities) and
``decode_predictions`` stitches the windows back together, so every word
is trained on and scored.  Use it for training and evaluation.

Batches have a fixed sequence length so that on-device graphs keep static
shapes.  Everything here is numpy; the training code converts to tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
from tokenizers import Encoding, Tokenizer

from ir.errors import InputFileError
from tasks.ner.conll import Sentence, to_iob2

__all__ = [
    "CONLL_LABELS",
    "IGNORE_INDEX",
    "Batch",
    "Encoded",
    "decode_predictions",
    "encode_sentence",
    "encode_sentences",
    "encode_texts",
    "label_list",
    "load_tokenizer",
    "make_batches",
    "split_microbatches",
]

CONLL_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")

# PyTorch's CrossEntropyLoss ignore_index default; other frameworks mask on it.
IGNORE_INDEX = -100

_PAD_TOKEN = "[PAD]"


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a ``tokenizer.json`` with its padding and truncation switched off.

    Files exported for sentence embedding often pad or truncate every
    input to a fixed length; here truncation must happen at word
    boundaries and padding per batch, so both are done by this module.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p}")
    try:
        tokenizer = Tokenizer.from_file(str(p))
    except Exception as exc:  # the tokenizers library raises its own Exception for any damage
        raise InputFileError(f"{p}: not a readable tokenizer.json ({str(exc)[:200]}); use the tokenizer.json "
                             "exported with the model") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def label_list(sentences: Iterable[Sentence]) -> tuple[str, ...]:
    """All IOB2 tags used by ``sentences``: ``"O"`` first, the rest sorted.

    Tags are converted to IOB2 first, the scheme ``encode_sentence``
    trains on.  ``"O"`` is always included: it is the prediction for every
    word outside an entity, and for words lost to truncation.
    """
    tags = {tag for sentence in sentences for tag in to_iob2(sentence.tags)}
    tags.discard("O")
    return ("O", *sorted(tags))


@dataclass(frozen=True, eq=False)
class Encoded:
    """One encoded sentence, or one window of a long sentence, without padding.

    ``input_ids``, ``attention_mask``, ``token_type_ids`` and ``labels``
    are read-only int64 arrays of the same length (at most ``max_len``).
    ``word_ids[i]`` is the index, in the original sentence, of the word
    position ``i`` belongs to, or None for special tokens.  The encoding
    covers words ``word_offset`` to ``word_end - 1`` of a sentence of
    ``n_words`` words.  ``pad_id`` is the tokenizer's padding id, kept here
    so batching needs no tokenizer.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    labels: np.ndarray
    word_ids: tuple[int | None, ...]
    n_words: int
    word_offset: int
    pad_id: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def word_end(self) -> int:
        """One past the last word this encoding covers."""
        return max(w for w in self.word_ids if w is not None) + 1

    def first_subtoken_positions(self) -> list[tuple[int, int]]:
        """``(position, word index)`` of each covered word's first piece."""
        seen: set[int] = set()
        out = []
        for position, word in enumerate(self.word_ids):
            if word is not None and word not in seen:
                seen.add(word)
                out.append((position, word))
        return out


def _check_tokenizer(tokenizer: Tokenizer) -> int:
    """Return the pad id; refuse tokenizers that would pad or truncate."""
    if tokenizer.padding is not None or tokenizer.truncation is not None:
        raise ValueError(
            "tokenizer has padding or truncation enabled; load it with "
            "load_tokenizer() or call no_padding() and no_truncation() first"
        )
    pad_id = tokenizer.token_to_id(_PAD_TOKEN)
    if pad_id is None:
        raise ValueError(f"tokenizer vocabulary has no {_PAD_TOKEN} token")
    return pad_id


def _tag_ids(sentence: Sentence, label_to_id: Mapping[str, int]) -> list[int]:
    ids = []
    for i, tag in enumerate(to_iob2(sentence.tags)):
        if tag not in label_to_id:
            raise ValueError(
                f"word {i} ({sentence.tokens[i]!r}) has tag {tag!r}, which is not in "
                f"the label set {sorted(label_to_id)}"
            )
        ids.append(label_to_id[tag])
    return ids


def _visible_words(
    tokenizer: Tokenizer, words: Sequence[str], encoding: Encoding | None = None
) -> tuple[list[str], Encoding]:
    """Words with those that tokenise to nothing replaced by the unknown token.

    The BERT normaliser deletes control characters, soft hyphens,
    zero-width spaces and U+FFFD; a word made only of those would get no
    piece, hence no label and no prediction.  Mapping it to [UNK] keeps the
    one-piece-per-word guarantee.  Returns the words and their encoding
    without special tokens; ``encoding`` may pass that encoding in when it
    has already been computed.
    """
    words = list(words)
    if encoding is None:
        encoding = tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False)
    present = {w for w in encoding.word_ids if w is not None}
    missing = [i for i in range(len(words)) if i not in present]
    if missing:
        unk = getattr(tokenizer.model, "unk_token", None)
        # The stand-in only works if the unknown token's text is matched as
        # a whole (an added special token, as in every BERT tokenizer.json)
        # rather than tokenised as "[", "unk", "]".
        probe = unk and tokenizer.encode([unk], is_pretokenized=True, add_special_tokens=False)
        if not probe or probe.ids != [tokenizer.token_to_id(unk)]:
            raise ValueError(
                f"word {missing[0]} ({words[missing[0]]!r}) produces no token, and the "
                "tokenizer has no special unknown token to stand in for it"
            )
        for i in missing:
            words[i] = unk
        encoding = tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False)
    return words, encoding


def _encode_span(
    tokenizer: Tokenizer,
    words: Sequence[str],
    tag_ids: Sequence[int],
    start: int,
    end: int,
    max_len: int,
    pad_id: int,
    encoding: Encoding | None = None,
) -> Encoded:
    """Encode words[start:end] with special tokens, cutting at ``max_len``.

    The cut falls at the last word boundary that fits; only when the first
    word alone is too long is it cut inside the word (its first piece, and
    so its label, is kept).  ``encoding``, if given, is the encoding of
    words[start:end] without special tokens, saving a second tokenisation.
    """
    budget = max_len - tokenizer.num_special_tokens_to_add(False)
    if encoding is None:
        encoding = tokenizer.encode(
            list(words[start:end]), is_pretokenized=True, add_special_tokens=False
        )
    if len(encoding) > budget:
        local = encoding.word_ids
        cut = budget
        while cut > 0 and local[cut] == local[cut - 1]:
            cut -= 1
        encoding.truncate(cut if cut > 0 else budget)
    # post_process adds [CLS]/[SEP] (or whatever the model's template says)
    # and, with padding and truncation off, nothing else.
    encoding = tokenizer.post_process(encoding)

    word_ids = tuple(None if w is None else w + start for w in encoding.word_ids)
    labels = np.full(len(word_ids), IGNORE_INDEX, dtype=np.int64)
    seen: set[int] = set()
    for position, word in enumerate(word_ids):
        if word is not None and word not in seen:
            seen.add(word)
            labels[position] = tag_ids[word]

    arrays = [
        np.asarray(encoding.ids, dtype=np.int64),
        np.asarray(encoding.attention_mask, dtype=np.int64),
        np.asarray(encoding.type_ids, dtype=np.int64),
        labels,
    ]
    # Encodings are reused across epochs; read-only arrays make accidental
    # in-place edits fail loudly instead of corrupting later epochs.
    for a in arrays:
        a.setflags(write=False)
    return Encoded(*arrays, word_ids=word_ids, n_words=len(words), word_offset=start, pad_id=pad_id)


def _check_max_len(tokenizer: Tokenizer, max_len: int) -> None:
    n_special = tokenizer.num_special_tokens_to_add(False)
    if max_len < n_special + 1:
        raise ValueError(
            f"max_len={max_len} leaves no room for words after {n_special} special tokens"
        )


def encode_sentence(
    tokenizer: Tokenizer,
    sentence: Sentence,
    label_to_id: Mapping[str, int],
    max_len: int,
) -> Encoded:
    """Encode one sentence, truncating at a word boundary to ``max_len``.

    Tags are converted to IOB2 and each word's first piece gets its tag
    id; every other position gets IGNORE_INDEX.  Special tokens stay in
    place (``[SEP]`` remains last).  Words cut off by truncation carry no
    label; see ``encode_sentences`` for the lossless alternative.
    """
    pad_id = _check_tokenizer(tokenizer)
    _check_max_len(tokenizer, max_len)
    tag_ids = _tag_ids(sentence, label_to_id)
    words, encoding = _visible_words(tokenizer, sentence.tokens)
    return _encode_span(tokenizer, words, tag_ids, 0, len(words), max_len, pad_id, encoding)


def encode_sentences(
    tokenizer: Tokenizer,
    sentences: Iterable[Sentence],
    label_to_id: Mapping[str, int],
    max_len: int,
) -> list[Encoded]:
    """Encode sentences, splitting any that exceed ``max_len`` into windows.

    Each window is a separate Encoded, in order, with ``word_offset`` set;
    a window that starts inside an entity has that entity's first visible
    word labelled ``B-`` (IOB2 within the window).  Cuts are moved back to
    the nearest word that does not continue an entity when one exists in
    the window.  ``decode_predictions`` reassembles whole sentences, so
    keep the list's order when predicting.
    """
    pad_id = _check_tokenizer(tokenizer)
    _check_max_len(tokenizer, max_len)
    budget = max_len - tokenizer.num_special_tokens_to_add(False)
    sentences = list(sentences)
    # One batched call tokenises on all cores; most of the cost is here.
    raw = tokenizer.encode_batch(
        [list(s.tokens) for s in sentences], is_pretokenized=True, add_special_tokens=False
    )
    out: list[Encoded] = []
    for sentence, raw_encoding in zip(sentences, raw):
        iob2 = to_iob2(sentence.tags)
        tag_ids = _tag_ids(sentence, label_to_id)
        words, encoding = _visible_words(tokenizer, sentence.tokens, raw_encoding)
        n_pieces = np.bincount(
            [w for w in encoding.word_ids if w is not None], minlength=len(words)
        )
        if int(n_pieces.sum()) <= budget:
            out.append(
                _encode_span(tokenizer, words, tag_ids, 0, len(words), max_len, pad_id, encoding)
            )
            continue
        start = 0
        while start < len(words):
            end, used = start, 0
            while end < len(words) and used + n_pieces[end] <= budget:
                used += int(n_pieces[end])
                end += 1
            if end == start:
                end = start + 1
            elif end < len(words):
                cut = end
                while cut > start and iob2[cut].startswith("I-"):
                    cut -= 1
                if cut > start:
                    end = cut
            window_tags = list(tag_ids)
            # The window's first word may continue an entity from the
            # previous window; as the window's own first word it starts one.
            first = iob2[start]
            if first.startswith("I-"):
                b_tag = "B-" + first[2:]
                if b_tag not in label_to_id:
                    raise ValueError(f"tag {b_tag!r} is not in the label set {sorted(label_to_id)}")
                window_tags[start] = label_to_id[b_tag]
            out.append(_encode_span(tokenizer, words, window_tags, start, end, max_len, pad_id))
            start = end
    return out


@dataclass(frozen=True, eq=False)
class Batch:
    """A padded batch: int64 arrays of shape [B, S] plus the labelled count.

    Padding positions have the tokenizer's pad id, attention 0, token type
    0 and label IGNORE_INDEX.  ``n_labelled`` (labels != IGNORE_INDEX) is
    the denominator for a mean token loss; when accumulating gradients over
    micro-batches, divide by the full batch's count, not each micro-batch's,
    or the result depends on how the batch was split.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    labels: np.ndarray
    n_labelled: int
    # sequence classification: one label per row, at position 0 (the rest IGNORE_INDEX); the
    # model's targets are then [B, labels], not [B, S, labels]
    per_sequence: bool = False

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        for name in ("input_ids", "attention_mask", "token_type_ids", "labels"):
            a = getattr(self, name)
            if a.ndim != 2 or a.shape != shape or a.dtype != np.int64:
                raise ValueError(
                    f"Batch.{name} must be an int64 array of shape {shape}, "
                    f"got {a.dtype} {a.shape}"
                )

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def _stack(items: Sequence[Encoded], seq_len: int, pad_id: int, per_sequence: bool = False) -> Batch:
    b = len(items)
    input_ids = np.full((b, seq_len), pad_id, dtype=np.int64)
    attention_mask = np.zeros((b, seq_len), dtype=np.int64)
    token_type_ids = np.zeros((b, seq_len), dtype=np.int64)
    labels = np.full((b, seq_len), IGNORE_INDEX, dtype=np.int64)
    for row, e in enumerate(items):
        n = len(e)
        input_ids[row, :n] = e.input_ids
        attention_mask[row, :n] = e.attention_mask
        token_type_ids[row, :n] = e.token_type_ids
        labels[row, :n] = e.labels
    return Batch(
        input_ids, attention_mask, token_type_ids, labels,
        n_labelled=int(np.count_nonzero(labels != IGNORE_INDEX)), per_sequence=per_sequence,
    )


def make_batches(
    encoded: Sequence[Encoded],
    batch_size: int,
    seq_len: int,
    seed: int,
    shuffle: bool = True,
    drop_last: bool = False,
    per_sequence: bool = False,
) -> list[Batch]:
    """Group encodings into batches padded to exactly ``seq_len``.

    The order is a permutation drawn from ``seed`` (the same seed gives
    the same batches), or the input order when ``shuffle`` is False, which
    is what ``decode_predictions`` needs.  With ``drop_last`` False the
    last batch may hold fewer than ``batch_size`` rows.  An encoding
    longer than ``seq_len`` is an error, not silently cut.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if not encoded:
        return []
    for i, e in enumerate(encoded):
        if len(e) > seq_len:
            raise ValueError(f"encoding {i} has {len(e)} positions, more than seq_len={seq_len}")
    pad_ids = {e.pad_id for e in encoded}
    if len(pad_ids) > 1:
        raise ValueError(f"encodings come from different tokenizers (pad ids {sorted(pad_ids)})")
    pad_id = pad_ids.pop()

    n = len(encoded)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    return [
        _stack([encoded[int(i)] for i in order[lo:min(lo + batch_size, stop)]], seq_len, pad_id, per_sequence)
        for lo in range(0, stop, batch_size)
    ]


def microbatch_slices(size: int, m: int) -> list[slice]:
    """The row ranges of ``m`` equal micro-batches of a batch of ``size`` rows, in order (a
    ValueError when ``m`` does not divide it)."""
    if m < 1:
        raise ValueError(f"number of micro-batches must be at least 1, got {m}")
    if size % m:
        raise ValueError(f"batch size {size} is not divisible by {m} micro-batches")
    rows = size // m
    return [slice(k * rows, (k + 1) * rows) for k in range(m)]


def split_microbatches(batch: Batch, m: int) -> list[Batch]:
    """Split a batch into ``m`` equal micro-batches, in row order.

    The pieces are views of the batch's arrays.  Each has its own
    ``n_labelled``; see Batch for how to normalise an accumulated loss.
    """
    out = []
    for sl in microbatch_slices(batch.size, m):
        labels = batch.labels[sl]
        out.append(Batch(
            batch.input_ids[sl], batch.attention_mask[sl], batch.token_type_ids[sl], labels,
            n_labelled=int(np.count_nonzero(labels != IGNORE_INDEX)), per_sequence=batch.per_sequence,
        ))
    return out


def encode_texts(
    tokenizer: Tokenizer,
    texts: Sequence[tuple[str, str | None]],
    label_ids: Sequence[int],
    max_len: int,
) -> list[Encoded]:
    """Encode sentences (or sentence pairs) for sequence classification, one label per text.

    The tokenizer's own template adds the special tokens ([CLS] a [SEP] b [SEP] for BERT, with
    token types 0 then 1; <s> a </s></s> b </s> for RoBERTa). Too long a text is cut to
    ``max_len`` pieces, the longer of a pair first (the "longest first" rule of transformers'
    tokenizers). The label sits at position 0, the first token, the one a classifier reads; every
    other position is IGNORE_INDEX. ``word_ids`` marks position 0 as word 0, so the first-token
    bookkeeping of ``Encoded`` still holds.
    """
    pad_id = _check_tokenizer(tokenizer)
    _check_max_len(tokenizer, max_len)
    if len(texts) != len(label_ids):
        raise ValueError(f"{len(texts)} texts but {len(label_ids)} labels")
    out = []
    for (a, b), label in zip(texts, label_ids):
        enc = tokenizer.encode(a, b) if b is not None else tokenizer.encode(a)
        if len(enc.ids) > max_len:
            enc = _truncated_pair(tokenizer, a, b, max_len)
        n = len(enc.ids)
        labels = np.full(n, IGNORE_INDEX, np.int64)
        labels[0] = int(label)
        word_ids = (0,) + (None,) * (n - 1)
        out.append(Encoded(_readonly(enc.ids), _readonly(enc.attention_mask), _readonly(enc.type_ids),
                           _readonly(labels), word_ids, 1, 0, pad_id))
    return out


def _readonly(values) -> np.ndarray:
    a = np.asarray(values, np.int64).copy()
    a.setflags(write=False)
    return a


def _truncated_pair(tokenizer: Tokenizer, a: str, b: str | None, max_len: int) -> Encoding:
    """The text (pair) cut to max_len pieces by the tokenizer's own longest-first truncation,
    switched on for this one call (the module keeps truncation off everywhere else)."""
    tokenizer.enable_truncation(max_len, strategy="longest_first")
    try:
        return tokenizer.encode(a, b) if b is not None else tokenizer.encode(a)
    finally:
        tokenizer.no_truncation()


def decode_predictions(
    encoded_list: Sequence[Encoded],
    predicted_ids_per_sentence: Sequence[Sequence[int]] | np.ndarray,
    id_to_label: Mapping[int, str] | Sequence[str],
) -> list[list[str]]:
    """Turn per-position predicted label ids into word-level tags.

    ``predicted_ids_per_sentence[k]`` holds the predicted ids for
    ``encoded_list[k]`` (longer rows, e.g. padded to seq_len, are fine).
    Each word takes the prediction at its first piece.  Windows from
    ``encode_sentences`` are stitched back into one list per sentence; a
    word no encoding covers (cut by ``encode_sentence``'s truncation) is
    predicted ``"O"``.  Returns one tag list per original sentence.
    """
    if len(encoded_list) != len(predicted_ids_per_sentence):
        raise ValueError(
            f"{len(encoded_list)} encodings but {len(predicted_ids_per_sentence)} prediction rows"
        )
    sentences: list[list[str]] = []
    expected_offset = 0
    for k, (enc, row) in enumerate(zip(encoded_list, predicted_ids_per_sentence)):
        row = np.asarray(row)
        if row.ndim != 1 or row.shape[0] < len(enc):
            raise ValueError(
                f"prediction row {k} has shape {row.shape}, encoding {k} needs {len(enc)} positions"
            )
        if enc.word_offset == 0:
            sentences.append(["O"] * enc.n_words)
        elif not sentences or enc.word_offset != expected_offset or enc.n_words != len(sentences[-1]):
            raise ValueError(
                f"encoding {k} continues a sentence at word {enc.word_offset}, but the "
                f"previous encoding does not end there; keep encode_sentences' order"
            )
        tags = sentences[-1]
        for position, word in enc.first_subtoken_positions():
            label_id = int(row[position])
            try:
                if label_id < 0:
                    raise IndexError
                tags[word] = id_to_label[label_id]
            except (IndexError, KeyError):
                raise ValueError(
                    f"prediction row {k}, position {position}: unknown label id {label_id}"
                ) from None
        expected_offset = enc.word_end
    return sentences
