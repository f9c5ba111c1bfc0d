"""Head-split stages under the asynchronous `1f1b-stash` schedule (PipeDream weight stashing): the
same losses and final weights as unsplit MNN stages under the same schedule, in the sequential
in-process replay and between real worker processes; and different results without stashing, so
that these tests can fail.

SGD with momentum rather than AdamW: the key bias's exact gradient is zero, and AdamW turns the
float32 noise there into lr-sized steps that differ between any two summation orders (see
tests/runtime/test_engine_split.py); SGD keeps every weight within float32 noise of the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.split.engine import SplitStageEngine
from runtime.pipeline.local_replay import LocalPipeline
from tasks.tokenize import split_microbatches
from tasks.trainer import batch_feeds
from support import M, ROWS, S, synthetic_batch  # the pipeline tests' synthetic batches

pytest.importorskip("torch")

STEPS = 2
SPLIT = {"mnn:cpu:t1": 1, "torch:cpu:t1": 3}
OPTIMIZER, LR = "sgd", 0.05
RTOL = 1e-5


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], ROWS, S)


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(STEPS)]


def _feeds(batches):
    return [batch_feeds(mb, 9, b.n_labelled) for b in batches for mb in split_microbatches(b, M)]


def _engine(split_stages: set[int], stash: bool = True):
    """Stage k's engine: split when k is in `split_stages`, else unsplit MNN."""
    def make(spec):
        stage = make.count
        make.count += 1
        if stage in split_stages:
            return SplitStageEngine(spec, SPLIT, stash_weights=stash)
        return MnnStageEngine(spec, stash_weights=stash)

    make.count = 0
    return make


def _replay(graph, batches, ranges, make_engine):
    """1f1b-stash over all micro-batches of `batches`, replayed in one process: (losses per
    micro-batch, final weights)."""
    pipe = LocalPipeline(graph, ranges, make_engine, OPTIMIZER, LR)
    schedule = make_schedule("1f1b-stash", len(ranges), len(batches) * M)
    try:
        losses = pipe.run(schedule, _feeds(batches))
        return losses, pipe.parameters()
    finally:
        for ex in pipe.executors:
            if isinstance(ex.engine, SplitStageEngine):
                ex.engine.close()


def _scale(want: dict, k: str) -> float:
    # A key bias starts at 0 and its exact gradient is 0, so it only ever holds float32 noise:
    # measure it against the query bias, which the same updates move for real.
    ref = k.replace("attention.self.key.bias", "attention.self.query.bias")
    return max(float(np.abs(want[ref]).max()), 1e-12)


def _assert_rel(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        err = float(np.abs(got[k] - want[k]).max()) / _scale(want, k)
        assert err <= rtol, f"{k}: relative error {err:.3g} > {rtol}"


def _max_rel(got: dict, want: dict) -> float:
    return max(float(np.abs(got[k] - want[k]).max()) / _scale(want, k) for k in want)


# Three stages: stage 0 (embeddings + encoder 1) keeps up to 2 old versions, stage 1 (encoder 2) 1.
RANGES = [(0, 1), (2, 2), (3, 4)]


def test_split_stages_under_weight_stashing_equal_unsplit(graph, batches):
    """The sequential replay of 1f1b-stash with both encoder stages head-split equals the replay
    with unsplit MNN stages."""
    want_losses, want = _replay(graph, batches, RANGES, _engine(set()))
    losses, got = _replay(graph, batches, RANGES, _engine({0, 1}))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    _assert_rel(got, want, RTOL)
    assert losses[-1] != losses[0]


def test_split_stages_without_stashing_differ(graph, batches):
    """The split engine with stash_weights=False runs the backward of a micro-batch in flight on
    the newer weights, so its result leaves the stashed reference by far more than float noise."""
    _, want = _replay(graph, batches, RANGES, _engine(set()))
    _, got = _replay(graph, batches, RANGES, _engine({0, 1}, stash=False))
    assert _max_rel(got, want) > 100 * RTOL


def test_real_pipeline_with_a_split_stage_under_weight_stashing(graph, batches):
    """Two worker processes over ZeroMQ, 1f1b-stash, stage 0 (both encoder blocks) split 1 + 3
    over MNN (a child of the worker) and torch (the worker): the losses and final weights of the
    unsplit replay."""
    from jobs.train.pipeline import LocalWorkers, StageChoice, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig

    config = PipelineConfig(schedule="1f1b-stash", microbatches=M, optimizer=OPTIMIZER, lr=LR, timeout_s=120)
    workers = LocalWorkers.start(2, threads=1)
    try:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, STEPS, cuts=[3], keys=workers.keys,
                                per_stage=(StageChoice(head_split=SPLIT), None))
    finally:
        assert workers.wait(60.0) == [0, 0]
    assert [tuple(r) for r in result.ranges] == [(0, 2), (3, 4)]
    losses, want = _replay(graph, batches, result.ranges, _engine(set()))
    step_losses = [sum(losses[i * M:(i + 1) * M]) for i in range(STEPS)]
    np.testing.assert_allclose(result.losses, step_losses, rtol=RTOL)
    _assert_rel(result.weights, want, RTOL)
