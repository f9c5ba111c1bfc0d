"""Issue 31 target 3: a stage's engine term charges a copy the engine makes once a stage once. PyTorch
copies each frozen float constant a stage reads (`torch.tensor`, one per name), so under LoRA on a float
base the embeddings' and the tied LM head's measured `BlockCost.engine_bytes` each hold the table's
copy, while a stage of both builds it once (`planner.cost.shared_engine_bytes`). Charged twice, a
one-device torch plan of a hidden-256 Llama with SmolLM2's 49152-token table was 48 MiB (~8%) above
its worker (tests/jobs/test_torch_per_block_plan.py: 0.84-0.90 of the plan; benchmarks/MEMORY_NOTES.md).
Since h42 the engine holds no such copy (views of the graph's arrays): the by-hand rule stands for
figures that hold one, and the measured figures hold none."""
from __future__ import annotations

import pytest

from ir.backend import BackendSpec
from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import Cluster, DeviceSpec
from planner.cost import engine_bytes, shared_engine_bytes, stage_memory_terms
from planner.lora import LoraSettings
from planner.onnx_import import load_model
from support import gc_frozen, tiny_tied_llama

MIB = 2 ** 20
VOCAB = 32768  # hidden 64: a float32 table of 8 MiB, well above the RSS noise of an engine's build
B, SEQ = 1, 16


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The tiny tied Llama under LoRA r=4 on q, k, v, o: over a float32 base and over an int4 one."""
    from jobs.common.lora import adapted

    _, path = tiny_tied_llama(tmp_path_factory.mktemp("tiedcopy"), VOCAB)
    return {dtype: adapted(load_model(path, B, SEQ), LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(),
                                                                 seed=0, base_dtype=dtype))
            for dtype in ("float32", "int4")}


def _device(graph, engine: str, figures: dict[str, int]) -> DeviceSpec:
    """A device whose profile gives each block kind the engine figure `figures[block name]` (else 0)."""
    costs = {}
    for b in graph.blocks:
        costs.setdefault(block_signature(b), BlockCost(0.001, 0.002, 0.0, MIB, stacked_bytes=MIB,
                                                        engine_bytes=figures.get(b.name, 0)))
    profile = DeviceProfile("d", graph.name, B, SEQ, (BackendProfile(f"{engine}:cpu:t1", costs),), 16 << 30, 100 * MIB)
    return DeviceSpec("d", "tcp://d:1", profile, 4 << 30, f"{engine}:cpu:t1")


def test_the_tied_tables_engine_copy_is_charged_once_on_a_stage_of_both_readers_by_hand(graphs):
    """By hand, on PyTorch, figures embeddings = table + 1 MiB, each layer 2 MiB, the head (fused with its
    loss) table + 0.5 MiB: the whole model's engine term is table + 1 + 2 x 2 + 0.5 MiB (the table once);
    a stage without the head, every figure as measured. MNN's figures hold no copy of a table (it looks
    tables up in numpy: the embeddings' 1.2 MiB on the hidden-256 Llama), an int4 base's table is shared
    by the engine, not copied: nothing comes off either."""
    graph = graphs["float32"]
    names = [b.name for b in graph.blocks]
    assert names[0] == "embeddings" and names[-2:] == ["head", "loss"] and len(names) == 5
    table = VOCAB * 64 * 4
    n = len(names)
    figures = {"embeddings": table + MIB, "layer.0": 2 * MIB, "head": table + MIB // 2}
    torch_device = _device(graph, "torch", figures)
    whole = stage_memory_terms(graph, torch_device, 0, n - 1, 0, 1, "1f1b-flush", 2, "adamw")
    assert whole.engine_bytes == table + MIB + 2 * 2 * MIB + MIB // 2
    assert shared_engine_bytes(graph, 0, n - 1, torch_device) == table
    assert whole.by_name()["engine"] == whole.engine_bytes
    # a stage of the embeddings and the layers alone holds its one reader's copy, as measured
    assert engine_bytes(graph, 0, n - 3, torch_device) == table + MIB + 2 * 2 * MIB
    assert shared_engine_bytes(graph, 0, n - 3, torch_device) == 0
    # the partitioners' instance prices the whole model as the cost model does
    from planner.partition.instance import _memory_bytes, make_instance

    inst = make_instance(graph, Cluster((torch_device,), Link(1e9, 0.0)), "1f1b-flush", 2, "adamw")
    assert _memory_bytes(inst, 0, 0, n - 1, 0, 1) == whole.total
    # figures without the copy (MNN's numpy tables): nothing comes off
    mnn = {"embeddings": int(1.2 * MIB), "layer.0": 2 * MIB, "head": MIB // 64}
    mnn_device = _device(graph, "mnn", mnn)
    assert shared_engine_bytes(graph, 0, n - 1, mnn_device) == 0
    # an int4 base: the table is int8 codes the engine shares; figures holding as much take nothing off
    quantized = graphs["int4"]
    assert shared_engine_bytes(quantized, 0, n - 1, _device(quantized, "torch", figures)) == 0


def test_the_planners_engine_term_is_a_one_stage_engines_measured_build(graphs):
    """Against the engine itself: the charge from each block kind's figure as `profile` measures it
    (`runtime.profiling.compute.engine_setup_bytes`: the embeddings alone, the head fused with its loss,
    the layers' run divided) is within 1.5 MiB of what building the whole model's PyTorch engine holds,
    measured the same way. The engine reads frozen float weights through views of the graph's arrays
    (h42, tests/runtime/test_torch_frozen_views.py): no figure holds a copy of the 8 MiB table any more,
    so nothing is taken off (when each held one, the table once; with it twice ~8 MiB above)."""
    from runtime.engines.stage import stage_spec
    from runtime.profiling.compute import engine_setup_bytes

    graph = graphs["float32"]
    backend = BackendSpec.cpu("torch", 1)
    n = len(graph.blocks)
    with gc_frozen():  # the builds' collections walk only what they make (as in `profile_device`)
        figures = {"embeddings": engine_setup_bytes(backend, stage_spec(graph, 0, 0)),
                   "layer.0": engine_setup_bytes(backend, stage_spec(graph, 1, n - 3)) // (n - 3),
                   "head": engine_setup_bytes(backend, stage_spec(graph, n - 2, n - 1))}
        built = engine_setup_bytes(backend, stage_spec(graph, 0, n - 1))
    table = VOCAB * 64 * 4
    assert figures["embeddings"] < table // 2 and figures["head"] < table // 2, figures  # neither holds a copy
    assert shared_engine_bytes(graph, 0, n - 1, _device(graph, "torch", figures)) == 0
    charged = engine_bytes(graph, 0, n - 1, _device(graph, "torch", figures))
    assert abs(charged - built) <= 1.5 * MIB, (charged / MIB, built / MIB)
