"""DeepSpeed's compiled ops: built ahead by the full setup, and never waited on in silence at run time.

DeepSpeed compiles its ops (``cpu_adam``, ``fused_adam``, ``async_io``, ...) on first use through torch's JIT
builder (``torch.utils.cpp_extension.load``), which holds a ``lock`` file in the op's build directory while it
compiles and removes it when done. A compile that is killed (Ctrl-C, a job's time limit) leaves the file, and
every later build of that op waits on it forever, printing nothing. Before ``deepspeed.initialize`` the DeepSpeed
engine calls :func:`check_deepspeed_ops`: a lock that a live build holds is waited for (one line says so), a
stale one is a :class:`~shardyard.core.errors.UserError` naming the file, and a first compile says so in one line with
how long it takes. ``python -m shardyard.core.op_builds`` (run by ``make setup EXTRAS=ops`` and ``make test``; not by
``make train``) compiles the shipped engines' ops ahead, so a run does not compile at all.

DeepSpeed and torch are imported inside the functions that need them: importing this module imports neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import tempfile
import time
from typing import Iterator, NamedTuple

from shardyard.core.errors import UserError

SETUP_OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder")
"""What the shipped engines load with the default optimizer (AdamW): ``zero1|zero2|zero3`` DeepSpeed's fused
Adam, the ``*_offload`` engines its CPU Adam, ``zero_infinity`` also its async I/O (when libaio is present)."""

COMPILE_TIME = {"fused_adam": "about 3 minutes", "cpu_adam": "about 3 minutes", "async_io": "about 5 minutes"}
"""How long an op's first compile takes on a 2-core CPU box (``time python -m shardyard.core.op_builds FusedAdamBuilder``:
184 s, ``CPUAdamBuilder`` 170 s, the three 638 s, load average 3; docs/development.md), said by the first-use line
so that a run that goes quiet for minutes is not taken for a hung one."""

NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "afs", "9p", "virtiofs")
"""File systems other hosts may share (with any ``fuse.*``): a lock there may be held by another node's build,
which this host's /proc cannot show, so it is waited for (with a line saying so) and never called stale."""


class Need(NamedTuple):
    """An op DeepSpeed will load for this run: its builder class, and the config key (and value) that asks for it."""

    builder: str
    key: str
    value: object


# DeepSpeed 0.19's choice of op per JSON optimizer type (runtime/engine.py, _configure_basic_optimizer): a CPU
# kernel when ZeRO-Offload runs the step on the host, a fused device kernel otherwise; other types are torch's.
_OFFLOADED_STEP = {"adam": "CPUAdamBuilder", "adamw": "CPUAdamBuilder", "adagrad": "CPUAdagradBuilder",
                   "lion": "CPULionBuilder"}
_DEVICE_STEP = {"adam": "FusedAdamBuilder", "adamw": "FusedAdamBuilder", "lamb": "FusedLambBuilder",
                "lion": "FusedLionBuilder"}
# A client optimizer from deepspeed.ops (optim._target_) loads its op when it is built.
_CLIENT_OPTIMIZERS = {"DeepSpeedCPUAdam": "CPUAdamBuilder", "FusedAdam": "FusedAdamBuilder",
                      "DeepSpeedCPUAdagrad": "CPUAdagradBuilder", "DeepSpeedCPULion": "CPULionBuilder",
                      "FusedLion": "FusedLionBuilder", "FusedLamb": "FusedLambBuilder"}


def deepspeed_needs(config: dict, optim_target: str, engine: str) -> list[Need]:
    """The compiled ops DeepSpeed loads for this generated JSON (``config``) and ``optim._target_``, once each,
    with the key that asks for each: the optimizer's kernel and, for NVMe offload, the async I/O op."""
    zero = config.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    needs: list[Need] = []
    kind = str(config.get("optimizer", {}).get("type", "")).lower()
    if kind and offload != "none" and kind in _OFFLOADED_STEP:
        needs.append(Need(_OFFLOADED_STEP[kind], "backend.offload_optimizer", offload))
    elif kind and offload == "none" and kind in _DEVICE_STEP:
        needs.append(Need(_DEVICE_STEP[kind], "backend", engine))
    module, _, name = optim_target.rpartition(".")
    if not kind and module.startswith("deepspeed.ops.") and name in _CLIENT_OPTIMIZERS:
        needs.append(Need(_CLIENT_OPTIMIZERS[name], "optim._target_", optim_target))
    for what in ("optimizer", "param"):  # the swappers (runtime/swap_tensor) load async I/O
        if zero.get(f"offload_{what}", {}).get("device") == "nvme":
            needs.append(Need("AsyncIOBuilder", f"backend.offload_{what}", "nvme"))
            break
    return needs


