"""MNN stage engine: runs a contiguous block range of the IR forward and backward on MNN.

Each block becomes its own MNN graph (placeholders in, one output), built once and re-fed with
`write` for every micro-batch: rebuilding costs ~190 ms a time, and one graph spanning several
layers makes MNN's cache checks explode (MNN_NOTES.md). Embedding lookups run in numpy because
MNN's Gather has no gradient; their tables live only in numpy and receive their gradient by
`np.add.at`.

MNN's backward re-runs the forward. A stage therefore stashes only each block's input per
micro-batch in flight; when a block's backward follows its own forward with no other micro-batch
in between (single-device training, the last pipeline stage), per-op caches let the gradient
program reuse the forward's activations instead (`cache_activations`, on by default: faster, at the
memory of one cached tensor per op); otherwise the block's forward is re-run from the stashed
input. The profile and the memory accounting of the planner must count both. With `cache_slots`
above 1 (or None: as many as micro-batches in flight) the engine builds one set of block graphs per
slot, all reading the same weight Vars, and runs each micro-batch in flight on a slot of its own, so
every backward finds its forward's caches (the planner's `activations: keep`). With `per_block`
(the planner's `activations: per-block`) no op caches anything and each block lets go of what MNN
holds for it (its output, its intermediates, its gradient program's buffers) right after its
forward and again after its backward (`_BlockProgram.release`): the stage then holds the stashed
block inputs and one block's buffers at a time, and every block's backward re-runs its forward
(SmolLM2 LoRA at 1 x 128: 89 MiB above the weights without the releases, 22 with them, against
~330 MiB of per-op caches). Such a stage whose frozen float32 weights lie on a mapping of the model file
(the graph loaded `mapped`) reads them a block at a time instead of holding them (`_FrozenStream`).

The causal-LM loss (``TokenCrossEntropy``) runs in numpy (`runtime.engines.lm_loss`), never as an
MNN graph, whose softmax, caches and gradient seed would each hold a vocabulary-sized copy: with
the LM head on the same stage, the head's projection is fused into it (the head's MNN graph ends
at the hidden state, and the vocabulary weight lives in numpy like an embedding table; a tied one
is the embedding table itself), so the logits are never materialised; alone on a stage, it
computes its gradient in place over the received logits.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from ir.graph import Block, Node
from ir.mapped_pages import drop_pages_under, gather_rows, mapping_of
from ir.precision import QuantizedTensor
from runtime.engines import fpmode, lm_loss
from runtime.engines import mnn_kernels as K
from runtime.engines.base import (RowGradient, StageEngine, StageGradients, accumulate, add_gradient, own_array,
                                  rows_at)
from runtime.engines.stage import FusedLmHead, StageSpec, fused_lm_head, host_values, looked_up_only
from runtime.procfs import release_free_heap


# The ops whose results the per-op caches keep for the backward. MatMul and Softmax keep ~98% of the
# speed-up of caching every op at about half the memory (benchmarks/engine.py); elementwise results
# are cheap to redo from them, except erf (with exact GELU's erf term): MNN's erf costs 8-10x its
# tanh or exp, and caching it takes one layer's GELU forward+backward from 38 to 26 ms (batch 8 x
# 128, feed-forward 1536, one thread; benchmarks/mnn_ops.py) for one more [rows, 4H] tensor.
CACHED_OPS = ("MatMul", "Softmax", "Erf")

# Host-value key prefix under which a forward keeps the rows its embedding lookups read (per node).
GATHERED = "\0gathered:"


def _constant_var(value) -> tuple["K.Var", dict]:
    """The Var of a graph constant, and the constant Vars it reads by QuantizedTensor field: a frozen
    weight held int8 / int4 (`ir.precision`) stays so in MNN and is widened inside each graph that
    reads it (`mnn_kernels.widened_weight_parts`); bfloat16, which MNN cannot hold, and every other
    constant become float32 constants."""
    if isinstance(value, QuantizedTensor) and value.storage in ("int8", "int4"):
        return K.widened_weight_parts(value)
    return K.constant(np.asarray(value, np.float32)), {}


def _frozen_table(value):
    """A frozen table held in numpy (a lookup's, a fused LM head's): a quantized one as it is
    (lookups widen the rows they gather, the loss a chunk of vocabulary rows at a time), any
    other as float32."""
    return value if isinstance(value, QuantizedTensor) else np.asarray(value, np.float32)


def _lower_node(node: Node, a: list) -> "K.Var":
    op, attrs = node.op, node.attrs
    if op == "MatMul":
        return K.matmul(a[0], a[1], bool(attrs.get("trans_b")))
    if op == "Add":
        return K.add(a[0], a[1])
    if op == "Sub":
        return K.sub(a[0], a[1])
    if op == "Mul":
        return K.mul(a[0], a[1])
    if op == "Div":
        return K.div(a[0], a[1])
    if op == "Pow":
        return K.pow_scalar(a[0], attrs["exponent"])
    if op == "Sqrt":
        return K.sqrt(a[0])
    if op == "Erf":
        return K.erf(a[0])
    if op == "Tanh":
        return K.tanh(a[0])
    if op == "Relu":
        return K.relu(a[0])
    if op == "ReduceMean":
        return K.reduce_mean(a[0], list(attrs["axes"]), bool(attrs.get("keepdims", True)))
    if op == "Softmax":
        return K.softmax(a[0], attrs["axis"])
    if op == "LayerNorm":
        return K.layer_norm(a[0], a[1], a[2], attrs["epsilon"])
    if op == "Gelu":
        return K.gelu(a[0], attrs.get("approximate", "none"))
    if op == "Transpose":
        return K.transpose(a[0], attrs["perm"])
    if op == "Reshape":
        return K.reshape(a[0], attrs["shape"])
    if op == "SoftmaxCrossEntropy":
        return K.softmax_cross_entropy(a[0], a[1])
    if op == "RMSNorm":
        return K.rms_norm(a[0], a[1], attrs["epsilon"], attrs.get("offset", 0.0))
    if op == "Sigmoid":
        return K.sigmoid(a[0])
    if op == "Silu":
        return K.silu(a[0])
    if op == "Rotary":
        return K.rotary(a[0], a[1], a[2])
    if op == "Expand":
        return K.expand(a[0], attrs["shape"])
    if op == "Slice":
        return K.slice_axis(a[0], attrs["axis"], attrs["start"], attrs["end"])
    if op == "Concat":
        return K.concat(a, attrs["axis"])
    raise NotImplementedError(f"MNN engine: op {op} (node {node.name!r}) has no lowering")


# Key prefix (in the engine's constant Vars) of an int4 weight's widened halves (`_int4_split`).
HALVES = "\0halves:"


def _int4_split(node: Node, graph, params) -> QuantizedTensor | None:
    """The int4 frozen weight a MatMul multiplies by, where `mnn_kernels.int4_matmul` can take it in
    halves (widened at half the cost of the whole weight); None otherwise."""
    if node.op != "MatMul" or node.inputs[1] in params:
        return None
    q = graph.constants.get(node.inputs[1])
    if isinstance(q, QuantizedTensor) and K.int4_splits(q, bool(node.attrs.get("trans_b"))):
        return q
    return None


def _hold_once(constants, name: str, var: "K.Var", parts: Mapping[str, "K.Var"] | None = None,
               transposed: bool = False) -> None:
    """Give the graph, in place of the frozen float32 weight `name`, a read-only view of the constant
    Var just built from it: MNN's const copies, so without this the stage holds every frozen weight
    twice (the graph's array and the Var; +466 MiB on SmolLM2's LoRA), and replaced as each Var is
    built, the engine's setup holds one weight twice at a time, not all of them. The values are the
    same; the view keeps the Var alive, so the graph stays valid after the engine is gone. A mapping
    that cannot be written (a lazily read file) is left as it is. `transposed`: the parts are held
    transposed (`mnn_kernels.int4_halves_parts`), the graph's fields become transposed views of them."""
    arr = constants.get(name) if isinstance(constants, dict) else None
    if isinstance(arr, QuantizedTensor):
        # a quantized weight's parts that MNN holds as the same values: the graph keeps views of
        # them (int4's codes, the same bytes; the scales and int4's offsets, which MNN holds as
        # float32: widening reads them as float32 either way). int8's codes MNN holds offset by 128.
        held = {}
        for field, part in (parts or {}).items():
            if field == "codes" and arr.storage != "int4":
                continue
            mine = getattr(arr, field)
            view = K.frozen_view_of(part)
            if mine is not None and view.size == mine.size and (field != "codes" or view.dtype == mine.dtype):
                held[field] = K.transposed_view(view, mine.shape) if transposed else view.reshape(mine.shape)
        if held:
            constants[name] = replace(arr, **held)
        return
    if not (isinstance(arr, np.ndarray) and arr.dtype == np.float32):
        return
    view = K.frozen_view_of(var)
    if view.dtype == np.float32 and view.size == arr.size:
        constants[name] = view.reshape(arr.shape)


