"""A quantized frozen base (issue 31, lever 1): the blockwise scheme of `ir.precision`, and LoRA on a
base held at int8 / int4 / bfloat16 against PEFT on the dequantized weights in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ir.precision import (BASE_DTYPES, BLOCK, QuantizedTensor, bytes_per_element, dequantize, held_bytes,
                          lookup_tables, quantize, quantize_frozen, storage_for)


# --- the scheme -----------------------------------------------------------------------------------

def _weight(shape=(48, 100), seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[3, 7] = 0.9  # one outlier: its block's scale, and only its block's, is large
    w[5, :] = 0.0  # an all-zero row: zero scales, no division by zero
    return w


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_blockwise_round_trip_error_is_half_a_step_of_its_block(storage, axis):
    w = _weight()
    q = quantize(w, storage, axis)
    d = dequantize(q)
    assert d.shape == w.shape and d.dtype == np.float32
    stored = w if axis == 1 else w.T
    rows, cols = stored.shape
    padded = np.zeros((rows, -(-cols // BLOCK) * BLOCK), np.float32)
    padded[:, :cols] = stored
    padded[:, cols:] = stored[:, -1:]
    blocks = padded.reshape(rows, -1, BLOCK)
    if storage == "int8":  # symmetric: 127 steps of max|w| / 127 each side of zero
        levels, step = 127, np.abs(blocks).max(axis=2) / 127
    else:  # asymmetric: 15 steps of (max - min) / 15 from the block's minimum
        levels, step = 15, (blocks.max(axis=2) - blocks.min(axis=2)) / 15
    step = np.repeat(step, BLOCK, axis=1)[:, :cols]
    err = np.abs((d if axis == 1 else d.T) - stored)
    # half a step, plus the float16 scale's (and offset's) rounding, 2^-11 relative, over all levels
    slack = levels * 2.0 ** -11 * step + 2.0 ** -11 * np.abs(stored).max()
    assert (err <= 0.5 * step + slack + 1e-12).all()
    assert err.max() > 0.2 * step.max()  # not lossless: the bound is the one that matters
    assert axis == 0 or (d[5] == 0).all()  # a zero block stays zero (a zero scale divides nothing)
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


def test_int4_gives_back_a_q4_1_models_weights_exactly():
    """A block dequantized from llama.cpp's Q4_1 (float16 d and m, codes 0..15, its extremes used,
    as Q4_1's quantizer makes them) is its own int4 form: SmolLM2's GGUF loses nothing more."""
    rng = np.random.default_rng(1)
    d = (rng.random((40, 6)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
    m = (-rng.random((40, 6)) * 0.08).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (40, 6, BLOCK))
    codes[:, :, 3], codes[:, :, 9] = 0, 15
    w = (codes * d[:, :, None] + m[:, :, None]).astype(np.float32).reshape(40, -1)
    assert np.array_equal(dequantize(quantize(w, "int4", 1)), w)
    assert not np.array_equal(dequantize(quantize(w, "int8", 1)), w)


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "int4"])
def test_storage_bytes_are_what_bytes_per_element_charges(storage):
    w = _weight((64, 96))
    q = quantize(w, storage, 1)
    assert q.nbytes == held_bytes(w.shape, storage) == int(w.size * bytes_per_element(storage))
    assert [bytes_per_element(t) for t in BASE_DTYPES] == [4.0, 2.0, 1.0625, 0.625]


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
        for name, p in model.named_parameters():
            if p.dim() == 2:  # int4 keeps the (tied) embedding table int8
                held = storage_for(storage, "embed_tokens" in name)
                p.copy_(torch.from_numpy(dequantize(quantize(p.detach().numpy(), held, 1))))
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny tied Llama (support.tiny_tied_llama), its export."""
    from support import tiny_tied_llama

    model, path = tiny_tied_llama(tmp_path_factory.mktemp("qllama"), VOCAB)
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
    assert len(held) == 15 and {v.storage for v in held.values()} == {storage, storage_for(storage, True)}
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
    # the 1-D norm scales stay float32 in every case; the 2-D weights cost bytes_per_element of the
    # precision they are held at (int4: the tied table int8)
    tables = lookup_tables(base.nodes)
    two_d = {k: v for k, v in base.constants.items() if k in base.params and np.asarray(v).ndim == 2}
    assert tables & set(two_d)
    # a weight counts in each block that reads it (the tied table: the embeddings' and the head's)
    readers = {k: sum(any(k in base.node(n).inputs for n in b.nodes) for b in base.blocks) for k in two_d}
    for storage in ("bfloat16", "int8", "int4"):
        want = sum(readers[k] * v.size * (bytes_per_element(storage_for(storage, k in tables)) - 4)
                   for k, v in two_d.items())
        assert frozen[storage] - frozen["float32"] == pytest.approx(want, abs=len(two_d)), storage


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


