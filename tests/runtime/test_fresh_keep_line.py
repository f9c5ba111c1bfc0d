"""A PyTorch stage keeping every activation is charged what a fresh worker's stage peaks: the keep line
(`BlockCost.stacked_bytes`, `kept_bytes`, the workspace) measured as a worker runs, in fresh children
(`runtime.profiling.fresh`), as the per-block line is. Measured warm in the profiling process it put a
SmolLM2 int4 LoRA layer at 8.5 MiB stacked where a fresh worker's stage grows ~16 a layer, and the
middle stage of `smollm2-torch-roomy` ran 1.04-1.09x its plan in five runs (benchmarks/MEMORY_NOTES.md).
MNN's keep line too (`builds`' fork-server children): warm it charged SmolLM2's four keeping layers 14.5 MiB
over a fresh worker's peak, and the keeping last stage of the `smollm2` row ran 0.86 of its plan (h62)."""
from __future__ import annotations

import statistics

import pytest

MIB = 2 ** 20


@pytest.mark.slow  # an export, then ~50 fresh torch children, five new interpreters (~5-10 min loaded)
def test_a_keeping_stage_s_line_is_a_fresh_worker_s_peak(tmp_path, monkeypatch):
    """The memory model's keep charge of a stage of every layer of a small int4 LoRA Llama, two micro-batches
    in flight (the workspace, each further layer's stacked part, each layer's kept part once more), beside
    what a keeping worker pays of torch's start-up, covers that stage's peak in new interpreters (the largest
    of five, each under its own hash seed and address layout, as workers are: one keeping stage's peak moves
    ~3% between them under the steady heap) and is at most 10% above it: beyond the lengths the line is
    drawn through (1-4 layers and a longer stage of 6)."""
    pytest.importorskip("torch")
    from ir.backend import parse_backend
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from runtime.profiling import device
    from runtime.profiling import fresh as fresh_processes
    from runtime.profiling.inputs import synthetic_feeds

    layers, in_flight, workers = 8, 2, 5
    monkeypatch.setattr(device, "FAR_RUN", 6)  # the longer stage shorter than the worker's
    path = export_causal_lm(random_causal_lm("llama", num_hidden_layers=layers, hidden_size=576, intermediate_size=1536,
                                             vocab_size=2048), tmp_path / "m.onnx", LlmExportOptions(), kv_cache=False)
    graph, _ = add_lora(load_model(path, 1, 128),
                        LoraSettings(8, 16.0, targets=("q", "k", "v", "o"), seed=0, base_dtype="int4"))
    feeds = synthetic_feeds(graph, 0)
    backend = parse_backend("torch:cpu:t1")
    # the start-up `profile_device` charges (the embeddings' first run, a layer's keeping, then per block),
    # and what a keeping worker pays of it (the first two): the keep line is drawn less that, as a profile does
    runs = [("start_up", 0, 0, None), ("start_up", 1, 1, "keep"), ("start_up", 1, 1, "per-block")]
    with fresh_processes.FreshProcesses(backend, servers=device.FRESH_PEAK_REPEATS) as fresh:
        charged_start_up, keeping_start_up = fresh_processes.median_start_ups(fresh, graph, feeds, runs,
                                                                              device.FRESH_PEAK_REPEATS, [3, 2])
        cost = device.measure_block(backend, graph, graph.blocks[1], feeds, 1, fresh, charged_start_up,
                                    keep_start_up=keeping_start_up)
    job = str(tmp_path / "job.json")
    fresh_processes._write_job(job, fresh_processes._stage_graph(graph, [(1, layers)]), feeds,
                               [("peak2", 1, layers, "keep")])
    peaks = [fresh_processes._measure_in_new_interpreter(backend.name, job, 600)[0] for _ in range(workers)]
    worker = max(peaks)
    line = cost.workspace_bytes + (layers - 1) * cost.stacked + layers * cost.kept * (in_flight - 1)
    charged = keeping_start_up + line
    got = (charged / MIB, [p / MIB for p in peaks], keeping_start_up / MIB, charged_start_up / MIB,
           cost.workspace_bytes / MIB, cost.stacked / MIB, cost.kept / MIB)
    print("keep line", got)
    # measured (h72, four runs, load 7-21): charged 213.7 / 220.0 / 215.7 / 216.2 MiB against the largest of
    # five interpreters 210.7 / 215.2 / 211.2 / 209.0 (1.014 / 1.022 / 1.021 / 1.034; they peaked 198.7-215.2);
    # keeping start-up 46.8-47.7, workspace 26.8-29.3, stacked 12.2-12.6, kept 6.6-7.1. Main's line (through 1-4 layers less
    # the 86 MiB a per-block worker pays, clamped; in flight 1 -> 4) charged 195.6 against 208.9: 0.936
    assert worker <= charged <= 1.10 * worker, got


