"""The PyTorch engine's backward seeds autograd with a scalar, sum(out * dy), not with dy as
`grad_outputs`: torch checks a given seed's shape through torch.fx.experimental.symbolic_shapes,
whose first import (sympy and mpmath, ~490 modules) held 31 MiB of every torch worker from its first
backward on (MiniLM's stage 0 under zb-h1: 537 -> 504 MiB; issue 31 target 5, benchmarks/MEMORY_NOTES.md,
helper h85). The gradients are bit for bit autograd's with the seed given (1.0 * dy is dy)."""
from __future__ import annotations

import importlib.abc
import sys

import numpy as np
import pytest

from planner.onnx_import import load_model
from runtime.engines.stage import stage_spec
from runtime.optim import AdamW
from runtime.profiling.inputs import synthetic_feeds

torch = pytest.importorskip("torch")
from runtime.engines.pytorch import TorchStageEngine  # noqa: E402

_SHAPES = "torch.fx.experimental.symbolic_shapes"


class _Refused(importlib.abc.MetaPathFinder):
    """Refuses to import the shape checker: the engine's backwards must not need it."""

    def find_spec(self, name, path, target=None):
        if name == _SHAPES or name.split(".")[0] in ("sympy", "mpmath"):
            raise ImportError(f"{name} imported by a backward")
        return None


def test_a_seeded_backward_needs_no_sympy_and_equals_autograd_seeded_with_dy(tiny_onnx, monkeypatch):
    graph = load_model(tiny_onnx["torchscript-17"], 2, 12)
    last = len(graph.blocks) - 1
    rng = np.random.default_rng(0)
    host = synthetic_feeds(graph, 0)

    def feeds_of(spec):
        f = {k: v for k, v in host.items() if k in spec.graph_inputs}
        f[spec.activation_input] = rng.normal(size=graph.values[spec.activation_input].shape).astype(np.float32)
        return f

    middle = stage_spec(graph, 1, last - 2)
    feeds = feeds_of(middle)
    dy = rng.normal(size=graph.values[middle.output].shape).astype(np.float32)
    engine = TorchStageEngine(middle)
    tail = TorchStageEngine(stage_spec(graph, 1, last))
    got = {}
    with monkeypatch.context() as m:
        # as in a fresh worker, where nothing imported it before its first backward
        m.delitem(sys.modules, _SHAPES, raising=False)
        m.setattr(sys, "meta_path", [_Refused(), *sys.meta_path])
        for split, mb in ((False, 0), (True, 2)):  # micro-batch mb + 1 (the same feeds) kept for the reference
            engine.split_backward = split
            engine.forward(feeds, mb)
            engine.forward(feeds, mb + 1)
            got[mb] = engine.backward(mb, dy)
        engine.split_backward = False
        engine.forward(feeds, 4)
        engine.backward_and_step(4, AdamW(lr=1e-3), dy)
        tail.forward(feeds_of(tail.spec), 0)
        tail.backward(0)
    for mb in (0, 2):  # autograd seeded with dy itself
        x_in, out, used, _ = engine._graph_of(mb + 1)
        ref = torch.autograd.grad([out], list(used.values()) + [x_in], [torch.from_numpy(dy)], allow_unused=True)
        assert np.array_equal(got[mb].activation_input, ref[-1].numpy())
        if mb == 0:  # the whole backward's weight gradients too (the split one's come from its W)
            assert all(np.array_equal(got[mb].params[k], g.numpy()) for k, g in zip(used, ref))
