"""A LoRA run's adapters out: exported in PEFT's format, loaded by peft onto the transformers model,
they give the logits of Confidant's trained model (the weights named by structure and value, since
the exporters rename them)."""
from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from jobs.common.errors import JobError
from jobs.export.adapter import export_adapter
from jobs.common.hf_names import hf_names
from jobs.train.pipeline import train_pipeline
from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.stage import stage_spec
from runtime.pipeline.coordinator import PipelineConfig
from runtime.pipeline.inprocess import InProcessWorkers
from support import M, ROWS, S, synthetic_batch, token_feeds

LORA = LoraSettings(4, 16.0, targets=("q", "k", "v", "o"), train_also=("head",), seed=2)


def _base_state(tiny_checkpoint):
    from jobs.export.encoder import load_token_classifier

    model = load_token_classifier(tiny_checkpoint, 9, seed=0)
    return model, {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("key", ["torchscript-17", "dynamo-18"])
def test_every_weight_finds_its_transformers_parameter(tiny_onnx, tiny_checkpoint, key):
    graph = load_model(tiny_onnx[key], ROWS, S)
    _, state = _base_state(tiny_checkpoint)
    floats = [p for p in graph.params if graph.constants[p].size > 1]
    names = hf_names(graph, state, floats)
    assert len({n.key for n in names.values()}) == len(floats)  # one parameter each
    for ir, hf in names.items():
        np.testing.assert_array_equal(hf.to_hf(graph.constants[ir]), state[hf.key], err_msg=ir)
    with pytest.raises(ValueError, match="cannot be placed in the transformers model"):
        hf_names(graph, {k: v + 1.0 for k, v in state.items()}, floats)


@pytest.fixture(scope="module")
def trained(tiny_onnx, tmp_path_factory):
    """Two 1f1b-flush steps of a LoRA model on 2 in-process workers, checkpointed."""
    model = tiny_onnx["torchscript-17"]
    graph, _ = add_lora(load_model(model, ROWS, S), LORA)
    folder = tmp_path_factory.mktemp("lora-ckpt")
    config = PipelineConfig(schedule="1f1b-flush", microbatches=M, optimizer="adamw", lr=1e-2, timeout_s=30)
    meta = {"model_path": str(model), "lora": asdict(LORA), "model": model.name}
    with InProcessWorkers(2, timeout_s=30) as workers:
        result = train_pipeline(graph, [synthetic_batch(i) for i in range(2)], 9, workers.addresses, config, 2,
                                transport=workers.coordinator, checkpoint_dir=folder, meta=meta)
    return model, folder, result


def test_the_exported_adapter_gives_confidants_logits_through_peft(tiny_checkpoint, trained, tmp_path):
    from peft import PeftModel

    model_path, folder, result = trained
    base, state = _base_state(tiny_checkpoint)
    out = export_adapter(folder, tmp_path / "adapter", state)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (4, 16.0, ["classifier"])
    assert len(config["target_modules"]) == 4 * 2  # q, k, v, o of both layers
    peft_model = PeftModel.from_pretrained(base, out).eval()
    feeds = token_feeds(ROWS, S, vocab=500, seed=4)
    with torch.no_grad():
        want = peft_model(input_ids=torch.tensor(feeds["input_ids"]),
                          attention_mask=torch.tensor(feeds["attention_mask"]),
                          token_type_ids=torch.tensor(feeds["token_type_ids"])).logits.numpy()
    graph, _ = add_lora(load_model(model_path, ROWS, S), LORA)
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **result.weights})
    got = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    assert float(np.abs(got - want).max()) <= 1e-4
    # the trained adapters matter: the base model alone gives other logits
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(input_ids=torch.tensor(feeds["input_ids"]),
                                 attention_mask=torch.tensor(feeds["attention_mask"]),
                                 token_type_ids=torch.tensor(feeds["token_type_ids"])).logits.numpy()
    assert float(np.abs(base_logits - want).max()) > 1e-3


