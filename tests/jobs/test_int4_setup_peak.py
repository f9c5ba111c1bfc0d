"""`train-local --base-dtype int4` sets up within what its training holds: the set-up (the tokenizer and
data, the model read and lowered, its frozen base quantized, the engine built) never peaks above the
steps' own peak. Read into memory first, the float32 file stood beside the quantized base while it was
quantized: SmolLM2 LoRA r=8's set-up peaked at 710-739 MiB against 341-542 in training (issue 31, lever 2
"every weight held once, no spikes"; benchmarks/MEMORY_NOTES.md, helper h75). Now the file is read from a
mapping, each float32 weight resident only while it is quantized (`jobs.common.lora.read_mapped`)."""
from __future__ import annotations

import pytest

from support import int4_train_local_peaks

MIB = 2 ** 20



@pytest.mark.slow  # the SmolLM2 export (shared with the slow tier), then one fresh process: ~1-2 min loaded
def test_an_int4_one_device_set_up_peaks_below_its_training(smollm2_onnx, tmp_path):
    """SmolLM2-135M LoRA r=8 on an int4 base, one row of 128 tokens per step, per-block activations
    (the least a step holds, so the hardest bound), two AdamW steps on MNN in a new interpreter: the
    set-up's VmHWM at most the steps' VmHWM. Measured (h75, load ~13): main's set-up 739.1 MiB against
    training's 369.8; with the mapped read 291.6 against 369.4 (the same losses)."""
    from tasks.causal_lm.entity_task import write_entity_splits

    train, _ = write_entity_splits(tmp_path / "data", n_train=8, n_dev=1, seed=0)
    # VmHWM when the job says its set-up is done (the "model ...; setup" note, after the engine is built),
    # then the steps' peak, which the job measures after resetting VmHWM (`train_causal_lm`)
    got = int4_train_local_peaks(smollm2_onnx, train, None, 2, {"setup": ["model ", "setup"]})
    setup, training = got["setup"], got["training"]
    assert setup is not None and training > 0, got
    print(f"set-up {setup / MIB:.1f} MiB, training {training / MIB:.1f} MiB, losses {got['losses']}")
    assert setup <= training, (f"set-up {setup / MIB:.1f} MiB above training's {training / MIB:.1f} MiB",
                               got["losses"])
