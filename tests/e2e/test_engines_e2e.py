"""Sharded engines through ``python train.py``: launch, generated DeepSpeed config, and user errors."""

import json

import pytest

from conftest import TINY, train_py
from shardyard.testing import compose, hf_eval_loss

FAST = [*TINY, "train.steps=3", "train.eval_every_n_steps=0", "checkpoint.save_final=true"]


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_sharded_engine_trains_and_exports_through_train_py(engine, tmp_path):
    proc = train_py(*FAST, f"backend={engine}", "launch.nproc_per_node=2", "backend.dump_config=true"
                    if engine == "zero3" else "backend.reshard_after_forward=true", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The export loads with AutoModelForCausalLM and holds the trained weights: it scores the eval set as the run
    # did at its last step (a parameter count passes weights filled in at random, or untrained ones).
    engine_loss = json.load(open(tmp_path / "summary.json"))["eval_losses"][-1][1]
    got = hf_eval_loss(str(tmp_path / "hf"), compose([*FAST, f"backend={engine}"], str(tmp_path)), 2)
    assert abs(got - engine_loss) <= 1e-4 * engine_loss, (got, engine_loss)
    if engine == "zero3":
        generated = json.load(open(tmp_path / "deepspeed_config.json"))
        assert "generated DeepSpeed config" in proc.stdout
        assert generated["zero_optimization"]["stage"] == 3
        assert generated["train_batch_size"] == 8 and generated["train_micro_batch_size_per_gpu"] == 4
        assert "auto" not in json.dumps(generated)


# DeepSpeed's own launcher starting train.py is tests/cluster/test_multinode.py's
# test_deepspeed_hostfile_across_hosts_trains_as_one_host: `deepspeed --hostfile` on two namespace hosts, each node's
# `deepspeed.launcher.launch` handing train.py its --local_rank and environment as the one-node launcher does (world
# size 2, the single-host run's losses); a one-node copy of it here cost a cold DeepSpeed start of three processes.


def test_a_bad_engine_combination_exits_2(tmp_path):
    """Engine checks run in the parent before any worker (the other combinations: tests/unit/test_config.py)."""
    proc = train_py("backend=zero2", "precision=fp16", run_dir=tmp_path, timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "no fp16 support" in proc.stderr and "Traceback" not in proc.stderr


def test_zero_infinity_without_async_io_says_so(tmp_path, monkeypatch):
    """`make test` installs libaio, so its absence is simulated: DeepSpeed's own probe answers no. The check
    runs in the parent's validation (here in-process), before any worker starts."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from shardyard.planning.validate import validate
    from shardyard.core.errors import UserError
    from shardyard.testing import compose

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    swap = tmp_path / "swap"
    swap.mkdir()
    with pytest.raises(UserError) as e:
        validate(compose(["backend=zero_infinity", f"backend.nvme_path={swap}"]), None)
    assert e.value.key == "backend" and "libaio" in e.value.problem and "apt-get install libaio-dev" in e.value.fix


# Horovod through train.py with its timeline: tests/dist/test_horovod.py (one run with its accumulation and resume).


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
