"""Big-model construction paths (meta device, ``deepspeed.zero.Init``) train correctly; an HF export beside each
checkpoint scores the eval set as the engine did at that step. (Every engine's final export: test_engines.py.)"""

import math

import pytest

from shardyard.testing import TINY, compose, hf_eval_loss, run_many

RUN = [*TINY, "train.steps=3", "train.eval_every_n_steps=0", "train.global_batch_size=8", "checkpoint.save_final=true"]


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_big_model_construction_path(engine, tmp_path):
    """init_device=meta forces the path big models take: FSDP shards on meta then materialises each rank's
    shards; ZeRO-3 builds under deepspeed.zero.Init. Both must start from a sane init and learn."""
    ranks = run_many(2, [([*TINY, f"backend={engine}", "model.init_device=meta", "train.steps=8", "optim.lr=3e-3",
                           "train.eval_every_n_steps=0"], str(tmp_path))])[0]
    s = ranks[0]["summary"]
    first = s["eval_losses"][0][1]
    assert abs(first - math.log(4096)) < 0.3, first  # a proper small-std init predicts ~uniformly
    assert s["train_losses"][-1][1] < s["train_losses"][0][1] - 0.2, s["train_losses"]
    if engine == "fsdp":
        full = 4096 * 64
        assert ranks[0]["local"]["model.embed_tokens.weight"].numel() == full // 2


def test_export_hf_beside_each_checkpoint(tmp_path):
    """checkpoint.export_hf=true: every checkpoint carries an HF export of the (sharded) model at that step."""
    res = run_many(2, [([*RUN, "backend=fsdp", "checkpoint.every_n_steps=2", "checkpoint.export_hf=true",
                         "train.steps=2"], str(tmp_path))])[0]
    hf = tmp_path / "checkpoints" / "step-00000002" / "hf"
    got = hf_eval_loss(str(hf), compose([*RUN, "backend=fsdp"]), 2)
    want = res[0]["summary"]["eval_losses"][-1][1]  # the step-2 eval
    assert abs(got - want) <= 1e-4 * want, (got, want)
