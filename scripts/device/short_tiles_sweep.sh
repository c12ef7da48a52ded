# The Hopper forward's tile candidates at 2048 and 4096 keys beside SDPA cuDNN, on whichever card the call
# gets (issue #11's short points, where the tiles were chosen on the H200): scripts/fwd_sm90_configs.py, B = 4,
# H = 32, bf16, causal and not, three rotated rounds, one process per head dim. The candidates are compiled
# first, in parallel (one process each), so that the timing processes find them in the kernel cache.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> bash scripts/device/short_tiles_sweep.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
D128="128x128/s2 128x128/s2/persistent 128x128/s2/pp/persistent 192x80/s3/persistent 192x64/s4/persistent 128x176/s2/pp"
D256="128x64/s2 128x64/s2/persistent 128x80/s2/pp 128x80/s2/pp/persistent 128x80/s2"
D64="192x128/s2/persistent 192x128/s3/persistent 128x128/s3/persistent 128x192/s2/pp/persistent"
python3 - "$D128" "$D256" "$D64" <<'PY'
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

def build(job):
    d, text, causal = job
    from tileattn.kernels import attention_fwd_sm90 as af
    sys.path.insert(0, "scripts")
    from fwd_sm90_configs import parse_config
    af._kernel(0, d, parse_config(text), causal, True)
    return d, text, causal

jobs = [(d, text, causal) for d, arg in zip((128, 256, 64), sys.argv[1:]) for text in arg.split() for causal in (False, True)]
with ProcessPoolExecutor(16, mp_context=get_context("spawn")) as pool:
    for done in pool.map(build, jobs):
        pass
print("compiled", len(jobs), "instantiations")
PY
echo "== compiled at $(( $(date +%s)-t0 ))s"
for d in 128 256 64; do
  eval cfgs=\$D$d; args=""; for c in $cfgs; do args="$args --config $c"; done
  timeout 150 python3 scripts/fwd_sm90_configs.py --label "$COMMIT" --rounds 3 --seq 2048 --seq 4096 --head-dim $d $args \
    > $OUT/short-tiles-d$d.jsonl 2> $OUT/short-tiles-d$d.err || tail -5 $OUT/short-tiles-d$d.err
  echo "== d=$d at $(( $(date +%s)-t0 ))s"
done
python3 - $OUT/short-tiles-d*.jsonl <<'PY'
import json, statistics, sys
from collections import defaultdict
rows = [json.loads(line) for f in sys.argv[1:] for line in open(f)]
tf = defaultdict(list)
for r in rows:
    tf[(r["d"], r["causal"], r["n"], r["impl"])].append(r["tflops"])
for d, causal, n in sorted({k[:3] for k in tf}):
    cudnn = statistics.median(tf[(d, causal, n, "cudnn")])
    cells = [f"{impl} {statistics.median(v):.0f} ({statistics.median(v) / cudnn:.3f})"
             for (dd, cc, nn, impl), v in tf.items() if (dd, cc, nn) == (d, causal, n) and impl != "cudnn"]
    print(f"d={d} {'causal' if causal else 'nc'} N={n} cudnn {cudnn:.0f}: " + "; ".join(cells))
PY
echo "== done $(( $(date +%s)-t0 ))s"
