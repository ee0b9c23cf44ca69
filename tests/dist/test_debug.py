"""debug.nan_policy on real engines: a gradient poisoned with NaN on one rank at step 3 (a tensor hook,
``SHARDYARD_TEST_POISON_GRAD``) stops the run naming step and parameter, or is skipped leaving the
parameters exactly as the step before left them."""

import os

import pytest
import torch

from conftest import TINY, train_py
from shardyard.testing import run_many

PARAM = "model.layers.1.mlp.up_proj.weight"
BASE = [*TINY, "train.eval_every_n_steps=0", "sched=constant", "sched.warmup_steps=0", "train.global_batch_size=8"]


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_nan_policy_stop_names_step_rank_and_parameter(engine, tmp_path):
    proc = train_py(*BASE, f"backend={engine}", "launch.nproc_per_node=2", "train.steps=5",
                    "checkpoint.every_n_steps=2", run_dir=tmp_path,
                    env={"SHARDYARD_TEST_POISON_GRAD": f"3:1:{PARAM}"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "debug.nan_policy" in err and "at step 3" in err and PARAM in err, err[-2000:]
    if engine == "zero3":  # DeepSpeed's hooks see each rank's own gradient before the reduction
        assert f"{PARAM} (rank 1)" in err
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["OWNER", "latest", "step-00000002"]  # nothing after the NaN


@pytest.mark.parametrize("engine", ["ddp", "zero2", "fsdp"])  # fsdp: the drill reaches FSDP2's unsharded parameters
def test_nan_policy_skip_leaves_the_parameters_of_the_step_before(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDYARD_TEST_POISON_GRAD", f"3:1:{PARAM}")
    skipped, clean = run_many(2, [
        ([*BASE, f"backend={engine}", "train.steps=3", "debug.nan_policy=skip"], str(tmp_path / "skip")),
        ([*BASE, f"backend={engine}", "train.steps=2"], str(tmp_path / "clean")),  # never reaches step 3
    ])
    summary = skipped[0]["summary"]
    assert summary["skipped_steps"] == 1
    for k, v in clean[0]["full"].items():
        assert torch.equal(skipped[0]["full"][k], v), k  # step 3 changed nothing
    assert [s for s, _ in summary["train_losses"]] == [1, 2, 3]


def test_nan_policy_skip_stops_after_max_skipped_in_a_row(tmp_path):
    proc = train_py(*BASE, "backend=single", "train.steps=4", "debug.nan_policy=skip", "debug.max_skipped=1",
                    run_dir=tmp_path, env={"SHARDYARD_TEST_POISON_GRAD": f"2:0:{PARAM}"})
    assert proc.returncode == 2 and "debug.max_skipped" in proc.stderr and "Traceback" not in proc.stderr
