"""Memory lines measured as a fresh worker runs (`runtime.profiling.fresh`): each peak in a child
process that has only imported the runtime and its engine, never the profiling process, whose heap
has room a worker's has not (a fresh PyTorch worker recomputing SmolLM2 int4 layers per block grew
~3.5-4 MiB a further layer where the warm profile measured 0.5-3.1; benchmarks/MEMORY_NOTES.md)."""
from __future__ import annotations

import pytest

MIB = 2 ** 20


def test_the_fresh_line_is_the_median_step_less_the_start_up_and_covers_every_peak():
    from runtime.profiling.fresh import fresh_line

    # stages of 1-4 layers, three fresh peaks each (MiB): a start-up of 80 in every one, 4 a layer,
    # one repeat of the three-layer stage 30 higher (a jump: charged once, not per layer)
    peaks = [[100, 101, 99], [104, 105, 104], [108, 138, 108], [112, 112, 113]]
    step, workspace = fresh_line([[p * MIB for p in r] for r in peaks], 80 * MIB)
    assert step == 4 * MIB
    assert workspace == (138 - 80 - 2 * 4) * MIB  # the high repeat less what two further layers stack
    for k, repeats in enumerate(peaks):  # with the start-up charged beside it, every stage is covered
        assert 80 * MIB + workspace + k * step >= max(repeats) * MIB
    # two lengths: the one step; nothing below zero, the workspace at least the step
    assert fresh_line([[10 * MIB], [9 * MIB]], 0) == (0, 10 * MIB)
    assert fresh_line([[10 * MIB], [16 * MIB]], 20 * MIB) == (6 * MIB, 6 * MIB)


@pytest.mark.slow  # a tiny export, torch in this process and in a child (~30-60 s loaded)
def test_a_fresh_measurement_pays_what_a_worker_s_first_steps_pay_and_a_warm_repeat_does_not(tmp_path):
    """A torch layer's peak measured in a fresh child includes torch's start-up (its first steps' kernels
    and buffers, tens of MiB), as a worker's first steps do; the same measurement repeated in this process
    after a first run does not. So the children are fresh, not copies of this process's heap."""
    pytest.importorskip("torch")
    from ir.backend import parse_backend
    from planner.onnx_import import load_model
    from runtime.engines.stage import stage_spec
    from runtime.profiling.compute import peak_workspace
    from runtime.profiling.fresh import FreshProcesses
    from runtime.profiling.inputs import synthetic_feeds
    from tests.support import tiny_tied_llama

    _, path = tiny_tied_llama(tmp_path)
    graph = load_model(path, 2, 32)
    feeds = synthetic_feeds(graph, 0)
    backend = parse_backend("torch:cpu:t1")
    spec = stage_spec(graph, 1, 2)
    warm = [peak_workspace(backend, spec, feeds, "per-block") for _ in range(2)][-1]
    with FreshProcesses(backend) as fresh:
        first, again = fresh.run(graph, feeds, [("peak", 1, 2, "per-block"), ("peak", 1, 2, "per-block")])
    assert first > again + 10 * MIB and first > warm + 10 * MIB, (first / MIB, again / MIB, warm / MIB)
