#!/usr/bin/env bash
# Compile-only check of the native kernel sources (not the torch binding: they build without
# torch headers) for the platforms whose compiler is present:
#   cuda: nvcc, sm_90
#   hip:  hipcc with HIP_PLATFORM=amd (else hipcc picks nvcc), gfx90a and gfx940, and gfx942
#         where the compiler knows it (Debian 12's hipcc 5.2 / clang 15 does not: reported, skipped)
# Usage: csrc/compile_check.sh [cuda|hip|all]
# Exit: 0 all compiled, 1 a compile failed, 77 no compiler for the requested platform.
set -uo pipefail
cd "$(dirname "$0")"
platform="${1:-all}"
sources=(paged_decode.cu reshape_and_cache.cu)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

nvcc_bin="$(command -v nvcc || true)"
for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
  [[ -z "$nvcc_bin" && -x "$c" ]] && nvcc_bin="$c"
done
hipcc_bin="$(command -v hipcc || true)"

jobs_names=()
start_job() {  # name, command...
  local name="$1"; shift
  ( t0=$SECONDS; if "$@" >"$out/$name.log" 2>&1; then echo "ok   $name ($((SECONDS - t0)) s)"; else
      echo "FAIL $name"; sed -n '1,40p' "$out/$name.log"; exit 1; fi ) &
  jobs_names+=("$name")
}

want() { [[ "$platform" == all || "$platform" == "$1" ]]; }
missing=0
if want cuda; then
  if [[ -z "$nvcc_bin" ]]; then
    echo "skip cuda: nvcc not found"; missing=1
  else
    for s in "${sources[@]}"; do
      start_job "cuda-sm_90-$s" "$nvcc_bin" -std=c++17 -O3 -arch=sm_90 -c "$s" -o "$out/cuda-$s.o"
    done
  fi
fi
if want hip; then
  if [[ -z "$hipcc_bin" ]]; then
    echo "skip hip: hipcc not found (Debian: apt-get install hipcc libamdhip64-dev rocm-device-libs)"; missing=1
  else
    printf '#include <hip/hip_runtime.h>\n__global__ void probe() {}\n' >"$out/probe.hip"
    for arch in gfx90a gfx940 gfx942; do
      if ! HIP_PLATFORM=amd "$hipcc_bin" --offload-arch="$arch" -x hip -c "$out/probe.hip" -o "$out/probe.o" \
          >"$out/probe-$arch.log" 2>&1; then
        if grep -q "invalid target ID" "$out/probe-$arch.log"; then
          echo "skip hip-$arch: this hipcc does not know the target ($(grep -m1 -i 'invalid target' "$out/probe-$arch.log" | cut -c1-60))"
          continue
        fi
        echo "FAIL hip-$arch probe:"; cat "$out/probe-$arch.log"; exit 1
      fi
      for s in "${sources[@]}"; do
        start_job "hip-$arch-$s" env HIP_PLATFORM=amd "$hipcc_bin" -std=c++17 -O3 --offload-arch="$arch" \
          -x hip -c "$s" -o "$out/hip-$arch-$s.o"
      done
    done
  fi
fi

status=0
for pid in $(jobs -p); do wait "$pid" || status=1; done
if [[ ${#jobs_names[@]} -eq 0 ]]; then
  [[ $missing -eq 1 ]] && exit 77
fi
exit $status
