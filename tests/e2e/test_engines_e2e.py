"""Sharded engines through ``python train.py``: launch, generated DeepSpeed config, and user errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, train_py

FAST = [*TINY, "train.steps=3", "train.eval_every_n_steps=0", "checkpoint.save_final=true"]


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_sharded_engine_trains_and_exports_through_train_py(engine, tmp_path):
    proc = train_py(*FAST, f"backend={engine}", "launch.nproc_per_node=2", "backend.dump_config=true"
                    if engine == "zero3" else "backend.reshard_after_forward=true", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) == json.load(open(tmp_path / "summary.json"))["params"]
    if engine == "zero3":
        generated = json.load(open(tmp_path / "deepspeed_config.json"))
        assert "generated DeepSpeed config" in proc.stdout
        assert generated["zero_optimization"]["stage"] == 3
        assert generated["train_batch_size"] == 8 and generated["train_micro_batch_size_per_gpu"] == 4
        assert "auto" not in json.dumps(generated)


def test_deepspeed_launcher_starts_train_py(tmp_path):
    if shutil.which("deepspeed") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "deepspeed")):
        pytest.skip("deepspeed launcher not installed")
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    from shardyard.launch import free_port

    # A free rendezvous port: the launcher's default 29500 may still be held by an earlier job's sockets.
    cmd = [launcher, "--num_nodes=1", "--num_gpus=2", "--no_ssh_check", f"--master_port={free_port()}", "train.py",
           "backend=zero2",
           f"hydra.run.dir={tmp_path}", *FAST]
    # The venv's bin goes last: first, its ninja would differ from the one every other run builds DeepSpeed's
    # ops with, and torch would rebuild them (about 100 s each time the ninja changes).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"] + ":" + os.path.dirname(sys.executable)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.load(open(tmp_path / "summary.json"))["world_size"] == 2


def test_a_bad_engine_combination_exits_2(tmp_path):
    """Engine checks run in the parent before any worker (the other combinations: tests/unit/test_config.py)."""
    proc = train_py("backend=zero2", "precision=fp16", run_dir=tmp_path, timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "no fp16 support" in proc.stderr and "Traceback" not in proc.stderr


def test_zero_infinity_without_async_io_says_so(tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("this machine has libaio; the validation passes")
    swap = tmp_path / "swap"
    swap.mkdir()
    proc = train_py("backend=zero_infinity", f"backend.nvme_path={swap}", run_dir=tmp_path / "run", timeout=180)
    assert proc.returncode == 2 and "libaio" in proc.stderr and "Traceback" not in proc.stderr


def test_horovod_through_train_py_and_horovodrun(tmp_path):
    pytest.importorskip("horovod.torch")
    proc = train_py(*FAST, "backend=horovod", "launch.nproc_per_node=2", "backend.timeline=true", run_dir=tmp_path / "a")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert isinstance(json.load(open(tmp_path / "a" / "horovod_timeline.json")), list)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "hf", local_files_only=True)
    # The user's own horovodrun starts the same train.py.
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py", "backend=horovod",
           f"hydra.run.dir={tmp_path / 'b'}", *FAST]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.load(open(tmp_path / "b" / "summary.json"))["world_size"] == 2


def test_pretrained_export_moves_weights_between_engines(tmp_path):
    """Train with DDP, export; start an FSDP run from the export (weights and tokenizer from the HF dir):
    its step-0 eval equals the DDP run's final eval on the same sequences."""
    a = train_py(*FAST, "backend=ddp", "train.micro_batch_size=4", run_dir=tmp_path / "a")
    assert a.returncode == 0, a.stderr[-2000:]
    hf = tmp_path / "a" / "hf"
    b = train_py(*[o for o in FAST if not o.startswith("model.")], "backend=fsdp", "launch.nproc_per_node=2",
                 "train.micro_batch_size=2",
                 "model=hf", f"model.path={hf}", run_dir=tmp_path / "b")  # its tokenizer too
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
    end_a = json.load(open(tmp_path / "a/summary.json"))["eval_losses"][-1][1]
    start_b = json.load(open(tmp_path / "b/summary.json"))["eval_losses"][0][1]
    assert abs(end_a - start_b) <= 1e-4 * end_a, (end_a, start_b)  # 1 rank x micro 4 == 2 ranks x micro 2
