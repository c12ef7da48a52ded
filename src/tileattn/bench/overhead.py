"""`tileattn bench overhead`: host microseconds per attention call, tileattn beside SDPA.

    tileattn bench overhead [--calls 200] [--rounds 15] [--json out.json]

What is timed: the wall time of `calls` back-to-back calls with no synchronization inside, divided
by `calls`, on shapes small enough that the GPU keeps up (so the figure is the host's cost: Python,
argument handling, allocation, the driver's launch call); the median of `rounds` such bursts, every
implementation of a case timed in the same rounds (one burst each, rotated), so that a drift of the
host's speed during the run does not land on one column.
Cases: forward without grad, forward whose inputs require grad (the autograd node is built),
backward alone (torch.autograd.grad on a retained graph), the backward at op level (no autograd
engine: the compiled path's `backward`, or tileattn.api._backward on the Python path, beside aten's
flash backward op), and a decode shape (one query token, GQA 32/8, 4096 keys) without grad. SDPA
runs with its backend chosen once, outside the loop (`sdpa_kernel(backend)` entered around the
burst): flash for the training shapes, and for decode whichever of flash / cudnn / efficient
accepts the shape and is fastest on the host.
Targets (issue #9): forward < 10 us without grad, < 20 us with grad, backward < 25 us, each at
most 0.5x SDPA's host time. Through torch.autograd.grad the backward's figure is mostly the autograd
engine's (its hand-over to the device thread and back), the same for every op; the op-level row is
the op's own.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from .env import environment
from .harness import positive_int
from .records import write_run
from .report import environment_line


def interleaved_bursts(fns: dict, calls: int, rounds: int, sync=None) -> dict[str, dict]:
    """Host us per call of each ``fns`` entry (name -> (callable, context factory entered around each
    of its bursts)): the median (and min, max) over ``rounds`` bursts of ``calls`` calls. Every round
    runs one burst of each, starting at a rotated position, so a host whose speed drifts during the
    run moves every column alike (the lent H100 of 2026-12-05 ran one process's late pieces 1.5-1.8x
    slower than its early ones: SDPA's forward 17.0 then 30.2 us). ``sync`` (default
    torch.cuda.synchronize) runs between bursts only, so the device never holds the host back inside one."""
    sync = sync or torch.cuda.synchronize
    names = list(fns)
    for fn, enter in fns.values():
        with enter():
            fn()
    sync()
    samples = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            fn, enter = fns[name]
            with enter():
                begin = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - begin) / calls * 1e6)
            sync()
    return {name: {"host_us": statistics.median(x), "host_us_min": min(x), "host_us_max": max(x)}
            for name, x in samples.items()}


def burst_us(fn, calls: int, rounds: int, sync=None) -> dict:
    """interleaved_bursts of one callable."""
    return interleaved_bursts({"fn": (fn, contextlib.nullcontext)}, calls, rounds, sync)["fn"]


class IdentityFunction(torch.autograd.Function):
    """The cheapest autograd.Function: what Function.apply itself costs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def cases():
    """(name, shape description, q/k/v factory, what is timed)."""
    bf16 = torch.bfloat16

    def train_inputs(grad):
        g = torch.Generator(device="cuda").manual_seed(0)
        return [torch.randn(1, 8, 128, 64, device="cuda", dtype=bf16, generator=g).requires_grad_(grad)
                for _ in range(3)]

    def decode_inputs(grad):
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=bf16, generator=g)
        k = torch.randn(8, 8, 4096, 128, device="cuda", dtype=bf16, generator=g)
        v = torch.randn(8, 8, 4096, 128, device="cuda", dtype=bf16, generator=g)
        return [q, k, v]

    return [
        ("forward", "B=1 H=8 N=128 d=64 bf16, no grad", train_inputs, False, "fwd"),
        ("forward+grad", "same, inputs require grad", train_inputs, True, "fwd"),
        ("backward", "same, autograd.grad on a retained graph", train_inputs, True, "bwd"),
        ("backward, op level", "same, the op's backward without the autograd engine", train_inputs, False, "bwd_op"),
        ("decode", "B=8 H=32 Hkv=8 Nq=1 Nk=4096 d=128 bf16, no grad", decode_inputs, False, "fwd"),
    ]


