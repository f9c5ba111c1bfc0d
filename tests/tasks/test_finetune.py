"""Fine-tuning the real MiniLM on generated NER data lowers the loss and raises entity F1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.ner.datagen import write_splits

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_local_learns(minilm_onnx, tmp_path):
    train, dev = write_splits(tmp_path / "data", n_train=400, n_dev=80, seed=3)
    metrics = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "confidant", "train-local", str(minilm_onnx), "--data", str(train), "--eval", str(dev),
         "--steps", "30", "--batch", "8", "--seq", "48", "--lr", "1e-4", "--optimizer", "adamw", "--seed", "1",
         "--metrics-out", str(metrics)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(metrics.read_text())
    losses = [s["loss"] for s in figures["steps"]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert figures["eval"]["after"] > figures["eval"]["before"] + 0.1, figures["eval"]
    assert figures["peak_rss_bytes"] > 100 * 2**20
    assert all(s["tokens_per_s"] > 0 for s in figures["steps"])
    assert "entity F1" in proc.stderr and "train [" in proc.stderr
