"""`confidant train-pipeline --task seq-cls|causal-lm` (jobs.train.pipeline_tasks): the job over real worker
processes trains as `train-local` does on the same data, seed and batch (the pipeline cuts each batch
into micro-batches; every task's loss is normalised by the whole batch, so the step losses agree),
and the task's metric comes back. The causal LM is a tiny random Llama with SmolLM2's tokenizer,
whose tied embedding sits on the first and the last stage."""
from __future__ import annotations

import os
import weakref
from dataclasses import replace

import numpy as np
import pytest

from jobs.train.local import train_local
from jobs.train.pipeline import train_pipeline_job
from jobs.common.errors import JobError
from jobs.common.settings import PipelineSettings, TrainingSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _losses(metrics) -> list[float]:
    return [s.loss for s in metrics.steps]


@pytest.fixture(scope="module")
def seqcls_model(tmp_path_factory, tokenizer_path):
    """A 2-layer BERT sequence classifier (3 labels) with the MiniLM tokenizer's vocabulary, and the
    generated review task."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from jobs.export.encoder import ExportOptions, export_model
    from tasks.seqcls.data import write_review_splits

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    root = tmp_path_factory.mktemp("seqcls-pipe")
    model = export_model(BertForSequenceClassification(config).eval(), root / "cls.onnx",
                         ExportOptions(num_labels=3, task="seq-cls"))
    train, dev = write_review_splits(root / "data", n_train=64, n_dev=16)
    return model, train, dev


def test_seq_cls_pipeline_trains_as_one_device_does(seqcls_model):
    model, train, dev = seqcls_model
    settings = TrainingSettings(steps=3, batch=8, seq=32, lr=1e-3, seed=0)
    one = train_local(model, train, dev, settings, task="seq-cls")
    pipe = train_pipeline_job(model, train, dev, settings, PipelineSettings(microbatches=2), local=2, task="seq-cls")
    np.testing.assert_allclose(_losses(pipe), _losses(one), rtol=1e-4)
    assert pipe.eval.metric == "accuracy" and 0.0 <= pipe.eval.after <= 1.0
    assert pipe.eval.after == pytest.approx(one.eval.after, abs=1 / 16 + 1e-9)
    assert pipe.settings["task"] == "seq-cls"


@pytest.mark.slow  # worker processes; threads twin: test_tied_pipeline
def test_causal_lm_pipeline_with_a_tied_head_trains_as_one_device_does(chat_llama, tmp_path):
    path, train, dev = chat_llama
    settings = TrainingSettings(steps=3, batch=4, seq=128, lr=3e-3, seed=0, eval_limit=2)
    one = train_local(path, train, None, settings, task="causal-lm")
    notes = []

    class Notes:
        def note(self, text):
            notes.append(text)

        def start(self, *a, **k):
            pass

        def step(self, *a, **k):
            pass

    pipe = train_pipeline_job(path, train, dev, settings, PipelineSettings(microbatches=2, checkpoint=tmp_path / "c"),
                              local=3, task="causal-lm", reporter=Notes())
    np.testing.assert_allclose(_losses(pipe), _losses(one), rtol=1e-4)
    assert any("held by several stages (model.embed_tokens.weight)" in n for n in notes), notes
    assert pipe.eval.metric == "exact_match" and pipe.eval.perplexity > 1.0
    assert (tmp_path / "c" / "meta.json").is_file()
    # resuming checks the task
    with pytest.raises(JobError, match="checkpoint has task='causal-lm', this run 'ner'"):
        from jobs.train.pipeline import _resumed

        _resumed(tmp_path / "c", {"model": "m.onnx", "task": "ner"}, 3)


@pytest.mark.slow  # the SmolLM2-tokenizer export; threads twin: test_tied_pipeline
def test_causal_lm_pipeline_refuses_1f1b_stash_through_the_tied_head(chat_llama):
    path, train, _ = chat_llama
    settings = TrainingSettings(steps=1, batch=4, seq=128, seed=0)
    with pytest.raises(JobError, match=r"1f1b-stash cannot train weights tied across stages \(1 of them, e\.g\. "
                                       r"'model\.embed_tokens\.weight'"):
        train_pipeline_job(path, train, None, settings, PipelineSettings(schedule="1f1b-stash", microbatches=2),
                           local=2, task="causal-lm")


def _two_device_plan(model, batch: int, seq: int, budget: str, tmp_path):
    """`model` profiled here at micro-batch batch/2, planned 1f1b-flush over two such devices cut at
    block 2, bundles signed: (the plan folder, the coordinator's keys folder)."""
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from jobs.common.workers import coordinator_pair
    from runtime.keys import signer

    _, profile = profile_this_device(model, batch // 2, seq, tmp_path / "dev.json", name="dev",
                                     backends=("mnn:cpu:t1",), reps=1, attention=False)
    (tmp_path / "cluster.yaml").write_text(
        "devices:\n"
        f"  - {{name: a, address: 'tcp://127.0.0.1:5901', profile: {profile.name}, memory_budget: {budget}}}\n"
        f"  - {{name: b, address: 'tcp://127.0.0.1:5902', profile: {profile.name}, memory_budget: {budget}}}\n"
        "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    keys = tmp_path / "keys"
    plan = plan_model(model, tmp_path / "cluster.yaml", PlanSettings("1f1b-flush", batch, seq, 2, cuts=(2,)),
                      tmp_path / "plan", sign=signer(coordinator_pair(keys)))
    return plan, keys


def _train_plan(plan, train, dev, keys):
    """`confidant train PLAN --local` for 3 steps (seed 0)."""
    from jobs.train.from_plan import PlanRunSettings, train_from_plan

    return train_from_plan(plan, train, dev, PlanRunSettings(steps=3, seed=0, local=True, keys=keys))


@pytest.fixture(scope="module")
def decoder_plan(chat_llama, tmp_path_factory):
    """The tiny Llama's two-device plan (`_two_device_plan` at 4 x 128, 2 GiB each), profiled and planned
    once for the module: the tests below train from it and read it, none writes into it."""
    return _two_device_plan(chat_llama[0], 4, 128, "2GiB", tmp_path_factory.mktemp("decoder-plan"))


@pytest.mark.slow  # profile, plan (the module's) and worker processes
def test_a_decoder_plan_trains_from_its_bundles_as_one_device_does(chat_llama, decoder_plan):
    """profile -> plan (the tokenizer copied beside the plan, bundles signed) -> `confidant train PLAN`
    on local workers: the step losses of train-local, and the dev perplexity."""
    path, train, dev = chat_llama
    plan, keys = decoder_plan
    assert (plan / "tokenizer.json").is_file() and (plan / "chat_template.json").is_file()
    metrics = _train_plan(plan, train, dev, keys)
    one = train_local(path, train, None, TrainingSettings(steps=3, batch=4, seq=128, lr=5e-5, seed=0),
                      task="causal-lm")
    np.testing.assert_allclose(_losses(metrics), _losses(one), rtol=1e-4)
    assert metrics.eval.metric == "perplexity" and metrics.eval.perplexity > 1.0


@pytest.mark.slow  # profile, plan (the module's) and worker processes
def test_a_decoder_plans_perplexity_is_scored_on_its_workers(chat_llama, decoder_plan, tmp_path, monkeypatch):
    """`confidant train PLAN` of a causal LM scores the dev perplexity on the workers (issue 32): this
    process builds no engine of the model, and the figure is one whole-model engine's over the
    checkpoint's weights (what the coordinator computed before), to 1e-5."""
    import runtime.engines.factory as factory
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from planner.onnx_import import load_model
    from runtime.pipeline.checkpoints import load_checkpoint
    from tasks.causal_lm.evaluation import engine_nll
    from tasks.causal_lm.task import CAUSAL_LM

    path, train, dev = chat_llama
    plan, keys = decoder_plan

    def refused(*args, **kwargs):
        raise AssertionError("the coordinator built an engine to evaluate")

    monkeypatch.setattr(factory, "whole_model_engine", refused)
    metrics = train_from_plan(plan, train, dev, PlanRunSettings(steps=2, seed=0, local=True, keys=keys,
                                                                checkpoint=tmp_path / "c"))
    monkeypatch.undo()
    _, weights, _ = load_checkpoint(tmp_path / "c")
    graph = load_model(path, 4, 128, loss=CAUSAL_LM.loss)
    engine = factory.whole_model_engine(graph, "mnn", 1, weights={**graph.constants, **weights}, cache_activations=False)
    run = CAUSAL_LM.read_data(path, train, dev, 128)
    want = engine_nll(engine, CAUSAL_LM.dev_batches(run, 4), 4, run.pad_id).perplexity
    assert metrics.eval.metric == "perplexity" and metrics.eval.perplexity == pytest.approx(want, rel=1e-5)


@pytest.mark.slow  # worker processes, three runs
def test_a_causal_lm_pipeline_resumes_exactly_and_replans(chat_llama, tmp_path):
    """Checkpoint after 2 steps then --resume for 2 more gives the 4-step run's losses bit for bit;
    a re-plan mid-run (every 2 steps, any gain) moves the tied table's holder and keeps the losses."""
    path, train, _ = chat_llama
    settings = TrainingSettings(steps=4, batch=4, seq=128, lr=3e-3, seed=0)
    whole = train_pipeline_job(path, train, None, settings, PipelineSettings(microbatches=2), local=2,
                               task="causal-lm")
    first = train_pipeline_job(path, train, None, replace(settings, steps=2),
                               PipelineSettings(microbatches=2, checkpoint=tmp_path / "c"), local=2, task="causal-lm")
    rest = train_pipeline_job(path, train, None, replace(settings, steps=2),
                              PipelineSettings(microbatches=2, resume=tmp_path / "c"), local=2, task="causal-lm")
    assert _losses(first) + _losses(rest) == _losses(whole)
    moved = train_pipeline_job(path, train, None, settings,
                               PipelineSettings(microbatches=2, replan_every=2, replan_threshold=0.0), local=3,
                               task="causal-lm")
    assert moved.replans and moved.replans[0]["step"] == 2
    np.testing.assert_allclose(_losses(moved), _losses(whole), rtol=1e-5)


@pytest.mark.slow  # profile, plan and worker processes
def test_a_sequence_classifier_plan_trains_from_its_bundles_as_one_device_does(seqcls_model, tmp_path):
    model, train, dev = seqcls_model
    plan, keys = _two_device_plan(model, 8, 32, "1GiB", tmp_path)
    metrics = _train_plan(plan, train, dev, keys)
    one = train_local(model, train, dev, TrainingSettings(steps=3, batch=8, seq=32, lr=5e-5, seed=0), task="seq-cls")
    np.testing.assert_allclose(_losses(metrics), _losses(one), rtol=1e-4)
    assert metrics.eval.metric == "accuracy" and metrics.eval.after == pytest.approx(one.eval.after, abs=1 / 16)


def test_plan_with_seq_cls_data_counts_the_rows_it_looks_up(seqcls_model, tmp_path):
    """`plan --data` reads a classification file as `train` will (the same task code): the word
    table's rows are the distinct token ids of the encoded sentences (and padding)."""
    import json

    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from jobs.planning import PlanSettings, plan_model
    from planner.onnx_import import load_model
    from tasks.seqcls.data import load_seqcls_data

    model, train, _ = seqcls_model
    graph = load_model(model, 4, 32)
    costs = {block_signature(b): BlockCost(0.01, 0.02, workspace_bytes=1 << 20) for b in graph.blocks}
    DeviceProfile("box", graph.name, 4, 32, (BackendProfile("mnn:cpu:t1", costs),), 8 << 30).save(tmp_path / "p.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
        {"name": "box", "address": "tcp://127.0.0.1:1", "profile": "p.json", "memory_budget": "4GiB"}]}))
    settings = PlanSettings(batch=8, seq=32, microbatches=2, data=train)
    plan = json.loads((plan_model(model, tmp_path / "cluster.json", settings, tmp_path / "plan") / "plan.json").read_text())
    encoded = load_seqcls_data(train, None, 32, None).train_encoded
    ids = {int(i) for e in encoded for i in np.asarray(e.input_ids).reshape(-1)} | {0}  # + the padding id
    assert plan["lookup_rows"] == {"inner.bert.embeddings.word_embeddings.weight": len(ids)}


