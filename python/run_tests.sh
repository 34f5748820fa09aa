#!/usr/bin/env bash
# Builds the PyTorch binding into ./build (-DTQDECODE_PYTHON=ON) and runs
# python/tests: with pytest when it is installed, else with unittest (the
# tests are unittest-based, so both run all of them). Uses the torch of
# $PYTHON (default: .venv/bin/python3, made by scripts/python_env.sh, when it
# exists, else python3 on PATH); needs no network. Extra arguments go to
# the test runner, e.g. `python/run_tests.sh -k graph`; extra CMake options
# go in TQDECODE_CMAKE_ARGS, e.g. TQDECODE_CMAKE_ARGS="-DTQDECODE_TESTS=OFF"
# on a machine without GoogleTest.
set -euo pipefail
cd "$(dirname "$0")/.."

default_python=python3
[ -x .venv/bin/python3 ] && default_python=.venv/bin/python3
PYTHON=$(command -v "${PYTHON:-$default_python}")
"$PYTHON" -c "import torch" || { echo "run_tests.sh: $PYTHON cannot import torch" >&2; exit 1; }
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# A new build directory uses Ninja when available; an existing one keeps its generator.
generator=()
if [ ! -f build/CMakeCache.txt ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
# shellcheck disable=SC2086 # TQDECODE_CMAKE_ARGS is a list of options
cmake -S . -B build "${generator[@]}" -DTQDECODE_PYTHON=ON -DTQDECODE_PYTHON_EXECUTABLE="$PYTHON" ${TQDECODE_CMAKE_ARGS:-}
cmake --build build --target tqdecode_torch --parallel "$(nproc)"

export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  exec "$PYTHON" -m pytest -p no:cacheprovider -v -rs python/tests "$@"
fi
echo "run_tests.sh: pytest is not installed; running the tests with unittest"
exec "$PYTHON" -m unittest discover -s python/tests -v "$@"
