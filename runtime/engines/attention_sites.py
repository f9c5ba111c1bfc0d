"""Which attention sites of a stage an engine may run as one unit instead of node by node.

The lowering places each block's attention (`ir.graph.AttentionSite`: its nodes, its input, mask,
weights by role, scale, pre-norm and rotary tables; `planner.attention`), and the head-split
engine already computes exactly that form piece by piece (`runtime.engines.split.piece`). An
engine with a fused attention kernel (PyTorch's scaled_dot_product_attention) can compute the
whole site at once: fewer ops, and no score or probability matrices kept for the backward.

It may only do so where the site is the whole story (`ir.attention_fusion.fusable_site`, the one
predicate, which the memory model reads too). Anything else runs node by node.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.attention_fusion import fusable_site
from ir.graph import AttentionSite
from runtime.engines.stage import StageSpec


@dataclass(frozen=True)
class AttentionUnit:
    """One block's attention as a unit: `at` is the stage's node after which it runs (the site's
    last), `nodes` the site's nodes the node-by-node loop skips; `heads` query heads and
    `kv_heads` key/value heads (fewer under grouped-query attention) of `head_size`."""

    block: int
    site: AttentionSite
    at: str
    nodes: frozenset[str]
    heads: int
    kv_heads: int
    head_size: int

    def weight(self, role: str) -> tuple[str, bool, int | None, int | None] | None:
        """(graph constant, stored transposed, first column, end column) of `role`, None if absent."""
        for w in self.site.weights:
            if w[0] == role:
                name, transposed, *cols = w[1:]
                first, end = (cols + [None, None])[:2]
                return name, bool(transposed), first, end
        return None


def attention_units(spec: StageSpec) -> dict[str, AttentionUnit]:
    """The stage's attention sites that can run as one unit, keyed by the node after which each runs."""
    units: dict[str, AttentionUnit] = {}
    for block in spec.blocks:
        at = fusable_site(spec.graph, spec.compute_nodes, spec.output, block)
        if at is not None:
            units[at] = AttentionUnit(block.index, block.attention, at, frozenset(block.attention.nodes),
                                      int(block.heads), int(block.split_units), int(block.head_size))
    return units
