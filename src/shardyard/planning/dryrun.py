"""The dry run (``plan.dry_run=true``): the run itself at the recipe's real world size, on this CPU, before a GPU
is rented; it measures what the plan predicts, and the two must agree.

One simulated rank per process, side by side on this machine's cores (``simulate_all``): a fake process group
of the real world size (collectives that move nothing, ``torch.testing._internal.distributed.fake_pg``) and fake
tensors (``FakeTensorMode``: shapes, dtypes and bytes, no storage), under which the engine's own ``init`` and ``prepare`` build the real device mesh, the real
FSDP2 / tensor-parallel / pipeline / expert-parallel wrapping of the model (built on the meta device), the real
optimizer; then two optimizer steps of real micro-batch shapes run under PyTorch's memory tracker
(``torch.distributed._tools``), and the second step's peak of every category is set beside the plan's figure:

    figure          the plan's                          the tracker's (per category, its largest value)
    params          parameters this rank holds          sharded parameters (the whole model on a replica)
    grads           gradients this rank holds           sharded gradients
    optimizer       optimizer state + master weights    optimizer state
    buffers         the engine's own buffers            unsharded parameters and gradients, all-gather and
                                                        reduce-scatter buffers (FSDP2)
    activations     activations of one micro-batch      activations and temporaries
    peak            the device's peak                   the peak of the sum

Which ranks are simulated is the engine's to say (``dry_run_roles``): those whose figures can differ (the first
and the last of an uneven shard, every distinct pipeline stage, the two ends of an expert-parallel group).
What a dry run cannot see: time, communication buffers of the collective library (NCCL's own), the caching
allocator's fragmentation, and routing: a MoE layer routes its tokens uniformly here (fake tensors have no
values to route by), the load balancing aims for and the dropless buffers of a collapsed routing exceed.
The engines that cannot run on fake tensors (DeepSpeed allocates its flat partitions with real storage and
reads them on the host; Horovod's and DDP's gradient buckets are C++ buffers) run one replica (the ``single``
engine's code, which DDP and Horovod wrap; for ZeRO the model in the compute dtype without autocast, as DeepSpeed
runs it) and add what they cannot measure by arithmetic, marked as not compared: the buckets, ZeRO's buffers;
ZeRO's model states are held against DeepSpeed's own estimators.

The verdict is two answers (``main``): whether the measured peak fits the hardware with the plan's margin
(``plan.measured_fit``), and whether every figure compared agrees with the plan; exit 0 only when both hold.
docs/plan.md, "The dry run", shows one (``DOC_RUN``, written by ``python -m shardyard.planning.dryrun --write-doc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import sys
import time
from typing import Any, Iterator

from omegaconf import DictConfig, open_dict

from shardyard.core.errors import UserError
from shardyard.core.memory import local
from shardyard.core.facts import Plan

GiB = float(2 ** 30)
TOLERANCE = 0.10
"""A figure agrees with the plan when within 10% of it ..."""
NEGLIGIBLE = 0.02
"""... or when both are under 2% of the rank's planned peak (a category the plan rounds to nothing)."""
FIGURES = ("params", "grads", "optimizer", "buffers", "activations", "peak")


@dataclasses.dataclass(frozen=True)
class Role:
    rank: int
    """The global rank simulated."""
    what: str
    """What sets it apart (``first stage``, ``last shard`` ...)."""
    kind: int = 0
    """Which of the plan's kinds of rank it is (``plan.estimate_kinds``: a pipeline's stage)."""


