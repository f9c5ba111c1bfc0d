"""Lowering a model mapped from its file and quantizing its base (issue 32: the coordinator's peak at
most the largest worker's). With `--base-dtype int4` the coordinator of SmolLM2 LoRA over 2 MNN
workers peaked at 724 MiB against workers of 361, in lowering: the tied-head check read every 2-D
weight whole (524 MiB) and quantizing the base touched every page of the float32 file, each given
back only once the whole walk was done. Now both give the pages they read back as they go
(`ir.mapped_pages.PagesGivenBack`), and the quantized base is bit for bit what it was."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ir.mapped_pages as mapped_pages_module
import ir.precision as precision_module
import planner.lora as lora_module
import planner.onnx_import as onnx_import_module
from ir.precision import QuantizedTensor
from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model
from support import ROWS, S, mapped_file_rss, wide_bert_onnx

RELEASE_EVERY = 1 << 20  # pages given back every MiB read, so the file's ~25 MiB stand out
CHUNK = 4 << 20  # what one step reads before it says so (a quantized chunk, a compared chunk)
READ_AHEAD = 2 << 20  # the kernel maps a faulting read's neighbours too


@pytest.fixture(scope="module")
def wide_graph_file(export_dir) -> Path:
    return wide_bert_onnx(export_dir)


def _int4(graph):
    return add_lora(graph, LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0,
                                        base_dtype="int4"))[0]


def test_lowering_and_quantizing_a_mapped_model_hold_a_few_mib_of_its_pages(wide_graph_file, monkeypatch):
    """While the mapped wide BERT (25 MiB of float32 weights) is lowered and its base quantized to
    int4, the model file's resident pages stay under RELEASE_EVERY + a chunk + read-ahead: after the
    tied-weights comparison (before: every 2-D weight read whole, all resident) and at every chunk
    quantized (before: growing to the whole base). The quantized base, the LoRA graph and the folded
    copies found are those of the same file lowered into memory of its own, bit for bit."""
    monkeypatch.setattr(mapped_pages_module, "RELEASE_EVERY", RELEASE_EVERY)
    after_comparison: list[int] = []
    at_chunks: list[int] = []
    real_folded, real_rows, real_frozen = (onnx_import_module.folded_transposes, precision_module._quantize_rows,
                                           lora_module.quantize_frozen)

    def folded(*args, **kwargs):
        out = real_folded(*args, **kwargs)
        after_comparison.append(mapped_file_rss(wide_graph_file))
        return out

    def rows(*args, **kwargs):
        at_chunks.append(mapped_file_rss(wide_graph_file))
        return real_rows(*args, **kwargs)

    def frozen(*args, **kwargs):
        out = real_frozen(*args, **kwargs)
        at_chunks.append(mapped_file_rss(wide_graph_file))
        return out

    monkeypatch.setattr(onnx_import_module, "folded_transposes", folded)
    monkeypatch.setattr(precision_module, "_quantize_rows", rows)
    monkeypatch.setattr(lora_module, "quantize_frozen", frozen)
    mapped = _int4(load_model(wide_graph_file, ROWS, S, mapped=True))
    weights_bytes = wide_graph_file.stat().st_size
    bound = RELEASE_EVERY + CHUNK + READ_AHEAD
    print(f"file {weights_bytes >> 10} KiB; after the comparison {[p >> 10 for p in after_comparison]} KiB; "
          f"at chunks max {max(at_chunks) >> 10} KiB over {len(at_chunks)}")
    assert after_comparison and max(after_comparison) <= bound, (after_comparison, bound)
    assert len(at_chunks) > 10 and max(at_chunks) <= bound, (max(at_chunks), bound)
    assert weights_bytes > 3 * bound  # the bound tells one chunk from the file

    monkeypatch.undo()
    held = _int4(load_model(wide_graph_file, ROWS, S, mapped=False))
    assert [n for n in mapped.nodes] == [n for n in held.nodes] and mapped.params == held.params
    assert set(mapped.constants) == set(held.constants)
    quantized = 0
    for name, value in held.constants.items():
        got = mapped.constants[name]
        assert type(got) is type(value), name
        if isinstance(value, QuantizedTensor):
            quantized += 1
            assert (got.storage, got.axis, got.block, got.shape) == (value.storage, value.axis, value.block, value.shape)
            for a, b in ((got.codes, value.codes), (got.scales, value.scales), (got.mins, value.mins)):
                assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), name
        else:
            assert np.array_equal(np.asarray(got), np.asarray(value)), name
    assert quantized >= 8


def test_the_tied_weights_check_compares_a_chunk_at_a_time_as_it_compared_whole(monkeypatch):
    """`folded_transposes` chunked: a transposed copy is found across chunk boundaries (rows not a
    multiple of the chunk), one element off anywhere is no copy, and a constant weight is skipped."""
    from onnx import helper

    monkeypatch.setattr(onnx_import_module, "_COMPARED_ELEMENTS", 1000)
    w = np.random.default_rng(0).standard_normal((7, 4285)).astype(np.float32)  # ~30 chunks, uneven
    graph = helper.make_graph([], "g", [], [])
    values = {"w": w, "w.T": np.ascontiguousarray(w.T), "flat": np.full((5, 3), 2.0, np.float32),
              "flat.T": np.full((3, 5), 2.0, np.float32)}
    assert onnx_import_module.folded_transposes(graph, values) == {"w.T": "w"}
    for at in ((4284, 6), (2000, 3), (0, 1)):
        off = dict(values, **{"w.T": values["w.T"].copy()})
        off["w.T"][at] += 1.0
        assert onnx_import_module.folded_transposes(graph, off) == {}, at
