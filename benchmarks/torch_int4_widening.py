"""Issue 31 target 6 on the PyTorch engine, side by side in one process (helper h45).

SmolLM2-135M LoRA r=8 (benchmarks/per_block_cost.py's shape: 4 x 1 x 128, AdamW, one thread), per block,
two engines: a float32 base and an int4 base. The int4 engine's steps alternate between the widening as it
was before h45 (the nibbles stacked as bytes then cast; each product's backward widening once more) and
today's, so each round gives float32, int4 before and int4 after within seconds of each other: CPU seconds
a step, which the machine's load disturbs less than a child per mode does. The int4 steps continue one
training run (before and after compute the same values: its losses follow the float32 engine's).

    python benchmarks/torch_int4_widening.py        (ROUNDS=4 in the environment: rounds, default 3)
"""
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from benchmarks.common import engine_step  # noqa: E402
from benchmarks.llm import smollm2_model
from benchmarks.lora import _lm_feeds, _lm_lora
from benchmarks.memory import LM_BATCH, LM_SEQ, M
from jobs.common.lora import adapted
from planner.onnx_import import load_model
from runtime.engines.factory import make_engine
from runtime.engines.stage import stage_spec
from runtime.optim import make_optimizer
from runtime.engines import pytorch as P

def old_widen(self):
    """`_FrozenWeight.widen` before h45."""
    q, c = self.q, self._codes
    if q.storage == "bfloat16":
        stored = c.view(torch.bfloat16).to(self.dtype)
    else:
        if q.storage == "int4":
            c = torch.stack((c & 0x0F, c >> 4), dim=-1)
        rows = c.shape[0]
        stored = (c.reshape(rows, -1, q.block).to(self.dtype) * self._scales.to(self.dtype)[:, :, None])
        if self._mins is not None:
            stored += self._mins.to(self.dtype)[:, :, None]
        stored = stored.reshape(rows, -1)[:, :q.cols]
    return stored if q.axis == 1 else stored.t()

class OldMM(torch.autograd.Function):
    """`_FrozenQuantizedMatMul` before h45: the backward widens again, also per block."""
    @staticmethod
    def forward(ctx, x, weight, transposed, keep_widened=False):
        ctx.weight, ctx.transposed = weight, transposed
        w = weight.widen()
        return torch.matmul(x, w.t() if transposed else w)
    @staticmethod
    def backward(ctx, grad_y):
        w = ctx.weight.widen()
        return torch.matmul(grad_y, w if ctx.transposed else w.t()), None, None, None

NEW_WIDEN, NEW_MM = P._FrozenWeight.widen, P._FrozenQuantizedMatMul
torch.set_num_threads(1)
model = smollm2_model()
feeds = _lm_feeds(model)
engines = {}
for dtype in ("float32", "int4"):
    settings = dataclasses.replace(_lm_lora(8), base_dtype=dtype)
    graph = adapted(load_model(model, LM_BATCH // M, LM_SEQ, loss="causal-lm"), settings)
    engines[dtype] = (make_engine("torch:cpu:t1", stage_spec(graph, 0, len(graph.blocks) - 1), activations="per-block"),
                      make_optimizer("adamw", 1e-4))
variants = {"float32": ("float32", None), "int4-before": ("int4", "old"), "int4-after": ("int4", "new")}
def setv(v):
    if v == "old":
        P._FrozenWeight.widen, P._FrozenQuantizedMatMul = old_widen, OldMM
    else:
        P._FrozenWeight.widen, P._FrozenQuantizedMatMul = NEW_WIDEN, NEW_MM
for name, (d, v) in variants.items():
    setv(v); engine_step(engines[d][0], feeds, engines[d][1])
cpu = {k: [] for k in variants}; losses = {k: [] for k in variants}
rounds = int(os.environ.get("ROUNDS", 3))
for r in range(rounds):
    for name, (d, v) in variants.items():
        setv(v)
        c0 = time.process_time()
        losses[name].append(engine_step(engines[d][0], feeds, engines[d][1]))
        cpu[name].append(time.process_time() - c0)
        print(r, name, f"{cpu[name][-1]:.3f}", f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
print(json.dumps({"cpu": cpu, "losses": losses}))
