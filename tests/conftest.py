"""Shared fixtures: real ONNX files from the real PyTorch exporters, made once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

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


def _export(checkpoint: Path, out: Path, **options) -> Path:
    from confidant.export import ExportOptions, export_checkpoint

    if not out.exists():
        export_checkpoint(checkpoint, out, ExportOptions(**options))
    return out


@pytest.fixture(scope="session")
def tiny_onnx(export_dir, tiny_checkpoint) -> dict[str, Path]:
    """The tiny BERT through both exporters and several opsets (decomposed and fused LayerNorm)."""
    return {
        "torchscript-14": _export(tiny_checkpoint, export_dir / "tiny-ts14.onnx", opset=14),
        "torchscript-17": _export(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17),
        "dynamo-18": _export(tiny_checkpoint, export_dir / "tiny-dyn18.onnx", opset=18, dynamo=True),
        # opset 20 has a Gelu operator: the fused form must lower like the decomposed one
        "dynamo-20": _export(tiny_checkpoint, export_dir / "tiny-dyn20.onnx", opset=20, dynamo=True),
    }


@pytest.fixture(scope="session")
def minilm_onnx(export_dir) -> Path:
    from confidant.export import default_checkpoint_dir

    return _export(default_checkpoint_dir(), export_dir / "minilm-ts17.onnx", opset=17)


def token_feeds(batch: int, seq: int, vocab: int, num_labels: int = 9, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token inputs with one padded row and targets normalised by the labelled count."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2:] = 0
    labels = rng.integers(0, num_labels, (batch, seq))
    weights = mask / mask.sum()
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((batch, seq), np.int64),
        "targets": (np.eye(num_labels)[labels] * weights[..., None]).astype(np.float32),
    }
