"""What a micro-batch in flight holds on MNN's lookup stage (issue 31 target 3): the block inputs the planner's
activations term charges (`planner.cost.block_input_bytes`), and the rows its lookups gathered only for a table
the stage steps (a re-run forward must read the rows its forward read). A frozen table (LoRA's base) never
changes: its rows are gathered again by a re-run, not held per micro-batch (a Llama-3.2-1B-class first stage,
128 x 2048 float32 rows, held 1 MiB a micro-batch in flight beside its plan: helper h112)."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.engines.factory import make_engine
from runtime.engines.mnn import GATHERED
from runtime.engines.stage import stage_spec
from support import ROWS, S, tiny_lora_graph, token_feeds


@pytest.fixture(scope="module")
def lora_graph(tiny_onnx):
    """The tiny BERT under LoRA, its base (the tables too) frozen and held int4 / int8."""
    return tiny_lora_graph(tiny_onnx["torchscript-17"], "int4")


def _in_flight(graph, microbatches: int):
    """An MNN stage of the embeddings and the first layer with `microbatches` forwards waiting for their
    backwards (recomputing: one set of per-op caches, the last forward's), its feeds and outputs."""
    spec = stage_spec(graph, 0, 1)
    engine = make_engine("mnn:cpu:t1", spec)
    vocab = len(graph.constants[next(n.inputs[0] for n in graph.nodes if n.op == "Gather")])
    feeds = {k: v for k, v in token_feeds(ROWS, S, vocab).items() if k in spec.graph_inputs}
    return engine, feeds, [engine.forward(feeds, m) for m in range(microbatches)]


def _gathered_bytes(engine, microbatch: int) -> int:
    return sum(v.nbytes for k, v in engine._stash[microbatch][3].items() if k.startswith(GATHERED))


def test_a_frozen_tables_rows_are_not_held_per_microbatch_in_flight(lora_graph):
    graph = lora_graph
    hidden = graph.values[graph.blocks[0].output].shape[-1]
    engine, _, _ = _in_flight(graph, 3)
    for m in range(3):
        # by hand: the first layer's input, ROWS x S x hidden float32 (2 x 12 x 64 x 4 = 6144 bytes on the tiny
        # BERT), the planner's activations term; nothing gathered (main held the word, position and token-type
        # tables' rows beside it: 6144 + 3072 + 6144 = 15360 bytes more a micro-batch)
        held = sum(x.nbytes for x in engine._stash[m][2] if x is not None)
        assert held == ROWS * S * hidden * 4 == 6144
        assert _gathered_bytes(engine, m) == 0


def test_a_re_run_forward_gathers_a_frozen_tables_rows_again(lora_graph):
    """Micro-batch 0's backward after two more forwards re-runs its forward (the caches hold micro-batch 2's):
    its gradients equal those of a forward directly followed by its backward."""
    graph = lora_graph
    engine, feeds, outs = _in_flight(graph, 3)
    grad = np.full_like(outs[0], 1e-2)
    got = engine.backward(0, grad).params
    fresh = make_engine("mnn:cpu:t1", stage_spec(graph, 0, 1))
    fresh.forward(feeds, 0)
    want = fresh.backward(0, grad).params
    assert got.keys() == want.keys() and got
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_stepped_tables_rows_are_still_held_with_their_microbatch(tiny_onnx):
    """Full fine-tuning steps the tables in place: a re-run must be fed the rows its forward read."""
    from planner.onnx_import import load_model

    graph = load_model(tiny_onnx["torchscript-17"], ROWS, S)
    hidden = graph.values[graph.blocks[0].output].shape[-1]
    engine, _, _ = _in_flight(graph, 2)
    lookups = sum(1 for n in graph.nodes if n.op == "Gather" and n.name in graph.blocks[0].nodes)
    for m in range(2):
        assert _gathered_bytes(engine, m) >= ROWS * S * hidden * 4  # the word table's rows at least
        assert lookups >= 1
