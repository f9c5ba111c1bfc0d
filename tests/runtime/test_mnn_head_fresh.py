"""MNN's fused LM head + loss in a profile (`runtime.profiling.device.measure_block` with `builds`, as
`profile_device` runs it): both its points are a stage of the pair's peak in fresh children, as a worker's
stage pays it, not its first run in the profiling process. That first run takes whatever free heap the
profile's earlier runs left: the same llama1b head read 39.4 and 46.9 MiB at 15 targets in two profiles, and
gemma3's and llama1b's head stages ran 0.98-1.00 of their plans (benchmarks/MEMORY_NOTES.md, h152, h154, h158)."""
from __future__ import annotations

from support import gc_frozen, raise_pair_first_run

MIB = 2 ** 20


def test_an_mnn_head_is_charged_its_fresh_stage_peak_whatever_the_profiling_heap(chat_llama, monkeypatch):
    import runtime.profiling.device as dev
    from ir.backend import parse_backend
    from planner.onnx_import import load_model
    from runtime.profiling.fresh import FreshProcesses

    # the session's tiny Llama with SmolLM2's tied 49152-token table, 1 x 16
    graph = load_model(chat_llama[0], 1, 16)
    feeds = dev.synthetic_feeds(graph, 0)
    n = len(graph.blocks)
    moved = 24 * MIB  # what a profiling process's heap moves the pair's first run by (one logits-sized buffer)
    raise_pair_first_run(monkeypatch, n - 2, n - 1, moved)
    mnn = parse_backend("mnn:cpu:t1")
    with gc_frozen(), FreshProcesses(mnn) as builds:
        cost = dev.measure_block(mnn, graph, graph.blocks[n - 2], feeds, reps=1, builds=builds)
        # the reference: the pair as a stage of its own in a new interpreter, not a child of the fork server
        # (here 23.7 MiB against the children's 24.8)
        alone = builds.run_new(graph, feeds, [("peak", n - 2, n - 1, None)])[0]
    assert abs(cost.workspace_bytes - alone) <= 2 * MIB, (cost.workspace_bytes / MIB, alone / MIB)
    assert cost.sparse_workspace_bytes is not None and cost.sparse_workspace_bytes <= cost.workspace_bytes
    assert cost.sparse_target_positions < cost.target_positions
