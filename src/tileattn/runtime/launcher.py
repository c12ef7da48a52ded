"""Load compiled kernels and launch them on torch's current stream: one launch path for every kernel.

Every launch is `cuLaunchKernel` (cuda.bindings) with `kernelParams`: an array of host addresses,
one per kernel parameter, from which the driver copies as many bytes as the kernel image says that
parameter has. The addresses point into one host buffer laid out at the kernel's own parameter
offsets (read once per kernel with `cuFuncGetParamInfo`), or, for a `__grid_constant__`
CUtensorMap parameter, at the 128 bytes of a `TensorMap`. Because the layout comes from the kernel
image, every argument is checked against the width the kernel expects when it is packed: a
np.int32 passed where the kernel takes a 64-bit value is an error, not a silent misread.

Two ways to launch:
- `launch(kernel, grid, block, args, smem)`: packs `args` on each call (labs, rare launches).
- `LaunchPlan`: geometry and arguments packed once; a call rewrites only the 64-bit slots named
  `dynamic` (the data pointers) and calls the driver. This is what the attention ops use; together
  with the raw current-stream handle it keeps a launch at a few microseconds of host time.

Launches go on torch's current stream of the kernel's device, so they order with torch's work and
are captured by `torch.cuda.graph`.

`LaunchPlan(..., pdl=True)` launches through `cuLaunchKernelEx` with the programmatic-stream-
serialization attribute (programmatic dependent launch, sm_90+): the kernel may start before the
previous kernel on the stream has finished, so it must execute `griddepcontrol.wait` before its
first global access (csrc/common/pdl.cuh). Kernel families opt in per launch through
`pdl_enabled(device_index)`: a device of compute capability 9.0 or newer, unless TILEATTN_PDL=0.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from ..launch_limits import MAX_GRID_X, MAX_GRID_YZ
from .compiler import CompiledModule, compile_cuda

_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in (cuKernelSetAttribute)


class NoGPUError(RuntimeError):
    """No CUDA device is visible to torch."""


class LaunchError(RuntimeError):
    """A launch was refused: bad geometry, too much shared memory, arguments that do not match the
    kernel's parameters, or an error returned by the driver."""


def require_gpu() -> int:
    """Index of torch's current CUDA device; NoGPUError when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError(
            "tileattn kernels need an NVIDIA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
        )
    return torch.cuda.current_device()


@lru_cache(maxsize=None)
def device_arch(device_index: int | None = None) -> str:
    """NVRTC arch for a device: sm_90a on Hopper (wgmma/TMA/setmaxnreg), else sm_XY."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


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
    return int(torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin)


