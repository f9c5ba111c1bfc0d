"""`confidant export --base-dtype`: the frozen weights stored quantized in the exported files.

Held to independent references: ONNX Runtime on the quantized file against ONNX Runtime on the float
export given the dequantized weights (`ir.precision.dequantize`), and greedy generation against
transformers' own on the model with those weights; the lowering and a LoRA run's base against the
very codes the export wrote (no second rounding); the file's weight bytes against the float export's.
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ir.precision import QuantizedTensor, dequantize
from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from jobs.export.quantized import quantize_export
from planner.onnx_import import load_model
from planner.onnx_quantize import quantized_weights, recorded_base_dtype
from support import run_cli
from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DTYPES = ["int4", "int8", "bfloat16"]
# wider than the default tiny Llama, so the projections (int4) outweigh the table (int8) as in an LLM
CONFIG = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    """A seeded random Llama (vocabulary 256, hidden 128, 2 layers, tied embeddings) and its export."""
    model = random_causal_lm("llama", 0, **CONFIG)
    return model, export_causal_lm(model, tmp_path_factory.mktemp("qexport") / "float" / "m.onnx")


@pytest.fixture(scope="module")
def quantized(float_llama, tmp_path_factory):
    """dtype -> (the quantized copy of the export, the QuantizedTensors it was written from)."""
    _, path = float_llama
    graph = load_model(path, 1, 8, with_loss=False)
    out = {}
    for dtype in DTYPES:
        folder = tmp_path_factory.mktemp(f"q-{dtype}")
        for f in path.parent.iterdir():
            shutil.copy(f, folder / f.name)
        done = quantize_export(folder / path.name, dtype)
        weights = quantized_weights(graph, dtype)
        assert done.weights == len(weights) and len(done.files) == 2  # the cache graph too
        out[dtype] = (folder / path.name, weights)
    return out


def _weight_bytes(path: Path) -> int:
    """Bytes of the file's initializers, as stored."""
    import onnx
    from onnx import numpy_helper

    return sum(len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in onnx.load(str(path)).graph.initializer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_onnx_runtime_on_the_quantized_file_equals_the_float_model_on_the_dequantized_weights(float_llama, quantized,
                                                                                              dtype):
    _, path = float_llama
    qpath, weights = quantized[dtype]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    reference = OnnxCausalLM(path, initializers={k: dequantize(q) for k, q in weights.items()},
                             optimize=False).logits(ids, mask)
    got = OnnxCausalLM(qpath, optimize=False).logits(ids, mask)
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4)
    plain = OnnxCausalLM(path, optimize=False).logits(ids, mask)
    assert np.abs(plain - reference).max() > 1e-4  # the weights did move: the check above can fail
    assert recorded_base_dtype(qpath) == dtype and recorded_base_dtype(path) == "float32"


def test_greedy_generation_on_the_int4_file_equals_transformers_on_the_dequantized_weights(float_llama, quantized):
    import torch

    model, _ = float_llama
    qpath, weights = quantized["int4"]
    twin = random_causal_lm("llama", 0, **CONFIG)
    with torch.no_grad():
        params = dict(twin.named_parameters())
        for name, q in weights.items():
            params[name].copy_(torch.from_numpy(dequantize(q)))
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        x = torch.tensor([prompt])
        expected = twin.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    for kv in (True, False):
        assert OnnxCausalLM(qpath).generate([prompt], GenerationSettings(max_new_tokens=10, kv_cache=kv)) == [expected]


def test_int4_weights_take_under_a_fifth_of_their_float32_bytes(float_llama, quantized):
    _, path = float_llama
    ratios = {d: _weight_bytes(quantized[d][0]) / _weight_bytes(path) for d in DTYPES}
    assert ratios["int4"] < 0.2, ratios
    assert ratios["int4"] < ratios["int8"] < ratios["bfloat16"] < 0.51, ratios
    assert quantized["int4"][0].stat().st_size < 0.3 * path.stat().st_size


def test_the_lowering_and_a_lora_base_get_the_exported_codes_back(quantized):
    from planner.lora import LoraSettings, add_lora

    qpath, weights = quantized["int4"]
    graph = load_model(qpath, 1, 8)
    for name, q in weights.items():
        np.testing.assert_array_equal(graph.constants[name], dequantize(q), err_msg=name)
    lora, _ = add_lora(graph, LoraSettings(8, base_dtype="int4"))
    held = {k: v for k, v in lora.constants.items() if isinstance(v, QuantizedTensor)}
    assert held.keys() == weights.keys()
    for name, q in weights.items():
        assert held[name].storage == q.storage
        np.testing.assert_array_equal(held[name].codes, q.codes, err_msg=name)
        np.testing.assert_array_equal(held[name].scales, q.scales, err_msg=name)


