"""Greedy speculative decoding with a DeepSeek-V3 model's own multi-token-prediction depths as the draft (issue 45;
DeepSeek-V3, arXiv 2412.19437, section 5.4.3): ``shardyard generate ... speculative=mtp``.

Depth k (``shardyard.models.mtp``) at position i reads the previous depth's hidden state at i and the embedding of token
i+k, and predicts token i+k+1. One round, with the main model holding tokens ``x_0..x_{n-1}`` in its KV cache and
its greedy next token ``x_n`` known:

1. Draft: depth 1 at position n-1 (``h_0[n-1]``, ``Emb(x_n)``) proposes ``d_1``; depth 2 at n-1 (``h_1[n-1]``,
   ``Emb(d_1)``) proposes ``d_2``; ... up to depth D. Each depth keeps a KV cache of its own (a decoder layer like
   the main ones): position j of depth k is final once token j+k is, so after the round depth k keeps positions
   ``<= n-k`` and recomputes the later ones (built on drafts) in the next round, from hidden states of the
   depth below kept for the purpose (``_Drafter``).
2. Verify: one main forward over ``x_n, d_1..d_D`` (positions n..n+D). The main model's argmax ``a_i`` at position
   n+i is its greedy token n+i+1: the drafts are accepted while ``d_{i+1} == a_i``, and ``a_m`` after the m
   accepted ones is the main model's own next token. So a round adds m+1 tokens, each one the main model's greedy
   choice given the accepted tokens before it: the output is plain greedy decoding's
   (``generation.generate(..., temperature=0)``), whatever the drafts. The main cache is cropped to the accepted
   tokens (``crop``).

Identical means token for token in fp32. In bf16/fp16 the verify forward (several positions at once) rounds
differently from one-token steps, so where two logits tie within that rounding the choice may differ, as with any
speculative decoder in low precision.

The model is one in memory (``inference.load``'s, or a bare DeepSeek-V3 with ``mtp.attach``-ed depths), one prompt
at a time (batch 1), called through its inner modules (embedding, decoder, depths, head): not a sharded engine's.
The MTP path needs transformers' ``create_causal_mask`` to size a mask per cache layer (``layer_idx``: transformers 5).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardyard.models import mtp
from shardyard.models.generation import cache_keyword, hf_model

StopCheck = Callable[[torch.Tensor], torch.Tensor]
"""``stop(completion_ids[:, :t+1]) -> bool[1]``: as ``generation.StopCheck`` (the completion ends after token t)."""


@dataclass
class SpecStats:
    """What speculation did for one or more prompts (``add`` sums them)."""

    drafted: int = 0
    """Draft tokens the main model verified (the depths' proposals; at most D per round, fewer near
    ``max_new_tokens``)."""
    accepted: int = 0
    """Drafts equal to the main model's greedy token (each one a token gained over plain decoding)."""
    forwards: int = 0
    """Main-model forwards: the prompt's (prefill) and one per round."""
    tokens: int = 0
    """Tokens generated (eos included)."""
    drafted_at: list[int] = field(default_factory=list)
    """Per depth (depth 1 first): drafts verified."""
    accepted_at: list[int] = field(default_factory=list)
    """Per depth (depth 1 first): drafts accepted (depth k's only when depths 1..k-1's were)."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified drafts (0 when none was verified)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens generated per main forward (plain KV-cached decoding: 1)."""
        return self.tokens / self.forwards if self.forwards else 0.0

    def add(self, other: "SpecStats") -> "SpecStats":
        """These counts plus ``other``'s (a new object)."""
        n = max(len(self.drafted_at), len(other.drafted_at))

        def pad(v: list[int]) -> list[int]:
            return v + [0] * (n - len(v))

        return SpecStats(self.drafted + other.drafted, self.accepted + other.accepted,
                         self.forwards + other.forwards, self.tokens + other.tokens,
                         [a + b for a, b in zip(pad(self.drafted_at), pad(other.drafted_at))],
                         [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))])


def available(model: Any) -> bool:
    """Whether ``model`` (or the transformers model inside a wrapper) has MTP depths to draft with."""
    return mtp.depth(hf_model(model)) > 0


