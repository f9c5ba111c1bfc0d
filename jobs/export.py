"""Export a Hugging Face BERT-family checkpoint to an ONNX token-classification model.

The planner only ever sees ONNX, so this is the one place where PyTorch and transformers are needed.
Both of PyTorch's exporters are supported because users arrive with files from either: the TorchScript
exporter (`dynamo=False`, opsets 14-18 here) and the dynamo exporter (`dynamo=True`).
The classifier head is freshly initialised from a seed (the checkpoint is an encoder only); the export
runs in eval mode, so dropout is absent from the graph, and fine-tuning runs without it.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from tasks.models import default_checkpoint_dir

__all__ = ["DEFAULT_NUM_LABELS", "ExportOptions", "default_checkpoint_dir", "export_checkpoint", "export_model",
           "load_token_classifier"]

DEFAULT_NUM_LABELS = 9  # CoNLL-2003: O plus B-/I- of PER, ORG, LOC, MISC


@dataclass(frozen=True)
class ExportOptions:
    num_labels: int = DEFAULT_NUM_LABELS
    opset: int = 17
    dynamo: bool = False
    seed: int = 0
    example_batch: int = 2
    example_seq: int = 16


def _check_checkpoint(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no config.json: point --checkpoint at a Hugging Face model folder"
        )
    if not any((checkpoint / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")):
        raise FileNotFoundError(f"{checkpoint} has no model.safetensors (nor pytorch_model.bin)")


def load_token_classifier(checkpoint: Path, num_labels: int, seed: int):
    """Load the encoder from `checkpoint` with a seeded linear head of `num_labels` outputs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    _check_checkpoint(checkpoint)
    torch.manual_seed(seed)
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights newly initialised" is expected for the head
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            str(checkpoint), num_labels=num_labels, attn_implementation="eager", local_files_only=True
        )
    finally:
        hf_logging.set_verbosity(previous)
    model.eval()
    return model


def export_model(model, out_path: Path, options: ExportOptions) -> Path:
    """Export a loaded token-classification model to `out_path` (inputs ids/mask/types, output logits)."""
    import torch

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    b, s = options.example_batch, options.example_seq
    gen = torch.Generator().manual_seed(options.seed)
    vocab = int(model.config.vocab_size)
    input_ids = torch.randint(0, vocab, (b, s), generator=gen)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[0, s // 2 :] = 0
    token_type_ids = torch.zeros(b, s, dtype=torch.long)
    args = (input_ids, attention_mask, token_type_ids)
    names = ["input_ids", "attention_mask", "token_type_ids"]

    class _LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).logits

    wrapped = _LogitsOnly(model).eval()
    # The exporters warn about trace-time constants in transformers' mask code (checked: the graph
    # is correct at every batch and sequence length, see tests/test_onnx_import.py); keep the
    # user's terminal for real problems.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if options.dynamo:
            batch = torch.export.Dim("batch", min=1, max=1024)
            seq = torch.export.Dim("seq", min=2, max=int(model.config.max_position_embeddings))
            shapes = {n: {0: batch, 1: seq} for n in names}
            program = torch.onnx.export(
                wrapped, args, dynamo=True, input_names=names, output_names=["logits"],
                dynamic_shapes=shapes, opset_version=options.opset, optimize=True, verbose=False,
            )
            program.save(str(out_path))
        else:
            axes = {n: {0: "batch", 1: "seq"} for n in names}
            axes["logits"] = {0: "batch", 1: "seq"}
            torch.onnx.export(
                wrapped, args, str(out_path), dynamo=False, input_names=names, output_names=["logits"],
                dynamic_axes=axes, opset_version=options.opset, do_constant_folding=True,
            )
    return out_path


def export_checkpoint(checkpoint: Path, out_path: Path, options: ExportOptions = ExportOptions()) -> Path:
    model = load_token_classifier(Path(checkpoint), options.num_labels, options.seed)
    return export_model(model, out_path, options)