@lru_cache(maxsize=None)
def device_sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index` (132 on an H200)."""
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _driver():
    from cuda.bindings import driver

    return driver


@contextlib.contextmanager
def relaxed_capture():
    """Within: this thread's stream-capture interaction mode is relaxed, so a module load or a kernel
    attribute set while torch's current stream captures a CUDA graph (a plan first needed inside a
    capture, e.g. dropout's kRngState kernels, which only a capture or a seed tensor asks for) is not
    refused as an unsafe call of global-mode capture. Neither enqueues work: the graph is unaffected.
    The thread's previous mode is restored after."""
    driver = _driver()
    err, previous = driver.cuThreadExchangeStreamCaptureMode(driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    _raise_for(err, "cuThreadExchangeStreamCaptureMode(relaxed)")
    try:
        yield
    finally:
        (err, _) = driver.cuThreadExchangeStreamCaptureMode(previous)
        _raise_for(err, "cuThreadExchangeStreamCaptureMode(restore)")


def pdl_enabled(device_index: int) -> bool:
    """Whether kernels written for programmatic dependent launch (they wait with
    griddepcontrol.wait before touching memory) should be launched with it on `device_index`: a
    device of compute capability 9.0 or newer (older ones have no griddepcontrol), unless
    TILEATTN_PDL=0 is in the environment (read on every call, so a test or benchmark can switch
    it). On by default since the H200's batch-1 Llama-3-8B decode measured it faster (docs/gemv.md)."""
    return os.environ.get("TILEATTN_PDL", "1") != "0" and _has_griddepcontrol(device_index)


@lru_cache(maxsize=None)
def _has_griddepcontrol(device_index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _raise_for(err, what: str) -> None:
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise LaunchError(f"{what} failed: {name.decode() if isinstance(name, bytes) else err}")


class LoadedKernel:
    """A kernel resident on one device: its CUfunction, its parameter layout, its resources."""

    def __init__(self, kernel, module: CompiledModule, expression: str, device_index: int):
        self.kernel = kernel  # cuda.core Kernel (keeps the loaded library alive)
        self.module = module
        self.expression = expression
        self.device_index = device_index
        self.resources = module.resources.get(expression)
        # A CUfunction in the device's primary context (the one torch uses), for cuLaunchKernel.
        err, self.function = _driver().cuKernelGetFunction(kernel.handle)
        _raise_for(err, f"cuKernelGetFunction({expression})")
        self.param_layout = _param_layout(self.function, expression)
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
        driver = _driver()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        with relaxed_capture():
            (err,) = driver.cuKernelSetAttribute(attr, nbytes, self.kernel.handle, self.device_index)
        _raise_for(err, f"cuKernelSetAttribute({nbytes} B dynamic smem) for {self.expression}")
        self._dynamic_smem_limit = nbytes


def _param_layout(function, expression: str) -> tuple[tuple[int, int], ...]:
    """((offset, size), ...) of every kernel parameter, from the kernel image."""
    driver = _driver()
    layout = []
    while True:
        err, offset, size = driver.cuFuncGetParamInfo(function, len(layout))
        if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:  # past the last parameter
            return tuple(layout)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"cuFuncGetParamInfo({expression}, {len(layout)}) failed: {err}")
        layout.append((int(offset), int(size)))


_kernels: dict[tuple, LoadedKernel] = {}


def load_kernel(source_path: Path, expression: str, *, compile_options: dict | None = None,
                device_index: int | None = None) -> LoadedKernel:
    """Compile (or fetch from the disk cache) one instantiation and load it on a device (default:
    torch's current one). Only this instantiation is compiled and loaded."""
    if device_index is None:
        device_index = require_gpu()
    key = (device_index, str(source_path), expression, tuple(sorted((compile_options or {}).items())))
    hit = _kernels.get(key)
    if hit is not None:
        return hit
    import torch
    from cuda.core import Device, ObjectCode

    module = compile_cuda(source_path, [expression], device_arch(device_index), extra_options=compile_options)
    with torch.cuda.device(device_index), relaxed_capture():
        torch.cuda.init()
        Device(device_index).set_current()  # the primary context, which torch uses too
        obj = ObjectCode.from_cubin(module.cubin, symbol_mapping={k: v.encode() for k, v in module.symbols.items()})
        loaded = LoadedKernel(obj.get_kernel(expression), module, expression, device_index)
    _kernels[key] = loaded
    return loaded


# ---- argument packing -------------------------------------------------------------------------
def _pack(kernel: LoadedKernel, args: Sequence) -> tuple[np.ndarray, np.ndarray, list]:
    """(buffer, addresses, keep-alive): `addresses[i]` is where parameter i's bytes are."""
    from .tma import TensorMap

    layout = kernel.param_layout
    if len(args) != len(layout):
        raise LaunchError(f"{kernel.expression} takes {len(layout)} parameters, got {len(args)} arguments")
    end = max((off + size for off, size in layout), default=8)
    buffer = np.zeros(-(-end // 8), dtype=np.uint64)  # 8-byte aligned; 64-bit slots for pointers
    raw = buffer.view(np.uint8)
    base = buffer.ctypes.data
    addresses = np.empty(max(len(layout), 1), dtype=np.uint64)
    keep: list = []
    for i, (arg, (offset, size)) in enumerate(zip(args, layout)):
        if isinstance(arg, TensorMap):
            if size != 128:
                raise LaunchError(f"{kernel.expression}: parameter {i} is {size} bytes, got a 128-byte TensorMap")
            keep.append(arg)
            addresses[i] = arg.address
            continue
        data = _arg_bytes(arg, i, size, kernel.expression)
        raw[offset:offset + size] = data
        addresses[i] = base + offset
    return buffer, addresses, keep


def _arg_bytes(arg, index: int, size: int, expression: str) -> np.ndarray:
    if isinstance(arg, (bool, np.bool_)):
        raise LaunchError(f"{expression}: argument {index} is a bool; pass np.int32 (its width is ambiguous)")
    if isinstance(arg, int):  # a pointer or a 64-bit integer
        if size != 8:
            raise LaunchError(f"{expression}: argument {index} is a Python int (8 bytes: pointer or 64-bit "
                              f"integer) but the kernel's parameter is {size} bytes; pass np.int32 etc.")
        return np.array([arg], dtype=np.int64 if arg < 0 else np.uint64).view(np.uint8)
    if isinstance(arg, np.generic):
        if arg.dtype.itemsize != size:
            raise LaunchError(f"{expression}: argument {index} is {arg.dtype} ({arg.dtype.itemsize} bytes) but "
                              f"the kernel's parameter is {size} bytes")
        return np.array([arg]).view(np.uint8)
    if isinstance(arg, (bytes, bytearray, memoryview, np.ndarray)):  # a packed parameter struct
        data = np.frombuffer(bytes(arg), dtype=np.uint8) if not isinstance(arg, np.ndarray) else arg.view(np.uint8).ravel()
        if data.size != size:
            raise LaunchError(f"{expression}: argument {index} has {data.size} bytes, the kernel's parameter {size}")
        return data
    if isinstance(arg, float):
        raise LaunchError(f"{expression}: argument {index} is a Python float; pass np.float32 (a float would "
                          "be a double)")
    raise LaunchError(f"{expression}: argument {index} has unsupported type {type(arg).__name__} (Python int "
                      "pointer, numpy scalar, TensorMap, or bytes of a parameter struct)")


def _check_geometry(kernel: LoadedKernel, grid, block, smem: int) -> tuple[tuple, tuple]:
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
    if min(grid) < 1 or min(block) < 1:
        raise LaunchError(f"{kernel.expression}: empty launch geometry grid={grid} block={block}")
    if grid[0] > MAX_GRID_X or max(grid[1:]) > MAX_GRID_YZ or block[0] * block[1] * block[2] > 1024:
        raise LaunchError(f"{kernel.expression}: launch geometry grid={grid} block={block} exceeds CUDA's limits")
    if smem > kernel._dynamic_smem_limit:
        kernel.reserve_dynamic_smem(smem)
    return grid, block


# ---- streams and the driver call -----------------------------------------------------------------
_raw_stream = None
_stream_objects: dict[int, object] = {}


def _current_raw_stream(device_index: int) -> int:
    """torch's current cudaStream_t on `device_index` as an int (torch._C._cuda_getCurrentRawStream:
    no torch.cuda.Stream object is built)."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream)
    return _raw_stream(device_index)


def current_stream_handle(device_index: int):
    """torch's current stream on `device_index` as a cuda.bindings CUstream."""
    handle = _current_raw_stream(device_index)
    stream = _stream_objects.get(handle)
    if stream is None:
        stream = _stream_objects[handle] = _driver().CUstream(handle)
    return stream


_stream_counters: dict[tuple[int, int], object] = {}  # (device, raw stream) -> zeroed int32 [2]
_graph_counters: list = []  # pairs made under CUDA graph capture: kept for the graphs' lifetime


def stream_counters(device_index: int) -> int:
    """The address of two zeroed int32 in device memory for torch's current stream on
    `device_index`: the scratch of a kernel that hands out its work through a grid-wide counter
    and leaves it 0 again when it ends (attention_fwd_sm90's persistent grids). One pair per
    stream, so launches that share a pair are ordered by their stream; under CUDA graph capture
    a new pair (zeroed in the graph) that the graph keeps to itself, so a replay on another stream
    cannot race eager launches on the capturing one."""
    import torch

    if torch.cuda.is_current_stream_capturing():
        pair = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", device_index))
        _graph_counters.append(pair)
        return pair.data_ptr()
    key = (device_index, _current_raw_stream(device_index))
    pair = _stream_counters.get(key)
    if pair is None:
        pair = _stream_counters[key] = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", device_index))
    return pair.data_ptr()


def launch(kernel: LoadedKernel, grid: Sequence[int], block: Sequence[int], args: Sequence, smem: int = 0) -> None:
    """Launch on torch's current stream of the kernel's device. `args`: pointers and 64-bit integers
    as Python ints, other scalars as numpy scalars of the kernel's width (np.int32, np.float32, ...),
    `TensorMap`s for CUtensorMap parameters, bytes for a packed struct. Packs on every call; use a
    `LaunchPlan` for launches on a hot path."""
    LaunchPlan(kernel, grid, block, args, smem).launch()


class LaunchPlan:
    """One kernel, its geometry and its packed arguments, made once and launched many times.

    `args` are the arguments of the first launch; `dynamic` lists the indices of the parameters
    that change between launches, in the order `launch(*values)` takes them: 64-bit values (data
    pointers, as Python ints) or CUtensorMap parameters (as `TensorMap`s). Everything else (sizes,
    strides, scale, fixed tensor maps) stays as packed: a plan belongs to one (device, shapes,
    strides, dtype, flags) combination, and the caller keys its plans so. Consecutive 64-bit
    dynamic parameters are written with one struct.pack_into. A lock makes concurrent launches of
    one plan from several threads safe (the driver has copied the parameters when cuLaunchKernel
    returns, so the buffer is free again right after).

    `pdl=True`: launch with cuLaunchKernelEx and CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    (programmatic dependent launch): the kernel's blocks may be scheduled while the previous kernel
    on the stream still runs, and the kernel itself must wait (griddepcontrol.wait) before it reads
    or writes global memory. Only for kernels written so; same packed parameters either way. Under
    stream capture the attribute becomes a programmatic edge of the graph (CUDA 12.3 and later).
    """

    __slots__ = ("kernel", "grid", "block", "smem", "pdl", "dynamic", "_buffer", "_view", "_addresses", "_keep",
                 "_runs", "_maps", "_call", "_config", "_lock", "_launch", "_ok", "_params")

    def __init__(self, kernel: LoadedKernel, grid, block, args: Sequence, smem: int = 0, dynamic: Sequence[int] = (),
                 pdl: bool = False):
        self.kernel = kernel
        self.grid, self.block = _check_geometry(kernel, grid, block, int(smem))
        self.smem = int(smem)
        self.dynamic = tuple(int(i) for i in dynamic)  # parameter index of each value launch() takes
        self._buffer, self._addresses, self._keep = _pack(kernel, args)
        self._view = memoryview(self._buffer.view(np.uint8))
        runs: list[list[int]] = []  # [byte offset, count, first value index] of consecutive 64-bit slots
        maps: list[tuple[int, int]] = []  # (parameter index, value index) of CUtensorMap parameters
        for j, i in enumerate(dynamic):
            offset, size = kernel.param_layout[i]
            if size == 128:
                maps.append((i, j))
            elif size == 8 and offset % 8 == 0:
                if runs and runs[-1][0] + 8 * runs[-1][1] == offset and runs[-1][2] + runs[-1][1] == j:
                    runs[-1][1] += 1
                else:
                    runs.append([offset, 1, j])
            else:
                raise LaunchError(f"{kernel.expression}: dynamic parameter {i} is {size} bytes; dynamic parameters "
                                  "are aligned 64-bit values or 128-byte tensor maps")
        self._runs = tuple((struct.Struct(f"<{n}Q").pack_into, off, j, j + n) for off, n, j in runs)
        self._maps = tuple(maps)
        self._params = int(self._addresses.ctypes.data)  # kernelParams: void*[], kept alive by _addresses
        driver = _driver()
        self.pdl = bool(pdl)
        self._ok = driver.CUresult.CUDA_SUCCESS
        if self.pdl:
            # One CUlaunchConfig per plan; only its stream changes per launch (under the lock).
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = self.grid
            config.blockDimX, config.blockDimY, config.blockDimZ = self.block
            config.sharedMemBytes = self.smem
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
            self._config = config
            self._call = (config, kernel.function)
            self._launch = driver.cuLaunchKernelEx
        else:
            self._config = None
            self._call = (kernel.function, *self.grid, *self.block, self.smem)
            self._launch = driver.cuLaunchKernel
        self._lock = threading.Lock()

    def host_fields(self) -> tuple | None:
        """What runtime.host_launch needs to launch this plan from C++: (CUfunction address, device
        index, grid, block, shared-memory bytes, the packed parameter buffer, each parameter's (byte
        offset, size) in it); None for a PDL plan (cuLaunchKernelEx: not on the compiled path)."""
        if self.pdl:
            return None
        return (int(self.kernel.function), self.kernel.device_index, self.grid, self.block, self.smem,
                self._buffer.tobytes(), tuple(self.kernel.param_layout))

    def launch(self, *values) -> None:
        """Launch with new values for the dynamic parameters, on torch's current stream of the
        plan's device."""
        stream = current_stream_handle(self.kernel.device_index)
        with self._lock:
            for pack_into, offset, first, end in self._runs:
                pack_into(self._view, offset, *values[first:end])
            for i, j in self._maps:
                self._addresses[i] = values[j].address  # the driver copies the map's 128 bytes
            if self._config is None:
                (err,) = self._launch(*self._call, stream, self._params, 0)
            else:
                self._config.hStream = stream
                (err,) = self._launch(*self._call, self._params, 0)
        if err != self._ok:
            what = "cuLaunchKernelEx (PDL)" if self.pdl else "cuLaunchKernel"
            _raise_for(err, f"{what}({self.kernel.expression}, grid={self.grid}, block={self.block}, "
                            f"smem={self.smem})")
