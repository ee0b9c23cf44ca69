"""What else could run this recipe: every engine and expert-parallel layout on the plan's hardware
(``plan.only``'s table), the alternatives a refusal names, ranked, and the check ``run.py`` makes before launch.

A module of the ``planning`` package: it reads the per-rank figures of :mod:`shardyard.planning.plan` and the
hardware of :mod:`shardyard.planning.hardware`, composes variants of the run's config with Hydra, and imports
``backends`` (the engines' own degree keys and rank limits), ``config`` and ``core``; DeepSpeed only inside
:func:`deepspeed_estimates`, when it is installed.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from shardyard.config import checkpointing_mode
from shardyard.config.schema import Offload
from shardyard.core.errors import UserError
from shardyard.core.facts import MAX_NODES, Plan
from shardyard.planning.hardware import GiB, Hardware, hardware
from shardyard.planning.plan import (ROUTING, STAGING, Estimate, _check_fit, describe, estimate, nodes_needed,
                                     optimizer_bytes_per_param, table)

# ------------------------------------------------------------------------------- before launch (run.py)
def before_launch(cfg: DictConfig, batch: Plan, rank0: bool = True) -> tuple[Estimate, str] | None:
    """This run's plan and the line that describes it; a run that does not fit is refused (``UserError``).
    With ``plan.only`` every engine's plan is printed and None returned (the caller exits 0)."""
    hw = hardware(cfg, batch)
    if cfg.plan.search:  # every layout that fits, ranked by predicted step time (shardyard.planning.layouts)
        from shardyard.planning import layouts

        text = layouts.report(cfg, batch, hw, layouts.command_line(), backend_options(),
                              lambda extra: compose_variant(extra, drop=("backend",)))
        if rank0:
            print(text, flush=True)
        return None
    if cfg.plan.only:
        if rank0:
            print(plan_report(cfg, batch, hw), flush=True)
        return None
    e = estimate(cfg, batch, hw)
    if not e.fits and cfg.plan.check:
        staging_refusal(cfg, batch, hw, e)
        raise refusal(cfg, batch, hw, e, rank0)
    return e, describe(e, hw)


def plan_report(cfg: DictConfig, batch: Plan, hw: Hardware) -> str:
    """``plan.only``: every engine for this recipe on ``hw``, the rules of thumb, and how to read it."""
    rows = []
    for name, variant in engine_variants(cfg, hw, batch.facts.routed_experts):
        e = estimate(variant, batch, hw)
        rows.append((e, None if e.fits else nodes_needed(variant, batch, hw)))
    P = batch.facts.params
    mfu = f"at MFU {cfg.plan.mfu:.0%} of {hw.peak_flops / 1e12:.0f} TFLOP/s" if hw.peak_flops else "(no FLOP/s figure for this hardware)"
    notes = [
        f"model {cfg.model.name}: {f'{P / 1e9:.2f}B' if P >= 1e9 else f'{P / 1e6:.1f}M'} parameters | precision {cfg.precision.name} | micro batch "
        f"{batch.micro_batch_size} x seq {batch.seq_len} | activation checkpointing {checkpointing_mode(cfg.model)} "
        f"| loss chunk {cfg.model.get('loss_chunk', 0) or 'off'} "
        f"| optimizer {cfg.optim._target_} ({optimizer_bytes_per_param(cfg.optim):.0f} bytes/param)",
        "rules of thumb (ZeRO paper, mixed-precision Adam: 16 bytes/param): DDP 16P = "
        f"{16 * P / GiB:.1f} GiB; ZeRO-1 4P+12P/N = {(4 * P + 12 * P / hw.world) / GiB:.1f}; ZeRO-2 2P+14P/N = "
        f"{(2 * P + 14 * P / hw.world) / GiB:.1f}; ZeRO-3/FSDP 16P/N = {16 * P / hw.world / GiB:.1f} GiB per rank (N={hw.world})",
        f"sent/step: bytes each rank sends per optimizer step (DDP, ZeRO-1/2 ~2P, ZeRO-3/FSDP ~3P, in the "
        f"communication dtype); comm s at {(hw.intra_bw if hw.nodes == 1 else hw.inter_bw) / 1e9:.0f} GB/s per rank; "
        f"compute s {mfu}",
    ]
    notes += [f"{e.engine}: {n}" for e, _ in rows for n in e.notes if n.startswith(ROUTING)]
    ds = deepspeed_estimates(cfg, batch, hw)
    if ds:
        notes.append(ds)
    return table(rows, hw) + "\n" + "\n".join(notes)