def generate_mtp(model: Any, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_id: int | list[int] | None,
                 stop: StopCheck | None = None, depths: int | None = None) -> tuple[torch.Tensor, SpecStats]:
    """Greedy completion of one prompt ``prompt_ids [1, P]`` with speculation (module docstring): ``(tokens [N'],
    stats)``, the tokens up to and including the first ``eos_id`` or the token that ends a ``stop`` check, at most
    ``max_new_tokens``; equal to ``generation.generate(model, ..., temperature=0)``'s completion truncated there.
    ``depths``: draft with depths 1..``depths`` only (default: all)."""
    hf = hf_model(model)
    have = mtp.depth(hf)
    if have == 0:
        raise ValueError(f"{type(hf).__name__} has no MTP depths to draft with (speculative.available is False)")
    D = have if depths is None else depths
    if not 1 <= D <= have:
        raise ValueError(f"depths must be 1..{have} (the model's MTP depths), got {depths}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_ids.dim() != 2 or prompt_ids.size(0) != 1 or prompt_ids.size(1) < 1:
        raise ValueError(f"prompt_ids must be one unpadded prompt [1, P], got {tuple(prompt_ids.shape)}")
    was = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            return _Speculation(hf, prompt_ids, max_new_tokens, eos_id, stop, D).run()
    finally:
        hf.train(was)


def _cache_kw(fn: Any) -> str:
    """The name a forward takes its KV cache under (``generation.cache_keyword``; ``past_key_values`` when it
    names neither: a ``**kwargs`` forward)."""
    return cache_keyword(fn) or "past_key_values"


class _Speculation:
    """One prompt's rounds (``run``). ``ids`` holds the sequence: the prompt, the accepted tokens, then the
    current round's next token and drafts."""

    def __init__(self, hf: Any, prompt: torch.Tensor, N: int, eos_id: int | list[int] | None, stop: StopCheck | None,
                 D: int) -> None:
        from transformers import DynamicCache

        self.hf, self.inner, self.head = hf, hf.model, hf.get_output_embeddings()
        self.N, self.stop, self.D = N, stop, D
        self.eos = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
        self.P = prompt.size(1)
        self.device = prompt.device
        self.ids = torch.zeros((1, self.P + N + D + 1), dtype=torch.long, device=self.device)
        self.ids[:, :self.P] = prompt
        self.cache = DynamicCache(config=hf.config)
        self.cache_kw = _cache_kw(type(self.inner).forward)
        self.drafter = _Drafter(hf, D)
        self.out: list[int] = []
        self.stats = SpecStats(drafted_at=[0] * D, accepted_at=[0] * D)

    def main(self, start: int, end: int, last_only: bool = False) -> tuple[torch.Tensor, list[int]]:
        """The main model over ``ids[start:end]`` (its cache holds the ``start`` before): its final hidden states
        ``[1, end - start, H]`` and its greedy token after each position (``last_only``: after the last), one host
        read."""
        out = self.inner(input_ids=self.ids[:, start:end],
                         attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
                         position_ids=torch.arange(start, end, device=self.device)[None], use_cache=True,
                         **{self.cache_kw: self.cache})
        hidden = out.last_hidden_state
        self.stats.forwards += 1
        return hidden, self.head(hidden[:, -1:] if last_only else hidden).float().argmax(-1)[0].tolist()

    def emit(self, token: int) -> bool:
        """Append a generated token; whether generation ends with it."""
        self.out.append(token)
        self.stats.tokens += 1
        t = len(self.out)
        if t >= self.N or token in self.eos:
            return True
        return self.stop is not None and bool(self.stop(self.ids[:, self.P:self.P + t])[0])

    def run(self) -> tuple[torch.Tensor, SpecStats]:
        n = self.P
        hidden, greedy = self.main(0, n, last_only=True)
        nxt = greedy[-1]
        self.ids[0, n] = nxt
        done = self.emit(nxt)
        self.drafter.absorb(hidden)
        while not done:
            drafts = self.drafter.draft(self.ids, n)  # writes ids[n+1 .. n+D]
            d = min(self.D, self.N - len(self.out) - 1)  # drafts that could still be used
            hidden, greedy = self.main(n, n + d + 1)
            m = 0
            while m < d and drafts[m] == greedy[m]:
                m += 1
            self.stats.drafted += d
            self.stats.accepted += m
            for k in range(d):
                self.stats.drafted_at[k] += 1
                self.stats.accepted_at[k] += k < m
            if d > m:
                self.cache.crop(-(d - m))  # the rejected drafts' keys and values
            self.drafter.absorb(hidden[:, :m + 1])
            n += m + 1
            self.ids[0, n] = greedy[m]  # ids[.. n-1] hold the accepted drafts already
            for token in drafts[:m] + [greedy[m]]:
                if done := self.emit(token):
                    break
        return torch.tensor(self.out, dtype=torch.long, device=self.device), self.stats


class _Drafter:
    """The MTP depths as a draft model with KV caches of their own (one ``DynamicCache`` whose layer
    ``L + k - 1`` is depth k's, cropped per layer).

    Stage 0 is the main model, stage k depth k; stage k's input at position j is stage k-1's output at j and token
    j+k. ``done[k]`` counts depth k's cached positions, all built on accepted tokens; ``kept[k-1]`` holds stage
    k-1's outputs at positions ``done[k]..`` that were built on accepted tokens (what depth k still needs from
    before this round). A round runs depth k over positions ``done[k]..n-1``."""

    def __init__(self, hf: Any, D: int) -> None:
        from transformers import DynamicCache
        from transformers.masking_utils import create_causal_mask

        self.inner, self.head, self.config = hf.model, hf.get_output_embeddings(), hf.model.config
        self.layers = mtp.layers(hf)[:D]
        self.first = len(self.inner.layers) - mtp.depth(hf)  # depth k's cache layer: first + k - 1
        self.cache: Any = DynamicCache()  # layers made as updated
        self.cache_kw = _cache_kw(type(self.layers[0]).forward)
        if "layer_idx" not in inspect.signature(create_causal_mask).parameters:
            raise RuntimeError("speculative decoding with MTP needs transformers' create_causal_mask(layer_idx=...) "
                               "(transformers 5): this transformers sizes a mask by the cache's first layer only")
        self.mask = create_causal_mask
        self.done = [0] * (D + 1)  # done[k]: depth k's final cached positions (done[0] unused: the main's is n)
        self.kept: list[torch.Tensor | None] = [None] * D

    def absorb(self, hidden: torch.Tensor) -> None:
        """The main model's final hidden states at its newly accepted positions."""
        prev = self.kept[0]
        self.kept[0] = hidden if prev is None else torch.cat([prev, hidden], dim=1)

    def draft(self, ids: torch.Tensor, n: int) -> list[int]:
        """Depths 1..D at positions up to n-1 (``ids[n]``: the main model's next token), each proposing the token
        after the previous one's: writes ``ids[n+1..n+D]`` and returns them (one host read)."""
        device = ids.device
        below = self.kept[0]  # stage 0's outputs at positions done[1]..n-1 (all final)
        assert below is not None
        drafts = []
        for k, layer in enumerate(self.layers, 1):
            start = self.done[k]  # below[:, 0]'s position
            pos = torch.arange(start, n, device=device)[None]
            emb = self.inner.embed_tokens(ids[:, start + k:n + k])
            idx = self.first + k - 1
            mask = self.mask(config=self.config, inputs_embeds=emb,
                             attention_mask=torch.ones((1, n), dtype=torch.long, device=device),
                             cache=self.cache, position_ids=pos, layer_idx=idx)
            rope = self.inner.rotary_emb(emb, pos)
            h = layer(below, emb, attention_mask=mask, position_ids=pos, position_embeddings=rope,
                      use_cache=True, **{self.cache_kw: self.cache})  # normed: the head's and depth k+1's input
            token = self.head(h[:, -1]).float().argmax(-1)
            ids[0, n + k] = token[0]
            drafts.append(token)
            # depth k's position j is final once token j+k is (j <= n-k); the later ones were built on drafts
            final = max(start, n - k + 1)
            if n > final:
                self.cache.layers[idx].crop(-(n - final))
            # what depth k takes from stage k-1 next round: its final outputs from position `final` on
            end_below = n if k == 1 else self.done[k - 1]
            self.kept[k - 1] = below[:, final - start:end_below - start]
            if k < len(self.layers):  # depth k+1's input: depth k's outputs at done[k+1]..n-1
                prev = self.kept[k]
                below = h if prev is None else torch.cat([prev, h], dim=1)
            self.done[k] = final
        return torch.cat(drafts).tolist()
