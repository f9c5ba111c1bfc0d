"""Device profiling: what `confidant profile` measures on a device (`ir.profile.DeviceProfile`).

By job: `device` (profile_device: the whole profile), `compute` (block and attention times,
optimizer rates), `memory` (peak RSS, the runtime's overhead, head-split children), `split_costs`
(a real head split's cost beyond the curves), `links` (bandwidth and latency to a peer),
`backends` (which backends run here), `inputs` (synthetic feeds). This face re-exports what
callers use.
"""
from runtime.profiling.backends import (
                                      discover,
                                      present_backends,
                                      thread_variants,
                                      torch_devices,
)
from runtime.profiling.compute import (
                                      accumulate_rate,
                                      attention_curve,
                                      engine_update_rates,
                                      measure_stage,
                                      update_rates,
)
from runtime.profiling.device import DEFAULT_BACKENDS, distinct_blocks, profile_device
from runtime.profiling.inputs import block_mask, synthetic_feeds
from runtime.profiling.links import (
                                      link_from_round_trips,
                                      link_probe_server,
                                      measure_link,
)
from runtime.profiling.memory import (
                                      PeakRss,
                                      memory_available_bytes,
                                      runtime_overhead_bytes,
                                      split_child_bytes,
)
from runtime.profiling.split_costs import (
                                      SplitExtraCost,
                                      SplitRun,
                                      split_allocations,
                                      split_extra_cost,
                                      split_primary,
                                      time_split_attention,
)

__all__ = [
    "DEFAULT_BACKENDS", "PeakRss", "SplitExtraCost", "SplitRun", "accumulate_rate", "attention_curve", "block_mask",
    "discover", "distinct_blocks", "engine_update_rates", "link_from_round_trips", "link_probe_server",
    "measure_link", "measure_stage", "memory_available_bytes", "present_backends", "profile_device",
    "runtime_overhead_bytes", "split_allocations", "split_child_bytes", "split_extra_cost", "split_primary",
    "synthetic_feeds", "thread_variants", "time_split_attention", "torch_devices", "update_rates",
]
