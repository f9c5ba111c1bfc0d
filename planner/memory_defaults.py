"""The memory model without a measured profile: block costs derived from the graph's shapes, a stage's
memory split into its parts, and frozen weights charged at their storage precision.

`confidant estimate` answers "will it fit" before any device was profiled, so it prices the graph
with the planner's own memory model (planner.cost) fed by a profile made from the graph
(`default_profile`) instead of a measured one:
- a block's workspace is what its forward leaves for its backward: every value its compute nodes
  produce (the per-op caches an engine keeps; an upper bound, since some ops keep less), plus its
  weight gradients (`stacked`), plus its largest single value as the one backward temporary
  (`transient`); a further micro-batch in flight on a device that keeps activations adds the caches
  again (`kept`);
- the engine is MNN on the CPU, the default engine, which recomputes the activations of micro-batches
  in flight (`planner.cost.DEFAULT_ACTIVATIONS`);
- the idle runtime is DEFAULT_RUNTIME_BYTES;
- times are nominal (FLOPs at one speed, backward twice the forward plus MNN's re-run of it): they
  only choose where the planner cuts, as identical devices would.
A measured profile replaces all of this; `with_profile_costs` fills only what a profile lacks (a
LoRA model's blocks priced by a full fine-tuning profile, whose signatures differ).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import numpy as np

from ir.attention_fusion import fusable_site
from ir.backend import parse_backend
from ir.graph import Block, Graph, block_signature
from ir.ops import REMADE_FROM_INPUTS
from ir.precision import QuantizedTensor, bytes_per_frozen_element, lookup_tables, quantizable, storage_for
from ir.profile import BackendProfile, BlockCost, DeviceProfile
from planner.cluster import DeviceSpec, runtime_bytes
from planner.cost import (LOSS_CHUNK_BYTES, OPTIMIZER_STATE_COPIES, STASHED_VERSION_COPIES, WEIGHT_COPIES,
                          async_extra_copies, block_input_bytes, check_blocks, double_held_bytes, engine_bytes,
                          fused_loss_hidden_bytes, gradient_copies, holds_base_mapped, in_flight_microbatches,
                          looked_up_only, mapped_frozen_bytes,
                          stage_memory_bytes, stage_params_bytes, stashed_weight_versions, transient_bytes,
                          workspace_of)

# Resident memory of an idle worker runtime with MNN and a ZeroMQ link up, as
# `runtime.profiling.memory.runtime_overhead_bytes` measured it on the development machine (55.4 MiB).
DEFAULT_RUNTIME_BYTES = 56 * 2**20
DEFAULT_BACKEND = "mnn:cpu:t1"
# Nominal seconds per FLOP: only the ratio between blocks matters (where the cuts go).
NOMINAL_S_PER_FLOP = 1e-10
MIN_BLOCK_S = 1e-6
UNLIMITED_BYTES = 2 ** 62


# What the LM head fused with its causal-LM loss holds of its logits at a time: one chunk
# (`planner.cost.LOSS_CHUNK_BYTES`), and for a head held quantized one chunk of its rows widened beside it.
def _fused_head_bytes(graph: Graph, block: Block, chunk_bytes: int) -> int | None:
    """What an LM head fused with its loss (`planner.cost.fused_loss_hidden_bytes`) holds of its logits
    while the loss runs a chunk at a time (`runtime.engines.lm_loss`), for the target positions of a
    micro-batch (`Graph.target_positions`, else every position): a float32 head a chunk of positions'
    logits; a quantized one (`_quantized_head_bytes`) a chunk of its vocabulary rows widened and their
    logits, with what widening a chunk holds beside them. None for any other block."""
    if fused_loss_hidden_bytes(graph) is None or block.index != len(graph.blocks) - 2:
        return None
    last = graph.node(block.nodes[-1])
    logits = graph.values[last.outputs[0]]
    vocab = int(logits.shape[-1])
    targets = graph.target_positions or int(np.prod(logits.shape[:-1]))
    weight = graph.constants[last.inputs[1]]
    if not isinstance(weight, QuantizedTensor):
        return min(4 * targets * vocab, chunk_bytes)
    return _quantized_head_bytes(weight, vocab, targets, chunk_bytes)


def fused_head_chunk_bytes(graph: Graph) -> int | None:
    """What the graph's LM head fused with its loss holds of its logits at a time in the engines'
    chunks (`_fused_head_bytes` at `LOSS_CHUNK_BYTES`); None without one."""
    if len(graph.blocks) < 2:
        return None
    return _fused_head_bytes(graph, graph.blocks[-2], LOSS_CHUNK_BYTES)


def _quantized_head_bytes(weight: QuantizedTensor, vocab: int, targets: int, chunk_bytes: int) -> int:
    """The peak of `runtime.engines.lm_loss.quantized_linear_cross_entropy` over a head held quantized
    ([vocab, H] storage rows) for `targets` target rows, as it allocates: a chunk of `rows` vocabulary
    rows (so many that the larger of the widened rows and their logits is a chunk) widened into one
    float32 buffer [rows, padded H], the chunk's logits [targets, rows] (the last chunk's still held
    while the next is widened and while the next's are computed), and inside the widening
    (`ir.precision.QuantizedTensor.widen_storage_rows`) an int4 chunk's codes unpacked a byte each beside
    the one nibble's temporary (half that) or its float32 scales (and int4's offsets), an int8 chunk's
    scales, a bfloat16 chunk its codes widened to 32 bits before the shift; and the target rows' hidden state
    and the running sum of their gradients [targets, H]. SmolLM2 under an int4 base (its tied head a
    table, held int8: `ir.precision`), 576 x 49152, 93 targets: 42.75 MiB, where rows and logits alone
    (the older charge) were 37.16; the kernel alone in a new interpreter peaks 42.68-42.70 MiB above its
    start (an int4 head of that shape: 49.57 modelled, 49.45 measured), the loss's forward in
    `train-local` 41.0 above its own (benchmarks/MEMORY_NOTES.md, helper h91)."""
    hidden = int(weight.size) // vocab
    rows = min(vocab, max(64, chunk_bytes // (4 * max(targets, hidden, 1))))
    padded = int(weight.codes.shape[1]) * (2 if weight.storage == "int4" else 1)
    logits = 4 * rows * targets
    earlier = logits if rows < vocab else 0  # the chunk before's logits, until the next's replace them
    scales = 4 * rows * (int(weight.scales.size) // vocab) * (1 if weight.mins is None else 2)
    if weight.storage == "int4":
        widening = rows * padded + max(rows * padded // 2, scales)
    elif weight.storage == "bfloat16":
        widening = 4 * rows * padded  # codes widened to 32 bits, then shifted into a second array
    else:
        widening = scales
    return 4 * rows * padded + earlier + max(widening, logits) + 2 * 4 * targets * hidden


def mnn_held_bytes(graph: Graph, keeping: bool = False) -> int:
    """What the MNN engine's programs hold over a step beyond the memory model's parts
    (`runtime.engines.mnn`), measured by helper h91 (benchmarks/MEMORY_NOTES.md: SmolLM2 LoRA, 4 x 128,
    tracemalloc and VmHWM per phase):
    - a table's lookup rows (`_BlockProgram.feed`: `table[ids]`, or an int4 table's rows widened), fed at
      the forward and held by the program until its next feed: 1.1 MiB;
    - each trained block's backward reads its weights' gradients and its input's gradient as one array
      (`mnn_kernels.GradientProgram.run`, from a concatenation MNN holds while it is read), the weights'
      gradients views of it that the step keeps until the update: every such array stays resident
      whole (SmolLM2: 30 x 1.24 MiB; the backward's RSS rose 37.4 MiB from the loss to the last block,
      37.27 MiB of numpy arrays read there, and a block's backward peaks ~1 MiB over its end). They
      build up while the backward runs, after the LM head + loss has let its chunks go: the larger of
      the two (the fused head's chunks, charged in the workspace) counts, not both. `keeping`: MNN
      keeps its per-op caches (not recomputing per block), and no block lets go of its gradient
      program's buffers (`_BlockProgram.release` runs per block only): the reads of one step are still
      held when the next step's loss makes its chunks, so both count (SmolLM2 int4 LoRA at 4 x 128
      without an evaluation: the first step peaked at 1672 MiB, the second at 1720, the next four
      1721-1722, the resident memory between steps 1644 each time; helper h97). Recomputing per block (not
      `keeping`), the reads held are this step's alone, and the weights' gradients in them are the ones the
      workspace charges (each block's `stacked` part, `default_block_cost`): only the rest is counted here
      (MiniLM full fine-tuning per block, 8 x 32: 420 MiB against 445 planned, and 488 / 485, over, with the
      gradients charged twice; helper h117)."""
    rows = mnn_lookup_rows_bytes(graph)
    inputs = block_input_bytes(graph)
    flats = [inputs[k] + b.params_bytes for k, b in enumerate(graph.blocks) if k > 0 and b.params]
    views = 0  # tried: without the snapshot the per-block steps set the peak, and hold both (0.90-0.93, h126)
    # keeping, the one being read is still MNN's concatenation too; recomputing per block, each block's program
    # lets go of it after its backward (`_BlockProgram.release`), into MNN's buffer pool, where the block's
    # transient (the workspace's) is held: MiniLM per block 8 x 32, the pool at the steps' peak 23.5 MiB against
    # 29.25 charged as the transient, and the step over-charged by ~42 MiB (357 / 398, helper h137)
    read = sum(flats) - views + (max(flats, default=0) if keeping else 0)
    head = fused_head_chunk_bytes(graph)
    return rows + (read if head is None or keeping else max(0, read - head))


def mnn_lookup_rows_bytes(graph: Graph) -> int:
    """The first block's table lookups as `runtime.engines.mnn._BlockProgram.feed` holds them: each looked-up
    table's rows (`table[ids]`, float32) fed at the forward and held by the program until its next feed."""
    first = graph.blocks[0]
    tables = lookup_tables(graph.nodes) & set(graph.constants)
    return sum(4 * int(np.prod(graph.values[graph.node(name).outputs[0]].shape)) for name in first.nodes
               if graph.node(name).op == "Gather" and graph.node(name).inputs[0] in tables)


def mnn_forward_kept_bytes(graph: Graph, blocks: list[Block]) -> int:
    """What a training forward on MNN keeping its per-op caches holds until its backward, as the step charges
    it: `blocks`' caches (`mnn_kept_bytes`) and the lookup rows (`mnn_lookup_rows_bytes`). A one-device run
    that measured that forward (its evaluation before training, on the training engine) charges the measured
    figure in its place (`jobs.common.memory_check.local_check`)."""
    return sum(mnn_kept_bytes(graph, b) for b in blocks) + mnn_lookup_rows_bytes(graph)


# The ops whose results MNN's keeping mode holds no buffer of its own for: its geometry lays a reshape or a
# transpose out as the raster regions of the op that reads it (`mnn_kept_bytes`).
MNN_VIEW_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def mnn_kept_bytes(graph: Graph, block: Block) -> int:
    """What MNN keeping its per-op caches (`runtime.engines.mnn`, not recomputing per block) holds of
    `block`'s forward until its backward: every value its compute nodes produce but the views
    (`MNN_VIEW_OPS`), where the graph-derived profile charges every value (`default_block_cost`'s
    `kept_bytes`). SmolLM2 LoRA at 4 x 128: 43.6 of a layer's 53.7 MiB, 1308 MiB over its 30 layers,
    where the run held 1240-1292 above the same run recomputing per block (benchmarks/MEMORY_NOTES.md,
    helper h97). An exact (erf) GELU holds its erf term beside its output (`mnn_kernels.erf_gelu`, cached
    for the backward: a value the graph does not have), charged as one more output: a MiniLM-shaped layer
    at 8 x 32 held 13.15 MiB against 11.63 charged without it, 1.5 of it the GELU's (helper h128)."""
    kept = 0
    for name in block.nodes:
        node = graph.node(name)
        if node.op in MNN_VIEW_OPS:
            continue
        out = sum(graph.values[o].nbytes for o in node.outputs if o in graph.values)
        erf = node.op == "Gelu" and node.attrs.get("approximate", "none") == "none"
        kept += 2 * out if erf else out
    return kept


# What PyTorch's autograd saves of a node's tensors for its backward, as `runtime.engines.pytorch` runs the
# graph's ops: a product (MatMul, Mul, Div) each operand whose partner needs a gradient (x @ W saves x only
# where W is trained: a frozen base saves no input); these its input where it needs a gradient ...
TORCH_SAVES_INPUT = frozenset({"Pow", "Erf", "Gelu", "Silu", "LayerNorm", "RMSNorm"})
# ... and these their output; adds, means, concatenations, lookups (the indices) and rotary embeddings (by
# constant tables) save nothing of the graph's values; views share their input's storage.
TORCH_SAVES_OUTPUT = frozenset({"Sqrt", "Tanh", "Relu", "Sigmoid", "Softmax", "SoftmaxCrossEntropy"})
TORCH_SAVES_NOTHING = frozenset({"Add", "Sub", "ReduceMean", "Concat", "Gather", "Rotary"})
TORCH_VIEW_OPS = MNN_VIEW_OPS | {"Expand", "Slice"}
# What a forward run node by node leaves as free heap of the values it lets go (`torch_kept_bytes`): a MiniLM
# LoRA layer at 8 x 32 lets 15.0 MiB go and left 5.1 (float32 base) to 6.5 (int4, its widened weights let go
# too) in the heap's extent; the steps of 1-6 layers rose ~10 MiB a layer where autograd saves 4.6 (helper h141).
# By the size of the value let go, against glibc's mmap threshold as the torch engine fixes it
# (`TORCH_MMAP_THRESHOLD_BYTES`): one under half of it half (UNFUSED_FREE_HEAP_SHARE); one between half of it
# and it (8 x 64's 1.5 MiB scores, twice its hidden values: the forward grew 24 MiB a layer where a half charged
# 23.0, helper h146) three quarters; one at or over it a sixth, one at or over twice it none. Such a value is
# mapped on its own (unmapped when let go, no hole) only where no free chunk holds it: in a fresh forward, where
# every value let go counted half charged a MiniLM LoRA layer 29.7 and 37.2 MiB at 4 x 128 and 2 x 256 (its 3 and
# 6 MiB values) where the forward grew 20-21 and 22-23 (helper h146); the steps leave 100-160 MiB of free heap
# (mallinfo2 after each step), which later ones can be carved from. With none of it charged, MiniLM LoRA float32
# at 4 x 128 read 518-532 MiB where 529 was planned (0.98-1.006); with a sixth, 544. A sixth of 2 x 256's 6 MiB
# scores too planned it 532 where it read 478 (0.898); without them, 514 (helper h157: both fits to those shapes'
# readings, not measured value by value)
UNFUSED_FREE_HEAP_SHARE = 0.5
LARGE_FREE_HEAP_SHARE = 0.75
MAPPED_FREE_HEAP_SHARE = 1 / 6
# glibc's mmap threshold as the torch engine fixes it (`runtime.heap.STEADY_MMAP_THRESHOLD_BYTES`, which the
# planner may not import; a test holds the two equal)
TORCH_MMAP_THRESHOLD_BYTES = 2 << 20


def torch_free_heap_bytes(sizes: Iterable[int], saved_elsewhere: int = 0) -> int:
    """The free heap a forward run node by node leaves of the values it lets go (`sizes`, bytes each):
    MAPPED_FREE_HEAP_SHARE of one at or over the engine's mmap threshold and under twice it, none of a larger one,
    LARGE_FREE_HEAP_SHARE of one over half
    of it, half (UNFUSED_FREE_HEAP_SHARE) of the rest, less half of `saved_elsewhere` (what autograd saves beyond
    the values it is keyed by, whose sources are among `sizes`: a LayerNorm's statistics, an RMSNorm's normalised
    input, a view larger than its root, SmolLM2's key and value heads repeated),
    as the charge before took all it saves off."""
    small = sum(n for n in sizes if n <= TORCH_MMAP_THRESHOLD_BYTES // 2)
    large = sum(n for n in sizes if TORCH_MMAP_THRESHOLD_BYTES // 2 < n < TORCH_MMAP_THRESHOLD_BYTES)
    mapped = sum(n for n in sizes if TORCH_MMAP_THRESHOLD_BYTES <= n < 2 * TORCH_MMAP_THRESHOLD_BYTES)
    return (int(UNFUSED_FREE_HEAP_SHARE * max(0, small - saved_elsewhere)) + int(LARGE_FREE_HEAP_SHARE * large)
            + int(MAPPED_FREE_HEAP_SHARE * mapped))


def torch_kept_bytes(graph: Graph, block: Block) -> int:
    """What PyTorch keeping its activations (`runtime.engines.pytorch`, autograd's saved tensors) holds of
    `block`'s forward until its backward: the storages its nodes' backwards need (`TORCH_SAVES_*`, a product
    each operand whose partner needs a gradient), each once however many nodes save it or views of it, less
    the block's input (the activations' charge, `planner.cost.block_input_bytes`); where the graph-derived
    profile charges every value (`default_block_cost`'s `kept_bytes`). An op with no rule here is charged
    its output (never under). A LayerNorm's mean and reciprocal deviation, a float each row, are counted.
    Node by node: an attention PyTorch runs fused (scaled_dot_product_attention) saves its probabilities'
    log-sum-exp where this counts the probabilities (the score matrix, never less). A MiniLM layer at 8 x 32:
    6.02 MiB saved (unique storages under `torch.autograd.graph.saved_tensors_hooks`, its input's 0.375 among
    them) where every value is 14.62 (helper h136).
    A block run node by node (no attention `ir.attention_fusion.fusable_site` fuses: LoRA's adapters on q/k/v/o,
    or none at all, the embeddings) is charged what it saves by the same rules and the free heap its forward leaves
    of what it lets go (`torch_free_heap_bytes`: by each value's size against the engine's mmap threshold): the
    engine lets each value go after its last reader, and the small tensors saved between them (an adapter's
    x @ A, a LayerNorm's statistics) split the holes they leave, so the next layer's values do not fit and the
    heap grows past them (MiniLM LoRA at 8 x 32: the heap's extent grew 9.8-11.1 MiB a layer where its in-use
    bytes grew 4.6; fused, 6.8 against 6.1; helper h141); a value mapped on its own leaves no hole (helpers
    h146, h157)."""
    compute = [n for n in graph.nodes if n.name in {x for b in graph.blocks for x in b.nodes}]
    fused = fusable_site(graph, compute, graph.blocks[-1].output, block) is not None
    # a fused site's pre-norm runs inside the unit, its output held as it is (`TorchStageEngine._attention`)
    saved = backward_read_values(graph, block,
                                 remade_except=frozenset(block.attention.nodes) if fused else frozenset())
    kept = sum(saved.values())
    if fused:
        return kept
    let_go = [graph.values[o].nbytes for name in block.nodes for o in graph.node(name).outputs
              if o in graph.values and o not in saved]
    # saved beyond the values it is keyed by: statistics, a normalised input, a view larger than its root
    elsewhere = kept - sum(graph.values[k].nbytes for k in saved if k in graph.values)
    return kept + torch_free_heap_bytes(let_go, elsewhere)


def backward_read_bytes(graph: Graph, block: Block, remade_except: frozenset[str] | None = None) -> int:
    """What `block`'s backward reads of its forward's values (`TORCH_SAVES_*`: a product each operand whose
    partner needs a gradient, so a product by a frozen weight none of its input; these ops their input or
    output; adds, views and the like nothing), each storage once, the block's input left out (the activations'
    charge), a LayerNorm's statistics counted: autograd's saved tensors (`torch_kept_bytes`), and what MNN's
    re-run of a block recomputing per block keeps for its backward (`mnn_rerun_held_bytes`).
    With `remade_except` (PyTorch's engine, `runtime.engines.pytorch._Remade`): a product by a trainable 2-D
    weight whose input a GELU or LayerNorm node makes (not one `remade_except` names) reads that node's inputs, which
    the node saves anyway, and makes the input again in its backward (MiniLM at 2 x 128: a layer's FFN input
    and GELU output, 1.875 MiB a micro-batch; helper h144)."""
    return sum(backward_read_values(graph, block, remade_except).values())


def backward_read_values(graph: Graph, block: Block, remade_except: frozenset[str] | None = None) -> dict[str, int]:
    """`backward_read_bytes`' storages: bytes by the value each is (a view's root; a LayerNorm's statistics
    under "<node> statistics", an RMSNorm's normalised input under "<node> normalised")."""
    makers = {} if remade_except is None else {
        o: n for o, n in graph.producers().items() if n.op in REMADE_FROM_INPUTS and n.name not in remade_except}
    needs = set(graph.params)
    for node in graph.nodes:  # topological: a value needs a gradient where anything it is made of does
        if any(i in needs for i in node.inputs):
            needs.update(node.outputs)
    root: dict[str, str] = {}
    for node in graph.nodes:
        for o in node.outputs:
            root[o] = root.get(node.inputs[0], node.inputs[0]) if node.op in TORCH_VIEW_OPS and node.inputs else o
    own = {o for name in block.nodes for o in graph.node(name).outputs}
    saved: dict[str, int] = {}

    def save(value: str, key: str | None = None) -> None:
        base = root.get(value, value)
        if base in own and value in graph.values:
            key = key or base
            saved[key] = max(saved.get(key, 0), graph.values[value].nbytes, graph.values[base].nbytes)

    for name in block.nodes:
        node = graph.node(name)
        if node.op in TORCH_VIEW_OPS or node.op in TORCH_SAVES_NOTHING or not any(i in needs for i in node.inputs):
            continue
        if node.op in ("MatMul", "Mul", "Div") and len(node.inputs) == 2:
            a, b = node.inputs
            if (node.op == "MatMul" and a in makers and b in graph.params
                    and len(graph.values[b].shape) == 2):
                for i in makers[a].inputs:
                    save(i)
            elif b in needs:
                save(a)
            if a in needs or node.op == "Div":
                save(b)
        elif node.op in TORCH_SAVES_INPUT:
            save(node.inputs[0])
            if node.op == "RMSNorm":  # the normalised input before its scale too, a storage of its own
                save(node.outputs[0], key=f"{name} normalised")
            elif node.op == "LayerNorm":  # its mean and reciprocal deviation, a float each row
                rows = graph.values[node.outputs[0]].nbytes // max(1, 4 * int(graph.values[node.outputs[0]].shape[-1]))
                saved[f"{name} statistics"] = 8 * rows
        else:  # TORCH_SAVES_OUTPUT, and any op without a rule
            for o in node.outputs:
                save(o)
    return saved


def mnn_rerun_held_bytes(graph: Graph, block: Block) -> int:
    """What MNN's re-run of `block`'s forward (recomputing per block) holds of its values while its backward
    runs, where the block holds a frozen base (LoRA's): the values the backward reads (`backward_read_bytes`:
    a product by a frozen weight reads none of its input, as it makes no weight gradient) and an exact GELU's
    erf term (`mnn_kernels.erf_gelu` keeps it; no graph value); MNN lets each other value go after its last
    reader. A MiniLM LoRA layer at 8 x 32 (r=8 on q/k/v/o, float32 base) held 15.5 MiB in its backward in a
    fresh process, read included, where every value and a gradient of each were charged (38.3); with this, its
    5.7 and a gradient of each, 24.8. Not where the block trains its products' weights in full: there a MiniLM
    layer held 30.2 MiB beside its read, every value and a gradient of each (29.25) held, as the inputs its
    weight gradients read wait with their pieces until the block's gradients are read as one (helper h143)."""
    erf = sum(graph.values[graph.node(name).outputs[0]].nbytes for name in block.nodes
              if graph.node(name).op == "Gelu" and graph.node(name).attrs.get("approximate", "none") == "none"
              and graph.node(name).outputs[0] in graph.values)
    return backward_read_bytes(graph, block) + erf


def default_block_cost(graph: Graph, block: Block, per_block: bool = False,
                       loss_chunk_bytes: int | None = None, gradient_of_each: bool = False,
                       engine: str | None = None) -> BlockCost:
    """A block's cost derived from its shapes (see the module docstring). `per_block`: with the figures
    of an engine recomputing per block too (`BlockCost.per_block_workspace_bytes`): a block then holds
    only its weight gradients beside the others (its input is the activations' charge), and one block
    at a time its forward's re-run and its backward: every value it produces and a gradient of each.
    `loss_chunk_bytes`: an LM head fused with its loss holds its logits a chunk at a time
    (`_fused_head_bytes`), not whole (None: whole, the older charge). `gradient_of_each`: a block's
    backward temporary is a gradient of each value it produced (as recomputing per block charges it),
    not its largest value alone (the older charge). `engine`: the engine the profile is for; on "mnn" a block
    holding a frozen base recomputing per block re-runs its forward keeping only what its backward reads
    (`mnn_rerun_held_bytes`), not every value."""
    produced = [graph.values[o].nbytes for name in block.nodes for o in graph.node(name).outputs if o in graph.values]
    fused = None if loss_chunk_bytes is None else _fused_head_bytes(graph, block, loss_chunk_bytes)
    if fused is not None:  # the logits (the head's last product) never held whole
        produced = produced[:-1] + [fused]
    caches = sum(produced)
    # weight gradients, less the tables only looked up: their gradient is the rows looked up, which
    # the memory model charges itself (`planner.cost.row_gradient_delta_bytes`)
    rows_only = looked_up_only(graph).intersection(block.params)
    stacked = caches + block.params_bytes - sum(int(graph.constants[t].nbytes) for t in rows_only)
    forward = max(block.flops * NOMINAL_S_PER_FLOP, MIN_BLOCK_S)
    gradients = stacked - caches
    # the fused pair's chunks are its whole peak (no temporary beside them); a block's backward
    # recomputing per block holds a gradient of each value beside the values
    again = 0 if fused is not None else caches
    largest = again if gradient_of_each else 0 if fused is not None else max(produced, default=0)
    # recomputing per block, the re-run's values MNN holds through the backward: every value, or where the block
    # holds a frozen base what its backward reads (`mnn_rerun_held_bytes`: MiniLM LoRA int4 per block read 0.86
    # of its figure with every value charged, helper h143)
    rerun = caches
    if per_block and engine == "mnn" and fused is None and block.frozen_bytes > 0:
        rerun = min(caches, mnn_rerun_held_bytes(graph, block))
    return BlockCost(forward_s=forward, backward_s=3 * forward, recompute_s=forward,
                     workspace_bytes=stacked + largest, stacked_bytes=stacked, kept_bytes=caches,
                     per_block_workspace_bytes=gradients + rerun + again if per_block else None,
                     per_block_stacked_bytes=gradients if per_block else None)


def default_profile(graph: Graph, name: str = "defaults", memory_available_bytes: int = UNLIMITED_BYTES,
                    backend: str = DEFAULT_BACKEND, per_block: bool = False,
                    runtime_overhead_bytes: int = DEFAULT_RUNTIME_BYTES,
                    loss_chunk_bytes: int | None = None, gradient_of_each: bool = False) -> DeviceProfile:
    """A profile of `graph` derived from its shapes, on `backend` (see the module docstring; its
    engine decides what the memory model does with activations in flight). `per_block`,
    `loss_chunk_bytes` and `gradient_of_each` as `default_block_cost`'s (a profile without per-block
    figures never offers recomputing per block, so the planner's own choices over nominal profiles
    stay as they were); `runtime_overhead_bytes`: the idle runtime's resident memory."""
    engine = parse_backend(backend).engine
    costs = {block_signature(b): default_block_cost(graph, b, per_block, loss_chunk_bytes, gradient_of_each, engine)
             for b in check_blocks(graph)}
    return DeviceProfile(name, graph.name, graph.batch, graph.seq, (BackendProfile(backend, costs),),
                         memory_available_bytes, runtime_overhead_bytes)


def with_profile_costs(graph: Graph, profile: DeviceProfile, reference: Graph | None = None
                       ) -> tuple[DeviceProfile, tuple[int, ...]]:
    """`profile` with a cost for every block of `graph` on each backend, and the blocks it lacked.
    A lacking block takes the cost the profile has for the block at the same index of `reference`
    (the model before LoRA: the full fine-tuning profile's workspace holds the frozen weights'
    gradients too, so it over-charges), else the cost derived from the shapes."""
    blocks = check_blocks(graph)
    missing: set[int] = set()
    backends = []
    for backend in profile.backends:
        costs = dict(backend.blocks)
        for b in blocks:
            sig = block_signature(b)
            if sig in costs:
                continue
            missing.add(b.index)
            ref = None
            if reference is not None and b.index < len(reference.blocks):
                ref = backend.blocks.get(block_signature(reference.blocks[b.index]))
            costs[sig] = ref if ref is not None else default_block_cost(graph, b)
        backends.append(dataclasses.replace(backend, blocks=costs))
    return dataclasses.replace(profile, backends=tuple(backends)), tuple(sorted(missing))


def with_frozen_precision(graph: Graph, dtype: str) -> Graph:
    """`graph` (its frozen weights float32, as lowered) with each block's frozen bytes charged as
    `--base-dtype dtype` would hold them (`ir.precision`: each frozen 2-D weight a product or a
    lookup reads at `bytes_per_element` of `storage_for` its kind; int4 keeps tables int8)."""
    if dtype == "float32":
        return graph
    can = quantizable(graph.nodes, graph.constants, graph.params)
    tables = lookup_tables(graph.nodes)
    blocks = []
    for b in graph.blocks:
        names = {i for n in b.nodes for i in graph.node(n).inputs if i in can}
        saved = sum(int(graph.constants[i].nbytes)
                    - math.ceil(graph.constants[i].size * bytes_per_frozen_element(storage_for(dtype, i in tables)))
                    for i in names)
        blocks.append(dataclasses.replace(b, frozen_bytes=max(0, b.frozen_bytes - saved)))
    return dataclasses.replace(graph, blocks=tuple(blocks))


def widened_bytes(graph: Graph, dtype: str) -> int:
    """What holding a base below float32 adds at a time: the engines widen one block's frozen
    weights to float32 while it runs and drop the copy, so the largest block's float32 frozen
    bytes (0 for a float32 base), embedding tables left out (a lookup widens only its rows; a tied
    LM head is widened a chunk of rows at a time). `graph`'s constants the float32 ones or those held
    at `dtype` (`ir.precision.QuantizedTensor`, whose `size` is its float32 shape's)."""
    if bytes_per_frozen_element(dtype) == 4.0:
        return 0
    tables = {n.inputs[0] for n in graph.nodes if n.op == "Gather"}
    trainable = set(graph.params)
    widest = 0
    for b in graph.blocks:
        frozen = {i for name in b.nodes for i in graph.node(name).inputs
                  if i in graph.constants and i not in trainable and i not in tables
                  and graph.constants[i].ndim >= 2}
        widest = max(widest, sum(4 * int(graph.constants[i].size) for i in frozen))
    return widest


# The parts of a stage's memory, in the order they are shown.
PARTS = ("weights", "gradients", "optimizer", "frozen", "activations", "workspace", "runtime", "other")
PART_TITLES = {"weights": "trainable weights (and old versions)", "gradients": "gradient sum",
               "optimizer": "optimizer state", "frozen": "frozen weights", "activations": "stashed activations",
               "workspace": "workspace (per-op caches, backward)", "runtime": "runtime and engine",
               "other": "embedding rows, tied sums, corrections"}


def memory_parts(graph: Graph, device: DeviceSpec, first: int, last: int, stage: int, stages: int, schedule: str,
                 microbatches: int, optimizer: str, update_every: int = 1) -> Mapping[str, int]:
    """`planner.cost.stage_memory_bytes` of the stage split into PARTS (bytes); they sum to it
    exactly, `other` taking the model's corrections (row gradients and row state of embedding
    tables, tied sums, tables held once)."""
    total = stage_memory_bytes(graph, device, first, last, stage, stages, schedule, microbatches, optimizer,
                               update_every)
    params = stage_params_bytes(graph, first, last)
    versions = stashed_weight_versions(schedule, stages, stage, microbatches, update_every)
    in_flight = in_flight_microbatches(schedule, stages, stage, microbatches)
    parts = {
        "weights": params * (WEIGHT_COPIES + async_extra_copies(schedule, stages, stage)
                             + STASHED_VERSION_COPIES * versions),
        "gradients": params * gradient_copies(schedule, update_every, microbatches),
        "optimizer": params * OPTIMIZER_STATE_COPIES[optimizer],
        "frozen": (mapped_frozen_bytes(graph, first, last, device) if holds_base_mapped(graph, device) else
                   sum(b.frozen_bytes for b in graph.blocks[first:last + 1]) + double_held_bytes(graph, first, last, device)),
        "activations": sum(block_input_bytes(graph)[first:last + 1]) * in_flight,
        "workspace": workspace_of(graph, device, first, last, in_flight) + transient_bytes(graph, device, first, last),
        "runtime": runtime_bytes(device) + engine_bytes(graph, first, last, device),
    }
    parts["other"] = total - sum(parts.values())
    return parts
