"""Full fine-tuning vs LoRA, on one device and on a 3-stage pipeline, next to PyTorch with PEFT.

What it measures
    MiniLM (all-MiniLM-L6-v2) token classification, 9 labels, batch 8 x sequence 128, AdamW
    (lr 1e-4), one compute thread per process, 4 micro-batches, `--steps` timed steps after one
    warm-up step, the same seeded random batches everywhere (benchmarks/common.py).
      * ``mnn single full`` / ``mnn single lora``: one child process trains the whole model on the
        MNN engine (gradients of the 4 micro-batches accumulated, one AdamW step).
      * ``mnn 3-stage full|lora flush|stash``: 3 worker processes (`jobs.common.workers.LocalWorkers`)
        driven by `jobs.train.pipeline.train_pipeline` (this process is the coordinator) with the
        even split of the model's 9 blocks, under ``1f1b-flush`` and ``1f1b-stash``.
      * ``torch+peft single full`` / ``torch+peft single lora``: one child process trains
        transformers' BertForTokenClassification (eval mode, as the ONNX export) with PyTorch, the
        LoRA one through PEFT (`get_peft_model`, same rank, alpha and targets, classifier trained
        in full as `modules_to_save`).
    LoRA: rank ``--rank`` (8), alpha 16, targets q, k, v, o (the attention projections), the task
    head trained in full.

Columns
    ``step s``     median seconds per step; 1f1b-stash runs all steps as one schedule, so its
                   figure is that run's time / steps (warm-up included).
    ``peak MiB``   each process's peak resident set (VmHWM), stage 0 first; the coordinator is not
                   counted (it lives elsewhere in a deployment).
    ``max``        the largest process.
    ``trainable``  bytes of trainable parameters (MNN: the graph's parameters; torch: requires_grad).
Ratios printed below the table are the issue's targets: the LoRA pipeline's largest device against
full fine-tuning's on the same split and against single-device full fine-tuning, and a LoRA step
against a full step on the same engine. ``others`` is the share of all CPUs other processes used.

``--model smollm2``: SmolLM2-135M-Instruct as a causal LM (benchmarks/llm.py's export and batch: 4
entities-json conversations x 128 tokens, loss on the answers), 4 micro-batches of one row, AdamW
lr 1e-4, LoRA on q, k, v, o only (a decoder trains its adapters; its tied embedding is frozen, so a
LoRA pipeline needs no tied-gradient exchange and 1f1b-stash is allowed, while full fine-tuning sums
the tied table's gradient across the first and last stage and runs 1f1b-flush only); the PyTorch
rows train transformers' own LlamaForCausalLM (with PEFT for LoRA).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import BATCH, NUM_LABELS, SEQ, NoiseMeter, default_model, make_batches  # noqa: E402

M, LR, ALPHA = 4, 1e-4, 16.0


def _peak_mib() -> float:
    from runtime.procfs import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _lora(rank: int):
    from planner.lora import LoraSettings

    return LoraSettings(rank, ALPHA, targets=("q", "k", "v", "o"), train_also=("head",), seed=0)


def _graph(model: Path, rows: int, rank: int | None):
    from jobs.common.lora import adapted
    from planner.onnx_import import load_model

    return adapted(load_model(model, rows, SEQ), _lora(rank) if rank else None)


# --- children ----------------------------------------------------------------------------------------

def child_mnn_single(model: Path, steps: int, rank: int | None) -> dict:
    from runtime.engines.factory import whole_model_engine
    from runtime.optim import make_optimizer
    from tasks.trainer import accumulate_gradients

    graph = _graph(model, BATCH // M, rank)
    engine = whole_model_engine(graph)
    opt = make_optimizer("adamw", LR)
    batches, times = make_batches(steps + 1), []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        _, grads = accumulate_gradients(engine, batches[step], M, NUM_LABELS)
        engine.step(opt, grads)  # the engine's own weights, in place, as tasks.trainer does
        times.append(time.perf_counter() - t0)
    trainable = sum(int(graph.constants[p].nbytes) for p in graph.params)
    return {"step_s": statistics.median(times[1:]), "peak_mib": [_peak_mib()], "trainable": trainable}


def child_torch_single(steps: int, rank: int | None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from jobs.export.encoder import default_checkpoint_dir, load_token_classifier

    torch.set_num_threads(1)
    model = load_token_classifier(default_checkpoint_dir(), NUM_LABELS, seed=0)
    if rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=ALPHA, lora_dropout=0.0,
                                                 target_modules=["query", "key", "value", "attention.output.dense"],
                                                 modules_to_save=["classifier"]))
    model.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR)
    batches, times = make_batches(steps + 1), []
    for step in range(steps + 1):
        b = batches[step]
        t0 = time.perf_counter()
        opt.zero_grad()
        rows = BATCH // M
        for m in range(M):
            sl = slice(m * rows, (m + 1) * rows)
            logits = model(input_ids=torch.tensor(b.input_ids[sl]), attention_mask=torch.tensor(b.attention_mask[sl]),
                           token_type_ids=torch.tensor(b.token_type_ids[sl])).logits
            labels = torch.tensor(b.labels[sl])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, NUM_LABELS), labels.reshape(-1),
                                                     ignore_index=-100, reduction="sum") / b.n_labelled
            loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "peak_mib": [_peak_mib()],
            "trainable": sum(p.numel() * p.element_size() for p in trainable)}


# --- SmolLM2 (--model smollm2) ---------------------------------------------------------------------

LM_BATCH, LM_SEQ = 4, 128


def _lm_lora(rank: int):
    from planner.lora import LoraSettings

    return LoraSettings(rank, ALPHA, targets=("q", "k", "v", "o"), train_also=(), seed=0)


def _lm_graph(model: Path, rows: int, rank: int | None, mapped: bool = False):
    from jobs.common.lora import adapted
    from planner.onnx_import import load_model

    return adapted(load_model(model, rows, LM_SEQ, loss="causal-lm", mapped=mapped), _lm_lora(rank) if rank else None)


def _lm_feeds(model: Path):
    from benchmarks.llm import _batch
    from tasks.causal_lm.data import microbatch_feeds

    return microbatch_feeds(_batch(model, LM_BATCH, LM_SEQ), M)


def child_mnn_single_lm(model: Path, steps: int, rank: int | None) -> dict:
    from runtime.engines.factory import whole_model_engine
    from runtime.optim import make_optimizer

    graph = _lm_graph(model, LM_BATCH // M, rank)
    engine = whole_model_engine(graph)
    opt, feeds, times = make_optimizer("adamw", LR), _lm_feeds(model), []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        total = {}
        for m, f in enumerate(feeds):
            engine.forward(f, m)
            for k, g in engine.backward(m).params.items():
                total[k] = total[k] + g if k in total else g
        engine.step(opt, total)
        times.append(time.perf_counter() - t0)
    trainable = sum(int(graph.constants[p].nbytes) for p in graph.params)
    return {"step_s": statistics.median(times[1:]), "peak_mib": [_peak_mib()], "trainable": trainable}


def child_torch_single_lm(model: Path, steps: int, rank: int | None) -> dict:
    import torch

    from jobs.export.llm import load_causal_lm

    torch.set_num_threads(1)
    feeds = _lm_feeds(model)
    lm, _, _ = load_causal_lm(None)
    if rank:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=rank, lora_alpha=ALPHA, lora_dropout=0.0,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    lm.train()
    trainable = [p for p in lm.parameters() if p.requires_grad]
    opt, times = torch.optim.AdamW(trainable, lr=LR), []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        for f in feeds:
            logits = lm(input_ids=torch.from_numpy(f["input_ids"]),
                        attention_mask=torch.from_numpy(f["attention_mask"])).logits
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(f["target_ids"]).flatten(),
                                                   reduction="none")
            (ce * torch.from_numpy(f["target_weights"]).flatten()).sum().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]), "peak_mib": [_peak_mib()],
            "trainable": sum(p.numel() * p.element_size() for p in trainable)}


def run_pipeline_lm(model: Path, steps: int, rank: int | None, schedule: str) -> dict:
    feeds = _lm_feeds(model)
    return _run_pipeline(_lm_graph(model, LM_BATCH // M, rank), steps, schedule, feeds_of_step=lambda k: feeds)


def _child(kind: str, model: Path, steps: int, rank: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--steps", str(steps), "--rank", str(rank or 0),
           "--model-path", str(model)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- pipelines (this process is the coordinator) ---------------------------------------------------

def run_pipeline(model: Path, steps: int, rank: int | None, schedule: str) -> dict:
    return _run_pipeline(_graph(model, BATCH // M, rank), steps, schedule, batches=make_batches(steps + 1))


def _run_pipeline(graph, steps: int, schedule: str, batches=None, feeds_of_step=None) -> dict:
    """`steps` + 1 steps of `graph` on 3 worker processes (this process coordinates): NER `batches`,
    or a causal LM's `feeds_of_step`."""
    from jobs.train.pipeline import FaultPolicy, train_pipeline
    from jobs.common.workers import LocalWorkers
    from runtime.pipeline.coordinator import PipelineConfig

    workers = LocalWorkers.start(3, threads=1)
    config = PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=LR, timeout_s=1800)
    try:
        result = train_pipeline(graph, batches, NUM_LABELS, workers.addresses, config, steps + 1, keys=workers.keys,
                                feeds_of_step=feeds_of_step, faults=FaultPolicy(on_failure="stop"))
    finally:
        workers.wait(60.0)
    seconds = result.step_seconds[1:] if schedule != "1f1b-stash" else result.step_seconds
    peaks = [max(rep[k]["peak_rss_bytes"] for rep in result.stage_reports) / 2**20 for k in range(3)]
    trainable = sum(int(graph.constants[p].nbytes) for p in graph.params)
    return {"step_s": statistics.median(seconds), "peak_mib": peaks, "trainable": trainable,
            "ranges": result.ranges}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (default %(default)s)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default %(default)s)")
    parser.add_argument("--model", choices=("minilm", "smollm2"), default="minilm")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rank = args.rank or None
        children = {"mnn-single": lambda: child_mnn_single(args.model_path, args.steps, rank),
                    "torch-single": lambda: child_torch_single(args.steps, rank),
                    "mnn-single-lm": lambda: child_mnn_single_lm(args.model_path, args.steps, rank),
                    "torch-single-lm": lambda: child_torch_single_lm(args.model_path, args.steps, rank)}
        print(json.dumps(children[args.child]()))
        return
    if args.model == "smollm2":
        from benchmarks.llm import smollm2_model

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model, kinds, pipeline = smollm2_model(), ("mnn-single-lm", "torch-single-lm"), run_pipeline_lm
        title = (f"SmolLM2-135M-Instruct, batch {LM_BATCH} x {LM_SEQ}, {M} micro-batches, AdamW, LoRA r={args.rank} "
                 f"alpha {ALPHA:g} on q,k,v,o; {args.steps} timed steps")
    else:
        model, kinds, pipeline = default_model(), ("mnn-single", "torch-single"), run_pipeline
        title = (f"MiniLM, batch {BATCH} x {SEQ}, {M} micro-batches, AdamW, LoRA r={args.rank} alpha {ALPHA:g} "
                 f"on q,k,v,o + head; {args.steps} timed steps")
    rows = []

    def measure(name: str, fn):
        print(f"... {name}", file=sys.stderr, flush=True)
        with NoiseMeter() as noise:
            row = fn()
        rows.append({"name": name, **row, "others": noise.others})

    for rank in (None, args.rank):
        tag = "lora" if rank else "full"
        measure(f"mnn single {tag}", lambda: _child(kinds[0], model, args.steps, rank))
        # a full fine-tune of SmolLM2 sums its tied embedding across stages: flush schedules only
        stash = rank is not None or args.model != "smollm2"
        for schedule in ("1f1b-flush",) + (("1f1b-stash",) if stash else ()):
            measure(f"mnn 3-stage {tag} {schedule}", lambda: pipeline(model, args.steps, rank, schedule))
        measure(f"torch+peft single {tag}", lambda: _child(kinds[1], model, args.steps, rank))
    print(f"\n{title}")
    print(f"{'configuration':34s} {'step s':>7s} {'peak MiB (per process)':>26s} {'max':>6s} {'trainable':>10s} "
          f"{'others':>6s}")
    for r in rows:
        peaks = " / ".join(f"{p:.0f}" for p in r["peak_mib"])
        others = "-" if r["others"] is None else f"{r['others']:.0%}"
        print(f"{r['name']:34s} {r['step_s']:7.3f} {peaks:>26s} {max(r['peak_mib']):6.0f} "
              f"{r['trainable'] / 2**20:8.2f}Mi {others:>6s}")
    by = {r["name"]: r for r in rows}
    print()
    for schedule in ("1f1b-flush", "1f1b-stash"):
        lora, full = by.get(f"mnn 3-stage lora {schedule}"), by.get(f"mnn 3-stage full {schedule}")
        if lora is None or full is None:
            continue
        single = by["mnn single full"]
        print(f"{schedule}: LoRA pipeline's largest device / full fine-tuning's on the same split "
              f"{max(lora['peak_mib']) / max(full['peak_mib']):.0%} (target <= 45%); / single-device full "
              f"{max(lora['peak_mib']) / max(single['peak_mib']):.0%} (target <= 25%); LoRA step / full step "
              f"{lora['step_s'] / full['step_s']:.2f}x (target <= 0.7x)")
    print(f"single device: LoRA step / full step {by['mnn single lora']['step_s'] / by['mnn single full']['step_s']:.2f}x "
          f"(MNN), {by['torch+peft single lora']['step_s'] / by['torch+peft single full']['step_s']:.2f}x (torch+PEFT)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
