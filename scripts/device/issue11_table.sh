# Issue #11's forward table on the lent GPU in one call (session 32's call 3, the command of docs/BENCHMARKS.md
# "issue #11's whole forward table in rotated rounds"): `tileattn bench attention --forward-only` against SDPA
# cuDNN, every head dim and dtype, N = 2048 ... 32768, three rotated rounds, one process per (d, dtype); records
# under $OUT. The issue's targets are the H200's: on another GPU it says so first and runs anyway (a same-run
# comparison on that GPU, not a measurement of the target), or, with REQUIRE_H200=1, stops there (a call that
# asked for an H200 and got an H100 then costs the machine's start and the prologue only). ~6 minutes on an H200.
# Usage (carry as scripts/device/prologue.sh says): COMMIT=<sha> [REQUIRE_H200=1] bash scripts/device/issue11_table.sh
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) ;; *) echo "NOT an H200: the issue's targets are not measured here"; [ -n "$REQUIRE_H200" ] && exit 0;; esac
source scripts/device/prologue.sh; mkdir -p $OUT; t0=$(date +%s)
for d in 128 64 256; do for t in bf16 fp16; do
  echo "== $(( $(date +%s)-t0 ))s d=$d $t"
  timeout 100 python3 -m tileattn.cli bench attention --forward-only --head-dim $d --dtype $t --seq 2048 --seq 4096 \
    --seq 8192 --seq 16384 --seq 32768 --rounds 3 --impl tileattn --impl sdpa_cudnn \
    --json $OUT/attention-fwd-d$d-$t-rounds3.json 2>&1 | grep -v -i warn | tail -14
done; done
echo "== done $(( $(date +%s)-t0 ))s"
