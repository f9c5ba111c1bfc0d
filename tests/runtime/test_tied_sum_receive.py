"""What receiving a tied gradient's sum holds at its peak, against the planner's charge
(`planner.cost.received_sum_bytes`): `runtime.transport.wire.join_payload` copies the frames last
first into one buffer and gives the freed ones back every RELEASE_EVERY_PARTS, so a few frames lie
freed-but-resident beside the joined buffer at the peak. Charged as the table alone, the embeddings'
stage of tests/jobs/test_torch_full_finetune_plan.py peaked 4.6-6.1 MiB above the sum it had received
(benchmarks/MEMORY_NOTES.md, helper h124)."""
from __future__ import annotations

from support import run_child

JOIN_CHILD = r"""
import json, sys
import numpy as np
from runtime.heap import release_free_heap
from runtime.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
from runtime.transport.wire import PART_BYTES, TensorHeader, join_payload, split_payload

n = int(sys.argv[2]) * PART_BYTES
src = np.arange(n // 4, dtype=np.float32)
header = TensorHeader(kind="tied_sum", stage=-1, microbatch=0, version=-1, dtype="float32", shape=(n // 4,),
                      nbytes=n, checksum=0, name="t")
# a worker's heap: its mmap threshold risen past a frame (glibc raises it when a larger block is freed),
# so the frames arrive as heap blocks, as ZeroMQ's do in a torch worker
big = bytearray(2 * PART_BYTES)
del big
parts = [bytes(p) for p in split_payload(memoryview(src.view(np.uint8)))]
del src
release_free_heap()
reset_peak_rss()
joined = join_payload(header, parts, checksum=False, consume=True)
print("JOINED", json.dumps({"after": rss_bytes(), "peak": peak_rss_bytes(), "n": n}))
"""


def test_a_received_sum_is_charged_the_frames_its_join_holds_beside_it():
    from planner.cost import RECEIVE_PART_BYTES, RECEIVE_RELEASE_EVERY_PARTS, received_sum_bytes
    from runtime.transport.wire import PART_BYTES, RELEASE_EVERY_PARTS

    # the planner restates the transport's frames (it imports no runtime)
    assert (RECEIVE_PART_BYTES, RECEIVE_RELEASE_EVERY_PARTS) == (PART_BYTES, RELEASE_EVERY_PARTS)
    got = run_child(JOIN_CHILD, "JOINED", 108)  # SmolLM2's tied table: 108 MiB, 108 frames
    beside = got["peak"] - got["after"]  # the joined sum is what stays
    charged = received_sum_bytes(got["n"]) - got["n"]
    # more than the table alone (the frames are real: 5.0-6.0 MiB measured), never more than the charge
    assert (RELEASE_EVERY_PARTS - 1) * PART_BYTES <= beside <= charged, (beside / 2**20, charged / 2**20)
    assert received_sum_bytes(PART_BYTES) == PART_BYTES  # one frame is returned as it came, not copied
