"""Fault drills for shardyard's own tests, switched on by environment variables; inert otherwise.

* ``SHARDYARD_TEST_CRASH_AT_STEP=STEP[:RANK][@TEXT][=raise]``: that rank dies (exit 13) after that step, on the
  first attempt only (a restarted worker has ``TORCHELASTIC_RESTART_COUNT`` > 0); with ``@TEXT`` only in a run
  whose directory contains TEXT (one job of a sweep); with ``=raise`` by an exception (a bug's way to die: its
  traceback must reach the user however the worker was started).
* ``SHARDYARD_TEST_POISON_GRAD=STEP:RANK:PARAM[=VALUE]``: the gradient of parameter PARAM turns NaN (or VALUE,
  e.g. ``inf``: an fp16 overflow) on that rank during that step.
* ``SHARDYARD_TEST_KILL_IN_SAVE=POINT@STEP[:RANK]``: when that rank (default 0) reaches the named point of the
  save of STEP (``SAVE_POINTS``), the whole job dies by SIGKILL at once, as in a node failure. A kill is placed at
  a named moment, never after a sleep: a test then knows what the moment left (a sleep-placed kill also passes
  when it lands before any file exists).
* ``SHARDYARD_TEST_SIGNAL_AT_STEP=STEP[:RANK][=SIGNAL]``: during that step (after its forward and backward,
  before the optimizer step) that rank (default 0) sends SIGNAL (default ``TERM``; ``USR1``) to the job, as Slurm
  or a user would: to the launcher that started it (its parent under torch's elastic agent: ``python train.py``
  or torchrun; under our Horovod launcher on CPU: ``python train.py``), which passes it on to every worker, and to itself at once, so that the run stops after exactly
  that step (the copy passed on arrives whenever it does). First attempt only, as the crash.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable


def crash_after(step: int, rank: int, run_dir: str = "") -> None:
    spec = os.environ.get("SHARDYARD_TEST_CRASH_AT_STEP")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    how = "raise" if spec.endswith("=raise") else "exit"  # a suffix: TEXT may hold "=" (a sweep job's "lr=3e-3")
    spec, _, where = spec.removesuffix("=raise").partition("@")
    if where and where not in os.path.basename(os.path.normpath(run_dir)):
        return
    at, _, who = spec.partition(":")
    if step == int(at) and rank == int(who or 0):
        if how == "raise":
            raise RuntimeError(f"SHARDYARD_TEST_CRASH_AT_STEP: rank {rank} raises after step {step}")
        print(f"shardyard | SHARDYARD_TEST_CRASH_AT_STEP: rank {rank} dies after step {step}", file=sys.stderr, flush=True)
        os._exit(13)


_SIGNALLED: list[bool] = []


def signal_in_step(step: int, rank: int) -> None:
    spec = os.environ.get("SHARDYARD_TEST_SIGNAL_AT_STEP")
    if not spec or _SIGNALLED or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    spec, _, name = spec.partition("=")
    at, _, who = spec.partition(":")
    if (step, rank) != (int(at), int(who or 0)):
        return
    _SIGNALLED.append(True)  # once, though a step of several micro-batches comes here for each
    sig = getattr(signal, "SIG" + (name or "TERM").upper().removeprefix("SIG"))
    print(f"shardyard | SHARDYARD_TEST_SIGNAL_AT_STEP: rank {rank} sends {sig.name} to the job in step {step}",
          file=sys.stderr, flush=True)
    if "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("SHARDYARD_FORKED_HOROVOD") == "1":
        os.kill(os.getppid(), sig)  # the elastic agent, or our Horovod launcher, started this worker: the job's
    os.kill(os.getpid(), sig)


def poison_gradient(model, rank: int, current_step: Callable[[], int]) -> None:
    """The tensor hook is registered on the bare model, before the engine wraps it, so it runs first:
    before any engine hook and any reduction. An engine that trains other tensors than the ones built
    (FSDP2 swaps in sharded and, around forward, unsharded parameters) is reached through the owning module
    instead: at the poisoned step its forward hooks whatever tensor it holds under that name then."""
    spec = os.environ.get("SHARDYARD_TEST_POISON_GRAD")
    if not spec:
        return
    import torch

    at, who, target = spec.split(":", 2)
    name, _, value = target.partition("=")
    if int(who) != rank:
        return
    bad = float(value or "nan")
    param = dict(model.named_parameters())[name]

    def poison(g):
        return torch.full_like(g, bad) if current_step() == int(at) else g

    param.register_hook(poison)
    owner, _, leaf = name.rpartition(".")

    def arm(module, args) -> None:
        if current_step() != int(at) or not torch.is_grad_enabled():
            return
        # The registry itself, not getattr: ZeRO-3's parameter dict all-gathers a parameter on attribute access,
        # a collective this one rank would enter alone.
        held = module._parameters.get(leaf)
        if held is None or held is param or not held.requires_grad:
            return
        handles: list = []

        def once(g):
            handles.pop().remove()
            return poison(g)

        handles.append(held.register_hook(once))

    model.get_submodule(owner).register_forward_pre_hook(arm)


def qlora_on_cpu() -> bool:
    """``SHARDYARD_TEST_QLORA_ON_CPU=1`` lets a test run ``peft=qlora`` on CPU. Users are refused there (the issue's
    rule: QLoRA is a CUDA method), but bitsandbytes 0.50 has CPU kernels for its 4-bit layers, so the CPU tier
    proves the path itself: quantise, adapters, train, merge."""
    return os.environ.get("SHARDYARD_TEST_QLORA_ON_CPU") == "1"


SAVE_POINTS = ("begin", "engine_written", "rank_written", "before_hash", "before_meta", "before_fsync",
               "before_rename", "before_latest", "before_prune")
"""Where ``Checkpointer.save`` calls ``save_point``, in order: tmp dir made; this rank's engine files written
(with ``checkpoint.async_save``: in the background thread, as every point after it); this rank about to hash and
fsync its files; then rank 0 only: the ranks' manifests merged; meta.json written; directories fsynced; renamed;
``latest`` moved; pruning."""


def save_point(name: str, step: int, rank: int) -> None:
    spec = os.environ.get("SHARDYARD_TEST_KILL_IN_SAVE")
    if not spec:
        return
    point, _, at = spec.partition("@")
    at, _, who = at.partition(":")
    if point not in SAVE_POINTS:
        raise ValueError(f"SHARDYARD_TEST_KILL_IN_SAVE={spec!r}: the point is one of {SAVE_POINTS}")
    if (point, int(at), int(who or 0)) != (name, step, rank):
        return
    print(f"shardyard | SHARDYARD_TEST_KILL_IN_SAVE: rank {rank} kills the job at {name} of step {step}",
          file=sys.stderr, flush=True)
    # The job is this process group (train.py started in its own session, CPU workers forked from it); spawned
    # workers have a session of their own under the elastic agent, which goes first.
    if "TORCHELASTIC_RUN_ID" in os.environ and os.getpgid(os.getppid()) != os.getpgrp():
        os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)
