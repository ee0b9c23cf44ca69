"""KV-cached batched generation (shardyard.models.generation): greedy output token for token equal to transformers'
``generate`` on left-padded prompts of different lengths (LLaMA, and DeepSeek-V3's MLA + MoE); the cache equal to
recomputing the whole prefix per token when sampling with a fixed generator; the top-k / top-p filter against a
brute-force reference; the mask and padding after eos and a stop check; lockstep's forward count; MoE routers
counting no load while generating."""

import itertools

import pytest
import torch

from shardyard.models import moe
from shardyard.models.generation import filter_logits, generate
from shardyard.models.build import build_model
from shardyard.testing import compose

PAD = 0
SMALL_LLAMA = ["model=deepseek_tiny", "model.hidden_size=64", "model.intermediate_size=176", "model.num_layers=2",
               "model.num_heads=4", "model.initializer_range=0.2"]
MODELS = {"llama": SMALL_LLAMA, "mla_moe": ["model=deepseek_moe_tiny"],
          "mla_moe_mtp": ["model=deepseek_moe_tiny", "model.mtp.depth=1"]}


def _model(name: str) -> torch.nn.Module:
    return build_model(compose(MODELS[name]).model, seed=0)


def _prompts(lengths: list[int], vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of these lengths (token ids 3.. so that none is the pad)."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), P), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


def _hf_greedy(model, ids, mask, n, eos):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, use_cache=True,
                         eos_token_id=eos, pad_token_id=PAD)[:, ids.size(1):]
    return torch.nn.functional.pad(out, (0, n - out.size(1)), value=PAD)  # HF stops once every row has


@pytest.mark.parametrize("name", ["llama", "mla_moe"])
def test_greedy_equals_transformers_generate_on_left_padded_prompts(name):
    model = _model(name)
    ids, mask = _prompts([5, 9, 2, 7], model.config.vocab_size)
    n = 12
    free, free_mask = generate(model, ids, mask, max_new_tokens=n, temperature=0.0, eos_id=None, pad_id=PAD)
    assert free_mask.all()
    assert torch.equal(free, _hf_greedy(model, ids, mask, n, eos=None))
    # An eos that row 1 produces at step 4 for the first time: that row ends there, the others may too.
    eos = int(free[1, 4])
    assert eos not in free[1, :4].tolist()
    got, got_mask = generate(model, ids, mask, max_new_tokens=n, temperature=0.0, eos_id=eos, pad_id=PAD)
    assert torch.equal(got, _hf_greedy(model, ids, mask, n, eos=eos))
    assert got_mask[1].tolist() == [1] * 5 + [0] * (n - 5)


@pytest.mark.parametrize("name", ["llama", "mla_moe", "mla_moe_mtp"])
def test_kv_cache_samples_what_recomputing_the_prefix_samples(name):
    model = _model(name)
    ids, mask = _prompts([3, 8, 6], model.config.vocab_size, seed=2)
    runs = []
    for kv_cache in (True, False):
        g = torch.Generator().manual_seed(7)
        runs.append(generate(model, ids, mask, max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95,
                             eos_id=None, pad_id=PAD, generator=g, kv_cache=kv_cache))
    (cached, _), (recomputed, _) = runs
    assert torch.equal(cached, recomputed)
    assert len(set(cached.flatten().tolist())) > 10  # sampled, not one repeated token
    g = torch.Generator().manual_seed(8)  # another seed, other tokens: the generator is what decides
    other, _ = generate(model, ids, mask, max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95, eos_id=None,
                        pad_id=PAD, generator=g)
    assert not torch.equal(other, cached)


def _brute_force(probs: list[float], k: int, p: float) -> set[int]:
    """The tokens kept: those with fewer than k strictly more probable ones, then of those (renormalised) the
    subset of fewest tokens whose mass is >= p (the most massive among the fewest)."""
    V = len(probs)
    kept = [i for i in range(V) if k == 0 or sum(q > probs[i] for q in probs) < k]
    total = sum(probs[i] for i in kept)
    best: tuple | None = None
    for size in range(1, len(kept) + 1):
        for subset in itertools.combinations(kept, size):
            mass = sum(probs[i] for i in subset) / total
            if mass >= p - 1e-12 and (best is None or mass > best[0]):
                best = (mass, subset)
        if best is not None:
            return set(best[1])
    raise AssertionError("unreachable")


@pytest.mark.parametrize("probs", [[0.05, 0.3, 0.1, 0.25, 0.2, 0.1], [0.5, 0.2, 0.2, 0.04, 0.03, 0.03],
                                   [0.9, 0.02, 0.03, 0.01, 0.015, 0.025]])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("p", [1.0, 0.96, 0.62, 0.45, 0.33, 0.01])
