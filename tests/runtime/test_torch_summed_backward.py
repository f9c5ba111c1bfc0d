"""Every whole PyTorch backward into a running sum adds each weight's gradient as autograd completes it
(`TorchStageEngine.backward_into` -> `_backward_summed`, wherever the backward is not split: 1F1B, GPipe,
train-local, zb-h1's joined passes), never the stage's whole set beside the sum: SmolLM2's per-block full
fine-tuning stages held 117-194 MiB less that way (benchmarks/MEMORY_NOTES.md, the 2026-12-07 merge, h150).
The sums are each micro-batch's own `backward` added up (float64), keeping, recomputing per block and
recomputing the stage; and the sum is made as the backward runs (the last layer's weights reach an empty sum
first, where `backward` then `accumulate` adds them in the forward's order)."""

import numpy as np
import pytest
import torch

from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from planner.onnx_import import load_model
from runtime.engines.base import accumulate, dense_gradient
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec

MODES = {"keep": {}, "per-block": {"per_block": True}, "recompute": {"recompute": True}}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = export_causal_lm(random_causal_lm("llama", vocab_size=512, num_hidden_layers=2),
                            tmp_path_factory.mktemp("summed") / "m.onnx", LlmExportOptions(), kv_cache=False)
    return load_model(path, 2, 16)


class _Arrivals(dict):
    """A running sum that records the order in which weights first reach it."""

    def __init__(self):
        super().__init__()
        self.order: list[str] = []

    def __setitem__(self, key, value):
        if key not in self:
            self.order.append(key)
        super().__setitem__(key, value)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_whole_backward_sums_as_autograd_completes_each_weight(graph, mode):
    spec = stage_spec(graph, 1, 2)  # the two layers: an activation input, every weight trained
    engine = TorchStageEngine(spec, dtype=torch.float64, **MODES[mode])
    ref = TorchStageEngine(spec, dtype=torch.float64, **MODES[mode])
    rng = np.random.default_rng(0)
    shape = graph.values[spec.activation_input].shape
    summed, want = _Arrivals(), {}
    dxs = []
    for m in range(3):
        feeds = {k: np.ones((2, 16), np.int64) for k in spec.graph_inputs}
        feeds[spec.activation_input] = rng.standard_normal(shape)
        grad = rng.standard_normal(graph.values[spec.output].shape)
        engine.forward(feeds, m)
        ref.forward(feeds, m)
        dx = engine.backward_into(m, summed, grad)
        result = ref.backward(m, grad)
        accumulate(want, {k: dense_gradient(g).copy() for k, g in result.params.items()})
        dxs.append((dx, result.activation_input))
    assert set(summed) == set(want) and len(want) == len(engine.parameter_arrays())
    for k in want:
        np.testing.assert_allclose(dense_gradient(summed[k]), want[k], rtol=1e-12, atol=1e-15, err_msg=k)
    for dx, ref_dx in dxs:
        np.testing.assert_allclose(dx, ref_dx, rtol=1e-12, atol=1e-15)
    last = {i for n in graph.blocks[2].nodes for i in graph.node(n).inputs if i in graph.params}
    # autograd completes the last layer's weights first; `backward` returns them in the forward's order
    assert summed.order[0] in last, (summed.order[:3], sorted(last))
