#!/usr/bin/env bash
# cp_hicache.vllm's tests against vLLM 0.34.0's real scheduler, on the CPU: builds (or reuses)
# the cached vLLM environment (scripts/vllm-env.sh, <repo>/.venv-vllm), builds the package's
# wheel (maturin, incremental after scripts/test.sh; the profile in CP_HICACHE_WHEEL_PROFILE,
# default release), installs it there, and runs
# python/tests/test_vllm_connector.py in it. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
env_sh="$(scripts/vllm-env.sh | tail -n1)"
# shellcheck disable=SC1090
source "$env_sh"
py="$(command -v python)"
echo "== the cp_hicache wheel, into the vLLM environment ($py)"
# An abi3 wheel: built for the interpreter scripts/python-dev.sh builds for when its .venv is
# there, so the build after scripts/test.sh's is a no-op (another interpreter would rebuild
# pyo3), and installed into the vLLM environment.
build_py="$py"
[ -x .venv/bin/python ] && build_py="$PWD/.venv/bin/python"
rm -rf python/dist
(cd python && maturin build --profile "${CP_HICACHE_WHEEL_PROFILE:-release}" -q -o dist -i "$build_py")
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps python/dist/cp_hicache-*.whl
"$py" -m pip install -q --disable-pip-version-check "numpy>=1.22"
echo "== python/tests/test_vllm_connector.py on vLLM $("$py" -c 'import vllm; print(vllm.__version__)')"
# From python/tests, not the repository root: nothing there may shadow the installed package.
cd python/tests
# The environment is built, so the module must not skip itself (it fails instead).
export CP_HICACHE_REQUIRE_VLLM=1
"$py" -m pytest -q -p no:cacheprovider -p no:asyncio test_vllm_connector.py "$@"
