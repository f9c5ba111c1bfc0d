"""Issue 31 target 3: a PyTorch stage over a float32 LoRA base read mapped looks a frozen table's rows up a file span
at a time (`ir.mapped_pages.gather_rows`, `runtime.engines.pytorch.TorchEngine._node`), its pages given back after
each, as MNN's does (tests/runtime/test_mapped_lookup_pages.py): read at once (`F.embedding` over the mapping), a
lookup faults in a page-cache folio around each row, up to 2 MiB in a freshly written file, which the stage held
until its block's pages went back (SmolLM2 LoRA float32 over 3 PyTorch devices at 408 MiB: stage 0 measured 291.8
against 290.5 MiB planned, the plan charging none of the table: helper h178). The rows are the table's (the mapped
engine trains as one over the base in memory: tests/runtime/test_torch_mapped_base.py); while a micro-batch's rows
are gathered the process rises at most two spans of the table and a little (`planner.cost.LOOKUP_READ_SPANS`)."""
from __future__ import annotations

import pytest

from ir.mapped_pages import FAULT_SPAN_BYTES, drop_pages_under, mapping_of
from jobs.common.lora import adapted
from planner.cost import LOOKUP_READ_SPANS
from planner.lora import LoraSettings
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.procfs import reset_peak_rss, status_bytes
from support import gc_frozen, lm_step_feeds

B, SEQ = 2, 12
LORA = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="float32")


def test_a_lookup_in_a_mapped_table_holds_at_most_two_spans_of_it(chat_llama):
    graph = adapted(load_model(chat_llama[0], B, SEQ, mapped=True), LORA)
    spec = stage_spec(graph, 0, 0)  # the embedding's block alone: its lookup is what the stage reads of the file
    engine = make_engine("torch:cpu:t1", spec, activations="per-block")
    table = next(graph.constants[n.inputs[0]] for n in spec.compute_nodes if n.op == "Gather")
    assert mapping_of(table) is not None and table.nbytes > 4 * FAULT_SPAN_BYTES
    bound = LOOKUP_READ_SPANS * FAULT_SPAN_BYTES + (1 << 20)
    rises = []
    for step in range(3):
        feeds = lm_step_feeds(step, rows=B, seq=SEQ, vocab=table.shape[0])[0]
        drop_pages_under([table])
        with gc_frozen():
            level = status_bytes("VmRSS")
            if level is None or not reset_peak_rss():
                pytest.skip("needs /proc/self/status and clear_refs (Linux)")
            engine.forward(feeds, step)
            rises.append(status_bytes("VmHWM") - level)
        engine.backward(step)
    # the first forward also makes what the engine keeps (its first allocations): the later ones are the lookup's
    assert max(rises[1:]) <= bound, f"{[round(r / 2**20, 1) for r in rises]} MiB above the level (bound {bound / 2**20:.1f})"
