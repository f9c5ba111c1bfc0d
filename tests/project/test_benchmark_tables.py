"""benchmarks/memory.py's table prints the plan rows of benchmarks/memory_plans.py (issue 31 targets 1-2)
after its own: the row loop once named its per-row planned figures `plans`, the plan rows' name, so with
`--plans` the targets' table was handed the last row's floats and the run ended in a TypeError after an
hour of measuring. Fed a Llama-1B-class plan row as `main` builds it (h44's figures, then h55's); its target 3
line measures "off" as the plan rows' own line does (measured / planned: planned / measured read 7% against 6%)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = {"model": "llama1b", "devices": 4, "target_mib": 768, "fits_target": True, "needs_mib": None,
       "schedule": "1f1b-flush", "engine": "mnn", "budget_mib": 768, "budgets_mib": [768] * 4,
       "blocks": [[0, 3], [4, 8], [9, 13], [14, 18]], "activations": ["per-block"] * 4,
       "planned_mib": [715.9, 543.6, 538.6, 748.5], "measured_mib": [722.6, 555.4, 552.8, 754.0]}


def test_the_targets_table_prints_the_plan_rows_after_a_row_with_planned_figures(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ is no installed package
    from benchmarks.memory import print_tables

    rows = [{"name": "confidant LoRA int4 llama1b 4 x 768 MiB plan", "peak_mib": ROW["measured_mib"],
             "planned_mib": ROW["planned_mib"]}]
    print_tables(rows, [ROW], 2)
    out = capsys.readouterr().out
    assert "llama1b (1f1b-flush): 4 devices of 768 MiB: fits\n" in out
    assert "stage 2 blocks 9-13 (per-block): planned  538.6  measured  552.8 MiB  measured/planned 1.03\n" in out
    assert "every peak within its budget: True" in out
    # four devices' figures keep their columns apart
    assert "723 / 555 / 553 / 754    716 / 544 / 539 / 748 0.99 / 0.98 / 0.97 / 0.99" in out
    # both target 3 lines measure "off" alike (measured / planned): h55's run, 0.936 of its plan at worst
    new = {**ROW, "planned_mib": [676.8, 615.9, 609.9, 713.4], "measured_mib": [636.8, 606.2, 604.4, 667.6]}
    print_tables([{**rows[0], "peak_mib": new["measured_mib"], "planned_mib": new["planned_mib"]}], [new], 2)
    out = capsys.readouterr().out
    assert "target 3: memory model vs measured, worst 6% off" in out and "model: worst 6% off" in out
