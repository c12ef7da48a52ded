"""Where a short tile's time goes: per-tile clock64 stamps of the Hopper forward's consumers (session 51 trial).

Runs on a tree patched with fwd-tile-trace-trial-2026-12-06.patch: thread 0 of each consumer warpgroup writes
clock64 at the points SEGMENTS names (taking the tile, Q's wait, the first S and its softmax, the loop and the
tail P V, each step of the epilogue, the store's issue and, without sO, its shared-memory read), the visit count,
the tile index and %globaltimer, into a buffer passed as the persistent grid's tile counter (the counter pair
first, 16 int64 per tile and consumer 64 bytes on). Prints, per shape and consumer, the median of each segment
over the tiles in SM clocks, the loop's clocks per visit, and the gap from one tile's store to the next tile.
Stamps: `trace-stamps.npz` under --out. The launch time in the summary is the harness's median (call 4's record
predates that: 20 launches back to back, no L2 flush; the docs quote its clocks, not its times).

    PYTHONPATH=<patched tree>/src python fwd-tile-trace-trial-2026-12-06.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

from tileattn.bench.harness import measure
from tileattn.kernels import attention_fwd_sm90 as af

TRACE_TILES = 64  # kTraceTiles in the patch
# (name, from stamp, to stamp): the patch's stamps 0 take tile, 1 Q waited, 8 first S waited, 2 first softmax
# done, 3 tail P V waited, 9 lse written, 14 previous store read (sO kernels), 10 first epilogue barrier,
# 11 stmatrix done, 12 proxy fence, 13 second barrier, 4 store issued, 15 store read (kernels without sO).
SEGMENTS = [("q_wait", 0, 1), ("first_s", 1, 8), ("first_softmax", 8, 2), ("loop_and_tail", 2, 3),
            ("lse", 3, 9), ("prev_store_read", 9, 14), ("barrier1", 14, 10), ("stmatrix", 10, 11),
            ("fence", 11, 12), ("barrier2", 12, 13), ("store_issue", 13, 4), ("store_read", 4, 15)]
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
    buf = torch.zeros(8 + sms * TRACE_TILES * 3 * 16, dtype=torch.int64, device="cuda")  # counter pair + stamps
    af._tile_counter = lambda persistent, device_index: buf.data_ptr() if persistent else 0
    summary, stamps = [], {}
    for d, causal, n, cfg in SHAPES:
        cfg = cfg or af.default_config(d, causal, n, seqlen_q=n, heads=h, kv_heads=h)
        assert cfg.persistent, cfg
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)

        def call():
            af.launch_forward_sm90(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d), config=cfg)

        ms = measure(call, warmup=5, reps=20, memory=False).median_ms  # also the stamped launch's warm-up
        buf[8:].zero_()
        call()
        torch.cuda.synchronize()
        assert int(buf[0]) == 0, "the counter pair was not reset"
        consumers = cfg.consumers
        raw = buf[8:8 + sms * TRACE_TILES * consumers * 16].view(sms, TRACE_TILES, consumers, 16).cpu().numpy()
        stamps[f"d{d}-{'causal' if causal else 'nc'}-{n}"] = raw
        rec = {"d": d, "causal": causal, "n": n, "config": str(cfg), "ms": ms,
               "tflops": 4 * b * h * n * n * d / (2 if causal else 1) / (ms * 1e-3) / 1e12}
        for c in range(consumers):
            segs = {name: [] for name, _, _ in SEGMENTS}
            segs["gap"], visits, loops = [], [], []
            for cta in range(sms):
                tiles = [raw[cta, i, c] for i in range(TRACE_TILES) if raw[cta, i, c, 0] != 0]
                for i, st in enumerate(tiles):
                    if 0 in (st[2], st[3], st[4], st[8]):  # a consumer with no rows in this tile
                        continue
                    for name, a, z in SEGMENTS:
                        if st[a] != 0 and st[z] != 0:
                            segs[name].append(st[z] - st[a])
                    if i + 1 < len(tiles):
                        segs["gap"].append(tiles[i + 1][0] - st[4])
                    visits.append(st[5])
                    loops.append(st[3] - st[2])
            v, lp = np.array(visits, float), np.array(loops, float)
            rec[f"c{c}"] = {"tiles": len(v), "mean_visits": float(v.mean()),
                            "loop_clk_per_visit": float(np.median(lp / np.maximum(v - 1, 1))),
                            **{name: float(np.median(x)) for name, x in segs.items() if x}}
        summary.append(rec)
        print(json.dumps(rec), flush=True)
    np.savez_compressed(f"{args.out}/trace-stamps.npz", **stamps)
    with open(f"{args.out}/tile-trace-summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    names = [name for name, _, _ in SEGMENTS] + ["gap"]
    print("| d | mask | N | config | TFLOP/s | consumer | visits | loop clk/visit | " + " | ".join(names) + " |")
    for r in summary:
        for key in sorted(k for k in r if k.startswith("c") and k[1:].isdigit()):
            x = r[key]
            print(f"| {r['d']} | {'causal' if r['causal'] else 'nc'} | {r['n']} | {r['config']} | {r['tflops']:.0f} | {key} | "
                  f"{x['mean_visits']:.1f} | {x['loop_clk_per_visit']:.0f} | "
                  + " | ".join(f"{x[nm]:.0f}" if nm in x else "-" for nm in names) + " |")


if __name__ == "__main__":
    main()
