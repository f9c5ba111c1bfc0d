"""A first stage under zb-h1 runs each B and the W right after it as one whole backward on PyTorch
(`runtime.pipeline.executor.joined_weight_passes`, `TorchStageEngine.joins_weight_passes`): nothing runs
between the two halves, and the split only held every projection's (x, dy) from the B to the W. With the
projections' inputs made again in the backward (`runtime.engines.pytorch._Remade`), MiniLM's zb-h1:torch
worker 0 read 440-443 MB against main's 450-458 at the same stage CPU (helper h144, benchmarks/MEMORY_NOTES.md).
The sums are the split's (float64), and zb-h1 pipelines still equal single-device training
(tests/pipeline/test_zero_bubble.py)."""
from __future__ import annotations

import numpy as np
import pytest

from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.engines.base import RowGradient, accumulate
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.pipeline.executor import StageExecutor, joined_weight_passes, stage_peer
from runtime.transport.local import LocalHub, LocalTransport
from support import ROWS, S, export_onnx, token_feeds


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), ROWS, S)


def test_the_ws_right_after_their_own_b():
    zb = make_schedule("zb-h1", 2, 4)
    # stage 0: `... B.m W.m FREE.m ...`; stage 1 sends each B's gradient before its W
    assert [str(a) for a in joined_weight_passes(zb.actions[0])] == [f"s0.W.m{m}" for m in range(4)]
    assert joined_weight_passes(zb.actions[1]) == []
    assert joined_weight_passes(make_schedule("1f1b-flush", 2, 4).actions[0]) == []  # no W at all


def test_zb_h1_splits_backwards_on_pytorch_only_where_a_w_waits(graph):
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    class _SplitAlways(TorchStageEngine):  # an engine that does not join them (MNN's)
        joins_weight_passes = False

    zb = make_schedule("zb-h1", 2, 4)
    cut = len(graph.blocks) // 2
    split = {}
    for stage, (first, last) in enumerate([(0, cut - 1), (cut, len(graph.blocks) - 1)]):
        for kind in (TorchStageEngine, _SplitAlways):
            engine = kind(stage_spec(graph, first, last), dtype=torch.float64)
            executor = StageExecutor(stage, 2, engine, LocalTransport(stage_peer(stage), LocalHub()),
                                     make_optimizer("sgd", 0.1), ())
            executor.prepare(zb.actions[stage])
            split[stage, kind.__name__] = engine.split_backward
    # the joined stage runs whole backwards (summed as autograd completes each weight's gradient); elsewhere split
    assert split == {(0, "TorchStageEngine"): False, (0, "_SplitAlways"): True,
                     (1, "TorchStageEngine"): True, (1, "_SplitAlways"): True}


def test_a_whole_backward_into_the_sum_equals_b_then_w(graph):
    """Two micro-batches of the first stage, float64: the whole backward summed as autograd completes each weight's
    gradient (`backward_into` without a split) against B then W (`backward_input`, `backward_weight_into`)."""
    torch = pytest.importorskip("torch")
    from runtime.engines.pytorch import TorchStageEngine

    spec = stage_spec(graph, 0, len(graph.blocks) // 2 - 1)
    sums = {}
    for split in (False, True):
        engine = TorchStageEngine(spec, dtype=torch.float64)
        engine.split_backward, engine.row_gradients = split, True  # whole: `_backward_summed`
        into, grads = {}, []
        for m in range(2):
            out = engine.forward(token_feeds(ROWS, S, vocab=500, seed=m), m)
            grads.append(np.random.default_rng(m).normal(size=out.shape))
        for m in range(2):
            if split:
                accumulate(into, engine.backward_input_into(m, into, grads[m]).params)
                engine.backward_weight_into(m, into)
            else:
                engine.backward_into(m, into, grads[m])
        sums[split] = {k: v.dense() if isinstance(v, RowGradient) else v for k, v in into.items()}
    assert sums[False].keys() == sums[True].keys()
    for k, want in sums[True].items():
        np.testing.assert_allclose(sums[False][k], want, rtol=1e-12, atol=1e-14, err_msg=k)
