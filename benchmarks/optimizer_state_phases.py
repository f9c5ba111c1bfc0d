"""One whole-model stage under full fine-tuning (a hidden-256, 8-layer Llama with SmolLM2's tokenizer,
float32, 2 x 128 in 4 micro-batches; one device's 1f1b-flush order: 4 F, 4 backward_into, the update),
VmHWM by phase over three steps: AdamW's moments, made at the first update, live beside a backward only
from the second step on (benchmarks/MEMORY_NOTES.md, helper h42).

    python benchmarks/optimizer_state_phases.py torch:cpu:t1 keep
    python benchmarks/optimizer_state_phases.py mnn:cpu:t1 per-block
    python benchmarks/optimizer_state_phases.py mnn:cpu:t1 per-block --smollm2 9 23

`--smollm2 FIRST LAST`: blocks FIRST..LAST of SmolLM2-135M (float32, full fine-tuning) at 1 x 128 in 4
micro-batches, a middle stage's 1f1b-flush order with 2 in flight (F F B F B F B B; a random activation in
and gradient out, as `profile` feeds a stage), after the profile's own `peak_workspace` of the same stage
on a fresh engine in this process: what the planner's workspace line holds against what a run holds
(helper h43).
"""
import sys
from pathlib import Path
import os
_HERE = Path(__file__).resolve().parent
# the repository's packages, not benchmarks/planner.py; tests/ for support.lm_step_feeds
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE] + [str(_HERE.parent / "tests")]
from jobs.export.llm import LlmExportOptions, export_random_causal_lm, smollm2_gguf_path
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.procfs import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes
from support import lm_step_feeds

MIB = 2 ** 20
_SMOLLM2 = "--smollm2" in sys.argv  # then argv[3] is the flag, not a model path: no export
out = Path(sys.argv[3] if len(sys.argv) > 3 and not _SMOLLM2 else "/tmp/optimizer_state_phases/m.onnx")
out.parent.mkdir(parents=True, exist_ok=True)
if not _SMOLLM2 and not out.exists():
    export_random_causal_lm("llama", out, LlmExportOptions(), kv_cache=False, tokenizer_from=smollm2_gguf_path(),
                            hidden_size=256, intermediate_size=768, num_hidden_layers=8)
if _SMOLLM2:
    from benchmarks.llm import smollm2_model
    from ir.backend import parse_backend
    from runtime.profiling.compute import _stage_inputs, peak_workspace
    at = sys.argv.index("--smollm2")
    first, last = int(sys.argv[at + 1]), int(sys.argv[at + 2])
    graph = load_model(smollm2_model(), 1, 128)
    spec = stage_spec(graph, first, last)
    feeds = lm_step_feeds(0, rows=1, seq=128, microbatches=1, vocab=49152)[0]
    stage_feeds, grad = _stage_inputs(spec, feeds)
    release_free_heap()
    print(f"rss after load {rss_bytes() / MIB:.1f} MiB, VmHWM {peak_rss_bytes() / MIB:.1f}")
    ws = peak_workspace(parse_backend(sys.argv[1]), spec, feeds, activations=sys.argv[2], in_flight=1)
    print(f"profile peak_workspace (in flight 1): {ws / MIB:.1f} MiB")
    release_free_heap()
    base = rss_bytes()
    engine = make_engine(sys.argv[1], spec, activations=sys.argv[2], take_weights="--take-weights" in sys.argv)
    trainable = sum(p.nbytes for p in engine.parameters().values())
    release_free_heap()
    print(f"engine built: +{(rss_bytes() - base) / MIB:.1f} MiB (trainable {trainable / MIB:.1f})")
    opt = make_optimizer("adamw", 1e-4)
    order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    for step in range(3):
        total = {}
        for kind, m in order:
            reset_peak_rss()
            if kind == "F":
                engine.forward(stage_feeds, m)
            else:
                engine.backward_into(m, total, grad)
            print(f"step {step} {kind}{m}: rss {(rss_bytes() - base) / MIB:7.1f}  peak {(peak_rss_bytes() - base) / MIB:7.1f}"
                  f"  (above the pre-engine level)")
        reset_peak_rss()
        engine.step(opt, total)
        print(f"step {step} update: rss {(rss_bytes() - base) / MIB:7.1f}  peak {(peak_rss_bytes() - base) / MIB:7.1f}")
        del total
        print(f"step {step} sum freed: rss {(rss_bytes() - base) / MIB:7.1f}")
    sys.exit(0)
B, S = 2, 128
graph = load_model(out, B, S)
spec = stage_spec(graph, 0, len(graph.blocks) - 1)
engine = make_engine(sys.argv[1], spec, activations=sys.argv[2], take_weights=True)
params = sum(p.nbytes for p in engine.parameters().values())
print(f"trainable {params / MIB:.1f} MiB")
opt = make_optimizer("adamw", 1e-4)
vocab = 49152  # SmolLM2's tokenizer

def phase(name, fn):
    release_free_heap(); reset_peak_rss(); before = rss_bytes()
    fn()
    print(f"{name:18s} rss before {before / MIB:8.1f}  VmHWM {peak_rss_bytes() / MIB:8.1f}  after {rss_bytes() / MIB:8.1f}")

for step in range(3):
    feeds = lm_step_feeds(step, rows=B, seq=S, microbatches=4, vocab=vocab)
    total = {}
    phase(f"step {step} forwards", lambda: [engine.forward(f, m) for m, f in enumerate(feeds)])
    phase(f"step {step} backwards", lambda: [engine.backward_into(m, total) for m in range(4)])
    phase(f"step {step} update", lambda: engine.step(opt, total))
