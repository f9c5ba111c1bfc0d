"""A causal LM as a `tasks.task.Task`: JSONL instructions or plain text in, the dev answers'
perplexity out, measured on the training engine itself (the lowered graph's causal-LM loss, so no
vocabulary-sized logits are made). Exact match of generated answers needs the exported model file
to generate with on ONNX Runtime, so the jobs that have one add it (`jobs.train.causal_lm`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ir.graph import Graph, is_causal_lm, logits_shape
from tasks.task import EvalFigures, TaskMismatch, before_after, loss_inputs_of


class TokenizerNotFound(ValueError):
    """No tokenizer.json (and chat template) where a causal LM's tokenizer was looked for."""


@dataclass(frozen=True, eq=False)
class LmData:
    """A causal-LM run's data: the tokenizer, its padding id, the training rows, the first
    `eval_limit` evaluation conversations and their rows, at `seq` tokens."""

    tokenizer: object  # tasks.causal_lm.tokenizer.LmTokenizer
    pad_id: int
    train: list
    dev: list
    dev_rows: list
    seq: int
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class CausalLmTask:
    name: str = "causal-lm"
    examples: str = "rows"
    loss: str = "causal-lm"
    loss_inputs: tuple[str, ...] = loss_inputs_of("target_ids", "target_weights")

    def read_data(self, model: Path, data: Path, eval_path: Path | None, seq: int, *,
                  tokenizer: Path | None = None, eval_limit: int | None = None,
                  note: Callable[[str], None] | None = None) -> LmData:
        """The tokenizer beside `model` (an exported file, or a plan folder `confidant plan` copied it
        into), or `tokenizer`'s; the training rows of `data`, the evaluation conversations of
        `eval_path` (the first `eval_limit`). TokenizerNotFound when there is none."""
        from tasks.causal_lm.rows import dev_rows_of, train_rows_of
        from tasks.causal_lm.tokenizer import load_lm_tokenizer

        try:
            tok = load_lm_tokenizer(tokenizer or model)
        except FileNotFoundError as exc:
            raise TokenizerNotFound(str(exc)) from None
        pad_id = tok.pad_id if tok.pad_id is not None else 0
        rows = train_rows_of(data, tok, seq, note)
        dev, dev_rows = dev_rows_of(eval_path, tok, seq, eval_limit, note)
        return LmData(tok, pad_id, rows, dev, dev_rows, seq)

    def check_graph(self, model: Path, graph: Graph, data, eval_path: Path | None = None) -> None:
        if not is_causal_lm(graph):
            raise TaskMismatch(f"{model} is lowered without a causal-LM loss (logits {list(logits_shape(graph))}); "
                               "export a causal LM with `confidant export --task causal-lm`")

    def batches(self, data: LmData, batch: int, seed: int) -> list:
        from tasks.causal_lm.data import make_lm_batches

        return make_lm_batches(data.train, batch, data.seq, data.pad_id, seed=seed)

    def dev_batches(self, data: LmData, batch: int) -> list:
        """The evaluation rows in batches of `batch`, in order."""
        from tasks.causal_lm.data import make_lm_batches

        return make_lm_batches(data.dev_rows, batch, data.seq, data.pad_id, shuffle=False) if data.dev_rows else []

    def feeds(self, data: LmData, batch, rows: int, microbatches: int) -> list[dict[str, np.ndarray]]:
        """Targets weighted by 1 / the whole batch's target count (`tasks.causal_lm.data.microbatch_feeds`)."""
        from tasks.causal_lm.data import microbatch_feeds, pad_lm_batch

        return microbatch_feeds(pad_lm_batch(batch, rows, data.pad_id), microbatches)

    def evaluate(self, engine, graph: Graph, data: LmData, batch: int) -> EvalFigures | None:
        """The dev answers' perplexity on `engine` (metric "perplexity")."""
        from tasks.causal_lm.evaluation import engine_nll

        if not data.dev_rows:
            return None
        nll = engine_nll(engine, self.dev_batches(data, batch), batch, data.pad_id)
        return EvalFigures(nll.perplexity, None, None, metric="perplexity", perplexity=nll.perplexity)

    def with_before(self, after: EvalFigures, before: EvalFigures) -> EvalFigures:
        return replace(before_after(after, before), perplexity_before=before.perplexity)

    def headline(self, figures: EvalFigures) -> str:
        if figures.metric == "perplexity":
            return f"dev perplexity {figures.perplexity:.3f}"
        return f"dev perplexity {figures.perplexity:.3f}, exact match {figures.after:.3f}"


CAUSAL_LM = CausalLmTask()
