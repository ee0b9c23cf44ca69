"""kill -9 during training and during a save, and elastic restarts: nothing half-written ever looks complete,
and ``checkpoint.resume=auto`` (or the agent's restart) continues from the newest complete checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import ROOT, TINY, train_py
from shardyard.checkpoint import verify

RUN = [*TINY, "train.eval_every_n_steps=0", "train.global_batch_size=8", "launch.nproc_per_node=2",
       "checkpoint.every_n_steps=2", "train.log_every_n_steps=1"]


def start(run_dir, *extra, env=None):
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *RUN, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)


def wait_for(path, proc, timeout=300):
    t = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t < timeout, f"{path} never appeared"
        time.sleep(0.2)


def workers(proc):
    """The worker processes of a `python train.py` job: on CPU they fork from it (same command line)."""
    parent = psutil.Process(proc.pid)
    return [c for c in parent.children(recursive=True)
            if "shardyard.worker" in " ".join(c.cmdline()) or c.cmdline() == parent.cmdline()]


def test_kill_9_a_worker_then_resume_auto(tmp_path):
    proc = start(tmp_path, "train.steps=400")
    wait_for(tmp_path / "checkpoints/step-00000002/meta.json", proc)
    t = time.time()
    workers(proc)[-1].send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "failed" in err and "rank" in err  # the survivor did not hang
    assert time.time() - t < 60
    done = sorted(p for p in os.listdir(tmp_path / "checkpoints") if p.startswith("step-"))
    assert done and all(verify(str(tmp_path / "checkpoints" / d)) is None for d in done)
    last = int(done[-1].split("-")[1])
    proc2 = train_py(*RUN, "train.steps=%d" % (last + 2), "checkpoint.resume=auto", run_dir=tmp_path)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert f"resumed from {tmp_path}/checkpoints/{done[-1]}" in proc2.stdout


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    proc = start(tmp_path, "train.steps=400", env={"SHARDYARD_TEST_PAUSE_IN_SAVE": "60@4"})
    wait_for(tmp_path / "checkpoints/.tmp-step-00000004", proc)
    time.sleep(2)  # the engine files of step 4 are being written / written, meta.json is not
    for p in [*workers(proc), psutil.Process(proc.pid)]:  # the whole job, as a node failure would
        p.send_signal(signal.SIGKILL)
    proc.communicate()
    ck = tmp_path / "checkpoints"
    assert open(ck / "latest").read().strip() == "step-00000002"
    assert not (ck / "step-00000004").exists() and verify(str(ck / ".tmp-step-00000004")) is not None
    proc2 = train_py(*RUN, "train.steps=5", "checkpoint.resume=auto", run_dir=tmp_path)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert "resumed from" in proc2.stdout and "step-00000002" in proc2.stdout
    assert sorted(p for p in os.listdir(ck) if p.startswith("step-")) == ["step-00000002", "step-00000004"]


def test_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path):
    proc = train_py(*RUN, "train.steps=4", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    newest = tmp_path / "checkpoints/step-00000004"
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.name != "meta.json"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    bad = train_py(*RUN, "train.steps=5", f"checkpoint.resume={newest}", run_dir=tmp_path / "x")
    assert bad.returncode == 2 and "truncated or corrupt" in bad.stderr  # named explicitly: refused
    proc = train_py(*RUN, "train.steps=5", "checkpoint.resume=auto", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "truncated or corrupt" in proc.stderr and "step-00000002" in proc.stdout  # auto: falls back


def test_max_restarts_survives_a_crash_with_the_clean_final_loss(tmp_path):
    clean = train_py(*RUN, "train.steps=6", run_dir=tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-2000:]
    crashed = train_py(*RUN, "train.steps=6", "launch.max_restarts=1", run_dir=tmp_path / "crash",
                       env={"SHARDYARD_TEST_CRASH_AT_STEP": "4:1"})
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "rank 1 dies after step 4" in crashed.stderr and "resumed from" in crashed.stdout
    final = [json.load(open(tmp_path / d / "summary.json"))["final_train_loss"] for d in ("clean", "crash")]
    assert final[0] == final[1]


def test_changed_model_is_refused_naming_the_keys(tmp_path):
    proc = train_py(*RUN, "train.steps=2", run_dir=tmp_path / "a")
    assert proc.returncode == 0
    bad = train_py(*RUN, "train.steps=3", "model.num_layers=3",
                   f"checkpoint.resume={tmp_path}/a/checkpoints/step-00000002", run_dir=tmp_path / "b")
    text = " ".join(bad.stderr.split())
    assert bad.returncode == 2 and "parameter(s) of this model are not in it (model.layers.2." in text, text
