"""``train.deterministic``: what the GPU tier runs every engine under (tests/gpu), proven here on CPU where it can
be: a 2-rank ddp run with it equals itself bit for bit, and its workers had the deterministic switches (torch's
deterministic algorithms, cuDNN's) and the environment the launcher must hand them before CUDA starts
(``CUBLAS_WORKSPACE_CONFIG``, ``NCCL_ALGO``, ``NCCL_PROTO``, ``HOROVOD_FUSION_THRESHOLD``), read back from each run's summary.json, which the
rank-0 worker writes. A run without it has none of them (the default stays as fast as before)."""

import json

from conftest import TINY, train_py

RUN = [*TINY, "train.steps=3", "train.eval_every_n_steps=0", "train.global_batch_size=8", "backend=ddp",
       "launch.nproc_per_node=2"]
ENV_KEYS = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "HOROVOD_FUSION_THRESHOLD")


def run(tmp_path, name, *extra):
    proc = train_py(*RUN, *extra, run_dir=tmp_path / name)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.load(open(tmp_path / name / "summary.json"))


def test_a_deterministic_run_equals_itself_and_its_workers_have_the_switches(tmp_path, monkeypatch):
    for key in ENV_KEYS:  # what the switch sets: unset before it
        monkeypatch.delenv(key, raising=False)
    a = run(tmp_path, "a", "train.deterministic=true")
    b = run(tmp_path, "b", "train.deterministic=true")
    assert a["world_size"] == 2
    for key in ("train_losses", "grad_norms"):
        assert a[key] == b[key], key  # bit for bit
    assert a["deterministic"] == {"algorithms": True, "cudnn": True, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                  "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "HOROVOD_FUSION_THRESHOLD": "0"}, \
        a["deterministic"]
    off = run(tmp_path, "off")
    assert off["deterministic"] == {"algorithms": False, "cudnn": False, **dict.fromkeys(ENV_KEYS)}, off["deterministic"]
    assert off["train_losses"] == a["train_losses"]  # on CPU the kernels were deterministic already


def test_the_next_job_of_an_in_process_sweep_gets_its_own_setting(monkeypatch):
    """A sweep's jobs share the parent process: a job without the switch takes back what an earlier one set (and
    leaves what the user set)."""
    import os

    from shardyard.dist_env import deterministic_env

    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_PROTO", "LL128")  # the user's own
    deterministic_env(True)
    assert [os.environ.get(k) for k in ENV_KEYS] == [":4096:8", "Ring", "LL128", "0"]
    deterministic_env(False)
    assert [os.environ.get(k) for k in ENV_KEYS] == [None, None, "LL128", None]
