"""Cross-group validation and the derived batch plan. Every failure is a ``UserError`` (exit code 2)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from shardyard.dist_env import DistEnv
from shardyard.errors import UserError
from shardyard.facts import ModelFacts, ParallelDims, Plan, split_hardware


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
    named = cfg.plan.hardware is not None and (nproc == "auto" or cfg.plan.dry_run)
    planning = named and (cfg.plan.only or cfg.plan.dry_run)  # a dry run is the named hardware's world too
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
    if planning and cfg.plan.dry_run:
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


def _check_nodes(cfg: DictConfig, per_node: int, world: int) -> None:
    """A dry run's ``plan.nodes``: the recipe's layout (its degrees dividing the world, expert parallelism dividing
    the data-parallel shards) and its global batch (a multiple of micro batch x data-parallel size) must be able
    to use that many nodes; the refusal lists the node counts that can."""
    from shardyard.backends import parallel_dims

    tr = cfg.train

    def usable(nodes: int) -> bool:
        dims = parallel_dims(cfg, per_node * nodes)
        gbs = tr.global_batch_size
        return (dims.product == dims.world_size and dims.dp_shard % max(dims.ep, 1) == 0
                and (gbs is None or gbs % (tr.micro_batch_size * dims.dp) == 0))

    if usable(cfg.plan.nodes):
        return
    fits = [n for n in range(1, 4 * cfg.plan.nodes + 1) if usable(n)]
    if not fits:  # no node count would do: the degree itself is wrong, and the checks below name its key
        return
    dims = parallel_dims(cfg, world)
    raise UserError("plan.nodes", cfg.plan.nodes,
                    f"The recipe's layout cannot use {world} ranks ({cfg.plan.nodes} x {per_node}): {dims.describe()} "
                    f"must multiply to the world, backend.ep must divide the data-parallel shards, and "
                    f"train.global_batch_size={tr.global_batch_size} must be a multiple of micro batch "
                    f"{tr.micro_batch_size} x the data-parallel size.",
                    f"Use plan.nodes in {fits[:12]}, or change the recipe's "
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
    if dims.product != world:
        mp = dims.product // dims.dp  # the ranks holding one model replica
        key = next((k for f, k in keys.items() if getattr(dims, f) > 1), next(iter(keys.values()), "backend"))
        field = next((f for f, k in keys.items() if k == key), "")
        raise UserError(key, getattr(dims, field, cfg.backend.name),
                        f"The world size {world} must be a multiple of the ranks holding one model replica "
                        f"(tensor parallel x pipeline stages = {mp}); the quotient is the data-parallel size.",
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
    from shardyard.model import inspect_model

    check_keys(cfg)
    check_ranges(cfg)
    if cfg.plan.dry_run and cfg.plan.hardware is None:
        raise UserError("plan.dry_run", True, "A dry run simulates the hardware you are about to rent at its world "
                        "size, and plan.hardware names none.",
                        "Add plan.hardware=8xH100-80GB (GPUs per node x a GPU of the plan's table) and plan.nodes=N; "
                        "this machine's own run needs no dry run: run it.")
    p = plan(cfg, env)
    tr, m, d, c = cfg.train, cfg.model, cfg.data, cfg.checkpoint
    if tr.steps < 1:
        raise UserError("train.steps", tr.steps, "Training needs at least one optimizer step.", "Use train.steps=1 or more.")
    for key in ("log_every_n_steps", "eval_batches"):
        _at_least(f"train.{key}", tr[key], 1)
    for key in ("eval_every_n_steps", "sample_tokens"):
        _at_least(f"train.{key}", tr[key], 0)
    if tr.max_grad_norm < 0:
        raise UserError("train.max_grad_norm", tr.max_grad_norm, "A clipping threshold cannot be negative.",
                        "Use train.max_grad_norm=1.0, or 0 to disable clipping.")
    _at_least("checkpoint.every_n_steps", c.every_n_steps, 0)
    _at_least("checkpoint.keep_last", c.keep_last, 0)
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
    _at_least("launch.max_restarts", cfg.launch.max_restarts, 0)
    _at_least("launch.timeout_s", cfg.launch.timeout_s, 1)
    _validate_sweep(cfg.sweep)
    attn = m.get("attn_implementation")
    if attn == "flash_attention_2" and (p.device_type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        raise UserError("model.attn_implementation", attn,
                        "FlashAttention-2 needs CUDA and the flash-attn package.",
                        "Use model.attn_implementation=sdpa (fast on every device), or install flash-attn on a GPU machine.")
    _validate_weights_and_peft(cfg, p.device_type)
    facts = inspect_model(m, d.seq_len, cfg.peft)
    longest = p.sequence_len or d.seq_len  # GRPO: the prompt and its completion (objective.max_new_tokens)
    if facts.max_positions is not None and longest > facts.max_positions:
        key = "model.max_position_embeddings" if "max_position_embeddings" in m else "model.path"
        what = "It" if longest == d.seq_len else f"With objective.max_new_tokens, the longest sequence ({longest})"
        raise UserError("data.seq_len", d.seq_len, f"{what} exceeds the model's longest position ({key}={facts.max_positions}).",
                        f"Use data.seq_len<={facts.max_positions - (longest - d.seq_len)}"
                        + (f" or raise {key}." if key != "model.path" else "."))
    src = validate_data(cfg)
    _validate_finetune(cfg, src, facts)
    _validate_objective(cfg, src)
    _validate_eval_tasks(cfg)
    _validate_balance(m.balance, facts)
    _validate_groups(m, facts)
    _validate_ep(cfg.backend, p.dims, facts)
    _validate_precision(cfg.precision, p.device_type)
    _validate_speed_options(cfg)
    if cfg.optim.lr <= 0:
        raise UserError("optim.lr", cfg.optim.lr, "The learning rate must be positive.", "Use e.g. optim.lr=3e-4.")
    if cfg.sched.get("warmup_steps", 0) < 0:
        raise UserError("sched.warmup_steps", cfg.sched.warmup_steps, "Warmup cannot be negative.",
                        "Use sched.warmup_steps=0 or more.")
    if c.resume not in (None, "auto") and not os.path.exists(c.resume):
        raise UserError("checkpoint.resume", c.resume, "There is no checkpoint at that path.",
                        "Use checkpoint.resume=auto (newest complete checkpoint of this run) or an existing path.")
    _validate_monitors(cfg)
    _validate_profile_debug(cfg)
    _validate_plan(cfg.plan)
    p = dataclasses.replace(p, model=facts)
    engine(cfg.backend).validate(cfg, p)
    return p


def check_ranges(cfg: DictConfig) -> None:
    """Every key ``schema.RANGES`` bounds (the engines' numeric settings), in the groups whose schema holds it."""
    from shardyard.config.schema import RANGES

    for group in ("backend", "precision", "model.balance"):
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


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise UserError(key, value, f"It must be at least {low}.", f"Use {key}={low} or more.")


# ------------------------------------------------------------------------------- keys nobody would read
GROUP_SCHEMAS = {"model": "ModelConfig", "data": "DataConfig"}
"""Groups whose options mix shardyard's own keys (these schemas) with their ``_target_``'s arguments."""


def check_keys(cfg: DictConfig) -> None:
    """Refuse keys that no schema or plug-in reads (``+some.key=value``, a misspelt plug-in argument), and
    ``_target_`` values that cannot be imported or called with the keys given. A user's plug-in option
    without a schema gets shardyard's own keys of its group filled in with their defaults."""
    _complete_plugin_options(cfg)
    _unknown_in_schemas(cfg, "")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(missing[0], "???", "This option needs a value, and none is given.",
                        f"Set it on the command line ({missing[0]}=...) or in the recipe.")
    for group in ("model", "data", "optim", "sched", "backend"):
        _check_target(f"{group}", cfg[group])
    for name, node in (cfg.monitor or {}).items():
        _check_target(f"monitor.{name}", node)


def _schema_fields(node: DictConfig) -> set[str] | None:
    typ = OmegaConf.get_type(node)
    return {f.name for f in dataclasses.fields(typ)} if typ is not None and dataclasses.is_dataclass(typ) else None


def _unknown_in_schemas(node: DictConfig, prefix: str) -> None:
    fields = _schema_fields(node)
    open_plugin = OmegaConf.is_struct(node) is False  # schema_*_plugin: its extra keys go to its _target_
    for key in node:
        full = f"{prefix}{key!s}"
        if fields is not None and key not in fields and not open_plugin:
            raise UserError(full, node[key], "No schema or plug-in reads this key, so it would be ignored.",
                            f"Remove it, or spell one of: {', '.join(sorted(fields))}. "
                            "`python train.py --cfg job` prints every key.")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _unknown_in_schemas(child, full + ".")


def _complete_plugin_options(cfg: DictConfig) -> None:
    from shardyard.config import schema

    for group, schema_name in GROUP_SCHEMAS.items():
        node: DictConfig = cfg[group]
        if _schema_fields(node) is not None:
            continue
        base = getattr(schema, schema_name)
        fields = {f.name for f in dataclasses.fields(base)}
        own = {k: node[k] for k in node if k in fields}
        try:
            typed: Any = OmegaConf.merge(OmegaConf.structured(base), own)
        except Exception as e:  # omegaconf.ValidationError: a wrong type for one of our keys
            raise UserError(group, own, f"One of shardyard's own {group} keys has a wrong value: {e}",
                            f"See {schema_name} in src/shardyard/config/schema.py.") from None
        with open_dict(cfg):
            for f in dataclasses.fields(base):
                if f.name not in node and not OmegaConf.is_missing(typed, f.name):
                    node[f.name] = typed[f.name]
            if "name" in fields and "name" not in node:
                node["name"] = str(node.get("_target_", group)).rsplit(".", 1)[-1]


def _check_target(key: str, node: DictConfig) -> None:
    """``node._target_`` imports, and accepts the node's keys (less shardyard's own) as arguments."""
    from hydra.utils import get_object

    from shardyard.config import schema

    target = node.get("_target_")
    if not target:
        raise UserError(f"{key}._target_", target, "Every pluggable option names what builds it.",
                        f"Set {key}._target_ to an importable callable (e.g. mypkg.module.function).")
    try:
        obj = get_object(target)
    except Exception as e:
        raise UserError(f"{key}._target_", target, f"It cannot be imported ({type(e).__name__}: {e}).",
                        "Check the spelling, and that its package is installed or on PYTHONPATH.") from None
    group = key.split(".")[0]
    if group == "backend":
        return  # engines take the whole run config
    own = {f.name for f in dataclasses.fields(getattr(schema, GROUP_SCHEMAS[group]))} if group in GROUP_SCHEMAS else {"_target_"}
    given = [str(k) for k in node if k not in own]
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: let the call itself judge
        return
    if group == "optim":  # shardyard passes the parameter groups first
        params = params[1:]
    if group == "monitor":  # ... and a monitor's run dir and run config
        params = [p for p in params if p.name not in ("run_dir", "config")]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for k in given:
        if k not in names:
            raise UserError(f"{key}.{k}", node[k], f"No schema or plug-in reads this key: {target} takes "
                            f"({', '.join(sorted(names))}).", f"Remove it, or spell one of those.")
    for p in params:
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) \
                and p.name not in given:
            raise UserError(f"{key}.{p.name}", None, f"{target} needs this argument, and the config does not give it.",
                            f"Add it to the option's YAML or the command line: +{key}.{p.name}=...")


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


