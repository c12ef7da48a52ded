# Trial (session 52): the Hopper forward's tile boundary merged into one step (kMerged: the next tile's S_0 issued
# with this tile's last P V, its first softmax under it; two Q buffers) against main. Run from a checkout of the
# trial (from main: `git apply` the patch beside this script and fwd-merged-boundary-tests-2026-12-06.patch first);
# main's src is rebuilt beside it by reversing the
# patch. scripts/fwd_sm90_configs.py at d = 128, the default 128 x 128 / s2 / persistent (B = 4, H = 32, bf16,
# causal and not; its output checked against cuDNN's, relative error < 1e-2), in processes main, trial, trial, main.
# Not the GPU tests: they and the sanitizers (e.g. scripts/gpu_check.py on the trial checkout) come before any merge.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [SEQS="2048 4096"] [BENCH_S=35] bash docs/runs/fwd-merged-boundary-2026-12-06.sh
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
