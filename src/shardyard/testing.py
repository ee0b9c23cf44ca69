"""Helpers for shardyard's own tests: compose configs, run real multi-process (gloo) workers from a kept pool
(``run_many``, ``on_ranks``), and run ``python train.py`` from a fork server (``run_python``)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
# Imported before _close_pools is registered, so that atexit runs multiprocessing's own handler (which joins
# live child processes) after ours (which stops the pools' ranks): the other order waits forever.
import multiprocessing.util  # noqa: F401
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf

from shardyard import config

CONF_DIR = str(config.CONF_DIR)  # the checkout's conf/ (tests read its files)

# A model and data shape small enough for 2 CPU cores, still the real architecture; no report.png (about a second
# of rank 0's matplotlib at the end of every run; the tests of the report ask for it with metrics.report=true).
TINY = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=4", "data.seq_len=64", "train.micro_batch_size=4", "train.sample_tokens=0",
        "train.eval_batches=2", "train.log_every_n_steps=1", "sched.warmup_steps=2", "checkpoint.save_final=false",
        "monitor=[console]", "monitor.console.style=plain", "metrics.report=false"]


def compose(overrides: list[str], run_dir: str | None = None) -> DictConfig:
    """``config.compose`` with a run dir that a test names (or a placeholder)."""
    return config.compose(overrides, run_dir=run_dir or "unused")


def _prepared(overrides: list[str], run_dir: str, env: Any) -> tuple[DictConfig, Any]:
    """What ``run.py`` does once before any worker starts: compose, validate (the plan), resolve."""
    from shardyard.planning.validate import validate
    from shardyard.training.rundir import resolved

    cfg = compose(overrides, run_dir)
    plan = validate(cfg, env)
    return resolved(cfg), plan


def _one_run(rank: int, world: int, overrides: list[str], run_dir: str) -> None:
    """One run on this rank, composed and validated here (a test's own rank function calls it)."""
    from shardyard.core.dist_env import detect

    cfg, plan = _prepared(overrides, run_dir, detect())
    _run_prepared(rank, world, cfg, plan, run_dir)


def _run_prepared(rank: int, world: int, cfg: DictConfig, plan: Any, run_dir: str) -> None:
    """One run on this rank of a config composed, validated and resolved already (``_prepared``): the worker's
    summary, and what the tests read of the engine (``rank<R>.pt``)."""
    import torch

    from shardyard.core.memory import local
    from shardyard.training import worker

    out: dict = {}

    def grab(backend):
        out["full"] = backend.full_state_dict()  # collective on sharded engines; rank 0 gets the dict
        # This rank's own tensors exactly as the engine holds them (a replica, or DTensor local shards).
        out["local"] = {k: local(v).detach().cpu().clone()
                        for k, v in backend.hf_model().state_dict().items()}
        # Expert parallelism: the token rows each MoE layer's all-to-all sent each rank of its group (training).
        out["ep_rows_sent"] = {name: list(m.ep_rows_sent) for name, m in backend.hf_model().named_modules()
                               if hasattr(m, "ep_rows_sent")}
        out["reference_built"] = "reference" in backend.__dict__  # a post-training objective's (reference_model)
        objective = backend.hf_model().__dict__.get("shardyard_objective")
        out["ref_cache_built"] = getattr(objective, "cache_built", None)  # DPO's precompute_ref_logps built its cache

    out["summary"] = worker.main(cfg, plan, after_train=grab)
    torch.save(out, os.path.join(run_dir, f"rank{rank}.pt"))


class RankFailed(RuntimeError):
    """A call on the ranks of a pool raised (the message holds the failing ranks' tracebacks) or a rank died."""


class _Pool:
    """``world`` spawned worker processes, started once and kept (a test session's, a benchmark's): each call
    runs on every rank with the caller's environment and working directory of that moment and its own
    ``MASTER_PORT``, so each run gets its own process group and run dir; only interpreter start-up and
    imports (torch, transformers, DeepSpeed: about 10 s per process set on 2 cores) are shared. A call that
    fails on some ranks while others are left waiting in a collective ends the pool; the next call starts a
    new one."""

    def __init__(self, world: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fresh interpreter per rank, never a fork of the caller (pytest)
        self.world = world
        self.calls = 0  # made so far (``on_ranks`` replaces the pool after POOL_CALLS)
        pipes = [ctx.Pipe() for _ in range(world)]
        self.conns = [parent for parent, _ in pipes]
        self.procs = [ctx.Process(target=_serve, args=(rank, world, child), name=f"shardyard-rank{rank}")
                      for rank, (_, child) in enumerate(pipes)]
        for proc in self.procs:
            proc.start()
        for _, child in pipes:
            child.close()

    def call(self, fn: Callable[..., None], args: tuple, timeout: float) -> None:
        from shardyard.launching.launch import free_port

        message = (fn, args, dict(os.environ), os.getcwd(), free_port())
        for conn in self.conns:
            conn.send(message)
        try:
            errors, pending = self._replies(timeout)
        except BaseException:  # interrupted (pytest's timeout, Ctrl-C) with the ranks mid-call: they cannot be reused
            self.close()
            raise
        if pending or errors:
            if pending:  # stuck or dead ranks: this pool is done
                self.close()
                errors.update({r: f"rank {r} did not finish ({'after a failure on another rank' if errors else f'timeout {timeout:.0f} s'})"
                               for r in pending})
            raise RankFailed("\n".join(f"-- rank {r}:\n{text}" for r, text in sorted(errors.items())))

    def _replies(self, timeout: float) -> tuple[dict[int, str], list[int]]:
        """Each rank's reply to the call just sent: the failing ranks' tracebacks, and the ranks that never
        replied."""
        from multiprocessing.connection import wait

        pending: dict[int, Any] = dict(enumerate(self.conns))
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            # Once a rank has failed, the others get a minute to fail too (a user error raised on every rank)
            # before they are taken for stuck in a collective with it.
            left = deadline - time.monotonic() if not errors else min(deadline - time.monotonic(), 60.0)
            ready = wait([*pending.values(), *(self.procs[r].sentinel for r in pending)], timeout=max(left, 0))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready or self.procs[rank].sentinel in ready:
                    try:
                        error = conn.recv()
                    except EOFError:
                        error = f"rank {rank} died (exit code {self.procs[rank].exitcode})"
                    del pending[rank]
                    if error is not None:
                        errors[rank] = error
        return errors, list(pending)

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        _POOLS.pop(self.world, None)


_POOLS: dict[int, _Pool] = {}


def _serve(rank: int, world: int, conn) -> None:
    """A pool rank: run each call it is sent, reply None or the traceback, until told to stop."""
    import gc
    import traceback

    import torch

    threads = max(1, (os.cpu_count() or 1) // world)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the caller's share of the cores (a test session's worker)
        threads = max(1, min(threads, int(os.environ["OMP_NUM_THREADS"])))
    torch.set_num_threads(threads)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the caller went away
            return
        if message is None:
            return
        fn, args, env, cwd, port = message
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(cwd)
        added = _put_pythonpath_on_sys_path()
        try:
            fn(rank, world, *args)
            reply = None
        except BaseException:
            reply = traceback.format_exc()
        finally:
            _forget_pythonpath(added)
        conn.send(reply)
        # What outlives a call (imported modules, their caches) is kept for good: the next run's collections
        # (an engine's teardown runs gc.collect, ~0.6 s over a heap of torch, transformers and DeepSpeed) then
        # scan only what that run made. The run's own garbage was collected by its teardown already; a call that
        # raised may have left cycles (its traceback's frames) and is collected first, never frozen in.
        if reply is not None:
            gc.collect()
        gc.freeze()


def _put_pythonpath_on_sys_path() -> list[str]:
    """``$PYTHONPATH``'s directories where a fresh interpreter puts them (after the script's), for a call or a
    forked run whose environment names a user's package; returns those that were not on sys.path yet."""
    import importlib

    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    added = [p for p in entries if p not in sys.path]
    sys.path[1:1] = added
    importlib.invalidate_caches()
    return added


def _forget_pythonpath(added: list[str]) -> None:
    """After a pool call: those directories off sys.path and their modules out of sys.modules, so that the next
    call that names a package of the same name (another test's temp project) imports its own."""
    for p in added:
        sys.path.remove(p)
    roots = tuple(os.path.join(os.path.abspath(p), "") for p in added)
    for name, module in list(sys.modules.items()):
        if roots and os.path.abspath(getattr(module, "__file__", None) or "/").startswith(roots):
            del sys.modules[name]


def on_ranks(world: int, fn: Callable[..., None], *args, timeout: float = 1800) -> None:
    """``fn(rank, world, *args)`` on every rank of this process's pool of ``world`` workers (started on first
    use and kept), with RANK/WORLD_SIZE/MASTER_* set and this process's environment; ``RankFailed`` names the
    failing ranks. ``fn`` must be importable (a module-level function)."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive() or pool.calls >= POOL_CALLS:
        if pool is not None:
            pool.close()
        pool = _POOLS[world] = _Pool(world)
    pool.calls += 1
    pool.call(fn, args, timeout)


POOL_CALLS = 24
"""Calls a pool serves before it is replaced by a fresh one. A run's process groups leave gloo's TCP threads
behind in the rank (seen: 345 ``gloo_tcp`` threads in a world-2 rank after ~150 runs, its idle ranks then
using 6-19% of a core each while other tests ran); a fresh pool costs one start-up of its ranks."""


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


def run_many(world: int, jobs: list[tuple[list[str], str]]) -> list[list[dict]]:
    """Run each (overrides, run_dir) job on ``world`` real worker processes (gloo), one job after another, each
    with its own process group and run dir; return, per job, each rank's summary, gathered full params and
    local tensors."""
    import torch

    from shardyard.core.dist_env import DistEnv

    for overrides, run_dir in jobs:
        os.makedirs(run_dir, exist_ok=True)
        # Composed and validated once, here, as run.py does for its workers (which neither re-compose nor
        # re-validate): each rank doing it again cost a second of CPU per rank and run. A config that does not
        # compose or validate goes to the ranks as it is, so that its error is every rank's, as a run's.
        # A call whose $PYTHONPATH names a user's package (a test's temp project) is composed by the ranks, which
        # put it on their path for the call (``_serve``): this process may hold another project's of that name.
        own_path = not [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        try:
            cfg, plan = _prepared(list(overrides), run_dir, DistEnv("elastic", 0, 0, world, world)) if own_path \
                else (None, None)
        except Exception:
            cfg = None
        if cfg is None:
            on_ranks(world, _one_run, list(overrides), run_dir)
        else:
            on_ranks(world, _run_prepared, cfg, plan, run_dir)
    return [[torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)] for _, d in jobs]


def run_ranks(world: int, overrides: list[str], run_dir: str) -> list[dict]:
    """One run on ``world`` real worker processes."""
    return run_many(world, [(overrides, run_dir)])[0]


def hf_tensors(hf_dir: str | os.PathLike) -> dict:
    """Every tensor of an HF export, whatever its sharding (one ``model.safetensors``, or the shards that several
    ranks wrote), by name."""
    import glob

    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(glob.glob(os.path.join(str(hf_dir), "*.safetensors"))):
        out.update(load_file(f))
    return out


def hf_eval_loss(hf_dir: str, cfg: DictConfig, world: int) -> float:
    """Eval loss of an HF export on exactly the sequences a ``world``-rank run evaluates, as ``loop.evaluate``
    weighs them (the mean over their label tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardyard.data import pipeline as data
    from shardyard.models.loss import causal_lm_loss_sum

    prep = data.prepare(cfg)
    val = data.open_split(prep, "val", cfg.data.seq_len)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for rank in range(world):
            for x, y in data.eval_batches(val, cfg.train.eval_batches, cfg.train.micro_batch_size, rank, world):
                total += causal_lm_loss_sum(model, x, y).item()
                count += int((y != -100).sum())
    return total / count


@contextlib.contextmanager
def accelerator_groups(accelerator: str = "cuda") -> Iterator[None]:
    """In a rank (``on_ranks``): play a run whose compute device is ``accelerator`` on this CPU, with the device
    rule of its collective library. Every process group created inside serves exactly the device types its
    backend string names, as NCCL serves CUDA tensors only: a CPU tensor in any collective on a group that names
    no ``cpu`` backend (``torch.distributed``'s, functional collectives, DTensor's, FSDP2's: they all reach
    c10d's per-device dispatch) is refused by c10d itself, "No backend type associated with device type cpu", the
    error a GPU run meets.

    1. ``torch.distributed.init_process_group(backend, ..., device_id=...)``: the string is read as torch reads
       it (``nccl`` names ``cuda`` alone, ``gloo`` both), and the group is created with gloo for each device type
       it names and for nothing else. Groups made from it (``new_group``, a DeviceMesh's sub-groups) inherit that.
    2. ``device_id`` is dropped: this machine has no such device to bind. A barrier therefore runs on the host
       here, where a GPU run's runs on its bound device.
    3. ``torch.cuda.set_device`` does nothing, so an engine's ``pick_device`` hands out ``cuda:LOCAL_RANK`` and
       its ``init`` builds its groups and meshes for it (a DeviceMesh of type cuda needs no CUDA to be built).

    Every tensor of this machine is a CPU tensor, so a group must name ``cpu`` to serve anything here: the
    rule that ``process_group.backend_string`` keeps on an accelerator (every group serves the host as well)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    real_init, real_set_device = dist.init_process_group, torch.cuda.set_device

    def init_process_group(backend: str | None = None, *args: Any, device_id: Any = None, **kwargs: Any) -> Any:
        # 1 (no backend: torch's default on a machine with the accelerator, one for each of its device types)
        declared = BackendConfig(Backend(backend)).get_device_backend_map() if backend else ("cpu", accelerator)
        return real_init(",".join(f"{device}:gloo" for device in declared), *args, **kwargs)  # 2

    dist.init_process_group = init_process_group
    torch.cuda.set_device = lambda device: None  # 3
    try:
        yield
    finally:
        dist.init_process_group, torch.cuda.set_device = real_init, real_set_device


# --------------------------------------------------------------------------------------------------------------
# `python train.py ...` for the e2e tier, from a fork server
#
# Every `python train.py` pays about 4-5 s on 2 cores importing torch and transformers (and the default model's
# modeling code, which validation's meta-device build needs) before it reads a single override. The e2e tier
# runs train.py some seventy times, so tests ask a server that has imported exactly those modules once to fork
# a child per run: the child gets the run's argv, working directory, environment and stdio (by fd passing), a
# new session, fresh Python and NumPy random states, and runs train.py as `__main__` (runpy), as the
# interpreter would. What is shared is only import work that every real run does anyway. Tests that are about
# the interpreter itself (`--help` time, lazy imports, the launchers torchrun/deepspeed/horovodrun/srun, a
# wheel in a fresh venv) start real processes; SHARDYARD_TEST_COLD=1 makes every run a real process.

def _zygote_main(sock_path: str) -> None:
    """The fork server: import what every ``python train.py`` imports, then fork one child per request."""
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401  (validation's meta build of the default model)

    import shardyard.cli  # noqa: F401
    import shardyard.launching.run  # noqa: F401
    import shardyard.training.worker  # noqa: F401

    import gc

    gc.freeze()  # what every run inherits stays put: its collections skip it (as the launcher before its fork)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            first, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            if not first:
                continue
            (size,) = struct.unpack("!I", first[:4])
            payload = first[4:]
            while len(payload) < size:
                payload += conn.recv(size - len(payload))
            request = json.loads(payload)
            if request.get("stop"):
                return
            pid = os.fork()
            if pid == 0:  # the child keeps only the run's stdio
                server.close()
                conn.close()
                _zygote_child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the client gave up (a timeout) and killed the child itself


def _zygote_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python <argv>`` in ``cwd`` with ``env`` and the given stdio, run it, exit."""
    import io
    import random
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the run and every worker it started
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else open(1, "wb", closefd=False),
                                      write_through=unbuffered, line_buffering=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                      write_through=True, line_buffering=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        random.seed()  # a fresh interpreter seeds these from the OS, not from the server's state
        import numpy as np

        np.random.seed()
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        _put_pythonpath_on_sys_path()
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class _Zygote:
    """The client's handle on the fork server (one per test session, started on first use)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="shardyard-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, "-c", f"from shardyard.testing import _zygote_main; "
                                      f"_zygote_main({self.path!r})"], stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the train.py fork server did not start (exit code {self.proc.wait()})")

    def _send(self, s: socket.socket, request: dict, fds: list[int]) -> None:
        payload = json.dumps(request).encode()
        socket.send_fds(s, [struct.pack("!I", len(payload)) + payload], fds)

    def run(self, argv: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.path)
            self._send(s, {"argv": argv, "cwd": cwd, "env": env}, [null.fileno(), out.fileno(), err.fileno()])
            reader = s.makefile("r")
            pid = int(reader.readline())
            s.settimeout(timeout)
            try:
                line = reader.readline()  # the exit code, once the child is gone
            except BaseException as e:  # a timeout, or pytest's own (an interrupt): the run and its workers go
                os.killpg(pid, signal.SIGKILL)
                if isinstance(e, TimeoutError):
                    raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
                raise
            if not line:
                raise RuntimeError(f"the train.py fork server lost the run of {argv}")
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
            return subprocess.CompletedProcess([sys.executable, *argv], int(line), texts[0], texts[1])

    def close(self) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, open(os.devnull, "rb") as null:
                s.connect(self.path)
                self._send(s, {"stop": True}, [null.fileno()] * 3)
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTE: list[_Zygote] = []


def run_python(argv: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``,
    forked by the server above (started on first use and kept); a real process with SHARDYARD_TEST_COLD=1."""
    if os.environ.get("SHARDYARD_TEST_COLD") == "1":
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [_Zygote()]
    return _ZYGOTE[0].run(argv, cwd, env, timeout)


@atexit.register
def _close_zygote() -> None:
    for zygote in _ZYGOTE:
        zygote.close()


# ------------------------------------------------------------------------------ memory measured on real ranks
def _planned(cfg, plan) -> dict:
    """The plan's per-rank figures for this run on this machine (what ``plan.only=true`` prints)."""
    from shardyard.planning import plan as memory_plan
    from shardyard.planning import hardware as plan_hardware

    e = memory_plan.estimate(cfg, plan, plan_hardware.hardware(cfg, plan))
    return {"device": e.device, "peak": e.device_peak}


def measure_engines(rank: int, world: int, ports: list[int], jobs: list[list[str]], out: str) -> None:
    """In a spawned rank of ``world``: for each job (overrides), build the engine, train one step and run the
    backward of the next (gradients and optimizer state both alive), and record what this rank holds
    (``held_by``) beside the parameter count. Rank 0 writes ``[{"overrides", "P", "params", ...}]`` to ``out``."""
    import json
    import os
    import tempfile

    import hydra.utils
    import torch

    from shardyard.data import pipeline as data
    from shardyard.planning.validate import validate
    from shardyard.core.dist_env import detect
    from shardyard.core.memory import held_by
    from shardyard.models.build import build_model
    from shardyard.models.shape import param_count

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    results = []
    for port, overrides in zip(ports, jobs):
        os.environ["MASTER_PORT"] = str(port)
        cfg = compose([*overrides, "train.steps=2"], run_dir=tempfile.mkdtemp(prefix="shardyard-mem-"))
        plan = validate(cfg, detect())
        backend = hydra.utils.get_object(cfg.backend._target_)(cfg, plan)
        backend.init()
        built: dict = {}

        def build(allow_meta: bool) -> torch.nn.Module:
            from shardyard.models.adapters import apply

            model = build_model(cfg.model, cfg.seed)
            built["P"] = param_count(model)
            built["m"] = apply(model, cfg.peft, cfg.seed)  # peft=lora: adapters, the base frozen
            return built["m"]

        backend.prepare(build, 2)
        prep = data.prepare(cfg)
        stream = data.TrainStream(data.open_split(prep, "train", cfg.data.seq_len), 0,
                                  plan.global_batch_size, plan.micro_batch_size, backend.dp_rank, backend.dp_size)
        weight = torch.ones((), device=backend.device)  # the loss's scale: nothing held depends on it
        x, y = stream.micro_batch(0, 0)
        backend.forward_backward(x, y, True, weight)
        backend.step()
        x, y = stream.micro_batch(1, 0)
        backend.forward_backward(x, y, True, weight)  # gradients of step 2 alive, optimizer state from step 1
        engine = getattr(backend, "engine", None)  # DeepSpeed's ZeRO optimizer, or the torch one of the stepper
        optimizer = engine.optimizer if engine is not None else getattr(backend, "stepper").optimizer
        results.append({"overrides": overrides, "P": built["P"], "trainable": param_count(backend.hf_model(), trainable=True),
                        "plan": _planned(cfg, plan), **held_by(backend.hf_model(), optimizer)})
        backend.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run_measurements(world: int, jobs: list[list[str]]) -> list[dict]:
    """``measure_engines`` on ``world`` gloo ranks (``on_ranks``' pool); one result per job."""
    import json
    import tempfile

    from shardyard.launching.launch import free_port

    out = tempfile.mktemp(suffix=".json", prefix=f"shardyard-memory-w{world}-")
    on_ranks(world, measure_engines, [free_port() for _ in jobs], jobs, out)
    with open(out) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------------------
# Data at corpus scale: generated corpora and the memory of a whole process tree

def synthetic_corpus(path: str, mb: float, seed: int = 0, words: int = 4000) -> int:
    """A JSONL corpus of about ``mb`` MB: documents of 50-3000 words drawn from ``words`` made-up words (a
    Zipf-like law, so a BPE tokenizer finds structure). Returns the number of records."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(words)])
    p = 1 / np.arange(1, words + 1)
    p /= p.sum()
    n, size = 0, 0
    with open(path, "w") as f:
        while size < mb * 1e6:
            text = " ".join(vocab[rng.choice(words, size=int(rng.integers(50, 3000)), p=p)])
            line = json.dumps({"text": text, "id": n}) + "\n"
            f.write(line)
            size += len(line)
            n += 1
    return n


def peak_tree_rss(cmd: list[str], env: dict | None = None, timeout: float = 600,
                  stop_when: Callable[[], bool] | None = None) -> tuple[int, float, subprocess.Popen]:
    """Run ``cmd`` and sample the memory of it and all its children every 20 ms: ``(peak bytes, wall s,
    process)``. The memory is the summed PSS (resident pages, a shared page counted once in all): summed RSS
    counts a child between fork and exec as a second copy of its parent. The tree is read process by process,
    not at one instant, so a process forked mid-read has its parent's shared pages counted whole in the parent and
    again in half in the child (a tokenizer worker forked from a 214 MB build read ~150 MB over, twice in full
    suites): a sample counts only if the same processes existed before and after its read, and the peak is the
    highest value held by two consecutive such samples of the same processes. ``stop_when``: checked at every
    sample; True kills the whole tree with SIGKILL (kill -9)."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    root, peak, last, last_pids = psutil.Process(proc.pid), 0, 0, None
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            pids: set[int] | None = {p.pid for p in tree}
            now = sum(p.memory_full_info().pss for p in tree)
            if pids != {root.pid, *(p.pid for p in root.children(recursive=True))}:
                now, pids = 0, None  # a process started or ended during the read
            if pids is not None and pids == last_pids:
                peak = max(peak, min(now, last))
            last, last_pids = now, pids
        except psutil.Error:
            last_pids = None
        if stop_when is not None and stop_when():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        if time.perf_counter() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(f"{cmd} ran over {timeout} s")
        time.sleep(0.02)
    return peak, time.perf_counter() - t0, proc


def activation_memory(overrides: list[str], rows: int, seq: int) -> dict:
    """What one training micro-batch of ``rows x seq`` tokens holds in this process, measured: ``kept``, the bytes
    alive after the forward (what backward will read), and ``peak``, the high-water mark through forward and
    backward, both above what was alive before (parameters, and gradients allocated by a first step). Run it in a
    process started with ``MALLOC_MMAP_THRESHOLD_=65536``: tensors then live in their own mappings, returned to
    the system when freed, so the resident size follows the live tensors (``VmHWM`` reset through clear_refs).
    Also the plan's ``_activations`` for the same micro-batch (``plan``)."""
    import torch

    from shardyard.config import checkpointed_fraction, checkpointing_mode
    from shardyard.models.build import build_model
    from shardyard.models.loss import causal_lm_loss_sum
    from shardyard.models.prepare import SpeedProbe, prepare_replica
    from shardyard.models.shape import model_shape
    from shardyard.planning.plan import _activations

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    cfg = compose(overrides)
    model = prepare_replica(build_model(cfg.model, cfg.seed), cfg, torch.device("cpu")).train()
    x = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(1))
    causal_lm_loss_sum(model, x, y).sum().backward()  # gradients exist from here on, as in every later step
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base = status("VmRSS")
    with SpeedProbe(model, cfg.model) as probe:  # summary.json's figure of the same bytes, beside the system's
        loss = causal_lm_loss_sum(model, x, y).sum()
        kept = status("VmRSS") - base
        loss.backward()
    shape = model_shape(build_model(cfg.model, cfg.seed, on_meta=True))
    regime = "fp32" if cfg.precision.name == "fp32" else "autocast"
    planned = _activations(shape, regime, rows * seq, checkpointing_mode(cfg.model),
                           checkpointed_fraction(cfg.model, shape["blocks"]), int(cfg.model.get("loss_chunk", 0)),
                           int(cfg.model.get("mlp_tiles", 0)))
    return {"kept": kept, "peak": status("VmHWM") - base, "plan": planned, "probe": probe.record}


def completion_length(completions: list[str], rows: list[dict]) -> list[float]:
    """A reward for the tests (``objective.rewards=[{_target_: shardyard.testing.completion_length}]``): each
    completion's length in characters, a user's own callable plugged in by ``_target_``."""
    return [float(len(c)) for c in completions]


@functools.cache
def _fixed_rollouts_class() -> Any:
    from shardyard.objectives.grpo import GRPO

    class FixedRollouts(GRPO):
        """``objective._target_=shardyard.testing.FixedRollouts``: GRPO whose completions are injected, a user's own
        objective plugged in by ``_target_``. Each completion is a function of its prompt's last tokens and of its
        place in its group (rows are prompt-major, G per prompt), 1..max_new tokens long, so any split of the batch
        over micro-batches and ranks samples the same: the engines are compared on everything after sampling."""

        def _generate(self, model, ids, mask, *, greedy, max_new, generator, backend):
            import torch

            place = torch.arange(ids.shape[0], device=ids.device)[:, None] % self.G
            k = torch.arange(max_new, device=ids.device)[None]
            tokens = 32 + (ids[:, -1:] * 7 + ids[:, -2:-1] * 3 + place * 11 + k * 5) % (len(self.tok) - 64)
            keep = k < 1 + (ids[:, -1:] + place * 3) % max_new
            return torch.where(keep, tokens, torch.full_like(tokens, self.pad)), keep.long()

    return FixedRollouts


def __getattr__(name: str) -> Any:  # FixedRollouts is built on first use: this module loads without torch
    if name == "FixedRollouts":
        return _fixed_rollouts_class()
    raise AttributeError(name)