@pytest.mark.parametrize("storage", ["int4", "int8", "bfloat16"])
@pytest.mark.parametrize("transposed", [True, False])
def test_the_logits_of_a_quantized_lm_head_are_the_whole_heads_chunk_by_chunk(transposed, storage):
    """An MNN stage's logits for evaluation (`until_block` at a fused head, what a pipeline's
    generation on its workers reads: jobs.train.pipeline_tasks.lm_evaluation_on_stages) of a head
    held quantized: widened 64 vocabulary rows at a time (5 chunks, the last partial) they equal the
    whole dequantized head's (an int4 base's tied head was refused: 'QuantizedTensor' has no 'T')."""
    from runtime.engines.lm_loss import LinearCrossEntropy

    rng = np.random.default_rng(5)
    vocab, hidden = 300, 64
    head = quantize(rng.standard_normal((vocab, hidden) if transposed else (hidden, vocab)).astype(np.float32),
                    storage, 1 if transposed else 0)
    h = rng.standard_normal((2, 6, hidden)).astype(np.float32)
    full = dequantize(head)
    want = h @ (full.T if transposed else full)
    got = LinearCrossEntropy(transposed, chunk_bytes=1).logits(h, head)
    assert got.shape == (2, 6, vocab) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- plans, bundles, pipelines, the command line --------------------------------------------------

@pytest.fixture(scope="module")
def int4_lora(tiny_onnx):
    """The tiny BERT of the LoRA pipeline tests, adapters on q, v, up, its base held int4, B non-zero."""
    from support import tiny_lora_graph

    return tiny_lora_graph(tiny_onnx["torchscript-17"], "int4")


def test_a_plan_records_the_base_precision_and_its_bundles_hold_the_same_quantized_weights(int4_lora, tmp_path,
                                                                                          capsys):
    from ir.bundle import load_bundle_dir, load_plan
    from planner.emit import emit_plan
    from planner.partition import make_instance, solve_partition
    from planner.replan import flops_cluster
    from planner.schedule import make_schedule

    cluster = flops_cluster(int4_lora, ["a", "b"])
    partition = solve_partition(make_instance(int4_lora, cluster, "1f1b-flush", 2, "adamw"), time_limit_s=5)
    emit_plan(tmp_path / "plan", int4_lora, partition, make_schedule("1f1b-flush", len(partition.stages), 2),
              {"model": "tiny-int4"}, cluster=cluster)
    plan = load_plan(tmp_path / "plan", verify_bundles=True)
    assert plan.base_dtype == "int4" and plan.to_json()["base_dtype"] == "int4"
    from confidant.commands import show_plan

    show_plan(tmp_path / "plan")
    assert ", frozen base held int4" in capsys.readouterr().out.splitlines()[0]
    assert sum(d.frozen_bytes for d in plan.devices) == sum(b.frozen_bytes for b in int4_lora.blocks)
    held = 0
    for d in plan.devices:
        graph = load_bundle_dir(tmp_path / "plan" / d.name).graph
        for name, value in graph.constants.items():
            original = int4_lora.constants[name]
            if isinstance(original, QuantizedTensor):
                held += 1
                assert isinstance(value, QuantizedTensor) and value.storage == original.storage
                assert np.array_equal(value.codes, original.codes) and np.array_equal(value.scales, original.scales)
    assert held >= 8
    # a plan from before --base-dtype (no field) reads as float32
    from ir.documents import PlanDocument

    doc = plan.to_json()
    del doc["base_dtype"]
    assert PlanDocument.from_json(doc, "old").base_dtype == "float32"
    with pytest.raises(Exception, match="base_dtype is 'int3'"):
        PlanDocument.from_json({**doc, "base_dtype": "int3"}, "bad")


