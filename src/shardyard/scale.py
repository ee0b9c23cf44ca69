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
    """Rewrite ``cfg`` in place when ``scale.name`` is ``smoke`` (before validation and the plan); the line that
    says what was scaled, or None."""
    if cfg.scale.name == "full":
        return None
    from shardyard.errors import UserError

    if cfg.scale.name != "smoke":
        raise UserError("scale.name", cfg.scale.name, "The scales are `full` (the recipe as written) and `smoke`.",
                        "Use +scale=smoke, or leave scale out.")
    s = cfg.scale
    was = (f"{cfg.model.name}, {cfg.launch.nproc_per_node} ranks x {cfg.launch.nnodes} node(s), "
           f"{cfg.train.steps} steps, {cfg.precision.name}")
    with open_dict(cfg):
        _model(cfg.model)
        world = _world(cfg, s.world_size)
        accum = _accumulation(cfg, world)
        cfg.launch.nproc_per_node, cfg.launch.nnodes = world, 1
        cfg.train.micro_batch_size = min(cfg.train.micro_batch_size, 2)
        _model_parallel(cfg, world)
        cfg.train.grad_accum_steps, cfg.train.global_batch_size = accum, None
        cfg.train.steps = s.steps
        cfg.train.eval_every_n_steps, cfg.train.eval_batches = 0, 1  # step 0 and the end, on the same batch
        cfg.train.log_every_n_steps, cfg.train.sample_tokens = 1, 0
        cfg.data.seq_len = min(cfg.data.seq_len, s.seq_len)
        if "warmup_steps" in cfg.sched:
            cfg.sched.warmup_steps = min(cfg.sched.warmup_steps, 1)
        if cfg.precision.name == "fp16":
            cfg.precision.name = "bf16"
        if cfg.peft.name == "qlora":
            cfg.peft.name = "lora"
        if cfg.backend.get("device") == "cuda":
            cfg.backend.device = "auto"
        cfg.checkpoint.every_n_steps, cfg.checkpoint.save_final, cfg.checkpoint.export_hf = 0, False, False
        for name in [m for m in cfg.monitor or {} if m != "console"]:
            del cfg.monitor[name]
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
    from shardyard.backends import model_parallel_size

    tr, launch = cfg.train, cfg.launch
    if tr.global_batch_size is None:
        accum = tr.grad_accum_steps or 1
    else:
        n = launch.nproc_per_node
        world = (int(n) if str(n).isdigit() else 1) * max(int(launch.nnodes), 1)
        dp = max(1, world // model_parallel_size(cfg))
        accum = max(1, tr.global_batch_size // (tr.micro_batch_size * dp))
    return min(int(accum), 2)


def _model_parallel(cfg: DictConfig, world: int) -> None:
    """Tensor parallel and pipeline stages shrink to the smoke world (the largest degree that divides it, kept
    at 2 or more where the world allows, so that the split itself is exercised); a pipeline keeps a layer per
    chunk and splits the micro batch as often as it has stages."""
    b = cfg.backend
    for key in ("tp", "stages"):
        if key in b:
            b[key] = max(d for d in range(1, world + 1) if world % d == 0 and d <= max(int(b[key]), 1))
    if "stages" in b:
        chunks = b.stages * (b.virtual_stages if b.schedule == "interleaved" else 1)
        if "num_layers" in cfg.model:
            cfg.model.num_layers = max(int(cfg.model.num_layers), chunks)
        b.microbatches = b.stages
        cfg.train.micro_batch_size = max(cfg.train.micro_batch_size, b.stages)
