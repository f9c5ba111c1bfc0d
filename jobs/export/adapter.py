"""`confidant export-adapter CHECKPOINT -o DIR`: a LoRA run's adapters in PEFT's format, which
`peft.AutoPeftModelForCausalLM.from_pretrained(DIR)` (or the classifiers' AutoPeftModelFor...) loads
with no other argument: the tokenizer is beside the adapter and `base_model_name_or_path` names a
transformers folder (`export_adapter_for`); with `--merged -o model.onnx`, the ONNX file it trained
with the adapters merged into the base weights, and the side files `generate` and `predict` read.

PEFT keeps, per adapted Linear `M` of the base model, `base_model.model.M.lora_A.weight` [r, in] and
`base_model.model.M.lora_B.weight` [out, r] (Confidant's A is [in, r] and B [r, out]: transposed),
and every module trained in full (`modules_to_save`: the task head) under its own parameter names
`base_model.model.<name>`. Which transformers module each weight of the lowered model is, is
`jobs.common.hf_names`' business; this job only writes the files (with the project's own safetensors codec).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ir.safetensors import save_safetensors
from jobs.common.errors import JobError
from jobs.common.hf_names import hf_names
from planner.lora import LoraSettings, add_lora
from planner.onnx_import import load_model
from runtime.pipeline.checkpoints import load_checkpoint

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def lora_run(checkpoint: Path):
    """(meta, trained weights, LoRA settings, the adapted graph as exported, its adapters) of a
    checkpoint written by a LoRA run."""
    meta, weights, _ = load_checkpoint(Path(checkpoint))
    if not meta.get("lora"):
        raise JobError(_not_a_lora_run(checkpoint, meta, weights))
    model = Path(meta.get("model_path", ""))
    if not model.is_file():
        raise JobError(f"{checkpoint}: the model it was trained from ({model}) is not there; the export needs it "
                       f"to name the weights")
    settings = LoraSettings(**{**meta["lora"], "targets": tuple(meta["lora"]["targets"]),
                               "train_also": tuple(meta["lora"]["train_also"])})
    graph, adapters = add_lora(load_model(model, 1, 8), settings)
    missing = sorted(set(graph.params) - set(weights))
    if missing:
        raise JobError(f"{checkpoint} lacks trained weights {missing[:4]} of the adapted model; was it written by "
                       f"this LoRA run?")
    return meta, weights, settings, graph, adapters


def _not_a_lora_run(checkpoint: Path, meta: dict, weights) -> str:
    """Why a checkpoint without LoRA settings has no adapters to export, and what to run instead
    (each flag named is one the command it names has)."""
    if any(name.endswith((".lora_A", ".lora_B")) for name in weights):
        if meta.get("plan"):
            return (f"{checkpoint} holds LoRA adapters but its meta.json has no LoRA settings: it was trained from "
                    f"the plan {meta['plan']}, made before plans recorded them; re-plan with `confidant plan MODEL "
                    "--cluster FILE --lora R` (the same LoRA flags) and train again with `confidant train PLAN "
                    "--checkpoint DIR`")
        return (f"{checkpoint} holds LoRA adapters but its meta.json has no LoRA settings (a checkpoint written "
                "before they were recorded); train again with --lora R --checkpoint DIR (train-local or "
                "train-pipeline)")
    return (f"{checkpoint} is the checkpoint of a full fine-tuning run (no adapters in it): write the trained model "
            f"with `confidant export-trained {checkpoint} --hf DIR` (or -o FILE.onnx); for adapters, train with "
            "--lora R (train-local and train-pipeline take it, and so does `confidant plan` for `confidant train "
            "PLAN`)")


def export_adapter(checkpoint: Path, out: Path, base_state: dict[str, np.ndarray], task_type: str = "TOKEN_CLS",
                   base_name: str | None = None, fan_in_fan_out: bool = False) -> Path:
    """Write `out`/adapter_config.json and `out`/adapter_model.safetensors from a LoRA checkpoint;
    `base_state` is the transformers model's state dict (numpy) the ONNX file was exported from."""
    meta, weights, settings, graph, adapters = lora_run(checkpoint)
    adapter_params = {p for a in adapters for p in (a.a, a.b)}
    in_full = [p for p in graph.params if p not in adapter_params]
    try:
        names = hf_names(graph, base_state, [a.base for a in adapters] + in_full)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    tensors: dict[str, np.ndarray] = {}
    for a in adapters:
        module = names[a.base].module
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(weights[a.a].T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(weights[a.b].T)
    for p in in_full:
        tensors[f"base_model.model.{names[p].key}"] = names[p].to_hf(weights[p])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(out / PEFT_WEIGHTS, {k: np.asarray(v, np.float32) for k, v in tensors.items()})
    config = {
        "peft_type": "LORA", "task_type": task_type, "r": settings.rank, "lora_alpha": settings.alpha,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": fan_in_fan_out, "inference_mode": True,
        "init_lora_weights": True, "base_model_name_or_path": base_name,
        "target_modules": sorted({names[a.base].module for a in adapters}),
        "modules_to_save": sorted({names[p].module.rsplit(".", 1)[-1] for p in in_full}) or None,
    }
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return out


BASE_FOLDER = "base"  # inside the adapter folder: the base model as a transformers folder, when one is written
BASE_MARK = "confidant-base.json"  # in that folder: what it was written from, so a later export reuses it
PEFT_AUTO_CLASSES = {"CAUSAL_LM": "AutoPeftModelForCausalLM", "SEQ_CLS": "AutoPeftModelForSequenceClassification",
                     "TOKEN_CLS": "AutoPeftModelForTokenClassification"}


def export_adapter_for(checkpoint: Path, out: Path, base: Path | None = None, num_labels: int | None = None,
                       seed: int = 0, tokenizer: Path | None = None) -> Path:
    """`export_adapter` against the transformers model the run's ONNX file was exported from, as its
    task has it: a token or sequence classifier at `base` (default: the bundled MiniLM) with the run's
    label count (`num_labels`, else the checkpoint's labels) and seed, or a causal LM at `base` (a
    Hugging Face folder or a .gguf file; default: the source its NAME.lm.json records). `tokenizer`:
    the tokenizer.json or folder it was trained with (default: the base's, else `jobs.common.hf_tokenizer`'s).

    The folder loads by PEFT's and transformers' own calls with no other argument
    (`loading_lines`): its tokenizer is written beside the adapter, and `base_model_name_or_path`
    names a transformers folder: a causal LM's Hugging Face folder as it is, else the base written
    into `out`/base (a GGUF file dequantized; an encoder with the run's head size, labels and seeded
    head, which the adapter's trained head replaces), reused when it is already there."""
    from jobs.export.encoder import default_checkpoint_dir, load_classifier, read_hf_sidecar
    from jobs.common.hf_tokenizer import causal_lm_tokenizer, encoder_tokenizer, has_tokenizer_files, load_hf_tokenizer

    meta, _, _, _, _ = lora_run(checkpoint)
    task = meta.get("task") or "ner"
    model_path = Path(meta["model_path"])
    if task == "causal-lm":
        from jobs.export.llm import load_causal_lm
        from tasks.causal_lm.generate import lm_metadata

        if base is None:
            source = ((lm_metadata(model_path) or {}).get("source") or {}).get("path")
            if not source:
                raise JobError(f"{checkpoint}: a causal LM's adapters are named against its transformers model: give "
                               "--base (the Hugging Face folder or .gguf file it was exported from)")
            base = Path(source)
        reuse_base = Path(base).is_dir() and (Path(base) / "config.json").is_file()
        written = None if reuse_base else _written_base(Path(out) / BASE_FOLDER, _base_source(base, task, seed))
        # a base written before is read back (safetensors) instead of dequantizing the GGUF again
        model = load_causal_lm(written or Path(base))[0]
        task_type = "CAUSAL_LM"
        hf_tokenizer = (load_hf_tokenizer(Path(tokenizer)) if tokenizer is not None
                        else causal_lm_tokenizer(model_path, Path(base))[0])
    else:
        base = Path(base) if base else default_checkpoint_dir()
        labels = meta.get("labels") or ()
        count = num_labels or len(labels) or 9
        model = load_classifier(base, "seq-cls" if task == "seq-cls" else "token-classification", count, seed)
        if len(labels) == count:
            model.config.id2label = dict(enumerate(labels))
            model.config.label2id = {name: i for i, name in enumerate(labels)}
        task_type = "SEQ_CLS" if task == "seq-cls" else "TOKEN_CLS"
        hf_tokenizer = (load_hf_tokenizer(base) if tokenizer is None and has_tokenizer_files(base)
                        else encoder_tokenizer(model_path, read_hf_sidecar(model_path), tokenizer)[0])
        reuse_base = False  # the folder's head (if any) is not the run's: the base with the run's head is written
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    # GPT-2's projections are Conv1D (weights [in, out]): PEFT merges those with fan_in_fan_out
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    out = Path(out)
    if reuse_base:
        base_dir = Path(base).resolve()
    else:
        base_dir = _write_base(model, hf_tokenizer, out / BASE_FOLDER,
                               _base_source(base, task, seed, model.config.num_labels if task != "causal-lm" else None))
    export_adapter(checkpoint, out, state, task_type, base_name=str(base_dir), fan_in_fan_out=conv1d)
    if hf_tokenizer is not None:
        from jobs.common.hf_tokenizer import write_hf_tokenizer

        write_hf_tokenizer(hf_tokenizer, out)
    return out


def _base_source(base: Path, task: str, seed: int, labels: int | None = None) -> dict:
    """What a written base is made from (BASE_MARK): the same source gives the same folder."""
    base = Path(base).resolve()
    stat = base.stat()
    return {"source": str(base), "size": stat.st_size if base.is_file() else None, "mtime_ns": stat.st_mtime_ns,
            "task": task, "seed": seed, "labels": labels}


def _written_base(folder: Path, source: dict) -> Path | None:
    """`folder` (absolute) if it holds a base written from `source`, else None."""
    folder = Path(folder).resolve()
    mark = folder / BASE_MARK
    if mark.is_file() and (folder / "config.json").is_file():
        try:
            if json.loads(mark.read_text()) == source:
                return folder
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    return None


def _write_base(model, tokenizer, folder: Path, source: dict) -> Path:
    """`model` (and its tokenizer) saved by transformers into `folder`, unless a base written from
    the same source is there already (BASE_MARK): the folder, absolute."""
    folder = Path(folder).resolve()
    if _written_base(folder, source) is not None:
        return folder
    mark = folder / BASE_MARK
    mark.unlink(missing_ok=True)  # written again: not the mark of another source meanwhile
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    mark.write_text(json.dumps(source, indent=1) + "\n")
    return folder


def loading_lines(folder: Path) -> list[str]:
    """The three Python lines that load the adapter folder `folder` with PEFT and transformers."""
    config = json.loads((Path(folder) / PEFT_CONFIG).read_text())
    auto = PEFT_AUTO_CLASSES.get(config.get("task_type"), "AutoPeftModel")
    where = str(Path(folder).resolve())
    if not (Path(folder) / "tokenizer_config.json").is_file():  # a model exported without one (a random test model)
        return [f"from peft import {auto}", f"model = {auto}.from_pretrained({where!r})",
                "# no tokenizer: the model was exported without one"]
    return [f"from peft import {auto}; from transformers import AutoTokenizer",
            f"model = {auto}.from_pretrained({where!r})",
            f"tokenizer = AutoTokenizer.from_pretrained({where!r})"]


def merged_weights(graph, weights, adapters, scale: float) -> dict[str, np.ndarray]:
    """Each adapted base weight with its adapter merged in (W + scale * A B, in W's own layout), and
    every parameter trained in full: the trained model as plain weights of the original file."""
    out = {}
    adapter_params = {p for a in adapters for p in (a.a, a.b)}
    for a in adapters:
        delta = scale * (weights[a.a].astype(np.float64) @ weights[a.b].astype(np.float64))
        base = graph.constants[a.base].astype(np.float64)
        out[a.base] = (base + (delta.T if a.base_transposed else delta)).astype(graph.constants[a.base].dtype)
    out.update({p: weights[p] for p in graph.params if p not in adapter_params})
    return out


def export_merged(checkpoint: Path, out: Path) -> Path:
    """The ONNX file the LoRA run trained, with its adapters merged into the base weights and the
    parameters trained in full replaced: ONNX Runtime runs it as the trained model. Beside it go the
    side files the commands read with the source's: a causal LM's NAME.lm.json, its key/value-cache
    graph with the same merged weights, tokenizer.json and chat_template.json (`generate` takes
    it); a classifier's NAME.hf.json with the run's label names (`predict` names its labels)."""
    from planner.onnx_import import write_weights

    meta, weights, settings, graph, adapters = lora_run(checkpoint)
    source, out = Path(meta["model_path"]), Path(out)
    if out.resolve() == source.resolve():
        raise JobError(f"-o {out} is the model the run was trained from; write the merged model elsewhere")
    merged = merged_weights(graph, weights, adapters, settings.scale)
    write_weights(source, out, merged)
    _merged_side_files(source, out, merged, meta)
    return out


def _merged_side_files(source: Path, out: Path, merged: dict, meta: dict) -> None:
    import shutil

    from jobs.export.encoder import hf_sidecar_path, read_hf_sidecar
    from planner.onnx_import import write_weights
    from tasks.causal_lm.generate import lm_metadata
    from tasks.causal_lm.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE

    lm = lm_metadata(source)
    if lm is not None:
        kv_source = source.parent / lm["kv_model"] if lm.get("kv_model") else None
        kv_out = out.with_suffix(".kv.onnx")
        if kv_source is not None and kv_source.is_file() and lm.get("kv_same_weight_names"):
            write_weights(kv_source, kv_out, merged)
        else:  # a dynamo export's cache graph has other weight names: generation recomputes instead
            kv_out.unlink(missing_ok=True)
            kv_out = None
        doc = {**lm, "model": out.name, "kv_model": None if kv_out is None else kv_out.name,
               "source": {**(lm.get("source") or {}), "merged_from": str(source)}}
        out.with_suffix(".lm.json").write_text(json.dumps(doc, indent=1) + "\n")
        if out.parent.resolve() != source.parent.resolve():
            for name in (TOKENIZER_FILE, CHAT_TEMPLATE_FILE):
                if (source.parent / name).is_file():
                    shutil.copyfile(source.parent / name, out.parent / name)
    sidecar = read_hf_sidecar(source)
    if sidecar is not None:
        labels = meta.get("labels")
        if labels and len(labels) == sidecar.get("num_labels"):
            sidecar = {**sidecar, "labels": list(labels)}
        hf_sidecar_path(out).write_text(json.dumps(sidecar, indent=1) + "\n")