def _validate_monitors(cfg: DictConfig) -> None:
    """A selected monitor whose package is missing (its class's ``requires``) is named before launch."""
    from hydra.utils import get_object

    for name, node in (cfg.monitor or {}).items():
        package = getattr(get_object(node._target_), "requires", None)
        if package and importlib.util.find_spec(package) is None:
            raise UserError("monitor", name, f"The {name} monitor needs the `{package}` package, which is not "
                            "installed in this environment.",
                            f"Install it (pip install {package}, or pip install -e '.[monitors]'), or drop it "
                            f"from the list, e.g. 'monitor=[console,tensorboard]'.")


def _validate_plan(pl: DictConfig) -> None:
    for key in ("headroom", "mfu"):
        if not 0 < pl[key] <= 1:
            raise UserError(f"plan.{key}", pl[key], "It is a fraction of the hardware, in (0, 1].",
                            f"Use e.g. plan.{key}={0.9 if key == 'headroom' else 0.4}.")
    _at_least("plan.nodes", pl.nodes, 1)


def _validate_profile_debug(cfg: DictConfig) -> None:
    pr, dbg, steps = cfg.profile, cfg.debug, cfg.train.steps
    if pr.enabled:
        ok = len(pr.steps) == 2 and 1 <= pr.steps[0] <= pr.steps[1] <= steps
        if not ok:
            raise UserError("profile.steps", list(pr.steps), f"It must be [first, last] with 1 <= first <= last <= "
                            f"train.steps ({steps}).", f"Use e.g. profile.steps=[{min(3, steps)},{min(4, steps)}].")
    if dbg.max_skipped < 1:
        raise UserError("debug.max_skipped", dbg.max_skipped, "It must be at least 1.", "Use e.g. debug.max_skipped=5.")
    if cfg.metrics.peak_tflops is not None and cfg.metrics.peak_tflops <= 0:
        raise UserError("metrics.peak_tflops", cfg.metrics.peak_tflops, "A peak throughput must be positive.",
                        "Use e.g. metrics.peak_tflops=989 (H100 SXM, bf16 dense), or null for the built-in table.")