# Placeholder sets a streamed per-block stage spreads its blocks over (`_FrozenStream`): a write into a
# placeholder costs MNN a walk over every graph that reads it (in a SmolLM2 stage's steady state, 1.1 ms
# for a [1536, 576] weight read by 30 blocks' graphs, 0.25 ms into a fresh placeholder), so one set for
# all 30 layers held 302 MiB but cost 1.7-1.8x the step, 6 sets 369-383 MiB and 1.33-1.34x, 10 sets 424-437
# MiB and 1.30-1.32x (1.17-1.18x in another sitting), against the base held as constants (SmolLM2 LoRA r=8 per
# block, 4 x 128, one thread, whole-process peak 694 MiB with the base held; MEMORY_NOTES.md, helper h156).
# The planner charges it as `planner.cost.STREAM_SETS` (not imported here: the planner's modules
# cost a worker +5.3 MiB; tests/planner/test_streamed_frozen.py holds the two equal).
STREAM_SETS = 10


class _FrozenStream:
    """A per-block stage's frozen float32 weights read from a mapping of the model file, not held as
    constant Vars (MNN's const copies what it is given, and its Python binding cannot build a Var over
    memory it does not own: `Var.set_device_ptr` on a CPU placeholder crashed the process). Each block
    reads them through input placeholders shared with the other blocks of its set (block index modulo
    `sets`) that have the same weight shapes, written from the mapping just before the block runs (its
    forward, its backward's re-run) unless they hold its weights already, the mapping's pages of them
    given back at once: the stage holds `sets` blocks' frozen weights in MNN, not all of them.
    `holder`: per set, the block program whose weights its placeholders hold now."""

    def __init__(self, sets: int = STREAM_SETS):
        self.sets = int(sets)
        self._placeholders: dict[tuple, "K.Var"] = {}
        self.holder: dict[int, object] = {}

    @staticmethod
    def takes(value) -> bool:
        """Whether a frozen constant is streamed: a float32 weight lying on a read-only file mapping."""
        return (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim >= 2
                and mapping_of(value) is not None and not value.flags.writeable)

    def set_of(self, block_index: int) -> int:
        return block_index % self.sets

    def placeholder(self, block_index: int, position: int, shape: tuple[int, ...]) -> "K.Var":
        """The placeholder of the `position`-th streamed weight (of `shape`) of a block in its set."""
        key = (self.set_of(block_index), position, tuple(shape))
        if key not in self._placeholders:
            self._placeholders[key] = K.placeholder(shape)
        return self._placeholders[key]


@dataclass
class _Lookup:
    """An embedding lookup done in numpy: output placeholder fed with table[ids]."""

    node: Node
    table: str
    ids: str
    placeholder: "K.Var"


