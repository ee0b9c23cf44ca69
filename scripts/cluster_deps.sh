#!/usr/bin/env bash
# The cluster tier's system packages (make test runs this; make train does not need them):
#   slurm-wlm + munge   a real local Slurm (tests/cluster/slurm.py)
#   iproute2            `ip netns`: hosts as network namespaces (tests/cluster/hosts.py)
#   openssh-server, pdsh  an sshd per namespace host for horovodrun -H and DeepSpeed's pdsh runner (sshd.py)
#   libaio-dev          DeepSpeed's async I/O op, which ZeRO-Infinity (backend=zero_infinity) swaps with
#                       (the op itself compiles on first use: about 4.5 minutes on 2 cores)
#   openmpi-bin, libopenmpi-dev  mpirun, and the MPI controller of Horovod (backend.controller=mpi), which
#                       setup.sh builds in when mpicc is present (make test runs this script before setup)
# Debian packages, so root and apt-get are needed; without them (or with SHARDYARD_SKIP_APT=1) nothing is
# installed and those tests skip, printing why.
set -uo pipefail
say() { echo "[cluster-deps] $*"; }
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
  say "not installing ${need[*]} (needs root and apt-get, or SHARDYARD_SKIP_APT=1 was set): the cluster tests that need them skip"
  exit 0
fi
say "installing ${need[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q "${need[@]}" >/dev/null 2>&1; then
  apt-get update -q >/dev/null 2>&1
  apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || say "apt-get install ${need[*]} failed: the cluster tests that need them skip"
fi
exit 0
