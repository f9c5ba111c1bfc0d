"""A quantized frozen base (issue 31, lever 1): the blockwise scheme of `ir.precision`, and LoRA on a
base held at int8 / int4 / bfloat16 against PEFT on the dequantized weights in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ir.precision import (BASE_DTYPES, BLOCK, QuantizedTensor, bytes_per_element, dequantize, held_bytes,
                          quantize, quantize_frozen)


# --- the scheme -----------------------------------------------------------------------------------

def _weight(shape=(48, 100), seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[3, 7] = 0.9  # one outlier: its block's scale, and only its block's, is large
    w[5, :] = 0.0  # an all-zero row: zero scales, no division by zero
    return w


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("storage,qmax", [("int8", 127), ("int4", 7)])
def test_blockwise_round_trip_error_is_half_a_step_of_its_block(storage, qmax, axis):
    w = _weight()
    q = quantize(w, storage, axis)
    d = dequantize(q)
    assert d.shape == w.shape and d.dtype == np.float32
    stored = w if axis == 1 else w.T
    rows, cols = stored.shape
    padded = np.zeros((rows, -(-cols // BLOCK) * BLOCK), np.float32)
    padded[:, :cols] = stored
    absmax = np.abs(padded.reshape(rows, -1, BLOCK)).max(axis=2)
    step = np.repeat(absmax / qmax, BLOCK, axis=1)[:, :cols]
    err = np.abs((d if axis == 1 else d.T) - stored)
    # half a quantization step, plus the float16 scale's rounding (2^-11 relative) times qmax steps
    assert (err <= step * (0.5 + qmax * 2.0 ** -11) + 1e-12).all()
    assert (d[5] == 0).all()  # zeros stay zero (a zero scale divides nothing)
    # an outlier coarsens its own block only: every other element dequantizes as without it
    calm = w.copy()
    calm[3, 7] = 0.01
    changed = dequantize(quantize(calm, storage, axis)) != d
    block = np.zeros_like(changed)
    if axis == 1:
        block[3, 0:32] = True
    else:
        block[0:32, 7] = True
    assert changed[block].any() and not changed[~block].any()


def test_bfloat16_rounds_to_nearest_with_8_bits_of_mantissa():
    w = _weight()
    d = dequantize(quantize(w, "bfloat16", 1))
    assert (np.abs(d - w) <= np.abs(w) * 2.0 ** -8).all()
    assert ((d.view(np.uint32) & 0xFFFF) == 0).all()


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("axis", [0, 1])
def test_quantizing_the_dequantized_weight_gives_back_the_same_codes(storage, axis):
    """What lets a bundle carry float32 values and a device quantize them again to the same weight."""
    q = quantize(_weight(seed=3), storage, axis)
    again = quantize(dequantize(q), storage, axis)
    assert np.array_equal(again.codes, q.codes) and np.array_equal(again.scales, q.scales)


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "int4"])
def test_storage_bytes_are_what_bytes_per_element_charges(storage):
    w = _weight((64, 96))
    q = quantize(w, storage, 1)
    assert q.nbytes == held_bytes(w.shape, storage) == int(w.size * bytes_per_element(storage))
    assert bytes_per_element("float32") == 4.0 and bytes_per_element("int4") < 0.6 < bytes_per_element("int8") < 1.1


def test_rows_and_row_ranges_widen_exactly_the_dequantized_slices():
    q = quantize(_weight(), "int4", 1)
    d = dequantize(q)
    assert np.array_equal(q.widen_rows(np.array([[3, 5], [0, 47]])), d[[[3, 5], [0, 47]]])
    assert np.array_equal(q.widen_range(10, 20), d[10:20])
    t = quantize(_weight(), "int8", 0)  # blocked along rows: storage rows are the logical columns
    assert np.array_equal(t.widen_range(4, 9), dequantize(t).T[4:9])
    assert np.array_equal(np.asarray(q), d) and q.shape == d.shape and q.dtype == np.float32


def test_bad_precisions_and_weights_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="int3.*not one of float32, bfloat16, int8, int4"):
        quantize(_weight(), "int3")
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.ones(8, np.float32), "int8")
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.full((2, 32), np.nan, np.float32), "int8")
    assert BASE_DTYPES == ("float32", "bfloat16", "int8", "int4")


# --- LoRA on a quantized base against PEFT ----------------------------------------------------------

RANK, ALPHA, B, S, VOCAB = 4, 8.0, 2, 12, 120


def _round_to(model, storage: str):
    """Every 2-D weight of `model` replaced by its dequantized `storage` form (blocks along the input
    dimension: a Linear's [out, in] rows, an embedding's rows), as the LoRA pass holds them (a copy)."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.detach().numpy(), storage, 1))))
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers as tf

    from jobs.export_llm import LlmExportOptions, export_causal_lm
    from support import scrambled_causal_lm

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True)
    model = scrambled_causal_lm(config)
    path = export_causal_lm(model, tmp_path_factory.mktemp("qllama") / "m.onnx", LlmExportOptions(), kv_cache=False)
    return model, path


