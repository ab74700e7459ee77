#!/usr/bin/env bash
# Install NVIDIA's NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel) into a project-local, git-ignored
# folder (`.nvrtc/` at the repository root) so cp-hicache can JIT-compile CUDA kernels without a
# CUDA toolkit. Idempotent: a second run reuses the existing install.
#
# Usage:  scripts/install-nvrtc.sh            # prints the absolute path of libnvrtc.so.12
#         export CP_HICACHE_NVRTC="$(scripts/install-nvrtc.sh | tail -n1)"
#
# Environment:
#   PYTHON               python interpreter to use (default: python3)
#   NVRTC_WHEEL_VERSION  pin a wheel version, e.g. "12.8.*" (default: latest 12.x)
#   CP_HICACHE_NVRTC_DIR install folder (default: <repo>/.nvrtc)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
dest="${CP_HICACHE_NVRTC_DIR:-$repo/.nvrtc}"
python="${PYTHON:-python3}"
spec="nvidia-cuda-nvrtc-cu12"
if [[ -n "${NVRTC_WHEEL_VERSION:-}" ]]; then
  spec="nvidia-cuda-nvrtc-cu12==${NVRTC_WHEEL_VERSION}"
fi

lib="$dest/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
if [[ ! -f "$lib" ]]; then
  echo "installing $spec into $dest" >&2
  mkdir -p "$dest"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$dest" --upgrade "$spec" >&2
fi

if [[ ! -f "$lib" ]]; then
  echo "error: $lib not found after installing $spec" >&2
  exit 1
fi
echo "NVRTC installed; use: export CP_HICACHE_NVRTC=$lib" >&2
echo "$lib"
