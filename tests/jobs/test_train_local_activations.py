"""`confidant train-local --activations keep|recompute|per-block` through the command line: each engine
builds its whole-model engine with that choice and trains to the same losses; --help teaches what each
costs; a value that is none of them exits 2 with one line."""
from __future__ import annotations

import json

import pytest

from support import make_tiny_tokenizer, run_cli


@pytest.fixture(scope="module")
def conll(tmp_path_factory):
    d = tmp_path_factory.mktemp("acts")
    data = d / "d.txt"
    data.write_text("Ann B-PER\nvisits O\nOslo B-LOC\non O\nMonday O\n\nBob B-PER\nmet O\nIBM B-ORG\n\n" * 3)
    make_tiny_tokenizer().save(str(d / "tokenizer.json"))
    return data


def _train(model, data, tmp_path, *extra):
    out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.json"
    run = run_cli("train-local", model, "--data", data, "--eval", data, "--steps", 2, "--seq", 16, "--batch", 2,
                  "--lr", "1e-3", "--metrics-out", out, "--tokenizer", data.parent / "tokenizer.json", *extra)
    assert run.returncode == 0, run.stderr
    return [s["loss"] for s in json.loads(out.read_text())["steps"]]


@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_train_local_trains_the_same_with_each_activations_choice(tiny_onnx, conll, tmp_path, monkeypatch, engine):
    from runtime.engines import factory

    built = []
    real = factory.single_engine

    def spy(backend, spec, **kw):
        built.append(kw.get("activations"))
        return real(backend, spec, **kw)

    monkeypatch.setattr(factory, "single_engine", spy)
    model = tiny_onnx["torchscript-17"]
    default = _train(model, conll, tmp_path, "--engine", engine)
    for choice in ("keep", "recompute", "per-block"):
        built.clear()
        got = _train(model, conll, tmp_path, "--engine", engine, "--activations", choice)
        assert built[0] == choice  # the training engine (evaluation builds its own after)
        assert got == pytest.approx(default, rel=1e-5), choice


def test_train_local_help_teaches_the_activations_choices():
    run = run_cli("train-local", "--help")
    text = " ".join(run.stdout.split())
    assert run.returncode == 0
    for words in ("--activations {keep,recompute,per-block}", "the least memory", "one more forward of time",
                  "the fastest, the most memory"):
        assert words in text, words


def test_train_local_refuses_an_unknown_activations_choice_in_one_line(tiny_onnx, conll):
    run = run_cli("train-local", tiny_onnx["torchscript-17"], "--data", conll, "--eval", conll,
                  "--activations", "per-layer")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--activations: invalid choice: 'per-layer'" in run.stderr