def _peft_grads(model, feeds, seed=5):
    """(PEFT's float64 adapter gradients by (layer, A|B), the A and B it ran with) for q, k, v, o."""
    import copy

    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(copy.deepcopy(model).double(), LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    rng = np.random.default_rng(seed)
    layers = {n: m for n, m in peft.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    with torch.no_grad():
        for m in layers.values():
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            a.copy_(torch.from_numpy(rng.normal(0, 0.2, tuple(a.shape))))
            b.copy_(torch.from_numpy(rng.normal(0, 0.2, tuple(b.shape))))
    logits = peft(input_ids=torch.from_numpy(feeds["input_ids"]),
                  attention_mask=torch.from_numpy(feeds["attention_mask"])).logits
    ids = torch.from_numpy(feeds["target_ids"])
    ce = torch.logsumexp(logits, -1) - logits.gather(-1, ids[..., None])[..., 0]
    loss = (torch.from_numpy(feeds["target_weights"]).double() * ce).sum()
    loss.backward()
    return loss.item(), layers


def _engine_weights(graph, adapters, layers):
    """The engine's A and B from PEFT's layers, matched by the base weight's value."""
    out, modules = {}, {}
    for a in adapters:
        w = np.asarray(graph.constants[a.base], np.float64)
        hf = w if a.base_transposed else w.T
        found = [m for m in layers.values() if tuple(m.base_layer.weight.shape) == hf.shape
                 and np.array_equal(m.base_layer.weight.detach().numpy(), hf)]
        assert len(found) == 1, a.base
        modules[a.base] = found[0]
        out[a.a] = found[0].lora_A["default"].weight.detach().numpy().T.astype(np.float32)
        out[a.b] = found[0].lora_B["default"].weight.detach().numpy().T.astype(np.float32)
    return out, modules


@pytest.mark.parametrize("storage", ["int4", "int8", "bfloat16"])
@pytest.mark.parametrize("engine", ["torch", "mnn"])
def test_lora_gradients_on_a_quantized_base_equal_pefts_on_the_dequantized_weights(tiny_llama, storage, engine):
    """The whole tied Llama on one engine: every frozen weight (projections, feed-forward, the tied
    embedding table and LM head) held at `storage`, adapters on q, k, v, o. PEFT in float64 runs on
    the model whose weights were rounded the same way; the engines never see a float32 base."""
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from runtime.engines.stage import stage_spec
    from support import lm_step_feeds, stage_engine

    model, path = tiny_llama
    graph, adapters = add_lora(load_model(path, B, S), LoraSettings(RANK, ALPHA, ("q", "k", "v", "o"), (),
                                                                  base_dtype=storage))
    held = {k: v for k, v in graph.constants.items() if isinstance(v, QuantizedTensor)}
    # 2 layers x 7 projections, and the tied table (looked up and read by the LM head)
    assert len(held) == 15 and {v.storage for v in held.values()} == {storage}
    assert not set(held) & set(graph.params)
    rounded = _round_to(model, storage)
    feeds = lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]
    want_loss, layers = _peft_grads(rounded, feeds)
    weights, modules = _engine_weights(graph, adapters, layers)
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    eng = stage_engine(engine, spec)
    eng.set_parameters(weights)
    assert float(np.asarray(eng.forward(feeds, 0)).reshape(-1)[0]) == pytest.approx(want_loss, rel=1e-5)
    grads = eng.backward(0).params
    assert set(grads) == set(graph.params)
    for a in adapters:
        for mine, theirs in ((a.a, modules[a.base].lora_A["default"]), (a.b, modules[a.base].lora_B["default"])):
            ref = theirs.weight.grad.numpy().T
            err = float(np.abs(grads[mine] - ref).max() / np.abs(ref).max())
            assert err <= 1e-4, (mine, err)


def test_the_lora_pass_charges_frozen_weights_at_their_precision(tiny_llama):
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model

    _, path = tiny_llama
    base = load_model(path, B, S)
    frozen = {}
    for storage in BASE_DTYPES:
        graph, _ = add_lora(base, LoraSettings(RANK, ALPHA, ("q", "k", "v", "o"), (), base_dtype=storage))
        frozen[storage] = sum(b.frozen_bytes for b in graph.blocks)
        trainable = sum(b.params_bytes for b in graph.blocks)
        assert trainable == sum(int(graph.constants[p].nbytes) for p in graph.params)  # adapters stay float32
    # the 1-D norm scales stay float32 in every case; the 2-D weights scale with bytes_per_element
    norms = sum(int(np.asarray(v).nbytes) for k, v in base.constants.items() if np.asarray(v).ndim == 1
                and k in base.params)
    for storage in ("bfloat16", "int8", "int4"):
        ratio = (frozen[storage] - norms) / (frozen["float32"] - norms)
        assert ratio == pytest.approx(bytes_per_element(storage) / 4, rel=1e-6), storage


def test_quantize_frozen_leaves_trainable_and_1d_constants_alone(tiny_llama):
    from planner.onnx_import import load_model

    _, path = tiny_llama
    graph = load_model(path, B, S)
    some = graph.params[:3]
    out = quantize_frozen(graph.nodes, graph.constants, some, "int4")
    for k, v in out.items():
        if isinstance(v, QuantizedTensor):
            assert k not in some and v.ndim == 2
        else:
            assert v is graph.constants[k]


@pytest.mark.parametrize("transposed", [True, False])
def test_the_quantized_lm_head_loss_over_vocabulary_chunks_equals_the_whole_heads(transposed):
    """The head widened 64 vocabulary rows at a time (5 chunks, the last partial; a running
    logsumexp) against the fused loss over the whole dequantized head, float64."""
    from runtime.engines.lm_loss import LinearCrossEntropy, quantized_linear_cross_entropy

    rng = np.random.default_rng(4)
    vocab, hidden = 300, 64
    head = quantize(rng.standard_normal((vocab, hidden) if transposed else (hidden, vocab)).astype(np.float32),
                    "int4", 1 if transposed else 0)
    h = rng.standard_normal((2, 6, hidden))
    ids = rng.integers(0, vocab, (2, 6))
    w = (rng.random((2, 6)) < 0.7) / 12.0
    got = quantized_linear_cross_entropy(h, head, ids, w, chunk_bytes=1)
    full = dequantize(head).astype(np.float64)
    logits = h @ (full.T if transposed else full)  # the unfused computation, float64
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, ids[..., None], -1)[..., 0]
    assert got.loss == pytest.approx(float((w * (lse - picked)).sum()), rel=1e-12)
    dz = np.exp(logits - lse[..., None]) - np.eye(vocab)[ids]
    want = (w[..., None] * dz) @ (full if transposed else full.T)
    np.testing.assert_allclose(got.grad_hidden, want, rtol=1e-10, atol=1e-14)
    assert got.grad_weight is None
    f32 = LinearCrossEntropy(transposed)(h, dequantize(head), ids, w, weight_grad=False)  # the float32 kernel
    assert quantized_linear_cross_entropy(h.astype(np.float32), head, ids, w).loss == pytest.approx(f32.loss, rel=1e-5)
