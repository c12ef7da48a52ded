# A Hopper-forward kernel trial against main in one device call. The checkout is the trial (its patches applied);
# main's src is rebuilt beside it by reversing PATCH (the trial's src patch). scripts/fwd_sm90_configs.py with ARGS
# (its --head-dim / --config / --seq options; B = 4, H = 32, bf16, causal and not, cuDNN in every process, each
# config's output checked against cuDNN's) in processes main, trial, trial, main, ROUNDS rounds each, then a table
# per tree; records $OUT/trial-ab.jsonl (stderr: trial-ab.err). With DEADLINE=<s>: the four sanitizers over the forward's sanitize cases,
# then the forward's GPU tests on the trial, until DEADLINE s (the rest of the suite, and any merge, come after).
# Usage (carry as scripts/device/prologue.sh says):
#   COMMIT=<sha> PATCH=docs/runs/<trial>.patch ARGS="--head-dim 128 --seq 2048 ..." [ROUNDS=3] [BENCH_S=60] [DEADLINE=<s>] \
#     bash scripts/device/fwd_trial.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
[ -n "$PATCH" ] && [ -n "$ARGS" ] || { echo "PATCH and ARGS are required"; exit 2; }
rm -rf /tmp/main-tree && mkdir -p /tmp/main-tree && cp -r src /tmp/main-tree/ \
  && (cd /tmp/main-tree && git apply -R "$OLDPWD/$PATCH") || exit 1
for run in main-1 trial-1 trial-2 main-2; do
  tree=src; [ "${run%-*}" = main ] && tree=/tmp/main-tree/src
  PYTHONPATH=$tree:.:/tmp/site timeout ${BENCH_S:-60} python3 scripts/fwd_sm90_configs.py --label $run --rounds ${ROUNDS:-3} \
    $ARGS > $OUT/ab-$run.jsonl 2>> $OUT/trial-ab.err || tail -3 $OUT/trial-ab.err
  echo "== $run at $(el)s"
done
for t in main trial; do echo "-- $t"; python3 scripts/fwd_sm90_configs.py --summary $OUT/ab-$t-*.jsonl; done
cat $OUT/ab-*.jsonl > $OUT/trial-ab.jsonl; rm -f $OUT/ab-*.jsonl  # one file: the device returns a limited number
[ "${DEADLINE:-0}" = 0 ] && exit 0
echo "== $(el)s the four sanitizers over tests/gpu/test_attention_fwd_sm90.py's sanitize cases (the trial)"
timeout ${SAN_S:-150} python3 scripts/gpu_check.py --report-dir $OUT/sanitize --bench "" --no-tests --no-audit \
  --tests tests/gpu/test_attention_fwd_sm90.py --sanitizer-jobs 15 2>&1 | tail -8
sanitizer_logs_back $OUT/sanitize
T=$(( DEADLINE - $(el) )); echo "== $(el)s the Hopper forward's GPU tests on the trial, $T s left"
[ $T -gt 30 ] && timeout -s INT $T python3 -m pytest -q -m "gpu and not exclusive" -n 15 -p no:cacheprovider \
  --junitxml=$OUT/junit-fwd.xml tests/gpu/test_attention_fwd_sm90.py tests/gpu/test_attention_fwd_sm90_dropout.py \
  tests/gpu/test_attention_fwd_sm90_varlen.py > $OUT/tests-fwd.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/tests-fwd.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/tests-fwd.log | head -20
echo "== $(el)s done"; gzip -f $OUT/*.xml 2>/dev/null; rm -f $OUT/tests-fwd.log; true
