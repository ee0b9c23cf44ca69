"""Parameter-efficient fine-tuning (``peft=lora|qlora``) through the ``peft`` library, on every engine.

Where the adapters go in, and why there (the engines call nothing of this module but the init):

1. ``worker.build`` wraps the built model with ``peft.get_peft_model`` *before* the engine sees it, so every
   engine shards, replicates or partitions the model with its adapters: FSDP2 shards each block with its
   frozen base weights and trainable adapters together. FSDP2 keeps one flat all-gather per unit but
   reduce-scatters only the gradients that exist, so mixed ``requires_grad`` inside one unit is fine (FSDP1
   refused it without ``use_orig_params``); the optimizer sees only the adapters' shards.
2. ZeRO-3 builds the base model under ``deepspeed.zero.Init`` (partitioned as each module is created); the
   adapters are created after it, outside ``zero.Init``, as ordinary tensors, and ``deepspeed.initialize``
   partitions every parameter it finds unpartitioned. peft reads a base layer's ``in_features`` /
   ``out_features``, never its (empty, partitioned) weight, so creating them after partitioning is safe.
3. Adapters are initialised here (``init_adapters``), from the seed and the parameter's name, on a full
   tensor of which each rank keeps its own shard: every engine and world size starts from the same
   adapters, whatever the order modules were created in or the device they were created on (peft's own
   init draws from the global RNG, and not at all on the meta device).
4. Only trainable tensors reach the optimizer (``optim.param_groups``) and the checkpoints
   (``checkpoint_state``); the frozen base is re-read from ``model.weights`` on resume, so a checkpoint
   holds the adapters plus the usual training state.
5. The export writes the adapter in PEFT's format (``PeftModel.from_pretrained``) and a merged HF model
   (``W + (alpha / r) B A``), from the gathered full state dict.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from shardyard.core.errors import UserError


def checkpoint_name(name: str) -> str:
    """The name a parameter has in an HF checkpoint: peft's wrappers (``base_model.model.``, ``.base_layer``)
    and torch's (activation checkpointing, compile) removed."""
    for wrapper in ("base_model.model.", "_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name.replace(".base_layer.", ".")


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class PeftMethod(Protocol):
    """A fine-tuning method, named by ``peft._target_`` and built with no arguments. What the rest of the run
    must know about it (is part of the model frozen? is the base quantised?) are attributes of the method, so
    that no call site tests the method's name: a new method is a new class, not a new branch (torchtune's
    ``AdapterModule`` plays this part there)."""

    freezes_base: bool
    """Part of the model is frozen: validation checks the adapter keys (``r``, ``alpha``, ``dropout``), the model
    must be a transformers one, and the plan holds gradients and optimizer state for the trainable part only."""
    quantized_base: bool
    """The frozen base is held 4-bit (bitsandbytes): only an engine whose class says ``quantized_base`` takes it,
    the model is built from its loaded weights (never on the meta device), and the plan counts NF4 bytes."""

    def apply(self, model: torch.nn.Module, p: DictConfig, seed: int, compute_dtype: torch.dtype
              ) -> torch.nn.Module:
        """The model the engine gets: ``model`` itself, or wrapped with its adapters (before any engine)."""

    def for_smoke(self, p: DictConfig) -> None:
        """``+scale=smoke``: rewrite this ``peft`` section in place for a run on a CPU box (``shardyard.planning.scale``)."""


class Full:
    """``peft=none``: every parameter trains."""

    freezes_base = False
    quantized_base = False

    def apply(self, model: torch.nn.Module, p: DictConfig, seed: int, compute_dtype: torch.dtype
              ) -> torch.nn.Module:
        return model

    def for_smoke(self, p: DictConfig) -> None:
        pass


class LoRA:
    """``peft=lora``: LoRA adapters on ``peft.target_modules``, every other parameter frozen."""

    freezes_base = True
    quantized_base = False
    requires = "peft"  # the finetune extra (shardyard.config.preflight checks it before any process starts)

    def apply(self, model: torch.nn.Module, p: DictConfig, seed: int, compute_dtype: torch.dtype
              ) -> torch.nn.Module:
        _check_targets(model, p)
        return _with_adapters(model, p, seed)

    def for_smoke(self, p: DictConfig) -> None:
        pass


class QLoRA:
    """``peft=qlora``: LoRA adapters on a base whose blocks' linear layers are 4-bit (``quantize``)."""

    freezes_base = True
    quantized_base = True
    requires = ("peft", "bitsandbytes")  # the finetune extra

    def apply(self, model: torch.nn.Module, p: DictConfig, seed: int, compute_dtype: torch.dtype
              ) -> torch.nn.Module:
        _check_targets(model, p)
        if not any(t.is_meta for t in model.parameters()):  # the plan's meta build counts adapters only
            quantize(model, p, compute_dtype)
        return _with_adapters(model, p, seed)

    def for_smoke(self, p: DictConfig) -> None:
        # The same adapters on an unquantised base: bitsandbytes' 4-bit kernels are CUDA-only.
        p._target_, p.name = f"{LoRA.__module__}.{LoRA.__qualname__}", "lora"


def method(p: DictConfig) -> PeftMethod:
    """The method ``peft._target_`` names."""
    from hydra.utils import get_object

    try:
        return get_object(p._target_)()
    except Exception as e:
        raise UserError("peft._target_", p._target_, f"It names no fine-tuning method ({type(e).__name__}: {e}).",
                        "Use peft=none, peft=lora or peft=qlora, or a class meeting "
                        "shardyard.models.adapters.PeftMethod.") from None


def apply(model: torch.nn.Module, p: DictConfig, seed: int, compute_dtype: torch.dtype = torch.float32
          ) -> torch.nn.Module:
    """The model with the adapters of ``peft`` (its method's ``apply``)."""
    return method(p).apply(model, p, seed, compute_dtype)


def _check_targets(model: torch.nn.Module, p: DictConfig) -> None:
    targets = list(p.target_modules)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise UserError("peft.target_modules", targets, f"The model has no module named {unknown[0]!r} (its "
                        f"linear layers: {sorted(n for n, mod in _linears(model))[:12]}).",
                        "Name modules the model has, e.g. peft.target_modules=[q_proj,v_proj].")


def _with_adapters(model: torch.nn.Module, p: DictConfig, seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=list(p.target_modules),
                        bias="none", task_type="CAUSAL_LM")
    import warnings

    with warnings.catch_warnings():  # peft 0.21 still asks transformers 5 for `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, config)
    init_adapters(model, seed)  # 3 (a model on the meta device is initialised after materialising)
    return model


def activation_bytes_per_token(model: torch.nn.Module, share: dict[int, float] | None = None) -> dict:
    """What LoRA's adapters save for backward, per token summed over the model: regime -> device kind ->
    bytes (the plan adds it to the frozen blocks' activations, ``model_shape``'s ``frozen_blocks``). Per
    adapted linear of input width ``in`` and rank ``r`` (measured on deepseek_tiny with saved-tensor hooks):

    1. ``lora_B`` keeps ``lora_A``'s output: r activations.
    2. With ``dropout > 0`` each adapter drops its own copy of the input: ``lora_A`` keeps it (its bf16 cast
       under autocast) and dropout keeps its mask, a bool per element on CUDA, a scaled noise tensor of the
       input's dtype on CPU. q, k and v thus keep three copies where the full model kept one.
    3. With ``dropout = 0`` ``lora_A`` keeps the input that the frozen base linear no longer does: per adapter
       under autocast (its own cast), once per distinct input otherwise.

    ``share``: id(module) -> the fraction of tokens it sees (an MoE expert's top_k / experts); 1 otherwise."""
    share = share or {}
    out: dict = {r: {"cpu": 0.0, "cuda": 0.0} for r in ("fp32", "autocast", "half")}
    seen: set = set()
    for parent in model.modules():
        for child in parent.children():
            lora_a = getattr(child, "lora_A", None)
            if not isinstance(lora_a, torch.nn.ModuleDict) or not lora_a:
                continue
            key = next(iter(lora_a))
            first: Any = lora_a[key]
            width, r = int(first.in_features), int(first.out_features)
            drop = getattr(child, "lora_dropout")[key]
            p = drop.p if isinstance(drop, torch.nn.Dropout) else 0.0
            f = share.get(id(child), 1.0)
            distinct = (id(parent), width) not in seen
            seen.add((id(parent), width))
            for regime, b, b_in in (("fp32", 4, 4), ("autocast", 2, 4), ("half", 2, 2)):
                for device, noise in (("cpu", b_in), ("cuda", 1)):
                    keeps = r * b + (width * (b + noise) if p > 0 else
                                     width * b if regime == "autocast" or distinct else 0)
                    out[regime][device] += f * keeps
    return out


def quantize(model: torch.nn.Module, p: DictConfig, compute_dtype: torch.dtype) -> None:
    """QLoRA's base: every linear layer of the blocks becomes a bitsandbytes ``Linear4bit`` holding the loaded
    weights (NF4, double quantisation per ``peft``); the embeddings, norms and LM head stay as they are, as in
    the QLoRA paper. The weights are quantised when the engine moves the model to its device
    (``Params4bit.to``), so they must be loaded first: ``worker.build`` does not build a QLoRA model on the
    meta device. peft then wraps each ``Linear4bit`` in its own 4-bit LoRA layer."""
    import bitsandbytes as bnb

    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child is head:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=p.double_quant,
                                  quant_type=str(p.quant_type))
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=p.double_quant,
                                         quant_type=str(p.quant_type))
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, q)


def dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the fp32 weight of every 4-bit layer (QLoRA), for the merged export."""

    out = {}
    for name, mod in model.named_modules():
        w: Any = getattr(mod, "weight", None)
        if getattr(w, "quant_state", None) is not None:
            import bitsandbytes.functional as bnbf

            out[checkpoint_name(name + ".weight")] = bnbf.dequantize_4bit(w.data, w.quant_state).float().cpu()
    return out


def _linears(model: torch.nn.Module):
    seen = set()
    for n, mod in model.named_modules():
        short = n.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and short not in seen:
            seen.add(short)
            yield short, mod


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """LoRA's init, from ``seed`` and each adapter's name: ``lora_A`` Kaiming-uniform (peft's choice),
    ``lora_B`` zeros, so the adapted model starts equal to the base. A sharded adapter (DTensor) gets its
    shard of the same full tensor on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor


    for name, p in model.named_parameters():
        if "lora_" not in name or p.is_meta:
            continue
        key = checkpoint_name(name)
        full = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in key:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.data.copy_(full)


def frozen(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a replica engine's checkpoint holds of the model: everything, or only the trainable tensors when
    part of it is frozen (the base is re-read from ``model.weights``)."""
    if not frozen(model):
        return model.state_dict()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def merged_state(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA update folded in, ``W + (alpha / r) B A``, under the base
    model's own names (loadable by ``AutoModelForCausalLM.from_pretrained``)."""

    cfg = model.peft_config["default"]
    scaling = cfg.lora_alpha / cfg.r
    deq = dequantized(model)  # QLoRA: 4-bit weights (and their quantisation state) become fp32 weights
    out: dict[str, torch.Tensor] = dict(deq)
    for key, value in state.items():
        name = checkpoint_name(key)
        if ".lora_" in key or name in deq or any(name.startswith(w + ".") for w in deq):
            continue
        out[name] = value
    for key, a in state.items():
        if not key.endswith(".lora_A.default.weight"):
            continue
        prefix = key[: -len(".lora_A.default.weight")]
        b = state[prefix + ".lora_B.default.weight"]
        base = checkpoint_name(prefix + ".base_layer.weight")
        w = out[base]
        out[base] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def save_adapter(model: Any, state: dict[str, torch.Tensor], out_dir: str) -> None:
    """The adapter in PEFT's own format (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    model.save_pretrained(out_dir, state_dict={k: v for k, v in state.items() if ".lora_" in k})