def _tileattn_fn(q, k, v, what):
    import tileattn

    causal = q.shape[2] > 1
    if what == "bwd_op":  # planned (and registered with the compiled path) by one Python-path call each
        from .. import api
        from ..runtime import host_launch

        out, lse, entry = api._forward(q, k, v, causal, None)
        dout = torch.randn_like(out)
        api._backward(entry, dout, q, k, v, out, lse, False)
        module = host_launch.loaded() if api._host_forward is not None else None  # None inside python_path()
        if module is not None and module.backward(q, k, v, out, lse, dout, causal, None, False) is not None:
            return lambda: module.backward(q, k, v, out, lse, dout, causal, None, False)
        return lambda: api._backward(entry, dout, q, k, v, out, lse, False)
    if what == "bwd":
        out = tileattn.attention(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: tileattn.attention(q, k, v, causal=causal)


def _sdpa_fn(q, k, v, what):
    F = torch.nn.functional
    causal = q.shape[2] > 1
    gqa = q.shape[1] != k.shape[1]
    if what == "bwd_op":  # aten's flash backward on its own forward's outputs
        aten = torch.ops.aten
        o, lse, cq, ck, mq, mk, seed, offset = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:8]
        dout = torch.randn_like(o)
        return lambda: aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, o, lse, cq, ck, mq, mk, 0.0,
                                                                          causal, seed, offset)
    if what == "bwd":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


@contextlib.contextmanager
def python_path():
    """Inside: tileattn.attention without the compiled path (runtime.host_launch), every
    call on the Python path, as with TILEATTN_HOST_LAUNCH=0 from the start."""
    from .. import api

    saved = api._host_forward
    api._host_forward = None
    try:
        yield
    finally:
        api._host_forward = saved


