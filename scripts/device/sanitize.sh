# The exclusive GPU tests, then compute-sanitizer (TOOLS, default all four) over the whole sanitize set with
# the compiled path on (the GPU conftest switches it on), in the time left before DEADLINE seconds (default
# 540): `make gpu-check`'s sanitizer half on the lent GPU. Sourced by issue9_benches.sh (prologue already
# run) or run alone.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [DEADLINE=<s>] [TOOLS=a,b] bash scripts/device/sanitize.sh
[ -z "$TILEATTN_GIT_COMMIT" ] && source scripts/device/prologue.sh
t0=${t0:-$(date +%s)}; left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - t0) )); }
T=$(left); echo "== exclusive GPU tests at $(( $(date +%s)-t0 ))s, $T s left"
[ $T -gt 60 ] && timeout 100 python3 -m pytest -q -m "gpu and exclusive" -p no:cacheprovider --junitxml=$OUT/junit-exclusive.xml tests/gpu 2>&1 | tail -4
T=$(left); echo "== ${TOOLS:=memcheck,racecheck,synccheck,initcheck} at $(( $(date +%s)-t0 ))s, $T s left"
[ $T -gt 90 ] && timeout $(( T - 15 )) python3 scripts/gpu_check.py --report-dir $OUT/sanitize --bench "" --no-tests --no-audit \
  --sanitizer-tools $TOOLS --sanitizer-jobs 15 2>&1 | tail -16
echo "== sanitize done $(( $(date +%s)-t0 ))s"
sanitizer_logs_back $OUT/sanitize
gzip -f $OUT/*.xml 2>/dev/null; true
