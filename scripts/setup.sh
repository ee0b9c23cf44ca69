#!/usr/bin/env bash
# Idempotent setup of .venv: the core and the extras asked for.
#
#   bash scripts/setup.sh                  # make setup / make train: the core + DeepSpeed's Python package
#   EXTRAS=monitors,eval bash scripts/setup.sh   # make setup EXTRAS=monitors,eval: those on top
#   EXTRAS=all bash scripts/setup.sh       # make setup EXTRAS=all / make test: everything
#
# EXTRAS, comma-separated: pyproject.toml's extras (dev, deepspeed, monitors, slurm, sweep, finetune, fp8, eval),
# `horovod` (Horovod 0.28.1 built from its sdist: scripts/build_horovod.sh, ~3 min once per machine) and `ops`
# (DeepSpeed's ops for the zero engines compiled now rather than on their first run: python -m shardyard.core.op_builds);
# `all` is every one of them. The default is `deepspeed`: the README's second command is backend=zero3.
# A venv only grows: its stamp lists what it holds, so asking for less (make train after make test) does nothing,
# and asking for more installs only that. A run that chooses what the venv lacks exits 2 naming the
# `make setup EXTRAS=...` that installs it (shardyard.config.preflight).
#
# torch: a torch the user already has is never replaced. If the base interpreter can import torch (a
# cluster's CUDA build, say), the venv sees it through --system-site-packages (and uv is told to leave torch
# alone); otherwise torch==2.13.0 is installed, pinned (a looser requirement would let the resolver pull a newer
# multi-GB CUDA build), from the file pip chooses by its own configuration (here: the CPU wheel on this disk).
# The installer is uv (SHARDYARD_INSTALLER=pip for pip alone); each phase prints its time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
ALL="dev deepspeed monitors slurm sweep finetune fp8 eval horovod ops"
say() { echo "[setup] $*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f s", b - a }'; }
start=$(now)

# What is asked: EXTRAS, `all` expanded, each name checked; the skips taken out (and said).
asked=()
for e in $(echo "${EXTRAS:-deepspeed}" | tr ',' ' '); do
  if [ "$e" = all ]; then asked+=($ALL); continue; fi
  if [ "$e" = core ]; then continue; fi  # always there
  case " $ALL " in
    *" $e "*) asked+=("$e") ;;
    *) echo "[setup] unknown extra '$e' in EXTRAS=${EXTRAS:-}: choose from ${ALL// /, } or all" >&2; exit 2 ;;
  esac
done
if [ "${SHARDYARD_SKIP_HOROVOD:-0}" = 1 ] && [[ " ${asked[*]} " == *" horovod "* ]]; then
  say "skipping Horovod (SHARDYARD_SKIP_HOROVOD=1): backend=horovod will be unavailable"
  asked=($(printf '%s\n' "${asked[@]}" | grep -vx horovod || true))
fi
if [ "${SHARDYARD_SKIP_OPS:-0}" = 1 ] && [[ " ${asked[*]} " == *" ops "* ]]; then
  say "skipping DeepSpeed's ops (SHARDYARD_SKIP_OPS=1): the zero engines compile them on first use"
  asked=($(printf '%s\n' "${asked[@]}" | grep -vx ops || true))
fi

VPY="$VENV/bin/python"
stamp="$VENV/.shardyard-setup"
# The stamp: line 1 a hash of what the install depends on, line 2 the extras the venv holds. A changed hash
# (requirements or these scripts edited, MPI appeared for a venv with Horovod, the torch the venv sees replaced:
# Horovod and DeepSpeed's ops are built against one torch) redoes everything it holds.
key() {  # the hash for a venv holding the extras "$@"
  (cat pyproject.toml scripts/setup.sh scripts/build_horovod.sh
   if [[ " $* " == *" horovod "* ]]; then command -v mpicc || true; fi
   # torch's version and where it is installed, read without importing it
   [ ! -x "$VPY" ] || $VPY -c 'import importlib.metadata as m; d = m.distribution("torch"); print(d.version, d.locate_file(""))' 2>/dev/null || true
  ) | sha256sum | cut -c1-16
}
held=()
stale=0
if [ -f "$stamp" ] && [ -x "$VPY" ]; then
  read -r -a held < <(sed -n 2p "$stamp") || true
  [ "$(sed -n 1p "$stamp")" = "$(key "${held[@]}")" ] || stale=1  # out of date: everything held is redone
