#!/usr/bin/env bash
# Build the HIP port of the reduction (reduction_hip.cpp) for AMD GPUs, with Debian's hipcc
# (apt-get install hipcc: HIP 5.2 + clang 15 + rocm-device-libs). Compiling and linking need no
# GPU; running ./build/reduction_hip needs an AMD GPU and the ROCm kernel driver.
#
#   labs/hip/build.sh                       # gfx90a (MI200, wave64) and gfx1030 (RDNA2, wave32)
#   ARCHS="gfx942" labs/hip/build.sh        # another target, if the device libraries have it
#
# Writes build/reduction_hip (fat binary, one code object per target), build/reduction_hip_<arch>.s
# (device assembly) and build/BUILD_INFO.txt (compiler versions and, per target, the wavefront
# size the code object declares and the instructions that show the port's choices).
set -euo pipefail
cd "$(dirname "$0")"
HIPCC=${HIPCC:-hipcc}
ARCHS=${ARCHS:-"gfx90a gfx1030"}
OUT=${OUT:-build}
if ! command -v "$HIPCC" >/dev/null 2>&1; then
  echo "no HIP compiler ($HIPCC) on PATH: apt-get install hipcc (Debian), or set HIPCC" >&2
  exit 2
fi
mkdir -p "$OUT"
export HIP_PLATFORM=amd  # hipcc would pick the NVIDIA backend when it finds nvcc
offload=()
for a in $ARCHS; do offload+=("--offload-arch=$a"); done

{
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "hipcc: $("$HIPCC" --version 2>&1 | grep -m1 -i 'HIP version' || true)"
  echo "clang: $("$HIPCC" --version 2>&1 | grep -m1 -i 'clang version' || true)"
  echo "targets: $ARCHS"
} > "$OUT/BUILD_INFO.txt"

"$HIPCC" "${offload[@]}" -O3 -Wall reduction_hip.cpp -o "$OUT/reduction_hip"
echo "built $OUT/reduction_hip for: $ARCHS"

for a in $ARCHS; do
  "$HIPCC" --offload-arch="$a" -O3 --cuda-device-only -S reduction_hip.cpp -o "$OUT/reduction_hip_$a.s" 2>/dev/null
  s="$OUT/reduction_hip_$a.s"
  {
    echo "== $a"
    echo "  wavefront sizes declared by its kernels: $(grep -o 'wavefront_size: [0-9]*' "$s" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
    echo "  cross-lane ops (ds_bpermute/ds_swizzle/dpp): $(grep -cE 'ds_bpermute|ds_swizzle|_dpp' "$s")"
    echo "  16-byte global loads (global_load_dwordx4): $(grep -c 'global_load_dwordx4' "$s")"
    echo "  block barriers (s_barrier): $(grep -c 's_barrier' "$s")"
    echo "  device-scope atomic increments (global_atomic_inc): $(grep -c 'global_atomic_inc' "$s")"
  } | tee -a "$OUT/BUILD_INFO.txt"
done
