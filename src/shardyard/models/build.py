"""Models: ``model._target_`` names a builder; shardyard builds and checks what it returns (this module), reads
its facts (``shape``), prepares it for training (``prepare``) and computes its loss (``loss``).

A builder is any callable that takes the ``model`` option's own keys (everything but the shardyard keys of
``config.schema.ModelConfig``) and returns either a ``transformers.PreTrainedModel`` (any
``AutoModelForCausalLM``) or an ``nn.Module`` meeting ``CausalLM`` below. The built-in builders are
``llama`` (DeepSeek-LLM is the LLaMA architecture), ``deepseek_v3`` (MLA attention + routed/shared
experts) and ``hf`` (any local HF directory). Nothing is ever downloaded.

shardyard itself decides *where* the model is created (CPU, the meta device for big models, under
``deepspeed.zero.Init``) and materialises it (``materialize``); ``shardyard.models.prepare`` applies activation
checkpointing, compile, float8 and the chunked loss head to its transformer blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from omegaconf import DictConfig

from shardyard.models import moe, mtp
from shardyard.core import moved
from shardyard.core.errors import UserError
from shardyard.core.facts import ModelFacts
from shardyard.models.shape import (_input_embeddings, _token_shares, attn_implementation, flops_per_token, is_hf,
                                    model_shape, param_count)
from shardyard.models.weights import load_weights, weights_dir


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


def call_builder(m: DictConfig, tokens: SpecialTokens | None = None) -> torch.nn.Module:
    """``model._target_`` called with the option's keys, less shardyard's own (``ModelConfig``). ``tokens``: the
    special tokens of the tokenizer the model is trained (or read) with, which its HF config takes (every family
    alike: ``use_special_tokens``)."""
    from shardyard.config.plugins import build
    from shardyard.config.schema import ModelConfig

    model = build(m, own=[f.name for f in dataclasses.fields(ModelConfig)])
    if m.get("mtp") is not None:  # DeepSeek-V3's multi-token prediction depths (model.mtp)
        mtp.attach(model, m.mtp)
    if is_hf(model):
        model.config.use_cache = False  # training never decodes incrementally
        if tokens is not None:
            use_special_tokens(model, tokens)
    return model


@dataclasses.dataclass(frozen=True)
# ----------------------------------------------------------------------------------------------------- special tokens
class SpecialTokens:
    """The special-token ids of a tokenizer: what a model's ``config.json`` and ``generation_config.json`` must say.
    A builder's HF config otherwise keeps transformers' defaults for its family (LLaMA and DeepSeek-V2: bos 1, eos 2;
    DeepSeek-V3: bos 0, eos 1), ids of another vocabulary: with shardyard's BPE tokenizers (``<|endoftext|>`` at 0,
    ``!`` and ``"`` at 1 and 2) ``generate`` would end every completion at its first ``"`` or ``!``."""

    bos: int | None
    eos: int | None
    pad: int | None
    special: frozenset[int]
    """Every id the tokenizer calls special: its bos, eos, pad, unk and added special tokens (a chat model's end
    of turn)."""

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialTokens:
        """From an HF tokenizer (``AutoTokenizer``)."""
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                    if getattr(t, "special", False)}
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        return cls(*ids, special=frozenset(int(i) for i in (*special, *ids) if i is not None))


def use_special_tokens(model: Any, tokens: SpecialTokens) -> list[str]:
    """Make ``model.config`` and ``model.generation_config`` say the tokenizer's special tokens; returns what
    changed (``"eos_token_id 2 -> 0"``, once per id whichever of the two said it), empty when they agreed.

    Each of bos, eos and pad becomes the tokenizer's; where the tokenizer has none (no bos), the config's own is
    kept only if the tokenizer calls it special, else it becomes None. A list of end tokens (Llama-3's
    ``<|end_of_text|>`` and ``<|eot_id|>``) keeps the ones the tokenizer calls special, with the tokenizer's eos
    among them. So generation ends at the tokenizer's end token and never at a token the tokenizer does not call
    special."""
    changed: dict[str, str] = {}
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is None:
            continue
        for name, want, many in (("bos_token_id", tokens.bos, False), ("eos_token_id", tokens.eos, True),
                                 ("pad_token_id", tokens.pad, False)):
            had = getattr(config, name, None)
            new = _agreeing_id(had, want, tokens.special, many)
            if new != had:
                changed.setdefault(name, f"{name} {had} -> {new}")
                setattr(config, name, new)
    return list(changed.values())


def _agreeing_id(had: Any, want: int | None, special: frozenset[int], many: bool) -> Any:
    listed = list(had) if isinstance(had, (list, tuple)) else [] if had is None else [had]
    kept = [i for i in listed if i in special]
    if want is not None:
        kept = kept if want in kept else [want, *kept]
    if not many or len(kept) <= 1:
        return kept[0] if kept else None
    return kept


# -------------------------------------------------------------------------------------------------- built-in builders
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


def rope_parameters(rope_scaling: Any, rope_theta: float, max_position_embeddings: int) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for ``model.rope_scaling`` (``schema.RopeScalingConfig``; type none or
    None: plain RoPE): the fields its ``type`` reads, named as HF's ``rope_scaling`` names them, checked against each other
    (the ranges of each alone are ``schema.ROPE_RANGES``'). A value that does not add up is a ``UserError``
    naming its key."""
    s = dict(rope_scaling or {})
    kind = s.get("type") or "none"
    kind = str(getattr(kind, "value", kind))  # the schema's RopeType, or its name (arguments() passes names)
    if kind == "none":
        return {"rope_type": "default", "rope_theta": rope_theta}
    key = "model.rope_scaling"
    original, factor = s.get("original_max_position_embeddings"), s.get("factor")
    from shardyard.config.schema import RopeType

    if kind not in {t.value for t in RopeType}:  # composition refuses it too; a builder called directly does not
        raise UserError(f"{key}.type", kind, "It names no rotary scaling shardyard passes to transformers.",
                        f"Use one of {[t.value for t in RopeType]}.")
    if kind == "dynamic" and original is not None:
        raise UserError(f"{key}.original_max_position_embeddings", original,
                        "dynamic (NTK) scaling takes model.max_position_embeddings as the pretrained length and grows "
                        "the rotary base for sequences past it, by their length over it (transformers' "
                        "dynamic_rope_update): a second length would be ignored.",
                        f"Drop {key}.original_max_position_embeddings and set model.max_position_embeddings to the "
                        "pretrained length, or use yarn to train at the extended length.")
    if original is None and kind in ("yarn", "llama3"):
        raise UserError(f"{key}.original_max_position_embeddings", None,
                        f"{kind} scaling extends the length the model was pretrained at, which it must be told.",
                        f"Set {key}.original_max_position_embeddings (DeepSeek-V3: 4096).")
    if original is not None and not 1 <= int(original) <= max_position_embeddings:
        raise UserError(f"{key}.original_max_position_embeddings", original,
                        f"The pretrained length must lie in 1..model.max_position_embeddings={max_position_embeddings} "
                        "(the length the scaled model runs to).",
                        f"Use the length the model was pretrained at, and raise model.max_position_embeddings to "
                        f"factor x that length.")
    derived = max_position_embeddings / int(original) if original else None
    if factor is None:
        if derived is None:
            raise UserError(f"{key}.factor", None, f"{kind} scaling divides positions by a factor it must be told.",
                            f"Set {key}.factor (e.g. 4), or {key}.original_max_position_embeddings to derive it.")
        factor = derived
    factor = float(factor)
    if not factor >= 1.0:
        raise UserError(f"{key}.factor", factor, "Rotary scaling extends a model: the factor must be at least 1.",
                        f"Use {key}.factor >= 1, or leave it null to take model.max_position_embeddings / "
                        f"{key}.original_max_position_embeddings.")
    if kind == "yarn" and abs(factor - derived) > 1e-6 * derived:  # type: ignore[operator]
        raise UserError(f"{key}.factor", factor,
                        f"YaRN's factor is the extended length over the pretrained one: model.max_position_embeddings"
                        f"={max_position_embeddings} / {original} = {derived:g} (transformers would warn and use "
                        "the factor, leaving the two at odds).",
                        f"Use {key}.factor={derived:g} (or null), or model.max_position_embeddings="
                        f"{int(round(factor * int(original)))}.")  # type: ignore[arg-type]
    out: dict[str, Any] = {"rope_type": kind, "rope_theta": rope_theta, "factor": factor}
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        if not float(s.get("beta_fast", 32.0)) > float(s.get("beta_slow", 1.0)):
            raise UserError(f"{key}.beta_slow", s.get("beta_slow"), f"YaRN interpolates the frequencies of fewer than "
                            f"beta_slow rotations and keeps those of more than beta_fast={s.get('beta_fast')}: "
                            "beta_slow must be below beta_fast.", "Use DeepSeek's beta_fast=32, beta_slow=1.")
        out.update({k: float(s.get(k, d)) for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 1.0),
                                                        ("mscale_all_dim", 0.0))})
    if kind == "llama3":
        if not float(s.get("high_freq_factor", 4.0)) > float(s.get("low_freq_factor", 1.0)):
            raise UserError(f"{key}.low_freq_factor", s.get("low_freq_factor"), "Llama 3's scaling blends the "
                            "wavelengths between original / low_freq_factor and original / high_freq_factor: "
                            "low_freq_factor must be below high_freq_factor.", "Use Llama 3.1's 1 and 4.")
        out.update({k: float(s.get(k, d)) for k, d in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0))})
    return out


