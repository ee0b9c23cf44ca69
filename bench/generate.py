# python bench/generate.py [--new-tokens 128] [--prompt 32] [--repeats 3] [--threads N]        (prints, never asserts)
"""Tokens per second of ``shardyard.generation.generate`` with its KV cache and without it (the whole prefix
recomputed at every token, as the end-of-run sample did before issue 44), for ``model=deepseek_tiny`` (LLaMA
architecture, ~5M parameters, fp32) at batch 1 and 8: ``--new-tokens`` sampled tokens after a ``--prompt``-token
prompt (top-k 20, temperature 0.8, a fixed generator, no eos: every row runs to the end). The two runs of a pair
alternate so that machine noise hits both alike; the median of ``--repeats`` each, and their ratio. Both sample
the same tokens (checked here; tests/unit/test_generation.py checks it on every model family)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402


def run(model, ids, mask, new_tokens: int, kv_cache: bool) -> tuple[float, torch.Tensor]:
    from shardyard.generation import generate

    g = torch.Generator(device=ids.device).manual_seed(0)
    start = time.perf_counter()
    out, _ = generate(model, ids, mask, max_new_tokens=new_tokens, temperature=0.8, top_k=20, eos_id=None, pad_id=0,
                      generator=g, kv_cache=kv_cache)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    from shardyard.model import build_model
    from shardyard.testing import compose

    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default); on a shared machine 1 "
                   "measured steadier (two threads contending with other jobs made single-token steps ~8x slower)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
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


if __name__ == "__main__":
    main()
