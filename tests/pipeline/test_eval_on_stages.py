"""A causal LM's evaluation on the pipeline's stages after training (issue 32: the coordinator need not
hold the model's weights to score them): `Coordinator.forward_only` runs micro-batches forward only
through the workers' engines, which hold the trained weights; the last stage returns each
micro-batch's loss (the dev perplexity, `staged_nll`), or the stage holding the LM head each row's
greedy next token (`StagedGreedyLM`). Independent references: ONNX Runtime's greedy generation with
a key/value cache over the exported file with the trained weights (the same tokens), and one engine
of the whole model for the perplexity (to 1e-5). In-process workers, both engines, a tied head on
the first and the last of three stages; the job over worker processes is
tests/jobs/test_pipeline_tasks.py::test_a_causal_lm_pipeline_is_evaluated_on_its_workers."""
from __future__ import annotations

import numpy as np
import pytest

from jobs.train.pipeline import FaultPolicy, train_pipeline
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from support import lm_step_feeds

ROWS, SEQ, STEPS, NEW = 2, 32, 2, 10


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(3, 14, n)]


@pytest.mark.parametrize("engine", ["mnn", "torch"])
def test_the_stages_score_and_generate_as_onnx_runtime_and_one_engine_do(chat_llama, engine):
    from jobs.train.causal_lm import generation_weights
    from planner.onnx_import import load_model
    from runtime.engines.factory import whole_model_engine
    from tasks.causal_lm.data import LmExample, make_lm_batches
    from tasks.causal_lm.evaluation import StagedGreedyLM, engine_nll, staged_nll
    from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM
    from tasks.causal_lm.task import CAUSAL_LM

    path, _, _ = chat_llama
    graph = load_model(path, ROWS, SEQ, loss=CAUSAL_LM.loss)
    vocab = int(graph.constants["model.embed_tokens.weight"].shape[0])
    prompts = _prompts(5, vocab)  # 5 rows: three micro-batches, the last one short
    rng = np.random.default_rng(3)
    dev_rows = [LmExample.of(p + rng.integers(0, vocab, 6).tolist(), [False] * len(p) + [True] * 6) for p in prompts]
    settings = GenerationSettings(max_new_tokens=NEW)
    head = len(graph.blocks) - 2

    def evaluate(coordinator):
        nll = staged_nll(coordinator.forward_only, dev_rows, ROWS, SEQ)

        def staged(**kw):
            return StagedGreedyLM(lambda feeds, at: coordinator.forward_only(feeds, at, until_block=head), ROWS, SEQ,
                                  **kw)

        lm = staged(draft=None)  # one token a pass
        plain = lm.generate(prompts, settings)
        short = lm.generate([prompts[0]], GenerationSettings(max_new_tokens=3), stop_ids=[])

        def continuation_of(j: int, sequence, limit: int) -> list[int]:
            """Row j's greedy tokens after `sequence` (whose first part is some prompt), wherever it is."""
            for p in prompts:
                if sequence[:len(p)] == p:
                    done = len(sequence) - len(p)
                    return plain[j][done:done + limit]
            raise AssertionError("a sequence that starts with no prompt")

        # drafts checked by the stages: the right continuation, another row's, and copied from the row itself
        oracle = staged(draft=lambda sq, limit: continuation_of(next(j for j, p in enumerate(prompts)
                                                                          if sq[:len(p)] == p), sq, limit))
        other = staged(draft=lambda sq, limit: continuation_of((next(j for j, p in enumerate(prompts)
                                                                     if sq[:len(p)] == p) + 1) % len(prompts),
                                                                sq, limit))
        lookup = staged()
        drafted = {name: (m.generate(prompts, settings), m) for name, m in
                   (("oracle", oracle), ("other", other), ("lookup", lookup))}
        return nll, plain, short, lm, drafted

    config = PipelineConfig(schedule="1f1b-flush", microbatches=2, engine=engine, lr=3e-3, timeout_s=60)
    with InProcessWorkers(3, timeout_s=60) as workers:
        result = train_pipeline(graph, None, 0, workers.addresses, config, STEPS, transport=workers.coordinator,
                                feeds_of_step=lambda k: lm_step_feeds(k, ROWS, SEQ, 2, vocab=vocab),
                                faults=FaultPolicy("stop"), after_training=evaluate)
    nll, generated, short, lm, drafted = result.after_training
    assert lm.passes == NEW + 3 and lm.tokens == len(prompts) * NEW + 3 and result.after_training_s > 0

    trained = {**graph.constants, **result.weights}
    reference = OnnxCausalLM(path, generation_weights(path, graph, trained, (), 1.0), threads=1)
    assert reference.kv_unavailable is None  # the reference generates from its key/value cache
    assert generated == reference.generate(prompts, settings)
    assert short == [generated[0][:3]]
    # a drafted continuation changes the passes, never the tokens: the right one is all kept (one
    # pass), another row's is kept only where the argmax agrees with it
    for name, (tokens, m) in drafted.items():
        assert tokens == generated, name
    oracle, other = drafted["oracle"][1], drafted["other"][1]
    assert oracle.passes == 1 and oracle.accepted == oracle.drafted == len(prompts) * (NEW - 1)
    assert other.drafted > 0 and other.accepted < other.drafted and other.passes > 1

    whole = whole_model_engine(load_model(path, 4, SEQ, loss=CAUSAL_LM.loss), engine, 1, weights=trained,
                               cache_activations=False)
    one = engine_nll(whole, make_lm_batches(dev_rows, 4, SEQ, 0, shuffle=False), 4)
    assert nll.n_targets == one.n_targets == 30
    assert nll.perplexity == pytest.approx(one.perplexity, rel=1e-5)


