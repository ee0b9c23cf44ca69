"""``Backend.reference_model`` on every engine (issue 44): the frozen reference model of DPO and GRPO's KL term.

On each engine, built after ``prepare`` from the same ``build``: its logits on a fixed batch are the policy's at
step 0 in the policy's numerics (fp32: both equal a single process's plain build of the model; bf16: the policy's
autocast, MixedPrecisionPolicy or DeepSpeed cast), and after one optimizer step of the policy they have not moved
while the policy's have. It is frozen (no parameter requires a gradient, none has one, none is in the policy's
optimizer, its logits carry no graph), in eval mode, and its build left the training's random streams alone. On
FSDP and ZeRO-3 at world 2 (with CPU offload too, and ZeRO-3 built under ``deepspeed.zero.Init``) it is sharded
as the policy: each rank holds half of its parameters' elements, as of the policy's (measured on the local
shards: DTensor local tensors, DeepSpeed's ``ds_tensor`` partitions), and nothing is left gathered after its
forward; DeepSpeed gives it no optimizer (ZeRO-3: its parameter hooks only; stage 0 under bf16: an empty shell)."""

import contextlib
import os

import pytest
import torch

from shardyard.testing import TINY, compose, on_ranks

BASE = [*TINY, "train.steps=2", "train.eval_every_n_steps=0", "sched.warmup_steps=0"]
# The fp32 replica, DDP, ZeRO-1/2 and Horovod references are proven by tests/dist/test_post_training.py (DPO on every
# engine equals the single process, its first loss log 2): here the numerics (bf16), the shards, offload, zero.Init.
# Not here, as carried elsewhere: DDP bf16 (``reference.replica``, as single bf16 below); plain fp32 FSDP and ZeRO-3
# (their logits: DPO on fsdp and zero3 in test_post_training; their shards: fsdp_offload and fsdp bf16, zero3
# zero.Init and zero3_offload below, the same sharding code).
WORLD1 = {
    "single bf16": ["backend=single", "precision=bf16"],
}
WORLD2 = {
    "fsdp bf16": ["backend=fsdp", "precision=bf16"],
    "fsdp_tp": ["backend=fsdp_tp", "backend.tp=2", "train.global_batch_size=4"],
    "zero2 bf16": ["backend=zero2", "precision=bf16"],
    # every parameter partitioned (the tiny model's are all below the default persistence threshold of 1e5); the
    # policy built under deepspeed.zero.Init (HfDeepSpeedConfig): the reference is too, under its own config
    "zero3 zero.Init": ["backend=zero3", "backend.stage3_param_persistence_threshold=0", "model.init_device=meta"],
    "zero3_offload": ["backend=zero3_offload", "backend.stage3_param_persistence_threshold=0"],
    "fsdp_offload": ["backend=fsdp_offload"],
}
SHARDED = ("fsdp bf16", "fsdp_offload", "zero3 zero.Init", "zero3_offload")


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _held(p) -> tuple[int, int]:
    """(elements this rank holds of parameter ``p``, elements of the whole parameter)."""
    if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's partition (padded to divide by the world)
        return p.ds_tensor.numel(), p.ds_numel
    return (p.to_local() if hasattr(p, "to_local") else p).numel(), p.numel()


def _gathered(p) -> bool:
    """Whether ``p`` is held whole beside its shard now (FSDP2 swaps the plain unsharded tensor in; ZeRO-3 marks
    it available)."""
    if hasattr(p, "ds_status"):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return p.ds_status != ZeroParamStatus.NOT_AVAILABLE
    from torch.distributed.tensor import DTensor

    return torch.distributed.is_initialized() and not isinstance(p, DTensor)


