"""`tileattn bench decode`: paged decode and chunked prefill, tileattn beside SDPA on the same work.

    tileattn bench decode [--quick] [--json PATH] [--markdown PATH] [--reps N] [--rounds R]
                          [--prefill-only [--block-sizes BS ...]]
    tileattn bench decode --sweep [--points H/HKV:B:KV ...] [--splits S ...] [--block-sizes BS ...] [--reps N]

Decode (issue #10): one query token per sequence, bf16, d=128, H/Hkv = 32/32 and 32/8,
B in {1, 8, 64, 256}, KV length in {1k, 4k, 32k}, block_size 16 and 256. tileattn runs
`attention_paged` on a paged cache whose block table is a random permutation (no two consecutive
blocks of a sequence are neighbours in memory); the peers, SDPA flash and cudnn, run on the same
keys and values in dense layout [B, Hkv, N, d] (GQA through enable_gqa, or K/V with repeated
heads when a backend refuses it; the record says which). Effective bandwidth = the K+V bytes
decode must read, 2 * B * Hkv * N * d * 2 bytes, divided by the median time; the H200's copy
bandwidth is 4.3 TB/s (torch's device copy on the H200, 2026-11-29: docs/labs/reduction.md). Points whose paged cache plus dense copy would pass
--memory-gb are skipped (B=256 with 32k keys MHA is 137 GB of K+V alone).

Chunked prefill: a 512-token query chunk after a 4096-token cached prefix (4608 keys, causal,
bottom-right aligned), B=8, H/Hkv 32/32 and 32/8, block_size 16 and 256, against tileattn's dense
forward (tileattn.attention with Nq=512, Nk=4608) on the same work; TFLOP/s of useful FLOPs
(each query row counts the keys it sees). The other prefill tiles of the paged kernel (the sm_80
table's, when the arch's differs, and the family's tuning candidates) are timed on the same work
through the launch layer (impl tileattn_paged_tile, the tile in its column). On sm_90a
attention_paged runs the Hopper paged prefill at the block sizes dispatch.SM90_PAGED_PREFILL lists. SDPA is not
a peer there: its is_causal is aligned top-left, which is a different mask when Nq < Nk. The
prefill implementations are timed in --rounds rounds (default 3) in rotated order and each one's
median is reported (prefill_point says why).

Every output is compared with a peer's on the same data before timing (rel_err in the record).
Timing: tileattn.bench.harness.measure (CUDA events, L2 flushed before each repetition).

--sweep (tuning, no peers): at each point (default: the --quick decode points) and block size, the
default decode config and every kernels.attention_paged_sm80.DECODE_TUNING candidate, each with
its automatic split count and every --splits count (default 1 2 4 8 16), through PagedLaunch with
the config and count given explicitly; every output is compared with the default's (rel_err_vs_default);
records of suite decode_sweep, plus five calibration records per point that split the fixed time
(docs/attention_paged.md, "GQA B=8 decode"). Prints per point the default, the best (config,
splits) and the top 3, then a config x split-count matrix. Cost at the quick points, --reps 10:
4 configs x <= 6 counts + 6 calibration timings = <= 30 per (point, block size), 12 of those;
a timing is 13 calls (3 warm-up) plus 10 flushes of 2x the L2 (~30-40 us each), so ~0.4 s of device
time at MHA B=64 (1 ms per call) and < 0.05 s elsewhere: ~2 s of device time, and ~3 ms of host
time per timing (~1 s). Set-up (random K/V, paging: up to 8.6 GB at MHA B=64) ~1 s per point, and
NVRTC compiles the 3 candidates once (~1-2 s each, measured here): ~20-30 s in all, far inside 90 s.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch

from .harness import host_overhead_us, measure, positive_int
from .records import save_run
from .report import environment_line, fmt_number, median_rounds

BATCHES = (1, 8, 64, 256)
KV_LENS = (1024, 4096, 32768)
BLOCK_SIZES = (16, 256)
HEADS = ((32, 32), (32, 8))
QUICK = {"batches": (1, 8, 64), "kv_lens": (4096,), "block_sizes": (16, 256)}
HEAD_DIM = 128
DTYPE = torch.bfloat16
COPY_TBPS = 4.3  # H200 device copy through torch, measured 2026-11-29 (docs/labs/reduction.md)


def paged_from_dense(k, block_size, gen):
    """k [B, Hkv, N, d] -> (cache [B * N / block_size, block_size, Hkv, d], table int32 [B, N / block_size])
    with the blocks in a random order."""
    batch, kv_heads, n, d = k.shape
    per_seq = n // block_size
    order = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(k.device)
    cache = torch.empty(batch * per_seq, block_size, kv_heads, d, dtype=k.dtype, device=k.device)
    for b in range(batch):  # one sequence at a time: no full-size temporary
        cache[order[b]] = k[b].view(kv_heads, per_seq, block_size, d).permute(1, 2, 0, 3)
    return cache, order.to(torch.int32)


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    F = torch.nn.functional

    def prepare(q, k, v):
        """A callable running this backend on (q, k, v), and how GQA was expressed."""
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(backend):
            try:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                return (lambda: _run(backend, q, k, v, gqa)), "enable_gqa" if gqa else "mha"
            except RuntimeError:
                if not gqa:
                    raise
        group = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return (lambda: _run(backend, q, kr, vr, False)), "repeated heads"

    return prepare


def _run(backend, q, k, v, gqa):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def rel_err(out, ref) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def decode_point(batch, heads, kv_heads, kv_len, block_sizes, reps, memory_gb) -> list[dict]:
    """Records for one (B, H, Hkv, N): each peer once, tileattn once per block size."""
    from ..api_paged import attention_paged
    from ..kernels.attention_paged_sm80 import PagedLaunch

    base = {"suite": "decode", "b": batch, "h": heads, "hkv": kv_heads, "kv_len": kv_len, "d": HEAD_DIM,
            "dtype": "bf16"}
    kv_bytes = 2 * batch * kv_heads * kv_len * HEAD_DIM * 2
    if 2 * kv_bytes > memory_gb * 1e9:
        return [dict(base, impl="all", status=f"skipped: {2 * kv_bytes / 1e9:.0f} GB of K+V (paged + dense)")]
    gen = torch.Generator(device="cuda").manual_seed(batch * kv_len + kv_heads)
    q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)  # [B, H, 1, d]
    k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    records, outputs = [], {}
    with torch.no_grad():
        for name in ("flash", "cudnn"):
            rec = dict(base, impl=f"sdpa_{name}")
            try:
                call, how = _sdpa(name)(q, k, v)
                outputs[name] = call()[:, :, 0]  # [B, H, d]
                rec.update(gqa=how, **_timed(call, reps, kv_bytes))
            except RuntimeError as exc:
                rec.update(status=f"error: {str(exc).splitlines()[0][:100]}")
            records.append(rec)
            torch.cuda.empty_cache()
        peer = next(iter(outputs.values()), None)
        q_packed = q[:, :, 0]  # [B, H, d]: token b is sequence b's only query
        cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        seqlens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
        for bs in block_sizes:
            k_cache, table = paged_from_dense(k, bs, torch.Generator().manual_seed(kv_len))
            v_cache, _ = paged_from_dense(v, bs, torch.Generator().manual_seed(kv_len))  # the same block order
            # TILEATTN_PAGED_UNSPLIT_TILES reaches the timed calls through PagedLaunch's default.
            call = functools.partial(attention_paged, q_packed, k_cache, v_cache, table, cu_q, seqlens, 1, kv_len)
            plan = PagedLaunch(q_packed, k_cache, v_cache, table, max_seqlen_q=1, causal=True,
                               scale=1 / math.sqrt(HEAD_DIM), return_lse=False, num_splits=None)
            rec = dict(base, impl="tileattn_paged", block_size=bs, num_splits=plan.num_splits, config=str(plan.config),
                       unsplit_tiles=plan.unsplit_tiles)
            if peer is not None:
                rec["rel_err_vs_sdpa"] = rel_err(call(), peer)
            rec.update(_timed(call, reps, kv_bytes))
            records.append(rec)
            del call, k_cache, v_cache  # free this block size's cache before the next
            torch.cuda.empty_cache()
    return records


def _timed(call, reps, kv_bytes) -> dict:
    t = measure(call, warmup=3, reps=reps, max_seconds=3.0, memory=False)
    return {"status": "ok", "us": t.median_ms * 1e3, "tbps": kv_bytes / (t.median_ms * 1e-3) / 1e12, **t.as_dict()}


def useful_flops(batch, heads, n_q, n_k, d) -> float:
    """Causal bottom-right: query i of n_q sees n_k - n_q + i + 1 keys; 4 FLOPs per (query, key, dim)."""
    pairs = n_q * (n_k - n_q) + n_q * (n_q + 1) // 2
    return 4.0 * batch * heads * pairs * d


def prefill_tiles(head_dim: int, arch: str) -> list:
    """Prefill tiles to time through the launch layer beside the default (which the public op runs):
    the sm_80 table's tile when the arch's differs, and the family's tuning candidates."""
    from ..kernels import attention_paged_sm80 as paged

    default = paged.configs(head_dim, arch)[2]
    extra = [paged.CONFIGS[head_dim][2], *paged.PREFILL_TUNING.get(head_dim, ())]
    return [c for c in dict.fromkeys(extra) if c != default]


