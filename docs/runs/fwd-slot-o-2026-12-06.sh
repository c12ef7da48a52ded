# Trial (session 52): the Hopper forward at d = 256 with O staged in the last visit's K / V slots (kSlotO) against
# main's O staged in sQ. The checkout is the trial; main's src is rebuilt beside it by reversing the patch next to
# this script. scripts/fwd_sm90_configs.py at d = 256 (B = 4, H = 32, bf16, causal and not, cuDNN in every process)
# in alternating processes main, trial, trial, main; then the four sanitizers over the
# forward's sanitize cases, its GPU tests, then the rest of the GPU suite on the trial, until DEADLINE s (0: the A/B only).
# Ran once (session 52, call 2) from a checkout of the trial branch (afb7078). From main: `git apply` this patch and
# fwd-slot-o-tests-2026-12-06.patch first, so that the checkout is the trial. Result: docs/attention_fwd_sm90.md, "d = 256:
# O staged in the last visit's ring slots".
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [SEQS="2048 4096 8192"] [CFGS="..."] [DEADLINE=590] bash docs/runs/fwd-slot-o-2026-12-06.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
rm -rf /tmp/main-tree && mkdir -p /tmp/main-tree && cp -r src /tmp/main-tree/ \
  && (cd /tmp/main-tree && git apply -R "$OLDPWD/docs/runs/fwd-slot-o-2026-12-06.patch") || exit 1
grep -c kSlotO src/tileattn/csrc/attention_fwd_sm90.cu /tmp/main-tree/src/tileattn/csrc/attention_fwd_sm90.cu
CFGS=${CFGS-"128x64/s2 128x64/s2/persistent 128x80/s2/pp 128x80/s2/pp/persistent"}
args=""; for c in $CFGS; do args="$args --config $c"; done
for n in ${SEQS:-2048 4096 8192}; do args="$args --seq $n"; done
for run in main-1 trial-1 trial-2 main-2; do
  tree=src; [ "${run%-*}" = main ] && tree=/tmp/main-tree/src
  PYTHONPATH=$tree:.:/tmp/site timeout ${BENCH_S:-120} python3 scripts/fwd_sm90_configs.py --label $run --rounds ${ROUNDS:-3} \
    --head-dim 256 $args > $OUT/slot-o-$run.jsonl 2> $OUT/slot-o-$run.err || tail -3 $OUT/slot-o-$run.err
  echo "== $run at $(el)s"
done
for t in main trial; do echo "-- $t"; python3 scripts/fwd_sm90_configs.py --summary $OUT/slot-o-$t-*.jsonl; done
[ "${DEADLINE:-590}" = 0 ] && exit 0
left() { echo $(( ${DEADLINE:-590} - $(el) )); }
echo "== $(el)s the four sanitizers over tests/gpu/test_attention_fwd_sm90.py's sanitize cases (the trial)"
timeout ${SAN_S:-150} python3 scripts/gpu_check.py --report-dir $OUT/sanitize --bench "" --no-tests --no-audit \
  --tests tests/gpu/test_attention_fwd_sm90.py --sanitizer-jobs 15 2>&1 | tail -8
sanitizer_logs_back $OUT/sanitize
FWD="tests/gpu/test_attention_fwd_sm90.py tests/gpu/test_attention_fwd_sm90_dropout.py tests/gpu/test_attention_fwd_sm90_varlen.py"
T=$(left); echo "== $(el)s the Hopper forward's GPU tests on the trial, $T s left"
[ $T -gt 30 ] && timeout -s INT $T python3 -m pytest -q -m "gpu and not exclusive" -n 15 -p no:cacheprovider \
  --junitxml=$OUT/junit-fwd.xml $FWD > $OUT/tests-fwd.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/tests-fwd.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/tests-fwd.log | head -20
T=$(left); echo "== $(el)s the rest of the GPU suite, $T s (SIGINT at the deadline: pytest still writes its summary)"
[ $T -gt 30 ] && timeout -s INT $T python3 -m pytest -q -m "gpu and not exclusive" -n 15 -p no:cacheprovider \
  $(for f in $FWD; do echo --ignore=$f; done) --junitxml=$OUT/junit-rest.xml tests/gpu > $OUT/tests-rest.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/tests-rest.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/tests-rest.log | head -20
echo "== $(el)s done"; gzip -f $OUT/*.xml 2>/dev/null; true