def _references(rank: int, world: int, overrides: list, out: str) -> None:
    """A pool rank (one call per engine: each its own port, so its own process group): the engine's ``prepare``
    and ``reference_model`` as ``worker.main`` calls them, then the logits of both on a fixed batch, one optimizer
    step of the policy, and the logits again."""
    import torch.distributed as dist
    from hydra.utils import get_object

    from shardyard.core.dist_env import detect
    from shardyard.models.build import build_model, wants_meta
    from shardyard.models.loss import logits
    from shardyard.planning.validate import validate

    cfg = compose(overrides, out)
    plan = validate(cfg, detect())
    backend = get_object(cfg.backend._target_)(cfg, plan)
    try:
        backend.init()

        def build(allow_meta: bool, model_cfg=None) -> torch.nn.Module:  # worker.main's, for a full fine-tune
            m = cfg.model if model_cfg is None else model_cfg  # the reference's own model section (its weights)
            return build_model(m, cfg.seed, on_meta=allow_meta and wants_meta(m, plan.facts))

        backend.prepare(build, cfg.train.steps)
        torch.manual_seed(1234 + rank)  # the per-rank streams worker.main seeds after prepare
        before = torch.get_rng_state()
        ref = backend.reference_model(build)
        rng_kept = torch.equal(torch.get_rng_state(), before)
        again = backend.reference_model(build) is ref
        engine = getattr(backend, "engine", None)  # DeepSpeed's: the policy as it trains
        stepper = getattr(backend, "stepper", None)
        policy = engine if engine is not None else backend.hf_model()
        ids = _batch(cfg.model.vocab_size).to(backend.device)

        def policy_logits() -> torch.Tensor:  # in the policy's numerics: the stepper's autocast where it has one
            with torch.no_grad(), stepper.autocast() if stepper is not None else contextlib.nullcontext():
                return logits(policy(ids)).float().cpu()

        policy_held = [_held(p) for p in backend.hf_model().parameters()]  # before a forward gathers the root
        p0 = policy_logits()
        out_ref = logits(ref(ids))  # no no_grad here: the reference's own forward runs without a graph
        r0 = out_ref.float().cpu()
        params = list(ref.parameters())
        held = [_held(p) for p in params]
        state = {
            "rng_kept": rng_kept, "again": again,
            "training": sum(m.training for m in getattr(ref, "module", ref).modules()),  # inside DeepSpeed's engine
            "graph": out_ref.requires_grad or out_ref.grad_fn is not None,
            "requires_grad": sum(p.requires_grad for p in params),
            "held": sum(h for h, _ in held) / sum(n for _, n in held),
            "gathered_after_forward": sum(_gathered(p) for p in params),
            "policy_held": sum(h for h, _ in policy_held) / sum(n for _, n in policy_held),
        }
        ds_optimizer = getattr(ref, "optimizer", None)
        state["ds_optimizer"] = None if ds_optimizer is None else (
            type(ds_optimizer).__name__, bool(getattr(ds_optimizer, "using_real_optimizer", False)))
        if stepper is not None:
            trained = {id(p) for g in stepper.optimizer.param_groups for p in g["params"]}
            state["in_optimizer"] = sum(id(p) in trained for p in params)
        rows, seq = ids.shape
        backend.forward_backward(ids, ids, True, torch.tensor(1.0 / (rows * seq), device=backend.device))
        backend.step()
        state["grads"] = sum(p.grad is not None for p in ref.parameters())
        p1, r1 = policy_logits(), logits(ref(ids)).float().cpu()
        found = {**state, "p0": p0, "r0": r0, "p1": p1, "r1": r1}
    finally:
        try:
            backend.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    torch.save(found, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference")
    found = {}
    for world, jobs in ((1, WORLD1), (2, WORLD2)):
        jobs = {name: [*BASE, f"train.global_batch_size={4 * world}", *o] for name, o in jobs.items()}
        for name, overrides in jobs.items():
            out = d / name.replace(" ", "-")
            out.mkdir()
            on_ranks(world, _references, overrides, str(out))
            found[name] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return found


@pytest.fixture(scope="module")
def truth():
    """The logits of a single process's plain build of the model (fp32, no engine)."""
    from shardyard.models.build import build_model
    from shardyard.models.loss import logits

    cfg = compose([*BASE, "backend=single"])
    model = build_model(cfg.model, cfg.seed).eval()
    with torch.no_grad():
        return logits(model(_batch(cfg.model.vocab_size))).float()


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("engine", [*WORLD1, *WORLD2])
def test_reference_gives_the_policys_logits_and_stays_frozen(engine, references, truth):
    if engine not in references:
        pytest.skip("Horovod is not installed")
    for rank, r in enumerate(references[engine]):
        what = f"{engine} rank {rank}"
        assert _diff(r["r0"], r["p0"]) <= 1e-5, f"{what}: reference vs policy at step 0: {_diff(r['r0'], r['p0']):.2e}"
        if "bf16" in engine:  # in the policy's numerics, which bf16 moved far from fp32's
            assert _diff(r["r0"], truth) > 1e-3, f"{what}: the reference ran in fp32 ({_diff(r['r0'], truth):.2e})"
        elif "zero.Init" not in engine:  # (zero.Init initialises the partitions from other random draws)
            assert _diff(r["r0"], truth) <= 1e-5, f"{what}: reference vs single process {_diff(r['r0'], truth):.2e}"
        assert torch.equal(r["r1"], r["r0"]), f"{what}: the policy's step moved the reference"
        assert _diff(r["p1"], r["p0"]) > 1e-3, f"{what}: the policy did not train ({_diff(r['p1'], r['p0']):.2e})"
        assert (r["requires_grad"], r["grads"], r["graph"], r["training"]) == (0, 0, False, 0), r
        assert r["rng_kept"] and r["again"], r
        assert r.get("in_optimizer", 0) == 0, r
        if engine.startswith("zero"):  # no optimizer: ZeRO-3's parameter hooks, stage 0's bf16 shell, or none
            want = ("DeepSpeedZeRoOffload", False) if engine.startswith("zero3") else \
                ("BF16_Optimizer", False) if "bf16" in engine else None
            assert r["ds_optimizer"] == want, r["ds_optimizer"]


@pytest.mark.parametrize("engine", [*WORLD1, *WORLD2])
def test_reference_is_sharded_as_the_policy(engine, references):
    """Per rank, the share of the reference's parameters held equals the policy's: half on FSDP and ZeRO-3 at
    world 2 (and on fsdp_tp, dp=1 x tp=2), the whole on the replica engines (ZeRO-1/2 shard no parameters); the
    sharded references hold nothing gathered after their forward."""
    if engine not in references:
        pytest.skip("Horovod is not installed")
    for rank, r in enumerate(references[engine]):
        assert abs(r["held"] - r["policy_held"]) <= 0.01, (engine, rank, r["held"], r["policy_held"])
        if engine in SHARDED or engine == "fsdp_tp":
            assert 0.45 <= r["held"] <= 0.55, (engine, rank, r["held"])
            assert r["gathered_after_forward"] == 0, (engine, rank, r["gathered_after_forward"])
        else:
            assert r["held"] == 1.0, (engine, rank, r["held"])
