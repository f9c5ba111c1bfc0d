"""Causal language-model data: plain text packed into fixed-length rows, JSONL instruction data, and the
batches and graph inputs of next-token training.

Two sources:
- plain text (any file that is not .jsonl): documents separated by blank lines, each tokenised (with the
  post-processor's special tokens, e.g. a bos token where the model uses one) and followed by the
  end-of-sequence token, concatenated into one stream and cut into rows of exactly `seq_len` tokens
  (the last row shorter, padded). Every token of a row but the first is a target. Rows are independent
  samples; a row may hold the end of one document and the start of the next, which attend to each
  other (the graph's mask is padding only), as in the usual packing.
- JSONL instructions: one object per line, `{"prompt": ..., "response": ...}` (optional `"system"`) or
  `{"messages": [{"role", "content"}, ...]}`, rendered with the model's chat template (tasks/causal_lm/tokenizer.py),
  one conversation per row. Only the assistant's tokens are targets (its content and its end-of-sequence
  token), never the prompt's.

The training interface (what the graph's causal-LM loss reads), per (micro-)batch of B rows of S tokens:
    input_ids       int64   [B, S]  token ids; padding positions hold the pad id
    attention_mask  int64   [B, S]  1 on tokens, 0 on padding (padding is always on the right)
    target_ids      int64   [B, S]  at position t: the id of token t+1 when that token is a target,
                                    else 0
    target_weights  float32 [B, S]  1 / (number of targets in the whole batch) where position t has a
                                    target, else 0
so that loss = sum over positions of target_weights x cross_entropy(logits[b, t], target_ids[b, t]) is the
mean next-token loss of the batch. Positions without a target: padding, the last position of a row
(token t+1 is not in the row) and, for instruction data, every position whose next token is prompt. The
weights carry the whole batch's count, so the losses and gradients of micro-batches sum to exactly the
batch's (`microbatch_feeds`), however the batch is split.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from ir.errors import InputFileError
from tasks.text_files import read_utf8_text
from tasks.causal_lm.tokenizer import check_messages

if TYPE_CHECKING:
    from tasks.causal_lm.tokenizer import LmTokenizer

__all__ = ["FittedConversations", "LmBatch", "LmExample", "encode_instructions", "fit_conversations", "load_lm_examples", "lm_feeds", "make_lm_batches",
           "microbatch_feeds", "pack_documents", "pad_lm_batch", "read_instructions", "read_text_documents",
           "split_microbatches"]


@dataclass(frozen=True, eq=False)
class LmExample:
    """One row before padding: `ids` and, per token, whether it is a target (predicted from the token
    before it; the first token's flag is never used). Read-only int64 / bool arrays of one length."""
    ids: np.ndarray
    counted: np.ndarray

    def __post_init__(self) -> None:
        if self.ids.ndim != 1 or self.ids.shape != self.counted.shape:
            raise ValueError(f"LmExample: ids {self.ids.shape} and counted {self.counted.shape} differ")

    @classmethod
    def of(cls, ids: Sequence[int], counted: Sequence[bool]) -> "LmExample":
        a, c = np.asarray(ids, np.int64), np.asarray(counted, bool)
        a.setflags(write=False)
        c.setflags(write=False)
        return cls(a, c)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_targets(self) -> int:
        return int(self.counted[1:].sum())


@dataclass(frozen=True, eq=False)
class LmBatch:
    """A padded batch of next-token targets (module docstring: the shapes and what each holds).

    `target_mask` (int64 [B, S], 1 where position t has a target) and `n_targets` (its sum) are what
    the weights are made of: `lm_feeds(batch, n_targets_total)` divides by the whole batch's count.
    """
    input_ids: np.ndarray
    attention_mask: np.ndarray
    target_ids: np.ndarray
    target_mask: np.ndarray
    n_targets: int

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        for name in ("input_ids", "attention_mask", "target_ids", "target_mask"):
            a = getattr(self, name)
            if a.ndim != 2 or a.shape != shape or a.dtype != np.int64:
                raise ValueError(f"LmBatch.{name} must be an int64 array of shape {shape}, got {a.dtype} {a.shape}")

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq(self) -> int:
        return int(self.input_ids.shape[1])


def lm_feeds(batch: LmBatch, n_targets_total: int | None = None) -> dict[str, np.ndarray]:
    """The graph inputs of a (micro-)batch: input_ids, attention_mask, target_ids, target_weights.
    `n_targets_total` is the count of the whole batch this one was split from (default: its own)."""
    count = batch.n_targets if n_targets_total is None else int(n_targets_total)
    weights = np.zeros(batch.target_mask.shape, np.float32)
    if count:
        weights[batch.target_mask != 0] = np.float32(1.0 / count)
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "target_ids": batch.target_ids, "target_weights": weights}


