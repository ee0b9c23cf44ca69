"""The layout search (``plan.search=true``): every layout of the recipe that fits ``plan.hardware`` x ``plan.nodes``,
ranked by the step time :mod:`shardyard.planning.steptime` predicts, the first checked by a dry run.

A layout is an engine (each ``backend`` option: DDP, Horovod, ZeRO-1/2/3 and their offloads, FSDP and its offload,
FSDP + tensor parallel, pipeline) with its degrees (HSDP copies, tensor-parallel degree, pipeline stages, schedule
and micro-batches, expert-parallel degree, Ulysses sequence groups at micro batch 1), a micro batch and an
activation-checkpointing policy; the model, the sequence and the global batch are the recipe's. All-gather context
parallelism (``backend.cp``) is not searched: where the heads divide, Ulysses holds less.
Keys set on the command line stay as given (``fixed``): ``backend=fsdp`` searches FSDP's layouts only.

Each layout is composed as the run would be (``backend=<option>`` through Hydra, once per engine; the degrees set on
a copy), planned by :func:`shardyard.planning.plan.estimate` (it must fit with ``plan.headroom``), timed by
:func:`shardyard.planning.steptime.predict`, and, in ranked order until the table is full, checked by the batch
arithmetic and the engine's own ``validate`` (what a run would refuse is not shown). The first is then dry-run
(:mod:`shardyard.planning.dryrun`) before it is printed as the winner; its overrides go to ``layout.yaml`` in the run dir.

A module of the ``planning`` package: it imports the plan, the step-time model, the dry run, validation, ``backends``
(the engines' degree keys), ``config`` and ``core``; Hydra only to compose the engines' options.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, open_dict

from shardyard.config import checkpointing_mode
from shardyard.core.errors import UserError
from shardyard.core.facts import Plan
from shardyard.planning.hardware import GiB, Hardware
from shardyard.planning.plan import Estimate, estimate, nodes_needed
from shardyard.planning.steptime import StepTime, predict

LAYOUT_KEYS = ("backend", "backend.tp", "backend.stages", "backend.schedule", "backend.microbatches",
               "backend.virtual_stages", "backend.ep", "backend.replicate", "train.micro_batch_size",
               "model.activation_checkpointing")
"""The keys a layout sets; those given on the command line stay fixed."""
POLICIES = ("none", "selective", "full")
"""Activation checkpointing policies searched (``model.activation_checkpointing``)."""


@dataclass
class Layout:
    """One layout that fits, with its plan and predicted step."""

    overrides: list[str]
    """What turns the recipe into this layout, to paste after ``python train.py``."""
    settings: tuple
    """(the engine's composed config, its option name, degrees, micro batch, policy): ``config`` rebuilds it."""
    batch: Plan
    estimate: Estimate
    time: StepTime

    @property
    def cfg(self) -> DictConfig:
        """The layout's own config, built on first use (a copy costs 20 ms: only the layouts shown need one)."""
        if "_cfg" not in self.__dict__:
            base, name, degrees, mbs, policy = self.settings
            self.__dict__["_cfg"] = _variant(base.copy(), self.batch, None, name, degrees, mbs, policy)[1]
        return self.__dict__["_cfg"]


# ------------------------------------------------------------------------------------------ the fixed keys
def command_line() -> dict[str, str]:
    """The layout keys the command line sets (Hydra's task overrides), key -> value."""
    from hydra.core.hydra_config import HydraConfig

    return fixed_keys(list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [])


def fixed_keys(overrides: list[str]) -> dict[str, str]:
    """``LAYOUT_KEYS`` among ``overrides`` (``key=value``, ``+key=value``), key -> value."""
    out = {}
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key in LAYOUT_KEYS:
            out[key] = value
    return out


def check_fixed(fixed: dict[str, str], world: int) -> None:
    """Degrees fixed by the user that contradict each other (``UserError`` naming the later key):

    1. Tensor parallelism and pipeline stages: no engine here combines them (``fsdp_tp`` has ``backend.tp``,
       ``pipeline`` has ``backend.stages``).
    2. Their product must divide the world (``plan.hardware`` x ``plan.nodes`` ranks): HSDP's copies multiply
       with tensor parallelism and pipeline stages (expert parallelism borrows the shards, within a copy)."""
    def num(key: str) -> int:
        return int(fixed.get(key, 1) or 1)

    if "backend.tp" in fixed and "backend.stages" in fixed:  # 1
        raise UserError("backend.stages", fixed["backend.stages"], f"backend.tp={fixed['backend.tp']} is fixed too, and "
                        "no engine here combines tensor parallelism with pipeline stages (fsdp_tp has backend.tp, "
                        "pipeline has backend.stages).",
                        "Fix one of the two (or neither: plan.search tries both).")
    product = num("backend.tp") * num("backend.stages") * num("backend.replicate")
    if world % product:  # 2
        key = next(k for k in ("backend.replicate", "backend.stages", "backend.tp") if num(k) > 1)
        raise UserError(key, fixed[key], f"The degrees fixed on the command line multiply to {product}, which does "
                        f"not divide the {world} ranks of plan.hardware x plan.nodes.",
                        "Fix degrees whose product divides the world, or plan.nodes to a count it divides.")


# ---------------------------------------------------------------------------------------------- the search
def free_micro_batch(cfg: DictConfig, fixed: dict[str, str], world: int) -> None:
    """The micro batch is the search's to choose unless the command line fixes it. The recipe's own would refuse the
    search before it starts where it does not divide the global batch at this world (the default 16 per rank beside
    torchtitan's global batch of 16 on 8 GPUs): 1 stands in for it then (``_batches`` searches every micro batch that
    divides, whatever the recipe's)."""
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if "train.micro_batch_size" in fixed or gbs is None or gbs % (mbs * world) == 0:
        return
    with open_dict(cfg):
        cfg.train.micro_batch_size = 1


def search(cfg: DictConfig, batch: Plan, hw: Hardware, fixed: dict[str, str], options: list[str],
           compose: Callable[[list[str]], DictConfig]) -> list[Layout]:
    """Every layout of ``cfg`` on ``hw`` that fits, fastest first (``options``: the ``backend`` group's options;
    ``compose(overrides)``: the run's config with more overrides)."""
    found = []
    for overrides, variant, b, settings in candidates(cfg, batch, hw, fixed, options, compose):
        e = estimate(variant, b, hw)
        if not e.fits:
            continue
        t = predict(variant, b, hw, e.grad_accum)
        if t is not None:  # the candidate's config is reused for the next: the layout rebuilds its own when asked
            found.append(Layout(overrides, settings, b, e, t))
    found.sort(key=lambda lay: lay.time.step_s)
    return found


def candidates(cfg: DictConfig, batch: Plan, hw: Hardware, fixed: dict[str, str], options: list[str],
               compose: Callable[[list[str]], DictConfig]) -> Iterator[tuple[list[str], DictConfig, Plan, tuple]]:
    """Every layout: each engine option (the fixed one only, when ``backend`` is fixed) composed once, then its
    degrees, micro batches and checkpointing policies set on copies (``_degrees``, ``_batches``)."""
    from hydra.errors import ConfigCompositionException

    from shardyard.backends import engine

    names = [fixed["backend"]] if "backend" in fixed else options
    for name in names:
        # 1. The engine as the run would compose it; one that cannot take this world (single) is skipped, as is
        # ZeRO-Infinity without the NVMe directory it needs.
        try:
            base = cfg if name == cfg.backend.name else compose([f"backend={name}"])
        except ConfigCompositionException:
            continue
        most = getattr(engine(base.backend), "max_ranks", None)
        if (most is not None and hw.world > most) or "nvme" in (str(base.backend.get("offload_param")),
                                                                 str(base.backend.get("offload_optimizer"))):
            continue
        work = base.copy()  # 2. one copy per engine, its keys set for each layout in turn (copies cost 20 ms each)
        for degrees in _degrees(base, batch, hw, fixed):
            with open_dict(work):
                work.backend = base.backend.copy()
            for mbs, policy in _batches(base, batch, degrees, hw, fixed):
                yield (*_variant(work, batch, hw, name, degrees, mbs, policy), (base, name, degrees, mbs, policy))


def _degrees(base: DictConfig, batch: Plan, hw: Hardware, fixed: dict[str, str]) -> list[dict[str, Any]]:
    """The engine's degree settings to try, as backend keys -> value (the engine's ``degree_keys`` say which it
    has): tensor-parallel degrees within a node that divide the heads, pipeline stages up to the layers with each
    schedule, each of them with HSDP copies whose shard groups (with their tp ranks) are whole nodes,
    expert-parallel degrees within a copy's shards (``search._ep_options``), sequence or context groups within a
    node (not beside expert parallelism yet, though the engines run it: its step time is not modelled for it)."""
    from shardyard.backends import engine
    from shardyard.planning.search import _ep_options

    keys = set(getattr(engine(base.backend), "degree_keys", {}).values())
    m = base.model
    layers, heads = int(m.get("num_layers", 0) or 0), int(m.get("num_heads", 0) or 0)
    kv = int(m.get("num_kv_heads", 0) or heads or 0)
    powers = [2 ** i for i in range(1, int(math.log2(hw.world)) + 1)]
    options: list[dict[str, Any]] = [{}]
    if "backend.tp" in keys:
        options = [{"tp": t} for t in powers if t <= hw.ranks_per_node and hw.ranks_per_node % t == 0
                   and (not heads or (heads % t == 0 and kv % t == 0))]
    if "backend.stages" in keys:
        options = [{"stages": s, "schedule": sch} for s in powers if hw.world % s == 0 and (not layers or s <= layers)
                   for sch in ("gpipe", "1f1b", "interleaved")]
    if "backend.replicate" in keys:  # a copy: whole nodes of shards (x tp), so that only the copies' all-reduce
        # crosses between them
        def copies(d: dict[str, Any]) -> list[int]:
            split = d.get("tp", 1) * d.get("stages", 1)
            return [r for r in range(2, hw.nodes + 1) if hw.world % (split * r) == 0
                    and hw.world // (split * r) * d.get("tp", 1) % hw.ranks_per_node == 0]
        options = [*options, *({**d, "replicate": r} for d in options for r in copies(d))]
    if "backend.ep" in keys and batch.facts.routed_experts:
        out = []
        for d in options:
            shards = hw.world // (d.get("stages", 1) * d.get("replicate", 1))
            out += [d] + [{**d, "ep": e} for e in _ep_options(batch.facts.routed_experts, shards, hw.ranks_per_node)]
        options = out
    if "backend.sp" in keys:  # Ulysses sequence groups within a node, dividing the heads and the sequence
        seq = int(base.data.seq_len)
        sps = [s for s in powers if s <= hw.ranks_per_node and hw.ranks_per_node % s == 0 and seq % s == 0
               and (not heads or heads % s == 0)]
        split = [{**d, "sp": s} for d in options if "ep" not in d for s in sps]
        if "backend.cp" in keys:  # all-gather context parallel groups within a node: any head count, the
            # sequence in 2 x cp chunks (each rank a head and a tail chunk)
            split += [{**d, "cp": c} for d in options if "ep" not in d for c in powers
                      if c <= hw.ranks_per_node and hw.ranks_per_node % c == 0 and seq % (2 * c) == 0]
        options = options + split
    # The user's own degrees stay as given (``fixed``): only the settings that agree with them.
    given = {k.split(".", 1)[1]: v for k, v in fixed.items() if k.startswith("backend.")}
    return [d for d in options if all(str(d.get(k, base.backend.get(k))) == v for k, v in given.items())] \
        or ([{k: _number(v) for k, v in given.items()}] if given else [{}])


def _number(v: str) -> Any:
    return int(v) if v.lstrip("-").isdigit() else v


def _batches(base: DictConfig, batch: Plan, degrees: dict[str, Any], hw: Hardware, fixed: dict[str, str]
             ) -> Iterator[tuple[int, str]]:
    """Micro batches (every divisor of each replica's share of the global batch: llm-foundry's 14 of a share of 14
    too, not powers of two only) and checkpointing policies, those fixed on the command line only. A sequence group
    (``sp``, ``cp``) trains one sequence at a time: it is the layout for a sequence too long for one rank, and more of
    them per micro-batch on the same ranks is the same work as fewer such ranks (the search stays within a minute)."""
    mp = int(degrees.get("tp", 1)) * int(degrees.get("stages", 1))
    group = int(degrees.get("sp", 1)) * int(degrees.get("cp", 1))  # one sequence's ranks, either split
    dp = hw.world // (mp * group)
    share = batch.global_batch_size // dp if batch.global_batch_size % dp == 0 else 0
    sizes = [int(fixed["train.micro_batch_size"])] if "train.micro_batch_size" in fixed else \
        [1] if group > 1 else _divisors(share)
    policies = [checkpointing_mode(_policy(fixed["model.activation_checkpointing"]))] \
        if "model.activation_checkpointing" in fixed else list(POLICIES)
    if int(base.model.get("mlp_tiles", 0)) > 1:  # tiled MLPs are refused beside selective checkpointing
        policies = [p for p in policies if p != "selective"]
    for mbs in sizes:
        if share and share % mbs == 0:
            for policy in policies:
                yield mbs, policy


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(sqrt n) (a global batch of millions of sequences stays quick)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


def _policy(value: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({"activation_checkpointing": {"true": True, "false": False}.get(value.lower(), value)})


def _variant(base: DictConfig, batch: Plan, hw: Hardware | None, name: str, degrees: dict[str, Any], mbs: int,
             policy: str) -> tuple[list[str], DictConfig, Plan]:
    """The layout's config (``base``, the engine's, set in place to its degrees, micro batch and policy), its batch
    plan, and the overrides that make it."""
    from shardyard.backends import parallel_dims

    v = base
    with open_dict(v):
        for k, val in degrees.items():
            v.backend[k] = val
        if "stages" in degrees:  # every pipeline micro-batch one sequence at most: the smallest bubble it can have
            v.backend.microbatches = mbs if degrees["schedule"] == "gpipe" or mbs % degrees["stages"] == 0 else \
                degrees["stages"]
        v.train.micro_batch_size = mbs
        v.train.global_batch_size = batch.global_batch_size
        v.train.grad_accum_steps = None
        v.model.activation_checkpointing = policy
    if hw is None:  # rebuilding a layout's config (``Layout.cfg``): its batch plan is known
        b = batch
    else:
        dims = parallel_dims(v, hw.world)
        accum = max(1, batch.global_batch_size // (mbs * dims.dp))
        b = dataclasses.replace(batch, micro_batch_size=mbs, grad_accum_steps=accum, dims=dims, world_size=hw.world,
                                nproc_per_node=hw.ranks_per_node, nnodes=hw.nodes)
    overrides = [f"backend={name}"] + [f"backend.{k}={val}" for k, val in degrees.items()]
    if "stages" in degrees:
        overrides.append(f"backend.microbatches={v.backend.microbatches}")
    overrides += [f"train.micro_batch_size={mbs}", f"model.activation_checkpointing={policy}"]
    return overrides, v, b


def runnable(lay: Layout, batch: Plan) -> bool:
    """Whether a run of this layout passes what validation checks of a layout: the batch arithmetic at the
    planned world and the engine's own ``validate`` (a pipeline's micro-batches and layers, tp's heads ...)."""
    from shardyard.backends import engine
    from shardyard.planning.validate import plan as batch_plan

    try:
        p = dataclasses.replace(batch_plan(lay.cfg, None), model=batch.facts)
        engine(lay.cfg.backend).validate(lay.cfg, p)
    except UserError:
        return False
    lay.batch = p
    return True


# ---------------------------------------------------------------------------------------------- the report
def report(cfg: DictConfig, batch: Plan, hw: Hardware, fixed: dict[str, str], options: list[str],
           compose: Callable[[list[str]], DictConfig], dry_run: Callable[[Layout], bool] | None = None) -> str:
    """``plan.search``: the ranked table, the winner checked by ``dry_run`` (``check_by_dry_run`` unless given),
    and where its overrides were written; ``UserError`` when no layout fits (naming the fewest nodes that would)."""
    ranked = search(cfg, batch, hw, fixed, options, compose)
    shown: list[Layout] = []
    for lay in ranked:  # in order, those a run would accept, until the table is full
        if runnable(lay, batch):
            shown.append(lay)
            if len(shown) == cfg.plan.search_top:
                break
    if not shown:
        raise nothing_fits(cfg, batch, hw, fixed, options, compose)
    check = dry_run or check_by_dry_run
    verdict = "not dry-run (plan.search_dry_runs=0)"
    for i, lay in enumerate(shown[:cfg.plan.search_dry_runs]):
        if check(lay):
            shown.insert(0, shown.pop(i))
            verdict = "checked by a dry run: it fits as measured and agrees with the plan"
            break
        verdict = f"the dry run refused the first {i + 1}: this one is unchecked"
    path = write_winner(cfg, hw, shown[0], verdict)
    line = " ".join(shown[0].overrides)
    return "\n".join([table(shown, hw, len(ranked)), f"winner ({verdict}): {line}",
                      f"its overrides are in {path}; run it with: python train.py <your overrides> {line}"])


def table(shown: list[Layout], hw: Hardware, fitting: int) -> str:
    """The ranked layouts: overrides, memory per GPU, predicted tokens/s/GPU and MFU, step time, the bottleneck."""
    head = f"{'#':>2} {'GiB/GPU':>7} {'tok/s/GPU':>9} {'MFU':>5} {'step s':>7}  {'bottleneck':44} overrides"
    lines = [f"layout search on {hw.nodes} x {hw.name} ({hw.world} GPUs): {fitting} layouts fit; the fastest "
             f"{len(shown)} a run accepts, by predicted step time (shardyard.planning.steptime; docs/plan.md)",
             head, "-" * len(head)]
    for i, lay in enumerate(shown, 1):
        t = lay.time
        lines.append(f"{i:>2} {(lay.estimate.device_peak + 0) / GiB:7.1f} {t.tokens_per_s_per_gpu:9,.0f} "
                     f"{t.mfu:5.1%} {t.step_s:7.3f}  {t.bottleneck[:44]:44} {' '.join(lay.overrides)}")
    lines.append(f"hardware: {hw.source or hw.name}")
    lines.append("not searched: the global batch, sequence, model and precision "
                 f"({shown[0].cfg.precision.name}: MFU of its peak) are the recipe's")
    return "\n".join(lines)


def write_winner(cfg: DictConfig, hw: Hardware, lay: Layout, verdict: str) -> str:
    """``layout.yaml`` in the run dir: the winner's overrides, the command line to paste, and its prediction."""
    import os

    from omegaconf import OmegaConf

    os.makedirs(cfg.run_dir, exist_ok=True)
    path = os.path.join(cfg.run_dir, "layout.yaml")
    t = lay.time
    doc = {"overrides": lay.overrides, "paste": "python train.py <your overrides> " + " ".join(lay.overrides),
           "hardware": f"{hw.nodes} x {hw.name}", "dry_run": verdict,
           "predicted": {"step_s": round(t.step_s, 4), "tokens_per_s_per_gpu": round(t.tokens_per_s_per_gpu, 1),
                         "mfu": round(t.mfu, 4), "bottleneck": t.bottleneck},
           "memory_gib_per_gpu": round(lay.estimate.device_peak / GiB, 2)}
    with open(path, "w") as f:
        f.write("# plan.search's winner (shardyard.planning.layouts): paste the overrides after your own\n")
        f.write(OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path


def check_by_dry_run(lay: Layout) -> bool:
    """The dry run of the layout at its world (``dryrun.main``): True when it fits as measured and agrees."""
    from shardyard.planning import dryrun

    print(f"shardyard | plan.search: dry run of the first choice: {' '.join(lay.overrides)}", flush=True)
    return dryrun.main(lay.cfg, lay.batch) == 0


def nothing_fits(cfg: DictConfig, batch: Plan, hw: Hardware, fixed: dict[str, str], options: list[str],
                 compose: Callable[[list[str]], DictConfig]) -> UserError:
    """The refusal when no layout fits: the fewest nodes on which one would (each layout's leanest: micro batch 1,
    full checkpointing), or that none does within the plan's node limit."""
    leanest = {**fixed, "train.micro_batch_size": "1", "model.activation_checkpointing": "full"}
    least = None
    for _, variant, b, _ in candidates(cfg, batch, hw, leanest, options, compose):
        n = nodes_needed(variant, b, hw)
        if n is not None and (least is None or n < least):
            least = n
    where = f"{hw.nodes} node(s) of {hw.name}"
    if least is None:
        return UserError("plan.nodes", hw.nodes, f"No layout of {cfg.model.name} fits {where}, nor any count of them "
                         "the plan searches.", "Use a smaller model, or a GPU with more memory (plan.hardware).")
    return UserError("plan.nodes", hw.nodes, f"No layout of {cfg.model.name} fits {where} (every engine, degree, "
                     "micro batch and checkpointing policy searched; keys fixed on the command line kept).",
                     f"The fewest nodes on which one fits: plan.nodes={least} (with a global batch their data-parallel "
                     "size divides).")
