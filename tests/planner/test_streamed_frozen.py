"""Issue 31 targets 3 and 4: the memory model's charge for an MNN stage recomputing per block over a float32 LoRA
base read mapped from the model file (`planner.cost.streamed_frozen_bytes`): the engine streams each block's
weights through placeholders shared by the blocks of a set (`runtime.engines.mnn._FrozenStream`), so the stage
holds per set one block's 2-D weights, its other frozen constants whole, the LM head's table (fused with its loss,
read in numpy) whole and a table only looked up not at all. Checked against the graph's own arrays and against the
placeholders the engine itself builds; plus the file pages one read of the mapping holds before the engine gives
them back (a fault maps up to a 2 MiB span of the file: a block's largest weight's spans, or a lookup's two); and
which runs read their base mapped (`jobs.common.lora.read_mapped`).
The PyTorch side: tests/planner/test_mapped_frozen.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from jobs.common.lora import adapted, read_mapped
from jobs.common.memory_check import step_bytes
from planner.cluster import DeviceSpec
from planner.cost import STREAMED_FROZEN, stage_memory_terms, streamed_frozen_bytes
from planner.lora import LoraSettings
from planner.cost import STREAM_SETS
from planner.memory_defaults import default_profile, memory_parts
from planner.onnx_import import load_model
from support import made_once, streamed_llama

LORA = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="float32")
LAYERS = 12


@pytest.fixture(scope="module")
def graph(export_dir):
    """A tied Llama of 12 layers of 5.9 MiB of projections (over the 64 KiB under which a weight is read into
    memory, not mapped) under LoRA on q, k, v, o over its float32 base read mapped; its table (384 KiB) looked up
    by the embeddings and read by the LM head fused with its loss. Exported once with
    tests/runtime/test_mnn_streamed_frozen.py's (`support.streamed_llama`)."""
    path = made_once(export_dir / "streamed-llama", streamed_llama) / "m.onnx"
    return adapted(load_model(path, 2, 12, loss="causal-lm", mapped=True), LORA)


def _device(graph, activations: str, mapped: bool = True, backend: str = "mnn:cpu:t1") -> DeviceSpec:
    profile = default_profile(graph, backend=backend, per_block=True)
    return DeviceSpec("d0", "tcp://127.0.0.1:1", profile, 2 ** 40, backend, activations=activations,
                      frozen_mapped=mapped)


def _terms(graph, device, first=0, last=None):
    last = len(graph.blocks) - 1 if last is None else last
    return stage_memory_terms(graph, device, first, last, 0, 1, "1f1b-flush", 1, "adamw")


def _by_hand(graph):
    """(a layer's 2-D frozen weights, the tied table, every 1-D frozen weight), bytes, off the graph's arrays."""
    frozen = {k: v for k, v in graph.constants.items() if k not in set(graph.params) and k.startswith("model.")}
    table = frozen["model.embed_tokens.weight"]
    layers = [sum(int(v.nbytes) for k, v in frozen.items() if f".layers.{i}." in k and v.ndim == 2)
              for i in range(LAYERS)]
    assert len(set(layers)) == 1 and layers[0] > 5 * 2**20 and f"model.layers.{LAYERS}.mlp.up_proj.weight" not in frozen
    small = sum(int(v.nbytes) for v in frozen.values() if v.ndim == 1)
    return layers[0], int(table.nbytes), small


SPAN = 2 << 20  # the most of a file one fault maps (a page-cache folio of a PMD, 4 KiB pages)