def test_greedy_generation_through_stages_stops_at_a_stop_id_and_at_the_graphs_length():
    """`StagedGreedyLM` on a stand-in forward (the next token is the last one + 1): a row ends at a
    stop id (kept), after max_new_tokens, or when it fills the graph's positions; finished rows
    leave the passes, a short micro-batch is filled with its first row."""
    from tasks.causal_lm.evaluation import StagedGreedyLM
    from tasks.causal_lm.generate import GenerationSettings

    calls = []

    def next_tokens(feeds, positions):
        calls.append(len(feeds))
        out = []
        for f, at in zip(feeds, positions):
            assert f["input_ids"].shape == (2, 8) and not f["target_weights"].any()
            assert at.shape == (2, 1)  # nothing recurs in these rows: nothing drafted
            assert (f["attention_mask"].sum(axis=1) == at[:, 0] + 1).all()
            out.append(f["input_ids"][np.arange(2)[:, None], at] + 1)
        return out

    lm = StagedGreedyLM(next_tokens, rows=2, seq=8)
    got = lm.generate([[1, 2], [10], [20, 21, 22, 23, 24, 25, 26], [5] * 8], GenerationSettings(max_new_tokens=5),
                      stop_ids=[4])
    assert got == [[3, 4], [11, 12, 13, 14, 15], [27], []]
    assert calls == [2, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="greedy only"):
        lm.generate([[1]], GenerationSettings(temperature=0.5))


@pytest.mark.parametrize("engine,base", [("mnn", "float32"), ("torch", "float32"), ("mnn", "int4"),
                                         ("torch", "int4")])