class _BlockProgram:
    """One block as an MNN graph plus its gradient program, both built once."""

    def __init__(self, block: Block, nodes: list[Node], spec: StageSpec, params: Mapping[str, "K.Var"],
                 tables: Mapping[str, np.ndarray], trainable_tables: set[str], constants: dict[str, "K.Var"],
                 stream: _FrozenStream | None = None):
        graph = spec.graph
        self.block = block
        self._stream = stream
        self.streamed: list[tuple["K.Var", np.ndarray]] = []  # (shared placeholder, mapped weight)
        self._set = stream.set_of(block.index) if stream is not None else None
        env: dict[str, K.Var] = {}
        self.lookups: list[_Lookup] = []
        self.activation: str | None = None
        self.host_inputs: list[str] = []
        produced = {o for n in nodes for o in n.outputs}
        for n in nodes:
            if n.op == "Gather":
                ph = K.placeholder(graph.values[n.outputs[0]].shape)
                self.lookups.append(_Lookup(n, n.inputs[0], n.inputs[1], ph))
                env[n.outputs[0]] = ph
        for name in block.inputs:
            if name in env:
                continue
            value = graph.values[name]
            if value.dtype != "float32" or any(name == lk.ids for lk in self.lookups):
                continue
            env[name] = K.placeholder(value.shape)
            if name == block.inputs[0] and block.index > 0:
                self.activation = name
            else:
                self.host_inputs.append(name)
        cached = []  # the intermediates whose results the backward reuses, in creation order
        for n in nodes:
            if n.op == "Gather":
                continue
            split = _int4_split(n, graph, params)
            if split is not None and n.inputs[0] in env:
                # an int4 frozen weight's product by its two widened halves (`mnn_kernels.int4_matmul`),
                # the halves built once for all the engine's graph sets, their constants held once
                key = HALVES + n.inputs[1]
                if key not in constants:
                    constants[key], parts = K.int4_halves_parts(split)
                    _hold_once(graph.constants, n.inputs[1], None, parts, transposed=True)
                env[n.outputs[0]] = K.int4_matmul(env[n.inputs[0]], constants[key], split, bool(n.attrs.get("trans_b")))
                cached.append(env[n.outputs[0]])
                continue
            args = []
            for i in n.inputs:
                if i not in env:
                    if i in params:
                        env[i] = params[i]
                    elif stream is not None and i in graph.constants and stream.takes(graph.constants[i]):
                        env[i] = stream.placeholder(block.index, len(self.streamed), graph.constants[i].shape)
                        self.streamed.append((env[i], graph.constants[i]))
                    elif i in graph.constants:
                        # one Var per constant for all the engine's graph sets: a frozen weight
                        # (LoRA's base) is held once however many sets there are
                        if i not in constants:
                            constants[i], parts = _constant_var(graph.constants[i])
                            _hold_once(graph.constants, i, constants[i], parts)
                        env[i] = constants[i]
                    elif i not in produced:
                        raise KeyError(f"block {block.name!r}: node {n.name!r} reads {i!r}, which is not available")
                args.append(env[i])
            if n.op == "Gelu" and n.attrs.get("approximate", "none") == "none":
                env[n.outputs[0]], erf = K.erf_gelu(args[0])
                cached.append(erf)
            else:
                env[n.outputs[0]] = _lower_node(n, args)
                if n.op in CACHED_OPS:
                    cached.append(env[n.outputs[0]])
        self.output = env[block.output]
        self.output_shape = tuple(graph.values[block.output].shape)
        self.inputs = env
        self.params = [p for p in block.params if p in params]
        self._param_vars = [params[p] for p in self.params]
        self.grad_seed = K.placeholder(self.output_shape)
        # a frozen table (LoRA's base embeddings) gets no gradient: its lookup is not differentiated
        self.trained_lookups = [lk for lk in self.lookups if lk.table in trainable_tables]
        self._rows_kept = {lk.node.name for lk in self.trained_lookups}  # `feed`: a stepped table's rows only
        wrt = (self._param_vars + ([env[self.activation]] if self.activation else [])
               + [lk.placeholder for lk in self.trained_lookups])
        self._grads = K.GradientProgram().build([self.output], [self.grad_seed], wrt)
        # the projections whose weight gradient a split backward leaves to W: a MatMul by a trainable
        # 2-D weight that nothing else in the block reads
        readers: dict[str, int] = {}
        for n in nodes:
            for i in n.inputs:
                readers[i] = readers.get(i, 0) + 1
        self.projections = [_Projection(n.inputs[1], env[n.inputs[0]], env[n.outputs[0]], bool(n.attrs.get("trans_b")))
                            for n in nodes if n.op == "MatMul" and n.inputs[1] in self.params
                            and len(graph.values[n.inputs[1]].shape) == 2 and readers[n.inputs[1]] == 1]
        self._split_grads: K.GradientProgram | None = None  # built at the first split backward
        self._tables = tables
        self._intermediates = cached
        self.fed_serial: int | None = None
        self._caching = False

    keeps_caches = False  # a per-block stage's block that keeps its per-op caches (`cached_programs`)

    def enable_op_caches(self) -> None:
        """Read every intermediate once, in creation order, so each op keeps its own result.

        MNN's `read()` caches only the Var read; without this the gradient program re-runs the
        whole forward from the inputs. With per-op caches, a later input write marks them stale,
        the forward's output read refreshes them all, and the backward reuses them (MNN_NOTES.md;
        one MiniLM layer at batch 8 x 128: backward 0.23 s -> 0.16 s, identical gradients). The
        price is one cached tensor per cached op. Priming must happen on the block's first
        evaluation of any kind: priming after an inference forward leaves the caches unused.
        """
        if not self._caching:
            for v in self._intermediates:
                K.read(v)
            self._caching = True

    def release(self) -> None:
        """Let go of what MNN holds for this block's last evaluation (its output and intermediates,
        its gradient program's buffers) by shrinking one of its input placeholders (`K.shrink`); the
        next `feed` writes every input anew. What recomputing per block frees after each block's
        forward and backward, so a stage holds one block's buffers at a time, not all of them."""
        held = self.inputs[self.activation] if self.activation else (self.lookups[0].placeholder if self.lookups
                                                                   else None)
        if held is not None:
            K.shrink(held)
        self.fed_serial = None

    def load_frozen(self) -> None:
        """Write this block's streamed frozen weights into the shared placeholders (`_FrozenStream`),
        unless they hold them already, and give back the mapping's pages they were read from."""
        if not self.streamed or self._stream.holder.get(self._set) is self:
            return
        for var, weight in self.streamed:
            # each weight's pages given back once written: a fault maps up to `FAULT_SPAN_BYTES` of the file,
            # and a SmolLM2 layer's 13.5 MiB read whole before one give-back set stage 1's peak at 18 MiB
            # of file pages (helper h172)
            K.write(var, weight)
            drop_pages_under([weight])
        # and once more all of them: a later weight's fault maps pages around it, an earlier weight's among them
        drop_pages_under([weight for _, weight in self.streamed])
        self._stream.holder[self._set] = self

    def feed(self, activation: np.ndarray | None, host: Mapping[str, np.ndarray], serial: int | None = None) -> None:
        """Write a forward's inputs; `serial` identifies that forward (None: never reuse)."""
        self.load_frozen()  # every use: another block may have written the shared placeholders since
        if serial is not None and serial == self.fed_serial:
            return  # the graph still holds this forward's inputs (and, with op caches, its activations)
        self.fed_serial = serial
        if self.activation is not None:
            K.write(self.inputs[self.activation], activation)
        for name in self.host_inputs:
            K.write(self.inputs[name], host[name])
        for lk in self.lookups:
            key = GATHERED + lk.node.name
            rows = host.get(key)
            if rows is None:
                ids = np.asarray(host[lk.ids])
                table = self._tables[lk.table]
                if ids.size and (ids.min() < 0 or ids.max() >= len(table)):
                    raise ValueError(f"{lk.ids} holds id {int(ids.max() if ids.max() >= len(table) else ids.min())}, "
                                     f"outside the {len(table)} rows of {lk.table!r}: the tokenizer does not belong "
                                     f"to this model")
                if isinstance(table, QuantizedTensor):
                    rows = table.widen_rows(ids)
                elif self._stream is not None:
                    # a mapped frozen table, a file span at a time and its pages given back after each: read
                    # at once, 128 ids faulted 44-52 MiB of SmolLM2's table in and set stage 0's peak (h172)
                    rows = gather_rows(table, ids)
                else:
                    rows = table[ids]
                if isinstance(host, dict) and lk.node.name in self._rows_kept:
                    # kept with the micro-batch's host values: a backward that re-runs this forward
                    # feeds the very rows its forward read, so the table itself needs no old version.
                    # A frozen table's (LoRA's base) never changes: a re-run gathers its rows again, and
                    # no micro-batch in flight holds a copy of them beside the block inputs the planner
                    # charges (Llama-3.2-1B-class, 128 x 2048 float32: 1 MiB a micro-batch, 4 MiB on a
                    # first stage of four; benchmarks/MEMORY_NOTES.md, helper h112)
                    host[key] = rows
            K.write(lk.placeholder, rows)

    def forward(self, train: bool = False) -> np.ndarray:
        return K.read(self.output)

    def backward(self, grad_output: np.ndarray | None, host: Mapping[str, np.ndarray], rows: bool = False):
        seed = np.ones(self.output_shape, np.float32) if grad_output is None else grad_output
        K.write(self.grad_seed, seed)
        grads = self._grads.run()
        k = len(self._param_vars)
        param_grads = dict(zip(self.params, grads[:k]))
        rest = grads[k:]
        dx = None
        if self.activation:
            dx, rest = rest[0], rest[1:]
        self._scatter_lookups(param_grads, rest, host, rows)
        return param_grads, dx

    def _scatter_lookups(self, param_grads: dict, grads, host: Mapping[str, np.ndarray], rows: bool = False) -> None:
        """The lookups' gradients into their tables' (`rows`: as RowGradients, see base.RowGradient)."""
        for lk, g in zip(self.trained_lookups, grads):
            ids = np.asarray(host[lk.ids]).reshape(-1)
            if rows:
                part = RowGradient(ids, g.reshape(ids.size, -1), tuple(self._tables[lk.table].shape))
                old = param_grads.get(lk.table)
                param_grads[lk.table] = part if old is None else add_gradient(old, part)
                continue
            table_grad = param_grads.get(lk.table)
            if table_grad is None:
                table_grad = np.zeros_like(self._tables[lk.table])
                param_grads[lk.table] = table_grad
            np.add.at(table_grad, ids, g.reshape(ids.size, -1))

    def backward_input(self, grad_output: np.ndarray | None, host: Mapping[str, np.ndarray], rows: bool = False):
        """B of a split backward: one gradient program that stops at the projections' outputs (MNN
        prunes what no requested gradient reads: the projections' weight gradients), giving every
        other gradient now and, per projection, the input and output gradient its W multiplies
        in numpy (one MiniLM layer, 2 x 128, one thread: forward + B + W 51.9 ms, forward + the
        whole backward 49.5 ms, so the plain backward keeps MNN's own program)."""
        deferred = {pr.weight for pr in self.projections}
        now = [p for p in self.params if p not in deferred]
        if self._split_grads is None:
            by_name = dict(zip(self.params, self._param_vars))
            wrt = ([by_name[p] for p in now] + ([self.inputs[self.activation]] if self.activation else [])
                   + [lk.placeholder for lk in self.trained_lookups] + [pr.y for pr in self.projections])
            self._split_grads = K.GradientProgram().build([self.output], [self.grad_seed], wrt)
        seed = np.ones(self.output_shape, np.float32) if grad_output is None else grad_output
        K.write(self.grad_seed, seed)
        grads = self._split_grads.run()
        param_grads = dict(zip(now, grads[:len(now)]))
        rest = grads[len(now):]
        dx = None
        if self.activation:
            dx, rest = rest[0], rest[1:]
        k = len(self.trained_lookups)
        self._scatter_lookups(param_grads, rest[:k], host, rows)
        pending = [_PendingWeightGrad(pr.weight, K.read(pr.x), gy, pr.transposed)
                   for pr, gy in zip(self.projections, rest[k:])]
        return param_grads, dx, pending


