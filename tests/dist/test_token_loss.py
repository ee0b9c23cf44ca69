"""Token-weighted loss (issue 33): an optimizer step's loss is the cross-entropy summed over the label tokens of
every micro-batch and rank, divided by their count, so micro-batches with few labels weigh less. Proven on
micro-batches whose label counts differ (SFT rows: assistant tokens only), one plain-SGD step each: the update
(the gradient times the learning rate) of every engine family at accumulation 1/2/4 and world 1/2 equals the
single-process full-batch run's within 1e-5, and the logged train loss is the full batch's token mean.

The pipeline refuses SFT rows, so it trains on pre-training rows whose targets are masked here (``masking``: each
row keeps the labels of its last tokens only, how many set by its first token), on 2 stages x 2 data-parallel
replicas, each micro batch cut into 2 pipeline micro-batches."""

import json
import os

import pytest
import torch

from conftest import train_py
from shardyard.testing import TINY, compose, hf_tensors, on_ranks, run_many

LR = 1.0  # an update of gradient size: the weights' fp32 rounding is far below the 1e-5 compared
STEP = [*(o for o in TINY if not o.startswith("data.seq_len")), "train.steps=1", "train.eval_every_n_steps=0",
        "train.global_batch_size=8", "optim=sgd", "optim.momentum=0", "optim.weight_decay=0", f"optim.lr={LR}",
        "sched=constant", "sched.warmup_steps=0", "train.max_grad_norm=0"]
SFT = [*STEP, "data=sft", "data.seq_len=128"]
PRETRAIN = [*STEP, "data.seq_len=64"]
PIPELINE = ["backend=pipeline", "backend.stages=2", "backend.schedule=1f1b", "backend.microbatches=2"]
MICRO = {1: 8, 2: 4, 4: 2}  # world 1: accumulation -> micro batch; world 2 halves it again
EXPORT = "checkpoint.save_final=true"


def masking(plain, unlabelled: bool = False):
    """``TrainStream.micro_batch`` (``plain``) with SFT-like targets: a row keeps the labels of its last 1..63
    tokens, the count set by its first token, so the same row has the same labels on every engine and split
    (``unlabelled``: none at all)."""
    def micro_batch(stream, step: int, micro: int):
        x, y = plain(stream, step, micro)
        keep = 0 * x[:, :1] if unlabelled else 1 + x[:, :1] % (y.shape[1] - 1)
        return x, y.masked_fill(torch.arange(y.shape[1]) < y.shape[1] - keep, -100)
    return micro_batch


def _masked_run(rank: int, world: int, overrides: list, run_dir: str, unlabelled: bool) -> None:
    """``testing.run_many``'s job on a pool rank, its training batches masked (``masking``)."""
    from shardyard.data import pipeline as data
    from shardyard import testing

    plain = data.TrainStream.micro_batch
    data.TrainStream.micro_batch = masking(plain, unlabelled)
    try:
        testing._one_run(rank, world, overrides, run_dir)
    finally:
        data.TrainStream.micro_batch = plain


