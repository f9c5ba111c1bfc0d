"""What a quantized frozen base costs in quality (issue 31, target 6): SmolLM2 LoRA on entities-json,
dev perplexity after the same steps at --base-dtype float32 and int4 (and any other), side by side.

What it measures
    SmolLM2-135M-Instruct (benchmarks/llm.py's export of the bundled GGUF), LoRA r=8 alpha 16 on q, k,
    v, o (the decoder's default: nothing else trains), the entities-json task of `confidant datagen
    --task entities-json` (`tasks.causal_lm.entity_task.write_entity_splits`, seed 0: --train conversations to train
    on, the first --dev of its held-out dev set to score), batch 4 x 128, AdamW lr 2e-4, seed 0, MNN
    at one thread: what `confidant train-local MODEL --task causal-lm --data train.jsonl --eval
    dev.jsonl --lora 8 --lora-alpha 16 --lr 2e-4 --steps N [--base-dtype D]` trains, each dtype in a
    child process of its own (this file with --child), the same batches in the same order.
    Generation (exact match, entity F1) is left out: it runs on ONNX Runtime, not on the held base.

Columns
    ``ppl before``  dev perplexity of the answers before training, on the training engine (the base at
                    that precision, the adapters' B zero): what the quantization alone costs.
    ``ppl after``   the same after --steps steps: the issue's figure.
    ``x float32``   ppl after / float32's ppl after (target: int4 within 5%, <= 1.05).
    ``loss``        mean training loss of the first and last fifth of the steps.
    ``step s``      median seconds a step; ``peak MiB`` the child's VmHWM (setup, both evaluations
                    and training together).

A float base (--float-base)
    The bundled SmolLM2 is a Q4_1 GGUF dequantized: its float32 weights already lie on a 4-bit grid
    (llama.cpp's Q4_1 is ir.precision's int4), so int4 equals float32 to every digit and says nothing.
    --float-base first makes (once, cached in --work) a float checkpoint off that grid by real
    training: SmolLM2 fully fine-tuned in float32 by transformers/torch (AdamW, lr --ft-lr, --ft-steps
    steps of 4 x 128 tokens) on other text (the plain-text pydoc pages of a fixed list of standard library
    modules: this machine's Python, no network), written as a Hugging Face folder and exported with
    `confidant export --task causal-lm --checkpoint FOLDER`. It prints how far each base is from the grid
    --base-dtype int4 holds it on (projections int4, the table int8), by storage, before the table:
    ``on grid`` the share of weights the round trip gives back exactly, ``err/step`` the mean round-trip
    error over the mean step of its block (0 on the grid; weights spread evenly between steps: 0.25).

A base spread within its steps (--noisy-base)
    SmolLM2 with each quantization block's weights moved by uniform noise of up to 0.49 of the block's own
    step (projections on int4's grid, the table on int8's), never past the block's extremes and one
    minimum and one maximum left in place (`spread_within_steps`): a float model whose --base-dtype int4
    rounding is exactly the shipped Q4_1 file (err/step ~0.23). What it shows: int4 (and int8) on a base
    that is nowhere on its grid, the same LoRA steps. What it does not: the noise carries no information,
    so int4 removing it gives back the real model, and float32 is the noisier of the two; it says nothing
    of what int4 costs a model whose off-grid detail was learned.

MiniLM (--model minilm)
    all-MiniLM-L6-v2 (the demo's model, a real float32 checkpoint: err/step ~0.23-0.24, nothing on the
    grid), LoRA r=8 alpha 16 on q, k, v, o with the random 9-label head trained in full (an encoder's
    default), token classification of the generated NER sentences (`confidant datagen`, seed 0), batch
    16 x 32 (every sentence fits 32 tokens), AdamW lr 1e-3, MNN, one thread. Columns: the dev set's mean
    token cross-entropy before and after, its exp (``ppl after``) and the ratio to float32's, entity F1
    before and after and its ratio.

A decoder trained from scratch (--model decoder)
    The LLM check on learned float weights with no 4-bit grid behind them (no float LLM checkpoint is on
    this machine and none can be fetched): a Qwen2-style decoder (`DECODER_SHAPE`: transformers'
    Qwen2Config reduced to 4 layers, hidden 256, MLP 1024, 4 / 2 heads, tied; SmolLM2's tokenizer and
    vocabulary) initialised at random (seed 0) and pre-trained from scratch in float32 (--ft-steps AdamW
    steps of 4 x 128 tokens of the pydoc text --float-base uses and 1000 entities-json conversations of
    seed 1, shuffled, lr --ft-lr after a 20-step warm-up), made once in --work and exported; then the same
    entities-json LoRA run (seed 0) as SmolLM2's at each precision.

Usage
    .venv/bin/python benchmarks/quality.py [--steps 30] [--dtypes float32,int4] [--dev 64] [--json OUT]
    .venv/bin/python benchmarks/quality.py --float-base [--ft-steps 30] [--ft-lr 2e-4] [--work DIR] ...
    .venv/bin/python benchmarks/quality.py --noisy-base [--work DIR] ...
    .venv/bin/python benchmarks/quality.py --model minilm [--steps 200] [--dev 500] [--dtypes float32,int8,int4]
    .venv/bin/python benchmarks/quality.py --model decoder [--ft-steps 150] [--ft-lr 2e-3] [--work DIR] ...
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

RANK, ALPHA, LR, ROWS, SEQ = 8, 16.0, 2e-4, 4, 128
MARKER = "CONFIDANT_QUALITY "
TARGET = 1.05  # issue 31, target 6: int4's dev perplexity within 5% of float32's


def _child(base_dtype: str, steps: int, n_train: int, n_dev: int, model: Path | None = None) -> dict:
    from benchmarks.llm import smollm2_model
    from tasks.causal_lm.entity_task import write_entity_splits
    from jobs.train.causal_lm import lm_data, lm_graph
    from jobs.common.settings import TrainingSettings
    from planner.lora import LoraSettings
    from runtime.engines.factory import whole_model_engine
    from runtime.procfs import peak_rss_bytes
    from tasks.causal_lm.evaluation import engine_nll
    from tasks.causal_lm.task import CAUSAL_LM
    from tasks.trainer import TrainConfig, train_steps

    model = model or smollm2_model()
    lora = LoraSettings(RANK, ALPHA, seed=0, base_dtype=base_dtype)
    settings = TrainingSettings(steps=steps, batch=ROWS, seq=SEQ, lr=LR, optimizer="adamw", seed=0, threads=1,
                                engine="mnn", lora=lora, eval_limit=n_dev)
    with tempfile.TemporaryDirectory() as d:
        train, dev = write_entity_splits(Path(d), n_train=n_train, n_dev=max(n_dev, 1), seed=0)
        run = lm_data(model, train, dev, settings)
    graph, _ = lm_graph(model, settings)
    engine = whole_model_engine(graph, "mnn", 1)
    config = TrainConfig(steps=steps, batch=ROWS, seq=SEQ, lr=LR, optimizer="adamw", seed=0, threads=1)
    batches = CAUSAL_LM.batches(run, ROWS, 0)
    dev_batches = CAUSAL_LM.dev_batches(run, ROWS)
    before = engine_nll(engine, dev_batches, ROWS, run.pad_id).perplexity
    result = train_steps(engine, batches, config, 0, step_feeds=lambda b: CAUSAL_LM.feeds(run, b, ROWS, 1))
    after = engine_nll(engine, dev_batches, ROWS, run.pad_id).perplexity
    losses = [s.loss for s in result.steps]
    return {"base_dtype": base_dtype, "ppl_before": before, "ppl_after": after, "losses": losses,
            "step_s": statistics.median(s.seconds for s in result.steps), "peak_mib": peak_rss_bytes() / 2**20,
            "dev_conversations": len(run.dev), "train_rows": len(run.train)}


def run_child(base_dtype: str, steps: int, n_train: int, n_dev: int, timeout: float,
              model: Path | None = None, kind: str = "smollm2") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", base_dtype, "--steps", str(steps),
           "--train", str(n_train), "--dev", str(n_dev), "--model", kind] + (["--onnx", str(model)] if model else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"--base-dtype {base_dtype}: child failed (rc {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len(MARKER):])


# --- MiniLM (--model minilm): a real float checkpoint -------------------------------------------------

# Token classification of the generated NER sentences (`confidant datagen`): they are at most 28 tokens,
# so 32 holds every one whole. LoRA r=8 alpha 16 on q, k, v, o with the random 9-label head trained in
# full (LoRA's default for an encoder, `--train-also auto`); lr 1e-3, LoRA's usual for an encoder.
NER_ROWS, NER_SEQ, NER_LR = 16, 32, 1e-3


def ner_dev_loss(engine, data, rows: int) -> float:
    """Mean cross-entropy of every labelled token of `data`'s dev sentences: each batch's loss is the
    mean over its own labelled tokens (`batch_feeds`), so it is weighted by their count."""
    import numpy as np

    from tasks.tokenize import make_batches
    from tasks.trainer import batch_feeds, pad_batch

    total = count = 0
    for b in make_batches(data.dev_encoded, rows, data.seq, seed=0, shuffle=False):
        if b.n_labelled:
            feeds = batch_feeds(pad_batch(b, rows), len(data.labels), b.n_labelled)
            total += float(np.asarray(engine.forward(feeds, train=False)).reshape(-1)[0]) * b.n_labelled
            count += b.n_labelled
    return total / count


def _ner_child(base_dtype: str, steps: int, n_train: int, n_dev: int, model: Path | None = None) -> dict:
    """MiniLM LoRA on NER at `base_dtype`: what `confidant train-local MODEL --data train.txt --eval
    dev.txt --lora 8 --lora-alpha 16 --lr 1e-3 --batch 16 --seq 32 --base-dtype D` trains."""
    import math

    from benchmarks.common import default_model
    from planner.lora import LoraSettings, add_lora
    from planner.onnx_import import load_model
    from runtime.engines.factory import whole_model_engine
    from runtime.procfs import peak_rss_bytes
    from tasks.choice import task_named
    from tasks.ner.datagen import write_splits
    from tasks.trainer import TrainConfig, train_steps

    model = model or default_model()
    task = task_named("ner")
    with tempfile.TemporaryDirectory() as d:
        train, dev = write_splits(d, n_train, n_dev, seed=0)
        data = task.read_data(model, train, dev, NER_SEQ)
    graph, _ = add_lora(load_model(model, NER_ROWS, NER_SEQ), LoraSettings(RANK, ALPHA, seed=0, base_dtype=base_dtype))
    engine = whole_model_engine(graph, "mnn", 1)
    config = TrainConfig(steps=steps, batch=NER_ROWS, seq=NER_SEQ, lr=NER_LR, optimizer="adamw", seed=0, threads=1)
    before = ner_dev_loss(engine, data, NER_ROWS), task.evaluate(engine, graph, data, NER_ROWS).after
    result = train_steps(engine, task.batches(data, NER_ROWS, 0), config, len(data.labels))
    after = ner_dev_loss(engine, data, NER_ROWS), task.evaluate(engine, graph, data, NER_ROWS).after
    return {"base_dtype": base_dtype, "loss_before": before[0], "loss_after": after[0],
            "ppl_before": math.exp(before[0]), "ppl_after": math.exp(after[0]), "f1_before": before[1],
            "f1_after": after[1], "losses": [s.loss for s in result.steps],
            "step_s": statistics.median(s.seconds for s in result.steps), "peak_mib": peak_rss_bytes() / 2**20,
            "dev_sentences": len(data.dev), "train_sentences": len(data.train)}


# --- a float base off the 4-bit grid (--float-base) ------------------------------------------------------

# Plain text the entities-json task has nothing to do with, fixed on this machine: pydoc's pages of
# these standard library modules (the Python that runs this).
TEXT_MODULES = ("argparse", "collections", "json", "logging", "pathlib", "subprocess", "typing", "unittest",
                "email.message", "http.client", "string", "textwrap")
FT_ROWS, FT_SEQ = 4, 128


def _pydoc_text() -> str:
    import importlib
    import pydoc

    return "\n\n".join(pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext)
                        for m in TEXT_MODULES)


def make_float_base(folder: Path, steps: int, lr: float) -> Path:
    """SmolLM2 (the bundled GGUF, dequantized) fully fine-tuned in float32 for `steps` AdamW steps of
    4 x 128 tokens of `_pydoc_text`, written to `folder` as a Hugging Face checkpoint (model and
    tokenizer). Seeded: the same folder on the same machine (one thread)."""
    import torch

    from jobs.export.llm import load_causal_lm

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tokenizer, _ = load_causal_lm(None)
    ids = tokenizer(_pydoc_text(), add_special_tokens=False)["input_ids"]
    rows = torch.tensor(ids[: len(ids) // FT_SEQ * FT_SEQ]).view(-1, FT_SEQ)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    if len(rows) < steps * FT_ROWS:
        order = order.repeat(-(-steps * FT_ROWS // len(rows)))
    losses = _train_whole(model, rows, order, steps, FT_ROWS, lr, 1, "fine-tune", 1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    (folder / "fine_tune.json").write_text(json.dumps({"steps": steps, "lr": lr, "rows": FT_ROWS, "seq": FT_SEQ,
                                                       "text_modules": TEXT_MODULES, "tokens": len(ids),
                                                       "losses": losses}, indent=1) + "\n")
    return folder


def _train_whole(model, rows, order, steps: int, per_step: int, lr: float, warmup: int, label: str,
                 every: int) -> list[float]:
    """`steps` AdamW steps (no weight decay, `lr` reached linearly over `warmup` steps, then constant) of every
    weight of the transformers causal LM `model` on `per_step` rows of `rows` a step in `order`; the losses,
    printed every `every` steps and at the last; `model` left in eval mode."""
    import torch

    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / warmup))
    losses = []
    for step in range(steps):
        batch = rows[order[step * per_step:(step + 1) * per_step]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % every == 0 or step == steps - 1:
            print(f"    {label} step {step + 1}/{steps}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    model.eval()
    return losses


# --- a small decoder trained from scratch in float32 (--model decoder) ---------------------------------

# A Qwen2-style decoder (transformers' Qwen2Config, SmolLM2's tokenizer and vocabulary) reduced from the published
# configs to 4 layers of 256 so it trains in minutes on one thread: its weights are learned float32 weights
# (random init, then --ft-steps AdamW steps on `_pydoc_text` and entities-json conversations), nowhere on a 4-bit grid.
DECODER_SHAPE = {"vocab_size": 49152, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                 "max_position_embeddings": 2048, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
DECODER_ROWS, DECODER_WARMUP = 4, 20
# ... and on entities-json conversations of another seed than the LoRA run's (seed 0), so that the base knows the
# chat format and the answers' JSON as a general model does (pydoc alone left the dev answers at perplexity ~1e5)
DECODER_ENTITY_SEED, DECODER_ENTITIES = 1, 1000


def _entity_conversation_ids(tokenizer, seed: int, n: int) -> list[int]:
    """`n` entities-json training conversations of `seed` (`write_entity_splits`), chat-rendered and tokenized
    as the LoRA run's rows are (`encode_instructions`), one after another."""
    from tasks.causal_lm.data import encode_instructions, read_instructions
    from tasks.causal_lm.entity_task import write_entity_splits

    with tempfile.TemporaryDirectory() as d:
        train, _ = write_entity_splits(Path(d), n_train=n, n_dev=1, seed=seed)
        conversations = read_instructions(train)
    return [int(t) for row in encode_instructions(tokenizer, conversations) for t in row.ids]


