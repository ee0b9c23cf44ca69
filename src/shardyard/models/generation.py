"""Batched sampling from a causal LM with a KV cache: GRPO's rollouts on every engine, and (issue 45) ``shardyard
generate`` and the end-of-run sample.

``generate`` takes left-padded prompts and returns ``max_new_tokens`` columns per row: the sampled tokens up to and
including the row's first ``eos_id`` (mask 1), the pad id after it (mask 0).

1. The prompt runs once (prefill) into an HF ``DynamicCache``; each later forward feeds one token per row. A row's
   positions count its real tokens (``cumsum(mask) - 1``, 0 on the left padding), as HF's ``generate`` does, and
   the attention mask grows by one column per token: 1 while the row is generating, 0 once it has finished. A
   finished row keeps taking part in every forward (fixed shapes; its tokens are pad and masked out).
2. Sampling in fp32: temperature 0 is greedy (argmax); otherwise ``logits / temperature``, then top-k (the
   ``k``-th largest logit and all ties with it kept, as HF's ``TopKLogitsWarper``), then top-p (nucleus: the
   smallest set of most probable tokens whose mass reaches ``top_p``, never empty), then one
   ``torch.multinomial`` draw per row from the caller's generator only, so a seed fixes every completion.
3. ``lockstep``: every call runs exactly ``max_new_tokens`` forwards. Sharded engines (FSDP, ZeRO-3, tensor
   parallel) gather parameters inside the forward, a collective every rank must join, and different ranks' rows
   finish at different times. Without it the loop ends as soon as every row has finished: one host read of a
   ``bool`` per token, the only host sync of the loop (none at all in lockstep).
4. The module is called with keyword arguments only (``input_ids``, ``attention_mask``, ``position_ids``, the
   cache, ``use_cache=True``), so it may be what an engine hands out (``Backend.hf_model()``: DDP's ``.module``,
   FSDP2's ``fully_shard``-ed root, a DeepSpeed engine's module, a peft model), with each engine's forward hooks
   running as for any forward; logits are read through ``shardyard.models.loss.logits``. The cache is passed under the
   name the model's class takes: ``cache`` (transformers 5.24, where ``past_key_values`` is a deprecated alias
   until 5.40) or ``past_key_values`` (older releases: the pin allows 4.57). A module whose forward takes the token ids alone (a user's
   ``CausalLM``, a pipeline engine's whole-model forward) recomputes the whole prefix per token and needs
   unpadded prompts.
5. The model runs in eval mode (its mode is restored after) and without autograd: MoE routers count no load for
   the balance in eval mode (``moe.Balancer``), and MTP depths run only inside the training loss (``mtp``).

Stop strings (issue 45) end a row like ``eos_id``: ``stop`` is the place for them (a check on the ids so far).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch

from shardyard.models.loss import logits as logits_of

StopCheck = Callable[[torch.Tensor], torch.Tensor]
"""``stop(completion_ids[:, :t+1]) -> bool[B]``: rows whose completion ends with token ``t`` (kept, mask 1)."""


def generate(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | list[int] | None,
             pad_id: int, generator: torch.Generator | None = None, lockstep: bool = False, kv_cache: bool = True,
             stop: StopCheck | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(completion_ids [B, max_new_tokens], completion_mask [B, max_new_tokens])`` for left-padded prompts
    ``prompt_ids [B, P]`` with ``prompt_mask [B, P]`` (1: a real token), on the prompts' device. See the module
    docstring; ``kv_cache=False`` recomputes the whole prefix at every token (the reference the cache is checked
    against, and ``bench/generate.py``'s baseline); ``eos_id=None``: rows end only at ``max_new_tokens`` (or
    ``stop``); a list: a row ends at any of them (a chat model's end-of-turn token beside its eos)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} must be "
                         "the same [batch, prompt_len]")
    B, P, N = prompt_ids.size(0), prompt_ids.size(1), max_new_tokens
    device = prompt_ids.device
    # The whole sequence, prompt then completion: its mask and positions are views of its first columns.
    ids = torch.full((B, P + N), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((B, P + N), dtype=torch.long, device=device)
    ids[:, :P] = prompt_ids
    mask[:, :P] = prompt_mask
    forward = _stepper(model, ids, mask, P, kv_cache)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    eos = None if eos_id is None else torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id),
                                                   dtype=torch.long, device=device)
    with _inference(model):
        for t in range(N):
            scores = forward(t)  # [B, V] fp32: the logits of the token at column P + t
            token = sample(scores, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            live = ~finished
            ids[:, P + t] = torch.where(live, token, torch.full_like(token, pad_id))
            mask[:, P + t] = live.long()
            if eos is not None:
                finished = finished | (live & torch.isin(token, eos))
            if stop is not None:  # issue 45's stop strings: a row ends after the token that completes one
                finished = finished | (live & stop(ids[:, P:P + t + 1]))
            if not lockstep and t < N - 1 and bool(finished.all()):  # the loop's one host sync per token
                break
    return ids[:, P:], mask[:, P:]


def sample(scores: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``scores [B, V]`` (fp32 logits): argmax at temperature 0, else a draw from
    ``filter_logits(scores / temperature, top_k, top_p)`` with ``generator``. ``[B]`` long."""
    if temperature == 0:
        return scores.argmax(dim=-1)
    kept = filter_logits(scores / temperature, top_k, top_p)
    return torch.multinomial(torch.softmax(kept, dim=-1), 1, generator=generator).squeeze(-1)


