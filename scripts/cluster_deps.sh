#!/usr/bin/env bash
# The cluster tier's system packages (make test runs this; make train does not need them):
#   slurm-wlm + munge   a real local Slurm (tests/cluster/slurm.py)
#   iproute2            `ip netns`: hosts as network namespaces (tests/cluster/hosts.py)
#   openssh-server, pdsh  an sshd per namespace host for horovodrun -H and DeepSpeed's pdsh runner (sshd.py)
#   libaio-dev          DeepSpeed's async I/O op, which ZeRO-Infinity (backend=zero_infinity) swaps with
#                       (the op itself compiles on first use: about 4.5 minutes on 2 cores)
#   openmpi-bin, libopenmpi-dev  mpirun, and the MPI controller of Horovod (backend.controller=mpi), which
#                       setup.sh builds in when mpicc is present (make test runs this script before setup)
# Debian packages, so root and apt-get are needed. Outside CI, without them (or with SHARDYARD_SKIP_APT=1)
# nothing is installed and this says so; the tests that need them then skip, and the test session fails on
# those skips unless SHARDYARD_ALLOW_SKIPS=1 (tests/conftest.py). Under CI=true a missing package is an error:
# an install that cannot run or fails stops `make test` here, with apt-get's own output.
set -uo pipefail
say() { echo "[cluster-deps] $*"; }
ci() { [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; }
need=()
command -v slurmctld >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
command -v ip >/dev/null || need+=(iproute2)
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v pdsh >/dev/null || need+=(pdsh)
[ -e /usr/include/libaio.h ] || need+=(libaio-dev)
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "${SHARDYARD_SKIP_APT:-0}" = 1 ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  why="needs root and apt-get, or SHARDYARD_SKIP_APT=1 was set"
  if ci; then
    say "error: CI=true and ${need[*]} cannot be installed here ($why); the cluster tests need them"
    exit 1
  fi
  say "not installing ${need[*]} ($why): the cluster tests that need them skip (SHARDYARD_ALLOW_SKIPS=1 lets the session pass)"
  exit 0
fi
say "installing ${need[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
# apt's output goes to a log, shown only when the install fails (quiet on success).
log=$(mktemp -t cluster-deps.XXXXXX)
trap 'rm -f "$log"' EXIT
if ! apt-get install -y -q "${need[@]}" >"$log" 2>&1; then
  # The package lists may be missing or stale (a fresh container): update them, then try once more.
  apt-get update -q >>"$log" 2>&1
  if ! apt-get install -y -q "${need[@]}" >>"$log" 2>&1; then
    if ci; then
      cat "$log" >&2
      say "error: apt-get install ${need[*]} failed (its output is above); CI=true needs them"
      exit 1
    fi
    tail -n 20 "$log" >&2
    say "apt-get install ${need[*]} failed (the end of its output is above): the cluster tests that need them skip"
  fi
fi
exit 0
