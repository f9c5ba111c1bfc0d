"""The MNN engine adds its fused LM head's weight gradient straight into the running gradient sum: in the
training forward's pass that computes it (`MnnStageEngine.forward_into`, which the executor and the
trainer call where the micro-batch's backward adds into that sum), or in a backward that recomputes the
pass (`backward_into`, `backward_input_into`). The sum equals the sum of each micro-batch's own gradients
(PyTorch float64), in every order a stage runs its forwards and backwards, and from the second
micro-batch on no second vocabulary x hidden array is made beside the sum (a measured peak). The full
fine-tuning test's MNN head stage peaked there, its 48 MiB head's gradient made in each forward beside the
sum: 309.1-309.2 MiB, 262.0-262.3 without (benchmarks/MEMORY_NOTES.md, h135)."""

import numpy as np
import pytest
import torch

from ir.backend import parse_backend
from ir.plan import SCHEDULE_NAMES, ActionKind
from jobs.export.llm import LlmExportOptions, export_causal_lm, random_causal_lm
from planner.onnx_import import load_model
from planner.schedule import make_schedule
from runtime.engines.base import accumulate, dense_gradient
from runtime.engines.factory import make_engine
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.pytorch import TorchStageEngine
from runtime.engines.stage import stage_spec
from runtime.pipeline.executor import summed_forwards
from runtime.procfs import release_free_heap, reset_peak_rss, status_bytes
from tasks.trainer import accumulate_feeds
from tests.runtime.test_head_sum import HEAD, big_head_stage, lm_feeds
from tests.support import gc_frozen

# the orders a stage runs three micro-batches in: (kind, micro-batch, how)
ORDERS = {
    # 1F1B's last stage: each forward just before its backward, from the second on into the sum
    "1f1b": [("F", 0, "into"), ("B", 0, "into"), ("F", 1, "into"), ("B", 1, "into"), ("F", 2, "into"),
             ("B", 2, "into")],
    # GPipe's: no sum at any forward; the first backward's saved gradient becomes the sum, the others
    # recompute their pass into it
    "gpipe": [("F", 0, "into"), ("F", 1, "into"), ("F", 2, "into"), ("B", 2, "into"), ("B", 1, "into"),
              ("B", 0, "into")],
    # a forward added into the sum whose saved pass is lost to a later forward: its backward recomputes
    # without adding the head's gradient twice
    "lost": [("F", 0, "into"), ("B", 0, "into"), ("F", 1, "into"), ("F", 2, "plain"), ("B", 1, "into"),
             ("B", 2, "into")],
    # zero-bubble's B then W (the head's gradient comes with B)
    "split": [("F", 0, "into"), ("B", 0, "split"), ("F", 1, "into"), ("B", 1, "split"), ("F", 2, "into"),
              ("B", 2, "split")],
}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = export_causal_lm(random_causal_lm("llama", vocab_size=4096, num_hidden_layers=1),
                            tmp_path_factory.mktemp("mnn-head-sum") / "m.onnx", LlmExportOptions(), kv_cache=False)
    return load_model(path, 2, 16)