def test_top_k_top_p_keep_what_a_brute_force_keeps(probs, k, p):
    scores = torch.tensor(probs, dtype=torch.float64).log()[None].repeat(2, 1)
    out = filter_logits(scores, top_k=k, top_p=p)
    for row in out:
        assert {i for i in range(len(probs)) if row[i] > float("-inf")} == _brute_force(probs, k, p)
        assert torch.equal(row[row > float("-inf")], scores[0][row > float("-inf")])  # kept logits unchanged


def test_eos_and_stop_end_a_row_with_pad_after():
    model = _model("llama")
    ids, mask = _prompts([4, 6, 3], model.config.vocab_size, seed=3)
    n = 10
    free, _ = generate(model, ids, mask, max_new_tokens=n, temperature=0.0, eos_id=None, pad_id=PAD)
    eos = int(free[0, 2])
    assert eos not in free[0, :2].tolist()
    ends = [next((t for t in range(n) if int(free[r, t]) == eos), None) for r in range(3)]

    def stop(so_far):  # row 2 ends with its 6th token, as a stop string would end it
        return torch.tensor([False, False, so_far.size(1) == 6])

    got, got_mask = generate(model, ids, mask, max_new_tokens=n, temperature=0.0, eos_id=eos, pad_id=PAD, stop=stop)
    for r, end in enumerate(ends):
        end = min(end if end is not None else n - 1, 5 if r == 2 else n - 1)
        assert got_mask[r].tolist() == [1] * (end + 1) + [0] * (n - end - 1)
        assert torch.equal(got[r, :end + 1], free[r, :end + 1])  # the tokens up to and including the end
        assert (got[r, end + 1:] == PAD).all()


def test_lockstep_runs_max_new_tokens_forwards_and_early_exit_fewer():
    model = _model("llama")
    ids, mask = _prompts([4, 6], model.config.vocab_size, seed=4)
    n = 10
    free, _ = generate(model, ids, mask, max_new_tokens=n, temperature=0.0, eos_id=None, pad_id=PAD)
    eos = int(free[1, 1])  # row 1 ends by step 1; every row ends by step 4 (the stop check)

    def stop(so_far):
        return torch.full((so_far.size(0),), so_far.size(1) >= 5)

    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        results = {}
        for lockstep in (True, False):
            calls.clear()
            results[lockstep] = generate(model, ids, mask, max_new_tokens=n, temperature=0.0, eos_id=eos,
                                         pad_id=PAD, lockstep=lockstep, stop=stop), len(calls)
    finally:
        handle.remove()
    (ids_l, mask_l), forwards_l = results[True]
    (ids_f, mask_f), forwards_f = results[False]
    assert forwards_l == n  # every rank of a sharded engine joins the same number of forwards
    assert forwards_f == 5  # the prefill and 4 steps: the last row ended with the 5th token
    assert torch.equal(ids_l, ids_f) and torch.equal(mask_l, mask_f)
    assert mask_f[:, 5:].sum() == 0 and (ids_f[:, 5:] == PAD).all()


def test_moe_routers_count_no_generated_token():
    cfg = compose(MODELS["mla_moe"])
    model = build_model(cfg.model, seed=0)
    model.train()  # as a training loop leaves it
    balancer = moe.Balancer.install(model, cfg.model.balance, experts=cfg.model.n_routed_experts)
    ids, mask = _prompts([4, 6], model.config.vocab_size)
    generate(model, ids, mask, max_new_tokens=4, temperature=1.0, eos_id=None, pad_id=PAD,
             generator=torch.Generator().manual_seed(0))
    assert model.training  # the mode is restored
    assert balancer.counts.sum().item() == 0 and not balancer.pending
    model(ids)  # a training forward (train mode, gradients on) counts: the zero above is generation's doing
    assert balancer.counts.sum().item() > 0
    balancer.close()


class _IdsOnly(torch.nn.Module):
    """A model whose forward takes the token ids alone (a user's ``CausalLM``, a pipeline's whole-model forward)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return self.inner(input_ids).logits


def test_a_forward_of_ids_alone_generates_without_a_cache_and_refuses_padding():
    model = _model("llama")
    ids, mask = _prompts([5, 5], model.config.vocab_size, seed=5)
    want, _ = generate(model, ids, mask, max_new_tokens=6, temperature=0.0, eos_id=None, pad_id=PAD)
    got, _ = generate(_IdsOnly(model), ids, mask, max_new_tokens=6, temperature=0.0, eos_id=None, pad_id=PAD)
    assert torch.equal(got, want)
    ids, mask = _prompts([5, 3], model.config.vocab_size, seed=5)
    with pytest.raises(ValueError, match="cannot mask left padding"):
        generate(_IdsOnly(model), ids, mask, max_new_tokens=6, temperature=0.0, eos_id=None, pad_id=PAD)
