"""Cross-group validation and the derived batch plan. Every failure is a ``UserError`` (exit code 2)."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from shardyard.dist_env import DistEnv
from shardyard.errors import UserError


@dataclass(frozen=True)
class Plan:
    """Numbers derived from the config and the launch; printed at start, used by every worker."""

    device_type: str
    nproc_per_node: int
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def describe(self) -> str:
        return (f"world size {self.world_size} ({self.nproc_per_node}/node on {self.device_type}) | "
                f"global batch {self.global_batch_size} = micro {self.micro_batch_size} x accumulation "
                f"{self.grad_accum_steps} x world {self.world_size} | seq_len {self.seq_len} | "
                f"tokens/step {self.tokens_per_step:,}")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_type(cfg: DictConfig) -> str:
    want = cfg.backend.device
    n_gpu = _cuda_count()
    if want == "auto":
        return "cuda" if n_gpu else "cpu"
    if want not in ("cpu", "cuda"):
        raise UserError("backend.device", want, "The device must be auto, cpu or cuda.", "Use backend.device=auto.")
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
    if env is not None:
        nproc, world = env.local_world_size, env.world_size
    else:
        if nproc == "auto":
            nproc = max(n_gpu, 1) if dev == "cuda" else 1
        elif not (isinstance(nproc, int) or (isinstance(nproc, str) and nproc.isdigit())) or int(nproc) < 1:
            raise UserError("launch.nproc_per_node", nproc, "It must be a positive integer or `auto`.",
                            "Use launch.nproc_per_node=auto (all GPUs, or 1 on CPU) or e.g. launch.nproc_per_node=2.")
        nproc = int(nproc)
        if dev == "cuda" and nproc > n_gpu:
            raise UserError("launch.nproc_per_node", nproc,
                            f"This node has {n_gpu} visible GPU(s), and each worker needs its own.",
                            f"Use launch.nproc_per_node={n_gpu} (or auto), or backend.device=cpu to run gloo workers.")
        if launch.nnodes != 1:
            raise UserError("launch.nnodes", launch.nnodes,
                            "`python train.py` starts workers on this node only.",
                            "Start multi-node jobs with torchrun/srun/deepspeed/horovodrun on every node "
                            "(see README, 'Launching'), leaving launch.nnodes=1.")
        world = nproc
    mbs = tr.micro_batch_size
    if mbs < 1:
        raise UserError("train.micro_batch_size", mbs, "It must be at least 1.", "Use train.micro_batch_size=1 or more.")
    accum, gbs = tr.grad_accum_steps, tr.global_batch_size
    if gbs is None:
        accum = accum or 1
        if accum < 1:
            raise UserError("train.grad_accum_steps", accum, "It must be at least 1.", "Use train.grad_accum_steps=1 or more.")
        gbs = mbs * accum * world
    else:
        per_step = mbs * world
        if gbs % per_step:
            raise UserError("train.global_batch_size", gbs,
                            f"The global batch must be micro batch x accumulation x world size, but {gbs} is not a "
                            f"multiple of micro batch {mbs} x world size {world} = {per_step}.",
                            f"Use a global batch that is a multiple of {per_step} (e.g. {per_step * max(1, round(gbs / per_step))}), "
                            "or change train.micro_batch_size / launch.nproc_per_node.")
        derived = gbs // per_step
        if accum is not None and accum != derived:
            raise UserError("train.grad_accum_steps", accum,
                            f"global_batch_size {gbs} / (micro batch {mbs} x world size {world}) = {derived} "
                            "accumulation steps, which contradicts it.",
                            "Set only one of train.grad_accum_steps and train.global_batch_size.")
        accum = derived
    return Plan(dev, nproc, world, mbs, accum, gbs, cfg.data.seq_len)


def validate(cfg: DictConfig, env: DistEnv | None) -> Plan:
    """All cross-group rules, run in the parent before any worker starts (and again in each worker)."""
    import hydra.utils

    p = plan(cfg, env)
    tr, m, d = cfg.train, cfg.model, cfg.data
    if tr.steps < 1:
        raise UserError("train.steps", tr.steps, "Training needs at least one optimizer step.", "Use train.steps=1 or more.")
    for key in ("log_every_n_steps", "eval_batches"):
        if tr[key] < 1:
            raise UserError(f"train.{key}", tr[key], "It must be at least 1.", f"Use train.{key}=1 or more.")
    if d.seq_len > m.max_position_embeddings:
        raise UserError("data.seq_len", d.seq_len,
                        f"It exceeds model.max_position_embeddings={m.max_position_embeddings}.",
                        f"Use data.seq_len<={m.max_position_embeddings} or raise model.max_position_embeddings.")
    if m.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
        raise UserError("model.attn_implementation", m.attn_implementation, "Unknown attention implementation.",
                        "Use sdpa, eager or flash_attention_2.")
    if m.attn_implementation == "flash_attention_2" and (p.device_type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        raise UserError("model.attn_implementation", m.attn_implementation,
                        "FlashAttention-2 needs CUDA and the flash-attn package.",
                        "Use model.attn_implementation=sdpa (fast on every device), or install flash-attn on a GPU machine.")
    if m.init_device not in ("auto", "cpu", "meta"):
        raise UserError("model.init_device", m.init_device, "Unknown init device.", "Use auto, cpu or meta.")
    if m.pretrained_path is not None and not os.path.isfile(os.path.join(m.pretrained_path, "config.json")):
        raise UserError("model.pretrained_path", m.pretrained_path, "No HF model directory (with config.json) is there.",
                        "Point it at a local directory written by save_pretrained (e.g. a run's hf/ export).")
    _validate_data(d)
    _validate_precision(cfg.precision, p.device_type)
    _validate_optim(cfg)
    if cfg.checkpoint.resume not in (None, "auto") and not os.path.exists(cfg.checkpoint.resume):
        raise UserError("checkpoint.resume", cfg.checkpoint.resume, "There is no checkpoint at that path.",
                        "Use checkpoint.resume=auto (newest complete checkpoint of this run) or an existing path.")
    _validate_monitors(cfg)
    _validate_profile_debug(cfg)
    backend_cls = hydra.utils.get_class(cfg.backend._target_)
    backend_cls.validate(cfg, p)
    return p


def apply_fast_dev_run(cfg: DictConfig) -> None:
    """``debug.fast_dev_run=true``: 2 steps and one evaluation (at the end); nothing saved but metrics."""
    if not cfg.debug.fast_dev_run:
        return
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.train.steps = min(cfg.train.steps, 2)
        cfg.train.eval_every_n_steps = 0
        cfg.train.sample_tokens = 0
        cfg.checkpoint.every_n_steps = 0
        cfg.checkpoint.save_final = False
        cfg.checkpoint.export_hf = False
        cfg.profile.enabled = False


def _validate_monitors(cfg: DictConfig) -> None:
    from shardyard.monitors import PLUGINS

    for name in cfg.monitor or {}:
        if name not in PLUGINS:  # a config file added to conf/monitor without a plugin behind it
            raise UserError("monitor", name, f"There is no monitor plugin named {name!r}.",
                            f"Use some of: {', '.join(PLUGINS)} (and jsonl, which is always on).")
        package = PLUGINS[name][1]
        if package and importlib.util.find_spec(package) is None:
            raise UserError("monitor", name, f"The {name} monitor needs the `{package}` package, which is not "
                            "installed in this environment.",
                            f"Install it (pip install {package}, or pip install -e '.[monitors]'), or drop it "
                            f"from the list, e.g. 'monitor=[console,tensorboard]'.")


def _validate_profile_debug(cfg: DictConfig) -> None:
    pr, dbg, steps = cfg.profile, cfg.debug, cfg.train.steps
    if pr.enabled:
        ok = len(pr.steps) == 2 and 1 <= pr.steps[0] <= pr.steps[1] <= steps
        if not ok:
            raise UserError("profile.steps", list(pr.steps), f"It must be [first, last] with 1 <= first <= last <= "
                            f"train.steps ({steps}).", f"Use e.g. profile.steps=[{min(3, steps)},{min(4, steps)}].")
    if dbg.nan_policy not in ("stop", "skip", "off"):
        raise UserError("debug.nan_policy", dbg.nan_policy, "Unknown policy for non-finite losses and gradients.",
                        "Use debug.nan_policy=stop (default), skip or off.")
    if dbg.max_skipped < 1:
        raise UserError("debug.max_skipped", dbg.max_skipped, "It must be at least 1.", "Use e.g. debug.max_skipped=5.")
    if cfg.metrics.peak_tflops is not None and cfg.metrics.peak_tflops <= 0:
        raise UserError("metrics.peak_tflops", cfg.metrics.peak_tflops, "A peak throughput must be positive.",
                        "Use e.g. metrics.peak_tflops=989 (H100 SXM, bf16 dense), or null for the built-in table.")


def _validate_data(d: DictConfig) -> None:
    if d.tokenizer.path is not None and not os.path.isfile(os.path.join(d.tokenizer.path, "tokenizer.json")) \
            and not os.path.isfile(os.path.join(d.tokenizer.path, "tokenizer_config.json")):
        raise UserError("data.tokenizer.path", d.tokenizer.path, "No HF tokenizer (tokenizer.json) is in that directory.",
                        "Point it at a directory written by a tokenizer's save_pretrained, or set it to null to "
                        "train a BPE tokenizer on the data.")
    if d.tokenizer.path is None and not 256 < d.tokenizer.vocab_size <= 1 << 20:
        raise UserError("data.tokenizer.vocab_size", d.tokenizer.vocab_size,
                        "A byte-level BPE vocabulary needs more than its 256 base bytes.", "Use e.g. 4096.")
    if not 0 < d.val_fraction < 1:
        raise UserError("data.val_fraction", d.val_fraction, "It must lie strictly between 0 and 1.", "Use e.g. 0.05.")
    if d.seq_len < 2:
        raise UserError("data.seq_len", d.seq_len, "Sequences need at least 2 tokens.", "Use e.g. data.seq_len=256.")
    if "paths" in d:
        if not d.paths:
            raise UserError("data.paths", list(d.paths), "No input files are given.", "Use data.paths=[/path/to/corpus].")
        for p in d.paths:
            if not glob.glob(os.path.expanduser(p)):
                raise UserError("data.paths", p, "Nothing exists at that path or pattern.",
                                "Give existing .txt/.jsonl/.parquet files, directories or glob patterns.")


def _validate_precision(pr: DictConfig, dev: str) -> None:
    import torch

    if pr.name not in ("fp32", "bf16", "fp16"):
        raise UserError("precision.name", pr.name, "Unknown precision.", "Use precision=fp32, bf16 or fp16.")
    if pr.name == "bf16" and dev == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("precision", "bf16", f"This GPU ({torch.cuda.get_device_name()}) has no bf16 support.",
                        "Use precision=fp16 (loss-scaled) or precision=fp32.")
    if pr.name != "fp32" and not torch.amp.autocast_mode.is_autocast_available(dev):
        raise UserError("precision", pr.name, f"This torch build has no autocast for {dev}.", "Use precision=fp32.")
    if pr.name == "fp16" and dev == "cpu":
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                torch.ones(2, 2) @ torch.ones(2, 2)
        except RuntimeError as e:
            raise UserError("precision", "fp16", f"This CPU torch build cannot run fp16 autocast ({e}).",
                            "Use precision=bf16 or precision=fp32 on CPU.") from None


def _validate_optim(cfg: DictConfig) -> None:
    if cfg.optim.name not in ("adamw", "sgd"):
        raise UserError("optim.name", cfg.optim.name, "Unknown optimizer.", "Use optim=adamw or optim=sgd.")
    if cfg.sched.name not in ("cosine", "linear", "constant"):
        raise UserError("sched.name", cfg.sched.name, "Unknown schedule.", "Use sched=cosine, linear or constant.")
    if cfg.optim.lr <= 0:
        raise UserError("optim.lr", cfg.optim.lr, "The learning rate must be positive.", "Use e.g. optim.lr=3e-4.")
    if cfg.sched.warmup_steps < 0:
        raise UserError("sched.warmup_steps", cfg.sched.warmup_steps, "Warmup cannot be negative.",
                        "Use sched.warmup_steps=0 or more.")
