"""Issue 31, lever 3 and target 3 on PyTorch, end to end: `profile` measures a torch backend's per-layer
lines and its start-up as a worker runs (each peak in a fresh child process, `runtime.profiling.fresh`),
the planner charges and picks recomputing per block for a device whose budget nothing else fits, the
bundle carries it, and `train PLAN` runs it on a real worker process whose measured peak (VmHWM, its
whole life: setup, training) stays within the plan's figure, with the losses of the same model planned
to keep its activations (the engine's gradients against keeping: tests/runtime/test_torch_per_block.py).
One device has one micro-batch in flight, so the part of a further micro-batch's checkpoints that is
not per layer (`BlockCost.per_block_kept_once_bytes`, measured apart) is charged nowhere here
(`planner.cost.kept_once_bytes`: once a stage per further micro-batch); when it sat in the per-block
workspace, charged on every stage, this plan was 10-13% high (0.87-0.90; benchmarks/MEMORY_NOTES.md).
The one device holds the embeddings and the tied LM head: PyTorch copies their frozen float table once
(`planner.cost.shared_engine_bytes`), which the plan charged twice (48 MiB: 0.84-0.90 of the plan).

Measured in the warm profiling process instead (`profile_this_device(..., fresh=False)`, with the offer
forced), the same plan's worker ran over its figure: CI's slow tier saw 485.1 MiB against 464.5 planned,
and this machine 1.01-1.21x on SmolLM2's layer stages (benchmarks/MEMORY_NOTES.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

MIB = 2 ** 20


@pytest.mark.slow  # an export, a real profile (~3-6 min on 2 loaded cores: fresh children), two plans, two runs
def test_a_torch_device_that_only_fits_per_block_is_planned_so_and_runs_within_its_plan(tmp_path):
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from planner.lora import LoraSettings
    from tasks.causal_lm.entity_task import write_entity_splits

    # a Llama whose layers' activations (2 x 128 tokens of 256 floats) outweigh the noise, with eight
    # layers: what keeping holds a layer beyond per block (~7 MiB) outweighs the once part of a further
    # micro-batch that per block is charged (with four, per block's figure came out at keep's in one
    # profile of two, and nothing but keep fitted)
    model = export_random_causal_lm("llama", tmp_path / "m.onnx", LlmExportOptions(), kv_cache=False,
                                    tokenizer_from=smollm2_gguf_path(), hidden_size=256, intermediate_size=768,
                                    num_hidden_layers=8)
    train, _ = write_entity_splits(tmp_path / "data", n_train=16, n_dev=1)
    lora = LoraSettings(4, 8.0, targets=("q", "k", "v", "o"), train_also=(), seed=0)
    profile, profile_file = profile_this_device(model, 2, 128, tmp_path / "dev.json", name="dev",
                                                backends=("torch:cpu:t1",), reps=1, attention=False, lora=lora)
    backend = profile.backend("torch:cpu:t1")
    assert backend.fresh_lines
    layers = [c for c in backend.blocks.values() if c.per_block_stacked_bytes is not None]
    assert layers and all(c.per_block_stacked < c.stacked for c in layers)  # measured, and leaner
    # a further micro-batch's once part measured apart from the workspace (charged per stage)
    assert all(c.per_block_kept_once_bytes is not None for c in layers)

    def planned(budget: str, name: str):
        (tmp_path / "cluster.yaml").write_text(
            f"devices:\n  - {{name: d0, address: 'tcp://127.0.0.1:5917', profile: {profile_file.name}, "
            f"memory_budget: {budget}, backend: 'torch:cpu:t1'}}\n")
        out = plan_model(model, tmp_path / "cluster.yaml",
                         PlanSettings("1f1b-flush", 4, 128, 2, lora=lora, data=train, time_limit_s=20.0),
                         tmp_path / name)
        (device,) = json.loads((out / "plan.json").read_text())["devices"]
        return out, device

    roomy, kept = planned("4GiB", "keep")
    assert kept["activations"] == "keep"
    # one device, one micro-batch in flight: recomputing the whole stage holds what keeping does, so
    # a budget just under keeping's figure fits only per block
    budget = kept["memory_bytes"] - MIB
    tight, lean = planned(f"{budget}B", "lean")
    assert lean["activations"] == "per-block" and lean["memory_bytes"] <= budget
    assert json.loads((tight / "d0" / "stage.json").read_text())["activations"] == "per-block"

    runs = {}
    for name, plan in (("keep", roomy), ("per-block", tight)):
        runs[name] = train_from_plan(plan, train, None, PlanRunSettings(steps=2, seed=0, local=True, insecure=True))
    (worker,) = runs["per-block"].devices
    figures = (worker.peak_rss_bytes / MIB, lean["memory_bytes"] / MIB)
    print(f"per block: measured {figures[0]:.1f} MiB, planned {figures[1]:.1f} ({figures[0] / figures[1]:.3f})")
    # within the plan (the promise); at least 0.87 of it. With the tied table's engine copy charged twice
    # (the embeddings' figure and the head's each held it; `planner.cost.shared_engine_bytes`) this plan
    # was 48 MiB high: 0.879-0.900 (h25), 0.836 in a clean-clone CI run (519.2 of 621.4 MiB); charged
    # once, 0.96 here (benchmarks/MEMORY_NOTES.md, helper h35). Under the fixed mmap threshold
    # (`runtime.heap.steady_heap`, h57) the worker peaks 445-448 MiB every run, ~35 MiB below glibc's
    # rising threshold, while the plan moves 465-501 MiB from profile to profile: 0.894-0.962 in four
    # runs, hence 0.87, which the double charge (~48 MiB more) still fails
    assert 0.87 * lean["memory_bytes"] <= worker.peak_rss_bytes <= lean["memory_bytes"], figures
    np.testing.assert_allclose([s.loss for s in runs["per-block"].steps], [s.loss for s in runs["keep"].steps],
                               rtol=1e-6)
