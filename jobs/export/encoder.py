"""Export a Hugging Face encoder checkpoint (BERT, RoBERTa, DistilBERT, ELECTRA, ALBERT, XLM-RoBERTa)
to an ONNX classification model: token classification (NER) or sequence classification.

The planner only ever sees ONNX, so this is the one place where PyTorch and transformers are needed.
Both of PyTorch's exporters are supported because users arrive with files from either: the TorchScript
exporter (`dynamo=False`, opsets 14-20) and the dynamo exporter (`dynamo=True`, opsets 18-20).
The classifier head is freshly initialised from a seed (the checkpoint is an encoder only); the export
runs in eval mode, so dropout is absent from the graph, and fine-tuning runs without it.

The model's inputs are the token inputs its forward takes: `input_ids`, `attention_mask`, and
`token_type_ids` where the model has more than one token type (BERT, ELECTRA, ALBERT; not RoBERTa,
XLM-RoBERTa or DistilBERT). The output is `logits`: [batch, seq, labels] for token classification,
[batch, labels] for sequence classification (the model's own pooling: BERT's and ALBERT's pooler,
the first token's representation through RoBERTa's, ELECTRA's and DistilBERT's classification heads).

Two exporter habits would tie weights that were merely equal when exported (a fresh model's zero
biases): the dynamo exporter's optimizer merges initializers with equal values, so it is off by
default here (`optimize=False`; the lowering folds what it would have folded); TorchScript merges them
too but marks each merged parameter with an Identity, which the lowering unties. Weights the model
really shares (ALBERT's one layer) stay one initializer read by every layer.

Next to `NAME.onnx` the export writes `NAME.hf.json`: the transformers config, the task and labels,
which transformers parameter each ONNX weight is (`jobs.common.hf_names`), and the checkpoint folder it was
exported from (for its tokenizer), so a fine-tuned model can be written back as a transformers
checkpoint (`confidant export-trained --hf`) without the original weights.
"""
from __future__ import annotations

import inspect
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.models import default_checkpoint_dir
from tasks.side_files import HF_SIDECAR_SUFFIX, hf_sidecar_path, read_hf_sidecar

__all__ = ["DEFAULT_NUM_LABELS", "ExportOptions", "HF_SIDECAR_SUFFIX", "TASKS", "default_checkpoint_dir",
           "export_checkpoint", "export_model", "load_classifier", "load_token_classifier", "model_inputs",
           "hf_sidecar_path", "read_hf_sidecar"]

DEFAULT_NUM_LABELS = 9  # CoNLL-2003: O plus B-/I- of PER, ORG, LOC, MISC
TASKS = ("token-classification", "seq-cls")
ATTENTIONS = ("eager", "sdpa")
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class ExportOptions:
    """How to export. `attention`: transformers' attention implementation (eager, or sdpa, the
    default of transformers 5; both lower to the same IR). `constant_folding`: the TorchScript
    exporter's `do_constant_folding`. `optimize`: the dynamo exporter's ONNX optimizer (merges equal
    initializers, see the module docstring). `inputs`: the token inputs to export (None: all the
    model takes; e.g. ("input_ids",) for a model without a mask input). `dynamic`: dynamic batch and
    sequence axes (False: the example's shape is baked in, every shape folded by the exporter)."""

    num_labels: int = DEFAULT_NUM_LABELS
    opset: int = 17
    dynamo: bool = False
    seed: int = 0
    example_batch: int = 2
    example_seq: int = 16
    task: str = "token-classification"
    attention: str = "eager"
    constant_folding: bool = True
    optimize: bool = False
    inputs: tuple[str, ...] | None = None
    dynamic: bool = True
    sidecar: bool = True
    labels: tuple[str, ...] = field(default=())

    def check(self) -> "ExportOptions":
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        low = 18 if self.dynamo else 14
        if not low <= self.opset <= 20:
            raise ValueError(f"opset {self.opset} is outside {low}-20 for the "
                             f"{'dynamo' if self.dynamo else 'TorchScript'} exporter")
        if self.num_labels < 2:
            raise ValueError(f"num_labels must be at least 2, got {self.num_labels}")
        if self.labels and len(self.labels) != self.num_labels:
            raise ValueError(f"{len(self.labels)} label names for {self.num_labels} labels")
        return self


