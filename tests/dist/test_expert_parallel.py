"""Expert parallelism (``backend.ep``) on the FSDP2 family equals the single process: losses and global pre-clip
grad norms within 1e-4 at (world 2, ep 2), (world 4, ep 2), (world 4, ep 4) with accumulation 1 and 2, with
activation checkpointing, and for 2 pipeline stages x ep 2 at world 4; each rank holds E / ep whole experts; a
resume is bit for bit, and a checkpoint written at ep 2 resumes at ep 4 (and 4 -> 2) with the same losses; the HF
export scores the eval set as the engine did."""

import pytest
import torch

from shardyard.testing import TINY, compose, hf_eval_loss, run_many

# TINY's 2 layers of deepseek_moe_tiny: layer 0 dense, layer 1 MoE with 8 routed experts (top 2) + 1 shared.
EP = [*TINY, "model=deepseek_moe_tiny", "train.steps=6", "train.eval_every_n_steps=0", "train.global_batch_size=8",
      "backend=fsdp"]
EXPERTS = "model.layers.1.mlp.experts.gate_up_proj"
CKPT = "checkpoint.every_n_steps=3"


def step3(run_dir):
    return f"checkpoint.resume={run_dir}/checkpoints/step-00000003"


def curve(ranks, key="train_losses"):
    return [v for _, v in ranks[0]["summary"][key]]


def assert_close(got, ref, what, rel=1e-4):
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert len(got) == len(ref) and worst <= rel, f"{what}: {worst:.2e}\n got {got}\n ref {ref}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep")
    single = run_many(1, [([*EP, "backend=single"], str(d / "single"))])[0]
    w2 = {"ep2": [*EP, "backend.ep=2", CKPT, "checkpoint.save_final=true"],
          "ep2-accum2": [*EP, "backend.ep=2", "train.micro_batch_size=2"],
          "ep2-ckpt": [*EP, "backend.ep=2", "model.activation_checkpointing=true"]}
    w2["ep2-resumed"] = [*EP, "backend.ep=2", step3(d / "w2-ep2")]
    w4 = {"ep2": [*EP, "backend.ep=2", "train.micro_batch_size=2", CKPT],
          "ep2-accum2": [*EP, "backend.ep=2", "train.micro_batch_size=1"],
          "ep4": [*EP, "backend.ep=4", "train.micro_batch_size=2", CKPT],
          "ep4-accum2": [*EP, "backend.ep=4", "train.micro_batch_size=1"],
          "pp2-ep2": [*EP, "backend=pipeline", "backend.stages=2", "backend.microbatches=2", "backend.ep=2",
                      "train.micro_batch_size=2"]}
    # a world-4 run's resumes, in a second call: its checkpoints must exist first
    w4_resumes = {"ep2-to-ep4": [*EP, "backend.ep=4", "train.micro_batch_size=2", step3(d / "w4-ep2")],
                  "ep4-to-ep2": [*EP, "backend.ep=2", "train.micro_batch_size=2", step3(d / "w4-ep4")]}
    out = {"single": single, "dir": d}
    out.update({f"w2-{k}": r for k, r in zip(w2, run_many(2, [(v, str(d / f"w2-{k}")) for k, v in w2.items()]))})
    for jobs in (w4, w4_resumes):
        out.update({f"w4-{k}": r for k, r in zip(jobs, run_many(4, [(v, str(d / f"w4-{k}")) for k, v in jobs.items()]))})
    return out


@pytest.mark.parametrize("run", ["w2-ep2", "w2-ep2-accum2", "w2-ep2-ckpt", "w4-ep2", "w4-ep2-accum2", "w4-ep4",
                                 "w4-ep4-accum2", "w4-pp2-ep2"])
def test_expert_parallel_matches_single_process(run, runs):
    ref = runs["single"]
    for rank in runs[run]:  # every rank reports the same all-reduced numbers
        assert_close(curve([rank]), curve(ref), f"{run} loss")
        assert_close(curve([rank], "grad_norms"), curve(ref, "grad_norms"), f"{run} grad norm")


@pytest.mark.parametrize("run,ep", [("w2-ep2", 2), ("w4-ep4", 4), ("w4-ep2", 2)])
def test_each_rank_holds_its_own_whole_experts(run, ep, runs):
    """Rank r's experts are rows r % ep of the E / ep blocks (its EP index), sharded over edp by FSDP: the local
    shards of one EP group's ranks are disjoint experts, together E / ep per EP rank, all E over the group."""
    ranks = runs[run]
    full = ranks[0]["full"][EXPERTS]  # the export's [E, 2I, H]
    per_ep_rank = full.shape[0] // ep
    world = len(ranks)
    for r, rank in enumerate(ranks):
        local = rank["local"][EXPERTS]
        ep_index, edp_index = r % ep, r // ep
        block = full[ep_index * per_ep_rank:(ep_index + 1) * per_ep_rank]  # this EP rank's experts
        rows = block.chunk(world // ep)[edp_index]  # FSDP's dim-0 shard of them
        assert torch.equal(local, rows), (run, r)
    assert sum(rank["local"][EXPERTS].shape[0] for rank in ranks) == full.shape[0] == 8


def test_resume_is_bit_for_bit(runs):
    assert curve(runs["w2-ep2-resumed"]) == curve(runs["w2-ep2"])


@pytest.mark.parametrize("resumed,full", [("w4-ep2-to-ep4", "w4-ep2"), ("w4-ep4-to-ep2", "w4-ep4")])
def test_a_checkpoint_resumes_at_another_ep(resumed, full, runs):
    """DCP reshards the experts' global [E, ...] tensors: steps 4-6 after a change of ep equal the run that kept it."""
    assert_close(curve(runs[resumed])[3:], curve(runs[full])[3:], f"{resumed} loss", rel=1e-5)


def test_export_loads_into_transformers_deepseek_v3_with_the_engines_eval_loss(runs):
    from transformers import AutoConfig

    hf = runs["dir"] / "w2-ep2" / "hf"
    assert AutoConfig.from_pretrained(str(hf)).architectures == ["DeepseekV3ForCausalLM"]
    engine = runs["w2-ep2"][0]["summary"]["eval_losses"][-1][1]
    assert abs(hf_eval_loss(str(hf), compose([*EP, "backend.ep=2"]), 2) - engine) < 1e-4
