"""LoRA through the IR and the engines: the pass against PEFT's LoRA on the same weights (float64
PyTorch), frozen weights that never move, and only adapters (and what trains in full) as parameters."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from planner.lora import LoraSettings, add_lora, projection_roles
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from support import token_feeds

B, S, LABELS, RANK, ALPHA = 2, 12, 9, 4, 8.0


@pytest.fixture(scope="module")
def graph(tiny_onnx):
    return load_model(tiny_onnx["torchscript-17"], B, S)


@pytest.fixture(scope="module")
def adapted(graph):
    return add_lora(graph, LoraSettings(RANK, ALPHA, targets=("q", "k", "v", "o"), seed=3))


def test_the_pass_adapts_the_attention_projections_and_freezes_the_rest(graph, adapted):
    lora, adapters = adapted
    encoders = [b for b in graph.blocks if b.kind == "encoder"]
    assert len(adapters) == 4 * len(encoders)
    assert {(a.block, a.role) for a in adapters} == {(b.index, r) for b in encoders for r in "qkvo"}
    head = {p for b in graph.blocks if b.kind == "head" for p in b.params}
    assert set(lora.params) == {p for a in adapters for p in (a.a, a.b)} | head
    for a in adapters:
        assert lora.constants[a.a].shape == (a.in_features, RANK) and lora.constants[a.b].shape == (RANK, a.out_features)
        assert not lora.constants[a.b].any()                     # B = 0: the adapted model starts as the base
        assert np.abs(lora.constants[a.a]).max() <= 1 / np.sqrt(a.in_features)   # PEFT's Kaiming-uniform bound
        assert a.base not in lora.params and a.base in lora.constants
    enc = lora.blocks[encoders[0].index]
    assert enc.frozen_bytes > 0 and enc.params_bytes == sum(lora.constants[p].nbytes for p in enc.params)
    assert enc.attention is None  # an adapted attention is not split
    assert lora.blocks[0].frozen_bytes == graph.blocks[0].params_bytes  # embeddings frozen whole


def test_roles_come_from_the_structure_not_names(graph):
    for b in graph.blocks:
        if b.kind == "encoder":
            roles = projection_roles(graph, b)
            assert sorted(roles.values()) == ["down", "k", "o", "q", "up", "v"]


def test_nothing_matched_says_what_can_be(graph):
    with pytest.raises(ValueError, match=r"match no linear projection .*\(roles: q, k, v, o, up, down"):
        add_lora(graph, LoraSettings(2, targets=("nonexistent",)))
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        LoraSettings(0)


def test_a_target_or_train_also_item_that_matches_nothing_is_no_silent_no_op(graph):
    with pytest.raises(ValueError, match=r"LoRA targets \['vv', 'kk'\] match no linear projection of .* \(its roles: "
                                         r"down, k, o, q, up, v; other targets are substrings of weight names\)"):
        add_lora(graph, LoraSettings(2, targets=("q", "vv", "kk")))
    with pytest.raises(ValueError, match=r"LoRA targets \['gate'\] match no linear projection"):
        add_lora(graph, LoraSettings(2, targets=("q", "gate")))  # BERT has no gated MLP
    with pytest.raises(ValueError, match=r"--train-also \['zzz'\] names nothing of .* \(give auto, head, embeddings"):
        add_lora(graph, LoraSettings(2, train_also=("zzz",)))


def test_b_zero_leaves_the_model_unchanged(graph, adapted):
    lora, _ = adapted
    feeds = token_feeds(B, S, vocab=500)
    base = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1)).forward(feeds, train=False)
    same = MnnStageEngine(stage_spec(lora, 0, len(lora.blocks) - 1)).forward(feeds, train=False)
    np.testing.assert_allclose(same, base, rtol=1e-6, atol=1e-7)


# --- against PEFT ----------------------------------------------------------------------------------

def _peft_model(tiny_checkpoint):
    from peft import LoraConfig, get_peft_model

    from jobs.export.encoder import load_token_classifier

    model = load_token_classifier(tiny_checkpoint, LABELS, seed=0).double()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, modules_to_save=["classifier"],
                        target_modules=["query", "key", "value", "attention.output.dense"])
    return get_peft_model(model, config).eval()


def _match_modules(peft_model, lora_graph, adapters) -> dict[str, torch.nn.Module]:
    """Base weight name of each adapter -> the PEFT LoRA layer wrapping the same weight (found by
    value: exporters rename weights)."""
    layers = {name: m for name, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    out = {}
    for a in adapters:
        w = lora_graph.constants[a.base].astype(np.float64)
        hf = w if a.base_transposed else w.T  # HF Linear weights are [out, in]
        found = [n for n, m in layers.items() if m.base_layer.weight.shape == hf.shape
                 and np.allclose(m.base_layer.weight.detach().numpy(), hf, atol=1e-7)]
        assert len(found) == 1, (a.base, found)
        out[a.base] = layers[found[0]]
    return out


def _same_adapter_weights(peft_model, lora_graph, adapters, seed=5):
    """Random A and B (B non-zero, so A's gradient is too) written into both models."""
    rng = np.random.default_rng(seed)
    modules = _match_modules(peft_model, lora_graph, adapters)
    weights = {}
    for a in adapters:
        A = rng.normal(0, 0.2, (a.in_features, RANK)).astype(np.float32)
        Bm = rng.normal(0, 0.2, (RANK, a.out_features)).astype(np.float32)
        weights[a.a], weights[a.b] = A, Bm
        layer = modules[a.base]
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(torch.tensor(A.T, dtype=torch.float64))
            layer.lora_B["default"].weight.copy_(torch.tensor(Bm.T, dtype=torch.float64))
    return weights, modules


def _peft_loss(peft_model, feeds):
    logits = peft_model(input_ids=torch.tensor(feeds["input_ids"]),
                        attention_mask=torch.tensor(feeds["attention_mask"]),
                        token_type_ids=torch.tensor(feeds["token_type_ids"])).logits
    targets = torch.tensor(feeds["targets"], dtype=torch.float64)
    return -(targets * torch.log_softmax(logits, dim=-1)).sum()


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def _peft_then_engine(engine: str, peft_model, lora, adapters):
    """One micro-batch through `peft_model` (its gradients left on its modules) and through the whole
    adapted graph as one stage on `engine` with the same adapter weights: the losses equal, the engine's
    gradients for the adapters and the head only (frozen weights get none). Returns PEFT's modules by
    base weight and the engine's gradients."""
    weights, modules, feeds, loss = _peft_reference(peft_model, lora, adapters)
    return modules, _engine_gradients(engine, lora, weights, feeds, loss)


def _peft_reference(peft_model, lora, adapters):
    """`_same_adapter_weights` written into both, then one micro-batch's loss and backward through
    `peft_model` (its gradients left on its modules): the weights, PEFT's modules by base weight, the
    feeds and PEFT's loss."""
    weights, modules = _same_adapter_weights(peft_model, lora, adapters)
    feeds = token_feeds(B, S, vocab=500)
    loss = _peft_loss(peft_model, feeds)
    loss.backward()
    return weights, modules, feeds, loss.item()


def _engine_gradients(engine: str, lora, weights, feeds, loss: float) -> dict:
    """The whole adapted graph as one stage on `engine` with `weights` in: its loss on `feeds` equals
    `loss`; returns its gradients, for the adapters and the head only (frozen weights get none)."""
    spec = stage_spec(lora, 0, len(lora.blocks) - 1)
    init = {**lora.constants, **weights}
    eng = MnnStageEngine(spec, weights=init) if engine == "mnn" else TorchStageEngine(spec, weights=init)
    assert float(eng.forward(feeds, 0)) == pytest.approx(loss, rel=1e-5)
    grads = eng.backward(0).params
    assert set(grads) == set(lora.params)
    return grads


@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_adapter_gradients_equal_peft_in_float64(tiny_checkpoint, adapted, engine):
    lora, adapters = adapted
    peft_model = _peft_model(tiny_checkpoint)
    modules, grads = _peft_then_engine(engine, peft_model, lora, adapters)
    for a in adapters:
        layer = modules[a.base]
        ga = layer.lora_A["default"].weight.grad.numpy().T
        gb = layer.lora_B["default"].weight.grad.numpy().T
        assert _rel_err(grads[a.a], ga) <= 1e-4, (a.a, _rel_err(grads[a.a], ga))
        assert _rel_err(grads[a.b], gb) <= 1e-4, (a.b, _rel_err(grads[a.b], gb))


@pytest.fixture(scope="module")
def int4_minilm_reference(minilm_onnx):
    """The real all-MiniLM-L6-v2 under LoRA with its frozen base held int4, and PEFT in float64 on the
    checkpoint with each held weight replaced by its dequantized values, one micro-batch through it (once
    for both engines): the adapted graph, its adapters, the adapter weights, the feeds, PEFT's loss and
    PEFT's adapter gradients by kind ("lora_A", "lora_B": {graph name: gradient})."""
    from ir.precision import QuantizedTensor, dequantize
    from jobs.export.encoder import default_checkpoint_dir

    base = load_model(minilm_onnx, B, S)
    lora, adapters = add_lora(base, LoraSettings(RANK, ALPHA, targets=("q", "k", "v", "o"), seed=3, base_dtype="int4"))
    held = {k: v for k, v in lora.constants.items() if isinstance(v, QuantizedTensor)}
    # 6 layers x 6 projections int4; word, position and token-type tables int8
    assert sorted(v.storage for v in held.values()) == ["int4"] * 36 + ["int8"] * 3
    peft_model = _peft_model(default_checkpoint_dir())
    matrices = [p for p in peft_model.parameters() if p.ndim == 2]
    with torch.no_grad():
        for name, q in held.items():
            w = np.asarray(base.constants[name], np.float64)
            found = [(p, t) for p in matrices for t in (False, True) if tuple(p.shape) == (w.T if t else w).shape
                     and np.array_equal(p.detach().numpy(), w.T if t else w)]
            assert len(found) == 1, name
            p, t = found[0]
            wide = dequantize(q).astype(np.float64)
            assert np.abs(wide - w).max() > 0  # off the grid: the rounding moves it
            p.copy_(torch.from_numpy(wide.T if t else wide))
    weights, modules, feeds, loss = _peft_reference(peft_model, lora, adapters)
    refs = {kind: {a.a if kind == "lora_A" else a.b: getattr(modules[a.base], kind)["default"].weight.grad.numpy().T
                   for a in adapters} for kind in ("lora_A", "lora_B")}
    return lora, weights, feeds, loss, refs


@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_adapter_gradients_on_an_int4_minilm_equal_peft_on_its_dequantized_weights_in_float64(int4_minilm_reference,
                                                                                               engine):
    """The real all-MiniLM-L6-v2 (a float checkpoint, off every grid) with its frozen base held as
    `--base-dtype int4` holds it: the projections int4, the three lookup tables int8 (`storage_for`). PEFT
    in float64 runs on the checkpoint with each of those weights replaced by its dequantized values; the
    engines never see the float32 base."""
    lora, weights, feeds, loss, refs = int4_minilm_reference
    grads = _engine_gradients(engine, lora, weights, feeds, loss)
    # relative to the largest gradient of its kind: some of a real model's adapters get gradients ~1e-3 of the
    # largest, where float32 against float64 differs in the 2nd digit on the float32 base too (measured: per
    # tensor 1.6e-2 at float32, all of them within 2.1e-5 of the largest)
    for kind in ("lora_A", "lora_B"):
        scale = max(np.abs(r).max() for r in refs[kind].values())
        for mine, ref in refs[kind].items():
            assert np.abs(grads[mine] - ref).max() <= 1e-4 * scale, (mine, np.abs(grads[mine] - ref).max() / scale)


@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_the_input_gradient_flows_through_frozen_projections(tiny_checkpoint, adapted, engine):
    """A stage of encoder layers (its input the embeddings' output) against PEFT's encoder in
    float64: dx passes through the frozen W and the adapters alike."""
    lora, adapters = adapted
    peft_model = _peft_model(tiny_checkpoint)
    weights, _ = _same_adapter_weights(peft_model, lora, adapters)
    first = next(b.index for b in lora.blocks if b.kind == "encoder")
    last = max(b.index for b in lora.blocks if b.kind == "encoder")
    spec = stage_spec(lora, first, last)
    feeds = token_feeds(B, S, vocab=500)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, S, lora.values[spec.activation_input].shape[-1])).astype(np.float32)
    dy = rng.standard_normal((B, S, x.shape[-1])).astype(np.float32)
    bert = peft_model.base_model.model.bert
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(feeds["attention_mask"], dtype=torch.float64)[:, None, None, :]
    additive = (1.0 - mask) * torch.finfo(torch.float64).min
    out = bert.encoder(xt, attention_mask=additive).last_hidden_state
    out.backward(torch.tensor(dy, dtype=torch.float64))
    init = {**lora.constants, **weights}
    eng = MnnStageEngine(spec, weights=init) if engine == "mnn" else TorchStageEngine(spec, weights=init)
    y = eng.forward({**feeds, spec.activation_input: x}, 0)
    np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-4, atol=1e-5)
    dx = eng.backward(0, dy).activation_input
    assert _rel_err(dx, xt.grad.numpy()) <= 1e-4


