"""Memory lines measured as a fresh worker runs (`runtime.profiling.fresh`): each peak in a child
process that has only imported the runtime and its engine, never the profiling process, whose heap
has room a worker's has not (a fresh PyTorch worker recomputing SmolLM2 int4 layers per block grew
~3.5-4 MiB a further layer where the warm profile measured 0.5-3.1; benchmarks/MEMORY_NOTES.md)."""
from __future__ import annotations

import numpy as np
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


def test_a_further_micro_batch_splits_into_a_per_block_line_and_a_once_a_stage_part():
    """What a second micro-batch in flight added at one block and at four (fresh peaks, two in flight less
    one): the step of the line is charged per block and further micro-batch, the rest at one block once a
    stage per further micro-batch (`BlockCost.per_block_kept_once_bytes`; planner.cost.kept_once_bytes),
    no longer put into the workspace, which charged it on every stage."""
    from runtime.profiling.device import further_microbatch_parts

    # SmolLM2 int4-like: 14 MiB at one layer, 16.1 at four: 0.7 a further layer, 13.3 once
    per_block, once = further_microbatch_parts(14 * MIB, 16.1 * MIB, 4)
    assert per_block == int(0.7 * MIB) and once == 14 * MIB - int(0.7 * MIB)
    assert further_microbatch_parts(14 * MIB, 12 * MIB, 4) == (0, 14 * MIB)  # no negative step
    assert further_microbatch_parts(-MIB, 3 * MIB, 2) == (3 * MIB, 0)  # nothing below 0
    with pytest.raises(ValueError):
        further_microbatch_parts(MIB, MIB, 1)


def test_three_fresh_readings_stop_at_two_that_agree_and_never_otherwise():
    """Children of one fork server repeat one allocation order (identical to ~0.1 MiB, h62, h72): where the
    first two readings agree within AGREE_BYTES, the median of three lies between them, so the third is
    not made; where they do not, or more than three are asked for, every reading is."""
    from runtime.profiling.fresh import AGREE_BYTES, agreeing_readings

    def reader(values):
        it = iter(values)
        return lambda: next(it)

    agree = [50 * MIB, 50 * MIB + AGREE_BYTES]
    assert agreeing_readings(reader(agree + [90 * MIB]), 3) == agree
    assert agreeing_readings(reader([50 * MIB, 50 * MIB + AGREE_BYTES + 1, 90 * MIB]), 3) == \
        [50 * MIB, 50 * MIB + AGREE_BYTES + 1, 90 * MIB]
    assert agreeing_readings(reader([7, 7, 7, 7, 7]), 5) == [7] * 5
    assert agreeing_readings(reader([7, 9]), 1) == [7]


def test_backends_of_one_engine_share_its_fork_server_and_read_what_their_own_servers_read(tiny_onnx):
    """`ForkServers`: one server per engine, handed to every backend of it (a profile's thread variants);
    each child still runs its own backend's measurement (the tiny BERT's engine build on MNN at 1 and 2
    threads: what a server of the backend's own gives, within the repeats' spread)."""
    from planner.onnx_import import load_model
    from runtime.profiling.fresh import ForkServers, FreshProcesses
    from runtime.profiling.inputs import synthetic_feeds

    graph = load_model(tiny_onnx["torchscript-14"], 2, 16)
    feeds = synthetic_feeds(graph, 0)
    job = [("engine", 1, 1, None)]
    with ForkServers() as servers:
        with FreshProcesses("mnn:cpu:t1", servers=servers) as one, FreshProcesses("mnn:cpu:t2", servers=servers) as two:
            assert one._server is two._server and one._server is not None
            shared = {"mnn:cpu:t1": one.run(graph, feeds, job)[0], "mnn:cpu:t2": two.run(graph, feeds, job)[0]}
        assert len(servers._servers) == 1
    for name, got in shared.items():
        with FreshProcesses(name) as own:
            alone = own.run(graph, feeds, job)[0]
        assert abs(got - alone) <= MIB, (name, got / MIB, alone / MIB)


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


