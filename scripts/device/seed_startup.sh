# Issue #9's benchmarks that no launch-path change moves, on the lent H200: `tileattn bench startup` with the
# compiled path on (the default), the seed table against its H200 baseline (docs/BENCHMARKS.md, session 29:
# two processes of one tree differ by up to 5 % at one point, so it runs twice), then the GPU tests a
# session changed but has not yet run on a GPU (TESTS, pytest targets; default: none).
# Usage: COMMIT=<sha> [TESTS="..."] bash scripts/device/seed_startup.sh   (carry as scripts/device/prologue.sh says)
source scripts/device/prologue.sh
t0=$(date +%s)
echo "== startup at $(( $(date +%s)-t0 ))s"
timeout 200 python3 -m tileattn.cli bench startup --runs 2 --profile $OUT/startup-profile.txt --json $OUT/startup.json 2>&1 | tail -12
BASE=docs/runs/attention_seed_h200_2026-12-04-355bd3e.json
for run in a b; do
  echo "== seed table ($run) at $(( $(date +%s)-t0 ))s"
  timeout 170 python3 -m tileattn.cli bench attention --seq 4096 --seq 16384 --seq 32768 --impl tileattn --impl sdpa_cudnn \
    --impl sdpa_flash --reps 3 --json $OUT/seed-$run.json > $OUT/seed-$run.log 2>&1; echo "rc $?"
  python3 -m tileattn.bench.report $OUT/seed-$run.json --compare $BASE 2>&1 | tail -16
  python3 -m tileattn.bench.report $OUT/seed-$run.json --compare $BASE --relative-to sdpa_cudnn 2>&1 | tail -16
done
if [ -n "$TESTS" ]; then
  echo "== tests at $(( $(date +%s)-t0 ))s: $TESTS"
  timeout 120 python3 -m pytest -q -m "gpu and not exclusive" -n 8 -p no:cacheprovider --junitxml=$OUT/junit-tests.xml $TESTS 2>&1 | tail -8
fi
echo "== done $(( $(date +%s)-t0 ))s"
gzip -f $OUT/*.xml $OUT/*.log 2>/dev/null; true
