# python bench/moe.py [--tokens 4096] [--repeats 7]        (CPU, gloo; prints, never asserts)
"""The MoE layer's throughput against a dense MLP with the same active parameters, and expert parallelism's
all-to-all share of the layer's step at ep 2.

1. One DeepseekV3 MoE layer (hidden 512, 16 routed experts of width 256, top 2, 1 shared expert) against one
   dense SwiGLU MLP of width (2 + 1) x 256: the same parameters touched per token. Forward and backward of
   ``--tokens`` tokens, alternating the two (dense, moe, dense, moe, ...) so that machine noise hits both alike;
   the median of ``--repeats`` each. The experts run as transformers runs them (its ``experts_implementation``:
   grouped matmuls where torch has them), printed beside the figure. Goal on the 2-core CPU: moe/dense >= 0.6.
2. The same layer on 2 gloo ranks with ``backend.ep=2``'s forward (``shardyard.backends.expert_parallel``): each
   rank holds 8 experts and sends the other its tokens' rows; the time inside ``all_to_all_single`` (the
   dispatch, the combine and their backward) as a share of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

HIDDEN, WIDTH, EXPERTS, TOP_K = 512, 256, 16, 2


def moe_layer():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, n_routed_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=1, topk_group=1)
    # What a whole model's from_config picks on this torch (a standalone layer gets no choice: the Python loop).
    cfg._experts_implementation = cfg._experts_implementation_internal = "grouped_mm"
    torch.manual_seed(0)
    layer = DeepseekV3MoE(cfg)
    for name, p in layer.named_parameters():  # transformers leaves the experts' [E, ...] tensors uninitialised
        torch.nn.init.normal_(p, std=0.02)
    return layer, cfg


def dense_layer():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    torch.manual_seed(0)
    return DeepseekV3MLP(DeepseekV3Config(hidden_size=HIDDEN), intermediate_size=(TOP_K + 1) * WIDTH)


def step_s(layer, x) -> float:
    t = time.perf_counter()
    layer(x).float().pow(2).mean().backward()
    return time.perf_counter() - t


def compare(tokens: int, repeats: int) -> None:
    moe, cfg = moe_layer()
    dense = dense_layer()
    x = torch.randn(1, tokens, HIDDEN, requires_grad=True)
    for layer in (dense, moe):  # warm-up
        step_s(layer, x)
    times: dict[str, list[float]] = {"dense": [], "moe": []}
    for _ in range(repeats):
        times["dense"].append(step_s(dense, x))
        times["moe"].append(step_s(moe, x))
    d, m = (statistics.median(times[k]) for k in ("dense", "moe"))
    active = sum(p.numel() for p in dense.parameters())
    impl = getattr(cfg, "_experts_implementation_internal", None) or getattr(cfg, "_experts_implementation", "?")
    print(f"[1] {tokens} tokens, forward+backward, median of {repeats}, {torch.get_num_threads()} threads; "
          f"{active:,} active parameters per token in both (the router's {EXPERTS * HIDDEN:,} besides)")
    print(f"    dense MLP  {tokens / d:10,.0f} tokens/s")
    print(f"    MoE layer  {tokens / m:10,.0f} tokens/s  (experts_implementation={impl})")
    print(f"    moe/dense  {d / m:.2f}   (goal >= 0.6)")


def _ep_rank(rank: int, port: int, tokens: int, repeats: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardyard.backends import expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on the 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    layer, _ = moe_layer()
    expert_parallel.shard_experts(layer, mesh)
    spent = [0.0]
    original = dist.all_to_all_single

    def timed(*args, **kwargs):
        t = time.perf_counter()
        result = original(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return result

    dist.all_to_all_single = timed  # the dispatch and combine, forward and backward, all go through it
    torch.manual_seed(1 + rank)
    x = torch.randn(1, tokens // 2, HIDDEN, requires_grad=True)  # each rank its half of the tokens
    step_s(layer, x)
    steps, shares = [], []
    for _ in range(repeats):
        spent[0] = 0.0
        dist.barrier()
        s = step_s(layer, x)
        steps.append(s)
        shares.append(spent[0] / s)
    dist.destroy_process_group()
    if rank == 0:
        out.put((statistics.median(steps), statistics.median(shares)))


def expert_parallel_share(tokens: int, repeats: int) -> None:
    import torch.multiprocessing as mp

    from shardyard.launching.launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ep_rank, args=(r, port, tokens, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    step, share = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"[2] ep 2 on 2 gloo ranks (1 thread each), {tokens // 2} tokens per rank: step {1e3 * step:.1f} ms, "
          f"all-to-all {100 * share:.0f}% of it (median of {repeats})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    compare(a.tokens, a.repeats)
    expert_parallel_share(a.tokens, a.repeats)


if __name__ == "__main__":
    main()