def main(cfg: DictConfig, batch: Plan) -> int:
    """``plan.dry_run=true``: simulate the roles, print the table beside the plan and the verdict: whether the
    measured peak fits the hardware (with the plan's margin) and whether every figure agrees with the plan; 0
    when both hold, 1 otherwise (saying which failed and what to do)."""
    from shardyard.models import adapters
    from shardyard.planning import plan as memory_plan
    from shardyard.backends import engine

    kind = getattr(engine(cfg.backend), "dry_run", None)
    if kind is None:
        raise UserError("backend", cfg.backend.name, "Its engine says nothing of how to dry-run it (a class "
                        "attribute `dry_run`: `engine`, `estimators` or `replica`).",
                        "Dry-run the recipe on an engine of shardyard's (fsdp, fsdp_offload, fsdp_tp, pipeline: the "
                        "real engine; ddp, horovod, single: one replica; zero1-3: one replica as ZeRO runs it, "
                        "and DeepSpeed's estimators), or plan.only=true for the plan alone.")
    hw = memory_plan.hardware(cfg, batch)
    kinds = memory_plan.estimate_kinds(cfg, batch, hw)
    e = max(kinds, key=lambda k: k.device_peak)
    started = time.time()
    print(f"shardyard | dry run of {cfg.backend.name} at world {batch.world_size} ({hw.name}, {hw.nodes} node(s)); "
          f"{batch.dims.describe()}", flush=True)
    notes: list[str] = []
    unchecked: dict[str, str] = {}  # figure -> why it is the plan's arithmetic, not a measurement
    if kind == "estimators":
        # DeepSpeed's ZeRO engines do not run on fake tensors (see below): one replica runs as ZeRO runs it (the
        # model in the compute dtype, no autocast; the same micro-batch and checkpointing) for the activations;
        # the model states are held against DeepSpeed's own estimators; the buffers are the plan's arithmetic.
        role = Role(0, "one replica, as ZeRO runs it")
        got = simulate(cfg, batch, role, replica=True, in_compute_dtype=True)
        plan = planned(e, hw)
        rows = [(role, {**plan, "activations": got["activations"],
                        "peak": plan["peak"] - plan["activations"] + got["activations"]})]
        why = ("the plan's, held against DeepSpeed's real engines by tests/dist/test_model_states.py (its estimators "
               "assume mixed precision)" if cfg.precision.name == "fp32" else
               "compared together, as model states, with DeepSpeed's estimators (the line on model states)")
        unchecked = {"params": why, "grads": why, "optimizer": why,
                     "buffers": "DeepSpeed's reduce bucket and ZeRO-3's gathered modules are flat buffers it "
                                "allocates with real storage (the plan's arithmetic)"}
        notes.append(deepspeed_check(cfg, batch, hw, e))
        notes.append("activations: one replica of the model in the compute dtype without autocast (as DeepSpeed "
                     "runs it), the run's micro-batch and checkpointing, under fake tensors and PyTorch's memory "
                     "tracker; peak: the plan's model states and buffers with the measured activations")
    else:
        roles = [Role(*r) for r in engine(cfg.backend).dry_run_roles(cfg, batch.dims)] \
            if kind == "engine" else [Role(0, "one replica")]
        rows = list(zip(roles, simulate_all(cfg, batch, roles, replica=kind == "replica")))
        if kind == "replica":  # the wrapper's buckets by arithmetic: the plan's figure, added to the peak
            buckets = e.device.get("buffers", 0.0) + e.host.get("buffers", 0.0)
            rows = [(role, {**got, "buffers": buckets, "peak": got["peak"] + buckets}) for role, got in rows]
            notes.append(replica_note(cfg, e))
            unchecked["buffers"] = "the wrapper's gradient buckets are C++ buffers (the plan's arithmetic)"
            if adapters.method(cfg.peft).quantized_base:  # 4-bit NF4 kernels are CUDA-only: the base ran unquantised
                nf4 = planned(e, hw)["params"]
                rows = [(role, {**got, "params": nf4, "peak": got["peak"] - got["params"] + nf4}) for role, got in rows]
                notes.append(f"peft={cfg.peft.name}: the base was simulated unquantised (bitsandbytes' 4-bit kernels "
                             f"are CUDA-only); its NF4 parameters are the plan's arithmetic, {nf4 / GiB:.2f} GiB")
                unchecked["params"] = "the NF4 base's bytes (the plan's arithmetic)"
    agree, text = report(rows, kinds, hw, tuple(unchecked))
    for n in notes:
        agree = agree and not n.startswith("DISAGREES")
    if unchecked:
        notes.append("not compared (~: the plan's figure stands in the measured column): "
                     + "; ".join(f"{f}: {why}" for f, why in unchecked.items()))
    fit, fit_text = fits(cfg, rows, kinds, hw)
    # this process's largest resident set, and each role's process's (they ran side by side: counted once each)
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
           + _side_by_side(len(rows)) * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2 ** 20
    print("\n".join([t for t in [text, *notes] if t]), flush=True)
    exceptions = f" but those marked ~, not compared ({', '.join(unchecked)})" if unchecked else ""
    agrees_text = (f"yes, every figure within {TOLERANCE:.0%} of the plan{exceptions}" if agree else
                   f"no, it DISAGREES with the plan beyond {TOLERANCE:.0%} (marked !)")
    print(f"shardyard | dry run: fits {hw.nodes} node(s) of {hw.name}: {fit_text}\n"
          f"shardyard | dry run: agrees with the plan: {agrees_text}", flush=True)
    if not fit:
        print(f"shardyard | dry run: does not fit: {advice(cfg, batch, hw, rows, kinds)}", flush=True)
    if not agree:
        print("shardyard | dry run: disagrees: the measured figures are what the engine holds; the plan's figure "
              "marked ! needs correcting (docs/plan.md, \"The dry run\"): trust the measured peak meanwhile", flush=True)
    verdict = "fits and agrees" if fit and agree else " and ".join(
        w for w, bad in (("does not fit", not fit), ("disagrees", not agree)) if bad)
    print(f"shardyard | dry run: {verdict}, exit {0 if fit and agree else 1}; {time.time() - started:.0f} s, "
          f"{rss:.2f} GiB of this machine's memory at most (no real parameter allocated)", flush=True)
    return 0 if fit and agree else 1