def test_training_moves_only_adapters_and_the_head(adapted):
    """Three AdamW steps: frozen weights bit-identical, adapters and head moved."""
    lora, adapters = adapted
    spec = stage_spec(lora, 0, len(lora.blocks) - 1)
    engine = MnnStageEngine(spec)
    opt = make_optimizer("adamw", 1e-2)
    params = engine.parameters()
    assert set(params) == set(lora.params)
    before = {k: v.copy() for k, v in lora.constants.items()}
    for step in range(3):
        engine.forward(token_feeds(B, S, vocab=500, seed=step), 0)
        params = opt.step(params, engine.backward(0).params)
        engine.set_parameters(params)
    after = engine.parameters()
    frozen = [k for k in lora.constants if k not in lora.params]
    for k in frozen:
        assert lora.constants[k].tobytes() == before[k].tobytes()
    assert all(not np.array_equal(after[a.b], before[a.b]) for a in adapters)  # B left zero
    assert set(opt.state()) - {"steps"} <= {f"{kind}/{p}" for kind in ("m", "v") for p in lora.params}


def test_the_mnn_engine_holds_each_frozen_weight_once_and_the_graph_stays_valid(adapted):
    """The engine's constant Vars copy what they are built from (MNN's const); the graph's frozen
    arrays are then views of those Vars, not a second copy, and still hold the same values after the
    engine is gone (the view keeps its Var alive)."""
    import gc

    from runtime.engines import mnn_kernels as K

    lora, _ = adapted
    graph = replace(lora, constants=dict(lora.constants))  # the module's fixture stays untouched
    before = {k: v.copy() for k, v in graph.constants.items()}
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    frozen_in_mnn = [k for k in engine._constant_vars if before[k].dtype == np.float32]
    assert len(frozen_in_mnn) >= 4 * len(graph.blocks[1:-1])  # each layer's frozen projections at least
    for k in frozen_in_mnn:
        assert K.shares_memory(engine._constant_vars[k], graph.constants[k]), k
        assert not graph.constants[k].flags.writeable  # a write would silently change training
    loss = engine.forward(token_feeds(B, S, vocab=500, seed=0), 0)
    del engine
    gc.collect()
    for k, v in before.items():
        assert graph.constants[k].tobytes() == v.tobytes(), k
    again = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1))
    assert again.forward(token_feeds(B, S, vocab=500, seed=0), 0) == pytest.approx(loss, rel=1e-6)


