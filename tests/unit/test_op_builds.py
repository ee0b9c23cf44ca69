"""Issue 41, "No silent waits": torch's JIT build lock left by a killed compile is reported (exit 2, naming the
file), a build another process runs is waited for with a line saying so, and DeepSpeed's ops are named per engine.

The compiles are real: a one-function C++ extension built with ``torch.utils.cpp_extension.load_inline`` into a
temporary ``TORCH_EXTENSIONS_DIR`` (about 25 s on 2 cores), killed mid-compile with every process of its session."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shardyard.core import op_builds
from shardyard.core.errors import UserError

BUILD = textwrap.dedent("""
    import torch.utils.cpp_extension as ext

    tiny = ext.load_inline(name="tiny", cpp_sources="int64_t add_one(int64_t x) { return x + 1; }",
                           functions=["add_one"])
    print("add_one(41) =", tiny.add_one(41), flush=True)
""")


def start_build(extensions: str) -> subprocess.Popen:
    """The tiny extension's JIT build in a process group of its own (ninja and the compiler join it)."""
    return subprocess.Popen([sys.executable, "-c", BUILD], env={**os.environ, "TORCH_EXTENSIONS_DIR": extensions},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_session(sid: int) -> None:
    """SIGKILL every process of the session ``sid`` (a job's time limit): the builder, ninja, and the compilers,
    which ninja starts in process groups of their own (so killing the builder's group alone leaves them running)."""
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(int(pid))
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_a_killed_compile_is_reported_and_once_its_lock_is_removed_the_build_runs(tmp_path, capsys):
    extensions = str(tmp_path / "ext")
    build_dir = os.path.join(extensions, "tiny")
    lock = os.path.join(build_dir, "lock")

    # 1. Kill a build while the compiler runs (ninja's build file written, the compiler working in the directory).
    first = start_build(extensions)
    wait_until(lambda: os.path.exists(os.path.join(build_dir, "build.ninja")), 120, "the build to start")
    wait_until(lambda: any(p != first.pid for p in op_builds.holders(build_dir)), 30, "ninja or the compiler")
    kill_session(first.pid)
    first.wait()
    assert not op_builds.holders(build_dir)
    assert os.path.exists(lock) and not os.path.exists(os.path.join(build_dir, "tiny.so"))

    # 2. That is the bug: torch's next build of the op waits on the file, silently, and compiles nothing.
    stuck = start_build(extensions)
    time.sleep(4)
    assert stuck.poll() is None and not os.path.exists(os.path.join(build_dir, "main.o"))
    kill_session(stuck.pid)
    stuck.wait()
    assert stuck.stdout.read() == ""

    # 3. The check reports it: the key that asked for the op, the file, and the fix.
    with pytest.raises(UserError) as e:
        op_builds.wait_for_lock(build_dir, "backend.offload_optimizer", "cpu", what="the tiny op", poll_s=0.05)
    text = one_line(e.value.paragraph())
    assert text.startswith("shardyard: error in `backend.offload_optimizer` (value: 'cpu')")
    assert "left from a build that was interrupted" in text and f"Remove the file (rm {lock})" in text
    # As a run reports it: the paragraph on stderr, exit 2, no traceback.
    report = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from shardyard.core import op_builds
        from shardyard.core.errors import UserError, report_and_exit
        try:
            op_builds.wait_for_lock({build_dir!r}, "backend.offload_optimizer", "cpu", what="the tiny op")
        except UserError as e:
            report_and_exit(e)
    """)], capture_output=True, text=True, timeout=60)
    assert report.returncode == 2 and "Traceback" not in report.stderr
    assert f"(rm {lock})" in one_line(report.stderr)

    # 4. With the file removed the build runs; a check meanwhile sees a live build: it waits, says so, returns.
    os.remove(lock)
    second = start_build(extensions)
    wait_until(lambda: os.path.exists(lock), 120, "the second build to take the lock")
    op_builds.wait_for_lock(build_dir, "backend.offload_optimizer", "cpu", what="the tiny op", poll_s=0.05)
    lock_at_return = os.path.exists(lock)  # it returns when the build has released its lock, never before
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    assert out.strip() == "add_one(41) = 42" and os.path.exists(os.path.join(build_dir, "tiny.so"))
    assert not lock_at_return and not os.path.exists(lock)
    said = capsys.readouterr().out
    assert said.count("waiting for another build of the tiny op") == 1 and f"holds {lock}" in said


@pytest.mark.parametrize("how", ["cwd", "command line", "open lock"])
def test_a_process_working_in_the_build_dir_is_a_live_build_until_it_dies(how, tmp_path, capsys):
    """A live build is never called stale: a process whose cwd is the build directory (ninja, the compiler), whose
    command line names a file in it (the compiler), or that holds the lock open (torch's builder). When it dies
    with the lock still there, the wait ends in the stale-lock error instead of going on forever."""
    build_dir = tmp_path / "op"
    build_dir.mkdir()
    lock = build_dir / "lock"
    lock.touch()
    sleep = "import os, sys, time; fd = os.open(os.environ['LOCK'], os.O_RDONLY) if os.environ.get('LOCK') else " \
            "None; print('ready', flush=True); time.sleep(120)"
    argv, cwd, env = [sys.executable, "-c", sleep], str(tmp_path), dict(os.environ)
    if how == "cwd":
        cwd = str(build_dir)
    elif how == "command line":
        argv.append(str(build_dir / "main.cpp"))
    else:
        env["LOCK"] = str(lock)  # by the environment: neither its cwd nor its command line names the directory
    worker = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "ready\n"
    assert op_builds.holders(str(build_dir)) == [worker.pid]

    outcome: list = []

    def check():
        try:
            op_builds.wait_for_lock(str(build_dir), "backend", "zero2", what="the op", poll_s=0.05)
            outcome.append("returned")
        except UserError as e:
            outcome.append(e)

    waiter = threading.Thread(target=check)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not outcome  # waiting on a live build
    worker.kill()
    worker.wait()
    waiter.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], UserError) and outcome[0].key == "backend"
    said = capsys.readouterr().out
    assert said.count("waiting for another build of the op") == 1 and f"process {worker.pid} (python" in said


def test_a_lock_on_a_file_system_other_hosts_share_is_never_called_stale(tmp_path):
    """Another node's build is invisible in this host's /proc: on NFS, Lustre, a FUSE mount... the wait goes on
    (with its line) instead of failing. The file system is read from the mount table, longest mount point first."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 259:1 / / rw,relatime - ext4 /dev/root rw\n"
                         "40 22 0:50 / /shared rw,relatime - nfs4 server:/export rw\n"
                         "41 40 0:51 / /shared/fuse rw - fuse.sshfs me@host:/x rw\n"
                         "42 22 259:2 / /shared\\040local rw - ext4 /dev/sdb rw\n"
                         "43 22 259:3 / /sharedlocal rw - xfs /dev/sdc rw\n")
    assert op_builds.network_fs("/shared/torch_extensions/py311_cpu/cpu_adam", str(mountinfo)) == "nfs4"
    assert op_builds.network_fs("/shared/fuse/cpu_adam", str(mountinfo)) == "fuse.sshfs"
    assert op_builds.network_fs("/shared local/cpu_adam", str(mountinfo)) is None
    assert op_builds.network_fs("/sharedlocal/cpu_adam", str(mountinfo)) is None  # not under /shared
    assert op_builds.network_fs("/root/.cache", str(mountinfo)) is None
    assert op_builds.network_fs(str(tmp_path)) is None  # where this suite's stale locks live: a local disk
    op_builds.wait_for_lock(str(tmp_path), "backend", "zero2", what="the op")  # no lock: returns at once


@pytest.mark.parametrize("overrides, needs", [
    (["backend=zero2"], [("FusedAdamBuilder", "backend", "zero2")]),
    (["backend=zero3_offload"], [("CPUAdamBuilder", "backend.offload_optimizer", "cpu")]),
    (["backend=zero_infinity"], [("CPUAdamBuilder", "backend.offload_optimizer", "nvme"),
                                 ("AsyncIOBuilder", "backend.offload_optimizer", "nvme")]),
    (["backend=zero3", "backend.offload_param=nvme"], [("FusedAdamBuilder", "backend", "zero3"),
                                                      ("AsyncIOBuilder", "backend.offload_param", "nvme")]),
    (["backend=zero2", "optim=sgd"], []),
    (["backend=zero2_offload", "optim._target_=deepspeed.ops.adam.DeepSpeedCPUAdam"],
     [("CPUAdamBuilder", "optim._target_", "deepspeed.ops.adam.DeepSpeedCPUAdam")]),
])
def test_each_engine_names_the_ops_deepspeed_compiles_for_it(overrides, needs, tmp_path):
    """DeepSpeed 0.19 loads fused Adam for AdamW on the device, CPU Adam under ZeRO-Offload (and for its own
    CPU Adam class as a client optimizer), async I/O when anything is swapped to NVMe, nothing for torch's SGD."""
    from shardyard.backends.deepspeed import ds_config
    from shardyard.testing import compose
    from shardyard.planning.validate import validate

    cfg = compose([*overrides, f"backend.nvme_path={tmp_path}"])
    config = ds_config(cfg, validate(cfg, None))
    assert op_builds.deepspeed_needs(config, cfg.optim._target_, cfg.backend.name) == needs


def test_importing_it_imports_neither_deepspeed_nor_torch():
    code = "import sys, shardyard.core.op_builds; print(sorted(m for m in ('deepspeed', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_each_install_compiles_its_ops_in_a_root_of_its_own(tmp_path, monkeypatch):
    """torch's default build root is one per user: a developer's checkout and a CI clone on one machine shared each
    op's directory, and each build.ninja names its own torch's and DeepSpeed's include directories, so each
    recompiled the ops the other had built (12 minutes each way here). The engines' check (and the setup's
    prebuild) now put torch's builder in a root of this install's own, under torch's default, keyed by where torch
    and DeepSpeed are installed: a venv reaching this one's packages (tests/e2e/test_project.py's) shares its
    builds. A root the user set is kept."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's default root: $XDG_CACHE_HOME/torch_extensions
    here = op_builds._installed("torch", "deepspeed")
    assert all(os.path.isfile(os.path.join(d, "__init__.py")) for d in here), here
    roots = []
    other = [str(tmp_path / "another-checkout" / ".venv" / "site-packages" / p) for p in ("torch", "deepspeed")]
    assert other != here  # (a fixed path here once named CI's own checkout: the two installs were one)
    for installs in (here, other, here):
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(op_builds, "_installed", lambda *packages, installs=installs: installs)
        op_builds.check_deepspeed_ops([])  # what the DeepSpeed engine calls before deepspeed.initialize
        roots.append(os.environ["TORCH_EXTENSIONS_DIR"])
        assert op_builds.build_dir("cpu_adam") == os.path.join(roots[-1], "cpu_adam")
    assert roots[0] == roots[2] != roots[1]  # one root per install, the same one every time
    for root in roots:
        assert os.path.dirname(root) == get_default_build_root() == str(tmp_path / "torch_extensions")
        assert os.path.basename(root).startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert op_builds.venv_build_root() == str(tmp_path / "mine") == os.environ["TORCH_EXTENSIONS_DIR"]
