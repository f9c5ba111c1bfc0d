"""Issue 31 target 4, evaluation included: train-local's generation over a float32 LoRA base read mapped
(torch, per block) runs ONNX Runtime over the mapped arrays in place (`held_quantized_copy`'s `shared`), and
one run of its session reads the whole base, so every page of it stayed resident (SmolLM2: 990-1028 MiB whole
process against training's 550). A thread gives the mapping's pages back every few milliseconds while it
generates (`ir.mapped_pages.PagesGivenBackWhile`): the pages are a read-only file mapping's, so one given back
while it is read is faulted in again, the same bytes (SmolLM2: 561-568 MiB; benchmarks/MEMORY_NOTES.md,
helper h159)."""
from __future__ import annotations

import pytest

from support import LIFE_PEAK_PROLOGUE, run_child


def test_the_pages_given_back_while_generating_leave_the_greedy_tokens_as_they_were(chat_llama, monkeypatch):
    """The session's chat Llama mapped: its answers with the pages given back all the time equal those
    with none given back, and the give-back ran while it generated (over the graph's one mapping)."""
    import ir.mapped_pages as pages
    from jobs.common.onnx_lm import evaluate_lm
    from planner.onnx_import import load_model
    from tasks.causal_lm.generate import GenerationSettings

    model, _, dev = chat_llama
    held = load_model(model, 1, 16, mapped=True).constants
    settings = GenerationSettings(max_new_tokens=16)

    def answers():
        return evaluate_lm(model, dev, settings, batch=8, limit=4, threads=1, perplexity=False, prepack=False,
                           held=held, float_base=True).predictions

    monkeypatch.setattr(pages, "GIVE_BACK_EVERY_S", 3600.0)  # none given back while it generates
    kept = answers()
    given = []
    give_back = pages.give_back_pages
    monkeypatch.setattr(pages, "give_back_pages", lambda m: (given.append(len(m)), give_back(m)))
    monkeypatch.setattr(pages, "GIVE_BACK_EVERY_S", 0.0002)
    assert answers() == kept
    assert len(given) > 20 and set(given) == {1}, (len(given), set(given))


# train-local's causal-LM job on a fresh process: VmHWM read and started again around each generation
# (`evaluate_lm`), and read at the job's own start again after training (what the steps and the perplexity
# before held since the first generation)
GENERATION_CHILD = LIFE_PEAK_PROLOGUE + r"""
import json, sys
from pathlib import Path
import jobs.common.onnx_lm as onnx_lm
import jobs.train.causal_lm as job
from jobs.common.settings import TrainingSettings
from planner.lora import LoraSettings

generations, trained = [], []
evaluate = onnx_lm.evaluate_lm
def measured(*args, **kwargs):
    procfs.reset_peak_rss()
    scores = evaluate(*args, **kwargs)
    generations.append(procfs.peak_rss_bytes())
    procfs.reset_peak_rss()
    return scores
onnx_lm.evaluate_lm = measured
reset = job.reset_peak_rss
def read_first():
    trained.append(procfs.peak_rss_bytes())
    return reset()
job.reset_peak_rss = read_first
settings = TrainingSettings(steps=2, batch=4, seq=128, lr=1e-4, optimizer="adamw", seed=0, threads=1, engine="torch",
                            lora=LoraSettings(8, base_dtype="float32"), activations="per-block", eval_limit=4)
job.train_causal_lm(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), settings)
print("PEAKS " + json.dumps({"generations": generations, "training": trained[0]}))
"""


@pytest.mark.slow
def test_a_fresh_train_local_generates_under_its_training_peak(tmp_path):
    """A random Llama with SmolLM2's tokenizer, 8 layers of hidden 384 (52 MiB) and a 72 MiB tied table:
    training holds one block of the mapped base (the head's table at most), each generation (before and
    after training) no more than the training did."""
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
    from tasks.causal_lm.entity_task import write_entity_splits

    model = export_random_causal_lm("llama", tmp_path / "m.onnx", LlmExportOptions(), tokenizer_from=smollm2_gguf_path(),
                                    hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                                    num_attention_heads=6, num_key_value_heads=2)
    train, dev = write_entity_splits(tmp_path / "data", n_train=8, n_dev=4, seed=0)
    got = run_child(GENERATION_CHILD, "PEAKS", model, train, dev)
    mib = {k: [round(v / 2 ** 20, 1) for v in (got[k] if isinstance(got[k], list) else [got[k]])] for k in got}
    print(mib)
    assert len(got["generations"]) == 2, mib
    assert max(got["generations"]) < got["training"], mib