def make_scratch_decoder(folder: Path, steps: int, lr: float) -> Path:
    """`DECODER_SHAPE` initialised at random (seed 0) and trained from scratch in float32 by transformers/torch
    (AdamW at `lr`, linear warm-up over `DECODER_WARMUP` steps then constant, `steps` steps of 4 x 128 tokens of
    `_pydoc_text` and `_entity_conversation_ids` in SmolLM2's tokenization, shuffled), written to `folder` as a
    Hugging Face checkpoint; one thread."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.llm import smollm2_model
    from tasks.causal_lm.tokenizer import load_lm_tokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokenizer = load_lm_tokenizer(smollm2_model())
    ids = tokenizer.encode(_pydoc_text()) + _entity_conversation_ids(tokenizer, DECODER_ENTITY_SEED, DECODER_ENTITIES)
    rows = torch.tensor(ids[: len(ids) // FT_SEQ * FT_SEQ]).view(-1, FT_SEQ)
    order = torch.cat([torch.randperm(len(rows), generator=torch.Generator().manual_seed(e))
                       for e in range(-(-steps * DECODER_ROWS // len(rows)))])
    model = Qwen2ForCausalLM(Qwen2Config(**DECODER_SHAPE))
    losses = _train_whole(model, rows, order, steps, DECODER_ROWS, lr, DECODER_WARMUP, "pre-train", 10)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    (folder / "fine_tune.json").write_text(json.dumps({"scratch": DECODER_SHAPE, "steps": steps, "lr": lr,
                                                       "rows": DECODER_ROWS, "seq": FT_SEQ, "tokens": len(ids),
                                                       "losses": losses}, indent=1) + "\n")
    return folder


def scratch_decoder_model(work: Path, steps: int, lr: float) -> Path:
    """The exported scratch decoder (`make_scratch_decoder`), made once, with SmolLM2's tokenizer beside it."""
    import shutil

    from benchmarks.llm import smollm2_model

    onnx = _exported(work / f"qwen-scratch-{steps}-lr{lr:g}-entities{DECODER_ENTITY_SEED}", lambda folder: make_scratch_decoder(folder, steps, lr))
    for f in ("tokenizer.json", "chat_template.json"):
        if not (onnx.parent / f).is_file():
            shutil.copy(smollm2_model().parent / f, onnx.parent / f)
    return onnx


