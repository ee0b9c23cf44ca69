"""Post-training objectives on every engine (issue 44): two DPO steps and two GRPO steps (one round of rollouts
trained on twice: the second step's ratio is to the policy that sampled) train every engine to the single
process's weights within 1e-4 (plain SGD, fp32), and a GRPO run resumed inside a round of rollouts ends bit for
bit as the uninterrupted run.

GRPO's rollouts are injected by a user's objective plugged in by ``_target_`` (``testing.FixedRollouts``:
completions made from each prompt's tokens and their place in the group, so every layout samples the same ones)
and rewarded by their length (``testing.completion_length``, a user's reward by ``_target_``): sampling itself is
``test_generation``'s. What is compared is everything after it: rewards, group advantages, the sampling policy's
log-probs kept for the round's second step, the asymmetric clip, the k3 KL to a reference model sharded as the
policy, token aggregation over micro-batches and ranks."""

import json
import os

import pytest
import torch

from conftest import train_py
from shardyard.testing import TINY, hf_tensors, run_many

STEP = [*(o for o in TINY if not o.startswith(("data.seq_len", "train.micro_batch_size"))), "train.steps=2",
        "train.eval_every_n_steps=0", "train.global_batch_size=8", "optim=sgd", "optim.momentum=0",
        "optim.weight_decay=0", "sched=constant", "sched.warmup_steps=0", "train.max_grad_norm=0"]
OBJECTIVES = {
    "dpo": [*STEP, "objective=dpo", "objective.beta=0.5", "data=preference", "data.seq_len=80",
            "data.max_examples=400", "optim.lr=2.0"],
    "grpo": [*STEP, "objective=grpo", "objective._target_=shardyard.testing.FixedRollouts", "data=prompts",
             "data.seq_len=48", "data.max_examples=400", "objective.num_generations=4", "objective.max_new_tokens=6",
             "objective.num_iterations=2", "objective.beta=0.1", "objective.epsilon=0.1", "objective.epsilon_high=0.3",
             "objective.rewards=[{_target_: shardyard.testing.completion_length}]", "optim.lr=0.5"]}
LAYOUTS = {  # engine -> (world, micro batch); the global batch is 8 (DPO pairs, GRPO prompts)
    "single": (1, 2), "ddp": (2, 2), "fsdp": (2, 4), "fsdp_tp": (2, 4), "zero2": (2, 2), "zero3": (2, 4)}
"""ZeRO-1 is not among them: its reference is ZeRO-2's (``deepspeed.reference_ds_config`` makes both a stage-0
replica), and ZeRO-1 against the single process is test_engines' matrix."""
HOROVOD_OBJECTIVES = ("grpo",)
"""Horovod's reference is ``reference.replica``, as DDP's and the single process's: GRPO's run (a KL term, beta 0.1,
so the reference is used) carries Horovod under post-training; DPO's batching of pairs over ranks is every other
engine's."""


def options(engine: str) -> list[str]:
    return [f"backend={engine}", f"train.micro_batch_size={LAYOUTS[engine][1]}"] + (
        ["backend.tp=2"] if engine == "fsdp_tp" else [])


@pytest.fixture(scope="module", params=list(OBJECTIVES))
def trained(request, tmp_path_factory):
    """Per objective: the single process at the whole batch, then every engine's layout, then (GRPO) Horovod
    (started by its own runner); their final weights and logged losses."""
    base = OBJECTIVES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    out = {"ref": run_many(1, [([*base, "backend=single", "train.micro_batch_size=8"], str(d / "ref"))])[0][0]}
    for world in (1, 2):
        names = [e for e, (w, _) in LAYOUTS.items() if w == world]
        out.update((n, got[0]) for n, got in zip(names, run_many(world, [([*base, *options(n)], str(d / n))
                                                                         for n in names])))
    if request.param not in HOROVOD_OBJECTIVES:
        return request.param, out
    hv = train_py(*base, "backend=horovod", "launch.nproc_per_node=2", "train.micro_batch_size=4",
                  "checkpoint.save_final=true", run_dir=d / "horovod")
    assert hv.returncode == 0, hv.stderr[-3000:]
    out["horovod"] = {"full": hf_tensors(d / "horovod/hf"),  # both workers' shards
                      "summary": json.load(open(d / "horovod/summary.json"))}
    return request.param, out


def test_every_engine_trains_to_the_single_process_weights(trained):
    objective, out = trained
    ref = out["ref"]["full"]
    losses = [v for _, v in out["ref"]["summary"]["train_losses"]]
    if objective == "dpo":  # the policy starts as its reference: every pair's loss is log 2
        assert losses[0] == pytest.approx(0.6931472, abs=1e-6)
    assert abs(losses[1] - losses[0]) > 1e-3  # the first step moved the weights: no comparison of idle runs
    for engine in [*LAYOUTS, *(["horovod"] if objective in HOROVOD_OBJECTIVES else [])]:
        full = out[engine]["full"]
        worst = max((full[k].float() - ref[k].float()).abs().max().item() for k in full)
        assert worst < 1e-4, (objective, engine, worst)
        got = [v for _, v in out[engine]["summary"]["train_losses"]]
        assert got == pytest.approx(losses, abs=1e-5), (objective, engine)


