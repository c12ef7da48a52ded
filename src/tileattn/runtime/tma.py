"""TMA tensor maps (CUtensorMap) for the Hopper kernels: encode, check, cache.

A tensor map describes a tiled view of a global tensor of rank 1 to 5 to the bulk tensor copy
engine: element type, sizes, byte strides, the box (the tile one `cp.async.bulk.tensor` moves),
the shared-memory swizzle and what out-of-bounds elements read as. It is passed to a kernel by value
as a 128-byte `const __grid_constant__ CUtensorMap` parameter: hand a `TensorMap` to
`tileattn.runtime.launch` or a `LaunchPlan`.

The hardware's rules, checked here with a clear error before the driver sees them:
- the innermost dimension is contiguous (stride 1), every other byte stride a multiple of 16 and
  below 2^40; the base address 16-byte aligned;
- 1 <= box size <= 256 per dimension; the box's innermost extent a multiple of 16 bytes, and at
  most the swizzle span (32, 64 or 128 bytes) when a swizzle is used.
A size-1 dimension's stride is never applied by the hardware but must still satisfy the rules, and
torch gives such dimensions arbitrary strides, so it is replaced by the extent of the dimensions
inside it.

Encoding costs a driver call (a few microseconds), so maps are cached: a `TensorMapTemplate` holds
a checked layout (dtype, shape, strides, box, swizzle, fill) and its encoded maps by address.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

_SWIZZLES = (0, 32, 64, 128)
_CACHE_LIMIT = 4096


class TensorMapError(ValueError):
    """A tensor that TMA cannot describe, or cuTensorMapEncodeTiled refused the description."""


@dataclass(frozen=True)
class TensorMap:
    """An encoded CUtensorMap (its 128 bytes) and what it describes, outermost dimension first."""

    data: np.ndarray  # 16 x uint64: the CUtensorMap, passed to the kernel by value
    shape: tuple[int, ...]
    strides_bytes: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int
    dtype: object
    # Host address of `data`'s 128 bytes (the driver copies them at launch), read once: numpy's
    # `.ctypes.data` costs ~1 us per read, and a Hopper forward launch passes four maps
    # (docs/runtime.md, "The Hopper forward's launch").
    address: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "address", int(self.data.ctypes.data))


def _data_type(dtype):
    import torch
    from cuda.bindings import driver

    types = driver.CUtensorMapDataType
    table = {
        torch.bfloat16: types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        torch.float16: types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        torch.float32: types.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        torch.int32: types.CU_TENSOR_MAP_DATA_TYPE_INT32,
        torch.uint8: types.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    }
    if dtype not in table:
        raise TensorMapError(f"TMA tensor dtype must be one of {sorted(str(t) for t in table)}, got {dtype}")
    return table[dtype]


def tma_strides_bytes(shape: Sequence[int], strides: Sequence[int], element_size: int) -> tuple[int, ...]:
    """Byte strides TMA gets for a tensor, outermost first (the innermost is the element size). A
    size-1 dimension's stride is never applied, so it gets the span of the dimensions inside it
    rounded up to 16 bytes, which satisfies TMA's rules whatever stride torch reports for it."""
    out = [element_size]
    span = element_size * shape[-1]  # bytes covered by the dimensions inside the current one
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        stride_bytes = stride * element_size if size > 1 else -(-span // 16) * 16
        out.append(stride_bytes)
        span += (size - 1) * stride_bytes
    return tuple(reversed(out))


def tma_requirements(tensor, box: Sequence[int], swizzle: int = 128) -> str | None:
    """Why TMA cannot describe `tensor` with this box and swizzle, or None when it can."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return f"TMA source must be a torch.Tensor, got {type(tensor).__name__}"
    rank = tensor.dim()
    if not 1 <= rank <= 5:
        return f"TMA tensors have rank 1 to 5, got shape {tuple(tensor.shape)}"
    if tensor.device.type != "cuda":
        return f"TMA tensor must be on a CUDA device, got {tensor.device}"
    if len(box) != rank:
        return f"box {tuple(box)} must give one size per dimension of shape {tuple(tensor.shape)}"
    if swizzle not in _SWIZZLES:
        return f"swizzle must be one of {_SWIZZLES} bytes, got {swizzle}"
    if tensor.numel() == 0:
        return f"TMA cannot describe an empty tensor (shape {tuple(tensor.shape)})"
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        return f"TMA needs a contiguous innermost dimension (stride 1), got strides {tensor.stride()}"
    elem = tensor.element_size()
    for dim, stride_bytes in enumerate(tma_strides_bytes(tensor.shape, tensor.stride(), elem)[:-1]):
        if stride_bytes % 16 or not 0 < stride_bytes < 2**40:
            return (f"TMA needs every non-innermost stride to be a positive multiple of 16 bytes below 2^40; "
                    f"dimension {dim} of shape {tuple(tensor.shape)} has stride {tensor.stride(dim)} elements "
                    f"= {tensor.stride(dim) * elem} bytes")
    if tensor.data_ptr() % 16:
        return f"TMA needs a 16-byte aligned base address, got {tensor.data_ptr():#x}"
    for dim, b in enumerate(box):
        if not (isinstance(b, (int, np.integer)) and 1 <= b <= 256):
            return f"box sizes must be integers in [1, 256], got {tuple(box)} (dimension {dim})"
    inner_bytes = box[-1] * elem
    if inner_bytes % 16:
        return f"the box's innermost extent must be a multiple of 16 bytes, got {box[-1]} x {elem} B"
    if swizzle and inner_bytes > swizzle:
        return f"with a {swizzle}-byte swizzle the box's innermost extent must be <= {swizzle} bytes, got {inner_bytes}"
    return None


class TensorMapTemplate:
    """Everything of a tensor map but the address: made (and checked) once per dtype, shape,
    strides, box, swizzle and fill; `encode(address)` gives the TensorMap of a tensor with that
    layout at that address, cached per address (a training loop or an engine reuses a few
    addresses, so a launch plan that holds a template pays the driver's encoding only on the first
    use of each)."""

    def __init__(self, tensor, box: Sequence[int], *, swizzle: int = 128, oob_fill_zero: bool = True):
        why = tma_requirements(tensor, box, swizzle)
        if why:
            raise TensorMapError(why)
        self.dtype = tensor.dtype
        self.shape = tuple(int(s) for s in tensor.shape)
        self.strides_bytes = tma_strides_bytes(self.shape, tensor.stride(), tensor.element_size())
        self.box = tuple(int(b) for b in box)
        self.swizzle = swizzle
        self.oob_fill_zero = oob_fill_zero
        self._encoded: dict[int, TensorMap] = {}

    def encode(self, address: int) -> TensorMap:
        """The map for the tensor of this layout at `address` (16-byte aligned)."""
        hit = self._encoded.get(address)
        if hit is not None:
            return hit
        if address % 16:
            raise TensorMapError(f"TMA needs a 16-byte aligned base address, got {address:#x}")
        tmap = _encode(self, address)
        if len(self._encoded) >= _CACHE_LIMIT:
            self._encoded.clear()
        self._encoded[address] = tmap
        return tmap


def _encode(t: TensorMapTemplate, address: int) -> TensorMap:
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    swizzle_enum = {
        0: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        32: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
        64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
        128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
    }[t.swizzle]
    fill = (driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE if t.oob_fill_zero  # NONE = zeros
            else driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
    rank = len(t.shape)
    err, cu_map = driver.cuTensorMapEncodeTiled(
        _data_type(t.dtype),
        rank,
        address,
        [u64(s) for s in reversed(t.shape)],  # the driver wants the innermost dimension first
        [u64(s) for s in reversed(t.strides_bytes[:-1])],  # rank - 1 byte strides, dimensions 1..
        [u32(b) for b in reversed(t.box)],
        [u32(1)] * rank,  # element strides: every element of the box
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle_enum,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        fill,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TensorMapError(
            f"cuTensorMapEncodeTiled failed with {err} for shape {t.shape}, byte strides {t.strides_bytes}, "
            f"dtype {t.dtype}, box {t.box}, swizzle {t.swizzle}, address {address:#x}"
        )
    return TensorMap(np.array(cu_map.opaque, dtype=np.uint64), t.shape, t.strides_bytes, t.box, t.swizzle, t.dtype)


_templates: dict[tuple, TensorMapTemplate] = {}


def tensor_map(tensor, box: Sequence[int], *, swizzle: int = 128, oob_fill_zero: bool = True) -> TensorMap:
    """A tiled TMA descriptor for a CUDA tensor of rank 1 to 5 (bf16, fp16, fp32, int32, uint8).

    `box` gives the tile size per dimension, outermost first like `tensor.shape`. Elements outside
    the tensor read as zero (`oob_fill_zero`, else NaN for floats) and are never written by a TMA
    store. `swizzle` is the shared-memory swizzle span in bytes (0, 32, 64, 128). The map holds the
    tensor's address: it is valid as long as that memory is.

    Raises TensorMapError (a ValueError) when TMA cannot describe the tensor (see the module
    docstring) or the driver refuses the description.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TensorMapError(f"TMA source must be a torch.Tensor, got {type(tensor).__name__}")
    key = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tuple(box), swizzle, oob_fill_zero, tensor.device)
    template = _templates.get(key)
    if template is None:
        template = TensorMapTemplate(tensor, box, swizzle=swizzle, oob_fill_zero=oob_fill_zero)
        if len(_templates) >= _CACHE_LIMIT:
            _templates.clear()
        _templates[key] = template
    elif tensor.data_ptr() % 16:
        raise TensorMapError(f"TMA needs a 16-byte aligned base address, got {tensor.data_ptr():#x}")
    return template.encode(tensor.data_ptr())
