"""Decoder families beyond Llama and GPT-2, as `confidant export --task causal-lm` exports them from
a checkpoint (eager attention, TorchScript): Qwen2 (biased Q/K/V), Qwen3 (Q/K norms, heads x head
size wider than the model), Phi-3 (fused QKV and gate/up projections, a rotary that covers the whole
head, so its pass-through part is sliced to nothing), Gemma (RMSNorm scaled by 1 + w, a scaled
embedding, tanh-GELU gating), GPT-J (interleaved rotary tables built with Tile, parallel residual),
GPT-NeoX (partial rotary), OPT (learned positions with an offset, ReLU), Falcon (multi-query) and
BLOOM (ALiBi position biases from the mask, a normed embedding before pre-norm layers).

Each is a tiny model with scrambled weights: the lowered model's logits on MNN and PyTorch equal ONNX
Runtime's and transformers', and every weight's gradient equals transformers' own model in float64.
Gemma's norm is one RMSNorm node with its offset, on every engine path (op by op, the fused
attention, the head split)."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ir.graph import AttentionSite
from jobs.export.llm import LlmExportOptions, export_causal_lm
from planner.onnx_import import ImportError_, load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.split.engine import SplitStageEngine
from runtime.engines.stage import stage_spec
from support import (Lazy, assert_grads_close, lm_step_feeds, scrambled_causal_lm, stage_engine,
                     transformers_lm_gradients)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
B, S, VOCAB = 2, 12, 256


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    return {
        "qwen2": lambda: tf.Qwen2Config(num_key_value_heads=2, **common),
        "qwen3": lambda: tf.Qwen3Config(num_key_value_heads=2, head_dim=32, **common),
        "phi3": lambda: tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, **common),
        "gemma": lambda: tf.GemmaConfig(num_key_value_heads=2, head_dim=32, **common),
        "gptj": lambda: tf.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                      n_positions=64),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common),
        "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64),
        "bloom": lambda: tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
        "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                                          alibi=False),
    }[family]()


FAMILIES = ("qwen2", "qwen3", "phi3", "gemma", "gptj", "gpt_neox", "opt", "falcon", "bloom")


def _model(family: str):
    """The family's tiny model, every parameter seeded noise (`support.scrambled_causal_lm`)."""
    return scrambled_causal_lm(_config(family))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (the transformers model, its ONNX file, the lowered graph), made on first use."""
    root = tmp_path_factory.mktemp("families")

    def make(family):
        model = _model(family)
        path = export_causal_lm(model, root / family / "m.onnx", LlmExportOptions(), kv_cache=False)
        return model, path, load_model(path, B, S)

    return Lazy(make)


def _feeds() -> dict[str, np.ndarray]:
    return lm_step_feeds(0, B, S, 1, vocab=VOCAB)[0]



@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_onnxruntime_and_transformers(exported, family, engine):
    model, path, graph = exported[family]
    assert [b.kind for b in graph.blocks] == ["embeddings", "decoder", "decoder", "head", "loss"]
    feeds = _feeds()
    inputs = {k: feeds[k] for k in ("input_ids", "attention_mask")}
    logits = stage_engine(engine, stage_spec(graph, 0, len(graph.blocks) - 1)).forward(
        feeds, train=False, until_block=len(graph.blocks) - 2)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    with torch.no_grad():
        hf = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).logits.numpy()
    scale = float(np.abs(hf).max())
    assert float(np.abs(logits - ref).max()) <= 2e-6 * scale
    assert float(np.abs(logits - hf).max()) <= 2e-6 * scale


@pytest.mark.parametrize("engine", ["mnn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_gradient_equals_transformers_in_float64(exported, family, engine):
    model, _, graph = exported[family]
    feeds = _feeds()
    run = stage_engine(engine, stage_spec(graph, 0, len(graph.blocks) - 1))
    run.forward(feeds, 0)
    got = run.backward(0).params
    want = transformers_lm_gradients(model, feeds)
    assert set(got) == set(want)
    assert_grads_close(got, want)


def test_gemmas_norm_is_one_rmsnorm_with_its_offset_on_every_path(exported):
    """(1 + w) is the norm's offset, not an Add of its own: the attention reads a pre-norm (so the
    fused attention and the head split take it), the site carries the offset through a plan's JSON,
    and the split engine gives the unsplit engine's loss and gradients."""
    _, _, graph = exported["gemma"]
    norms = [n for n in graph.nodes if n.op == "RMSNorm"]
    assert len(norms) == 5 and {n.attrs.get("offset") for n in norms} == {1.0}
    assert not [n for n in graph.nodes if n.op == "Add" and set(n.inputs) & set(graph.params)]
    sites = [b.attention for b in graph.blocks if b.kind == "decoder"]
    assert all(s is not None and s.norm == "RMSNorm" and s.norm_offset == 1.0 for s in sites)
    assert AttentionSite.from_json(sites[0].to_json()) == sites[0]
    spec = stage_spec(graph, 0, len(graph.blocks) - 1)
    feeds = _feeds()
    ref = MnnStageEngine(spec)
    want_loss = float(np.asarray(ref.forward(feeds, 0)).reshape(-1)[0])
    want = ref.backward(0).params
    with SplitStageEngine(spec, {"mnn:cpu:t1": 1, "torch:cpu:t1": 1}) as split:
        assert len([s for s in split.segments if hasattr(s, "attention")]) == 2
        assert float(np.asarray(split.forward(feeds, 0)).reshape(-1)[0]) == pytest.approx(want_loss, rel=1e-6)
        assert_grads_close(split.backward(0).params, want, rtol=1e-5)


