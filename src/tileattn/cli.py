"""The `tileattn` command: info, check, demo, bench."""

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
    return 0


def cmd_check(args) -> int:
    from .check import format_table, run_check

    rows = run_check(args.arch or None, family_filter=args.family, use_cache=not args.no_cache)
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


def cmd_bench(args) -> int:
    from .bench.attention import main as attention_main

    return attention_main(args.rest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tileattn", description="Fused attention kernels and GPU labs")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, driver and library versions, cache directory").set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="compile every registered kernel (no GPU needed); fail on spills/stack")
    p.add_argument("--arch", action="append", help="only this arch (repeatable), e.g. sm_90a")
    p.add_argument("--family", help="only families whose name contains this")
    p.add_argument("--no-cache", action="store_true", help="recompile even when cached")
    p.set_defaults(fn=cmd_check)
    sub.add_parser("demo", help="what `make demo` runs: CPU lab + reference, GPU checks when present").set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="benchmarks: `tileattn bench attention [...]` (labs: python -m labs.<name>)")
    p.add_argument("what", choices=["attention"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to that benchmark (see its --help)")
    p.set_defaults(fn=cmd_bench)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
