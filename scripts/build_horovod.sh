#!/usr/bin/env bash
# Build (once per machine) and install Horovod 0.28.1 into the active Python environment.
#
#   bash scripts/build_horovod.sh            # called by `make setup`; SHARDYARD_SKIP_HOROVOD=1 skips it
#
# Horovod 0.28.1 is the last release and its CMake asks for C++14, which current torch headers reject.
# We take PyPI's sdist, raise CMAKE_CXX_STANDARD to 17 in the two CMakeLists that set it, and build a
# wheel with PyTorch + Gloo, plus the MPI controller when an MPI compiler wrapper (mpicc) is present (never
# required; `make test` installs Open MPI first, as root), and NCCL ops when CUDA is present.
# The wheel is cached under $SHARDYARD_CACHE/wheels keyed by Horovod, torch and Python versions and by MPI:
# a machine that gains MPI later gets an MPI build, once.
set -euo pipefail
HVD_VERSION=0.28.1
PY=${PYTHON:-python}
CACHE=${SHARDYARD_CACHE:-$HOME/.cache/shardyard}
step() { echo "[horovod] $*"; }
fail() {
  echo "[horovod] FAILED at step: $1" >&2
  echo "[horovod] Horovod is optional: skip it with SHARDYARD_SKIP_HOROVOD=1 (backend=horovod is then unavailable)." >&2
  exit 1
}

MPI=nompi
if command -v mpicc >/dev/null 2>&1; then MPI=mpi; fi
# Installed already, and with MPI whenever MPI is here (a build from before MPI came is replaced).
if $PY -c "import horovod.torch as h, sys; sys.exit(0 if '$MPI' == 'nompi' or h.mpi_built() else 1)" 2>/dev/null; then
  step "already installed: $($PY -c 'import horovod; print(horovod.__version__)') ($MPI)"; exit 0
fi
TORCH_V=$($PY -c "import torch; print(torch.__version__.replace('+', '_'))") || fail "import torch (install the project first)"
PY_V=$($PY -c "import sys; print(f'cp{sys.version_info.major}{sys.version_info.minor}')")
CUDA=$($PY -c "import torch; print('cuda' if torch.version.cuda else 'cpu')")
KEY="horovod-${HVD_VERSION}-torch-${TORCH_V}-${PY_V}-${CUDA}-${MPI}"
WHEEL_DIR="$CACHE/wheels/$KEY"
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  step "downloading the horovod==$HVD_VERSION source from PyPI"
  $PY -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work" || fail "download sdist"
  tar -xzf "$work"/horovod-$HVD_VERSION.tar.gz -C "$work" || fail "unpack sdist"
  src="$work/horovod-$HVD_VERSION"
  step "raising CMAKE_CXX_STANDARD 14 -> 17 (torch >= 2.1 headers need C++17)"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || fail "patch CMakeLists.txt"
  # CMake 4 refuses the `cmake_minimum_required` of Horovod's bundled gloo: keep CMake 3.x.
  $PY -m pip install -q 'cmake>=3.13,<4' 'setuptools<81' wheel packaging || fail "install build tools"
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
  if [ "$CUDA" = cuda ]; then export HOROVOD_GPU_OPERATIONS=NCCL; fi
  # MPI: required when mpicc is here (a failed MPI build should say so, not quietly drop the controller).
  if [ "$MPI" = mpi ]; then export HOROVOD_WITH_MPI=1; else export HOROVOD_WITHOUT_MPI=1; fi
  export MAKEFLAGS="-j$(nproc)"
  step "compiling the wheel ($KEY); this takes about 3 minutes on 2 cores"
  $PY -m pip wheel -v --no-deps --no-build-isolation "$src" -w "$work/dist" > "$work/build.log" 2>&1 \
    || { grep -A20 -m3 -E 'CMake Error|error:' "$work/build.log" >&2; tail -30 "$work/build.log" >&2; fail "compile (pip wheel)"; }
  mkdir -p "$WHEEL_DIR.tmp" && cp "$work"/dist/horovod-*.whl "$WHEEL_DIR.tmp/" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
fi
step "installing the cached wheel from $WHEEL_DIR"
$PY -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl || fail "install wheel"
$PY -m pip install -q cloudpickle psutil pyyaml packaging 'cffi>=1.4.0' || fail "install runtime deps"
$PY -c "import horovod.torch" || fail "import horovod.torch"
# horovodrun may not be on PATH (venv not activated): ask the runner module through this interpreter.
built=$($PY -m horovod.runner.launch --check-build | grep -E '\[X\] (PyTorch|Gloo|MPI|NCCL)' | sed 's/^ *//; s/ *$//' | sort -u | tr '\n' ' ')
step "ok, horovodrun --check-build: $built"
