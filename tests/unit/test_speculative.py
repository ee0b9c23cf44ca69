"""MTP speculative decoding (shardyard.inference.speculative, issue 45): the output equals plain greedy decoding
(``generation.generate`` at temperature 0) token for token, with eos and a stop check inside, on tiny DeepSeek-V3
models with 1 and 2 MTP depths, random (drafts rejected) and briefly trained (drafts mostly accepted, some
rounds only partly); the counts equal a brute-force replay that recomputes every draft without a cache
(``mtp.run_depths`` over the whole sequence, the training forward's) and verifies it against the plain greedy
tokens; a model without MTP."""

import contextlib
import io

import pytest
import torch
from omegaconf import OmegaConf
from transformers.masking_utils import create_causal_mask

from conftest import Whole

from shardyard.models import mtp
from shardyard.inference import speculative
from shardyard.models.generation import generate
from shardyard.models.build import build_model
from shardyard.models.loss import causal_lm_loss_sum
from shardyard.inference.speculative import available, generate_mtp

V = 96
SHAPE = dict(_target_="shardyard.models.build.deepseek_v3", name="spec_test", vocab_size=V, hidden_size=64,
             intermediate_size=128, num_layers=2, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
             moe_intermediate_size=32, first_k_dense_replace=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One CPU thread: these are tiny forwards, which two threads on a shared machine slow down."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


def _tiny(depth: int, seed: int = 0):
    keys = dict(SHAPE)
    if depth:
        keys["mtp"] = dict(depth=depth, weight=0.3, final_weight=None, final_weight_from_step=None)
    return build_model(OmegaConf.create(keys), seed).eval()


@pytest.fixture(scope="module")
def trained():
    """Depth 2, trained 30 steps on chains ``x[i+1] = perm[x[i]]`` where a token below V-16 fixes the next one and
    the others are followed by a random token: the depths learn the chain (drafts accepted) and cannot guess past
    a random token (rejected)."""
    torch.manual_seed(0)
    model = _tiny(2).train()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(V, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(30):
        x = torch.empty(16, 32, dtype=torch.long)
        x[:, 0] = torch.randint(0, V, (16,), generator=g)
        for i in range(1, 32):
            x[:, i] = torch.where(x[:, i - 1] < V - 16, perm[x[:, i - 1]], torch.randint(0, V, (16,), generator=g))
        sums = causal_lm_loss_sum(model, x[:, :-1], x[:, 1:])
        (sums.sum() / x[:, 1:].numel()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, prompt, n: int, eos: int | None, stop=None) -> list[int]:
    """Plain KV-cached greedy decoding's completion, up to and including its end."""
    ids, mask = generate(model, prompt, torch.ones_like(prompt), max_new_tokens=n, temperature=0, eos_id=eos,
                         pad_id=0, stop=stop)
    return ids[0][mask[0].bool()].tolist()


def _drafts(model, seq: list[int], D: int) -> list[int]:
    """The drafts after ``seq`` (``x_0..x_n``: the accepted tokens and the main model's next one), without any
    cache: the main model and ``mtp.run_depths`` (the training forward's depths) over the whole sequence, depth
    j+1's argmax at position n-1 appended before depth j+2 runs."""
    inner, toks, n = model.model, list(seq), len(seq) - 1
    with torch.no_grad():
        for j in range(D):
            ids = torch.tensor([toks])
            pos = torch.arange(ids.size(1))[None]
            emb = inner.embed_tokens(ids)
            mask = create_causal_mask(config=inner.config, inputs_embeds=emb, attention_mask=None, cache=None,
                                      position_ids=pos)
            normed = mtp.run_depths(model, inner(input_ids=ids).last_hidden_state, emb, attention_mask=mask,
                                    position_embeddings=inner.rotary_emb(emb, pos), position_ids=pos)
            toks.append(int(model.lm_head(normed[j][0, n - 1]).argmax()))
    return toks[n + 1:]


def _replay(model, prompt, N: int, eos: int | None, D: int, stop=None) -> tuple[list[int], dict]:
    """Speculation replayed by brute force: each round's drafts from ``_drafts``, accepted while they equal the
    plain greedy tokens at their places, then the greedy token after them. The tokens and the counts."""
    g = _greedy(model, prompt, N, None)
    p = prompt[0].tolist()
    out, counts = [g[0]], dict(drafted=0, accepted=0, forwards=1, accepted_at=[0] * D, drafts=[])

    def ended() -> bool:
        return (len(out) >= N or out[-1] == eos
                or (stop is not None and bool(stop(torch.tensor([out]))[0])))

    while not ended():
        drafts = _drafts(model, p + out, D)
        counts["drafts"].append(drafts)
        d = min(D, N - len(out) - 1)
        m = 0
        while m < d and drafts[m] == g[len(out) + m]:
            counts["accepted_at"][m] += 1
            m += 1
        counts["drafted"] += d
        counts["accepted"] += m
        counts["forwards"] += 1
        for token in g[len(out):len(out) + m + 1]:
            out.append(token)
            if ended():
                break
    return out, counts


def _check(monkeypatch, model, prompt, N: int, eos: int | None, D: int | None = None, stop=None):
    """Speculation's tokens against plain greedy decoding's, and its drafts (each round's, read as the drafter
    returns them) and counts against ``_replay``'s."""
    depth = D or mtp.depth(model)
    drafted: list[list[int]] = []
    real = speculative._Drafter.draft

    def draft(self, ids, n):
        drafted.append(real(self, ids, n))
        return drafted[-1]

    monkeypatch.setattr(speculative._Drafter, "draft", draft)
    out, stats = generate_mtp(model, prompt, max_new_tokens=N, eos_id=eos, stop=stop, depths=D)
    monkeypatch.undo()
    assert out.tolist() == _greedy(model, prompt, N, eos, stop)
    tokens, counts = _replay(model, prompt, N, eos, depth, stop)
    assert out.tolist() == tokens
    assert drafted == counts["drafts"]
    assert (stats.drafted, stats.accepted, stats.forwards, stats.accepted_at) == \
        (counts["drafted"], counts["accepted"], counts["forwards"], counts["accepted_at"])
    assert stats.tokens == len(tokens)
    return stats


@pytest.mark.parametrize("depth", [1, 2])
def test_random_init_equals_greedy(monkeypatch, depth):
    model = _tiny(depth, seed=depth)
    for i, n in enumerate([1, 4, 9]):
        prompt = _prompt(n, seed=10 * depth + i)
        eos = _greedy(model, prompt, 12, None)[7] if i == 1 else None  # eos inside: its first place
        stats = _check(monkeypatch, model, prompt, 12, eos)
        assert stats.forwards == stats.tokens - stats.accepted  # a round adds its accepted drafts + one token
    for n in (1, 2):  # the prompt's forward alone; one round with no draft to verify
        assert _check(monkeypatch, model, _prompt(3, seed=7), n, None).drafted == 0


def test_drafts_chain_the_depths_as_training_does(monkeypatch):
    """Depth 2 drafts from depth 1's output after its ``shared_head.norm``, as ``mtp.run_depths`` (and Megatron-Core)
    chain them: with norm weights far from 1 and a sharp head, drafting from depth 1's output before that norm
    gives other drafts than ``_replay``'s (issue 53)."""
    model = _tiny(2, seed=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        for layer in mtp.layers(model):
            norm = layer.shared_head.norm.weight
            norm.copy_(torch.rand(norm.shape, generator=g) * 2.8 + 0.2)
    for i, n in enumerate([2, 6]):
        _check(monkeypatch, model, _prompt(n, seed=40 + i), 12, None)


def test_trained_drafts_accepted_and_rejected(monkeypatch, trained):
    total = None
    for i in range(4):
        prompt = _prompt(3 + 2 * i, seed=i)
        eos = _greedy(trained, prompt, 24, None)[13] if i % 2 else None
        stats = _check(monkeypatch, trained, prompt, 24, eos)
        total = stats if total is None else total.add(stats)
    assert 0 < total.accepted < total.drafted
    assert total.accepted_at[1] < total.accepted_at[0]  # some rounds accepted depth 1's draft, not depth 2's
    assert total.acceptance_rate > 0.5
    assert total.tokens_per_forward > 1.5
    stats = _check(monkeypatch, trained, _prompt(5, seed=9), 24, None, D=1)  # drafting with depth 1 alone
    assert stats.drafted_at == [stats.drafted] and stats.accepted > 0


def test_stop_check(monkeypatch, trained):
    prompt = _prompt(4, seed=3)
    g = _greedy(trained, prompt, 24, None)
    pair = g[10:12]  # ends on the first place these two tokens follow each other

    def stop(ids):
        return torch.tensor([ids.size(1) >= 2 and ids[0, -2:].tolist() == pair])

    _check(monkeypatch, trained, prompt, 24, None, stop=stop)
    assert len(generate_mtp(trained, prompt, max_new_tokens=24, eos_id=None, stop=stop)[0]) <= 12


def test_without_mtp():
    plain = _tiny(0)
    assert not available(plain) and available(_tiny(1))
    with pytest.raises(ValueError, match="no MTP depths"):
        generate_mtp(plain, _prompt(3, 0), max_new_tokens=4, eos_id=None)




def test_from_an_export(tmp_path, trained):
    """``inference.load`` of the HF export (DeepSeek's layout, the depth under ``model.layers.2``) keeps the depth:
    the same tokens and the same drafts accepted as the model that was exported."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from shardyard.training import export
    from shardyard.inference import loading as inference

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(tmp_path / "tok"))
    export.save_hf(Whole(trained), str(tmp_path / "tok"), str(tmp_path / "hf"))
    loaded = inference.load(str(tmp_path / "hf")).model
    assert available(loaded)
    prompt = _prompt(6, seed=5)
    out, stats = generate_mtp(loaded, prompt, max_new_tokens=24, eos_id=None)
    want, want_stats = generate_mtp(trained, prompt, max_new_tokens=24, eos_id=None)
    assert out.tolist() == want.tolist() and stats == want_stats and stats.accepted > 0
    # The command on that export: acceptance, tokens per forward, tokens/s; compare=true checks the tokens against
    # plain greedy decoding and prints the measured speed-up. The counts are generate_mtp's own on that prompt.
    import re

    from shardyard.inference import generate as command

    text = " ".join(f"t{i}" for i in prompt[0].tolist())
    tok = inference.load(str(tmp_path / "hf")).tokenizer
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    _, want_stats = generate_mtp(loaded, ids, max_new_tokens=24, eos_id=command.eos_ids(tok, loaded))
    out = tmp_path / "rows.jsonl"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        command.main([str(tmp_path / "hf"), f"prompt={text}", "speculative=mtp", "compare=true", "max_new_tokens=24",
                      "device=cpu", f"out={out}"])
    line = next(ln for ln in err.getvalue().splitlines() if "speculative=mtp" in ln)
    assert f"{want_stats.accepted}/{want_stats.drafted} drafted tokens accepted" in line, line
    assert f"({want_stats.tokens_per_forward:.2f} tokens per forward)" in line, line
    assert re.search(r"tokens/s; plain greedy decoding: the same tokens, [0-9.]+ tokens/s: speed-up [0-9.]+x", line)