def backend_options() -> list[str]:
    """The ``backend`` group's options in this app: shardyard's and a project's (its primary config's
    ``hydra.searchpath``)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    return GlobalHydra.instance().config_loader().get_group_options("backend", config_name=HydraConfig.get().job.config_name)


def engine_variants(cfg: DictConfig, hw: Hardware, experts: int = 0) -> list[tuple[str, DictConfig]]:
    """The recipe under every ``backend`` option whose engine takes ``hw.world`` ranks (its class's ``max_ranks``;
    ``single``: one), composed with the run's own overrides; the run's engine first. For a mixture-of-experts
    model (``experts`` routed experts) the engines that shard experts come again with expert-parallel layouts
    (``_ep_options``), labelled ``fsdp ep=8``."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import ConfigCompositionException
    # With the primary config's name its hydra.searchpath counts: a project's options and shardyard's packaged ones.
    options = GlobalHydra.instance().config_loader().get_group_options("backend", config_name=HydraConfig.get().job.config_name)
    from omegaconf import open_dict

    from shardyard.backends import engine, parallel_dims

    own = f"{cfg.backend.name} ep={cfg.backend.ep}" if cfg.backend.get("ep", 1) > 1 else cfg.backend.name
    out = [(own, cfg)]
    for name in [cfg.backend.name] + [o for o in options if o != cfg.backend.name]:
        try:
            variant = cfg if name == cfg.backend.name else compose_variant([f"backend={name}"], drop=("backend",))
        except ConfigCompositionException:  # a recipe that sets its engine's own keys (backend.stages) in its body
            continue
        most = getattr(engine(variant.backend), "max_ranks", None)
        if most is not None and hw.world > most:
            continue
        dims = parallel_dims(variant, hw.world)
        if dims.product != hw.world:  # tensor/pipeline parallel need a multiple of their degree
            continue
        if name != cfg.backend.name:
            out.append((name, variant))
        if "ep" in getattr(engine(variant.backend), "degree_keys", {}):
            for ep in _ep_options(experts, dims.shard_group, hw.ranks_per_node):
                if ep == variant.backend.ep:
                    continue
                v = variant.copy()
                with open_dict(v):
                    v.backend.ep = ep
                out.append((f"{name} ep={ep}", v))
    return out


def _ep_options(experts: int, dp_shard: int, ranks_per_node: int) -> list[int]:
    """The expert-parallel degrees the plan compares: the largest that keeps the all-to-all inside a node (its
    fast links), and the largest overall up to 64 (the least expert memory per rank; DeepSeek-V3 trained at
    64), each dividing both the experts and the data-parallel shards."""
    divides = [d for d in range(2, min(experts, dp_shard, 64) + 1) if experts % d == 0 and dp_shard % d == 0]
    if not divides:
        return []
    in_node = [d for d in divides if d <= ranks_per_node]
    return sorted({*in_node[-1:], divides[-1]})


def _changes_of_engine(cfg: DictConfig, variant: DictConfig) -> list[str]:
    """The overrides that turn ``cfg``'s engine into ``variant``'s."""
    out = [f"backend={variant.backend.name}"] if variant.backend.name != cfg.backend.name else []
    if variant.backend.get("ep", 1) != cfg.backend.get("ep", 1):
        out.append(f"backend.ep={variant.backend.ep}")
    return out


