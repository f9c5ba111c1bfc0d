"""Hugging Face folders that load by the ecosystem's own calls: the tokenizer beside the weights.

A folder with config.json and model.safetensors but no tokenizer files is a trap: transformers'
`AutoTokenizer.from_pretrained(folder)` does not refuse it, it builds a tokenizer that knows a few
special tokens, and every prediction made with it is silently wrong. So every folder Confidant
writes for transformers (`export-trained --hf`, `export-adapter`, the adapter's base) gets the
model's real tokenizer, written by transformers' own `save_pretrained` (tokenizer.json,
tokenizer_config.json with the special tokens, and the chat template where the model has one).

Where the tokenizer comes from, first found:
- given (`--tokenizer`): a Hugging Face folder, or a tokenizer.json;
- the transformers checkpoint the ONNX file was exported from, if it has tokenizer files (a folder,
  or a .gguf file, whose tokenizer transformers reads);
- the tokenizer.json (and chat_template.json) `confidant export --task causal-lm` wrote beside it;
- for an encoder, the bundled MiniLM's, which every encoder command reads by default, when its
  vocabulary is the model's size (otherwise refused: no tokenizer is better than a wrong one).
A bare tokenizer.json becomes a transformers tokenizer with its special tokens named: the ones
Confidant's chat_template.json records for a causal LM (and its Jinja template), else the BERT
([CLS] [SEP] [PAD] [UNK] [MASK]) or RoBERTa (<s> </s> <pad> <unk> <mask>) ones its vocabulary has.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from jobs.common.errors import JobError

__all__ = ["TOKENIZER_FILES", "has_tokenizer_files", "load_hf_tokenizer", "write_hf_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
_BERT_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                  "mask_token": "[MASK]"}
_ROBERTA_SPECIALS = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
                     "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}


def has_tokenizer_files(folder: Path) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES)


def _quiet():
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    return lambda: hf_logging.set_verbosity(previous)


def load_hf_tokenizer(source: Path):
    """A transformers tokenizer from `source`: a Hugging Face folder with tokenizer files, a .gguf
    file, or a tokenizer.json (see the module docstring). JobError when there is none."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = Path(source)
    restore = _quiet()
    try:
        if source.is_dir():
            if (source / "tokenizer_config.json").is_file() or not (source / "tokenizer.json").is_file():
                if not has_tokenizer_files(source):
                    raise JobError(f"{source} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])})")
                return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
            source = source / "tokenizer.json"
        if source.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name, local_files_only=True)
        if not source.is_file():
            raise JobError(f"{source}: no such tokenizer file (give a tokenizer.json or a Hugging Face folder)")
        if (source.parent / "tokenizer_config.json").is_file() and source.name == "tokenizer.json":
            return AutoTokenizer.from_pretrained(str(source.parent), local_files_only=True)
        specials, template = _specials_of(source)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source), **specials)
        if template:
            tokenizer.chat_template = template
        return tokenizer
    except (OSError, ValueError) as exc:
        raise JobError(f"{source}: transformers cannot read a tokenizer from it ({exc})") from None
    finally:
        restore()


def _specials_of(tokenizer_json: Path) -> tuple[dict[str, str], str | None]:
    """The special tokens of a bare tokenizer.json, and the chat template (see the module docstring)."""
    from tasks.tokenize import load_tokenizer

    chat = tokenizer_json.parent / "chat_template.json"
    if chat.is_file():
        doc = json.loads(chat.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and doc.get("format") == "confidant-chat-template":
            specials = {k: doc[k] for k in ("bos_token", "eos_token", "pad_token") if doc.get(k)}
            return specials, doc.get("template")
    vocab = load_tokenizer(tokenizer_json).get_vocab(with_added_tokens=True)
    for table in (_BERT_SPECIALS, _ROBERTA_SPECIALS):
        if table["unk_token"] in vocab:
            return {k: t for k, t in table.items() if t in vocab}, None
    return {}, None


def write_hf_tokenizer(tokenizer, folder: Path) -> Path:
    """`tokenizer` saved into `folder` by transformers (tokenizer.json, tokenizer_config.json with the
    special tokens, chat_template.jinja where there is a template); the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def encoder_tokenizer(model_path: Path, sidecar: dict | None, given: Path | None):
    """(the transformers tokenizer of an exported encoder, where it came from): `given`, else the
    checkpoint its NAME.hf.json records, else the bundled MiniLM's when the vocabulary fits."""
    vocab = ((sidecar or {}).get("config") or {}).get("vocab_size")
    if given is not None:
        tokenizer = load_hf_tokenizer(Path(given))
        if vocab is not None and len(tokenizer) > int(vocab):
            raise JobError(f"--tokenizer {given}: {len(tokenizer)} tokens, more than the model's {vocab}: not the "
                           "tokenizer it was trained with")
        return tokenizer, Path(given)
    recorded = (sidecar or {}).get("checkpoint")
    if recorded and has_tokenizer_files(Path(recorded)):
        return load_hf_tokenizer(Path(recorded)), Path(recorded)
    from tasks.models import default_checkpoint_dir

    try:
        default = default_checkpoint_dir()
    except FileNotFoundError:
        default = None
    if default is not None and has_tokenizer_files(default):
        tokenizer = load_hf_tokenizer(default)
        if vocab is not None and len(tokenizer) <= int(vocab) and int(vocab) - len(tokenizer) < 64:
            return tokenizer, default
    raise JobError(f"{model_path}: no tokenizer found for it (its {Path(model_path).stem}.hf.json names no checkpoint "
                   f"with tokenizer files, and the bundled MiniLM's does not fit its {vocab} tokens): pass --tokenizer "
                   "(the tokenizer.json or Hugging Face folder it was trained with)")


def causal_lm_tokenizer(model_path: Path, base: Path | None):
    """(the transformers tokenizer of an exported causal LM, where it came from) or (None, None):
    the base checkpoint's (a folder with tokenizer files, or a .gguf file), else the tokenizer.json
    beside the ONNX file."""
    if base is not None and (Path(base).suffix == ".gguf" or has_tokenizer_files(Path(base))):
        return load_hf_tokenizer(Path(base)), Path(base)
    beside = Path(model_path).parent / "tokenizer.json"
    if beside.is_file():
        return load_hf_tokenizer(beside), beside
    return None, None
