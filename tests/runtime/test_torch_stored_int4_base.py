"""Issue 31 (lever 1 + 2): a PyTorch stage recomputing per block over a LoRA base the model file stores int4
(`confidant export --base-dtype int4`) reads it in place: the graph loaded mapped has every stored piece (codes,
float16 scales and offsets, the int8 table's) as a view onto the file's mapping (`planner.onnx_weights.map_raw`'s
stored pieces, whatever their size), the engine widens each product's weight from them (`_FrozenWeight`: no copy)
and gives a block's pages back after its use as for a float32 base. Held in memory (main's path) the packed base
was resident whole (SmolLM2: 94 MiB; a 0.5B model ~300). Losses and gradients equal the held path's bit for bit.
The planner's charge: tests/planner/test_mapped_frozen.py."""
from __future__ import annotations

import numpy as np
import pytest

from ir.mapped_pages import mapping_of
from ir.precision import QuantizedTensor, stored_arrays
from jobs.common.lora import adapted, base_on_mapping, read_mapped
from planner.lora import LoraSettings
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from support import lm_step_feeds, lm_train, made_once, stored_int4_llama

B, SEQ, VOCAB = 2, 12, 256
LORA = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="int4")


@pytest.fixture(scope="module")
def model(export_dir):
    return made_once(export_dir / "stored-int4-llama", stored_int4_llama) / "m.onnx"


def _engine(model, mapped: bool):
    graph = adapted(load_model(model, B, SEQ, mapped=mapped), LORA)
    return graph, make_engine("torch:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), activations="per-block")


def _gradients(engine) -> dict[str, np.ndarray]:
    engine.forward(lm_step_feeds(0, rows=B, seq=SEQ, vocab=VOCAB)[0], 0)
    return {k: np.array(v) for k, v in engine.backward(0).params.items()}


def test_the_stored_int4_base_is_read_in_place_and_trains_as_held(model):
    graph, engine = _engine(model, True)
    stored = {k: v for k, v in graph.constants.items() if isinstance(v, QuantizedTensor)}
    assert {v.storage for v in stored.values()} == {"int4", "int8"}  # the projections, the tied table
    for name, q in stored.items():  # every piece on the mapping, float16 ones and those under 64 KiB included
        assert all(mapping_of(a) is not None for a in stored_arrays(q)), name
        assert q.scales.dtype == np.float16, name
        # the engine widens from the mapping's own bytes: no copy of the codes
        assert engine._frozen[name]._codes.data_ptr() == q.codes.__array_interface__["data"][0], name
    assert engine._mapped  # the mapping whose pages a block gives back after its use
    held_graph, held = _engine(model, False)
    assert not held._mapped
    assert not any(mapping_of(a) is not None for v in held_graph.constants.values() for a in stored_arrays(v))
    got, want = _gradients(engine), _gradients(held)
    assert got.keys() == want.keys() and got
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    steps = lambda step: lm_step_feeds(step, rows=B, seq=SEQ, vocab=VOCAB)  # noqa: E731
    assert lm_train(engine, steps, 2) == lm_train(held, steps, 2)


def test_a_run_maps_a_stored_base_only_on_torch_per_block(model):
    """PyTorch per block reads it in place; MNN copies a quantized weight's parts into its constants, and a
    graph kept for the backward holds what it read: those read the file into memory as before."""
    assert read_mapped(model, LORA, "torch", "per-block") and base_on_mapping(model, LORA, "torch", "per-block")
    for engine, activations in (("mnn", "per-block"), ("torch", "keep"), ("torch", None), ("mnn", None)):
        assert not read_mapped(model, LORA, engine, activations), (engine, activations)
        assert not base_on_mapping(model, LORA, engine, activations), (engine, activations)