def venv_build_root() -> str:
    """Give torch's JIT builder a build root of this environment's own, ``TORCH_EXTENSIONS_DIR`` (a root the user
    set is kept), and return it.

    torch's default root, ``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ>``, is one per user, so two environments
    of one machine (two checkouts' venvs; a CI clone's beside a developer's) share each op's directory, and the
    ``build.ninja`` each writes there names its own torch's and DeepSpeed's include directories: ninja then
    rebuilds the op for whichever ran last. Measured here: each session after a CI run on the machine recompiled
    fused_adam, cpu_adam and async_io (12 min, in its first DeepSpeed test), and each CI run's setup after a session
    did the same (10 min). The root is torch's with ``-`` and 10 hex digits of the sha256 of where torch and
    DeepSpeed are installed appended (``py311_cpu-3f2a9c01de``): what the build commands name, so a venv that
    reaches another's packages (a ``--system-site-packages`` venv, a project's venv with a ``.pth`` line) shares
    its builds, and two installs never do. Set in this process's environment before DeepSpeed loads an op, so its
    compilers and the ranks it starts see the same root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    # torch's own folder name (torch.utils.cpp_extension._get_build_directory, torch 2.13)
    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    installs = hashlib.sha256("\0".join(_installed("torch", "deepspeed")).encode()).hexdigest()[:10]
    root = os.path.join(get_default_build_root(), f"{folder}-{installs}")
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    return root


def _installed(*packages: str) -> list[str]:
    """Where each package is installed (its directory, symlinks resolved; "" for one that is not), found without
    importing it."""
    import importlib.util

    specs = [importlib.util.find_spec(name) for name in packages]
    return [os.path.dirname(os.path.realpath(s.origin)) if s is not None and s.origin else "" for s in specs]


def check_deepspeed_ops(needs: list[Need]) -> None:
    """Before DeepSpeed loads ``needs``: wait (saying so) for a build of one that another process runs, refuse a
    stale build lock (:func:`wait_for_lock`), and say when an op is about to compile for the first time."""
    venv_build_root()
    for need in needs:
        builder = _builder(need.builder)
        if builder is None or _prebuilt(builder):
            continue
        directory = build_dir(builder.name)
        wait_for_lock(directory, need.key, need.value, what=f"DeepSpeed's {builder.name} op")
        if not _built(directory, builder.name) and os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"shardyard | compiling DeepSpeed's {builder.name} op on its first use: once per machine and venv, "
                  f"{COMPILE_TIME.get(builder.name, 'a minute or more')} on 2 cores (`make setup EXTRAS=ops`, or "
                  f"`python -m shardyard.core.op_builds`, compiles the shipped engines' ops ahead) in {directory}",
                  flush=True)


def build_dir(op: str) -> str:
    """Where torch's JIT builder compiles ``op``: ``$TORCH_EXTENSIONS_DIR/<op>`` (:func:`venv_build_root` sets it
    when the user has not; torch's own rule, which also creates the directory)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(op, verbose=False)


def wait_for_lock(directory: str, key: str, value: object, what: str, poll_s: float = 1.0) -> None:
    """Return once ``directory`` holds no build lock: at once when there is none, after the build that holds it
    when one is alive. A lock no build holds is stale: raise a UserError naming ``key`` and the file.

    1. The lock is live while a process of this host (another than this one) holds it open or works in the
       directory (:func:`holders`); the wait says so once, naming the file.
    2. A holder may remove the lock between our look at the file and our look at /proc: it is stale only if the
       very file we first saw (inode and change time) is still there after a scan found no holder.
    3. A holder that dies while we wait (its run was killed) leaves the lock behind: reported then, not waited on.
    4. On a file system other hosts share, another node's build is invisible here: wait, saying so and how to
       clear the lock if no node is building.
    """
    lock = os.path.join(directory, "lock")
    known: list[int] = []
    said = False
    while True:
        seen = _identity(lock)
        if seen is None:
            return
        known = [pid for pid in known if _works_in(pid, directory)] or holders(directory)
        if not known:
            network = network_fs(directory)
            if network is None:
                if _identity(lock) != seen:  # 2.
                    continue
                raise _stale(lock, directory, key, value, what)
            if not said:
                print(f"shardyard | waiting on {lock}: no process on this host holds it, and {directory} is on "
                      f"{network}, which other nodes may share, so another node may be compiling {what}. If none "
                      f"is, the lock is left from an interrupted build: remove it (rm {lock}).", flush=True)
                said = True
        elif not said:
            names = ", ".join(f"{pid} ({_command(pid)})" for pid in known[:3])
            print(f"shardyard | waiting for another build of {what}, which holds {lock} (process {names})",
                  flush=True)
            said = True
        time.sleep(poll_s)


