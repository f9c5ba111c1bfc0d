"""The PyTorch engine adds a fused LM head's weight gradient straight into the running gradient sum
(`TorchStageEngine.backward_into`, `backward_input_into`): the sum equals the sum of each micro-batch's
own gradients (float64), and from the second micro-batch on no second vocabulary x hidden array is made
beside the sum (a fresh measured peak). The full fine-tuning test's last stage peaked there, 112-115
MiB above its level for SmolLM2's 108 MiB head (benchmarks/MEMORY_NOTES.md, h129, h131)."""

import numpy as np
import pytest
import torch

from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from planner.onnx_import import load_model
from runtime.engines.base import accumulate, dense_gradient
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from runtime.procfs import release_free_heap, reset_peak_rss, status_bytes
from tests.support import gc_frozen

HEAD = "model.embed_tokens.weight"


def lm_feeds(seed: int, batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    counted = rng.random((batch, seq)) < 0.7
    counted[:, -1] = False
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
            "target_ids": np.where(counted, rng.integers(0, vocab, (batch, seq)), 0).astype(np.int64),
            "target_weights": (counted / counted.sum()).astype(np.float32)}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = export_causal_lm(random_causal_lm("llama", vocab_size=4096, num_hidden_layers=1),
                            tmp_path_factory.mktemp("head-sum") / "m.onnx", LlmExportOptions(), kv_cache=False)
    return load_model(path, 2, 16)


def _feeds(spec, graph, m: int) -> dict[str, np.ndarray]:
    feeds = lm_feeds(m, 2, 16, 4096)
    if spec.activation_input:
        feeds[spec.activation_input] = np.random.default_rng(10 + m).standard_normal(
            graph.values[spec.activation_input].shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("split", [False, True], ids=["backward_into", "split"])
@pytest.mark.parametrize("blocks", ["head+loss", "whole"])
def test_the_summed_gradient_is_the_sum_of_each_microbatchs_in_float64(graph, blocks, split):
    """Three micro-batches summed by the engine (the head's part added in place from the second on;
    on the whole model the tied table's lookup part added after it) against each micro-batch's own
    `backward` added up, float64; the split backward (B then W, zero-bubble's) likewise."""
    n = len(graph.blocks)
    spec = stage_spec(graph, *((n - 2, n - 1) if blocks == "head+loss" else (0, n - 1)))
    engine, ref = TorchStageEngine(spec, dtype=torch.float64), TorchStageEngine(spec, dtype=torch.float64)
    engine.row_gradients = ref.row_gradients = True
    engine.split_backward = split
    summed, want = {}, {}
    for m in range(3):
        engine.forward(_feeds(spec, graph, m), m)
        if split:
            result = engine.backward_input_into(m, summed)
            accumulate(summed, result.params)
            engine.backward_weight_into(m, summed)
        else:
            engine.backward_into(m, summed)
        ref.forward(_feeds(spec, graph, m), m)
        for k, g in ref.backward(m).params.items():
            want[k] = dense_gradient(g) + want[k] if k in want else dense_gradient(g).copy()
    assert HEAD in summed and set(summed) == set(want)
    for k in want:
        np.testing.assert_allclose(dense_gradient(summed[k]), want[k], rtol=1e-12, atol=1e-15, err_msg=k)


def big_head_stage(tmp_path, vocab: int, hidden: int):
    """A one-layer Llama with a big LM head (vocab x hidden), at 2 x 16, and its head + loss stage's spec."""
    path = export_causal_lm(random_causal_lm("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=256,
                                             num_hidden_layers=1), tmp_path / "m.onnx", LlmExportOptions(),
                            kv_cache=False)
    big = load_model(path, 2, 16)
    n = len(big.blocks)
    return big, stage_spec(big, n - 2, n - 1)


def test_no_second_head_sized_gradient_is_made_beside_the_sum(graph, tmp_path):
    """A head of 32 MiB (vocabulary 32768 x hidden 256, float32): the second micro-batch's backward
    into the sum peaks less than half the head's size above the level before it (fresh VmHWM); the
    head's new gradient made beside the sum (and then added) read +32 MiB and more."""
    vocab, hidden = 32768, 256
    big, spec = big_head_stage(tmp_path, vocab, hidden)
    engine = TorchStageEngine(spec, threads=1)
    engine.row_gradients = True
    head_bytes = vocab * hidden * 4
    summed: dict = {}
    feeds = [_feeds(spec, big, m) for m in range(2)]
    with gc_frozen():
        for m in range(2):
            engine.forward(feeds[m], m)
        engine.backward_into(0, summed)  # the sum: the first micro-batch's gradient itself
        assert summed[HEAD].nbytes == head_bytes
        release_free_heap()
        level = status_bytes("VmRSS")
        if level is None or not reset_peak_rss():
            pytest.skip("needs /proc/self/status and clear_refs (Linux)")
        engine.backward_into(1, summed)
        rise = status_bytes("VmHWM") - level
    assert rise < head_bytes // 2, f"{rise / 2**20:.1f} MiB above the level for a {head_bytes / 2**20:.0f} MiB head"
