"""The first setup's bundles on the coordinator (issue 32: its peak at most the largest worker's).
SmolLM2 LoRA over 2 MNN workers peaked at 1039 MiB in its setup against workers of 600 / 548: the
stage just shipped still queued in ZeroMQ while the next stage's weights file was put together, and
that stage's pages of the mapped model file resident beside it, three stage-sized buffers. Now each
stage's weights file is put together when shipped, its mapped pages given back as they are copied,
and the next one is put together only once ZeroMQ has let go of it. Real worker processes over
CURVE; the training still equals single-device training."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import runtime.pipeline.bundles as bundles_module
from jobs.train.pipeline import FaultPolicy, train_pipeline
from planner.onnx_import import load_model
from runtime.pipeline.coordinator import PipelineConfig
from support import M, ROWS, S, mapped_file_rss, single_device_training, synthetic_batch, wide_bert_onnx

STEPS = 2
RELEASE_EVERY = 1 << 20  # the pages given back every MiB copied, so a stage's pages (~12 MiB) stand out
READ_AHEAD = 2 << 20


@pytest.fixture(scope="module")
def wide_graph_file(export_dir) -> Path:
    return wide_bert_onnx(export_dir)


def _references(obj) -> int:
    return sys.getrefcount(obj)


@pytest.mark.slow  # three worker processes over CURVE and a 6.6 M-parameter model
def test_the_first_setup_holds_one_stages_weights_file_and_gives_its_mapped_pages_back(wide_graph_file, monkeypatch):
    """Three worker processes over CURVE, the graph's weights mapped from its file (as train-pipeline
    lowers it): when each stage's weights file is put together, no weights file put together before
    is still held by anyone (ZeroMQ's queue included: before, the last stage's still was, besides
    the one being made), and while one is put together the model file's resident pages stay under
    RELEASE_EVERY and the largest tensor (before: all of the stage's pages, given back only once the
    whole file was made). Losses and weights are single-device training's."""
    graph = load_model(wide_graph_file, ROWS, S, mapped=True)
    largest = max(int(np.asarray(v).nbytes) for v in graph.constants.values())
    batches = [synthetic_batch(i) for i in range(STEPS)]
    built: list = []  # each weights file put together, in order (the test's reference to it)
    held_before: list[int] = []  # bytes of earlier weights files someone else still held, at each
    pages: list[int] = []  # the model file's resident pages each time they are given back
    # a buffer no one else holds, seen as the buffers below are (a list's item, through one call)
    baseline = [_references(b) for b in [bytearray(1)]][0]
    real_assemble, real_drop = bundles_module.assemble_safetensors, bundles_module.drop_mapped_pages

    def assemble(*args, **kwargs):
        held_before.append(sum(len(b) for b in built if _references(b) > baseline))
        out = real_assemble(*args, **kwargs)
        built.append(out)
        return out

    def drop(values):
        pages.append(mapped_file_rss(wide_graph_file))
        return real_drop(values)

    monkeypatch.setattr(bundles_module, "assemble_safetensors", assemble)
    monkeypatch.setattr(bundles_module, "drop_mapped_pages", drop)
    monkeypatch.setattr(bundles_module, "RELEASE_EVERY", RELEASE_EVERY)
    from jobs.common.workers import LocalWorkers

    workers = LocalWorkers.start(3, threads=1)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)
    try:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, STEPS, keys=workers.keys,
                                faults=FaultPolicy("stop"))
    finally:
        codes = workers.wait(30.0)
    assert codes == [0, 0, 0] and result.events == []
    assert len(built) == 3 and min(len(b) for b in built) > 0  # each stage's weights file, made here
    print(f"weights files {[len(b) >> 10 for b in built]} KiB; held before each: {held_before}; "
          f"mapped pages at each give-back {[p >> 10 for p in pages]} KiB (largest tensor {largest >> 10} KiB)")
    assert held_before == [0, 0, 0], held_before
    # the kernel reads a mapped file ahead of the faulting read (seen: 2 MiB at a time)
    assert pages and max(pages) <= RELEASE_EVERY + largest + READ_AHEAD, (pages, largest)
    want_losses, want_weights = single_device_training(graph, batches, STEPS)
    np.testing.assert_allclose(result.losses, want_losses, rtol=1e-5)
    assert set(result.weights) == set(want_weights)
    for name, want in want_weights.items():
        np.testing.assert_array_equal(result.weights[name], want, err_msg=name)
