"""Models: ``model._target_`` names a builder; shardyard builds, checks and prepares what it returns.

A builder is any callable that takes the ``model`` option's own keys (everything but the shardyard keys of
``config.schema.ModelConfig``) and returns either a ``transformers.PreTrainedModel`` (any
``AutoModelForCausalLM``) or an ``nn.Module`` meeting ``CausalLM`` below. The built-in builders are
``llama`` (DeepSeek-LLM is the LLaMA architecture), ``deepseek_v3`` (MLA attention + routed/shared
experts) and ``hf`` (any local HF directory). Nothing is ever downloaded.

shardyard itself decides *where* the model is created (CPU, the meta device for big models, under
``deepspeed.zero.Init``), and applies activation checkpointing and compile to its transformer blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from shardyard import moe, mtp
from shardyard.config import checkpointing_mode
from shardyard.errors import UserError
from shardyard.facts import META_INIT_ABOVE, ModelFacts
from shardyard.weights import load_weights, weights_dir



@runtime_checkable
class CausalLM(Protocol):
    """What shardyard needs of a model that is not a ``transformers.PreTrainedModel``:

    * ``forward(input_ids)`` with a ``LongTensor[batch, seq]`` returns the logits ``[batch, seq, vocab]``
      (or an object with a ``.logits`` attribute);
    * its transformer blocks are the children of its longest ``nn.ModuleList`` (the units FSDP shards and
      activation checkpointing recomputes);
    * built on the meta device (``model.init_device=meta``), its modules' ``reset_parameters()`` (or the
      model's own ``init_weights()``) initialise the materialised weights.

    Such a model trains on every engine; the final export is then ``model.safetensors`` rather than an HF
    directory.
    """

    def forward(self, input_ids: torch.Tensor) -> Any: ...


def call_builder(m: DictConfig) -> torch.nn.Module:
    """``model._target_`` called with the option's keys, less shardyard's own (``ModelConfig``)."""
    from shardyard.config.plugins import build
    from shardyard.config.schema import ModelConfig

    model = build(m, own=[f.name for f in dataclasses.fields(ModelConfig)])
    if m.get("mtp") is not None:  # DeepSeek-V3's multi-token prediction depths (model.mtp)
        mtp.attach(model, m.mtp)
    if is_hf(model):
        model.config.use_cache = False  # training never decodes incrementally
    return model


# ------------------------------------------------------------------------------------ built-in builders
def _check_heads(hidden_size: int, num_heads: int, num_kv_heads: int | None) -> None:
    if num_heads < 1 or hidden_size % num_heads:
        raise UserError("model.num_heads", num_heads, f"model.hidden_size={hidden_size} must be a multiple of it "
                        "(each head gets hidden_size / num_heads dimensions).",
                        f"Use a divisor of {hidden_size} (e.g. model.num_heads={_divisor_near(hidden_size, num_heads)}), "
                        "or change model.hidden_size.")
    if num_kv_heads is not None and (num_kv_heads < 1 or num_heads % num_kv_heads):
        raise UserError("model.num_kv_heads", num_kv_heads, f"Grouped-query attention shares each key/value head "
                        f"among a whole number of query heads, so it must divide model.num_heads={num_heads}.",
                        f"Use a divisor of {num_heads} (e.g. model.num_kv_heads={_divisor_near(num_heads, num_kv_heads)}), "
                        "or null (= num_heads).")


def _divisor_near(n: int, want: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - want), d))


def llama(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, max_position_embeddings: int = 2048, rope_theta: float = 10000.0,
          rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False, initializer_range: float = 0.02,
          attn_implementation: str = "sdpa") -> torch.nn.Module:
    """DeepSeek-LLM / LLaMA (``transformers.LlamaForCausalLM``) from its dimensions."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    _check_heads(hidden_size, num_heads, num_kv_heads)
    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta, attn_implementation: PretrainedConfig kwargs
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
        attn_implementation=attn_implementation, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config)


def deepseek_v3(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                n_routed_experts: int, n_shared_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                q_lora_rank: int | None = None, first_k_dense_replace: int = 0, n_group: int = 1, topk_group: int = 1,
                routed_scaling_factor: float = 1.0, num_kv_heads: int | None = None,
                max_position_embeddings: int = 2048, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                tie_word_embeddings: bool = False, initializer_range: float = 0.02,
                attn_implementation: str = "sdpa") -> torch.nn.Module:
    """DeepSeek-V3 (``transformers.DeepseekV3ForCausalLM``): MLA attention, shared + routed experts, a sigmoid
    router with a selection bias (balanced by ``model.balance.bias_update_speed``)."""
    return _deepseek("DeepseekV3Config", **locals())