def _stack(items: Sequence[LmExample], seq_len: int, pad_id: int) -> LmBatch:
    b = len(items)
    input_ids = np.full((b, seq_len), pad_id, np.int64)
    attention_mask = np.zeros((b, seq_len), np.int64)
    target_ids = np.zeros((b, seq_len), np.int64)
    target_mask = np.zeros((b, seq_len), np.int64)
    for row, e in enumerate(items):
        n = len(e)
        input_ids[row, :n] = e.ids
        attention_mask[row, :n] = 1
        counted = e.counted[1:n]
        target_mask[row, :n - 1] = counted
        target_ids[row, :n - 1] = np.where(counted, e.ids[1:n], 0)
    return LmBatch(input_ids, attention_mask, target_ids, target_mask, int(target_mask.sum()))


def make_lm_batches(examples: Sequence[LmExample], batch_size: int, seq_len: int, pad_id: int, seed: int = 0,
                    shuffle: bool = True, drop_last: bool = False) -> list[LmBatch]:
    """Rows grouped into batches padded on the right to exactly `seq_len`, in a permutation drawn from
    `seed` (or in order). With `drop_last` False the last batch may be short (`pad_lm_batch`). A row
    longer than `seq_len` is an error, not silently cut."""
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"batch_size must be at least 1 and seq_len at least 2, got {batch_size} and {seq_len}")
    for i, e in enumerate(examples):
        if len(e) > seq_len:
            raise ValueError(f"example {i} has {len(e)} tokens, more than seq_len={seq_len}: raise --seq, or "
                             "encode with truncate=True")
    n = len(examples)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    return [_stack([examples[int(i)] for i in order[lo:min(lo + batch_size, stop)]], seq_len, pad_id)
            for lo in range(0, stop, batch_size)]


def pad_lm_batch(batch: LmBatch, size: int, pad_id: int = 0) -> LmBatch:
    """A short batch padded with empty rows (masked, no targets) to the lowered batch size; the count
    of targets is unchanged."""
    extra = size - batch.size
    if extra <= 0:
        return batch

    def pad(a, value):
        return np.concatenate([a, np.full((extra, a.shape[1]), value, np.int64)])
    return LmBatch(pad(batch.input_ids, pad_id), pad(batch.attention_mask, 0), pad(batch.target_ids, 0),
                   pad(batch.target_mask, 0), batch.n_targets)


def split_microbatches(batch: LmBatch, m: int) -> list[LmBatch]:
    """`m` equal micro-batches in row order (views). Each has its own `n_targets`; feed them with the
    whole batch's count (`microbatch_feeds`)."""
    from tasks.tokenize import microbatch_slices

    out = []
    for sl in microbatch_slices(batch.size, m):
        mask = batch.target_mask[sl]
        out.append(LmBatch(batch.input_ids[sl], batch.attention_mask[sl], batch.target_ids[sl], mask,
                           int(mask.sum())))
    return out


def microbatch_feeds(batch: LmBatch, m: int) -> list[dict[str, np.ndarray]]:
    """The graph inputs of `batch` split into `m` micro-batches, each weighted by the whole batch's
    count of targets, so their losses (and gradients) sum to the batch's."""
    return [lm_feeds(micro, batch.n_targets) for micro in split_microbatches(batch, m)]


# --- plain text ---------------------------------------------------------------------------------------

def read_text_documents(path: str | os.PathLike[str]) -> list[str]:
    """The documents of a text file: runs of non-blank lines, separated by blank lines (line breaks
    inside a document are kept)."""
    text = read_utf8_text(path)
    docs, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            docs.append("\n".join(current))
            current = []
    if current:
        docs.append("\n".join(current))
    return docs


