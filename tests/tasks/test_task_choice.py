"""Which task a training command runs without --task: the model's side files (a real export's), then
the data's kind; and a causal LM trained by `train-local MODEL --data x.jsonl` alone (it was read as
CoNLL: "invalid NER tag")."""
from __future__ import annotations

import json

import pytest

from tasks.choice import task_of
from support import run_cli


def test_a_causal_lm_export_is_a_causal_lm_whatever_the_data(chat_llama):
    model, train, _ = chat_llama
    assert model.with_suffix(".lm.json").is_file()
    for data in (train, model.parent / "notes.txt", None):
        choice = task_of(model=model, data=data)
        assert choice.task == "causal-lm" and "m.lm.json" in choice.reason


@pytest.mark.parametrize("exported, task", [("seq-cls", "seq-cls"), ("token-classification", "ner")])
def test_an_encoder_export_names_its_task(tmp_path, exported, task):
    model = tmp_path / "enc.onnx"
    model.write_bytes(b"")
    (tmp_path / "enc.hf.json").write_text(json.dumps({"format": "confidant-hf-export", "task": exported}))
    # the side file wins over a data file whose kind says otherwise
    assert task_of(model=model, data=tmp_path / "train.jsonl").task == task


@pytest.mark.parametrize("data, task", [("train.jsonl", "causal-lm"), ("train.TSV", "seq-cls"),
                                        ("train.csv", "seq-cls"), ("eng.train", "ner"), ("train.txt", "ner")])
def test_without_side_files_the_data_decides(tmp_path, data, task):
    model = tmp_path / "plain.onnx"
    model.write_bytes(b"")
    (tmp_path / "plain.hf.json").write_text("{not json")  # an unreadable side file decides nothing
    assert task_of(model=model, data=tmp_path / data).task == task


# `confidant train-local` inferring a causal LM from the model's side file (m.lm.json) and scoring its
# perplexity: tests/jobs/test_train_local_memory_line.py's run (one run of train-local for both)


def test_a_short_seq_trains_on_what_fits_and_says_what_it_left_out(chat_llama, tmp_path):
    """`--seq` shorter than some conversations (demo --llm --seq 64 stopped after its export): the long
    ones are cut, those whose answer starts past the row left out, with a count, and training runs."""
    model, train, dev = chat_llama
    run = run_cli("train-local", model, "--data", train, "--eval", dev, "--eval-limit", "1", "--steps", "1",
                  "--batch", "2", "--seq", "80")
    assert run.returncode == 0, run.stderr
    said = run.stdout + run.stderr
    assert "--data train.jsonl: 37 of 40 conversations cut to --seq 80 tokens; 3 of 40 skipped, their answers " \
           "starting past token 80" in said  # 84-110 tokens each: the 37 whose answers start within 80 are cut
    run = run_cli("train-local", model, "--data", train, "--eval", dev, "--steps", "1", "--batch", "2", "--seq", "56")
    assert run.returncode == 2 and "every conversation's answer starts past token 56: raise --seq" in run.stderr
    run = run_cli("train-local", model, "--data", train, "--eval", dev, "--eval-limit", "2", "--steps", "1",
                  "--batch", "2", "--seq", "72")
    assert run.returncode == 2 and f"--eval {dev}: every conversation's answer starts past token 72" in run.stderr
