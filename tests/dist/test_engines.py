"""Every engine computes the same training run: losses and global pre-clip grad norms at each of the first
5 optimizer steps equal the single-process run with the same global batch (fp32, fixed seed, CPU/gloo); its HF
export scores the eval set exactly as the engine did."""

import json
import os

import pytest
import torch

from shardyard.testing import TINY, compose, hf_eval_loss, on_ranks, run_many

STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8"]
EXPORT = "checkpoint.save_final=true"
ENGINES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def curve(result, key="train_losses"):
    return [v for _, v in result["summary"][key]]


def worst(got, ref):
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def assert_close(got, ref, rel, what):
    assert len(got) == len(ref) == 5
    assert worst(got, ref) <= rel, f"{what}: worst relative difference {worst(got, ref):.2e} > {rel:.0e}\n got {got}\n ref {ref}"


def _probed_run(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """``testing.run_many``'s job on a pool rank, also writing to ``probe<rank>.json`` what the engine did that
    equal losses cannot show: how many times FSDP2 reduced gradients (one ``foreach_reduce`` per parameter group
    per synchronised backward), on DeepSpeed engines whether ZeRO offloads the optimizer (and parameters) and
    which optimizer class steps, and on DDP with accumulation the buckets it all-reduced (through a counting
    comm hook, torch's own ``allreduce_hook``: DDP's built-in reduction is C++ and cannot be counted)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardyard import testing
    from shardyard.training import worker

    probe = {"reduces": 0}
    plain_reduce, plain_main, plain_ddp = pg.foreach_reduce, worker.main, DDP.__init__

    def reduce(*args, **kwargs):
        probe["reduces"] += 1
        return plain_reduce(*args, **kwargs)

    def counted_ddp(self, *args, **kwargs):
        plain_ddp(self, *args, **kwargs)
        probe.update(buckets=[])

        def hook(state, bucket):
            probe["buckets"].append(bucket.index())
            return allreduce_hook(state, bucket)
        self.register_comm_hook(None, hook)

    def main(cfg, plan, after_train):
        if cfg.backend.name == "ddp" and plan.grad_accum_steps > 1:
            DDP.__init__ = counted_ddp
        def grab(backend):
            engine = getattr(backend, "engine", None)  # DeepSpeedBackend's DeepSpeedEngine
            if engine is not None:
                probe.update(cpu_offload=bool(engine.zero_cpu_offload()), offload_param=bool(engine.zero_offload_param()),
                             optimizer=type(engine.optimizer.optimizer).__name__)
            after_train(backend)
        return plain_main(cfg, plan, after_train=grab)

    pg.foreach_reduce, worker.main = reduce, main
    try:
        testing._one_run(rank, world, overrides, run_dir)
    finally:
        pg.foreach_reduce, worker.main, DDP.__init__ = plain_reduce, plain_main, plain_ddp
    with open(os.path.join(run_dir, f"probe{rank}.json"), "w") as f:
        json.dump(probe, f)


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
    out = {}
    for k, overrides in jobs.items():
        run_dir = d / f"{k[0]}-{k[1]}"
        run_dir.mkdir()
        on_ranks(2, _probed_run, overrides, str(run_dir))
        out[k] = [{**torch.load(run_dir / f"rank{r}.pt", weights_only=False),
                   "probe": json.load(open(run_dir / f"probe{r}.json"))} for r in range(2)]
    return {**out, "dir": d}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_matches_single_process(engine, accum, reference, world2):
    ranks = world2[(engine, accum)]
    ref = reference["fp32"]
    for r in ranks:  # every rank reports the same (all-reduced) numbers
        assert_close(curve(r), curve(ref), 1e-4, f"{engine} loss")
        assert_close(curve(r, "grad_norms"), curve(ref, "grad_norms"), 1e-4, f"{engine} grad norm")


def test_fsdp_reducing_once_per_step_matches_single_process(reference, world2):
    """backend.reduce_every_micro_batch=false at accumulation 2: half the gradient reductions of the default (one
    per optimizer step instead of one per micro-batch, as many as without accumulation), on every rank, and the
    same training."""
    for every, once, accum1 in zip(world2[("fsdp", 2)], world2[("fsdp", "reduce_once")], world2[("fsdp", 1)]):
        counts = every["probe"]["reduces"], once["probe"]["reduces"], accum1["probe"]["reduces"]
        assert counts[0] > 0 and counts[1] * 2 == counts[0] and counts[1] == counts[2], counts
        assert_close(curve(once), curve(reference["fp32"]), 1e-4, "fsdp reduce once, loss")
        assert_close(curve(once, "grad_norms"), curve(reference["fp32"], "grad_norms"), 1e-4, "fsdp reduce once, norm")


def test_ddp_reduces_once_per_step_while_accumulating(world2):
    """DDP at accumulation 2 all-reduces each gradient bucket once per optimizer step (no_sync on the first
    micro-batch), not once per micro-batch: 5 steps x its buckets, on every rank."""
    for r in world2[("ddp", 2)]:
        buckets = r["probe"]["buckets"]
        assert buckets and len(buckets) == 5 * len(set(buckets)), buckets


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_matches_single_bf16_and_differs_from_fp32(engine, reference, world2):
    """The engine's bf16 run tracks the single process's bf16 run (a bf16 run that did not train is ~1e-2 off),
    and bf16 moved it from the engine's own fp32 run by far more than that fp32 run differs from single's (so an
    engine that silently runs fp32 fails). ZeRO holds bf16 parameters; DDP (autocast) and FSDP
    (MixedPrecisionPolicy) keep fp32 ones and cast for compute."""
    got = curve(world2[(engine, "bf16")][0])
    own32 = curve(world2[(engine, 1)][0])
    assert_close(got, curve(reference["bf16"]), 5e-4, f"{engine} bf16 vs single bf16")
    moved, noise = worst(got, own32), worst(own32, curve(reference["fp32"]))
    assert moved >= max(1e-6, 20 * noise), f"{engine}: bf16 moved the losses by {moved:.1e}, fp32 noise {noise:.1e}"
    if engine.startswith("zero"):
        assert {v.dtype for v in world2[(engine, "bf16")][0]["local"].values()} == {torch.bfloat16}


@pytest.mark.parametrize("engine,base", [("fsdp_offload", "fsdp"), ("zero2_offload", "zero2"), ("zero3_offload", "zero3")])
def test_offload_matches_no_offload(engine, base, world2):
    """Same training with and without offload; on ZeRO the engine really offloads (CPU-Adam steps the host copy,
    ZeRO-3 also offloads parameters), which the base engine does not. (fsdp_offload's placement:
    tests/dist/test_device_rules.py.)"""
    assert_close(curve(world2[(engine, 1)][0]), curve(world2[(base, 1)][0]), 1e-4, f"{engine} vs {base}")
    if engine.startswith("zero"):
        stage3 = engine.startswith("zero3")
        for r in world2[(engine, 1)]:
            assert r["probe"] == {"reduces": 0, "cpu_offload": True, "offload_param": stage3,
                                  "optimizer": "DeepSpeedCPUAdam"}, r["probe"]
        for r in world2[(base, 1)]:
            assert not r["probe"]["cpu_offload"] and not r["probe"]["offload_param"] \
                and r["probe"]["optimizer"] != "DeepSpeedCPUAdam", r["probe"]


WORLD4 = {"fsdp": ["backend=fsdp"], "zero3": ["backend=zero3"],
          "hsdp": ["backend=fsdp", "backend.replicate=2"]}  # HSDP: 2 copies x 2 shards (a 2-D mesh)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    d = tmp_path_factory.mktemp("w4")
    return dict(zip(WORLD4, run_many(4, [([*STEPS, *over, "train.micro_batch_size=2"], str(d / name))
                                         for name, over in WORLD4.items()])))


@pytest.mark.parametrize("engine", WORLD4)
def test_world_size_4(engine, reference, world4):
    ranks = world4[engine]
    assert_close(curve(ranks[0]), curve(reference["fp32"]), 1e-4, f"{engine} x4 loss")
    assert_close(curve(ranks[0], "grad_norms"), curve(reference["fp32"], "grad_norms"), 1e-4, f"{engine} x4 grad norm")


def test_hsdp_shards_within_a_copy_and_the_copies_hold_the_same_shards(world4):
    """backend.replicate=2 at world 4 is HSDP, not FSDP over 4: each rank holds half the model (its copy's shard,
    twice plain FSDP's quarter), ranks 0 and 2 (and 1 and 3) hold the same shard bit for bit after training (the
    gradients all-reduced across the copies), and the two shards of a copy differ."""
    hsdp, fsdp = world4["hsdp"], world4["fsdp"]
    numel = [sum(v.numel() for v in r["local"].values()) for r in hsdp]
    quarter = [sum(v.numel() for v in r["local"].values()) for r in fsdp]
    whole = sum(v.numel() for v in hsdp[0]["full"].values())
    assert numel[0] + numel[1] == whole == sum(quarter) and numel[0] >= 2 * min(quarter), (numel, quarter, whole)
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(hsdp[a]["local"][k], hsdp[b]["local"][k]) for k in hsdp[a]["local"]), (a, b)
    assert any(not torch.equal(hsdp[0]["local"][k], hsdp[1]["local"][k]) for k in hsdp[0]["local"])


def test_replicas_stay_bit_identical(world2):
    """DDP and Horovod-style replicas: after training, every rank holds exactly the same parameters."""
    p0, p1 = world2[("ddp", 1)][0]["local"], world2[("ddp", 1)][1]["local"]
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)


def test_fp16_ddp_scales_the_loss_and_tracks_fp32(world2, reference):
    """fp16 autocast with a GradScaler at 2**16 tracks fp32 (5 steps move the loss ~1e-2; fp16 stays within
    1e-4) and reports the unscaled pre-clip gradient norm (clipping before unscale_ reports it 2**16 too big);
    no step overflows, so the scale stays at its initial 2**16 (a scaler that skips steps halves it)."""
    r = world2[("ddp", "fp16")][0]
    assert_close(curve(r), curve(reference["fp32"]), 1e-4, "ddp fp16 loss")
    assert_close(curve(r, "grad_norms"), curve(reference["fp32"], "grad_norms"), 1e-3, "ddp fp16 grad norm")
    metrics = [json.loads(line) for line in open(world2["dir"] / "ddp-fp16" / "metrics.jsonl")]
    scales = [m["loss_scale"] for m in metrics if "loss_scale" in m]
    assert scales == [2.0 ** 16] * 5, scales
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
