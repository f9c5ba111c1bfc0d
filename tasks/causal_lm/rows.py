"""The rows a causal-LM run trains and is scored on, at `--seq` tokens: JSONL conversations (long ones
cut, those whose answer starts past the row left out, and said) or plain text packed into rows
(`tasks.causal_lm.data`). Errors name the file and are `ir.errors.InputFileError`s."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ir.errors import InputFileError
from tasks.causal_lm.data import fit_conversations, load_lm_examples, read_instructions
from tasks.causal_lm.tokenizer import LmTokenizer


def _fitted(conversations, tokenizer: LmTokenizer, seq: int, what: str, note: Callable[[str], None] | None):
    """Rows of conversations at `seq` tokens (long ones cut, those with no answer left skipped), said."""
    fitted = fit_conversations(tokenizer, conversations, seq)
    line = fitted.summary(what)
    if line is not None and note is not None:
        note(line)
    if not fitted.rows and fitted.skipped:
        raise ValueError(f"every conversation's answer starts past token {seq}: raise --seq")
    return fitted.rows


def _rows_of(path: Path, tokenizer: LmTokenizer, seq: int, what: str, note: Callable[[str], None] | None):
    try:
        if path.suffix == ".jsonl":
            return _fitted(read_instructions(path), tokenizer, seq, f"{what} {path.name}", note)
        return load_lm_examples(path, tokenizer, seq)
    except (ValueError, OSError) as exc:  # the file, or what it holds at this --seq: fix the input
        raise InputFileError(f"{what} {path}: {exc}") from None


def train_rows_of(data: Path, tokenizer: LmTokenizer, seq: int, note: Callable[[str], None] | None = None):
    """The training rows of `data` at `seq` tokens; `note` hears how many conversations were cut or skipped."""
    rows = _rows_of(Path(data), tokenizer, seq, "--data", note)
    if not rows:
        raise InputFileError(f"--data {data}: no training rows")
    return rows


def dev_rows_of(eval_path: Path | None, tokenizer: LmTokenizer, seq: int, eval_limit: int | None = None,
                note: Callable[[str], None] | None = None):
    """(the first `eval_limit` evaluation conversations (None: all), their encoded rows); empty
    without a file."""
    dev = read_instructions(eval_path)[:eval_limit] if eval_path is not None else []
    if eval_path is not None and not dev:
        raise InputFileError(f"--eval {eval_path}: no conversations")
    try:
        return dev, (_fitted(dev, tokenizer, seq, f"--eval {Path(eval_path).name}", note) if dev else [])
    except ValueError as exc:
        raise InputFileError(f"--eval {eval_path}: {exc}") from None
