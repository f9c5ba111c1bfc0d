"""An LLM stage fits a phone (issue 31, targets 1-3): planned against measured memory per device, from a plan folder.

What it measures
    For each model, LoRA r=8 alpha 16 on q, k, v, o with the frozen base held `--base-dtype int4`,
    batch 4 x 128 in 4 micro-batches of one row, AdamW, 1f1b-flush, one thread per process:
      1. `confidant profile` of this machine for the model (MNN, one thread, one repetition);
      2. `confidant plan` over N copies of this machine with the target budget each (the issue's);
         where no plan fits, the planner's own figure of the tightest device's need is reported and
         the plan is made again at the smallest budget (a multiple of 16 MiB) the planner accepts,
         so the memory model can still be checked against a run;
      3. `confidant train PLAN --local` for `--steps` steps on the entities-json task: one worker
         process per device, each started with the plan's base.safetensors (`--base`), as a user
         runs it.
    ``measured`` is each worker's own peak resident set (VmHWM, setup included: the worker's whole
    life, as `train` reports it); ``planned`` the memory model's (plan.json, `confidant show`).

Models
    ``smollm2``: SmolLM2-135M-Instruct (benchmarks/llm.py's export), 3 devices of 256 MiB.
    ``qwen``: a Qwen2.5-0.5B-class model: transformers' Qwen2Config with the published shape (vocab
    151936, 24 layers, hidden 896, intermediate 4864, 14 heads / 2 key-value heads, tied embeddings),
    random weights (seed 0), saved with save_pretrained and exported by the project's own causal-LM
    exporter (jobs.export.llm, `confidant export --task causal-lm`), with SmolLM2's tokenizer beside
    it (its ids are below Qwen's vocabulary); 3 devices of 512 MiB. Export: ~8 GiB for a moment.
    ``llama1b``: a Llama-3.2-1B-class model the same way (vocab 128256, 16 layers, hidden 2048,
    intermediate 8192, 32 / 8 heads, tied), 4 devices of 768 MiB, exported with `--base-dtype int4`
    (planner/onnx_quantize.py's lean export: it holds the loaded model and the quantized file, ~5 GiB; it needed ~20).

    ``gpt2`` and ``gemma3``: families the memory model was not tuned on, random weights from the published
    configs (GPT-2 124M: LayerNorm, learned positions, fused QKV, tanh GELU, biases; Gemma-3-270M: a 262144 x
    640 tied table, GeGLU, RMSNorm (1 + w), Q / K norms, a scaled embedding, sliding-window layers; exported
    `--base-dtype int4`), 3 devices each at the least multiple of 32 MiB that plans (rows ``gpt2``,
    ``gemma3`` on MNN, ``gpt2-torch``, ``gemma3-torch`` on PyTorch; each run ~2-4 min with its profile).

Further rows (`CONFIGS`): ``smollm2-all-target`` (data whose every position is a target: the fused
LM head + loss's worst case; `plan --data` charges the head for the data's most targets a micro-batch), ``smollm2-float32`` (a float32 base),
``smollm2-stash`` (1f1b-stash), ``smollm2-torch`` (every device on PyTorch, profiled and planned
there: the least budget from 320 MiB up that plans; layer stages recompute per block; ``-float32``
the same with a float32 base; ``-roomy`` at 1024 MiB, where they keep), ``smollm2-recompute`` (3 x 384 MiB: MNN's per-op caches of one
micro-batch fit), ``smollm2-modes`` (budgets 1024 / 448 / 256 MiB: the planner picks
keep, recompute or per-block per device by its budget), ``minilm-full-2`` / ``minilm-full-3``
(MiniLM full fine-tuning, token classification, over 2 and 3 devices at the least budget that plans).

Usage
    python benchmarks/memory_plans.py [--models smollm2,qwen] [--steps 1] [--json OUT]
`plan_rows()` returns the rows for benchmarks/memory.py (`--plans`) to print beside its own.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

CACHE = Path.home() / ".cache" / "confidant"
RANK, ALPHA, BATCH, SEQ, M = 8, 16.0, 4, 128, 4
MIB = 2 ** 20
# name -> (devices, budget MiB, HF config for a random model or None for SmolLM2)
MODELS = {
    "smollm2": (3, 256, None),
    "qwen": (3, 512, {"family": "qwen2", "vocab_size": 151936, "num_hidden_layers": 24, "hidden_size": 896,
                      "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
                      "tie_word_embeddings": True, "max_position_embeddings": 32768, "rope_theta": 1e6,
                      "rms_norm_eps": 1e-6}),
    # Llama-3.2-1B's published config; exported with --base-dtype int4 (a 1 GiB file, not 4.7 GiB of float32)
    "llama1b": (4, 768, {"family": "llama", "vocab_size": 128256, "num_hidden_layers": 16, "hidden_size": 2048,
                         "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
                         "head_dim": 64, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                         "rope_theta": 5e5, "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001,
                         "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                         "export_flags": ["--base-dtype", "int4"]}),
}
# llama1b's vocabulary, width and layer shape with 4 layers, over 2 devices of 768 MiB: its first stage is
# llama1b's (the 128256 x 2048 tied table's lookup and layers recomputing) at a fraction of the cost (no
# far point of the per-block line, 4 layers to train): ~0.6 GB export, a profile of a few minutes
MODELS["llama1b-4"] = (2, 768, {**MODELS["llama1b"][2], "num_hidden_layers": 4})
# Families the memory model was not tuned on (its rows above are all Llama / Qwen2 decoders):
# GPT-2 (124M), its published config: LayerNorm, learned positions, Conv1D exported as Gemm, fused QKV, tanh GELU,
# biases everywhere, the head tied; 3 devices, the budget the least 32 MiB step that plans (CONFIGS)
MODELS["gpt2"] = (3, 256, {"family": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
                           "n_positions": 1024, "n_inner": None, "activation_function": "gelu_new",
                           "tie_word_embeddings": True})
# Gemma-3-270M's published text config: vocabulary 262144 (a 640-wide tied table of 160 Mi entries), 18 layers,
# 4 heads / 1 key-value head of 256, GeGLU MLP of 2048 (tanh GELU, not fused on this export: it lowers op by op),
# RMSNorm with (1 + w), Q / K norms, embeddings scaled by sqrt(hidden), 5 sliding-window layers to 1 full
MODELS["gemma3"] = (3, 256, {"family": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
                             "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
                             "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
                             "query_pre_attn_scalar": 256, "sliding_window": 512, "rms_norm_eps": 1e-6,
                             "tie_word_embeddings": True,
                             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                             "export_flags": ["--base-dtype", "int4"]})
# GPT-2's shape at a toy size (SmolLM2's vocabulary, 64 wide, 2 layers): every stage holds a few MiB beyond
# PyTorch's runtime, less than its import peaks above where it settles (~33 MiB here): the set-up's own peak
# is such a stage's figure (`planner.cluster.setup_peak_bytes`)
MODELS["gpt2-tiny"] = (2, 256, {"family": "gpt2", "vocab_size": 49152, "n_embd": 64, "n_layer": 2, "n_head": 2,
                                "n_positions": 256, "n_inner": None, "activation_function": "gelu_new",
                                "tie_word_embeddings": True})

# a budget below any plan's need, so the row is planned and run at the least multiple of 32 MiB that plans
_TIGHT = {"budget": 64, "budget_step": 32}

# Further rows for the memory model (issue 31 target 3), each a model of MODELS (or "minilm") run another
# way: name -> (model, overrides). Overrides: base_dtype ("int4", "float32"; None with full fine-tuning),
# full (no LoRA), schedule, update_every (backwards per update), devices,
# budget (MiB: one for all, or one per device, which then is planned
# as given), budget_step (MiB: where no plan fits the budget, the least multiple of it that plans; 16 unless
# given), data ("entities" or "all-target": every position a target, the fused loss's worst case).
CONFIGS = {
    "smollm2": ("smollm2", {}),
    "qwen": ("qwen", {}),
    "llama1b": ("llama1b", {}),
    "llama1b-4": ("llama1b-4", {}),
    "smollm2-all-target": ("smollm2", {"data": "all-target"}),
    "smollm2-float32": ("smollm2", {"base_dtype": "float32"}),
    "smollm2-stash": ("smollm2", {"schedule": "1f1b-stash"}),
    # 2bw keeps two weight versions: an update at most every `stages` backwards, dividing the 4 micro-batches,
    # so 2 devices updating every 2 (256 MiB does not fit two stages: planned and run at their need)
    "smollm2-2bw": ("smollm2", {"schedule": "2bw", "update_every": 2, "devices": 2}),
    # full fine-tuning (no LoRA, a float32 base): 256 MiB does not fit, so planned and run at its need
    "smollm2-full": ("smollm2", {"full": True}),
    # one device of each activation mode the planner picks by budget (keep, recompute, per block)
    "smollm2-modes": ("smollm2", {"budget": [1024, 448, 256], "base_dtype": "float32"}),
    "smollm2-recompute": ("smollm2", {"budget": 384}),  # room for one micro-batch's caches, not for more
    # every device on the PyTorch engine (its import and start-up ~190 MiB a process): the least budget
    # that plans, where layer stages recompute per block (each block under a checkpoint of its own)
    "smollm2-torch": ("smollm2", {"engine": "torch", "budget": 320}),
    "smollm2-torch-roomy": ("smollm2", {"engine": "torch", "budget": 1024}),  # the same where keeping fits
    "smollm2-torch-float32": ("smollm2", {"engine": "torch", "budget": 320, "base_dtype": "float32"}),
    # the same where its workers read the base mapped (issue 31 target 4, helper h162): 408 MiB, where one device
    # (412.6 MiB planned) does not fit and three per-block stages do
    "smollm2-torch-float32-mapped": ("smollm2", {"engine": "torch", "budget": 408, "base_dtype": "float32"}),
    "smollm2-torch-stash": ("smollm2", {"engine": "torch", "budget": 320, "schedule": "1f1b-stash"}),
    "smollm2-torch-2bw": ("smollm2", {"engine": "torch", "budget": 320, "schedule": "2bw", "update_every": 2,
                                       "devices": 2}),
    "smollm2-torch-full": ("smollm2", {"engine": "torch", "full": True}),
    # families the memory model was not tuned on (MODELS): LoRA int4 on MNN and on PyTorch, 3 devices each at
    # the least 32 MiB step that plans
    "gpt2": ("gpt2", _TIGHT),
    "gpt2-torch": ("gpt2", {**_TIGHT, "engine": "torch"}),
    "gemma3": ("gemma3", _TIGHT),
    "gemma3-torch": ("gemma3", {**_TIGHT, "engine": "torch"}),
    "gpt2-tiny-torch": ("gpt2-tiny", {**_TIGHT, "engine": "torch"}),
    "minilm-full-2": ("minilm", {"full": True, "devices": 2, "budget": 128}),
    "minilm-full-3": ("minilm", {"full": True, "devices": 3, "budget": 96}),
}
_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

_MAKE_RANDOM = """
import json, sys, torch
import transformers as tf
shape = json.loads(sys.argv[2])
family = shape.pop("family")
config, cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
               "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[family]
