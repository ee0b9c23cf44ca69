"""What shardyard reads of a built model without running it: its transformer blocks, parameter counts and
signature, FLOPs per token, and the shape and activation bytes per token the memory plan reads (``model_shape``).
Works on meta, sharded (DTensor) and ZeRO-3-partitioned models alike; imports no other module of ``models`` but
``moe`` and ``mtp``."""

from __future__ import annotations

from typing import Any

import torch

from shardyard.models import moe, mtp


def _token_shares(model: torch.nn.Module) -> dict[int, float]:
    """id(module) -> the fraction of a micro-batch's tokens it computes: top_k / experts inside a routed
    expert, absent (all of them) elsewhere."""
    found = moe.routers(model)
    if not found:
        return {}
    share = found[0].top_k / max(found[0].experts, 1)
    return {id(sub): share for block in transformer_blocks(model) for expert in moe.expert_modules(block)
            for sub in expert.modules()}


def _input_embeddings(model: Any) -> torch.nn.Module | None:
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's 6N + 12*L*H*Q*T (appendix B), as torchtitan counts it.

    N: parameters a token passes through, so the input embedding (a lookup) is left out and of a MoE
    layer's routed experts only the ``num_experts_per_tok`` a token uses count. 12*L*H*Q*T is the
    attention-score and attention-value matmuls (forward + backward), with Q the query/key head size
    (and MLA's separate value head size averaged in). Read from the model's HF config; a model without
    one counts 6N.
    """
    import re

    c: Any = getattr(model, "config", None)
    emb = _input_embeddings(model)
    skip = {id(p) for p in emb.parameters()} if emb is not None else set()
    routed = getattr(c, "num_experts_per_tok", None), getattr(c, "n_routed_experts", None)
    n = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        if routed[0] and routed[1] and re.search(r"\.experts(\.|$)", name):  # "shared_experts" do not match
            n += p.numel() * routed[0] / routed[1]
        else:
            n += p.numel()
    layers, heads = getattr(c, "num_hidden_layers", None), getattr(c, "num_attention_heads", None)
    if not (layers and heads):
        return 6 * n
    if getattr(c, "qk_nope_head_dim", None):
        q = (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2
    else:
        q = getattr(c, "head_dim", None) or c.hidden_size // heads
    # Multi-token prediction (``shardyard.models.mtp``), D depths: N above has each depth's block, norms and eh_proj
    # (a layer of model.layers; eh_proj 6 x 2h x h per token), and the shared head once. Each depth also runs the
    # shared head again on every token (6 x hidden x vocab: the head's parameters once more per depth) and its
    # block's attention (the 12*H*Q*T term once more per depth: config.num_hidden_layers counts the main layers).
    d = mtp.depth(model)
    head: Any = getattr(model, "get_output_embeddings", lambda: None)() if d else None
    extra_head = d * 6.0 * sum(p.numel() for p in head.parameters()) if head is not None else 0.0
    return 6 * n + extra_head + 12 * (layers + d) * heads * q * seq_len


def dense_mlp(block: torch.nn.Module) -> torch.nn.Module | None:
    """A transformer block's dense MLP (its ``mlp`` without routed ``experts``): what ``model.mlp_tiles`` tiles
    (``prepare.apply_mlp_tiles``); None for a routed-expert block or a block without one."""
    mlp = getattr(block, "mlp", None)
    return mlp if isinstance(mlp, torch.nn.Module) and not hasattr(mlp, "experts") else None


def block_norms(block: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformer block's own norms over the hidden size (its direct children named ``*norm``: LLaMA's and
    DeepSeek's ``input_layernorm`` and ``post_attention_layernorm``), what ``model.norm_tiles`` tiles
    (``prepare.apply_norm_tiles``); not the norms inside attention (MLA's latent norms)."""
    return [m for name, m in block.named_children() if name.endswith("norm")]


def is_hf(model: torch.nn.Module) -> bool:
    return hasattr(model, "save_pretrained") and hasattr(model, "config")


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: HF's ``_no_split_modules`` classes, else the longest ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [mod for mod in model.modules() if type(mod).__name__ in names]
    if blocks:
        return blocks
    lists = [list(mod) for mod in model.modules() if isinstance(mod, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else []


def _bare(model: Any) -> Any:
    """The model inside DDP's and DeepSpeed's wrappers (their ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def param_count(model: torch.nn.Module, trainable: bool = False) -> int:
    """Full parameter count (``trainable``: of those that train), also for DeepSpeed ZeRO-3 partitioned
    (``ds_numel``), sharded (DTensor) or meta parameters."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable)


def signature(model: torch.nn.Module) -> dict[str, list[int]]:
    """Parameter names and full shapes: what a checkpoint must match to be loaded into this model. A model
    that holds only part of itself (a pipeline stage's) carries the whole model's as ``shardyard_signature``."""
    whole = getattr(model, "shardyard_signature", None)
    if whole is not None:
        return whole
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}


def attn_implementation(model: Any) -> str | None:
    config = getattr(_bare(model), "config", None)
    return getattr(config, "_attn_implementation", None)


def model_shape(model: Any) -> dict:
    """What the plan needs of a model built on the meta device: sizes, the largest block, the parameters
    outside the blocks, and activation bytes per token (summed over blocks, of the largest block, and what
    activation checkpointing keeps) for each numeric regime.

    Regimes: ``fp32``; ``autocast`` (fp32 parameters, bf16/fp16 matmuls: single, DDP, Horovod);
    ``half`` (bf16/fp16 parameters: FSDP's MixedPrecisionPolicy, DeepSpeed). Per-block bytes per token
    were measured with ``torch.autograd.graph.saved_tensors_hooks`` on transformers 5's LLaMA and
    DeepSeek-V3 blocks (SDPA attention), and fitted exactly (LLaMA) or within 1% (DeepSeek-V3):
    ``tests/unit/test_plan.py`` re-measures them.
    """
    c = getattr(model, "config", None)
    blocks = transformer_blocks(model)
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    h = getattr(c, "hidden_size", None) or (emb.embedding_dim if emb is not None else 1024)
    vocab = getattr(c, "vocab_size", None) or (emb.num_embeddings if emb is not None else 32000)
    per_block = [_block_bytes_per_token(block, c, h) for block in blocks] or [_llama_bytes(h, 4 * h, h, max(1, h // 64))]
    # what a dense MLP keeps per token (``model.mlp_tiles`` no longer keeps it): 0 for routed-expert blocks
    dense = [dense_mlp(block) is not None for block in blocks] or [False]
    act = {}
    for regime in ("fp32", "autocast", "half"):
        layer = [b[regime] for b in per_block]
        kept = [b["selective_" + regime] for b in per_block]
        mlp = [b.get("mlp_" + regime, 0.0) if d else 0.0 for b, d in zip(per_block, dense)]
        resid = 2 if regime == "half" else 4  # the residual stream: fp32 but under half parameters
        act[regime] = {"blocks": sum(layer), "max_block": max(layer), "ckpt_per_block": resid * h,
                       "mlp_blocks": sum(mlp), "block_list": layer, "mlp_list": mlp,
                       "selective_blocks": sum(kept), "max_selective_block": max(kept),
                       # the logits (and their fp32 upcast, log-softmax and gradient) per token at the loss's
                       # backward, which model.loss_chunk bounds (12 bytes measured by the dry run at deepseek7b;
                       # in fp32 too, 12.3 at deepseek_tiny with checkpointing, where 14 made ZeRO-3's -11%),
                       # and the final norm's and the head's inputs
                       "logits": 12 * vocab, "loss_hidden": 2 * resid * h,
                       # what the backward of the largest block allocates beside its activations (gradients of
                       # its activations, the experts' grouped GEMM inputs): 0 where the fit above holds it
                       "max_block_backward": max(b.get("backward_" + regime, b.get("backward", 0.0)) * b[regime]
                                                 for b in per_block),
                       # with model.norm_tiles: a LLaMA block's backward keeps only its MLP's gradients beside its
                       # activations (half of the MLP's bytes, one tile's with model.mlp_tiles: ``mlp``); other
                       # blocks' is as above (not measured with tiled norms)
                       "norm_tiled_backward": {
                           "mlp": max((0.5 * b["mlp_" + regime] for b in per_block if "backward_" + regime in b),
                                      default=0.0),
                           "other": max((b.get("backward_" + regime, b.get("backward", 0.0)) * b[regime]
                                         for b in per_block if "backward_" + regime not in b), default=0.0)},
                       # what the blocks do not save when their base is frozen (``peft``; the adapters' own
                       # activations are ``adapters.activation_bytes_per_token``)
                       "frozen_blocks": sum(b["frozen_" + regime] for b in per_block),
                       # Multi-token prediction (``shardyard.models.mtp``), per depth and token, beside its block (one of
                       # ``blocks`` above: it is a layer of model.layers) and kept until the depth's backward
                       # whatever activation checkpointing does (they run outside the block): enorm, hnorm and
                       # shared_head.norm each keep their input, normalised input and rsqrt (3 x (8h + 4) bytes;
                       # under half parameters the input's fp32 upcast and the bf16 normalised one, 3 x (6h + 4));
                       # eh_proj's input [enorm(Emb(x[i+k])); hnorm(h)] (2h, in the matmul dtype), the shared head's
                       # input (h) and the depth's int64 targets (8). The embedding's second lookup is not kept
                       # (enorm keeps its own roll). 36h/30h/24h + 20: what saved_tensors_hooks records
                       # (tests/unit/test_plan_mtp.py).
                       "mtp_per_depth": {"fp32": 36, "autocast": 30, "half": 24}[regime] * h + 20,
                       # and each depth's loss keeps its fp32 log-softmax (4 bytes per vocabulary entry) until
                       # its backward: the loss's peak (``logits``, one term's) gains that per depth, unless
                       # model.loss_chunk recomputes it chunk by chunk
                       "mtp_logits": 4 * vocab}
    module_params = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    # Routed experts (what expert parallelism splits): their parameters in all and in the largest block.
    block_experts = [sum(p.numel() for m in moe.expert_modules(b) for p in m.parameters()) for b in blocks]
    found = moe.routers(model)
    return {"hidden": h, "vocab": vocab, "blocks": len(blocks), "block_params": sum(block_params),
            "max_block_params": max(block_params, default=total), "root_params": total - sum(block_params),
            "max_module_params": max(module_params, default=total),
            "expert_params": sum(block_experts),
            "max_block_expert_params": max((e for e, b in zip(block_experts, block_params) if b == max(block_params)),
                                           default=0),
            "block_param_list": block_params, "block_expert_list": block_experts,
            "dense_mlp_params": sum(p.numel() for mlp in map(dense_mlp, blocks) if mlp is not None
                                    for p in mlp.parameters()),
            "moe_layers": len(found), "experts_per_token": found[0].top_k if found else 0,
            "activation_bytes_per_token": act, "mtp_depth": mtp.depth(model)}


def _llama_bytes(h: int, i: int, hkv: int, heads: int) -> dict:
    # Saved tensors of one LLaMA block per token: 2 RMSNorms (input and output each), q/k/v, SDPA's output
    # and log-sum-exp, o_proj's input, and the SwiGLU MLP's gate, up, silu(gate) and product (4 x i).
    # Selective checkpointing keeps the block's input (the fp32 residual; half under half parameters) and what
    # its matmuls and SDPA return: q, k, v, o_proj's and down's outputs (3h + 2 hkv), gate and up (2i), SDPA's
    # output (h) and log-sum-exp (fp32 per head).
    mm = 4 * h + 2 * hkv + 2 * i
    # A frozen block (``peft``) saves neither its norms' inputs (their weights take no gradient) nor its linear
    # layers' inputs, but o_proj's (SDPA keeps its output): under autocast each linear its own bf16 cast of the
    # input (q, k, v, gate, up; down's is bf16 already), else one per distinct input (measured, deepseek_tiny).
    frozen = {"fp32": 16 * h + 4 * i, "autocast": 18 * h + 2 * i, "half": 8 * h + 2 * i}
    # The MLP's own intermediates (gate, up, the activation and the product: 4 x i), in the matmul dtype: what
    # ``model.mlp_tiles`` stops keeping (the MLP's input is the block's normalised hidden states, kept anyway).
    mlp = {"mlp_fp32": 16 * i, "mlp_autocast": 8 * i, "mlp_half": 8 * i}
    # The backward of a recomputed block under half parameters allocates a third of the block's activations beside
    # them (the gradients of its activations, the norms' fp32 intermediates): measured by the dry run of
    # deepseek7b (FSDP2, bf16, full checkpointing, 131,072 tokens per rank): 30.29 GiB where the block alone is 22.77,
    # at sp 4 and sp 8 alike; with model.mlp_tiles=8, 22.33 beside 13.36 + 0.33 x 22.77 (-7%). Not measured for fp32
    # or autocast (0: the fit above holds it where the loss, not the block, is the peak).
    # With model.norm_tiles (RMSNorm's fp32 intermediates one tile at a time) what is left beside them is the MLP's
    # gradients, about half its bytes (``norm_tiled_backward``; the same dry run: 26.29 GiB untiled, 45.5 + 7 x hidden
    # per token; with 8 and 32 MLP tiles 13.22 and 13.27, the block's attention part).
    return mlp | {"backward_half": 0.33} | {"frozen_" + k: v for k, v in frozen.items()} | {
            "fp32": 32 * h + 16 * i + 8 * hkv + 4 * heads + 8,
            "autocast": 30 * h + 8 * i + 4 * hkv + 4 * heads,  # + the bf16 weight copies (``autocast_copies``)
            "half": 20 * h + 8 * i + 4 * hkv + 4 * heads + 8,
            "selective_fp32": 4 * h + 4 * mm + 4 * heads, "selective_autocast": 4 * h + 2 * mm + 4 * heads,
            "selective_half": 2 * h + 2 * mm + 4 * heads}


# DeepSeek-V3 under autocast / half parameters, relative to fp32 (measured on transformers' implementation:
# its experts run a grouped matmul outside autocast's cast list, so they stay fp32 under autocast).
_V3_AUTOCAST, _V3_HALF, _V3_BACKWARD = 1.09, 0.70, 0.34


def _block_bytes_per_token(block: Any, c: Any, h: int) -> dict:
    if c is None:  # a plain nn.Module model: a LLaMA-like block of its width
        return _llama_bytes(h, 4 * h, h, max(1, h // 64))
    heads = getattr(c, "num_attention_heads", max(1, h // 64))
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    mlp = getattr(block, "mlp", None)
    moe = mlp is not None and hasattr(mlp, "experts")
    if getattr(c, "kv_lora_rank", None):  # MLA attention (DeepSeek-V2/V3)
        dq, dv, rq, rkv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
        attn = (2 * h + (2 * rq if rq else 0) + heads * dq  # input norm; q (through its low-rank norm)
                + heads * dq + (rkv + c.qk_rope_head_dim) + rkv + heads * (c.qk_nope_head_dim + dv)  # query; kv latent
                + heads * dq + 2 * heads * dv + heads + 2 * h)  # key, SDPA out, o_proj in, lse; output norm
        if moe:  # router scores; per routed token its input, gate|up, silu, product, output; shared experts
            k, mi = c.num_experts_per_tok, c.moe_intermediate_size
            ffn = c.n_routed_experts + k * (2 * h + 4 * mi) + 4 * c.n_shared_experts * mi + 1.5 * h
        else:
            ffn = 4 * c.intermediate_size
        fp32 = 4 * (attn + ffn)
        # selective: the block's input and the matmul/SDPA outputs: q (and its low-rank latent), the kv latent
        # and its up-projection, SDPA's output and lse, o_proj's output; the router's scores and per routed
        # token the experts' gate|up and down outputs; the shared experts' likewise (a dense MLP: gate, up, down)
        kept = (h + (rq if rq else 0) + heads * dq + rkv + c.qk_rope_head_dim + heads * (c.qk_nope_head_dim + dv)
                + heads * dv + heads + h)
        if moe:
            kept += c.n_routed_experts + k * (2 * mi + h) + c.n_shared_experts * 2 * mi + h
        else:
            kept += 2 * c.intermediate_size + h
        # The backward of an MLA block allocates 0.34x its activations beside them (measured by the dry run on
        # DeepSeek-V3's pipeline stages, 4096 tokens: 5.3 GiB recomputed and temporary for a block of 4.0, once
        # FSDP's own gradient buffers made in its post-backward are counted as buffers, not temporaries).
        # frozen (``peft``): the two norms' inputs at least (what else its linears stop saving is not counted)
        mlp = 0.0 if moe else 4 * ffn  # a dense MLP's intermediates (4 x its width) in fp32 bytes, half in bf16
        return {"mlp_fp32": mlp, "mlp_autocast": mlp / 2, "mlp_half": mlp / 2,
                "fp32": fp32, "autocast": _V3_AUTOCAST * fp32, "half": _V3_HALF * fp32,
                "frozen_fp32": 8 * h, "frozen_autocast": 8 * h, "frozen_half": 4 * h, "backward": _V3_BACKWARD,
                "selective_fp32": 4 * kept, "selective_autocast": _V3_AUTOCAST * 4 * kept,
                "selective_half": _V3_HALF * 4 * kept}
    i = getattr(c, "intermediate_size", None) or 4 * h
    if moe and getattr(c, "num_experts_per_tok", None):  # LLaMA-style attention with routed experts
        i = c.num_experts_per_tok * (getattr(c, "moe_intermediate_size", None) or i)
    return _llama_bytes(h, i, kv_heads * head_dim, heads)
