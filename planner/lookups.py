"""Which rows of each embedding table the training data looks up: `Graph.lookup_rows`, from the
feeds of the batches a run trains on (`confidant plan --data`, checked again by `confidant train`).

An embedding table's optimizer state is kept only for the rows that ever had a gradient
(runtime.optim), so a run over data that uses a few thousand of a vocabulary's tens of thousands of
tokens holds a small part of the table's AdamW moments (`planner.cost.table_state_delta_bytes`).
Only a table whose indices are a graph input as fed (through ops that keep the values: casts and
reshapes) is counted; one indexed by anything computed in the graph (position ids made by a Range)
is left out, and the memory model charges it dense.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from ir.graph import Graph
from planner.cost import ROWS_DENSE_SHARE, looked_up_only

# ops whose output holds exactly its first input's values (in another shape or integer type)
_SAME_VALUES = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"})


def table_index_inputs(graph: Graph) -> dict[str, str]:
    """Each embedding table (the constant first input of a Gather along axis 0) every lookup of
    which takes its indices from one graph input as fed -> that input's name."""
    producers = graph.producers()
    fed = {v.name for v in graph.inputs}
    found: dict[str, str | None] = {}
    for node in graph.nodes:
        if node.op != "Gather" or node.inputs[0] not in graph.constants:
            continue
        table = node.inputs[0]
        source: str | None = node.inputs[1]
        while source is not None and source not in fed:
            producer = producers.get(source)
            source = producer.inputs[0] if producer is not None and producer.op in _SAME_VALUES else None
        if int(node.attr("axis", 0)) != 0 or (table in found and found[table] != source):
            source = None
        found[table] = source
    return {t: s for t, s in found.items() if s is not None}


def lookup_rows(graph: Graph, feeds: Iterable[Mapping[str, np.ndarray]]) -> dict[str, int]:
    """Distinct rows of each table of `table_index_inputs` that the feeds (one dict per micro-batch,
    or per batch) look up, negative indices counted from the end as a lookup takes them. A table
    whose input no feed holds is left out (unknown)."""
    sources = table_index_inputs(graph)
    seen: dict[str, np.ndarray] = {}
    for feed in feeds:
        for table, name in sources.items():
            if name not in feed:
                continue
            rows = int(graph.constants[table].shape[0])
            ids = np.asarray(feed[name]).reshape(-1).astype(np.int64)
            bad = ids[(ids < -rows) | (ids >= rows)]
            if bad.size:
                raise ValueError(f"input {name!r} holds index {int(bad[0])}, outside table {table!r} of {rows} rows")
            mask = seen.setdefault(table, np.zeros(rows, bool))
            mask[ids % rows] = True
    return {table: int(mask.sum()) for table, mask in seen.items()}


def charged_rows(graph: Graph, rows: Mapping[str, int], optimizer: str) -> list[tuple[str, int, int, int | None, str]]:
    """How the memory model charges each table of `rows` (its looked-up row counts, `lookup_rows`):
    (table, rows looked up, rows in all, the rows charged or None for the whole table, why), in
    table order. Only AdamW keeps a table's state as rows, only for a table nothing but lookups
    reads (`planner.cost.looked_up_only`) and while at most ROWS_DENSE_SHARE of its rows are
    looked up; a frozen table (LoRA's base) has no state and is left out."""
    out = []
    only_looked_up = looked_up_only(graph)
    for table, n in sorted(rows.items()):
        total = int(graph.constants[table].shape[0])
        if table not in graph.params:
            continue
        charged = None
        if table not in only_looked_up:
            why = "another op reads it too (a tied head): its gradient and state are dense, charged whole"
        elif optimizer != "adamw":
            why = f"{optimizer}'s state of the table is charged whole (only AdamW's is kept as rows)"
        elif n > ROWS_DENSE_SHARE * total:
            why = f"over {ROWS_DENSE_SHARE:.0%} of them, AdamW's state of the table is dense, charged whole"
        else:
            why, charged = "AdamW's state of the table is charged for those rows", n
        out.append((table, n, total, charged, why))
    return out