@pytest.mark.parametrize("split", [[], ["backend.sp=2"]], ids=["dp2", "sp2"])
def test_grpo_resumes_bit_for_bit_inside_a_round(tmp_path, split):
    """4 steps, 2 per round of rollouts, on 2 DDP ranks (data-parallel, or one sequence group at sp 2: each rank keeps
    the log-probs of its share of the positions); the run resumed from step 1 (inside round 0: its rollouts come
    from the checkpoint, not sampled again) ends with the uninterrupted run's weights and losses, bit for bit."""
    base = [*OBJECTIVES["grpo"], "backend=ddp", "train.micro_batch_size=2", "train.steps=4", "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=0", *split]
    a, b = run_many(2, [(base, str(tmp_path / "a")),
                        ([*base, f"checkpoint.resume={tmp_path}/a/checkpoints/step-00000001"], str(tmp_path / "b"))])
    assert os.path.isfile(tmp_path / "a/checkpoints/step-00000001/rollouts/rank1/rollouts.safetensors")
    assert not os.path.isdir(tmp_path / "a/checkpoints/step-00000002/rollouts")  # a round's end: nothing to keep
    for k, v in a[0]["full"].items():
        assert torch.equal(v, b[0]["full"][k]), k
    assert b[0]["summary"]["train_losses"][1:] == a[0]["summary"]["train_losses"][1:]
    assert len(b[0]["summary"]["step_wall_s"]) == 3  # really resumed
    metrics = [json.loads(line) for line in open(tmp_path / "a/metrics.jsonl")]
    assert any(m.get("train/clip_ratio/region", 0) > 0 for m in metrics)  # the second step of a round clips


def test_dpo_precomputed_reference_is_cached_verified_and_equals_the_live_one(tmp_path):
    """``objective.precompute_ref_logps`` on FSDP (a sharded reference, each replica its share of the pairs): the
    first run builds the reference, caches every pair's log-probs and frees the reference before training; the
    second finds the cache and builds no reference; a damaged cache is rebuilt (never read); all three train to the
    live reference's weights."""
    base = [*OBJECTIVES["dpo"], "backend=fsdp", "train.micro_batch_size=4", f"data.cache_dir={tmp_path}/cache"]
    pre = [*base, "objective.precompute_ref_logps=true"]
    live, built, found = run_many(2, [(base, str(tmp_path / "live")), (pre, str(tmp_path / "built")),
                                      (pre, str(tmp_path / "found"))])
    [cache] = (tmp_path / "cache/ref_logps").glob("ref_logps-*[!k]")
    arr = cache / "train.npy"
    arr.write_bytes(arr.read_bytes()[:-4] + b"\x00\x00\xc0\x7f")  # the last pair's rejected log-prob: NaN
    [damaged] = run_many(2, [(pre, str(tmp_path / "damaged"))])
    runs = (live[0], built[0], found[0], damaged[0])
    assert [r["reference_built"] for r in runs] == [True, False, False, False]  # held while training: live only
    assert [r["ref_cache_built"] for r in runs] == [False, True, False, True]
    for run in (built, found, damaged):
        for k, v in live[0]["full"].items():
            assert (run[0]["full"][k] - v).abs().max() < 1e-5, k


def test_grpo_samples_with_the_sharded_policy_on_fsdp_and_zero3(tmp_path):
    """Real rollouts (no injection) on the engines whose forward gathers parameters (FSDP2's units, ZeRO-3's
    fetches): every rank runs the same number of forwards (lockstep), so two steps and a greedy evaluation of the
    held-out prompts end, and the rewards and completion lengths they log are those of real completions."""
    base = [*OBJECTIVES["grpo"], "objective._target_=shardyard.objectives.grpo.GRPO", "train.micro_batch_size=4",
            "train.eval_every_n_steps=2", "train.eval_batches=1"]
    engines = ("fsdp", "zero3")
    for engine, (out, _) in zip(engines, run_many(2, [([*base, f"backend={e}"], str(tmp_path / e)) for e in engines])):
        metrics = [json.loads(line) for line in open(tmp_path / engine / "metrics.jsonl")]
        sampled = [m for m in metrics if "train/completion_len" in m]
        assert sampled and all(0 < m["train/completion_len"] <= 6 for m in sampled), (engine, sampled)
        assert all(m["train/reward"] > 0 for m in sampled), (engine, sampled)  # completion_length: > 0 chars
        assert "eval/reward" in out["summary"]["final_eval"], engine
