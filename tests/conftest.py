import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# The CPU tiers (unit, dist, e2e, cluster) are CPU tests on every machine. With `backend.device=auto` their runs
# would land on a GPU machine's GPUs: two workers refused on one GPU, nccl for gloo, CUDA memory metrics for RSS,
# GPU kernels where the tests compare bit for bit. So the session hides the GPUs, from itself and from every
# process it starts (set here, before anything in this process can initialise CUDA; bitsandbytes' import does),
# and the GPU tier (tests/gpu) hands them back to its own runs only: `use_gpus`, `gpu_env`, `gpu_count`.
# Launchers that set CUDA_VISIBLE_DEVICES themselves (DeepSpeed's) or log in over ssh (which does not carry it)
# are given `backend.device=cpu` (and DeepSpeed's CPU accelerator) by the tests that use them.
REAL_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from shardyard.testing import TINY, run_python  # noqa: E402,F401  (TINY is re-exported to the tests)


def train_py(*overrides: str, run_dir: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py`` as a user would, in its own run dir: forked from a server that has imported torch
    and transformers once (``shardyard.testing.run_python``), or a cold interpreter with SHARDYARD_TEST_COLD=1."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_python([str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides], str(ROOT), full_env, timeout)


def gpu_env() -> dict:
    """This session's environment with the machine's own CUDA_VISIBLE_DEVICES: what the GPU tier's runs see."""
    env = dict(os.environ)
    if REAL_CUDA_VISIBLE_DEVICES is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = REAL_CUDA_VISIBLE_DEVICES
    return env


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """The GPUs the GPU tier's runs see, counted by a fresh interpreter (this process keeps CUDA hidden and
    uninitialised); 0 at once with a CPU build of torch."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return 0
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=gpu_env(),
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.split()
    return int(lines[-1]) if proc.returncode == 0 and lines else 0


def use_gpus(monkeypatch) -> None:
    """For the GPU tier: its runs see the GPUs again, and each ``python train.py`` is a fresh interpreter (the
    fork server started with the GPUs hidden, and a CUDA context must never exist before a fork)."""
    if REAL_CUDA_VISIBLE_DEVICES is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", REAL_CUDA_VISIBLE_DEVICES)
    monkeypatch.setenv("SHARDYARD_TEST_COLD", "1")


def pytest_report_header(config):
    n = gpu_count()
    if n == 0:
        return "GPU tier: no CUDA device (tests/gpu skip); the other tiers run on CPU"
    return (f"GPU tier: {n} visible GPU(s), every engine runs at world {n}"
            + (" (FSDP and ZeRO shard over that one rank)" if n == 1 else "")
            + "; the other tiers run on CPU (CUDA_VISIBLE_DEVICES hidden)")


CLUSTER_STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8",
                 "backend.device=cpu"]
"""The cluster tier's recipe: 5 steps of the tiny model at a global batch of 8, on CPU (``backend.device=cpu``:
workers started over ssh, by DeepSpeed's launcher or by Slurm may see a GPU machine's GPUs). Every cluster run of
an engine (namespace hosts, Slurm) must match the 1-host run of it."""


@pytest.fixture(scope="session")
def one_host(tmp_path_factory):
    """The single-host 2-worker run of an engine on CLUSTER_STEPS (plus any overrides), made once per session
    on first use: ``one_host("ddp")`` or ``one_host("ddp", "train.steps=40")`` -> its train losses."""
    import json

    runs: dict = {}

    def get(engine, *extra):
        if (engine, extra) not in runs:
            d = tmp_path_factory.mktemp(f"one-{engine}")
            proc = train_py(*CLUSTER_STEPS, f"backend={engine}", *extra, "launch.nproc_per_node=2", run_dir=d)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            runs[engine, extra] = [v for _, v in json.load(open(d / "summary.json"))["train_losses"]]
        return runs[engine, extra]
    return get


# CI cannot pass by skipping: a test outside the GPU tier (tests/gpu, marker `gpu`) that skips fails the
# session, after a list of them and why. Every requirement of those tests is installed by `make test`
# (scripts/cluster_deps.sh as root, scripts/setup.sh), so a skip means a tier silently did not run.
# SHARDYARD_ALLOW_SKIPS=1 lets a developer without root (or with SHARDYARD_SKIP_HOROVOD=1) pass anyway.
_SKIPPED: list[tuple[str, str]] = []


def _gpu_tier(report) -> bool:
    return report.nodeid.startswith("tests/gpu/") or "gpu" in getattr(report, "keywords", {})


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and not _gpu_tier(report):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason))


def pytest_collectreport(report):  # a module-level skip (pytest.importorskip at import) skips at collection
    if report.skipped and not _gpu_tier(report):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason))


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED and exitstatus == 0 and os.environ.get("SHARDYARD_ALLOW_SKIPS") != "1":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _SKIPPED:
        return
    allowed = os.environ.get("SHARDYARD_ALLOW_SKIPS") == "1"
    terminalreporter.section("skipped outside the GPU tier" + (" (allowed: SHARDYARD_ALLOW_SKIPS=1)" if allowed
                                                                else ": the session fails"), sep="=", red=not allowed)
    for nodeid, reason in _SKIPPED:
        terminalreporter.line(f"{nodeid}: {reason}")
    if not allowed:
        terminalreporter.line("Each needs what `make test` installs (as root). Install it, or set "
                              "SHARDYARD_ALLOW_SKIPS=1 to let this machine pass without it.")
