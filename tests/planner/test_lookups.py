"""The rows of an embedding table the training data looks up bound its AdamW state (issue 14's memory
model): `planner.lookups` counts them from the feeds `confidant train` will run, the memory model
charges the table's m and v as those rows (`planner.cost.table_state_delta_bytes`) as runtime.optim
holds them, `plan --data` records them and `train` refuses data that looks up more."""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

from ir.graph import block_signature
from ir.profile import BackendProfile, BlockCost, DeviceProfile, Link
from planner.cluster import DeviceSpec
from planner.cost import (OPTIMIZER_STATE_COPIES, ROW_STATE_PAGE, ROWS_DENSE_SHARE,
                          stage_memory_bytes, table_state_delta_bytes)
from planner.lookups import charged_rows, lookup_rows, table_index_inputs
from planner.onnx_import import load_model
from planner.partition import make_instance, manual_partition
from planner.cluster import Cluster
from support import S, export_onnx, token_feeds

MIB = 2 ** 20
WORD = "inner.bert.embeddings.word_embeddings.weight"


@pytest.fixture(scope="module")
def graph(tiny_checkpoint, export_dir):
    return load_model(export_onnx(tiny_checkpoint, export_dir / "tiny-ts17.onnx", opset=17), 2, S)


def _device(graph, name="box", engine="mnn") -> DeviceSpec:
    costs = {block_signature(b): BlockCost(0.01, 0.02, workspace_bytes=MIB) for b in graph.blocks}
    profile = DeviceProfile(name, graph.name, graph.batch, graph.seq, (BackendProfile(f"{engine}:cpu:t1", costs),),
                            memory_available_bytes=8 << 30, runtime_overhead_bytes=100 * MIB)
    return DeviceSpec(name, "tcp://127.0.0.1:1", profile, 4 << 30)


def test_the_tables_indexed_by_fed_inputs_and_their_distinct_rows(graph):
    """The word and token-type tables are looked up by inputs as fed; the position table by ids the
    graph computes, so it is left out. Rows count each distinct index once, a negative one as the
    row it takes; an index outside the table is an error naming input, index and table."""
    sources = table_index_inputs(graph)
    assert sources[WORD] == "input_ids"
    assert "token_type_ids" in sources.values()
    assert not any("position" in t for t in sources), sources
    rows = graph.constants[WORD].shape[0]
    feeds = [token_feeds(2, S, vocab=50, seed=s) for s in range(3)]
    want = len(set(np.concatenate([f["input_ids"].reshape(-1) for f in feeds]).tolist()))
    assert lookup_rows(graph, feeds)[WORD] == want
    extra = {**feeds[0], "input_ids": np.full_like(feeds[0]["input_ids"], -1)}  # the last row
    assert lookup_rows(graph, feeds + [extra])[WORD] == want + 1
    assert WORD not in lookup_rows(graph, [{"token_type_ids": feeds[0]["token_type_ids"]}])
    with pytest.raises(ValueError, match=rf"input 'input_ids' holds index {rows}, outside table '{WORD}' of {rows} rows"):
        lookup_rows(graph, [{**feeds[0], "input_ids": np.full_like(feeds[0]["input_ids"], rows)}])


def test_which_tables_are_charged_as_rows_and_why_not(graph):
    """`charged_rows`, what `plan --data` notes and the pipeline benchmark charges: AdamW's state as
    the rows looked up while they are at most ROWS_DENSE_SHARE of the table; past that, or under
    SGD, the whole table, each with its reason; a table that is not a parameter is left out."""
    n = graph.constants[WORD].shape[0]
    over = int(ROWS_DENSE_SHARE * n) + 1
    assert charged_rows(graph, {WORD: 40}, "adamw") == [
        (WORD, 40, n, 40, "AdamW's state of the table is charged for those rows")]
    assert charged_rows(graph, {WORD: over}, "adamw") == [
        (WORD, over, n, None, f"over {ROWS_DENSE_SHARE:.0%} of them, AdamW's state of the table is dense, charged whole")]
    assert charged_rows(graph, {WORD: 40}, "sgd") == [
        (WORD, 40, n, None, "sgd's state of the table is charged whole (only AdamW's is kept as rows)")]
    frozen = dataclasses.replace(graph, params=tuple(p for p in graph.params if p != WORD))
    assert charged_rows(frozen, {WORD: 40}, "adamw") == []


