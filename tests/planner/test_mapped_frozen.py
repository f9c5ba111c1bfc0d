"""Issue 31 target 4: the memory model's charge for a stage whose float32 frozen weights are read mapped from the
model file by PyTorch recomputing per block (`planner.cost.maps_frozen`): its largest block's frozen bytes
("frozen weights mapped, one block resident"), not the stage's, and only where the run maps (`DeviceSpec.
frozen_mapped`), the engine is PyTorch and it recomputes per block; checked against the graph's own arrays.
The engine's side: tests/runtime/test_torch_mapped_base.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from jobs.common.lora import adapted
from jobs.common.memory_check import step_bytes
from planner.cluster import DeviceSpec
from planner.cost import MAPPED_FROZEN, stage_memory_terms
from planner.lora import LoraSettings
from planner.memory_defaults import default_profile, memory_parts
from planner.onnx_import import load_model


@pytest.fixture(scope="module")
def graph(chat_llama):
    """The tiny chat Llama under LoRA on q, k, v, o over its float32 base: a 12 MiB tied table (the embeddings'
    block and the head's each read it) and two small layers."""
    return adapted(load_model(chat_llama[0], 1, 16),
                   LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="float32"))


def _device(graph, backend: str, activations: str | None, mapped: bool) -> DeviceSpec:
    profile = default_profile(graph, backend=backend, per_block=True)
    return DeviceSpec("d0", "tcp://127.0.0.1:1", profile, 2 ** 40, backend, activations=activations,
                      frozen_mapped=mapped)


