"""Text generation and logits of an exported causal LM on ONNX Runtime (the project's one use of it).

The runtime's engines run graphs lowered at one batch and sequence length; generation needs every
length, so it runs the exported ONNX files themselves (jobs/export/llm.py), with their dynamic shapes:
- with a key/value cache (`NAME.kv.onnx`, the default when it is there): the prompts, left-padded
  after one masked dummy position (the cache graph's past is never empty), run once; then one token per
  step, each step feeding the previous step's `present.*` as `past.*`. Positions count the real tokens
  only, so a left-padded row sees the positions an unpadded one would.
- by recomputation (`NAME.onnx`, the training graph, any causal LM with inputs input_ids and
  attention_mask): every step runs the whole right-padded sequence again and reads each row's logits
  at its last token. Slower (quadratic in the length), needs nothing but the one file.

Trained weights: `initializers` maps initializer names of `NAME.onnx` (the names the importer's
parameters have) to arrays that replace the file's, via ONNX Runtime's add_initializer, so a fine-tuned
model generates without writing a new file. Names and shapes are checked against `NAME.lm.json` (ONNX
Runtime itself ignores an unknown name silently); with replacement weights ONNX Runtime's constant folding
is off, since it would fold the file's weights (a Transpose of the old W) into the graph. The cache graph takes them too when its weights have
the same names (a TorchScript export); otherwise (a dynamo export) generation recomputes.

Decoding: greedy (temperature 0: the first highest logit, as torch.argmax picks), or sampling at a
temperature from the top k logits (k = 0: all), from a numpy generator seeded by `seed`. A row stops
at an end-of-sequence id (kept in its output, as transformers' generate keeps it) or after
`max_new_tokens`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ir.mapped_pages import drop_pages_under
from ir.versioned import check_header
from runtime.engines import fpmode
from runtime.heap import release_free_heap

if TYPE_CHECKING:
    from tasks.causal_lm.tokenizer import LmTokenizer, Message

__all__ = ["GenerationSettings", "OnnxCausalLM", "generate_text", "lm_metadata"]


# model families (transformers' model_type) whose positions are rows of a learned table: no position
# past max_positions exists
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "xglm"})


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut; sampling only
    seed: int = 0
    kv_cache: bool = True  # use NAME.kv.onnx when it is there and can take the weights

    def __post_init__(self) -> None:
        for name, value in (("max new tokens", self.max_new_tokens), ("top-k", self.top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"the {name} must be a whole number >= 0, not {value!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"the temperature must be a finite number >= 0 (0: greedy), not {self.temperature!r}")


def lm_metadata(model_path: Path) -> dict | None:
    """NAME.lm.json beside NAME.onnx, or None for a file exported elsewhere."""
    path = Path(model_path).with_suffix(".lm.json")
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    check_header(d, format="confidant-causal-lm", versions=None, where=str(path),
                 redo="re-export the model (`confidant export --task causal-lm`)")
    return d


def _check_initializers(initializers: Mapping[str, np.ndarray], meta: dict | None, model: Path,
                        weight_shapes: Mapping[str, Sequence[int]] | None = None) -> dict:
    if meta is not None:
        known = meta["weights"]
    elif weight_shapes is not None:
        known = weight_shapes
    else:
        raise ValueError(f"{model} has no {model.with_suffix('.lm.json').name}, so replacement weights cannot be "
                         "checked (ONNX Runtime ignores unknown names): export it with `confidant export --task "
                         "causal-lm`")
    out = {}
    # a stored weight's pieces a session reads in place (`jobs.common.onnx_lm.held_quantized_copy`): its codes,
    # scales and offsets as they are stored, checked against what the copy declares, never widened here
    in_place = (meta or {}).get("pieces_in_place") or {}
    for name, array in initializers.items():
        if name in in_place:
            shape, dtype = in_place[name]
            if list(array.shape) != list(shape) or np.dtype(array.dtype).str != dtype:
                raise ValueError(f"piece {name!r}: {array.dtype} {list(array.shape)}, the copy declares {dtype} "
                                 f"{shape}")
            out[name] = array
            continue
        if name not in known:
            close = sorted(known)[:3]
            raise ValueError(f"{model}: no weight named {name!r} (its weights are named like {close})")
        a = np.asarray(array)
        if a.dtype.kind != "f":
            raise ValueError(f"weight {name!r}: expected floats, got {a.dtype}")
        if list(a.shape) != list(known[name]):
            raise ValueError(f"weight {name!r}: shape {list(a.shape)}, the model's is {known[name]}")
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def _session(path: Path, initializers: Mapping[str, np.ndarray], threads: int | None, optimize: bool,
             stored_quantized: bool = False, source: bytes | None = None, prepack: bool = True,
             pieces_in_place: bool = False):
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if not prepack:
        # ONNX Runtime pre-packs every MatMul weight into its GEMM layout, a second copy of the
        # weights beside the session's own (SmolLM2's cache graph: 817 MiB resident against 592)
        options.add_session_config_entry("session.disable_prepacking", "1")
        # and no arena: its blocks outlive the widened weights of a stored-quantized file (SmolLM2 int4's
        # generation: 832 -> 741 MiB whole process, helper h78)
        options.enable_cpu_mem_arena = False
        # and no memory pattern: a session keeps one per shape of its inputs, and a generation's shapes grow
        # a position each step (SmolLM2 float32 in 19 parts, 32 new tokens: 218 -> 183 MiB anon; helper h170)
        options.enable_mem_pattern = False
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    elif pieces_in_place:
        # a stored weight's pieces given in place (the file holds zeros there): the layout level's passes read
        # the file's values, not the given ones (a tiny int4 Llama generated one token over and over; the
        # extended level and below generate the file's own answers, helper h175)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    keep = []  # the OrtValues must outlive the session
    for name, array in initializers.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        keep.append(value)
        options.add_initializer(name, value)
    # Constant folding (and the transpose optimizer's folding into initializers) reads the file's
    # weights, not the added ones: a folded Transpose(W) would keep the old W. Checked by moving every
    # weight in tests/tasks/test_generate.py.
    # A file whose weights are stored quantized (`export --base-dtype`) widens each weight with a few
    # ops over its stored arrays: folded at load, every intermediate of every weight was held at once
    # (SmolLM2 int4: 4.9 GB against 1.2 for the float file); left to run, each weight is widened when
    # a product needs it and dropped after, so the session holds the small arrays.
    disabled = ["ConstantFolding", "TransposeOptimizer"] if initializers or stored_quantized else []
    flushed = fpmode.denormals_flushed()
    session = ort.InferenceSession(str(path) if source is None else source, options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=disabled)
    if flushed:
        # creating a session clears this thread's flush-to-zero bits (MXCSR), and an MNN engine in the
        # same process (train-local scores with ONNX Runtime between its steps) computes on this thread
        # too: its backward ran 2.7x slower on denormals afterwards
        fpmode.enable_flush_denormals()
    return session, keep


class _PartsInOrder:
    """The cache graph as the sessions of its parts (`NAME.lm.json`'s `kv_parts`: [file, the initializers
    it reads] each, by `planner.onnx_quantize.write_layer_ranges`: the embedding, layer ranges, the head), run one after
    another over one dict of values, as one session's `get_inputs` and `run`. After each part's run the
    pages of the weights it read that lie in a read-only file mapping (a mapped float32 base shared in
    place) are given back, from this thread, before the next part reads its own: what a step holds of
    the base is one part's weights, whatever the load on the machine (a thread giving pages back on a
    timer was starved for 759 ms at load 9-12 and the generation rose to 862 MiB; helper h163)."""

    def __init__(self, sessions, weights: Sequence[Sequence[str]], initializers: Mapping[str, np.ndarray],
                 rows: Sequence[tuple[int, str] | None] = ()):
        self.parts = []
        made: set[str] = set()
        self.inputs = []
        # a part run by rows (`kv_parts`' third and fourth fields, (rows, input)): its table (its one weight)
        # fed a range of so many rows at a time as that input, the products' columns joined: the head's product over the tied
        # table (SmolLM2 113 MB, Qwen2.5-0.5B 545 MB) read a range at a time, each range's pages given back
        # after its run, as training's fused head reads it by vocabulary chunk (helper h170)
        self.rows = list(rows) + [None] * (len(weights) - len(rows))
        for (session, keep), names, by in zip(sessions, weights, self.rows):
            feed = by[1] if by else None
            taken = [i.name for i in session.get_inputs() if i.name != feed]
            self.inputs += [i for i in session.get_inputs() if i.name not in made and i.name != feed
                            and i.name not in {j.name for j in self.inputs}]
            outputs = [o.name for o in session.get_outputs()]
            made.update(outputs)
            read = [initializers[k] for k in names if k in initializers]
            self.parts.append((session, keep, taken, outputs, read))

    def get_inputs(self):
        return list(self.inputs)

    def run(self, output_names, feeds):
        values = dict(feeds)
        for (session, _, taken, outputs, read), by in zip(self.parts, self.rows):
            given = {k: values[k] for k in taken}
            if not by:
                values.update(zip(outputs, session.run(outputs, given)))
                drop_pages_under(read)
            else:
                (table,), (out,), (step, feed), products = read, outputs, by, []
                for lo in range(0, len(table), step):
                    block = table[lo:lo + step]  # a view: the rows' bytes on the mapping, no copy
                    products.append(session.run(outputs, {**given, feed: block})[0])
                    drop_pages_under([block])
                values[out] = np.concatenate(products, axis=-1)
            # and the heap its run freed: kept, it stood under the next part's run (SmolLM2 int4 file, the stored
            # pieces in place: the first layers' part left ~100 MiB of free heap, generation's peak 524 -> 472
            # MiB; helper h175)
            release_free_heap()
        return [values[k] for k in output_names]


class OnnxCausalLM:
    """An exported causal LM on ONNX Runtime: `logits` for evaluation, `generate` for text.

    `initializers`: replacement weights by `NAME.onnx` initializer name (module docstring); `optimize`
    False runs ONNX Runtime without graph optimisations (its fused kernels round differently, which
    matters only for comparisons at float32's last digits). `weight_shapes` (initializer name ->
    shape, read from the file by the caller) checks replacement weights of a file exported elsewhere,
    which has no `NAME.lm.json`. `prepack` False: ONNX Runtime keeps no pre-packed copy of the
    MatMul weights (less memory; a coordinator's evaluation after training asks for it)."""

    def __init__(self, model_path: str | Path, initializers: Mapping[str, np.ndarray] | None = None,
                 threads: int | None = None, optimize: bool = True,
                 weight_shapes: Mapping[str, Sequence[int]] | None = None,
                 sources: Mapping[Path, bytes] | None = None, prepack: bool = True):
        self.path = Path(model_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such ONNX file")
        self.meta = lm_metadata(self.path)
        self.initializers = (_check_initializers(initializers, self.meta, self.path, weight_shapes)
                             if initializers else {})
        self.threads, self.optimize, self.prepack = threads, optimize, prepack
        self.stored_quantized = (self.meta or {}).get("base_dtype", "float32") != "float32"
        self.pieces_in_place = bool(set((self.meta or {}).get("pieces_in_place") or ()) & set(self.initializers))
        # the files as bytes to run instead (path -> bytes): a stored-quantized file with trained weights
        # as plain initializers (planner.onnx_quantize.with_float_weights, made by jobs.common.onnx_lm)
        self.sources = {Path(k): v for k, v in (sources or {}).items()}
        stored = set((self.meta or {}).get("stored_quantized") or ()) & set(self.initializers)
        if stored and self.path not in self.sources:
            raise ValueError(f"{self.path}: weight {sorted(stored)[0]!r} is stored {self.meta['base_dtype']} "
                             "(exported with --base-dtype) and computed from its stored arrays, so it cannot be "
                             "replaced as an initializer: give the files with it as one (`sources`)")
        self._full = None
        self._step = None
        kv = self.meta.get("kv_model") if self.meta else None
        self.kv_path = self.path.parent / kv if kv and (self.path.parent / kv).is_file() else None
        if self.kv_path is None:
            self.kv_unavailable = "no key/value-cache graph beside the model"
        elif self.initializers and not self.meta.get("kv_same_weight_names"):
            self.kv_unavailable = "replacement weights are named for the training graph only (a dynamo export)"
        else:
            self.kv_unavailable = None

    def _full_session(self):
        if self._full is None:
            self._full = _session(self.path, self.initializers, self.threads, self.optimize, self.stored_quantized,
                                  self.sources.get(self.path), self.prepack, self.pieces_in_place)
        return self._full[0]

    def _step_session(self):
        if self._step is None:
            parts = (self.meta or {}).get("kv_parts")
            if parts and self.kv_path not in self.sources:
                # every part is given every replacement weight: ONNX Runtime ignores a name its graph lacks
                sessions = [_session(self.kv_path.parent / part[0], self.initializers, self.threads, self.optimize,
                                     self.stored_quantized, None, self.prepack, self.pieces_in_place) for part in parts]
                self._step = (_PartsInOrder(sessions, [part[1] for part in parts], self.initializers,
                                            [tuple(part[2:]) if len(part) > 2 else None for part in parts]), None)
            else:
                self._step = _session(self.kv_path, self.initializers, self.threads, self.optimize,
                                      self.stored_quantized, self.sources.get(self.kv_path), self.prepack,
                                      self.pieces_in_place)
        return self._step[0]

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """float32 [B, S, V] logits of the training graph (right padding)."""
        input_ids = np.asarray(input_ids, np.int64)
        mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, np.int64)
        session = self._full_session()
        # what the file declares: a file exported elsewhere may take position_ids (right padding:
        # 0..S-1 on every row, transformers' default) or no mask, and int32 ids
        positions = np.broadcast_to(np.arange(input_ids.shape[1], dtype=np.int64), input_ids.shape)
        offered = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
        feeds = {i.name: offered[i.name].astype(np.int32 if i.type == "tensor(int32)" else np.int64)
                 for i in session.get_inputs() if i.name in offered}
        return session.run(["logits"], feeds)[0]

    # --- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings = GenerationSettings(),
                 stop_ids: Sequence[int] = ()) -> list[list[int]]:
        """The generated ids of each prompt (not the prompt), each ending at its first stop id (kept)
        or after settings.max_new_tokens."""
        prompts = [[int(t) for t in p] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("an empty prompt: give at least one token (a bos token, for a raw start)")
        if not prompts or settings.max_new_tokens == 0:
            return [[] for _ in prompts]
        config = (self.meta or {}).get("config") or {}
        # only a learned position table ends there (GPT-2's): rotary and ALiBi models run on past their
        # trained length, as transformers lets them
        limit = int(config.get("max_positions") or 0) if config.get("family") in LEARNED_POSITIONS else 0
        longest = max(len(p) for p in prompts)
        if limit and longest + settings.max_new_tokens > limit:
            raise ValueError(f"the longest prompt has {longest} tokens; with {settings.max_new_tokens} new ones that is "
                             f"{longest + settings.max_new_tokens} positions, past the {limit} this model has "
                             "(max_positions): shorten the prompt or ask for fewer new tokens (--max-new-tokens)")
        rng = np.random.default_rng(settings.seed)
        stop = {int(s) for s in stop_ids}
        use_kv = settings.kv_cache and self.kv_unavailable is None
        run = self._generate_cached if use_kv else self._generate_recomputed
        return run(prompts, settings, stop, rng)

    def _pick(self, last_logits: np.ndarray, settings: GenerationSettings, rng) -> np.ndarray:
        """One next token per row of [n, V] logits."""
        if settings.temperature == 0:
            return last_logits.argmax(axis=-1)
        scaled = last_logits.astype(np.float64) / settings.temperature
        if settings.top_k and settings.top_k < scaled.shape[-1]:
            kth = np.partition(scaled, -settings.top_k, axis=-1)[:, -settings.top_k][:, None]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        p = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return np.array([rng.choice(p.shape[-1], p=row) for row in p])

    def _generate_recomputed(self, prompts, settings, stop, rng) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(settings.max_new_tokens):
            rows = [prompts[i] + out[i] for i in active]
            lengths = np.array([len(r) for r in rows])
            ids = np.zeros((len(rows), lengths.max()), np.int64)
            mask = np.zeros_like(ids)
            for k, r in enumerate(rows):
                ids[k, :len(r)] = r
                mask[k, :len(r)] = 1
            logits = self.logits(ids, mask)
            picked = self._pick(logits[np.arange(len(rows)), lengths - 1], settings, rng)
            for i, token in zip(active, picked):
                out[i].append(int(token))
            active = [i for i in active if out[i][-1] not in stop]
            if not active:
                break
        return out

    def _generate_cached(self, prompts, settings, stop, rng) -> list[list[int]]:
        session = self._step_session()
        declared = {i.name for i in session.get_inputs()}  # BLOOM's step takes no position_ids (ALiBi)
        past_names = [i.name for i in session.get_inputs() if i.name.startswith("past.")]
        present_names = [n.replace("past.", "present.") for n in past_names]
        cfg = self.meta["config"]
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        ids = np.zeros((n, longest), np.int64)
        mask = np.zeros((n, 1 + longest), np.int64)  # column 0: the dummy past position
        for k, p in enumerate(prompts):
            ids[k, longest - len(p):] = p
            mask[k, 1 + longest - len(p):] = 1
        positions = np.maximum(np.cumsum(mask[:, 1:], axis=1) - 1, 0)
        past = {name: np.zeros((n, cfg["kv_heads"], 1, cfg["head_size"]), np.float32) for name in past_names}
        out: list[list[int]] = [[] for _ in prompts]
        active = np.arange(n)
        next_position = positions[:, -1] + 1
        for _ in range(settings.max_new_tokens):
            feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
            results = session.run(["logits", *present_names], {k: v for k, v in feeds.items() if k in declared})
            picked = self._pick(results[0][:, -1], settings, rng)
            for i, token in zip(active, picked):
                out[i].append(int(token))
            keep = np.array([out[i][-1] not in stop for i in active])
            if not keep.any():
                break
            # finished rows leave the batch, cache included
            active, picked, next_position = active[keep], picked[keep], next_position[keep]
            past = {p: r[keep] for p, r in zip(past_names, results[1:])}
            mask = np.concatenate([mask[keep], np.ones((len(active), 1), np.int64)], axis=1)
            ids = picked.astype(np.int64)[:, None]
            positions = next_position[:, None].astype(np.int64)
            next_position = next_position + 1
        return out


def generate_text(model: OnnxCausalLM, tokenizer: "LmTokenizer", prompts: Sequence[str | Sequence["Message"]],
                  settings: GenerationSettings = GenerationSettings(), raw: bool = False) -> list[str]:
    """Answers to prompts: each a text (the chat template applied with a generation prompt, unless
    `raw` or the model has no template) or a list of messages. Decoded without special tokens."""
    ids = [tokenizer.prompt_ids(p, raw=raw) for p in prompts]
    stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    return [tokenizer.decode(g) for g in model.generate(ids, settings, stop)]