def test_what_would_make_it_fit_names_a_quantized_base_with_the_bytes_it_saves(int4_lora, tiny_onnx):
    from dataclasses import replace

    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from planner.partition import make_instance, solve_partition
    from planner.partition.explain import PlanDoesNotFit
    from planner.replan import flops_cluster
    from support import ROWS, S as SEQ

    f32, _ = add_lora(load_model(tiny_onnx["torchscript-17"], ROWS, SEQ),
                      LoraSettings(4, 16.0, targets=("q", "v", "up"), seed=1))
    cluster = flops_cluster(f32, ["a"])
    cluster = replace(cluster, devices=tuple(replace(d, memory_budget_bytes=1 << 16) for d in cluster.devices))
    with pytest.raises(PlanDoesNotFit) as err:
        solve_partition(make_instance(f32, cluster, "1f1b-flush", 2, "adamw"), time_limit_s=5)
    quantized = {k: v for k, v in int4_lora.constants.items() if isinstance(v, QuantizedTensor)}
    assert {v.storage for v in quantized.values()} == {"int4", "int8"}  # the embedding tables int8
    int8 = sum(int(4 * v.size - v.size * bytes_per_element("int8")) for v in quantized.values())
    int4 = sum(int(4 * v.size - v.nbytes) for v in quantized.values())
    assert f"--base-dtype int4 saves {int4} bytes" in str(err.value)
    assert f"--base-dtype int8 saves {int8} bytes" in str(err.value)
    with pytest.raises(PlanDoesNotFit) as err:  # already int4: nothing more to name
        solve_partition(make_instance(int4_lora, cluster, "1f1b-flush", 2, "adamw"), time_limit_s=5)
    assert "--base-dtype" not in str(err.value)


@pytest.mark.slow  # in process: the bundle test above (the same int4 weights after the round trip)
def test_a_pipeline_on_an_int4_base_equals_one_device(int4_lora):
    """Real worker processes over ZeroMQ: each receives its stage's frozen weights as float32 values
    and quantizes them again to the same int4 weights (ir.serialize), so the run equals one device."""
    from jobs.train.pipeline import train_pipeline
    from jobs.common.workers import LocalWorkers
    from runtime.pipeline.coordinator import PipelineConfig
    from support import M, single_device_training, synthetic_batch

    batches = [synthetic_batch(i) for i in range(2)]
    workers = LocalWorkers.start(2, threads=1)
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-3, timeout_s=120)
    try:
        result = train_pipeline(int4_lora, batches, 9, workers.addresses, config, 2, keys=workers.keys)
    finally:
        assert workers.wait(30.0) == [0, 0]
    losses, weights = single_device_training(int4_lora, batches, 2)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    for k in weights:
        err = float(np.abs(result.weights[k] - weights[k]).max()) / max(float(np.abs(weights[k]).max()), 1e-12)
        assert err <= 1e-5, k


@pytest.mark.parametrize("argv,message", [
    (["train-local", "--base-dtype", "int4"], "--base-dtype int4 holds the frozen base weights at lower precision, "
                                               "but without --lora R every weight trains in full"),
    (["plan", "--base-dtype", "int3"], "argument --base-dtype: invalid choice: 'int3'"),
    (["train-pipeline", "--lora", "8", "--base-dtype", "float16"], "argument --base-dtype: invalid choice"),
])
def test_bad_base_dtypes_get_one_line_and_exit_2(argv, message, tmp_path):
    from support import run_cli

    data = tmp_path / "d.txt"
    data.write_text("x\n")
    extra = {"train-local": ["m.onnx", "--data", data, "--eval", data], "plan": ["m.onnx", "--cluster", "c.yaml"],
             "train-pipeline": ["m.onnx", "--data", data]}[argv[0]]
    run = run_cli(argv[0], *extra, *argv[1:])
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len([line for line in run.stderr.splitlines() if line.startswith(("error", "confidant"))]) == 1


def test_checkpoints_carry_the_base_precision_and_resume_refuses_another(tmp_path):
    from dataclasses import asdict

    from planner.lora import LoraSettings

    settings = LoraSettings(8, base_dtype="int4")
    assert asdict(settings)["base_dtype"] == "int4"
    old = {k: v for k, v in asdict(LoraSettings(8)).items() if k != "base_dtype"}
    assert LoraSettings(**old).base_dtype == "float32"  # a checkpoint's meta from before the field
    with pytest.raises(ValueError, match="--base-dtype 'int2' is not one of"):
        LoraSettings(8, base_dtype="int2")


