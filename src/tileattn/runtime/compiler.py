"""Compile CUDA C++ to cubin with NVRTC (through cuda.core), with a disk cache of our own.

Works without a GPU: the arch is explicit ("sm_90a", "sm_80"), so CI compiles every kernel and
reads its resource report (registers, stack, spills, static shared memory) from the ptxas log.

Cache: `$TILEATTN_CACHE` or `~/.cache/tileattn`, one `<key>.cubin` + `<key>.json` per compiled
program, keyed by `cuda.core.utils.make_program_cache_key` over the source, the options, the name
expressions and an extra digest of everything the key cannot see itself (our headers, the NVRTC
version, the CUDA include directory used when NVRTC is too old for bundled headers).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Sequence

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
# NVRTC ships its own copies of the CUDA headers (<cuda/std/...>) from this version on.
_BUNDLED_HEADERS_MIN_NVRTC = (13, 3)


class CompileError(RuntimeError):
    """NVRTC rejected a source file; the message carries NVRTC's log (file(line): error ...)."""


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel (`-v`)."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_smem_bytes: int

    @property
    def spills(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass
class CompiledModule:
    """One NVRTC program compiled to cubin: the kernels named by `symbols` (expression -> mangled)."""

    source: str
    arch: str
    cubin: bytes
    symbols: dict[str, str]
    log: str
    resources: dict[str, Resources] = field(default_factory=dict)
    compile_seconds: float = 0.0
    from_cache: bool = False


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def cuda_home() -> Path:
    return Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def cache_dir() -> Path:
    root = os.environ.get("TILEATTN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tileattn"


@lru_cache(maxsize=None)
def _header_options() -> tuple[bool, tuple[str, ...], bytes]:
    """(use_bundled_headers, system include dirs, digest of what they stand for)."""
    version = nvrtc_version()
    digest = hashlib.sha256(f"nvrtc{version}".encode())
    if version >= _BUNDLED_HEADERS_MIN_NVRTC:
        return True, (), digest.digest()
    # Older NVRTC (the H200 machine has 13.0) cannot find <cuda/std/cstdint> by itself.
    home = cuda_home()
    includes = (str(home / "include"), str(home / "include" / "cccl"))
    if not (home / "include" / "cuda" / "std" / "cstdint").exists() and not (
        home / "include" / "cccl" / "cuda" / "std" / "cstdint"
    ).exists():
        raise CompileError(
            f"NVRTC {version[0]}.{version[1]} has no bundled headers and no CUDA headers were "
            f"found under {home}/include; set CUDA_HOME or install nvidia-cuda-nvrtc >= 13.3"
        )
    digest.update(str(home).encode())
    return False, includes, digest.digest()


def _headers_digest(include_dirs: Sequence[Path]) -> bytes:
    h = hashlib.sha256()
    for d in include_dirs:
        for p in sorted(Path(d).rglob("*.cuh")):
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.digest()


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, Resources]:
    """Mangled kernel name -> Resources, from `ptxas -v` output."""
    out: dict[str, Resources] = {}
    current = None
    fields: dict[str, int] = {}
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current, fields = m.group(1), {}
            continue
        if current is None:
            continue
        if m := _STACK.search(line):
            fields["stack_bytes"], fields["spill_store_bytes"], fields["spill_load_bytes"] = map(
                int, m.groups()
            )
        if m := _REGS.search(line):
            fields["registers"] = int(m.group(1))
            sm = _SMEM.search(line)
            fields["static_smem_bytes"] = int(sm.group(1)) if sm else 0
            out[current] = Resources(
                registers=fields["registers"],
                stack_bytes=fields.get("stack_bytes", 0),
                spill_store_bytes=fields.get("spill_store_bytes", 0),
                spill_load_bytes=fields.get("spill_load_bytes", 0),
                static_smem_bytes=fields["static_smem_bytes"],
            )
            current = None
    return out


def compile_cuda(
    source_path: Path,
    name_expressions: Sequence[str],
    arch: str,
    *,
    use_cache: bool = True,
    extra_options: dict | None = None,
) -> CompiledModule:
    """Compile `source_path` to a cubin for `arch`, instantiating `name_expressions`.

    Raises CompileError with NVRTC's log on failure. `extra_options` are passed to ProgramOptions
    (e.g. {"lineinfo": True} for the sanitizer).
    """
    from cuda.core import Program, ProgramOptions

    source_path = Path(source_path)
    code = source_path.read_text()
    bundled, sys_includes, header_digest = _header_options()
    include_dirs = [CSRC_DIR, source_path.parent]
    options = ProgramOptions(
        name=str(source_path.name),
        arch=arch,
        std="c++17",
        use_bundled_headers=bundled or None,
        include_path=[str(d) for d in include_dirs] + list(sys_includes),
        ptxas_options=["-v"],
        **(extra_options or {}),
    )
    extra_digest = header_digest + _headers_digest(include_dirs)
    key = _cache_key(code, options, arch, name_expressions, extra_digest)
    cubin_path = cache_dir() / f"{key}.cubin"
    meta_path = cache_dir() / f"{key}.json"
    if use_cache and cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return CompiledModule(
            source=str(source_path),
            arch=arch,
            cubin=cubin_path.read_bytes(),
            symbols=meta["symbols"],
            log=meta["log"],
            resources={k: Resources(**v) for k, v in meta["resources"].items()},
            compile_seconds=meta["compile_seconds"],
            from_cache=True,
        )

    log_stream = io.StringIO()
    start = time.perf_counter()
    try:
        obj = Program(code, "c++", options=options).compile(
            "cubin", name_expressions=tuple(name_expressions), logs=log_stream
        )
    except Exception as exc:  # cuda.core raises a generic error carrying the NVRTC log
        raise CompileError(
            f"NVRTC failed to compile {source_path} for {arch} "
            f"({', '.join(name_expressions) or 'no name expressions'}):\n{exc}"
        ) from exc
    seconds = time.perf_counter() - start
    log = log_stream.getvalue().replace("\x00", "")
    symbols = {str(k): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in obj.symbol_mapping.items()}
    by_mangled = parse_ptxas_log(log)
    resources = {expr: by_mangled[mangled] for expr, mangled in symbols.items() if mangled in by_mangled}
    module = CompiledModule(str(source_path), arch, bytes(obj.code), symbols, log, resources, seconds)
    if use_cache:
        _store(cubin_path, meta_path, module)
    return module


def _cache_key(code, options, arch, name_expressions, extra_digest) -> str:
    try:
        from cuda.core.utils import make_program_cache_key

        return make_program_cache_key(
            code=code,
            code_type="c++",
            options=options,
            target_type="cubin",
            name_expressions=list(name_expressions),
            extra_digest=extra_digest,
        ).hex()
    except ImportError:  # cuda.core older than the cache-key helper: hash the same inputs
        h = hashlib.sha256(code.encode())
        h.update(repr(sorted(vars(options).items())).encode() if hasattr(options, "__dict__") else repr(options).encode())
        h.update(arch.encode())
        h.update("\0".join(sorted(name_expressions)).encode())
        h.update(extra_digest)
        return h.hexdigest()


def _store(cubin_path: Path, meta_path: Path, module: CompiledModule) -> None:
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "source": module.source,
        "arch": module.arch,
        "symbols": module.symbols,
        "log": module.log,
        "resources": {k: asdict(v) for k, v in module.resources.items()},
        "compile_seconds": module.compile_seconds,
    }
    # Write then rename: a reader never sees half a file, and parallel writers race harmlessly.
    for path, data in ((cubin_path, module.cubin), (meta_path, json.dumps(meta).encode())):
        tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
