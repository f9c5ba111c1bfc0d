"""Single-device fine-tuning: batches in, optimizer steps, per-step figures and entity F1 out.

The loss of a batch is the sum of token cross-entropies divided by the batch's count of labelled
tokens; the division is folded into the `targets` tensor (one-hot x 1/count), so a batch split into
micro-batches gives the same loss and gradients as the whole batch, which the pipeline relies on.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from ir.plan import DEFAULT_LR
from runtime.engines.base import StageEngine
from runtime.procfs import peak_rss_bytes, release_free_heap
from tasks.metrics import ClassScores, Scores, class_scores, entity_f1
from runtime.optim import make_optimizer
from tasks.tokenize import IGNORE_INDEX, Batch, decode_predictions, make_batches, split_microbatches


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    batch: int = 8
    seq: int = 128
    lr: float = DEFAULT_LR
    optimizer: str = "adamw"
    seed: int = 0
    threads: int = 1
    weight_decay: float | None = None
    microbatches: int = 1


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    seconds: float
    tokens_per_s: float


@dataclass
class TrainResult:
    steps: list[StepRecord] = field(default_factory=list)
    peak_rss_bytes: int = 0
    # the optimizer after the last step: its state (runtime.optim's keys) made only when asked for (a checkpoint),
    # since `state()` makes each table's row state dense (MiniLM: 2 x 44.7 MiB, the whole life's peak of full
    # fine-tuning, helper h126)
    optimizer: object | None = None

    @property
    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {} if self.optimizer is None else self.optimizer.state()

    def to_json(self) -> dict:
        return {"steps": [asdict(s) for s in self.steps], "peak_rss_bytes": self.peak_rss_bytes}


def batch_feeds(batch: Batch, num_labels: int, n_labelled_total: int | None = None) -> dict[str, np.ndarray]:
    """Graph inputs for a (micro-)batch; targets are one-hot / labelled tokens of the whole batch
    ([B, S, labels]), or one-hot / labelled rows ([B, labels]) for a sequence-classification batch."""
    labels = batch.labels
    count = n_labelled_total if n_labelled_total is not None else batch.n_labelled
    if batch.per_sequence:
        labels = labels[:, 0]
    targets = np.zeros(labels.shape + (num_labels,), np.float32)
    where = np.nonzero(labels != IGNORE_INDEX)
    if count:
        targets[where + (labels[where],)] = 1.0 / count
    return {
        "input_ids": batch.input_ids.astype(np.int64),
        "attention_mask": batch.attention_mask.astype(np.int64),
        "token_type_ids": batch.token_type_ids.astype(np.int64),
        "targets": targets,
    }


def pad_batch(batch: Batch, size: int) -> Batch:
    """Pad a short final batch with empty rows (masked, unlabelled) to the lowered batch size."""
    extra = size - batch.size
    if extra <= 0:
        return batch
    def pad(a, value):
        return np.concatenate([a, np.full((extra,) + a.shape[1:], value, a.dtype)])
    return Batch(pad(batch.input_ids, 0), pad(batch.attention_mask, 0), pad(batch.token_type_ids, 0),
                 pad(batch.labels, IGNORE_INDEX), n_labelled=batch.n_labelled, per_sequence=batch.per_sequence)


def accumulate_gradients(engine: StageEngine, batch: Batch, microbatches: int, num_labels: int):
    """Loss and summed gradients of `batch` run as `microbatches` forward/backward pairs; the
    targets carry the whole batch's labelled count, so the sum equals the unsplit batch's."""
    return accumulate_feeds(engine, [batch_feeds(micro, num_labels, batch.n_labelled)
                                     for micro in split_microbatches(batch, microbatches)])


def accumulate_feeds(engine: StageEngine, feeds: Sequence[dict[str, np.ndarray]]):
    """Loss and summed gradients of one batch given as its micro-batches' graph inputs (each
    normalised by the whole batch's count, so the sums are the batch's; any task)."""
    loss = 0.0
    grads: dict[str, np.ndarray] = {}
    # summed as a pipeline stage sums them (runtime.engines.base.accumulate), so the two agree bit
    # for bit; embedding tables may come as the rows they touch
    was, engine.row_gradients = engine.row_gradients, True
    try:
        for m, micro in enumerate(feeds):
            # what the forward's pass computes of the gradients (MNN's fused LM head) straight into the sum
            loss += float(engine.forward_into(micro, m, grads))
            engine.backward_into(m, grads)  # each block's gradients summed as they come
            if m == 0:
                _release_heap_after_first_backward(engine)
    finally:
        engine.row_gradients = was
    return loss, grads


def _release_heap_after_first_backward(engine: StageEngine) -> None:
    """Give the C library's free heap back after a step's first backward, on an engine whose activations come
    from it (`StageEngine.releases_heap_each_step`: PyTorch), as a pipeline stage does
    (`runtime.pipeline.executor`'s `_release_heap_once`), whose figures the memory model charges: the backward's
    re-runs and gradients leave their small blocks as free heap, which the next micro-batch's forward (its LM
    head's chunks mapped on their own) and the next step do not reuse whole. SmolLM2 LoRA on PyTorch per block
    over a mapped base, 4 micro-batches of 1 x 128: glibc held 45-47 MiB free at the next forward's LM head and
    the step peaked 448 MiB against 443 planned; given back, 412 (helper h161). Once a step: each give-back costs
    the pages faulted back in."""
    if engine.releases_heap_each_step:
        release_free_heap()


def update(engine: StageEngine, optimizer, feeds: Sequence[dict[str, np.ndarray]]) -> float:
    """One optimizer step over a batch given as its micro-batches' graph inputs; its loss. An update that
    reads one backward (one micro-batch) on an engine stepping each weight as its gradient comes
    (`StageEngine.steps_in_backward`: PyTorch) steps in that backward, as the pipeline executor fuses a B with
    the UPDATE after it alone (`runtime.pipeline.executor.fused_backwards`; the same weights and state bit for
    bit): the whole gradient set is never held (MiniLM full fine-tuning on PyTorch, the steps' peak 24-33 MiB
    lower, helper h132). Else the summed gradients, then the step."""
    if len(feeds) == 1 and engine.steps_in_backward:
        was, engine.row_gradients = engine.row_gradients, True  # tables stepped by the rows they touched
        try:
            loss = float(engine.forward(feeds[0], microbatch=0))
            engine.backward_and_step(0, optimizer)
            _release_heap_after_first_backward(engine)
        finally:
            engine.row_gradients = was
        return loss
    loss, grads = accumulate_feeds(engine, feeds)
    engine.step(optimizer, grads)
    # let go now (returning): held, the step's gradients stood beside the next step's backward (MiniLM full
    # fine-tuning: a whole set, helper h117)
    return loss


def train_steps(engine: StageEngine, batches: Sequence, config: TrainConfig, num_labels: int,
                on_step: Callable[[StepRecord], None] | None = None,
                step_feeds: Callable[[object], list[dict[str, np.ndarray]]] | None = None) -> TrainResult:
    """`config.steps` optimizer steps over `batches` (cycled) on one engine holding the whole model.
    `step_feeds(batch)` gives a batch's micro-batch graph inputs (default: a token- or
    sequence-classification `Batch`, padded to `config.batch` rows; the causal-LM trainer passes
    `tasks.causal_lm.data`'s)."""
    if not batches:
        raise ValueError("no training batches: the training file produced no sentences")
    optimizer = make_optimizer(config.optimizer, config.lr, config.weight_decay)
    result = TrainResult()
    for step in range(config.steps):
        start = time.perf_counter()
        if step_feeds is None:
            batch = pad_batch(batches[step % len(batches)], config.batch)
            feeds = [batch_feeds(micro, num_labels, batch.n_labelled)
                     for micro in split_microbatches(batch, config.microbatches)]
        else:
            feeds = step_feeds(batches[step % len(batches)])
        loss = update(engine, optimizer, feeds)
        seconds = time.perf_counter() - start
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step + 1}: lower --lr (now {config.lr})")
        record = StepRecord(step + 1, loss, seconds, float(sum(f["attention_mask"].sum() for f in feeds)) / seconds)
        result.steps.append(record)
        if on_step:
            on_step(record)
    result.peak_rss_bytes = peak_rss_bytes()
    result.optimizer = optimizer
    return result