def fits(cfg: DictConfig, rows: list[tuple[Role, dict[str, float]]], kinds: list[Any], hw: Any) -> tuple[bool, str]:
    """Whether every simulated rank's measured peak fits the hardware with the plan's margin (``plan.measured_fit``:
    the CUDA runtime added, ``plan.headroom`` of the device), and the sentence that says so of the fullest."""
    from shardyard.planning import plan as memory_plan

    if not rows:
        return True, "nothing simulated"
    checked = [(role, memory_plan.measured_fit(kinds[role.kind], hw, got["peak"], cfg.plan.headroom))
               for role, got in rows]
    role, m = max(checked, key=lambda c: (not c[1].fits, c[1].device_peak))
    ok = all(c.fits for _, c in checked)
    where = f"rank {role.rank} ({role.what})"
    if hw.device == "cpu":
        need, have = m.device_peak * hw.ranks_per_node, hw.host_bytes * cfg.plan.headroom
        size = (f"{hw.ranks_per_node} rank(s) x {m.device_peak / GiB:.2f} GiB (the measured peak of rank {role.rank}, "
                f"{role.what}, with the worker's runtime) = {need / GiB:.2f} GiB of host RAM, of the {have / GiB:.1f} GiB the plan may "
                f"fill ({cfg.plan.headroom:.0%} of {hw.host_bytes / GiB:.1f} GiB)")
    else:
        need, have = m.device_peak + memory_plan.CUDA_RUNTIME_BYTES, (hw.device_bytes or 0.0) * cfg.plan.headroom
        size = (f"the measured peak of {where}, {m.device_peak / GiB:.2f} GiB + "
                f"{memory_plan.CUDA_RUNTIME_BYTES / GiB:.0f} GiB of CUDA runtime = {need / GiB:.2f} GiB per GPU, of the "
                f"{have / GiB:.1f} GiB the plan may fill ({cfg.plan.headroom:.0%} of {(hw.device_bytes or 0) / GiB:.1f} GiB)")
    if ok:
        return True, f"yes, {size}"
    return False, f"NO, {size}" + ("" if need > have else f"; {m.shortfall}")


def advice(cfg: DictConfig, batch: Plan, hw: Any, rows: list[tuple[Role, dict[str, float]]], kinds: list[Any]) -> str:
    """What to do when the measured peak does not fit: the fewest nodes (that the recipe can be dry-run at as it is)
    on which the plan fits with the margin this run measured over it, to dry-run next."""
    from shardyard.planning import plan as memory_plan

    over = max([1.0] + [got["peak"] / p for role, got in rows if (p := planned(kinds[role.kind], hw)["peak"]) > 0])
    tighter = cfg.copy()
    with open_dict(tighter):
        tighter.plan.headroom = cfg.plan.headroom / over
    n = memory_plan.nodes_needed(tighter, batch, hw, whole_batch=True)
    if n is not None and n > hw.nodes:
        return (f"dry-run plan.nodes={n}, the fewest nodes of {hw.name} on which the plan fits"
                + (f" with the {over - 1:.0%} this run measured over it" if over > 1 else "")
                + " (and the recipe's layout and global batch can use); or plan.only=true for other engines and "
                  "settings that fit")
    return (f"no node count of {hw.name} up to {memory_plan.MAX_NODES} fits it as it is: plan.only=true lists "
            "other engines and settings (full activation checkpointing, a smaller micro batch) that do")


# ------------------------------------------------------------------------------------------ one rank's run
def _side_by_side(roles: int) -> int:
    """How many roles ``simulate_all`` runs at once: one process per core this process may use, at most one per
    role; none (0) when there is one role or one core (it runs here)."""
    n = min(roles, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    return n if n > 1 else 0


def simulate_all(cfg: DictConfig, batch: Plan, roles: list[Role], replica: bool = False) -> list[dict[str, float]]:
    """``simulate`` of every role, side by side: each role is independent (its own fake process group, engine
    and fake tensors) and costs minutes of one core on a large model (fake tensors cost per operation: a V3
    pipeline stage runs every micro-batch in flight twice), so the roles run in a pool of processes forked from
    this one, one per core (its imports inherited: a tiny model's roles cost no more than in order; the dry run
    never makes a CUDA context, and the run's own CPU workers are forked the same way, ``launch.elastic``); in
    order, here, with one core or one role."""
    workers = _side_by_side(len(roles))
    if not workers:
        return [simulate(cfg, batch, role, replica=replica) for role in roles]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_simulate_one, [(cfg, batch, role, replica) for role in roles]))