def test_the_memory_model_charges_a_tables_adamw_state_as_the_rows_looked_up(graph):
    """Known rows under ROWS_DENSE_SHARE: m and v for those rows (grown by doubling) and a slot per
    table row instead of two whole tables; past the share, unknown rows, SGD, or an engine the model
    does not know: the whole table. The partition instance agrees with the stage's memory."""
    table = graph.constants[WORD]
    n, row = table.shape[0], table.nbytes // table.shape[0]
    device = _device(graph)
    last = len(graph.blocks) - 1
    few = dataclasses.replace(graph, lookup_rows={WORD: 40})
    held = 8 * n + 40 * (8 + 2 * row) + 3 * ROW_STATE_PAGE  # by hand: slots, 40 ids and rows of m and v
    want = min(0, held - 2 * table.nbytes)
    assert table_state_delta_bytes(few, 0, last, device, "adamw") == want < 0
    assert (stage_memory_bytes(few, device, 0, last, 0, 1, "1f1b-flush", 2, "adamw")
            - stage_memory_bytes(graph, device, 0, last, 0, 1, "1f1b-flush", 2, "adamw")) == want
    many = dataclasses.replace(graph, lookup_rows={WORD: int(ROWS_DENSE_SHARE * n) + 1})
    assert table_state_delta_bytes(many, 0, last, device, "adamw") == 0
    assert table_state_delta_bytes(graph, 0, last, device, "adamw") == 0
    assert table_state_delta_bytes(few, 0, last, device, "sgd") == 0
    assert table_state_delta_bytes(few, 1, last, device, "adamw") == 0  # the table is in block 0
    odd = dataclasses.replace(device, profile=dataclasses.replace(
        device.profile, backends=(dataclasses.replace(device.profile.backends[0], backend="tflite:cpu:t1"),)))
    assert table_state_delta_bytes(few, 0, last, odd, "adamw") == 0
    cluster = Cluster((device, _device(graph, "b", "torch")), Link(1e9, 1e-4))
    inst = make_instance(few, cluster, "1f1b-flush", 2, "adamw")
    plan = manual_partition(inst, ["box", "b"], [2])
    assert plan.stages[0].memory_bytes == stage_memory_bytes(few, device, 0, 1, 0, 2, "1f1b-flush", 2, "adamw")


