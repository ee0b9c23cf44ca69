"""Model options build the real HF architectures; the big ones with their exact published sizes (on meta)."""

import pytest
import torch

from shardyard.model import build_model, count_params, hf_config, materialize, prepare_replica
from shardyard.testing import compose


def test_deepseek7b_has_the_published_dimensions():
    m = compose(["model=deepseek7b"]).model
    c = hf_config(m)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads) == \
        (102400, 4096, 11008, 30, 32)
    n = count_params(m)  # meta device: no memory
    assert n == 6_910_365_696  # deepseek-llm-7b-base: 6.9B


def test_deepseek_v3_is_671b():
    m = compose(["model=deepseek_v3"]).model
    c = hf_config(m)
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.kv_lora_rank, c.q_lora_rank) == (7168, 61, 256, 512, 1536)
    n = count_params(m)
    assert abs(n / 671e9 - 1) < 0.01, n


def test_big_models_are_built_on_meta():
    m = compose(["model=deepseek7b"]).model
    model = build_model(m, seed=0)
    assert all(p.is_meta for p in model.parameters())
    assert build_model(compose(["model=deepseek_tiny"]).model, seed=0).model.embed_tokens.weight.device.type == "cpu"


@pytest.mark.parametrize("name", ["deepseek_tiny", "deepseek_moe_tiny"])
def test_tiny_models_train_a_step(name):
    m = compose([f"model={name}"]).model
    model = build_model(m, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 2e6 <= n <= 20e6, n
    x = torch.randint(0, m.vocab_size, (2, 16))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_seeded_build_is_identical_and_meta_init_matches_distribution():
    m = compose(["model=deepseek_tiny"]).model
    a, b = build_model(m, seed=3), build_model(m, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    m.init_device = "meta"
    c = build_model(m, seed=3)
    assert c.model.layers[0].mlp.up_proj.weight.is_meta
    materialize(c, torch.device("cpu"), seed=3)
    w = c.model.layers[0].mlp.up_proj.weight
    assert not w.is_meta and abs(w.std().item() - m.initializer_range) < 2e-3
    for (n, x), (_, y) in zip(a.named_buffers(), c.named_buffers()):
        assert torch.equal(x, y), n  # rotary inv_freq recomputed after to_empty


def test_activation_checkpointing_disables_cache():
    m = compose(["model=deepseek_tiny", "model.activation_checkpointing=true"]).model
    model = prepare_replica(build_model(m, seed=0), m, torch.device("cpu"), 0)
    assert model.config.use_cache is False
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
