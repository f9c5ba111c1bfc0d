"""train-local's generation over a file `confidant export --base-dtype int4` stored quantized, LoRA on an int4
base: ONNX Runtime runs the base as the file stores it with the trained adapters beside it
(`jobs.common.onnx_lm.held_quantized_copy`), not with each adapted weight merged into a float32 initializer
(`stored_replaced`), which made SmolLM2 int4's generation after training 1.5 GiB against training's 555 MiB
(issue 31 lever 2, benchmarks/MEMORY_NOTES.md, helper h169).

The session generation runs is read as it is built (a subclass of the real `OnnxCausalLM` that reads the graph
it is given): no float32 initializer (in the file or given in place) for a targeted weight; the answers equal
those of the merged float32 weights (the earlier path, an independent reference: the file's own widening ops
over the stored pieces, the adapters merged in float64)."""
from __future__ import annotations

import numpy as np
import pytest

from support import made_once, shared_root


@pytest.fixture(scope="module")
def int4_chat_llama(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, exported with its base stored int4 (and its cache graph),
    and 2 dev conversations of the entities-json task: (model, train, dev)."""
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
    from tasks.causal_lm.entity_task import write_entity_splits

    root = shared_root(tmp_path_factory) / "chat-llama-int4"
    path = made_once(root / "m.onnx", lambda out: export_random_causal_lm(
        "llama", out, LlmExportOptions(base_dtype="int4"), tokenizer_from=smollm2_gguf_path()))
    train, dev = write_entity_splits(tmp_path_factory.mktemp("int4-chat-data"), n_train=4, n_dev=2)
    return path, train, dev


def test_a_stored_int4_files_generation_keeps_its_base_stored_with_the_adapters_beside_it(int4_chat_llama,
                                                                                           monkeypatch):
    import onnx

    import jobs.common.onnx_lm as onnx_lm
    from jobs.common.settings import TrainingSettings
    from jobs.train.causal_lm import (CAUSAL_LM, _evaluation_nll, _scores, generation_weights, lm_data, lm_graph)
    from planner.lora import LoraSettings
    from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM, lm_metadata

    model, train, dev = int4_chat_llama
    settings = TrainingSettings(steps=1, batch=2, seq=128, threads=1, engine="torch", activations="per-block",
                                lora=LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(),
                                                  base_dtype="int4"), eval_limit=2)
    graph, adapters = lm_graph(model, settings)
    targeted = {a.base for a in adapters}
    assert len(targeted) == 8, sorted(targeted)
    rng = np.random.default_rng(0)  # trained adapters: B no longer zero
    weights = {p: (rng.normal(0, 0.3, graph.constants[p].shape).astype(np.float32) if p in {a.b for a in adapters}
                   else np.asarray(graph.constants[p], np.float32)) for p in graph.params}
    seen = []

    class ReadAsBuilt(OnnxCausalLM):
        def __init__(self, model_path, initializers=None, *args, sources=None, **kwargs):
            super().__init__(model_path, initializers, *args, sources=sources, **kwargs)
            kv = self.path.parent / lm_metadata(self.path)["kv_model"]
            proto = (onnx.ModelProto.FromString(sources[kv]) if sources and kv in sources
                     else onnx.load(str(kv), load_external_data=False))
            seen.append(sorted({t.name for t in proto.graph.initializer if t.name in targeted
                                and t.data_type == onnx.TensorProto.FLOAT} | (set(initializers or ()) & targeted)))

    monkeypatch.setattr(onnx_lm, "OnnxCausalLM", ReadAsBuilt)
    run = lm_data(model, train, dev, settings)
    dev_batches = CAUSAL_LM.dev_batches(run, settings.batch)
    _, scores = _scores(_evaluation_nll(graph, "torch", 1, weights), model, graph, adapters, settings, dev,
                        dev_batches, run.pad_id, weights)
    assert seen == [[]], f"float32 copies of targeted weights in the generation's session: {seen}"
    # the reference: the adapters merged into float32 weights (float64 sums) over the file's own widening ops
    merged = generation_weights(model, graph, weights, adapters, settings.lora.scale)
    assert targeted <= set(merged)
    want = onnx_lm.evaluate_lm(model, dev, GenerationSettings(max_new_tokens=48), batch=8, limit=2, threads=1,
                               initializers=merged, perplexity=False)
    assert seen[1] == sorted(targeted)  # the reference does hold them: the spy can tell
    assert scores.predictions == want.predictions
    plain = onnx_lm.evaluate_lm(model, dev, GenerationSettings(max_new_tokens=48), batch=8, limit=2, threads=1,
                                perplexity=False)
    assert plain.predictions != want.predictions  # the adapters count: the answers can tell


def _carried_weights_only(part) -> list[str]:
    """A part's outputs made from its weights alone (its initializers through nodes that read nothing else)."""
    from_weights = {t.name for t in part.graph.initializer}
    for n in part.graph.node:  # written in topological order (`write_layer_ranges`)
        if n.input and all(i in from_weights for i in n.input if i):
            from_weights.update(n.output)
    return [o.name for o in part.graph.output if o.name in from_weights]


def test_a_stored_int4_copys_pieces_are_read_in_place_a_layer_range_at_a_time(int4_chat_llama, tmp_path):
    """The held base's stored pieces are given to ONNX Runtime in place (the copy's file holds none of their
    bytes: its session read them into a heap of its own beside the held ones), the cache graph runs in parts,
    and no part hands a later one a value made of weights alone (the tied table's widened blocks, carried from
    the first part to the head: SmolLM2 int4's generation 113 MB); the answers are those of the copy with the
    pieces written into it (the earlier path) and differ from no adapters'. On main: no `pieces`, no parts."""
    import json

    import onnx

    from ir.precision import QuantizedTensor, stored_arrays
    from jobs.common.onnx_lm import held_quantized_copy
    from planner.onnx_import import load_model
    from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM

    model, _, _ = int4_chat_llama
    held = load_model(model, 1, 16, mapped=True).constants  # as PyTorch per block reads the file
    stored = [a for v in held.values() if isinstance(v, QuantizedTensor) for a in stored_arrays(v)]
    rng = np.random.default_rng(1)
    branches = {name: (rng.normal(0, 0.3, (v.shape[1], 4)).astype(np.float32),
                       rng.normal(0, 0.3, (4, v.shape[0])).astype(np.float32))
                for name, v in held.items() if isinstance(v, QuantizedTensor) and ".self_attn.q_proj" in name}
    for name in ("in-place", "written", "plain"):
        (tmp_path / name).mkdir()
    pieces = {}
    copy = held_quantized_copy(model, held, None, tmp_path / "in-place", dict(branches), pieces=pieces)
    assert len(pieces) == len(stored), (len(pieces), len(stored))  # every stored piece, in place
    assert all(any(p is a for a in stored) for p in pieces.values())
    meta = json.loads(copy.with_suffix(".lm.json").read_text())
    assert set(meta["pieces_in_place"]) == set(pieces)
    data = copy.with_name(meta["kv_model"] + ".data")
    assert os_blocks(data) * 512 < sum(a.nbytes for a in stored) / 4, "the pieces were written into the copy"
    assert meta["kv_parts"] and len(meta["kv_parts"]) >= 3
    for file, _ in meta["kv_parts"]:
        part = onnx.load(str(copy.parent / file), load_external_data=False)
        assert _carried_weights_only(part) == [], file
    prompts = [[1, 5, 9, 30, 42, 7], [3, 8, 2]]
    settings = GenerationSettings(max_new_tokens=12)
    got = OnnxCausalLM(copy, pieces, threads=1).generate(prompts, settings)
    want = OnnxCausalLM(held_quantized_copy(model, held, None, tmp_path / "written", dict(branches)),
                        threads=1).generate(prompts, settings)
    plain = OnnxCausalLM(held_quantized_copy(model, held, None, tmp_path / "plain"), threads=1).generate(
        prompts, settings)
    assert got == want
    assert plain != want  # the adapters count: the answers can tell


def os_blocks(path) -> int:
    """512-byte blocks a file has on disk (a sparse file's holes take none)."""
    import os

    return os.stat(path).st_blocks
