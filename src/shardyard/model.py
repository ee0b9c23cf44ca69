"""HF transformers models built from the ``model`` group; never downloaded.

``deepseek_tiny`` / ``deepseek7b`` are DeepSeek-LLM, i.e. the LLaMA architecture; ``deepseek_moe_tiny`` /
``deepseek_v3`` are DeepSeek-V3 (MLA attention + routed/shared experts).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from shardyard.errors import UserError

META_INIT_ABOVE = 1_000_000_000  # parameters; above this `init_device: auto` builds on the meta device


def hf_config(m: DictConfig):
    from transformers import DeepseekV3Config, LlamaConfig

    common = dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads or m.num_heads, max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_word_embeddings,
        initializer_range=m.initializer_range, use_cache=not m.activation_checkpointing,
        attn_implementation=m.attn_implementation, dtype=torch.float32,
    )
    if m.arch == "llama":
        return LlamaConfig(**common)
    if m.arch == "deepseek_v3":
        return DeepseekV3Config(
            **common, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, n_routed_experts=m.n_routed_experts,
            n_shared_experts=m.n_shared_experts, num_experts_per_tok=m.num_experts_per_tok,
            moe_intermediate_size=m.moe_intermediate_size, first_k_dense_replace=m.first_k_dense_replace,
            n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor,
        )
    raise UserError("model.arch", m.arch, "Unknown architecture.", "Use llama or deepseek_v3.")


def count_params(m: DictConfig) -> int:
    """Exact parameter count, from a meta-device build (no memory)."""
    return sum(p.numel() for p in _meta_model(m).parameters())


def _meta_model(m: DictConfig):
    """The model's structure on the meta device: shapes and names, no memory, no init."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(m))


def flops_per_token(m: DictConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's 6N + 12*L*H*Q*T (appendix B), as torchtitan counts it.

    N: parameters a token passes through, so the input embedding (a lookup) is left out and of a MoE
    layer's routed experts only the ``num_experts_per_tok`` a token uses count. 12*L*H*Q*T is the
    attention-score and attention-value matmuls (forward + backward), with Q the query/key head size
    (and MLA's separate value head size averaged in).
    """
    import re

    n = 0
    for name, p in _meta_model(m).named_parameters():
        if name.endswith("embed_tokens.weight"):
            continue
        if re.search(r"\.experts(\.|$)", name):  # routed experts only ("shared_experts" do not match)
            n += p.numel() * m.num_experts_per_tok / m.n_routed_experts
        else:
            n += p.numel()
    if m.arch == "deepseek_v3":
        q = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2
    else:
        q = m.hidden_size // m.num_heads
    return 6 * n + 12 * m.num_layers * m.num_heads * q * seq_len


def build_model(m: DictConfig, seed: int, allow_meta: bool = True):
    """Build the bare model (seeded, so identical on every rank); no training options applied yet.

    Small models are created on CPU. Big ones (or ``init_device: meta``) are created on the meta device
    when ``allow_meta``; the engine then materialises them (``materialize``), shard by shard if it shards.
    """
    from transformers import AutoModelForCausalLM

    if m.pretrained_path is not None:
        return _load_pretrained(m)
    cfg = hf_config(m)
    on_meta = allow_meta and (m.init_device == "meta" or (m.init_device == "auto" and count_params(m) > META_INIT_ABOVE))
    torch.manual_seed(seed)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(cfg)


def materialize(model, device: torch.device, seed: int) -> None:
    """Give meta (or sharded-meta) parameters real storage on ``device`` and run HF's init on them."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()  # HF's own init (rotary buffers included), on whatever shards this rank holds


def _load_pretrained(m: DictConfig):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(m.pretrained_path, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation=m.attn_implementation)
    want = hf_config(m).to_dict()
    have = model.config.to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")
    diff = {k: (want.get(k), have.get(k)) for k in keys if want.get(k) != have.get(k)}
    if diff:
        shown = ", ".join(f"{k}: config {a} vs checkpoint {b}" for k, (a, b) in diff.items())
        raise UserError("model.pretrained_path", m.pretrained_path, f"Its dimensions differ from model={m.name} ({shown}).",
                        "Choose the model option whose dimensions match the checkpoint, or override them.")
    return model


def apply_activation_checkpointing(model, m: DictConfig) -> None:
    model.config.use_cache = not m.activation_checkpointing
    if m.activation_checkpointing:
        # Non-reentrant checkpointing composes with DDP/FSDP and torch.compile.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_compile(model, m: DictConfig) -> None:
    # Per block, not the whole model: blocks are identical, so one compiled graph serves them all, and
    # sharding/DDP hooks stay outside the compiled regions.
    if m.compile:
        for block in model.model.layers:
            block.compile()


def prepare_replica(model, m: DictConfig, device: torch.device, seed: int):
    """Full-replica engines (single, DDP): materialise, activation checkpointing, then compile, then move."""
    materialize(model, device, seed)
    apply_activation_checkpointing(model, m)
    apply_compile(model, m)
    return model.to(device)


def param_count(model) -> int:
    """Full parameter count, also for DeepSpeed ZeRO-3 partitioned (``ds_numel``) or meta parameters."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def transformer_blocks(model) -> list[torch.nn.Module]:
    return list(model.model.layers)


def causal_lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits upcast to fp32 for a stable softmax under autocast."""
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
