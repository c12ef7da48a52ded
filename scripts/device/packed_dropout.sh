# The varlen dropout kernels written in session 47 after its device time was spent (the Hopper forward's
# VARLEN_DROPOUT_INSTANTIATIONS, the Hopper backward's VARLEN_DROPOUT_SETS; their dispatcher tables wait in
# UNMEASURED_SM90_TABLES): their GPU tests, the four sanitizers on their small cases, then their timing
# against the sm80 varlen dropout kernels. If all pass, fill dispatch.SM90_VARLEN_DROPOUT_FORWARD /
# SM90_VARLEN_DROPOUT_BACKWARD with the measured head dims and record the run (docs/attention_variants.md,
# "Variants on the packed layouts").
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> bash scripts/device/packed_dropout.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
echo "== $(el)s varlen dropout tests (forward and backward files)"
timeout 190 python3 -m pytest -q -p no:cacheprovider -n 15 tests/gpu/test_attention_fwd_sm90_varlen.py \
  tests/gpu/test_attention_bwd_sm90_varlen.py -k dropout --junitxml=$OUT/varlen-dropout.xml > $OUT/t.log 2>&1
echo "rc $?"; grep -E "passed|failed|Error" $OUT/t.log | tail -8
for tool in memcheck racecheck synccheck initcheck; do echo "== $(el)s $tool"
  timeout 55 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 1 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_attention_fwd_sm90_varlen.py tests/gpu/test_attention_bwd_sm90_varlen.py \
    -m sanitize -k dropout > $OUT/san-$tool.log 2>&1
  echo "$tool rc $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" $OUT/san-$tool.log | tail -3
done
echo "== $(el)s bench"
timeout 140 python3 scripts/packed_variants_bench.py --rounds 3 --dropout --backward > $OUT/bench.jsonl 2> $OUT/bench.err
echo "rc $?"; tail -6 $OUT/bench.err
echo "== $(el)s done"; gzip -f $OUT/*.xml $OUT/*.log 2>/dev/null; true