def deepseek_v2(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                n_routed_experts: int, n_shared_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                q_lora_rank: int | None = None, first_k_dense_replace: int = 0, n_group: int = 1, topk_group: int = 1,
                routed_scaling_factor: float = 1.0, num_kv_heads: int | None = None,
                max_position_embeddings: int = 2048, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                tie_word_embeddings: bool = False, initializer_range: float = 0.02,
                attn_implementation: str = "sdpa", topk_method: str = "greedy") -> torch.nn.Module:
    """DeepSeek-V2 (``transformers.DeepseekV2ForCausalLM``): MLA attention, shared + routed experts, a softmax
    router (``topk_method``: ``greedy`` or ``group_limited_greedy``) balanced by auxiliary losses."""
    if topk_method not in ("greedy", "group_limited_greedy"):
        raise UserError("model.topk_method", topk_method, "DeepSeek-V2's router chooses experts greedily, or greedily "
                        "within the model.topk_group best of model.n_group groups.",
                        "Use model.topk_method=greedy or group_limited_greedy.")
    return _deepseek("DeepseekV2Config", **locals())


def _deepseek(config_class: str, *, num_experts_per_tok: int, n_routed_experts: int, n_group: int, topk_group: int,
              num_layers: int, num_heads: int, num_kv_heads: int | None, **dims: Any) -> torch.nn.Module:
    """The DeepSeek-V2/V3 families from their dimensions (the builders' arguments, named as in the HF config
    but for ``num_layers``, ``num_heads`` and ``num_kv_heads``)."""
    import transformers
    from transformers import AutoModelForCausalLM

    if num_experts_per_tok > n_routed_experts:
        raise UserError("model.num_experts_per_tok", num_experts_per_tok,
                        f"A token cannot be routed to more than the model.n_routed_experts={n_routed_experts} experts.",
                        f"Use model.num_experts_per_tok<={n_routed_experts}.")
    if n_group < 1 or n_routed_experts % n_group:
        divisors = [d for d in range(1, n_routed_experts + 1) if n_routed_experts % d == 0]
        raise UserError("model.n_group", n_group, f"Routing groups split the model.n_routed_experts={n_routed_experts} "
                        "experts into equal groups of consecutive experts, so model.n_group must divide it.",
                        f"Use one of {divisors} (1: no group-limited routing; DeepSeek-V3: 8).")
    if not 1 <= topk_group <= n_group:
        raise UserError("model.topk_group", topk_group, f"Each token's experts come from its model.topk_group best of "
                        f"the model.n_group={n_group} groups, so it must lie in 1..{n_group}.",
                        f"Use model.topk_group<={n_group} (DeepSeek-V3: 4 of 8 groups).")
    config = getattr(transformers, config_class)(
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        num_experts_per_tok=num_experts_per_tok, n_routed_experts=n_routed_experts, n_group=n_group,
        topk_group=topk_group, dtype=torch.float32, **dims)
    return AutoModelForCausalLM.from_config(config)


# ``+scale=smoke`` (shardyard.scale): the tiny shape of each builder's family. A user's builder may carry its
# own as a ``smoke_shape`` attribute (a dict of its keyword arguments); without one its model is kept as is.
llama.smoke_shape = dict(  # type: ignore[attr-defined]
    hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=None)
deepseek_v3.smoke_shape = deepseek_v2.smoke_shape = dict(  # type: ignore[attr-defined]
    hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=None, q_lora_rank=None,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1)