fi
missing=()
for e in "${asked[@]}"; do [[ " ${held[*]} " == *" $e "* ]] || missing+=("$e"); done
if [ $stale = 1 ]; then missing+=("${held[@]}"); fi
# ops compile DeepSpeed's: they need its package
want=($(printf '%s\n' "${held[@]}" "${asked[@]}" | sed 's/^ops$/ops\ndeepspeed/' | grep -v '^$' | sort -u || true))
has() { $VPY -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 1)" 2>/dev/null; }
if [ ${#missing[@]} -eq 0 ] && [ -f "$stamp" ] && has torch && has shardyard; then
  say "up to date ($VENV: core${held[*]:+ + ${held[*]}})"; exit 0
fi

# 1. the installer: uv (a resolver and installer written in Rust: `make train`'s setup in 9-40 s against pip's 122 s
# here, docs/development.md), kept once per machine in $SHARDYARD_CACHE/uv (or the uv on PATH); pip when
# SHARDYARD_INSTALLER=pip, or when uv cannot be had.
INSTALLER=${SHARDYARD_INSTALLER:-uv}
CACHE=${SHARDYARD_CACHE:-$HOME/.cache/shardyard}
UV=
if [ "$INSTALLER" = uv ]; then
  UV=$(command -v uv || true)
  [ -n "$UV" ] || [ ! -x "$CACHE/uv/bin/uv" ] || UV="$CACHE/uv/bin/uv"
  if [ -z "$UV" ]; then
    t=$(now)
    say "installing uv into $CACHE/uv (once per machine)"
    rm -rf "$CACHE/uv.tmp"
    if PIP_ROOT_USER_ACTION=ignore $PY -m pip install -q --target "$CACHE/uv.tmp" "uv>=0.13,<0.14"; then
      rm -rf "$CACHE/uv" && mv "$CACHE/uv.tmp" "$CACHE/uv" && UV="$CACHE/uv/bin/uv"
    fi
    say "  uv: $(since "$t")"
  fi
  if [ -z "$UV" ]; then say "uv could not be installed: installing with pip"; INSTALLER=pip; fi
fi
# 2. the venv (with pip: torch's resolution and the Horovod build use it)
if [ ! -x "$VPY" ]; then
  t=$(now)
  site=()
  if $PY -c "import torch" 2>/dev/null; then
    say "creating $VENV on top of the existing torch $($PY -c 'import torch; print(torch.__version__)')"
    site=(--system-site-packages)
  else
    say "creating $VENV"
  fi
  if [ "$INSTALLER" = uv ]; then
    "$UV" venv -q --seed "${site[@]}" --python "$($PY -c 'import sys; print(sys.executable)')" "$VENV"
  else
    $PY -m venv "${site[@]}" "$VENV"
  fi
  say "  venv: $(since "$t")"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
uv_flags=()
# 3. torch: pip decides which file (pip's own configuration says where from: here the CPU wheel on this disk),
# pinned; uv installs that file with the rest
torch=()
if has torch; then
  say "keeping torch $($VPY -c 'from importlib.metadata import version; print(version("torch"))')"
  # uv does not count a --system-site-packages venv's base packages as installed: keep it from resolving torch
  if [ "$($VPY -c 'import importlib.util as u, sys; print(u.find_spec("torch").origin.startswith(sys.prefix))')" = False ]; then
    echo torch > "$tmp/excludes.txt"; uv_flags+=(--excludes "$tmp/excludes.txt")
  fi
elif [ "$INSTALLER" = uv ]; then
  t=$(now)
  url=$($VPY -m pip install -q --dry-run --ignore-installed --no-deps --report - torch==2.13.0 \
        | $VPY -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')
  torch=("torch @ $url")
  say "torch==2.13.0 from $url ($(since "$t") to ask pip)"
else
  t=$(now)
  say "installing torch==2.13.0"
  $VPY -m pip install -q torch==2.13.0
  say "  torch: $(since "$t")"
fi
# 4. the project and its pip extras
pip_extras=()
for e in "${want[@]}"; do case "$e" in horovod|ops|core) ;; *) pip_extras+=("$e") ;; esac; done
spec="."
if [ ${#pip_extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${pip_extras[*]}")]"; fi
t=$(now)
say "installing shardyard (editable) with: core${pip_extras[*]:+ + ${pip_extras[*]}} (with $INSTALLER)"
if [ "$INSTALLER" = uv ]; then
  "$UV" pip install -q --python "$VPY" "${uv_flags[@]}" "${torch[@]}" -e "$spec"
else
  $VPY -m pip install -q -e "$spec"
fi
say "  packages: $(since "$t")"
# 5. Horovod, built from its sdist (cached per machine)
if [[ " ${want[*]} " == *" horovod "* ]]; then
  t=$(now)
  say "Horovod 0.28.1 (built once per machine, cached; skip with SHARDYARD_SKIP_HOROVOD=1)"
  PYTHON="$VPY" bash scripts/build_horovod.sh
  say "  horovod: $(since "$t")"
fi
# 6. DeepSpeed's ops: without this step the zero engines compile them on their first run (one line says so, and
# how long); `ops` compiles them now: one line, the compiler's output only on failure.
if [[ " ${want[*]} " == *" ops "* ]]; then
  t=$(now)
  say "DeepSpeed's ops for the zero engines (compiled once per machine and venv; skip with SHARDYARD_SKIP_OPS=1)"
  $VPY -m shardyard.core.op_builds
  say "  ops: $(since "$t")"
fi
# 7. Bytecode: every .py of the venv's packages (and of src/) compiled to its .pyc now. uv installs without it, and
# an environment with PYTHONDONTWRITEBYTECODE=1 (this machine's, and CI's) never writes one at import: then every
# process compiled torch, transformers and DeepSpeed from source again (63% of a 2-rank zero2 run's CPU; importing
# the worker 8.8 s -> 4.1 s, a tiny zero2 run through train.py 36 -> 16 s, a Horovod one 50 -> 19 s, measured
# 2026-11-29). A .pyc is only read, so the variable keeps meaning what it says; a few files of other packages
# that are not Python 3 (test data) do not compile, and are left as they are.
t=$(now)
$VPY -m compileall -qq -j 0 "$($VPY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" src > /dev/null 2>&1 || true
say "  bytecode: $(since "$t")"
printf '%s\n%s\n' "$(key "${want[@]}")" "${want[*]}" > "$stamp"
say "ok in $(since "$start"): $($VPY -c 'from importlib.metadata import version as v; print("torch", v("torch") + ", transformers", v("transformers"))'); extras: ${want[*]:-none}"
