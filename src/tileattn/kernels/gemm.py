"""GEMM ladder (labs/csrc/gemm.cu): the registered instantiations, and the host side of TMA.

Families:
  gemm_fp32   rungs 1-7 (FFMA), sm_90a and sm_80
  gemm_tc     rungs 8-9 (mma.sync + ldmatrix, cp.async), sm_90a and sm_80; rung 9 at 1, 2, 3, 4
              and 6 stages (labs.pipeline uses 1-3; 6 is the "deeper pipeline loses" case)
  gemm_sm90   rung 10 (TMA + mbarrier + wgmma + setmaxnreg) and the TMA self-test probe, sm_90a only

TMA host side (reusable by the Hopper attention kernels; a candidate for tileattn.runtime):
  `tensor_map_2d(tensor, box_rows, box_cols)` encodes a CUtensorMap for a row-major 2-D 16-bit
  CUDA tensor with cuda.bindings' cuTensorMapEncodeTiled (128-byte swizzle, zero fill), and
  `launch_raw(kernel, grid, block, args, smem)` launches with any mix of pointers (Python int),
  np.int32 / np.float32 scalars and TensorMap arguments. cuda.core's `launch` packs only scalars
  and pointers in the cuda.core versions the GPU image may carry (a 128-byte struct needs
  cuda.core's own TensorMapDescriptor, which is newer than some of them), so `launch_raw` calls
  cuLaunchKernel with a kernelParams array it builds itself: one host address per parameter,
  from which the driver copies as many bytes as the kernel image says that parameter has.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from . import Family

# ---- instantiations ---------------------------------------------------------------------------
FP32 = {
    1: "sgemm_naive",
    2: "sgemm_coalesced",
    3: "sgemm_smem<32>",
    4: "sgemm_1d<64, 64, 8, 8>",
    5: "sgemm_2d<64, 64, 8, 8, 8>",
    6: "sgemm_vec<true>",
    7: "sgemm_warptile<true, true>",
}
FP32_VARIANTS = (  # scalar-load fallbacks (unaligned N or K) and the one-idea-at-a-time variants
    "sgemm_vec<false>",
    "sgemm_warptile<false, true>",
    "sgemm_warptile<true, false>",
    "sgemm_warptile<false, false>",
)
SPILLING = "sgemm_2d<128, 128, 8, 16, 16>"  # deliberately too large a per-thread tile: spills

TC_STAGES = (1, 2, 3, 4, 6)
DEFAULT_STAGES = 3


def mma_name(bf16: bool, aligned: bool) -> str:
    return f"hgemm_mma<{str(bf16).lower()}, {str(aligned).lower()}>"


def cp_async_name(bf16: bool, stages: int, aligned: bool) -> str:
    return f"hgemm_cp_async<{str(bf16).lower()}, {stages}, {str(aligned).lower()}>"


def wgmma_name(bf16: bool, bn: int, stages: int) -> str:
    return f"hgemm_tma_wgmma<{str(bf16).lower()}, {bn}, {stages}>"


TC = tuple(
    [mma_name(b, a) for b in (True, False) for a in (True, False)]
    + [cp_async_name(True, s, True) for s in TC_STAGES]
    + [cp_async_name(False, DEFAULT_STAGES, True), cp_async_name(True, DEFAULT_STAGES, False),
       cp_async_name(False, DEFAULT_STAGES, False)]
)
WGMMA_CONFIGS = ((256, 4), (256, 3), (128, 4))  # (BN, stages) for bf16; fp16 gets the first
SM90 = tuple([wgmma_name(True, bn, s) for bn, s in WGMMA_CONFIGS] + [wgmma_name(False, 256, 4), "tma_probe"])

FAMILIES = (
    Family(
        name="gemm_fp32",
        source="labs/gemm.cu",
        instantiations=tuple(FP32.values()) + FP32_VARIANTS + (SPILLING,),
        broken=frozenset({SPILLING}),
    ),
    Family(name="gemm_tc", source="labs/gemm.cu", instantiations=TC),
    Family(name="gemm_sm90", source="labs/gemm.cu", instantiations=SM90, archs=("sm_90a",)),
)

# Rung 10 geometry (must match namespace h100 in gemm.cu).
WGMMA_BM, WGMMA_BK, WGMMA_THREADS = 128, 64, 384


def wgmma_smem_bytes(bn: int, stages: int) -> int:
    return stages * (WGMMA_BM + bn) * WGMMA_BK * 2 + 1024


# ---- TMA host side ----------------------------------------------------------------------------
class TensorMapError(ValueError):
    """A tensor that TMA cannot describe, or cuTensorMapEncodeTiled refused the description."""


@dataclass
class TensorMap:
    """An encoded CUtensorMap (cuda.bindings object) and what it describes; pass it to launch_raw."""

    cu_map: object  # cuda.bindings.driver.CUtensorMap (128 bytes, owns its storage)
    shape: tuple[int, int]
    box: tuple[int, int]  # (rows, cols) in elements
    swizzle_128b: bool
    tensor: object  # keeps the described memory alive as long as the map

    @property
    def address(self) -> int:
        return int(self.cu_map.getPtr())

    def raw_bytes(self) -> bytes:
        return ctypes.string_at(self.address, 128)


def _row_stride(tensor) -> int:
    """Elements between rows; a one-row tensor's stride(0) is arbitrary in torch, so use its width."""
    return tensor.stride(0) if tensor.shape[0] > 1 else tensor.shape[1]


