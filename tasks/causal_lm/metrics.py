"""Causal-LM metrics: next-token cross-entropy, perplexity, exact match of generated answers.

Perplexity is exp(mean negative log-likelihood per target token) over a whole evaluation set: the sum
of token losses over all batches divided by the count of all targets (never a mean of per-batch
perplexities, which would weight short batches up). The targets are those of tasks/causal_lm/data.py: for
instruction data the answer tokens only, so it is the perplexity of the answers given their prompts.
A model that spreads its probability evenly over V tokens has perplexity V.

Exact match compares a generated answer with the reference after stripping whitespace at both ends:
nothing else is forgiven (a JSON answer with other spacing or key order is not a match; the entity task
has its own, more lenient scores in tasks/causal_lm/entity_task.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from tasks.causal_lm.data import LmBatch

__all__ = ["NllSum", "exact_match", "lm_loss", "perplexity", "token_cross_entropy"]


def token_cross_entropy(logits: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per position, float64 [B, S] (logits [B, S, V], computed in float64
    one row at a time, so a vocabulary-sized batch is never copied whole)."""
    logits = np.asarray(logits)
    if logits.ndim != 3 or logits.shape[:2] != np.shape(target_ids):
        raise ValueError(f"logits {logits.shape} do not fit targets {np.shape(target_ids)} ([B, S, V] and [B, S])")
    out = np.empty(logits.shape[:2], np.float64)
    for b in range(logits.shape[0]):
        row = logits[b].astype(np.float64)
        top = row.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(row - top).sum(axis=-1)) + top[:, 0]
        out[b] = lse - row[np.arange(row.shape[0]), target_ids[b]]
    return out


def lm_loss(logits: np.ndarray, feeds: Mapping[str, np.ndarray]) -> float:
    """The causal-LM loss of one (micro-)batch: sum(target_weights x token cross-entropy), the number
    the graph's loss block computes (tasks/causal_lm/data.py's `lm_feeds` makes the feeds)."""
    ce = token_cross_entropy(logits, feeds["target_ids"])
    return float((ce * feeds["target_weights"]).sum())


def perplexity(nll_sum: float, n_targets: int) -> float:
    if n_targets <= 0:
        raise ValueError("perplexity of no target tokens")
    return math.exp(nll_sum / n_targets)


@dataclass
class NllSum:
    """Summed negative log-likelihood and target count over batches; `perplexity` at the end."""
    nll: float = 0.0
    n_targets: int = 0

    def add(self, logits: np.ndarray, batch: "LmBatch") -> None:
        """Add one batch's targets (padding rows and positions without targets count nothing)."""
        ce = token_cross_entropy(logits[:batch.size], batch.target_ids)
        self.nll += float(ce[batch.target_mask != 0].sum())
        self.n_targets += batch.n_targets

    @property
    def mean(self) -> float:
        return self.nll / self.n_targets if self.n_targets else float("nan")

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll, self.n_targets)


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The fraction of predictions equal to their reference (whitespace at the ends stripped)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError("exact match of no examples")
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)
