"""Where a short tile's time goes: per-tile clock64 stamps of the Hopper forward's consumers (session 51 trial).

Runs on a tree patched with fwd-tile-trace-trial-2026-12-06.patch (consumer thread 0 of each consumer writes,
per tile: clock64 after taking the tile, after Q's wait, after the first block's softmax, after the tail P V's
wait, after the O store's issue; the visit count, the tile index and %globaltimer), into a buffer passed as the
persistent grid's tile counter (the counter pair first, the stamps 64 bytes on). Prints, per shape, the median
split of a tile into Q wait / first block / loop + tail / epilogue / gap to the next tile, in clocks, and
the loop's clocks per visit from a least-squares fit over the tiles, so the per-tile cost reads in visits.

    PYTHONPATH=<patched tree>/src python fwd-tile-trace-trial-2026-12-06.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

from tileattn.kernels import attention_fwd_sm90 as af

TRACE_TILES = 64  # kTraceTiles in the patch
SHAPES = [  # (d, causal, N, config or None for the default)
    (128, False, 2048, None), (128, True, 2048, None), (128, False, 4096, None), (128, True, 4096, None),
    (128, False, 8192, af.Sm90Config(128, 2, False, True)), (64, False, 2048, None), (64, True, 2048, None),
    (256, False, 2048, af.Sm90Config(80, 2, True, True)), (256, True, 2048, af.Sm90Config(80, 2, True, True)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    b, h = 4, 32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(8 + sms * TRACE_TILES * 3 * 8, dtype=torch.int64, device="cuda")  # counter pair + stamps
    af._tile_counter = lambda persistent, device_index: buf.data_ptr() if persistent else 0
    summary = []
    for d, causal, n, cfg in SHAPES:
        cfg = cfg or af.default_config(d, causal, n, seqlen_q=n, heads=h, kv_heads=h)
        assert cfg.persistent, cfg
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)

        def call():
            af.launch_forward_sm90(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d), config=cfg)

        for _ in range(5):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        buf[8:].zero_()
        call()
        torch.cuda.synchronize()
        assert int(buf[0]) == 0, "the counter pair was not reset"
        consumers = cfg.consumers
        raw = buf[8:8 + sms * TRACE_TILES * consumers * 8].view(sms, TRACE_TILES, consumers, 8).cpu().numpy()
        np.save(f"{args.out}/trace-d{d}-{'c' if causal else 'nc'}-{n}.npy", raw)
        stamps = raw[:, :, consumers - 1, :]  # the last consumer: its rows see every visited block when causal
        rows = []
        for cta in range(sms):
            tiles = [stamps[cta, i] for i in range(TRACE_TILES) if stamps[cta, i, 0] != 0]
            for i, s in enumerate(tiles):
                if 0 in (s[2], s[3], s[4]):  # a consumer with no rows in this tile (no visit, no store)
                    continue
                gap = tiles[i + 1][0] - s[4] if i + 1 < len(tiles) else None
                rows.append((s[5], s[1] - s[0], s[2] - s[1], s[3] - s[2], s[4] - s[3], gap))
        visits = np.array([r[0] for r in rows], dtype=float)
        loop = np.array([r[3] for r in rows], dtype=float)
        slope, icpt = np.polyfit(visits - 1, loop, 1)  # clocks per visit, and the tail P V's share
        per_tile = {name: float(np.median([r[j] for r in rows if r[j] is not None]))
                    for j, name in ((1, "q_wait"), (2, "first_block"), (4, "epilogue"), (5, "gap"))}
        fixed = per_tile["q_wait"] + per_tile["first_block"] + icpt + per_tile["epilogue"] + per_tile["gap"]
        rec = {"d": d, "causal": causal, "n": n, "config": str(cfg), "ms": ms,
               "tflops": 4 * b * h * n * n * d / (2 if causal else 1) / (ms * 1e-3) / 1e12,
               "tiles_traced": len(rows), "mean_visits": float(visits.mean()), "clk_per_visit": float(slope),
               "loop_intercept": float(icpt), **per_tile, "fixed_clk": float(fixed),
               "fixed_in_visits": float(fixed / slope),
               "fixed_share": float(fixed / (fixed + slope * visits.mean()))}
        summary.append(rec)
        print(json.dumps(rec), flush=True)
    with open(f"{args.out}/tile-trace-summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    print("| d | mask | N | config | TFLOP/s | visits/tile | clk/visit | Q wait | first block | tail (fit) | epilogue "
          "| gap | fixed (visits) | fixed share |")
    for r in summary:
        print(f"| {r['d']} | {'causal' if r['causal'] else 'nc'} | {r['n']} | {r['config']} | {r['tflops']:.0f} | "
              f"{r['mean_visits']:.1f} | {r['clk_per_visit']:.0f} | {r['q_wait']:.0f} | {r['first_block']:.0f} | "
              f"{r['loop_intercept']:.0f} | {r['epilogue']:.0f} | {r['gap']:.0f} | {r['fixed_in_visits']:.2f} | "
              f"{r['fixed_share']:.3f} |")


if __name__ == "__main__":
    main()
