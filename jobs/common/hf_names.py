"""Which Hugging Face parameter each weight of a lowered model is, so trained weights can go back
into the transformers model (PEFT adapters, a fine-tuned checkpoint).

Exporters rename weights: the TorchScript exporter stores a Linear's weight transposed under a
name like `onnx::MatMul_317`, the dynamo exporter may prefix or fold names, and Confidant's own
exporter wraps the model (`inner.`). Names are therefore tried first (an IR name whose dotted suffix
is a state-dict key, with equal values), and every weight left is matched by value against the
state dict: as it is, or transposed for a 2-D weight stored [in, out]. Values come from the model
file as exported, before any training, so they match the transformers model it was exported from.
A weight that matches several parameters (two equal tensors) or none is reported, never guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ir.graph import Graph


@dataclass(frozen=True)
class HfName:
    """The transformers parameter a weight is: its state-dict key, and whether the IR stores it
    transposed (x @ W with W [in, out], where torch's Linear keeps [out, in])."""

    key: str
    transposed: bool

    @property
    def module(self) -> str:
        """The module the parameter belongs to (`...attention.self.query` for `...query.weight`)."""
        return self.key.rsplit(".", 1)[0]

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(value.T) if self.transposed else np.asarray(value)


ATOL = 1e-7  # a weight as exported equals its parameter up to float32 rounding


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.allclose(a, b, rtol=0, atol=ATOL)


def hf_names(graph: Graph, state_dict: Mapping[str, np.ndarray], names) -> dict[str, HfName]:
    """IR weight name -> its HfName, for each of `names` (float constants of `graph` as exported);
    ValueError names every weight that matches no parameter, or several."""
    out: dict[str, HfName] = {}
    taken: set[str] = set()
    left = []
    for name in names:
        value = np.asarray(graph.constants[name], np.float64)
        parts = name.split(".")
        hit = None
        for i in range(len(parts)):
            key = ".".join(parts[i:])
            if key in state_dict and key not in taken:
                ref = np.asarray(state_dict[key], np.float64)
                if _same(value, ref):
                    hit = HfName(key, False)
                elif value.ndim == 2 and _same(value.T, ref):
                    hit = HfName(key, True)
                if hit:
                    break
        if hit:
            out[name] = hit
            taken.add(hit.key)
        else:
            left.append(name)
    candidates = _Candidates({k: v for k, v in state_dict.items() if k not in taken})
    problems = []
    for name in left:
        value = np.asarray(graph.constants[name], np.float64)
        found = []
        for key, transposed in candidates.near(value):
            ref = np.asarray(state_dict[key], np.float64)
            if _same(value.T if transposed else value, ref):
                found.append(HfName(key, transposed))
        free = [f for f in found if f.key not in taken]
        if not free:  # a weight retrained or re-initialised since (a new head): the Linear of its bias
            free = [f for f in [_by_bias(graph, name, out, state_dict)] if f is not None and f.key not in taken]
        if len(free) == 1:
            out[name] = free[0]
            taken.add(free[0].key)
        else:
            problems.append(f"{name!r} matches {'no parameter' if not free else [f.key for f in free]}")
    if problems:
        raise ValueError("weights of the lowered model that cannot be placed in the transformers model: "
                         + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else "")
                         + " (is the base checkpoint the one the ONNX file was exported from?)")
    return out


# Elements of a weight compared before the whole of it: a value match is searched among every
# parameter of the same shape, and a deep model has hundreds (a 190-layer BERT: 760 square
# projections), so comparing whole arrays pair by pair made the export quadratic in depth (95 s of
# a 110 s export at 190 layers). Probes rule out almost every candidate at once; the survivors are
# compared whole, so the answer is the same.
PROBES = 16


def _probe_positions(shape: tuple[int, ...]) -> np.ndarray:
    size = int(np.prod(shape, dtype=np.int64))
    return np.unique(np.linspace(0, max(size - 1, 0), min(PROBES, max(size, 1))).astype(np.int64))


class _Candidates:
    """The float parameters of a state dict, grouped by shape with their values at a few fixed
    positions, so that the parameters a weight may equal (as it is, or transposed) are found with
    one vectorised comparison instead of one array comparison per parameter."""

    def __init__(self, state: Mapping[str, np.ndarray]):
        self._state = {k: np.asarray(v) for k, v in state.items() if np.asarray(v).dtype.kind == "f"}
        self._by_shape: dict[tuple[int, ...], list[str]] = {}
        for key, v in self._state.items():
            self._by_shape.setdefault(tuple(v.shape), []).append(key)
        self._probes: dict[tuple, tuple[list[str], np.ndarray]] = {}

    def _group(self, shape: tuple[int, ...], transposed: bool) -> tuple[list[str], np.ndarray]:
        """The parameters that, as they are or transposed, have `shape`, and their values at
        `shape`'s probe positions (read in that layout)."""
        cached = self._probes.get((shape, transposed))
        if cached is None:
            keys = self._by_shape.get(shape[::-1] if transposed else shape, [])
            at = _probe_positions(shape)
            rows = [np.asarray(self._state[k].T if transposed else self._state[k], np.float64).reshape(-1)[at]
                    for k in keys]
            cached = self._probes[(shape, transposed)] = (keys, np.array(rows).reshape(len(keys), at.size))
        return cached

    def near(self, value: np.ndarray) -> list[tuple[str, bool]]:
        """(key, transposed) of each parameter whose probed values are within `_same`'s tolerance of
        `value`'s: a superset of the parameters `_same` accepts."""
        shape = tuple(value.shape)
        probe = value.reshape(-1)[_probe_positions(shape)]
        out, seen = [], set()  # a symmetric weight equals its parameter both ways: taken as it is
        for transposed in ((False, True) if value.ndim == 2 else (False,)):
            keys, rows = self._group(shape, transposed)
            if keys:
                with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are close, as in allclose
                    close = np.all((np.abs(rows - probe) <= ATOL) | (rows == probe), axis=1)
                out.extend((keys[i], transposed) for i in np.flatnonzero(close) if keys[i] not in seen)
                seen.update(keys[i] for i in np.flatnonzero(close))
        return out


def _by_bias(graph: Graph, weight: str, named: Mapping[str, HfName], state_dict) -> HfName | None:
    """The `M.weight` of a Linear `M` whose bias is already placed: `weight` feeds a MatMul whose
    result the bias `M.bias` is added to."""
    consumers = graph.consumers()
    for mm in (n for n in graph.nodes if n.op == "MatMul" and n.inputs[1] == weight):
        value = mm.outputs[0]
        for _ in range(3):  # through a LoRA adapter's Add, if any
            adds = [n for n in consumers.get(value, []) if n.op == "Add"]
            if len(adds) != 1:
                break
            bias = next((i for i in adds[0].inputs if i in named and named[i].key.endswith(".bias")), None)
            if bias is not None:
                key = named[bias].module + ".weight"
                ref = state_dict.get(key)
                w = graph.constants[weight]
                transposed = not bool(mm.attrs.get("trans_b"))
                if ref is not None and (w.T if transposed else w).shape == np.asarray(ref).shape:
                    return HfName(key, transposed)
                return None
            value = adds[0].outputs[0]
    return None
