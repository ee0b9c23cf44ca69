# python bench/moe_grouped_mm.py [--rows 4096] [--repeats 15]        (CPU; prints, never asserts)
"""What expert parallelism's choice of GEMM costs on this machine (issue 41, ``expert_parallel.fused_grouped_mm``).

Without a fused kernel that reads its group offsets on the device (CUDA: bf16 on SM90/SM100), the experts loop over
their groups on the sizes the host already holds; torch's own fallback does the same loop but first copies the
offsets to the host, a sync per call on a GPU. On CPU fp32 takes that loop (a dry run's fake tensors need it) and
bf16 torch's grouped GEMM. This times, forward + backward of both projections of one rank's experts (the shapes of
``bench/moe.py``'s ep-2 layer: 8 local experts, hidden 512, width 256), the loop against torch's grouped GEMM,
alternating the two so that machine noise hits both alike; the median of ``--repeats`` each, as a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

HIDDEN, WIDTH, LOCAL = 512, 256, 8


def step_s(gemm, x, w_gu, w_d, offs, sizes) -> float:
    start = time.perf_counter()
    gate, up = gemm(x, w_gu, offs, sizes).chunk(2, dim=-1)
    y = gemm(torch.nn.functional.silu(gate) * up, w_d, offs, sizes)
    y.backward(torch.ones_like(y))  # a dense gradient, as the all-to-all's backward brings
    return time.perf_counter() - start


def main() -> None:
    from shardyard.backends import expert_parallel as ep

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    if ep._GROUPED_MM is None:
        print("this torch has no grouped GEMM: only the loop exists")
        return
    fused = ep._GROUPED_MM

    def grouped(x, w, offs, sizes):
        return fused(x, w, offs=offs)

    def loop(x, w, offs, sizes):  # what expert_parallel.grouped_mm runs where fused_grouped_mm says no
        with _forced(ep, False):
            return ep.grouped_mm(x, w, offs, sizes)

    torch.manual_seed(0)
    sizes = torch.distributions.Dirichlet(torch.ones(LOCAL)).sample() * a.rows  # uneven groups, as routing makes
    counts = sizes.floor().long()
    counts[-1] += a.rows - counts.sum()
    sizes = counts.tolist()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    print(f"{a.rows} rows over {LOCAL} experts ({counts.tolist()}), hidden {HIDDEN}, width {WIDTH}; forward + backward"
          f" of both projections, median of {a.repeats}, {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(a.rows, HIDDEN, dtype=dtype, requires_grad=True)
        w_gu = (torch.randn(LOCAL, HIDDEN, 2 * WIDTH, dtype=dtype) / HIDDEN ** 0.5).requires_grad_()
        w_d = (torch.randn(LOCAL, WIDTH, HIDDEN, dtype=dtype) / WIDTH ** 0.5).requires_grad_()
        times: dict[str, list[float]] = {"grouped": [], "loop": []}
        for i in range(a.repeats + 2):  # two warm-up rounds
            for name, gemm in (("grouped", grouped), ("loop", loop)):
                t = step_s(gemm, x, w_gu, w_d, offs, sizes)
                if i >= 2:
                    times[name].append(t)
        g, lp = statistics.median(times["grouped"]), statistics.median(times["loop"])
        chosen = "grouped" if ep.fused_grouped_mm(w_gu) else "loop"
        print(f"    {str(dtype).split('.')[-1]:9s} grouped {g * 1e3:7.1f} ms   loop {lp * 1e3:7.1f} ms   "
              f"loop/grouped {lp / g:.2f}   (shardyard takes: {chosen})")


class _forced:
    """``expert_parallel.fused_grouped_mm`` answering ``value`` inside."""

    def __init__(self, module, value: bool):
        self.module, self.value = module, value

    def __enter__(self):
        self.saved = self.module.fused_grouped_mm
        self.module.fused_grouped_mm = lambda w: self.value

    def __exit__(self, *exc):
        self.module.fused_grouped_mm = self.saved


if __name__ == "__main__":
    main()
