"""Issue 31 target 3 under full fine-tuning on MNN, end to end: `profile`, `plan` over two MNN devices and
`train PLAN` for two steps on real worker processes, each worker's measured peak (VmHWM, its whole life)
within what the plan says it needs. Two steps, not one: AdamW's moments are made at the first update, so
only a backward from the second step on holds them beside the gradient sum and the workspace; a plan
checked over one step never sees that peak (benchmarks/MEMORY_NOTES.md, helpers h42, h43). The plan's
gradient term and the profiled per-block workspace both hold the stage's gradients (the run holds one
set, its sum), and that double charge is what today covers a worker's heap beyond the profile's figures
(h43: ~19 MiB more non-gradient backward transient once the moments exist, ~18 MiB more at setup, on
a SmolLM2 stage); a term that took the double charge off without charging those (h41's
`summed_gradient_bytes`) ran SmolLM2's stages 1.05-1.13x their plans, and this plan's stages over theirs.
On main the head stage (the fused LM head + loss over the tied 49152 x 256 table) ran 1.014-1.029x its plan
(h43, h51): its worker's transport threads each had a malloc arena of their own, and what one arena freed
the compute thread's allocations did not reuse; a worker now keeps one arena (`runtime.heap.one_arena`),
and the stage ran 0.970x (0.985 with the snapshot copies' chunks)."""
from __future__ import annotations

import pytest

from support import profile_plan_and_run_two_workers


@pytest.mark.slow  # an export, a real MNN profile, a plan and a two-step run of two workers (~4-8 min loaded)
def test_mnn_full_fine_tuning_runs_two_steps_within_its_plan(tmp_path):
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path

    # SmolLM2's tokenizer and table (49152 x 256 here), four layers: trainable 57 MiB, AdamW's moments
    # twice that, so the second step's backward is where the peak is
    model = export_random_causal_lm("llama", tmp_path / "m.onnx", LlmExportOptions(), kv_cache=False,
                                    tokenizer_from=smollm2_gguf_path(), hidden_size=256, intermediate_size=768,
                                    num_hidden_layers=4)
    figures, measured, planned = profile_plan_and_run_two_workers(model, tmp_path, "mnn:cpu:t1", "7", "2GiB")
    # the promise: no worker past what its plan says it needs
    assert all(measured[n] <= planned[n] for n in planned), figures
