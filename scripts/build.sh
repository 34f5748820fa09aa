#!/usr/bin/env bash
# Installs what the build needs (Debian packages) when missing, then
# configures and builds tqdecode in ./build. CUDA kernels are built when nvcc
# is found (on PATH or in /usr/local/cuda/bin); everything else builds without.
# The PyTorch binding is built, and its tests join ctest, when the Python
# environment of scripts/python_env.sh exists.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/packages.sh

ensure_packages cmake:cmake ninja:ninja-build g++:g++ /usr/include/gtest/gtest.h:libgtest-dev

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# The PyTorch binding (and its tests in ctest) when scripts/python_env.sh has
# made the Python environment.
python_args=()
venv_python="${TQDECODE_VENV:-.venv}/bin/python3"
if [ -x "$venv_python" ] && "$venv_python" -c "import torch" 2>/dev/null; then
  python_args=(-DTQDECODE_PYTHON=ON "-DTQDECODE_PYTHON_EXECUTABLE=$(cd "$(dirname "$venv_python")" && pwd)/python3")
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${python_args[@]}" "$@" >/dev/null
cmake --build build --parallel "$(nproc)"
