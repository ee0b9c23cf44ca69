"""engine=deepspeed on CPU (shardyard.inference.ds_inference): DeepSpeed's AutoTP at tp 2 over gloo generates, greedily and
KV-cached through ``generation.generate``, the tokens transformers' own ``generate`` gives on the whole model, for
LLaMA with grouped-query attention and DeepSeek-V3 (MLA + MoE), each rank holding half of every split layer. The
whole command (``shardyard generate ... engine=deepspeed tp_size=2``) is tests/dist/test_generate_checkpoints.py's."""

import time

import pytest
import torch

from shardyard.core.errors import UserError

PAD = 0
N_NEW = 10
MODELS = {"llama_gqa": dict(builder="llama", vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2,
                             num_heads=4, num_kv_heads=2, initializer_range=0.2),
          "mla_moe": dict(builder="deepseek_v3", vocab_size=512, hidden_size=192, intermediate_size=512, num_layers=3,
                          num_heads=6, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                          n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
                          first_k_dense_replace=1)}
"""The unit tests' tiny shapes (tests/unit/test_generation.py: deepseek_tiny narrowed, deepseek_moe_tiny), built
by shardyard's own builders without composing a config; the LLaMA one with 2 key/value heads for 4 query heads."""


def _model(name: str) -> torch.nn.Module:
    from shardyard.models import build as model

    dims = dict(MODELS[name])
    torch.manual_seed(0)  # the same weights in every process
    return getattr(model, dims.pop("builder"))(**dims).eval()


def _prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 6, 3 and 8 tokens (ids 3.., none the pad)."""
    g = torch.Generator().manual_seed(1)
    lengths = [6, 3, 8]
    ids = torch.full((3, 8), PAD, dtype=torch.long)
    mask = torch.zeros((3, 8), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 8 - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, 8 - n:] = 1
    return ids, mask


def _reference(name: str, device: str = "cpu") -> torch.Tensor:
    """transformers' own greedy ``generate`` on the whole model: ``[3, N_NEW]`` on the CPU."""
    model = _model(name).to(device)
    ids, mask = _prompts(model.config.vocab_size)
    model.generation_config.eos_token_id = None  # every row runs N_NEW tokens, as the ranks' do
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=N_NEW, do_sample=False,
                         use_cache=True, pad_token_id=PAD)
    return out[:, ids.size(1):].cpu()


def _tp_generate(out: str, tp: int, device_type: str) -> None:
    """A rank of ``run_ranks`` (also the GPU tier's, tests/gpu/test_gpu.py): each model built on the CPU, wrapped
    at ``tp`` on ``device_type``, greedy tokens; rank 0 saves them and the shapes this rank holds."""
    from shardyard.inference import ds_inference
    from shardyard.models.generation import generate

    got = {}
    for name in MODELS:
        model = _model(name)
        full_q = model.model.layers[0].self_attn.q_proj.weight.shape[0]
        engine = ds_inference.wrap(model, tp_size=tp, dtype=torch.float32, device_type=device_type)
        attn = engine.module.model.layers[0].self_attn
        device = attn.q_proj.weight.device  # where the engine put this rank's share: cuda:LOCAL_RANK or the CPU
        ids, mask = _prompts(model.config.vocab_size)
        tokens, _ = generate(engine, ids.to(device), mask.to(device), max_new_tokens=N_NEW, temperature=0.0,
                             eos_id=None, pad_id=PAD, lockstep=True)
        got[name] = {"tokens": tokens.cpu(), "q_rows": (attn.q_proj.weight.shape[0], full_q),
                     "o_proj": type(attn.o_proj).__name__, "device": str(device)}
    if ds_inference.rank() == 0:
        torch.save(got, out)


@pytest.mark.timeout(300)
def test_tp2_on_cpu_generates_the_tokens_of_transformers_generate(tmp_path):
    from shardyard.inference import ds_inference

    out = str(tmp_path / "tp2.pt")
    t0 = time.perf_counter()
    ds_inference.run_ranks(2, _tp_generate, out, 2, "cpu", device_type="cpu")
    print(f"tp 2 ranks: {time.perf_counter() - t0:.1f} s")
    got = torch.load(out)
    for name in MODELS:
        rows, full = got[name]["q_rows"]
        assert rows * 2 == full and got[name]["o_proj"] == "LinearAllreduce", (name, got[name])  # really split
        want = _reference(name)
        assert torch.equal(got[name]["tokens"], want), (name, got[name]["tokens"], want)