def prefill_point(heads, kv_heads, block_sizes, reps, rounds=3, chunk=512, prefix=4096, batch=8) -> list[dict]:
    """Records of suite prefill_chunk: the dense op, attention_paged at each block size and the other prefill tiles,
    each checked against the dense op's output, then timed in `rounds` rounds whose order rotates
    (bench.attention.round_order), one record per implementation and round (key "round"). The
    GPU's power cap makes whichever call is timed first after a pause read up to ~15 % fast at this
    shape (session 19, call J3: the dense op 593 / 608 TFLOP/s first in its process, 522-535
    after), so a fixed order favoured the dense op; render reports each implementation's median."""
    import tileattn

    from ..api_paged import attention_paged
    from ..kernels import dispatch
    from ..kernels.attention_paged_sm80 import PagedLaunch, pick_config
    from ..runtime import device_arch
    from .attention import round_order

    n_k = prefix + chunk
    base = {"suite": "prefill_chunk", "b": batch, "h": heads, "hkv": kv_heads, "chunk": chunk, "prefix": prefix,
            "d": HEAD_DIM, "dtype": "bf16"}
    flops = useful_flops(batch, heads, chunk, n_k, HEAD_DIM)
    gen = torch.Generator(device="cuda").manual_seed(heads + kv_heads)
    q = torch.randn(batch, heads, chunk, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(batch, kv_heads, n_k, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(batch, kv_heads, n_k, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    calls: dict[str, tuple[dict, object]] = {}  # name -> (record fields, no-argument call)

    with torch.no_grad():
        dense = lambda: tileattn.attention(q, k, v, causal=True)  # noqa: E731
        ref = dense().transpose(1, 2).reshape(batch * chunk, heads, HEAD_DIM)
        calls["dense"] = (dict(base, impl="tileattn_dense"), dense)
        q_packed = q.transpose(1, 2).reshape(batch * chunk, heads, HEAD_DIM)  # [B * chunk, H, d]
        cu_q = torch.arange(0, batch * chunk + 1, chunk, device="cuda", dtype=torch.int32)
        seqlens = torch.full((batch,), n_k, device="cuda", dtype=torch.int32)
        for bs in block_sizes:
            pad = -n_k % bs
            kp = torch.nn.functional.pad(k, (0, 0, 0, pad))  # whole blocks; the pad keys are never visible
            vp = torch.nn.functional.pad(v, (0, 0, 0, pad))
            k_cache, table = paged_from_dense(kp, bs, torch.Generator().manual_seed(bs))
            v_cache, _ = paged_from_dense(vp, bs, torch.Generator().manual_seed(bs))
            del kp, vp
            call = functools.partial(attention_paged, q_packed, k_cache, v_cache, table, cu_q, seqlens, chunk, n_k)
            hopper = (HEAD_DIM, bs) in dispatch.SM90_PAGED_PREFILL and device_arch() == "sm_90a"
            config = "attention_fwd_sm90" if hopper else pick_config(HEAD_DIM, chunk * heads // kv_heads, device_arch())
            calls[f"paged {bs}"] = (dict(base, impl="tileattn_paged", block_size=bs, config=str(config),
                                         rel_err_vs_dense=rel_err(call(), ref)), call)
            args = (q_packed, k_cache, v_cache, table, cu_q, seqlens)
            for tile in prefill_tiles(HEAD_DIM, device_arch()):  # other tiles, same work (launch layer)
                launch = PagedLaunch(q_packed, k_cache, v_cache, table, max_seqlen_q=chunk, causal=True,
                                     scale=1 / math.sqrt(HEAD_DIM), return_lse=False, num_splits=None, config=tile)
                run = functools.partial(launch, *args)
                calls[f"tile {tile} {bs}"] = (dict(base, impl="tileattn_paged_tile", block_size=bs, config=str(tile),
                                                   rel_err_vs_dense=rel_err(run()[0], ref)), run)
        records = []
        for rnd in range(rounds):
            for _, (fields, call) in round_order(calls, rnd):
                t = measure(call, reps=reps, max_seconds=3.0, memory=False)
                records.append(dict(fields, status="ok", round=rnd, tflops=flops / (t.median_ms * 1e-3) / 1e12,
                                    us=t.median_ms * 1e3, **t.as_dict()))
    del calls
    torch.cuda.empty_cache()
    return records


def prefill_medians(records: list[dict]) -> list[dict]:
    """One record per prefill implementation (report.median_rounds: its median round, in first-seen
    order) with tflops_min / tflops_max the range of its rounds and rounds their count."""
    out = []
    for r in median_rounds([r for r in records if r["suite"] == "prefill_chunk"]):
        spread = r.get("tflops_rounds", [r["tflops"]])
        out.append(dict(r, tflops_min=min(spread), tflops_max=max(spread), rounds=r.get("rounds", 1)))
    return out


def host_time(records: list[dict]) -> None:
    """Host microseconds per attention_paged call (decode, B=8, GQA 32/8, 4k keys), beside SDPA."""
    from ..api_paged import attention_paged

    k = torch.randn(8, 8, 4096, HEAD_DIM, device="cuda", dtype=DTYPE)
    q = torch.randn(8, 32, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache, table = paged_from_dense(k, 16, torch.Generator().manual_seed(0))
    args = (q[:, :, 0], k_cache, k_cache, table, torch.arange(9, device="cuda", dtype=torch.int32),
            torch.full((8,), 4096, device="cuda", dtype=torch.int32), 1, 4096)
    with torch.no_grad():
        ours = host_overhead_us(lambda: attention_paged(*args))
        sdpa = host_overhead_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True))
    records.append({"suite": "host_overhead", "impl": "tileattn_paged", "host_us_per_call": ours})
    records.append({"suite": "host_overhead", "impl": "sdpa", "host_us_per_call": sdpa})


def render(records: list[dict]) -> str:
    lines = ["### decode, bf16 d=128: median us (effective K+V TB/s)", "",
             "| H/Hkv | B | KV | sdpa_flash | sdpa_cudnn | tileattn bs=16 | tileattn bs=256 | best tileattn / best "
             "peer | splits |", "|---|---|---|---|---|---|---|---|---|"]
    points: dict[tuple, dict] = {}
    for r in records:
        if r["suite"] == "decode":
            key = (f"{r['h']}/{r['hkv']}", r["b"], r["kv_len"])
            name = r["impl"] if r["impl"] != "tileattn_paged" else f"bs{r['block_size']}"
            points.setdefault(key, {})[name] = r

    def cell(r):
        if r is None:
            return "-"
        if r.get("status") != "ok":
            return r.get("status", "-")
        return f"{r['us']:.1f} ({r['tbps']:.2f})"

    for key, cells in points.items():
        if "all" in cells:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cells['all']['status']} | | | | | |")
            continue
        ours = [r["tbps"] for n, r in cells.items() if n.startswith("bs") and r.get("status") == "ok"]
        peers = [r["tbps"] for n, r in cells.items() if n.startswith("sdpa") and r.get("status") == "ok"]
        ratio = f"{max(ours) / max(peers):.2f}" if ours and peers else "-"
        splits = "/".join(str(cells[n].get("num_splits")) for n in ("bs16", "bs256") if n in cells)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell(cells.get('sdpa_flash'))} | "
                     f"{cell(cells.get('sdpa_cudnn'))} | {cell(cells.get('bs16'))} | {cell(cells.get('bs256'))} | "
                     f"{ratio} | {splits} |")
    lines += ["", f"(an H200's device copy bandwidth {COPY_TBPS} TB/s, docs/labs/reduction.md, not measured in this run; "
              "targets: >= 1.1x the best peer, >= 3.9 TB/s at B >= 8 with "
              "KV >= 4k, B=1 KV=4k <= 30 us)", ""]
    if not points:  # --prefill-only: no decode table
        lines = []
    lines += ["### chunked prefill: 512 queries after a 4096-key prefix, B=8, causal: TFLOP/s (useful FLOPs; "
              "median of the rotated rounds, their range)", "",
              "| H/Hkv | impl | tile | block_size | TFLOP/s | range | us | vs dense | rel. error vs dense |",
              "|---|---|---|---|---|---|---|---|---|"]
    prefill = prefill_medians(records)
    dense = {(r["h"], r["hkv"]): r["tflops"] for r in prefill if r["impl"] == "tileattn_dense"}
    for r in prefill:
        ratio = r["tflops"] / dense[(r["h"], r["hkv"])] if (r["h"], r["hkv"]) in dense else None
        lines.append(f"| {r['h']}/{r['hkv']} | {r['impl']} | {r.get('config', '-')} | {r.get('block_size', '-')} | "
                     f"{fmt_number(r['tflops'])} | {fmt_number(r['tflops_min'])}-{fmt_number(r['tflops_max'])} | "
                     f"{fmt_number(r['us'])} | {fmt_number(ratio)} | {fmt_number(r.get('rel_err_vs_dense'))} |")
    for r in records:
        if r["suite"] == "host_overhead":
            lines.append(f"\nhost time per call, {r['impl']}: {r['host_us_per_call']:.1f} us")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# --sweep: every decode tile config x split count at a few points (docs/attention_paged.md, "GQA B=8
