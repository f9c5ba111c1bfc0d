"""Which attention sites of a stage an engine may run as one unit instead of node by node.

The lowering places each block's attention (`ir.graph.AttentionSite`: its nodes, its input, mask,
weights by role, scale, pre-norm and rotary tables; `planner.attention`), and the head-split
engine already computes exactly that form piece by piece (`runtime.engines.split.piece`). An
engine with a fused attention kernel (PyTorch's scaled_dot_product_attention) can compute the
whole site at once: fewer ops, and no score or probability matrices kept for the backward.

It may only do so where the site is the whole story: its nodes are all in the stage, they read
nothing from outside but the block input, the mask and constants, every float tensor constant
they read is one of the site's weights (or rotary tables), so nothing was added to it since it
was matched (LoRA adapters on a projection, for one), and nothing outside reads any value the
site makes but its residual, and only after the site's last node. Anything else runs node by node.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    position = {n.name: i for i, n in enumerate(spec.compute_nodes)}
    units: dict[str, AttentionUnit] = {}
    for block in spec.blocks:
        unit = _unit(spec, block, position)
        if unit is not None:
            units[unit.at] = unit
    return units


def _unit(spec: StageSpec, block, position: dict[str, int]) -> AttentionUnit | None:
    site = block.attention
    if site is None or not block.heads or not block.head_size or not block.split_units:
        return None
    if block.heads % block.split_units or not site.nodes or any(n not in position for n in site.nodes):
        return None
    roles = {w[0] for w in site.weights}
    if not {"Wq", "Wk", "Wv", "Wo"} <= roles or (site.norm is not None and "norm_w" not in roles):
        return None  # a form the fused kernel does not spell (a norm without its scale, say)
    if site.norm not in (None, "LayerNorm", "RMSNorm"):
        return None
    graph = spec.graph
    nodes = [spec.compute_nodes[position[n]] for n in site.nodes]
    made = {o for n in nodes for o in n.outputs}
    if site.residual not in made:
        return None
    allowed = {w[1] for w in site.weights} | set(site.rotary or ())
    for n in nodes:
        for i in n.inputs:
            if i in made or i in (site.x, site.mask):
                continue
            if i not in graph.constants:
                return None  # a computed value from outside the site
            c = graph.constants[i]
            if c.dtype.kind == "f" and c.size > 1 and i not in allowed:
                return None  # a float tensor the site's form does not know (an adapter, a bias table)
    last = max(position[n] for n in site.nodes)
    names = frozenset(site.nodes)
    for n in spec.compute_nodes:
        reads = made.intersection(n.inputs)
        if n.name in names or not reads:
            continue
        if reads != {site.residual} or position[n.name] < last:
            return None  # something outside reads the site's insides, or its output before the site ends
    if made.intersection({spec.output}) - {site.residual}:
        return None
    return AttentionUnit(block.index, site, spec.compute_nodes[last].name, names, int(block.heads),
                         int(block.split_units), int(block.head_size))