@pytest.mark.slow  # worker processes, two runs
@pytest.mark.parametrize("engine, lora", [("mnn", None), ("torch", 4)])
def test_a_causal_lm_pipeline_is_evaluated_on_its_workers(chat_llama, tmp_path, monkeypatch, engine, lora):
    """train-pipeline --task causal-lm scores the trained model on the workers before they stop
    (issue 32: the coordinator holds none of the model's weights): this process builds no engine
    and opens no ONNX Runtime session, and the figures are those of the coordinator's evaluation
    before (`lm_scores` on the trained weights: ONNX Runtime's greedy answers, one engine's
    perplexity): the same generated answers, the perplexity to 1e-5."""
    import jobs.train.causal_lm as causal_lm
    import runtime.engines.factory as factory
    import tasks.causal_lm.evaluation as evaluation
    import tasks.causal_lm.generate as generate
    from planner.lora import LoraSettings
    from runtime.pipeline.checkpoints import load_checkpoint

    path, train, dev = chat_llama
    settings = TrainingSettings(steps=2, batch=4, seq=128, lr=3e-3, seed=0, eval_limit=2, engine=engine,
                                lora=None if lora is None else LoraSettings(lora))
    answered, real_evaluate = [], evaluation.evaluate_instructions

    def refused(*args, **kwargs):
        raise AssertionError("the coordinator built an engine or a session to evaluate")

    def evaluate(*args, **kwargs):
        scores = real_evaluate(*args, **kwargs)
        answered.append(scores)
        return scores

    for module, name in ((factory, "make_engine"), (factory, "whole_model_engine"), (causal_lm, "make_engine"),
                         (generate, "_session")):
        monkeypatch.setattr(module, name, refused)
    monkeypatch.setattr(evaluation, "evaluate_instructions", evaluate)
    pipe = train_pipeline_job(path, train, dev, settings,
                              PipelineSettings(microbatches=2, checkpoint=tmp_path / "c", insecure=True), local=3,
                              task="causal-lm")
    monkeypatch.undo()
    (scores,) = answered
    _, weights, _ = load_checkpoint(tmp_path / "c")
    run = causal_lm.lm_data(path, train, dev, settings)
    perplexity, before = causal_lm.lm_scores(path, settings, dev, run.dev_rows, weights)
    assert scores.predictions == before.predictions and len(scores.predictions) == 2
    assert pipe.eval.after == before.exact_match and pipe.eval.metric == "exact_match"
    assert pipe.eval.perplexity == pytest.approx(perplexity, rel=1e-5)