# decode"), through PagedLaunch with the config and split count given explicitly.
# ---------------------------------------------------------------------------------------------
SWEEP_SPLITS = (1, 2, 4, 8, 16)  # forced split counts; the automatic choice is always timed too
SWEEP_ERR_WARN = 2e-2  # rel. error vs the default's output above which a case is flagged


def parse_point(text: str) -> tuple[int, int, int, int]:
    """'H/Hkv:B:KV' (e.g. '32/8:8:4096') -> (heads, kv_heads, batch, kv_len); ValueError naming the
    text when it is malformed, H is not a multiple of Hkv or a value is not positive."""
    try:
        heads_text, batch, kv_len = text.split(":")
        heads, kv_heads = (int(x) for x in heads_text.split("/"))
        point = (heads, kv_heads, int(batch), int(kv_len))
    except ValueError:
        raise ValueError(f"point {text!r}: expected H/Hkv:B:KV, e.g. 32/8:8:4096") from None
    if min(point) <= 0 or heads % kv_heads:
        raise ValueError(f"point {text!r}: values must be positive and H a multiple of Hkv")
    return point


def quick_points() -> list[tuple[int, int, int, int]]:
    """The --quick decode points, (heads, kv_heads, batch, kv_len) in the bench's order."""
    return [(h, hkv, b, n) for h, hkv in HEADS for b in QUICK["batches"] for n in QUICK["kv_lens"]]


