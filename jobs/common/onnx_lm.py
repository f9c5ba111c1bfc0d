"""An exported causal LM run on ONNX Runtime over its files (tasks/causal_lm/generate.py), as the jobs
that use one open it: `confidant generate` (jobs.generation) and training's before/after scores
(jobs.train.causal_lm). `initializers` (initializer name -> array) replaces the file's weights, which is
how a fine-tuned model is tried before and after training without writing a new file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from ir.mapped_pages import PagesGivenBackWhile, read_only_mappings
from jobs.common.errors import JobError
from planner.cost import LOSS_CHUNK_BYTES
from tasks.causal_lm.data import read_instructions
from tasks.causal_lm.evaluation import InstructionScores, evaluate_instructions
from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM, lm_metadata
from tasks.causal_lm.tokenizer import load_lm_tokenizer

__all__ = ["HEAD_BYTES", "RANGE_BYTES", "evaluate_lm", "held_quantized_copy", "open_lm", "stored_replaced"]

# the weights one part of the cache graph reads when generation runs it a block range at a time over a
# mapped float32 base (`planner.onnx_quantize.write_layer_ranges`); None: as many layers as the largest
# weight outside them, the head's tied table that its own part reads whole. Each ONNX Runtime session adds
# its own heap: SmolLM2 one layer a part (32 sessions) read 634 MiB whole life, 4 layers (10) 568, the
# table's 113 MB of layers (8 layers, 6 sessions) see MEMORY_NOTES (helper h163)
RANGE_BYTES: int | None = None
# the rows of the head's tied table one run of its part reads (`write_layer_ranges`' `head_bytes`): as
# training's fused head reads it on PyTorch (one vocabulary chunk, `LOSS_CHUNK_BYTES`), so a generation after
# training holds no more of the table than the training did (helper h170); None: the table read whole
HEAD_BYTES: int | None = LOSS_CHUNK_BYTES


def stored_replaced(model: Path, initializers) -> dict[Path, bytes] | None:
    """For a file `export --base-dtype` stored quantized whose stored weights are replaced (trained):
    it and its cache graph as bytes with those weights as plain initializers (ONNX Runtime cannot
    replace a weight that ops compute)."""
    meta = lm_metadata(model) or {}
    if not initializers or not set(meta.get("stored_quantized") or ()) & set(initializers):
        return None
    from planner.onnx_quantize import with_float_weights

    files = [model] + ([model.parent / meta["kv_model"]] if meta.get("kv_model") else [])
    return {f: with_float_weights(f, initializers) for f in files if f.is_file()}


def held_quantized_copy(model: Path, held: Mapping[str, object], initializers: Mapping[str, np.ndarray] | None,
                        folder: Path, branches: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                        shared: dict[str, np.ndarray] | None = None,
                        pieces: dict[str, np.ndarray] | None = None) -> Path:
    """A copy in `folder` of the export at `model` (float32, or stored quantized by `export --base-dtype`:
    its stored weights read as `held`'s) that ONNX Runtime runs with the weights a
    quantized-base engine holds (`held`: its graph's constants): each `ir.precision.QuantizedTensor` of
    `held` stored quantized as `confidant export --base-dtype` stores it (widening ops over the stored
    arrays, run as a product needs them), each of `initializers` (trained, adapters merged) a float32
    initializer, the file's other weights (norms) as they are. Only the graph generation runs is written
    (the cache graph when it takes the weights, else the training graph), streamed one weight at a time
    from a mapping of the file; the other files beside `model` (tokenizer, template) are linked. The
    float32 file's session held its 514 MB twice (SmolLM2: 1.1 GB of a train-local's 1.4 GB peak);
    this one holds the quantized base (MEMORY_NOTES, helper h78). The weights read transposed by products
    and the tied table are read by rows (`planner.onnx_quantize.read_by_rows`: no float32 table widened
    whole, no transposed copies), and the cache graph gives its last position's logits only, all that
    generation reads (`last_position_only`): SmolLM2 int4's generation 708 -> 481 MiB (helper h84). `branches`: trained LoRA adapters by
    base weight name, (A [in, r], B [r, out] x scale), computed beside the base kept quantized
    (`planner.onnx_quantize.read_by_rows`), not merged into a float32 weight (helper h84); a base the
    copy cannot run so is merged here. `shared` (a dict, filled here): a float32 base (`held`'s plain
    float32 arrays, a float32 LoRA run's graph) is read by rows too (products a Gemm over the weight as it
    is, no transposed copies; the last logits only; adapters beside it) and its arrays are given in
    `shared` for the session to read in place (`open_lm`'s initializers: ONNX Runtime shares them, no
    second copy); the copy's file then stores them only as zeros of a sparse file, never read, and its cache
    graph is written again as parts over layer ranges (`kv_parts` in its NAME.lm.json; `RANGE_BYTES`). The float32
    file's session held its weights twice and their transposed copies (SmolLM2 float32's generation 1742 MiB
    against training's 888; helper h101). `pieces` (a dict, filled here): the stored pieces of `held`'s
    QuantizedTensors the copy reads by rows, given there for the session to read in place (the copy's
    NAME.lm.json names them, `pieces_in_place`), its cache graph in parts as for `shared` (helper h175).
    Returns the copy's NAME.onnx."""
    import json

    from ir.precision import QuantizedTensor, base_dtype_of, stored_arrays
    from planner.onnx_import import read_onnx_apart
    from planner.onnx_quantize import (BASE_DTYPE_KEY, WEIGHTS_KEY, Unwritten, last_position_only, read_by_rows,
                                       widen_stored_weights, write_layer_ranges, write_with_weights)
    from planner.onnx_weights import drop_mapped_pages

    model, folder = Path(model), Path(folder)
    meta = dict(lm_metadata(model) or {})
    kv = model.parent / meta["kv_model"] if meta.get("kv_model") else None
    runs = kv if kv is not None and kv.is_file() and meta.get("kv_same_weight_names") else model
    if runs is model:
        meta["kv_model"] = None
    proto, arrays = read_onnx_apart(runs, mapped=True)
    # a file `export --base-dtype` stored quantized: each stored weight one stub initializer over its pieces on
    # the mapping (its widening ops gone), as a float32 file's weight is, so `held`'s quantized weights and the
    # adapters beside them are written as for a float32 file. Its trained weights merged into float32
    # initializers instead (`stored_replaced`) made SmolLM2 int4's generation 1.5 GiB against training's 555 MiB
    # (helper h169)
    widen_stored_weights(proto, arrays)
    for prop in [p for p in proto.metadata_props if p.key in (BASE_DTYPE_KEY, WEIGHTS_KEY)]:
        proto.metadata_props.remove(prop)  # written again for the weights the copy stores quantized
    initializers = initializers or {}
    weights = {}
    for t in proto.graph.initializer:
        value = held.get(t.name)
        plain = (shared is not None and isinstance(value, np.ndarray) and value.dtype == np.float32
                 and t.name in arrays)
        weights[t.name] = (initializers[t.name] if t.name in initializers
                           else value if (isinstance(value, QuantizedTensor) or plain)
                           and tuple(value.shape) == tuple(t.dims)
                       else arrays[t.name])
    del proto.graph.initializer[:]
    base_dtype = base_dtype_of(dict(held))
    # the weights read by rows (`read_by_rows`): a lookup widens only the rows it looks up, a product
    # x @ W^T (the tied LM head a block of rows at a time) is a Gemm over W widened, never transposed
    if runs is not model:  # generation reads each step's last position only (`last_position_only`)
        last_position_only(proto.graph)
    branches = dict(branches or {})
    tables = read_by_rows(proto.graph, {k: v for k, v in weights.items() if isinstance(v, QuantizedTensor)
                                        or (shared is not None and v is held.get(k))}, branches=branches)
    for name, parts in tables.items():
        del weights[name]
        weights.update(parts)
    for name in set(branches) - set(tables):  # read some other way: merged, as a float32 initializer
        a, b = branches.pop(name)
        weights[name] = (np.asarray(held[name], np.float64) + (a.astype(np.float64) @ b).T).astype(np.float32)
    if shared is not None:  # the float32 base's arrays read in place by the session, not from the copy's file
        shared.update({k: v for k, v in weights.items() if isinstance(v, np.ndarray) and v is held.get(k)})
        tables = {k: v for k, v in tables.items() if k not in shared}
        weights.update({k: Unwritten(v.shape, v.dtype) for k, v in shared.items()})
    if pieces is not None:
        # a quantized base's stored pieces (codes, scales, offsets) as `held` holds them, read in place: written
        # into the copy, ONNX Runtime read them into a heap of its own beside `held`'s (SmolLM2 int4 file, torch
        # per block: the cache graph's session 155 MiB; its generation 80-110 MiB above training's peak; h175)
        pieces.update({k: v for name, parts in tables.items() if isinstance(held.get(name), QuantizedTensor)
                       for k, v in parts if any(v is a for a in stored_arrays(held[name])) and v.flags.c_contiguous})
        meta["pieces_in_place"] = {k: [list(v.shape), v.dtype.str] for k, v in pieces.items()}
        weights.update({k: Unwritten(v.shape, v.dtype) for k, v in pieces.items()})
    done = write_with_weights(proto, weights, folder / runs.name, base_dtype) + sorted(tables)
    drop_mapped_pages([a for v in arrays.values() for a in stored_arrays(v)])
    # the held base's pieces the writer read, where they lie on a mapping (a stored-quantized file read mapped,
    # torch per block): left resident they stood beside the session (SmolLM2 int4: 174 MiB of file pages)
    drop_mapped_pages([a for v in held.values() if isinstance(v, QuantizedTensor) for a in stored_arrays(v)])
    del proto, arrays, weights
    if (shared or pieces) and runs is not model:  # the cache graph a block range at a time (`OnnxCausalLM`'s parts)
        meta["kv_parts"] = write_layer_ranges(folder / runs.name, RANGE_BYTES, HEAD_BYTES)
    for other in model.parent.iterdir():
        if not (folder / other.name).exists() and other.name != runs.name:
            (folder / other.name).symlink_to(other.resolve())
    meta.update(base_dtype=base_dtype, stored_quantized=sorted(done))
    (folder / model.with_suffix(".lm.json").name).unlink()
    (folder / model.with_suffix(".lm.json").name).write_text(json.dumps(meta))
    return folder / model.name


def open_lm(model: Path, initializers, threads, prepack: bool = True):
    """The exported LM at `model` on ONNX Runtime (its weights replaced by `initializers`) and its tokenizer."""
    if not model.is_file():
        raise FileNotFoundError(f"{model}: no such ONNX file")
    try:
        tokenizer = load_lm_tokenizer(model)
    except FileNotFoundError as exc:
        raise JobError(str(exc)) from None
    try:
        shapes = None
        if initializers and model.is_file() and lm_metadata(model) is None:
            # a file exported elsewhere: replacement weights are checked against its own initializers
            from planner.onnx_import import initializer_shapes

            shapes = initializer_shapes(model)
        lm = OnnxCausalLM(model, initializers, threads, weight_shapes=shapes,
                          sources=stored_replaced(model, initializers), prepack=prepack)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return lm, tokenizer


def evaluate_lm(model: Path, data: Path, settings: GenerationSettings = GenerationSettings(max_new_tokens=48),
                batch: int = 8, limit: int | None = None, threads: int | None = None,
                initializers: Mapping[str, np.ndarray] | None = None, perplexity: bool = True,
                prepack: bool = True, held: Mapping[str, object] | None = None,
                branches: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                float_base: bool = False) -> InstructionScores:
    """Perplexity and exact match (and the entity task's scores) on a JSONL instruction file, the first
    `limit` conversations of it. The default 48 new tokens fit every entities-json answer (at most 37
    SmolLM2 tokens with its end token); a base model that rambles is cut there. `perplexity` False:
    the answers generated and scored only (`InstructionScores.perplexity` None), so ONNX Runtime holds
    one session (the cache graph's), never the whole-sequence graph's beside it; `prepack` False: no
    pre-packed copy of the weights (`OnnxCausalLM`). `held`: a quantized-base engine's constants, run as
    it holds them (`held_quantized_copy`: a float32 file's base replaced by `held`'s quantized weights,
    `initializers` written in, and `branches`: LoRA adapters beside their base), not over the float32 file;
    `float_base`: `held`'s float32 arrays too, read in place (`held_quantized_copy`'s `shared`); where they
    lie in a read-only mapping of the file (train-local's mapped base), one run of one session over the
    cache graph read the whole base, which stayed resident (SmolLM2 LoRA float32, torch per block:
    train-local's whole life 991 MiB; helper h159): the cache graph is run as sessions over layer ranges
    (`planner.onnx_quantize.write_layer_ranges`), each part's pages given back after its run, so a step holds
    one part's weights whatever the machine's load (550-557 MiB, its generation at training's level; a timer
    giving the pages back every 5 ms, h159's, was starved at load 9-12 and rose to 783-862; helper h163). A
    graph that cannot be cut so has its pages given back on that timer (`PagesGivenBackWhile`)."""
    conversations = read_instructions(data)[:limit]
    if not conversations:
        raise JobError(f"{data}: no conversations")
    if held is None:
        lm, tokenizer = open_lm(Path(model), initializers, threads, prepack)
        return evaluate_instructions(lm, tokenizer, conversations, settings, batch, perplexity)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="confidant-eval-") as folder:
        shared, pieces = ({} if float_base else None), {}
        copy = held_quantized_copy(Path(model), held, initializers, Path(folder), branches, shared, pieces)
        initializers = branches = None  # written into the copy: a caller that passed them alone lets them go here
        in_place = {**(shared or {}), **pieces}
        lm, tokenizer = open_lm(copy, in_place or None, threads, prepack)
        # the cache graph run in parts gives each part's pages back after its run; a graph that could not be
        # cut so (`write_layer_ranges`) has them given back on a timer instead
        ranged = bool((lm.meta or {}).get("kv_parts"))
        with PagesGivenBackWhile(() if ranged else read_only_mappings(in_place.values())):
            return evaluate_instructions(lm, tokenizer, conversations, settings, batch, perplexity)