def compose_variant(extra: list[str], drop: tuple[str, ...] = ()) -> DictConfig:
    """The run's config again with ``extra`` overrides (overrides of the ``drop`` keys removed first;
    ``backend.nvme_path`` is kept)."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from hydra.errors import ConfigCompositionException

    task = [o for o in HydraConfig.get().overrides.task
            if not any(o.lstrip("+~").split("=")[0].split(".")[0] == d for d in drop) or "nvme_path" in o]
    name = HydraConfig.get().job.config_name  # train.py's, or a project's
    try:
        return compose(config_name=name, overrides=task + extra)
    except ConfigCompositionException:  # an engine without backend.nvme_path (ddp, fsdp, ...): without it
        return compose(config_name=name, overrides=[o for o in task if "nvme_path" not in o] + extra)


def _swaps_to_nvme(b: DictConfig) -> bool:
    return Offload.nvme in (b.get("offload_param"), b.get("offload_optimizer"))


def alternatives(cfg: DictConfig, batch: Plan, hw: Hardware, limit: int = 6) -> list[tuple[str, Estimate, int]]:
    """Changes that would fit, ranked: fewest nodes, then fewest changed settings, then step time (or bytes
    sent). Each is an override string, its estimate and the nodes it needs."""
    from omegaconf import open_dict

    found = []
    gbs = batch.global_batch_size
    for name, variant in engine_variants(cfg, hw, batch.facts.routed_experts):
        if _swaps_to_nvme(variant.backend) and not variant.backend.get("nvme_path"):
            continue  # ZeRO-Infinity needs the user's NVMe directory
        mode = checkpointing_mode(cfg.model)
        for ckpt in dict.fromkeys([mode, "full"]):  # as written first, then full checkpointing
            mbs = batch.micro_batch_size
            while mbs >= 1:
                v = variant.copy()
                with open_dict(v):
                    v.model.activation_checkpointing = ckpt
                    v.train.micro_batch_size = mbs
                    v.train.global_batch_size = gbs
                    v.train.grad_accum_steps = None
                b = dataclasses.replace(batch, micro_batch_size=mbs)
                changes = _changes_of_engine(cfg, variant)
                if ckpt != mode:
                    changes.append("model.activation_checkpointing=full")
                if mbs != batch.micro_batch_size:
                    changes.append(f"train.micro_batch_size={mbs} train.global_batch_size={gbs}")
                nodes = nodes_needed(v, b, hw)
                if nodes is not None:
                    e = estimate(v, b, dataclasses.replace(hw, nodes=nodes))
                    if nodes > hw.nodes:
                        like = "like this one" if hw.this_machine else f"of {hw.name}"
                        changes.append(f"{nodes} nodes {like} ({'launch.nnodes' if hw.this_machine else 'plan.nodes'}={nodes})")
                    speed = e.step_s if e.step_s is not None else e.comm_bytes / 1e12
                    found.append(((nodes, len(changes), speed, e.device_peak), " ".join(changes) or "as it is", e, nodes))
                    break  # a smaller micro batch fits too, but only costs throughput
                mbs //= 2
    found.sort(key=lambda f: f[0])
    seen, out = set(), []
    for _, text, e, nodes in found:
        if text not in seen:
            seen.add(text)
            out.append((text, e, nodes))
    return out[:limit]


def staging_refusal(cfg: DictConfig, batch: Plan, hw: Hardware, e: Estimate) -> None:
    """A run that fits but for its background saves' host copy (``checkpoint.async_save``) is refused naming
    that key, the copy's size and the host RAM (``UserError``); otherwise nothing."""
    staged = e.host.get(STAGING, 0.0) or e.device.get(STAGING, 0.0)
    if not staged:
        return
    without = dataclasses.replace(e, host={k: v for k, v in e.host.items() if k != STAGING},
                                  device={k: v for k, v in e.device.items() if k != STAGING})
    _check_fit(without, hw, cfg.plan.headroom)
    if not without.fits:
        return
    need = (e.host_peak if hw.device == "cuda" else e.device_peak) * hw.ranks_per_node
    raise UserError("checkpoint.async_save", True,
                    f"A background save stages a host copy of each rank's parameters and optimizer state: "
                    f"{staged / GiB:.1f} GiB per rank, {staged * hw.ranks_per_node / GiB:.1f} GiB for the "
                    f"{hw.ranks_per_node} rank(s) of a node. With what the run holds there that is {need / GiB:.1f} "
                    f"GiB of host RAM per node, and {hw.name} has {hw.host_bytes / GiB:.1f} GiB "
                    f"({cfg.plan.headroom:.0%} of it usable: {hw.host_bytes * cfg.plan.headroom / GiB:.1f} GiB). "
                    "Without background saves the run fits.",
                    "Drop checkpoint.async_save (each save then holds the step while it writes), or spread the state "
                    "over more nodes or a sharded engine (each rank stages its own part only), or plan.check=false "
                    "to launch anyway.").on_every_rank()


def refusal(cfg: DictConfig, batch: Plan, hw: Hardware, e: Estimate, rank0: bool = True) -> UserError:
    alts = alternatives(cfg, batch, hw)
    if rank0:
        print(table([(e, None)], hw), flush=True)
    if alts:
        listed = "; ".join(f"({i}) {text}: {a.device_peak / GiB:.1f} GiB per rank" for i, (text, a, _) in enumerate(alts, 1))
        fix = f"Alternatives that fit, best first: {listed}. Or plan.check=false to launch anyway."
    else:
        fix = (f"Nothing within {MAX_NODES} nodes of this hardware fits; use a smaller model, or plan.check=false to "
               "launch anyway.")
    where = "GPU" if hw.device == "cuda" else "rank"
    return UserError("backend", cfg.backend.name,
                     f"The plan for {cfg.model.name} on {e.world} rank(s) of {hw.name} needs {e.device_peak / GiB:.1f} GiB "
                     f"per {where} and does not fit: {e.shortfall}.", fix).on_every_rank()


def deepspeed_estimates(cfg: DictConfig, batch: Plan, hw: Hardware) -> str:
    """DeepSpeed's own model-state estimators (ZeRO-2, ZeRO-3) beside ours, when DeepSpeed is installed."""
    import logging

    logging.disable(logging.WARNING)  # its import warns that it found no GPU: this plan may be for GPUs elsewhere
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return ""
    finally:
        logging.disable(logging.NOTSET)
    P, shape = batch.facts.params, batch.facts.shape
    _, z2 = estimate_zero2_model_states_mem_needs(P, hw.ranks_per_node, hw.nodes, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(P, shape["max_module_params"], hw.ranks_per_node, hw.nodes,
                                                      cpu_offload=False, cpu_offload_params=False)
    return (f"DeepSpeed's estimators (model states per GPU, mixed precision): ZeRO-2 {z2 / GiB:.2f} GiB "
            f"(2P + 18P/N: it adds a 16-bit gradient partition that bf16 with fp32 accumulation does not keep), "
            f"ZeRO-3 {z3 / GiB:.2f} GiB (4 bytes x the largest module + 18P/N; ours counts two gathered modules in the "
            f"compute dtype and the reduce bucket under buffers)")