def _check_checkpoint(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no config.json: point --checkpoint at a Hugging Face model folder"
        )
    if not any((checkpoint / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")):
        raise FileNotFoundError(f"{checkpoint} has no model.safetensors (nor pytorch_model.bin)")


def load_classifier(checkpoint: Path, task: str = "token-classification", num_labels: int = DEFAULT_NUM_LABELS,
                    seed: int = 0, attention: str = "eager"):
    """The encoder at `checkpoint` with a seeded classifier head of `num_labels` outputs, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    checkpoint = Path(checkpoint)
    _check_checkpoint(checkpoint)
    cls = AutoModelForSequenceClassification if task == "seq-cls" else AutoModelForTokenClassification
    torch.manual_seed(seed)
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights newly initialised" is expected for the head
    try:
        # a head of another size (a 9-label tagger exported with --num-labels 5, or as a sequence
        # classifier) is replaced by a new seeded one, as a base checkpoint's missing head is
        model = cls.from_pretrained(str(checkpoint), num_labels=num_labels, attn_implementation=attention,
                                    local_files_only=True, ignore_mismatched_sizes=True)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"{checkpoint}: transformers cannot build a {task} model from it ({exc})") from None
    finally:
        hf_logging.set_verbosity(previous)
    model.eval()
    return model


def load_token_classifier(checkpoint: Path, num_labels: int, seed: int):
    """Load the encoder from `checkpoint` with a seeded linear head of `num_labels` outputs."""
    return load_classifier(checkpoint, "token-classification", num_labels, seed)


def model_inputs(model) -> tuple[str, ...]:
    """The token inputs `model`'s forward takes (token types only where there is more than one)."""
    params = inspect.signature(model.forward).parameters
    names = [n for n in TOKEN_INPUTS if n in params]
    if "token_type_ids" in names and int(getattr(model.config, "type_vocab_size", 2) or 0) < 2:
        names.remove("token_type_ids")
    return tuple(names)


def _example(model, names, options: ExportOptions):
    import torch

    b, s = options.example_batch, options.example_seq
    gen = torch.Generator().manual_seed(options.seed)
    vocab = int(model.config.vocab_size)
    pad = getattr(model.config, "pad_token_id", None)
    low = 0 if pad is None else min(int(pad) + 1, vocab - 1)  # no pad ids inside the example's text
    values = {"input_ids": torch.randint(low, vocab, (b, s), generator=gen),
              "attention_mask": torch.ones(b, s, dtype=torch.long),
              "token_type_ids": torch.zeros(b, s, dtype=torch.long)}
    values["attention_mask"][0, s // 2:] = 0
    return tuple(values[n] for n in names)


def export_model(model, out_path: Path, options: ExportOptions, checkpoint: Path | None = None) -> Path:
    """Export a loaded classifier to `out_path` (its token inputs, output logits), and the sidecar
    (which records `checkpoint`, the folder the model was loaded from, for its tokenizer)."""
    import torch

    options.check()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    names = tuple(options.inputs) if options.inputs is not None else model_inputs(model)
    unknown = [n for n in names if n not in model_inputs(model) and n != "token_type_ids"]
    if "input_ids" not in names or unknown:
        raise ValueError(f"inputs {names}: input_ids is needed, and the model takes {model_inputs(model)}")
    example = dict(zip(names, _example(model, names, options)))
    # Inputs go in by keyword and in the model's own order, so any subset (no mask, no token types)
    # exports with the same wrapper; positional order is what TorchScript names the graph inputs by.
    first, rest = names[0], {n: example[n] for n in names[1:]}

    class _LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, token_type_ids=None):
            given = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
            return self.inner(input_ids=input_ids, **{k: v for k, v in given.items() if v is not None}).logits

    wrapped = _LogitsOnly(model).eval()
    logits_axes = {0: "batch", 1: "seq"} if options.task == "token-classification" else {0: "batch"}
    # The exporters warn about trace-time constants in transformers' mask code (checked: the graph
    # is correct at every batch and sequence length, see tests/planner/test_onnx_import.py); keep the
    # user's terminal for real problems.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if options.dynamo:
            shapes = None
            if options.dynamic:
                batch = torch.export.Dim("batch", min=1, max=1024)
                seq = torch.export.Dim("seq", min=2, max=int(model.config.max_position_embeddings) - 2)
                shapes = {n: {0: batch, 1: seq} for n in names}
            program = torch.onnx.export(
                wrapped, (example[first],), kwargs=rest, dynamo=True, input_names=list(names),
                output_names=["logits"], dynamic_shapes=shapes, opset_version=options.opset,
                optimize=options.optimize, verbose=False,
            )
            program.save(str(out_path))
        else:
            axes = {n: {0: "batch", 1: "seq"} for n in names}
            axes["logits"] = logits_axes
            torch.onnx.export(
                wrapped, (example[first],), str(out_path), kwargs=rest, dynamo=False, input_names=list(names),
                output_names=["logits"], dynamic_axes=axes if options.dynamic else None,
                opset_version=options.opset, do_constant_folding=options.constant_folding,
            )
    if options.sidecar:
        write_hf_sidecar(model, out_path, options, checkpoint)
    return out_path


def write_hf_sidecar(model, out_path: Path, options: ExportOptions, checkpoint: Path | None = None) -> Path:
    """NAME.hf.json: config, task, labels and the transformers name of every ONNX weight."""
    from jobs.common.hf_names import hf_names
    from planner.onnx_import import load_model

    graph = load_model(out_path, 1, 8, with_loss=False)
    state = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    try:
        names, unplaced = hf_names(graph, state, graph.params), None
    except ValueError as exc:  # equal tensors that names do not tell apart: --hf is refused, saying this
        names, unplaced = {}, str(exc)
    config = model.config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        config.pop(key, None)
    labels = list(options.labels) if options.labels else None
    if labels:
        config["id2label"] = {str(i): name for i, name in enumerate(labels)}
        config["label2id"] = {name: i for i, name in enumerate(labels)}
    doc = {"format": "confidant-hf-export", "version": 1, "task": options.task, "num_labels": options.num_labels,
           "labels": labels, "inputs": list(model_inputs(model) if options.inputs is None else options.inputs),
           "architecture": type(model).__name__, "config": config,
           "weights": {p: {"key": n.key, "transposed": n.transposed} for p, n in names.items()},
           "unplaced": unplaced,
           # the folder exported from (None: a model in memory): its tokenizer goes with export-trained --hf
           "checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve()),
           "export": {k: v for k, v in asdict(options).items() if k != "labels"}}
    sidecar = hf_sidecar_path(out_path)
    sidecar.write_text(json.dumps(doc, indent=1, default=list) + "\n")
    return sidecar


def export_checkpoint(checkpoint: Path, out_path: Path, options: ExportOptions = ExportOptions()) -> Path:
    options.check()
    model = load_classifier(Path(checkpoint), options.task, options.num_labels, options.seed, options.attention)
    return export_model(model, out_path, options, Path(checkpoint))
