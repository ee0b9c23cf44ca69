"""One simulated rank of a dry run (:mod:`shardyard.planning.dryrun`): the engine's own ``init`` and ``prepare``
over a fake process group of the real world size and on fake tensors, two optimizer steps of real micro-batch
shapes, and PyTorch's memory tracker (``torch.distributed._tools``) reading the second step's largest bytes by
category (``simulate``); every rank a dry run asks for, side by side in forked processes (``simulate_all``).

A module of the ``planning`` package: it imports ``backends`` (the engine), ``models``, ``objectives``, ``config``
and ``core``, torch and transformers inside its functions; :mod:`shardyard.planning.dryrun` reads its figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

from omegaconf import DictConfig, open_dict

from shardyard.core.facts import Plan
from shardyard.core.memory import local

@dataclasses.dataclass(frozen=True)
class Role:
    rank: int
    """The global rank simulated."""
    what: str
    """What sets it apart (``first stage``, ``last shard`` ...)."""
    kind: int = 0
    """Which of the plan's kinds of rank it is (``plan.estimate_kinds``: a pipeline's stage)."""


# ------------------------------------------------------------------------------------------ one rank's run
def side_by_side(roles: int) -> int:
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
    workers = side_by_side(len(roles))
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
    from shardyard.planning import hardware as plan_hardware
    from shardyard.backends import engine
    from shardyard.backends import sequence_parallel
    from shardyard.backends.expert_parallel import assume_uniform_routing
    from shardyard.backends.torch_step import COMPUTE_DTYPES
    from shardyard.models.build import build_model, materialized_in
    from shardyard.models.prepare import offload_to  # model.activation_offload's host RAM: the meta device

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
            if batch.dims.sp > 1 or batch.dims.cp > 1:
                sequence_parallel.install(model)
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
        gpu = plan_hardware.hardware(batch_cfg, batch).device == "cuda"  # the hardware simulated, not this machine
        # model.activation_offload's host RAM: the meta device, measured apart, on a GPU plan; on CPU the device is
        # host RAM (one pool, as the plan counts it)
        with mode, assume_uniform_routing(), fp32_grouped_gemms(), unpacked_rows(), \
                (offload_to("meta") if gpu else contextlib.nullcontext()), \
                (gpu_attention() if gpu else contextlib.nullcontext()):
            # An engine whose schedule talks to its peers to run (the pipeline's shape handshake) plays its part
            # of a step alone here.
            run_micro = getattr(backend, "simulated_forward_backward", backend.forward_backward)
            # A micro-batch as the objective runs it (DPO: a chosen and a rejected row per pair; GRPO: G prompt +
            # completion rows per prompt), through the plain loss: the activations of one forward and backward.
            rows = batch.micro_batch_size * batch.sequences_per_sample
            ids: Any = torch.randint(0, int(batch.facts.embedding_rows or 2), (rows, batch.sequence_len or batch.seq_len))
            targets = ids
            split = sequence_parallel.groups(1, batch.dims, 0, simulated=True)
            if split is not None:  # one rank's share of the positions, its exchanges simulated (no group: buffers only)
                depths = int((cfg.model.get("mtp") or {}).get("depth", 0) or 0)  # what MTP reads past the edges
                ids, targets = sequence_parallel.shard(ids, ids, split, depths)
            weight = torch.ones(())
            accum = min(batch.grad_accum_steps, 2)  # what accumulation holds shows from the second micro-batch on
            # The measured step is a second one, as every step after the first runs: the engine set up (FSDP2 on
            # its first forward), the optimizer state made (by the first step, untracked), the gradients freed by
            # that step unless the engine keeps them in buffers of its own (DDP's: ``dry_run_keeps_gradients``).
            run_micro(ids, targets, True, weight)
            backend.step()
            if getattr(engine(batch_cfg.backend), "dry_run_keeps_gradients", lambda c: False)(batch_cfg):
                for p in backend.stepper.params:
                    p.grad = torch.zeros_like(p)
            tracker = _Tracker(backend)
            with tracker:
                for micro in range(accum):
                    tracker.inner.reset_mod_stats()  # its per-module figures (not read) hold one forward
                    run_micro(ids, targets, micro == accum - 1, weight)
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
def unpacked_rows() -> Iterator[None]:
    """The causal mask as transformers makes it for the simulated rows on real tensors: none. transformers (5) looks
    for packed sequences in the position ids (``masking_utils.find_packed_sequence_indices``: positions restarting
    within a row) and, on a FakeTensor, which it takes for tracing, cannot read them: it assumes packing and builds
    a [rows, 1, T, T] mask that a run skips (SDPA's ``is_causal``). With that mask a grouped-query attention
    (fewer key/value heads) takes ``repeat_kv`` instead of SDPA's ``enable_gqa`` (its K and V saved for every query
    head: 4 (h - hkv) bytes per token and block in bf16, 3 GiB at 32 blocks of 8192 tokens, h 4096, hkv 1024), and
    ``gpu_attention`` makes each block its own additive copy of the mask, which its kernel saves (2 T bytes per token
    and block: 4 GiB there): the dry run measured 12% more activations than the plan for that LLaMA. The simulated
    rows are never packed (plain ids, the positions transformers' own arange): on fake tensors the search finds no
    packing, as it does on the run's real ones."""
    from torch._subclasses.fake_tensor import FakeTensor

    def unpacked(original: Any) -> Any:
        return lambda position_ids: None if isinstance(position_ids, FakeTensor) else original(position_ids)

    with _replaced("transformers.masking_utils", "find_packed_sequence_indices", unpacked):
        yield


@contextlib.contextmanager
def _replaced(module: str, name: str, wrap: Any) -> Iterator[None]:
    """``module.name`` replaced by ``wrap(original)`` for the simulation's duration, and put back; nothing where the
    installed transformers has neither (it does that part otherwise)."""
    import importlib

    try:
        owner = importlib.import_module(module)
    except ImportError:
        yield
        return
    original = getattr(owner, name, None)
    if original is None:
        yield
        return
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """Attention as a GPU computes it: PyTorch's SDPA on CPU falls back to its math kernel (the whole
    [heads, T, T] matrix, 25 GiB for one DeepSeek-V3 sequence of 4096) when the value head differs from the key's
    (MLA: 128 vs 192), where a GPU runs the memory-efficient kernel (O(T) saved: the output and the log-sum-exp).
    On fake tensors that kernel's shapes need no GPU. Grouped-query attention (``enable_gqa``, fewer key/value
    heads) without a mask in bf16/fp16, head size up to 256, runs the flash kernel, as a GPU's SDPA does (the
    memory-efficient one takes no grouped heads): it saves K and V with their own heads, not repeated for every
    query head. ``F.scaled_dot_product_attention`` is replaced for the simulation's duration (a function mode
    would not reach activation checkpointing's recompute alike)."""
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def efficient(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: Any = None, enable_gqa: bool = False) -> Any:
        if (enable_gqa and k.shape[-3] != q.shape[-3] and attn_mask is None
                and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256):
            out, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)
            return out
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

    def bf16_only(original: Any) -> Any:
        return lambda input, weight, offs: weight.dtype == torch.bfloat16 and original(input, weight, offs)

    with _replaced("transformers.integrations.moe", "_can_use_grouped_mm", bf16_only):
        yield


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
        # HSDP: each group's all-reduced gradient shard, referenced by the group until the end of the backward; a
        # buffer of its own where the gradient existed already (accumulating), which the tracker sees as temporaries
        self.all_reduced: dict[int, float] = {}
        for g in groups:
            g.post_backward = self._recount_after(g, g.post_backward)  # type: ignore[method-assign]
            g.finalize_backward = self._forget_after(g, g.finalize_backward)  # type: ignore[method-assign]
        # A root's group (embedding, head) is reduced once, at the end of the step; its gradient, kept unsharded in
        # the compute dtype meanwhile, is counted at every change (a few tensors).
        roots = [m for m in roots if isinstance(m, FSDPModule)]
        self.root_params = [p for m in roots for g in m._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]
        self.most: dict[str, float] = {}
        self.settled: dict[str, float] = {}
        self.offloaded = 0.0  # the most bytes model.activation_offload held in host RAM (the meta device's)

        def update(state: Any) -> None:
            # Every change of the tracked memory passes here. The tracker's own per-module peaks (a walk over
            # every module at every op: minutes on a model with adapters) are not read, so not kept.
            for device, snap in self.inner._curr_mem_snap.items():
                if str(device) == "meta":  # host RAM (``prepare.offload_to``), not the device's
                    self.offloaded = max(self.offloaded, float(snap.get("Total", 0)))
                    continue
                named = self._named(snap)
                for figure, cats in CATEGORIES.items():
                    v = float(sum(named.get(c, 0) for c in cats))
                    if v > self.most.get(figure, 0.0):
                        self.most[figure] = v

        self.inner._update_peak_stats = update

    def _recount_after(self, group: Any, post_backward: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # what FSDP2 allocates in its post-backward (the fp32 accumulation of a block's gradients, the cast
            # that fills it, the reduce-scatter input) is the engine's, though the tracker sees backward temporaries
            self.entered = sum(self._temp(snap) for device, snap in self.inner._curr_mem_snap.items()
                               if str(device) != "meta")
            accumulating = any(p.sharded_param.grad is not None for p in group.fsdp_params)
            try:
                out = post_backward(*args, **kwargs)
            finally:
                self.entered = None
            state = getattr(group, "_all_reduce_state", None)
            if accumulating and state is not None:  # HSDP's all-reduced shard, added into the gradient and kept
                self.all_reduced[id(group)] = float(local(state.all_reduce_input).nbytes)
            self._recount()
            return out
        return wrapped

    def _forget_after(self, group: Any, finalize_backward: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = finalize_backward(*args, **kwargs)  # drops the group's all-reduce buffer
            if self.all_reduced.pop(id(group), None) is not None:
                self._recount()
            return out
        return wrapped

    def _recount(self) -> None:
        """``held``: the unsharded gradients FSDP2 keeps now, and HSDP's all-reduced shards still referenced."""
        self.held = sum(local(g).nbytes for p in self.fsdp_params for g in _unsharded_grads(p)) \
            + sum(self.all_reduced.values())

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
        for device, snap in self.inner._curr_mem_snap.items():
            if str(device) == "meta":
                continue
            named = self._named(snap)
            self.settled[figure] = float(sum(named.get(c, 0) for c in CATEGORIES[figure]))

    def figures(self) -> dict[str, float]:
        """Each figure's largest value; the gradients as the backward left them and the optimizer's state as
        the step did: what they hold, not the temporaries of adding to them (those count in the peak)."""
        self.settle("optimizer")
        return {**{f: self.settled.get(f, self.most.get(f, 0.0)) for f in CATEGORIES}, "offloaded": self.offloaded}
