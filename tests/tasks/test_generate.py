"""Generation on ONNX Runtime (tasks/causal_lm/generate.py): greedy equals transformers' generate token for token on
tiny random models, with the key/value cache and by recomputation; seeded sampling; replacement weights
(a fine-tuned model) reach both graphs and are checked; `confidant generate` end to end."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from support import Lazy
from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 200], [17] * 12, [42]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """"gpt2", "llama" (TorchScript) and "llama-dynamo" -> (the model, its export), each made when a
    test first asks (the fast tier runs the Llama ones)."""
    root = tmp_path_factory.mktemp("generate")

    def make(key):
        if key == "llama-dynamo":
            model = random_causal_lm("llama")
            return model, export_causal_lm(model, root / "dynamo" / "m.onnx", LlmExportOptions(opset=18, dynamo=True))
        model = random_causal_lm(key)
        return model, export_causal_lm(model, root / key / "m.onnx")

    return Lazy(make)


def _hf_greedy(model, prompt, n, eos=None):
    import torch

    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
@pytest.mark.parametrize("kv", [True, False], ids=["kv-cache", "recompute"])
def test_greedy_equals_transformers_token_for_token(models, family, kv):
    model, path = models[family]
    got = OnnxCausalLM(path).generate(PROMPTS, GenerationSettings(max_new_tokens=12, kv_cache=kv))
    expected = [_hf_greedy(model, p, 12) for p in PROMPTS]
    assert got == expected
    assert len({t for row in expected for t in row}) > 12  # the random model does not repeat one token


def test_a_row_stops_at_its_end_token_and_keeps_it(models):
    model, path = models["llama"]
    free = _hf_greedy(model, PROMPTS[0], 8)
    eos = free[3]
    lm = OnnxCausalLM(path)
    for kv in (True, False):
        got = lm.generate(PROMPTS, GenerationSettings(max_new_tokens=8, kv_cache=kv), stop_ids=[eos])
        assert got[0] == free[:free.index(eos) + 1] == _hf_greedy(model, PROMPTS[0], 8, eos=eos)
        assert got[1:] == [_hf_greedy(model, p, 8, eos=eos) for p in PROMPTS[1:]]


def test_generation_past_a_learned_position_table_is_refused_up_front(models):
    """A GPT-2 (learned positions) asked past its table ended in ONNX Runtime's Gather traceback; a
    rotary model runs on past its trained length, as transformers lets it."""
    _, path = models["gpt2"]
    lm = OnnxCausalLM(path)
    limit = lm.meta["config"]["max_positions"]
    assert lm.generate([[5] * (limit - 2)], GenerationSettings(max_new_tokens=2))  # fits exactly
    with pytest.raises(ValueError, match=rf"the longest prompt has {limit - 2} tokens; with 3 new ones that is "
                                         rf"{limit + 1} positions, past the {limit} this model has \(max_positions\)"):
        lm.generate([[5], [5] * (limit - 2)], GenerationSettings(max_new_tokens=3))
    _, path = models["llama"]
    rotary = OnnxCausalLM(path)
    limit = rotary.meta["config"]["max_positions"]
    assert len(rotary.generate([[5] * limit], GenerationSettings(max_new_tokens=2))[0]) == 2


def test_sampling_is_seeded_and_top_k_one_is_greedy(models):
    _, path = models["llama"]
    lm = OnnxCausalLM(path)
    hot = GenerationSettings(max_new_tokens=10, temperature=1.5, seed=7)
    a, b = lm.generate(PROMPTS, hot), lm.generate(PROMPTS, hot)
    assert a == b
    assert a == lm.generate(PROMPTS, GenerationSettings(max_new_tokens=10, temperature=1.5, seed=7, kv_cache=False))
    assert a != lm.generate(PROMPTS, GenerationSettings(max_new_tokens=10, temperature=1.5, seed=8))
    greedy = lm.generate(PROMPTS, GenerationSettings(max_new_tokens=10))
    assert a != greedy
    assert lm.generate(PROMPTS, GenerationSettings(max_new_tokens=10, temperature=1.0, top_k=1, seed=3)) == greedy
    top3 = GenerationSettings(max_new_tokens=1, temperature=5.0, top_k=3, seed=0)
    logits = lm.logits(np.array([PROMPTS[0]]))[0, -1]
    allowed = set(np.argsort(logits)[-3:].tolist())
    picks = {lm.generate([PROMPTS[0]], GenerationSettings(**{**top3.__dict__, "seed": s}))[0][0] for s in range(30)}
    assert picks <= allowed and len(picks) > 1


def _perturbed(model, scale=0.05, seed=3):
    import copy

    import torch

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def test_replacement_weights_reach_both_graphs(models, family):
    """A 'fine-tuned' model: every weight moved. Logits and greedy tokens follow the new weights."""
    model, path = models[family]
    tuned = _perturbed(model)
    weights = {n: p.detach().numpy() for n, p in tuned.named_parameters()}
    lm = OnnxCausalLM(path, initializers=weights)
    assert lm.kv_unavailable is None
    ids = np.array([PROMPTS[0]], np.int64)
    import torch
    with torch.no_grad():
        expected = tuned(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(lm.logits(ids) - expected).max() <= 1e-4
    for kv in (True, False):
        got = lm.generate(PROMPTS, GenerationSettings(max_new_tokens=10, kv_cache=kv))
        assert got == [_hf_greedy(tuned, p, 10) for p in PROMPTS]
    assert got != OnnxCausalLM(path).generate(PROMPTS, GenerationSettings(max_new_tokens=10))


def test_replacement_weights_are_checked(models, tmp_path):
    model, path = models["llama"]
    embedding = model.get_input_embeddings().weight.detach().numpy()
    with pytest.raises(ValueError, match="no weight named 'lm_head.weight'"):
        OnnxCausalLM(path, initializers={"lm_head.weight": embedding})  # the tied head's name is the embedding's
    with pytest.raises(ValueError, match=r"shape \[256, 32\], the model's is \[256, 64\]"):
        OnnxCausalLM(path, initializers={"model.embed_tokens.weight": embedding[:, :32]})
    with pytest.raises(ValueError, match="expected floats"):
        OnnxCausalLM(path, initializers={"model.embed_tokens.weight": embedding.astype(np.int64)})
    lonely = tmp_path / "m.onnx"
    lonely.write_bytes(path.read_bytes())  # no m.lm.json beside it
    with pytest.raises(ValueError, match="cannot be checked"):
        OnnxCausalLM(lonely, initializers={"model.embed_tokens.weight": embedding})
    # float64 arrays are accepted, as float32
    lm = OnnxCausalLM(path, initializers={"model.embed_tokens.weight": embedding.astype(np.float64)})
    np.testing.assert_allclose(lm.logits(np.array([[1, 2]])), OnnxCausalLM(path).logits(np.array([[1, 2]])),
                               atol=1e-6)


@pytest.mark.slow  # a dynamo export
def test_a_dynamo_export_with_replacement_weights_recomputes(models):
    """The dynamo graph's weights have the exporter's names (pre-transposed `val_N`), the cache graph the
    state dict's: replacement weights go to the training graph only, and generation recomputes."""
    import copy

    import torch

    model, path = models["llama-dynamo"]
    meta = json.loads(path.with_suffix(".lm.json").read_text())
    name = next(n for n in meta["weights"] if n.startswith("model.layers.0") and "norm" in n)
    value = dict(_perturbed(model, scale=0.5).named_parameters())[name].detach().numpy()
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        dict(tuned.named_parameters())[name].copy_(torch.from_numpy(value))
    lm = OnnxCausalLM(path, initializers={name: value})
    assert lm.kv_unavailable and "dynamo" in lm.kv_unavailable
    got = lm.generate(PROMPTS, GenerationSettings(max_new_tokens=8))
    assert got == [_hf_greedy(tuned, p, 8) for p in PROMPTS]
    assert got != [_hf_greedy(model, p, 8) for p in PROMPTS]
    assert OnnxCausalLM(path).kv_unavailable is None  # its own weights: the cache graph is used