def masked_runs(world: int, overrides: list, run_dir: str, unlabelled: bool = False) -> list[dict]:
    os.makedirs(run_dir, exist_ok=True)
    on_ranks(world, _masked_run, overrides, run_dir, unlabelled)
    return [torch.load(os.path.join(run_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def label_counts(overrides: list, world: int, micro: int, masked: bool = False) -> list[int]:
    """Labels per micro-batch of step 1, for every (rank, micro-step) of that layout."""
    from shardyard.data import pipeline as data

    cfg = compose([*overrides, f"train.micro_batch_size={micro}"])
    seqs = data.open_split(data.prepare(cfg), "train", cfg.data.seq_len)
    fetch = masking(data.TrainStream.micro_batch) if masked else data.TrainStream.micro_batch
    counts = []
    for rank in range(world):
        stream = data.TrainStream(seqs, cfg.seed, 8, micro, rank, world)
        counts += [int((fetch(stream, 0, m)[1] != -100).sum()) for m in range(8 // (micro * world))]
    return counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("token-loss")
    single = [*SFT, "backend=single"]
    one = run_many(1, [([*single, f"train.micro_batch_size={MICRO[1]}"], str(d / "ref")),
                       ([*single, f"train.micro_batch_size={MICRO[4]}"], str(d / "single-4"))])
    jobs = {("ddp", 1): [*SFT, "backend=ddp", f"train.micro_batch_size={MICRO[1] // 2}"]}
    for e in ["ddp", "fsdp", "zero2", "zero3"]:
        jobs[(e, 2)] = [*SFT, f"backend={e}", f"train.micro_batch_size={MICRO[2] // 2}"]
    two = dict(zip(jobs, run_many(2, [(o, str(d / f"{e}-{a}")) for (e, a), o in jobs.items()])))
    masked_ref = masked_runs(1, [*PRETRAIN, "backend=single", f"train.micro_batch_size={MICRO[1]}"], str(d / "masked"))
    unlabelled = masked_runs(1, [*PRETRAIN, "backend=single", f"train.micro_batch_size={MICRO[2]}"],
                             str(d / "unlabelled"), unlabelled=True)
    pipeline = masked_runs(4, [*PRETRAIN, *PIPELINE, f"train.micro_batch_size={MICRO[2] // 2}"], str(d / "pipeline"))
    return {"ref": one[0], ("single", 4): one[1], **two, "masked-ref": masked_ref, ("pipeline", 2): pipeline,
            "unlabelled": unlabelled, "dir": d}


def update_gap(got: dict, ref: dict) -> float:
    """The largest difference between two runs' gradients, read off their weights after one SGD step from the
    same start: (w_ref - w_got) / lr = g_got - g_ref."""
    assert got.keys() == ref.keys()
    return max((got[k].float() - v.float()).abs().max().item() for k, v in ref.items()) / LR


def assert_same_step(ranks: list, ref: dict, what: str) -> None:
    assert update_gap(ranks[0]["full"], ref["full"]) <= 1e-5, what
    want = ref["summary"]["train_losses"][0][1]
    for r in ranks:  # every rank logs the same token-weighted mean
        got = r["summary"]["train_losses"][0][1]
        assert abs(got - want) <= 1e-5 * want, (what, got, want)


def test_micro_batches_hold_different_numbers_of_labels():
    """What makes the test bite: the micro-batches of one step differ in their label counts."""
    for world, accum in [(1, 4), (2, 1), (2, 2)]:
        counts = label_counts(SFT, world, MICRO[accum] // world)
        assert len(set(counts)) == len(counts) == world * accum, counts
    pipeline_chunks = label_counts(PRETRAIN, 2, 1, masked=True)  # a pipeline micro-batch is one row
    assert len(set(pipeline_chunks)) > 4 and min(pipeline_chunks) < max(pipeline_chunks) / 2, pipeline_chunks


@pytest.mark.parametrize("engine,accum", [("single", 4), ("ddp", 1), ("ddp", 2), ("fsdp", 2), ("zero2", 2),
                                          ("zero3", 2)])
def test_step_equals_the_full_batch(engine, accum, runs):
    assert_same_step(runs[(engine, accum)], runs["ref"][0], f"{engine}, accumulation {accum}")


def test_pipeline_step_equals_the_full_batch(runs):
    """2 stages x dp 2, accumulation 2, each micro batch cut into 2 pipeline micro-batches of different label
    counts: the loss function's chunks add up to the token-weighted mean."""
    assert_same_step(runs[("pipeline", 2)], runs["masked-ref"][0], "pipeline")


def test_a_step_without_labels_trains_nothing_and_logs_zero(runs):
    """No label in the whole step (N = 0): the weight stays finite (N counts as 1), so the update is zero and the
    logged loss 0, where a mean would be NaN (and debug.nan_policy=stop, the default, would end the run)."""
    summary = runs["unlabelled"][0]["summary"]
    assert summary["train_losses"] == [(1, 0.0)] and summary["grad_norms"] == [(1, 0.0)], summary


def test_horovod_step_equals_the_full_batch(runs, tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup`")
    proc = train_py(*SFT, "backend=horovod", "launch.nproc_per_node=2", f"train.micro_batch_size={MICRO[2] // 2}",
                    EXPORT, run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    got = {"full": hf_tensors(tmp_path / "hf"), "summary": summary}  # both workers' shards
    assert_same_step([got], runs["ref"][0], "horovod, accumulation 2")
