"""The GPU tier cannot pass by skipping (issue 42): pytest on tests/gpu in a subprocess, with the NVIDIA driver
faked (``SHARDYARD_TEST_DRIVER_GPUS``, or an ``nvidia-smi`` on PATH) while torch, a CPU build here, counts no GPU.
A driver that lists GPUs torch cannot use fails the tier with the reason, at setup, before any training; no driver
skips it with "no GPU on this machine"; any other skip reason under the ``gpu`` marker fails the session, a named
capability does not. Each run only collects tests/gpu and sets up its fixtures: about 3 s."""

import os
import subprocess
import sys
import textwrap

from conftest import ROOT

HERE = ROOT / "tests"


def pytest_run(*args: str, env: dict | None = None, cwd=ROOT) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("SHARDYARD_TEST_DRIVER_GPUS", "SHARDYARD_ALLOW_SKIPS", "PYTEST_ADDOPTS")}
    full.update(env or {})  # CUDA_VISIBLE_DEVICES stays "" (this session's): on a GPU machine torch sees none too
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)


def assert_fails_with_the_reason(proc: subprocess.CompletedProcess, how: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "torch cannot use them" in out and how in out, out[-3000:]  # here: "torch 2.x+cpu is a CPU build"
    assert " passed" not in out and " skipped" not in out, out[-3000:]  # nothing ran, nothing skipped


def test_a_driver_gpu_that_torch_cannot_use_fails_the_tier_with_the_reason():
    proc = pytest_run("tests/gpu", env={"SHARDYARD_TEST_DRIVER_GPUS": "1"})
    assert_fails_with_the_reason(proc, "the driver reports 1 GPU(s) (SHARDYARD_TEST_DRIVER_GPUS=1)")


def test_an_nvidia_smi_that_lists_a_gpu_is_the_driver(tmp_path):
    """The real probe's first source: ``nvidia-smi -L`` on PATH (here a script printing one GPU)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)
    proc = pytest_run("tests/gpu", "-k", "bitwise or plan_holds", env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert_fails_with_the_reason(proc, "nvidia-smi -L lists 1")


def test_no_driver_gpu_skips_the_tier_with_no_gpu_on_this_machine(tmp_path):
    proc = pytest_run("tests/gpu", env={"SHARDYARD_TEST_DRIVER_GPUS": "0"})
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "skipped in the GPU tier" in out and "skipped, allowed: no GPU on this machine" in out, out[-3000:]
    assert " passed" not in out and "failed" not in out, out[-3000:]


def test_a_gpu_tier_skip_for_another_reason_fails_the_session(tmp_path):
    """Only "no GPU on this machine" and ``capability(...)`` are allowed under the ``gpu`` marker (listed either
    way); "needs CUDA" (the old reason, which a broken CUDA also gave) fails the session, whatever
    SHARDYARD_ALLOW_SKIPS says. tests/conftest.py is loaded as a plugin for a test file outside tests/."""
    (tmp_path / "test_skips.py").write_text(textwrap.dedent("""
        import pytest
        from conftest import NO_GPU, capability

        pytestmark = pytest.mark.gpu

        def test_machine():
            pytest.skip(NO_GPU)

        def test_capability():
            pytest.skip(capability("float8 matmuls need compute capability 8.9+"))

        def test_other():
            pytest.skip("needs CUDA")
    """))
    env = {"PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}", "SHARDYARD_ALLOW_SKIPS": "1"}
    proc = pytest_run("-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py"), env=env,
                      cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1 and "3 skipped" in out, out[-3000:]
    assert "skipped in the GPU tier: the session fails" in out, out[-3000:]
    assert "1 skipped, allowed: no GPU on this machine" in out, out[-3000:]
    assert "1 skipped, allowed: capability: float8 matmuls need compute capability 8.9+" in out, out[-3000:]
    assert "1 skipped, NOT allowed" in out and "needs CUDA" in out and "test_skips.py::test_other" in out, out[-3000:]
    (tmp_path / "test_skips.py").write_text(
        (tmp_path / "test_skips.py").read_text().replace('pytest.skip("needs CUDA")', "pass"))
    proc = pytest_run("-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py"), env=env,
                      cwd=tmp_path)
    assert proc.returncode == 0 and "1 passed, 2 skipped" in proc.stdout, proc.stdout[-3000:]
