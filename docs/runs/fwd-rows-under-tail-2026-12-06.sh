# Trial (session 51, not merged): the Hopper forward's rows finished under the tail P V: 1 / l and lse computed and
# written while the tile's last P V runs instead of after its wait (the patch beside this script, applied to a copy
# of src). scripts/ab_trees.py first (main's src and the patched copy in alternating processes, cuDNN in each), then
# the forward's GPU tests on the patched copy in the time left (TEST_S seconds).
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> bash docs/runs/fwd-rows-under-tail-2026-12-06.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
rm -rf /tmp/trial && mkdir -p /tmp/trial && cp -r src tests labs pyproject.toml /tmp/trial/ && (cd /tmp/trial && git apply "$OLDPWD/docs/runs/fwd-rows-under-tail-2026-12-06.patch") || exit 1
grep -c finish_rows src/tileattn/csrc/attention_fwd_sm90.cu /tmp/trial/src/tileattn/csrc/attention_fwd_sm90.cu
echo "== $(el)s A/B d = 128"
timeout ${AB_S:-170} python3 scripts/ab_trees.py --tree main=src --tree trial=/tmp/trial/src --repeat 2 --peer sdpa_cudnn --out $OUT/ab128 \
  -- bench attention --forward-only --head-dim 128 --seq 2048 --seq 4096 --impl tileattn --impl sdpa_cudnn --rounds 3 2>&1 | tail -16
[ "${TEST_S:-150}" = 0 ] && { echo "== $(el)s done (no tests: TEST_S=0)"; tar czf $OUT/ab.tgz -C $OUT ab128 2>/dev/null && rm -rf $OUT/ab128; exit 0; }
echo "== $(el)s GPU tests of the forward on the trial"
(cd /tmp/trial && timeout -s INT ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -n 15 -m "gpu and not exclusive" \
  tests/gpu/test_attention_fwd_sm90.py tests/gpu/test_attention_fwd_sm90_varlen.py tests/gpu/test_attention_fwd_sm90_dropout.py \
  --junitxml=$OUT/junit-fwd.xml > $OUT/tests.log 2>&1)
echo "rc $?"; grep -E "passed|failed|error" $OUT/tests.log | tail -3
echo "== $(el)s done"; gzip -f $OUT/*.xml 2>/dev/null; tar czf $OUT/ab.tgz -C $OUT ab128 2>/dev/null && rm -rf $OUT/ab128; true