def test_a_full_fine_tuning_checkpoint_is_refused(trained, tmp_path):
    _, folder, _ = trained
    meta = json.loads((folder / "meta.json").read_text())
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in folder.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    (plain / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "lora"}))
    with pytest.raises(JobError, match=r"holds LoRA adapters but its meta.json has no LoRA settings .*; train again "
                                       r"with --lora R --checkpoint DIR \(train-local or train-pipeline\)$"):
        export_adapter(plain, tmp_path / "out", {})
    (plain / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "lora"} | {"plan": "p"}))
    with pytest.raises(JobError, match=r"trained from the plan p, made before plans recorded them; re-plan with "
                                       r"`confidant plan MODEL --cluster FILE --lora R`"):
        export_adapter(plain, tmp_path / "out", {})
    full = tmp_path / "full"
    from runtime.pipeline.checkpoints import save_checkpoint

    save_checkpoint(full, [{"param/w": np.zeros(2, np.float32)}], {"step": 1, "stages": 1, "ranges": [[0, 3]]})
    with pytest.raises(JobError, match=r"a full fine-tuning run \(no adapters in it\): write the trained model with "
                                       r"`confidant export-trained .*full --hf DIR`"):
        export_adapter(full, tmp_path / "out", {})


def _lora_plan(model, settings: LoraSettings, tmp_path):
    """`model` planned with LoRA `settings` over two devices of a made-up profile, cut at block 2."""
    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from jobs.common.lora import adapted
    from jobs.planning import PlanSettings, plan_model

    graph = adapted(load_model(model, ROWS, S), settings)
    costs = {block_signature(b): BlockCost(0.01, 0.02, workspace_bytes=1 << 20) for b in graph.blocks}
    DeviceProfile("box", graph.name, ROWS, S, (BackendProfile("mnn:cpu:t1", costs),), 8 << 30).save(tmp_path / "p.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
        {"name": n, "address": f"tcp://127.0.0.1:{5900 + i}", "profile": "p.json", "memory_budget": "4GiB"}
        for i, n in enumerate(("a", "b"))], "links": {"default": {"bandwidth": "1Gbit/s", "latency": "0.2ms"}}}))
    return plan_model(model, tmp_path / "cluster.json", PlanSettings(batch=ROWS * M, seq=S, microbatches=M, cuts=(2,),
                                                                     lora=settings), tmp_path / "plan")


