"""A causal LM's two evaluations on the workers (`jobs.train.pipeline_tasks`: train-pipeline's
perplexity and generation, `train PLAN`'s perplexity) share one helper: the dev rows' loss forward
only through the stages, and a worker failing during it leaves the run unevaluated with the same
note. The coordinator here is only its `forward_only`, which is all either evaluation calls."""
from __future__ import annotations

from types import SimpleNamespace

import math

from ir.graph import Graph
from jobs.train.pipeline_tasks import lm_evaluation_on_stages, lm_perplexity_on_stages
from runtime.pipeline.coordinator import WorkerFailed
from tasks.causal_lm.data import LmExample

NOTE = "not evaluated: a worker failed during the evaluation on the workers: stage 1 (pi-b): gone"


def _run():
    rows = [LmExample.of([1, 5, 6, 2], [False, True, True, True]), LmExample.of([1, 7, 2], [False, True, True])]
    return SimpleNamespace(dev=["a dev conversation"], dev_rows=rows, pad_id=0, seq=8, tokenizer=None)


class _Failing:
    def forward_only(self, feeds, *rest, **kwargs):
        raise WorkerFailed("stage 1 (pi-b): gone")


class _Losses:
    """Each micro-batch's mean loss, as the last stage returns it."""

    def __init__(self):
        self.calls = 0

    def forward_only(self, feeds, *rest, **kwargs):
        self.calls += 1
        return [0.5 for _ in feeds]


def _graph(rows: int) -> Graph:
    return SimpleNamespace(batch=rows, blocks=[None] * 4)


def test_a_worker_failing_during_either_evaluation_on_the_workers_leaves_one_note():
    notes = []
    assert lm_perplexity_on_stages(_graph(2), _run(), notes.append)(_Failing()) is None
    assert lm_evaluation_on_stages(_graph(2), SimpleNamespace(seq=8), _run(),
                                   SimpleNamespace(note=notes.append))(_Failing()) is None
    assert notes == [NOTE, NOTE]
    assert lm_perplexity_on_stages(_graph(2), _run())(_Failing()) is None  # no note asked for: none made


def test_train_plans_perplexity_is_the_stages_mean_loss_per_target():
    """5 targets in one micro-batch of 2 rows, its loss 0.5 per target: perplexity e^0.5."""
    coordinator = _Losses()
    figures = lm_perplexity_on_stages(_graph(2), _run())(coordinator)
    assert coordinator.calls == 1
    assert figures.metric == "perplexity" and math.isclose(figures.perplexity, math.exp(0.5), rel_tol=1e-12)
