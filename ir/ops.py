"""The closed op set of Confidant's graph IR.

Every node of a lowered graph is one of the ops below; anything else is refused at import time with
the node's name. Ops come in two tiers:

* ``compute``: float tensors on the trainable path. Every engine (MNN, PyTorch) implements these,
  forward and backward. Parameters are 2-D (or 1-D) float tensors; shapes are static once batch and
  sequence length are bound.
* ``host``: integer/boolean bookkeeping with no gradient (the attention-mask arithmetic that
  exporters emit, position-id slices). They keep ONNX semantics and are evaluated with numpy by
  ``ir.host_eval``, at plan time to fold constants and at run time for graph inputs such as
  ``attention_mask``. They never touch a parameter.

| op                  | tier    | inputs                     | attributes               | output shape                         |
|---------------------|---------|----------------------------|--------------------------|--------------------------------------|
| Gather              | compute | table (param), ids (int)   | —                        | ids.shape + table.shape[1:]          |
| MatMul              | compute | a, b                       | trans_b: bool            | numpy matmul broadcast (b^T if set)  |
| Add, Sub, Mul, Div  | compute | a, b                       | —                        | numpy broadcast                      |
| Pow                 | compute | x                          | exponent: float          | x.shape                              |
| Sqrt, Erf, Tanh     | compute | x                          | —                        | x.shape                              |
| Relu                | compute | x                          | —                        | x.shape (DistilBERT's classifier)    |
| ReduceMean          | compute | x                          | axes, keepdims           | x.shape reduced                      |
| Softmax             | compute | x                          | axis (non-negative)      | x.shape                              |
| LayerNorm           | compute | x, scale, bias             | epsilon (over last axis) | x.shape                              |
| Gelu                | compute | x                          | approximate: none|tanh   | x.shape                              |
| Transpose           | compute | x                          | perm                     | permuted                             |
| Reshape             | compute | x                          | shape (static, no -1)    | shape                                |
| SoftmaxCrossEntropy | compute | logits, targets            | —                        | [] = -sum(targets * log_softmax)     |
| RMSNorm             | compute | x, scale                   | epsilon (over last axis), offset (default 0) | x.shape: x / sqrt(mean(x^2)+eps) * (s + offset) |
| Sigmoid, Silu       | compute | x                          | —                        | x.shape (Silu: x * sigmoid(x))       |
| Rotary              | compute | x, cos, sin (constants)    | —                        | x.shape: x*cos + rotate_half(x)*sin  |
| Expand              | compute | x                          | shape                    | broadcast(x.shape, shape)            |
| Slice               | compute | x                          | axis, start, end         | x.shape, axis cut to end - start     |
| Concat              | compute | x1, x2, ...                | axis (non-negative)      | shapes joined along axis             |
| TokenCrossEntropy   | compute | logits, ids (int), weights | —                        | [] = sum(w * (lse(logits) - l[ids])) |
| host ops            | host    | ONNX semantics             | ONNX attributes          | numpy result                         |

Host ops (ONNX semantics): Gather, Unsqueeze, Squeeze, Concat, Slice, Cast, Range, ConstantOfShape,
Equal, Greater, GreaterOrEqual, Less, LessOrEqual, And, Or, Not, Where, Expand, Flatten, Reshape,
GatherND, Max, Min, Add, Sub, Mul, Div, Neg, Identity, Transpose, Shape, CumSum,
GatherElements.

The loss is ``SoftmaxCrossEntropy`` over a *targets* tensor (a one-hot of the label, scaled by the
token's weight, zero for unlabelled tokens), so a batch's loss is normalised by the batch's labelled
token count however it is split into micro-batches.

Decoder LLMs (Llama/SmolLM2, GPT-2): ``RMSNorm`` is fused from its decomposed form as LayerNorm is;
``Silu`` from x * Sigmoid(x) (the SwiGLU MLP is down(silu(gate(x)) * up(x)) of plain ops);
``Rotary`` is rotary position embedding with rotate-half (rotate_half(x) = concat(-x[..., d/2:],
x[..., :d/2])) over cos/sin tables folded to constants once batch and sequence are bound;
grouped-query attention's repeated key/value heads are an ``Expand``; GPT-2's fused QKV is a
multi-output ONNX Split, lowered to one ``Slice`` per output. The causal-LM loss is
``TokenCrossEntropy`` over ``target_ids`` (int64 [B, S], a host input) and ``target_weights``
(float32 [B, S], 1/the batch's count of targets where counted, else 0): the same micro-batch
exactness without a one-hot of the vocabulary. Engines compute it without a second vocabulary-sized
copy of the logits (`runtime.engines.lm_loss`).
"""
from __future__ import annotations

COMPUTE_OPS = frozenset(
    {
        "Gather", "MatMul", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Erf", "Tanh", "Relu", "ReduceMean",
        "Softmax", "LayerNorm", "Gelu", "Transpose", "Reshape", "SoftmaxCrossEntropy",
        "RMSNorm", "Sigmoid", "Silu", "Rotary", "Expand", "Slice", "Concat", "TokenCrossEntropy",
    }
)

# compute ops whose output is the loss (a 0-d float), the last block of a lowered graph
LOSS_OPS = frozenset({"SoftmaxCrossEntropy", "TokenCrossEntropy"})
# graph inputs the loss reads: host values (no gradient), fed by the coordinator with each batch
LOSS_INPUTS = ("targets", "target_ids", "target_weights")

