"""DPO and GRPO under sequence and context parallelism (issue 56 point 4: "DPO and GRPO sequences split the same
way") are exact: on 2 real gloo ranks, each running its share of every row's positions, the 3 steps' losses (within
1e-5), global gradient norms (5e-5) and final weights (1e-5) equal one process training the whole rows.

* DPO (chosen and rejected rows, right-padded; a response's log-probability is the sum of its shares' sums over
  the sequence group, ``sequence_parallel.sequence_sum``, for the policy and the frozen reference): DDP at sp 2,
  FSDP2 at sp 2, ZeRO-2 at cp 2 (each rank two chunks, head and tail), and IPO (a response's mean: the whole
  row's token count) on DDP at cp 2;
* GRPO (prompt + completion rows, the prompts left-padded: the padding masked over the whole row, as one process
  masks it), the round's second step's ratio to the sampling policy and the k3 KL to a reference on: with injected
  completions (``testing.FixedRollouts``) on DDP at sp 2 (per-token aggregation: every completion token in the
  second rank's half, the first's positions reached through attention only) and at cp 2 (per completion: each
  row's mean over its whole length; rows of 48 + 22 = 70 positions, padded to 72 for cp 2's 4 chunks, completions
  straddling two ranks' chunks), and with the policy's own sampling on FSDP2 at sp 2 (the group samples as one
  reader: the same completions as one process).

Measured: losses within 2.5e-6, gradient norms 3.9e-6, weights 8.3e-7 (GRPO: 3.6e-7, 1.9e-7, 3.0e-8). Broken on
purpose, the runs fail: with the group's sum skipped (each rank's DPO loss of its own shares' log-probabilities) the
DPO losses are 0.54 (of the curve's largest) off and the IPO loss 4.4e-2; with the padding mask dropped (plain causal
attention over the split) the GRPO losses 5.7e-3 to 8.8e-2; with each share's own completion length in the
per-completion mean, 4.0; with every rank counting the whole rows' completion tokens, 0.48."""

import pytest

from shardyard.testing import TINY, run_many

STEP = [*(o for o in TINY if not o.startswith(("data.seq_len", "train.micro_batch_size"))), "train.steps=3",
        "train.eval_every_n_steps=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optim=sgd", "optim.momentum=0", "optim.weight_decay=0", "sched=constant", "sched.warmup_steps=0",
        "train.max_grad_norm=0"]
"""Plain SGD: the weights move by the gradients themselves (Adam's first steps, about lr x sign(g), turn an entry's
near-zero gradient into a share of a step: one embedding entry 3.5e-4 off at lr 3e-3 on FSDP2 with sampling)."""
DPO = [*STEP, "objective=dpo", "objective.beta=0.5", "data=preference", "data.seq_len=80", "data.max_examples=200",
       "optim.lr=0.3"]
GRPO = [*STEP, "objective=grpo", "objective._target_=shardyard.testing.FixedRollouts", "data=prompts",
        "data.seq_len=48", "data.max_examples=200", "objective.num_generations=4", "objective.max_new_tokens=22",
        "objective.num_iterations=2", "objective.beta=0.1", "objective.epsilon=0.1", "objective.epsilon_high=0.3",
        "objective.rewards=[{_target_: shardyard.testing.completion_length}]", "optim.lr=0.5"]
REFS = {"dpo": DPO, "ipo": [*DPO, "objective.loss_type=ipo"], "grpo": GRPO,
        "per completion": [*GRPO, "objective.loss_aggregation=sequence"],
        "sampled": [*GRPO, "objective._target_=shardyard.objectives.grpo.GRPO"]}
"""The single processes, each training the whole rows."""
RUNS = {  # name -> (the single process it equals, the 2 ranks' layout)
    "dpo ddp sp2": ("dpo", ["backend=ddp", "backend.sp=2"]),
    "dpo fsdp sp2": ("dpo", ["backend=fsdp", "backend.sp=2"]),
    "dpo zero2 cp2": ("dpo", ["backend=zero2", "backend.cp=2"]),
    "ipo ddp cp2": ("ipo", ["backend=ddp", "backend.cp=2"]),
    "grpo ddp sp2": ("grpo", ["backend=ddp", "backend.sp=2"]),
    "grpo per completion ddp cp2": ("per completion", ["backend=ddp", "backend.cp=2"]),
    "grpo sampled fsdp sp2": ("sampled", ["backend=fsdp", "backend.sp=2"]),
}


def curve(result, key):
    return [v for _, v in result["summary"][key]]


def folder(name):
    return name.replace(" ", "-")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp-post")
    out = dict(zip(REFS, run_many(1, [([*o, "backend=single"], str(d / folder(n))) for n, o in REFS.items()])))
    names = list(RUNS)
    out.update(zip(names, run_many(2, [([*REFS[RUNS[n][0]], *RUNS[n][1]], str(d / ("sp-" + folder(n))))
                                       for n in names])))
    return out


def assert_close(got, ref, what, rel):
    """Relative to the curve's largest value (GRPO's loss is 0 where every ratio is 1 and each group's advantages,
    counted per completion, add up to 0)."""
    worst = max(abs(a - b) for a, b in zip(got, ref)) / max(abs(b) for b in ref)
    assert len(got) == len(ref) == 3 and worst <= rel, f"{what}: {worst:.2e}\n got {got}\n ref {ref}"


@pytest.mark.parametrize("run", list(RUNS))
def test_each_rank_trained_its_share_of_the_rows(runs, run):
    """What ``sequence_parallel.shard`` cut on each rank (``summary.json``'s ``sequence_share``): half of the
    (padded) rows each, the two ranks different halves; a run that skipped the split would equal one process too."""
    shares = [r["summary"]["sequence_share"] for r in runs[run]]
    assert [s["index"] for s in shares] == [0, 1] and shares[0]["first"] != shares[1]["first"], shares
    assert all(s["size"] == 2 and 2 * s["positions"] == s["of"] for s in shares), shares


@pytest.mark.parametrize("run", list(RUNS))
def test_post_training_split_equals_one_process(runs, run):
    want = runs[RUNS[run][0]][0]
    losses = curve(want, "train_losses")
    assert max(losses) - min(losses) > 1e-3, losses  # the steps moved the policy: no comparison of idle runs
    for r in runs[run]:  # every rank: the same reduced numbers
        assert_close(curve(r, "train_losses"), losses, f"{run} loss", 1e-5)
        assert_close(curve(r, "grad_norms"), curve(want, "grad_norms"), f"{run} grad norm", 5e-5)
    full = runs[run][0]["full"]
    for key, value in want["full"].items():
        assert (full[key] - value).abs().max() <= 1e-5, (run, key)
