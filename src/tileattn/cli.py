"""The `tileattn` command: info, check, demo, bench, and the engine's generate, chat and serve."""

from __future__ import annotations

import argparse
import sys


def cmd_info(args) -> int:
    import torch

    from .bench import environment
    from .runtime import cache_dir

    env = environment()
    print(f"tileattn {__import__('tileattn').__version__}")
    for key in ("gpu", "compute_capability", "sm_count", "driver", "torch", "torch_cuda", "cudnn",
                "nvrtc", "cuda_core", "cuda_bindings", "triton", "python"):
        print(f"  {key:<19}{env.get(key) if env.get(key) is not None else 'not available'}")
    if torch.cuda.is_available():
        from .runtime import device_arch

        print(f"  {'build arch':<19}{device_arch()}")
    else:
        print("  no CUDA GPU visible: kernels can still be compiled (tileattn check), not run")
    print(f"  {'kernel cache':<19}{cache_dir()}")
    from .runtime import host_launch

    built = host_launch.library_path()
    state = (host_launch.status() if not host_launch.enabled() else
             f"built ({built})" if built.exists() else "not built yet (the first eager forward on a GPU builds it)")
    print(f"  {'compiled path':<19}{state}")
    return 0


def cmd_check(args) -> int:
    import importlib

    from .check import format_table, run_check

    for module in args.with_module or ():  # e.g. labs.kernels: registers the repository's lab kernels
        importlib.import_module(module)
    try:
        rows = run_check(args.arch or None, family_filter=args.family, use_cache=not args.no_cache, tuning=args.tuning)
    except ValueError as exc:  # filters that match nothing
        print(f"tileattn check: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    for r in failed:
        if r.error:
            print(f"\n{r.family}:{r.expression} [{r.arch}]\n{r.error}", file=sys.stderr)
    compiled = sum(1 for r in rows if r.error is None)
    broken = sum(1 for r in rows if r.broken)
    print(f"\n{compiled}/{len(rows)} instantiations compiled, {len(failed)} failed, "
          f"{broken} deliberately broken lab versions not judged")
    return 1 if failed else 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo()


# `tileattn bench NAME ...`: module and function of each benchmark (imported only when run).
BENCHES = {
    "attention": ("tileattn.bench.attention", "main"),
    "overhead": ("tileattn.bench.overhead", "main"),
    "startup": ("tileattn.bench.startup", "main"),
    "decode": ("tileattn.bench.decode", "main"),
    "varlen": ("tileattn.bench.varlen", "main"),
    "variants": ("tileattn.bench.variants", "main"),
    "layers": ("tileattn.bench.layers", "main"),
    "engine": ("tileattn.engine.bench_engine", "bench_engine_main"),
    "serve": ("tileattn.engine.bench_serve", "bench_serve_main"),
}


def cmd_bench(args) -> int:
    import importlib

    module, function = BENCHES[args.what]
    return getattr(importlib.import_module(module), function)(args.rest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tileattn", description="Fused attention kernels and GPU labs")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, driver and library versions, cache directory").set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="compile every registered kernel (no GPU needed); fail on spills/stack")
    p.add_argument("--arch", action="append", help="only this arch (repeatable), e.g. sm_90a")
    p.add_argument("--family", help="only families whose name contains this")
    p.add_argument("--no-cache", action="store_true", help="recompile even when cached")
    p.add_argument("--tuning", action="store_true", help="also the tuning candidates (what bench --tune times)")
    p.add_argument("--with", dest="with_module", action="append", metavar="MODULE",
                   help="import MODULE first so it registers its kernel families (e.g. labs.kernels)")
    p.set_defaults(fn=cmd_check)
    sub.add_parser("demo", help="what `make demo` runs: CPU lab + reference, GPU checks when present").set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="benchmarks: `tileattn bench NAME [...]`, NAME one of "
                       f"{', '.join(sorted(BENCHES))} (labs: python -m labs.<name>)")
    p.add_argument("what", choices=sorted(BENCHES))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to that benchmark (see its --help)")
    p.set_defaults(fn=cmd_bench)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ENGINE_COMMANDS:
        _add_engine_commands(sub)  # the engine's imports (tokenizers, FastAPI, ...) only when it runs
    else:
        for name, what in ENGINE_COMMANDS.items():
            sub.add_parser(name, help=what)
    args = ap.parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "what", None))))  # e.g. "bench attention"
    return report_missing_gpu(lambda: args.fn(args), f"tileattn {command}")


def report_missing_gpu(call, who: str) -> int:
    """call()'s exit status; on a machine without an NVIDIA GPU (NoGPUError), one line `who: message` on
    stderr and status 1 instead of a traceback: the user's setting, not a bug, reported as argparse reports
    a bad option. Any other exception propagates. (The labs' entry, labs.run_lab, uses it too.)"""
    try:
        return call()
    except RuntimeError as exc:
        from .runtime import NoGPUError  # loaded by then: whatever raised it imported the runtime

        if not isinstance(exc, NoGPUError):
            raise
        print(f"{who}: {exc}", file=sys.stderr)
        return 1


# The engine's commands (tileattn[engine]); their parsers are built only when one of them runs.
ENGINE_COMMANDS = {
    "generate": "generate text from prompts with a model (HF directory or GGUF file)",
    "chat": "chat with a model in the terminal, tokens streamed",
    "serve": "an OpenAI-compatible HTTP server on the engine",
}


def _add_engine_commands(sub) -> None:
    """`generate`, `chat` and `serve`; without the engine's dependencies they say what to install."""
    try:
        from .engine.cli import add_commands
        from .engine.server import add_serve_command
    except ImportError as exc:
        missing = str(exc)
        for name in ENGINE_COMMANDS:
            p = sub.add_parser(name, help="(needs the engine extra: pip install 'tileattn[engine]')")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(fn=lambda args, missing=missing: _missing_engine(missing))
        return
    add_commands(sub)
    add_serve_command(sub)


def _missing_engine(reason: str) -> int:
    print(f"tileattn's engine is not available: {reason}\ninstall it with: pip install 'tileattn[engine]'",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
