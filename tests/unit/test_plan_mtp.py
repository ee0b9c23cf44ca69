"""The plan counts DeepSeek-V3's multi-token prediction (``model.mtp``, issue 43), each against a count made
without the plan: the depth's parameters from the built model's own modules (by DeepSeek's names) and what an engine
holds of them; its FLOPs by hand from the config; its activations from what autograd saves
(``saved_tensors_hooks``, as tests/unit/test_plan.py measures blocks) and from the dry run's memory tracker."""

import pytest
import torch
from omegaconf import OmegaConf

from shardyard.planning import plan as memory_plan
from shardyard.planning import hardware as plan_hardware
from shardyard.models.build import call_builder
from shardyard.models.loss import causal_lm_loss_sum
from shardyard.models.shape import flops_per_token, model_shape, param_count
from shardyard.testing import compose
from shardyard.planning.validate import validate
from test_plan import V3, saved_by

L = 2  # main layers: the depth is model.layers.2


def spec(depth, **extra):
    return OmegaConf.create({**V3, "num_layers": L, **extra, "mtp": {"depth": depth, "weight": 0.3,
                                                                     "final_weight": None,
                                                                     "final_weight_from_step": None}})


def meta(depth, **extra):
    with torch.device("meta"):
        return call_builder(spec(depth, **extra))


def depth_params(model, first):
    """The parameters of the MTP depth by name: ``model.layers.{num_hidden_layers}.*`` (DeepSeek's layout)."""
    return {n: p.numel() for n, p in model.named_parameters() if n.startswith(f"model.layers.{first}.")}


def test_each_depth_parameters_are_planned_and_held_by_the_engines():
    """The depth's block, enorm, hnorm, eh_proj and shared_head.norm are parameters of the plan (a block of it,
    not the root: the head and embedding are shared), and the engines hold them: FSDP's fp32 shards over 8 ranks
    (parameters, gradients, AdamW's two moments), DDP's whole replica."""
    d0, d1 = meta(0), meta(1)
    own = depth_params(d1, L)
    h = V3["hidden_size"]
    assert own["model.layers.2.eh_proj.weight"] == 2 * h * h
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        assert own[f"model.layers.2.{norm}.weight"] == h
    n = sum(own.values())
    s0, s1 = model_shape(d0), model_shape(d1)
    assert param_count(d1) - param_count(d0) == n
    assert (s1["blocks"], s1["block_params"] - s0["block_params"], s1["root_params"]) == (L + 1, n, s0["root_params"])
    assert s1["mtp_depth"] == 1 and s0["mtp_depth"] == 0

    with torch.device("meta"):  # the recipe-sized check: deepseek_moe_tiny (3 layers), its depth is layers.3
        tiny = call_builder(compose(["model=deepseek_moe_tiny", "model.mtp.depth=1"]).model)
    n_tiny = sum(depth_params(tiny, 3).values())
    for backend, share in (("fsdp", 1 / 8), ("ddp", 1.0)):
        got = []
        for d in (0, 1):
            cfg = compose(["model=deepseek_moe_tiny", f"backend={backend}", "precision=bf16", f"model.mtp.depth={d}",
                           "plan.hardware=8xH100-80GB"])
            batch = validate(cfg, None)
            got.append(memory_plan.estimate(cfg, batch, plan_hardware.hardware(cfg, batch)).device)
        for key, per_param in (("params", 4), ("grads", 4), ("optimizer", 8)):
            assert got[1][key] - got[0][key] == pytest.approx(n_tiny * per_param * share, rel=1e-9), (backend, key)


