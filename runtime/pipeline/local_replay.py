"""A whole pipeline in one process: every stage's executor over the in-process transport, run in
one thread by replaying the action lists in a dependency-respecting interleaving.

This is the "fake hardware first" layer (DESIGN habit 9) and the sequential reference for weight
stashing: the same executor and engine code as real workers, with the order of every action
explicit and repeatable, so a multi-process run can be compared to it exactly.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ir.graph import Graph
from ir.plan import Schedule
from runtime.pipeline.executor import COORDINATOR, StageExecutor, stage_peer
from runtime.optim import make_optimizer
from runtime.engines.stage import stage_spec
from runtime.transport.wire import Expected, PeerTimeout
from runtime.transport.local import LocalHub, LocalTransport


class LocalPipeline:
    def __init__(self, graph: Graph, ranges: Sequence[tuple[int, int]], make_engine: Callable,
                 optimizer: str, lr: float, weight_decay: float | None = None):
        self.hub = LocalHub()
        self.coordinator = LocalTransport(COORDINATOR, self.hub)
        self.stages = len(ranges)
        self.executors: list[StageExecutor] = []
        for k, (first, last) in enumerate(ranges):
            spec = stage_spec(graph, first, last)
            transport = LocalTransport(stage_peer(k), self.hub)
            self.executors.append(StageExecutor(k, self.stages, make_engine(spec), transport,
                                                make_optimizer(optimizer, lr, weight_decay), spec.graph_inputs,
                                                timeout=0))

    def run(self, schedule: Schedule, microbatch_feeds: Sequence[Mapping[str, np.ndarray]]) -> list[float]:
        for m, feeds in enumerate(microbatch_feeds):
            for k, ex in enumerate(self.executors):
                for name in ex.input_names:
                    self.coordinator.send_tensor(stage_peer(k), "batch", -1, m, np.asarray(feeds[name], order="C"), name=name)
        positions = [0] * self.stages
        lists = [list(a) for a in schedule.actions]
        for ex, actions in zip(self.executors, lists):
            ex.prepare(actions)
        while any(pos < len(lst) for pos, lst in zip(positions, lists)):
            progressed = False
            for k, ex in enumerate(self.executors):
                while positions[k] < len(lists[k]):
                    action = lists[k][positions[k]]
                    try:
                        ex.execute(action)
                    except PeerTimeout:
                        if not action.kind.is_recv:
                            raise
                        break  # its message is not there yet: let another stage run
                    positions[k] += 1
                    progressed = True
            if not progressed:
                stuck = [str(lst[pos]) for pos, lst in zip(positions, lists) if pos < len(lst)]
                raise RuntimeError(f"local pipeline deadlocked at {stuck}")
        last = stage_peer(self.stages - 1)
        return [float(self.coordinator.recv_tensor(last, Expected(kind="loss", stage=self.stages - 1, microbatch=m),
                                                   timeout=0)[1][0]) for m in range(schedule.microbatches)]

    def parameters(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for ex in self.executors:
            out.update(ex.engine.parameters())
        return out
