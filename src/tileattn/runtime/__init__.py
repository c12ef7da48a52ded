"""Kernel runtime: NVRTC compile with a disk cache and resource report, load, launch on torch's stream."""

from .compiler import CompileError, CompiledModule, Resources, cache_dir, compile_cuda, nvrtc_version, parse_ptxas_log
from .launcher import (
    LaunchError,
    LoadedKernel,
    NoGPUError,
    device_arch,
    device_smem_optin,
    launch,
    load_kernel,
    require_gpu,
)

__all__ = [
    "CompileError",
    "CompiledModule",
    "LaunchError",
    "LoadedKernel",
    "NoGPUError",
    "Resources",
    "cache_dir",
    "compile_cuda",
    "device_arch",
    "device_smem_optin",
    "launch",
    "load_kernel",
    "nvrtc_version",
    "parse_ptxas_log",
    "require_gpu",
]