def test_resume_refuses_another_base_precision_and_reads_old_checkpoints_as_float32(tmp_path):
    from dataclasses import asdict

    from jobs.common.errors import JobError
    from jobs.train.pipeline import _resumed
    from planner.lora import LoraSettings
    from runtime.pipeline.checkpoints import save_checkpoint

    meta = {"model": "m.onnx", "task": "causal-lm", "schedule": "1f1b-flush", "microbatches": 2, "batch": 2,
            "seq": 8, "optimizer": "adamw", "seed": 0, "step": 1, "stages": 1, "ranges": [[0, 3]]}
    old = {k: v for k, v in asdict(LoraSettings(4)).items() if k != "base_dtype"}
    save_checkpoint(tmp_path / "old", [{"param/a": np.ones(3, np.float32)}], {**meta, "lora": old})
    assert _resumed(tmp_path / "old", {**meta, "lora": asdict(LoraSettings(4))}, 1)[0] == 1
    with pytest.raises(JobError, match="checkpoint has lora=.*'seed': 0}, this run .*'base_dtype': 'int4'"):
        _resumed(tmp_path / "old", {**meta, "lora": asdict(LoraSettings(4, base_dtype="int4"))}, 1)
    save_checkpoint(tmp_path / "q", [{"param/a": np.ones(3, np.float32)}],
                    {**meta, "lora": asdict(LoraSettings(4, base_dtype="int4"))})
    assert _resumed(tmp_path / "q", {**meta, "lora": asdict(LoraSettings(4, base_dtype="int4"))}, 1)[0] == 1
    with pytest.raises(JobError, match="'base_dtype': 'int4'.*this run .*'int8'"):
        _resumed(tmp_path / "q", {**meta, "lora": asdict(LoraSettings(4, base_dtype="int8"))}, 1)


def test_the_memory_model_charges_mnns_float32_block_scales_and_nothing_more_on_pytorch(int4_lora):
    """MNN has no float16 Var: the quantized weights its graphs read hold their block scales and
    int4 offsets as float32 (2 bytes more each); tables stay in numpy in ir.precision's own form."""
    import dataclasses

    from planner.cost import frozen_storage_extra_bytes
    from support import tiny_cluster

    mnn = tiny_cluster().device("a")
    torch_backend = dataclasses.replace(mnn.profile.backends[0], backend="torch:cpu:t1")
    torch_device = dataclasses.replace(mnn, backend="torch:cpu:t1", profile=dataclasses.replace(
        mnn.profile, backends=mnn.profile.backends + (torch_backend,)))
    n = len(int4_lora.blocks)
    tables = lookup_tables(int4_lora.nodes)
    want = sum(2 * v.scales.size * (2 if v.mins is not None else 1) for k, v in int4_lora.constants.items()
               if isinstance(v, QuantizedTensor) and k not in tables)
    assert want > 0
    assert frozen_storage_extra_bytes(int4_lora, 0, n - 1, mnn) == want
    assert frozen_storage_extra_bytes(int4_lora, 0, n - 1, torch_device) == 0
    assert frozen_storage_extra_bytes(int4_lora, 0, 0, mnn) == 0  # the embeddings: tables, in numpy


def test_the_recompute_widens_again_to_the_same_gradients(tiny_llama):
    """A stage that recomputes its forward in the backward (PyTorch's recompute, MNN without per-op
    caches) widens the quantized weights a second time: the same loss and gradients, input's too."""
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.pytorch import TorchStageEngine
    from runtime.engines.stage import stage_spec
    from support import lm_step_feeds

    _, path = tiny_llama
    graph, _ = add_lora(load_model(path, B, S), LoraSettings(RANK, ALPHA, ("q", "k", "v", "o"), (), base_dtype="int4"))
    rng = np.random.default_rng(0)
    weights = {p: rng.normal(0, 0.1, graph.constants[p].shape).astype(np.float32) for p in graph.params}
    spec = stage_spec(graph, 1, len(graph.blocks) - 1)
    feeds = {**lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0],
             spec.activation_input: rng.standard_normal(graph.values[spec.activation_input].shape).astype(np.float32)}
    runs = []
    for make in (lambda: TorchStageEngine(spec), lambda: TorchStageEngine(spec, recompute=True),
                 lambda: MnnStageEngine(spec, cache_activations=False)):
        engine = make()
        engine.set_parameters(weights)
        loss = float(np.asarray(engine.forward(feeds, 0)).reshape(-1)[0])
        result = engine.backward(0)
        runs.append((loss, result.params, result.activation_input))
    (loss, grads, dx), recomputed, mnn = runs
    assert recomputed[0] == loss and all(np.array_equal(recomputed[1][k], grads[k]) for k in grads)
    assert np.array_equal(recomputed[2], dx)
    assert mnn[0] == pytest.approx(loss, rel=1e-6)
    for k in grads:
        assert float(np.abs(mnn[1][k] - grads[k]).max()) <= 1e-4 * float(np.abs(grads[k]).max()), k
    assert float(np.abs(mnn[2] - dx).max()) <= 1e-4 * float(np.abs(dx).max())