def _terms(graph, device):
    return stage_memory_terms(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")


def test_a_mapped_torch_per_block_stage_is_charged_its_largest_blocks_frozen_bytes(graph):
    table = next(v for k, v in graph.constants.items() if "embed" in k and v.ndim == 2)
    layer_weights = sum(int(v.nbytes) for k, v in graph.constants.items()
                        if ".layers." in k and k not in graph.params and v.ndim == 2)
    assert table.nbytes > 2 * layer_weights
    head = table.nbytes + graph.constants["model.norm.weight"].nbytes  # the largest block: the final norm and the head
    held = _terms(graph, _device(graph, "torch:cpu:t1", "per-block", False))
    mapped = _terms(graph, _device(graph, "torch:cpu:t1", "per-block", True))
    assert mapped.frozen_bytes == {MAPPED_FROZEN: head}
    assert "frozen " + MAPPED_FROZEN in mapped.by_name()  # what `show` prints
    # the stage held the table once and every layer's weights (and the norms' scales)
    spared = sum(held.frozen_bytes.values()) - head
    assert spared >= layer_weights
    assert held.total - mapped.total == spared
    device = _device(graph, "torch:cpu:t1", "per-block", True)
    assert memory_parts(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == head
    # a one-device run's step charges the resident block its set-up (read with the base given back) does not hold
    assert (step_bytes(graph, "adamw", "torch", "per-block", "float32", 1, True)
            - step_bytes(graph, "adamw", "torch", "per-block", "float32", 1, False)) == head


@pytest.mark.parametrize("backend,activations,mapped", [("torch:cpu:t1", "per-block", False),
                                                       ("torch:cpu:t1", "keep", True),
                                                       ("torch:cpu:t1", "recompute", True),
                                                       ("mnn:cpu:t1", "per-block+1", True)])
def test_only_a_mapped_torch_per_block_stage_is_charged_so(graph, backend, activations, mapped):
    """The base held in memory, a graph kept for the whole backward, an MNN hybrid's copies of its constants: all
    of it. (MNN per block streams a mapped base: tests/planner/test_streamed_frozen.py.)"""
    device = _device(graph, backend, activations, mapped)
    assert _terms(graph, device) == _terms(graph, replace(device, frozen_mapped=False))
    assert MAPPED_FROZEN not in _terms(graph, device).frozen_bytes


def test_a_table_only_looked_up_is_not_charged_resident(tiny_onnx):
    """The tiny BERT under LoRA, base mapped, on PyTorch per block: its word table is only looked up (the rows
    gathered, the embeddings block's pages given back after its forward), so a block is charged its other frozen
    weights, read off the graph's arrays: the embeddings block alone its position and type tables and LayerNorm,
    the whole model its largest layer's. The merge tree of helper h161 charged the table (MiniLM NER: 45 MiB, read
    0.85-0.88 of its plan)."""
    from support import tiny_lora_graph

    g = tiny_lora_graph(tiny_onnx["torchscript-17"])
    gathered = {n.inputs[0] for n in g.nodes if n.op == "Gather" and n.inputs[0] in g.constants}
    read_otherwise = {i for n in g.nodes if n.op != "Gather" for i in n.inputs}
    only_looked_up = gathered - read_otherwise
    frozen = [sum(int(g.constants[i].nbytes) for i in {i for name in b.nodes for i in g.node(name).inputs}
                  if i in g.constants and i not in g.params and i not in only_looked_up
                  and g.constants[i].dtype.kind == "f" and g.constants[i].size > 1) for b in g.blocks]  # not scalars
    word = max(int(g.constants[t].nbytes) for t in only_looked_up)
    assert word > 100 * frozen[0]  # charged, the table would set the embeddings block's figure
    device = _device(g, "torch:cpu:t1", "per-block", True)
    for last, expected in ((0, frozen[0]), (len(g.blocks) - 1, max(frozen))):
        assert memory_parts(g, device, 0, last, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == expected


@pytest.fixture(scope="module")
def int4_graph(export_dir):
    """A tiny tied Llama whose file stores its base int4 (the table int8), loaded mapped under LoRA int4."""
    from support import made_once, stored_int4_llama

    path = made_once(export_dir / "stored-int4-llama", stored_int4_llama) / "m.onnx"
    return adapted(load_model(path, 1, 16, mapped=True),
                   LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="int4"))


def test_a_stored_int4_base_mapped_on_torch_per_block_is_charged_its_largest_block(int4_graph):
    """PyTorch per block reads a base the file stores int4 in place and gives each block's pages back
    (tests/runtime/test_torch_stored_int4_base.py): charged its largest block's stored bytes (codes, scales,
    offsets) and norm scales, read off the graph's arrays, not the whole packed base; on MNN (which copies the
    parts into its constants) and unmapped, the whole base as before."""
    from ir.precision import QuantizedTensor

    g = int4_graph

    def by_hand(block) -> int:
        read = {i for name in block.nodes for i in g.node(name).inputs if i in g.constants and i not in g.params}
        return sum(int(g.constants[i].nbytes) for i in read
                   if isinstance(g.constants[i], QuantizedTensor) or i.endswith("norm.weight"))

    largest = max(by_hand(b) for b in g.blocks)
    assert largest == by_hand(g.blocks[1])  # a layer's projections, beyond the int8 table's 17 KiB
    stored = sum(int(v.nbytes) for v in g.constants.values() if isinstance(v, QuantizedTensor))
    assert stored > 2.5 * largest
    mapped = _terms(g, _device(g, "torch:cpu:t1", "per-block", True))
    held = _terms(g, _device(g, "torch:cpu:t1", "per-block", False))
    assert mapped.frozen_bytes == {MAPPED_FROZEN: largest}
    assert "frozen " + MAPPED_FROZEN in mapped.by_name()  # what `show` prints
    assert sum(held.frozen_bytes.values()) >= stored and held.total - mapped.total == sum(held.frozen_bytes.values()) - largest
    device = _device(g, "torch:cpu:t1", "per-block", True)
    assert memory_parts(g, device, 0, len(g.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == largest
    assert (step_bytes(g, "adamw", "torch", "per-block", "int4", 1, True)
            - step_bytes(g, "adamw", "torch", "per-block", "int4", 1, False)) == largest
    for backend, activations in (("mnn:cpu:t1", "per-block"), ("torch:cpu:t1", "keep")):
        device = _device(g, backend, activations, True)
        assert _terms(g, device) == _terms(g, replace(device, frozen_mapped=False)), backend
        assert memory_parts(g, device, 0, len(g.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw") == \
            memory_parts(g, replace(device, frozen_mapped=False), 0, len(g.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")
    engine = "mnn"
    assert step_bytes(g, "adamw", engine, "per-block", "int4", 1, True) == \
        step_bytes(g, "adamw", engine, "per-block", "int4", 1, False)


def test_a_frozen_head_is_charged_one_vocabulary_chunk_of_its_table(graph, monkeypatch):
    """The PyTorch engine's fused head + loss over a frozen float32 table reads it a chunk of vocabulary rows at a
    time, each chunk's pages given back (`runtime.engines.pytorch._FrozenLinearCrossEntropy`), and the tied
    table's lookup gathers its rows: with a chunk smaller than the table (here 1 MiB, a 12 MiB table) the head's
    block is charged the final norm and one chunk of rows (as many as the larger of the rows and the logits of the
    micro-batch's 16 positions is the chunk), the embeddings' block none of the table, read off the graph's arrays.
    h165's tree charged the table whole in both (a Qwen2.5-0.5B-class head: 519 MiB of a 1171 MiB plan)."""
    import planner.cost as cost

    monkeypatch.setattr(cost, "LOSS_CHUNK_BYTES", 1 << 20)
    table = next(v for k, v in graph.constants.items() if "embed" in k and v.ndim == 2)
    vocab, hidden = table.shape
    rows = max(64, (1 << 20) // (4 * max(16, hidden)))
    assert rows * hidden * 4 < table.nbytes // 8
    layers = [sum(int(v.nbytes) for k, v in graph.constants.items() if f".layers.{i}." in k and k not in graph.params)
              for i in range(2)]
    head = rows * hidden * 4 + graph.constants["model.norm.weight"].nbytes
    device = _device(graph, "torch:cpu:t1", "per-block", True)
    assert memory_parts(graph, device, 0, 0, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == 0  # the embeddings' block
    whole = memory_parts(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")["frozen"]
    assert whole == max(head, *layers)


def test_an_mnn_streamed_stage_is_charged_one_vocabulary_chunk_of_its_frozen_head(graph, monkeypatch):
    """The MNN engine's fused head + loss over a frozen float32 table reads it a chunk of vocabulary rows at a time,
    each chunk's pages given back (`runtime.engines.lm_loss.frozen_linear_cross_entropy`), charged by the same rule
    as PyTorch's (`planner.cost.head_table_chunk`): with a 1 MiB chunk against the 12 MiB tied table, a per-block
    stage streaming its mapped base is charged every frozen weight of the model but the table (2 layers, under the
    engine's 10 placeholder sets: each layer's own; the norms' scales) and one chunk of the table's rows, read off
    the graph's arrays; plus one read of the mapping (helper h172: a fault maps up to a 2 MiB span of the file, and
    a lookup's rows or a weight under 2 MiB lie in at most two spans: 4 MiB). h167's tree charged the table whole
    (a Qwen2.5-0.5B-class head: 519 MiB)."""
    import planner.cost as cost

    monkeypatch.setattr(cost, "LOSS_CHUNK_BYTES", 1 << 20)
    table = next(v for k, v in graph.constants.items() if "embed" in k and v.ndim == 2)
    vocab, hidden = table.shape
    rows = max(64, (1 << 20) // (4 * max(16, hidden)))
    assert rows * hidden * 4 < table.nbytes // 8
    others = sum(int(v.nbytes) for k, v in graph.constants.items()
                 if k.startswith("model.") and k not in graph.params and "embed" not in k)
    assert max(int(v.nbytes) for k, v in graph.constants.items() if k.startswith("model.") and "embed" not in k) \
        <= 2 << 20
    read = 2 * (2 << 20)
    device = _device(graph, "mnn:cpu:t1", "per-block", True)
    assert memory_parts(graph, device, 0, len(graph.blocks) - 1, 0, 1, "1f1b-flush", 1, "adamw")["frozen"] == \
        others + rows * hidden * 4 + read
    assert (step_bytes(graph, "adamw", "mnn", "per-block", "float32", 1, True)
            - step_bytes(graph, "adamw", "mnn", "per-block", "float32", 1, False)) == others + rows * hidden * 4 + read