def test_an_engines_logits_at_chosen_positions_are_its_whole_logits_there(chat_llama, engine, base):
    """`StageEngine.logits_at` (what the LM head's stage argmaxes in generation on the workers): the
    logits of each row at its position, those of the whole [rows, S, V] output of
    `forward(until_block=head)`; MNN's head fused with its loss projects those rows only."""
    from planner.onnx_import import load_model
    from runtime.engines.factory import whole_model_engine
    from runtime.engines.stage import fused_lm_head
    from tasks.causal_lm.task import CAUSAL_LM
    from support import lm_step_feeds

    path, _, _ = chat_llama
    graph = load_model(path, ROWS, SEQ, loss=CAUSAL_LM.loss)
    if base == "int4":  # LoRA over a base held int4, the tied head among it (`--base-dtype int4`)
        from ir.precision import QuantizedTensor
        from planner.lora import LoraSettings, add_lora

        graph, _ = add_lora(graph, LoraSettings(4, 8.0, targets=("q", "v"), base_dtype="int4"))
        assert isinstance(graph.constants[fused_lm_head(graph, 0, len(graph.blocks) - 1).weight], QuantizedTensor)
    stage = whole_model_engine(graph, engine, 1, cache_activations=False)
    head = len(graph.blocks) - 2
    assert stage._lm is not None and stage._lm.head_index == head  # the fused path is the one tested
    feeds = lm_step_feeds(0, ROWS, SEQ, 1, vocab=256)[0]
    whole = np.asarray(stage.forward(feeds, train=False, until_block=head))
    vocab = whole.shape[-1]
    for at in (np.array([SEQ - 1, 5]), np.array([[3, 4, 5], [SEQ - 1, 0, 0]])):
        shapes = []
        if engine == "torch":  # every tensor the forward makes, seen from PyTorch's dispatcher
            from torch.utils._python_dispatch import TorchDispatchMode

            class Sizes(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    out = func(*args, **(kwargs or {}))
                    for t in out if isinstance(out, (tuple, list)) else [out]:
                        if hasattr(t, "shape"):
                            shapes.append(tuple(t.shape))
                    return out

            with Sizes():
                got = stage.logits_at(feeds, head, at)
            # the head's projection of the chosen rows only, never the whole [rows, S, V] logits
            assert at.shape + (vocab,) in shapes
            assert (ROWS, SEQ, vocab) not in shapes
        else:
            got = stage.logits_at(feeds, head, at)
        assert got.shape == at.shape + (vocab,)
        np.testing.assert_allclose(got, whole[np.arange(ROWS).reshape(-1, *[1] * (at.ndim - 1)), at],
                                   rtol=1e-5, atol=1e-5)


def test_a_drafted_continuation_gives_the_tokens_of_one_pass_a_token_in_fewer_passes():
    """`StagedGreedyLM` with `lookup_draft` on a stand-in causal forward whose greedy sequence cycles
    (the next token is (the last one + 1) mod 4, but 9 after 9): the drafts copied from earlier in
    the row are checked at their positions, the tokens those of one pass a token, in fewer passes;
    a stop id inside an accepted draft ends the row there, and no row passes max_new_tokens or the
    graph's length."""
    from tasks.causal_lm.evaluation import StagedGreedyLM, answer_index, lookup_draft
    from tasks.causal_lm.generate import GenerationSettings

    def next_tokens(feeds, positions):
        out = []
        for f, at in zip(feeds, positions):
            ids = f["input_ids"]
            assert at.ndim == 2 and (at < f["attention_mask"].sum(axis=1)[:, None]).all()
            last = ids[np.arange(len(ids))[:, None], at]
            out.append(np.where(last == 9, 9, (last + 1) % 4))
        return out

    prompts = [[0, 1, 2, 3, 0], [9], [2, 3], [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    settings = GenerationSettings(max_new_tokens=12)
    one = StagedGreedyLM(next_tokens, rows=2, seq=16, draft=None)
    drafted = StagedGreedyLM(next_tokens, rows=2, seq=16)
    for stop in ([], [3]):
        want = one.generate(prompts, settings, stop)
        assert drafted.generate(prompts, settings, stop) == want
    assert want == [[1, 2, 3], [9] * 12, [0, 1, 2, 3], [3]]
    assert one.generate(prompts, settings)[0] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]  # the graph's 16 positions
    assert drafted.accepted > 0 and drafted.passes < one.passes
    assert lookup_draft([5, 1, 2, 7, 1, 2], 3) == [7, 1, 2] and lookup_draft([1, 2, 3], 4) == []
    # the training answers' n-grams as a second source: the row's own occurrence first, then the
    # longest n-gram an answer holds
    index = answer_index([[8, 1, 2, 6, 6], [2, 9]])
    assert lookup_draft([1, 2], 4, index=index) == [6, 6] and lookup_draft([4, 2], 1, index=index) == [6]
    assert lookup_draft([4, 9, 2], 4, index=index) == [6, 6] and lookup_draft([1, 2, 9], 4, index=index) == []
    assert lookup_draft([2, 5, 1, 2], 4, index=index) == [6, 6] and lookup_draft([2, 5, 2], 4, index=index) == [5, 2]
    answers = answer_index([[2, 3, 0, 1, 2, 3, 0, 1]])
    with_answers = StagedGreedyLM(next_tokens, rows=2, seq=16,
                                  draft=lambda sq, limit: lookup_draft(sq, limit, index=answers))
    own = StagedGreedyLM(next_tokens, rows=2, seq=16)
    eight = GenerationSettings(max_new_tokens=8)
    assert own.generate([[2]], eight) == with_answers.generate([[2]], eight) == [[3, 0, 1, 2, 3, 0, 1, 2]]
    assert with_answers.passes == 1 < own.passes
