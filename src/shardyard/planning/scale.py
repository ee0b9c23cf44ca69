"""``+scale=smoke``: any recipe, scaled down to run on a CPU box in seconds (the recipe book's test runs every
recipe this way; a user runs one before queueing it on a cluster).

What decides *how* a recipe trains is kept: its engine and every engine option, the architecture family
(the builder's ``smoke_shape``), activation checkpointing, gradient accumulation (at most 2), the optimizer
and schedule types, gradient compression. What only decides *how much* shrinks: model size, vocabulary
(the default corpus' tokenizer), sequence length, micro batch, ranks (``scale.world_size``, one node), steps.
fp16 becomes bf16: the CPU's reduced precision, with the same autocast code path; the DeepSpeed fp16 loss
scaler is CUDA-only. Fine-tuning keeps its data, chat template and adapters, but not the recipe's pretrained
weights (``model.weights``: they are of the full-size model), and ``peft=qlora`` becomes ``lora`` (the same
adapters on an unquantised base: bitsandbytes' 4-bit kernels are CUDA-only). The model is evaluated before and after, so a run can be checked for a falling loss.
"""

from __future__ import annotations

from omegaconf import DictConfig, open_dict


def apply(cfg: DictConfig) -> str | None:
    """Rewrite ``cfg`` in place with the function ``scale._target_`` names (before validation and the plan);
    the line that says what was scaled, or None for the recipe as written."""
    target = cfg.scale._target_
    if target is None:
        return None
    from hydra.utils import get_object

    from shardyard.core.errors import UserError

    try:
        scaler = get_object(target)
    except Exception as e:
        raise UserError("scale._target_", target, f"It cannot be imported ({type(e).__name__}: {e}).",
                        "Use +scale=smoke, or leave scale out.") from None
    return scaler(cfg)


def smoke(cfg: DictConfig) -> str:
    """``+scale=smoke``: the recipe shrunk to ``scale.world_size`` ranks, ``scale.steps`` steps and a tiny model
    of its family (the module's docstring says what is kept)."""
    from shardyard.models import adapters
    from shardyard import monitors
    from shardyard.config.schema import Precision

    s = cfg.scale
    if cfg.plan.dry_run:  # it would drop the hardware the dry run simulates, and the dry run then find none
        from shardyard.core.errors import UserError

        raise UserError("plan.dry_run", True, "A dry run simulates the recipe at its own size on the hardware "
                        "plan.hardware x plan.nodes names, and +scale=smoke shrinks the recipe to a tiny model on "
                        f"{s.world_size} rank(s) of this machine: the two undo each other.",
                        "Drop +scale=smoke to dry-run the recipe as written (plan.dry_run=true plan.hardware=... "
                        "plan.nodes=N), or drop plan.dry_run to run the scaled-down recipe here.")
    was = (f"{cfg.model.name}, {cfg.launch.nproc_per_node} ranks x {cfg.launch.nnodes} node(s), "
           f"{cfg.train.steps} steps, {cfg.precision.name}")
    with open_dict(cfg):
        _model(cfg.model)
        world = _world(cfg, s.world_size)
        accum = _accumulation(cfg, world)
        cfg.launch.nproc_per_node, cfg.launch.nnodes = world, 1
        cfg.train.micro_batch_size = min(cfg.train.micro_batch_size, 2)
        _model_parallel(cfg, world)  # after the micro batch: a pipeline raises it to its stages
        cfg.train.grad_accum_steps, cfg.train.global_batch_size = accum, None
        cfg.train.steps = s.steps
        cfg.train.eval_every_n_steps, cfg.train.eval_batches = 0, 1  # step 0 and the end, on the same batch
        cfg.train.log_every_n_steps, cfg.train.sample_tokens = 1, 0
        cfg.data.seq_len = min(cfg.data.seq_len, s.seq_len)
        if "warmup_steps" in cfg.sched:
            cfg.sched.warmup_steps = min(cfg.sched.warmup_steps, 1)
        if Precision(cfg.precision.name) is Precision.fp16:
            cfg.precision.name = Precision.bf16  # the CPU's reduced precision; DeepSpeed's loss scaler is CUDA-only
        adapters.method(cfg.peft).for_smoke(cfg.peft)
        if cfg.backend.get("device") == "cuda":
            cfg.backend.device = "auto"
        cfg.checkpoint.every_n_steps, cfg.checkpoint.save_final, cfg.checkpoint.export_hf = 0, False, False
        monitors.check_run_only(cfg.monitor)
        cfg.profile.enabled = False
        cfg.plan.hardware, cfg.plan.nodes = None, 1
    return (f"+scale=smoke: the recipe ({was}) scaled down to a tiny {cfg.model.name}-family model, "
            f"{world} rank(s), {s.steps} steps, {cfg.precision.name}; engine {cfg.backend.name} and its options as written")


def _model(m: DictConfig) -> None:
    from hydra.utils import get_object

    shape = getattr(get_object(m._target_), "smoke_shape", None)
    if shape is None:
        return  # a user's builder without a smoke shape: its model is kept as is
    for key, value in shape.items():
        m[key] = value
    if "vocab_size" in m:
        m.vocab_size = "${data.tokenizer.vocab_size}"  # the default corpus' tokenizer, not the recipe's 100k vocab
    m.compile = False
    if m.get("weights") not in (None, "auto"):
        m.weights = None  # the full-size model's checkpoint does not fit the tiny shape


def _world(cfg: DictConfig, most: int) -> int:
    n = cfg.launch.nproc_per_node
    wanted = (int(n) if str(n).isdigit() else 1) * max(int(cfg.launch.nnodes), 1)
    return max(1, min(wanted, most))


def _accumulation(cfg: DictConfig, world_smoke: int) -> int:
    """The recipe's own accumulation (from its global batch over its own data-parallel ranks), at most 2."""
    from shardyard.backends import parallel_dims

    tr, launch = cfg.train, cfg.launch
    if tr.global_batch_size is None:
        accum = tr.grad_accum_steps or 1
    else:
        n = launch.nproc_per_node
        world = (int(n) if str(n).isdigit() else 1) * max(int(launch.nnodes), 1)
        dp = parallel_dims(cfg, world).dp  # the recipe's layout on its own world (validation derives the smoke run's)
        accum = max(1, tr.global_batch_size // (tr.micro_batch_size * dp))
    return min(int(accum), 2)


def _model_parallel(cfg: DictConfig, world: int) -> None:
    """The engine's own parallel degrees shrink to the smoke world (its class's ``for_smoke``: the engine knows
    its options), and so do the sequence and context parallel degrees of the data-parallel engines."""
    from shardyard.backends import engine, smoke_degree

    for_smoke = getattr(engine(cfg.backend), "for_smoke", None)
    if for_smoke is not None:
        for_smoke(cfg, world)
    for key in ("sp", "cp"):  # one sequence's split (the data-parallel engines' keys): over what the smoke world has
        if int(cfg.backend.get(key, 1)) > 1:
            cfg.backend[key] = smoke_degree(cfg.backend[key], world)