def hf(path: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Any ``AutoModelForCausalLM`` architecture from a local directory (its ``config.json``). Its weights are
    not read here: ``model.weights`` (``auto`` for this option: the directory's own) is loaded by shardyard
    after the engine has placed the model, shard by shard on the sharded engines (``load_weights``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_file):
        raise UserError("model.path", path, "No HF model directory (with config.json) is there.",
                        "Point it at a local directory written by save_pretrained (e.g. a run's hf/ export).")
    config = AutoConfig.from_pretrained(os.path.dirname(config_file), local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        # A quantised release (DeepSeek-V3's FP8 blocks): its weights are dequantised as they load
        # (``weights.load_weights``) and train in high precision, so neither the model nor its export is quantised
        del config.quantization_config
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


# ------------------------------------------------------------------------------ facts from a meta build
def shape_model(m: DictConfig) -> torch.nn.Module:
    """The model's structure on the meta device: shapes and names, no memory, no init."""
    with torch.device("meta"):
        return call_builder(m)


def inspect_model(m: DictConfig, seq_len: int, peft: DictConfig | None = None) -> ModelFacts:
    """Build on the meta device and report what validation and planning need. Builder errors that are not
    already ``UserError`` are the user's model options not adding up: named, exit 2."""
    try:
        model = shape_model(m)
    except UserError:
        raise
    except (ValueError, TypeError, AssertionError, KeyError, OSError, ImportError) as e:
        raise UserError("model", m.get("name", m._target_), f"Its builder {m._target_} refused these options: "
                        f"{type(e).__name__}: {e}", "Fix the model.* values it names (python train.py --cfg job "
                        "shows them all).") from None
    if not isinstance(model, torch.nn.Module):
        raise UserError("model._target_", m._target_, f"It returned a {type(model).__name__}, not a torch.nn.Module.",
                        "Return a transformers PreTrainedModel or an nn.Module meeting shardyard.model.CausalLM.")

    emb = _input_embeddings(model)
    config = getattr(model, "config", None)
    trainable, adapter_acts = None, None
    from shardyard.adapters import activation_bytes_per_token, apply, method

    if peft is not None and method(peft).freezes_base:  # the adapters, on the meta device too: their count for the plan
        if not is_hf(model):
            raise UserError("peft", peft.name, f"peft's LoRA wraps transformers models (PreTrainedModel), and model "
                            f"{m.name} ({m._target_}) is a plain module.",
                            "Use an HF model option (model=hf, deepseek_tiny, deepseek7b, ...) or peft=none.")
        try:
            with torch.device("meta"):
                adapted = apply(shape_model(m), peft, 0)
            trainable = param_count(adapted, trainable=True)
            adapter_acts = activation_bytes_per_token(adapted, _token_shares(adapted))
        except UserError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise UserError("peft", peft.name, f"peft refused these adapter settings: {type(e).__name__}: {e}",
                            "Fix the peft.* values it names (python train.py --cfg job shows them).") from None
    found = moe.routers(model)
    return ModelFacts(params=param_count(model), flops_per_token=flops_per_token(model, seq_len),
                      embedding_rows=getattr(emb, "num_embeddings", None),
                      max_positions=getattr(config, "max_position_embeddings", None), shape=model_shape(model),
                      attn=attn_implementation(model) if is_hf(model) else None, trainable=trainable,
                      adapter_activations=adapter_acts,
                      moe_layers=len(found), routed_experts=found[0].experts if found else 0,
                      experts_per_token=found[0].top_k if found else 0,
                      router_bias=bool(found) and all(r.biased for r in found))


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
    # Multi-token prediction (``shardyard.mtp``), D depths: N above has each depth's block, norms and eh_proj
    # (a layer of model.layers; eh_proj 6 x 2h x h per token), and the shared head once. Each depth also runs the
    # shared head again on every token (6 x hidden x vocab: the head's parameters once more per depth) and its
    # block's attention (the 12*H*Q*T term once more per depth: config.num_hidden_layers counts the main layers).
    d = mtp.depth(model)
    head: Any = getattr(model, "get_output_embeddings", lambda: None)() if d else None
    extra_head = d * 6.0 * sum(p.numel() for p in head.parameters()) if head is not None else 0.0
    return 6 * n + extra_head + 12 * (layers + d) * heads * q * seq_len


# ------------------------------------------------------------------------------- building for training
def build_model(m: DictConfig, seed: int, on_meta: bool = False) -> torch.nn.Module:
    """Build the bare model (seeded, so identical on every rank); no training options applied yet.

    With ``on_meta`` (big models, ``init_device: meta``) it is created on the meta device, and the engine
    materialises it (``materialize``), shard by shard if it shards.
    """
    torch.manual_seed(seed)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return call_builder(m)


def wants_meta(m: DictConfig, facts: ModelFacts) -> bool:
    """Build on the meta device: big models, ``init_device: meta``, and HF models whose weights are loaded
    (``model.weights``): a random init that the checkpoint overwrites would be wasted, and on FSDP each rank
    then reads only its shards."""
    loads = weights_dir(m) is not None and facts.attn is not None  # HF's init_weights recomputes rotary buffers;
    # a plain module's non-persistent buffers would stay uninitialised on the meta device, and no checkpoint has them
    return m.init_device == "meta" or (m.init_device == "auto" and (facts.big or loads))


def materialize(model: Any, device: torch.device, seed: int, m: DictConfig | None = None,
                buffers: torch.device | None = None) -> None:
    """Give meta (or sharded-meta) parameters real storage on ``device``, initialise them, then load
    ``model.weights`` (only this rank's shards) and initialise the adapters (LoRA), which no checkpoint has.
    ``buffers``: the compute device, where every buffer ends when the parameters are stored elsewhere (FSDP2's
    CPU offload keeps them in host memory, and moves parameters only): the forward reads the buffers beside its
    activations (a V3 router adds ``e_score_correction_bias`` to its scores)."""
    if any(p.is_meta for p in model.parameters()):
        _init_on_device(model, device, seed)
        weights = weights_dir(m) if m is not None else None
        if weights is not None:
            load_weights(model, weights)
        from shardyard.adapters import init_adapters

        init_adapters(model, seed)
    if buffers is not None:
        with _FAKE_STORAGE["mode"] or contextlib.nullcontext():
            _buffers_to(model, buffers)


_FAKE_STORAGE: dict[str, Any] = {"mode": None}


@contextlib.contextmanager
def materialized_in(mode: Any) -> Iterator[None]:
    """Inside, ``materialize`` gives meta parameters storage in ``mode`` (a ``FakeTensorMode``: shapes and bytes,
    no memory) instead of real storage: the dry run's seam (``shardyard.dryrun``), which builds, shards and wraps
    the model as the engine does and must never allocate the real parameters."""
    _FAKE_STORAGE["mode"] = mode
    try:
        yield
    finally:
        _FAKE_STORAGE["mode"] = None


def _init_on_device(model: Any, device: torch.device, seed: int) -> None:
    with _FAKE_STORAGE["mode"] or contextlib.nullcontext():
        _init_storage(model, device, seed)


def _init_storage(model: Any, device: torch.device, seed: int) -> None:
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        if hasattr(model, "init_weights"):
            with mtp.main_only(model):  # the MTP depths after, from their own stream (mtp.init_depths)
                model.init_weights()  # HF's own init (rotary buffers included), on whatever shards this rank holds
            mtp.init_depths(model)
        else:
            for module in model.modules():
                reset: Any = getattr(module, "reset_parameters", None)
                if reset is not None:
                    reset()


def _buffers_to(model: Any, device: torch.device) -> None:
    """Every buffer of ``model`` onto ``device`` (one copy of a buffer that several modules share)."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                if id(buf) not in moved:
                    moved[id(buf)] = buf.to(device)
                module._buffers[name] = moved[id(buf)]


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


def _saved_ops() -> set:
    """What a ``selective`` block keeps for backward: the outputs of its matmuls and of attention (the costly
    ops); every other op (norms, activations, rotary, elementwise products) is recomputed from them."""
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention"]
    ops = (getattr(torch.ops.aten, name, None) for name in names)  # some exist only in newer torch builds
    return {op.default for op in ops if op is not None}


def _selective_context() -> Any:
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def apply_activation_checkpointing(model: Any, m: DictConfig) -> None:
    """``model.activation_checkpointing`` on every ``model.activation_checkpointing_every``-th block.

    1. Non-reentrant checkpointing: it composes with DDP/FSDP hooks, torch.compile and keyword arguments.
    2. ``selective`` passes torch's selective policy (``_selective_context``) as the checkpoint's
       ``context_fn``: the same wrapper, only what it keeps differs.
    3. HF models checkpoint through their own layers' switch (``gradient_checkpointing``, set per layer), which
       keeps FSDP's hooks outside the recomputed forward and the parameter names unchanged; others are wrapped
       with torch's ``checkpoint_wrapper`` (its state dict drops the wrapper's prefix)."""
    mode = checkpointing_mode(m)
    if mode == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}  # 1
    if mode == "selective":
        kwargs["context_fn"] = _selective_context()  # 2
    every = int(m.get("activation_checkpointing_every", 1))
    blocks = transformer_blocks(model)
    chosen = {id(b) for i, b in enumerate(blocks) if i % every == 0}
    if is_hf(model) and getattr(model, "supports_gradient_checkpointing", False):  # 3
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for block in blocks:
            if hasattr(block, "gradient_checkpointing"):
                setattr(block, "gradient_checkpointing", id(block) in chosen)
        return
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing as wrap,
                                                                             checkpoint_wrapper)

    wrap(model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, **kwargs), check_fn=lambda mod: id(mod) in chosen)


def apply_compile(model: Any, m: DictConfig) -> None:
    # Per block, not the whole model: blocks are identical, so one compiled graph serves them all, and
    # sharding/DDP hooks stay outside the compiled regions.
    if m.compile:
        for block in transformer_blocks(model):
            block.compile()


def apply_float8(model: Any, precision: DictConfig, device: torch.device) -> None:
    """``precision=fp8``: the transformer blocks' ``nn.Linear`` layers become torchao's ``Float8Linear``
    (dynamic tensorwise scales; e4m3 activations and weights, e5m2 gradients), before checkpointing, compile
    and sharding wrap them, as torchtitan orders it. The LM head and the embeddings stay in bf16 (their
    precision matters most for the loss; torchtitan leaves the output layer out too), and so do layers whose
    dimensions are not multiples of 16 (float8 matmuls need them). On a CPU torchao emulates the float8
    matmuls: the same rounding of inputs to float8, the product in high precision."""
    if precision.name != "fp8":
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    inside = {id(mod) for block in transformer_blocks(model) for mod in block.modules()}

    def wanted(mod: torch.nn.Module, name: str) -> bool:
        return (id(mod) in inside and isinstance(mod, torch.nn.Linear)
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"),
                               module_filter_fn=wanted)


def float8_linears(model: torch.nn.Module) -> int:
    """How many layers ``apply_float8`` converted (tests/unit/test_model.py counts them)."""
    return sum(type(mod).__name__ == "Float8Linear" for mod in model.modules())


_PROBED = {"loss_chunks": 0}  # chunks the chunked heads of this process computed (SpeedProbe reads the step's)


def apply_chunked_loss(model: Any, m: DictConfig) -> None:
    """``model.loss_chunk``: the LM head computes the summed cross-entropy itself, ``loss_chunk`` tokens at a
    time, when the loss asks for it (the caller sets ``head.shardyard_targets``: ``_cross_entropy``, and
    ``mtp.head_sum`` for each multi-token-prediction depth); otherwise it is the plain head.

    1. Inside the head's own forward, so each engine's hooks on the head (ZeRO-3's gather, FSDP's unshard)
       run as for any forward, and the parameter names do not change (only the instance's ``forward``).
    2. Each chunk's logits, their fp32 upcast and the softmax live only inside a non-reentrant checkpoint:
       forward keeps the chunk's hidden states (which the model has anyway), backward recomputes the chunk's
       logits, so at most one chunk's ``chunk x vocab`` logits exist at a time; the head's matmul runs once
       more in backward (2 x hidden x vocab FLOPs per token).
    3. The sum of the chunks' sums equals the whole sum (fp32 accumulation), so losses and gradients equal the
       unchunked ones within rounding."""
    chunk = int(m.get("loss_chunk", 0))
    if chunk <= 0:
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if head is None or getattr(config, "final_logit_softcapping", None):
        why = ("has no get_output_embeddings() to run in chunks" if head is None else
               "changes its logits after the head (final_logit_softcapping), which the chunks would skip")
        raise UserError("model.loss_chunk", chunk, f"This model ({type(model).__name__}) {why}.",
                        "Use model.loss_chunk=0 with it.")
    plain = head.forward  # 1
    head.shardyard_targets = None

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        targets = head.shardyard_targets
        if targets is None:
            return plain(hidden)
        h = hidden.reshape(-1, hidden.size(-1))
        t = targets.reshape(-1)
        assert h.size(0) == t.size(0), (h.shape, t.shape)

        def piece(h_c: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(plain(h_c).float(), t_c, ignore_index=-100, reduction="sum")

        from torch.utils.checkpoint import checkpoint

        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, h.size(0), chunk):  # 2, 3
            total = total + checkpoint(piece, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
            _PROBED["loss_chunks"] += 1  # what SpeedProbe reports: this head, not the plain one, computed the loss
        return total

    head.forward = forward
    model.shardyard_loss_chunk = chunk


def _bare(model: Any) -> Any:
    """The model inside DDP's and DeepSpeed's wrappers (their ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def has_chunked_loss(model: Any) -> bool:
    return bool(getattr(_bare(model), "shardyard_loss_chunk", 0))


class SpeedProbe:
    """``summary.json``'s ``speed_options``: what the speed options did at one training step (the first this run
    trains), measured inside the engine's own step, so an option that an engine's wrapper or sharding dropped
    shows as nothing done. Entered around the step's forward and backward (``loop.train``); one step only, so
    the cost of measuring (a dispatch mode over that step's ops) stays off every other step.

    * ``loss_chunks``: the chunks the ``model.loss_chunk`` head computed in the step's training forwards
      (micro-batches x ceil(tokens / loss_chunk) x (1 + MTP depths) on every engine that takes it; null when the
      option is off).
    * ``compiled_calls``: the times the step entered compiled code (``model.compile``): dynamo's cached graphs
      that passed their guards, and the graphs it compiled then. Each block's forward once per micro-batch
      (a pipeline stage's blocks once per pipeline micro-batch); 0: the blocks ran eagerly; null when off.
    * ``kept_bytes`` / ``block_kept_bytes``: the bytes of the tensors the step's training forwards created
      that are still alive when backward starts (what backward reads: the activations activation
      checkpointing saves or drops), and of those the ones created inside the transformer blocks. The most
      alive at the start of any backward (a pipeline stage has several micro-batches in flight). Storage
      is counted once however many views share it; a DTensor counts its local shard. Measured only with
      ``debug.measure_activations`` (``measure``), never under ``model.compile`` (null): a dispatch mode
      would run the compiled blocks eagerly."""

    def __init__(self, model: Any, m: DictConfig, measure: bool = True) -> None:
        self.m, self.blocks, self.measure = m, transformer_blocks(_bare(model)), measure
        self.record: dict[str, Any] = {}

    def __enter__(self) -> SpeedProbe:
        self.chunks0, self.hits = _PROBED["loss_chunks"], 0
        self.mode = _KeptBytes(self.blocks).__enter__() if self.measure and not self.m.compile else None
        if self.m.compile:  # dynamo is imported only by runs that compile (about a second of start-up otherwise)
            from torch._C._dynamo.eval_frame import set_guard_complete_hook
            from torch._dynamo.utils import counters

            def guarded(cache_hit: bool) -> bool:  # dynamo's hook at every entry into compiled code (its guards run)
                self.hits += cache_hit
                return self.chained(cache_hit) if self.chained is not None else cache_hit

            self.graphs0 = counters["stats"]["unique_graphs"]
            self.chained = set_guard_complete_hook(guarded)  # e.g. torch.compiler.set_enable_guard_collectives'
        return self

    def __exit__(self, *exc: Any) -> None:
        compiled: int | None = None
        if self.mode is not None:
            self.mode.__exit__(*exc)
        if self.m.compile:
            from torch._C._dynamo.eval_frame import set_guard_complete_hook
            from torch._dynamo.utils import counters

            set_guard_complete_hook(self.chained)
            compiled = self.hits + counters["stats"]["unique_graphs"] - self.graphs0
        mode = self.mode if self.mode is not None and self.mode.counted else None
        self.record = {
            "loss_chunks": _PROBED["loss_chunks"] - self.chunks0 if int(self.m.get("loss_chunk", 0)) > 0 else None,
            "compiled_calls": compiled,
            "kept_bytes": mode.kept if mode else None, "block_kept_bytes": mode.block_kept if mode else None}


class _KeptBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """``SpeedProbe``'s memory figures. Every op's outputs in a forward (autograd not running: no graph task)
    are remembered by weak references to their storages, tagged when a transformer block is running (forward
    hooks); at the first op of each backward the storages still alive are summed."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.blocks, self.depth, self.kept, self.block_kept, self.counted = blocks, 0, 0, 0, True
        self.live: dict[int, tuple[Any, int, bool]] = {}  # storage address: (weak ref, bytes, inside a block)
        self.sampled: set[int] = set()

    def __enter__(self) -> _KeptBytes:
        def enter(*_: Any) -> None:
            self.depth += 1

        def leave(*_: Any) -> None:
            self.depth -= 1

        self.hooks = [h for b in self.blocks
                      for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self.hooks:
            h.remove()
        self.live.clear()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.multiprocessing.reductions import StorageWeakRef

        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self.sampled and self.counted:  # a backward starts: what the forwards left
            self.sampled.add(task)
            alive = [(n, inside) for ref, n, inside in self.live.values() if not ref.expired()]
            self.kept = max(self.kept, sum(n for n, _ in alive))
            self.block_kept = max(self.block_kept, sum(n for n, inside in alive if inside))
        out = func(*args, **(kwargs or {}))
        if task == -1 and self.counted:
            try:  # new storages only: a view of its input (a weight's transpose) allocates nothing
                held = {s.data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs)) for s in _storages(t)}
                for storage in (s for t in torch.utils._pytree.tree_leaves(out) for s in _storages(t)):
                    if storage.data_ptr() not in held and (storage.data_ptr() not in self.live
                                                           or self.live[storage.data_ptr()][0].expired()):
                        self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), self.depth > 0)
            except Exception:  # a tensor kind without storages to count: no figure rather than a failed step
                self.counted = False
        return out


def _storages(t: Any) -> list[Any]:
    """The storages a tensor holds: its own, or a wrapper subclass's inner tensors' (a DTensor's local shard,
    a float8 tensor's data and scale)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return []
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return [s for name in t.__tensor_flatten__()[0] for s in _storages(getattr(t, name))]
    return [t.untyped_storage()]


def prepare_model(model: Any, cfg: DictConfig, device: torch.device) -> None:
    """The options that change how a built model computes, in the order every engine applies them before
    it wraps or shards the model: float8 linears -> activation checkpointing -> regional compile -> chunked
    loss head. Float8 first, so checkpointing recomputes and compile traces the float8 layers; the loss
    head last, outside the compiled blocks."""
    apply_float8(model, cfg.precision, device)
    apply_activation_checkpointing(model, cfg.model)
    apply_compile(model, cfg.model)
    apply_chunked_loss(model, cfg.model)


def prepare_replica(model: torch.nn.Module, cfg: DictConfig, device: torch.device) -> torch.nn.Module:
    """Full-replica engines (single, DDP, Horovod): materialise, ``prepare_model``, then move."""
    materialize(model, device, cfg.seed, cfg.model)
    prepare_model(model, cfg, device)
    # Always moved (bitsandbytes quantises a 4-bit base as it moves), but for a dry run's fake storage, which is on
    # the device already and cannot be swapped for itself.
    return model if _FAKE_STORAGE["mode"] is not None else model.to(device)


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


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def causal_lm_loss(model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens with a target (-100 marks the others: prompts, padding);
    logits upcast to fp32 for a stable softmax under autocast. ``inputs``: token ids, or the model's keyword
    arguments (``input_ids`` and ``position_ids`` of packed rows, ``data=sft``). Evaluation's form; training
    backpropagates ``causal_lm_loss_sum``. Under an installed objective (``shardyard.objectives.install``: DPO,
    GRPO), that objective's held-out loss."""
    objective = _objective(model)
    if objective is not None:
        return objective.eval_loss(model, inputs, targets)
    return _cross_entropy(model, inputs, targets, "mean")


def causal_lm_loss_sum(model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """The training loss's terms, each the cross-entropy summed over its labelled tokens (fp32; 0 when none is
    labelled, where the mean is NaN): the main head's (0-d), or ``[main, MTP depth 1, ..., depth D]`` for a model
    with multi-token prediction (``shardyard.mtp``). The engines weight each term so that an optimizer step's loss is
    its token-weighted mean over every micro-batch and rank (docs/architecture.md, "Token-weighted loss"), times
    its factor (``mtp.term_weights``). Under an installed objective (``shardyard.objectives.install``: DPO, GRPO),
    that objective's terms, summed over what it averages over (``Objective.counts``)."""
    objective = _objective(model)
    if objective is not None:
        return objective.loss_sum(model, inputs, targets)
    bare = _bare(model)
    if mtp.depth(bare):
        with mtp.training_targets(bare, targets):
            return logits(_call(model, inputs))
    return _cross_entropy(model, inputs, targets, "sum")


def _objective(model: Any) -> Any:
    """The objective installed on the model the engine trains (``shardyard.objectives.install``), or None (``lm``)."""
    return getattr(_bare(model), "__dict__", {}).get("shardyard_objective")


def _cross_entropy(model: torch.nn.Module, inputs: Any, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    bare = _bare(model)
    if has_chunked_loss(model):  # the head returns the summed cross-entropy (apply_chunked_loss)
        head = bare.get_output_embeddings()
        head.shardyard_targets = targets
        try:
            total = logits(_call(model, inputs))
        finally:
            head.shardyard_targets = None
        return total if reduction == "sum" else total / (targets != -100).sum()
    out = logits(_call(model, inputs))
    return F.cross_entropy(out.float().reshape(-1, out.size(-1)), targets.reshape(-1), ignore_index=-100,
                           reduction=reduction)


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**packed_kwargs(model, inputs)) if isinstance(inputs, dict) else model(inputs)


def attn_implementation(model: Any) -> str | None:
    config = getattr(_bare(model), "config", None)
    return getattr(config, "_attn_implementation", None)


def packed_kwargs(model: Any, inputs: dict) -> dict:
    """Keep packed conversations apart. Positions restart at 0 at every conversation; FlashAttention-2 reads
    those restarts as varlen boundaries, sdpa and eager get them as a block-diagonal causal mask (a token
    attends to the earlier tokens of its own conversation only). transformers does not build that mask from
    ``position_ids`` for sdpa/eager (measured: logits of a packed row then differ from each conversation run
    alone by 0.28), so it is built here: boolean for sdpa, additive for eager."""
    impl = attn_implementation(model)
    if impl == "flash_attention_2" or "attention_mask" in inputs:
        return inputs
    pos = inputs["position_ids"]
    segment = (pos == 0).cumsum(-1)
    L = pos.size(-1)
    causal = torch.ones(L, L, dtype=torch.bool, device=pos.device).tril()
    mask = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
    if impl == "eager":
        mask = torch.zeros(mask.shape, device=pos.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return {**inputs, "attention_mask": mask}


# ------------------------------------------------------------------------------ what the memory plan reads
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
    act = {}
    for regime in ("fp32", "autocast", "half"):
        layer = [b[regime] for b in per_block]
        kept = [b["selective_" + regime] for b in per_block]
        resid = 2 if regime == "half" else 4  # the residual stream: fp32 but under half parameters
        act[regime] = {"blocks": sum(layer), "max_block": max(layer), "ckpt_per_block": resid * h,
                       "selective_blocks": sum(kept), "max_selective_block": max(kept),
                       # the logits (and their fp32 upcast, log-softmax and gradient) per token at the loss's
                       # backward, which model.loss_chunk bounds (12 bytes measured by the dry run at deepseek7b),
                       # and the final norm's and the head's inputs
                       "logits": (14 if regime == "fp32" else 12) * vocab, "loss_hidden": 2 * resid * h,
                       # what the backward of the largest block allocates beside its activations (gradients of
                       # its activations, the experts' grouped GEMM inputs): 0 where the fit above holds it
                       "max_block_backward": max(b.get("backward", 0.0) * b[regime] for b in per_block),
                       # what the blocks do not save when their base is frozen (``peft``; the adapters' own
                       # activations are ``adapters.activation_bytes_per_token``)
                       "frozen_blocks": sum(b["frozen_" + regime] for b in per_block),
                       # Multi-token prediction (``shardyard.mtp``), per depth and token, beside its block (one of
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
    return {"frozen_" + k: v for k, v in frozen.items()} | {
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
        return {"fp32": fp32, "autocast": _V3_AUTOCAST * fp32, "half": _V3_HALF * fp32,
                "frozen_fp32": 8 * h, "frozen_autocast": 8 * h, "frozen_half": 4 * h, "backward": _V3_BACKWARD,
                "selective_fp32": 4 * kept, "selective_autocast": _V3_AUTOCAST * 4 * kept,
                "selective_half": _V3_HALF * 4 * kept}
    i = getattr(c, "intermediate_size", None) or 4 * h
    if moe and getattr(c, "num_experts_per_tok", None):  # LLaMA-style attention with routed experts
        i = c.num_experts_per_tok * (getattr(c, "moe_intermediate_size", None) or i)
    return _llama_bytes(h, i, kv_heads * head_dim, heads)


# ---------------------------------------------------------------------------------------- the optimizer