@dataclass(frozen=True)
class _Projection:
    """A MatMul by a trainable weight, as Vars of a block graph: its input and output."""

    weight: str
    x: "K.Var"
    y: "K.Var"
    transposed: bool


@dataclass(frozen=True)
class _PendingWeightGrad:
    """What W needs for one projection of one micro-batch: its input and its output's gradient."""

    weight: str
    x: np.ndarray
    grad_y: np.ndarray
    transposed: bool

    def gradient(self) -> np.ndarray:
        x = self.x.reshape(-1, self.x.shape[-1])
        gy = self.grad_y.reshape(-1, self.grad_y.shape[-1])
        return gy.T @ x if self.transposed else x.T @ gy


class _LossProgram:
    """The causal-LM loss block in numpy (module docstring): fused with the LM head's projection
    (`fused`: its input is the head's hidden state, the weight a numpy table) or over the logits it
    receives. Same interface as `_BlockProgram`. A training forward computes the gradients in the
    same pass and keeps them for the backward of that forward; any other backward recomputes."""

    def __init__(self, block: Block, loss: Node, fused: FusedLmHead | None, tables: Mapping[str, np.ndarray],
                 trainable: set[str], give_back: bool = False):
        self.block = block
        self._give_back = give_back  # a mapped frozen head weight's pages given back after each pass
        self.ids, self.weights = loss.inputs[1], loss.inputs[2]
        self.fused = fused
        self.kernel = lm_loss.LinearCrossEntropy(fused.transposed) if fused else None
        self._tables = tables
        self.weight_trained = fused is not None and fused.weight in trainable
        self.params = [fused.weight] if self.weight_trained else []
        self.fed_serial: int | None = None
        self._x: np.ndarray | None = None
        self._host: Mapping[str, np.ndarray] = {}
        self._saved: tuple[int | None, lm_loss.LinearCrossEntropyResult] | None = None

    keeps_caches = False

    def enable_op_caches(self) -> None:
        pass

    def release(self) -> None:
        pass  # numpy: nothing held beyond what the stage stashes

    def feed(self, activation: np.ndarray, host: Mapping[str, np.ndarray], serial: int | None = None) -> None:
        if serial is not None and serial == self.fed_serial:
            return
        self.fed_serial, self._x, self._host = serial, activation, host

    def _fused(self, grad: bool, weight_sum: np.ndarray | None = None,
               weight_grad: bool = True) -> lm_loss.LinearCrossEntropyResult:
        """The fused pass; `weight_sum`: the weight's running gradient sum, its gradient added into it
        (and none returned); `weight_grad` False: no weight gradient (already in the sum)."""
        weight = self._tables[self.fused.weight]
        if isinstance(weight, QuantizedTensor):  # frozen: widened a chunk of vocabulary rows at a time
            return lm_loss.quantized_linear_cross_entropy(self._x, weight, self._host[self.ids],
                                                          self._host[self.weights], grad=grad)
        if not self.weight_trained:  # frozen float (LoRA's base): a chunk of vocabulary rows at a time, each
            # chunk's pages of a mapped table given back once read (the table resident a chunk at a time: h171)
            give_back = (lambda view: drop_pages_under([view])) if self._give_back else None
            return lm_loss.frozen_linear_cross_entropy(self._x, weight, self._host[self.ids], self._host[self.weights],
                                                       self.fused.transposed, grad=grad, after_chunk=give_back)
        trained = self.weight_trained and weight_grad
        try:
            return self.kernel(self._x, weight, self._host[self.ids], self._host[self.weights],
                               grad=grad, weight_grad=trained, weight_grad_into=weight_sum if trained else None)
        finally:
            if self._give_back:
                drop_pages_under([weight])

    def forward(self, train: bool = False, weight_sum: np.ndarray | None = None) -> np.ndarray:
        """The loss; a training forward computes the gradients in the same pass, the weight's added
        into `weight_sum` where given (`MnnStageEngine.forward_into`)."""
        if self.fused is None:
            loss = lm_loss.token_cross_entropy(self._x, self._host[self.ids], self._host[self.weights])
        else:
            result = self._fused(grad=train, weight_sum=weight_sum if train else None)
            self._saved = (self.fed_serial, result) if train and self.fed_serial is not None else None
            loss = result.loss
        return np.asarray(loss, np.float32)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.kernel.logits(hidden, self._tables[self.fused.weight]).astype(np.float32)

    def backward(self, grad_output: np.ndarray | None, host: Mapping[str, np.ndarray],
                 weight_sum: np.ndarray | None = None, summed: bool = False):
        """The hidden state's gradient and the weight's, unless its forward added that into the running
        sum already (`summed`) or a recomputed pass adds it into `weight_sum` (the sum, where given)."""
        scale = 1.0 if grad_output is None else float(np.asarray(grad_output).reshape(-1)[0])
        if self.fused is None:  # in place over the stashed logits: one copy
            return {}, lm_loss.token_cross_entropy_grad(self._x, host[self.ids], host[self.weights], scale)
        if summed and scale != 1.0:
            raise ValueError(f"a backward seeded with {scale} after its forward added the LM head's weight "
                             f"gradient into the running sum (seeded with 1)")
        saved, self._saved = self._saved, None
        if saved is not None and saved[0] == self.fed_serial:
            result = saved[1]
        else:  # recomputed: into the sum where there is one (unscaled), not at all where the forward summed it
            into = weight_sum if scale == 1.0 and not summed else None
            result = self._fused(grad=True, weight_sum=into, weight_grad=not summed)
            summed = summed or into is not None
        grads = {}
        if self.weight_trained and not summed:
            grads[self.fused.weight] = result.grad_weight if scale == 1.0 else result.grad_weight * np.float32(scale)
        dx = result.grad_hidden if scale == 1.0 else result.grad_hidden * np.float32(scale)
        return grads, dx


