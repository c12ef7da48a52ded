# The Hopper forward's tile candidates at short lengths beside SDPA cuDNN, on whichever card the call gets
# (issue #11's 2048 / 4096-key points, where the tiles were chosen on the H200): scripts/fwd_sm90_configs.py,
# B = 4, H = 32, bf16, causal and not, ROUNDS rotated rounds of REPS repetitions, one process per head dim;
# records $OUT/short-tiles-dD.jsonl and a table of medians (ratio to cuDNN) last. D64 / D128 / D256: the
# configs per head dim (an empty list skips the head dim); SEQS the lengths.
# Usage (carry as scripts/device/prologue.sh says):
#   COMMIT=<sha> [SEQS="2048 4096"] [ROUNDS=3] [REPS=10] [D128="..."] ... bash scripts/device/short_tiles_sweep.sh
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
D128=${D128-"128x128/s2 128x128/s2/persistent 128x128/s2/pp/persistent 192x80/s3/persistent 192x64/s4/persistent 128x176/s2/pp"}
D256=${D256-"128x64/s2 128x64/s2/persistent 128x80/s2/pp 128x80/s2/pp/persistent 128x80/s2"}
D64=${D64-"192x128/s2/persistent 192x128/s3/persistent 128x128/s3/persistent 128x192/s2/pp/persistent"}
seqs=""; for n in ${SEQS:-2048 4096}; do seqs="$seqs --seq $n"; done
for d in 128 256 64; do
  eval cfgs=\$D$d; [ -z "$cfgs" ] && continue
  args=""; for c in $cfgs; do args="$args --config $c"; done
  timeout 200 python3 scripts/fwd_sm90_configs.py --label "$COMMIT" --rounds ${ROUNDS:-3} --reps ${REPS:-10} $seqs \
    --head-dim $d $args > $OUT/short-tiles-d$d.jsonl 2> $OUT/short-tiles-d$d.err || tail -5 $OUT/short-tiles-d$d.err
  echo "== d=$d at $(( $(date +%s)-t0 ))s"
done
python3 scripts/fwd_sm90_configs.py --summary $OUT/short-tiles-d*.jsonl
echo "== done $(( $(date +%s)-t0 ))s"