def test_a_pipelines_lm_evaluation_builds_its_engines_after_generating_a_block_range_at_a_time(chat_llama,
                                                                                                 monkeypatch):
    """The causal LM's evaluation after pipeline training (jobs.train.causal_lm.lm_scores) generates on
    ONNX Runtime before it builds any engine for the perplexity, so the sessions and an engine's copy
    of the model are never held at once (SmolLM2 LoRA: 2393 MiB at the peak with the engine built
    first, 2053 after; FAULTS.md), and runs the perplexity a block range at a time, each range's
    engine let go before the next is built (the whole model's engine: 1057 MiB, against MNN workers of
    600); the perplexity is that of one engine of the whole model."""
    import jobs.common.onnx_lm as onnx_lm
    import jobs.train.causal_lm as causal_lm

    path, train, dev = chat_llama
    settings = TrainingSettings(steps=1, batch=4, seq=128, seed=0, eval_limit=2)
    run = causal_lm.lm_data(path, train, dev, settings)
    graph, _ = causal_lm.lm_graph(path, settings)
    weights = {p: np.array(graph.constants[p]) * 1.01 for p in graph.params}  # "trained" weights
    order, real_engine, real_generate = [], causal_lm.make_engine, onnx_lm.evaluate_lm
    alive = []

    def engine(backend, spec, **kwargs):
        alive[:] = [e for e in alive if e() is not None]
        order.append(("engine", spec.first_block, spec.last_block, len(alive)))
        built = real_engine(backend, spec, **kwargs)
        alive.append(weakref.ref(built))
        return built

    def generate(*args, **kwargs):
        order.append(("generate",))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(causal_lm, "make_engine", engine)
    monkeypatch.setattr(onnx_lm, "evaluate_lm", generate)
    monkeypatch.setattr(causal_lm, "EVAL_RANGES", 3)
    perplexity, scores = causal_lm.lm_scores(path, settings, dev, run.dev_rows, weights)
    n = len(graph.blocks)
    assert order[0] == ("generate",)
    assert [o[1:3] for o in order[1:]] == [tuple(r) for r in causal_lm.even_ranges(n, 3)]
    assert all(o[3] == 0 for o in order[1:])  # the range before it let go
    first = causal_lm.whole_model_engine(graph, "mnn", settings.threads, weights=weights, cache_activations=False)
    batches = causal_lm.make_lm_batches(run.dev_rows, settings.batch, settings.seq, run.pad_id or 0, shuffle=False)
    assert perplexity == pytest.approx(causal_lm.engine_nll(first, batches, settings.batch, run.pad_id or 0).perplexity,
                                       rel=1e-6)
    assert 0.0 <= scores.exact_match <= 1.0


