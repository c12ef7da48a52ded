# The Hopper forward's rows finished under the tail P V (session 51): 1 / l and lse computed and written while the
# tile's last P V runs instead of after its wait (the working tree's src holds the change; the patch beside it is
# that change, applied in reverse to a copy of src to make the tree it is measured against). GPU tests of the
# forward's layouts on the change, then scripts/ab_trees.py, the two trees in alternating processes, cuDNN in each.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> bash docs/runs/fwd-rows-under-tail-2026-12-06.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
el() { echo $(( $(date +%s)-t0 )); }
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r src /tmp/base/ && (cd /tmp/base && git apply -R "$OLDPWD/docs/runs/fwd-rows-under-tail-2026-12-06.patch") || exit 1
grep -c finish_rows src/tileattn/csrc/attention_fwd_sm90.cu /tmp/base/src/tileattn/csrc/attention_fwd_sm90.cu
echo "== $(el)s GPU tests of the forward (the change)"
timeout -s INT ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -n 15 -m "gpu and not exclusive" tests/gpu/test_attention_fwd_sm90.py \
  tests/gpu/test_attention_fwd_sm90_varlen.py tests/gpu/test_attention_fwd_sm90_dropout.py --junitxml=$OUT/junit-fwd.xml > $OUT/tests.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/tests.log | tail -3
echo "== $(el)s A/B d = 128"
timeout 170 python3 scripts/ab_trees.py --tree main=/tmp/base/src --tree trial=src --repeat 2 --peer sdpa_cudnn --out $OUT/ab128 \
  -- bench attention --forward-only --head-dim 128 --seq 2048 --seq 4096 --impl tileattn --impl sdpa_cudnn --rounds 3 2>&1 | tail -16
echo "== $(el)s A/B d = 256"
timeout 110 python3 scripts/ab_trees.py --tree main=/tmp/base/src --tree trial=src --repeat 2 --peer sdpa_cudnn --out $OUT/ab256 \
  -- bench attention --forward-only --head-dim 256 --seq 2048 --impl tileattn --impl sdpa_cudnn --rounds 3 2>&1 | tail -10
echo "== $(el)s done"; gzip -f $OUT/*.xml 2>/dev/null; tar czf $OUT/ab.tgz -C $OUT ab128 ab256 2>/dev/null && rm -rf $OUT/ab128 $OUT/ab256; true