HOST_OPS = frozenset(
    {
        "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Range", "ConstantOfShape",
        "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Not", "Where",
        "Expand", "Flatten", "Reshape", "GatherND", "Max", "Min", "Add", "Sub", "Mul", "Div", "Neg",
        "Identity", "Transpose", "Shape", "CumSum", "GatherElements", "Tile", "Abs", "Log",
        "Sign", "Ceil", "Floor", "Clip",
    }
)

ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})
ELEMENTWISE_UNARY = frozenset({"Pow", "Sqrt", "Erf", "Tanh", "Relu", "Gelu", "Sigmoid", "Silu"})
# Ops whose output an engine may make again from their inputs, which their own backward keeps anyway,
# rather than hold it for a product that reads it (runtime.engines.pytorch's `_Remade`; the memory model's
# `planner.memory_defaults.backward_read_bytes` charges the same).
REMADE_FROM_INPUTS = frozenset({"Gelu", "LayerNorm"})


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for x, y in zip((1,) * (len(b) - len(a)) + tuple(a), (1,) * (len(a) - len(b)) + tuple(b)):
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {a} and {b} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def compute_output_shape(op: str, attrs: dict, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape rule of each compute op (the table's last column)."""
    if op == "Gather":
        return tuple(shapes[1]) + tuple(shapes[0][1:])
    if op == "MatMul":
        a, b = shapes
        if attrs.get("trans_b"):
            b = tuple(b[:-2]) + (b[-1], b[-2])
        if a[-1] != b[-2]:
            raise ValueError(f"MatMul inner dimensions differ: {a} @ {b}")
        return _broadcast(tuple(a[:-2]), tuple(b[:-2])) + (a[-2], b[-1])
    if op in ELEMENTWISE_BINARY:
        return _broadcast(shapes[0], shapes[1])
    if op in ELEMENTWISE_UNARY or op in ("Softmax", "LayerNorm", "RMSNorm"):
        return tuple(shapes[0])
    if op == "Rotary":
        if _broadcast(shapes[0], shapes[1]) != tuple(shapes[0]) or _broadcast(shapes[0], shapes[2]) != tuple(shapes[0]):
            raise ValueError(f"Rotary tables {shapes[1]} and {shapes[2]} do not broadcast to {shapes[0]}")
        if shapes[0][-1] % 2:
            raise ValueError(f"Rotary needs an even last dimension, got {shapes[0]}")
        return tuple(shapes[0])
    if op == "Expand":
        return _broadcast(tuple(shapes[0]), tuple(int(d) for d in attrs["shape"]))
    if op == "Slice":
        axis, start, end = int(attrs["axis"]), int(attrs["start"]), int(attrs["end"])
        if not (0 <= axis < len(shapes[0]) and 0 <= start < end <= shapes[0][axis]):
            raise ValueError(f"Slice [{start}:{end}] of axis {axis} does not fit shape {shapes[0]}")
        return tuple(end - start if i == axis else d for i, d in enumerate(shapes[0]))
    if op == "Concat":
        axis = int(attrs["axis"])
        rest = {tuple(d for i, d in enumerate(s) if i != axis) for s in shapes}
        if len(rest) != 1 or not 0 <= axis < len(shapes[0]):
            raise ValueError(f"Concat along axis {axis} of shapes {shapes}")
        return tuple(sum(s[axis] for s in shapes) if i == axis else d for i, d in enumerate(shapes[0]))
    if op == "TokenCrossEntropy":
        if tuple(shapes[0][:-1]) != tuple(shapes[1]) or tuple(shapes[1]) != tuple(shapes[2]):
            raise ValueError(f"TokenCrossEntropy: logits {shapes[0]} do not fit ids {shapes[1]} and weights {shapes[2]}")
        return ()
    if op == "ReduceMean":
        axes = {a % len(shapes[0]) for a in attrs["axes"]}
        keep = attrs.get("keepdims", True)
        return tuple((1 if i in axes else d) for i, d in enumerate(shapes[0]) if keep or i not in axes)
    if op == "Transpose":
        return tuple(shapes[0][p] for p in attrs["perm"])
    if op == "Reshape":
        return tuple(attrs["shape"])
    if op == "SoftmaxCrossEntropy":
        return ()
    raise ValueError(f"no shape rule for compute op {op}")


def compute_flops(op: str, attrs: dict, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> int:
    """Forward FLOPs (multiply-add = 2) of one compute node; data movement counts zero."""
    def numel(s):
        n = 1
        for d in s:
            n *= d
        return n

    if op == "MatMul":
        k = in_shapes[0][-1]
        return 2 * numel(out_shape) * k
    if op in ("Transpose", "Reshape", "Gather", "Expand", "Slice", "Concat"):
        return 0
    per_element = {"LayerNorm": 8, "Gelu": 8, "Softmax": 5, "Erf": 4, "Tanh": 4, "RMSNorm": 5, "Sigmoid": 4,
                   "Silu": 5, "Rotary": 4, "SoftmaxCrossEntropy": 6, "TokenCrossEntropy": 5}.get(op, 1)
    base = numel(in_shapes[0]) if op in ("ReduceMean", "SoftmaxCrossEntropy", "TokenCrossEntropy") else numel(out_shape)
    return per_element * base