def test_a_pipelines_lm_evaluation_generates_on_one_session_with_no_packed_copy(chat_llama, monkeypatch):
    """The evaluation after pipeline training (jobs.train.causal_lm.lm_scores) opens one ONNX Runtime
    session, the key/value-cache graph's, with no pre-packed copy of the weights: the perplexity is the
    engine's, so the whole-sequence graph (a second copy of every weight) and its [B, S, V] logits are
    never loaded beside it (SmolLM2 LoRA: the coordinator's peak 2072 MiB with both, 1081 with one,
    against a largest worker of 1285; FAULTS.md). Its answers are those of the default sessions'."""
    import jobs.train.causal_lm as causal_lm
    import tasks.causal_lm.generate as generate
    from jobs.common.onnx_lm import evaluate_lm

    path, train, dev = chat_llama
    settings = TrainingSettings(steps=1, batch=4, seq=128, seed=0, eval_limit=2)
    run = causal_lm.lm_data(path, train, dev, settings)
    graph, _ = causal_lm.lm_graph(path, settings)
    weights = {p: np.array(graph.constants[p]) * 1.01 for p in graph.params}  # "trained" weights
    opened, real_session = [], generate._session

    def session(model, *args, **kwargs):
        made = real_session(model, *args, **kwargs)
        opened.append((model.name, made[0].get_session_options().get_session_config_entry(
            "session.disable_prepacking") if _has_entry(made[0], "session.disable_prepacking") else "0"))
        return made

    monkeypatch.setattr(generate, "_session", session)
    perplexity, scores = causal_lm.lm_scores(path, settings, dev, run.dev_rows, weights)
    assert opened == [(path.with_suffix(".kv.onnx").name, "1")]
    assert scores.perplexity is None and np.isfinite(perplexity)
    monkeypatch.setattr(generate, "_session", real_session)
    initializers = causal_lm.generation_weights(path, graph, weights, (), 1.0)
    default = evaluate_lm(path, dev, generate.GenerationSettings(max_new_tokens=causal_lm.ANSWER_TOKENS),
                          batch=8, limit=2, threads=settings.threads, initializers=initializers)
    assert scores.predictions == default.predictions and scores.exact_match == default.exact_match


def _has_entry(session, key: str) -> bool:
    try:
        session.get_session_options().get_session_config_entry(key)
    except Exception:  # onnxruntime raises when the entry was never set
        return False
    return True
