"""Which attention sites a stage may run as one fused unit instead of node by node (PyTorch's
scaled_dot_product_attention): one predicate for the engine that fuses them (`runtime.engines.
attention_sites`) and the memory model that charges what they hold (`planner.memory_defaults.
torch_kept_bytes`: a fused site keeps no score or probability matrices).

A site (`ir.graph.AttentionSite`) may run fused only where it is the whole story: its nodes are all in
the stage, they read nothing from outside but the block input, the mask and constants, every float
tensor constant they read is one of the site's weights (or rotary tables), so nothing was added to it
since it was matched (LoRA adapters on a projection, for one), and nothing outside reads any value the
site makes but its residual, and only after the site's last node. Anything else runs node by node.
"""
from __future__ import annotations

from typing import Sequence

from ir.graph import Block, Graph, Node


def fusable_site(graph: Graph, compute_nodes: Sequence[Node], output: str, block: Block) -> str | None:
    """The name of the stage's node after which `block`'s attention site runs as one unit (the site's
    last), or None where it must run node by node. `compute_nodes`: the stage's, in order; `output`: the
    stage's output value."""
    site = block.attention
    if site is None or not block.heads or not block.head_size or not block.split_units:
        return None
    position = {n.name: i for i, n in enumerate(compute_nodes)}
    if block.heads % block.split_units or not site.nodes or any(n not in position for n in site.nodes):
        return None
    roles = {w[0] for w in site.weights}
    if not {"Wq", "Wk", "Wv", "Wo"} <= roles or (site.norm is not None and "norm_w" not in roles):
        return None  # a form the fused kernel does not spell (a norm without its scale, say)
    if site.norm not in (None, "LayerNorm", "RMSNorm"):
        return None
    nodes = [compute_nodes[position[n]] for n in site.nodes]
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
    for n in compute_nodes:
        reads = made.intersection(n.inputs)
        if n.name in names or not reads:
            continue
        if reads != {site.residual} or position[n.name] < last:
            return None  # something outside reads the site's insides, or its output before the site ends
    if made.intersection({output}) - {site.residual}:
        return None
    return compute_nodes[last].name