def test_a_lora_plan_records_its_settings_and_its_train_checkpoint_exports_an_adapter(tiny_onnx, tiny_checkpoint,
                                                                                       tmp_path):
    """plan.json records the LoRA settings (before: nothing, and `export-adapter` refused every
    checkpoint of `train PLAN`); the checkpoint meta of `train PLAN` carries them, and the adapter
    exported from it gives, through PEFT, the logits of the trained weights on the plan's graph.
    A plan.json without the field (full fine-tuning, or written before) still reads."""
    from types import SimpleNamespace

    from peft import PeftModel

    from ir.bundle import load_plan
    from ir.documents import PlanDocument, PlannedLora
    from jobs.export.adapter import export_adapter_for
    from jobs.train.from_plan import _checkpoint_meta
    from runtime.pipeline.checkpoints import save_checkpoint

    model = tiny_onnx["torchscript-17"]
    plan_dir = _lora_plan(model, LORA, tmp_path)
    doc = json.loads((plan_dir / "plan.json").read_text())
    assert doc["lora"] == {"rank": 4, "alpha": 16.0, "targets": ["q", "k", "v", "o"], "train_also": ["head"], "seed": 2}
    plan = load_plan(plan_dir)
    assert plan.lora == PlannedLora(4, 16.0, ("q", "k", "v", "o"), ("head",), 2)
    older = {k: v for k, v in doc.items() if k != "lora"}
    old = PlanDocument.from_json(older, "old")
    assert old.lora is None and "lora" not in old.to_json()
    with pytest.raises(ValueError, match=r"plan bad: lora is \{'rank': 0"):
        PlanDocument.from_json({**doc, "lora": {**doc["lora"], "rank": 0}}, "bad")
    # a re-plan (a device lost) writes a plan folder with the same settings and model file
    from jobs.common.lora import adapted
    from planner.emit import load_plan_cluster
    from planner.replan import PlanReplanner

    replanner = PlanReplanner(plan_dir, plan, adapted(load_model(model, ROWS, S), LORA), load_plan_cluster(plan_dir))
    again = load_plan(replanner.without(1, ["a"], {}).directory)
    assert (again.lora, again.model_path, again.device_names) == (plan.lora, plan.model_path, ["b"])

    meta = _checkpoint_meta(plan_dir, plan, SimpleNamespace(name="ner", labels=[f"L{i}" for i in range(9)]))
    assert meta["lora"] == doc["lora"] and meta["model_path"] == str(model.resolve())
    graph, _ = add_lora(load_model(model, ROWS, S), LORA)
    rng = np.random.default_rng(5)
    weights = {p: (graph.constants[p] + 0.1 * rng.standard_normal(graph.constants[p].shape)).astype(np.float32)
               for p in graph.params}  # as training moves them: B away from zero, the head
    ranges = [(d.first_block, d.last_block) for d in plan.devices]
    stage_of = {p: i for i, (a, b) in enumerate(ranges) for k in range(a, b + 1) for p in graph.blocks[k].params}
    save_checkpoint(tmp_path / "ck", [{f"param/{p}": w for p, w in weights.items() if stage_of[p] == i}
                                      for i in range(len(ranges))],
                    {**meta, "step": 1, "stages": len(ranges), "ranges": [list(r) for r in ranges]})
    from support import make_tiny_tokenizer

    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))  # the tiny BERT's folder has none
    out = export_adapter_for(tmp_path / "ck", tmp_path / "adapter", base=tiny_checkpoint,
                             tokenizer=tmp_path / "tokenizer.json")
    base, _ = _base_state(tiny_checkpoint)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    feeds = token_feeds(ROWS, S, vocab=500, seed=4)
    with torch.no_grad():
        want = peft_model(**{k: torch.tensor(feeds[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}
                          ).logits.numpy()
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    got = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    assert float(np.abs(got - want).max()) <= 1e-4
    # the folder alone: the base with the run's head size and labels is written into it, the tokenizer beside
    from peft import AutoPeftModelForTokenClassification
    from transformers import AutoTokenizer

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    alone = AutoPeftModelForTokenClassification.from_pretrained(str(out)).eval()
    assert alone.config.id2label == {i: f"L{i}" for i in range(9)}
    with torch.no_grad():
        again = alone(**{k: torch.tensor(feeds[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}
                      ).logits.numpy()
    assert float(np.abs(got - again).max()) <= 1e-4
    assert AutoTokenizer.from_pretrained(str(out))("rome x")["input_ids"] == [2, 7, 8, 3]  # the tiny tokenizer


@pytest.mark.slow
def test_the_command_line_trains_lora_checkpoints_and_exports_the_adapter(minilm_onnx, tmp_path):
    """train-pipeline --lora --checkpoint, then export-adapter: PEFT on MiniLM gives the pipeline's logits."""
    import subprocess
    import sys

    from peft import PeftModel

    from jobs.export.encoder import default_checkpoint_dir, load_token_classifier
    from tasks.ner.datagen import write_splits

    train, _ = write_splits(tmp_path / "data", n_train=32, n_dev=4, seed=1)
    run = [sys.executable, "-m", "confidant"]
    proc = subprocess.run(run + ["train-pipeline", str(minilm_onnx), "--data", str(train), "--local", "2",
                                 "--steps", "2", "--batch", "4", "--microbatches", "2", "--seq", "24", "--lr", "1e-2",
                                 "--lora", "4", "--checkpoint", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LoRA r=4" in proc.stderr
    proc = subprocess.run(run + ["export-adapter", str(tmp_path / "ckpt"), "-o", str(tmp_path / "adapter")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from runtime.pipeline.checkpoints import load_checkpoint

    meta, weights, _ = load_checkpoint(tmp_path / "ckpt")
    graph, _ = add_lora(load_model(minilm_onnx, 2, 24), LoraSettings(**{**meta["lora"], "targets": tuple(
        meta["lora"]["targets"]), "train_also": tuple(meta["lora"]["train_also"])}))
    feeds = token_feeds(2, 24, vocab=30522, seed=3)
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    got = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    peft_model = PeftModel.from_pretrained(load_token_classifier(default_checkpoint_dir(), 9, 0),
                                           tmp_path / "adapter").eval()
    with torch.no_grad():
        want = peft_model(input_ids=torch.tensor(feeds["input_ids"]),
                          attention_mask=torch.tensor(feeds["attention_mask"]),
                          token_type_ids=torch.tensor(feeds["token_type_ids"])).logits.numpy()
    assert float(np.abs(got - want).max()) <= 1e-4
    # the lines it printed load the folder alone: the base with the run's head written into it, MiniLM's tokenizer
    lines = [line.strip() for line in proc.stdout.splitlines()[1:]]
    assert lines[0] == "from peft import AutoPeftModelForTokenClassification; from transformers import AutoTokenizer"
    namespace: dict = {}
    exec("\n".join(lines), namespace)
    with torch.no_grad():
        alone = namespace["model"].eval()(**{k: torch.tensor(feeds[k]) for k in
                                             ("input_ids", "attention_mask", "token_type_ids")}).logits.numpy()
    assert float(np.abs(got - alone).max()) <= 1e-4
    assert len(namespace["tokenizer"]) == 30522 and namespace["model"].config.id2label[1] == meta["labels"][1]


def test_the_merged_onnx_gives_the_trained_logits_on_onnx_runtime(trained, tmp_path):
    import onnxruntime as ort

    from jobs.export.adapter import export_merged

    model_path, folder, result = trained
    merged = export_merged(folder, tmp_path / "merged.onnx")
    feeds = token_feeds(ROWS, S, vocab=500, seed=6)
    want = ort.InferenceSession(str(merged)).run(
        None, {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")})[0]
    graph, _ = add_lora(load_model(model_path, ROWS, S), LORA)
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **result.weights})
    got = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    assert float(np.abs(got - want).max()) <= 1e-4
    base = ort.InferenceSession(str(model_path)).run(
        None, {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")})[0]
    assert float(np.abs(base - want).max()) > 1e-3  # the adapters are in it


def test_a_causal_lms_adapter_loads_onto_its_transformers_model_through_peft(tmp_path):
    """export-adapter of a causal-LM run (before: only token classifiers, the MiniLM default blamed
    for the mismatch): named against the transformers model at --base, CAUSAL_LM, and GPT-2's Conv1D
    projections marked fan_in_fan_out; PEFT's logits are the engine's with the same weights."""
    import transformers as tf
    from peft import PeftModel

    from jobs.export.adapter import export_adapter_for
    from jobs.export.llm import LlmExportOptions, export_causal_lm
    from runtime.pipeline.checkpoints import save_checkpoint
    from support import scrambled_causal_lm

    model = scrambled_causal_lm(tf.GPT2Config(vocab_size=120, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    model.save_pretrained(tmp_path / "hf")
    path = export_causal_lm(model, tmp_path / "onnx" / "m.onnx", LlmExportOptions(), kv_cache=False)
    settings = LoraSettings(2, 8.0, targets=("qkv", "o"), train_also=(), seed=3)
    graph, adapters = add_lora(load_model(path, 2, 12), settings)
    rng = np.random.default_rng(0)
    weights = {p: rng.normal(0, 0.3, graph.constants[p].shape).astype(np.float32) for p in graph.params}
    save_checkpoint(tmp_path / "ck", [{f"param/{k}": v for k, v in weights.items()}],
                    {"model": "m.onnx", "model_path": str(path), "task": "causal-lm", "step": 1, "stages": 1,
                     "ranges": [[0, len(graph.blocks) - 1]], "lora": {"rank": 2, "alpha": 8.0, "targets": ["qkv", "o"],
                                                                      "train_also": [], "seed": 3}})
    out = export_adapter_for(tmp_path / "ck", tmp_path / "adapter", base=tmp_path / "hf")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["task_type"], config["fan_in_fan_out"]) == ("CAUSAL_LM", True)
    peft_model = PeftModel.from_pretrained(model, out).eval()
    _assert_engine_logits_equal_peft(peft_model, graph, weights, vocab=120)


@pytest.fixture(scope="module")
def chat_llama_run(chat_llama, tmp_path_factory):
    """The session's tiny random Llama with SmolLM2's tokenizer and chat template beside its ONNX file
    (conftest), its transformers model rebuilt from the same seed and saved as a folder without a
    tokenizer (as a converted model often is), and a LoRA checkpoint of it whose adapters moved:
    (root, transformers model, ONNX file, adapted graph, weights)."""
    from jobs.export.llm import random_causal_lm
    from runtime.pipeline.checkpoints import save_checkpoint

    path = chat_llama[0]
    root = tmp_path_factory.mktemp("chat-llama-lora")
    chat = json.loads((path.parent / "chat_template.json").read_text())
    model = random_causal_lm("llama", 0, vocab_size=49152, bos_token_id=chat["bos_token_id"],
                             eos_token_id=chat["eos_token_id"])
    model.save_pretrained(root / "hf")
    settings = LoraSettings(2, 8.0, targets=("q", "v"), train_also=(), seed=3)
    graph, _ = add_lora(load_model(path, 2, 12), settings)
    rng = np.random.default_rng(1)
    weights = {p: rng.normal(0, 0.3, graph.constants[p].shape).astype(np.float32) for p in graph.params}
    save_checkpoint(root / "ck", [{f"param/{k}": v for k, v in weights.items()}],
                    {"model": "m.onnx", "model_path": str(path), "task": "causal-lm", "step": 1, "stages": 1,
                     "ranges": [[0, len(graph.blocks) - 1]], "lora": asdict(settings)})
    return root, model, path, graph, weights


def test_a_causal_lm_adapter_folder_loads_alone_with_auto_peft_and_its_tokenizer(chat_llama_run, tmp_path):
    """export-adapter writes the tokenizer (SmolLM2's, with its chat template) beside the adapter and
    records a base transformers loads: AutoPeftModelForCausalLM.from_pretrained(DIR) with no other
    argument gives the engine's logits, and AutoTokenizer.from_pretrained(DIR) encodes and renders
    chats as training did (before: base_model_name_or_path could be a GGUF path, and no tokenizer)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from jobs.export.adapter import export_adapter_for, loading_lines
    from tasks.causal_lm.tokenizer import load_lm_tokenizer

    root, _, path, graph, weights = chat_llama_run
    out = export_adapter_for(root / "ck", tmp_path / "adapter", base=root / "hf")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "hf").resolve())  # a transformers folder, reused
    assert not (out / "base").exists()
    lines = loading_lines(out)
    assert lines[0] == "from peft import AutoPeftModelForCausalLM; from transformers import AutoTokenizer"
    namespace: dict = {}
    exec("\n".join(lines), namespace)  # the three printed lines, as a user pastes them
    peft_model, tokenizer = namespace["model"].eval(), namespace["tokenizer"]
    assert isinstance(peft_model, type(AutoPeftModelForCausalLM.from_pretrained(str(out))))
    _assert_engine_logits_equal_peft(peft_model, graph, weights, vocab=49152)
    ours = load_lm_tokenizer(path)
    chat = [{"role": "user", "content": "List the places: Anna flew to Oslo."}]
    assert len(tokenizer) == ours.vocab_size == 49152
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ours.render_chat(chat)
    assert tokenizer("Anna flew to Oslo.")["input_ids"] == ours.encode("Anna flew to Oslo.")
    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "<|im_end|>"


def test_a_merged_causal_lm_generates_and_gives_the_adapted_logits(chat_llama_run, tmp_path):
    """export-adapter --merged writes, beside the merged ONNX file, NAME.lm.json, its key/value-cache
    graph with the merged weights, and the tokenizer with its chat template: `generate` takes it
    (before: refused, no tokenizer), and its logits are PEFT's merged model's."""
    from peft import PeftModel

    from jobs.export.adapter import export_adapter_for, export_merged
    from jobs.generation import generate
    from tasks.causal_lm.generate import GenerationSettings, OnnxCausalLM

    root, model, _, _, _ = chat_llama_run
    merged = export_merged(root / "ck", tmp_path / "merged" / "m.onnx")
    assert {p.name for p in merged.parent.iterdir()} >= {"m.onnx", "m.kv.onnx", "m.lm.json", "tokenizer.json",
                                                         "chat_template.json"}
    adapter = export_adapter_for(root / "ck", tmp_path / "adapter", base=root / "hf")
    reference = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    ids = np.array([[5, 900, 17, 4000, 33, 2]], np.int64)
    with torch.no_grad():
        want = reference(input_ids=torch.tensor(ids)).logits.numpy()
    lm = OnnxCausalLM(merged)
    assert lm.kv_path is not None and lm.kv_unavailable is None
    got = lm.logits(ids, np.ones_like(ids))
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())
    cached = generate(merged, ["Where is Oslo?"], GenerationSettings(max_new_tokens=4))
    recomputed = generate(merged, ["Where is Oslo?"], GenerationSettings(max_new_tokens=4, kv_cache=False))
    assert cached == recomputed and isinstance(cached[0], str)


def test_a_merged_sequence_classifier_keeps_its_label_names(tmp_path):
    """export-adapter --merged of a LoRA review classifier writes NAME.hf.json beside the merged file
    with the run's label names: `predict` names its labels (before: it asked for --labels). The
    merged file's logits: test_the_merged_onnx_gives_the_trained_logits_on_onnx_runtime."""
    from jobs.export.encoder import ExportOptions, export_model
    from jobs.export.adapter import export_merged
    from jobs.predict import predict
    from runtime.pipeline.checkpoints import save_checkpoint
    from support import make_tiny_tokenizer, tiny_model

    path = export_model(tiny_model("bert", task="seq-cls", num_labels=3, seed=5), tmp_path / "cls.onnx",
                        ExportOptions(num_labels=3, task="seq-cls", attention="sdpa"))
    settings = LoraSettings(2, 8.0, targets=("q", "v"), train_also=("head",), seed=1)
    graph, _ = add_lora(load_model(path, 1, 8), settings)
    rng = np.random.default_rng(2)
    weights = {p: (graph.constants[p] + 0.5 * rng.standard_normal(graph.constants[p].shape)).astype(np.float32)
               for p in graph.params}
    labels = ["negative", "neutral", "positive"]
    save_checkpoint(tmp_path / "ck", [{f"param/{k}": v for k, v in weights.items()}],
                    {"model": path.name, "model_path": str(path), "task": "seq-cls", "labels": labels, "step": 1,
                     "stages": 1, "ranges": [[0, len(graph.blocks) - 1]], "lora": asdict(settings)})
    merged = export_merged(tmp_path / "ck", tmp_path / "out" / "merged.onnx")
    assert json.loads((tmp_path / "out" / "merged.hf.json").read_text())["labels"] == labels
    make_tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("rome x .\nunbelievable x\n")
    _, predictions = predict(merged, tmp_path / "in.txt", seq=8, tokenizer=tmp_path / "tokenizer.json")
    assert all(set(p.scores) == set(labels) and p.label in labels for p in predictions)
    with pytest.raises(JobError, match="-o .* is the model the run was trained from"):
        export_merged(tmp_path / "ck", path)


@pytest.mark.slow  # worker processes; the in-process tests above cover each part
def test_plan_lora_then_train_plan_then_export_adapter_through_the_command_line(chat_llama_run, chat_llama,
                                                                              tmp_path, monkeypatch):
    """The issue's dead end, as a user runs it: `plan --lora 2`, `train PLAN --local --checkpoint`,
    then `export-adapter` (before: "its meta.json has no lora settings", advice naming a flag train
    lacks), and the printed lines load it: PEFT's logits are the engine's with the trained weights."""
    from ir.graph import block_signature
    from ir.profile import BackendProfile, BlockCost, DeviceProfile
    from jobs.common.lora import adapted
    from runtime.pipeline.checkpoints import load_checkpoint
    from support import lm_step_feeds, run_cli

    monkeypatch.setenv("CONFIDANT_HOME", str(tmp_path / "home"))
    root, _, path, _, _ = chat_llama_run
    _, train, _ = chat_llama
    graph = adapted(load_model(path, 2, 128), LoraSettings(2))
    costs = {block_signature(b): BlockCost(0.01, 0.02, workspace_bytes=1 << 20) for b in graph.blocks}
    DeviceProfile("box", graph.name, 2, 128, (BackendProfile("mnn:cpu:t1", costs),), 8 << 30).save(tmp_path / "p.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"devices": [
        {"name": n, "address": f"tcp://127.0.0.1:{5910 + i}", "profile": "p.json", "memory_budget": "4GiB"}
        for i, n in enumerate(("laptop", "phone"))],
        "links": {"default": {"bandwidth": "1Gbit/s", "latency": "0.2ms"}}}))
    for args in (("plan", path, "--cluster", tmp_path / "cluster.json", "--batch", 4, "--seq", 128, "--microbatches", 2,
                  "--cuts", 2, "--lora", 2, "-o", tmp_path / "plan"),
                 ("train", tmp_path / "plan", "--data", train, "--local", "--steps", 2,
                  "--checkpoint", tmp_path / "ck")):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("export-adapter", tmp_path / "ck", "-o", tmp_path / "adapter", "--base", root / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.strip() for line in proc.stdout.splitlines()[1:]]
    assert lines[0] == "from peft import AutoPeftModelForCausalLM; from transformers import AutoTokenizer"
    namespace: dict = {}
    exec("\n".join(lines), namespace)
    meta, weights, _ = load_checkpoint(tmp_path / "ck")
    assert meta["lora"] == {"rank": 2, "alpha": 8.0, "targets": ["q", "k", "v", "o"], "train_also": ["auto"], "seed": 0}
    feeds = lm_step_feeds(0, 2, 12, 1, vocab=49152)[0]
    graph, _ = add_lora(load_model(path, 2, 12), LoraSettings(2))
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    got = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    with torch.no_grad():
        want = namespace["model"].eval()(input_ids=torch.tensor(feeds["input_ids"]),
                                          attention_mask=torch.tensor(feeds["attention_mask"])).logits.numpy()
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())
    assert namespace["tokenizer"].eos_token == "<|im_end|>"


def _flags_of(command: str) -> set[str]:
    import argparse

    from confidant.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices[command]._option_string_actions)


def test_every_refusal_of_export_adapter_advises_flags_its_commands_have(tmp_path):
    """The advice once said "train with --lora R" for a `train PLAN` checkpoint, a flag `train` lacks:
    each flag an advice names belongs to the command it names (a `confidant CMD ...` span, or the
    commands in parentheses after the flags)."""
    import re

    from jobs.export.adapter import _not_a_lora_run

    adapters = {"w.lora_A": 0, "w.lora_B": 0}
    messages = [_not_a_lora_run(tmp_path, {"plan": "p"}, adapters), _not_a_lora_run(tmp_path, {}, adapters),
                _not_a_lora_run(tmp_path, {}, {"w": 0})]
    checked = 0
    for message in messages:
        for command, args in re.findall(r"`confidant ([a-z-]+)([^`]*)`", message):
            for flag in re.findall(r"(--[a-z-]+)", args):
                assert flag in _flags_of(command), (command, flag, message)
                checked += 1
        for flags, commands in re.findall(r"((?:--[a-z-]+ [A-Z]+ ?)+)\(([a-z-]+(?: or [a-z-]+)*)\)", message):
            for command in commands.split(" or "):
                for flag in re.findall(r"--[a-z-]+", flags):
                    assert flag in _flags_of(command), (command, flag, message)
                    checked += 1
    assert checked >= 6


def _assert_engine_logits_equal_peft(peft_model, graph, weights, vocab: int) -> None:
    """The PEFT model's logits on a batch of token ids equal the MNN engine's on the trained weights."""
    from support import lm_step_feeds

    feeds = lm_step_feeds(0, 2, 12, 1, vocab=vocab)[0]
    with torch.no_grad():
        want = peft_model(input_ids=torch.tensor(feeds["input_ids"]),
                          attention_mask=torch.tensor(feeds["attention_mask"])).logits.numpy()
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), weights={**graph.constants, **weights})
    got = engine.forward(feeds, train=False, until_block=len(graph.blocks) - 2)
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())
