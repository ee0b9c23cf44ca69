"""``train.deterministic``: what the GPU tier runs every engine under (tests/gpu), proven here on CPU where it can
be: a 2-rank ddp run with it equals itself bit for bit, and its workers had the deterministic switches (torch's
deterministic algorithms, cuDNN's) and the environment the launcher must hand them before CUDA starts
(``CUBLAS_WORKSPACE_CONFIG``, ``NCCL_ALGO``, ``NCCL_PROTO``, ``HOROVOD_FUSION_THRESHOLD``), read back from each run's summary.json, which the
rank-0 worker writes. A run without it has none of them (the default stays as fast as before)."""

import json
import os

from conftest import TINY, train_py

RUN = [*TINY, "train.steps=3", "train.eval_every_n_steps=0", "train.global_batch_size=8", "backend=ddp",
       "launch.nproc_per_node=2"]
ENV_KEYS = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "HOROVOD_FUSION_THRESHOLD")


def run(tmp_path, name, *extra):
    proc = train_py(*RUN, *extra, run_dir=tmp_path / name)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.load(open(tmp_path / name / "summary.json"))


def test_a_deterministic_run_equals_itself_and_its_workers_have_the_switches(tmp_path, monkeypatch):
    """Also the preemption drill, against the uninterrupted run without the switch ("off"): the same run, sent
    SIGUSR1 in step 2 (``SHARDYARD_TEST_SIGNAL_AT_STEP``: rank 1 signals ``python train.py``, whose elastic agent
    passes it to both workers), stops after step 2 on both ranks with that step's checkpoint and exits 75;
    ``checkpoint.resume=auto`` resumes from step 2 and ends with every step's loss and gradient norm bit for bit
    those of the uninterrupted run."""
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
    stopped = train_py(*RUN, run_dir=tmp_path / "preempted", env={"SHARDYARD_TEST_SIGNAL_AT_STEP": "2:1=USR1"})
    assert stopped.returncode == 75, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    ck = tmp_path / "preempted/checkpoints"
    assert f"preempted (SIGUSR1) after step 2: its checkpoint is published ({ck}/step-00000002)" in stopped.stdout
    assert sorted(os.listdir(ck)) == ["latest", "step-00000002"] and not (tmp_path / "preempted/summary.json").exists()
    resumed = train_py(*RUN, "checkpoint.resume=auto", run_dir=tmp_path / "preempted")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck}/step-00000002 (step 2" in resumed.stdout, resumed.stdout[-2000:]
    again = json.load(open(tmp_path / "preempted/summary.json"))
    assert len(again["step_wall_s"]) == 1  # step 3 trained here, steps 1-2 before the signal
    for key in ("train_losses", "grad_norms"):
        assert again[key] == off[key], key  # bit for bit


def test_the_next_job_of_an_in_process_sweep_gets_its_own_setting(monkeypatch):
    """A sweep's jobs share the parent process: a job without the switch takes back what an earlier one set (and
    leaves what the user set)."""
    import os

    from shardyard.core.dist_env import deterministic_env

    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_PROTO", "LL128")  # the user's own
    deterministic_env(True)
    assert [os.environ.get(k) for k in ENV_KEYS] == [":4096:8", "Ring", "LL128", "0"]
    deterministic_env(False)
    assert [os.environ.get(k) for k in ENV_KEYS] == [None, None, "LL128", None]
