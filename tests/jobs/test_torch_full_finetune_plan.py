"""Issue 31 target 3 under full fine-tuning on PyTorch, end to end: `profile` (torch, one thread), `plan`
over two torch devices and `train PLAN` for two steps on real worker processes, each worker's measured peak
(VmHWM, its whole life) within 0.90-1.00 of what the plan says it needs. Two steps: AdamW's moments are
made at the first update, so only the second step's backwards and update hold them (benchmarks/
MEMORY_NOTES.md, h42). The plan cuts the tied table's holders apart (the embeddings with the layers, the
fused LM head + loss on the other device), as SmolLM2's three-device row does. The embeddings' stage
never holds the table's gradient dense: its backwards give rows (a sparse embedding gradient) and its
update makes a dense copy of them in zeroed pages it never writes, so its one resident table beyond the
weights and moments is the sum the exchange returns (`planner.cost._tied_lookup_delta_bytes`). Charged
dense and summed, that stage ran 0.84-0.85 of its plan on SmolLM2 (`smollm2-torch-full`, helper h64)."""
from __future__ import annotations

import pytest

from support import profile_plan_and_run_two_workers


@pytest.mark.slow  # an export, a real torch profile (fresh children), a plan and a two-step run of two workers
def test_torch_full_fine_tuning_runs_two_steps_within_0_90_to_1_00_of_its_plan(tmp_path):
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path

    # SmolLM2's tokenizer and tied table (49152 x 576 here, 108 MiB: the table's gradient a sizeable part
    # of the embeddings' stage), two layers of SmolLM2's width
    model = export_random_causal_lm("llama", tmp_path / "m.onnx", LlmExportOptions(), kv_cache=False,
                                    tokenizer_from=smollm2_gguf_path(), hidden_size=576, intermediate_size=1536,
                                    num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)
    # cut at the head: the embeddings with the layers, the fused LM head + loss on the other device
    figures, measured, planned = profile_plan_and_run_two_workers(model, tmp_path, "torch:cpu:t1", "9", "4GiB",
                                                                  cuts=(3,))
    # the promise (no worker past its plan) and target 3 (within 10% of it)
    assert all(0.90 * planned[n] <= measured[n] <= planned[n] for n in planned), figures
