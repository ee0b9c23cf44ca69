"""Model options build the real HF architectures; the big ones with their exact published sizes (on meta)."""

import pytest
import torch

from shardyard.models.build import build_model, inspect_model, materialize, shape_model, wants_meta
from shardyard.models.prepare import prepare_replica
from shardyard.testing import compose

TINY_MODEL = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_layers=2", "model.num_heads=4"]


def test_deepseek7b_has_the_published_dimensions():
    m = compose(["model=deepseek7b"]).model
    c = shape_model(m).config  # meta device: no memory
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads) == \
        (102400, 4096, 11008, 30, 32)
    assert inspect_model(m, 128).params == 6_910_365_696  # deepseek-llm-7b-base: 6.9B


def test_deepseek_v3_is_671b():
    m = compose(["model=deepseek_v3"]).model
    c = shape_model(m).config
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.kv_lora_rank, c.q_lora_rank) == (7168, 61, 256, 512, 1536)
    n = inspect_model(compose(["model=deepseek_v3", "model.mtp.depth=0"]).model, 128).params
    assert abs(n / 671e9 - 1) < 0.01, n
    # with its multi-token prediction depth (the option trains with one, as the paper): the official checkpoint's
    # 685B, which stores its own copies of the embedding and head that the depth shares here
    with_mtp = inspect_model(m, 128).params + 2 * c.vocab_size * c.hidden_size
    assert c.num_nextn_predict_layers == 1 and abs(with_mtp / 685e9 - 1) < 0.01, with_mtp


def test_big_models_are_built_on_meta():
    m = compose(["model=deepseek7b"]).model
    assert wants_meta(m, inspect_model(m, 128))
    model = build_model(m, seed=0, on_meta=True)
    assert all(p.is_meta for p in model.parameters())
    tiny = compose(["model=deepseek_tiny"]).model
    assert not wants_meta(tiny, inspect_model(tiny, 128))
    assert build_model(tiny, seed=0).model.embed_tokens.weight.device.type == "cpu"


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
    c = build_model(m, seed=3, on_meta=True)
    assert c.model.layers[0].mlp.up_proj.weight.is_meta
    materialize(c, torch.device("cpu"), seed=3)
    w = c.model.layers[0].mlp.up_proj.weight
    assert not w.is_meta and abs(w.std().item() - m.initializer_range) < 2e-3
    for (n, x), (_, y) in zip(a.named_buffers(), c.named_buffers()):
        assert torch.equal(x, y), n  # rotary inv_freq recomputed after to_empty


def test_activation_checkpointing_disables_cache():
    cfg = compose(["model=deepseek_tiny", "model.activation_checkpointing=true"])
    model = prepare_replica(build_model(cfg.model, seed=0), cfg, torch.device("cpu"))
    assert model.config.use_cache is False
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert model.model.layers[0].training and model.config.use_cache is False


def test_flops_per_token_is_6n_plus_attention():
    from shardyard.models.shape import flops_per_token

    m = compose(["model=deepseek_tiny"]).model
    h, i, L, v = m.hidden_size, m.intermediate_size, m.num_layers, m.vocab_size
    kv = (m.num_kv_heads or m.num_heads) * (h // m.num_heads)
    # Non-embedding parameters of a LLaMA block stack, written out: q,o + k,v + SwiGLU + 2 norms; final norm; head.
    n = L * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h + v * h
    assert flops_per_token(shape_model(m), 128) == 6 * n + 12 * L * m.num_heads * (h // m.num_heads) * 128
    moe = compose(["model=deepseek_moe_tiny"]).model
    facts = inspect_model(moe, 128)
    # Only the experts a token is routed to count: far fewer FLOPs than 6 x all parameters.
    assert facts.flops_per_token < 6 * facts.params * 0.7


def test_peak_table_and_override(monkeypatch):
    import torch

    from shardyard.training.metrics import peak_tflops

    cuda = torch.device("cuda", 0)
    for name, precision, want in [("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0),
                                  ("NVIDIA H200", "bf16", 989.4), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
                                  ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("Tesla T4", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
        assert peak_tflops(cuda, precision, None) == want, name
    assert peak_tflops(torch.device("cpu"), "bf16", None) is None
    assert peak_tflops(torch.device("cpu"), "bf16", 2.5) == 2.5


def test_anomaly_detection_switch():
    import torch

    from shardyard.training.debug import anomaly_detection

    with anomaly_detection(compose(["debug.detect_anomaly=true"]).debug):
        assert torch.is_anomaly_enabled()
        x = torch.ones(2, requires_grad=True)
        y = torch.sqrt(x - 2)  # NaN in forward; backward of sqrt at a NaN input returns NaN
        with pytest.raises(RuntimeError, match="SqrtBackward0"):
            y.sum().backward()
    with anomaly_detection(compose([]).debug):
        assert not torch.is_anomaly_enabled()


def test_prepare_model_applies_the_speed_options_where_they_belong():
    """fp8: the blocks' linear layers become torchao's Float8Linear, the LM head and embeddings do not;
    regional compile: each block compiled, not the model; loss_chunk: the head returns the summed loss when
    the loss asks, the logits otherwise (generation, export)."""
    from shardyard.models.loss import causal_lm_loss_sum
    from shardyard.models.prepare import float8_linears, has_chunked_loss
    from shardyard.models.shape import transformer_blocks

    cfg = compose([*TINY_MODEL, "precision=fp8", "model.compile=true", "model.loss_chunk=64"])
    model = prepare_replica(build_model(cfg.model, seed=0), cfg, torch.device("cpu"))
    assert float8_linears(model) == 7 * cfg.model.num_layers  # q, k, v, o, gate, up, down
    assert type(model.lm_head).__name__ == "Linear"
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in transformer_blocks(model))
    assert getattr(model, "_compiled_call_impl", None) is None
    assert has_chunked_loss(model)
    x = torch.randint(0, 100, (2, 32))
    assert model.lm_head(torch.zeros(2, cfg.model.hidden_size)).shape == (2, cfg.model.vocab_size)
    plain = compose(TINY_MODEL)
    ref = prepare_replica(build_model(plain.model, seed=0), plain, torch.device("cpu"))
    ref_model = compose([*TINY_MODEL, "model.loss_chunk=24"])  # 64 targets: chunks of 24, 24 and 16
    chunked = prepare_replica(build_model(ref_model.model, seed=0), ref_model, torch.device("cpu"))
    torch.testing.assert_close(causal_lm_loss_sum(chunked, x, x), causal_lm_loss_sum(ref, x, x), rtol=1e-6, atol=0)
