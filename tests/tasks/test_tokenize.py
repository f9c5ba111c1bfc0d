"""WordPiece encoding, label alignment, batching and decoding."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from support import TINY_VOCAB, make_tiny_tokenizer
from tasks.ner.conll import Sentence
from tasks.ner.datagen import generate
from tasks.tokenize import (
    CONLL_LABELS,
    IGNORE_INDEX,
    Batch,
    decode_predictions,
    encode_sentence,
    encode_sentences,
    label_list,
    load_tokenizer,
    make_batches,
    split_microbatches,
)

L2I = {label: i for i, label in enumerate(CONLL_LABELS)}
X = IGNORE_INDEX


@pytest.fixture(scope="module")
def real_tokenizer(tokenizer_path):
    return load_tokenizer(tokenizer_path)


def tokens_of(tokenizer, encoded):
    return [tokenizer.id_to_token(int(i)) for i in encoded.input_ids]


# --- loading -------------------------------------------------------------------


def test_load_tokenizer_missing_file(tmp_path):
    missing = tmp_path / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*tokenizer.json"):
        load_tokenizer(missing)


def test_load_tokenizer_switches_off_file_padding_and_truncation(tokenizer_path):
    raw = Tokenizer.from_file(str(tokenizer_path))
    # The shipped file pads and truncates to 128; the loader must undo both.
    assert raw.padding is not None and raw.truncation is not None
    tok = load_tokenizer(tokenizer_path)
    assert tok.padding is None and tok.truncation is None


def test_encode_refuses_a_padding_tokenizer(tokenizer_path):
    raw = Tokenizer.from_file(str(tokenizer_path))
    with pytest.raises(ValueError, match="padding or truncation enabled"):
        encode_sentence(raw, Sentence(("EU",), ("B-ORG",)), L2I, 16)


# --- alignment -----------------------------------------------------------------


def test_labels_on_first_subtoken_only(real_tokenizer):
    s = Sentence(("Schwarzenegger", "visited", "Ouagadougou", "."), ("B-PER", "O", "B-LOC", "O"))
    e = encode_sentence(real_tokenizer, s, L2I, 32)
    assert tokens_of(real_tokenizer, e) == [
        "[CLS]", "schwarz", "##ene", "##gger", "visited",
        "ou", "##aga", "##dou", "##go", "##u", ".", "[SEP]",
    ]
    assert e.labels.tolist() == [
        X, L2I["B-PER"], X, X, L2I["O"], L2I["B-LOC"], X, X, X, X, L2I["O"], X,
    ]
    assert e.word_ids == (None, 0, 0, 0, 1, 2, 2, 2, 2, 2, 3, None)
    assert e.attention_mask.tolist() == [1] * 12
    assert e.token_type_ids.tolist() == [0] * 12
    for a in (e.input_ids, e.attention_mask, e.token_type_ids, e.labels):
        assert a.dtype == np.int64 and not a.flags.writeable
    assert (e.n_words, e.word_offset, e.word_end, len(e)) == (4, 0, 4, 12)


def test_alignment_on_generated_data(real_tokenizer):
    sentences = generate(200, seed=5)
    cls_id, sep_id = real_tokenizer.token_to_id("[CLS]"), real_tokenizer.token_to_id("[SEP]")
    n_split_words = 0
    for s in sentences:
        e = encode_sentence(real_tokenizer, s, L2I, 128)
        assert e.input_ids[0] == cls_id and e.input_ids[-1] == sep_id
        labelled = np.flatnonzero(e.labels != X).tolist()
        firsts = [p for p, _ in e.first_subtoken_positions()]
        assert labelled == firsts
        assert [int(e.labels[p]) for p in firsts] == [L2I[t] for t in s.tags]
        n_split_words += len(e) - 2 - len(s.tokens)
    assert n_split_words > 100, "test data should contain many multi-piece words"


def test_iob1_tags_are_labelled_as_iob2(real_tokenizer):
    s = Sentence(("EU", "rejects", "German", "Paris", "Rome"), ("I-ORG", "O", "I-MISC", "I-LOC", "B-LOC"))
    e = encode_sentence(real_tokenizer, s, L2I, 32)
    got = [CONLL_LABELS[e.labels[p]] for p, _ in e.first_subtoken_positions()]
    assert got == ["B-ORG", "O", "B-MISC", "B-LOC", "B-LOC"]


def test_unknown_tag_is_an_error(real_tokenizer):
    s = Sentence(("Oslo", "rocks"), ("B-LOC", "B-XYZ"))
    with pytest.raises(ValueError, match=r"word 1 \('rocks'\) has tag 'B-XYZ', which is not in"):
        encode_sentence(real_tokenizer, s, L2I, 32)


def test_word_that_normalises_away_becomes_unk(tiny_tokenizer):
    s = Sentence(("Rome", "\u200b", "x"), ("B-LOC", "O", "O"))
    e = encode_sentence(tiny_tokenizer, s, L2I, 16)
    assert tokens_of(tiny_tokenizer, e) == ["[CLS]", "rome", "[UNK]", "x", "[SEP]"]
    assert e.labels.tolist() == [X, L2I["B-LOC"], L2I["O"], L2I["O"], X]


def test_word_that_normalises_away_without_special_unk():
    tok = make_tiny_tokenizer(special_tokens=False)
    s = Sentence(("Rome", "\u200b"), ("B-LOC", "O"))
    with pytest.raises(ValueError, match=r"word 1 \('\\u200b'\) produces no token"):
        encode_sentence(tok, s, L2I, 16)


# --- truncation and windows ----------------------------------------------------

# Pieces per word with the tiny vocabulary: 1, 3, 1, 1.
LONG = Sentence(("Rome", "unbelievable", "x", "Rome"), ("B-LOC", "B-PER", "O", "B-LOC"))


def test_truncation_cuts_at_word_boundary_and_keeps_sep(tiny_tokenizer):
    e = encode_sentence(tiny_tokenizer, LONG, L2I, 5)
    # Three word pieces fit, but the third would split "unbelievable".
    assert tokens_of(tiny_tokenizer, e) == ["[CLS]", "rome", "[SEP]"]
    assert e.labels.tolist() == [X, L2I["B-LOC"], X]

    e = encode_sentence(tiny_tokenizer, LONG, L2I, 6)
    assert tokens_of(tiny_tokenizer, e) == ["[CLS]", "rome", "un", "##believ", "##able", "[SEP]"]
    assert e.labels.tolist() == [X, L2I["B-LOC"], L2I["B-PER"], X, X, X]
    assert (e.n_words, e.word_end) == (4, 2)

    # Truncated words come back as "O" predictions.
    pred = e.labels.copy()
    pred[pred == X] = 0
    assert decode_predictions([e], [pred], CONLL_LABELS) == [["B-LOC", "B-PER", "O", "O"]]


def test_truncation_inside_an_overlong_first_word(tiny_tokenizer):
    s = Sentence(("unbelievable", "x"), ("B-MISC", "O"))
    e = encode_sentence(tiny_tokenizer, s, L2I, 4)
    assert tokens_of(tiny_tokenizer, e) == ["[CLS]", "un", "##believ", "[SEP]"]
    assert e.labels.tolist() == [X, L2I["B-MISC"], X, X]


def test_windows_around_an_overlong_word(tiny_tokenizer):
    s = Sentence(("x", "unbelievable", "x"), ("O", "B-MISC", "O"))
    windows = encode_sentences(tiny_tokenizer, [s], L2I, 4)
    assert [tokens_of(tiny_tokenizer, w) for w in windows] == [
        ["[CLS]", "x", "[SEP]"],
        ["[CLS]", "un", "##believ", "[SEP]"],
        ["[CLS]", "x", "[SEP]"],
    ]
    assert decode_predictions(windows, [w.labels.clip(0) for w in windows], CONLL_LABELS) == [
        ["O", "B-MISC", "O"]
    ]


def test_max_len_without_room_for_words(tiny_tokenizer):
    with pytest.raises(ValueError, match="max_len=2 leaves no room for words after 2 special tokens"):
        encode_sentence(tiny_tokenizer, LONG, L2I, 2)


def test_encode_sentences_windows_long_sentences(tiny_tokenizer):
    words = ("Rome", "unbelievable", "unbelievable", "x", "Rome", "x")  # pieces 1 3 3 1 1 1
    tags = ("B-LOC", "B-PER", "I-PER", "O", "B-ORG", "O")
    windows = encode_sentences(tiny_tokenizer, [Sentence(words, tags)], L2I, 6)
    # The first window could hold words 0-1, but ending there would split
    # the PER entity, so it stops after word 0.  The entity is longer than
    # a window, so it must be split; its second half starts with B-.
    assert [(w.word_offset, w.word_end) for w in windows] == [(0, 1), (1, 2), (2, 4), (4, 6)]
    for w in windows:
        assert len(w) <= 6 and tokens_of(tiny_tokenizer, w)[-1] == "[SEP]"
        assert w.n_words == 6
    labelled_words = [word for w in windows for _, word in w.first_subtoken_positions()]
    assert labelled_words == list(range(6))
    window_tags = [CONLL_LABELS[w.labels[p]] for w in windows for p, _ in w.first_subtoken_positions()]
    assert window_tags == ["B-LOC", "B-PER", "B-PER", "O", "B-ORG", "O"]
    assert decode_predictions(windows, [w.labels.clip(0) for w in windows], CONLL_LABELS) == [
        window_tags
    ]


def test_encode_sentences_matches_encode_sentence_and_decodes_gold(real_tokenizer):
    sentences = generate(150, seed=9)
    many = encode_sentences(real_tokenizer, sentences, L2I, 128)
    assert len(many) == len(sentences)
    for s, e in zip(sentences, many):
        one = encode_sentence(real_tokenizer, s, L2I, 128)
        assert np.array_equal(e.input_ids, one.input_ids) and np.array_equal(e.labels, one.labels)
        assert e.word_ids == one.word_ids
    decoded = decode_predictions(many, [e.labels.clip(0) for e in many], CONLL_LABELS)
    assert decoded == [list(s.tags) for s in sentences]

    # With windows forced by a short max_len, decoding still gives one
    # full-length tag list per sentence.
    windows = encode_sentences(real_tokenizer, sentences, L2I, 12)
    assert len(windows) > len(sentences)
    assert all(len(w) <= 12 for w in windows)
    decoded = decode_predictions(windows, [w.labels.clip(0) for w in windows], CONLL_LABELS)
    assert [len(d) for d in decoded] == [len(s.tokens) for s in sentences]


# --- labels --------------------------------------------------------------------


def test_label_list():
    sentences = [
        Sentence(("a", "b", "c"), ("I-ORG", "I-ORG", "O")),
        Sentence(("d", "e"), ("B-LOC", "B-LOC")),
    ]
    assert label_list(sentences) == ("O", "B-LOC", "B-ORG", "I-ORG")
    assert label_list([Sentence(("a",), ("B-PER",))]) == ("O", "B-PER")
    assert set(label_list(generate(500, seed=0))) == set(CONLL_LABELS)


# --- batching ------------------------------------------------------------------


def xs_encodings(tokenizer, n):
    # Sentence k has k+1 words, so a row's attention sum (k+3) identifies it.
    return [
        encode_sentence(tokenizer, Sentence(("x",) * (k + 1), ("B-PER",) + ("I-PER",) * k), L2I, 64)
        for k in range(n)
    ]


def row_ids(batch):
    return (batch.attention_mask.sum(axis=1) - 3).tolist()


def test_make_batches_pads_to_fixed_length(tiny_tokenizer):
    enc = xs_encodings(tiny_tokenizer, 5)
    batches = make_batches(enc, batch_size=2, seq_len=10, seed=0, shuffle=False)
    assert [b.input_ids.shape for b in batches] == [(2, 10), (2, 10), (1, 10)]
    b = batches[1]
    assert row_ids(b) == [2, 3]
    # Row 0 is sentence 2: [CLS] x x x [SEP] then padding.
    assert b.input_ids[0].tolist() == [2, 8, 8, 8, 3] + [TINY_VOCAB["[PAD]"]] * 5
    assert b.attention_mask[0].tolist() == [1] * 5 + [0] * 5
    assert b.token_type_ids[0].tolist() == [0] * 10
    assert b.labels[0].tolist() == [X, L2I["B-PER"], L2I["I-PER"], L2I["I-PER"], X] + [X] * 5
    assert b.n_labelled == 3 + 4
    assert all(a.dtype == np.int64 for a in (b.input_ids, b.attention_mask, b.token_type_ids, b.labels))


def test_make_batches_pad_id_comes_from_tokenizer(real_tokenizer):
    enc = [encode_sentence(real_tokenizer, Sentence(("hi",), ("O",)), L2I, 8)]
    (b,) = make_batches(enc, batch_size=1, seq_len=6, seed=0)
    assert b.input_ids[0, 3:].tolist() == [real_tokenizer.token_to_id("[PAD]")] * 3


def test_make_batches_shuffle_is_seeded(tiny_tokenizer):
    enc = xs_encodings(tiny_tokenizer, 20)

    def order(**kw):
        return [i for b in make_batches(enc, batch_size=4, seq_len=24, **kw) for i in row_ids(b)]

    assert order(seed=1) == order(seed=1)
    assert order(seed=1) != order(seed=2)
    assert sorted(order(seed=1)) == list(range(20))
    assert order(seed=1) != list(range(20))
    assert order(seed=1, shuffle=False) == list(range(20))


def test_make_batches_drop_last(tiny_tokenizer):
    enc = xs_encodings(tiny_tokenizer, 7)
    assert [b.size for b in make_batches(enc, 3, 12, seed=0)] == [3, 3, 1]
    kept = make_batches(enc, 3, 12, seed=0, drop_last=True)
    assert [b.size for b in kept] == [3, 3]
    assert make_batches([], 3, 12, seed=0) == []


def test_make_batches_rejects_too_long(tiny_tokenizer):
    enc = xs_encodings(tiny_tokenizer, 5)
    with pytest.raises(ValueError, match="encoding 3 has 6 positions, more than seq_len=5"):
        make_batches(enc, 2, 5, seed=0)
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        make_batches(enc, 0, 10, seed=0)


def test_split_microbatches(tiny_tokenizer):
    (batch,) = make_batches(xs_encodings(tiny_tokenizer, 6), 6, 12, seed=3)
    parts = split_microbatches(batch, 3)
    assert [p.input_ids.shape for p in parts] == [(2, 12)] * 3
    for name in ("input_ids", "attention_mask", "token_type_ids", "labels"):
        assert np.array_equal(np.concatenate([getattr(p, name) for p in parts]), getattr(batch, name))
    assert [p.n_labelled for p in parts] == [
        int((p.labels != X).sum()) for p in parts
    ]
    assert sum(p.n_labelled for p in parts) == batch.n_labelled == sum(range(1, 7))
    assert split_microbatches(batch, 1)[0].n_labelled == batch.n_labelled


def test_split_microbatches_errors(tiny_tokenizer):
    (batch,) = make_batches(xs_encodings(tiny_tokenizer, 6), 6, 12, seed=0)
    with pytest.raises(ValueError) as err:
        split_microbatches(batch, 4)
    assert str(err.value) == "batch size 6 is not divisible by 4 micro-batches"
    with pytest.raises(ValueError, match="at least 1, got 0"):
        split_microbatches(batch, 0)


def test_batch_checks_arrays():
    ok = np.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="Batch.labels must be an int64 array of shape"):
        Batch(ok, ok, ok, np.zeros((2, 3), dtype=np.int32), n_labelled=0)
    with pytest.raises(ValueError, match=r"Batch.attention_mask must be .* got int64 \(2, 4\)"):
        Batch(ok, np.zeros((2, 4), dtype=np.int64), ok, ok, n_labelled=0)


# --- decoding ------------------------------------------------------------------


def test_decode_uses_first_subtoken_and_padded_rows(real_tokenizer):
    sentences = [
        Sentence(("Schwarzenegger", "visited", "Ouagadougou"), ("B-PER", "O", "B-LOC")),
        Sentence(("EU", "rejects", "German", "lamb"), ("B-ORG", "O", "B-MISC", "O")),
    ]
    enc = encode_sentences(real_tokenizer, sentences, L2I, 32)
    (batch,) = make_batches(enc, batch_size=2, seq_len=16, seed=0, shuffle=False)
    pred = np.where(batch.labels == X, L2I["I-MISC"], batch.labels)
    # Continuation pieces and special tokens predict I-MISC; only first
    # pieces may count.
    assert decode_predictions(enc, pred, CONLL_LABELS) == [list(s.tags) for s in sentences]
    id_to_label = dict(enumerate(CONLL_LABELS))
    assert decode_predictions(enc, list(pred), id_to_label) == [list(s.tags) for s in sentences]


def test_decode_errors(tiny_tokenizer):
    enc = xs_encodings(tiny_tokenizer, 2)
    with pytest.raises(ValueError, match="2 encodings but 1 prediction rows"):
        decode_predictions(enc, [np.zeros(8, dtype=np.int64)], CONLL_LABELS)
    with pytest.raises(ValueError, match=r"prediction row 1 has shape \(3,\), encoding 1 needs 4"):
        decode_predictions(enc, [np.zeros(8), np.zeros(3)], CONLL_LABELS)
    with pytest.raises(ValueError, match="prediction row 0, position 1: unknown label id 9"):
        decode_predictions(enc, [np.full(8, 9), np.zeros(8)], CONLL_LABELS)
    with pytest.raises(ValueError, match="prediction row 0, position 1: unknown label id -1"):
        decode_predictions(enc, [np.full(8, -1), np.zeros(8)], CONLL_LABELS)

    windows = encode_sentences(tiny_tokenizer, [LONG], L2I, 5)
    assert len(windows) >= 2
    with pytest.raises(ValueError, match="encoding 0 continues a sentence at word"):
        decode_predictions(windows[1:], [np.zeros(8)] * (len(windows) - 1), CONLL_LABELS)
