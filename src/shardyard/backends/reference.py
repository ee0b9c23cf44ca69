"""The frozen reference model of the post-training objectives (DPO, GRPO's KL term): the parts of
``Backend.reference_model`` that every engine shares. Each engine builds, places and shards its reference with
its own code (the replica engines' ``prepare_replica``, ``parallelize_fsdp``, ``parallelize_fsdp_tp``,
``deepspeed.initialize``); this module only

1. turns off what only training needs (``options``): activation checkpointing (nothing is kept for a backward),
   regional compile (a second set of graphs for a module that never trains) and the chunked loss head (the
   reference gives logits); float8 linears stay, since they change the numbers;
2. freezes it (``freeze``): ``requires_grad`` off on every parameter before any engine wraps it, so that no
   engine makes gradient buffers, reduce hooks or optimizer state for it, and eval mode;
3. keeps its forward in the policy's numerics without the caller's help (``frozen_forward``): under
   ``torch.no_grad`` and, on the engines that train under autocast, the policy's autocast;
4. builds it without moving the training's random streams (``keep_rng``): ``build`` seeds the global
   generator (``build_model``, ``materialize``), and the reference is built after ``prepare``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf, open_dict


def options(cfg: DictConfig) -> DictConfig:
    """``cfg`` for building the reference with an engine's own function: activation checkpointing (and its offload), compile, the
    tiled MLPs and norms and the chunked loss head off (1); the objective's ``reference_weights`` as ``model.weights`` when it names
    some (validation checked them against the policy's shapes); everything else, the precision included, as the
    policy's."""
    ref = copy.deepcopy(cfg)
    OmegaConf.set_readonly(ref, False)
    with open_dict(ref):
        ref.model.activation_checkpointing = "none"
        ref.model.compile = False
        ref.model.loss_chunk = 0
        ref.model.mlp_tiles = 0
        ref.model.norm_tiles = 0
        ref.model.activation_offload = False  # nothing checkpointed to offload
        weights = OmegaConf.select(cfg, "objective.reference_weights", default=None)
        if weights:
            ref.model.weights = weights
    return ref


def build_frozen(build: Callable[..., torch.nn.Module], cfg: DictConfig, allow_meta: bool) -> torch.nn.Module:
    """The engine's ``build`` of the reference (``options(cfg)``'s model section: its weights), frozen (2)."""
    return freeze(build(allow_meta=allow_meta, model_cfg=options(cfg).model))


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter frozen (2); eval mode (no dropout: a fixed function of its inputs)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def frozen_forward(model: torch.nn.Module, autocast: Callable[[], contextlib.AbstractContextManager] | None = None
                   ) -> None:
    """The instance's ``forward`` run under ``torch.no_grad`` and ``autocast()`` when given (3). Only the instance's
    forward changes, as ``model.apply_chunked_loss`` does the head's: the class, the parameter names and the hooks
    an engine put on the module (FSDP2's all-gathers, ZeRO-3's fetches) stay."""
    plain = model.forward

    @functools.wraps(plain)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), autocast() if autocast is not None else contextlib.nullcontext():
            return plain(*args, **kwargs)

    model.forward = forward


@contextlib.contextmanager
def keep_rng(device: torch.device) -> Iterator[None]:
    """The global random state of the host (and of ``device``) as it was before (4)."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def replica(build: Callable[..., torch.nn.Module], cfg: DictConfig, device: torch.device) -> torch.nn.Module:
    """The replica engines' reference (single, DDP, Horovod): ``prepare_replica`` as the policy's, frozen, its
    forward under the autocast ``TorchStepper`` trains the policy under (none for fp32). Identical on every rank
    without a broadcast: ``build`` seeds the init and reads the same ``model.weights`` everywhere."""
    from shardyard.backends.torch_step import COMPUTE_DTYPES
    from shardyard.models.prepare import prepare_replica

    with keep_rng(device):
        model = freeze(prepare_replica(build_frozen(build, cfg, allow_meta=True), options(cfg), device))
    name = cfg.precision.name
    frozen_forward(model, None if name == "fp32" else lambda: torch.autocast(device.type, dtype=COMPUTE_DTYPES[name]))
    return model


def release(backend: Any) -> None:
    """Drop the engine's reference model (``Backend.reference_model`` keeps it in ``backend.reference``) once it is
    no longer needed (DPO's precomputed log-probs): a DeepSpeed engine is destroyed (its hooks and buffers, ZeRO-3's
    partitions released), any other reference simply freed."""
    ref = backend.__dict__.pop("reference", None)
    if ref is not None and hasattr(ref, "destroy"):
        from shardyard.backends.deepspeed_patches import release_zero3

        module = ref.module
        stage = ref.zero_optimization_stage()
        ref.destroy()
        if stage == 3:
            release_zero3(module)
