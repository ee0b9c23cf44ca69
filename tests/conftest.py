import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardyard.testing import TINY, run_python  # noqa: E402,F401  (TINY is re-exported to the tests)


def train_py(*overrides: str, run_dir: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py`` as a user would, in its own run dir: forked from a server that has imported torch
    and transformers once (``shardyard.testing.run_python``), or a cold interpreter with SHARDYARD_TEST_COLD=1."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_python([str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides], str(ROOT), full_env, timeout)




CLUSTER_STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8"]
"""The cluster tier's recipe: 5 steps of the tiny model at a global batch of 8. Every cluster run of an
engine (namespace hosts, Slurm) must match the 1-host run of it."""


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