def llama(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, max_position_embeddings: int = 2048, rope_theta: float = 10000.0,
          rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False, initializer_range: float = 0.02,
          attn_implementation: str = "sdpa", rope_scaling: Any = None) -> torch.nn.Module:
    """DeepSeek-LLM / LLaMA (``transformers.LlamaForCausalLM``) from its dimensions."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    _check_heads(hidden_size, num_heads, num_kv_heads)
    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta, attn_implementation: PretrainedConfig kwargs
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
        rope_parameters=rope_parameters(rope_scaling, rope_theta, max_position_embeddings),
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
                attn_implementation: str = "sdpa", rope_scaling: Any = None) -> torch.nn.Module:
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
                attn_implementation: str = "sdpa", topk_method: str = "greedy", rope_scaling: Any = None
                ) -> torch.nn.Module:
    """DeepSeek-V2 (``transformers.DeepseekV2ForCausalLM``): MLA attention, shared + routed experts, a softmax
    router (``topk_method``: ``greedy`` or ``group_limited_greedy``) balanced by auxiliary losses."""
    if topk_method not in ("greedy", "group_limited_greedy"):
        raise UserError("model.topk_method", topk_method, "DeepSeek-V2's router chooses experts greedily, or greedily "
                        "within the model.topk_group best of model.n_group groups.",
                        "Use model.topk_method=greedy or group_limited_greedy.")
    return _deepseek("DeepseekV2Config", **locals())


def _deepseek(config_class: str, *, num_experts_per_tok: int, n_routed_experts: int, n_group: int, topk_group: int,
              num_layers: int, num_heads: int, num_kv_heads: int | None, rope_scaling: Any = None,
              **dims: Any) -> torch.nn.Module:
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
        topk_group=topk_group, dtype=torch.float32,
        rope_parameters=rope_parameters(rope_scaling, dims["rope_theta"], dims["max_position_embeddings"]), **dims)
    return AutoModelForCausalLM.from_config(config)


# ``+scale=smoke`` (shardyard.planning.scale): the tiny shape of each builder's family. A user's builder may carry its
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


# -------------------------------------------------------------------------------------------- facts from a meta build
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
                        "Return a transformers PreTrainedModel or an nn.Module meeting shardyard.models.build.CausalLM.")

    emb = _input_embeddings(model)
    config = getattr(model, "config", None)
    trainable, adapter_acts = None, None
    from shardyard.models.adapters import activation_bytes_per_token, apply, method

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
    flops = flops_per_token(model, seq_len)
    return ModelFacts(params=param_count(model), flops_per_token=flops,
                      attention_flops_per_token=flops - flops_per_token(model, 0),  # the 12*L*H*Q*T term
                      embedding_rows=getattr(emb, "num_embeddings", None),
                      max_positions=getattr(config, "max_position_embeddings", None), shape=model_shape(model),
                      attn=attn_implementation(model) if is_hf(model) else None, trainable=trainable,
                      adapter_activations=adapter_acts,
                      moe_layers=len(found), routed_experts=found[0].experts if found else 0,
                      experts_per_token=found[0].top_k if found else 0,
                      router_bias=bool(found) and all(r.biased for r in found))


# ---------------------------------------------------------------------------------------------- building for training
def build_model(m: DictConfig, seed: int, on_meta: bool = False,
                tokens: SpecialTokens | None = None) -> torch.nn.Module:
    """Build the bare model (seeded, so identical on every rank); no training options applied yet. ``tokens``:
    the special tokens of the tokenizer it trains with, which its HF config takes (``call_builder``).

    With ``on_meta`` (big models, ``init_device: meta``) it is created on the meta device, and the engine
    materialises it (``materialize``), shard by shard if it shards.
    """
    torch.manual_seed(seed)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return call_builder(m, tokens)


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
        from shardyard.models.adapters import init_adapters

        init_adapters(model, seed)
    if buffers is not None:
        with _FAKE_STORAGE["mode"] or contextlib.nullcontext():
            _buffers_to(model, buffers)


_FAKE_STORAGE: dict[str, Any] = {"mode": None}


@contextlib.contextmanager
def materialized_in(mode: Any) -> Iterator[None]:
    """Inside, ``materialize`` gives meta parameters storage in ``mode`` (a ``FakeTensorMode``: shapes and bytes,
    no memory) instead of real storage: the dry run's seam (``shardyard.planning.dryrun``), which builds, shards and wraps
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


# The public names that moved out (core.moved.NAMES_MOVED) still import from here, with a deprecation line.
__getattr__ = moved.names_moved_from(__name__)
