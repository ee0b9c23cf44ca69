# python bench/generate.py [--new-tokens 128] [--prompt 32] [--repeats 3] [--threads N]
#     [--spec-steps 150] [--spec-layers 6] [--random-share 0.17] [--weights DIR] [--no-spec]  (prints, never asserts)
"""Tokens per second of ``shardyard.models.generation.generate`` with its KV cache and without it (the whole prefix
recomputed at every token, as the end-of-run sample did before issue 44), for ``model=deepseek_tiny`` (LLaMA
architecture, ~5M parameters, fp32) at batch 1 and 8: ``--new-tokens`` sampled tokens after a ``--prompt``-token
prompt (top-k 20, temperature 0.8, a fixed generator, no eos: every row runs to the end). The two runs of a pair
alternate so that machine noise hits both alike; the median of ``--repeats`` each, and their ratio. Both sample
the same tokens (checked here; tests/unit/test_generation.py checks it on every model family).

Then MTP speculative decoding (``shardyard.inference.speculative``, issue 45): greedy tokens/s of one prompt at a time, plain
(KV cache) against speculation drafting with MTP depth 1 and with depths 1-2, their acceptance rate, tokens per main
forward and speed-up, and whether both gave the same tokens. The model is ``model=deepseek_moe_tiny
model.mtp.depth=2 model.vocab_size=512 model.num_layers=6`` (MLA + MoE, fp32; ``--spec-layers``: a depth costs
about one main layer, a far bigger share of a round's work than DeepSeek-V3's one depth beside 61 layers), trained
here for ``--spec-steps`` AdamW steps on a synthetic text whose next token is a fixed function of the current one,
except after the top ``--random-share`` of the vocabulary, where it is random: the acceptance rate (and so the
speed-up) depends on how predictable the text is, and this one is mostly predictable. ``--weights DIR`` measures a
trained model instead (a run dir, checkpoint or HF export with MTP depths, ``shardyard.inference.load``) on random
prompts from its vocabulary."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402


def run(model, ids, mask, new_tokens: int, kv_cache: bool) -> tuple[float, torch.Tensor]:
    from shardyard.models.generation import generate

    g = torch.Generator(device=ids.device).manual_seed(0)
    start = time.perf_counter()
    out, _ = generate(model, ids, mask, max_new_tokens=new_tokens, temperature=0.8, top_k=20, eos_id=None, pad_id=0,
                      generator=g, kv_cache=kv_cache)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    from shardyard.models.build import build_model
    from shardyard.testing import compose

    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default); on a shared machine 1 "
                   "measured steadier (two threads contending with other jobs made single-token steps ~8x slower)")
    p.add_argument("--no-spec", action="store_true", help="skip the MTP speculative decoding rows")
    p.add_argument("--spec-steps", type=int, default=150, help="training steps of the MTP model (speculation rows)")
    p.add_argument("--spec-layers", type=int, default=6, help="main layers of the speculation model (each MTP depth "
                   "costs about one: DeepSeek-V3 has 61 and one depth)")
    p.add_argument("--random-share", type=float, default=1 / 6, help="share of the vocabulary followed by a random "
                   "token in the speculation model's training text (the rest: a fixed next token)")
    p.add_argument("--weights", default=None, help="speculate with this trained model instead (run dir, checkpoint "
                   "or HF export with MTP depths)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if not a.no_spec:
        speculation(a, device)
    cfg = compose(["model=deepseek_tiny"])
    model = build_model(cfg.model, seed=0).to(device)
    params = sum(t.numel() for t in model.parameters())
    print(f"model=deepseek_tiny ({params / 1e6:.1f}M parameters, fp32) on {device} "
          f"({torch.get_num_threads()} threads): {a.prompt}-token prompts, {a.new_tokens} new tokens, "
          f"median of {a.repeats}")
    print(f"{'batch':>5} {'KV cache tok/s':>15} {'recompute tok/s':>16} {'cache/recompute':>16}")
    for batch in (1, 8):
        ids = torch.randint(3, cfg.model.vocab_size, (batch, a.prompt), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        mask = torch.ones_like(ids)
        run(model, ids, mask, 4, True)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for _ in range(a.repeats):
            for kv_cache in (True, False):
                t, outs[kv_cache] = run(model, ids, mask, a.new_tokens, kv_cache)
                times[kv_cache].append(t)
        same = torch.equal(outs[True], outs[False])
        tokens = batch * a.new_tokens
        cached, recomputed = tokens / statistics.median(times[True]), tokens / statistics.median(times[False])
        print(f"{batch:>5} {cached:>15.0f} {recomputed:>16.0f} {cached / recomputed:>16.2f}"
              f"{'' if same else '   (the two sampled different tokens!)'}")


def chains(vocab: int, random_share: float, rows: int, length: int, perm: torch.Tensor,
           g: torch.Generator) -> torch.Tensor:
    """Token rows where token ``x`` is followed by ``perm[x]``, except the top ``random_share`` of the vocabulary,
    followed by a random token."""
    fixed = vocab - int(vocab * random_share)
    x = torch.empty(rows, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for i in range(1, length):
        x[:, i] = torch.where(x[:, i - 1] < fixed, perm[x[:, i - 1]], torch.randint(0, vocab, (rows,), generator=g))
    return x


def speculation(a: argparse.Namespace, device: torch.device) -> None:
    from shardyard.models import mtp
    from shardyard.models.generation import generate
    from shardyard.inference.speculative import SpecStats, available, generate_mtp

    g = torch.Generator().manual_seed(0)
    if a.weights:
        from shardyard.inference.loading import load

        model = load(a.weights, device=device).model
        if not available(model):
            print(f"{a.weights}: no MTP depths, no speculation rows")
            return
        vocab = model.config.vocab_size
        prompts = torch.randint(0, vocab, (4, a.prompt), generator=g)
        what = f"{a.weights}"
    else:
        from shardyard.models.build import build_model
        from shardyard.models.loss import causal_lm_loss_sum
        from shardyard.testing import compose

        cfg = compose(["model=deepseek_moe_tiny", "model.mtp.depth=2", "model.vocab_size=512",
                       f"model.num_layers={a.spec_layers}"])
        vocab = cfg.model.vocab_size
        what = f"model=deepseek_moe_tiny model.mtp.depth=2 model.vocab_size=512 model.num_layers={a.spec_layers}"
        model = build_model(cfg.model, seed=0).to(device)
        perm = torch.randperm(vocab, generator=g)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        start = time.perf_counter()
        for _ in range(a.spec_steps):
            x = chains(vocab, a.random_share, 16, 64, perm, g).to(device)
            sums = causal_lm_loss_sum(model, x[:, :-1], x[:, 1:])
            (sums.sum() / x[:, 1:].numel()).backward()
            opt.step()
            opt.zero_grad()
        losses = ", ".join(f"{v:.2f}" for v in (sums / x[:, 1:].numel()).tolist())
        print(f"\nspeculation model: {what}, {a.spec_steps} steps in "
              f"{time.perf_counter() - start:.0f} s on chains with {a.random_share:.0%} of the vocabulary followed by "
              f"a random token; last losses (main, depth 1, depth 2): {losses}")
        prompts = chains(vocab, a.random_share, 4, a.prompt, perm, g)
    model.eval()
    prompts = prompts.to(device)
    depth = mtp.depth(model)
    print(f"{what} on {device} ({torch.get_num_threads()} threads): greedy, {len(prompts)} prompts of {a.prompt} "
          f"tokens one at a time, {a.new_tokens} new tokens each, median of {a.repeats}")

    def plain(ids: torch.Tensor) -> torch.Tensor:
        out, _ = generate(model, ids, torch.ones_like(ids), max_new_tokens=a.new_tokens, temperature=0, eos_id=None,
                          pad_id=0)
        return out[0]

    def timed(fn) -> tuple[float, list]:
        start = time.perf_counter()
        outs = [fn(prompts[i:i + 1]) for i in range(len(prompts))]
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, outs

    runs = {"plain": plain}
    for d in range(1, depth + 1):
        runs[f"mtp depth 1-{d}" if d > 1 else "mtp depth 1"] = \
            (lambda d: lambda ids: generate_mtp(model, ids, max_new_tokens=a.new_tokens, eos_id=None, depths=d))(d)
    timed(lambda ids: plain(ids[:, :4]))  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runs}
    outs: dict[str, list] = {}
    for _ in range(a.repeats):
        for name, fn in runs.items():
            t, outs[name] = timed(fn)
            times[name].append(t)
    tokens = len(prompts) * a.new_tokens
    base = tokens / statistics.median(times["plain"])
    print(f"{'decoding':>14} {'tok/s':>8} {'speed-up':>9} {'accepted':>9} {'tok/forward':>12}  same tokens")
    print(f"{'plain greedy':>14} {base:>8.0f} {1:>9.2f} {'':>9} {1:>12.2f}")
    for name in list(runs)[1:]:
        stats = SpecStats()
        for _, s in outs[name]:
            stats = stats.add(s)
        same = all(torch.equal(t, p) for (t, _), p in zip(outs[name], outs["plain"]))
        rate = tokens / statistics.median(times[name])
        per_depth = "/".join(f"{x / max(y, 1):.0%}" for x, y in zip(stats.accepted_at, stats.drafted_at))
        print(f"{name:>14} {rate:>8.0f} {rate / base:>9.2f} {stats.acceptance_rate:>9.0%} "
              f"{stats.tokens_per_forward:>12.2f}  {same}   (accepted per depth: {per_depth})")


if __name__ == "__main__":
    main()
