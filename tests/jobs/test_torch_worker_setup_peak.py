"""A PyTorch worker imports its engine before it reads its stage's weights (the setup order names the
engine, `runtime.engines.single.import_engine`): importing torch peaks ~48 MiB above where it settles
(its libraries' pages, which `runtime.engines.pytorch` gives back at its import), and the profile charges
the settled figure (`runtime.profiling.memory.engine_overhead_bytes`). Imported after the weights, that
transient stacked on them: a Gemma-3-270M-shaped stage holding only its 170 MiB int8 table peaked at
396.9 MiB while it built its engine, 1.04 of its plan's 381.3 (benchmarks/MEMORY_NOTES.md, helper h151).

A real worker process (`confidant worker`, fresh) is set up by a real coordinator with a one-stage torch
bundle whose weights are a 64 MiB table, more than the import's transient; once it is ready its peak
(VmHWM) must stand within a few MiB of what it holds (VmRSS): +0.0 MiB; main's order read +50.1 here (and 52-54
in the Gemma-shaped workers)."""
from __future__ import annotations

import os

import pytest

MIB = 2 ** 20
VOCAB, HIDDEN = 262144, 64  # a 64 MiB float32 table: more than torch's import transient (~48 MiB)


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)
                if k in ("VmRSS", "VmHWM")}


@pytest.mark.slow  # a fresh worker importing torch and a 64 MiB export: ~12 CPU s (40-50 s wall at load 8)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_torch_workers_setup_does_not_stack_the_engines_import_on_its_weights(tmp_path):
    from ir.partition import Partition, StageAssignment
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from jobs.common.workers import LocalWorkers
    from planner.emit import emit_plan
    from planner.onnx_import import load_model
    from planner.schedule import make_schedule
    from runtime.keys import KeyPair, signer
    from runtime.pipeline.coordinator import Coordinator, PipelineConfig, StagePlacement
    from runtime.transport.zeromq import ZmqTransport
    from runtime.pipeline.executor import COORDINATOR

    model = random_causal_lm("gpt2", 0, vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2, n_positions=16)
    path = export_causal_lm(model, tmp_path / "m" / "m.onnx", LlmExportOptions(example_seq=8), kv_cache=False)
    del model
    graph = load_model(path, 1, 8)
    boss = KeyPair.generate("coordinator")
    stage = Partition((StageAssignment(0, "a", 0, len(graph.blocks) - 1),), "manual")
    emit_plan(tmp_path / "plan", graph, stage, make_schedule("1f1b-flush", 1, 1), {"model": "m", "engine": "torch"},
              sign=signer(boss))
    workers = LocalWorkers.start(1, threads=1, coordinator=boss)
    transport = ZmqTransport(COORDINATOR, "tcp://127.0.0.1:0", keys=boss.curve_keys())
    try:
        address = workers.addresses[0]
        coordinator = Coordinator([StagePlacement(0, 0, len(graph.blocks) - 1, address)],
                                  PipelineConfig(schedule="1f1b-flush", microbatches=1, engine="torch", timeout_s=120),
                                  transport, [graph], worker_keys=workers.keys.workers)
        ready = coordinator.setup_bundles([tmp_path / "plan" / "a"], ["a"])
        held = _status(int(ready[0]["pid"]))
        coordinator.stop()
    finally:
        transport.close()
    workers.wait(30.0)
    over = held["VmHWM"] - held["VmRSS"]
    print(f"ready: VmRSS {held['VmRSS'] / MIB:.1f} MiB, VmHWM {held['VmHWM'] / MIB:.1f} (+{over / MIB:.1f})")
    assert held["VmRSS"] > VOCAB * HIDDEN * 4  # the table is there
    assert over < 16 * MIB, over / MIB