# --- the planner's view ------------------------------------------------------------------------------

def test_the_memory_model_counts_frozen_weights_once_and_trainable_ones_per_copy(graph, adapted):
    from planner.cost import block_input_bytes, stage_memory_bytes, weight_copies
    from planner.replan import flops_cluster

    lora, _ = adapted
    device = flops_cluster(lora, ["d"]).device("d")
    first, last = 1, 2
    blocks = lora.blocks[first:last + 1]
    trainable, frozen = sum(b.params_bytes for b in blocks), sum(b.frozen_bytes for b in blocks)
    assert frozen > trainable > 0
    copies = weight_copies("1f1b-stash", "adamw", 3, 0, 4)
    inputs = sum(block_input_bytes(lora)[first:last + 1])
    want = trainable * copies + frozen + inputs * 3 + device.profile.runtime_overhead_bytes
    assert stage_memory_bytes(lora, device, first, last, 0, 3, "1f1b-stash", 4, "adamw") == want


def test_a_lora_plan_records_trainable_and_frozen_bytes_and_show_prints_them(adapted, tmp_path, capsys):
    from confidant.commands import show_plan
    from ir.bundle import load_plan
    from planner.emit import emit_plan
    from planner.partition import make_instance, solve_partition
    from planner.replan import flops_cluster
    from planner.schedule import make_schedule

    lora, _ = adapted
    cluster = flops_cluster(lora, ["a", "b"])
    partition = solve_partition(make_instance(lora, cluster, "1f1b-flush", 2, "adamw"), time_limit_s=5)
    emit_plan(tmp_path / "plan", lora, partition, make_schedule("1f1b-flush", len(partition.stages), 2),
              {"model": "tiny-lora"}, cluster=cluster)
    plan = load_plan(tmp_path / "plan", verify_bundles=True)
    assert sum(d.trainable_bytes for d in plan.devices) == sum(int(lora.constants[p].nbytes) for p in lora.params)
    assert sum(d.frozen_bytes for d in plan.devices) == sum(b.frozen_bytes for b in lora.blocks)
    show_plan(tmp_path / "plan")
    out = capsys.readouterr().out
    assert "trainable / frozen" in out
    d = plan.devices[0]
    assert f"{d.trainable_bytes / 2**20:.1f} / {d.frozen_bytes / 2**20:.1f} MiB" in out
    # each device's memory by term, from the memory model, summing to its planned bytes: the frozen
    # weights once, the adapters' weight, gradient and two AdamW moments once each (flush)
    for d in plan.devices:
        terms = d.memory_terms
        assert sum(terms.values()) == d.memory_bytes and "other" not in terms
        assert terms["frozen float32"] == d.frozen_bytes
        assert terms["trainable"] == terms["gradients"] == terms["optimizer state"] / 2 == d.trainable_bytes
        assert terms["activations"] > 0 and "runtime" in terms and "workspace" in terms
        assert (f"  {d.name}: trainable {d.trainable_bytes / 2**20:.1f}, frozen float32 {d.frozen_bytes / 2**20:.1f}, "
                f"gradients {d.trainable_bytes / 2**20:.1f}") in out


def test_lora_flags_without_lora_are_refused_not_ignored():
    """--lora-targets / --lora-alpha / --train-also without --lora ran full fine-tuning silently."""
    import argparse

    from confidant.commands import _lora_settings
    from confidant.errors import UsageError

    args = argparse.Namespace(lora=None, lora_alpha=None, lora_targets="q,v", train_also=None)
    with pytest.raises(UsageError, match=r"^--lora-targets set LoRA's adapters, but without --lora R every weight "
                                       r"trains in full; add --lora R \(e.g. --lora 8\), or drop them$"):
        _lora_settings(args)
    assert _lora_settings(argparse.Namespace(lora=None, lora_alpha=None, lora_targets=None, train_also=None)) is None
    settings = _lora_settings(argparse.Namespace(lora=4, lora_alpha=None, lora_targets=None, train_also=None))
    assert (settings.rank, settings.alpha, settings.targets, settings.train_also) == (4, 8.0, ("q", "k", "v", "o"),
                                                                                     ("auto",))