def cached_programs(programs: list, count: int, head_index: int | None = None) -> list:
    """The block programs of a per-block stage that keep their per-op caches: the last `count` MNN
    graphs that read an activation (an embedding's lookups and an LM head fused with its loss are
    never among them: the planner charges the layers' caches, `planner.cost.cached_block_indices`).
    The last ones, because in a stage whose backward follows its forward (one device, the last
    pipeline stage) their backwards come first."""
    graphs = [p for p in programs if isinstance(p, _BlockProgram) and p.activation is not None
              and p.block.index != head_index]
    return graphs[max(0, len(graphs) - count):] if count > 0 else []


class MnnStageEngine(StageEngine):
    """A stage on MNN. `stash_weights` keeps, for every micro-batch in flight, the weight version its
    forward used, and runs its backward on that version (PipeDream weight stashing): MNN Vars are
    updated in place, so without it a backward after an update would silently use the new weights.
    `cache_slots`: sets of block graphs (module docstring); 1 re-runs the forward in any backward
    that does not directly follow its own forward, None adds a set whenever every set is held.
    `per_block`: activations recomputed per block (module docstring; no per-op caches);
    `cached_blocks` with it: the stage's last that many layers keep their per-op caches (a hybrid:
    each saves its forward's re-run where a backward follows its forward, for its caches' memory).
    `stream_frozen` (per block, no cached blocks): frozen float32 weights on a file mapping are written
    into placeholders shared by the blocks of `stream_sets` sets before each use (`_FrozenStream`)."""

    def __init__(self, spec: StageSpec, threads: int = 1, weights: Mapping[str, np.ndarray] | None = None,
                 cache_activations: bool = True, stash_weights: bool = True, cache_slots: int | None = 1,
                 take_weights: bool = False, per_block: bool = False, cached_blocks: int = 0,
                 stream_frozen: bool = True, stream_sets: int = STREAM_SETS):
        if K.denormals_flushed_at_import():
            # before MNN (re)starts its worker threads, which inherit this thread's flush-to-zero bits;
            # another library may have cleared them since MNN was imported (creating an ONNX Runtime
            # session does), and denormals slow MNN's backward ~2.5x
            fpmode.enable_flush_denormals()
        K.set_threads(threads)
        self.spec = spec
        self.threads = threads
        # activations recomputed per block: no per-op caches, and each block lets go of what MNN
        # holds for it after its forward and after its backward (`_BlockProgram.release`)
        self.per_block = bool(per_block)
        cache_activations = cache_activations and not self.per_block
        if cached_blocks < 0 or (cached_blocks and not self.per_block):
            raise ValueError(f"cached_blocks is {cached_blocks!r}: a count >= 0 of the blocks a per-block stage "
                             f"keeps the per-op caches of")
        # a hybrid: the last `cached_blocks` blocks of a per-block stage keep their per-op caches (as
        # the default mode does), so their backward skips the re-run of their forward where it follows
        # its own forward; the rest recompute per block
        self.cached_blocks = int(cached_blocks)
        # a per-block stage (no block keeping caches) whose frozen float32 weights lie on a mapping of
        # the model file (LoRA's base, the graph loaded `mapped`) reads them a block at a time
        # (`_FrozenStream`) instead of holding them all as constant Vars; `stream_frozen` False holds them
        self._stream = (_FrozenStream(stream_sets) if stream_frozen and self.per_block and not self.cached_blocks
                        and any(_FrozenStream.takes(spec.graph.constants.get(i)) for n in spec.compute_nodes
                                for i in n.inputs if i not in spec.params) else None)
        source = weights if weights is not None else spec.graph.constants
        self._lm = fused_lm_head(spec.graph, spec.first_block, spec.last_block)
        # weights held in numpy: embedding tables (MNN's Gather has no gradient) and a fused LM
        # head's weight; one that an MNN graph reads as well (a tied head not fused) also gets a Var
        numpy_held = {n.inputs[0] for n in spec.compute_nodes if n.op == "Gather"}
        skipped = set()
        if self._lm is not None:
            numpy_held.add(self._lm.weight)
            skipped = {self._lm.matmul.name, self._lm.loss.name}
        mnn_read = {i for n in spec.compute_nodes if n.op not in ("Gather", "TokenCrossEntropy")
                    and n.name not in skipped for i in n.inputs}
        self._tables = {p: own_array(source[p], np.float32, take_weights) for p in spec.params if p in numpy_held}
        # frozen tables (not parameters): looked up like the others, never differentiated or stepped
        self._frozen_tables = {t: _frozen_table(spec.graph.constants[t]) for t in numpy_held
                               if t not in self._tables and t in spec.graph.constants
                               and spec.graph.constants[t].dtype.kind == "f"}
        taken = source if take_weights and isinstance(source, dict) else None
        self._params = {}
        for p in spec.params:
            if p in numpy_held and p not in mnn_read:
                continue
            self._params[p] = K.trainable(np.asarray(source[p], np.float32))
            if taken is not None and p not in numpy_held:
                # the caller's array let go as soon as its Var holds a copy: building every Var
                # first held the stage's weights twice at setup (SmolLM2 full: 1050 MiB for 513)
                taken[p] = K.memory_of(self._params[p])
        # The current weights as numpy arrays (what the optimizer steps, old versions are copied
        # from, checkpoints read). Until the stage updates with forwards in flight they are the
        # Vars' own memory (`K.memory_of`): the weights held once, stepped in place, re-read by
        # MNN at the next evaluation (each writes its inputs). Then (`_separate_current`) they
        # become arrays of their own, and the Vars are written when a forward needs a version.
        self._current = {p: K.memory_of(self._params[p]) for p in spec.params if p not in numpy_held}
        self._current_in_vars = True
        # with take_weights the caller's arrays are let go: its mapping gets the Vars' memory
        self._taken = source if take_weights and isinstance(source, dict) else None
        if self._taken is not None:
            self._taken.update(self._current)
        if cache_slots is not None and (not isinstance(cache_slots, int) or cache_slots < 1):
            raise ValueError(f"cache_slots must be an int >= 1 or None (one per micro-batch in flight), "
                             f"got {cache_slots!r}")
        # one set of block graphs per slot, all reading the same weight Vars: a micro-batch's forward
        # runs on a slot no other micro-batch in flight holds, so its per-op caches (its activations)
        # are still there for its backward, which then skips re-running the forward. Which slot a
        # micro-batch gets changes speed only: a backward whose caches went stale re-runs its
        # forward from the stashed inputs, as with one slot. None: a slot is added whenever every
        # slot is held (as many as micro-batches in flight: the planner's "keep").
        self._max_slots = (cache_slots if cache_activations else 1)
        self._lookup = ChainMap(self._tables, self._frozen_tables)
        self._constant_vars: dict[str, K.Var] = {}
        # Weight Vars are written lazily: `_var_version[k]` is the weight version Var set k holds,
        # written before a forward or backward that needs another (a step writes nothing). Every
        # slot reads set 0, unless the stage updates while micro-batches are in flight
        # (`updates_in_flight`, set before the first forward) and keeps their activations: each slot
        # built then gets a set of its own, which keeps the version its forward ran with until its
        # backward, so that backward neither swaps versions in and out nor loses its op caches to
        # the write (and with slots added as needed, no old version of those weights is copied).
        self._var_sets = [self._params]
        self._var_version = [0]
        self._slot_vars = [0]
        self._slots = [self._build_blocks(spec, self._lookup, self._params)]
        self._blocks = self._slots[0]
        if self._constant_vars or self._taken is not None:
            # the graph's arrays let go for views of the constant Vars (`_hold_once`) are glibc heap a
            # later allocation may never reuse: hand it back now, or the frozen weights stay resident
            # twice after all (a MiniLM LoRA stage: +41 MiB, tests/planner/test_memory_phases.py)
            release_free_heap()
        self._slot_used = [0] * len(self._slots)  # the serial of the last forward on each slot
        self._stash: dict[int, tuple[int, int, list[np.ndarray | None], dict[str, np.ndarray], int]] = {}
        self._serial = 0
        self.cache_activations = cache_activations
        self.stash_weights = stash_weights
        self.version = 0
        self._old_versions: dict[int, dict[str, np.ndarray]] = {}
        # what a backward reads, so what an old version holds: every weight but the tables only
        # looked up (a lookup's gradient does not read its table, and a re-run forward is fed the
        # rows its forward gathered), which spares a copy of an embedding table per update
        unversioned = looked_up_only(spec)
        self._versioned = [p for p in spec.params if p not in unversioned]
        # arrays of dropped old versions, reused by the next copy (no fresh pages to fault in)
        self._spare: dict[tuple, list[np.ndarray]] = {}
        # split backwards: per micro-batch, what its W multiplies (its B computed the rest)
        self._pending: dict[int, list[_PendingWeightGrad]] = {}
        # micro-batches whose forward added the fused LM head's weight gradient into the sum (`forward_into`)
        self._head_summed: set[int] = set()

    def _build_blocks(self, spec: StageSpec, lookup, params: Mapping[str, "K.Var"]) -> list:
        """The stage's block programs over the weight Vars `params` (and a view of the tables: version
        swaps of _tables show through)."""
        blocks: list = []
        for b, nodes in spec.block_nodes():
            if self._lm is not None and b.index == self._lm.head_index:
                nodes = [n for n in nodes if n.name != self._lm.matmul.name]
                b = replace(b, output=self._lm.hidden)
            if len(nodes) == 1 and nodes[0].op == "TokenCrossEntropy":
                fused = self._lm if self._lm is not None and b.index == self._lm.loss_index else None
                blocks.append(_LossProgram(b, nodes[0], fused, lookup, set(self._tables),
                                           give_back=self._stream is not None))
            else:
                blocks.append(_BlockProgram(b, nodes, spec, params, lookup, set(self._tables),
                                            self._constant_vars, self._stream))
        head = self._lm.head_index if self._lm is not None else None
        for prog in cached_programs(blocks, self.cached_blocks if self.per_block else 0, head):
            prog.keeps_caches = True
        return blocks

    def _free_slot(self) -> int:
        """A slot no micro-batch in flight holds (the least recently used); a new one if every slot is
        held and more are allowed; else the least recently used."""
        held = {entry[4] for entry in self._stash.values()}
        free = [k for k in range(len(self._slots)) if k not in held]
        if not free and (self._max_slots is None or len(self._slots) < self._max_slots):
            vars_of_slot = 0
            if self._own_vars_per_slot:
                self._var_sets.append({p: K.trainable(self._weight(p)) for p in self._params})
                self._var_version.append(self.version)
                vars_of_slot = len(self._var_sets) - 1
            self._slots.append(self._build_blocks(self.spec, self._lookup, self._var_sets[vars_of_slot]))
            self._slot_vars.append(vars_of_slot)
            self._slot_used.append(0)
            return len(self._slots) - 1
        return min(free or range(len(self._slots)), key=lambda k: self._slot_used[k])

    @property
    def updates_in_flight(self) -> bool:
        return self._updates_in_flight

    @updates_in_flight.setter
    def updates_in_flight(self, value: bool) -> None:
        self._updates_in_flight = bool(value)
        if self._updates_in_flight and self.stash_weights:
            self._separate_current()

    _updates_in_flight = False

    def _separate_current(self) -> None:
        """The current weights in arrays of their own, apart from Var set 0 (which then holds
        whatever version a forward or backward last needed)."""
        if not self._current_in_vars:
            return
        self._current = {p: a.copy() for p, a in self._current.items()}
        self._current_in_vars = False
        if self._taken is not None:
            self._taken.update(self._current)

    def _check_current_in_vars(self) -> None:
        for p, arr in self._current.items():
            if not K.shares_memory(self._params[p], arr):
                raise RuntimeError(f"MNN moved the memory of weight {p!r} of stage blocks {self.spec.first_block}-"
                                   f"{self.spec.last_block}: its numpy view no longer lies over it")

    @property
    def _own_vars_per_slot(self) -> bool:
        return self.updates_in_flight and self.stash_weights and self._max_slots != 1

    def _write_vars(self, k: int, version: int) -> None:
        """Make Var set k hold weight `version` (the current one or a stashed old one)."""
        if self._var_version[k] == version:
            return
        weights = self._current if version == self.version else self._old_versions[version]
        for name, var in self._var_sets[k].items():
            K.write(var, weights[name] if name in weights else self._weight(name))
        self._var_version[k] = version

    @property
    def cache_slots(self) -> int:
        """Sets of block graphs built so far (one per micro-batch in flight at most, when keeping)."""
        return len(self._slots)

    def _host(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = host_values(self.spec, feeds)
        for n in self.spec.compute_nodes:  # constant lookup ids (position ids) join the host values
            if n.op == "Gather" and n.inputs[1] in self.spec.graph.constants and n.inputs[1] not in self._params:
                env[n.inputs[1]] = self.spec.graph.constants[n.inputs[1]]
        return env

    def logits_at(self, feeds, until_block: int, positions) -> np.ndarray:
        if self._lm is None or until_block != self._lm.head_index:
            return super().logits_at(feeds, until_block, positions)
        # the head fused with its loss: its projection of the chosen positions only ([rows, V], not
        # [rows, S, V]: a micro-batch of SmolLM2 at 128 positions is 24 MiB of logits a row)
        hidden = self.forward(feeds, train=False, until_block=until_block, _hidden=True)
        rows = np.asarray(hidden)[rows_at(positions)]
        return self._slots[0][-1].logits(rows.reshape(-1, rows.shape[-1])).reshape(*rows.shape[:-1], -1)

    def forward_into(self, feeds, microbatch: int, into: dict) -> np.ndarray:
        """A training forward whose fused LM head + loss adds its weight's gradient straight into the
        running sum `into`, a block of vocabulary rows at a time, its backward then leaving it out: the
        forward's pass computes the gradients, and the head's, a new vocabulary x hidden array, stood
        beside the sum from its forward to its backward (the head's stage of tests/jobs/
        test_full_finetune_plan.py: 48 MiB, benchmarks/MEMORY_NOTES.md, helper h135). Where `into` has
        no sum of the head yet, this forward starts it (zeros, which the pass adds into as it added into
        its own zeros before): a stage that runs several forwards before any backward (GPipe's last)
        kept each forward's gradient until its backward, one vocabulary x hidden array per micro-batch
        in flight when keeping (4.3 heads above the level at 4 micro-batches) and two at once
        recomputing (the next forward's made while the last one's was still saved: 2.3), where the plan
        charges one (helper h142). The same products added in another order."""
        return self.forward(feeds, microbatch, True, _head_sum=self._head_sum_target(into, start=True))

    def _head_sum_target(self, into: dict | None, start: bool = False) -> np.ndarray | None:
        """The running sum of the fused LM head's trainable weight, to add its gradient into, or None
        (no fused head, a frozen one, a row or read-only sum, another dtype or shape; no sum yet, unless
        `start`: then a new one of zeros, put into `into`)."""
        if self._lm is None or into is None or self._lm.weight not in self._tables:
            return None
        weight = self._tables[self._lm.weight]
        if start and self._lm.weight not in into and isinstance(weight, np.ndarray) and weight.dtype == np.float32:
            into[self._lm.weight] = np.zeros(weight.shape, np.float32)
        acc = into.get(self._lm.weight)
        if (not isinstance(acc, np.ndarray) or acc.dtype != np.float32 or not acc.flags.writeable
                or not acc.flags.c_contiguous or acc.shape != weight.shape):
            return None
        return acc

    def forward(self, feeds, microbatch: int = 0, train: bool = True, until_block: int | None = None,
                _hidden: bool = False, _head_sum: np.ndarray | None = None) -> np.ndarray:
        if train and microbatch in self._stash:
            raise ValueError(f"micro-batch {microbatch} already has a forward waiting for its backward")
        self._head_summed.discard(microbatch)
        host = self._host(feeds)
        x = None
        if self.spec.activation_input is not None:
            x = np.asarray(feeds[self.spec.activation_input], np.float32)
            if isinstance(self._blocks[0], _LossProgram) and train:
                x = x.copy()  # the loss writes its gradient into the logits it keeps
        block_inputs: list[np.ndarray | None] = []
        self._serial += 1
        serial = self._serial if train else None
        # an inference forward runs on slot 0 unless a micro-batch in flight holds it (its Vars may
        # keep that micro-batch's weights, of which no other copy exists)
        slot = self._free_slot() if train or 0 in {entry[4] for entry in self._stash.values()} else 0
        self._slot_used[slot] = self._serial
        self._write_vars(self._slot_vars[slot], self.version)
        programs = self._slots[slot]
        for prog in programs:
            if until_block is not None and prog.block.index > until_block:
                if train:
                    raise ValueError("a training forward must run the whole stage")
                break
            block_inputs.append(x)
            prog.feed(x, host, serial)
            if self.cache_activations or prog.keeps_caches:
                # also on an inference forward: priming later would leave the caches unused for good
                prog.enable_op_caches()
            x = prog.forward(train, _head_sum) if isinstance(prog, _LossProgram) else prog.forward(train)
            if self.per_block and not prog.keeps_caches:
                prog.release()
        if train and _head_sum is not None:
            self._head_summed.add(microbatch)  # its backward leaves the head's weight gradient out
        if self._lm is not None and until_block == self._lm.head_index and not _hidden:
            x = programs[-1].logits(x)  # the head's real output, for evaluation
        if train:
            self._stash[microbatch] = (self._serial, self.version, block_inputs, host, slot)
        return x

    def backward(self, microbatch: int, grad_output=None) -> StageGradients:
        return self._backward(microbatch, grad_output, split=False)

    def backward_input(self, microbatch: int, grad_output=None) -> StageGradients:
        return self._backward(microbatch, grad_output, split=True)

    def backward_weight(self, microbatch: int) -> dict[str, np.ndarray]:
        grads: dict[str, np.ndarray] = {}
        for item in self._pending.pop(microbatch, ()):
            accumulate(grads, {item.weight: item.gradient()})
        return grads

    def backward_into(self, microbatch: int, into: dict, grad_output=None):
        return self._backward(microbatch, grad_output, split=False, into=into, head_into=into).activation_input

    def backward_input_into(self, microbatch: int, into: dict, grad_output=None) -> StageGradients:
        """`backward_input`, a fused LM head's weight gradient, where its pass is recomputed, added
        straight into `into` (as `backward_into`); the other gradients returned, for the caller to add."""
        return self._backward(microbatch, grad_output, split=True, head_into=into)

    def _backward(self, microbatch: int, grad_output, split: bool, into: dict | None = None,
                  head_into: dict | None = None) -> StageGradients:
        """`into`: every block's gradients added into it as they come (none returned); `head_into`: the
        running sum a fused LM head's recomputed pass adds its weight's gradient into."""
        if microbatch not in self._stash:
            raise KeyError(f"backward of micro-batch {microbatch} before its forward")
        serial, version, block_inputs, host, slot = self._stash.pop(microbatch)
        head_summed = microbatch in self._head_summed
        self._head_summed.discard(microbatch)
        # without stashing, a backward after an update runs on the new weights
        wanted = version if self.stash_weights else self.version
        if wanted != self._var_version[self._slot_vars[slot]]:
            if wanted != self.version and wanted not in self._old_versions:
                raise RuntimeError(f"micro-batch {microbatch}: its forward's weights (version {wanted}) were not "
                                   f"kept, and the graphs it ran on hold version "
                                   f"{self._var_version[self._slot_vars[slot]]}")
            self._write_vars(self._slot_vars[slot], wanted)  # left there: the next forward writes what it needs
        # tables a backward reads (a fused LM head's weight) switch by reference, and back after
        swapped = self.stash_weights and version != self.version
        current = dict(self._tables)
        if swapped:
            self._tables.update({k: v for k, v in self._old_versions[version].items() if k in self._tables})
        try:
            grads: dict[str, np.ndarray] = {}
            g = grad_output
            pending: list[_PendingWeightGrad] = []
            for prog, x in zip(reversed(self._slots[slot]), reversed(block_inputs)):
                prog.feed(x, host, serial)
                if split and isinstance(prog, _BlockProgram) and prog.projections:
                    pg, g, later = prog.backward_input(g, host, self.row_gradients)
                    pending += later
                elif isinstance(prog, _BlockProgram):
                    pg, g = prog.backward(g, host, self.row_gradients)
                else:
                    pg, g = prog.backward(g, host, self._head_sum_target(head_into), head_summed)
                if self.per_block and not prog.keeps_caches:
                    prog.release()
                if into is not None:  # each block's into the running sum: no whole set of this one's
                    accumulate(into, pg)
                    continue
                for k, v in pg.items():
                    grads[k] = add_gradient(grads[k], v) if k in grads else v
        finally:
            if swapped:
                self._tables.update(current)
            self._drop_unused_versions()
        if split:
            self._pending[microbatch] = pending
        return StageGradients(grads, g if self.spec.activation_input is not None else None)

    def _drop_unused_versions(self) -> None:
        # a version is kept while a micro-batch in flight needs it (Var sets hold their own copies)
        live = {entry[1] for entry in self._stash.values()}
        for v in [v for v in self._old_versions if v not in live]:
            for arr in self._old_versions.pop(v).values():
                self._spare.setdefault((arr.shape, arr.dtype.str), []).append(arr)

    def stashed_versions(self) -> int:
        """Weight versions held besides the current one (PipeDream: up to stages - s - 1)."""
        return len(self._old_versions)

    def parameters(self):
        out = {k: v.copy() for k, v in self._current.items()}
        out.update({k: v.copy() for k, v in self._tables.items()})
        return out

    def parameter_arrays(self):
        return {**self._current, **self._tables}

    def _weight(self, name: str) -> np.ndarray:
        return self._tables[name] if name in self._tables else self._current[name]

    def _copy(self, arr: np.ndarray) -> np.ndarray:
        spare = self._spare.get((arr.shape, arr.dtype.str))
        if spare:
            out = spare.pop()
            np.copyto(out, arr)
            return out
        return arr.copy()

    def _keep_old_version(self) -> None:
        """Before the current weights change: a copy of what a backward of a forward in flight may
        read becomes the old version (the current arrays, perhaps the caller's, taken with
        take_weights, are then changed in place). With a Var set per slot and slots added as
        needed, each such forward's Vars keep its version, so only numpy-held weights are copied."""
        if not (self.stash_weights and any(entry[1] == self.version for entry in self._stash.values())):
            return
        self._separate_current()  # Var set 0 must be free to hold the old version for that backward
        names = self._versioned
        if self._own_vars_per_slot and self._max_slots is None:
            names = [k for k in names if k not in self._params]
        self._old_versions[self.version] = {k: self._copy(self._weight(k)) for k in names}

    def step(self, optimizer, grads) -> None:
        self._keep_old_version()
        if self._current_in_vars:
            self._check_current_in_vars()
        params = {p: self._tables[p] if p in self._tables else self._current[p] for p in self.spec.params}
        optimizer.step(params, grads)
        self.version += 1  # the Vars are written when a forward needs the new weights
        if self._current_in_vars:
            self._var_version[0] = self.version  # stepped in place
            for k in self._tables.keys() & self._params.keys():  # a table MNN also reads: its Var apart
                K.write(self._params[k], self._tables[k])

    def set_parameters(self, values):
        unknown = [k for k in values if k not in self._tables and k not in self._params]
        if unknown:
            raise KeyError(f"parameters {unknown[:3]} are not in this stage (blocks "
                           f"{self.spec.first_block}-{self.spec.last_block})")
        if self.stash_weights and any(entry[1] == self.version for entry in self._stash.values()):
            self._separate_current()
            # the current arrays become the old version as they are (no copy); every key gets a
            # fresh array (the new values are written into it below; keys not given keep a copy),
            # so no array is shared by two versions and later in-place writes cannot reach the old one
            old = {**self._tables, **self._current}
            self._old_versions[self.version] = old
            for k, arr in old.items():
                fresh = np.empty_like(arr) if k in values else arr.copy()
                if k in self._tables:
                    self._tables[k] = fresh  # the same dict the block programs read
                else:
                    self._current[k] = fresh
        for k, v in values.items():
            if k in self._tables:
                self._tables[k][...] = v
            else:
                np.copyto(self._current[k], v)
        self.version += 1  # the Vars are written when a forward needs the new weights
        if self._current_in_vars:
            self._var_version[0] = self.version  # written in place
            for k in self._tables.keys() & self._params.keys():  # a table MNN also reads: its Var apart
                K.write(self._params[k], self._tables[k])
