"""The PyTorch engine's W (zero-bubble's deferred weight gradients) added into the running sum one
parameter at a time (`backward_weight_into`): a W held the micro-batch's whole set of weight
gradients beside the sum (MiniLM's stage 0 under zb-h1: 27 MiB at each W; issue 31 target 5,
benchmarks/MEMORY_NOTES.md). The sum is bit for bit `backward_weight`'s then `accumulate`'s, and a
zb-h1 pipeline still equals single-device training (tests/pipeline/test_zero_bubble.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.onnx_import import load_model
from runtime.engines.base import accumulate
from runtime.engines.stage import stage_spec
from support import ROWS, S, autograd_saved_bytes, token_feeds

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20

# In a fresh interpreter: MiniLM's layers 1-4 at 2 x 128 on the torch engine, two micro-batches'
# forwards and Bs, the first W (the sum is made), then the second W with VmHWM started again: how far
# the peak rose above what the process held before it. glibc hands every block of 64 KiB or more
# out as its own mapping and unmaps it when freed (MALLOC_MMAP_THRESHOLD_), so resident memory is
# what is allocated, not what an earlier free left behind.
_PROBE = """
import gc, json, sys
import numpy as np
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes
graph = load_model(sys.argv[1], 2, 128)
spec = stage_spec(graph, 1, 4)
engine = make_engine("torch:cpu:t1", spec, take_weights=True)
engine.split_backward = engine.row_gradients = True
rng = np.random.default_rng(0)
shape = graph.values[spec.activation_input].shape
feeds = {k: np.ones(graph.values[k].shape, np.int64) for k in spec.graph_inputs}
outs = []
for m in range(2):
    feeds[spec.activation_input] = rng.normal(size=shape).astype(np.float32)
    outs.append(engine.forward(dict(feeds), m))
into = {}
for m in range(2):
    engine.backward_input(m, rng.normal(size=outs[m].shape).astype(np.float32))
engine.backward_weight_into(0, into)
deferred = sum(g.nbytes for g in into.values())
gc.collect(); release_free_heap(); reset_peak_rss()
before = rss_bytes()
engine.backward_weight_into(1, into)
print("PROBE " + json.dumps({"rise": peak_rss_bytes() - before, "deferred": deferred}))
"""


@pytest.mark.slow  # MiniLM's export (shared) and a fresh interpreter with torch (~20-40 s here)
def test_a_w_adds_its_gradients_into_the_sum_without_a_whole_set_beside_it(minilm_onnx):
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(minilm_onnx)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                              "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[6:])
    # four layers' projections: 27 MiB of weight gradients; the old W held all of them at once
    # (its rise measured 27-28 MiB), one parameter at a time holds the largest one (2.25 MiB)
    assert probe["deferred"] > 20 * MIB, probe
    assert probe["rise"] < 0.25 * probe["deferred"], probe


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    from support import export_onnx

    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


@pytest.mark.parametrize("first", [0, 1])
def test_a_w_into_the_sum_is_w_then_accumulate(graph, first):
    """Two micro-batches' Ws summed both ways, from a sum that one B started (the table's rows and
    the norms come with B), in float64: the same arrays to rounding. Not bit for bit: a W whose weight's
    sum is there adds its products into the sum with one GEMM each (`_WeightSums`), which rounds as it
    goes where `backward_weight` then `accumulate` round the product and then the sum."""
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, first, len(graph.blocks) - 1)
    sums = []
    for into_sum in (False, True):
        engine = TorchStageEngine(spec, dtype=torch.float64)
        engine.split_backward = engine.row_gradients = True
        total: dict = {}
        for m in range(2):
            feeds = token_feeds(ROWS, S, vocab=500, seed=m)
            if spec.activation_input:
                shape = graph.values[spec.activation_input].shape
                feeds[spec.activation_input] = np.random.default_rng(m).normal(size=shape)
            engine.forward(feeds, m)
            accumulate(total, engine.backward_input(m).params)
            if into_sum:
                engine.backward_weight_into(m, total)
            else:
                accumulate(total, engine.backward_weight(m))
        assert engine.backward_weight(0) == {} and engine.backward_weight(1) == {}  # each W ran once
        sums.append(total)
    assert set(sums[0]) == set(sums[1])
    for k in sums[0]:
        a, b = sums[0][k], sums[1][k]
        a = a.dense() if hasattr(a, "dense") else a
        b = b.dense() if hasattr(b, "dense") else b
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14, err_msg=k)


@pytest.mark.slow  # two worker processes with torch (~20-40 s here); twin on threads in tests/pipeline/test_zero_bubble.py
def test_a_zb_h1_pipeline_of_torch_worker_processes_equals_single_device_training(graph):
    """zb-h1 over real ZeroMQ sockets between two torch worker processes, every W summed into the
    running sum in place: the losses and weights of single-device training on the same engine."""
    pytest.importorskip("torch")
    from jobs.train.pipeline import LocalWorkers, train_pipeline
    from runtime.engines.pytorch import TorchStageEngine
    from runtime.pipeline.coordinator import PipelineConfig
    from support import single_device_training, synthetic_batch

    batches = [synthetic_batch(i) for i in range(2)]
    config = PipelineConfig(schedule="zb-h1", microbatches=2, optimizer="adamw", lr=1e-3, timeout_s=120,
                            engine="torch")
    workers = LocalWorkers.start(2, threads=1)
    try:
        result = train_pipeline(graph, batches, 9, workers.addresses, config, 2, keys=workers.keys)
    finally:
        assert workers.wait(30.0) == [0, 0]
    assert all(d["seconds"].get("W", 0) > 0 for d in result.stage_reports[-1])  # W ran on both workers
    losses, weights = single_device_training(graph, batches, 2, engine=TorchStageEngine(
        stage_spec(graph, 0, len(graph.blocks) - 1)))
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    for k, want in weights.items():
        # a bias whose true gradient is 0 gets float32 noise that AdamW scales to lr-sized steps
        bound = 2 * 1e-3 * 2 if k.endswith("attention.self.key.bias") else 1e-5 * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(result.weights[k] - want).max()) <= bound, k


def test_a_deferred_projection_of_a_gelu_saves_the_gelu_s_input_not_its_output(graph):
    """zb-h1's forward holds less than the unsplit one by every GELU's output (the FFN's second
    projection saves the GELU's input, which the GELU saves anyway, and runs the GELU again in its
    backward), and B + W still give the unsplit backward's gradients."""
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = token_feeds(ROWS, S, vocab=500)
    gelus = [n for n in spec.compute_nodes if n.op == "Gelu"]
    assert gelus
    gelu_bytes = sum(8 * int(np.prod(graph.values[n.outputs[0]].shape)) for n in gelus)
    whole, split = TorchStageEngine(spec, dtype=torch.float64), TorchStageEngine(spec, dtype=torch.float64)
    split.split_backward = True
    # the unsplit forward as it was: its projections save their inputs (both now make a GELU's or LayerNorm's
    # output again, `_Remade`: tests/runtime/test_torch_remade_inputs.py)
    whole._remade_from = {}
    assert autograd_saved_bytes(split, feeds) <= autograd_saved_bytes(whole, feeds) - gelu_bytes
    ref = whole.backward(0)
    got = {**split.backward_input(0).params, **split.backward_weight(0)}
    for k in ref.params:
        np.testing.assert_allclose(got[k], ref.params[k], rtol=1e-10, atol=1e-12, err_msg=k)
