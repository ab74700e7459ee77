#!/usr/bin/env bash
# Installs Mooncake Store's client and master (issue 44) for the Python package's tests and
# for `cp_hicache.mooncake.MooncakeStore`:
#   - the PyPI wheel `mooncake-transfer-engine-non-cuda` (0.3.13.post1: the Python client
#     `mooncake.store.MooncakeDistributedStore` and the `mooncake_master` binary) into the
#     environment of PYTHON (default .venv/bin/python, which scripts/python-dev.sh builds);
#   - Debian's `libibverbs1`, which the wheel's libraries link even for TCP (apt; sudo only
#     when not root).
# Prints PYTHON's path and the master binary's, one a line. A second run with everything in
# place installs nothing (about 1 s).
#
#   scripts/mooncake-env.sh [PYTHON]
#
# Exit status 3 means the install is impossible here (PyPI or apt cannot be reached, or no
# wheel for this platform): a caller may skip; any other failure is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
version="0.3.13.post1"

if [ ! -x "$python" ]; then
  echo "mooncake-env: $python is not there (run scripts/python-dev.sh first)" >&2
  exit 1
fi

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  if ! $sudo apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
    && ! { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q libibverbs1 >/dev/null; }; then
    echo "mooncake-env: cannot install Debian's libibverbs1 (apt)" >&2
    exit 3
  fi
fi

have="$("$python" -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))' 2>/dev/null || true)"
if [ "$have" != "$version" ]; then
  log="$(mktemp)"
  trap 'rm -f "$log"' EXIT
  if ! "$python" -m pip install -q --retries 1 --timeout 30 \
    "mooncake-transfer-engine-non-cuda==$version" >"$log" 2>&1; then
    cat "$log" >&2
    if grep -Eq "NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|Name or service not known|Network is unreachable|ConnectTimeoutError|ProxyError|No route to host|No matching distribution" "$log"; then
      echo "mooncake-env: the wheel cannot be installed here (no network, or no wheel for this platform)" >&2
      exit 3
    fi
    echo "mooncake-env: pip install failed" >&2
    exit 1
  fi
fi

master="$("$python" -c 'import mooncake, os; print(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))')"
[ -x "$master" ] || { echo "mooncake-env: no mooncake_master in the wheel ($master)" >&2; exit 1; }
"$python" -c 'from mooncake.store import MooncakeDistributedStore' \
  || { echo "mooncake-env: the client does not load" >&2; exit 1; }
echo "$python"
echo "$master"
