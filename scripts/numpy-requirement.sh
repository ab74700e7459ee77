#!/usr/bin/env bash
# Prints the numpy requirement scripts/python-dev.sh gives pip for .venv: one that Debian's
# python3-torch can run with. .venv is made over the system Python (--system-site-packages) to
# see Debian's torch, which Debian builds against its own python3-numpy (1.24 on Debian 12);
# a module built against numpy 1.x fails to import under numpy 2 ("A module that was compiled
# using NumPy 1.x cannot be run in NumPy 2.x"), and a numpy pip puts in .venv hides Debian's.
# So the requirement never admits a later major version than Debian's numpy:
# - Debian's numpy is importable: its major caps the requirement (which it then satisfies, so
#   pip installs none; a numpy 2 an earlier run left in .venv is replaced by a 1.x).
# - It is not installed yet (python-dev.sh run by hand before scripts/test.sh installed
#   python3-torch, which brings python3-numpy): the major of the version apt would install
#   (`apt-cache policy python3-numpy`, its candidate) caps it, so the numpy pip installs now
#   still runs the torch apt installs later.
# - Neither is known (not Debian): no cap.
# CP_HICACHE_SYSTEM_PYTHON names the system Python (default /usr/bin/python3, as python-dev.sh).
set -euo pipefail
python="${CP_HICACHE_SYSTEM_PYTHON:-/usr/bin/python3}"
floor="numpy>=1.22"
major="$("$python" -c 'import numpy; print(numpy.__version__.split(".")[0])' 2>/dev/null || true)"
if [ -z "$major" ] && command -v apt-cache >/dev/null 2>&1; then
  # A Debian version is [epoch:]upstream[-revision]; "(none)" when no source has it.
  candidate="$(apt-cache policy python3-numpy 2>/dev/null | sed -n 's/^ *Candidate: *//p' | head -n1)"
  candidate="${candidate#*:}"
  major="${candidate%%.*}"
fi
if [[ "$major" =~ ^[0-9]+$ ]]; then
  echo "$floor,<$((major + 1))"
else
  echo "$floor"
fi
