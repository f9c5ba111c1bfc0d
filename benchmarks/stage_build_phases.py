"""VmRSS by phase of one MNN stage built as a worker builds it (`take_weights`), LoRA r=8 on q, k, v, o over an
int4 base, per-block activations, 1 x 128: after loading, after the build, after each of 3 forwards and 3
backwards, twice (a middle stage of 1F1B over 4 devices has 3 micro-batches in flight). What the build holds
beyond the loaded graph is what the plan's frozen float32 term (MNN's widened scales, `frozen_storage_extra_bytes`)
and engine term (`engine_bytes`, from the profile's `engine_setup_bytes`) charge for the stage.

Usage: python benchmarks/stage_build_phases.py MODEL.onnx FIRST_BLOCK LAST_BLOCK
(helper h44: the Llama-1B-class row's stages ran 1-3% over their plans, MEMORY_NOTES.md)
"""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

M = 2 ** 20


def _hwm_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> int:
    from jobs.common.lora import adapted
    from planner.lora import LoraSettings
    from planner.onnx_import import load_model
    from runtime.engines.factory import make_engine
    from runtime.engines.stage import stage_spec
    from runtime.heap import release_free_heap
    from runtime.procfs import rss_bytes
    from runtime.profiling.compute import _stage_inputs
    from runtime.profiling.inputs import synthetic_feeds

    args = argv if argv is not None else sys.argv[1:]
    model, first, last = Path(args[0]), int(args[1]), int(args[2])

    def rss() -> float:
        gc.collect()
        release_free_heap()
        return rss_bytes() / M

    graph = adapted(load_model(model, 1, 128),
                    LoraSettings(8, 16.0, targets=("q", "k", "v", "o"), train_also=(), seed=0, base_dtype="int4"))
    spec = stage_spec(graph, first, last)
    stage_feeds, grad = _stage_inputs(spec, synthetic_feeds(graph, 0))
    loaded = rss()
    print(f"loaded: rss {loaded:.1f} MiB, hwm {_hwm_mib():.1f}", flush=True)
    engine = make_engine("mnn:cpu:t1", spec, activations="per-block", take_weights=True)
    engine.row_gradients = True
    built = rss()
    print(f"built: rss {built:.1f} (+{built - loaded:.1f} over loaded), hwm {_hwm_mib():.1f}", flush=True)
    for rnd in range(2):
        for phase, run in (("F", lambda mb: engine.forward(stage_feeds, mb)), ("B", lambda mb: engine.backward(mb, grad))):
            for mb in range(3):
                run(mb)
                now = rss()
                print(f"round {rnd} {phase}{mb}: rss {now:.1f} (+{now - built:.1f} over built), hwm {_hwm_mib():.1f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
