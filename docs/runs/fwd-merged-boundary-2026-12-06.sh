# Trial (session 52, not yet run): the Hopper forward's tile boundary merged into one step (kMerged: the next tile's
# S_0 issued with this tile's last P V, its first softmax under it; two Q buffers) against main, at d = 128 on the
# default 128 x 128 / s2 / persistent tile, through scripts/device/fwd_trial.sh. From a checkout of main: `git apply`
# the patch beside this script and fwd-merged-boundary-tests-2026-12-06.patch first, so that the checkout is the trial.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [SEQS="2048 4096"] [DEADLINE=560] bash docs/runs/fwd-merged-boundary-2026-12-06.sh
args="--head-dim 128 --config 128x128/s2/persistent"; for n in ${SEQS:-2048 4096}; do args="$args --seq $n"; done
PATCH=docs/runs/fwd-merged-boundary-2026-12-06.patch ARGS="$args" BENCH_S=${BENCH_S:-35} exec bash scripts/device/fwd_trial.sh