def tma_requirements(tensor) -> str | None:
    """Why a 2-D 16-bit CUDA tensor cannot be a TMA source, or None when it can."""
    import torch

    if tensor.dim() != 2:
        return f"TMA tensor must be 2-D, got shape {tuple(tensor.shape)}"
    if tensor.dtype not in (torch.bfloat16, torch.float16):
        return f"TMA tensor must be bf16 or fp16 here, got {tensor.dtype}"
    if tensor.stride(1) != 1:
        return f"TMA tensor must have a contiguous inner dimension, got strides {tensor.stride()}"
    row_bytes = _row_stride(tensor) * tensor.element_size()
    if row_bytes % 16:
        return (f"TMA needs the row stride to be a multiple of 16 bytes; got {_row_stride(tensor)} elements "
                f"= {row_bytes} bytes (K must be a multiple of 8 for 16-bit data: pad K)")
    if tensor.data_ptr() % 16:
        return f"TMA needs a 16-byte aligned base address, got {tensor.data_ptr():#x}"
    return None


def tensor_map_2d(tensor, box_rows: int, box_cols: int, *, swizzle_128b: bool = True) -> TensorMap:
    """Encode a tiled tensor map for a row-major [rows, cols] bf16/fp16 CUDA tensor.

    Boxes of box_rows x box_cols elements (cols innermost; box_cols * 2 bytes <= 128 with the
    128-byte swizzle), out-of-bounds elements zero-filled, L2 promotion 128 B.
    Raises TensorMapError when TMA cannot describe the tensor or the driver refuses.
    """
    import torch
    from cuda.bindings import driver

    why = tma_requirements(tensor)
    if why:
        raise TensorMapError(why)
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256):
        raise TensorMapError(f"TMA box dimensions must be in [1, 256], got {box_rows} x {box_cols}")
    if swizzle_128b and box_cols * tensor.element_size() > 128:
        raise TensorMapError(f"128B swizzle needs box_cols * elem_size <= 128, got {box_cols * tensor.element_size()}")
    rows, cols = tensor.shape
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t  # cuda.bindings rejects plain ints for the 32-bit lists
    dtype = (driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if tensor.dtype == torch.bfloat16
             else driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    swizzle = (driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle_128b
               else driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE)
    err, cu_map = driver.cuTensorMapEncodeTiled(
        dtype,
        2,
        tensor.data_ptr(),
        [u64(cols), u64(rows)],  # innermost first
        [u64(_row_stride(tensor) * tensor.element_size())],  # rank-1 byte strides (dims 1..)
        [u32(box_cols), u32(box_rows)],
        [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,  # NONE = zero fill
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TensorMapError(
            f"cuTensorMapEncodeTiled failed with {err} for shape {tuple(tensor.shape)} strides {tensor.stride()} "
            f"dtype {tensor.dtype} box {box_rows}x{box_cols} swizzle {'128B' if swizzle_128b else 'none'} "
            f"address {tensor.data_ptr():#x}"
        )
    return TensorMap(cu_map, (rows, cols), (box_rows, box_cols), swizzle_128b, tensor)


def pack_params(args) -> tuple[object, list]:
    """(ctypes void*[] array, keep-alive list) for cuLaunchKernel's kernelParams.

    Python int -> 8-byte pointer; np.int32/np.uint32/np.int64/np.float32 -> that width;
    TensorMap -> its 128 bytes (the driver copies from the CUtensorMap's own storage).
    """
    import numpy as np

    keep: list = []
    addresses: list[int] = []
    for i, a in enumerate(args):
        if isinstance(a, TensorMap):
            keep.append(a)
            addresses.append(a.address)
            continue
        if isinstance(a, bool):
            raise TypeError(f"kernel argument {i}: bool is ambiguous; pass np.int32")
        if isinstance(a, int):
            holder = ctypes.c_uint64(a)
        elif isinstance(a, np.int32):
            holder = ctypes.c_int32(int(a))
        elif isinstance(a, np.uint32):
            holder = ctypes.c_uint32(int(a))
        elif isinstance(a, np.int64):
            holder = ctypes.c_int64(int(a))
        elif isinstance(a, np.float32):
            holder = ctypes.c_float(float(a))
        else:
            raise TypeError(f"kernel argument {i}: unsupported type {type(a).__name__} (int pointer, np.int32, "
                            "np.uint32, np.int64, np.float32 or TensorMap)")
        keep.append(holder)
        addresses.append(ctypes.addressof(holder))
    array = (ctypes.c_void_p * max(1, len(addresses)))(*addresses)
    keep.append(array)
    return array, keep


def launch_raw(kernel, grid, block, args, smem: int = 0) -> None:
    """Launch a tileattn.runtime.LoadedKernel on torch's current stream with cuLaunchKernel.

    For kernels taking TensorMap (CUtensorMap, 128-byte __grid_constant__) parameters. Raises
    RuntimeError with the driver's error name if the launch is refused.
    """
    import torch
    from cuda.bindings import driver

    if smem > kernel._dynamic_smem_limit:
        kernel.reserve_dynamic_smem(smem)
    func = _function_of(kernel)
    params, keep = pack_params(args)
    stream = driver.CUstream(torch.cuda.current_stream(kernel.device_index).cuda_stream)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
    (err,) = driver.cuLaunchKernel(func, *grid, *block, int(smem), stream, ctypes.addressof(params), 0)
    del keep
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernel({kernel.expression}, grid={grid}, block={block}, smem={smem}) failed: {err}")


_functions: dict[int, object] = {}


def _function_of(kernel):
    """The CUfunction for a loaded kernel (cuda.core holds a CUkernel; cuKernelGetFunction maps it
    into the current context)."""
    from cuda.bindings import driver

    key = id(kernel)
    func = _functions.get(key)
    if func is None:
        handle = kernel.kernel.handle
        if isinstance(handle, driver.CUfunction):
            func = handle
        else:
            if not isinstance(handle, driver.CUkernel):  # some cuda.core versions wrap it: take the address
                handle = driver.CUkernel(int(handle))
            err, func = driver.cuKernelGetFunction(handle)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelGetFunction failed for {kernel.expression}: {err}")
        _functions[key] = func
    return func
