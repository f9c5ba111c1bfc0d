"""MNN full fine-tuning's per-block line measured as a worker's second step (issue 31 target 3): a worker
holds its stage's weight gradients once, as its running sum, and from its second step on its backwards run
beside AdamW's moments. Measured on a fresh engine's `backward` (which returns a stage's whole gradient set)
the line held the layers' gradients that the gradient term charges too, and SmolLM2's full fine-tuning
stages ran 0.85 / 0.85 / 0.92 of their plans (benchmarks/MEMORY_NOTES.md, h43, h56, h61, h69). The profile
now measures the line as a worker's second step (`runtime.profiling.compute.summed_workspace`, each point in
a new interpreter) and leaves the gradients to the gradient term."""
from __future__ import annotations

import logging
import statistics

import pytest

from support import run_child

MIB = 2 ** 20

# A worker's two steps of a middle stage, written here apart from the profile's code: a new interpreter that
# imported what a worker imports, the stage loaded from a job file as a worker loads its bundle, its engine
# built taking the weights, 1f1b-flush's order of a middle stage with 4 micro-batches (one forward ahead), each
# backward summed into the running sum, AdamW's update; the second step's peak (VmHWM from its start, the heap
# not trimmed) above the built engine.
_WORKER = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
import runtime.pipeline.worker, runtime.engines.mnn, runtime.transport.zeromq
import numpy as np
from ir.backend import parse_backend
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.procfs import release_free_heap, reset_peak_rss, status_bytes
from runtime.profiling.fresh import _read_job

graph, feeds, [(_, first, last, activations)] = _read_job(sys.argv[2])
spec = stage_spec(graph, first, last)
engine = make_engine(parse_backend("mnn:cpu:t1"), spec, activations=activations, take_weights=True)
engine.row_gradients = True
del graph
gc.collect()
release_free_heap()
base = status_bytes("VmRSS")
rng = np.random.default_rng(1)
x = spec.activation_input
shape = spec.graph.values[x].shape
out_shape = spec.graph.values[spec.output].shape
optimizer = make_optimizer("adamw", 1e-4)
order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]

def step():
    grads = {}
    for kind, m in order:
        if kind == "F":
            mb = {k: np.array(feeds[k]) for k in spec.graph_inputs}
            mb[x] = rng.standard_normal(shape).astype(np.float32)
            engine.forward(mb, m)
        else:
            engine.backward_into(m, grads, (1e-3 * rng.standard_normal(out_shape)).astype(np.float32))
    engine.step(optimizer, grads)