def _word_tokenizer_beside(path, words):
    """A word-level tokenizer.json and a ChatML-like chat_template.json beside an exported model."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, decoders

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(path.parent / "tokenizer.json"))
    pieces = {"default_system": "", "prefix": {r: f"<|im_start|> {r} " for r in ("system", "user", "assistant")},
              "suffix": {r: " <|im_end|> " for r in ("system", "user", "assistant")},
              "generation_prompt": "<|im_start|> assistant "}
    chat = {"format": "confidant-chat-template", "version": 1, "template": None, "pieces": pieces,
            "bos_token": None, "bos_token_id": None, "adds_bos": False, "eos_token": "<|im_end|>",
            "eos_token_id": vocab["<|im_end|>"], "pad_token": None, "pad_token_id": None}
    (path.parent / "chat_template.json").write_text(json.dumps(chat))
    return vocab


def test_the_generate_command(models, capsys):
    from confidant.cli import main
    from tasks.causal_lm.tokenizer import load_lm_tokenizer

    model, path = models["llama"]
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"] + [f"w{i}" for i in range(250)]
    vocab = _word_tokenizer_beside(path, words)
    tok = load_lm_tokenizer(path)
    prompt_ids = tok.prompt_ids("w1 w2 w3")
    assert prompt_ids == [vocab[w] for w in "<|im_start|> user w1 w2 w3 <|im_end|> <|im_start|> assistant".split()]
    expected = _hf_greedy(model, prompt_ids, 6, eos=vocab["<|im_end|>"])
    assert main(["generate", str(path), "--prompt", "w1 w2 w3", "--max-new-tokens", "6"]) == 0
    text = capsys.readouterr().out.strip()
    assert text == tok.decode(expected) and text.split() == [words[i] for i in expected if i > 2]
    raw_ids = tok.prompt_ids("w1 w2 w3", raw=True)
    assert main(["generate", str(path), "--prompt", "w1 w2 w3", "--raw", "--max-new-tokens", "4",
                 "--no-kv-cache"]) == 0
    assert capsys.readouterr().out.strip() == tok.decode(_hf_greedy(model, raw_ids, 4, eos=vocab["<|im_end|>"]))
    assert main(["generate", str(path), "--prompt", "w1", "--temperature", "-1"]) == 2  # a bad flag value: exit 2



def test_damaged_side_files_and_settings_are_named(models, tmp_path):
    """A corrupt tokenizer.json was a traceback, a broken chat_template.json a JSON error naming no
    file, a missing model 'no tokenizer.json beside', a NaN temperature numpy's 'Probabilities
    contain NaN', a negative --max-new-tokens the settings' repr."""
    import json
    import math
    import shutil

    from ir.errors import InputFileError
    from jobs.common.errors import JobError
    from jobs.generation import generate
    from support import find_tokenizer_json
    from tasks.causal_lm.tokenizer import load_lm_tokenizer

    with pytest.raises(ValueError, match=r"^the temperature must be a finite number >= 0 \(0: greedy\), not nan$"):
        GenerationSettings(temperature=math.nan)
    with pytest.raises(ValueError, match=r"^the max new tokens must be a whole number >= 0, not -1$"):
        GenerationSettings(max_new_tokens=-1)
    with pytest.raises(FileNotFoundError, match=r"missing.onnx: no such ONNX file$"):
        generate(tmp_path / "missing.onnx", ["hi"])
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(InputFileError, match=r"tokenizer.json: not a readable tokenizer.json \("):
        load_lm_tokenizer(folder)
    shutil.copy(find_tokenizer_json(), folder / "tokenizer.json")  # a good one; the template is broken
    (folder / "chat_template.json").write_text("{'format': 1}")
    with pytest.raises(InputFileError, match=r"chat_template.json: not valid JSON \(.*\); re-export the model"):
        load_lm_tokenizer(folder)
    (folder / "chat_template.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match=r"chat_template.json is a JSON list, not an object; re-export the model"):
        load_lm_tokenizer(folder)
