"""LoRA across pipeline stages: flush schedules equal single-device training, weight stashing equals
its sequential replay and stashes adapters only, and a checkpoint carries adapters and their
optimizer state only and resumes bit-identically (real worker processes over ZeroMQ)."""
from __future__ import annotations


import numpy as np
import pytest

from jobs.train.pipeline import PlanInMemory, train_pipeline
from jobs.common.workers import LocalWorkers
from planner.schedule import make_schedule
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.pipeline.checkpoints import load_checkpoint
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.local_replay import LocalPipeline
from support import M, ROWS, S, single_device_training, synthetic_batch, tiny_lora_graph, token_feeds
from tasks.tokenize import split_microbatches
from tasks.trainer import batch_feeds

STEPS = 2


@pytest.fixture(scope="module")
def lora_graph(tiny_onnx):
    return tiny_lora_graph(tiny_onnx["torchscript-17"])


@pytest.fixture(scope="module")
def batches():
    return [synthetic_batch(i) for i in range(4)]


def _run(graph, batches, schedule, stages, steps=STEPS, **kwargs):
    workers = LocalWorkers.start(stages, threads=1)
    config = PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)
    try:
        return train_pipeline(graph, batches, 9, workers.addresses, config, steps, keys=workers.keys, **kwargs)
    finally:
        assert workers.wait(30.0) == [0] * stages


def _assert_rel(a: dict, b: dict, rtol: float) -> None:
    assert set(a) == set(b)
    for k in b:
        err = float(np.abs(a[k] - b[k]).max()) / max(float(np.abs(b[k]).max()), 1e-12)
        assert err <= rtol, f"{k}: relative error {err:.3g}"


@pytest.mark.parametrize("schedule,stages", [("1f1b-flush", 2), ("gpipe", 3)])
def test_lora_flush_pipelines_equal_single_device_training(lora_graph, batches, schedule, stages):
    result = _run(lora_graph, batches, schedule, stages)
    losses, weights = single_device_training(lora_graph, batches, STEPS)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    _assert_rel(result.weights, weights, 1e-5)
    assert set(result.weights) == set(lora_graph.params)  # adapters and the head travel; the base stays


def test_lora_weight_stashing_equals_its_sequential_replay(lora_graph, batches):
    result = _run(lora_graph, batches, "1f1b-stash", 3)
    pipe = LocalPipeline(lora_graph, result.ranges, lambda spec: MnnStageEngine(spec, stash_weights=True), "adamw",
                         1e-3)
    feeds = [batch_feeds(mb, 9, b.n_labelled) for b in batches[:STEPS] for mb in split_microbatches(b, M)]
    losses = pipe.run(make_schedule("1f1b-stash", 3, STEPS * M), feeds)
    assert result.losses == [sum(losses[i * M:(i + 1) * M]) for i in range(STEPS)]
    replay = pipe.parameters()
    for k in replay:
        np.testing.assert_array_equal(result.weights[k], replay[k], err_msg=k)


def test_the_stash_holds_only_trainable_tensors(lora_graph):
    """An update while two micro-batches are in flight: the old version kept for their backwards
    is the adapters' (and the head's) arrays, not the frozen base."""
    first = next(b.index for b in lora_graph.blocks if b.kind == "encoder")
    spec = stage_spec(lora_graph, first, first)
    engine = MnnStageEngine(spec, stash_weights=True)
    rng = np.random.default_rng(0)
    feeds = token_feeds(ROWS, S, vocab=500)
    x = rng.standard_normal(lora_graph.values[spec.activation_input].shape).astype(np.float32)
    for m in (0, 1):
        engine.forward({**feeds, spec.activation_input: x}, m)
    params = engine.parameters()
    engine.set_parameters({k: v + 1e-3 for k, v in params.items()})
    assert engine.stashed_versions() == 1
    (old,) = engine._old_versions.values()
    assert set(old) == set(spec.params)
    trainable = sum(int(lora_graph.constants[p].nbytes) for p in spec.params)
    frozen = lora_graph.blocks[first].frozen_bytes
    assert sum(v.nbytes for v in old.values()) == trainable < frozen
    engine.backward(0, np.ones_like(x))
    engine.backward(1, np.ones_like(x))
    assert engine.stashed_versions() == 0


def test_lora_checkpoint_then_resume_continues_identically(lora_graph, batches, tmp_path):
    whole = _run(lora_graph, batches, "1f1b-flush", 2, steps=3)
    _run(lora_graph, batches, "1f1b-flush", 2, steps=2, checkpoint_dir=tmp_path / "ckpt", meta={"model": "tiny"})
    meta, weights, opt_state = load_checkpoint(tmp_path / "ckpt")
    assert set(weights) == set(lora_graph.params)  # adapters and the head, never the frozen base
    assert all(name.split("/", 1)[1] in lora_graph.params for state in opt_state.values() for name in state
               if "/" in name)
    resumed = _run(lora_graph, batches, "1f1b-flush", 2, steps=1, start_step=2, weights=weights,
                   optimizer_state=opt_state, cuts=[r[0] for r in meta["ranges"][1:]])
    assert resumed.losses == whole.losses[2:]
    for k in whole.weights:
        np.testing.assert_array_equal(resumed.weights[k], whole.weights[k], err_msg=k)


def test_a_lora_replan_moves_adapters_and_their_optimizer_state_only(lora_graph, batches):
    """A forced re-plan after step 1 over in-process workers: the blocks that change worker carry
    their trainable bytes (weights and AdamW's two moments), not the frozen base they also hold."""
    from ir.partition import even_ranges
    from runtime.pipeline.inprocess import InProcessWorkers

    a_ranges = even_ranges(len(lora_graph.blocks), 2)
    b_ranges = [(0, a_ranges[0][1] - 1), (a_ranges[0][1], len(lora_graph.blocks) - 1)]  # an encoder moves
    assert lora_graph.blocks[a_ranges[0][1]].kind == "encoder"
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=30)
    with InProcessWorkers(2, timeout_s=30) as workers:
        plans = PlanInMemory(lora_graph, config, 1, workers.addresses)  # a re-plan by hand: b_ranges after step 1
        result = train_pipeline(lora_graph, batches, 9, workers.addresses, config, 3, transport=workers.coordinator,
                                replan_every=1, in_memory=plans,
                                on_replan=lambda step, measured, weights: plans(b_ranges, workers.addresses,
                                                                                weights()) if step == 1 else None)
    (step, reconf), = result.replans
    moved = [lora_graph.blocks[m.block] for m in reconf.moves]
    assert step == 1 and moved and all(m.params == lora_graph.blocks[m.block].params for m in reconf.moves)
    assert reconf.moved_bytes == 3 * sum(b.params_bytes for b in moved)  # adapters (+ head): weights, m, v
    assert sum(b.frozen_bytes for b in moved) > reconf.moved_bytes  # what a full fine-tune would have moved more
    losses, weights = single_device_training(lora_graph, batches, 3)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    _assert_rel(result.weights, weights, 1e-5)
