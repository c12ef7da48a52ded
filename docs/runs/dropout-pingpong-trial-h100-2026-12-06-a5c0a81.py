"""Trial (not registered): the dense dropout forward on ping-pong tiles against the registered tiles, one process,
rotated rounds; forward without autograd, bf16, B = 4, N = 4096; plain causal / non-causal for the ratio.

Session 48, call 6 (H100; output in the .md of the same name). The statements are the ones that ran, laid out for
the linter afterwards.
"""

import json
import statistics

import torch

import tileattn
from tileattn import api
from tileattn.bench.harness import measure
from tileattn.kernels import attention_fwd_sm90 as af
from tileattn.kernels import family

C = af.Sm90Config
fam = family(af.FAMILY_NAME)
base = dict(af.VARIANT_DEFAULTS)
trial = {64: [C(128, 3, pingpong=True), C(128, 2, pingpong=True)], 128: [C(128, 2, pingpong=True)],
         256: [C(64, 2, pingpong=True)]}
extra = tuple(af.variant_expression(d, c, True, f) for d, cs in trial.items() for c in cs for f in (32, 33))
object.__setattr__(fam, "tuning", fam.tuning + extra)  # the ping-pong dropout expressions as tuning candidates
g = torch.Generator(device="cuda").manual_seed(0)
res = {}
for rnd in range(3):
    for d in (64, 128, 256):
        h = 32 if d < 256 else 16
        q, k, v = (torch.randn(4, h, 4096, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * 4 * h * 4096 * 4096 * d / (2 if causal else 1)
            cands = [("plain", None), ("default", base[d])] + [(str(c), c) for c in trial[d]]
            cands = cands[rnd % len(cands):] + cands[:rnd % len(cands)]
            outs = {}
            for name, cfg in cands:
                af.VARIANT_DEFAULTS[d] = cfg or base[d]
                api.clear_plans()
                opts = {} if name == "plain" else {"dropout_p": 0.1, "seed": 7, "offset": 0}

                def fn(opts=opts, causal=causal):
                    return tileattn.attention(q, k, v, causal, **opts)

                with torch.no_grad():
                    outs[name] = fn()
                    t = measure(fn, reps=20).median_ms
                res.setdefault((d, causal, name), []).append(flops / t / 1e9)
            af.VARIANT_DEFAULTS[d] = base[d]
            for name, _ in cands:
                if name not in ("plain", "default"):
                    diff = float((outs[name].float() - outs["default"].float()).abs().max())
                    print(json.dumps({"round": rnd, "d": d, "causal": causal, "cfg": name, "maxdiff_vs_default": diff}),
                          flush=True)
print("| d | causal | config | TFLOP/s (median of 3) | / plain |\n|---|---|---|---|---|")
for (d, causal, name), v in res.items():
    m = statistics.median(v)
    p = statistics.median(res[(d, causal, "plain")])
    print(f"| {d} | {causal} | {name} | {m:.0f} | {m / p:.3f} |")
