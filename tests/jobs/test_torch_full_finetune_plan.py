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

import json

import pytest

MIB = 2 ** 20


@pytest.mark.slow  # an export, a real torch profile (fresh children), a plan and a two-step run of two workers
def test_torch_full_fine_tuning_runs_two_steps_within_0_90_to_1_00_of_its_plan(tmp_path):
    from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
    from jobs.planning import PlanSettings, plan_model
    from jobs.profiling import profile_this_device
    from jobs.train.from_plan import PlanRunSettings, train_from_plan
    from tasks.causal_lm.entity_task import write_entity_splits

    # SmolLM2's tokenizer and tied table (49152 x 576 here, 108 MiB: the table's gradient a sizeable part
    # of the embeddings' stage), two layers of SmolLM2's width
    model = export_random_causal_lm("llama", tmp_path / "m.onnx", LlmExportOptions(), kv_cache=False,
                                    tokenizer_from=smollm2_gguf_path(), hidden_size=576, intermediate_size=1536,
                                    num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)
    train, _ = write_entity_splits(tmp_path / "data", n_train=16, n_dev=1)
    _, profile_file = profile_this_device(model, 1, 128, tmp_path / "dev.json", name="dev",
                                          backends=("torch:cpu:t1",), reps=1, attention=False, lora=None)
    (tmp_path / "cluster.yaml").write_text("devices:\n" + "".join(
        f"  - {{name: d{k}, address: 'tcp://127.0.0.1:59{k}9', profile: {profile_file.name}, "
        f"memory_budget: 4GiB, backend: 'torch:cpu:t1'}}\n" for k in range(2))
        + "links:\n  default: {bandwidth: 1Gbit/s, latency: 0.2ms}\n")
    out = plan_model(model, tmp_path / "cluster.yaml",
                     PlanSettings("1f1b-flush", 4, 128, 4, lora=None, data=train, time_limit_s=20.0,
                                  cuts=(3,)),
                     tmp_path / "plan")
    devices = json.loads((out / "plan.json").read_text())["devices"]
    planned = {d["name"]: d["memory_bytes"] for d in devices}
    for d in devices:  # what each figure is made of, for a failure's message
        print(d["name"], d["blocks"], d.get("activations"),
              {k: round(v / MIB, 1) for k, v in (d.get("memory_terms") or {}).items()})
    assert len(planned) == 2 and devices[0]["blocks"][0] == 0 and devices[0]["blocks"][1] < devices[1]["blocks"][0]
    run = train_from_plan(out, train, None, PlanRunSettings(steps=2, seed=0, local=True, insecure=True))
    measured = {d.name: d.peak_rss_bytes for d in run.devices}
    figures = {n: (round(measured[n] / MIB, 1), round(planned[n] / MIB, 1), round(measured[n] / planned[n], 3))
               for n in planned}
    print(f"measured, planned MiB, ratio: {figures}")
    # the promise (no worker past its plan) and target 3 (within 10% of it)
    assert all(0.90 * planned[n] <= measured[n] <= planned[n] for n in planned), figures