torch.manual_seed(0)
cls(config(**shape)).save_pretrained(sys.argv[1])
"""


def model_path(name: str) -> Path:
    """The ONNX export of `name`, made once and cached under ~/.cache/confidant."""
    if name == "minilm":
        from benchmarks.common import default_model

        return default_model()
    shape = MODELS[name][2]
    if shape is None:
        from benchmarks.llm import smollm2_model

        return smollm2_model()
    folder = CACHE / f"bench-{name}"
    onnx = folder / f"{name}.onnx"
    if onnx.is_file():
        return onnx
    hf = folder / "hf"
    env = {**os.environ, **_ENV}
    shape = dict(shape)
    flags = shape.pop("export_flags", [])
    if not (hf / "config.json").is_file():
        subprocess.run([sys.executable, "-c", _MAKE_RANDOM, str(hf), json.dumps(shape)], check=True, env=env)
    subprocess.run([sys.executable, "-m", "confidant", "export", "--task", "causal-lm", "--checkpoint", str(hf),
                    "--no-kv-cache", *flags, "-o", str(onnx)], check=True, env=env, cwd=_HERE.parent)
    smollm2 = model_path("smollm2").parent
    for f in ("tokenizer.json", "chat_template.json"):  # SmolLM2's ids are all below the vocabulary
        shutil.copy(smollm2 / f, folder / f)
    shutil.rmtree(hf)
    return onnx


def hf_checkpoint(name: str) -> Path:
    """The transformers folder of a random model of MODELS (`name`), for reference runs (PEFT) on the weights
    its cached export holds: made again with the export's seed (the export deletes its own), kept beside it."""
    shape = dict(MODELS[name][2])
    shape.pop("export_flags", None)
    folder = model_path(name).parent / "transformers"
    if not (folder / "config.json").is_file():
        env = {**os.environ, **_ENV}
        subprocess.run([sys.executable, "-c", _MAKE_RANDOM, str(folder), json.dumps(shape)], check=True, env=env)
    return folder


