"""Kernel runtime: NVRTC compile with a disk cache and resource report, load, one launch path
(cuLaunchKernel through cuda.bindings, plans for hot paths), TMA tensor maps."""

from .compiler import CompileError, CompiledModule, Resources, cache_dir, compile_cuda, nvrtc_version, parse_ptxas_log
from .launcher import (
    LaunchError,
    LaunchPlan,
    LoadedKernel,
    NoGPUError,
    current_stream_handle,
    device_arch,
    device_sm_count,
    device_smem_optin,
    launch,
    load_kernel,
    require_gpu,
    stream_counters,
)
from .tma import TensorMap, TensorMapError, TensorMapTemplate, tensor_map, tma_requirements

__all__ = [
    "CompileError",
    "CompiledModule",
    "LaunchError",
    "LaunchPlan",
    "LoadedKernel",
    "NoGPUError",
    "Resources",
    "TensorMap",
    "TensorMapError",
    "TensorMapTemplate",
    "cache_dir",
    "compile_cuda",
    "current_stream_handle",
    "device_arch",
    "device_sm_count",
    "device_smem_optin",
    "launch",
    "load_kernel",
    "nvrtc_version",
    "parse_ptxas_log",
    "require_gpu",
    "stream_counters",
    "tensor_map",
    "tma_requirements",
]
