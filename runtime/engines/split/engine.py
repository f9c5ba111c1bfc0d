"""A stage engine whose encoder and decoder blocks run their attention heads split across compute
backends.

Each block of the stage whose attention the planner found when it lowered the model
(`ir.graph.AttentionSite`, `planner.attention`) is cut into
  * the attention: a pre-norm of the block input x if the block has one (GPT-2, Llama), Q/K/V
    projections, rotary embeddings, grouped-query heads, the heads' scaled dot-product attention
    with the additive mask, and the output projection with its bias; run by
    `runtime.engines.split.attention.SplitAttention` over the allocation's backends;
  * the residual Add of the attention output and x, done here in numpy (an elementwise float32
    sum is exact and commutative, so it equals MNN's bit for bit);
  * the rest of the block (LayerNorm, feed-forward, residual, LayerNorm; or norm, MLP, residual),
    which reads only the residual sum: a one-block IR graph run by an `MnnStageEngine`.
Runs of other blocks (embeddings, unsplit encoders, head, loss) are `MnnStageEngine`s over
sub-ranges of the stage. Backward goes through the segments in reverse; for a split block the
gradient of the residual sum is both the attention output's gradient and a share of x's, to which
the attention's dx is added.

Parameters keep the graph's names, so the executor, the optimizer and checkpoints work unchanged.
A graph parameter may feed several places (the dynamo exporter shares identical constants, e.g.
one all-zero bias for many layers): its gradient is the sum over the places, and
`set_parameters` writes it to all of them. A projection stored for `trans_b` (x @ W^T) is
transposed into the x @ W layout `SplitAttention` takes, and its gradient back.

Weight stashing (PipeDream; the asynchronous 1f1b-stash schedule updates while micro-batches
are in flight): the backward of micro-batch m uses the weights m's forward used. Every part of the
stage keeps its own old versions, because every part holds its own weights: the MNN segments and
the post-attention engines are `MnnStageEngine`s with `stash_weights`, and the attention slices
live in the backends' engines, in child processes too, which stash them likewise
(`runtime.engines.split.attention`). This engine only numbers the versions (`version`, `stashed_versions`, as
`MnnStageEngine` does): one update through `set_parameters` reaches every part, so the parts'
versions move together. Under flush schedules no update meets a micro-batch in flight and nothing
is stashed. An old version costs one copy of the stage's weights, as `planner.cost` counts it.

A fused projection (GPT-2's c_attn: Q, K and V as column ranges of one constant) is split into
its roles' columns and its gradient reassembled from them.

Limits: blocks whose attention the lowering did not place (`block.attention` None) are not split
(by default) or raise when named in `blocks`, naming the block.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ir.graph import Block, Graph
from ir.graph import AttentionSite
from runtime.engines.base import StageEngine, StageGradients
from runtime.engines.mnn import MnnStageEngine
from runtime.engines.split.attention import SplitAttention
from runtime.engines.split.piece import attention_form
from runtime.engines.stage import StageSpec, host_values, stage_spec


def _post_spec(graph: Graph, block: Block, match: AttentionSite) -> StageSpec:
    """The block's nodes after the residual Add, as block 1 of a two-block graph whose activation
    input is the residual sum (block 0 is an empty stand-in, as in `runtime.engines.split.piece`)."""
    nodes = tuple(graph.node(n) for n in block.nodes if n not in match.nodes)
    params = tuple(dict.fromkeys(i for n in nodes for i in n.inputs if i in graph.params))
    r = match.residual
    blocks = (
        Block(0, "residual", "embeddings", (), (), (), r, (), 0, graph.values[r].nbytes, 0),
        Block(1, f"{block.name}.post_attention", "encoder", tuple(n.name for n in nodes), (), (r,), block.output,
              params, sum(int(graph.constants[p].nbytes) for p in params), graph.values[block.output].nbytes, 0),
    )
    consts = {k: graph.constants[k] for k in dict.fromkeys(i for n in nodes for i in n.inputs) if k in graph.constants}
    sub = Graph(f"{graph.name}.{block.name}.post", (), (graph.values[block.output],), nodes, graph.values, consts,
                params, blocks, graph.batch, graph.seq)
    return StageSpec(sub, 1, 1, nodes, (), r, (), block.output, params)


# Segments ---------------------------------------------------------------------------------------

class _MnnSegment:
    """A run of unsplit blocks [first, last] of the stage on MNN."""

    def __init__(self, spec: StageSpec, first: int, last: int, threads: int, stash_weights: bool):
        self.first, self.last = first, last
        self.spec = stage_spec(spec.graph, first, last)
        self.engine = MnnStageEngine(self.spec, threads=threads, stash_weights=stash_weights)

    @property
    def names(self) -> set[str]:
        return set(self.engine.parameters())


class _SplitSegment:
    """One block: split attention (its pre-norm included), residual in numpy, the rest on MNN."""

    def __init__(self, graph: Graph, block: Block, allocation: Mapping[str, int], threads: int, concurrent: bool,
                 stash_weights: bool):
        self.first = self.last = block.index
        self.block = block
        if block.attention is None:
            raise ValueError(f"block {block.index} ({block.name}): its attention heads cannot be split, because no "
                             f"splittable attention was found when the model was lowered "
                             f"(`planner.attention.match_attention` tells why)")
        self.match = block.attention
        self.roles = block.attention.weight_of
        self.columns = block.attention.columns_of
        self.form = attention_form(graph, block)
        self._shapes = {name: tuple(graph.constants[name].shape) for name, _ in self.roles.values()}
        self.mask_shape = tuple(graph.values[self.match.mask].shape)
        B, S, _ = graph.values[self.match.x].shape
        self.attention = SplitAttention(self._full_weights(graph.constants), self.form.units, block.head_size,
                                        allocation, B, S, self.mask_shape, concurrent=concurrent,
                                        stash_weights=stash_weights, form=self.form)
        self.post = MnnStageEngine(_post_spec(graph, block, self.match), threads=threads, stash_weights=stash_weights)

    def _role_value(self, role: str, stored: np.ndarray) -> np.ndarray:
        """A role's full weight (x @ W layout) out of the graph constant that holds it."""
        _, transposed = self.roles[role]
        w = np.asarray(stored, np.float32)
        w = w.T if transposed else w
        cols = self.columns[role]
        if cols is not None:
            w = w[..., cols[0]:cols[1]]
        return np.ascontiguousarray(w)

    def _full_weights(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {role: self._role_value(role, values[name]) for role, (name, _) in self.roles.items()}

    def _stored(self, full: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray] | None = None,
                add: bool = False) -> dict[str, np.ndarray]:
        """The graph constants of the roles in `full`: fused ones reassembled from their roles'
        columns (into a copy of `like`'s, or zeros), transposed back where stored so; with `add`
        the roles' values are summed into `like`'s (gradients)."""
        out: dict[str, np.ndarray] = {}
        for role, (name, transposed) in self.roles.items():
            if role not in full:
                continue
            v = np.asarray(full[role], np.float32)
            cols = self.columns[role]
            if cols is None and not add:
                out[name] = np.ascontiguousarray(v.T) if transposed else v
                continue
            if name not in out:
                base = like.get(name) if like is not None else None
                out[name] = np.zeros(self._shapes[name], np.float32) if base is None else np.array(base, np.float32)
            target = out[name].T if transposed else out[name]  # a view: writes land in out[name]
            if cols is None:
                target += v
            elif add:
                target[..., cols[0]:cols[1]] += v
            else:
                target[..., cols[0]:cols[1]] = v
        return out

    @property
    def names(self) -> set[str]:
        return {n for n, _ in self.roles.values()} | set(self.post.parameters())

    def parameters(self) -> dict[str, np.ndarray]:
        out = self.post.parameters()
        out.update(self._stored(self.attention.parameters()))
        return out

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        post = {k: v for k, v in values.items() if k in self.post.spec.params}
        if post:
            self.post.set_parameters(post)
        if any(name in values for name, _ in self.roles.values()):
            current = self.attention.parameters()
            for role, (name, _) in self.roles.items():
                if name in values:
                    current[role] = self._role_value(role, values[name])
            self.attention.set_weights(current)

    def forward(self, x: np.ndarray, host: Mapping[str, np.ndarray], microbatch: int, train: bool) -> np.ndarray:
        attn = self.attention.forward(x, host[self.match.mask], microbatch, train)
        r = attn + x  # the graph's residual Add, exactly
        return self.post.forward({self.match.residual: r}, microbatch, train)

    def backward(self, microbatch: int, grad_output: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        g = self.post.backward(microbatch, grad_output)
        dr = g.activation_input
        dx, full = self.attention.backward(dr, microbatch)
        dx += dr  # the residual path
        grads = dict(g.params)
        # a parameter the post part also reads (a shared constant) gets both gradients
        mine = self._stored(full, like={k: v for k, v in grads.items() if k in {n for n, _ in self.roles.values()}},
                            add=True)
        grads.update(mine)
        return grads, dx

    def close(self) -> None:
        self.attention.close()


# The engine -------------------------------------------------------------------------------------

class SplitStageEngine(StageEngine):
    """`spec`'s blocks on MNN, except that every encoder block's attention heads are split by
    `allocation` (backend name -> heads, e.g. {"mnn:cpu:t1": 1, "torch:cpu:t1": 3}); `blocks`
    limits the split to those block indices (default: every encoder block of the stage).
    `concurrent` as in `SplitAttention` (False: every backend in this process, one after another).
    `stash_weights` as in `MnnStageEngine` (module docstring); False is a reference that shows what
    stashing changes (torch backends of a split stash regardless).
    Close it (or use it as a context manager) to stop the backends' child processes."""

    def __init__(self, spec: StageSpec, allocation: Mapping[str, int], threads: int = 1,
                 blocks: set[int] | None = None, concurrent: bool = True, stash_weights: bool = True):
        self.spec = spec
        self.threads = threads
        self.allocation = dict(allocation)
        split = {b.index for b in spec.blocks if b.attention is not None} if blocks is None else set(blocks)
        outside = split - {b.index for b in spec.blocks}
        if outside:
            raise ValueError(f"blocks {sorted(outside)} are not in this stage (blocks {spec.first_block}-{spec.last_block})")
        for b in spec.blocks:
            if b.index in split and (b.kind not in ("encoder", "decoder") or not b.heads):
                raise ValueError(f"block {b.index} ({b.name}) is a {b.kind} block without attention heads")
        self.stash_weights = stash_weights
        self.segments: list[_MnnSegment | _SplitSegment] = []
        self.version = 0
        self._stash: dict[int, int] = {}  # micro-batch in flight -> the weight version its forward used
        try:
            run: list[int] = []
            for b in spec.blocks:
                if b.index in split:
                    if run:
                        self.segments.append(_MnnSegment(spec, run[0], run[-1], threads, stash_weights))
                        run = []
                    self.segments.append(_SplitSegment(spec.graph, b, self.allocation, threads, concurrent,
                                                       stash_weights))
                else:
                    run.append(b.index)
            if run:
                self.segments.append(_MnnSegment(spec, run[0], run[-1], threads, stash_weights))
        except BaseException:
            self.close()
            raise
        self._owners: dict[str, list] = {}
        for seg in self.segments:
            for name in seg.names:
                self._owners.setdefault(name, []).append(seg)

    # compute -------------------------------------------------------------------------------------
    def forward(self, feeds, microbatch: int = 0, train: bool = True, until_block: int | None = None) -> np.ndarray:
        if train and microbatch in self._stash:
            raise ValueError(f"micro-batch {microbatch} already has a forward waiting for its backward")
        if train and until_block is not None and until_block < self.spec.last_block:
            raise ValueError("a training forward must run the whole stage")
        host = host_values(self.spec, feeds)
        x = None if self.spec.activation_input is None else np.asarray(feeds[self.spec.activation_input], np.float32)
        for seg in self.segments:
            if until_block is not None and seg.first > until_block:
                break
            if isinstance(seg, _MnnSegment):
                seg_feeds = {k: host[k] for k in seg.spec.graph_inputs}
                if seg.spec.activation_input is not None:
                    seg_feeds[seg.spec.activation_input] = x
                self._threads()
                x = seg.engine.forward(seg_feeds, microbatch, train, until_block)
            else:
                x = seg.forward(x, host, microbatch, train)
        if train:
            self._stash[microbatch] = self.version
        return x

    def _threads(self) -> None:
        # MNN's thread count is process-wide; an MNN backend of a split may have changed it
        from runtime.engines import mnn_kernels as K

        if K.get_threads() != self.threads:
            K.set_threads(self.threads)

    def backward(self, microbatch: int, grad_output: np.ndarray | None = None) -> StageGradients:
        if microbatch not in self._stash:
            raise KeyError(f"backward of micro-batch {microbatch} before its forward")
        del self._stash[microbatch]
        # each segment swaps in the version its own forward of this micro-batch used
        grads: dict[str, np.ndarray] = {}
        g = grad_output
        for seg in reversed(self.segments):
            if isinstance(seg, _MnnSegment):
                self._threads()
                result = seg.engine.backward(microbatch, g)
                params, g = result.params, result.activation_input
            else:
                params, g = seg.backward(microbatch, g)
            for k, v in params.items():
                # fresh arrays: the executor accumulates into what it gets
                grads[k] = grads[k] + v if k in grads else np.array(v, np.float32)
        return StageGradients(grads, g if self.spec.activation_input is not None else None)

    # parameters ---------------------------------------------------------------------------------
    def parameters(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for seg in self.segments:
            params = seg.engine.parameters() if isinstance(seg, _MnnSegment) else seg.parameters()
            for k, v in params.items():
                out.setdefault(k, np.array(v, np.float32))
        return out

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        unknown = [k for k in values if k not in self._owners]
        if unknown:
            raise KeyError(f"parameters {unknown[:3]} are not in this stage (blocks "
                           f"{self.spec.first_block}-{self.spec.last_block})")
        # each segment stashes its current weights itself if a micro-batch in flight used them
        for seg in self.segments:
            mine = {k: v for k, v in values.items() if seg in self._owners[k]}
            if not mine:
                continue
            if isinstance(seg, _MnnSegment):
                seg.engine.set_parameters(mine)
            else:
                seg.set_parameters(mine)
        self.version += 1

    def stashed_versions(self) -> int:
        """Weight versions held besides the current one (PipeDream: up to stages - s - 1): those of
        the micro-batches in flight whose forward ran before the latest update."""
        if not self.stash_weights:
            return 0
        return len({v for v in self._stash.values() if v != self.version})

    # lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        for seg in self.segments:
            if isinstance(seg, _SplitSegment):
                seg.close()

    def __enter__(self) -> "SplitStageEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
