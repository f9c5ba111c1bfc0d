"""Decoder LLMs (issue 11) on the tiny seeded random Llama and GPT-2 of jobs/export/llm.py: lowering
to decoder blocks (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; GPT-2's Gemm, fused-QKV
Split, tanh-GELU, learned positions), forward equal to ONNX Runtime and transformers, gradients of
every decoder block kind on MNN and PyTorch equal PyTorch float64 autograd (the engine in float64 and
transformers' own model), the causal-LM loss without a second copy of the logits, tied embeddings
across two stages, the planner's view, LoRA roles, and `train-local --task causal-lm`.

The SmolLM2 tests (slow) are in tests/models/test_smollm2.py."""
from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ir.graph import block_signature, tied_parameters
from support import assert_grads_close
from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from planner.onnx_import import ImportError_, load_model
from runtime.engines import lm_loss
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import fused_lm_head, stage_spec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, S, VOCAB = 2, 12, 256
FAMILIES = ("llama", "gpt2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (the transformers model, its TorchScript export): a 2-layer model per family."""
    root = tmp_path_factory.mktemp("decoders")
    out = {}
    for family in FAMILIES:
        model = random_causal_lm(family)
        out[family] = model, export_causal_lm(model, root / family / "m.onnx", LlmExportOptions(), kv_cache=False)
    return out


@pytest.fixture(scope="module")
def graphs(tiny):
    return {f: load_model(path, B, S) for f, (_, path) in tiny.items()}


def lm_feeds(seed: int = 0, batch: int = B, seq: int = S, vocab: int = VOCAB) -> dict[str, np.ndarray]:
    """Token ids, a right-padded last row, next-token targets weighted 1/count (a third uncounted,
    as prompt tokens are)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2:] = 0
    counted = (mask == 1) & (rng.random((batch, seq)) < 0.67)
    counted[:, -1] = False
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "attention_mask": mask,
            "target_ids": np.where(counted, rng.integers(0, vocab, (batch, seq)), 0).astype(np.int64),
            "target_weights": (counted / counted.sum()).astype(np.float32)}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


# --- lowering --------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_decoders_lower_to_decoder_blocks_with_their_heads(graphs, family):
    graph = graphs[family]
    assert [b.kind for b in graph.blocks] == ["embeddings", "decoder", "decoder", "head", "loss"]
    layers = [b for b in graph.blocks if b.kind == "decoder"]
    ops = {n.op for n in graph.nodes if n.tier == "compute"}
    if family == "llama":  # 4 query heads on 2 key/value heads of 16
        assert {(b.heads, b.kv_heads, b.head_size) for b in layers} == {(4, 2, 16)}
        assert {"RMSNorm", "Rotary", "Silu", "Expand", "TokenCrossEntropy"} <= ops
        assert not ops & {"Pow", "Sqrt", "Concat", "Sigmoid"}  # all fused
        assert graph.blocks[-2].params[-1] == "model.embed_tokens.weight"  # the tied head: the embedding
    else:  # GPT-2: Gemm (MatMul + bias), fused QKV split three ways, tanh-GELU fused, learned positions
        assert {(b.heads, b.kv_heads, b.head_size) for b in layers} == {(4, 4, 16)}
        assert {"LayerNorm", "Slice", "Gelu"} <= ops and "Tanh" not in ops
        assert sum(n.op == "Slice" for n in graph.nodes) == 6
        assert {n.attrs["approximate"] for n in graph.nodes if n.op == "Gelu"} == {"tanh"}
        assert graph.blocks[0].params == ("transformer.wte.weight", "transformer.wpe.weight")
    assert tied_parameters(graph, [(0, 1), (2, 4)]) == {graph.blocks[0].params[0]: (0, 1)}
    assert {i.name for i in graph.inputs} == {"input_ids", "attention_mask", "target_ids", "target_weights"}


def test_inspect_json_lists_heads_kv_heads_and_head_size(tiny, capsys):
    from confidant.cli import main

    assert main(["inspect", str(tiny["llama"][1]), "--batch", "2", "--seq", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layers = [b for b in doc["blocks"] if b["kind"] == "decoder"]
    assert len(layers) == 2 and all((b["heads"], b["kv_heads"], b["head_size"]) == (4, 2, 16) for b in layers)
    assert [b["kind"] for b in doc["blocks"]] == ["embeddings", "decoder", "decoder", "head", "loss"]
    # a head split deals out the 2 key/value groups; blocks without attention have nothing to split
    assert [b["split_units"] for b in doc["blocks"]] == [None, 2, 2, None, None]
    assert main(["inspect", str(tiny["llama"][1]), "--batch", "2", "--seq", "8"]) == 0
    table = capsys.readouterr().out
    assert "head split" in table and table.count("2 kv groups") == 2


def test_an_unsupported_decoder_op_is_named_with_what_to_do(tiny, tmp_path):
    model = onnx.load(str(tiny["llama"][1]))
    node = next(n for n in model.graph.node if n.op_type == "Sigmoid")
    node.op_type = "Softplus"
    path = tmp_path / "softplus.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ImportError_) as err:
        load_model(path, B, S)
    message = str(err.value)
    assert message.startswith(f"{path}: node '{node.name}' (op Softplus): not in Confidant's op set")
    assert "re-export" in message and "ir/ops.py" in message


# --- forward and gradients -----------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_onnxruntime_and_transformers(tiny, graphs, family, engine):
    """Logits of the whole lowered model (absolute error; the tiny models' logits are ~6)."""
    model, path = tiny[family]
    graph = graphs[family]
    feeds = lm_feeds()
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    run = MnnStageEngine(spec) if engine == "mnn" else TorchStageEngine(spec)
    logits = run.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    inputs = {k: feeds[k] for k in ("input_ids", "attention_mask")}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    with torch.no_grad():
        hf = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).logits.numpy()
    assert logits.shape == (B, S, VOCAB)
    assert float(np.abs(logits - ref).max()) <= 1e-4
    assert float(np.abs(logits - hf).max()) <= 1e-4
    loss = float(run.forward(feeds, train=False))
    want = float((torch.from_numpy(feeds["target_weights"]).double() * _token_ce(torch.from_numpy(hf).double(), feeds)).sum())
    assert abs(loss - want) <= 1e-5 * abs(want)


def _token_ce(logits: torch.Tensor, feeds) -> torch.Tensor:
    ids = torch.from_numpy(feeds["target_ids"])
    return torch.logsumexp(logits, -1) - logits.gather(-1, ids[..., None])[..., 0]


BLOCK_RANGES = {"embeddings": (0, 0), "decoder": (1, 1), "head": (3, 3), "loss": (4, 4),
                "head+loss (fused)": (3, 4), "whole model": (0, 4)}


@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("blocks", list(BLOCK_RANGES), ids=list(BLOCK_RANGES))
@pytest.mark.parametrize("family", FAMILIES)
def test_block_gradients_equal_torch_float64(graphs, family, blocks, engine):
    """Every decoder block kind (embeddings; RMSNorm + RoPE attention with grouped-query heads +
    SwiGLU, or GPT-2's; the final norm and tied head; the causal-LM loss alone and fused with the
    head) on each engine against the PyTorch engine in float64."""
    graph = graphs[family]
    spec = stage_spec(graph, *BLOCK_RANGES[blocks])
    feeds = lm_feeds(1)
    rng = np.random.default_rng(2)
    if spec.activation_input:
        feeds[spec.activation_input] = rng.standard_normal(graph.values[spec.activation_input].shape).astype(np.float32)
    ref = TorchStageEngine(spec, dtype=torch.float64)
    run = MnnStageEngine(spec) if engine == "mnn" else TorchStageEngine(spec)
    out, want_out = run.forward(feeds, 0), ref.forward(feeds, 0)
    assert rel_err(out, want_out) <= 1e-5
    grad_out = None if spec.is_last else rng.standard_normal(out.shape).astype(np.float32)
    got, want = run.backward(0, grad_out), ref.backward(0, grad_out)
    if want.params:
        assert_grads_close(got.params, want.params)
    if spec.activation_input:
        assert rel_err(got.activation_input, want.activation_input) <= 1e-4


@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_gradients_equal_transformers_in_float64(tiny, graphs, family, engine):
    """The independent oracle: transformers' own model in float64, loss sum(w x CE), autograd; a tied
    head's gradient is the embedding's (one Parameter in both)."""
    model, _ = tiny[family]
    graph = graphs[family]
    feeds = lm_feeds(3)
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    run = MnnStageEngine(spec) if engine == "mnn" else TorchStageEngine(spec)
    run.forward(feeds, 0)
    got = run.backward(0).params
    model64 = random_causal_lm(family).double()
    logits = model64(input_ids=torch.from_numpy(feeds["input_ids"]),
                     attention_mask=torch.from_numpy(feeds["attention_mask"])).logits
    (torch.from_numpy(feeds["target_weights"]).double() * _token_ce(logits, feeds)).sum().backward()
    want = {n: p.grad.numpy() for n, p in model64.named_parameters() if n in got}
    assert set(want) == set(got)
    assert_grads_close(got, want)


def test_the_causal_lm_loss_never_holds_the_logits(tmp_path, monkeypatch):
    """With the head on its stage the loss is fused: no [B, S, V] array is allocated, forward or
    backward (numpy allocations traced; a chunk is 1/8 of the logits here, and of the weight gradient
    a block; the vocabulary is 4096 so the logits outweigh everything else). Alone, its gradient is written over the logits it received."""
    vocab = 4096
    path = export_causal_lm(random_causal_lm("llama", vocab_size=vocab, num_hidden_layers=1), tmp_path / "m.onnx",
                            LlmExportOptions(), kv_cache=False)
    graph = load_model(path, 2, 32)
    head, loss = graph.blocks[-2], graph.blocks[-1]
    logits_bytes = graph.values[head.output].nbytes
    weight_bytes = graph.constants["model.embed_tokens.weight"].nbytes
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", logits_bytes // 8)
    monkeypatch.setattr(lm_loss, "_ACCUMULATE_BYTES", weight_bytes // 8)  # the weight gradient's blocks
    assert fused_lm_head(graph, head.index, loss.index) is not None
    rng = np.random.default_rng(0)
    for engine in (MnnStageEngine(stage_spec(graph, head.index, loss.index)),
                   MnnStageEngine(stage_spec(graph, loss.index, loss.index))):
        feeds = lm_feeds(4, 2, 32, vocab)
        feeds[engine.spec.activation_input] = rng.standard_normal(
            graph.values[engine.spec.activation_input].shape).astype(np.float32)
        engine.forward(feeds, 0)
        engine.backward(0)  # warm-up
        tracemalloc.start()
        try:
            engine.forward(feeds, 0)
            grads = engine.backward(0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        if engine.spec.first_block == head.index:  # fused: the weight's gradient, chunks, small arrays
            assert set(grads.params) == {"model.norm.weight", "model.embed_tokens.weight"}
            assert peak < weight_bytes + logits_bytes // 2
        else:  # the loss alone: the stashed copy of the logits it received, its gradient in place
            assert grads.activation_input.shape == graph.values[head.output].shape
            assert peak < logits_bytes + logits_bytes // 2


# --- tied embeddings across stages -------------------------------------------------------------------

def test_tied_embeddings_on_two_stages_equal_one_device_when_their_gradients_are_summed(graphs):
    """The tiny Llama cut after layer 0: the embedding table (also the LM head) is on both stages;
    each stage's gradient for it is a part, and their sum is the single-device gradient (what the
    runtime's tied-weights exchange must send and add before each update)."""
    graph = graphs["llama"]
    ranges = [(0, 1), (2, 4)]
    tied = tied_parameters(graph, ranges)
    assert tied == {"model.embed_tokens.weight": (0, 1)}
    feeds = lm_feeds(5)
    first, second = (MnnStageEngine(stage_spec(graph, *r)) for r in ranges)
    x = first.forward(feeds, 0)
    loss = second.forward({**feeds, second.spec.activation_input: x}, 0)
    g2 = second.backward(0)
    g1 = first.backward(0, g2.activation_input)
    whole = MnnStageEngine(stage_spec(graph, 0, 4))
    assert abs(float(whole.forward(feeds, 0)) - float(loss)) <= 1e-6
    want = whole.backward(0).params
    got = {**g1.params, **g2.params}
    got["model.embed_tokens.weight"] = g1.params["model.embed_tokens.weight"] + g2.params["model.embed_tokens.weight"]
    assert_grads_close(got, want, rtol=1e-5)
    assert rel_err(g2.params["model.embed_tokens.weight"], want["model.embed_tokens.weight"]) > 1e-2  # a part only


def test_the_planner_counts_a_tied_head_once_per_stage_and_charges_the_cut(graphs):
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from planner.cluster import DeviceSpec
    from planner.cost import (block_input_bytes, check_tied_schedule, joined_boundaries, stage_memory_bytes,
                              stage_params_bytes, tied_bytes, tied_sum_bytes)

    graph = graphs["llama"]
    table = graph.constants["model.embed_tokens.weight"].nbytes
    blocks = graph.blocks
    assert stage_params_bytes(graph, 0, 4) == sum(b.params_bytes for b in blocks) - table
    assert tied_bytes(graph, 0, 4) == 0 and tied_bytes(graph, 0, 1) == table == tied_bytes(graph, 2, 4)
    # memory: the sum arrives dense where the holder's gradient is rows (the lookup's stage); the
    # head's stage held a dense gradient of it in every backward (counted in its workspace); a stage
    # holding both is charged too (an additive charge: a one-stage plan over-charged by the table)
    assert tied_sum_bytes(graph, 0, 1) == table and tied_sum_bytes(graph, 2, 4) == 0
    assert tied_sum_bytes(graph, 0, 4) == table and tied_sum_bytes(graph, 1, 3) == 0
    assert joined_boundaries(graph) == (3,)
    hidden = graph.values[graph.node(blocks[3].nodes[-1]).inputs[0]].nbytes
    assert block_input_bytes(graph)[-1] == hidden < blocks[3].activation_bytes  # no logits stashed when fused
    costs = {block_signature(b): BlockCost(0.01, 0.02, 0.0, 0) for b in blocks}
    profile = DeviceProfile("d", graph.name, B, S, (BackendProfile("mnn:cpu:t1", costs),), 10**10)
    device = DeviceSpec("d", "tcp://d:1", profile, 10**10, "mnn:cpu:t1")
    one = stage_memory_bytes(graph, device, 0, 4, 0, 1, "1f1b-flush", 1, "sgd")
    cut = stage_memory_bytes(graph, device, 3, 3, 0, 2, "1f1b-flush", 1, "sgd")  # the head without its loss
    assert cut >= blocks[3].activation_bytes + table  # holds the logits until their gradient comes back
    assert one < sum(b.params_bytes for b in blocks) * 6  # the tied table counted once
    check_tied_schedule(graph, [(0, 1), (2, 4)], "1f1b-flush")
    with pytest.raises(ValueError, match="1f1b-stash cannot train weights tied across stages"):
        check_tied_schedule(graph, [(0, 1), (2, 4)], "1f1b-stash")


@pytest.mark.parametrize("activations", ["recompute", "per-block"])
def test_the_fused_head_and_its_loss_alone_are_charged_their_peak_and_beside_blocks_the_blocks_transient_too(
        graphs, activations):
    """A tied Llama (embeddings, two layers, the head, its loss) on MNN. The head's measured workspace
    is the fused head + loss stage's whole peak; alone on a stage that is all it needs (SmolLM2: 137
    MiB above the weights; charged before besides the layers' transient, 25-35 MiB it never held),
    beside layers the layers' transient comes on top (SmolLM2: 163-165 with two layers), once per
    stage, and a stage ending at the last layer pays that transient once too. By hand (MiB), layers
    40 (24 stacked; per block 30, 2 stacked), head 100."""
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from planner.cluster import DeviceSpec
    from planner.cost import stage_memory_terms

    mib = 2 ** 20
    graph = graphs["llama"]
    blocks = graph.blocks
    layer = BlockCost(0.01, 0.02, 0.0, 40 * mib, stacked_bytes=24 * mib, kept_bytes=16 * mib,
                      per_block_workspace_bytes=30 * mib, per_block_stacked_bytes=2 * mib)
    costs = {block_signature(blocks[0]): BlockCost(0.01, 0.02, 0.0, 0, stacked_bytes=0, kept_bytes=0),
             block_signature(blocks[1]): layer,
             block_signature(blocks[3]): BlockCost(0.01, 0.02, 0.0, 100 * mib, kept_bytes=0),
             block_signature(blocks[4]): BlockCost(0.01, 0.02, 0.0, 50 * mib, kept_bytes=0)}
    assert block_signature(blocks[2]) == block_signature(blocks[1])
    profile = DeviceProfile("d", graph.name, B, S, (BackendProfile("mnn:cpu:t1", costs),), 10**10)
    device = DeviceSpec("d", "tcp://d:1", profile, 10**10, "mnn:cpu:t1", activations=activations)
    stacked, transient = (24, 16) if activations == "recompute" else (2, 28)

    def workspace(first, last):
        return stage_memory_terms(graph, device, first, last, 0, 1, "1f1b-flush", 1, "sgd").workspace_bytes / mib

    assert workspace(3, 4) == 100
    assert workspace(2, 4) == stacked + transient + 100
    assert workspace(0, 4) == 2 * stacked + transient + 100
    assert workspace(0, 1) == stacked + transient
    assert workspace(0, 2) == 2 * stacked + transient  # a stage ending at the last layer: its transient once
    # a head smaller than the layers' transient: alone, its own peak; beside a layer, both
    costs[block_signature(blocks[3])] = BlockCost(0.01, 0.02, 0.0, 10 * mib, kept_bytes=0)
    assert workspace(3, 4) == 10
    assert workspace(2, 4) == stacked + transient + 10


def test_the_partition_instance_prices_a_tied_decoder_as_the_cost_model_and_keeps_head_and_loss_together(graphs):
    """A tied Llama over three MNN devices: the partitioners' instance charges every stage what
    planner.cost charges it (the tied sum on the lookup's stage, no second copy of a table a fused
    head reads from numpy, the loss's own workspace not on top of the fused head's), for every cut
    of two and three stages that keeps the head with its loss, and the solver never separates them."""
    import dataclasses

    from ir.partition import Partition, StageAssignment
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from planner.cluster import Cluster, DeviceSpec, Link
    from planner.cost import stage_costs
    from planner.partition import check_feasible, make_instance, manual_partition, solve_partition
    from planner.replan import best_cuts, partition_of, replan

    graph = graphs["llama"]
    n = len(graph.blocks)
    table = graph.constants["model.embed_tokens.weight"].nbytes
    sigs = [block_signature(b) for b in graph.blocks]
    # a loss measured alone with a workspace of its own, which the fused head's figure already holds
    costs = {sig: BlockCost(0.18 if k == n - 1 else 0.01, 0.02, 0.001, 3000 + 100 * k, stacked_bytes=2000,
                            kept_bytes=500) for k, sig in enumerate(sigs)}
    profile = DeviceProfile("d", graph.name, B, S, (BackendProfile("mnn:cpu:t1", costs),), 10**6)
    devices = tuple(DeviceSpec(name, f"tcp://{name}:1", profile, 10**9, "mnn:cpu:t1") for name in ("a", "b", "c"))
    cluster = Cluster(devices, Link(1e8, 0.001), {})
    # the same devices with a loss that measured no workspace of its own
    bare = dict(costs)
    bare[sigs[-1]] = BlockCost(costs[sigs[-1]].forward_s, 0.02, 0.001, 0, stacked_bytes=0, kept_bytes=0)
    bare_profile = DeviceProfile("d", graph.name, B, S, (BackendProfile("mnn:cpu:t1", bare),), 10**6)
    bare_cluster = Cluster(tuple(dataclasses.replace(d, profile=bare_profile) for d in devices), Link(1e8, 0.001), {})
    for schedule in ("1f1b-flush", "gpipe"):
        inst = make_instance(graph, cluster, schedule, 2, "adamw")
        assert inst.joined == (n - 2,)
        for names, cuts in ((["a", "b"], [2]), (["a", "b"], [1]), (["c", "a", "b"], [1, 2])):
            plan = manual_partition(inst, names, cuts)
            got = [c.memory_bytes for c in stage_costs(graph, cluster, plan, schedule, 2, "adamw")]
            assert [s.memory_bytes for s in plan.stages] == got
            assert got == [c.memory_bytes for c in stage_costs(graph, bare_cluster, plan, schedule, 2, "adamw")]
        # one stage holds both copies of the tied table: the per-block instance over-charges it, never under
        whole = manual_partition(inst, ["a"], [])
        assert whole.stages[0].memory_bytes >= stage_costs(graph, cluster, whole, schedule, 2, "adamw")[0].memory_bytes
        # the tied sum on the lookup's block, not on the head's (whose dense gradient its workspace held)
        assert inst.state_delta_bytes[0][0] == table and inst.state_delta_bytes[0][n - 2] == 0
        assert inst.workspace_bytes[0][n - 1] == 0
        with pytest.raises(ValueError, match=rf"^cannot cut between block {n - 2} 'head' and block {n - 1} 'loss': "
                                             rf"they run as one on a stage .*; start the stage at block {n - 2} instead$"):
            manual_partition(inst, ["a", "b"], [n - 1])
        split = Partition((StageAssignment(0, "a", 0, n - 2, 0.1, 1, 10**9),
                           StageAssignment(1, "b", n - 1, n - 1, 0.1, 1, 10**9)), "manual", 0.1)
        assert any("joined to block" in problem for problem in check_feasible(split, inst))
        # the loss is the slowest block here, so a cut before it would balance best: never made
        plan = solve_partition(inst, time_limit_s=5.0, workers=1)
        assert all(last != n - 2 for _, last in plan.ranges[:-1]) and check_feasible(plan, inst) == []
        free = solve_partition(dataclasses.replace(inst, joined=()), time_limit_s=5.0, workers=1)
        assert [last for _, last in free.ranges[:-1]][-1] == n - 2
    # a plan made before the two were joined is re-planned at once, whatever the gain
    decision = replan(graph, cluster, partition_of([(0, n - 2), (n - 1, n - 1)], ["a", "b"]), "1f1b-flush", 2,
                      "adamw", workers=1, time_limit_s=5.0)
    assert decision.forced and f"separates blocks {n - 2} and {n - 1}" in decision.reason
    assert all(last != n - 2 for _, last in decision.new_partition.ranges[:-1])
    assert all(last != n - 2 for _, last in best_cuts(make_instance(graph, cluster, "1f1b-flush", 2, "adamw"),
                                                       ["a", "b", "c"]).ranges[:-1])


# --- LoRA ------------------------------------------------------------------------------------------

def test_lora_finds_decoder_projections_by_structure(graphs):
    from planner.lora import LoraSettings, add_lora, projection_roles

    llama, gpt2 = graphs["llama"], graphs["gpt2"]
    roles = projection_roles(llama, llama.blocks[1])
    assert {w.rsplit(".", 2)[-2]: r for w, r in roles.items()} == {
        "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
        "down_proj": "down"}
    assert sorted(projection_roles(gpt2, gpt2.blocks[2]).values()) == ["down", "o", "qkv", "up"]
    adapted, adapters = add_lora(llama, LoraSettings(4))
    assert [a.role for a in adapters] == ["q", "k", "v", "o"] * 2
    assert set(adapted.params) == {p for a in adapters for p in (a.a, a.b)}  # the tied head stays frozen
    spec = stage_spec(adapted, 0, len(adapted.blocks) - 1)
    engine = MnnStageEngine(spec)
    engine.forward(lm_feeds(6), 0)
    grads = engine.backward(0).params
    assert set(grads) == set(adapted.params) and any(np.abs(g).max() > 0 for g in grads.values())


# --- training on one device ----------------------------------------------------------------------------

@pytest.mark.slow  # a random Llama with the SmolLM2 tokenizer, trained and generated from
def test_train_local_causal_lm_reports_perplexity_and_exact_match(chat_llama, tmp_path):
    from jobs.train.local import train_local
    from jobs.common.metrics import read_metrics
    from jobs.common.settings import TrainingSettings

    path, train, dev = chat_llama
    settings = TrainingSettings(steps=4, batch=4, seq=128, lr=3e-3, seed=0, eval_limit=4)
    metrics = train_local(path, train, dev, settings, task="causal-lm", checkpoint=tmp_path / "ckpt")
    doc = read_metrics(metrics.write(tmp_path / "run.json"))
    assert doc["eval"]["metric"] == "exact_match" and doc["settings"]["task"] == "causal-lm"
    assert doc["eval"]["perplexity"] < doc["eval"]["perplexity_before"]  # a random model learns the format's tokens
    assert 0.0 <= doc["eval"]["after"] <= 1.0 and set(doc["eval"]["per_type"]) >= {"valid_json", "f1"}
    assert len(doc["steps"]) == 4 and doc["steps"][-1]["loss"] < doc["steps"][0]["loss"]
    assert (tmp_path / "ckpt" / "meta.json").is_file()


# --- profile, plan, show, simulate ------------------------------------------------------------------

def test_profile_plan_show_and_simulate_a_decoder(tiny, tmp_path, capsys):
    """A decoder through the planner: profiled (its head timed fused with the loss), planned over two
    devices, the tied embedding named, shown and simulated."""
    from confidant.cli import main
    from jobs.planning import PlanSettings, plan_model, simulate_plan
    from jobs.profiling import profile_this_device
    from jobs.common.report import Silent

    class Notes(Silent):
        def __init__(self):
            self.lines = []

        def note(self, text):
            self.lines.append(text)

    path = tiny["llama"][1]
    profile, profile_path = profile_this_device(path, 2, 16, tmp_path / "dev.json", name="dev",
                                                backends=("mnn:cpu:t1",), reps=1, attention=False)
    graph = load_model(path, 2, 16)
    costs = profile.backend("mnn:cpu:t1").blocks
    assert {block_signature(b) for b in graph.blocks} <= set(costs)
    (tmp_path / "cluster.yaml").write_text(
        "devices:\n"
        f"  - {{name: a, address: 'tcp://127.0.0.1:5901', profile: {profile_path.name}, memory_budget: 1GiB}}\n"
        f"  - {{name: b, address: 'tcp://127.0.0.1:5902', profile: {profile_path.name}, memory_budget: 1GiB}}\n"
        "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    notes = Notes()
    plan = plan_model(path, tmp_path / "cluster.yaml", PlanSettings("1f1b-flush", 4, 16, 2, cuts=(3,)),
                      tmp_path / "plan", notes, sign=None)
    assert any("tied across stages" in line and "model.embed_tokens.weight" in line for line in notes.lines)
    _, sim = simulate_plan(plan, 1, tmp_path / "trace.json")
    assert (tmp_path / "trace.json").is_file()
    assert main(["show", str(plan)]) == 0
    shown = capsys.readouterr().out
    assert "predicted step" in shown
    # the head's stage names the fused head + loss's part of its memory, and says it is the worst case
    b_line = next(line for line in shown.splitlines() if line.startswith("  b: "))
    assert "LM head + loss" in b_line and "trainable" in b_line and "workspace" in b_line
    assert "every position of a micro-batch a target, the worst case" in shown
    with pytest.raises(Exception, match="1f1b-stash cannot train weights tied across stages"):
        plan_model(path, tmp_path / "cluster.yaml", PlanSettings("1f1b-stash", 4, 16, 2, cuts=(3,)),
                   tmp_path / "plan2", notes, sign=None)
    # --devices orders the stages of --cuts: alone, or naming another number of devices, it was ignored
    with pytest.raises(Exception, match=r"^--devices b orders the devices of --cuts; without --cuts the planner picks"):
        plan_model(path, tmp_path / "cluster.yaml", PlanSettings("1f1b-flush", 4, 16, 2, devices=("b",)),
                   tmp_path / "plan3", notes, sign=None)
    with pytest.raises(Exception, match=r"^--devices names 1 devices but --cuts 3 makes 2 stages: give one device per"):
        plan_model(path, tmp_path / "cluster.yaml", PlanSettings("1f1b-flush", 4, 16, 2, cuts=(3,), devices=("b",)),
                   tmp_path / "plan3", notes, sign=None)
