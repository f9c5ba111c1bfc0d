"""What one frozen weight element costs in memory at each storage precision (DESIGN: "a frozen weight
has a storage precision"): the one formula the memory model, the estimate and the engines share.

Blockwise integer formats keep one float32 scale per QUANT_BLOCK consecutive elements (as GGUF's
Q8_0/Q4_0 and bitsandbytes' blockwise schemes do), so int8 costs 1 + 4/64 bytes an element and int4
0.5 + 4/64. Trainable tensors stay float32 whatever the base's precision.
"""
from __future__ import annotations

import math

BASE_DTYPES = ("float32", "bfloat16", "int8", "int4")
QUANT_BLOCK = 64          # elements per blockwise scale
SCALE_BYTES = 4           # one float32 scale per block
_VALUE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}


def check_base_dtype(dtype: str) -> str:
    if dtype not in _VALUE_BYTES:
        raise ValueError(f"base dtype {dtype!r} is not one of {', '.join(BASE_DTYPES)}")
    return dtype


def bytes_per_frozen_element(dtype: str) -> float:
    """Bytes one frozen element takes at `dtype`, its share of the blockwise scale included."""
    check_base_dtype(dtype)
    scale = SCALE_BYTES / QUANT_BLOCK if dtype in ("int8", "int4") else 0.0
    return _VALUE_BYTES[dtype] + scale


def frozen_tensor_bytes(numel: int, dtype: str) -> int:
    """Bytes of one frozen tensor of `numel` elements at `dtype` (whole bytes, a last partial block
    still has its scale)."""
    check_base_dtype(dtype)
    if dtype in ("int8", "int4"):
        return math.ceil(numel * _VALUE_BYTES[dtype]) + SCALE_BYTES * math.ceil(numel / QUANT_BLOCK)
    return int(numel * _VALUE_BYTES[dtype])