def _read_by_hand(graph) -> int:
    """What one read of the mapping holds at most: the largest streamed weight (the feed-forward's 1024 x 384
    float32, 1.5 MiB) lies in up to 2 spans; a lookup reads its rows a span at a time (a row may straddle two):
    4 MiB either way."""
    largest = max(int(v.nbytes) for k, v in graph.constants.items() if k.startswith("model.layers.") and v.ndim == 2)
    assert largest == 1024 * 384 * 4
    return max(2 * SPAN, (-(-largest // SPAN) + 1) * SPAN)


def test_an_mnn_streamed_stage_is_charged_its_sets_and_the_head_table(graph):
    layer, table, small = _by_hand(graph)
    n = len(graph.blocks)
    # 12 layers (blocks 1-12) over 10 sets: 10 layers' weights held; the fused head's table whole; the norms'
    # scales (under 64 KiB: read into memory, held as constants); one read's spans
    read = _read_by_hand(graph)
    assert read == 4 << 20
    charge = STREAM_SETS * layer + table + small + read
    assert streamed_frozen_bytes(graph, 0, n - 1, STREAM_SETS) == charge
    assert streamed_frozen_bytes(graph, 0, n - 1, 1) == layer + table + small + read  # one set: one layer's
    assert streamed_frozen_bytes(graph, 0, n - 1, 20) == LAYERS * layer + table + small + read  # a set each
    mapped = _terms(graph, _device(graph, "per-block"))
    assert mapped.frozen_bytes == {STREAMED_FROZEN: charge}
    assert "frozen " + STREAMED_FROZEN in mapped.by_name()  # what `show` prints
    held = _terms(graph, _device(graph, "per-block", mapped=False))
    assert sum(held.frozen_bytes.values()) >= LAYERS * layer + table  # the base held: every layer's
    assert held.total - mapped.total == sum(held.frozen_bytes.values()) - charge
    device = _device(graph, "per-block")
    assert memory_parts(graph, device, 0, n - 1, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == charge
    # a one-device run's step charges what its set-up (the base given back) does not hold
    assert (step_bytes(graph, "adamw", "mnn", "per-block", "float32", 1, True)
            - step_bytes(graph, "adamw", "mnn", "per-block", "float32", 1, False)) == charge


def test_a_stage_that_only_looks_its_table_up_is_not_charged_it(graph):
    """The embeddings and the first three layers (sets 1-3): the table's rows gathered in numpy a span at a time,
    its pages given back after each (one read's spans charged); the head and the loss alone: the table whole (no
    weight streamed, nothing looked up: no read charged beside it)."""
    layer, table, small = _by_hand(graph)
    n = len(graph.blocks)
    norm = small // (2 * LAYERS + 1)  # two a layer and the final one
    first = _terms(graph, _device(graph, "per-block"), 0, 3)
    assert sum(first.frozen_bytes.values()) == 3 * (layer + 2 * norm) + _read_by_hand(graph)
    last = _terms(graph, _device(graph, "per-block"), n - 2, n - 1)
    assert sum(last.frozen_bytes.values()) == table + norm


@pytest.mark.parametrize("activations,mapped", [("per-block", False), ("per-block+1", True), ("keep", True)])
def test_only_mnn_per_block_without_cached_blocks_streams(graph, activations, mapped):
    """The base held in memory, a hybrid keeping caches (its weights constants), a kept graph: all of it."""
    device = _device(graph, activations, mapped)
    assert _terms(graph, device) == _terms(graph, replace(device, frozen_mapped=False))
    assert STREAMED_FROZEN not in _terms(graph, device).frozen_bytes


@pytest.mark.parametrize("sets", [1, STREAM_SETS])
def test_the_charged_sets_are_the_placeholders_the_engine_builds(graph, sets):
    from runtime.engines.mnn import STREAM_SETS as ENGINE_SETS, MnnStageEngine
    from runtime.engines.stage import stage_spec

    assert ENGINE_SETS == STREAM_SETS  # the planner's copy of the engine's constant
    layer, table, small = _by_hand(graph)
    n = len(graph.blocks)
    engine = MnnStageEngine(stage_spec(graph, 0, n - 1), per_block=True, stream_sets=sets)
    built = sum(int(np.prod(shape)) * 4 for _, _, shape in engine._stream._placeholders)
    assert built == streamed_frozen_bytes(graph, 0, n - 1, sets) - table - small - _read_by_hand(graph) > 0


@pytest.mark.parametrize("engine,activations,base,expected", [
    ("mnn", "per-block", "float32", True), ("torch", "per-block", "float32", True),
    ("mnn", "per-block+2", "float32", False), ("mnn", "keep", "float32", False), ("mnn", None, "float32", False),
    ("torch", "keep", "float32", False), ("mnn", "keep", "int4", True)])
def test_which_runs_read_the_base_mapped(export_dir, engine, activations, base, expected):
    """MNN or PyTorch recomputing exactly per block over a float32 base (a hybrid keeps caches: its base held as
    constants), any engine over a base held quantized; never full fine-tuning (no LoRA settings)."""
    path = made_once(export_dir / "streamed-llama", streamed_llama) / "m.onnx"
    assert read_mapped(path, replace(LORA, base_dtype=base), engine, activations) is expected
    assert read_mapped(path, None, engine, activations) is False
