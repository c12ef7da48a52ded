"""The compiled attention path: host_launch.cpp, built once per (source, torch, Python, compiler).

An eager `tileattn.attention` forward that the Python path has planned is served by one call into
C++ (`forward(q, k, v, causal, scale, want)`): key, allocation, stream, tensor maps, launch; its
backward, once the Python path has run the backward of that dout layout, by the C++ autograd node
(or `backward(...)` without autograd): gradients, workspaces and the three launches. The
module is compiled with the system's C++ compiler against torch's and Python's headers (no CUDA
header or toolkit: the driver entry points come from cuGetProcAddress) and cached under
`cache_dir()/host/`. Building takes tens of seconds (torch's autograd headers), so it happens in a
child process (`build_in_child`) that a background thread, started by the first eager forward, waits
for; until the module is loaded, and wherever it cannot be built (no compiler, no Python headers, an
unusual torch), every call takes the Python path, which launches the same plans.
`TILEATTN_HOST_LAUNCH=0` switches it off, `1` on (the default, DEFAULT below). The switch decides
whether the module is built and combinations are registered: set it before the first forward, since
a combination once registered is served by the module for the rest of the process. `status()` says
which case holds (`tileattn info` prints it).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

from .compiler import cache_dir

SOURCE = Path(__file__).with_name("host_launch.cpp")
MODULE_NAME = "_host_launch"  # PyInit__host_launch in the source

_lock = threading.Lock()
_module = None
_thread: threading.Thread | None = None
_status = "not started (the first eager forward on a GPU starts the build)"
_poison = False
_failed = False


# What the plans hand over (LaunchPlan.host_fields plus slots; host_launch.cpp's Slot and Source):
# a slot is one kernel parameter that changes per call, (kind, parameter index, source, encode,
# byte offset): a data pointer (POINTER) of a source plus the offset, a tensor map (TENSOR_MAP) of
# a source encoded by `encode`, or the stream's tile-counter pair (TILE_COUNTER, source -1).
POINTER, TENSOR_MAP, TILE_COUNTER = 0, 1, 2
Q, K, V, OUT, LSE, DOUT, DQ, DK, DV, WORKSPACE, SEMAPHORES, NULL = range(12)  # NULL: the value 0


def pointer_slots(params, sources) -> list[tuple]:
    """POINTER slots for kernel parameters `params` (indices, e.g. a LaunchPlan's `dynamic`), one
    per entry of `sources`: a source, or (source, byte offset) for a part of a workspace."""
    return [(POINTER, param, *((source, None, 0) if isinstance(source, int) else (source[0], None, source[1])))
            for param, source in zip(params, sources, strict=True)]


def launch_fields(plan, slots) -> tuple | None:
    """(function, grid, block, smem, buffer, param_layout, slots) of a LaunchPlan for the module's
    register / register_backward (param_layout: each parameter's (byte offset, size)); None for a
    plan it cannot launch (PDL)."""
    fields = plan.host_fields()
    if fields is None:
        return None
    function, _device, grid, block, smem, buffer, layout = fields
    return function, grid, block, smem, buffer, layout, tuple(slots)


class HostLaunchBuildError(RuntimeError):
    """The compiled attention path could not be built or loaded (the message has the compiler's output)."""


# On since its first GPU run (session 39, an H100, sm_90 like the H200: every GPU test passed with it
# on but one stale test, memcheck clean, host time 2.8-3.2x below the Python path's; docs/runtime.md,
# "The compiled attention path"); TILEATTN_HOST_LAUNCH=0 keeps every call on the Python path.
DEFAULT = "1"


def enabled() -> bool:
    """Whether the compiled path may be used: TILEATTN_HOST_LAUNCH (read on every call), "1" on,
    "0" off, DEFAULT when unset."""
    return os.environ.get("TILEATTN_HOST_LAUNCH", DEFAULT) != "0"


def status() -> str:
    """One line: loaded (and from where), building, off, not started, or why it failed."""
    return "off (TILEATTN_HOST_LAUNCH=0)" if not enabled() else _status


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"


def _command(output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    includes = [sysconfig.get_paths()["include"], *cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    return [
        _compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{d}" for d in includes), str(SOURCE), "-o", str(output),
        *(f"-L{d}" for d in libraries), *(f"-Wl,-rpath,{d}" for d in libraries),
        "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
    ]


def library_path() -> Path:
    """Where the built module lives: keyed by the source, torch's version and location, Python's
    version and the compiler, so that a change to any of them builds anew."""
    import torch

    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), torch.__file__.encode(), sys.version.encode(),
                 _compiler().encode()):
        digest.update(part)
        digest.update(b"\0")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / "host" / digest.hexdigest()[:20] / f"{MODULE_NAME}{suffix}"


def build() -> Path:
    """Compile the module (or find it already built) and return its path; HostLaunchBuildError
    with the compiler's output when that fails. Safe to run from several processes at once (each
    writes its own temporary file and renames it into place)."""
    path = library_path()
    if path.exists():
        return path
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        raise HostLaunchBuildError(f"Python's headers are not installed ({sysconfig.get_paths()['include']}/Python.h)")
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise HostLaunchBuildError(f"could not run the C++ compiler {compiler!r}: not found")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    # The shell renames the finished library into place itself, so a process that exits while its
    # background build runs still leaves the cache filled for the next one.
    script = 'set -e; "$@"; mv -f "$TILEATTN_PARTIAL" "$TILEATTN_LIBRARY"'
    env = dict(os.environ, TILEATTN_PARTIAL=str(partial), TILEATTN_LIBRARY=str(path))
    done = subprocess.run(["sh", "-c", script, "sh", *_command(partial)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise HostLaunchBuildError(f"{compiler} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return path


def build_in_child() -> Path:
    """build() in a fresh Python process, as the background build runs it: build() imports
    torch.utils.cpp_extension for torch's header paths, which imports setuptools (0.37 s on the lent
    H100's host, with the GIL held, in the middle of a process's first attention call); in a child
    process that import holds nothing back. HostLaunchBuildError with the child's error otherwise."""
    path = library_path()
    if path.exists():
        return path
    package_root = str(Path(__file__).resolve().parents[2])  # the directory that holds this tileattn package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", "from tileattn.runtime.host_launch import build; build()"],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0 or not path.exists():
        raise HostLaunchBuildError(f"the build process exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return path


def import_built(path: Path):
    """The built module at `path`, imported but not configured (it launches nothing until load)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(path: Path):
    """Import the built module from `path` and hand it the driver entry points it calls."""
    from cuda.bindings import driver

    from .launcher import LaunchError, stream_counters

    module = import_built(path)
    addresses = []
    for symbol in (b"cuLaunchKernel", b"cuStreamIsCapturing"):
        # (CUresult, pfn, CUdriverProcAddressQueryResult) in cuda-bindings 12 and 13
        err, address = driver.cuGetProcAddress(symbol, 12000,
                                               driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)[:2]
        if err != driver.CUresult.CUDA_SUCCESS or not address:
            raise HostLaunchBuildError(f"cuGetProcAddress({symbol.decode()}) failed: {err}")
        addresses.append(int(address))
    from .. import api

    module.configure(*addresses, stream_counters, LaunchError, vars(api))
    module.set_poison(_poison)
    return module


def _build_and_load() -> None:
    global _module, _status, _failed
    try:
        path = build_in_child()
        module = load(path)
    except Exception as exc:  # any failure leaves the Python path in charge; status() says why
        _status = f"unavailable: {type(exc).__name__}: {exc}"
        _failed = True
        return
    _module = module
    _status = f"loaded ({path})"


def set_poison(on: bool) -> None:
    """Tests: make the compiled path fill its outputs (out, lse) with NaN before each launch, as
    the GPU tests' poisoned_allocations() makes torch's allocations on the Python path; kept for a
    module that loads later."""
    global _poison
    _poison = bool(on)
    if _module is not None:
        _module.set_poison(_poison)


def module():
    """The loaded module, or None while it is not (starting the background build on the first
    call). Called by tileattn.api on Python-path forwards only, so it costs nothing on calls that
    the module serves."""
    global _thread, _status
    if not enabled():
        return None
    if _module is None and _thread is None:
        with _lock:
            if _thread is None:
                _status = "building (in a background thread)"
                _thread = threading.Thread(target=_build_and_load, name="tileattn-host-launch", daemon=True)
                _thread.start()
    return _module


def loaded():
    """The module if this process has loaded it, whatever the switch says now (its records may
    still serve calls: tileattn.api.clear_plans clears them)."""
    return _module


def unavailable() -> bool:
    """True when the module will not load in this process: switched off, or its build failed."""
    return not enabled() or _failed


def wait(timeout: float | None = None):
    """Start the build if needed, wait for it (up to `timeout` seconds) and return the module or
    None (disabled, failed, or still building at the timeout). For benchmarks and tests."""
    module()
    if _thread is not None:
        _thread.join(timeout)
    return _module if enabled() else None