def holders(directory: str) -> list[int]:
    """This host's processes, other than this one, that build in ``directory``: the one holding its ``lock`` open
    (torch's FileBaton keeps the descriptor until it removes the file), or a compiler or ninja working in it (its
    cwd, or a path in its command line; the only sign of another user's build, whose descriptors are private)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and _works_in(int(p), directory)]


def network_fs(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` is on when other hosts may share it (``NETWORK_FILESYSTEMS``,
    ``fuse.*``), else None: the longest mount point above the path in ``mountinfo``."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split()
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # " " is \040
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return None
    return kind if kind in NETWORK_FILESYSTEMS or kind.startswith("fuse.") else None


def _works_in(pid: int, directory: str) -> bool:
    directory = os.path.realpath(directory)
    lock, inside = os.path.join(directory, "lock"), directory + os.sep
    base = f"/proc/{pid}"
    with contextlib.suppress(OSError):
        cwd = os.readlink(f"{base}/cwd")
        if cwd == directory or cwd.startswith(inside):
            return True
    with contextlib.suppress(OSError):
        with open(f"{base}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
        if any(a == directory or inside in a for a in args):
            return True
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"{base}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"{base}/fd/{fd}") == lock:
                    return True
    return False


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _stale(lock: str, directory: str, key: str, value: object, what: str) -> UserError:
    err = UserError(key, value, f"This run needs {what}, which torch compiles on first use, and its build lock "
                    f"{lock} is left from a build that was interrupted (no process on this host holds it or works "
                    f"in {directory}); torch's builder would wait on that file forever.",
                    f"Remove the file (rm {lock}) and run again: the op then compiles once "
                    "(`python -m shardyard.core.op_builds` compiles the shipped engines' ops ahead).")
    # Every rank of this host meets the same file: its local rank 0 alone prints the paragraph (each exits 2).
    return err.on_every_rank() if os.environ.get("LOCAL_RANK", "0") != "0" else err


def _builder(name: str):
    """DeepSpeed's builder ``name`` for the current accelerator (deepspeed.ops.op_builder resolves it), or None."""
    import deepspeed.ops.op_builder as op_builder

    make = getattr(op_builder, name, None)
    return make() if make is not None else None


def _prebuilt(builder) -> bool:
    """Loaded already in this process, or compiled into DeepSpeed's install (DS_BUILD_OPS): no JIT build."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    if builder.name in getattr(builder, "_loaded_ops", {}):
        return True
    return bool(installed_ops.get(builder.name, False)) and accelerator_name == get_accelerator()._name


def _built(directory: str, op: str) -> bool:
    return any(f.startswith(op) and f.endswith(".so") for f in os.listdir(directory))


@contextlib.contextmanager
def _captured() -> Iterator[dict]:
    """Send this process's stdout and stderr (its children's too) to a temporary file; its text is in the
    yielded dict's ``"text"`` afterwards."""
    out: dict = {}
    with tempfile.TemporaryFile("w+") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            log.seek(0)
            out["text"] = log.read()


def prebuild(names: tuple[str, ...] = SETUP_OPS) -> int:
    """Compile ``names`` now (the setup's step), quietly: one line for the lot, one per op skipped or failed.

    1. DeepSpeed's and the compiler's output goes to a log, shown only when a build fails.
    2. A stale lock is removed here: this is the build it belongs to, and setup must stay re-runnable.
    3. An op that fails to build is left for its first use, which reports the error in the run that needs it
       (a CUDA machine without nvcc, say): the setup goes on. Returns the number that failed.
    """
    ready, failed, start = [], 0, time.time()
    venv_build_root()
    for name in names:
        with _captured():  # importing DeepSpeed and probing for libaio print
            builder = _builder(name)
            usable = builder is not None and (_prebuilt(builder) or builder.is_compatible(verbose=False))
        op = builder.name if builder is not None else name
        if not usable:
            why = getattr(builder, "error_log", None) or "not available for this accelerator"
            print(f"[ops] {op} skipped: {why} (the engines that need it say what to install)", flush=True)
            continue
        if not _prebuilt(builder):
            directory = build_dir(op)
            try:
                wait_for_lock(directory, "setup", name, what=f"DeepSpeed's {op} op")
            except UserError:  # 2.
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, "lock"))
                print(f"[ops] removed {directory}/lock, left by an interrupted build of {op}", flush=True)
            with _captured() as log:
                try:
                    builder.load(verbose=False)
                    error = None
                except Exception as e:  # 3.
                    error = f"{type(e).__name__}: {e}"
            if error is not None:
                failed += 1
                print(f"{log['text'][-3000:]}\n[ops] {op} failed to build ({error.splitlines()[0][:300]}); it is "
                      "compiled again on first use", file=sys.stderr, flush=True)
                continue
        ready.append(op)
    if ready:
        print(f"[ops] DeepSpeed ops ready: {', '.join(ready)} ({time.time() - start:.0f} s)", flush=True)
    return failed


if __name__ == "__main__":
    prebuild(tuple(sys.argv[1:]) or SETUP_OPS)