def validate_data(cfg: DictConfig):
    from shardyard.data import check_tokenizer, num_proc, open_sources, tokenizer_source

    d = cfg.data
    tokenizer = tokenizer_source(cfg)
    if tokenizer is not None:
        check_tokenizer(*tokenizer)
    if d.tokenizer.path is None and not 256 < d.tokenizer.vocab_size <= 1 << 20:
        raise UserError("data.tokenizer.vocab_size", d.tokenizer.vocab_size,
                        "A byte-level BPE vocabulary needs more than its 256 base bytes.", "Use e.g. 4096.")
    if not 0 < d.val_fraction < 1:
        raise UserError("data.val_fraction", d.val_fraction, "It must lie strictly between 0 and 1.", "Use e.g. 0.05.")
    if d.seq_len < 2:
        raise UserError("data.seq_len", d.seq_len, "Sequences need at least 2 tokens.", "Use e.g. data.seq_len=256.")
    num_proc(d)
    for key in ("buffer_mb", "shard_mb"):
        _at_least(f"data.{key}", d[key], 1)
    return open_sources(d)[0].docs  # sources check their own arguments (paths exist, weights, ...) when built


def _validate_weights_and_peft(cfg: DictConfig, device_type: str) -> None:
    """Pretrained weights and adapters: before the model is inspected (which builds the adapters)."""
    import glob
    import importlib.util

    from shardyard import adapters
    from shardyard.backends import engine
    from shardyard.data import has_tokenizer
    from shardyard.weights import weights_dir

    m, p = cfg.model, cfg.peft
    w = m.get("weights")
    here = cfg.plan.hardware is None  # planning for other machines: their files are not here to check
    if w == "auto" and "path" not in m:
        raise UserError("model.weights", w, "`auto` means the model directory's own weights, and this model option "
                        "has no model.path.", "Give a directory: model.weights=/models/NAME, or null (fresh init).")
    wdir = weights_dir(m) if w != "auto" or "path" in m else None
    if wdir is not None and here:
        if not os.path.isdir(wdir):
            raise UserError("model.weights", w, "No directory is there.",
                            "Point it at a local HF checkpoint (e.g. a run's hf/ export), or null to start from a "
                            "fresh init.")
        if not glob.glob(os.path.join(wdir, "*.safetensors")):
            raise UserError("model.weights", wdir, "It holds no *.safetensors weights (PyTorch .bin files are pickles, "
                            "which shardyard does not load: unpickling runs code from the file).",
                            "Convert it once: python -c \"from transformers import AutoModelForCausalLM as M; "
                            f"M.from_pretrained('{wdir}').save_pretrained('{wdir}-safetensors')\" (copy the tokenizer "
                            "files too), and point model.weights there.")
        for f in sorted(glob.glob(os.path.join(wdir, "*.safetensors"))):
            problem = _safetensors_problem(f)
            if problem:
                raise UserError("model.weights" if w not in (None, "auto") else "model.path", f, f"The weights file "
                                f"is not whole: {problem}.", "Copy or download it again (a cut-short copy is the usual "
                                "cause), or point the key at a complete checkpoint.")
        if cfg.data.tokenizer.path is None and not has_tokenizer(wdir) and not (
                isinstance(m.get("path"), str) and has_tokenizer(os.path.expanduser(m.path))):
            raise UserError("model.weights", wdir, "The pretrained weights come without their tokenizer, and a "
                            "tokenizer trained on this data would give the model token ids that mean nothing to it.",
                            "Put the model's tokenizer files in that directory, or give data.tokenizer.path=DIR.")
    method = adapters.method(p)
    if not method.freezes_base:
        return
    if p.r < 1:
        raise UserError("peft.r", p.r, "An adapter needs rank 1 or more.", "Use e.g. peft.r=16.")
    if p.alpha <= 0:
        raise UserError("peft.alpha", p.alpha, "The update is scaled by alpha / r, so alpha must be positive.",
                        "Use e.g. peft.alpha=32 (2 x r).")
    if not 0 <= p.dropout < 1:
        raise UserError("peft.dropout", p.dropout, "A dropout probability lies in [0, 1).", "Use e.g. 0.05.")
    if importlib.util.find_spec("peft") is None:
        raise UserError("peft", p.name, "The peft library is not installed.",
                        "Run `make setup` (or pip install 'shardyard[finetune]').")
    if w is None:
        print(f"shardyard | warning: peft={p.name} trains adapters on a base model with no pretrained weights "
              "(model.weights is null): the frozen base is a random init.", file=sys.stderr, flush=True)
    if not method.quantized_base:
        return
    if not getattr(engine(cfg.backend), "quantized_base", False):
        raise UserError("peft", "qlora", f"backend={cfg.backend.name} shards or partitions parameters itself, and "
                        "bitsandbytes' packed 4-bit weights cannot be sharded or all-gathered by it.",
                        "Use backend=single or backend=ddp with peft=qlora (each rank holds the 4-bit base), or "
                        "peft=lora on this engine.")
    from shardyard import drills

    elsewhere = cfg.plan.hardware is not None and "cpu" not in str(cfg.plan.hardware).lower()  # planning GPUs
    if elsewhere:
        return
    if device_type != "cuda" and not drills.qlora_on_cpu():
        raise UserError("peft", "qlora", "QLoRA keeps the frozen base in 4-bit NF4 through bitsandbytes, a CUDA GPU "
                        "method; this run is on CPU.",
                        "Use peft=lora on CPU (same adapters, fp32/bf16 base), or run on a GPU.")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("peft", "qlora", "QLoRA needs the bitsandbytes package, which is not installed.",
                        "pip install bitsandbytes (on the GPU machine), or use peft=lora.")


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is cut short or not one, from its header alone (8 bytes of length, a JSON header,
    then the tensors, whose last end offset must reach the file's end), or None: cheap at any size."""
    import json

    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + n > size:
                return f"it has {size} bytes, fewer than its header's own length ({n} bytes + 8)"
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"its header is not a safetensors header ({type(e).__name__}: {e})"
    if 8 + n + end != size:
        return f"it has {size} bytes, and its header places tensor data up to byte {8 + n + end}"
    return None


def _validate_balance(b: DictConfig, facts: ModelFacts) -> None:
    """``model.balance`` keys that would do nothing are refused: any of them on a dense model, the bias update on
    routers without a selection bias (DeepSeek-V2's softmax routers)."""
    on = [k for k in ("bias_update_speed", "seq_aux_alpha", "device_aux_alpha", "comm_aux_alpha") if b[k]]
    if on and not facts.moe_layers:
        raise UserError(f"model.balance.{on[0]}", b[on[0]], "It balances the routing of mixture-of-experts layers, "
                        "and this model has none (no router).",
                        f"Leave model.balance.{on[0]}=0 for a dense model, or choose a MoE model "
                        "(model=deepseek_moe_tiny, deepseek_v2_lite, deepseek_v3).")
    if b.bias_update_speed and not facts.router_bias:
        raise UserError("model.balance.bias_update_speed", b.bias_update_speed, "This model's routers have no "
                        "selection bias to move (DeepSeek-V3's e_score_correction_bias): DeepSeek-V2's softmax "
                        "routers are balanced by the auxiliary losses.",
                        "Use model.balance.bias_update_speed=0, and model.balance.seq_aux_alpha (with "
                        "device_aux_alpha and comm_aux_alpha under expert parallelism) to balance them.")


def _validate_groups(m: DictConfig, facts: ModelFacts) -> None:
    """Group-limited routing that transformers' router would run wrongly (``model.build``'s own check has refused
    groups that do not divide the experts, and ``topk_group`` outside 1..n_group): a DeepSeek-V3 router scores a
    group by its top-2 experts, so a group needs two; and a token's ``top_k`` experts must fit in its
    ``topk_group`` groups, or its top-k reaches experts the mask excluded. Whether the groups line up with the
    expert-parallel ranks is the plan's note (``plan.routing_notes``), not an error."""
    from shardyard.moe import routing_groups

    if not facts.moe_layers:
        return
    rg = routing_groups(m, facts.routed_experts, facts.experts_per_token, 1, 1)
    if rg.groups > 1 and facts.router_bias and rg.per_group < 2:
        raise UserError("model.n_group", rg.groups, f"A DeepSeek-V3 router scores each group by the sum of its 2 best "
                        f"experts, and {rg.groups} groups of model.n_routed_experts={rg.experts} hold "
                        f"{rg.per_group} each.", f"Use a model.n_group of at most {rg.experts // 2} that divides "
                        f"{rg.experts} (DeepSeek-V3: 8 groups of 32), or model.n_group=1 model.topk_group=1.")
    if rg.groups > 1 and rg.top_k > rg.topk_group * rg.per_group:
        raise UserError("model.topk_group", rg.topk_group, f"Each token's model.num_experts_per_tok={rg.top_k} "
                        f"experts are chosen within its topk_group best groups, which hold {rg.topk_group} x "
                        f"{rg.per_group} = {rg.topk_group * rg.per_group} experts.",
                        f"Use model.topk_group>={-(-rg.top_k // rg.per_group)} (at most model.n_group={rg.groups}), "
                        "or fewer experts per token.")


def _validate_ep(b: DictConfig, dims: ParallelDims, facts: ModelFacts) -> None:
    """``backend.ep``: an engine that shards experts, a MoE model, and a degree that divides both the routed
    experts (whole experts per rank) and the data-parallel shards it borrows its ranks from; and
    ``backend.ep_capacity_factor``: null, or above 1 with ``ep > 1``."""
    from shardyard.backends import engine

    ep, factor = b.ep, b.get("ep_capacity_factor")
    if factor is not None and not (isinstance(factor, (int, float)) and factor > 1):
        raise UserError("backend.ep_capacity_factor", factor, "It bounds the token rows a rank of an expert-parallel "
                        "group receives to this many times its balanced share, so it must be greater than 1 "
                        "(at 1 or below only a perfectly balanced routing fits).",
                        "Use e.g. backend.ep_capacity_factor=2, or null (the default: dropless, no bound).")
    if factor is not None and ep == 1:
        raise UserError("backend.ep_capacity_factor", factor, "It bounds expert parallelism's receive buffer, and "
                        "backend.ep=1 sends no token to another rank.",
                        "Leave backend.ep_capacity_factor null, or set backend.ep to 2 or more.")
    if ep == 1:
        return
    if "ep" not in getattr(engine(b), "degree_keys", {}):
        raise UserError("backend.ep", ep, f"backend={b.name} does not shard experts: every rank holds every expert.",
                        "Use backend=fsdp (or fsdp_offload, or pipeline for stages x ep) for expert parallelism, "
                        "or backend.ep=1.")
    if not facts.moe_layers:
        raise UserError("backend.ep", ep, "Expert parallelism splits a mixture-of-experts layer's experts, and this "
                        "model has none (no router).", "Use backend.ep=1, or a MoE model (model=deepseek_moe_tiny, "
                        "deepseek_v2_lite, deepseek_v3).")
    if facts.routed_experts % ep:
        raise UserError("backend.ep", ep, f"Each rank of an expert-parallel group holds whole experts, so it must "
                        f"divide the model's {facts.routed_experts} routed experts.",
                        f"Use a divisor of {facts.routed_experts} that also divides the {dims.dp_shard} data-parallel "
                        f"shards: {_common_divisors(facts.routed_experts, dims.dp_shard)}.")
    if dims.dp_shard % ep:
        raise UserError("backend.ep", ep, f"The expert-parallel groups are made of data-parallel shards, and there are "
                        f"{dims.dp_shard} ({dims.describe()}), which it must divide.",
                        f"Use one of {_common_divisors(facts.routed_experts, dims.dp_shard)}, or a world size that "
                        f"{ep} divides.")


def _common_divisors(a: int, b: int) -> str:
    return ", ".join(f"backend.ep={d}" for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0)


def _validate_finetune(cfg: DictConfig, src, facts) -> None:
    """SFT rows and early stopping (after the model is inspected)."""
    m, tr = cfg.model, cfg.train
    if cfg.data.document_mask and facts.attn is None:
        raise UserError("data.document_mask", True, "Document masking passes per-document positions and a "
                        "block-diagonal attention mask as keyword arguments that only an HF model (PreTrainedModel) "
                        f"takes; model {m.name} is a plain module.", "Use an HF model (model=hf, deepseek_tiny, "
                        "deepseek7b, ...), or data.document_mask=false.")
    if hasattr(src, "tokenize_rows") and facts.attn is None:
        raise UserError("data", cfg.data._target_, "Its rows carry per-conversation positions and a block-diagonal "
                        "attention mask, passed as keyword arguments that only an HF model (PreTrainedModel) takes; "
                        f"model {m.name} is a plain module.", "Use an HF model (model=hf, deepseek_tiny, deepseek7b, ...).")
    if tr.early_stopping_patience is not None:
        _at_least("train.early_stopping_patience", tr.early_stopping_patience, 1)
    _at_least("train.warn_after_evals", tr.warn_after_evals, 0)


def _validate_objective(cfg: DictConfig, src: Any) -> None:
    """``objective``: its own values (the class checks them as it is built: G, beta, epsilon, the rewards'
    ``_target_``s), the rows it trains on, and what the engine and the model must offer it."""
    from shardyard import objectives
    from shardyard.backends import engine

    o = cfg.objective
    objective = objectives.build(cfg)
    want, have = getattr(objective, "data_kind", "text"), getattr(src, "kind", "text")
    if want != have:
        option = {"text": "a text or conversation option (stdlib_code, text_files, mixture, sft, arithmetic)",
                  "preference": "data=preference", "prompts": "data=prompts"}
        raise UserError("data", cfg.data._target_, f"objective={o.name} trains on {option.get(want, want)}; this "
                        f"data option gives {option.get(have, have)} rows.",
                        f"Use {option.get(want, want)}, or the objective that trains on these rows.")
    if want == "text":
        return
    eng = engine(cfg.backend)
    if not getattr(eng, "post_training", True):
        raise UserError("backend", cfg.backend.name, f"objective={o.name} needs each sequence's log-probabilities "
                        "from one forward of the whole model (and GRPO samples completions with it); this engine "
                        "splits the model into pipeline stages.",
                        "Use backend=fsdp or zero3 (sharded), ddp, zero1/zero2, fsdp_tp, horovod or single.")
    m = cfg.model
    _validate_reference_weights(cfg)
    if m.get("loss_chunk", 0):
        raise UserError("model.loss_chunk", m.loss_chunk, f"objective={o.name} reads each token's log-probability; "
                        "the chunked loss head returns only the summed cross-entropy.", "Use model.loss_chunk=0.")
    if m.get("mtp") is not None and int(m.mtp.depth):
        raise UserError("model.mtp.depth", m.mtp.depth, f"objective={o.name} trains the main head only; multi-token "
                        "prediction depths are a pre-training objective.", "Use model.mtp.depth=0.")


def _validate_eval_tasks(cfg: DictConfig) -> None:
    """``train.eval_tasks``: the harness installed, every task one it knows (``harness.check_tasks``: the shipped,
    ``train.eval_tasks_include_path``'s, its own), none a generation task (where its YAML tells), a limit
    ``options.limit`` takes, and an engine whose ranks each run the whole model's forward (every rank scores the
    tasks in lockstep: ``harness.InTraining``)."""
    from shardyard import harness, options
    from shardyard.backends import engine

    tr = cfg.train
    tasks = list(tr.get("eval_tasks") or [])
    options.limit("train.eval_tasks_limit", tr.get("eval_tasks_limit"))  # a bad value is refused even unused
    if not tasks:
        if tr.get("eval_tasks_include_path"):
            raise UserError("train.eval_tasks_include_path", tr.eval_tasks_include_path, "It names a directory of "
                            "task YAMLs, and train.eval_tasks names no task.",
                            "Add train.eval_tasks=[NAME] (a task of that directory), or drop the path.")
        return
    if not getattr(engine(cfg.backend), "post_training", True):
        raise UserError("train.eval_tasks", tasks, "The harness scores each request with one forward of the whole "
                        f"model on every rank, and backend={cfg.backend.name} splits the model into pipeline stages.",
                        "Score the run's export after training with `shardyard eval RUN tasks=[...]`, or use "
                        "backend=fsdp, zero3, fsdp_tp, ddp or zero1/zero2 for scores during training.")
    harness.require_harness("train.eval_tasks", "leave train.eval_tasks unset")
    manager = harness.check_tasks(tasks, tr.get("eval_tasks_include_path"), key="train.eval_tasks",
                                  include_key="train.eval_tasks_include_path")
    generating = harness.generation_tasks(manager, tasks)
    if generating:
        raise UserError("train.eval_tasks", generating[0] if len(generating) == 1 else generating,
                        "Generation tasks (output_type generate_until) are not scored during training: only "
                        "log-likelihood and multiple-choice tasks run in lockstep on every rank.",
                        "Score them after the run with `shardyard eval RUN tasks=[...]`, and keep "
                        "train.eval_tasks to log-likelihood and multiple-choice tasks.")


def _validate_reference_weights(cfg: DictConfig) -> None:
    """``objective.reference_weights``: a directory of safetensors whose tensors are the policy's, by name and shape
    (read from the files' headers, against the policy built on the meta device), so the reference loads on every
    engine; else exit 2 naming the first tensor that differs."""
    from shardyard.model import shape_model, signature
    from shardyard.objectives import held

    w = cfg.objective.get("reference_weights")
    key = "objective.reference_weights"
    if w and cfg.peft.name != "none":
        raise UserError(key, w, f"With peft={cfg.peft.name} the reference is the policy with its adapters disabled "
                        "(no second model), so other reference weights would not be used.",
                        "Drop objective.reference_weights, or train without adapters (peft=none).")
    if w and not held(cfg.objective)[0] and not cfg.objective.get("precompute_ref_logps"):
        raise UserError(key, w, "This objective holds no reference model (GRPO with objective.beta=0: no KL term).",
                        "Drop objective.reference_weights, or set objective.beta above 0.")
    if not w or cfg.plan.hardware is not None:  # planning for other machines: their files are not here to check
        return
    d = os.path.expanduser(w)
    from shardyard.weights import _weight_files, has_weights

    if not os.path.isdir(d) or not has_weights(d):
        raise UserError(key, w, "No directory of *.safetensors weights is there.",
                        "Point it at an HF checkpoint of the policy's architecture (e.g. an SFT run's hf/ export), "
                        "or null for the policy's own starting weights.")
    from safetensors import safe_open

    have: dict[str, list[int]] = {}
    for name, f in _weight_files(d).items():
        with safe_open(f, framework="pt") as fh:
            have[name] = list(fh.get_slice(name).get_shape())
    want = signature(shape_model(cfg.model))
    for name, shape in want.items():
        if name not in have or have[name] != shape:
            got = f"shape {have[name]}" if name in have else "no such tensor"
            raise UserError(key, w, f"The reference does not match the policy ({cfg.model.name}): {name} is {shape} "
                            f"in the policy and has {got} there.",
                            "Use a checkpoint of the policy's architecture and size (the same model option and "
                            "shape keys), or null for the policy's own starting weights.")


SWEEP_METRICS = ("train/loss", "eval/loss", "eval/ppl", "lr", "grad_norm", "tokens_per_s", "samples_per_s",
                 "step_time_s", "data_time_s", "tflops_per_device", "mfu", "loss_scale", "skipped_steps")
"""What ``metrics.jsonl`` holds (``loop.train``), so what a sweep can rank by (``memory/*`` too)."""


def _validate_sweep(sw: DictConfig) -> None:
    if sw.objective not in SWEEP_METRICS and not str(sw.objective).startswith("memory/"):
        raise UserError("sweep.objective", sw.objective, "The runs log no such metric.",
                        f"Use one of {', '.join(SWEEP_METRICS)} or memory/*.")
    if not 1024 <= sw.base_port <= 65535 - 64 * 16:
        raise UserError("sweep.base_port", sw.base_port, "Job slots take 64 ports each from it, above the "
                        "privileged ports.", f"Use a port between 1024 and {65535 - 64 * 16}, e.g. 29600.")


def _gpu_capability() -> tuple[str, float] | None:
    """The first GPU's name and compute capability from nvidia-smi, leaving CUDA uninitialised in this process
    (a parallel sweep forks its jobs from it); None without nvidia-smi."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        name, cap = out[0].rsplit(",", 1)
        return name.strip(), float(cap)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _validate_speed_options(cfg: DictConfig) -> None:
    """The keys that buy throughput or memory (docs/performance.md): their values, and the adapters fp8 cannot
    convert. Which engines take each one is the engine's own ``validate``."""
    from shardyard.config import checkpointing_mode

    m = cfg.model
    checkpointing_mode(m)  # raises UserError on a value it does not know
    _at_least("model.activation_checkpointing_every", m.get("activation_checkpointing_every", 1), 1)
    _at_least("model.loss_chunk", m.get("loss_chunk", 0), 0)
    if cfg.precision.name == "fp8" and cfg.peft.name != "none":
        raise UserError("precision", "fp8", f"Float8 linears replace the blocks' nn.Linear layers, which peft="
                        f"{cfg.peft.name} wraps with its adapters (and QLoRA quantizes to 4 bits).",
                        "Use precision=bf16 with adapters, or peft=none for fp8 training.")


def _validate_precision(pr: DictConfig, dev: str) -> None:
    import torch

    from shardyard.config.schema import Precision

    precision = Precision(pr.name)
    if precision is Precision.fp8:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise UserError("precision", "fp8", "Float8 training runs through torchao, which is not installed.",
                            "pip install 'shardyard[fp8]' (torchao), or use precision=bf16.")
        gpu = _gpu_capability() if dev == "cuda" else None
        if gpu is not None and gpu[1] < 8.9:  # float8 tensor cores: Ada (8.9) and Hopper (9.0) on
            raise UserError("precision", "fp8", f"This GPU ({gpu[0]}, compute capability {gpu[1]}) has no float8 "
                            "matmuls (Ada, 8.9, and Hopper, 9.0, and later have them).", "Use precision=bf16.")
    if precision in (Precision.bf16, Precision.fp8) and dev == "cuda":
        gpu = _gpu_capability()
        if gpu is None:  # no nvidia-smi: ask torch (this initialises CUDA here)
            gpu = (torch.cuda.get_device_name(), 8.0 if torch.cuda.is_bf16_supported() else 0.0)
        if gpu[1] < 8.0:  # bf16 tensor cores from Ampere (sm_80) on
            raise UserError("precision", pr.name, f"This GPU ({gpu[0]}, compute capability {gpu[1]}) has no native "
                            "bf16 (Ampere, 8.0, and later have it; older GPUs would emulate it, slowly).",
                            "Use precision=fp16 (loss-scaled) or precision=fp32.")
    if precision is not Precision.fp32 and not torch.amp.autocast_mode.is_autocast_available(dev):
        raise UserError("precision", pr.name, f"This torch build has no autocast for {dev}.", "Use precision=fp32.")
    if precision is Precision.fp16 and dev == "cpu":
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                torch.ones(2, 2) @ torch.ones(2, 2)
        except RuntimeError as e:
            raise UserError("precision", "fp16", f"This CPU torch build cannot run fp16 autocast ({e}).",
                            "Use precision=bf16 or precision=fp32 on CPU.") from None
