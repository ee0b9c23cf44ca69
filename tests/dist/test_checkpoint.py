"""Checkpoints on every engine: a run resumed from step 3 reproduces the uninterrupted run's losses at steps
4-6 bit for bit (fp32, CPU); DDP and FSDP checkpoints resume at other world sizes through DCP resharding."""

import json
import os

import pytest

from conftest import TINY, train_py
from shardyard.testing import run_many

STEPS = [*TINY, "train.steps=6", "train.eval_every_n_steps=0", "train.global_batch_size=8"]


def losses(r):
    return [loss for _, loss in r["summary"]["train_losses"]]


@pytest.mark.parametrize("engine,world", [("single", 1), ("ddp", 2), ("fsdp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2)])
def test_resume_is_bitwise_exact(engine, world, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    full, resumed = run_many(world, [
        ([*STEPS, f"backend={engine}", "checkpoint.every_n_steps=3"], str(a)),
        ([*STEPS, f"backend={engine}", f"checkpoint.resume={a}/checkpoints/step-00000003"], str(b)),
    ])
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step-00000003", "step-00000006"]
    meta = json.load(open(a / "checkpoints/step-00000003/meta.json"))
    assert meta["step"] == 3 and meta["world_size"] == world and len(meta["rng"]) == world
    assert meta["data"] == {"epoch": 0, "step_in_epoch": 3, "samples_seen": 24}
    assert losses(resumed[0])[:1] and [s for s, _ in resumed[0]["summary"]["train_losses"]] == [4, 5, 6]
    assert losses(resumed[0]) == losses(full[0])[3:]  # bit for bit


def test_horovod_resume_is_bitwise_exact(tmp_path):
    pytest.importorskip("horovod.torch")
    hv = [*STEPS, "backend=horovod", "launch.nproc_per_node=2"]
    pa = train_py(*hv, "checkpoint.every_n_steps=3", run_dir=tmp_path / "a")
    assert pa.returncode == 0, pa.stderr[-2000:]
    pb = train_py(*hv, f"checkpoint.resume={tmp_path}/a/checkpoints/step-00000003", run_dir=tmp_path / "b")
    assert pb.returncode == 0, pb.stderr[-2000:]
    la = [x for _, x in json.load(open(tmp_path / "a/summary.json"))["train_losses"]]
    lb = [x for _, x in json.load(open(tmp_path / "b/summary.json"))["train_losses"]]
    assert lb == la[3:]


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_world_size_2_to_4_to_1(engine, tmp_path):
    # Every segment has the same recipe (train.steps=6, global batch 8); only the world size changes.
    ref = run_many(2, [([*STEPS, f"backend={engine}", "checkpoint.every_n_steps=2"], str(tmp_path / "w2"))])[0]
    w4 = run_many(4, [([*STEPS, f"backend={engine}", "train.micro_batch_size=2", "checkpoint.every_n_steps=2",
                        f"checkpoint.resume={tmp_path}/w2/checkpoints/step-00000002"], str(tmp_path / "w4"))])[0]
    w1 = run_many(1, [([*STEPS, f"backend={engine}",  # 1 rank: micro 4 x accumulation 2
                        f"checkpoint.resume={tmp_path}/w4/checkpoints/step-00000004"], str(tmp_path / "w1"))])[0]
    got = losses(w4[0])[:2] + losses(w1[0])  # steps 3-4 at world 4, steps 5-6 at world 1
    want = losses(ref[0])[2:]
    assert len(got) == 4
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-4, (got, want)


@pytest.mark.parametrize("stages", [("zero1", "zero2", "zero1"), ("zero3", "zero3", "zero3")])
def test_deepspeed_world_size_2_to_4_to_1_through_universal_checkpoints(stages, tmp_path):
    # ZeRO partitions are per rank: each resume at another world size converts the checkpoint with
    # DeepSpeed's ds_to_universal (by itself) and loads that. Stages 1 and 2 read each other's checkpoints.
    s2, s4, s1 = stages
    ref = run_many(2, [([*STEPS, f"backend={s2}", "checkpoint.every_n_steps=2"], str(tmp_path / "w2"))])[0]
    w4 = run_many(4, [([*STEPS, f"backend={s4}", "train.micro_batch_size=2", "checkpoint.every_n_steps=2",
                        f"checkpoint.resume={tmp_path}/w2/checkpoints/step-00000002"], str(tmp_path / "w4"))])[0]
    w1 = run_many(1, [([*STEPS, f"backend={s1}", f"checkpoint.resume={tmp_path}/w4/checkpoints/step-00000004"],
                       str(tmp_path / "w1"))])[0]
    assert os.listdir(tmp_path / "w4/universal") == []  # converted there, and removed once loaded
    assert json.load(open(tmp_path / "w4/checkpoints/step-00000004/meta.json"))["training_state"]["zero_stage"] == int(s4[-1])
    got = losses(w4[0])[:2] + losses(w1[0])  # steps 3-4 at world 4, steps 5-6 at world 1
    want = losses(ref[0])[2:]
    assert len(got) == 4
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-4, (got, want)


def test_deepspeed_stage_3_to_2_is_refused_with_the_supported_pairs(tmp_path):
    run_many(2, [([*STEPS, "backend=zero3", "train.steps=2", "checkpoint.every_n_steps=2"], str(tmp_path / "a"))])
    proc = train_py(*STEPS, "backend=zero2", "launch.nproc_per_node=1",
                    f"checkpoint.resume={tmp_path}/a/checkpoints/step-00000002", run_dir=tmp_path / "b")
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert "holds ZeRO-3 partitions and this run is ZeRO-2" in err
    assert "any world size within ZeRO-1/2" in err and "backend=zero3" in err
    assert "Traceback" not in err