def predict(engine: StageEngine, encoded, config: TrainConfig, num_labels: int, head_block: int,
            per_sequence: bool = False) -> list[np.ndarray]:
    """Predicted label ids per encoding (argmax of the head's logits), in input order: an array
    per position, or one id per encoding for sequence classification."""
    batches = make_batches(encoded, config.batch, config.seq, seed=0, shuffle=False, per_sequence=per_sequence)
    preds: list[np.ndarray] = []
    for batch in batches:
        n = batch.size
        logits = engine.forward(batch_feeds(pad_batch(batch, config.batch), num_labels), train=False,
                                until_block=head_block)
        preds.extend(np.argmax(logits[:n], axis=-1))
    return preds


def evaluate(engine: StageEngine, encoded, gold_tags: Sequence[Sequence[str]], labels: Sequence[str],
             config: TrainConfig, head_block: int) -> Scores:
    preds = predict(engine, encoded, config, len(labels), head_block)
    predicted_tags = decode_predictions(encoded, preds, list(labels))
    return entity_f1([list(t) for t in gold_tags], predicted_tags)


def evaluate_classes(engine: StageEngine, encoded, gold: Sequence[str], labels: Sequence[str], config: TrainConfig,
                     head_block: int) -> ClassScores:
    """Accuracy and macro-F1 of a sequence classifier on `encoded` (gold labels by name)."""
    preds = predict(engine, encoded, config, len(labels), head_block, per_sequence=True)
    return class_scores(list(gold), [labels[int(p)] for p in preds])
