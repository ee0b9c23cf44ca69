"""2 real gloo processes: DDP reproduces the single-process run with the same global batch."""

import json

import pytest
import torch

from shardyard.testing import TINY, run_ranks

STEPS = ["train.steps=5", "train.eval_every_n_steps=0"]


def losses(result):
    return [loss for _, loss in result["summary"]["train_losses"]]


@pytest.fixture(scope="module")
def single_ref(tmp_path_factory):
    # Global batch 8 in one process: micro 4 x accumulation 2.
    d = tmp_path_factory.mktemp("single")
    return run_ranks(1, [*TINY, *STEPS, "backend=single", "train.global_batch_size=8"], str(d))[0]


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_matches_single_process(single_ref, accum, tmp_path):
    micro = 4 // accum  # world 2 x micro x accum = 8
    res = run_ranks(2, [*TINY, *STEPS, "backend=ddp", f"train.micro_batch_size={micro}",
                        "train.global_batch_size=8"], str(tmp_path))
    ref = losses(single_ref)
    for r in res:
        got = losses(r)
        assert len(got) == 5
        for a, b in zip(got, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (got, ref)
    # Every replica holds bit-identical parameters after training.
    p0, p1 = res[0]["local"], res[1]["local"]
    assert p0.keys() == p1.keys()
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    # ...and they equal the single-process parameters up to fp32 summation order.
    for k in p0:
        torch.testing.assert_close(p0[k], single_ref["full"][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_ddp_trains(precision, tmp_path):
    res = run_ranks(2, [*TINY, "train.steps=8", "train.eval_every_n_steps=0", "backend=ddp", f"precision={precision}",
                        "optim.lr=3e-3"], str(tmp_path))
    got = losses(res[0])
    assert all(torch.isfinite(torch.tensor(got)))
    assert got[-1] < got[0] - 0.3, got
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    scales = [m["loss_scale"] for m in metrics if "loss_scale" in m]
    if precision == "fp16":  # dynamic loss scaling is active and reported
        assert len(scales) == 8 and all(s > 1 for s in scales)
    else:
        assert not scales