@pytest.mark.slow  # a SmolLM2-shaped export, its profile and three fresh interpreters (~3-4 min loaded)
def test_an_mnn_keeping_stage_is_charged_what_a_fresh_process_peaks_keeping(tmp_path):
    """On MNN a stage of k layers keeping their per-op caches is charged `workspace_bytes` + (k - 1) x
    `stacked_bytes`, beside the engine's start-up in the runtime term (`engine_overhead_bytes`: a keeping
    stage pays all of it). Against what a new interpreter peaks above its built engine running that stage's
    first steps, the stage loaded from a file as a worker loads its bundle (`runtime.profiling.fresh`'s job
    file, no fork server): at the profile's longest stage (4 layers) within 2 MiB, never below. Measured in
    the warm profiling process, after the profile's other engines, the line put SmolLM2's four keeping layers
    at 71.0 + 3.3 MiB where fresh children peak 59.8, and a keeping last stage ran 0.86 of its plan
    (benchmarks/MEMORY_NOTES.md, helper h62)."""
    from ir.graph import block_signature
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from runtime.profiling import fresh as fresh_processes
    from runtime.profiling.device import profile_device
    from runtime.profiling.inputs import synthetic_feeds
    from support import int4_lora_graph

    model = export_causal_lm(random_causal_lm("llama", num_hidden_layers=4, hidden_size=576, intermediate_size=1536,
                                              vocab_size=49152, num_attention_heads=9, num_key_value_heads=3),
                             tmp_path / "smollm2-shaped.onnx", LlmExportOptions(), kv_cache=False)
    graph = int4_lora_graph(model, 128)
    layer = graph.blocks[1]
    assert block_signature(graph.blocks[4]) == block_signature(layer)
    backend = profile_device(graph, "d", backends=("mnn:cpu:t1",), reps=1, attention=False).backends[0]
    cost = backend.blocks[block_signature(layer)]
    charged = backend.engine_overhead_bytes + cost.workspace_bytes + 3 * cost.stacked
    job = str(tmp_path / "job.json")
    fresh_processes._write_job(job, fresh_processes._stage_graph(graph, [(1, 4)]), synthetic_feeds(graph, 0),
                               [("peak", 1, 4, "keep")])
    fresh = statistics.median(fresh_processes._measure_in_new_interpreter("mnn:cpu:t1", job, 300)[0]
                              for _ in range(3))
    got = (charged / MIB, fresh / MIB, backend.engine_overhead_bytes / MIB, cost.workspace_bytes / MIB,
           cost.stacked / MIB)
    # measured (load 10-16): new interpreters 59.6 MiB; the profile 1.85 + 21.92 + 3 x 12.51 = 61.30 (the line
    # covers its highest peak, three layers' at 48.8 in fork-server children 20.8 / 32.4 / 48.8 / 59.9 for 1-4:
    # ~0.8 above four layers'; a further layer at least what a further micro-batch keeps, 12.51 against the
    # median step 11.61: ~0.9); with the keep line measured warm (main's `device.py`) 0 + 29.89 + 3 x 12.51 =
    # 67.42 against 59.57: fails
    assert fresh > 20 * MIB, got  # a peak big enough for the warm reading to miss it
    assert fresh - MIB // 2 <= charged <= fresh + 2 * MIB, got