def _simulate_one(job: tuple[DictConfig, Plan, Role, bool]) -> dict[str, float]:
    cfg, batch, role, replica = job
    return simulate(cfg, batch, role, replica=replica)


def simulate(cfg: DictConfig, batch: Plan, role: Role, replica: bool = False,
             in_compute_dtype: bool = False) -> dict[str, float]:
    """Rank ``role.rank`` of ``batch.world_size`` (``replica``: one replica on the ``single`` engine): the
    engine's ``init`` and ``prepare`` over a fake process group, two optimizer steps on fake tensors; the
    second step's largest bytes by category. ``in_compute_dtype``: the replica's model cast to the precision's
    compute dtype and run without autocast, as DeepSpeed's ZeRO engines run it (their activations)."""
    import torch
    import torch.distributed as dist
    from hydra.utils import get_object
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardyard.models import adapters
    from shardyard.planning import plan as memory_plan
    from shardyard.backends import engine
    from shardyard.backends.expert_parallel import assume_uniform_routing
    from shardyard.backends.torch_step import COMPUTE_DTYPES
    from shardyard.models.build import build_model, materialized_in

    batch_cfg = cfg  # the run's own engine (a replica is simulated on ``single``)
    cfg = _simulated_config(cfg, replica)
    world = 1 if replica else batch.world_size
    plan = dataclasses.replace(batch, device_type="cpu")
    env = {"RANK": str(role.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(role.rank % batch.nproc_per_node),
           "LOCAL_WORLD_SIZE": str(batch.nproc_per_node)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if not replica:
        dist.init_process_group("fake", store=FakeStore(), rank=role.rank, world_size=world)
    backend = get_object(cfg.backend._target_)(cfg, plan)
    try:
        backend.init()

        def build(allow_meta: bool, model_cfg: Any = None) -> torch.nn.Module:  # on the meta device: the engine
            m = cfg.model if model_cfg is None else model_cfg  # materialises it (model_cfg: a reference's section)
            model = build_model(m, cfg.seed, on_meta=True)
            model = adapters.apply(model, cfg.peft, cfg.seed, COMPUTE_DTYPES[cfg.precision.name])
            return model.to(COMPUTE_DTYPES[cfg.precision.name]) if in_compute_dtype else model

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        # The wrapping runs as in the run, on the meta tensors (FSDP2's sharding reads values fake tensors do not
        # have), and storage comes from the fake mode.
        from shardyard.objectives import held

        with materialized_in(mode):
            backend.prepare(build, cfg.train.steps)
            if held(cfg.objective)[0] and batch.facts.trainable is None:  # DPO, GRPO with a KL term: the frozen
                backend.reference_model(build)  # reference, held as the engine holds the policy (the plan's `reference`)
        if in_compute_dtype:  # the parameters are in the compute dtype already: no autocast (DeepSpeed has none)
            backend.stepper.autocast_on = False
        gpu = memory_plan.hardware(batch_cfg, batch).device == "cuda"  # the hardware simulated, not this machine
        with mode, assume_uniform_routing(), fp32_grouped_gemms(), \
                (gpu_attention() if gpu else contextlib.nullcontext()):
            # An engine whose schedule talks to its peers to run (the pipeline's shape handshake) plays its part
            # of a step alone here.
            run_micro = getattr(backend, "simulated_forward_backward", backend.forward_backward)
            # A micro-batch as the objective runs it (DPO: a chosen and a rejected row per pair; GRPO: G prompt +
            # completion rows per prompt), through the plain loss: the activations of one forward and backward.
            rows = batch.micro_batch_size * batch.sequences_per_sample
            ids = torch.randint(0, int(batch.facts.embedding_rows or 2), (rows, batch.sequence_len or batch.seq_len))
            weight = torch.ones(())
            accum = min(batch.grad_accum_steps, 2)  # what accumulation holds shows from the second micro-batch on
            # The measured step is a second one, as every step after the first runs: the engine set up (FSDP2 on
            # its first forward), the optimizer state made (by the first step, untracked), the gradients freed by
            # that step unless the engine keeps them in buffers of its own (DDP's: ``dry_run_keeps_gradients``).
            run_micro(ids, ids, True, weight)
            backend.step()
            if getattr(engine(batch_cfg.backend), "dry_run_keeps_gradients", lambda c: False)(batch_cfg):
                for p in backend.stepper.params:
                    p.grad = torch.zeros_like(p)
            tracker = _Tracker(backend)
            with tracker:
                for micro in range(accum):
                    tracker.inner.reset_mod_stats()  # its per-module figures (not read) hold one forward
                    run_micro(ids, ids, micro == accum - 1, weight)
                    tracker.release()
                tracker.settle("grads")  # what the step reads (not the transient of adding one into another)
                backend.step()
            return tracker.figures()  # read after the step: the optimizer state it keeps
    finally:
        try:
            backend.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """Attention as a GPU computes it: PyTorch's SDPA on CPU falls back to its math kernel (the whole
    [heads, T, T] matrix, 25 GiB for one DeepSeek-V3 sequence of 4096) when the value head differs from the key's
    (MLA: 128 vs 192), where a GPU runs the memory-efficient kernel (O(T) saved: the output and the log-sum-exp).
    On fake tensors that kernel's shapes need no GPU. ``F.scaled_dot_product_attention`` is replaced for the
    simulation's duration (a function mode would not reach activation checkpointing's recompute alike)."""
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def efficient(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: Any = None, enable_gqa: bool = False) -> Any:
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
        out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, True, dropout_p, is_causal and attn_mask is None, scale=scale)
        return out

    F.scaled_dot_product_attention = efficient  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def fp32_grouped_gemms() -> Iterator[None]:
    """transformers' experts (a replica's MoE layers, without expert parallelism) run torch's grouped GEMM for any
    dtype on CPU, whose CPU kernel takes fp32 and whose meta kernel, the one fake tensors run, takes bf16 only: for
    the simulation's duration a non-bf16 grouped GEMM takes transformers' own fallback (a GEMM per expert into
    one output, the same shapes), as ``expert_parallel.fused_grouped_mm`` does for the expert-parallel layers."""
    import torch

    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without it runs its experts otherwise
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def bf16_only(input: Any, weight: Any, offs: Any) -> bool:
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    moe._can_use_grouped_mm = bf16_only
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _simulated_config(cfg: DictConfig, replica: bool) -> DictConfig:
    """The run's config as the simulation runs it: no weights read (the meta build stays random), the CPU
    device (the fake tensors' place), and for a replica the ``single`` engine that DDP and Horovod wrap."""
    cfg = cfg.copy()
    with open_dict(cfg):
        if "weights" in cfg.model:
            cfg.model.weights = None
        cfg.model.compile = False  # inductor does not compile fake tensors; compiled regions hold what eager does
        if "device" in cfg.backend:
            cfg.backend.device = "cpu"
        if replica:
            cfg.backend._target_ = "shardyard.backends.single.SingleBackend"
    return cfg


def _unsharded_grads(p: Any) -> list:
    """The gradients FSDP2 keeps unsharded for a parameter between reductions: the fp32 accumulation, or the
    unsharded parameter's own gradient where it accumulates in the compute dtype."""
    acc = getattr(p, "unsharded_accumulated_grad", None)
    own = getattr(getattr(p, "_unsharded_param", None), "grad", None)
    return [g for g in (acc, own) if g is not None]


class _NoHook:
    def remove(self) -> None:
        pass


CATEGORIES = {
    # figure -> the tracker's categories (FSDPMemTracker's, then MemTracker's names)
    "params": ("Sharded Param", "Parameter"),
    "grads": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "buffers": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter", "Buffer"),
    "activations": ("Activation", "Temp"),
    "peak": ("Total",),
}


class _Tracker:
    """PyTorch's memory tracker for the engine's model and optimizer (``FSDPMemTracker`` on one FSDP2 root,
    ``MemTracker`` otherwise), keeping the largest value of each figure (``CATEGORIES``: sums of the tracker's
    categories) besides the peak of the whole. Reads the trackers' snapshot as torch 2.13 keeps it."""

    def __init__(self, backend: Any):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        optimizer = backend.stepper.optimizer
        roots: list[Any] = list(getattr(backend, "stages", None) or [backend.hf_model()])
        self.root: Any = None
        if len(roots) == 1 and isinstance(roots[0], FSDPModule):
            self.root = roots[0]
            self.inner: Any = FSDPMemTracker(self.root, optimizer)
        else:
            self.inner = MemTracker()
            self.inner.track_external(backend.hf_model(), optimizer)
        self.frozen = [p for p in backend.hf_model().parameters() if not p.requires_grad]
        # FSDP2 accumulates gradients unsharded between reductions (the pipeline's schedule: every backward of a
        # step without one) in tensors of its own that the tracker counts as backward temporaries: they are the
        # engine's buffers.
        groups = [g for m in backend.hf_model().modules() if isinstance(m, FSDPModule)
                  for g in m._get_fsdp_state()._fsdp_param_groups]
        self.fsdp_params = [p for g in groups for p in g.fsdp_params]
        self.entered: float | None = None  # the backward temporaries when a post-backward began (in one: a float)
        self.held = 0  # those bytes, counted again after each post-backward (where FSDP2 accumulates and frees them)
        for g in groups:
            g.post_backward = self._recount_after(g.post_backward)  # type: ignore[method-assign]
        # A root's group (embedding, head) is reduced once, at the end of the step; its gradient, kept unsharded in
        # the compute dtype meanwhile, is counted at every change (a few tensors).
        roots = [m for m in roots if isinstance(m, FSDPModule)]
        self.root_params = [p for m in roots for g in m._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]
        self.most: dict[str, float] = {}
        self.settled: dict[str, float] = {}
        def update(state: Any) -> None:
            # Every change of the tracked memory passes here. The tracker's own per-module peaks (a walk over
            # every module at every op: minutes on a model with adapters) are not read, so not kept.
            for snap in self.inner._curr_mem_snap.values():
                named = self._named(snap)
                for figure, cats in CATEGORIES.items():
                    v = float(sum(named.get(c, 0) for c in cats))
                    if v > self.most.get(figure, 0.0):
                        self.most[figure] = v

        self.inner._update_peak_stats = update

    def _recount_after(self, post_backward: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # what FSDP2 allocates in its post-backward (the fp32 accumulation of a block's gradients, the cast
            # that fills it, the reduce-scatter input) is the engine's, though the tracker sees backward temporaries
            self.entered = sum(self._temp(snap) for snap in self.inner._curr_mem_snap.values())
            try:
                out = post_backward(*args, **kwargs)
            finally:
                self.entered = None
            self.held = sum(local(g).nbytes for p in self.fsdp_params for g in _unsharded_grads(p))
            return out
        return wrapped

    @staticmethod
    def _temp(snap: dict) -> float:
        return float(sum(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Temp"))

    def _named(self, snap: dict) -> dict[str, float]:
        named = {str(getattr(k, "value", k)): float(v) for k, v in snap.items()}
        held = max(self.held, sum(local(g).nbytes for p in self.root_params for g in _unsharded_grads(p)))
        if self.entered is not None:
            held += max(named.get("Temp", 0.0) - self.entered, 0.0)
        moved = min(held, named.get("Temp", 0.0))  # what the tracker has not counted as unsharded gradients already
        if moved:
            named["Temp"] -= moved
            named["Unsharded Grad"] = named.get("Unsharded Grad", 0.0) + moved
        return named

    def __enter__(self) -> _Tracker:
        # PyTorch's module tracker hooks every tracked module's inputs that require gradients with a multi-grad hook
        # whose closure holds those tensors' gradient nodes, and the hook sits on the tensors: a cycle through C++
        # that nothing collects. A pipeline stage's received hidden states (leaves) and their gradients would stay
        # alive after the step that used them, one more set with every micro-batch of accumulation (the dry run of
        # deepseek_v3_pipeline_ep measured 2 GiB more stage activations at 16 nodes, accumulation 4, than at 64,
        # accumulation 1). The hooks are kept here and removed after each micro-batch (``release``).
        from torch.distributed._tools import mod_tracker

        self.handles: list[Any] = []
        self.register = mod_tracker.register_multi_grad_hook

        def register(*args: Any, **kwargs: Any) -> Any:
            handle = self.register(*args, **kwargs)
            self.handles.append(handle)
            return handle

        mod_tracker.register_multi_grad_hook = register
        self.inner.__enter__()
        if self.root is None:
            # torch 2.13's MemTracker hooks every parameter's gradient, and a frozen one (an adapter's base) takes
            # no hook: it is marked as hooked already (its gradient never exists).
            for p in self.frozen:
                self.inner._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        if self.root is not None:  # after the tracker's own hooks, which it registers on entering, and before them:
            # its per-module figures (not read here) hold one forward of the root at a time (a pipeline stage runs
            # several micro-batches forward before their backward), so they are cleared before each
            self.hook = self.root.register_forward_pre_hook(lambda *_: self.inner.reset_mod_stats(), prepend=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed._tools import mod_tracker

        if self.root is not None:
            self.hook.remove()
        self.inner.__exit__(*exc)
        mod_tracker.register_multi_grad_hook = self.register
        self.release()

    def release(self) -> None:
        """Remove the module tracker's hooks on the inputs of a micro-batch that has run its backward (``__enter__``):
        its tensors are then freed as the engine frees them."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def settle(self, figure: str) -> None:
        """``figure`` as it is now (what the engine holds), in place of its largest value."""
        for snap in self.inner._curr_mem_snap.values():
            named = self._named(snap)
            self.settled[figure] = float(sum(named.get(c, 0) for c in CATEGORIES[figure]))

    def figures(self) -> dict[str, float]:
        """Each figure's largest value; the gradients as the backward left them and the optimizer's state as
        the step did: what they hold, not the temporaries of adding to them (those count in the peak)."""
        self.settle("optimizer")
        return {f: self.settled.get(f, self.most.get(f, 0.0)) for f in CATEGORIES}


# ----------------------------------------------------------------------------------------- beside the plan
def planned(e: Any, hw: Any) -> dict[str, float]:
    """The plan's figures for one rank in the dry run's terms (``e``: ``plan.Estimate``): on a CPU plan the
    worker's own runtime is not a tensor, so it is left out of the peak."""
    d = {k: e.device.get(k, 0.0) + e.host.get(k, 0.0) for k in {*e.device, *e.host}}  # offload: fake tensors
    # live in one pool, so what the plan puts in host RAM is counted with the device's
    return {"params": d.get("params", 0.0) + d.get("reference", 0.0), "grads": d.get("grads", 0.0),
            "optimizer": d.get("optimizer", 0.0) + d.get("master", 0.0), "buffers": d.get("buffers", 0.0),
            "activations": d.get("activations", 0.0),
            "peak": e.device_peak + e.host_peak - d.get("runtime", 0.0)}


def agrees(measured: float, plan: float, peak: float) -> bool:
    return abs(measured - plan) <= TOLERANCE * plan or max(measured, plan) <= NEGLIGIBLE * peak


def report(rows: list[tuple[Role, dict[str, float]]], kinds: list[Any], hw: Any,
           unchecked: tuple[str, ...] = ()) -> tuple[bool, str]:
    """The table: per simulated rank its measured figures beside the plan's for that kind of rank (``kinds``:
    ``plan.estimate_kinds``), a figure that disagrees marked ``!``, one not measured (``unchecked``: the plan's
    arithmetic stands in for it) shown as ``-`` and marked ``~``; whether all those compared agree."""
    if not rows:
        return True, ""
    head = f"{'rank':>6} {'role':30} " + " ".join(f"{f:>18}" for f in FIGURES)
    lines = ["GiB per rank: measured (plan); ! where they differ by more than "
             f"{TOLERANCE:.0%} (and more than {NEGLIGIBLE:.0%} of the peak)"
             + ("; - (plan)~ where not compared" if unchecked else ""), head, "-" * len(head)]
    ok, worst = True, (0.0, "")
    for role, got in rows:
        plan = planned(kinds[role.kind], hw)
        cells = []
        for f in FIGURES:
            if f in unchecked:
                cells.append(f"{'-':>8} ({plan[f] / GiB:6.2f})~")
                continue
            good = agrees(got[f], plan[f], plan["peak"])
            ok = ok and good
            cells.append(f"{got[f] / GiB:8.2f} ({plan[f] / GiB:6.2f}){' ' if good else '!'}")
            off = abs(got[f] / plan[f] - 1) if plan[f] and not agrees(got[f], plan[f], 0.0) else 0.0
            if f != "peak" and off > worst[0] and not good:
                worst = (off, f"{f} of rank {role.rank} ({role.what})")
        lines.append(f"{role.rank:>6} {role.what[:30]:30} " + " ".join(cells))
    busiest = max(planned(k, hw)["peak"] for k in kinds)
    lines.append(f"the plan's busiest rank: {busiest / GiB:.2f} GiB per {'GPU' if hw.device == 'cuda' else 'rank'}"
                 f"; measured peak over the simulated ranks: {max((g['peak'] for _, g in rows), default=0) / GiB:.2f} GiB"
                 + (f"; furthest off: {worst[1]} by {worst[0]:.0%}" if worst[1] else ""))
    return ok, "\n".join(lines)


def replica_note(cfg: DictConfig, e: Any) -> str:
    """DDP and Horovod: every rank is one replica (simulated above on the ``single`` engine's code); what the
    wrapper adds is its gradient buckets, which the plan states by arithmetic."""
    buffers = e.device.get("buffers", 0.0)
    return (f"{cfg.backend.name}: every rank holds one whole replica, as simulated; the engine's gradient "
            f"buckets (the plan's buffers, {buffers / GiB:.2f} GiB) are C++ buffers outside fake tensors, "
            "checked by arithmetic (bucket_cap_mb / Horovod's fusion buffer)")


def deepspeed_check(cfg: DictConfig, batch: Plan, hw: Any, e: Any) -> str:
    """DeepSpeed's own model-state estimators at the recipe's size beside the plan's model states (params,
    gradients, optimizer state and master weights, device and host together), within ``TOLERANCE``."""
    import logging

    logging.disable(logging.WARNING)  # its import warns that it found no GPU
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    finally:
        logging.disable(logging.NOTSET)
    b = cfg.backend
    if cfg.precision.name == "fp32":
        return ("model states: DeepSpeed's estimators assume mixed precision (16-bit parameters and gradients), "
                "and this recipe trains in fp32: its figures are held instead against what DeepSpeed's engines "
                "allocate at 2 and 4 ranks in fp32 and bf16 (tests/dist/test_model_states.py, within 10%)")
    P, shape = batch.facts.params, batch.facts.shape
    offload_opt = str(b.get("offload_optimizer", "none")) != "none"
    offload_par = str(b.get("offload_param", "none")) != "none"
    # Without their 1.5 "additional buffer" factor, and their host figure (a node's) only where state is offloaded:
    # without offload it is the host memory of loading the model, not of training.
    if int(b.stage) == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, shape["max_module_params"], hw.ranks_per_node,
                                                            hw.nodes, cpu_offload=offload_opt,
                                                            cpu_offload_params=offload_par, zero_init=True,
                                                            additional_buffer_factor=1.0)
        gpu -= 4 * shape["max_module_params"]  # its largest-layer term is a gathered module: our buffers
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(P, hw.ranks_per_node, hw.nodes, cpu_offload=offload_opt,
                                                         additional_buffer_factor=1.0)
    theirs = gpu + (cpu / hw.ranks_per_node if offload_opt or offload_par else 0.0)
    ours = sum(e.model_states.values())
    good = abs(ours - theirs) <= TOLERANCE * theirs
    return (f"{'' if good else 'DISAGREES: '}model states per rank (device + host): plan {ours / GiB:.2f} GiB, "
            f"DeepSpeed's estimator (ZeRO-{b.stage}{', offload' if offload_opt or offload_par else ''}) "
            f"{theirs / GiB:.2f} GiB ({100 * (ours / theirs - 1):+.0f}%). DeepSpeed is not run on fake tensors: "
            "its ZeRO optimizers allocate their flat partitions with real storage and read them on the host "
            "(docs/plan.md, \"The dry run\")")


# ------------------------------------------------------------------------------------------ docs/plan.md's table
DOC_RUN = ("recipe=deepseek_v3_pipeline_ep", "plan.dry_run=true", "plan.hardware=8xH200-141GB", "plan.nodes=16")
"""The dry run whose table docs/plan.md shows (``write_doc``), checked by tests/unit/test_dryrun.py (its plan
figures, against the plan as it is) and tests/e2e/test_plan_e2e.py (the whole block, against a run)."""
DOC_MARK = "<!-- dry-run table: python -m shardyard.planning.dryrun --write-doc -->"


def doc_block(stdout: str) -> str:
    """The lines of a dry run's output that docs/plan.md shows: the table and the verdict, less what differs from
    one machine or run to the next (the seconds taken, this machine's memory)."""
    import re

    keep, table = [], False
    for line in stdout.splitlines():
        if line.startswith("GiB per rank: measured"):
            table = True
        if line.startswith("shardyard | dry run: "):
            table = False
            keep.append(re.sub(r"; \d+ s, [0-9.]+ GiB of this machine's memory at most.*$", "", line.rstrip()))
        elif table:
            keep.append(line.rstrip())
            table = not line.startswith("the plan's busiest rank")
    return "\n".join(keep)


def doc_table(doc: str) -> str:
    """The block docs/plan.md holds after ``DOC_MARK`` (its fenced text)."""
    after = doc.split(DOC_MARK, 1)[1]
    return after.split("```text\n", 1)[1].split("\n```", 1)[0]


def write_doc(path: str) -> bool:
    """Run ``DOC_RUN`` (``python -m shardyard train``, a minute or two) and write its block into ``path`` after
    ``DOC_MARK``; whether it changed."""
    import subprocess
    import tempfile

    with open(path) as f:
        doc = f.read()
    with tempfile.TemporaryDirectory() as run_dir:
        proc = subprocess.run([sys.executable, "-m", "shardyard", "train", *DOC_RUN, f"hydra.run.dir={run_dir}"],
                              capture_output=True, text=True)
    block = doc_block(proc.stdout)
    if not block:
        raise SystemExit(f"the dry run printed no table (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    head, after = doc.split(DOC_MARK, 1)
    pre, rest = after.split("```text\n", 1)
    new = head + DOC_MARK + pre + "```text\n" + block + "\n```" + rest.split("\n```", 1)[1]
    if new != doc:
        with open(path, "w") as f:
            f.write(new)
    return new != doc


if __name__ == "__main__":  # python -m shardyard.planning.dryrun --write-doc [docs/plan.md]
    if sys.argv[1:2] != ["--write-doc"]:
        raise SystemExit("usage: python -m shardyard.planning.dryrun --write-doc [docs/plan.md]")
    where = sys.argv[2] if len(sys.argv) > 2 else "docs/plan.md"
    print(f"{where}: {'rewritten' if write_doc(where) else 'unchanged'}")