def spread_within_steps(w, storage: str, rng):
    """`w` (a float32 [rows, cols] weight on the `storage` grid, blocked along its columns as `ir.precision`
    blocks a weight along its input) with each element moved by uniform noise of up to 0.49 of its own
    block's step, never past the block's extremes, and one minimum and one maximum element of each block
    (int8: the largest magnitude) left where they are: the block's scale (and offset) and every code stay,
    so `storage` rounds the result back to `w`, while the weights themselves lie anywhere within their
    steps (err/step about 0.245)."""
    import numpy as np

    from ir.precision import BLOCK, quantize

    rows, cols = w.shape
    assert cols % BLOCK == 0, (w.shape, "a weight whose input is not whole blocks")
    q = quantize(w, storage, axis=1)
    step = np.repeat(q.scales.astype(np.float32), BLOCK, axis=1).reshape(rows, cols // BLOCK, BLOCK)
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    noise = rng.uniform(-0.49, 0.49, blocks.shape).astype(np.float32) * step
    if storage == "int4":
        low, high = blocks.min(axis=2, keepdims=True), blocks.max(axis=2, keepdims=True)
        keep = [blocks.argmin(axis=2), blocks.argmax(axis=2)]
    else:  # int8: symmetric, the block's largest magnitude sets its scale
        high = np.abs(blocks).max(axis=2, keepdims=True)
        low = -high
        keep = [np.abs(blocks).argmax(axis=2)]
    noise = np.where(blocks == low, np.abs(noise), np.where(blocks == high, -np.abs(noise), noise))
    r, b = np.indices(keep[0].shape)
    for k in keep:
        noise[r, b, k] = 0.0
    return (blocks + noise).reshape(rows, cols)


def make_noisy_base(folder: Path) -> Path:
    """SmolLM2 (the bundled GGUF, dequantized) with every 2-D weight spread within its steps
    (`spread_within_steps`: projections on `--base-dtype int4`'s grid, the tied table on int8's, as
    `storage_for` holds them), written to `folder` as a Hugging Face checkpoint: a float model whose
    --base-dtype int4 rounding is the shipped Q4_1 file again. Seed 0."""
    import numpy as np
    import torch

    from ir.precision import dequantize, quantize, storage_for
    from jobs.export.llm import load_causal_lm

    model, tokenizer, _ = load_causal_lm(None)
    rng = np.random.default_rng(0)
    table = model.get_input_embeddings().weight
    same = total = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2:
                continue
            storage = storage_for("int4", p is table)
            w = p.detach().numpy().astype(np.float32)
            spread = spread_within_steps(w, storage, rng)
            same += int((dequantize(quantize(spread, storage, axis=1)) == w).sum())
            total += w.size
            p.copy_(torch.from_numpy(spread))
    print(f"    noisy base: {same / total:.6f} of {total} weights round back to the shipped file's at int4",
          file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    (folder / "fine_tune.json").write_text(json.dumps({"noisy": True, "seed": 0, "round_trip_same": same,
                                                       "weights": total}, indent=1) + "\n")
    return folder


def noisy_base_model(work: Path) -> Path:
    """The exported noisy base (`make_noisy_base`), made once."""
    return _exported(work / "smollm2-noisy", make_noisy_base)


def float_base_model(work: Path, steps: int, lr: float) -> Path:
    """The exported float base (`confidant export --task causal-lm --checkpoint FOLDER -o ...`), made once."""
    return _exported(work / f"smollm2-ft{steps}-lr{lr:g}", lambda folder: make_float_base(folder, steps, lr))


def _exported(folder: Path, make) -> Path:
    """`folder`'s checkpoint (made by `make(folder)` unless there) exported to folder/onnx/model.onnx, once."""
    onnx = folder / "onnx" / "model.onnx"
    if not onnx.is_file():
        if not (folder / "fine_tune.json").is_file():
            make(folder)
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(_HERE.parent))
        subprocess.run([sys.executable, "-m", "confidant", "export", "--task", "causal-lm", "--checkpoint", str(folder),
                        "-o", str(onnx), "--no-kv-cache"], check=True, env=env)
    return onnx


def grid_distance(model: Path) -> dict:
    """How far a lowered model's 2-D float weights are from the grid `--base-dtype int4` puts them on (its
    projections int4, its lookup table int8, `ir.precision.storage_for`), by storage: the share of elements
    the round trip (`ir.precision.quantize`, blocked along the input) gives back exactly, and the mean
    round-trip error over the mean step of its block (an even spread over the grid's steps gives 0.25)."""
    import numpy as np

    from ir.precision import dequantize, lookup_tables, quantize, storage_for
    from planner.onnx_import import load_model

    graph = load_model(model, 1, 8, with_loss=False)
    tables = lookup_tables(graph.nodes)
    out: dict[str, dict] = {}
    for name, w in graph.constants.items():
        if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype != np.float32 or w.size < 4096:
            continue
        storage = storage_for("int4", name in tables)
        q = quantize(w, storage, axis=1)
        diff = np.abs(dequantize(q) - w)
        step = q.scales.astype(np.float64)  # a block's step is its scale (int4 and int8 alike)
        acc = out.setdefault(storage, {"exact": 0, "elements": 0, "err": 0.0, "step": 0.0})
        acc["exact"] += int((diff == 0).sum())
        acc["elements"] += w.size
        acc["err"] += float(diff.sum())
        acc["step"] += float(step.sum()) * q.block
    return {k: {"on_grid": v["exact"] / v["elements"], "err_over_step": v["err"] / v["step"], "elements": v["elements"]}
            for k, v in sorted(out.items())}


def _aligned(header: list[str], table: list[list[str]]) -> list[str]:
    """`header` and `table` as lines of columns (the first left-aligned), a rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    out = []
    for k, row in enumerate([header] + table):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            out.append("-" * len(out[-1]))
    return out


def _first_last(losses: list[float]) -> str:
    k = max(1, len(losses) // 5)
    return f"{sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f}"


def report_ner(rows: list[dict], steps: int) -> str:
    """The MiniLM table: dev loss (token perplexity exp(loss)) and entity F1 before and after."""
    base = next((r for r in rows if r["base_dtype"] == "float32"), None)
    out = [f"all-MiniLM-L6-v2 LoRA r={RANK} alpha {ALPHA:g} (q,k,v,o; the 9-label head in full) on generated NER, "
           f"{steps} AdamW steps of {NER_ROWS} x {NER_SEQ} at lr {NER_LR:g}, MNN, 1 thread; dev: "
           f"{rows[0]['dev_sentences']} sentences, {rows[0]['train_sentences']} to train on", ""]
    header = ["base", "dev loss before", "dev loss after", "ppl after", "x float32", "F1 before", "F1 after",
              "F1 x float32", "loss first -> last", "step s", "peak MiB"]
    table = []
    for r in rows:
        ppl = r["ppl_after"] / base["ppl_after"] if base else None
        f1 = r["f1_after"] / base["f1_after"] if base and base["f1_after"] else None
        table.append([r["base_dtype"], f"{r['loss_before']:.5f}", f"{r['loss_after']:.5f}", f"{r['ppl_after']:.5f}",
                      "-" if ppl is None else f"{ppl:.4f}", f"{r['f1_before']:.4f}", f"{r['f1_after']:.4f}",
                      "-" if f1 is None else f"{f1:.4f}", _first_last(r["losses"]), f"{r['step_s']:.3f}",
                      f"{r['peak_mib']:.0f}"])
    out += _aligned(header, table)
    q = next((r for r in rows if r["base_dtype"] == "int4"), None)
    if base and q:
        x = q["ppl_after"] / base["ppl_after"]
        out += ["", f"target 6 (quality) on a real float base: int4 dev perplexity after {steps} steps {x:.4f}x "
                    f"float32's (target <= {TARGET:.2f}x): {'met' if x <= TARGET else 'NOT met'}; entity F1 "
                    f"{q['f1_after']:.4f} against {base['f1_after']:.4f}"]
    return "\n".join(out)


def report(rows: list[dict], steps: int, base_name: str = "SmolLM2-135M") -> str:
    base = next((r for r in rows if r["base_dtype"] == "float32"), None)
    out = [f"{base_name} LoRA r={RANK} alpha {ALPHA:g} (q,k,v,o) on entities-json, {steps} AdamW steps of "
           f"{ROWS} x {SEQ} at lr {LR:g}, MNN, 1 thread; dev perplexity of the answers "
           f"({rows[0]['dev_conversations']} dev conversations)", ""]
    header = ["base", "ppl before", "ppl after", "x float32", "loss first -> last", "step s", "peak MiB"]
    table = []
    for r in rows:
        ratio = r["ppl_after"] / base["ppl_after"] if base else None
        table.append([r["base_dtype"], f"{r['ppl_before']:.5f}", f"{r['ppl_after']:.5f}",
                      "-" if ratio is None else f"{ratio:.4f}", _first_last(r["losses"]), f"{r['step_s']:.2f}",
                      f"{r['peak_mib']:.0f}"])
    out += _aligned(header, table)
    q = next((r for r in rows if r["base_dtype"] == "int4"), None)
    if base and q:
        x = q["ppl_after"] / base["ppl_after"]
        out += ["", f"target 6 (quality): int4 dev perplexity after {steps} steps {x:.4f}x float32's "
                    f"(target <= {TARGET:.2f}x): {'met' if x <= TARGET else 'NOT met'}"]
    return "\n".join(out)


def _print_grid(label: str, grid: dict) -> None:
    print(f"{label}: " + "; ".join(f"{k} ({g['elements']} weights): on grid {g['on_grid']:.4f}, err/step "
                                   f"{g['err_over_step']:.4f}" for k, g in grid.items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps per base precision (default 30; "
                                                              "minilm 200)")
    ap.add_argument("--dtypes", default="float32,int4", help="comma-separated --base-dtype values (default float32,int4)")
    ap.add_argument("--train", type=int, default=None,
                    help="entities-json training conversations (default 1000; minilm: NER sentences, 3000)")
    ap.add_argument("--dev", type=int, default=None, help="dev conversations scored (default 64; minilm: sentences, 500)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per precision (default 3600)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument("--float-base", action="store_true",
                    help="start from SmolLM2 fine-tuned in float32 (off the 4-bit grid; made once in --work)")
    ap.add_argument("--noisy-base", action="store_true",
                    help="start from SmolLM2 with every weight spread uniformly within its own 4-bit step (a float "
                         "model whose --base-dtype int4 is the shipped file; made once in --work)")
    ap.add_argument("--ft-steps", type=int, default=None, help="--float-base: full fine-tuning steps (default 30); "
                                                                 "--model decoder: pre-training steps (default 150)")
    ap.add_argument("--ft-lr", type=float, default=None, help="--float-base: its AdamW learning rate (default 2e-4); "
                                                                "--model decoder: pre-training's (default 2e-3)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "confidant" / "quality",
                    help="--float-base: where the fine-tuned checkpoint and its export are kept")
    ap.add_argument("--model", choices=("smollm2", "minilm", "decoder"), default="smollm2",
                    help="smollm2 (causal LM, entities-json; default), minilm (all-MiniLM-L6-v2, a real float "
                         "checkpoint: token classification of entities, dev loss and entity F1) or decoder (a "
                         "4-layer Qwen2-style decoder pre-trained from scratch in float32, made once in --work; "
                         "entities-json as smollm2)")
    ap.add_argument("--child", metavar="DTYPE", help=argparse.SUPPRESS)
    ap.add_argument("--onnx", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ner = args.model == "minilm"
    scratch = args.model == "decoder"
    args.ft_steps = args.ft_steps if args.ft_steps is not None else (150 if scratch else 30)
    args.ft_lr = args.ft_lr if args.ft_lr is not None else (2e-3 if scratch else 2e-4)
    args.steps = args.steps if args.steps is not None else (200 if ner else 30)
    args.train = args.train if args.train is not None else (3000 if ner else 1000)
    args.dev = args.dev if args.dev is not None else (500 if ner else 64)
    if (ner or scratch) and (args.float_base or args.noisy_base):
        ap.error("--float-base and --noisy-base make a SmolLM2 base; --model minilm and decoder are float models "
                 "already (drop one)")
    if args.float_base and args.noisy_base:
        ap.error("--float-base or --noisy-base, not both")
    if args.steps < 1 or args.train < 1 or args.dev < 1 or args.ft_steps < 1:
        ap.error("--steps, --train and --dev must be at least 1")
    if args.child:
        child = _ner_child if ner else _child
        print(MARKER + json.dumps(child(args.child, args.steps, args.train, args.dev, args.onnx)), flush=True)
        return 0
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "int8", "int4")]
    if bad or not dtypes:
        ap.error(f"--dtypes: float32, bfloat16, int8 or int4, comma-separated, not {args.dtypes!r}")
    model = None
    grid = {}
    if ner:
        from benchmarks.common import default_model

        grid["all-MiniLM-L6-v2"] = grid_distance(default_model())
        _print_grid("all-MiniLM-L6-v2", grid["all-MiniLM-L6-v2"])
    if scratch:
        model = scratch_decoder_model(args.work, args.ft_steps, args.ft_lr)
        grid["decoder"] = grid_distance(model)
        _print_grid(f"scratch decoder ({model})", grid["decoder"])
    if args.float_base or args.noisy_base:
        from benchmarks.llm import smollm2_model

        model = (float_base_model(args.work, args.ft_steps, args.ft_lr) if args.float_base
                 else noisy_base_model(args.work))
        for label, path in (("bundled SmolLM2 (Q4_1 GGUF)", smollm2_model()), (f"float base ({model})", model)):
            grid[label] = grid_distance(path)
            _print_grid(label, grid[label])
    rows = []
    for d in dtypes:
        t = time.perf_counter()
        print(f"  --base-dtype {d} ...", file=sys.stderr, flush=True)
        rows.append(run_child(d, args.steps, args.train, args.dev, args.timeout, model, args.model))
        print(f"    ppl {rows[-1]['ppl_before']:.4f} -> {rows[-1]['ppl_after']:.4f} ({time.perf_counter() - t:.0f} s)",
              file=sys.stderr, flush=True)
    if ner:
        print(report_ner(rows, args.steps))
    else:
        name = ("SmolLM2-135M fine-tuned in float32 (--float-base)" if args.float_base else
                f"A 4-layer Qwen2-style decoder pre-trained {args.ft_steps} steps from scratch (--model decoder)"
                if scratch else
                "SmolLM2-135M spread within its 4-bit steps (--noisy-base)" if args.noisy_base else "SmolLM2-135M")
        print(report(rows, args.steps, name))
    if args.json:
        document = {"model_kind": args.model, "steps": args.steps, "rows": rows, "grid": grid,
                    "model": str(model) if model else None}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
