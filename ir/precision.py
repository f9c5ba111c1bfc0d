"""Storage precision of frozen weights: float32, bfloat16, or int8 / int4 blockwise (QLoRA-style).

A frozen weight (LoRA's base) is never stepped, so it can be held smaller than the float32 the
engines compute in; a trainable tensor always stays float32. The scheme, the one every engine, the
planner's memory model and `confidant estimate` use:

- `float32`: the array as is, 4 bytes an element.
- `bfloat16`: the top 16 bits of each float32, rounded to nearest even; 2 bytes an element.
- `int8`: symmetric blockwise. A 2-D weight is cut into blocks of `BLOCK` (32) consecutive
  elements along its *input* dimension (the one a product sums over: rows of x @ W's W [in, out],
  columns of a [out, in] weight read transposed and of an embedding table); each block has one
  scale s = max|w| / 127, held as float16, and each element the integer q = round(w / s) clipped
  to [-127, 127]; the weight the engines compute with is exactly q * s (float32). 1 + 2/32 =
  1.0625 bytes an element (llama.cpp's Q8_0 layout).
- `int4`: asymmetric blockwise, the same blocks: a float16 step d = (max - min) / 15 and a float16
  offset m = min per block, codes q = round((w - m) / d) in [0, 15], two to a byte (the lower
  nibble first); the weight is exactly q * d + m. 0.5 + 4/32 = 0.625 bytes an element: llama.cpp's
  Q4_1, the format SmolLM2's shipped GGUF is in, so a model dequantized from Q4_1 comes back to
  the very weights it was shipped as (measured: SmolLM2 LoRA's first loss 0.8966 at float32 and
  int8, 0.8966 at this int4; 1.3336 with a symmetric 15-level int4, Q4_0-style, which re-rounds
  every Q4_1 block: benchmarks/memory_quantized.py).
- A dimension that is not a multiple of the block is padded with zeros (held, never read).
- Quantizing a dequantized weight gives back the same codes and scales: the scale (and offset) are
  float16 values re-derived exactly from the dequantized block's extremes, which the codes 0/15
  (int4) or +-127 (int8) reproduce. So a bundle can carry the widened values and a device
  quantize them again to the very same weight: `quantize(dequantize(q)) == q`. (An int4 block
  whose spread is below float16's resolution of its offset, ~1e-3 of its magnitude, is the
  exception; weights do not have such blocks.)

Only 2-D float weights read by a product or a lookup are quantized (`quantizable`); norms, biases
and anything 1-D stay float32 (a rounding of a scale vector is not worth its bytes). Under `int4`,
an embedding table (a lookup's, and so a tied LM head) is held `int8` (`storage_for`): as
llama.cpp's 4-bit files keep it at 6-8 bits, since every token's row and every logit read it.
Measured on SmolLM2 (its GGUF's projections are Q4_1, its table Q8_0): int4 gives back 210 of its
211 frozen weights exactly; the table alone, at int4, moved the first LoRA loss from 0.8966 to
0.8350.

`bytes_per_element(dtype)` is the one number the memory model charges a frozen element at: keep it
the single source of truth. Standard library and numpy only (the `ir` rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ir.mapped_pages import PagesGivenBack

BASE_DTYPES = ("float32", "bfloat16", "int8", "int4")
BLOCK = 32
_QMAX = {"int8": 127}
_INT4_LEVELS = 15
_SCALE_BYTES = 2  # float16 scales (and int4's float16 offsets)


def bytes_per_element(dtype: str, block: int = BLOCK) -> float:
    """Bytes one frozen element costs held at `dtype` (codes plus its share of the block's scale)."""
    if dtype == "float32":
        return 4.0
    if dtype == "bfloat16":
        return 2.0
    if dtype == "int8":
        return 1.0 + _SCALE_BYTES / block
    if dtype == "int4":
        return 0.5 + 2 * _SCALE_BYTES / block
    raise ValueError(f"base dtype {dtype!r} is not one of {', '.join(BASE_DTYPES)}")


# `confidant estimate`'s names for the same figures (it prices a base it never quantizes)
QUANT_BLOCK = BLOCK


def bytes_per_frozen_element(dtype: str) -> float:
    """`bytes_per_element` at the engines' block (the estimate's name for it)."""
    return bytes_per_element(dtype)


def frozen_tensor_bytes(numel: int, dtype: str, block: int = BLOCK) -> int:
    """Bytes one frozen tensor of `numel` elements (one row of blocks) takes at `dtype`, as
    `quantize` holds it: a last partial block padded and with its scale (and int4 offset)."""
    check_base_dtype(dtype)
    if dtype in ("float32", "bfloat16"):
        return int(numel * bytes_per_element(dtype))
    blocks = -(-int(numel) // block)
    per_block = (block if dtype == "int8" else block // 2) + _SCALE_BYTES * (1 if dtype == "int8" else 2)
    return blocks * per_block


def check_base_dtype(dtype: str) -> str:
    """`dtype` if it is a storage precision, else ValueError naming the choices."""
    if dtype not in BASE_DTYPES:
        raise ValueError(f"base dtype {dtype!r} is not one of {', '.join(BASE_DTYPES)}")
    return dtype


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A frozen 2-D weight held at `dtype` (bfloat16, int8, int4). `codes` and `scales` are in
    *storage layout*: the blocked axis (`axis` of the logical shape) last, i.e. [rows, padded cols]
    where rows run over the other axis; int4 packs two codes a byte ([rows, padded cols / 2]);
    `scales` [rows, padded cols / block] float16 (empty for bfloat16, whose codes are uint16);
    `mins` int4's offsets, shaped as `scales` (None for the others).

    It answers `shape`, `ndim`, `size`, `dtype` (float32: what it computes as) like the float32
    array it stands for, `nbytes` with its storage, and `np.asarray(q)` (or `astype`) widens it
    whole, so code that does not know the format still computes the right numbers, only bigger.
    Precision-aware engines widen it a slice of rows at a time (`widen_rows`, `widen_range`)."""

    codes: np.ndarray
    scales: np.ndarray
    shape: tuple[int, int]
    storage: str
    axis: int
    block: int = BLOCK
    mins: np.ndarray | None = None

    dtype = np.dtype(np.float32)
    ndim = 2

    @property
    def size(self) -> int:
        return int(self.shape[0]) * int(self.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(self.scales.nbytes) + (0 if self.mins is None else int(self.mins.nbytes))

    @property
    def rows(self) -> int:
        """Rows of the storage layout (the logical axis that is not blocked)."""
        return int(self.shape[1 - self.axis])

    @property
    def cols(self) -> int:
        return int(self.shape[self.axis])

    def __len__(self) -> int:
        return int(self.shape[0])

    def __array__(self, dtype=None, copy=None):
        out = dequantize(self)
        return out if dtype is None else out.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return dequantize(self).astype(dtype, copy=False)

    def widen_storage_rows(self, index, out: np.ndarray | None = None) -> np.ndarray:
        """Float32 [n, cols] of storage rows `index` (a slice or integer array), in storage layout.
        `out`: a float32 buffer of at least n x (blocks x block) elements to widen into (an LM head's
        chunks reuse one: a fresh 33 MB array per chunk cost SmolLM2's int8 head its page faults);
        the result is then a view of it."""
        codes = self.codes[index]
        if self.storage == "bfloat16":
            return (codes.astype(np.uint32) << 16).view(np.float32)
        if self.storage == "int4":
            unpacked = np.empty((codes.shape[0], codes.shape[1] * 2), np.uint8)
            unpacked[:, 0::2] = codes & 0x0F
            unpacked[:, 1::2] = codes >> 4
            codes = unpacked
        scales = self.scales[index].astype(np.float32)
        n = codes.shape[0]
        blocks = codes.reshape(n, -1, self.block)
        if out is None:
            out = blocks.astype(np.float32) * scales[:, :, None]
        else:
            out = out.reshape(-1)[:blocks.size].reshape(blocks.shape)
            np.multiply(blocks, scales[:, :, None], out=out)
        if self.mins is not None:
            out += self.mins[index].astype(np.float32)[:, :, None]
        return out.reshape(n, -1)[:, :self.cols]

    def widen_range(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Storage rows lo..hi as a float32 [hi - lo, cols] array (one chunk of an LM head's rows),
        widened into `out` where given (`widen_storage_rows`)."""
        return self.widen_storage_rows(slice(lo, hi), out)

    def widen_rows(self, ids) -> np.ndarray:
        """Logical rows `ids` of a weight blocked along axis 1 (an embedding table): [len(ids), cols]."""
        if self.axis != 1:
            raise ValueError("row lookups need a weight blocked along its second axis")
        ids = np.asarray(ids)
        flat = self.widen_storage_rows(ids.reshape(-1))
        return flat.reshape(*ids.shape, self.cols)


def _to_bfloat16_bits(w: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(w, np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)  # round to nearest, ties to even
    return ((bits + rounding) >> 16).astype(np.uint16)


def quantize(w: np.ndarray, storage: str, axis: int = 0, block: int = BLOCK,
             after_chunk: "Callable[[int], None] | None" = None) -> "QuantizedTensor | np.ndarray":
    """`w` (2-D float) held at `storage`, blocked along `axis` (its input dimension); float32
    gives the float32 array back. Raises ValueError for a weight a float16 scale cannot hold.
    Rows are quantized a chunk at a time (each row's blocks are independent), so the work arrays
    are a few MiB whatever the weight's size: an export quantizes a 1 GiB embedding table without
    holding several float32 copies of it. `w` may also be a tensor in a file (`read_rows(lo, hi)`, `read()`,
    `shape`: `ir.safetensors.FileTensor`): blocked along axis 1, only a chunk of its rows is ever read.
    `after_chunk(nbytes)` is told the float32 bytes of each chunk once it is quantized (a reader of
    mapped weights gives their pages back as it goes: `quantize_frozen`)."""
    check_base_dtype(storage)
    read_rows = getattr(w, "read_rows", None)  # a tensor read from its file (ir.safetensors.FileTensor)
    if read_rows is not None and axis == 1 and storage != "float32" and len(w.shape) == 2:
        shape = tuple(w.shape)  # blocked along its rows' elements: read a chunk of rows at a time
    else:
        w = np.asarray(w.read() if read_rows is not None else w)
        if w.dtype != np.float32 and storage == "float32":
            w = w.astype(np.float32)
        if storage == "float32":
            return w
        if w.ndim != 2 or axis not in (0, 1):
            raise ValueError(f"only 2-D weights are quantized (got shape {w.shape}, axis {axis})")
        shape, stored = tuple(w.shape), (w if axis == 1 else w.T)
        read_rows = lambda lo, hi: stored[lo:hi]  # noqa: E731
    if storage != "bfloat16" and block % 2:
        raise ValueError(f"block {block} must be even")
    rows, cols = shape if axis == 1 else shape[::-1]
    padded = cols if storage == "bfloat16" else -(-cols // block) * block
    width = padded // 2 if storage == "int4" else padded
    codes = np.empty((rows, width), {"bfloat16": np.uint16, "int8": np.int8, "int4": np.uint8}[storage])
    scales = np.empty((rows, 0 if storage == "bfloat16" else padded // block), np.float16)
    mins = np.empty_like(scales) if storage == "int4" else None
    step = max(1, _CHUNK_ELEMENTS // max(padded, 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        part = np.asarray(read_rows(lo, hi), np.float32)
        if not np.isfinite(part).all():
            raise ValueError("a weight to quantize has a NaN or an infinity")
        if storage == "bfloat16":
            codes[lo:hi] = _to_bfloat16_bits(part)
            continue
        got = _quantize_rows(part, storage, padded, block)
        codes[lo:hi], scales[lo:hi] = got[0], got[1]
        if mins is not None:
            mins[lo:hi] = got[2]
        if after_chunk is not None:
            after_chunk(part.nbytes)
    return QuantizedTensor(codes, scales, shape, storage, axis, block, mins)


_CHUNK_ELEMENTS = 1 << 20  # float32 elements a chunk of rows is quantized in (4 MiB, a few work arrays)


def _quantize_rows(stored: np.ndarray, storage: str, padded: int, block: int) -> tuple:
    """(codes, scales[, mins]) of float32 rows `stored` [rows, cols] at int8 or int4."""
    rows, cols = stored.shape
    x = np.zeros((rows, padded), np.float32)
    x[:, :cols] = stored
    if padded != cols:  # the padding repeats a real element: it widens no block's range
        x[:, cols:] = stored[:, -1:]
    x = x.reshape(rows, padded // block, block)
    if storage == "int4":
        low, high = x.min(axis=2), x.max(axis=2)
        if (np.abs(np.stack([low, high])) > np.finfo(np.float16).max).any():
            raise ValueError(f"a weight of magnitude {np.abs(x).max():.3g} is beyond what a float16 block offset holds")
        mins = low.astype(np.float16)
        m = mins.astype(np.float32)
        scales = ((high - m) / _INT4_LEVELS).astype(np.float16)
        d = scales.astype(np.float32)
        safe = np.where(d > 0, d, 1.0)
        q = np.clip(np.rint((x - m[:, :, None]) / safe[:, :, None]), 0, _INT4_LEVELS).astype(np.uint8)
        q = q.reshape(rows, padded)
        return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), scales, mins
    qmax = _QMAX[storage]
    absmax = np.abs(x).max(axis=2)
    if (absmax / qmax > np.finfo(np.float16).max).any():
        raise ValueError(f"a weight of magnitude {absmax.max():.3g} is beyond what a float16 block scale holds")
    scales = (absmax / qmax).astype(np.float16)
    s = scales.astype(np.float32)
    safe = np.where(s > 0, s, 1.0)
    return np.clip(np.rint(x / safe[:, :, None]), -qmax, qmax).astype(np.int8).reshape(rows, padded), scales


def dequantize(q: "QuantizedTensor | np.ndarray") -> np.ndarray:
    """The float32 weight `q` stands for (a float32 array is returned as is)."""
    if not isinstance(q, QuantizedTensor):
        return np.asarray(q, np.float32)
    stored = q.widen_storage_rows(slice(None))
    return np.ascontiguousarray(stored if q.axis == 1 else stored.T)


def stored_arrays(value) -> tuple:
    """The arrays a constant's bytes lie in: a QuantizedTensor's storage arrays (codes, scales, int4's
    offsets), else the value itself (what a reader of a mapped base gives the pages of back)."""
    if isinstance(value, QuantizedTensor):
        return (value.codes, value.scales) + (() if value.mins is None else (value.mins,))
    return (value,)


def storage_of(value) -> str:
    """The storage precision of a constant: its QuantizedTensor's, else float32."""
    return value.storage if isinstance(value, QuantizedTensor) else "float32"


def held_bytes(shape, dtype: str, block: int = BLOCK) -> int:
    """Bytes a frozen weight of `shape` takes held at `dtype` (the memory model's per-weight term):
    elements x `bytes_per_element` for a 2-D weight (what `quantizable` can pick), 4 an element
    for anything else (kept float32). The padding of a partial last block is not charged (model
    dimensions are multiples of 32)."""
    shape = tuple(int(d) for d in shape)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(shape) != 2:
        return numel * 4
    return int(np.ceil(numel * bytes_per_element(dtype, block)))


def storage_for(storage: str, is_table: bool) -> str:
    """The precision a frozen weight is held at under `--base-dtype storage`: int4 keeps an
    embedding table (one a lookup reads) at int8 (module note); every other case is `storage`."""
    return "int8" if storage == "int4" and is_table else storage


def lookup_tables(graph_nodes) -> set[str]:
    """The constants a lookup (Gather) reads as its table."""
    return {n.inputs[0] for n in graph_nodes if n.op == "Gather"}


def quantizable(graph_nodes, constants: Mapping[str, np.ndarray], params) -> dict[str, int]:
    """Frozen constants worth holding quantized -> the axis to block along (their input dimension):
    2-D float constants that are not trainable and that only products (as the weight) and lookups
    (as the table) read. An embedding table, and a weight read transposed ([out, in]), block along
    axis 1; a weight read as x @ W ([in, out]) along axis 0. A weight read both ways keeps float32."""
    params = set(params)
    axes: dict[str, set[int]] = {}
    other: set[str] = set()
    for n in graph_nodes:
        for k, i in enumerate(n.inputs):
            if i not in constants or i in params:
                continue
            if n.op == "MatMul" and k == 1:
                axes.setdefault(i, set()).add(1 if n.attrs.get("trans_b") else 0)
            elif n.op == "Gather" and k == 0:
                axes.setdefault(i, set()).add(1)
            else:
                other.add(i)
    out = {}
    for name, seen in axes.items():
        v = constants[name]
        if name in other or len(seen) != 1 or getattr(v, "ndim", 0) != 2 or np.dtype(v.dtype).kind != "f":
            continue
        out[name] = seen.pop()
    return out


def quantize_frozen(nodes, constants: Mapping[str, np.ndarray], params, storage: str) -> dict[str, np.ndarray]:
    """`constants` with every `quantizable` frozen weight held at `storage` (a new mapping; the
    others are the same arrays). Already-quantized ones are widened and quantized again, which
    gives back the same weight (see the module's note), so a bundle's float32 copy round-trips.
    Weights mapped from a model file (`planner.onnx_weights.map_raw`) have their pages given back
    every `RELEASE_EVERY` bytes read: the quantized base and one chunk's pages are resident at a
    time, not the float32 file (a coordinator quantizing an int4 base held the whole file's pages)."""
    check_base_dtype(storage)
    out = dict(constants)
    if storage == "float32":
        return out
    nodes = list(nodes)
    tables = lookup_tables(nodes)
    pages = PagesGivenBack()
    for name, axis in quantizable(nodes, constants, params).items():
        value, held = constants[name], storage_for(storage, name in tables)
        if isinstance(value, QuantizedTensor) and value.storage == held:
            continue
        out[name] = quantize(dequantize(value), held, axis, after_chunk=lambda n, v=value: pages.read(v, n))
    pages.done()
    return out


def frozen_precisions(constants: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Constant name -> storage precision, for those held other than float32."""
    return {k: v.storage for k, v in constants.items() if isinstance(v, QuantizedTensor)}


def base_dtype_of(constants: Mapping[str, np.ndarray]) -> str:
    """The `--base-dtype` a graph's frozen weights were held at: the narrowest precision among them
    (int4 keeps tables int8), float32 when none is quantized."""
    held = set(frozen_precisions(constants).values())
    return next((t for t in ("int4", "int8", "bfloat16") if t in held), "float32")


# --- the storage form in files -------------------------------------------------------------------
# A quantized frozen weight NAME is written to a tensor file (a bundle's weights.safetensors, a
# plan's base.safetensors) as its storage arrays, never widened: `NAME.q_codes` (int8 codes, int4
# codes packed two to a byte as uint8, bfloat16 bit patterns as uint16), `NAME.q_scales` (float16,
# [rows, blocks]; [rows, 0] for bfloat16) and, for int4 only, `NAME.q_mins` (float16, as scales).
# The graph document records its storage, blocked axis and block (`ir.serialize`), its logical
# shape in the constants table; so a file's SHA-256 covers exactly the bytes the engines compute
# from, and a reader rebuilds the QuantizedTensor from them without widening anything.
PIECES = ("q_codes", "q_scales", "q_mins")
_CODES_DTYPE = {"bfloat16": np.uint16, "int8": np.int8, "int4": np.uint8}


def storage_piece_names(name: str, storage: str) -> tuple[str, ...]:
    """The tensor names a weight held at `storage` is written as."""
    check_base_dtype(storage)
    if storage == "float32":
        return (name,)
    return tuple(f"{name}.{p}" for p in (PIECES if storage == "int4" else PIECES[:2]))


def storage_tensors(name: str, value) -> dict[str, np.ndarray]:
    """The tensors a constant is written as: a QuantizedTensor's storage arrays, else itself."""
    if not isinstance(value, QuantizedTensor):
        return {name: value}
    arrays = (value.codes, value.scales) + (() if value.mins is None else (value.mins,))
    return dict(zip(storage_piece_names(name, value.storage), arrays))


def from_storage_tensors(name: str, tensors: Mapping[str, np.ndarray], storage: str, axis: int, block: int,
                         shape) -> QuantizedTensor:
    """The QuantizedTensor `storage_tensors` wrote, its arrays taken as they are (no copy); ValueError
    naming the weight when a piece is missing or of the wrong dtype or shape for `shape`."""
    check_base_dtype(storage)
    if storage == "float32" or axis not in (0, 1) or not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"weight {name!r}: storage {storage!r}, axis {axis!r}, block {block!r} is not a "
                         f"quantized layout")
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2:
        raise ValueError(f"weight {name!r}: a quantized weight is 2-D, declared {list(shape)}")
    rows, cols = shape[1 - axis], shape[axis]
    if storage == "bfloat16":
        want = {"q_codes": (np.uint16, (rows, cols)), "q_scales": (np.float16, (rows, 0))}
    else:
        padded = -(-cols // block) * block
        width = padded // 2 if storage == "int4" else padded
        want = {"q_codes": (_CODES_DTYPE[storage], (rows, width)), "q_scales": (np.float16, (rows, padded // block))}
        if storage == "int4":
            want["q_mins"] = want["q_scales"]
    got = {}
    for piece, (dtype, pshape) in want.items():
        key = f"{name}.{piece}"
        if key not in tensors:
            raise ValueError(f"weight {name!r} ({storage}): tensor {key!r} is missing")
        arr = tensors[key]
        if arr.dtype != np.dtype(dtype) or tuple(arr.shape) != pshape:
            raise ValueError(f"weight {name!r} ({storage}): {key} is {arr.dtype}{list(arr.shape)}, expected "
                             f"{np.dtype(dtype)}{list(pshape)}")
        got[piece] = arr
    return QuantizedTensor(got["q_codes"], got["q_scales"], shape, storage, axis, block, got.get("q_mins"))