def sweep_cases(configs, splits) -> list[tuple]:
    """(config, requested split count or None for the automatic choice) in timing order: the first
    config (the default) with the automatic count first, so every output is compared with its."""
    return [(c, s) for c in configs for s in (None, *splits)]


def sweep_point(base: dict, kv_bytes: int, cases, build, timer) -> list[dict]:
    """Records of one (point, block size). `build(config, requested)` -> (launch, run): the
    PagedLaunch (its .config / .num_splits / .groups are the decisions taken) and a callable
    returning (out, lse); it may raise CompileError, LaunchError (refused before any launch) or
    ValueError: an error record. `timer(run)` -> harness.Timing. A case whose (config, split count) was already timed
    (a forced count equal to the automatic one, or capped to it) is skipped. Outputs [Tq, H, d] are
    compared with the first case's (rel_err_vs_default)."""
    from ..runtime import CompileError, LaunchError

    records, seen, ref = [], set(), None
    for config, requested in cases:
        rec = dict(base, impl="tileattn_paged_sweep", config=str(config),
                   splits_requested="auto" if requested is None else requested)
        try:
            launch, run = build(config, requested)
        except (CompileError, LaunchError, ValueError) as exc:  # e.g. more shared memory than this GPU has
            records.append(dict(rec, status=f"error: {str(exc).splitlines()[0][:100]}"))
            continue
        key = (str(launch.config), launch.num_splits)
        if key in seen:
            continue
        seen.add(key)
        out = run()[0]
        if ref is None:
            ref = out
        t = timer(run)
        records.append(dict(
            rec, status="ok", num_splits=launch.num_splits, ctas=launch.groups * launch.num_splits,
            smem_kb=launch.config.smem_bytes(base["d"]) / 1024, rel_err_vs_default=rel_err(out, ref),
            us=t.median_ms * 1e3, tbps=kv_bytes / (t.median_ms * 1e-3) / 1e12, **t.as_dict()))
    return records


