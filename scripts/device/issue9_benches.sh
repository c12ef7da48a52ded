# Issue #9's benchmarks on the lent GPU, most important first: `tileattn bench overhead --breakdown` (the
# compiled path built first), `tileattn bench startup` with the compiled path on (the default); then on an
# H200 the seed table twice against its H200 baseline (docs/BENCHMARKS.md, session 29: two processes of one
# tree differ by up to 5 % at one point), or on another GPU (where that baseline means nothing) the
# exclusive GPU tests and racecheck / synccheck / initcheck over the sanitize set (scripts/device/sanitize.sh),
# in the time left before DEADLINE seconds (default 540; BENCH_ONLY=1: not those).
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [DEADLINE=<s>] [BENCH_ONLY=1] bash scripts/device/issue9_benches.sh
source scripts/device/prologue.sh
t0=$(date +%s); left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - t0) )); }
python3 -c "import time; t=time.time(); from tileattn.runtime import host_launch as h; p=h.build(); print('built', p, round(time.time()-t,1), 's')" 2>&1 | tail -3
echo "== overhead at $(( $(date +%s)-t0 ))s"
timeout 150 python3 -m tileattn.cli bench overhead --breakdown --calls 100 --rounds 15 --json $OUT/overhead.json 2>&1 | grep -v Warning | grep -v "return lambda" | tail -32
echo "== startup at $(( $(date +%s)-t0 ))s"
timeout 150 python3 -m tileattn.cli bench startup --runs 2 --profile $OUT/startup-profile.txt --json $OUT/startup.json 2>&1 | tail -6
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BASE=docs/runs/attention_seed_h200_2026-12-04-355bd3e.json
  for run in a b; do
    T=$(left); echo "== seed table ($run) at $(( $(date +%s)-t0 ))s, $T s left"
    [ $T -lt 150 ] && break
    timeout $(( T - 10 )) python3 -m tileattn.cli bench attention --seq 4096 --seq 16384 --seq 32768 --impl tileattn \
      --impl sdpa_cudnn --impl sdpa_flash --reps 3 --json $OUT/seed-$run.json > $OUT/seed-$run.log 2>&1; echo "rc $?"
    python3 -m tileattn.bench.report $OUT/seed-$run.json --compare $BASE 2>&1 | tail -15
    python3 -m tileattn.bench.report $OUT/seed-$run.json --compare $BASE --relative-to sdpa_cudnn 2>&1 | tail -3
  done
elif [ -z "$BENCH_ONLY" ]; then
  TOOLS=${TOOLS:-racecheck,synccheck,initcheck} source scripts/device/sanitize.sh
fi
echo "== done $(( $(date +%s)-t0 ))s"
gzip -f $OUT/*.xml $OUT/*.log $OUT/sanitize/*.log 2>/dev/null; true
