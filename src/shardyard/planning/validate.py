"""Cross-group validation and the derived batch plan (``validate``: the one call before any worker starts; the
world's layout, ``plan``; the ranges of the numeric keys). Each group's own rules are ``rules``'s, the keys nobody
would read ``keys``'s. Every failure is a ``UserError`` (exit code 2)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from shardyard.config import preflight
from shardyard.core import moved
from shardyard.core.dist_env import DistEnv
from shardyard.core.errors import UserError
from shardyard.core.facts import ParallelDims, Plan, split_hardware
from shardyard.planning.keys import check_keys
from shardyard.planning.rules import (at_least, validate_balance, validate_data, validate_ep, validate_eval_tasks,
                                      validate_finetune, validate_groups, validate_objective, validate_plan,
                                      validate_precision, validate_profile_debug, validate_sp,
                                      validate_speed_options, validate_sweep, validate_weights_and_peft)


def _cuda_count() -> int:
    import torch

    # device_count() asks NVML and leaves CUDA uninitialised (is_available() would call cuInit): the parent
    # forks the jobs of a parallel sweep (hydra/launcher=parallel), and a fork after cuInit cannot use CUDA.
    return torch.cuda.device_count()


def device_type(cfg: DictConfig) -> str:
    want = cfg.backend.device
    n_gpu = _cuda_count()
    if want == "auto":
        return "cuda" if n_gpu else "cpu"
    if want == "cuda" and not n_gpu:
        raise UserError("backend.device", want, "No CUDA device is visible to this process.",
                        "Use backend.device=auto (or cpu), or run on a machine with GPUs.")
    return want


def plan(cfg: DictConfig, env: DistEnv | None) -> Plan:
    """Resolve nproc/world size and the batch arithmetic; raise ``UserError`` when it does not add up."""
    dev = device_type(cfg)
    launch, tr = cfg.launch, cfg.train
    n_gpu = _cuda_count()
    nproc = launch.nproc_per_node
    # Named hardware fixes the ranks per node an `auto` launch has; a plan-only run starts nothing here, so
    # it plans the named nodes (plan.nodes) and this machine's GPUs do not bound it.
    # plan.only and a dry run plan the named hardware's nodes (plan.nodes) whatever the launch says.
    searching = cfg.plan.get("search", False)  # the layout search plans the named hardware, as plan.only does
    named = cfg.plan.hardware is not None and (nproc == "auto" or cfg.plan.dry_run or cfg.plan.only or searching)
    planning = named and (cfg.plan.only or cfg.plan.dry_run or searching)  # a dry run is the named hardware's world too
    if named:
        _check_named_hardware(cfg.plan)
    if env is not None:
        nproc, world = env.local_world_size, env.world_size
    else:
        if named:
            nproc = split_hardware(cfg.plan.hardware)[0]
        elif nproc == "auto":
            nproc = max(n_gpu, 1) if dev == "cuda" else 1
        elif not (isinstance(nproc, int) or (isinstance(nproc, str) and nproc.isdigit())) or int(nproc) < 1:
            raise UserError("launch.nproc_per_node", nproc, "It must be a positive integer or `auto`.",
                            "Use launch.nproc_per_node=auto (all GPUs, or 1 on CPU) or e.g. launch.nproc_per_node=2.")
        nproc = int(nproc)
        if dev == "cuda" and nproc > n_gpu and not planning:
            raise UserError("plan.hardware" if named else "launch.nproc_per_node", cfg.plan.hardware if named else nproc,
                            f"This node has {n_gpu} visible GPU(s), and each worker needs its own"
                            + (f"; the named hardware has {nproc} per node." if named else "."),
                            f"Use launch.nproc_per_node={n_gpu}" + (" (or plan.only=true to plan the named hardware)"
                                                                    if named else " (or auto)")
                            + ", or backend.device=cpu to run gloo workers.")
        world = nproc * (cfg.plan.nodes if planning else _nodes(launch))
    if launch.socket_ifname and not os.path.exists(f"/sys/class/net/{launch.socket_ifname}"):
        have = ", ".join(sorted(os.listdir("/sys/class/net"))) if os.path.isdir("/sys/class/net") else "none listed"
        raise UserError("launch.socket_ifname", launch.socket_ifname,
                        f"This node has no network interface of that name (it has: {have}).",
                        "Name one of them (`ip addr` shows their addresses), or leave launch.socket_ifname unset.")
    if planning:
        _check_nodes(cfg, nproc, world)
    dims = _parallel_dims(cfg, world)
    mp, dp = dims.model_parallel, dims.dp  # dp: the replicas that read different batches
    mbs = tr.micro_batch_size
    if mbs < 1:
        raise UserError("train.micro_batch_size", mbs, "It must be at least 1.", "Use train.micro_batch_size=1 or more.")
    accum, gbs = tr.grad_accum_steps, tr.global_batch_size
    if gbs is None:
        accum = accum or 1
        if accum < 1:
            raise UserError("train.grad_accum_steps", accum, "It must be at least 1.", "Use train.grad_accum_steps=1 or more.")
        gbs = mbs * accum * dp
    else:
        per_step = mbs * dp
        replicas = f"data-parallel size {dp}" if mp > 1 else f"world size {world}"
        if gbs % per_step:
            raise UserError("train.global_batch_size", gbs,
                            f"The global batch must be micro batch x accumulation x {replicas.split(' size')[0]} size, "
                            f"but {gbs} is not a multiple of micro batch {mbs} x {replicas} = {per_step}.",
                            f"Use a global batch that is a multiple of {per_step} (e.g. {per_step * max(1, round(gbs / per_step))}), "
                            "or change train.micro_batch_size / launch.nproc_per_node.")
        derived = gbs // per_step
        if accum is not None and accum != derived:
            raise UserError("train.grad_accum_steps", accum,
                            f"global_batch_size {gbs} / (micro batch {mbs} x {replicas}) = {derived} "
                            "accumulation steps, which contradicts it.",
                            "Set only one of train.grad_accum_steps and train.global_batch_size.")
        accum = derived
    from shardyard.objectives import sequences

    per_sample, length = sequences(cfg.objective, cfg.data.seq_len)
    return Plan(dev, nproc, world, mbs, accum, gbs, cfg.data.seq_len, dims, nnodes=max(1, world // nproc),
                sequences_per_sample=per_sample, sequence_len=length)


def _check_named_hardware(pl: DictConfig) -> None:
    """``plan.hardware``'s devices per node and ``plan.nodes``, before any layout is derived from them (a world of
    0 ranks would be blamed on the first degree that cannot divide it)."""
    from shardyard.core.facts import GPUS, find_gpu

    per_node, name = split_hardware(str(pl.hardware))
    if per_node < 1:
        raise UserError("plan.hardware", pl.hardware, f"It names {per_node} devices per node; a node has at least 1.",
                        "Use e.g. plan.hardware=8xH100-80GB (GPUs per node x a GPU of the plan's table), or "
                        "plan.hardware=2xcpu.")
    if name.lower() != "cpu" and find_gpu(name) is None:
        raise UserError("plan.hardware", pl.hardware, f"It names no GPU the plan knows "
                        f"({', '.join(g.name for g in GPUS)}).",
                        "Use e.g. plan.hardware=8xH100-80GB (GPUs per node x GPU) with plan.nodes=N, or leave it "
                        "unset to plan for this machine.")
    if not isinstance(pl.nodes, int) or pl.nodes < 1:
        raise UserError("plan.nodes", pl.nodes, "It is the number of nodes of plan.hardware, at least 1.",
                        "Use plan.nodes=1 or more.")


def _check_nodes(cfg: DictConfig, per_node: int, world: int) -> None:
    """Planned nodes (``plan.nodes`` with ``plan.only`` or a dry run): the recipe's layout (its degrees dividing the
    world, expert parallelism dividing the data-parallel shards) and its global batch (a multiple of micro batch x
    data-parallel size) must be able to use that many nodes; the refusal lists the node counts that can, searched
    over every count the global batch allows (``facts.node_counts``)."""
    from shardyard.backends import engine
    from shardyard.core.facts import MAX_NODES, nearest, node_counts

    tr = cfg.train
    gbs, mbs = tr.global_batch_size, max(int(tr.micro_batch_size), 1)
    degrees = getattr(engine(cfg.backend), "degrees", None)
    fixed = degrees(cfg.backend) if degrees else {}

    def usable(nodes: int) -> bool:
        dims = ParallelDims.of(per_node * nodes, fixed)
        return (dims.product == dims.world_size and dims.shard_group % max(dims.ep, 1) == 0
                and (gbs is None or gbs % (mbs * dims.dp) == 0))

    if usable(cfg.plan.nodes):
        return
    if not cfg.plan.dry_run and ParallelDims.of(world, fixed).product != world:
        return  # plan.only: a degree that cannot divide the world is named by the degree's own check, as for a run
    one = ParallelDims.of(per_node, fixed)
    replica = max(one.product // max(one.dp, 1), 1)  # ranks that hold one replica (tp x pp x cp)
    # a global batch bounds the data-parallel size (gbs / micro batch), so the world (x the replica's ranks)
    most = MAX_NODES if gbs is None else min(MAX_NODES, -(-replica * max(int(gbs) // mbs, 1) // per_node))
    fits = node_counts(usable, most)
    if not fits:  # no node count would do: the degree itself is wrong, and the checks below name its key
        return
    dims = ParallelDims.of(world, fixed)
    raise UserError("plan.nodes", cfg.plan.nodes,
                    f"The recipe's layout cannot use {world} ranks ({cfg.plan.nodes} x {per_node}): {dims.describe()} "
                    f"must multiply to the world, backend.ep must divide the data-parallel shards, and "
                    f"train.global_batch_size={gbs} must be a multiple of micro batch "
                    f"{tr.micro_batch_size} x the data-parallel size. Of 1 to {most} nodes"
                    + (" (the most its global batch can use)" if most < MAX_NODES else "")
                    + f", it can use {len(fits)} count(s).",
                    f"Use plan.nodes in {nearest(fits, cfg.plan.nodes)}, or change the recipe's "
                    "degrees or global batch to suit the nodes you have.")


def _parallel_dims(cfg: DictConfig, world: int) -> ParallelDims:
    """The run's layout (``backends.parallel_dims``), derived here once and checked: every degree the engine
    fixes is at least 1, and together they divide the world size."""
    from shardyard.backends import engine, parallel_dims

    dims = parallel_dims(cfg, world)
    keys = getattr(engine(cfg.backend), "degree_keys", {})
    for field, key in keys.items():
        if getattr(dims, field) < 1:
            raise UserError(key, getattr(dims, field), "It is a number of ranks, at least 1.", f"Use {key}=2 (or 1 for none).")
    split = dims.tp * dims.pp * dims.sp * dims.cp  # the ranks of one data-parallel index
    if dims.dp_replicate > 1 and "dp_replicate" in keys and world % split == 0 and (world // split) % dims.dp_replicate:
        key, dp = keys["dp_replicate"], world // split  # HSDP's copies of the data-parallel ranks' shards
        names = [f"{k} {getattr(dims, k)}" for k in ("tp", "pp", "sp", "cp") if getattr(dims, k) > 1]
        within = f" (world {world} / {' x '.join(names)})" if names else ""
        raise UserError(key, dims.dp_replicate, f"The {dp} data-parallel ranks{within} must be a multiple of the "
                        f"copies of the sharded model; each copy is sharded over {dp} / {key} of them.",
                        f"Use {key} in {[d for d in range(1, dp + 1) if dp % d == 0]}, or a world size "
                        f"(launch.nproc_per_node x launch.nnodes) that leaves a multiple of {dims.dp_replicate} "
                        f"data-parallel ranks{within}.")
    if dims.product != world:
        mp = dims.product // dims.dp  # the ranks holding one model replica
        key = next((k for f, k in keys.items() if getattr(dims, f) > 1), next(iter(keys.values()), "backend"))
        field = next((f for f, k in keys.items() if k == key), "")
        raise UserError(key, getattr(dims, field, cfg.backend.name),
                        f"The world size {world} must be a multiple of the ranks holding one model replica "
                        f"(tensor parallel x pipeline stages{' x sequence parallel' if dims.sp > 1 else ''} = {mp}); "
                        "the quotient is the data-parallel size.",
                        f"Use a world size (launch.nproc_per_node x launch.nnodes) that is a multiple of {mp}, "
                        f"or a {key} that divides {world}.")
    return dims


def _nodes(launch: DictConfig) -> int:
    """``launch.nnodes`` of a self-launched run, checked with what a multi-node start needs."""
    from shardyard.config import run_dir_defaulted

    n, r, endpoint = launch.nnodes, launch.node_rank, launch.rdzv_endpoint
    if not isinstance(n, int) or n < 1:
        raise UserError("launch.nnodes", n, "It must be a positive integer.", "Use launch.nnodes=1, or the number of nodes.")
    if n == 1:
        return 1
    if not isinstance(r, int) or not 0 <= r < n:
        raise UserError("launch.node_rank", r, f"With launch.nnodes={n} the node ranks are 0 to {n - 1}.",
                        "Start node 0 with launch.node_rank=0 and every other node with its own rank.")
    if not endpoint or not re.fullmatch(r"[^:\s]+:\d+", str(endpoint)):
        raise UserError("launch.rdzv_endpoint", endpoint,
                        f"The {n} nodes meet at node 0's rendezvous, HOST:PORT, which every node must be given.",
                        "Pass launch.rdzv_endpoint=<node 0's address>:29500, the same on every node.")
    if run_dir_defaulted():
        raise UserError("hydra.run.dir", "(a timestamp)",
                        f"With launch.nnodes={n} every node must use the same run directory, on a file system they "
                        "all share; the default is a timestamp that each node would pick for itself.",
                        "Pass the same hydra.run.dir=/shared/path/run-name on every node.")
    return n


def validate(cfg: DictConfig, env: DistEnv | None) -> Plan:
    """All cross-group rules, run once before any worker starts; the Plan it returns goes to the workers."""
    from shardyard.backends import engine
    from shardyard.models.build import inspect_model

    check_keys(cfg)
    check_ranges(cfg)
    preflight.check(cfg)  # the optional packages its choices need (the extras), before anything imports them
    if cfg.plan.dry_run and cfg.plan.hardware is None:
        raise UserError("plan.dry_run", True, "A dry run simulates the hardware you are about to rent at its world "
                        "size, and plan.hardware names none.",
                        "Add plan.hardware=8xH100-80GB (GPUs per node x a GPU of the plan's table) and plan.nodes=N; "
                        "this machine's own run needs no dry run: run it.")
    if cfg.plan.search and cfg.plan.hardware is None:
        raise UserError("plan.search", True, "The layout search ranks layouts by their step time on the hardware you "
                        "are about to rent, and plan.hardware names none (this machine's own CPU has no FLOP/s or "
                        "memory-bandwidth figure to predict with).",
                        "Add plan.hardware=8xH100-80GB (GPUs per node x a GPU of the plan's table) and plan.nodes=N.")
    p = plan(cfg, env)
    tr, m, d, c = cfg.train, cfg.model, cfg.data, cfg.checkpoint
    if tr.steps < 1:
        raise UserError("train.steps", tr.steps, "Training needs at least one optimizer step.", "Use train.steps=1 or more.")
    for key in ("log_every_n_steps", "eval_batches"):
        at_least(f"train.{key}", tr[key], 1)
    for key in ("eval_every_n_steps", "sample_tokens"):
        at_least(f"train.{key}", tr[key], 0)
    if tr.max_grad_norm < 0:
        raise UserError("train.max_grad_norm", tr.max_grad_norm, "A clipping threshold cannot be negative.",
                        "Use train.max_grad_norm=1.0, or 0 to disable clipping.")
    at_least("checkpoint.every_n_steps", c.every_n_steps, 0)
    at_least("checkpoint.keep_last", c.keep_last, 0)
    if c.get("overwrite_run_dir") and c.resume is not None:  # every start of a requeued job would move it aside
        raise UserError("checkpoint.overwrite_run_dir", True, f"It moves an earlier run's results aside, and "
                        f"checkpoint.resume={c.resume} continues them: the two contradict each other.",
                        "Drop checkpoint.overwrite_run_dir to continue the run, or checkpoint.resume to start "
                        "afresh with the old results moved aside (nothing is deleted).")
    if c.get("async_save") and not hasattr(engine(cfg.backend), "save_checkpoint_async"):
        raise UserError("checkpoint.async_save", True, f"backend={cfg.backend.name} writes its checkpoints with its "
                        "own engine, which has no background save here; the engines that write DCP checkpoints "
                        "have one (single, ddp, fsdp, fsdp_tp, pipeline).",
                        f"Drop checkpoint.async_save for backend={cfg.backend.name}, or use one of those engines.")
    at_least("launch.max_restarts", cfg.launch.max_restarts, 0)
    at_least("launch.timeout_s", cfg.launch.timeout_s, 1)
    validate_sweep(cfg.sweep)
    attn = m.get("attn_implementation")
    if attn == "flash_attention_2" and (p.device_type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        raise UserError("model.attn_implementation", attn,
                        "FlashAttention-2 needs CUDA and the flash-attn package.",
                        "Use model.attn_implementation=sdpa (fast on every device), or install flash-attn on a GPU machine.")
    validate_weights_and_peft(cfg, p.device_type)
    facts = inspect_model(m, d.seq_len, cfg.peft)
    longest = p.sequence_len or d.seq_len  # GRPO: the prompt and its completion (objective.max_new_tokens)
    if facts.max_positions is not None and longest > facts.max_positions:
        key = "model.max_position_embeddings" if "max_position_embeddings" in m else "model.path"
        what = "It" if longest == d.seq_len else f"With objective.max_new_tokens, the longest sequence ({longest})"
        raise UserError("data.seq_len", d.seq_len, f"{what} exceeds the model's longest position ({key}={facts.max_positions}).",
                        f"Use data.seq_len<={facts.max_positions - (longest - d.seq_len)}"
                        + (f" or raise {key}." if key != "model.path" else "."))
    if m.get("mtp") is not None:  # every MTP depth must leave targets in a row (no wrapped ones)
        from shardyard.models import mtp

        mtp.check_seq_len(int(m.mtp.depth), int(d.seq_len))
    src = validate_data(cfg)
    validate_finetune(cfg, src, facts)
    validate_objective(cfg, src)
    validate_eval_tasks(cfg)
    validate_balance(m.balance, facts)
    validate_groups(m, facts)
    validate_ep(cfg.backend, p.dims, facts)
    validate_sp(cfg, p.dims)
    validate_precision(cfg.precision, p.device_type)
    validate_speed_options(cfg)
    if cfg.optim.lr <= 0:
        raise UserError("optim.lr", cfg.optim.lr, "The learning rate must be positive.", "Use e.g. optim.lr=3e-4.")
    if cfg.sched.get("warmup_steps", 0) < 0:
        raise UserError("sched.warmup_steps", cfg.sched.warmup_steps, "Warmup cannot be negative.",
                        "Use sched.warmup_steps=0 or more.")
    if c.resume not in (None, "auto") and not os.path.exists(c.resume):
        raise UserError("checkpoint.resume", c.resume, "There is no checkpoint at that path.",
                        "Use checkpoint.resume=auto (newest complete checkpoint of this run) or an existing path.")
    validate_profile_debug(cfg)
    validate_plan(cfg.plan)
    p = dataclasses.replace(p, model=facts)
    engine(cfg.backend).validate(cfg, p)
    return p


def check_ranges(cfg: DictConfig) -> None:
    """Every key ``schema.RANGES`` bounds (the engines' numeric settings), in the groups whose schema holds it."""
    from shardyard.config.schema import RANGES

    for group in ("backend", "precision", "model.balance", "model.rope_scaling"):
        node = OmegaConf.select(cfg, group)
        typ = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        for cls in getattr(typ, "__mro__", ()):
            defaults = {f.name: f.default for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
            for key, r in RANGES.get(cls, {}).items():
                _in_range(f"{group}.{key}", node[key], r, defaults.get(key))


def _in_range(key: str, value: Any, r: Any, default: Any) -> None:
    import math

    bound = (f"greater than {r.low:g}" if r.above else f"at least {r.low:g}") + (
        f" and at most {r.high:g}" if r.high is not None else "")
    kind = {None: "a number", 1: "a whole number"}.get(r.multiple_of, f"a multiple of {r.multiple_of}")
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > r.low if r.above else value >= r.low) and (r.high is None or value <= r.high)
          and (r.multiple_of is None or value % r.multiple_of == 0))
    if not ok:
        raise UserError(key, value, f"It must be {kind} {bound} (it becomes {r.becomes}).",
                        f"Use e.g. {key}={default:g} (the default)." if isinstance(default, (int, float)) else
                        f"Use a value in that range for {key}.")


def apply_fast_dev_run(cfg: DictConfig) -> None:
    """``debug.fast_dev_run=true``: a smoke test of the whole path (build, 2 steps, one evaluation batch) that
    does nothing else: no checkpoints, exports, samples, profiles, and no monitors but the console (and
    metrics.jsonl), as Lightning's fast_dev_run. It costs what a sweep or a test pays per job."""
    if not cfg.debug.fast_dev_run:
        return
    from shardyard import monitors

    with open_dict(cfg):
        cfg.train.steps = min(cfg.train.steps, 2)
        cfg.train.eval_every_n_steps = 0
        cfg.train.eval_batches = 1
        cfg.train.log_every_n_steps = 1
        cfg.train.sample_tokens = 0
        monitors.check_run_only(cfg.monitor)
        cfg.checkpoint.every_n_steps = 0
        cfg.checkpoint.save_final = False
        cfg.checkpoint.export_hf = False
        cfg.profile.enabled = False


# The public names that moved out (core.moved.NAMES_MOVED) still import from here, with a deprecation line.
__getattr__ = moved.names_moved_from(__name__)
