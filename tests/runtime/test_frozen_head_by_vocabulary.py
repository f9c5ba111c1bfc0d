"""Issue 31 target 4: the PyTorch engine's fused LM head + loss over a frozen float head runs a chunk of
vocabulary rows at a time (`runtime.engines.pytorch._FrozenLinearCrossEntropy`: an online logsumexp, the hidden
state's gradient summed over the chunks), so a table read mapped is resident a chunk at a time, not whole. Its
loss and the hidden state's gradient against PyTorch float64 cross-entropy over the whole logits, with chunks
whose last one is partial and targets on the chunks' edges, the table on a read-only file mapping."""
from __future__ import annotations

import mmap
import warnings

import numpy as np
import pytest
import torch

from ir.mapped_pages import mapping_of
from runtime.engines.pytorch import _FrozenLinearCrossEntropy, vocabulary_chunk_rows

V, H = 1000, 24  # 64-row chunks (the kernel's least): 15 whole and a last of 40


def _mapped(tmp_path, array: np.ndarray) -> np.ndarray:
    path = tmp_path / "table.bin"
    path.write_bytes(array.tobytes())
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(view, array.dtype, array.size).reshape(array.shape)


@pytest.mark.parametrize("transposed", [True, False])
def test_loss_and_hidden_gradient_equal_float64_cross_entropy(tmp_path, transposed):
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((V, H)) * 0.5).astype(np.float32)
    stored = table if transposed else np.ascontiguousarray(table.T)
    source = _mapped(tmp_path, stored)
    assert mapping_of(source) is not None and vocabulary_chunk_rows(V, H, 12, 4, 1) == 64
    hidden = torch.from_numpy(rng.standard_normal((2, 7, H)).astype(np.float32)).requires_grad_(True)
    # targets on the chunks' edges (63 | 64, 127 | 128), the first and the last row; weight 0 rows skipped
    ids = torch.tensor([[0, 63, 64, 127, 128, 999, 5], [998, 640, 639, 3, 960, 959, 1]])
    weights = torch.tensor([[1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 1, 1, 1]], dtype=torch.float32) / 12
    with warnings.catch_warnings():  # read-only, as the engine views a mapped base (nothing writes it)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        tensor = torch.from_numpy(source)
    loss = _FrozenLinearCrossEntropy.apply(hidden, ids, weights, tensor, transposed, source, 1)
    loss.backward()

    h64 = hidden.detach().double().requires_grad_(True)
    logits = h64 @ torch.from_numpy(table).double().t()
    per_row = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids.reshape(-1), reduction="none")
    expected = (weights.double().reshape(-1) * per_row).sum()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    scale = h64.grad.abs().max().item()
    np.testing.assert_allclose(hidden.grad.double().numpy(), h64.grad.numpy(), rtol=0, atol=1e-6 * scale)