def _resident_bytes(a: np.ndarray) -> int:
    """The resident bytes of the pages `a`'s data spans, as the kernel counts them (`mincore`; a
    mapping's smaps line will not do: adjacent anonymous maps merge into one)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = a.__array_interface__["data"][0] // page * page
    length = a.__array_interface__["data"][0] + a.nbytes - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts resident pages with mincore")
def test_runtime_optim_holds_no_more_than_the_memory_model_charges():
    """The model's constants are runtime.optim's, and AdamW's row state after steps over tables of
    looked-up rows is resident within what `table_state_delta_bytes` charges for that many rows (its
    maps' pages, counted by the kernel: the rows are written in order into room for every row) and
    holds more than 9/10 of it (the charge is the rows' own bytes: a state grown by doubling, old and
    new alive at once, or made whole, fails one side)."""
    from runtime import optim
    from runtime.engines.base import RowGradient

    assert (optim.ROWS_DENSE_SHARE, OPTIMIZER_STATE_COPIES["adamw"]) == (ROWS_DENSE_SHARE, 2)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((30000, 64)).astype(np.float32)  # 7.3 MiB: each moment a map of its own
    opt, used = optim.AdamW(lr=1e-3), set()
    for _ in range(12):
        ids = rng.integers(0, 10000, 370)
        used |= set(ids.tolist())
        opt.step({"t": table}, {"t": RowGradient(ids, rng.standard_normal((370, 64)).astype(np.float32),
                                                table.shape)})
        state = opt.rows["t"]
        held = state.slot.nbytes + sum(_resident_bytes(a) for a in (state.ids, *state.arrays))
        charged = 8 * 30000 + len(used) * (8 + 2 * 64 * 4) + 3 * ROW_STATE_PAGE
        assert state.n == len(used) and 0.9 * charged <= held <= charged, (held, charged)


def _minilm_cluster(graph, folder, budget="4GiB"):
    profile = _device(graph).profile
    profile.save(folder / "box.json")
    devices = [{"name": n, "address": f"tcp://127.0.0.1:{i + 1}", "profile": "box.json", "memory_budget": budget,
                "backend": "mnn:cpu:t1"} for i, n in enumerate(("a", "b"))]
    (folder / "cluster.json").write_text(json.dumps({"devices": devices, "links": {
        "default": {"bandwidth": "1GB/s", "latency": "0.1ms"}}}))
    return folder / "cluster.json"


def test_plan_with_data_charges_the_rows_and_train_refuses_data_that_looks_up_more(minilm_onnx, tmp_path, capsys):
    from jobs.common.errors import JobError
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from jobs.planning import PlanSettings, plan_model
    from tasks.ner.datagen import write_splits

    seq = 32
    graph = load_model(minilm_onnx, 4, seq)
    cluster = _minilm_cluster(graph, tmp_path)
    small, _ = write_splits(tmp_path / "small", n_train=8, n_dev=2, seed=1)
    large, _ = write_splits(tmp_path / "large", n_train=200, n_dev=2, seed=2)
    settings = PlanSettings(batch=8, seq=seq, microbatches=2, cuts=(3,), devices=("a", "b"))
    whole = json.loads((plan_model(minilm_onnx, cluster, settings, tmp_path / "whole") / "plan.json").read_text())
    from jobs.common.report import Silent

    class Notes(Silent):
        def __init__(self):
            self.lines = []

        def note(self, text):
            self.lines.append(text)

    notes = Notes()
    out = plan_model(minilm_onnx, cluster, dataclasses.replace(settings, data=small), tmp_path / "rows", notes)
    planned = json.loads((out / "plan.json").read_text())
    rows = planned["lookup_rows"][WORD]
    # token types: 1 of 2 rows, over ROWS_DENSE_SHARE: charged whole, so neither recorded nor checked
    assert set(planned["lookup_rows"]) == {WORD}
    assert any(f"rows of {WORD} (" in n and n.endswith("AdamW's state of the table is charged for those rows")
               for n in notes.lines), notes.lines
    assert any("token_type_embeddings.weight (50.0%" in n and n.endswith("AdamW's state of the table is dense, "
                                                                          "charged whole") for n in notes.lines)
    assert 0 < rows < ROWS_DENSE_SHARE * graph.constants[WORD].shape[0]
    saved = table_state_delta_bytes(dataclasses.replace(graph, lookup_rows={WORD: rows}), 0, 2,
                                    _device(graph), "adamw")
    assert planned["devices"][0]["memory_bytes"] - whole["devices"][0]["memory_bytes"] == saved < -50 * MIB
    assert planned["devices"][1]["memory_bytes"] == whole["devices"][1]["memory_bytes"]
    from confidant.commands import show_plan

    show_plan(out)
    assert f"looks up (plan --data; their AdamW state is charged as rows, and train refuses data that looks up more): " \
           f"{WORD} {rows}\n" in capsys.readouterr().out
    with pytest.raises(JobError, match=rf"{large} looks up \d+ rows of embedding table '{WORD}' in 40 steps, but the "
                                       rf"plan was made for data that looks up {rows} \(`confidant plan --data`\)"):
        train_from_plan(out, large, None, PlanRunSettings(steps=40, local=True, insecure=True))


def test_plan_names_what_data_and_tokenizer_do_and_refuses_a_tokenizer_alone(tmp_path):
    from support import run_cli

    proc = run_cli("plan", "--help")
    assert proc.returncode == 0 and "--data" in proc.stdout and "AdamW state" in proc.stdout
    proc = run_cli("plan", tmp_path / "m.onnx", "--cluster", tmp_path / "c.json", "--tokenizer", tmp_path / "t.json")
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("confidant plan: error: --tokenizer is the tokenizer of --data: give the training "
                                   "data with it")


def test_a_tied_tables_rows_change_nothing(tmp_path):
    """A table the LM head also reads (tied embeddings) has a dense gradient, so its AdamW state is
    dense whatever rows the data looks up: the memory model charges it whole."""
    from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
    from planner.cost import looked_up_only

    path = export_causal_lm(random_causal_lm("llama"), tmp_path / "llama.onnx", LlmExportOptions(), kv_cache=False)
    tied = load_model(path, 2, 12)
    table = "model.embed_tokens.weight"
    assert table_index_inputs(tied)[table] == "input_ids" and table not in looked_up_only(tied)
    few = dataclasses.replace(tied, lookup_rows={table: 5})
    assert table_state_delta_bytes(few, 0, len(tied.blocks) - 1, _device(tied), "adamw") == 0
