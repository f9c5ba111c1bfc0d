"""One whole-model stage under full fine-tuning (a hidden-256, 8-layer Llama with SmolLM2's tokenizer,
float32, 2 x 128 in 4 micro-batches; one device's 1f1b-flush order: 4 F, 4 backward_into, the update),
VmHWM by phase over three steps: AdamW's moments, made at the first update, live beside a backward only
from the second step on (benchmarks/MEMORY_NOTES.md, helper h42).

    python benchmarks/optimizer_state_phases.py torch:cpu:t1 keep
    python benchmarks/optimizer_state_phases.py mnn:cpu:t1 per-block
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
out = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/optimizer_state_phases/m.onnx")
out.parent.mkdir(parents=True, exist_ok=True)
if not out.exists():
    export_random_causal_lm("llama", out, LlmExportOptions(), kv_cache=False, tokenizer_from=smollm2_gguf_path(),
                            hidden_size=256, intermediate_size=768, num_hidden_layers=8)
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
    del total