def test_an_activation_sliced_to_nothing_may_only_be_concatenated(exported, tmp_path):
    """Phi-3's rotary pass-through part is empty and only concatenated (so it is dropped); any other
    reader of an empty slice is named."""
    _, path, _ = exported["phi3"]
    model = onnx.load(str(path))
    made_by = {o: n.op_type for n in model.graph.node for o in n.output}
    # cat((x * cos + rotate_half(x) * sin), x[..., rotary:]): the rotated half and the empty rest
    concat = next(n for n in model.graph.node
                  if n.op_type == "Concat" and [made_by.get(i) for i in n.input] == ["Add", "Slice"])
    concat.op_type = "Add"
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    with pytest.raises(ImportError_, match=rf"node '{concat.name}' \(op Add\): reads '[^']+', which node "
                                           r"'[^']+' sliced to nothing; only a Concat may read an empty activation"):
        load_model(broken, B, S)


def test_a_sequence_past_gpt_js_position_table_says_to_shorten_it(exported):
    _, path, _ = exported["gptj"]  # 64 positions
    with pytest.raises(ImportError_, match=r"node '[^']*rotary_emb/Gather' \(op Gather\): cannot fold constant inputs "
                                           r"\(IndexError: .*\) at batch 2 x sequence 65; the model may not take "
                                           r"sequences this long \(its position table\): try a smaller --seq"):
        load_model(path, B, 65)


LORA_ROLES = {
    "qwen2": {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
              "down_proj": "down"},
    "phi3": {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "up", "down_proj": "down"},
    "gptj": {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "o", "fc_in": "up", "fc_out": "down"},
    "gpt_neox": {"query_key_value": "qkv", "dense": "o", "dense_h_to_4h": "up", "dense_4h_to_h": "down"},
}


@pytest.mark.parametrize("family", list(LORA_ROLES))
def test_lora_finds_each_projection_by_structure(exported, family):
    """Through a rotary over part of the heads (GPT-NeoX's fused QKV, GPT-J's interleaved pairs) and
    a parallel block (GPT-J: attention and MLP read one norm)."""
    from planner.lora import projection_roles

    _, _, graph = exported[family]
    roles = projection_roles(graph, graph.blocks[1])
    assert {w.rsplit(".", 2)[-2]: r for w, r in roles.items()} == LORA_ROLES[family]


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma", "gptj", "falcon", "bloom"])
def test_generation_with_the_key_value_cache_equals_transformers_greedy(family, tmp_path):
    """NAME.kv.onnx (the step graph `generate` runs) per family: two prompts of different lengths
    (left-padded together) give transformers' greedy tokens, with the cache and without. BLOOM's
    step takes no position_ids (its ALiBi biases come from the mask)."""
    from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM

    model = _model(family)
    lm = OnnxCausalLM(export_causal_lm(model, tmp_path / "m.onnx", LlmExportOptions()))
    prompts = [[5, 17, 33, 2, 9, 41], [7, 8]]
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    assert lm.generate(prompts, GenerationSettings(max_new_tokens=6)) == want
    assert lm.generate(prompts, GenerationSettings(max_new_tokens=6, kv_cache=False)) == want
