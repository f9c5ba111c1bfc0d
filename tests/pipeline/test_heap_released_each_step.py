"""The pipeline executor gives glibc's free heap back once a step, after the step's first backward, on an
engine whose activations come from it (`StageEngine.releases_heap_each_step`: PyTorch's). MiniLM's zb-h1:torch
worker 0 read 418-423 MB with it against 430-438 without, at the same step time within 1% (the 2026-12-07 merge,
benchmarks/MEMORY_NOTES.md); after every backward it read 414-416 at +7-10% a step, hence once."""
from __future__ import annotations

import pytest

from planner.onnx_import import load_model
from runtime.pipeline import executor as executor_module
from support import ROWS, S, export_onnx, synthetic_batch


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.mark.parametrize("engine, schedule", [("torch", "zb-h1"), ("torch", "1f1b-flush"), ("mnn", "1f1b-flush")])
def test_the_free_heap_is_given_back_once_a_step_on_pytorch_stages(graph, monkeypatch, engine, schedule):
    from jobs.train.pipeline import train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig
    from runtime.pipeline.inprocess import InProcessWorkers

    if engine == "torch":
        pytest.importorskip("torch")
    released = []
    monkeypatch.setattr(executor_module, "release_free_heap", lambda: released.append(1) or True)
    config = PipelineConfig(schedule=schedule, microbatches=2, optimizer="adamw", lr=1e-3, timeout_s=30,
                            engine=engine)
    steps, stages = 3, 2
    with InProcessWorkers(stages, timeout_s=30) as workers:
        train_pipeline(graph, [synthetic_batch(i) for i in range(2)], 9, workers.addresses, config, steps,
                       transport=workers.coordinator)
    assert workers.codes == [0] * stages, workers.errors
    # each stage once a step on PyTorch (not after every backward: 2 a step each), never on MNN
    assert len(released) == (steps * stages if engine == "torch" else 0)