def filter_logits(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``scores`` with the tokens outside the top-k (0: all kept), then outside the nucleus ``top_p`` (1: all kept),
    set to -inf. Top-k keeps every token tied with the k-th largest; the nucleus is the smallest set of most
    probable tokens whose probability (after top-k) adds up to ``top_p`` or more, the most probable always in it."""
    out = scores
    if 0 < top_k < scores.size(-1):
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.softmax(out, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # the mass of the more probable tokens
        drop = before >= top_p
        drop[..., 0] = False
        out = out.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return out


# ------------------------------------------------------------------------------------------- the forwards
def _stepper(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, P: int,
             kv_cache: bool) -> Callable[[int], torch.Tensor]:
    """``step(t)``: the fp32 next-token logits ``[B, V]`` of the sequence up to column ``P + t - 1`` (whose
    columns the loop has filled), by the fastest way ``model`` allows."""
    if not _takes_keywords(model):
        return _plain_steps(model, ids, mask, P)
    hf = hf_model(model)
    params = inspect.signature(type(hf).forward).parameters
    cache_kw = cache_keyword(type(hf).forward)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def positions(upto: int) -> torch.Tensor:
        return (mask[:, :upto].cumsum(-1) - 1).clamp(min=0)

    if not kv_cache or cache_kw is None:
        def recompute(t: int) -> torch.Tensor:
            out = model(input_ids=ids[:, :P + t], attention_mask=mask[:, :P + t], position_ids=positions(P + t),
                        use_cache=False, **extra)
            return logits_of(out)[:, -1].float()

        return recompute

    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    seen = mask[:, :P].sum(-1)  # each row's real tokens so far

    def cached(t: int) -> torch.Tensor:
        nonlocal seen
        if t == 0:
            start, pos = 0, positions(P)
        else:  # the token of column P + t - 1; its position counts the real tokens before it
            start, new = P + t - 1, mask[:, P + t - 1]
            pos = (seen - 1 + new).clamp(min=0)[:, None]
            seen = seen + new
        out = model(input_ids=ids[:, start:P + t], attention_mask=mask[:, :P + t], position_ids=pos,
                    use_cache=True, **{cache_kw: cache}, **extra)
        return logits_of(out)[:, -1].float()

    return cached


def _plain_steps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 P: int) -> Callable[[int], torch.Tensor]:
    """A forward of the token ids alone: the whole prefix each token; padding it cannot mask is refused."""
    if not bool(mask[:, :P].all()):
        raise ValueError(f"{type(model).__name__}'s forward takes the token ids alone, so it cannot mask left "
                         "padding: generate from unpadded prompts (one row, or rows of equal length)")

    def step(t: int) -> torch.Tensor:
        return logits_of(model(ids[:, :P + t]))[:, -1].float()

    return step


def _takes_keywords(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward (as called: an instance's own, an engine's) takes an ``attention_mask``."""
    params = inspect.signature(model.forward).parameters
    return "attention_mask" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def hf_model(model: Any) -> Any:
    """The transformers model inside DDP's and DeepSpeed's ``.module`` and peft's ``PeftModel``."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_keyword(forward: Any) -> str | None:
    """The name ``forward`` takes its KV cache under (module docstring, point 4): ``cache`` or
    ``past_key_values``; None when it takes neither."""
    params = inspect.signature(forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


@contextlib.contextmanager
def _inference(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (restored after) and no autograd. ``no_grad``, not ``inference_mode``: tensors an engine
    allocates inside the forward (FSDP2's unsharded parameters) are used again by training."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)