def calibration_records(base: dict, kv_bytes: int, default_run, empty_run, reps: int, device="cuda") -> list[dict]:
    """What the model of docs/attention_paged.md ("GQA B=8 decode") splits the fixed time into,
    measured at this point: `calib_empty` the default launch with every length 0 (launch, prologue,
    split-KV arrival and combine; no K/V read); `calib_no_flush` the default without the harness's L2
    flush; `calib_read` / `calib_read_no_flush` torch.sum over the same bytes of fp32 (a streaming
    read: the ceiling of a plain reduction), with and without the flush; `calib_write_flush` the
    default after the write-only flush the harness used until 2026-12-01 evening (a write pass over 2x
    the L2 that leaves it full of dirty lines the call must write back; the harness now follows it
    with a read pass): the difference of two timings without the harness's flush, (write flush +
    call) - write flush, both recorded. The default minus calib_write_flush is what that flush cost
    the call."""
    stream = torch.zeros(kv_bytes // 4, dtype=torch.float32, device=device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device == "cuda" else 1 << 20
    dirty = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def write_flush():
        return dirty.fill_(1)  # the old harness's flush: the L2 is left full of dirty lines

    def flushed_call():
        write_flush()
        return default_run()

    cases = (("calib_empty", empty_run, True, 0), ("calib_no_flush", default_run, False, kv_bytes),
             ("calib_read", stream.sum, True, kv_bytes), ("calib_read_no_flush", stream.sum, False, kv_bytes))
    records = []
    for impl, run, flush, nbytes in cases:
        t = measure(run, warmup=3, reps=reps, flush_l2=flush, max_seconds=3.0, memory=False)
        rec = dict(base, impl=impl, status="ok", us=t.median_ms * 1e3, **t.as_dict())
        if nbytes:
            rec["tbps"] = nbytes / (t.median_ms * 1e-3) / 1e12
        records.append(rec)
    both = measure(flushed_call, warmup=3, reps=reps, flush_l2=False, max_seconds=3.0, memory=False)
    alone = measure(write_flush, warmup=3, reps=reps, flush_l2=False, max_seconds=3.0, memory=False)
    us = (both.median_ms - alone.median_ms) * 1e3
    records.append(dict(base, impl="calib_write_flush", status="ok", us=us, flush_and_call_us=both.median_ms * 1e3,
                        flush_us=alone.median_ms * 1e3, reps=both.reps,
                        **({"tbps": kv_bytes / (us * 1e-6) / 1e12} if us > 0 else {})))
    return records


def _decode_builder(q, k_cache, v_cache, table, cu_q, seqlens):
    """sweep_point's `build` for decode (one query token per sequence, causal, default scale): a
    PagedLaunch with the given config and split count (None: automatic) and its call."""
    from ..kernels.attention_paged_sm80 import PagedLaunch

    def build(config, requested):
        launch = PagedLaunch(q, k_cache, v_cache, table, max_seqlen_q=1, causal=True, scale=1 / math.sqrt(HEAD_DIM),
                             return_lse=False, num_splits=requested, config=config)
        return launch, functools.partial(launch, q, k_cache, v_cache, table, cu_q, seqlens)

    return build


def sweep_decode_point(heads, kv_heads, batch, kv_len, block_sizes, splits, reps, memory_gb,
                       device="cuda") -> list[dict]:
    """Sweep records of one decode point (bf16, d=128, one query per sequence), per block size:
    the default decode config and every DECODE_TUNING candidate x (automatic, *splits), then the
    calibration records. Skipped (one record) when the dense K/V, the paged cache and the read
    stream (3x the K+V bytes) would pass `memory_gb`. (`device`: "cuda"; the CPU tests run the
    harness on "cpu" with a stand-in launch.)"""
    from ..kernels import attention_paged_sm80 as paged
    from ..runtime import device_arch

    group = heads // kv_heads
    default = paged.pick_config(HEAD_DIM, group, device_arch())
    configs = list(dict.fromkeys((default, *paged.DECODE_TUNING.get(HEAD_DIM, ()))))
    configs = [c for c in configs if group <= c.block_m]  # decode tiles hold one token's G rows
    kv_bytes = 2 * batch * kv_heads * kv_len * HEAD_DIM * 2
    if 3 * kv_bytes > memory_gb * 1e9:
        return [{"suite": "decode_sweep", "b": batch, "h": heads, "hkv": kv_heads, "kv_len": kv_len, "d": HEAD_DIM,
                 "impl": "all", "status": f"skipped: {3 * kv_bytes / 1e9:.0f} GB (dense K/V, cache, read stream)"}]
    gen = torch.Generator(device=device).manual_seed(batch * kv_len + kv_heads)
    q = torch.randn(batch, heads, HEAD_DIM, device=device, dtype=DTYPE, generator=gen)  # [B, H, d]: one token each
    k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device=device, dtype=DTYPE, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device=device, dtype=DTYPE, generator=gen)
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
    seqlens = torch.full((batch,), kv_len, device=device, dtype=torch.int32)
    no_keys = torch.zeros_like(seqlens)
    timer = functools.partial(measure, warmup=3, reps=reps, max_seconds=3.0, memory=False)
    records = []
    with torch.no_grad():
        for bs in block_sizes:
            k_cache, table = paged_from_dense(k, bs, torch.Generator().manual_seed(kv_len))
            v_cache, _ = paged_from_dense(v, bs, torch.Generator().manual_seed(kv_len))  # the same block order
            base = {"suite": "decode_sweep", "b": batch, "h": heads, "hkv": kv_heads, "kv_len": kv_len, "d": HEAD_DIM,
                    "dtype": "bf16", "block_size": bs, "default_config": str(default)}
            build = _decode_builder(q, k_cache, v_cache, table, cu_q, seqlens)
            records += sweep_point(base, kv_bytes, sweep_cases(configs, splits), build, timer)
            launch, run = build(default, None)
            empty = functools.partial(launch, q, k_cache, v_cache, table, cu_q, no_keys)
            records += calibration_records(base, kv_bytes, run, empty, reps, device)
            del k_cache, v_cache, build, launch, run, empty
            if device == "cuda":
                torch.cuda.empty_cache()
    return records


