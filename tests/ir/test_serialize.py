"""A stage's graph slice survives JSON + raw tensors and runs identically afterwards."""
from __future__ import annotations

import json

import numpy as np
import pytest

from support import token_feeds
from ir.serialize import graph_from_json, graph_to_json, slice_graph
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec


@pytest.mark.parametrize("blocks", [(0, 1), (2, 4)])
def test_slice_round_trip_runs_the_same(tiny_onnx, blocks):
    graph = load_model(tiny_onnx["dynamo-18"], 2, 12)
    part = slice_graph(graph, *blocks)
    doc = json.loads(json.dumps(graph_to_json(part)))
    back = graph_from_json(doc, {k: v.copy() for k, v in part.constants.items()})
    assert set(back.constants) < set(graph.constants) or blocks == (0, 4)
    feeds = token_feeds(2, 12, vocab=500)
    spec_a, spec_b = stage_spec(graph, *blocks), stage_spec(back, *blocks)
    if spec_a.activation_input:
        feeds[spec_a.activation_input] = np.random.default_rng(0).standard_normal(
            graph.values[spec_a.activation_input].shape).astype(np.float32)
    np.testing.assert_array_equal(MnnStageEngine(spec_a).forward(feeds, 0), MnnStageEngine(spec_b).forward(feeds, 0))


def test_missing_or_mismatched_constants_are_refused(tiny_onnx):
    graph = slice_graph(load_model(tiny_onnx["dynamo-18"], 2, 12), 1, 1)
    doc = graph_to_json(graph)
    consts = dict(graph.constants)
    name = graph.params[0]
    with pytest.raises(ValueError, match=f"graph constants missing: \\['{name}'"):
        graph_from_json(doc, {k: v for k, v in consts.items() if k != name})
    consts[name] = consts[name][:1]
    with pytest.raises(ValueError, match=f"constant '{name}' is float32"):
        graph_from_json(doc, consts)
    with pytest.raises(ValueError, match="graph: schema_version 99 is not supported by this build"):
        graph_from_json({**doc, "schema_version": 99}, graph.constants)
