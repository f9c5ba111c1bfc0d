"""Issue 31 target 4, evaluation included: train-local's generation over a float32 LoRA base read mapped
(torch, per block) runs ONNX Runtime over the mapped arrays in place (`held_quantized_copy`'s `shared`), and
one run of its session reads the whole base, so every page of it stayed resident (SmolLM2: 990-1028 MiB whole
process against training's 550). A thread gave the mapping's pages back every few milliseconds while it
generated (SmolLM2: 561-568 MiB, helper h159), but a starved thread let them rise (783-862 at load 9-12); the
cache graph now runs as sessions over layer ranges, each part's pages given back after its run by the thread
that runs them (`planner.onnx_quantize.write_layer_ranges`, `tasks.causal_lm.generate`; helper h163): the
pages are a read-only file mapping's, so one given back is faulted in again from the file, the same bytes."""
from __future__ import annotations

import numpy as np
import pytest

from support import LIFE_PEAK_PROLOGUE, run_child


def _resident_kib(mapping) -> int:
    """Resident KiB of the file mapping `mapping` (an mmap), from /proc/self/smaps: what the kernel counts."""
    import numpy as np

    address = np.frombuffer(mapping, np.uint8, count=1).__array_interface__["data"][0]
    inside = False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            low, high = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            inside = low <= address < high
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no such mapping")


def test_the_cache_graph_run_a_layer_at_a_time_holds_one_part_of_the_mapped_base(chat_llama, monkeypatch):
    """The session's chat Llama mapped, generation's cache graph run one layer a part (`RANGE_BYTES` 1 byte):
    its greedy answers equal the one session's over the whole graph, and after each part's run the mapped base
    holds no more than that part's weights (read from /proc/self/smaps; the pages are given back between
    runs, from the thread that runs them, so no load on the machine moves it). With the give-back a no-op
    the base after the last parts holds every layer's weights: the bound FAILS."""
    import jobs.common.onnx_lm as onnx_lm
    import planner.onnx_quantize as quantize
    import tasks.causal_lm.generate as generate
    from ir.mapped_pages import give_back_pages, read_only_mappings
    from jobs.common.onnx_lm import evaluate_lm
    from planner.onnx_import import load_model
    from tasks.causal_lm.generate import GenerationSettings

    model, _, dev = chat_llama
    held = load_model(model, 1, 16, mapped=True).constants
    mapping, = read_only_mappings(v for v in held.values() if getattr(v, "dtype", None) == "float32")
    settings = GenerationSettings(max_new_tokens=16)

    def answers():
        return evaluate_lm(model, dev, settings, batch=8, limit=4, threads=1, perplexity=False, prepack=False,
                           held=held, float_base=True).predictions

    cut = quantize.write_layer_ranges
    monkeypatch.setattr(quantize, "write_layer_ranges", lambda *a: None)  # one session over the whole graph
    whole = answers()
    monkeypatch.setattr(quantize, "write_layer_ranges", cut)
    monkeypatch.setattr(onnx_lm, "RANGE_BYTES", 1)
    runs = []  # (part, its weights' KiB, how many, the base's resident KiB after its run), each part's runs
    parts_in_order = generate._PartsInOrder

    class Measured(parts_in_order):
        def __init__(self, sessions, weights, initializers, *rows):
            super().__init__(sessions, weights, initializers, *rows)
            for k, (session, keep, taken, outputs, read) in enumerate(self.parts):
                self.parts[k] = (_Reading(k, session, read, runs, mapping), keep, taken, outputs, read)

    monkeypatch.setattr(generate, "_PartsInOrder", Measured)
    give_back_pages([mapping])
    assert answers() == whole
    base_kib = sum(v.nbytes for v in held.values() if getattr(v, "dtype", None) == "float32") // 1024
    assert len({part for part, _, _, _ in runs}) >= 4, runs  # the embedding, each layer, the head
    # over a part's own weights: their pages rounded out to whole pages and the kernel's fault-around (64 KiB
    # windows of pages already cached) at each array's two edges
    over = [(resident - own, arrays) for _, own, arrays, resident in runs]
    assert all(kib <= 2 * 64 * arrays for kib, arrays in over), (base_kib, max(over), runs[:8])