def test_a_fresh_childs_job_goes_as_bundle_formats_and_comes_back_whole(tmp_path, minilm_onnx):
    """What a fresh child measures travels as a graph document and a safetensors file, nothing pickled:
    an int4 LoRA graph's stored weights, the feeds and the measurements come back equal, and the
    stage a child builds from it is the parent's."""
    from ir.precision import QuantizedTensor
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from runtime.profiling.fresh import _read_job, _write_job
    from runtime.profiling.inputs import synthetic_feeds

    graph, _ = add_lora(load_model(minilm_onnx, 1, 16),
                        LoraSettings(4, 8.0, targets=("q", "v"), seed=0, base_dtype="int4"))
    feeds = synthetic_feeds(graph, 0)
    jobs = [("peak", 1, 2, "per-block"), ("start_up", 1, 1, None)]
    path = str(tmp_path / "job.json")
    _write_job(path, graph, feeds, jobs)
    got, got_feeds, got_jobs = _read_job(path)
    assert got_jobs == jobs
    assert set(got_feeds) == set(feeds) and all(np.array_equal(got_feeds[k], feeds[k]) for k in feeds)
    assert set(got.constants) == set(graph.constants)
    held = [k for k, v in graph.constants.items() if isinstance(v, QuantizedTensor)]
    assert held  # the int4 base travels as its storage
    for k, v in graph.constants.items():
        w = got.constants[k]
        if isinstance(v, QuantizedTensor):
            assert isinstance(w, QuantizedTensor) and (w.storage, w.axis, w.block) == (v.storage, v.axis, v.block) \
                and np.array_equal(w.codes, v.codes) and np.array_equal(w.scales, v.scales) \
                and (v.mins is None or np.array_equal(w.mins, v.mins))
        else:
            assert np.array_equal(np.asarray(w), np.asarray(v))
    assert [b.name for b in got.blocks] == [b.name for b in graph.blocks] and got.params == graph.params
    assert open(path).read().lstrip().startswith("{")  # JSON, not a pickle


def test_a_job_written_after_an_mnn_build_in_this_process_carries_the_weights_as_stored(tmp_path, minilm_onnx):
    """An MNN engine built here leaves the graph's int4 weights holding views of its float32 scales and
    offsets (`runtime.engines.mnn._hold_once`); a fresh child's job (the profile's engine builds run after
    its in-process engines) takes them back as the float16 they were widened from, exactly."""
    from ir.precision import QuantizedTensor
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.profiling.fresh import _read_job, _stage_graph, _write_job
    from runtime.profiling.inputs import synthetic_feeds

    graph, _ = add_lora(load_model(minilm_onnx, 1, 16),
                        LoraSettings(4, 8.0, targets=("q", "v"), seed=0, base_dtype="int4"))
    stored = {k: (v.scales.copy(), None if v.mins is None else v.mins.copy()) for k, v in graph.constants.items() if isinstance(v, QuantizedTensor)}
    engine = make_engine("mnn:cpu:t1", stage_spec(graph, 1, 1))
    widened = [k for k, v in graph.constants.items() if isinstance(v, QuantizedTensor) and v.scales.dtype == np.float32]
    assert widened  # what the job's file format refused before
    del engine
    path = str(tmp_path / "job.json")
    _write_job(path, _stage_graph(graph, [(1, 1)]), synthetic_feeds(graph, 0), [("engine", 1, 1, None)])
    got, _, _ = _read_job(path)
    for k in widened:
        assert got.constants[k].scales.dtype == np.float16 and np.array_equal(got.constants[k].scales, stored[k][0])
        assert (stored[k][1] is None and got.constants[k].mins is None) or \
            (got.constants[k].mins.dtype == np.float16 and np.array_equal(got.constants[k].mins, stored[k][1]))