def pack_documents(tokenizer: "LmTokenizer", documents: Iterable[str], seq_len: int) -> list[LmExample]:
    """Documents tokenised, each followed by eos, concatenated and cut into rows of `seq_len` tokens
    (the last row holds the rest; a rest of one token, which has no target, is dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    stream: list[int] = []
    for doc in documents:
        stream += tokenizer.encode(doc, special=True)
        if tokenizer.eos_id is not None:
            stream.append(tokenizer.eos_id)
    rows = []
    for lo in range(0, len(stream), seq_len):
        chunk = stream[lo:lo + seq_len]
        if len(chunk) >= 2:
            rows.append(LmExample.of(chunk, [False] + [True] * (len(chunk) - 1)))
    return rows


# --- instruction data -------------------------------------------------------------------------------------

def read_instructions(path: str | os.PathLike[str]) -> list[list[dict[str, str]]]:
    """Conversations of a JSONL file (module docstring: the two layouts); errors name the line."""
    conversations = []
    path = Path(path)
    for number, line in enumerate(read_utf8_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputFileError(f"{where}: not a JSON object ({exc.msg})") from None
        except RecursionError:
            raise InputFileError(f"{where}: JSON nested too deeply to be a conversation") from None
        try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputFileError(f"{where}: a string holds {exc.object[exc.start:exc.end]!r}, half of a UTF-16 "
                             "surrogate pair (an escape like \\ud800 without its partner), not a character") from None
        if not isinstance(record, dict):
            raise InputFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "messages" in record:
            try:
                messages = check_messages(record["messages"], f"{where}: messages")
            except ValueError as exc:
                raise InputFileError(str(exc)) from None
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
            messages = [{"role": "user", "content": record["prompt"]},
                        {"role": "assistant", "content": record["response"]}]
            if isinstance(record.get("system"), str):
                messages.insert(0, {"role": "system", "content": record["system"]})
        else:
            raise InputFileError(f"{where}: expected {{\"prompt\", \"response\"}} (text) or {{\"messages\": [...]}}, "
                             f"got the keys {sorted(record)}")
        if not any(m["role"] == "assistant" for m in messages):
            raise InputFileError(f"{where}: no assistant message, so nothing to train on")
        conversations.append(messages)
    return conversations


def encode_instructions(tokenizer: "LmTokenizer", conversations: Iterable[Sequence[dict[str, str]]],
                        seq_len: int | None = None, truncate: bool = False) -> list[LmExample]:
    """One row per conversation, with the assistant's tokens as targets (tasks/causal_lm/tokenizer.py's
    `encode_chat`). A conversation longer than `seq_len` is an error, or with `truncate` cut to its
    first `seq_len` tokens (a cut that leaves no target is still an error)."""
    rows = []
    for i, messages in enumerate(conversations):
        ids, counted = tokenizer.encode_chat(messages)
        if seq_len is not None and len(ids) > seq_len:
            if not truncate:
                raise ValueError(f"conversation {i} has {len(ids)} tokens, more than seq_len={seq_len}: raise "
                                 "--seq (or truncate)")
            ids, counted = ids[:seq_len], counted[:seq_len]
        row = LmExample.of(ids, counted)
        if row.n_targets == 0:
            raise ValueError(f"conversation {i} has no target token within {len(ids)} tokens")
        rows.append(row)
    return rows


@dataclass(frozen=True)
class FittedConversations:
    """Conversations encoded at a row length: the rows, how many were cut to it (their answers' ends
    are not trained), and which were left out because their answer starts past it (nothing to train)."""

    rows: list[LmExample]
    seq_len: int
    truncated: int
    skipped: tuple[int, ...]

    def summary(self, what: str) -> str | None:
        """One line on what the row length did to `what` (e.g. "--data train.jsonl"), None if nothing."""
        if not self.truncated and not self.skipped:
            return None
        total = len(self.rows) + len(self.skipped)
        parts = []
        if self.truncated:
            parts.append(f"{self.truncated} of {total} conversations cut to --seq {self.seq_len} tokens")
        if self.skipped:
            parts.append(f"{len(self.skipped)} of {total} skipped, their answers starting past token {self.seq_len} "
                         f"(first: conversation {self.skipped[0]})")
        return f"{what}: " + "; ".join(parts) + "; raise --seq to train on them whole"


def fit_conversations(tokenizer: "LmTokenizer", conversations: Iterable[Sequence[dict[str, str]]],
                      seq_len: int) -> FittedConversations:
    """Each conversation as one row of at most `seq_len` tokens: a longer one is cut there and, if
    the cut leaves no answer token to train on, left out (training data is rarely all short; a
    run that stops at the first long conversation, or pads every row to the longest, helps no one)."""
    rows, truncated, skipped = [], 0, []
    for i, messages in enumerate(conversations):
        ids, counted = tokenizer.encode_chat(messages)
        if len(ids) > seq_len:
            ids, counted = ids[:seq_len], counted[:seq_len]
            row = LmExample.of(ids, counted)
            if row.n_targets == 0:
                skipped.append(i)
                continue
            truncated += 1
        else:
            row = LmExample.of(ids, counted)
            if row.n_targets == 0:
                raise ValueError(f"conversation {i} has no answer token to train on")
        rows.append(row)
    return FittedConversations(rows, seq_len, truncated, tuple(skipped))


def load_lm_examples(path: str | os.PathLike[str], tokenizer: "LmTokenizer", seq_len: int,
                     truncate: bool = False) -> list[LmExample]:
    """Rows of a data file: .jsonl is instruction data, anything else plain text."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return encode_instructions(tokenizer, read_instructions(path), seq_len, truncate)
    return pack_documents(tokenizer, read_text_documents(path), seq_len)