def _feeds(spec, graph, m: int, vocab: int = 4096) -> dict[str, np.ndarray]:
    feeds = lm_feeds(m, 2, 16, vocab)
    if spec.activation_input:
        feeds[spec.activation_input] = np.random.default_rng(10 + m).standard_normal(
            graph.values[spec.activation_input].shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("blocks", ["head+loss", "whole"])
def test_the_summed_gradient_is_the_sum_of_each_microbatchs_in_float64(graph, blocks, order):
    """Three micro-batches summed by the MNN engine (the head's part added in place from the second on; on
    the whole model the tied table's lookup rows added after it) against each micro-batch's own gradients
    from PyTorch in float64, added up: float32's rounding apart, equal; a head gradient added twice or
    left out is off by the whole of one micro-batch's."""
    n = len(graph.blocks)
    spec = stage_spec(graph, *((n - 2, n - 1) if blocks == "head+loss" else (0, n - 1)))
    engine, ref = MnnStageEngine(spec), TorchStageEngine(spec, dtype=torch.float64)
    engine.row_gradients = ref.row_gradients = True
    engine.split_backward = order == "split"
    summed, want = {}, {}
    for kind, m, how in ORDERS[order]:
        if kind == "F" and how == "into":
            engine.forward_into(_feeds(spec, graph, m), m, summed)
        elif kind == "F":
            engine.forward(_feeds(spec, graph, m), m)
        elif how == "split":
            result = engine.backward_input_into(m, summed)
            accumulate(summed, result.params)
            engine.backward_weight_into(m, summed)
        else:
            engine.backward_into(m, summed)
    for m in range(3):
        ref.forward(_feeds(spec, graph, m), m)
        for k, g in ref.backward(m).params.items():
            want[k] = dense_gradient(g) + want[k] if k in want else dense_gradient(g).copy()
    assert HEAD in summed and set(summed) == set(want)
    for k in want:
        got = dense_gradient(summed[k]).astype(np.float64)
        np.testing.assert_allclose(got, want[k], rtol=1e-4, atol=1e-5 * np.abs(want[k]).max(), err_msg=k)


def test_no_second_head_sized_gradient_is_made_beside_the_sum(tmp_path):
    """A head of 32 MiB (vocabulary 32768 x hidden 256, float32) trained on MNN by the trainer's gradient
    accumulation (`tasks.trainer.accumulate_feeds`, as a pipeline stage sums): two micro-batches peak less
    than half the head's size above one micro-batch's peak (each from the level before it, measured in
    this process). Each forward made the head's gradient a new array, the second beside the sum: +32 MiB
    and more."""
    vocab, hidden = 32768, 256
    big, spec = big_head_stage(tmp_path, vocab, hidden)
    engine = MnnStageEngine(spec, threads=1)
    head_bytes = vocab * hidden * 4
    feeds = [_feeds(spec, big, m, vocab) for m in range(2)]
    rises = []
    with gc_frozen():
        accumulate_feeds(engine, feeds[:1])  # first use: MNN's and numpy's heap in
        for count in (1, 2):
            release_free_heap()
            level = status_bytes("VmRSS")
            if level is None or not reset_peak_rss():
                pytest.skip("needs /proc/self/status and clear_refs (Linux)")
            _, grads = accumulate_feeds(engine, feeds[:count])
            assert grads[HEAD].nbytes == head_bytes
            rises.append(status_bytes("VmHWM") - level)
            del grads
    one, two = rises
    assert two - one < head_bytes // 2, (f"two micro-batches {two / 2**20:.1f} MiB above the level, one "
                                         f"{one / 2**20:.1f}, for a {head_bytes / 2**20:.0f} MiB head")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_executor_adds_into_the_sum_only_from_forwards_whose_backward_comes_before_the_update(name):
    """`summed_forwards` against the lists themselves: an F is in it exactly when the stage's list has its
    micro-batch's B after it with no UPDATE between, at every place the F occurs (several steps' lists
    included); and the last stage's forwards under 1F1B are all there (its peak's case)."""
    for update_every in {"1f1b-stash": (1, 2), "2bw": (3, 6)}.get(name, (1,)):
        schedule = make_schedule(name, 3, 6, update_every=update_every)
        for s, row in enumerate(schedule.for_steps(2).actions if name in ("1f1b-stash", "2bw") else schedule.actions):
            row = list(row)
            ok = {}
            for i, a in enumerate(row):
                if a.kind is ActionKind.F:
                    j = next(j for j in range(i + 1, len(row))
                             if row[j].kind in (ActionKind.B, ActionKind.UPDATE) and
                             (row[j].kind is ActionKind.UPDATE or row[j].microbatch == a.microbatch))
                    ok[a] = ok.get(a, True) and row[j].kind is ActionKind.B
            got = summed_forwards(row)
            assert set(got) == {a for a, yes in ok.items() if yes}, (name, update_every, s)
            if name in ("1f1b-flush", "zb-h1") and s == 2:
                assert len(got) == 6


@pytest.fixture(scope="module")
def big_head(tmp_path_factory):
    """A one-layer Llama with a 32 MiB head (vocabulary 32768 x hidden 256, float32) and its head + loss
    stage's spec."""
    return big_head_stage(tmp_path_factory.mktemp("mnn-big-head"), 32768, 256)


def _last_stage_step(engine, name: str, feeds) -> None:
    """One step of the last of two stages under schedule `name` (3 micro-batches) as the executor runs
    it: `forward_into` the running sum for the forwards `summed_forwards` picks, each backward into it."""
    row = [a for a in make_schedule(name, 2, 3).actions[1] if a.kind in (ActionKind.F, ActionKind.B)]
    summed, grads = set(summed_forwards(row)), {}
    for a in row:
        if a.kind is ActionKind.B:
            engine.backward_into(a.microbatch, grads)
        elif a in summed:
            engine.forward_into(feeds[a.microbatch], a.microbatch, grads)
        else:
            engine.forward(feeds[a.microbatch], a.microbatch)
    assert grads[HEAD].nbytes == 32768 * 256 * 4


@pytest.mark.parametrize("activations", ["keep", "recompute"])
def test_gpipe_holds_no_more_head_gradients_than_1f1b(big_head, activations):
    """GPipe's last stage runs all its forwards before any backward: each forward starts or adds into the
    running sum (`MnnStageEngine.forward_into`), so its step peaks less than half the head's size above
    1F1B-flush's (one forward before each backward), each above the level before it, measured in this
    process with the engine built as a worker builds it. Where a forward with no sum yet made the head's
    gradient a new array, keeping (a set of graphs per micro-batch in flight, each loss keeping its
    forward's pass) held one per forward (+2 heads over 1F1B at 3 micro-batches; 4.3 heads above the
    level against 1.3 at 4, helper h142) and recomputing two at once (the next forward's made while the
    last one's was still saved: +1 head)."""
    big, spec = big_head
    engine = make_engine(parse_backend("mnn:cpu:t1"), spec, activations=activations)
    engine.row_gradients = True
    head_bytes = 32768 * 256 * 4
    feeds = [_feeds(spec, big, m, 32768) for m in range(3)]
    rises = {}
    with gc_frozen():
        for name in ("1f1b-flush", "gpipe"):  # first use: MNN's and numpy's heap in, graph sets built
            _last_stage_step(engine, name, feeds)
        for name in ("1f1b-flush", "gpipe"):
            release_free_heap()
            level = status_bytes("VmRSS")
            if level is None or not reset_peak_rss():
                pytest.skip("needs /proc/self/status and clear_refs (Linux)")
            _last_stage_step(engine, name, feeds)
            rises[name] = status_bytes("VmHWM") - level
    mib = {k: round(v / 2**20, 1) for k, v in rises.items()}
    assert rises["gpipe"] - rises["1f1b-flush"] < head_bytes // 2, (
        f"MiB above the level: {mib}, for a {head_bytes / 2**20:.0f} MiB head")
