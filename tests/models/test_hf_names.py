"""The value search of `jobs.common.hf_names`: the probe prefilter finds every parameter the whole-array
comparison accepts (as it is or transposed), so placing weights stays exact while it stops being
quadratic in the number of same-shaped parameters."""
from __future__ import annotations

import numpy as np
import pytest

from jobs.common.hf_names import ATOL, _Candidates, _same


def _state(rng):
    square = {f"layer.{i}.q.weight": rng.standard_normal((6, 6)).astype(np.float32) for i in range(40)}
    wide = {f"layer.{i}.up.weight": rng.standard_normal((4, 10)).astype(np.float32) for i in range(10)}
    sym = rng.standard_normal((6, 6)).astype(np.float32)
    return {**square, **wide, "sym.weight": sym + sym.T, "bias": np.zeros(6, np.float32),
            "ids": np.arange(6)}  # an integer buffer is never a candidate


def test_probes_find_exactly_what_whole_arrays_accept():
    rng = np.random.default_rng(0)
    state = _state(rng)
    candidates = _Candidates(state)
    queries = [state["layer.3.q.weight"], state["layer.7.up.weight"].T, state["sym.weight"], state["bias"],
               state["layer.5.q.weight"] + np.float32(ATOL / 4)]
    off_one = state["layer.9.q.weight"].copy()
    off_one[2, 3] += 1.0  # differs in one element the probes may not read: the whole comparison decides
    queries.append(off_one)
    for query in queries:
        value = np.asarray(query, np.float64)
        brute = {(k, False) for k, v in state.items() if v.dtype.kind == "f" and _same(value, np.asarray(v, np.float64))}
        brute |= {(k, True) for k, v in state.items() if v.dtype.kind == "f" and value.ndim == 2
                  and (k, False) not in brute and _same(value.T, np.asarray(v, np.float64))}
        near = candidates.near(value)
        assert brute <= set(near)
        assert len({k for k, _ in near}) == len(near)  # each parameter once
    assert candidates.near(np.asarray(state["sym.weight"], np.float64)) == [("sym.weight", False)]
    assert candidates.near(np.asarray(state["layer.7.up.weight"].T, np.float64)) == [("layer.7.up.weight", True)]
    assert candidates.near(np.asarray(state["bias"], np.float64)) == [("bias", False)]


def _equal_weights_model(kind: str):
    """A scrambled tiny BERT with two of its attention projections holding equal values: `same`,
    layer 1's query a copy of layer 0's; `transposed`, layer 0's key the transpose of its query
    (the TorchScript exporter stores each Linear transposed under an anonymous name, so each of the
    two ONNX weights equals one parameter as it is and the other transposed)."""
    import torch

    from support import tiny_model

    model = tiny_model("bert", task="seq-cls", num_labels=3, seed=4, scramble=True)
    attention = [layer.attention.self for layer in model.bert.encoder.layer]
    with torch.no_grad():
        if kind == "same":
            attention[1].query.weight.copy_(attention[0].query.weight)
        else:
            attention[0].key.weight.copy_(attention[0].query.weight.T)
    return model


@pytest.mark.parametrize("kind", ["same", "transposed"])
def test_equal_valued_weights_are_told_apart_or_refused_never_swapped(tmp_path, kind):
    """Two weights with equal values (as exported) match the same parameters by value: each must
    be placed by what tells them apart (names, the graph), or the --hf export refused. Taking the
    first candidate instead swaps them (the `transposed` case: each weight's first candidate is the
    other's parameter), which shows once training has moved them apart: transformers' logits from
    the export-trained folder would differ from the trained model's."""
    import torch

    from jobs.common.errors import JobError
    from jobs.export.encoder import ExportOptions, export_model, model_inputs, read_hf_sidecar
    from jobs.train.local import write_single_device_checkpoint
    from jobs.export.trained import export_trained_hf
    from planner.onnx_import import load_model
    from runtime.engines.mnn import MnnStageEngine
    from runtime.engines.stage import stage_spec
    from support import TINY, family_feeds, make_tiny_tokenizer
    from transformers import AutoModelForSequenceClassification

    model = _equal_weights_model(kind)
    path = export_model(model, tmp_path / "m.onnx", ExportOptions(num_labels=3, task="seq-cls", attention="sdpa"))
    graph = load_model(path, 2, 10)
    anonymous = [p for p in graph.params if p.startswith("onnx::")]
    assert anonymous, "the TorchScript export was expected to store its Linear weights under anonymous names"
    rng = np.random.default_rng(0)
    weights = {p: (graph.constants[p] + 0.05 * rng.standard_normal(graph.constants[p].shape)).astype(np.float32)
               for p in graph.params}
    ckpt = write_single_device_checkpoint(tmp_path / "ckpt", weights, {}, graph, {
        "command": "train-local", "model": path.name, "model_path": str(path.resolve()), "task": "seq-cls",
        "labels": None, "step": 1})
    sidecar = read_hf_sidecar(path)
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    try:
        folder = export_trained_hf(ckpt, tmp_path / "hf", tokenizer=tmp_path / "tokenizer.json")
    except JobError as exc:  # refused: the sidecar says which weights matched several parameters
        assert sidecar["unplaced"] and "matches [" in sidecar["unplaced"] and "could not name every weight" in str(exc)
        return
    feeds = family_feeds(model_inputs(model), 2, 10, TINY["vocab"], 3, task="seq-cls")
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    ours = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    reloaded = AutoModelForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = reloaded(**{k: torch.tensor(feeds[k]) for k in model_inputs(model)}).logits.numpy()
    assert float(np.abs(theirs - ours).max()) <= 1e-4
