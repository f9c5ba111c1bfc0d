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
    """torch.optim.SGD semantics; updates the given arrays in place (they are the optimizer's own
    copies of the weights, so no allocation per step on 22M-parameter models)."""

    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.steps += 1
        for name, p in params.items():
            g = np.asarray(grads[name], np.float32)
            if self.weight_decay:
                g = g + np.float32(self.weight_decay) * p
            if self.momentum:
                buf = self.buffers.get(name)
                if buf is None:
                    buf = self.buffers[name] = np.array(g, np.float32)
                else:
                    buf *= np.float32(self.momentum)
                    buf += g
                g = buf
            p -= np.float32(self.lr) * g
        return params

    def state(self) -> dict[str, np.ndarray]:
        return {f"momentum/{k}": v for k, v in self.buffers.items()} | {"steps": np.array(self.steps)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.buffers = {k.split("/", 1)[1]: np.array(v) for k, v in state.items() if k.startswith("momentum/")}
        self.steps = int(state.get("steps", 0))


@dataclass
class AdamW:
    """torch.optim.AdamW semantics; updates the given arrays in place with one scratch buffer."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)
    steps: int = 0

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.steps += 1
        b1, b2 = self.betas
        c1 = 1 - b1 ** self.steps
        c2 = 1 - b2 ** self.steps
        f = np.float32
        for name, p in params.items():
            g = np.asarray(grads[name], np.float32)
            m = self.m.get(name)
            v = self.v.get(name)
            if m is None:
                m = self.m[name] = np.zeros_like(p)
                v = self.v[name] = np.zeros_like(p)
            tmp = np.multiply(g, f(1 - b1))
            m *= f(b1)
            m += tmp
            np.multiply(g, g, out=tmp)
            tmp *= f(1 - b2)
            v *= f(b2)
            v += tmp
            np.sqrt(v, out=tmp)
            tmp *= f(1 / np.sqrt(c2))
            tmp += f(self.eps)
            np.divide(m, tmp, out=tmp)
            tmp *= f(self.lr / c1)
            if self.weight_decay:
                p *= f(1 - self.lr * self.weight_decay)
            p -= tmp
        return params

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
