"""What one snapshot copy costs the CPUs of the two workers it involves, by the shape of a stage's state.

What it measures
    A stage's snapshot copy (runtime.pipeline.snapshots.StateCopies: taken into a file, shipped to
    its holder, filed there) between two endpoints in this process over real CURVE ZeroMQ links, as
    fast as they go (no spread), ``--snapshots`` times after two warm-up copies. The figure is this
    process's CPU (every thread: the ZeroMQ I/O threads, where CURVE works, included) per snapshot:
    sender and holder together, which a loaded machine disturbs far less than wall clock.
      * ``lora``: SmolLM2-135M's LoRA r8 adapters on q, k, v, o (30 layers) with their AdamW moments:
        721 small tensors, 10.5 MiB.
      * ``dense``: 12 tensors of 8 MiB (a full fine-tuning stage's few large tensors), 96 MiB.
    ``messages``: side-lane messages per snapshot (a copy's index and its chunks).

Usage
    PYTHONPATH=. python benchmarks/snapshot_cpu.py [--state lora|dense] [--snapshots 20]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.keys import KeyPair  # noqa: E402
from runtime.pipeline.snapshots import StateCopies  # noqa: E402
from runtime.transport.zeromq import ZmqTransport  # noqa: E402


def lora_state() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    state = []
    for layer in range(30):
        for proj, out in (("q", 576), ("k", 192), ("v", 192), ("o", 576)):
            state += [(f"param/l{layer}.{proj}.lora_A", rng.standard_normal((8, 576)).astype(np.float32)),
                      (f"param/l{layer}.{proj}.lora_B", rng.standard_normal((out, 8)).astype(np.float32))]
    state += [(f"opt/adamw/{m}/{n[6:]}", rng.standard_normal(x.shape).astype(np.float32))
              for m in "mv" for n, x in list(state)]
    return state + [("opt/adamw/steps", np.array(3, np.int64))]


def dense_state() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(f"param/w{i}", rng.standard_normal(2 * 2 ** 20).astype(np.float32)) for i in range(12)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", choices=("lora", "dense"), default="lora")
    parser.add_argument("--snapshots", type=int, default=20)
    args = parser.parse_args()
    names = ("stage0", "stage1")
    pairs = {n: KeyPair.generate(n) for n in names}
    ends = {n: ZmqTransport(n, "tcp://127.0.0.1:0", keys=pairs[n].curve_keys(), linger_s=0.2,
                            accept={o: pairs[o].public.curve for o in names if o != n}) for n in names}
    for n, t in ends.items():
        for o, other in ends.items():
            if o != n:
                t.connect(o, other.address, key=pairs[o].public.curve)
    a, b = ends["stage0"], ends["stage1"]
    state = lora_state() if args.state == "lora" else dense_state()
    sender, holder = StateCopies(a, lambda msg: None), StateCopies(b, lambda msg: None)
    sent = [0]
    real_send = a._send_frames

    def counting(peer, frames):
        sent[0] += 1
        real_send(peer, frames)

    a._send_frames = counting

    def once(sid: int) -> None:
        sender.take(sid, 0, state, "stage1", [sid - 1], 0.0)
        while (0, sid) not in holder.replicas:
            sender.pump()
            holder.take_in(["stage0"], 1)
            time.sleep(0.002)  # what waits for the I/O threads is not a snapshot's CPU
        sender.forget_except([sid]), holder.forget_except([sid])

    for sid in (1, 2):  # warm-up: the files' pages in the page cache, as in a long run
        once(sid)
    sent[0] = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for sid in range(3, 3 + args.snapshots):
        once(sid)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    n = args.snapshots
    print(f"{args.state}: {len(state)} tensors, {sum(x.nbytes for _, x in state) / 2 ** 20:.1f} MiB: "
          f"{cpu / n:.4f} CPU-s per snapshot (sender and holder, all threads), {wall / n:.3f} s wall, "
          f"{sent[0] / n:.0f} messages")
    a.close(), b.close()


if __name__ == "__main__":
    main()