def _case_name(r: dict) -> str:
    return f"{r['config']} s{r['num_splits']}"


def render_sweep(records: list[dict]) -> str:
    """Markdown: per (point, block size) the default (its config, automatic splits), the best case,
    the top 3 and the calibration times; then per point a config x split-count matrix of us."""
    points: dict[tuple, list[dict]] = {}
    skipped = []
    for r in records:
        if r.get("suite") == "decode_sweep" and r["impl"] == "all":
            skipped.append(f"{r['h']}/{r['hkv']} B={r['b']} KV={r['kv_len']}: {r['status']}")
        elif r.get("suite") == "decode_sweep":
            points.setdefault((f"{r['h']}/{r['hkv']}", r["b"], r["kv_len"], r["block_size"]), []).append(r)
    lines = ["### decode sweep, bf16 d=128: median us (effective K+V TB/s)", "",
             "| H/Hkv | B | KV | bs | default (splits) | us (TB/s) | best (splits) | us (TB/s) | default / best "
             "| top 3 | empty | no flush | write-only flush | read (TB/s) | read, no flush |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def timed(r):
        return "-" if r is None else f"{r['us']:.1f}" + (f" ({r['tbps']:.2f})" if "tbps" in r else "")

    matrices = []
    for key, rs in points.items():
        cases = [r for r in rs if r["impl"] == "tileattn_paged_sweep" and r.get("status") == "ok"]
        calib = {r["impl"]: r for r in rs if r["impl"].startswith("calib_")}
        default = next((r for r in cases if r["config"] == r["default_config"] and r["splits_requested"] == "auto"),
                       None)
        ranked = sorted(cases, key=lambda r: r["us"])
        best = ranked[0] if ranked else None
        ratio = f"{default['us'] / best['us']:.2f}x" if default and best else "-"
        top = "; ".join(f"{_case_name(r)} {r['us']:.1f}" for r in ranked[:3])
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | "
            f"{_case_name(default) if default else '-'} | {timed(default)} | {_case_name(best) if best else '-'} | "
            f"{timed(best)} | {ratio} | {top} | {timed(calib.get('calib_empty'))} | "
            f"{timed(calib.get('calib_no_flush'))} | {timed(calib.get('calib_write_flush'))} | "
            f"{timed(calib.get('calib_read'))} | "
            f"{timed(calib.get('calib_read_no_flush'))} |")
        errors = [r for r in rs if r["impl"] == "tileattn_paged_sweep" and r.get("status") != "ok"]
        counts = sorted({r["num_splits"] for r in cases})
        configs = list(dict.fromkeys(r["config"] for r in rs if r["impl"] == "tileattn_paged_sweep"))
        matrix = [f"{key[0]} B={key[1]} KV={key[2]} bs={key[3]}: us by config (rows) x split count (columns; "
                  "* the automatic choice)", "",
                  "| config | " + " | ".join(str(s) for s in counts) + " | max rel. err |",
                  "|---|" + "---|" * (len(counts) + 1)]
        for c in configs:
            mine = {r["num_splits"]: r for r in cases if r["config"] == c}
            cells = [f"{mine[s]['us']:.1f}{'*' if mine[s]['splits_requested'] == 'auto' else ''}" if s in mine
                     else "-" for s in counts]
            err = max((r["rel_err_vs_default"] for r in mine.values()), default=None)
            status = next((r["status"] for r in errors if r["config"] == c), None)
            matrix.append(f"| {c} | " + " | ".join(cells) + f" | {fmt_number(err)}{' ' + status if status else ''} |")
        matrices += ["", *matrix]
    lines += ["", "(empty: the default launch with every length 0; no flush: the default without the L2 flush; "
              "write-only flush: the default after the old harness flush (a write pass over 2x the L2, no read pass), "
              "(flush + call) - flush; "
              "read: torch.sum over the same bytes, fp32)", *(f"\n{s}" for s in skipped), *matrices]
    return "\n".join(lines)