class _Reading:
    """A part's session whose runs record (the part, its weights' KiB and how many, the mapped base's
    resident KiB just after)."""

    def __init__(self, part, session, read, runs, mapping):
        self.part, self.session, self.runs, self.mapping = part, session, runs, mapping
        self.own, self.arrays = sum(a.nbytes for a in read) // 1024, len(read)

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, outputs, feeds):
        got = self.session.run(outputs, feeds)
        self.runs.append((self.part, self.own, self.arrays, _resident_kib(self.mapping)))
        return got


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


def test_the_head_run_a_range_of_its_table_rows_at_a_time_gives_the_same_logits(chat_llama, monkeypatch):
    """The head's product over the tied table as a part of its own, fed a range of the mapped table's rows at
    a time (`HEAD_BYTES` 1 MiB of the chat Llama's 12 MiB table): every step's logits equal, bit for bit, those
    of the head's part reading the table whole (`HEAD_BYTES` None), so the greedy answers do; the table is
    read in ranges of at most a quarter of it, and before each range's run the mapped base holds less than
    two ranges (the range before given back after its run). FAILS with that give-back a no-op (the ranges
    read before stay resident) and on h167's tree (no `HEAD_BYTES`: the table read whole). Training's
    fused head reads the table so on PyTorch (helper h167); read whole here the generation after training
    rose above it (helper h170)."""
    import jobs.common.onnx_lm as onnx_lm
    import tasks.causal_lm.generate as generate
    from ir.mapped_pages import give_back_pages, read_only_mappings
    from jobs.common.onnx_lm import evaluate_lm
    from planner.onnx_import import load_model
    from tasks.causal_lm.generate import GenerationSettings

    model, _, dev = chat_llama
    held = load_model(model, 1, 16, mapped=True).constants
    mapping, = read_only_mappings(v for v in held.values() if getattr(v, "dtype", None) == "float32")
    settings = GenerationSettings(max_new_tokens=16)
    seen = []
    pick = generate.OnnxCausalLM._pick

    def recorded(self, last_logits, settings, rng):
        seen[-1].append(np.array(last_logits))
        return pick(self, last_logits, settings, rng)

    monkeypatch.setattr(generate.OnnxCausalLM, "_pick", recorded)

    def answers():
        seen.append([])
        return evaluate_lm(model, dev, settings, batch=8, limit=4, threads=1, perplexity=False, prepack=False,
                           held=held, float_base=True).predictions

    monkeypatch.setattr(onnx_lm, "HEAD_BYTES", None)
    whole = answers()
    monkeypatch.setattr(onnx_lm, "HEAD_BYTES", 1 << 20)
    ranges = []  # (rows fed to a run of the head's part, the mapped table's resident KiB just before it)
    parts_in_order = generate._PartsInOrder

    class Measured(parts_in_order):
        def __init__(self, sessions, weights, initializers, rows):
            super().__init__(sessions, weights, initializers, rows)
            for k, (session, *rest) in enumerate(self.parts):
                if self.rows[k]:
                    self.parts[k] = (_RangesRead(session, self.rows[k][1], ranges, mapping), *rest)

    monkeypatch.setattr(generate, "_PartsInOrder", Measured)
    give_back_pages([mapping])
    assert answers() == whole
    assert len(seen[0]) == len(seen[1]) and all(np.array_equal(a, b) for a, b in zip(*seen))
    table = max((v for v in held.values() if getattr(v, "ndim", 0) == 2), key=lambda v: v.nbytes)
    widest = max(rows for rows, _ in ranges) * table.nbytes // len(table) // 1024
    assert len(ranges) >= 4 * len(seen[1]) and widest < table.nbytes // 1024 // 4, (widest, ranges[:4])
    # before each range's run the table holds at most one range read before it (given back after its run:
    # none) and the rows the embedding's lookups and the fault-around brought in: under two ranges
    assert all(kib <= 2 * widest for _, kib in ranges), (widest, max(kib for _, kib in ranges))


class _RangesRead:
    """The head's part run by rows, whose runs record (the rows fed, the mapped table's resident KiB just
    before the run: after the range before it was given back)."""

    def __init__(self, session, feed, ranges, mapping):
        self.session, self.feed, self.ranges, self.mapping = session, feed, ranges, mapping

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, outputs, feeds):
        self.ranges.append((len(feeds[self.feed]), _resident_kib(self.mapping)))
        return self.session.run(outputs, feeds)