def run(calls: int, rounds: int) -> list[dict]:
    """Each case's implementations timed in the same rounds (interleaved_bursts): tileattn, its Python
    path and each SDPA backend that accepts the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..runtime import host_launch

    host_launch.wait(300)  # time the compiled path when it can be built here (status printed by main)
    records = []
    for name, shape, make, grad, what in cases():
        q, k, v = make(grad)
        with torch.enable_grad() if grad else torch.no_grad():
            fns = {"tileattn": (_tileattn_fn(q, k, v, what), contextlib.nullcontext)}
            with python_path():  # made inside: "bwd_op" picks the Python backward there
                fns["tileattn_python_path"] = (_tileattn_fn(q, k, v, what), python_path)
            backends = ([SDPBackend.FLASH_ATTENTION] if name != "decode" else
                        [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
            refused = {}
            for backend in backends:  # chosen once per burst, outside the timed loop
                impl, enter = f"sdpa_{backend.name.lower()}", (lambda b=backend: sdpa_kernel(b))
                try:
                    with enter():
                        fn = _sdpa_fn(q, k, v, what)
                        fn()
                except RuntimeError as exc:  # a backend that refuses the shape
                    refused[impl] = f"error: {str(exc).splitlines()[0][:100]}"
                    continue
                fns[impl] = (fn, enter)
            timed = interleaved_bursts(fns, calls, rounds)
        for impl, result in timed.items():
            extra = {"host_launch": host_launch.status()} if impl == "tileattn" else {}
            records.append({"suite": "overhead", "case": name, "shape": shape, "impl": impl, **extra, **result})
        records += [{"suite": "overhead", "case": name, "shape": shape, "impl": impl, "status": status}
                    for impl, status in refused.items()]
    return records


def breakdown(calls: int, rounds: int) -> list[dict]:
    """Host cost of each piece of the eager path on the forward/backward shape (where the
    microseconds go), beside the op-level SDPA calls (no autograd engine on either side)."""
    from .. import api

    q, k, v = cases()[0][2](False)
    with torch.no_grad():
        out, lse, entry = api._forward(q, k, v, True, None)
    dout = torch.randn_like(out)
    F = torch.nn.functional
    aten = torch.ops.aten
    plan = getattr(entry.forward, "plan", None)
    pieces = {
        "python call of a no-op": lambda: None,
        "api._eager(q, k, v)": lambda: api._eager(q, k, v),
        "plan lookup (key tuple + dict)": lambda: api._plan_entry(q, k, v, True, None),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.empty(lse shape, fp32)": lambda: torch.empty(q.shape[:3], dtype=torch.float32, device=q.device),
        "torch.empty_strided(out spec)": lambda: torch.empty_strided(*entry.out_spec, dtype=q.dtype, device=q.device),
        "current device + stream handle": lambda: (torch.cuda.current_device(),
                                                   __import__("tileattn").runtime.current_stream_handle(0)),
        "forward plan .launch (the kernel launch)": lambda: entry.forward.launch(q, k, v, out, lse),
        "torch.empty_strided(lse spec)": lambda: torch.empty_strided(*entry.lse_spec, dtype=torch.float32,
                                                                    device=q.device),
        "tileattn.attention, no grad (all of the above)": lambda: api.attention(q, k, v, causal=True),
        "backward op level: api._backward": lambda: api._backward(entry, dout, q, k, v, out, lse, False),
        "SDPA flash forward, op level (aten)": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
        "F.scaled_dot_product_attention (flash)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    if api._host_forward is not None:  # registered by the api._forward call above
        from ..runtime import host_launch

        module = host_launch.loaded()
        pieces["the compiled path alone (host_launch forward)"] = lambda: api._host_forward(q, k, v, True, None, 0)
        api._backward(entry, dout, q, k, v, out, lse, False)  # registers the backward of dout's layout
        pieces["the compiled backward alone (host_launch backward)"] = lambda: module.backward(
            q, k, v, out, lse, dout, True, None, False)
    templates = getattr(entry.forward, "templates", None)
    if templates is not None:  # the Hopper forward: the per-launch pieces of ForwardPlan.launch before the driver call
        from ..kernels.attention_fwd_sm90 import _tile_counter

        tq, tk, tv, to = templates
        pieces["4 tensor-map lookups (TensorMapTemplate.encode, cached)"] = lambda: (
            tq.encode(q.data_ptr()), tk.encode(k.data_ptr()), tv.encode(v.data_ptr()), to.encode(out.data_ptr()))
        pieces["tile counter (stream_counters: capture check, stream, dict)"] = lambda: _tile_counter(
            True, q.device.index)
    if plan is not None and hasattr(plan, "_call"):  # the driver call alone, parameters already packed
        from ..runtime import current_stream_handle

        stream = current_stream_handle(q.device.index)
        pieces["cuLaunchKernel alone (cuda.bindings)"] = lambda: plan._launch(*plan._call, stream, plan._params, 0)
    try:
        fwd = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        o, l, cq, ck, mq, mk, seed, off = fwd[:8]
        pieces["SDPA flash backward, op level (aten)"] = lambda: aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, o, l, cq, ck, mq, mk, 0.0, True, seed, off)
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"SDPA op-level backward not timed: {exc}")
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    pieces["autograd.Function.apply of an identity"] = lambda: IdentityFunction.apply(qg)
    pieces["tileattn.attention, inputs require grad"] = lambda: api.attention(qg, kg, vg, causal=True)
    records = []
    with torch.no_grad():
        for name, fn in pieces.items():
            ctx = torch.enable_grad() if "require grad" in name or "autograd" in name else torch.no_grad()
            with ctx:
                records.append({"suite": "overhead-breakdown", "case": name, **burst_us(fn, calls, rounds)})
    return records


def table(records: list[dict]) -> str:
    lines = ["| case | shape | tileattn us | Python path us | best SDPA us (backend) | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    targets = {"forward": 10.0, "forward+grad": 20.0, "backward": 25.0, "backward, op level": 25.0, "decode": 10.0}
    for name in targets:
        rows = [r for r in records if r["case"] == name and r["suite"] == "overhead"]
        ours = next(r for r in rows if r["impl"] == "tileattn")
        slow = next((f"{r['host_us']:.1f}" for r in rows if r["impl"] == "tileattn_python_path"), "-")
        peers = [r for r in rows if r["impl"].startswith("sdpa") and "host_us" in r]
        best = min(peers, key=lambda r: r["host_us"]) if peers else None
        ratio = ours["host_us"] / best["host_us"] if best else float("nan")
        ok = ours["host_us"] < targets[name] and ratio <= 0.5
        lines.append(f"| {name} | {ours['shape']} | {ours['host_us']:.1f} | {slow} | "
                     f"{best['host_us']:.1f} ({best['impl']}) | {ratio:.2f} | "
                     f"< {targets[name]:g} us and <= 0.5x: {'met' if ok else 'NOT met'} |" if best else
                     f"| {name} | {ours['shape']} | {ours['host_us']:.1f} | {slow} | - | - | - |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tileattn bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=positive_int, default=200, help="calls per burst (no sync inside)")
    ap.add_argument("--rounds", type=positive_int, default=15, help="bursts; the median is reported")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--breakdown", action="store_true", help="also time the pieces of one eager forward/backward")
    args = ap.parse_args(argv)
    import os

    from ..runtime import require_gpu

    require_gpu()
    os.environ.setdefault("TILEATTN_HOST_LAUNCH", "1")  # timed beside the Python path, unless set to 0
    records = run(args.calls, args.rounds)
    if args.breakdown:
        records += breakdown(args.calls, args.rounds)
        for r in records:
            if r["suite"] == "overhead-breakdown":
                print(f"  {r['case']:<52} {r['host_us']:7.2f} us")
    from ..runtime import host_launch

    env = environment()
    print(environment_line(env))
    print(f"compiled path: {host_launch.status()}")
    if args.json:
        write_run(args.json, records, env)
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
