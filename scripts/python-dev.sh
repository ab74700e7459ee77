#!/usr/bin/env bash
# Builds the Python package into .venv (a virtual environment over the system Python, so it
# sees Debian's python3-torch) and installs it. Used by scripts/test.sh; run it alone after
# changing python/ to try the package by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
# The Cargo profile of the wheel: release by default; scripts/test.sh builds it with the dev
# profile, whose artifacts `cargo test` has just built (a release build would compile the
# crate and its dependencies again).
profile="${CP_HICACHE_WHEEL_PROFILE:-release}"
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
# numpy: never a later major than Debian's python3-torch was built against, even when this runs
# before that is installed (scripts/numpy-requirement.sh says why and how).
"$venv/bin/python" -m pip install -q "maturin>=1.9.4,<2" "$(scripts/numpy-requirement.sh)" "pytest>=7"
# SGLang's published wheel, for its storage backend interface (its engine is not loaded, so
# its dependencies are not installed).
"$venv/bin/python" -m pip install -q --no-deps -r python/tests/requirements.txt
rm -rf python/dist
(cd python && "../$venv/bin/maturin" build --profile "$profile" -q -o dist -i "../$venv/bin/python")
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps python/dist/cp_hicache-*.whl
