"""Pipeline-parallel training vs one process, on this machine: step time, bubble, memory, per process.

What it measures
    MiniLM (all-MiniLM-L6-v2) token classification, 9 labels, batch 8, sequence 128, float32,
    AdamW (lr 1e-4, weight decay 0.01), every process with one compute thread, for 4 and 8
    micro-batches (``--microbatches``).  Each batch is random token ids (< 30522) with rows padded
    to random lengths (label -100 and attention 0 on padding) and random labels; the same
    ``steps + 1`` batches (seeded) go to every configuration, and the first step is warm-up, left out.

    MNN (this project's runtime, ZeroMQ between processes):
      * ``single``: one process, the whole model on ``MnnStageEngine(stage_spec(g, 0, 8), threads=1)``
        with the graph lowered at the micro-batch size, ``tasks.trainer.accumulate_gradients``
        over the M micro-batches plus the optimizer step: single-device training of the same
        batch, same arithmetic.  Runs in a child process, so its peak RSS is its own.
      * 2 and 3 worker processes (``jobs.train.pipeline.LocalWorkers``) driven by
        ``jobs.train.pipeline.train_pipeline`` (this process is the coordinator) for the schedules
        ``1f1b-flush``, ``gpipe`` and ``1f1b-stash``; stage k holds blocks
        ``stage_ranges(9, stages, None)[k]`` (block 0 embeddings, 1-6 encoder layers, 7 head,
        8 loss): 2 stages = 0-3 | 4-8, 3 stages = 0-2 | 3-5 | 6-8.  ``1f1b-stash`` runs with
        train_pipeline's default ``update_every=1``: every stage updates after each backward, i.e.
        M optimizer steps per batch where the other configurations take one (it shows in ``UPD``).
      * with ``--variants`` also: ``1f1b-stash`` on the PyTorch engine and on the plan's split
        (``plan[...]``, below), ``1f1b-stash k=M`` (an update per M backwards), ``2bw k=M``
        (PipeDream-2BW: the same order, two weight versions at most), ``1f1b-flush`` on the PyTorch
        engine, with MNN keeping its activations, and with the engine and activations ``plan``
        picks per stage (``auto[...]``), and ``zb-h1`` (each backward split into B, whose gradient
        is sent at once, and W, the weight gradients; shown together in ``B``) on the PyTorch
        engine and with ``plan``'s pick; and ``plan[...]``: 1f1b-flush, zb-h1 and 1f1b-stash on the cuts, engines
        and activations ``confidant plan`` picks for as many devices like this machine (each with
        its profile; the block ranges, engine and activations per stage are in the label), where
        every other row keeps the fixed block ranges below.
    PyTorch (``torch.distributed.pipelining``, gloo over TCP on 127.0.0.1, one rank per process):
      * ``single``: one process, ``BertForTokenClassification`` (eval mode: no dropout, as the
        ONNX export the MNN side trains), gradient accumulation over the M micro-batches, AdamW.
      * ``Schedule1F1B`` (shown as ``1f1b-flush``), ``ScheduleGPipe`` (``gpipe``) and
        ``ScheduleInterleavedZeroBubble`` with one stage per rank (``zb-h1``) on 2 and 3
        ranks, ``PipelineStage`` over hand-built stage modules with the same block ranges.  The
        attention mask travels between stages as a second (int64, gradient-free) tensor and each
        stage builds BERT's additive mask from it, so padding is real, as on the MNN side.  The
        loss (summed token cross-entropy / labelled tokens of the whole batch, ``scale_grads=False``)
        is the MNN graph's loss, so the first-step losses of both frameworks must agree.

Columns of the main tables
    ``step s``     median seconds per training step (forward, backward and optimizer update of the
                   whole batch) as the coordinator (MNN) or rank 0 between barriers (torch) saw it.
                   ``1f1b-stash`` has no flush: it runs all steps+1 batches as one schedule, so its
                   figure is stage 0's time from the update that ends the first (warm-up) batch to
                   the end of the run, / steps: the warm-up left out as for the other schedules,
                   one pipeline drain amortised over the steps (the whole run / (steps + 1), warm-up
                   in, is in the JSON as ``whole_run_step_s``).
    ``samp/s``     8 / step s.
    ``speedup``    single's step s / this step s (above 1: faster than one process).
    ``bub meas``   measured bubble: 1 - sum over stages of (F + B seconds) / (stages x step s), the
                   share of the stages x time grid not spent in forward/backward compute (so it also
                   holds transfers, the optimizer update and coordinator overhead).  Compute is
                   timed by wall clock, so a process descheduled in the middle of an F counts as busy.
    ``bub sim``    ``ir.verify.dry_run(make_schedule(name, stages, M), f, b).bubble_fraction``:
                   the plan's bubble with equal stages and zero-cost transfers, with f:b = 4 :
                   round(4 x measured B/F) (shown as ``f:b``).
    ``imbal``      max over stages of (F + B) / mean over stages: 1.00 is perfectly balanced; the
                   step can be no faster than the slowest stage's compute.
    ``cpu/1``      CPU seconds per step of all the stage processes together / single's (MNN: read
                   from /proc for the flush schedules, none for 1f1b-stash; torch: process_time):
                   the work the pipeline adds (MNN re-runs the forward inside the backward of every
                   block whose backward does not directly follow its forward, transfers, polling).
                   Unlike the times, it barely moves when other processes load the machine.
    ``peak MB``    each process's peak resident set (``ru_maxrss``), stage 0 first.  For MNN workers
                   that is what the worker reported in its last 'done'; the coordinator (this
                   process, which holds the full graph and the batches) is not counted, as on a real
                   deployment where it lives elsewhere.  Torch ranks import torch (a few hundred MB)
                   and load the whole checkpoint before keeping their stage's modules.
    ``max/1``      the largest process's peak / single's peak;  ``sum/1``: all processes / single.
    ``others``     share of all CPUs used by other processes while the configuration ran (noise).
    The time-split table lists per stage and step (medians, ms): F, B, UPDATE, SEND (ACT+GRAD),
    RECV (ACT+GRAD, waiting for the peer included: that is where the bubble shows), other (wall of
    the action list minus all that), and ``cpu``: the process's CPU time (MNN flush schedules: from
    /proc; torch: process_time), which falls below F+B when processes outnumber cores.

Noise and oversubscription
    The machine's CPUs used by other processes during each configuration are recorded
    (``others_cpu`` in the JSON) and a warning is printed above 10 %.  With 3 stages on a 2-core
    machine the 3 worker processes (plus the coordinator) share 2 cores: those rows measure
    contention as much as pipelining; the script says so when stages > CPUs.

Issues 31 (target 5) and 32 (throughput), alone: ``--compare CONFIGS``
    Only the named Confidant configurations (SCHEDULE[:ENGINE[:ACTIVATIONS[:POLICY]]], POLICY
    ``default``, the command line's fault policy with its snapshots on the peers, or ``stop``) and
    torch.distributed.pipelining's three schedules, on ``--compare-stages`` (2) processes, alternating
    over ``--rounds``.  Each Confidant configuration runs in a child process that is its coordinator,
    so every process's peak (VmHWM, setup included) is measured, the coordinator's too, and counted
    (it is the last in ``peak MB per process``); ``coord cpu s`` is the coordinator's CPU seconds a
    step.  Steps are wall clock on both sides (Confidant: a step's start to the next's, the
    snapshots in it; TDP: rank 0 between barriers, the optimizer step in it); the best round of each
    configuration is compared with TDP's fastest schedule: throughput (issue 32: >= 1.2x) and the
    largest process against that schedule's largest rank (issue 31 target 5: <= 0.5x).  Neither side
    evaluates.  E.g. ``--compare zb-h1:torch,1f1b-flush:mnn,1f1b-flush:mnn::stop --microbatches 4
    --steps 4 --rounds 2`` (~15 min on 2 busy cores).

Usage
    .venv/bin/python benchmarks/pipeline.py [--steps N] [--microbatches 4,8] [--json OUT]
                                            [--model PATH] [--skip-torch] [--rounds R] [--isa-rounds N]
    ``--steps`` timed steps per configuration (default 3; one more runs as warm-up).  ``--rounds``
    repeats TDP's schedules and the plans within ``--within-tdp`` R times, alternating, and gives
    issue 14's first target as the median of the rounds' ratios (TDP's own step time moves up to
    30% between runs on this machine); ``--isa-rounds`` (default 3) the ISA-matched engine
    comparison of ``benchmarks/engine.py --isa-matched``.  Without
    ``--model`` the default checkpoint is exported once to ``$CONFIDANT_HOME/bench-minilm.onnx``
    (default ``~/.cache/confidant``; shared with benchmarks/engine.py).  6 to 8 minutes on 2 cores
    with the defaults.  Confidant's pipelines run under the command line's default fault policy
    (each stage's state copied every K steps, `jobs.train.pipeline.AUTO_SNAPSHOTS`, and shipped to
    a neighbouring worker while the next step runs: `FaultPolicy(state_on="peers")`), and a step's
    wall time runs from its start to the next step's start, the copies in it (issue 32).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path, where a sibling script named like a
# project package (benchmarks/planner.py) would shadow it, in this process and in every child
# started from this file: drop that entry and put the repository root first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

from benchmarks.common import NoiseMeter, default_model, make_batches  # noqa: E402

BATCH, SEQ, NUM_LABELS, VOCAB = 8, 128, 9, 30522
LR = 1e-4
SCHEDULES = ("1f1b-flush", "gpipe", "1f1b-stash")
TORCH_SCHEDULES = {"1f1b-flush": "Schedule1F1B", "gpipe": "ScheduleGPipe",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}  # TDP's zero bubble, one stage per rank
STAGES = (2, 3)
ASYNC = ("1f1b-stash", "2bw")  # no flush: one schedule over the whole run
MARKER = "CONFIDANT_BENCH "
SIM_F = 4  # forward ticks in the simulated dry run; backward ticks follow the measured B/F ratio


# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------


def time_methods(obj, methods: dict[str, str]) -> dict[str, float]:
    """Wrap obj's methods (kind -> method name) so that each call adds its wall seconds to the
    returned dict under its kind."""
    timers = {kind: 0.0 for kind in methods}

    def timed(kind, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[kind] += time.perf_counter() - t
        return wrapper

    for kind, name in methods.items():
        setattr(obj, name, timed(kind, getattr(obj, name)))
    return timers

def _rss_mb() -> float:
    """This process's peak resident memory, MiB: VmHWM (runtime.procfs), not ru_maxrss, which Linux
    keeps across execve: a TDP rank started by this script's process read that process's peak as its
    own (every rank of every schedule 1030 MB in a run that exported MiniLM first, 846-850 without;
    benchmarks/MEMORY_NOTES.md, helper h85)."""
    from runtime.procfs import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _child_env() -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    return env


def _parse_marker(stdout: str) -> dict | None:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARKER)]
    return json.loads(lines[-1][len(MARKER):]) if lines else None


def simulated_bubble(schedule: str, stages: int, microbatches: int, b_over_f: float | None,
                     update_every: int = 1) -> tuple[float, str]:
    from ir.verify import dry_run
    from planner.schedule import make_schedule

    b = max(1, round(SIM_F * (b_over_f or 2.0)))
    plan = make_schedule(schedule, stages, microbatches, update_every if schedule in ASYNC else 1)
    if plan.splits_backward:  # B and W, half of the measured backward each
        w = max(1, b // 2)
        return dry_run(plan, SIM_F, max(1, b - w), w).bubble_fraction, f"{SIM_F}:{max(1, b - w)}:{w}"
    return dry_run(plan, forward_ticks=SIM_F, backward_ticks=b).bubble_fraction, f"{SIM_F}:{b}"


# --------------------------------------------------------------------------
# Child: MNN single process
# --------------------------------------------------------------------------

def child_single_mnn(model: str, M: int, steps: int) -> dict:
    from planner.onnx_import import load_model
    from runtime.engines.mnn import MnnStageEngine
    from runtime.optim import make_optimizer
    from runtime.engines.stage import stage_spec
    from tasks.trainer import accumulate_gradients

    batches = make_batches(steps + 1)
    graph = load_model(model, batch=BATCH // M, seq=SEQ)
    rss_base = _rss_mb()
    engine = MnnStageEngine(stage_spec(graph, 0, len(graph.blocks) - 1), threads=1)
    timers = time_methods(engine, {"F": "forward", "B": "backward"})
    opt = make_optimizer("adamw", LR)
    rows = []
    for step in range(steps + 1):
        timers.update(F=0.0, B=0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, grads = accumulate_gradients(engine, batches[step], M, NUM_LABELS)
        t1 = time.perf_counter()
        engine.step(opt, grads)  # the engine's own weights, in place, as tasks.trainer does
        t2, c2 = time.perf_counter(), time.process_time()
        rows.append({"loss": loss, "step_s": t2 - t0, "F": timers["F"], "B": timers["B"], "UPDATE": t2 - t1,
                     "cpu_s": c2 - c0})
    return {"steps": rows, "rss_base_mb": rss_base, "peak_rss_mb": _rss_mb()}


# --------------------------------------------------------------------------
# Child: torch single process and torch pipeline ranks
# --------------------------------------------------------------------------

def _torch_setup():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return torch


def _torch_stage_module(model, first: int, last: int):
    """Blocks first..last of BertForTokenClassification as one module (block numbering of the IR).

    Inputs: (input_ids, attention_mask, token_type_ids) for the stage holding block 0, else
    (hidden, attention_mask).  Output: (hidden, attention_mask) unless the stage holds the head,
    then the logits (the loss, block 8, is the schedule's loss_fn)."""
    import torch

    bert = model.bert
    n_layers = len(bert.encoder.layer)
    head_block = n_layers + 1

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = bert.embeddings if first == 0 else None
            self.layers = torch.nn.ModuleList(
                [bert.encoder.layer[b - 1] for b in range(max(first, 1), min(last, n_layers) + 1)])
            self.classifier = model.classifier if first <= head_block <= last else None
            self.dtype_min = torch.finfo(torch.float32).min

        def forward(self, *args):
            if self.embeddings is not None:
                input_ids, mask, token_type_ids = args
                x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
            else:
                x, mask = args
            if len(self.layers):
                bias = (1.0 - mask[:, None, None, :].to(torch.float32)) * self.dtype_min
                for layer in self.layers:
                    out = layer(x, attention_mask=bias)
                    x = out[0] if isinstance(out, tuple) else out
            if self.classifier is not None:
                return self.classifier(x)  # eval mode: the head's dropout is off, as in the ONNX export
            return x, mask

    return Stage()


def _torch_model():
    from jobs.export.encoder import default_checkpoint_dir, load_token_classifier

    model = load_token_classifier(default_checkpoint_dir(), NUM_LABELS, seed=0)
    model.eval()  # dropout off: the MNN side trains the eval-mode export
    return model


def _loss(torch, logits, labels, n_labelled: int):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum") / n_labelled


def child_single_torch(M: int, steps: int) -> dict:
    torch = _torch_setup()
    rss_base = _rss_mb()
    batches = make_batches(steps + 1)
    model = _torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    rows = []
    for step in range(steps + 1):
        b = batches[step]
        ids, mask, tt, labels = (torch.from_numpy(a) for a in (b.input_ids, b.attention_mask, b.token_type_ids, b.labels))
        t0, c0 = time.perf_counter(), time.process_time()
        f_s = b_s = loss_sum = 0.0
        for k in range(M):
            sl = slice(k * BATCH // M, (k + 1) * BATCH // M)
            ta = time.perf_counter()
            logits = model(input_ids=ids[sl], attention_mask=mask[sl], token_type_ids=tt[sl]).logits
            loss = _loss(torch, logits, labels[sl], b.n_labelled)
            tb = time.perf_counter()
            loss.backward()
            tc = time.perf_counter()
            f_s += tb - ta
            b_s += tc - tb
            loss_sum += float(loss)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2, c2 = time.perf_counter(), time.process_time()
        rows.append({"loss": loss_sum, "step_s": t2 - t0, "F": f_s, "B": b_s, "UPDATE": t2 - t1, "cpu_s": c2 - c0})
    return {"steps": rows, "rss_base_mb": rss_base, "peak_rss_mb": _rss_mb()}


def child_torch_rank(M: int, stages: int, schedule: str, rank: int, steps: int, cuts=None) -> dict:
    torch = _torch_setup()
    import datetime

    import torch.distributed as dist
    from torch.distributed import pipelining

    from jobs.train.pipeline import stage_ranges

    rss_base = _rss_mb()
    dist.init_process_group("gloo", rank=rank, world_size=stages, timeout=datetime.timedelta(seconds=300))
    try:
        batches = make_batches(steps + 1)
        model = _torch_model()
        n_blocks = len(model.bert.encoder.layer) + 3
        first, last = stage_ranges(n_blocks, stages, cuts)[rank]
        module = _torch_stage_module(model, first, last)
        del model
        import gc

        gc.collect()
        stage = pipelining.PipelineStage(module, rank, stages, torch.device("cpu"))
        methods = {"F": "forward_one_chunk", "B": "backward_one_chunk"}
        if hasattr(stage, "backward_weight_one_chunk"):  # zero bubble's W, shown with its B
            methods["W"] = "backward_weight_one_chunk"
        timers = time_methods(stage, methods)
        is_last = rank == stages - 1
        n_labelled = [1]
        # every rank passes loss_fn: the schedule runs backwards only when it has one (it is applied on the last)
        def loss_fn(logits, labels):
            return _loss(torch, logits, labels, n_labelled[0])

        kind = getattr(pipelining, TORCH_SCHEDULES[schedule])
        # the schedules built for several stages per rank take a list of them
        stages_arg = [stage] if issubclass(kind, pipelining.schedules.PipelineScheduleMulti) else stage
        sched = kind(stages_arg, M, loss_fn=loss_fn, scale_grads=False)
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
        rows = []
        for step in range(steps + 1):
            b = batches[step]
            n_labelled[0] = b.n_labelled
            timers.update({k: 0.0 for k in timers})
            losses: list = []
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rank == 0:
                sched.step(torch.from_numpy(b.input_ids), torch.from_numpy(b.attention_mask),
                           torch.from_numpy(b.token_type_ids))
            elif is_last:
                sched.step(target=torch.from_numpy(b.labels), losses=losses)
            else:
                sched.step()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2, c2 = time.perf_counter(), time.process_time()
            dist.barrier()
            t3 = time.perf_counter()
            rows.append({"step_s": t3 - t0, "own_s": t2 - t0, "F": timers["F"], "B": timers["B"] + timers.get("W", 0.0),
                         "UPDATE": t2 - t1, "cpu_s": c2 - c0,
                         "loss": float(sum(float(x) for x in losses)) if is_last else None})
        return {"rank": rank, "blocks": [first, last], "steps": rows, "rss_base_mb": rss_base,
                "peak_rss_mb": _rss_mb(), "params": sum(p.numel() for p in module.parameters())}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------
# Child: a Confidant pipeline with its coordinator in a process of its own (--compare)
# --------------------------------------------------------------------------

def parse_config(spec: str) -> dict:
    """A --compare configuration: SCHEDULE[:ENGINE[:ACTIVATIONS[:POLICY]]], ENGINE and ACTIVATIONS one
    for every stage or one per stage joined by '+' (e.g. 'zb-h1:torch', '1f1b-flush:mnn+torch:per-block+'),
    POLICY the fault policy: 'default' (the command line's: snapshots on the peers) or 'stop'
    (`--on-failure stop`: no snapshots)."""
    parts = spec.split(":")
    if not 1 <= len(parts) <= 4 or not parts[0]:
        raise ValueError(f"not SCHEDULE[:ENGINE[:ACTIVATIONS[:POLICY]]]: {spec!r}")
    policy = parts[3] if len(parts) > 3 and parts[3] else "default"
    if policy not in ("default", "stop"):
        raise ValueError(f"policy 'default' or 'stop', not {policy!r}, in {spec!r}")
    schedule = parts[0]
    engine = parts[1] if len(parts) > 1 and parts[1] else "mnn"
    acts = parts[2] if len(parts) > 2 and parts[2] else None
    engines = tuple(engine.split("+")) if "+" in engine else engine
    if acts is not None and "+" in acts:
        acts = tuple(a or None for a in acts.split("+"))
    return {"schedule": schedule, "engine": engines, "activations": acts, "policy": policy}


def child_mnn_pipeline(model: str, M: int, stages: int, spec: str, steps: int, cuts=None) -> dict:
    """One Confidant configuration, this process its coordinator: every process's peak (VmHWM, setup
    included), the coordinator's too, and wall-clock steps."""
    from planner.onnx_import import load_model
    from runtime.procfs import peak_rss_bytes

    c = parse_config(spec)
    graph = load_model(model, batch=BATCH // M, seq=SEQ)
    batches = make_batches(steps + 1)
    from jobs.train.pipeline import stage_ranges

    r = run_mnn_pipeline(graph, batches, M, stages, c["schedule"], steps, engine=c["engine"],
                         activations=c["activations"], variant=spec, policy=c["policy"],
                         ranges=stage_ranges(len(graph.blocks), stages, cuts) if cuts else None)
    r["coordinator_peak_mb"] = peak_rss_bytes() / 2**20
    r["coordinator_imports_torch"] = "torch" in sys.modules  # a few hundred MB when it does
    return r


def _cuts_args(cuts) -> list[str]:
    return ["--compare-cuts", ",".join(map(str, cuts))] if cuts else []


def run_mnn_pipeline_apart(model: Path, M: int, stages: int, spec: str, steps: int, timeout: float,
                           cuts=None) -> dict:
    """`child_mnn_pipeline` in a child process: the coordinator's peak is its own."""
    r = _spawn(["--child", "mnn-pipeline", str(M), "--model", str(model), "--stages", str(stages),
                "--schedule", spec, "--steps", str(steps), *_cuts_args(cuts)], timeout)
    r["workers_peak_mb"] = list(r["peak_rss_mb"])
    r["peak_rss_mb"] = r["workers_peak_mb"] + [r["coordinator_peak_mb"]]  # the coordinator is a process too
    return r


def compare(model: Path, M: int, stages: int, specs: list[str], rounds: int, steps: int, timeout: float,
            skip_torch: bool = False, cuts=None) -> list[dict]:
    """Issue 31 target 5 and issue 32's throughput target, side by side: each Confidant configuration
    (coordinator counted as a process) and torch.distributed.pipelining's schedules on `stages`
    processes, alternating (A B A B ...) over `rounds`."""
    results = []
    for round_ in range(rounds):
        runs = [("mnn", s) for s in specs] + ([] if skip_torch else [("torch", s) for s in TORCH_SCHEDULES])
        if round_ % 2:
            runs.reverse()
        for fw, s in runs:
            label = f"{fw} {s} M={M} {stages}p (round {round_ + 1}/{rounds})"
            print(f"  {label} ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            try:
                if fw == "mnn":
                    r = run_mnn_pipeline_apart(model, M, stages, s, steps, timeout, cuts)
                else:
                    r = run_torch_pipeline(M, stages, s, steps, timeout, cuts)
                r["round"] = round_
                r["load_avg"] = os.getloadavg()
                results.append(r)
                print(f"    {r['step_s']:.3f} s/step, peaks {'/'.join(f'{x:.0f}' for x in r['peak_rss_mb'])} MB "
                      f"({time.perf_counter() - t:.0f} s, load {r['load_avg'][0]:.1f})", file=sys.stderr, flush=True)
            except Exception as exc:  # keep the others
                print(f"    {label}: not measured because {type(exc).__name__}: {str(exc).strip()[-1500:]}",
                      file=sys.stderr, flush=True)
    return results


def compare_report(results: list[dict], M: int, stages: int, steps: int) -> str:
    """Per configuration: best (minimum over rounds) wall-clock step, every process's peak; then the
    targets against TDP's fastest schedule (its best round) and that schedule's largest rank."""
    by: dict[str, list[dict]] = {}
    for r in results:
        key = f"{r['framework']} {r.get('variant') or r.get('torch_schedule') or r['schedule']}"
        by.setdefault(key, []).append(r)
    out = [f"MiniLM batch {BATCH} x {SEQ}, {M} micro-batches, {stages} processes, 1 thread each, {steps} timed "
           f"steps (+1 warm-up), wall clock from a step's start to the next's (Confidant: snapshots of the default "
           f"fault policy included); best round of {max(r['round'] for r in results) + 1}; peaks are VmHWM, setup "
           "included, Confidant's coordinator counted as a process (last)",
           "blocks per stage: " + "; ".join(sorted({f"{r['framework']} " + " | ".join(f"{a}-{b}" for a, b in r["ranges"])
                                                   for r in results})), ""]
    rows = []
    best = {}
    for key, rs in by.items():
        b = min(rs, key=lambda r: r["step_s"])
        best[key] = b
        peaks = max((r["peak_rss_mb"] for r in rs), key=max)
        coord = b.get("coordinator_cpu_s")
        if any(r.get("events") for r in rs):
            key += " (events: " + "; ".join(",".join(r["events"]) for r in rs if r.get("events")) + ")"
        rows.append([key, f"{b['step_s']:.3f}", " ".join(f"{r['step_s']:.3f}" for r in rs),
                     f"{BATCH / b['step_s']:.2f}", "/".join(f"{x:.0f}" for x in peaks), f"{max(peaks):.0f}",
                     "-" if coord is None else f"{coord:.3f}", " ".join(f"{r['load_avg'][0]:.1f}" for r in rs)])
    out += _table(rows, ["configuration", "step s", "per round", "samp/s", "peak MB per process", "largest",
                         "coord cpu s", "load avg"])
    tdp = [k for k in best if k.startswith("torch ")]
    mine = [k for k in best if k.startswith("mnn ")]
    if tdp and mine:
        t = min(tdp, key=lambda k: best[k]["step_s"])
        rank = max(max(r["peak_rss_mb"]) for r in by[t])
        out += ["", f"TDP's fastest: {t} {best[t]['step_s']:.3f} s a step, largest rank {rank:.0f} MB"]
        for k in mine:
            x = best[t]["step_s"] / best[k]["step_s"]
            largest = max(max(r["peak_rss_mb"]) for r in by[k])
            out.append(f"  {k}: throughput {x:.2f}x TDP's (issue 32: >= 1.2x {'met' if x >= 1.2 else 'NOT met'}); "
                       f"largest process {largest:.0f} MB = {largest / rank:.2f}x TDP's largest rank (issue 31 "
                       f"target 5: <= 0.5x {'met' if largest <= 0.5 * rank else 'NOT met'})")
    return "\n".join(out)


# --------------------------------------------------------------------------
# Parent: configurations
# --------------------------------------------------------------------------

def _spawn(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    with NoiseMeter() as noise:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env())
    result = _parse_marker(proc.stdout)
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"child {' '.join(args)} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    result["others_cpu"] = noise.others
    return result


def _single_summary(framework: str, M: int, raw: dict) -> dict:
    rows = raw["steps"][1:]
    step_s = _median([r["step_s"] for r in rows])
    f, b = _median([r["F"] for r in rows]), _median([r["B"] for r in rows])
    return {"framework": framework, "schedule": "single", "stages": 1, "microbatches": M,
            "step_s": step_s, "samples_per_s": BATCH / step_s, "step_samples_s": [r["step_s"] for r in rows],
            "b_over_f": b / f if f else None, "first_loss": raw["steps"][0]["loss"],
            "peak_rss_mb": [raw["peak_rss_mb"]], "rss_base_mb": raw["rss_base_mb"],
            "per_stage": [{"F": f, "B": b, "UPDATE": _median([r["UPDATE"] for r in rows]),
                           "cpu": _median([r["cpu_s"] for r in rows]), "wall": step_s}],
            "others_cpu": raw.get("others_cpu"), "raw": raw}


def run_single_mnn(model: Path, M: int, steps: int, timeout: float) -> dict:
    raw = _spawn(["--child", "single-mnn", str(M), "--model", str(model), "--steps", str(steps)], timeout)
    return _single_summary("mnn", M, raw)


def run_single_torch(M: int, steps: int, timeout: float) -> dict:
    raw = _spawn(["--child", "single-torch", str(M), "--steps", str(steps)], timeout)
    return _single_summary("torch", M, raw)


def _send_recv(seconds: dict) -> tuple[float, float]:
    send = seconds.get("SEND_ACT", 0.0) + seconds.get("SEND_GRAD", 0.0)
    recv = seconds.get("RECV_ACT", 0.0) + seconds.get("RECV_GRAD", 0.0)
    return send, recv


def engines_picked(graph, model: Path, stages: int, schedule: str, M: int) -> tuple[tuple[str, ...], tuple]:
    """The engine and activations per stage `confidant plan` would pick for this machine
    (planner.engines.stage_pick over a quick profile of MNN and PyTorch at one thread), for the
    benchmark's fixed block ranges."""
    from ir.backend import engine_of
    from jobs.train.pipeline import stage_ranges
    from planner.cluster import DeviceSpec
    from planner.engines import stage_pick

    profile = _profile(graph, model)
    device = DeviceSpec("bench", "tcp://127.0.0.1:1", profile, profile.memory_available_bytes)
    ranges = stage_ranges(len(graph.blocks), stages, None)
    picks = [stage_pick(graph, device, a, b, s, stages, schedule, M, "adamw") for s, (a, b) in enumerate(ranges)]
    return (tuple(engine_of(p[0]) if p else "mnn" for p in picks),
            tuple(p[1] if p else None for p in picks))


def _profile(graph, model: Path):
    """This machine's profile of MNN and PyTorch at one thread (measured once per model and shape)."""
    from runtime.profiling.device import profile_device

    key = (str(model), graph.batch, graph.seq)
    if key not in _PROFILES:
        _PROFILES[key] = profile_device(graph, "bench", ("mnn:cpu:t1", "torch:cpu:t1"), reps=2, attention=False)
    return _PROFILES[key]


def plan_picked(graph, model: Path, stages: int, schedule: str, M: int, budget_bytes: int | None = None,
                batches=None):
    """What `confidant plan` decides for `stages` devices like this machine (each a copy of its
    profile, auto engine, `budget_bytes` or else the machine's memory as budget, loopback links), for
    `batches` as `plan --data` plans for them (None: every embedding row charged): the block ranges,
    the engine and activations per stage, and the predicted peak bytes per stage
    (planner.engines.best_picks, as jobs.planning.plan_model does)."""
    from ir.backend import engine_of
    from ir.profile import Link
    from planner.cluster import Cluster, DeviceSpec, device_backend
    from planner.cost import activations_of
    from planner.engines import best_picks
    from planner.partition import solve_partition

    profile = _profile(graph, model)
    if batches is not None:
        graph = _charging_lookups(graph, batches)
    budget = profile.memory_available_bytes if budget_bytes is None else budget_bytes
    devices = tuple(DeviceSpec(f"dev{k}", f"tcp://127.0.0.1:{k + 1}", profile, budget) for k in range(stages))
    # loopback: a 384 KiB activation takes well under a millisecond, as measured in the transport rows
    cluster = Cluster(devices, Link(bandwidth_bytes_per_s=2e9, latency_s=50e-6))
    solve = lambda inst: solve_partition(inst, time_limit_s=10.0)  # noqa: E731
    picks = best_picks(graph, cluster, schedule, M, "adamw", solve)
    partition = picks.partition
    if len(partition.stages) != stages:
        raise RuntimeError(f"the plan uses {len(partition.stages)} of the {stages} devices")
    chosen = [picks.cluster.device(name) for name in partition.devices]
    return ([tuple(r) for r in partition.ranges], tuple(engine_of(device_backend(d).backend) for d in chosen),
            tuple(activations_of(d) for d in chosen), tuple(s.memory_bytes for s in partition.stages))


def _charging_lookups(graph, batches):
    """The graph with the embedding rows `batches` (the run's) look up, charged as `confidant plan
    --data` charges them: the runtime keeps AdamW's state of a table for the rows that had a gradient
    only."""
    import dataclasses

    from planner.lookups import charged_rows, lookup_rows
    from tasks.trainer import batch_feeds

    rows = lookup_rows(graph, (batch_feeds(b, NUM_LABELS) for b in batches))
    charged = {table: n for table, _, _, n, _ in charged_rows(graph, rows, "adamw") if n is not None}
    return dataclasses.replace(graph, lookup_rows=charged)


def run_planned(graph, model: Path, batches, M: int, stages: int, schedule: str, steps: int,
                budget_bytes: int | None = None) -> dict:
    """`run_mnn_pipeline` on the plan's cuts, engines and activations (`plan_picked` for these
    batches, each device's budget `budget_bytes` or the machine's memory), with the plan's predicted
    peak per stage beside the measured one."""
    ranges, picked, kept, predicted = plan_picked(graph, model, stages, schedule, M, budget_bytes, batches)
    label = ",".join(f"{a}-{b}:{e}/{k}" if k else f"{a}-{b}:{e}" for (a, b), e, k in zip(ranges, picked, kept))
    within = "" if budget_bytes is None else f"<={budget_bytes / 2**20:.0f}MB"
    result = run_mnn_pipeline(graph, batches, M, stages, schedule, steps, engine=picked, activations=kept,
                              ranges=ranges, variant=f"plan{within}[{label}]")
    return {**result, "predicted_mb": [b / 2**20 for b in predicted], "budget_mb": None if budget_bytes is None
            else budget_bytes / 2**20}


_PROFILES: dict = {}


def run_mnn_pipeline(graph, batches, M: int, stages: int, schedule: str, steps: int,
                     engine: str | tuple[str, ...] = "mnn", update_every: int = 1, variant: str | None = None,
                     activations=None, ranges=None, policy: str = "default") -> dict:
    import numpy as np

    from jobs.train.pipeline import AUTO_SNAPSHOTS, FaultPolicy, LocalWorkers, StageChoice, train_pipeline
    from runtime.pipeline.coordinator import PipelineConfig

    n = steps + 1
    cpu_marks: list[list[float | None]] = []
    coord_marks: list[float] = []
    with NoiseMeter() as noise:
        workers = LocalWorkers.start(stages, threads=1)
        pids = [p.pid for p in workers.procs]

        def on_step(*_):
            cpu_marks.append([_proc_cpu_s(pid) for pid in pids])
            coord_marks.append(time.process_time())  # the coordinator's own CPU (this process)

        try:
            # one engine and activation choice for all stages, or one per stage (each stage's device's)
            per_stage = None
            if not isinstance(engine, str) or isinstance(activations, tuple):
                engines = (engine,) * stages if isinstance(engine, str) else engine
                kept = activations if isinstance(activations, tuple) else (activations,) * stages
                per_stage = tuple(StageChoice(engine=e, activations=a) for e, a in zip(engines, kept))
            config = PipelineConfig(schedule=schedule, microbatches=M, optimizer="adamw", lr=LR, timeout_s=300,
                                    **({} if per_stage else {"engine": engine, "activations": activations}))
            cuts = [last + 1 for _, last in ranges[:-1]] if ranges else None
            # the command line's default policy, or --on-failure stop (no snapshots)
            faults = (FaultPolicy(on_failure="stop") if policy == "stop"
                      else FaultPolicy(snapshot_every=AUTO_SNAPSHOTS, state_on="peers"))
            res = train_pipeline(graph, batches, NUM_LABELS, workers.addresses, config, n, cuts=cuts, on_step=on_step,
                                 keys=workers.keys, faults=faults,
                                 update_every=update_every, per_stage=per_stage)
        finally:
            codes = workers.wait(60.0)
    if any(codes):
        raise RuntimeError(f"workers exited with {codes}")

    per_stage_steps = []  # [step][stage] dict of ms-level figures (seconds)
    if schedule in ASYNC:
        # one report for the whole run of n batches: per-step figures are its totals / n
        total = sum(res.step_seconds)
        reports = [(res.stage_reports[0], total, None)]
        divisor = n
    else:
        reports = [(res.stage_reports[k], res.step_seconds[k],
                    [None if a is None or b is None else b - a for a, b in zip(cpu_marks[k - 1], cpu_marks[k])])
                   for k in range(1, n)]
        divisor = 1
    bubbles, busy_bubbles, walls = [], [], []
    for done, wall, cpus in reports:
        rows = []
        for s, d in enumerate(done):
            sec = d["seconds"]
            send, recv = _send_recv(sec)
            # a split backward's W is shown with its B: the backward, as in the other schedules
            rows.append({"F": sec.get("F", 0.0) / divisor, "B": (sec.get("B", 0.0) + sec.get("W", 0.0)) / divisor,
                         "UPDATE": sec.get("UPDATE", 0.0) / divisor, "SEND": send / divisor, "RECV": recv / divisor,
                         "exec_wall": d["wall_s"] / divisor, "cpu": None if cpus is None else cpus[s],
                         "seconds": sec})
            rows[-1]["other"] = rows[-1]["exec_wall"] - sum(rows[-1][k] for k in ("F", "B", "UPDATE", "SEND", "RECV"))
        per_stage_steps.append(rows)
        fb = sum(r["F"] + r["B"] for r in rows) * divisor
        bubbles.append(1.0 - fb / (stages * wall))
        busy_bubbles.append(1.0 - statistics.mean(
            sum(d["seconds"].get(k, 0) for k in ("F", "B", "W", "UPDATE")) / d["wall_s"]
            for d in done))
        walls.append(wall / divisor)
    step_s = _median(walls) if schedule not in ASYNC else walls[0]
    whole_run_step_s = step_s
    if schedule in ASYNC and n > 1:
        # the warm-up batch left out, as for the flush schedules: stage 0 (the last to finish) from
        # its update that ended batch 0 to its run's end, per batch (one drain in it)
        first = res.stage_reports[0][0]
        marks = first.get("updates_at_s") or []
        k = max(M // update_every, 1) - 1
        if len(marks) > k:
            step_s = (first["wall_s"] - marks[k]) / (n - 1)
    per_stage = []
    for s in range(stages):
        agg = {k: _median([rows[s][k] for rows in per_stage_steps])
               for k in ("F", "B", "UPDATE", "SEND", "RECV", "other", "exec_wall", "cpu")}
        agg["wall"] = step_s
        per_stage.append(agg)
    f_all = sum(p["F"] for p in per_stage)
    b_all = sum(p["B"] for p in per_stage)
    sim_mb = M * n if schedule in ASYNC else M
    sim, ticks = simulated_bubble(schedule, stages, sim_mb, b_all / f_all if f_all else None, update_every)
    fb = [p["F"] + p["B"] for p in per_stage]
    # messages per step: each stage but the last sends M activations, each but the first M gradients
    sends = sum(p["SEND"] for p in per_stage)
    msgs = 2 * (stages - 1) * M
    from runtime.engines.stage import stage_spec

    act_shape = graph.values[stage_spec(graph, *res.ranges[1]).activation_input].shape
    act_bytes = 4 * int(np.prod(act_shape))  # float32 activation (and its gradient) per micro-batch
    return {"framework": "mnn", "schedule": schedule, "variant": variant, "engine": engine, "update_every": update_every,
            "stages": stages, "microbatches": M, "ranges": res.ranges,
            "step_s": step_s, "samples_per_s": BATCH / step_s, "step_samples_s": walls,
            "whole_run_step_s": whole_run_step_s,
            "bubble_measured": _median(bubbles), "bubble_busy": _median(busy_bubbles),
            "bubble_simulated": sim, "sim_ticks": ticks, "b_over_f": b_all / f_all if f_all else None,
            "imbalance": max(fb) / statistics.mean(fb) if fb and statistics.mean(fb) else None,
            "peak_rss_mb": [d["peak_rss_bytes"] / 2**20 for d in res.stage_reports[-1]],
            "per_stage": per_stage, "send_ms_per_msg": 1000 * sends / msgs if msgs else None,
            "act_bytes": act_bytes, "losses": res.losses, "first_loss": res.losses[0] if schedule not in ASYNC else None,
            "stage_busy": res.stage_busy, "others_cpu": noise.others,
            "coordinator_cpu_s": _median([b - a for a, b in zip(coord_marks[1:], coord_marks[2:])]),
            "events": [e.get("event") for e in res.events],  # a loss under load (recovery) shows here
            "reports": [[{"seconds": d["seconds"], "wall_s": d["wall_s"], "peak_rss_bytes": d["peak_rss_bytes"]}
                         for d in done] for done in res.stage_reports]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_pipeline(M: int, stages: int, schedule: str, steps: int, timeout: float, cuts=None) -> dict:
    env = _child_env()
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(stages)})
    procs = []
    with NoiseMeter() as noise:
        for rank in range(stages):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "torch-rank", str(M), "--stages", str(stages),
                   "--schedule", schedule, "--rank", str(rank), "--steps", str(steps), *_cuts_args(cuts)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**env, "RANK": str(rank)}))
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                out, err = p.communicate()
            outs.append((p.returncode, out, err))
    results = []
    for rank, (rc, out, err) in enumerate(outs):
        r = _parse_marker(out)
        if rc != 0 or r is None:
            raise RuntimeError(f"torch rank {rank} ({schedule}, {stages} ranks, M={M}) failed (rc {rc}):\n"
                               f"{(out + err)[-3000:]}")
        results.append(r)
    n = steps + 1
    walls = [results[0]["steps"][k]["step_s"] for k in range(1, n)]
    step_s = _median(walls)
    bubbles = []
    for k in range(1, n):
        fb = sum(r["steps"][k]["F"] + r["steps"][k]["B"] for r in results)
        bubbles.append(1.0 - fb / (stages * results[0]["steps"][k]["step_s"]))
    per_stage = []
    for r in results:
        rows = r["steps"][1:]
        agg = {k: _median([x[k] for x in rows]) for k in ("F", "B", "UPDATE")}
        agg["cpu"] = _median([x["cpu_s"] for x in rows])
        agg["own"] = _median([x["own_s"] for x in rows])
        # P2P waits, loss, scheduling
        agg["other"] = _median([x["own_s"] - x["F"] - x["B"] - x["UPDATE"] for x in rows])
        agg["wall"] = step_s
        per_stage.append(agg)
    f_all = sum(p["F"] for p in per_stage)
    b_all = sum(p["B"] for p in per_stage)
    sim, ticks = simulated_bubble(schedule, stages, M, b_all / f_all if f_all else None)
    fb = [p["F"] + p["B"] for p in per_stage]
    return {"framework": "torch", "schedule": schedule, "torch_schedule": TORCH_SCHEDULES[schedule],
            "stages": stages, "microbatches": M, "ranges": [r["blocks"] for r in results],
            "step_s": step_s, "samples_per_s": BATCH / step_s, "step_samples_s": walls,
            "bubble_measured": _median(bubbles), "bubble_simulated": sim, "sim_ticks": ticks,
            "b_over_f": b_all / f_all if f_all else None,
            "imbalance": max(fb) / statistics.mean(fb) if fb and statistics.mean(fb) else None,
            "peak_rss_mb": [r["peak_rss_mb"] for r in results], "rss_base_mb": [r["rss_base_mb"] for r in results],
            "per_stage": per_stage, "first_loss": results[-1]["steps"][0]["loss"],
            "losses": [x["loss"] for x in results[-1]["steps"]], "others_cpu": noise.others, "raw": results}


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def _table(rows: list[list[str]], header: list[str], left: int = 1) -> list[str]:
    allrows = [header] + rows
    widths = [max(len(r[i]) for r in allrows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(allrows):
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("-" * len(lines[-1]))
    return lines


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _cpu_ratio(r: dict, single: dict | None) -> float | None:
    """CPU seconds per step of all the configuration's processes / the single process's."""
    cpus = [p.get("cpu") for p in r["per_stage"]]
    base = single["per_stage"][0].get("cpu") if single else None
    if not base or any(c is None for c in cpus):
        return None
    return sum(cpus) / base


def _label(r: dict) -> str:
    return r["schedule"] + (f" {r['variant']}" if r.get("variant") else "")


def main_table(results: list[dict], framework: str) -> list[str]:
    singles = {r["microbatches"]: r for r in results if r["framework"] == framework and r["schedule"] == "single"}
    mnn = {(r["microbatches"], r["stages"], r["schedule"]): r for r in results
           if r["framework"] == "mnn" and not r.get("variant")}
    header = ["config", "M", "procs", "step s", "samp/s", "speedup", "bub meas", "bub sim", "f:b", "imbal",
              "cpu/1", "peak MB per proc", "max/1", "sum/1", "others"]
    if framework == "torch":
        header += ["step torch/MNN"]
    rows = []
    for r in results:
        if r["framework"] != framework:
            continue
        single = singles.get(r["microbatches"])
        base_step = single["step_s"] if single else None
        base_rss = single["peak_rss_mb"][0] if single else None
        rss = r["peak_rss_mb"]
        row = [_label(r) if framework == "mnn" or r["schedule"] == "single" else r["torch_schedule"],
               str(r["microbatches"]), str(r["stages"]), _fmt(r["step_s"], ".2f"), _fmt(r["samples_per_s"], ".2f"),
               _fmt(base_step / r["step_s"] if base_step else None, ".2f"),
               _fmt(r.get("bubble_measured"), ".2f"), _fmt(r.get("bubble_simulated"), ".2f"), r.get("sim_ticks", "-"),
               _fmt(r.get("imbalance"), ".2f"), _fmt(_cpu_ratio(r, single), ".2f"), "/".join(f"{x:.0f}" for x in rss),
               _fmt(max(rss) / base_rss if base_rss else None, ".2f"),
               _fmt(sum(rss) / base_rss if base_rss else None, ".2f"),
               "-" if r.get("others_cpu") is None else f"{r['others_cpu']:.0%}"]
        if framework == "torch":
            m = mnn.get((r["microbatches"], r["stages"], r["schedule"]))
            row.append(_fmt(r["step_s"] / m["step_s"] if m else None, ".2f"))
        rows.append(row)
    return _table(rows, header)


def split_table(results: list[dict], framework: str) -> list[str]:
    if framework == "mnn":
        header = ["config", "M", "procs", "stage", "blocks", "F", "B", "UPD", "SEND", "RECV", "other", "cpu", "wall"]
    else:
        header = ["config", "M", "procs", "stage", "blocks", "F", "B", "UPD", "other", "cpu", "wall"]
    rows = []
    for r in results:
        if r["framework"] != framework:
            continue
        name = _label(r) if framework == "mnn" or r["schedule"] == "single" else r["torch_schedule"]
        ranges = r.get("ranges") or [[0, 8]]
        for s, p in enumerate(r["per_stage"]):
            ms = lambda k: _fmt(None if p.get(k) is None else 1000 * p[k], ".0f")  # noqa: E731
            row = [name if s == 0 else "", str(r["microbatches"]) if s == 0 else "", str(r["stages"]) if s == 0 else "",
                   str(s), f"{ranges[s][0]}-{ranges[s][1]}", ms("F"), ms("B"), ms("UPDATE")]
            if framework == "mnn":
                row += [ms("SEND"), ms("RECV")]
            row += [ms("other"), ms("cpu"), ms("wall") if s == 0 else ""]
            rows.append(row)
    return _table(rows, header)


def _tdp_best(results: list[dict], stages: int, M: int, round_: int = 0) -> dict | None:
    """torch.distributed.pipelining's fastest schedule on `stages` ranks at M micro-batches (in
    round `round_` of `--rounds`)."""
    tdp = [t for t in results if t["framework"] == "torch" and t["stages"] == stages and t["microbatches"] == M
           and t["schedule"] != "single" and t.get("round", 0) == round_]
    return max(tdp, key=lambda t: t["samples_per_s"]) if tdp else None


def targets_table(results: list[dict]) -> list[str]:
    """Issue 14's first target, side by side: each Confidant row planned within a budget (a fraction
    of the largest rank of torch.distributed.pipelining's fastest schedule, `--within-tdp`) against
    that schedule on as many processes: throughput ratio (target >= 1.2) and largest process ratio
    (target <= 0.5), with the plan's predicted peaks beside the measured ones. With `--rounds` R > 1
    each row is measured R times, each time beside TDP's schedules measured again just before it:
    then ``x TDP`` is the median of the rounds' ratios (each round's in brackets) and ``max/TDP``
    the worst round's."""
    rows = []
    for r in (r for r in results if r["framework"] == "mnn" and r.get("budget_mb") is not None
              and r.get("round", 0) == 0):
        rounds = [x for x in results if x["framework"] == "mnn" and x.get("budget_mb") is not None
                  and _label(x) == _label(r) and (x["stages"], x["microbatches"]) == (r["stages"], r["microbatches"])]
        pairs = [(x, _tdp_best(results, r["stages"], r["microbatches"], x.get("round", 0))) for x in rounds]
        pairs = [(x, b) for x, b in pairs if b is not None]
        if not pairs:
            continue
        best = pairs[0][1]
        largest = max(best["peak_rss_mb"])
        speed = [x["samples_per_s"] / b["samples_per_s"] for x, b in pairs]
        memory = [max(x["peak_rss_mb"]) / max(b["peak_rss_mb"]) for x, b in pairs]
        shown = f"{statistics.median(speed):.2f}" + (
            f" [{' '.join(f'{v:.2f}' for v in speed)}]" if len(speed) > 1 else "")
        rows.append([f"{r['schedule']} {r['variant']}", str(r["stages"]), f"{r['samples_per_s']:.2f}",
                     f"{best['samples_per_s']:.2f} {TORCH_SCHEDULES.get(best['schedule'], best['schedule'])}",
                     shown, "/".join(f"{x:.0f}" for x in r["peak_rss_mb"]),
                     "/".join(f"{x:.0f}" for x in r["predicted_mb"]), f"{largest:.0f}", f"{max(memory):.2f}"])
    if not rows:
        return []
    header = ["planned within budget", "procs", "samp/s", "TDP best samp/s", "x TDP", "peak MB per proc",
              "predicted MB", "its largest rank", "max/TDP"]
    return ["", "Issue 14's targets: throughput >= 1.2x TDP's fastest schedule and largest process <= 0.5x that "
                "schedule's largest rank, at once (each device's budget: --within-tdp x that rank in this run)"
            ] + _table(rows, header)


def other_targets_lines(results: list[dict]) -> list[str]:
    """Issue 14's other pipeline targets from this run: the 2-process pipeline's speedup over
    Confidant's own single process (its fastest 2-process row, target >= 1.6x), and 1f1b-stash
    against 1f1b-flush on the same work (the fixed cuts, MNN: target stash at least as fast)."""
    out = []
    for M in sorted({r["microbatches"] for r in results}):
        mine = [r for r in results if r["framework"] == "mnn" and r["microbatches"] == M]
        single = next((r for r in mine if r["schedule"] == "single"), None)
        two = [r for r in mine if r["stages"] == 2 and r["schedule"] != "single"]
        if single is not None and two:
            best = min(two, key=lambda r: r["step_s"])
            x = single["step_s"] / best["step_s"]
            out.append(f"M={M}: 2 processes over Confidant's single process: {x:.2f}x ({_label(best)}, "
                       f"{best['step_s']:.2f} s against {single['step_s']:.2f} s; target >= 1.6x: "
                       f"{'met' if x >= 1.6 else 'NOT met'})")
        for stages in sorted({r["stages"] for r in mine if r["schedule"] != "single"}):
            plain = {r["schedule"]: r for r in mine if r["stages"] == stages and not r.get("variant")}
            if "1f1b-stash" in plain and "1f1b-flush" in plain:
                a, b = plain["1f1b-stash"]["step_s"], plain["1f1b-flush"]["step_s"]
                out.append(f"M={M}, {stages} processes, fixed cuts, MNN: 1f1b-stash {a:.2f} s against 1f1b-flush "
                           f"{b:.2f} s per step (target: stash at least as fast: {'met' if a <= b else 'NOT met'})")
    return [""] + out if out else []


def report(results: list[dict], errors: list[str], steps: int, elapsed: float, model: Path,
           isa: dict | None = None) -> str:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    cpus = os.cpu_count() or 1
    every_round, results = results, [r for r in results if r.get("round", 0) == 0]  # the tables show round 1
    out = [f"MiniLM {model}: batch {BATCH}, seq {SEQ}, float32, AdamW lr {LR}, 1 thread per process; "
           f"{steps} timed steps (+1 warm-up), medians; {cpus} CPUs; MNN {version('MNN')}, torch {version('torch')}; "
           f"{elapsed:.0f} s", ""]
    out.append("MNN: single = 1 process with gradient accumulation; pipelines = LocalWorkers over ZeroMQ "
               "(coordinator = this process, not counted in memory)")
    out += main_table(results, "mnn")
    torch_rows = [r for r in results if r["framework"] == "torch"]
    if torch_rows:
        out.append("")
        out.append("PyTorch: single = 1 process with gradient accumulation; pipelines = torch.distributed.pipelining "
                   "over gloo (mask passed between stages as an int64 tensor)")
        out += main_table(results, "torch")
    out.append("")
    out.append("Where the time goes, per stage and step (median ms). RECV includes waiting for the peer; "
               "other = executor wall - all listed (MNN) or rank's step - F - B - UPD (torch: P2P waits, loss, "
               "scheduling); 1f1b-stash: whole run / (steps+1), warm-up included.")
    out += split_table(results, "mnn")
    if torch_rows:
        out.append("")
        out += split_table(results, "torch")
    out += targets_table(every_round)
    out += other_targets_lines(results)
    if isa is not None:
        from benchmarks.engine import isa_matched_lines

        out += isa_matched_lines(isa)
    # transport
    pipes = [r for r in results if r["framework"] == "mnn" and r["schedule"] != "single" and r.get("send_ms_per_msg")]
    if pipes:
        out.append("")
        parts = []
        for M in sorted({r["microbatches"] for r in pipes}):
            xs = [r["send_ms_per_msg"] for r in pipes if r["microbatches"] == M]
            kb = next((r["act_bytes"] for r in pipes if r["microbatches"] == M and r.get("act_bytes")), None)
            parts.append(f"M={M} ({_fmt(kb and kb / 1024, '.0f')} KiB per activation/gradient): "
                         f"{statistics.median(xs):.2f} ms per send (median over configs, range "
                         f"{min(xs):.2f}-{max(xs):.2f})")
        out.append("MNN transport: SEND_ACT+SEND_GRAD time per message (header, crc32, hand-off to ZeroMQ); " +
                   "; ".join(parts))
    losses = []
    for fw in ("mnn", "torch"):
        xs = {r["microbatches"]: r["first_loss"] for r in results if r["framework"] == fw and r["schedule"] == "single"}
        if xs:
            losses.append(f"{fw} " + ", ".join(f"M={m}: {v:.5f}" for m, v in sorted(xs.items())))
    pl = [r["first_loss"] for r in results if r["schedule"] != "single" and r.get("first_loss") is not None]
    if losses:
        out.append("First-batch loss (same data and initial weights everywhere): " + "; ".join(losses) +
                   (f"; pipelines {min(pl):.5f}..{max(pl):.5f}" if pl else ""))
    if any(r["stages"] > cpus for r in results):
        out.append("")
        out.append(f"NOTE: {max(r['stages'] for r in results)} worker processes on {cpus} CPUs: the rows with more "
                   "processes than CPUs measure CPU contention as much as pipelining (their F/B times are wall "
                   "clock, inflated when a worker is descheduled; compare 'cpu').")
    busy = [(r, r["others_cpu"]) for r in results if r.get("others_cpu") is not None and r["others_cpu"] > 0.10]
    if busy:
        out.append("")
        out.append("WARNING: other processes used the CPUs during these runs (share of all CPUs): "
                   + ", ".join(f"{r['framework']} {r['schedule']} M={r['microbatches']} {r['stages']}p {b:.0%}"
                               for r, b in busy)
                   + ". Those times are inflated; rerun on an idle machine.")
    for e in errors:
        out.append(e)
    return "\n".join(out)


def _strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "raw"} | ({"raw": r["raw"]} if "raw" in r else {})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration (default 3; +1 warm-up)")
    ap.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts (default 4,8)")
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (default: export MiniLM once)")
    ap.add_argument("--json", type=Path, default=None, help="also write all figures to this JSON file")
    ap.add_argument("--skip-torch", action="store_true", help="measure the MNN runtime only")
    ap.add_argument("--variants", action="store_true",
                    help="also run 1f1b-stash with one update per M backwards, 1f1b-flush on the PyTorch engine, "
                         "1f1b-flush with MNN keeping its activations, 1f1b-flush with the engine and "
                         "activations per stage `plan` would pick (a quick profile first), and zb-h1 (zero "
                         "bubble) on the PyTorch engine and with `plan`'s pick")
    ap.add_argument("--cuts", default="",
                    help="also run 1f1b-stash on the PyTorch engine at these cuts: the first block of stages 2..p, "
                         "comma-separated, ';' between configurations (e.g. '3;2,5': blocks 0-2 | 3-8 on 2 "
                         "processes, and 0-1 | 2-4 | 5-8 on 3); for memory against speed beside the plan's cuts")
    ap.add_argument("--within-tdp", type=float, default=0.5, metavar="FRACTION",
                    help="after torch.distributed.pipelining's rows, plan 1f1b-stash, 1f1b-flush and zb-h1 with each "
                         "device's budget FRACTION x the largest rank of TDP's fastest schedule in this run (issue "
                         "14's target: 0.5) and run those plans; 0 skips them (default 0.5)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per configuration (default 600)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="measure TDP's schedules and the plans within --within-tdp R times, alternating, and "
                         "give the targets as the median of the rounds' ratios (TDP's own step time moves up to "
                         "30%% between runs here); the plans keep round 1's budgets (default 1)")
    ap.add_argument("--isa-rounds", type=int, default=3, metavar="N",
                    help="also compare MNN's whole-model fwd+bwd with PyTorch held to AVX2 (this MNN wheel's GEMM "
                         "ISA), N alternating rounds of benchmarks/engine.py's children, about 25 s each; 0 skips "
                         "(default 3)")
    ap.add_argument("--compare", metavar="CONFIGS", default="",
                    help="only the targets of issues 31 (5) and 32: these Confidant configurations, comma-separated "
                         "SCHEDULE[:ENGINE[:ACTIVATIONS[:POLICY]]] ('+' between per-stage values, e.g. 'zb-h1:torch,"
                         "1f1b-flush:mnn:per-block,zb-h1:torch::stop'; POLICY default or stop), each with its coordinator in a process of its own (counted), "
                         "against torch.distributed.pipelining's schedules on --compare-stages processes, --rounds "
                         "rounds alternating; wall-clock steps, every process's peak")
    ap.add_argument("--compare-stages", type=int, default=2, help="processes for --compare (default 2)")
    ap.add_argument("--compare-cuts", default="", metavar="CUTS",
                    help="--compare at these cuts (the first block of stages 2..p, comma-separated, e.g. '4': "
                         "blocks 0-3 | 4-8), the same split for Confidant and for TDP's ranks (default: the even "
                         "split of jobs.train.pipeline.stage_ranges, MiniLM's 0-4 | 5-8: 4 layers against 2)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "M"), help=argparse.SUPPRESS)
    ap.add_argument("--stages", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.rounds < 1:
        ap.error(f"--rounds: 1 or more, not {args.rounds}")
    if args.isa_rounds < 0:
        ap.error(f"--isa-rounds: 0 (skip) or more, not {args.isa_rounds}")
    if not 0 <= args.within_tdp:
        ap.error(f"--within-tdp: a fraction of TDP's largest rank, 0 or more (0 skips), not {args.within_tdp}")

    try:
        compare_cuts = [int(c) for c in args.compare_cuts.split(",") if c.strip()] or None
    except ValueError:
        ap.error(f"--compare-cuts: comma-separated block numbers, e.g. 4, not {args.compare_cuts!r}")
    if args.child:
        kind, M = args.child[0], int(args.child[1])
        if kind == "single-mnn":
            result = child_single_mnn(str(args.model), M, args.steps)
        elif kind == "single-torch":
            result = child_single_torch(M, args.steps)
        elif kind == "torch-rank":
            result = child_torch_rank(M, args.stages, args.schedule, args.rank, args.steps, compare_cuts)
        elif kind == "mnn-pipeline":
            result = child_mnn_pipeline(str(args.model), M, args.stages, args.schedule, args.steps, compare_cuts)
        else:
            ap.error(f"unknown child kind {kind}")
        sys.stdout.flush()
        print(MARKER + json.dumps(result, default=float), flush=True)
        return 0

    try:
        mbs = [int(x) for x in args.microbatches.split(",") if x.strip()]
    except ValueError:
        ap.error("--microbatches: comma-separated integers, e.g. 4,8")
    if not mbs or any(m < 1 or BATCH % m for m in mbs):
        ap.error(f"--microbatches: each must divide the batch of {BATCH}")
    try:
        extra_cuts = [[int(c) for c in part.split(",")] for part in args.cuts.split(";") if part.strip()]
    except ValueError:
        ap.error(f"--cuts: comma-separated block numbers, ';' between configurations, e.g. '3;2,5', not {args.cuts!r}")
    model = args.model if args.model is not None else default_model()
    if not Path(model).is_file():
        ap.error(f"model {model} does not exist")
    if args.compare:
        specs = [x.strip() for x in args.compare.split(",") if x.strip()]
        try:
            for spec in specs:
                parse_config(spec)
        except ValueError as exc:
            ap.error(f"--compare: {exc}")
        for M in mbs:
            results = compare(Path(model), M, args.compare_stages, specs, args.rounds, args.steps, args.timeout,
                              args.skip_torch, compare_cuts)
            print(compare_report(results, M, args.compare_stages, args.steps) if results else "nothing measured")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"microbatches": M, "results": [_strip(r) for r in results]},
                                                indent=1, default=float) + "\n")
        return 0

    from planner.onnx_import import load_model

    batches = make_batches(args.steps + 1)
    results: list[dict] = []
    errors: list[str] = []
    start = time.perf_counter()

    def attempt(label: str, fn, round_: int = 0):
        print(f"  {label} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            r = fn()
            r["round"] = round_
            results.append(r)
            print(f"    {r['step_s']:.2f} s/step ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
        except Exception as exc:  # keep the other configurations
            msg = f"{label}: not measured because {type(exc).__name__}: {str(exc).strip()[-1500:]}"
            errors.append(msg)
            print("    " + msg, file=sys.stderr, flush=True)

    for M in mbs:
        graph = load_model(str(model), batch=BATCH // M, seq=SEQ)
        attempt(f"mnn single M={M}", lambda: run_single_mnn(Path(model), M, args.steps, args.timeout))
        if not args.skip_torch:
            attempt(f"torch single M={M}", lambda: run_single_torch(M, args.steps, args.timeout))
        for stages in STAGES:
            for schedule in SCHEDULES:
                attempt(f"mnn {schedule} M={M} {stages} stages",
                        lambda: run_mnn_pipeline(graph, batches, M, stages, schedule, args.steps))
            if args.variants:
                # PipeDream's rule with one update per M backwards: two weight versions at most
                attempt(f"mnn 1f1b-stash update-every {M} M={M} {stages} stages",
                        lambda: run_mnn_pipeline(graph, batches, M, stages, "1f1b-stash", args.steps,
                                                 update_every=M, variant=f"k={M}"))
                # PipeDream-2BW: the same, two weight versions at most
                attempt(f"mnn 2bw update-every {M} M={M} {stages} stages",
                        lambda: run_mnn_pipeline(graph, batches, M, stages, "2bw", args.steps,
                                                 update_every=M, variant=f"k={M}"))
                # PipeDream's schedule on the PyTorch engine and on the plan's own split
                attempt(f"mnn 1f1b-stash torch engine M={M} {stages} stages",
                        lambda: run_mnn_pipeline(graph, batches, M, stages, "1f1b-stash", args.steps,
                                                 engine="torch", variant="torch"))
                attempt(f"mnn 1f1b-stash as planned M={M} {stages} stages",
                        lambda: run_planned(graph, Path(model), batches, M, stages, "1f1b-stash", args.steps))
                attempt(f"mnn 1f1b-flush activations kept M={M} {stages} stages",
                        lambda: run_mnn_pipeline(graph, batches, M, stages, "1f1b-flush", args.steps,
                                                 activations="keep", variant="keep"))
                # zb-h1, zero bubble: each backward split into B (sent at once) and W (weight gradients)
                for flush in ("1f1b-flush", "zb-h1"):
                    attempt(f"mnn {flush} torch engine M={M} {stages} stages",
                            lambda: run_mnn_pipeline(graph, batches, M, stages, flush, args.steps,
                                                     engine="torch", variant="torch"))
                    picked, kept = engines_picked(graph, Path(model), stages, flush, M)
                    label = ",".join(f"{e}/{a}" if a else e for e, a in zip(picked, kept))
                    attempt(f"mnn {flush} engine auto {label} M={M} {stages} stages",
                            lambda: run_mnn_pipeline(graph, batches, M, stages, flush, args.steps,
                                                     engine=picked, activations=kept, variant=f"auto[{label}]"))
                    # the plan's own cuts too: what `confidant plan` runs on devices like this one
                    attempt(f"mnn {flush} as planned M={M} {stages} stages",
                            lambda: run_planned(graph, Path(model), batches, M, stages, flush, args.steps))
            for cuts in (c for c in extra_cuts if len(c) == stages - 1):
                bounds = [0, *cuts, len(graph.blocks)]
                ranges = [(a, b - 1) for a, b in zip(bounds, bounds[1:])]
                if any(a > b for a, b in ranges):
                    errors.append(f"--cuts {cuts}: not increasing block numbers within 1..{len(graph.blocks) - 1}")
                    continue
                label = "|".join(f"{a}-{b}" for a, b in ranges)
                attempt(f"mnn 1f1b-stash torch engine at {label} M={M} {stages} stages",
                        lambda: run_mnn_pipeline(graph, batches, M, stages, "1f1b-stash", args.steps,
                                                 engine="torch", ranges=ranges, variant=f"torch[{label}]"))
            budget = None
            for round_ in range(args.rounds if not args.skip_torch else 0):
                tag = f" (round {round_ + 1}/{args.rounds})" if args.rounds > 1 else ""
                for schedule in TORCH_SCHEDULES:
                    attempt(f"torch.distributed.pipelining {TORCH_SCHEDULES[schedule]} M={M} {stages} ranks{tag}",
                            lambda: run_torch_pipeline(M, stages, schedule, args.steps, args.timeout), round_)
                best = _tdp_best(results, stages, M, round_)
                if args.within_tdp > 0 and best is not None:
                    if budget is None:  # round 1's: every round runs the same plans
                        budget = int(args.within_tdp * max(best["peak_rss_mb"]) * 2**20)
                    for schedule in ("1f1b-stash", "1f1b-flush", "zb-h1"):
                        attempt(f"mnn {schedule} as planned within {budget / 2**20:.0f} MB M={M} {stages} "
                                f"stages{tag}",
                                lambda: run_planned(graph, Path(model), batches, M, stages, schedule, args.steps,
                                                    budget), round_)
    isa = None
    if args.isa_rounds:
        from benchmarks.engine import isa_matched

        try:
            isa = isa_matched(Path(model), args.isa_rounds, timeout=args.timeout)
        except Exception as exc:  # keep the pipeline figures
            errors.append(f"ISA-matched engine comparison: not measured because {type(exc).__name__}: "
                          f"{str(exc).strip()[-1500:]}")
    elapsed = time.perf_counter() - start
    order = {"single": 0, **{s: i + 1 for i, s in enumerate(SCHEDULES + ("2bw", "zb-h1"))}}
    results.sort(key=lambda r: (r["framework"] != "mnn", r["microbatches"], r["stages"], order[r["schedule"]],
                                r.get("variant") or ""))
    print(report(results, errors, args.steps, elapsed, Path(model), isa))

    if args.json:
        import importlib.metadata as md

        def version(dist):
            try:
                return md.version(dist)
            except md.PackageNotFoundError:
                return None

        doc = {"model": str(model), "batch": BATCH, "seq": SEQ, "num_labels": NUM_LABELS, "lr": LR,
               "steps": args.steps, "microbatches": mbs, "cpus": os.cpu_count(), "machine": platform.machine(),
               "python": platform.python_version(), "mnn": version("MNN"), "torch": version("torch"),
               "elapsed_s": elapsed, "results": [_strip(r) for r in results], "errors": errors, "isa_matched": isa}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
