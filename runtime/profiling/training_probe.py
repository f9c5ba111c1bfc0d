"""One small training step on an engine, run by the profile's engine probe (`runtime.profiling.memory`) so
that the engine's term holds what a training worker holds of it, not what its import alone left.

The PyTorch engine gives back its own libraries' loading pages at its import (`runtime.library_pages`):
~60 MiB of libtorch's file pages, of which a worker's training maps ~35-40 again (the kernels it runs,
autograd's, the update's). Measured after the import and one matrix product only, the engine's term fell
~60 MiB while a training worker's peak fell ~35: a plan came out under its worker (SmolLM2-shaped layers
per block: 411.7 MiB measured against 406.0 planned; benchmarks/MEMORY_NOTES.md, helpers h85, h99, h104).
So the probe also trains a small attention block (a pre-norm, rotary, Q/K/V, masked softmax attention,
the output projection: `runtime.engines.split.piece.attention_piece`) as a worker does: forward, backward,
the gradient summed, an AdamW update through the engine's own step (the probe runs one step: two
map the same pages, 146.3 MiB either way, helper h104). Its arrays are small (a few
hundred KiB), so what it leaves is the pages, kernels and threads training maps, not its data."""
from __future__ import annotations

import numpy as np

# A small piece (batch 2, 16 tokens, hidden 64, 2 heads of 32), SmolLM2's form of attention at that size
PROBE_SHAPE = (2, 16, 64, 2, 32)


def training_step_probe(backend: str, steps: int = 2) -> None:
    """`steps` training steps of a small attention block on `backend` (e.g. "torch:cpu:t1") in this process,
    each forward, backward summed into a running sum and an AdamW update (`engine.step`)."""
    from ir.backend import parse_backend
    from runtime.engines.factory import make_engine
    from runtime.engines.split.piece import PROJECTIONS, AttentionForm, attention_piece
    from runtime.engines.stage import stage_spec
    from runtime.optim import AdamW

    batch, seq, hidden, heads, head_size = PROBE_SHAPE
    angles = np.arange(seq, dtype=np.float32)[:, None] * np.linspace(0.0, 1.0, head_size, dtype=np.float32)
    form = AttentionForm(hidden, heads, heads, head_size, roles=frozenset(PROJECTIONS + ("norm_w",)), norm="RMSNorm",
                         norm_epsilon=1e-5, cos=np.cos(angles)[None, None], sin=np.sin(angles)[None, None])
    mask = np.zeros((batch, 1, seq, seq), np.float32)
    graph = attention_piece(batch, seq, hidden, heads, head_size, mask.shape, form=form)
    spec = stage_spec(graph, 1, 1)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((batch, seq, hidden)).astype(np.float32), "mask": mask}
    engine = make_engine(parse_backend(backend), spec)
    optimizer = AdamW(lr=1e-4)
    for _ in range(steps):
        out = engine.forward(feeds, 0)
        summed: dict = {}
        engine.backward_into(0, summed, (1e-3 * np.ones_like(np.asarray(out))).astype(np.float32))
        engine.step(optimizer, summed)
    del engine
