"""Issue 31 target 4 on MNN: the engine's LM head fused with its loss over a frozen float32 table (LoRA's base,
read mapped from the model file) runs a chunk of vocabulary rows at a time (`runtime.engines.lm_loss.
frozen_linear_cross_entropy`: an online logsumexp, the hidden state's gradient summed over the chunks in the same
pass), each chunk's pages given back once read, so the table is resident a chunk at a time. Through the MNN
engine (a per-block stage of the head and the loss, a tiny random tied Llama whose 30000 x 256 table lies on the
file's mapping): the loss and the head's input gradient against PyTorch float64 (RMSNorm, the logits, cross-
entropy over the whole vocabulary) with 64-row chunks whose last is partial and targets on the chunks' edges; and
the table's pages resident during the head's pass (the process's peak above its level before it) a small part of
the table. Before (helper h171) the pass split by target rows, each piece reading every row of the table: the
Qwen2.5-0.5B-class table's 519 MiB resident through it (benchmarks/MEMORY_NOTES.md, h165)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ir.mapped_pages import drop_pages_under, mapping_of
from jobs.common.lora import adapted
from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from planner.lora import LoraSettings
from planner.onnx_import import load_model
from runtime.engines import lm_loss
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.procfs import peak_rss_bytes, reset_peak_rss, status_bytes
from tests.support import gc_frozen

VOCAB, HIDDEN, ROWS, SEQ = 30000, 256, 2, 16  # 64-row chunks: 468 whole and a last of 48
TABLE = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = export_causal_lm(random_causal_lm("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1),
                            tmp_path_factory.mktemp("mnn-frozen-head") / "m.onnx", LlmExportOptions(), kv_cache=False)
    return adapted(load_model(path, ROWS, SEQ, loss="causal-lm", mapped=True),
                   LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="float32"))


def _engine(graph):
    n = len(graph.blocks)
    spec = stage_spec(graph, n - 2, n - 1)  # the final norm and the head, then the loss
    engine = MnnStageEngine(spec, per_block=True)
    assert engine._stream is not None and mapping_of(graph.constants[TABLE]) is not None  # read mapped
    return spec, engine


def _feeds(spec, graph):
    rng = np.random.default_rng(3)
    # targets on the chunks' edges (63 | 64, 127 | 128, 29951 | 29952), the first and the last row
    ids = rng.integers(0, VOCAB, (ROWS, SEQ))
    ids[0, :8] = [0, 63, 64, 127, 128, 29951, 29952, VOCAB - 1]
    weights = (rng.random((ROWS, SEQ)) < 0.8).astype(np.float32)
    weights[0, :8] = 1
    weights /= weights.sum()
    x = rng.standard_normal(graph.values[spec.activation_input].shape).astype(np.float32)
    return {spec.activation_input: x, "target_ids": ids.astype(np.int64), "target_weights": weights}


def test_loss_and_hidden_gradient_equal_float64_cross_entropy(graph, monkeypatch):
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 1)  # the least: 64 rows a chunk
    spec, engine = _engine(graph)
    feeds = _feeds(spec, graph)
    loss = float(np.asarray(engine.forward(feeds, 0)).reshape(-1)[0])
    dx = engine.backward(0).activation_input

    norm = next(graph.node(x) for x in graph.blocks[-2].nodes if graph.node(x).op == "RMSNorm")
    x = torch.from_numpy(feeds[spec.activation_input]).double().requires_grad_(True)
    scale = torch.from_numpy(np.array(graph.constants[norm.inputs[1]])).double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.attrs["epsilon"]) * scale
    logits = y @ torch.from_numpy(np.array(graph.constants[TABLE])).double().t()
    per_row = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                torch.from_numpy(feeds["target_ids"]).reshape(-1), reduction="none")
    expected = (torch.from_numpy(feeds["target_weights"]).double().reshape(-1) * per_row).sum()
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    largest = x.grad.abs().max().item()
    np.testing.assert_allclose(np.asarray(dx, np.float64), x.grad.numpy(), rtol=0, atol=1e-5 * largest)


def test_the_table_is_resident_a_chunk_at_a_time(graph, monkeypatch):
    """The head's training forward (the pass that also makes the gradient), from none of the table's pages
    resident: the process's peak above its level before rises by under a quarter of the 29 MiB table with 1 MiB
    chunks (1024 rows; the kernel maps a few MiB more than the chunk it reads: large folios); the pass that
    split by target rows held every page of it until its end."""
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 1 << 20)
    spec, engine = _engine(graph)
    feeds = _feeds(spec, graph)
    table = graph.constants[TABLE]
    assert table.nbytes > 29 << 20
    engine.forward(feeds, 0)  # once to build what the first run builds
    engine.backward(0)
    with gc_frozen():
        drop_pages_under([table])
        before = status_bytes("VmRSS")
        if not reset_peak_rss():
            pytest.skip("the peak RSS cannot be reset here")
        engine.forward(feeds, 0)
        rise = peak_rss_bytes() - before
    engine.backward(0)
    assert rise < table.nbytes // 4, (rise, table.nbytes)
