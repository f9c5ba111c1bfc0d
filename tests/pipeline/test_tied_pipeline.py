"""Tied weights across pipeline stages (issue 11: a decoder's LM head is its input embedding; issue
10: ALBERT's one layer cut through): every holder keeps a copy, its gradient part goes to the
coordinator at each UPDATE, and every holder steps with the same sum, so 1f1b-flush and gpipe on 2
and 3 stages equal single-device training and the copies stay bit-identical.

The model is jobs/export/llm.py's tiny seeded random Llama (tied embeddings, RMSNorm, RoPE,
grouped-query attention, SwiGLU), cut so that its first and last blocks are on different stages.
The reference is one MNN engine over the whole model, micro-batch gradients summed in order, the
same AdamW. Threads over the in-process transport for every case; worker processes over CURVE
ZeroMQ for two of them."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ir.graph import tied_parameters
from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from jobs.train.pipeline import FaultPolicy, LocalWorkers, train_pipeline
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.pipeline.checkpoints import merge_checkpoint
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from support import lm_single_device, lm_step_feeds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROWS, S, M, VOCAB, STEPS = 2, 12, 2, 256, 3
TIED = "model.embed_tokens.weight"
# cuts -> stages: the tied table on stages 0 and 1, or on 0 and 2 with a stage between that holds none
CUTS = {2: [2], 3: [1, 3]}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return export_causal_lm(random_causal_lm("llama"), tmp_path_factory.mktemp("tied") / "llama.onnx",
                            LlmExportOptions(), kv_cache=False)


@pytest.fixture(scope="module")
def graph(model_path):
    return load_model(model_path, ROWS, S)


def step_feeds(step: int) -> list[dict[str, np.ndarray]]:
    return lm_step_feeds(step, ROWS, S, M, VOCAB)


def single_device(graph, steps: int = STEPS):
    return lm_single_device(graph, step_feeds, steps)


@pytest.fixture(scope="module")
def reference(graph):
    return single_device(graph), graph.constants[TIED].copy()


def _config(schedule: str) -> PipelineConfig:
    return PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=60)


def _assert_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for k in want:
        err = float(np.abs(got[k] - want[k]).max()) / max(float(np.abs(want[k]).max()), 1e-12)
        assert err <= tol, f"{k}: relative error {err:.3g}"


def _check(result, graph, reference, stages: int) -> None:
    (losses, weights), initial = reference
    ranges = [tuple(r) for r in result.ranges]
    holders = tied_parameters(graph, ranges)[TIED]
    assert holders == ((0, 1) if stages == 2 else (0, 2))
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    _assert_close(result.weights, weights)
    # the copies are bit-identical: every holder stepped with the same sum
    copies = [c[f"param/{TIED}"] for c in result.checkpoint if f"param/{TIED}" in c]
    assert len(copies) == 2 and np.array_equal(copies[0], copies[1])
    merge_checkpoint(result.checkpoint)  # refuses copies that differ
    # the table trained through both of its uses: the head part alone (what the last stage would
    # apply without the exchange) gives other weights
    assert not np.array_equal(result.weights[TIED], initial)


@pytest.mark.parametrize("schedule,stages", [("1f1b-flush", 2), ("1f1b-flush", 3), ("gpipe", 2), ("gpipe", 3)])
def test_flush_schedules_with_tied_weights_equal_single_device_training(graph, reference, schedule, stages):
    with InProcessWorkers(stages, timeout_s=60) as workers:
        result = train_pipeline(graph, None, 0, workers.addresses, _config(schedule), STEPS, cuts=CUTS[stages],
                                transport=workers.coordinator, feeds_of_step=step_feeds,
                                faults=FaultPolicy(on_failure="stop"))
    assert workers.codes == [0] * stages, workers.errors
    _check(result, graph, reference, stages)


def test_a_missing_sum_would_be_seen(graph, reference):
    """What the test above would see were the tied sum wrong: the last stage stepping with its head
    part alone trains the table differently from one device."""
    (_, weights), _ = reference
    ranges = [(0, 1), (2, len(graph.blocks) - 1)]
    first, last = (MnnStageEngine(stage_spec(graph, *r)) for r in ranges)
    opt, params = make_optimizer("adamw", 1e-3), last.parameters()
    for step in range(STEPS):
        total = {}
        for m, feeds in enumerate(step_feeds(step)):
            x = first.forward(feeds, m)
            last.forward({**feeds, last.spec.activation_input: x}, m)
            back = last.backward(m)
            first.backward(m, back.activation_input)
            for k, g in back.params.items():
                total[k] = total[k] + g if k in total else g.copy()
        params = opt.step(params, total)
        last.set_parameters(params)
    err = float(np.abs(params[TIED] - weights[TIED]).max()) / float(np.abs(weights[TIED]).max())
    assert err > 1e-3


def test_1f1b_stash_refuses_weights_tied_across_stages(graph):
    with InProcessWorkers(2, timeout_s=30) as workers:
        with pytest.raises(ValueError, match=r"1f1b-stash cannot train weights tied across stages "
                                             r"\('model.embed_tokens.weight' is on stages \[0, 1\]\)"):
            train_pipeline(graph, None, 0, workers.addresses, _config("1f1b-stash"), 2, cuts=[2],
                           transport=workers.coordinator, feeds_of_step=step_feeds,
                           faults=FaultPolicy(on_failure="stop"))


@pytest.mark.parametrize("schedule,stages", [("1f1b-flush", 3), pytest.param("gpipe", 2, marks=pytest.mark.slow)])
def test_worker_processes_with_tied_weights_equal_single_device_training(graph, reference, schedule, stages):
    workers = LocalWorkers.start(stages, threads=1)
    try:
        result = train_pipeline(graph, None, 0, workers.addresses, _config(schedule), STEPS, cuts=CUTS[stages],
                                keys=workers.keys, feeds_of_step=step_feeds, faults=FaultPolicy(on_failure="stop"))
    finally:
        assert workers.wait(30.0) == [0] * stages
    _check(result, graph, reference, stages)


def test_the_memory_model_counts_a_tied_table_twice_where_an_mnn_graph_reads_it(graph, model_path):
    """MNN looks the table up in numpy. A tied head fused with its loss (the decoder's last stage) reads
    it from numpy as well, so no stage holds a second copy; a head that is not fused (here: a model
    lowered without its loss) reads it from a Var, and the memory model then adds the table once
    more on an MNN device, once per stage however many of its blocks read it, and never on PyTorch
    (one tensor)."""
    import dataclasses

    from planner.cost import double_held_bytes
    from support import tiny_cluster

    mnn = tiny_cluster().device("a")
    torch_backend = dataclasses.replace(mnn.profile.backends[0], backend="torch:cpu:t1")
    torch_device = dataclasses.replace(mnn, backend="torch:cpu:t1", profile=dataclasses.replace(
        mnn.profile, backends=mnn.profile.backends + (torch_backend,)))
    table = graph.constants[TIED].nbytes
    n = len(graph.blocks)
    last = MnnStageEngine(stage_spec(graph, 2, n - 1))  # the engine the fused charge rests on
    assert TIED in last._tables and TIED not in last._params
    assert [double_held_bytes(graph, a, b, mnn) for a, b in ((0, 0), (0, n - 1), (2, n - 1))] == [0, 0, 0]

    unfused = load_model(model_path, ROWS, S, with_loss=False)
    m = len(unfused.blocks)
    head = MnnStageEngine(stage_spec(unfused, 1, m - 1))
    assert TIED in head._params
    assert double_held_bytes(unfused, 0, 0, mnn) == table
    assert double_held_bytes(unfused, 0, m - 1, mnn) == table
    assert double_held_bytes(unfused, 1, 1, mnn) == 0  # a layer: no table
    assert double_held_bytes(unfused, 0, m - 1, torch_device) == 0
