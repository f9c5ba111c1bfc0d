"""The synthetic CoNLL data generator: determinism, coverage and the dev split."""

import time

from tasks.ner.conll import read_conll, to_iob2
from tasks.ner.datagen import ENTITY_TYPES, TEMPLATES, generate, write_splits
from tasks.metrics import extract_entities


def entity_strings(sentences):
    return {
        (t, " ".join(s.tokens[a:b])) for s in sentences for t, a, b in extract_entities(s.tags)
    }


def test_deterministic_for_a_seed():
    assert generate(300, seed=7) == generate(300, seed=7)
    assert generate(300, seed=7) != generate(300, seed=8)
    # A shorter run is a prefix of a longer one.
    assert generate(50, seed=7) == generate(300, seed=7)[:50]


def test_tags_are_valid_iob2():
    for s in generate(1000, seed=1):
        assert to_iob2(s.tags) == s.tags, s
        assert all(" " not in t and t for t in s.tokens)


def test_covers_all_types_and_structures():
    sentences = generate(2000, seed=2)
    tags = {t for s in sentences for t in s.tags}
    for entity_type in ENTITY_TYPES:
        # I- tags for every type means multi-token entities of every type.
        assert {f"B-{entity_type}", f"I-{entity_type}"} <= tags
    assert tags <= {"O"} | {f"{p}-{t}" for p in "BI" for t in ENTITY_TYPES}

    assert any(set(s.tags) == {"O"} for s in sentences), "no sentence without entities"
    assert any(s.tags[0] != "O" for s in sentences), "no entity at sentence start"
    assert any(s.tags[-1] != "O" for s in sentences), "no entity at sentence end"

    same_type_adjacent = different_type_adjacent = False
    for s in sentences:
        spans = sorted(extract_entities(s.tags), key=lambda e: e[1])
        for (t1, _, end), (t2, start, _) in zip(spans, spans[1:]):
            if end == start:
                same_type_adjacent |= t1 == t2
                different_type_adjacent |= t1 != t2
    assert same_type_adjacent and different_type_adjacent


def test_no_name_repeats_within_a_sentence():
    # "Ajax beat Ajax" or a merger of a company with itself reads as noise.
    for s in generate(2000, seed=6):
        texts = [(t, s.tokens[a:b]) for t, a, b in extract_entities(s.tags)]
        assert len(texts) == len(set(texts)), s


def test_varied_vocabulary_and_templates():
    sentences = generate(3000, seed=4)
    assert len(TEMPLATES) >= 40
    names = entity_strings(sentences)
    for entity_type in ENTITY_TYPES:
        assert len({n for t, n in names if t == entity_type}) >= 40, entity_type
    # Some surface forms carry different types in different sentences.
    by_name = {}
    for t, n in names:
        by_name.setdefault(n, set()).add(t)
    assert any(len(types) > 1 for types in by_name.values())
    assert len({s.tokens[:3] for s in sentences}) > 500


def test_thousands_of_sentences_quickly():
    start = time.perf_counter()
    sentences = generate(5000, seed=5)
    assert len(sentences) == 5000
    assert time.perf_counter() - start < 5.0


def entity_words(sentences):
    return {(t[2:], w) for s in sentences for w, t in zip(s.tokens, s.tags) if t != "O"}


def test_write_splits(tmp_path):
    train_path, dev_path = write_splits(tmp_path / "data", n_train=6000, n_dev=400, seed=0)
    assert (train_path.name, dev_path.name) == ("train.txt", "dev.txt")
    train, dev = read_conll(train_path), read_conll(dev_path)
    assert (len(train), len(dev)) == (6000, 400)

    # 6000 sentences drawn from all names cover practically every entity
    # word in dev, so words the held-out train never shows must have been
    # held out on purpose.
    dev_words = entity_words(dev)
    unseen_in_train = dev_words - entity_words(train)
    unseen_in_full = dev_words - entity_words(generate(6000, seed=99))
    assert len(unseen_in_full) <= 0.02 * len(dev_words)
    assert len(unseen_in_train) >= 0.1 * len(dev_words)
    assert {t for t, _ in unseen_in_train} == set(ENTITY_TYPES)


def test_write_splits_deterministic(tmp_path):
    a = write_splits(tmp_path / "a", n_train=200, n_dev=50, seed=3)
    b = write_splits(tmp_path / "b", n_train=200, n_dev=50, seed=3)
    c = write_splits(tmp_path / "c", n_train=200, n_dev=50, seed=4)
    assert a[0].read_bytes() == b[0].read_bytes() and a[1].read_bytes() == b[1].read_bytes()
    assert a[0].read_bytes() != c[0].read_bytes()
    assert a[0].read_bytes() != a[1].read_bytes()
