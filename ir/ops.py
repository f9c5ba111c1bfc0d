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
| ReduceMean          | compute | x                          | axes, keepdims           | x.shape reduced                      |
| Softmax             | compute | x                          | axis (non-negative)      | x.shape                              |
| LayerNorm           | compute | x, scale, bias             | epsilon (over last axis) | x.shape                              |
| Gelu                | compute | x                          | approximate: none|tanh   | x.shape                              |
| Transpose           | compute | x                          | perm                     | permuted                             |
| Reshape             | compute | x                          | shape (static, no -1)    | shape                                |
| SoftmaxCrossEntropy | compute | logits, targets            | —                        | [] = -sum(targets * log_softmax)     |
| host ops            | host    | ONNX semantics             | ONNX attributes          | numpy result                         |

Host ops (ONNX semantics): Gather, Unsqueeze, Squeeze, Concat, Slice, Cast, Range, ConstantOfShape,
Equal, Greater, GreaterOrEqual, Less, LessOrEqual, And, Or, Not, Where, Expand, Flatten, Reshape,
GatherND, Max, Min, Add, Sub, Mul, Div, Neg, Identity, Transpose.

The loss is ``SoftmaxCrossEntropy`` over a *targets* tensor (a one-hot of the label, scaled by the
token's weight, zero for unlabelled tokens), so a batch's loss is normalised by the batch's labelled
token count however it is split into micro-batches.
"""
from __future__ import annotations

COMPUTE_OPS = frozenset(
    {
        "Gather", "MatMul", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Erf", "Tanh", "ReduceMean",
        "Softmax", "LayerNorm", "Gelu", "Transpose", "Reshape", "SoftmaxCrossEntropy",
    }
)

HOST_OPS = frozenset(
    {
        "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Range", "ConstantOfShape",
        "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Not", "Where",
        "Expand", "Flatten", "Reshape", "GatherND", "Max", "Min", "Add", "Sub", "Mul", "Div", "Neg",
        "Identity", "Transpose", "Shape",
    }
)

ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})
ELEMENTWISE_UNARY = frozenset({"Pow", "Sqrt", "Erf", "Tanh", "Gelu"})


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
    if op in ELEMENTWISE_UNARY or op in ("Softmax", "LayerNorm"):
        return tuple(shapes[0])
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
    if op in ("Transpose", "Reshape", "Gather"):
        return 0
    per_element = {"LayerNorm": 8, "Gelu": 8, "Softmax": 5, "Erf": 4, "Tanh": 4,
                   "SoftmaxCrossEntropy": 6}.get(op, 1)
    base = numel(in_shapes[0]) if op in ("ReduceMean", "SoftmaxCrossEntropy") else numel(out_shape)
    return per_element * base
