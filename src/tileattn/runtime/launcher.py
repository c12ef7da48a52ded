"""Load compiled kernels on the current GPU and launch them on torch's current stream.

Host cost matters (an attention call should spend well under 10 us in Python), so everything that
can be made once is cached: the loaded kernel per (device, source, expression), the cuda.core
Stream wrapper per torch stream handle, and the LaunchConfig per (grid, block, shared memory).
Launching on torch's current stream keeps ordering with torch ops and lets torch.cuda.graph
capture our kernels.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

from .compiler import CompiledModule, compile_cuda

_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in (cuKernelSetAttribute)


class NoGPUError(RuntimeError):
    """No CUDA device is visible to torch."""


class LaunchError(RuntimeError):
    """A launch was refused before reaching the GPU (bad geometry, too much shared memory)."""


def require_gpu() -> int:
    """Index of torch's current CUDA device; NoGPUError when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError(
            "tileattn kernels need an NVIDIA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
        )
    return torch.cuda.current_device()


def device_arch(device_index: int | None = None) -> str:
    """NVRTC arch for a device: sm_90a on Hopper (wgmma/TMA/setmaxnreg), else sm_XY."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


class LoadedKernel:
    """A kernel resident on one device, with the facts a launch needs."""

    def __init__(self, kernel, module: CompiledModule, expression: str, device_index: int):
        self.kernel = kernel
        self.module = module
        self.expression = expression
        self.device_index = device_index
        self.resources = module.resources.get(expression)
        self._dynamic_smem_limit = _DEFAULT_DYNAMIC_SMEM_LIMIT

    def reserve_dynamic_smem(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory cap to `nbytes` (needed above 48 KB)."""
        if nbytes <= self._dynamic_smem_limit:
            return
        optin = device_smem_optin(self.device_index)
        static = self.resources.static_smem_bytes if self.resources else 0
        if nbytes + static > optin:
            raise LaunchError(
                f"{self.expression} needs {nbytes} B dynamic + {static} B static shared memory; "
                f"device {self.device_index} allows {optin} B per block"
            )
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, self.kernel.handle, self.device_index)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"cuKernelSetAttribute({nbytes} B smem) failed for {self.expression}: {err}")
        self._dynamic_smem_limit = nbytes


@lru_cache(maxsize=None)
def device_smem_optin(device_index: int) -> int:
    """Bytes of shared memory one block may use on CUDA device `device_index` (the opt-in limit:
    227 KB on an H100/H200, 163 KB on an A100). NoGPUError without a GPU, ValueError for an index
    that names no device."""
    import torch

    require_gpu()
    if isinstance(device_index, bool) or not isinstance(device_index, int) or not (
        0 <= device_index < torch.cuda.device_count()
    ):
        count = torch.cuda.device_count()
        raise ValueError(f"device_index must name one of the {count} CUDA devices, got {device_index!r}")
    from cuda.core import Device

    return int(Device(device_index).properties.max_shared_memory_per_block_optin)


_kernels: dict[tuple, LoadedKernel] = {}


def load_kernel(source_path: Path, expression: str, *, compile_options: dict | None = None) -> LoadedKernel:
    """Compile (or fetch from cache) one instantiation and load it on torch's current device."""
    device_index = require_gpu()
    key = (device_index, str(source_path), expression, tuple(sorted((compile_options or {}).items())))
    hit = _kernels.get(key)
    if hit is not None:
        return hit
    from cuda.core import Device, ObjectCode

    Device(device_index).set_current()
    module = compile_cuda(source_path, [expression], device_arch(device_index), extra_options=compile_options)
    obj = ObjectCode.from_cubin(module.cubin, symbol_mapping={k: v.encode() for k, v in module.symbols.items()})
    loaded = LoadedKernel(obj.get_kernel(expression), module, expression, device_index)
    _kernels[key] = loaded
    return loaded


@lru_cache(maxsize=64)
def _stream(handle: int):
    from cuda.core import Stream

    return Stream.from_handle(handle)


@lru_cache(maxsize=1024)
def _config(grid: tuple, block: tuple, smem: int):
    from cuda.core import LaunchConfig

    return LaunchConfig(grid=grid, block=block, shmem_size=smem)


def launch(kernel: LoadedKernel, grid: Sequence[int], block: Sequence[int], args: Sequence, smem: int = 0) -> None:
    """Launch on torch's current stream. `args`: pointers as Python ints, 32-bit scalars as
    np.int32 / np.float32 (a Python float would be passed as a double)."""
    import torch

    grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
    if min(grid) < 1 or min(block) < 1:
        raise LaunchError(f"{kernel.expression}: empty launch geometry grid={grid} block={block}")
    if smem > kernel._dynamic_smem_limit:
        kernel.reserve_dynamic_smem(smem)
    from cuda.core import launch as cc_launch

    stream = _stream(torch.cuda.current_stream(kernel.device_index).cuda_stream)
    cc_launch(stream, _config(grid, block, int(smem)), kernel.kernel, *args)