def test_flops_add_the_depth_block_its_attention_and_the_second_head_pass():
    """6 x (the depth's parameters a token passes through: MLA, the router, the shared expert, top_k of the routed
    experts, eh_proj, three norms) + 6 x hidden x vocab (the shared head, once more) + 12 x heads x Q x T (its
    attention), by hand from the config."""
    c = V3
    h, V, heads, mi, k = c["hidden_size"], c["vocab_size"], c["num_heads"], c["moe_intermediate_size"], 2
    dq, dv = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    mla = (h * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * dq  # q down, its norm, q up
           + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]  # kv latent + rope key, its norm
           + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + dv) + heads * dv * h)  # kv up, o_proj
    ffn = (c["n_routed_experts"] * h  # router
           + 3 * h * mi * c["n_shared_experts"]  # shared expert (gate, up, down)
           + k * 3 * h * mi)  # the top_k routed experts a token uses
    norms = 2 * h + 3 * h  # the block's two, enorm, hnorm, shared_head.norm
    active = mla + ffn + norms + 2 * h * h  # + eh_proj
    T = 64
    attention = 12 * heads * (dq + dv) / 2 * T
    by_hand = 6 * active + 6 * h * V + attention
    assert flops_per_token(meta(1), T) - flops_per_token(meta(0), T) == pytest.approx(by_hand, rel=1e-9)
    d2 = flops_per_token(meta(2), T) - flops_per_token(meta(0), T)
    assert d2 == pytest.approx(2 * by_hand, rel=1e-9)  # the same again per depth


def saved_bytes(model, x, y):
    """Bytes autograd saves in one training forward, every loss term (``test_plan.saved_by``, for
    ``causal_lm_loss_sum``: the MTP depths run only there)."""
    return saved_by(model, lambda: causal_lm_loss_sum(model, x, y))


@pytest.mark.parametrize("regime", ["fp32", "half"])
@pytest.mark.parametrize("chunk", [0, 16])
def test_depth_activations_equal_what_autograd_saves(regime, chunk):
    """What one depth adds to a training forward's saved tensors, per token: its block (the plan's per-block
    figure, within 5% as test_plan's blocks), its norms', eh_proj's and head's inputs and targets, and the log-softmax
    of its loss (none with model.loss_chunk, whose head recomputes it in backward)."""
    from shardyard.models.prepare import apply_chunked_loss

    b, s = 2, 32
    x = torch.randint(0, V3["vocab_size"], (b, s), generator=torch.Generator().manual_seed(0))
    measured = []
    for d in (0, 1):
        torch.manual_seed(0)
        model = call_builder(spec(d, loss_chunk=chunk))
        apply_chunked_loss(model, spec(d, loss_chunk=chunk))
        if regime == "half":
            model = model.to(torch.bfloat16)
        measured.append(saved_bytes(model, x, x.roll(-1, 1)) / (b * s))
    a0, a1 = (model_shape(meta(d))["activation_bytes_per_token"][regime] for d in (0, 1))
    planned = a1["blocks"] - a0["blocks"] + a1["mtp_per_depth"] + (0 if chunk else a1["mtp_logits"])
    increase = measured[1] - measured[0]
    assert planned == pytest.approx(increase, rel=0.05), (planned, increase)
    # not the block alone: what the depth keeps outside it is a third or more of the increase
    assert a1["blocks"] - a0["blocks"] < 0.8 * increase


def test_the_plans_increase_agrees_with_the_dry_run():
    """The plan's activations and peak with one depth less without, against the same from the dry run (the engine's
    own step on fake tensors, PyTorch's memory tracker) at deepseek_moe_tiny's size on FSDP over 8 ranks: within
    15%, and the plan's increase is more than the depth's block alone (its head pass and inputs count)."""
    from shardyard.planning import dryrun
    from shardyard.planning import simulation

    planned, measured, block_only = {}, {}, 0.0
    for d in (0, 1):
        cfg = compose(["model=deepseek_moe_tiny", "backend=fsdp", "precision=bf16", "plan.dry_run=true",
                       "plan.hardware=8xH100-80GB", f"model.mtp.depth={d}", "train.micro_batch_size=2",
                       "data.seq_len=1024"])
        batch = validate(cfg, None)
        hw = plan_hardware.hardware(cfg, batch)
        planned[d] = dryrun.planned(memory_plan.estimate_kinds(cfg, batch, hw)[0], hw)
        measured[d] = simulation.simulate(cfg, batch, simulation.Role(0, "first shard"))
        a = batch.facts.shape["activation_bytes_per_token"]["half"]
        block_only += (1 if d else -1) * a["blocks"] * 2 * 1024
    for key in ("activations", "peak"):
        plan_up, real_up = planned[1][key] - planned[0][key], measured[1][key] - measured[0][key]
        assert plan_up == pytest.approx(real_up, rel=0.15), (key, plan_up, real_up)
    assert block_only < 0.8 * (measured[1]["activations"] - measured[0]["activations"])
