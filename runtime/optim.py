"""Optimizers on numpy arrays, so every engine updates its parameters identically.

Semantics follow PyTorch's `torch.optim.SGD` (momentum, dampening 0, L2 weight decay added to the
gradient) and `torch.optim.AdamW` (decoupled weight decay, bias correction), the reference the
tests compare against. State is plain arrays, so checkpoints need no pickle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np


@dataclass
class SGD:
    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.steps += 1
        out = {}
        for name, p in params.items():
            g = grads[name].astype(np.float32, copy=False)
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                buf = self.buffers.get(name)
                buf = g.copy() if buf is None else self.momentum * buf + g
                self.buffers[name] = buf
                g = buf
            out[name] = (p - self.lr * g).astype(np.float32)
        return out

    def state(self) -> dict[str, np.ndarray]:
        return {f"momentum/{k}": v for k, v in self.buffers.items()} | {"steps": np.array(self.steps)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.buffers = {k.split("/", 1)[1]: np.array(v) for k, v in state.items() if k.startswith("momentum/")}
        self.steps = int(state.get("steps", 0))


@dataclass
class AdamW:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.steps += 1
        b1, b2 = self.betas
        c1 = 1 - b1 ** self.steps
        c2 = 1 - b2 ** self.steps
        out = {}
        for name, p in params.items():
            g = grads[name].astype(np.float32, copy=False)
            m = self.m.get(name)
            v = self.v.get(name)
            m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
            v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
            self.m[name], self.v[name] = m, v
            decayed = p * (1 - self.lr * self.weight_decay)
            denom = np.sqrt(v) / np.sqrt(c2) + self.eps
            out[name] = (decayed - (self.lr / c1) * m / denom).astype(np.float32)
        return out

    def state(self) -> dict[str, np.ndarray]:
        return ({f"m/{k}": x for k, x in self.m.items()} | {f"v/{k}": x for k, x in self.v.items()}
                | {"steps": np.array(self.steps)})

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.m = {k[2:]: np.array(x) for k, x in state.items() if k.startswith("m/")}
        self.v = {k[2:]: np.array(x) for k, x in state.items() if k.startswith("v/")}
        self.steps = int(state.get("steps", 0))


def make_optimizer(name: str, lr: float, weight_decay: float | None = None):
    if name == "sgd":
        return SGD(lr=lr, weight_decay=0.0 if weight_decay is None else weight_decay)
    if name == "adamw":
        return AdamW(lr=lr, weight_decay=0.01 if weight_decay is None else weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose sgd or adamw")
