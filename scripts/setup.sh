#!/usr/bin/env bash
# Idempotent setup: .venv with the project and its test tools.     bash scripts/setup.sh   (or: make setup)
#
# torch: a torch the user already has is never replaced. If the base interpreter can import torch (a
# cluster's CUDA build, say), the venv sees it through --system-site-packages; otherwise we install the
# CPU wheel pinned to torch==2.13.0 (a looser requirement would make pip pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
say() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  if $PY -c "import torch" 2>/dev/null; then
    say "creating $VENV on top of the existing torch $($PY -c 'import torch; print(torch.__version__)')"
    $PY -m venv --system-site-packages "$VENV"
  else
    say "creating $VENV"
    $PY -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"
stamp="$VENV/.shardyard-setup"
# Redo when the requirements or these scripts change, or when MPI appears (Horovod is then rebuilt with it).
want=$( (cat pyproject.toml scripts/setup.sh scripts/build_horovod.sh; command -v mpicc || true) | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && $VPY -c "import torch, shardyard" 2>/dev/null; then
  say "up to date ($VENV)"; exit 0
fi
$VPY -m pip install -q --upgrade pip
if $VPY -c "import torch" 2>/dev/null; then
  say "keeping torch $($VPY -c 'import torch; print(torch.__version__)')"
else
  say "installing torch==2.13.0 (CPU)"
  $VPY -m pip install -q torch==2.13.0
fi
say "installing shardyard (editable) with its dev, deepspeed, monitors, slurm, sweep, finetune, fp8 and eval extras"
$VPY -m pip install -q -e '.[dev,deepspeed,monitors,slurm,sweep,finetune,fp8,eval]'
if [ "${SHARDYARD_SKIP_HOROVOD:-0}" = 1 ]; then
  say "skipping Horovod (SHARDYARD_SKIP_HOROVOD=1): backend=horovod will be unavailable"
else
  say "Horovod 0.28.1 (built once per machine, cached; skip with SHARDYARD_SKIP_HOROVOD=1)"
  PYTHON="$VPY" bash scripts/build_horovod.sh
fi
# DeepSpeed compiles its ops on first use, inside a training run (a killed compile there leaves a lock that
# shardyard.op_builds reports). Compile the zero engines' ops now instead: one line, output only on failure.
if [ "${SHARDYARD_SKIP_OPS:-0}" = 1 ]; then
  say "skipping DeepSpeed's ops (SHARDYARD_SKIP_OPS=1): the zero engines compile them on first use"
else
  say "DeepSpeed's ops for the zero engines (compiled once per machine and venv; skip with SHARDYARD_SKIP_OPS=1)"
  $VPY -m shardyard.op_builds
fi
echo "$want" > "$stamp"
say "ok: $($VPY -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
