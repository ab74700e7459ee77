#!/usr/bin/env bash
# Install NVIDIA's NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel) into a project-local, git-ignored
# folder (`.nvrtc/` at the repository root) so cp-hicache can JIT-compile CUDA kernels without a
# CUDA toolkit. Idempotent: a second run reuses an existing install of the same version.
#
# The wheel is installed with `python3 -m pip` when pip is there; without pip (a fresh Debian
# without python3-pip) it is downloaded from PyPI with python3's urllib, checked against the
# sha256 PyPI lists, and unpacked with python3's zipfile.
#
# Usage:  scripts/install-nvrtc.sh            # prints the absolute path of libnvrtc.so.12
#         export CP_HICACHE_NVRTC="$(scripts/install-nvrtc.sh | tail -n1)"
#
# Environment:
#   PYTHON               python interpreter to use (default: python3)
#   NVRTC_WHEEL_VERSION  wheel version (default: 12.9.86, pinned so CI is reproducible); pip
#                        also takes a pattern such as "12.8.*", the download needs an exact one
#   NVRTC_INSTALL_METHOD auto (default: pip if there, else download), pip or download
#   NVRTC_PYPI_URL       PyPI root for the download (default: https://pypi.org)
#   CP_HICACHE_NVRTC_DIR install folder (default: <repo>/.nvrtc)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
dest="${CP_HICACHE_NVRTC_DIR:-$repo/.nvrtc}"
python="${PYTHON:-python3}"
package="nvidia-cuda-nvrtc-cu12"
version="${NVRTC_WHEEL_VERSION:-12.9.86}"
method="${NVRTC_INSTALL_METHOD:-auto}"
pypi="${NVRTC_PYPI_URL:-https://pypi.org}"
case "$method" in
  auto | pip | download) ;;
  *)
    echo "error: NVRTC_INSTALL_METHOD must be auto, pip or download, not '$method'" >&2
    exit 1
    ;;
esac

lib="$dest/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
# An install counts when the library and the wheel's metadata for this version are there (a
# pattern version is matched by the shell glob).
installed() {
  [[ -f "$lib" ]] || return 1
  local info
  for info in "$dest"/nvidia_cuda_nvrtc_cu12-${version}.dist-info; do
    [[ -d "$info" ]] && return 0
  done
  return 1
}

install_pip() {
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$dest" --upgrade "$package==$version" >&2
}

install_download() {
  if [[ "$version" == *[*?[]* ]]; then
    echo "error: the download (no pip) needs an exact NVRTC_WHEEL_VERSION, not '$version'" >&2
    return 1
  fi
  "$python" - "$pypi" "$package" "$version" "$(uname -m)" "$dest" >&2 <<'PY'
import hashlib, json, os, sys, tempfile, urllib.parse, urllib.request, zipfile

pypi, package, version, machine, dest = sys.argv[1:]
index = f"{pypi.rstrip('/')}/pypi/{package}/json"
with urllib.request.urlopen(index, timeout=60) as r:
    releases = json.load(r)["releases"]
files = [
    f for f in releases.get(version, [])
    if f["packagetype"] == "bdist_wheel"
    and "manylinux" in f["filename"]
    and f["filename"].endswith(f"_{machine}.whl")
]
if len(files) != 1:
    sys.exit(f"error: {index}: want one manylinux {machine} wheel of {version}, found "
             f"{[f['filename'] for f in files] or 'none'}")
wheel = files[0]
url = urllib.parse.urljoin(index, wheel["url"])  # some mirrors list relative URLs
want = wheel["digests"]["sha256"]
print(f"downloading {wheel['filename']} from {url}")
with tempfile.TemporaryFile() as tmp:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=600) as r:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            tmp.write(chunk)
    if digest.hexdigest() != want:
        sys.exit(f"error: {wheel['filename']}: sha256 {digest.hexdigest()}, PyPI lists {want}")
    tmp.seek(0)
    with zipfile.ZipFile(tmp) as z:
        for name in z.namelist():
            if name.startswith("/") or ".." in name.split("/"):
                sys.exit(f"error: {wheel['filename']}: unsafe path {name!r}")
        z.extractall(dest)
PY
}

if ! installed; then
  echo "installing $package==$version into $dest" >&2
  mkdir -p "$dest"
  # Another version's files would be left beside the new ones: remove them first.
  rm -rf "$dest/nvidia/cuda_nvrtc" "$dest"/nvidia_cuda_nvrtc_cu12-*.dist-info
  case "$method" in
    pip) install_pip ;;
    download) install_download ;;
    auto)
      if "$python" -m pip --version >/dev/null 2>&1; then
        install_pip
      else
        echo "no pip for $python: downloading the wheel from $pypi instead" >&2
        install_download
      fi
      ;;
  esac
fi

if ! installed; then
  echo "error: $lib (version $version) not found after installing $package" >&2
  exit 1
fi
echo "NVRTC installed; use: export CP_HICACHE_NVRTC=$lib" >&2
echo "$lib"
