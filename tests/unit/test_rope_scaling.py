"""``model.rope_scaling`` (issue 56, point 1): rotary scaling past the pretrained length for every family, as
DeepSeek's released configs state it. The references are independent of shardyard's builders: DeepSeek-V3's own
``precompute_freqs_cis`` and MLA softmax scale (deepseek-ai/DeepSeek-V3, inference/model.py, written out here) and
a transformers model made from a released-style ``config.json`` dict (``rope_scaling``, as HF hub configs spell it)."""

import math

import pytest
import torch

from shardyard.core.errors import UserError
from shardyard.models.build import build_model, hf
from shardyard.planning.validate import validate
from shardyard.testing import compose

V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}
"""DeepSeek-V3's released ``rope_scaling`` (config.json), beside max_position_embeddings 163840."""
TINY_V3 = ["model=deepseek_moe_tiny", "model.num_layers=2", "model.qk_rope_head_dim=64", "model.qk_nope_head_dim=64"]


def override(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"


def deepseek_reference(dim: int, base: float, factor: float, beta_fast: float, beta_slow: float, original: int,
                       mscale: float, qk_head_dim: int) -> tuple[torch.Tensor, float]:
    """DeepSeek-V3's inference/model.py: ``precompute_freqs_cis``'s frequencies for a max_seq_len past the original
    length, and ``MLA.softmax_scale``."""
    def find_correction_dim(num_rotations):
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(beta_fast)), 0)
    high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    smooth = 1 - ramp
    freqs = freqs / factor * (1 - smooth) + freqs * smooth
    m = 0.1 * mscale * math.log(factor) + 1.0
    return freqs, qk_head_dim ** -0.5 * m * m


def test_deepseek_v3_yarn_is_deepseeks_own():
    """The released V3 fields on a V3 of the real rotary width (64) and base: the rotary frequencies and the
    attention's softmax scale are DeepSeek's reference's, and cos/sin carry no extra factor (its freqs_cis are
    unit complex numbers). Without model.rope_scaling (plain RoPE) both differ."""
    cfg = compose([*TINY_V3, "model.max_position_embeddings=163840", f"model.rope_scaling={override(V3_YARN)}"])
    model = build_model(cfg.model, 0)
    freqs, scale = deepseek_reference(64, 10000.0, 40, 32, 1, 4096, 1.0, 128)
    assert torch.allclose(model.model.rotary_emb.inv_freq, freqs, rtol=1e-6, atol=0)
    assert model.model.rotary_emb.attention_scaling == 1.0
    assert all(abs(layer.self_attn.scaling - scale) < 1e-12 for layer in model.model.layers)
    assert model.config.max_position_embeddings == 163840
    plain = build_model(compose(TINY_V3).model, 0)
    assert not torch.allclose(plain.model.rotary_emb.inv_freq, freqs)
    assert abs(plain.model.layers[0].self_attn.scaling - scale) > 0.05


@pytest.mark.parametrize("family,scaling", [
    ("deepseek_v3", V3_YARN),
    ("deepseek_v2", {"type": "yarn", "factor": 8, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    ("llama", {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0}),
    ("llama", {"type": "linear", "factor": 8.0}),
    ("llama", {"type": "dynamic", "factor": 8.0}),  # past model.max_position_embeddings (64 here): generation
])
def test_logits_at_8x_the_original_length_are_transformers_from_a_released_config(family, scaling, tmp_path):
    """A tiny model of each family with ``model.rope_scaling``, run on a sequence 8 times its original length
    (512 of 64), gives the logits of transformers' model made from a ``config.json``-style dict with the same
    ``rope_scaling`` and weights; the same weights without the scaling give others (the check can fail). The
    export (``save_pretrained``) keeps the scaling, and ``model=hf`` reads it back to the same logits."""
    import transformers

    seq, original = 512, 64
    if family == "deepseek_v3":  # the released fields, at the length they were made for (4096 -> 163840)
        over = [*TINY_V3, "model.max_position_embeddings=163840"]
    elif family == "deepseek_v2":
        over = ["model=deepseek_v2_lite", "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
                "model.num_heads=4", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                "model.v_head_dim=16", "model.n_routed_experts=4", "model.num_experts_per_tok=2",
                "model.moe_intermediate_size=32", "model.first_k_dense_replace=1", f"model.max_position_embeddings={seq}"]
    else:  # llama3: Llama 3.1's own ratio (max 16x the original at factor 8); dynamic: the original length
        longest = {"llama3": 16 * original, "dynamic": original}.get(scaling["type"], seq)
        over = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.num_heads=4",
                f"model.max_position_embeddings={longest}"]
    cfg = compose([*over, f"model.rope_scaling={override(scaling)}"])
    ours = build_model(cfg.model, 0).eval()
    released = ours.config.to_dict()
    for k in ("rope_parameters", "rope_theta", "rope_scaling"):
        released.pop(k, None)
    released["rope_theta"] = cfg.model.rope_theta
    released["rope_scaling"] = dict(scaling)  # the hub's spelling, as a released config.json has it
    theirs = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(released.pop("model_type"), **released)).eval()
    theirs.load_state_dict(ours.state_dict())
    plain = build_model(compose(over).model, 0).eval()
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, without = ours(ids).logits, theirs(ids).logits, plain(ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    assert (got - without).abs().max() > 1e-3
    assert seq >= 8 * original or scaling["type"] == "linear"
    ours.save_pretrained(tmp_path)
    again = hf(str(tmp_path)).eval()
    again.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert torch.equal(again(ids).logits, got)


@pytest.mark.parametrize("over,key", [
    (["model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=64",
      "model.rope_scaling.factor=4"], "model.rope_scaling.factor"),  # 2048 / 64 = 32, not 4
    (["model.rope_scaling.type=yarn"], "model.rope_scaling.original_max_position_embeddings"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=4096"],
     "model.rope_scaling.original_max_position_embeddings"),  # above max_position_embeddings (2048)
    (["model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=512",
      "model.rope_scaling.beta_slow=40"], "model.rope_scaling.beta_slow"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=512",
      "model.rope_scaling.mscale_all_dim=-1"], "model.rope_scaling.mscale_all_dim"),
    (["model.rope_scaling.type=linear"], "model.rope_scaling.factor"),
    (["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"], "model.rope_scaling.factor"),
    (["model.rope_scaling.type=dynamic", "model.rope_scaling.factor=2",
      "model.rope_scaling.original_max_position_embeddings=512"], "model.rope_scaling.original_max_position_embeddings"),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.original_max_position_embeddings=512",
      "model.rope_scaling.factor=8", "model.rope_scaling.low_freq_factor=4"], "model.rope_scaling.low_freq_factor"),
])
def test_bad_rope_scaling_values_name_their_key(over, key):
    with pytest.raises(UserError) as e:
        validate(compose(["model=deepseek_tiny", *over]), None)
    assert e.value.key == key, e.value.paragraph()
