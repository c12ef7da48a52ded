# Issue #9 on the lent GPU, most important first (a short device budget may cut the tail): build the
# compiled path (runtime/host_launch.cpp), its GPU tests, `tileattn bench overhead --breakdown`, memcheck
# over its tests, then the GPU tests (GPU_TESTS, default every one: tests/gpu) in the time left before DEADLINE
# seconds (default 575). NO_BENCH=1: without the overhead table (a call that runs issue9_benches.sh too).
# Usage (scripts/device/prologue.sh says what to carry): COMMIT=<sha> DEADLINE=<s> [GPU_TESTS="..."] [NO_BENCH=1] bash scripts/device/compiled_path.sh
source scripts/device/prologue.sh
export TILEATTN_HOST_LAUNCH=1
t0=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - t0) )); }
python3 -c "import time; t=time.time(); from tileattn.runtime import host_launch as h; p=h.build(); print('built', p, round(time.time()-t,1), 's')" 2>&1 | tail -20
echo "== host_launch tests at $(( $(date +%s)-t0 ))s"
timeout 120 python3 -m pytest -q -m "gpu and not exclusive" -n 15 -p no:cacheprovider --junitxml=$OUT/junit-host.xml tests/gpu/test_host_launch.py 2>&1 | tail -25
[ -z "$NO_BENCH" ] && echo "== overhead at $(( $(date +%s)-t0 ))s" &&
timeout 80 python3 -m tileattn.cli bench overhead --breakdown --calls 100 --rounds 15 --json $OUT/overhead.json 2>&1 | grep -v Warning | grep -v "return lambda" | tail -32
echo "== memcheck at $(( $(date +%s)-t0 ))s"
timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not exclusive" tests/gpu/test_host_launch.py 2>&1 | tail -8; echo "memcheck rc ${PIPESTATUS[0]}"
T=$(left ${DEADLINE:-575}); echo "== GPU tests (${GPU_TESTS:-tests/gpu}) at $(( $(date +%s)-t0 ))s, $T s (SIGINT at the deadline: pytest still writes its summary and JUnit)"
[ $T -gt 30 ] && timeout -s INT $T python3 -m pytest -q -m "gpu and not exclusive" -n 15 -p no:cacheprovider --junitxml=$OUT/junit-gpu.xml ${GPU_TESTS:-tests/gpu} 2>&1 | tail -12
echo "== done $(( $(date +%s)-t0 ))s"
gzip -f $OUT/*.xml 2>/dev/null; true
