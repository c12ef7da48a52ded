# Trial (session 52): the Hopper forward's tile boundary merged into one step (kMerged: the next tile's S_0 issued
# with this tile's last P V, its first softmax under it; two Q buffers) against main. Run from a checkout of the
# trial (from main: `git apply` the patch beside this script and fwd-merged-boundary-tests-2026-12-06.patch first);
# main's src is rebuilt beside it by reversing the
# patch. scripts/fwd_sm90_configs.py at d = 128, the default 128 x 128 / s2 / persistent (B = 4, H = 32, bf16,
# causal and not; its output checked against cuDNN's, relative error < 1e-2), in processes main, trial, trial, main.
# With DEADLINE=<s> (e.g. 560) it then runs the four sanitizers over the forward's sanitize cases and the forward's GPU
# tests on the trial until DEADLINE s; the rest of the suite and a merge come after.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [SEQS="2048 4096"] [BENCH_S=35] [DEADLINE=<s>] bash docs/runs/fwd-merged-boundary-2026-12-06.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
rm -rf /tmp/main-tree && mkdir -p /tmp/main-tree && cp -r src /tmp/main-tree/ \
  && (cd /tmp/main-tree && git apply -R "$OLDPWD/docs/runs/fwd-merged-boundary-2026-12-06.patch") || exit 1
grep -c kMerged src/tileattn/csrc/attention_fwd_sm90.cu /tmp/main-tree/src/tileattn/csrc/attention_fwd_sm90.cu
args="--config 128x128/s2/persistent"; for n in ${SEQS:-2048 4096}; do args="$args --seq $n"; done
for run in main-1 trial-1 trial-2 main-2; do
  tree=src; [ "${run%-*}" = main ] && tree=/tmp/main-tree/src
  PYTHONPATH=$tree:.:/tmp/site timeout ${BENCH_S:-35} python3 scripts/fwd_sm90_configs.py --label $run --rounds ${ROUNDS:-3} \
    --head-dim 128 $args > $OUT/merged-$run.jsonl 2> $OUT/merged-$run.err || tail -3 $OUT/merged-$run.err
  echo "== $run at $(el)s"
done
for t in main trial; do echo "-- $t"; python3 scripts/fwd_sm90_configs.py --summary $OUT/merged-$t-*.jsonl; done
cat $OUT/merged-*.jsonl > $OUT/merged-all.jsonl; rm -f $OUT/merged-[mt]*.jsonl
[ "${DEADLINE:-0}" = 0 ] && exit 0
left() { echo $(( DEADLINE - $(el) )); }
echo "== $(el)s the four sanitizers over tests/gpu/test_attention_fwd_sm90.py's sanitize cases (the trial)"
timeout ${SAN_S:-150} python3 scripts/gpu_check.py --report-dir $OUT/sanitize --bench "" --no-tests --no-audit \
  --tests tests/gpu/test_attention_fwd_sm90.py --sanitizer-jobs 15 2>&1 | tail -8
sanitizer_logs_back $OUT/sanitize
T=$(left); echo "== $(el)s the Hopper forward's GPU tests on the trial, $T s left"
[ $T -gt 30 ] && timeout -s INT $T python3 -m pytest -q -m "gpu and not exclusive" -n 15 -p no:cacheprovider \
  --junitxml=$OUT/junit-fwd.xml tests/gpu/test_attention_fwd_sm90.py tests/gpu/test_attention_fwd_sm90_dropout.py \
  tests/gpu/test_attention_fwd_sm90_varlen.py > $OUT/tests-fwd.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/tests-fwd.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/tests-fwd.log | head -20
echo "== $(el)s done"; gzip -f $OUT/*.xml 2>/dev/null; rm -f $OUT/tests-fwd.log; true