def _cluster(path: Path, profile: Path, devices: int, budget_mib, engine: str = "mnn") -> Path:
    budgets = budget_mib if isinstance(budget_mib, list) else [budget_mib] * devices
    path.write_text("devices:\n" + "".join(
        f"  - {{name: d{k}, address: 'tcp://127.0.0.1:59{k}1', profile: {profile.name}, memory_budget: "
        f"{budgets[k]}MiB, backend: '{engine}:cpu:t1'}}\n" for k in range(devices))
        + "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    return path


def all_target_data(path: Path, rows: int = 64) -> Path:
    """Entities-json-shaped rows whose every position is a target: a one-letter prompt and a response
    longer than the sequence (the fused loss's worst case: it skips positions of weight 0)."""
    words = " ".join(f"word{i % 50}" for i in range(200))
    path.write_text("".join(json.dumps({"prompt": "x", "response": words}) + "\n" for _ in range(rows)))
    return path


def plan_row(config: str, steps: int, out: Path, data: Path, base: bool = True) -> dict:
    from ir.bundle import load_plan
    from jobs.common.errors import JobError
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from planner.lora import LoraSettings

    name, over = CONFIGS[config]
    devices, target = MODELS[name][:2] if name in MODELS else (2, 128)
    devices, target = over.get("devices", devices), over.get("budget", target)
    model = model_path(name)
    out.mkdir(parents=True, exist_ok=True)
    lora = None if over.get("full") else LoraSettings(RANK, ALPHA, targets=("q", "k", "v", "o"), train_also=(),
                                                      seed=0, base_dtype=over.get("base_dtype", "int4"))
    if over.get("data") == "all-target":
        data = all_target_data(out / "all-target.jsonl")
    profile = out / "dev.json"
    engine = over.get("engine", "mnn")
    profiled = time.perf_counter()
    profile_this_device(model, 1, SEQ, profile, name="dev", backends=(f"{engine}:cpu:t1",), reps=1,
                        attention=False, lora=lora)
    profile_s = time.perf_counter() - profiled
    schedule = over.get("schedule", "1f1b-flush")
    # the plan knows its data (`plan --data`): an embedding table's AdamW state is charged for the rows it looks up
    settings = PlanSettings(schedule, BATCH, SEQ, M, update_every=over.get("update_every", 1), lora=lora, data=data,
                            time_limit_s=60.0)
    row = {"model": config, "devices": devices, "target_mib": target, "fits_target": True, "needs_mib": None,
           "schedule": schedule, "engine": engine, "profile_s": profile_s}
    budget = target
    try:
        plan_model(model, _cluster(out / "cluster.yaml", profile, devices, budget, engine), settings, out / "plan")
    except JobError as exc:  # no plan fits: the planner's need for the tightest device, then plan there
        need = re.search(r"needs ([0-9.]+) MiB", str(exc))
        if need is None or isinstance(target, list):
            raise
        # the planner's own line, with its "what would make it fit" (the levers and the MiB each saves)
        row.update(fits_target=False, needs_mib=float(need.group(1)), no_fit=str(exc))
        step = over.get("budget_step", 16)
        budget = step * math.ceil(row["needs_mib"] / step)
        while True:
            try:
                plan_model(model, _cluster(out / "cluster.yaml", profile, devices, budget, engine), settings, out / "plan")
                break
            except JobError:
                budget += step
    plan = load_plan(out / "plan")
    budgets = budget if isinstance(budget, list) else [budget] * devices
    by_device = {f"d{k}": b for k, b in enumerate(budgets)}
    row.update(budget_mib=budget, budgets_mib=[by_device[d.name] for d in plan.devices],
               blocks=[list(d.blocks) for d in plan.devices],
               activations=[d.activations for d in plan.devices],
               planned_mib=[d.memory_bytes / MIB for d in plan.devices],
               terms_mib=[{k: v / MIB for k, v in (d.memory_terms or {}).items()} for d in plan.devices])

    started = time.perf_counter()
    metrics = train_from_plan(out / "plan", data, None, PlanRunSettings(steps=steps, seed=0, local=True,
                                                                        insecure=True, local_base=base))
    by_name = {d.name: d.peak_rss_bytes for d in metrics.devices}
    row["measured_mib"] = [by_name[d.name] / MIB if by_name.get(d.name) else None for d in plan.devices]
    row["seconds"] = time.perf_counter() - started
    row["loss"] = metrics.steps[-1].loss if metrics.steps else None
    return row


def _child(name: str, steps: int, base: bool = True) -> dict:
    if name not in CONFIGS:
        raise SystemExit(f"--models: {name!r} is not one of {', '.join(CONFIGS)}")
    cmd = [sys.executable, __file__, "--child", name, "--steps", str(steps)] + ([] if base else ["--workers-without-base"])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **_ENV}, timeout=7200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def plan_rows(models=("smollm2", "qwen"), steps: int = 1, base: bool = True) -> list[dict]:
    """One row per model, each from its own child process, one after another."""
    return [_child(m, steps, base) for m in models]


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        fits = ("fits" if r["fits_target"] else f"does not fit (tightest device needs {r['needs_mib']:.1f} MiB); "
                f"planned and run at {r['budget_mib']} MiB")
        lines.append(f"{r['model']} ({r.get('schedule', '1f1b-flush')}): {r['devices']} devices of "
                     f"{r['target_mib']} MiB: {fits}")
        if r.get("no_fit"):
            lines.append("  plan at the target: " + r["no_fit"].replace("\n", "\n    "))
        budgets = r.get("budgets_mib") or [r["budget_mib"]] * len(r["blocks"])
        for k, blocks in enumerate(r["blocks"]):
            planned, measured = r["planned_mib"][k], r["measured_mib"][k]
            ratio = "-" if not measured else f"{measured / planned:.2f}"
            within = "" if not measured else ("  over budget" if measured > budgets[k] else "")
            mode = (r.get("activations") or [None] * len(r["blocks"]))[k] or "default"
            mode = f"{r['engine']}, {mode}" if r.get("engine", "mnn") != "mnn" else mode
            lines.append(f"  stage {k} blocks {blocks[0]}-{blocks[1]} ({mode}): planned {planned:6.1f}  measured "
                         f"{measured or float('nan'):6.1f} MiB  measured/planned {ratio}{within}")
        worst = max(abs(m / p - 1) for p, m in zip(r["planned_mib"], r["measured_mib"]) if m)
        lines.append(f"  memory model: worst {worst:.0%} off (target <= 10%); every peak within its budget: "
                     f"{all(m and m <= b for m, b in zip(r['measured_mib'], budgets))}")
        if r.get("profile_s") is not None:
            lines.append(f"  profile {r['profile_s']:.0f} s, training {r['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models", default="smollm2,qwen", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=2, help="training steps per plan (default 2: AdamW's moments exist from the first update on, so a run of one step never holds them during a backward)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workers-without-base", action="store_true",
                    help="start the local workers without the plan's base.safetensors, as remote workers started "
                         "without `confidant worker --base`: every frozen weight is sent to them")
    args = ap.parse_args(argv)
    if args.child:
        import tempfile

        from tasks.causal_lm.entity_task import write_entity_splits

        with tempfile.TemporaryDirectory() as d:
            if CONFIGS[args.child][0] == "minilm":
                from tasks.ner.datagen import write_splits

                train, _ = write_splits(Path(d), n_train=64, n_dev=1, seed=0)
            else:
                train, _ = write_entity_splits(Path(d), n_train=64, n_dev=1, seed=0)
            print("ROW " + json.dumps(plan_row(args.child, args.steps, Path(d) / "run", train, not args.workers_without_base)), flush=True)
        return 0
    rows, failed = [], []
    for name in args.models.split(","):  # each row printed as it comes; a failed one named, the rest still run
        try:
            rows.append(_child(name, args.steps, not args.workers_without_base))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failed.append(name)
            print(f"{name}: failed: {exc}", flush=True)
            continue
        print(format_rows(rows[-1:]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
