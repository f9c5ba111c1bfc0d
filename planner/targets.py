"""How many positions of a micro-batch are loss targets in the training data: `Graph.target_positions`,
from the feeds of the batches a run trains on (`confidant plan --data`, checked again by `confidant
train`).

A causal LM's fused head + loss (`runtime.engines.lm_loss`) computes logits only for the positions
that are targets (weight not 0: instruction data counts only the answers), so its workspace follows
the data; the memory model charges the most targets any micro-batch has
(`ir.profile.BlockCost.workspace_at_targets`), and a run over data with more is refused.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

# the feed of a causal LM's per-position loss weights (`ir.ops` TokenCrossEntropy's third input)
TARGET_WEIGHTS = "target_weights"


def most_target_positions(feeds: Iterable[Mapping[str, np.ndarray]]) -> int | None:
    """The most positions with a non-zero target weight in any one feed (one dict per micro-batch);
    None when no feed holds `TARGET_WEIGHTS` (not a causal LM: nothing to charge by it)."""
    most = None
    for feed in feeds:
        weights = feed.get(TARGET_WEIGHTS)
        if weights is None:
            continue
        count = int(np.count_nonzero(np.asarray(weights)))
        most = count if most is None else max(most, count)
    return most