def _args(model: Path, **flags) -> argparse.Namespace:
    base = dict(model=model, lora=8, lora_alpha=None, lora_targets=None, train_also=None, base_dtype="float32", seed=0)
    return argparse.Namespace(**{**base, **flags})


def test_a_lora_run_holds_the_base_at_the_files_precision_and_refuses_another(quantized, float_llama):
    from confidant.commands import _lora_settings
    from confidant.errors import UsageError

    qpath, _ = quantized["int4"]
    assert _lora_settings(_args(qpath)).base_dtype == "int4"
    assert _lora_settings(_args(qpath, base_dtype="int4")).base_dtype == "int4"
    assert _lora_settings(_args(qpath, lora=None)) is None  # full fine-tuning: float32 from the stored values
    with pytest.raises(UsageError, match="round them a second time"):
        _lora_settings(_args(qpath, base_dtype="int8"))
    assert _lora_settings(_args(float_llama[1], base_dtype="int8")).base_dtype == "int8"


def test_generate_runs_on_a_quantized_export_and_bad_flags_get_one_line(chat_llama, tmp_path):
    path, _, _ = chat_llama
    for f in path.parent.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    qpath = tmp_path / path.name
    quantize_export(qpath, "int4")
    run = run_cli("generate", qpath, "--prompt", "Hello", "--max-new-tokens", "3")
    assert run.returncode == 0, run.stderr
    run = run_cli("train-local", qpath, "--task", "causal-lm", "--lora", "8", "--base-dtype", "int8",
                  "--data", tmp_path / "none.jsonl", "--eval", tmp_path / "none.jsonl")
    assert run.returncode == 2 and "round them a second time" in run.stderr and "Traceback" not in run.stderr
    run = run_cli("export", "--task", "causal-lm", "--random", "llama", "--dynamo", "--base-dtype", "int4",
                  "-o", tmp_path / "d.onnx")
    assert run.returncode == 2 and "drop --dynamo" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    run = run_cli("export", "--base-dtype", "int3", "-o", tmp_path / "e.onnx")
    assert run.returncode == 2 and "int3" in run.stderr


def test_trained_weights_replace_stored_ones_for_onnx_runtime(float_llama, quantized):
    """Evaluation after training (train-local) runs ONNX Runtime with the trained weights in place of
    the file's: a weight stored quantized is ops' output, which ONNX Runtime would silently keep, so
    the files are rewritten with it as an initializer (jobs.common.onnx_lm), and refused without that."""
    from jobs.common.onnx_lm import stored_replaced as _stored_replaced

    _, path = float_llama
    qpath, weights = quantized["int4"]
    name = "model.layers.0.self_attn.q_proj.weight"
    trained = {name: dequantize(weights[name]) * 1.5}
    ids = np.arange(9)[None] % 250
    mask = np.ones_like(ids)
    with pytest.raises(ValueError, match="cannot be\\s+replaced"):
        OnnxCausalLM(qpath, trained)
    got = OnnxCausalLM(qpath, trained, sources=_stored_replaced(qpath, trained), optimize=False).logits(ids, mask)
    reference = OnnxCausalLM(path, {**{k: dequantize(q) for k, q in weights.items()}, **trained},
                             optimize=False).logits(ids, mask)
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4)
    untrained = OnnxCausalLM(qpath, optimize=False).logits(ids, mask)
    assert np.abs(untrained - reference).max() > 1e-3


def test_a_trained_model_is_written_out_of_a_stored_quantized_export(float_llama, quantized, tmp_path):
    """`export-trained -o` (planner.onnx_import.write_weights): trained weights that the export stored
    quantized become plain initializers of the written file; the others stay stored."""
    from planner.onnx_import import write_weights

    _, path = float_llama
    qpath, weights = quantized["int8"]
    name = "model.layers.1.mlp.down_proj.weight"
    trained = {name: dequantize(weights[name]) - 0.01}
    out = write_weights(qpath, tmp_path / "trained.onnx", trained)
    ids = np.arange(7)[None] % 250
    mask = np.ones_like(ids)
    reference = OnnxCausalLM(path, {**{k: dequantize(q) for k, q in weights.items()}, **trained},
                             optimize=False).logits(ids, mask)
    np.testing.assert_allclose(OnnxCausalLM(out, optimize=False).logits(ids, mask), reference, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(load_model(out, 1, 7).constants[name], trained[name])
    assert _weight_bytes(out) < 0.5 * _weight_bytes(path)