step()
reset_peak_rss()
step()
print("WORKER " + json.dumps({"peak": status_bytes("VmHWM") - base}), flush=True)
"""


@pytest.mark.slow  # a SmolLM2-layer-shaped export, its MNN profile and three new interpreters (~4-6 min loaded)
def test_a_full_fine_tuning_stage_is_charged_what_a_worker_s_second_step_holds(tmp_path, caplog):
    """A SmolLM2-layer-shaped float32 Llama (hidden 576, 9 / 3 heads, 4 layers, vocabulary 4096), full
    fine-tuning, profiled on MNN: what the plan charges a per-block middle stage of its 4 layers beyond its
    weights (the gradient sum, AdamW's moments, the activations, the workspace, the start-up a per-block
    stage is charged) against what a new interpreter running that stage's two steps as a worker peaks
    above its built engine in its second step (median of 3): not below it less 1 MiB, nor above it plus
    a quarter of the stage's gradients. With the line measured on a fresh engine's backward (main before
    h70) the layers' gradients are charged twice, less what that line misses beside the moments: measured
    273.8 MiB against 253.9 (+19.9, the bound +13.5), failing."""
    from ir.graph import block_signature
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from planner.cluster import DeviceSpec
    from planner.cost import stage_memory_terms
    from planner.onnx_import import load_model
    from runtime.profiling import fresh as fresh_processes
    from runtime.profiling.device import profile_device
    from runtime.profiling.inputs import synthetic_feeds

    model = export_causal_lm(random_causal_lm("llama", num_hidden_layers=4, hidden_size=576, intermediate_size=1536,
                                              vocab_size=4096, num_attention_heads=9, num_key_value_heads=3),
                             tmp_path / "smollm2-layers.onnx", LlmExportOptions(), kv_cache=False)
    graph = load_model(model, 1, 128)
    layers = [b for b in graph.blocks if block_signature(b) == block_signature(graph.blocks[1])]
    first, last = layers[0].index, layers[-1].index
    assert last - first == 3 and layers[0].params_bytes > 0 and not layers[0].frozen_bytes
    with caplog.at_level(logging.INFO, logger="runtime.profiling.device"):
        profile = profile_device(graph, "d", backends=("mnn:cpu:t1",), reps=1, attention=False)
    # the profile's raw readings per length (`runtime.profiling.device._summed_line`), for the failure message
    profile_readings = [r.getMessage() for r in caplog.records if "summed per-block line" in r.getMessage()]
    backend = profile.backends[0]
    device = DeviceSpec("d", "tcp://d:1", profile, 1 << 40, "mnn:cpu:t1", activations="per-block")
    terms = stage_memory_terms(graph, device, first, last, 1, 3, "1f1b-flush", 4, "adamw")
    start_up = backend.engine_overhead_bytes - backend.caches_start_up_bytes  # what a per-block stage is charged
    charged = (terms.gradient_bytes + terms.optimizer_state_bytes + terms.activation_bytes + terms.workspace_bytes
               + start_up)
    job = str(tmp_path / "job.json")
    fresh_processes._write_job(job, fresh_processes._stage_graph(graph, [(first, last)]), synthetic_feeds(graph, 0),
                               [("summed", first, last, "per-block")])
    readings = [run_child(_WORKER, "WORKER", job)["peak"] for _ in range(3)]
    worker = statistics.median(readings)
    gradients = sum(b.params_bytes for b in layers)
    cost = backend.blocks[block_signature(layers[0])]
    got = {"charged": charged / MIB, "worker": worker / MIB, "readings": [r / MIB for r in readings],
           "gradients": terms.gradient_bytes / MIB, "workspace": terms.workspace_bytes / MIB,
           "line": ((cost.per_block_workspace_bytes or 0) / MIB, (cost.per_block_stacked_bytes or 0) / MIB),
           "start_up": start_up / MIB, "profile_readings": profile_readings}
    print(got)
    # measured (h70, load 7-21), three runs: 254.33 against 253.77 / 254.01 / 254.14 (the line 88.2 + 0.38 a layer),
    # 281.45 against 254.26 / 254.04 / 253.93 (the line 74.8 + 13.9: FAILS), 253.91 against 254.03 / 253.91 / 253.91
    # (88.9 + 0.0): 2 of 3 with h70's median of steps. With `summed_line` (h80, load 17-27), three runs: 253.82 against
    # 254.43 / 254.14 / 253.92 (its profile's 3-layer readings 103.2-103.4, a layer's gradient high: the line 88.8 + 0.02),
    # 253.66 against 254.12 / 253.77 / 254.07, 253.62 against 253.86 / 254.02 / 254.07: 3 of 3 (benchmarks/MEMORY_NOTES.md)
    assert worker > terms.gradient_bytes + terms.optimizer_state_bytes, got  # the moments and the sum are in it
    assert worker - MIB <= charged <= worker + gradients // 4, got


def test_the_summed_line_is_not_moved_by_one_length_read_a_layer_s_gradient_high():
    """`summed_line` on the readings of SmolLM2-shaped layers (new interpreters, MiB): its 3-layer job read
    103.4 every time in one profile where 2 and 4 layers read 89.5 (h80; a worker-like run of 3 layers holds
    what 2 and 4 do), and 89.6 in others (h70). Either way the line is ~0 a further block at the 2-4 layers'
    level; h70's median of the steps between the medians of 1-4 layers (27.9, 13.9, -13.9) drew it at a
    layer's gradient (13.9 MiB) a block. With a far point the step is the steepest from that level at 4
    layers to its highest reading, and the workspace covers the far and the one-block readings."""
    from runtime.profiling.fresh import summed_line

    def mib(*values):
        return [int(v * MIB) for v in values]

    lengths = [1, 2, 3, 4]
    high = [mib(61.6, 61.6, 61.6), mib(89.5, 89.4, 89.5), mib(103.4, 103.4, 103.3), mib(89.5, 89.6, 89.5)]
    usual = [mib(61.4, 61.5, 61.4), mib(89.2, 89.8, 89.5), mib(89.6, 89.7, 89.6), mib(89.1, 89.4, 89.2)]
    for peaks in (high, usual):
        step, workspace = summed_line(peaks, lengths, 4, 5 * MIB)
        assert step < MIB // 4 and 84.2 * MIB <= workspace <= 84.7 * MIB, (step / MIB, workspace / MIB)
    # a far point at 30 layers: its step from the 4 layers' level, every far and one-block reading covered
    step, workspace = summed_line(high + [mib(103.0, 104.0)], lengths + [30], 4, 0)
    assert 0.55 * MIB <= step <= 0.57 * MIB
    assert workspace + 29 * step >= 104.0 * MIB - 1 and workspace >= 61.6 * MIB
    assert workspace + 3 * step <= 91.0 * MIB  # a 4-layer stage charged about what 2 and 4 layers read (89.5)
