# Sourced at the start of every call on the lent GPU machine (which has no network and NVRTC 13.0):
# installs the carried wheels and preloads NVRTC 13.5, so that cuda.pathfinder finds it already loaded
# ahead of the image's own. Carry: .dev/whl (cuda-core 1.2.0 and llguidance 1.9.1, for the engine's
# structured-outputs GPU test, plus any wheels a call needs, e.g. the server's) and .dev/nvrtc.tar.xz
# (the nvidia-cuda-nvrtc 13.5 wheel's nvidia/ folder, xz: 41 MB against the wheel's 58 MB, so that the
# tree + carry stays under the device's 64 MiB). Made here with:
#   echo /.dev/ >> .git/info/exclude; mkdir -p .dev/whl /tmp/nv
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/dl "nvidia-cuda-nvrtc==13.5.*" "cuda-core==1.2.0"
#   pip download (the same flags, plus --platform manylinux_2_31_x86_64) -d .dev/whl "llguidance==1.9.1"
#   mv /tmp/dl/cuda_core-*.whl .dev/whl/; unzip -q /tmp/dl/nvidia_cuda_nvrtc-*.whl -d /tmp/nv
#   tar cJf .dev/nvrtc.tar.xz -C /tmp/nv nvidia
# Then e.g. run(command="COMMIT=<local HEAD, written out> bash scripts/device/compiled_path.sh",
#               carry=[".dev/whl", ".dev/nvrtc.tar.xz"]).
# COMMIT names the records' tree: write the local `git rev-parse --short HEAD` into the command. The
# device's copy of .git can be stale, so a $(git rev-parse ...) evaluated there names an older commit
# (session 41's records say 84543b4 for trees 9bf3186 to df9c7aa).
mkdir -p /tmp/site /tmp/nv
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
# Bytecode for the tree and the carried wheels, as a pip install leaves it: none was cached on the device
# (session 41: every startup-bench process compiled ~90 sources, 0.12 s of a 0.36 s profiled first call).
python3 -m compileall -q -j 0 src /tmp/site > /dev/null || exit 1
tar xJf .dev/nvrtc.tar.xz -C /tmp/nv || exit 1
cat > /tmp/site/sitecustomize.py <<'PY'
import ctypes
for _n in ("libnvrtc-builtins.so.13.5", "libnvrtc.so.13"):
    ctypes.CDLL("/tmp/nv/nvidia/cu13/lib/" + _n, mode=ctypes.RTLD_GLOBAL)
PY
export PYTHONPATH=src:.:/tmp/site PYTHONUNBUFFERED=1 TILEATTN_GIT_COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cuda.core; from tileattn.runtime import nvrtc_version; print('torch', torch.__version__, 'cuda.core', cuda.core.__version__, 'nvrtc', nvrtc_version())" || exit 1
# After scripts/gpu_check.py's sanitizer half wrote its logs under DIR ($OUT/sanitize): each shard's summary from
# its own log (printed even when a timeout cut gpu_check.py before its table), then the logs back as one archive
# (the device returns a limited number of files).
sanitizer_logs_back() {
  for f in "$1"/sanitizer-*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY| passed| failed' "$f" | tail -2 | tr '\n' ' ')"; done
  tar czf "$1-logs.tgz" -C "$(dirname "$1")" "$(basename "$1")" 2>/dev/null && rm -rf "$1"
}
