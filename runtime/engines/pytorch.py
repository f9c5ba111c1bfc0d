"""PyTorch stage engine (optional extra): interprets the IR with torch ops and autograd.

It is the laptop/GPU engine of later issues and, in float64, the independent gradient oracle the
MNN engine is tested against. Importing this module requires torch; the runtime never does unless
this engine is chosen.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ir.graph import Node
from runtime.engines.base import StageEngine, StageGradients
from runtime.engines.stage import StageSpec, host_values


def _run_node(node: Node, args: list[torch.Tensor]) -> torch.Tensor:
    op, a = node.op, node.attrs
    if op == "Gather":
        return F.embedding(args[1].long(), args[0])
    if op == "MatMul":
        b = args[1].transpose(-1, -2) if a.get("trans_b") else args[1]
        return torch.matmul(args[0], b)
    if op == "Add":
        return args[0] + args[1]
    if op == "Sub":
        return args[0] - args[1]
    if op == "Mul":
        return args[0] * args[1]
    if op == "Div":
        return args[0] / args[1]
    if op == "Pow":
        return args[0] ** a["exponent"]
    if op == "Sqrt":
        return torch.sqrt(args[0])
    if op == "Erf":
        return torch.erf(args[0])
    if op == "Tanh":
        return torch.tanh(args[0])
    if op == "ReduceMean":
        return args[0].mean(dim=tuple(a["axes"]), keepdim=bool(a.get("keepdims", True)))
    if op == "Softmax":
        return torch.softmax(args[0], dim=a["axis"])
    if op == "LayerNorm":
        return F.layer_norm(args[0], (args[0].shape[-1],), args[1], args[2], a["epsilon"])
    if op == "Gelu":
        return F.gelu(args[0], approximate=a.get("approximate", "none"))
    if op == "Transpose":
        return args[0].permute(*a["perm"])
    if op == "Reshape":
        return args[0].reshape(*a["shape"])
    if op == "SoftmaxCrossEntropy":
        return -(args[1] * torch.log_softmax(args[0], dim=-1)).sum()
    raise NotImplementedError(f"torch engine: op {op} (node {node.name!r})")


class TorchStageEngine(StageEngine):
    def __init__(self, spec: StageSpec, dtype: torch.dtype = torch.float32, threads: int | None = None,
                 weights: Mapping[str, np.ndarray] | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.dtype = dtype
        source = weights if weights is not None else spec.graph.constants
        self._params = {p: torch.tensor(np.asarray(source[p]), dtype=dtype, requires_grad=True) for p in spec.params}
        param_set = set(spec.params)
        self._consts = {}
        for n in spec.compute_nodes:
            for i in n.inputs:
                if i in spec.graph.constants and i not in param_set:
                    v = spec.graph.constants[i]
                    self._consts[i] = torch.tensor(v, dtype=dtype if v.dtype.kind == "f" else torch.int64)
        self._saved: dict[int, tuple] = {}

    def _tensor(self, v: np.ndarray) -> torch.Tensor:
        v = np.asarray(v)
        return torch.tensor(v, dtype=self.dtype if v.dtype.kind == "f" else torch.int64)

    def forward(self, feeds, microbatch: int = 0, train: bool = True, until_block: int | None = None) -> np.ndarray:
        env: dict[str, torch.Tensor] = {k: self._tensor(v) for k, v in host_values(self.spec, feeds).items()}
        x_in = None
        if self.spec.activation_input is not None:
            x_in = self._tensor(feeds[self.spec.activation_input]).requires_grad_(train)
            env[self.spec.activation_input] = x_in
        env.update(self._params)
        env.update(self._consts)
        stop_after = set()
        if until_block is not None:
            stop_after = {n for b in self.spec.graph.blocks[until_block + 1:] for n in b.nodes}
        with torch.set_grad_enabled(train):
            for node in self.spec.compute_nodes:
                if node.name in stop_after:
                    break
                env[node.outputs[0]] = _run_node(node, [env[i] for i in node.inputs])
        out = env[self.spec.output if until_block is None else self.spec.graph.blocks[until_block].output]
        if train:
            self._saved[microbatch] = (x_in, out, dict(self._params))
        return out.detach().cpu().numpy().astype(np.float32 if self.dtype == torch.float32 else np.float64)

    def backward(self, microbatch: int, grad_output=None) -> StageGradients:
        if microbatch not in self._saved:
            raise KeyError(f"backward of micro-batch {microbatch} before its forward")
        x_in, out, used = self._saved.pop(microbatch)
        seed = torch.ones_like(out) if grad_output is None else self._tensor(grad_output)
        wrt = list(used.values()) + ([x_in] if x_in is not None else [])
        grads = torch.autograd.grad([out], wrt, [seed], allow_unused=True)
        params = {}
        for (name, p), g in zip(used.items(), grads):
            params[name] = (torch.zeros_like(p) if g is None else g).detach().numpy().copy()
        dx = grads[-1].detach().numpy().copy() if x_in is not None else None
        return StageGradients(params, dx)

    def parameters(self):
        return {k: v.detach().numpy().copy() for k, v in self._params.items()}

    def set_parameters(self, values):
        # New leaf tensors rather than in-place copies: a forward still waiting for its backward
        # keeps the tensors it ran with, which is weight stashing for free.
        for k, v in values.items():
            if k not in self._params:
                raise KeyError(f"parameter {k!r} is not in this stage")
            self._params[k] = torch.tensor(np.asarray(v), dtype=self.dtype, requires_grad=True)
