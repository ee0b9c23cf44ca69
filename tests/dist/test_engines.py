"""Every engine computes the same training run: losses and global pre-clip grad norms at each of the first
5 optimizer steps equal the single-process run with the same global batch (fp32, fixed seed, CPU/gloo); its HF
export scores the eval set exactly as the engine did."""

import json

import pytest
import torch

from shardyard.testing import TINY, compose, hf_eval_loss, run_many

STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8"]
EXPORT = "checkpoint.save_final=true"
ENGINES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def curve(result, key="train_losses"):
    return [v for _, v in result["summary"][key]]


def assert_close(got, ref, rel, what):
    assert len(got) == len(ref) == 5
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= rel, f"{what}: worst relative difference {worst:.2e} > {rel:.0e}\n got {got}\n ref {ref}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    fp32, bf16 = run_many(1, [([*STEPS, "backend=single", EXPORT], str(d / "fp32")),
                              ([*STEPS, "backend=single", "precision=bf16"], str(d / "bf16"))])
    return {"fp32": fp32[0], "bf16": bf16[0], "dir": d}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """All world-size-2 runs, in one set of 2 processes: engines x accumulation {1, 2}, bf16, offload, DDP fp16."""
    d = tmp_path_factory.mktemp("w2")
    jobs = {}
    for e in ENGINES:
        jobs[(e, 1)] = [*STEPS, f"backend={e}", EXPORT]
        jobs[(e, 2)] = [*STEPS, f"backend={e}", "train.micro_batch_size=2"]  # 2 x accumulation 2 x world 2
        jobs[(e, "bf16")] = [*STEPS, f"backend={e}", "precision=bf16"]
    for e in ["fsdp_offload", "zero2_offload", "zero3_offload"]:
        jobs[(e, 1)] = [*STEPS, f"backend={e}"]
    jobs[("ddp", "fp16")] = [*STEPS, "backend=ddp", "precision=fp16"]
    # FSDP reducing once per step (unsharded gradients kept while accumulating) instead of every micro-batch
    jobs[("fsdp", "reduce_once")] = [*STEPS, "backend=fsdp", "train.micro_batch_size=2",
                                     "backend.reduce_every_micro_batch=false"]
    keys = list(jobs)
    results = run_many(2, [(jobs[k], str(d / f"{k[0]}-{k[1]}")) for k in keys])
    return {**dict(zip(keys, results)), "dir": d}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_matches_single_process(engine, accum, reference, world2):
    ranks = world2[(engine, accum)]
    ref = reference["fp32"]
    for r in ranks:  # every rank reports the same (all-reduced) numbers
        assert_close(curve(r), curve(ref), 1e-4, f"{engine} loss")
        assert_close(curve(r, "grad_norms"), curve(ref, "grad_norms"), 1e-4, f"{engine} grad norm")


def test_fsdp_reducing_once_per_step_matches_single_process(reference, world2):
    for r in world2[("fsdp", "reduce_once")]:
        assert_close(curve(r), curve(reference["fp32"]), 1e-4, "fsdp reduce once, loss")
        assert_close(curve(r, "grad_norms"), curve(reference["fp32"], "grad_norms"), 1e-4, "fsdp reduce once, norm")


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_stays_close_to_fp32(engine, reference, world2):
    got = curve(world2[(engine, "bf16")][0])
    assert_close(got, curve(reference["fp32"]), 2e-2, f"{engine} bf16 vs fp32")
    assert got != curve(reference["fp32"])  # it really ran in bf16


@pytest.mark.parametrize("engine,base", [("fsdp_offload", "fsdp"), ("zero2_offload", "zero2"), ("zero3_offload", "zero3")])
def test_offload_matches_no_offload(engine, base, world2):
    assert_close(curve(world2[(engine, 1)][0]), curve(world2[(base, 1)][0]), 1e-4, f"{engine} vs {base}")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    d = tmp_path_factory.mktemp("w4")
    engines = ["fsdp", "zero3"]
    return dict(zip(engines, run_many(4, [([*STEPS, f"backend={e}", "train.micro_batch_size=2"], str(d / e))
                                          for e in engines])))


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_world_size_4(engine, reference, world4):
    ranks = world4[engine]
    assert_close(curve(ranks[0]), curve(reference["fp32"]), 1e-4, f"{engine} x4 loss")
    assert_close(curve(ranks[0], "grad_norms"), curve(reference["fp32"], "grad_norms"), 1e-4, f"{engine} x4 grad norm")


def test_replicas_stay_bit_identical(world2):
    """DDP and Horovod-style replicas: after training, every rank holds exactly the same parameters."""
    p0, p1 = world2[("ddp", 1)][0]["local"], world2[("ddp", 1)][1]["local"]
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)


def test_fp16_ddp_scales_the_loss_and_tracks_fp32(world2, reference):
    got = curve(world2[("ddp", "fp16")][0])
    assert_close(got, curve(reference["fp32"]), 2e-2, "ddp fp16 vs fp32")
    metrics = [json.loads(line) for line in open(world2["dir"] / "ddp-fp16" / "metrics.jsonl")]
    scales = [m["loss_scale"] for m in metrics if "loss_scale" in m]
    assert len(scales) == 5 and all(s > 1 for s in scales)  # dynamic loss scaling is active and reported
    assert not any("loss_scale" in json.loads(line) for line in open(world2["dir"] / "ddp-1" / "metrics.jsonl"))


@pytest.mark.parametrize("engine", ["single", *ENGINES])
def test_export_gives_the_engines_eval_loss(engine, reference, world2):
    """The HF export (gathered from the shards on sharded engines) loads with AutoModelForCausalLM and scores the
    eval set exactly as the engine did at its last step."""
    res, run_dir, world = ((reference["fp32"], reference["dir"] / "fp32", 1) if engine == "single"
                           else (world2[(engine, 1)][0], world2["dir"] / f"{engine}-1", 2))
    engine_loss = res["summary"]["eval_losses"][-1][1]
    got = hf_eval_loss(str(run_dir / "hf"), compose([*STEPS, f"backend={engine}"]), world)
    assert abs(got - engine_loss) <= 1e-4 * engine_loss, (got, engine_loss)


def test_sharded_engines_really_shard(world2, reference):
    full = reference["fp32"]["full"]["model.embed_tokens.weight"].numel()
    fsdp_local = world2[("fsdp", 1)][0]["local"]["model.embed_tokens.weight"].numel()
    assert fsdp_local == full // 2
    # The gathered export of a sharded engine equals the single-process weights after the same 5 steps.
    for e in ("fsdp", "zero3"):
        got = world2[(e, 1)][0]["full"]
        for k, v in reference["fp32"]["full"].items():
            torch.testing.assert_close(got[k].float(), v, rtol=1e-4, atol=1e-5)
