"""MNN full fine-tuning's per-block line measured as a worker's second step (issue 31 target 3): a worker
holds its stage's weight gradients once, as its running sum, and from its second step on its backwards run
beside AdamW's moments. Measured on a fresh engine's `backward` (which returns a stage's whole gradient set)
the line held the layers' gradients that the gradient term charges too, and SmolLM2's full fine-tuning
stages ran 0.85 / 0.85 / 0.92 of their plans (benchmarks/MEMORY_NOTES.md, h43, h56, h61, h69). The profile
now measures the line as a worker's second step (`runtime.profiling.compute.summed_workspace`, each point in
a new interpreter) and leaves the gradients to the gradient term."""
from __future__ import annotations

MIB = 2 ** 20

# The profile's line against a worker's second step, end to end, is checked in
# tests/jobs/test_full_finetune_plan.py (`_check_summed_line`: folded there by h88, whose profile reads the line
# already on layers small enough that the worker's readings cost seconds; here it took 250-582 s loaded, h80).


def test_the_summed_line_is_not_moved_by_one_length_read_a_layer_s_gradient_high():
    """`summed_line` on the readings of SmolLM2-shaped layers (new interpreters, MiB): its 3-layer job read
    103.4 every time in one profile where 2 and 4 layers read 89.5 (h80; a worker-like run of 3 layers holds
    what 2 and 4 do), and 89.6 in others (h70). Either way the line is ~0 a further block at the 2-4 layers'
    level; h70's median of the steps between the medians of 1-4 layers (27.9, 13.9, -13.9) drew it at a
    layer's gradient (13.9 MiB) a block. With a far point the step is the steepest from that level at 4
    layers to its highest reading, and the workspace covers the far and the one-block readings."""
    from runtime.profiling.fresh import summed_line

    def mib(*values):
        return [int(v * MIB) for v in values]

    lengths = [1, 2, 3, 4]
    high = [mib(61.6, 61.6, 61.6), mib(89.5, 89.4, 89.5), mib(103.4, 103.4, 103.3), mib(89.5, 89.6, 89.5)]
    usual = [mib(61.4, 61.5, 61.4), mib(89.2, 89.8, 89.5), mib(89.6, 89.7, 89.6), mib(89.1, 89.4, 89.2)]
    for peaks in (high, usual):
        step, workspace = summed_line(peaks, lengths, 4, 5 * MIB)
        assert step < MIB // 4 and 84.2 * MIB <= workspace <= 84.7 * MIB, (step / MIB, workspace / MIB)
    # a far point at 30 layers: its step from the 4 layers' level, every far and one-block reading covered
    step, workspace = summed_line(high + [mib(103.0, 104.0)], lengths + [30], 4, 0)
    assert 0.55 * MIB <= step <= 0.57 * MIB
    assert workspace + 29 * step >= 104.0 * MIB - 1 and workspace >= 61.6 * MIB
    assert workspace + 3 * step <= 91.0 * MIB  # a 4-layer stage charged about what 2 and 4 layers read (89.5)