def run_sweep(points, block_sizes, splits, reps, memory_gb, device="cuda") -> list[dict]:
    """Sweep records of every point (see sweep_decode_point), printing each point's best."""
    records = []
    for heads, kv_heads, batch, kv_len in points:
        point = sweep_decode_point(heads, kv_heads, batch, kv_len, block_sizes, splits, reps, memory_gb, device)
        records += point
        if point[0]["impl"] == "all":
            print(f"sweep H={heads}/{kv_heads} B={batch} KV={kv_len}: {point[0]['status']}")
            continue
        ok = [r for r in point if r["impl"] == "tileattn_paged_sweep" and r.get("status") == "ok"]
        best = min(ok, key=lambda r: r["us"], default=None)
        print(f"sweep H={heads}/{kv_heads} B={batch} KV={kv_len}: {len(ok)} cases"
              + (f", best {_case_name(best)} bs={best['block_size']} {best['us']:.1f} us" if best else ""))
    return records


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; with --sweep, points as (heads, kv_heads, batch, kv_len) tuples (the --quick
    decode points by default), split counts and block sizes filled in. Bad values exit through
    argparse's error (status 2) naming the option."""
    ap = argparse.ArgumentParser(prog="tileattn bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"B in {QUICK['batches']}, KV in {QUICK['kv_lens']}")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--memory-gb", type=float, default=100.0, help="skip points needing more K+V than this")
    ap.add_argument("--no-prefill", action="store_true", help="decode only")
    ap.add_argument("--prefill-only", action="store_true", help="chunked prefill only (no decode points)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="chunked prefill: timing rounds, the implementations' order rotated (median reported)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="write the tables here")
    ap.add_argument("--sweep", action="store_true",
                    help="time the default decode config and every DECODE_TUNING candidate x split count instead")
    ap.add_argument("--points", nargs="+", metavar="H/HKV:B:KV",
                    help="--sweep points, e.g. 32/8:8:4096 (default: the --quick decode points)")
    ap.add_argument("--splits", nargs="+", type=positive_int, metavar="S",
                    help=f"--sweep forced split counts, beside the automatic one (default: {SWEEP_SPLITS})")
    ap.add_argument("--block-sizes", nargs="+", type=int, metavar="BS",
                    help=f"--sweep or --prefill-only block sizes (default: {QUICK['block_sizes']})")
    args = ap.parse_args(argv)
    if not 0 < args.memory_gb < float("inf"):  # NaN too: every point would be skipped
        ap.error(f"--memory-gb must be a finite number > 0, got {args.memory_gb}")
    if args.prefill_only and (args.no_prefill or args.sweep):
        ap.error("--prefill-only goes without --no-prefill and --sweep")
    if args.block_sizes is not None:
        if not (args.sweep or args.prefill_only):
            ap.error("--block-sizes goes with --sweep or --prefill-only")
        args.block_sizes = tuple(dict.fromkeys(args.block_sizes))
        if any(bs < 16 or bs > 256 or bs & (bs - 1) for bs in args.block_sizes):
            ap.error(f"--block-sizes must be powers of two in 16..256, got {list(args.block_sizes)}")
    if not args.sweep:
        if args.points or args.splits:
            ap.error("--points and --splits go with --sweep")
        return args
    try:
        args.points = [parse_point(p) for p in args.points] if args.points else quick_points()
    except ValueError as exc:
        ap.error(f"--points: {exc}")
    args.splits = tuple(dict.fromkeys(args.splits or SWEEP_SPLITS))
    args.block_sizes = args.block_sizes or QUICK["block_sizes"]
    ragged = [p for p in args.points if any(p[3] % bs for bs in args.block_sizes)]
    if ragged:  # the cache is the dense K/V cut into whole blocks
        ap.error(f"--points: KV {ragged[0][3]} is not a multiple of every block size {list(args.block_sizes)}")
    return args


def main(argv=None) -> int:
    from ..runtime import require_gpu
    from .env import environment

    args = parse_args(argv)
    require_gpu()
    env = environment()
    print(environment_line(env))
    if args.sweep:
        start = time.perf_counter()
        records = run_sweep(args.points, args.block_sizes, args.splits, args.reps, args.memory_gb)
        for r in records:
            err = r.get("rel_err_vs_default")
            if err is not None and err > SWEEP_ERR_WARN:
                print(f"WARNING: sweep {r['config']} splits={r['num_splits']} B={r['b']} H={r['h']}/{r['hkv']} "
                      f"bs={r['block_size']}: rel. error {err:.2e} vs the default")
        text = render_sweep(records)
        save_run(records, env, text, args.json, args.markdown)
        print(text)
        print(f"\nsweep: {time.perf_counter() - start:.0f} s wall")
        return 0
    batches = QUICK["batches"] if args.quick else BATCHES
    kv_lens = QUICK["kv_lens"] if args.quick else KV_LENS
    block_sizes = args.block_sizes or (QUICK["block_sizes"] if args.quick else BLOCK_SIZES)
    records: list[dict] = []
    for heads, kv_heads in HEADS:
        for batch in () if args.prefill_only else batches:
            for kv_len in kv_lens:
                point = decode_point(batch, heads, kv_heads, kv_len, block_sizes, args.reps, args.memory_gb)
                records += point
                print(f"decode H={heads}/{kv_heads} B={batch} KV={kv_len}: " + ", ".join(
                    f"{r['impl']}{r.get('block_size', '')} {fmt_number(r.get('us'))} us" if r.get("status") == "ok"
                    else f"{r['impl']} {r.get('status')}" for r in point))
        if not args.no_prefill:
            records += prefill_point(heads, kv_heads, block_sizes, args.reps, args.rounds)
    if not args.prefill_only:
        host_time(records)
    for r in records:
        err = r.get("rel_err_vs_sdpa", r.get("rel_err_vs_dense"))
        if err is not None and err > 2e-2:
            print(f"WARNING: {r['suite']} {r['impl']} B={r['b']} H={r['h']}/{r['hkv']}: rel. error {err:.2e}")
    text = render(records)
    save_run(records, env, text, args.json, args.markdown)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
