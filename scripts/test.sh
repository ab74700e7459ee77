#!/usr/bin/env bash
# The test command (README): the Rust tests, then the Python package's. Before the latter it
# installs what they need on a fresh machine: Debian's python3-torch (a CPU build with gloo,
# about 1.5 minutes) and a virtual environment over the system Python (.venv, which sees it)
# holding maturin, the built wheel and pytest. Arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "== [$(date -u +%T), ${SECONDS}s in] $*"; }

step "cargo test"
cargo test "$@"

need_apt=()
/usr/bin/python3 -c "import torch.distributed" 2>/dev/null || need_apt+=(python3-torch)
/usr/bin/python3 -c "import ensurepip" 2>/dev/null || need_apt+=(python3-venv)
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "== installing ${need_apt[*]} (Debian packages) for the Python tests"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q "${need_apt[@]}" >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "${need_apt[@]}" >/dev/null; }
fi

step "the Python package: build the wheel (maturin) into .venv, then pytest"
# The wheel and the binary (the in-process replay the multi-process one is compared with) are
# built with the dev profile, whose artifacts `cargo test` has just built (Cargo.toml: the
# test profile is the dev one; optimised, so the default replay runs as fast as a release
# build's), not a release build of everything again (4 to 5 minutes on 2 cores). Not
# `--profile test`: maturin would build the extension as a test harness.
export CP_HICACHE_WHEEL_PROFILE=dev
cargo build --bin cp-hicache --quiet
scripts/python-dev.sh
CP_HICACHE_BIN="$PWD/target/debug/cp-hicache" .venv/bin/python -m pytest -q --durations=12 python/tests

step "the wheel installs and serves in a fresh virtual environment (numpy from PyPI)"
fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT
/usr/bin/python3 -m venv "$fresh/venv"
"$fresh/venv/bin/python" -m pip install -q python/dist/cp_hicache-*.whl
(cd "$fresh" && "$fresh/venv/bin/python" - <<'PY'
import cp_hicache
dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=1)
stats = cp_hicache.RankCache(dep, device_pages=16, host_pages=16, backend="host").serve(range(64))
assert stats["computed_tokens"] == 64 and stats["mismatched_tokens"] == 0, stats
print(f"fresh venv: cp_hicache {cp_hicache.__version__} served and verified 64 tokens")
PY
)

step "the vLLM KV connector against vLLM 0.34.0's real scheduler (CPU)"
# Builds the cached environment (.venv-vllm: 2 to 3 minutes and 3.8 GB downloaded the first
# time, seconds after), installs the wheel there, runs python/tests/test_vllm_connector.py
# (about 30 s).
scripts/test-vllm.sh
