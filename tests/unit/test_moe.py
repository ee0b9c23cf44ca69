"""MoE routing balance (shardyard.models.moe): the DeepSeek-V3 bias update and the balance losses against values computed
by hand on fixed batches (the sequence-wise loss on sigmoid scores, where softmax scores give another number, and
its gradient in the router's weight), the load counting through real transformers routers (activation
checkpointing included), no host sync in a MoE layer and one per log step for the metrics, and validation of the
keys."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from shardyard.models import moe
from shardyard.core.errors import UserError
from shardyard.models.build import build_model
from shardyard.testing import compose
from shardyard.planning.validate import validate
from syncs import HostSyncs, moe_step_syncs

SMOKE_MOE = ["model=deepseek_moe_tiny"]


def test_bias_moves_against_the_load_by_gamma():
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    moe.bias_update(bias, torch.tensor([3.0, 1.0, 2.0, 2.0]), gamma=0.1)  # mean 2: over, under, at, at
    assert torch.allclose(bias, torch.tensor([0.4, 0.1, -0.25, 0.0]))


def test_expert_level_balance_loss_by_hand():
    # One sequence of T=2 tokens, E=2 experts, K=1. Softmax scores: token 0 [1/4, 3/4], token 1 [1/2, 1/2];
    # both tokens go to expert 1: f = E/(K T) * [0, 2] = [0, 2]; P = [(1/4 + 1/2)/2, (3/4 + 1/2)/2] = [3/8, 5/8].
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    chosen = torch.tensor([[1], [1]])
    loss = moe.balance_loss(logits, chosen, batch=1, sigmoid=False, alphas=(0.1, 0.0, 0.0))
    assert loss.item() == pytest.approx(0.1 * (0 * 3 / 8 + 2 * 5 / 8))
    # Two sequences are averaged; a balanced one (f = [1, 1], P = [1/2, 1/2]) scores exactly alpha.
    logits2 = torch.cat([logits, torch.zeros(2, 2)])
    chosen2 = torch.cat([chosen, torch.tensor([[0], [1]])])
    loss2 = moe.balance_loss(logits2, chosen2, batch=2, sigmoid=False, alphas=(0.1, 0.0, 0.0))
    assert loss2.item() == pytest.approx((0.1 * 1.25 + 0.1 * 1.0) / 2)


def test_sequence_wise_loss_takes_sigmoid_affinities_normalised_over_all_experts():
    # DeepSeek-V3 (eqs. 17-20): s = sigmoid(u), s' = s / sum_j s_j over ALL E experts, P_i = mean_t s'_i,
    # f_i = E / (K T) * #tokens choosing i. One sequence, T = 2, E = 3, K = 2 (each token's top 2 sigmoid scores):
    #   token 0, u = [0, ln 3, -ln 3]: s = [1/2, 3/4, 1/4], sum 3/2, s' = [1/3, 1/2, 1/6]; chooses 1, 0
    #   token 1, u = [ln 3, 0, 0]:     s = [3/4, 1/2, 1/2], sum 7/4, s' = [3/7, 2/7, 2/7]; chooses 0, 1
    # f = 3/4 * [2, 2, 0] = [3/2, 3/2, 0]; P_0 = (1/3 + 3/7)/2 = 8/21, P_1 = (1/2 + 2/7)/2 = 11/28:
    # L = 3/2 * (8/21 + 11/28) = 65/56. The f-weighting is uneven (expert 2 has no token), so the scores matter:
    # softmax scores (V2) give 84/65 on the same logits, unnormalised sigmoid scores 15/8.
    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0)], [math.log(3.0), 0.0, 0.0]])
    chosen = torch.tensor([[1, 0], [0, 1]])
    v3 = moe.balance_loss(logits, chosen, batch=1, sigmoid=True, alphas=(1.0, 0.0, 0.0))
    assert v3.item() == pytest.approx(65 / 56, rel=1e-6)
    # softmax: s' = [3/13, 9/13, 1/13] and [3/5, 1/5, 1/5]; L = 3/2 * ((3/13 + 3/5) + (9/13 + 1/5)) / 2
    v2 = moe.balance_loss(logits, chosen, batch=1, sigmoid=False, alphas=(1.0, 0.0, 0.0))
    assert v2.item() == pytest.approx(84 / 65, rel=1e-6)


def v3_balance_by_hand(u: torch.Tensor, chosen: torch.Tensor, batch: int, alpha: float):
    """DeepSeek-V3's sequence-wise balance loss for router logits ``u`` [B T, E] (``chosen``: [B T, K]) and its
    gradient with respect to ``u``, in float64, written out rather than taken from ``moe.balance_loss``:
    L = alpha / B * sum_b sum_i f_bi P_bi = alpha / (B T) * sum_t sum_i f_i s'_ti (f of the token's sequence);
    dL/ds_tj = alpha / (B T) * (f_j - sum_i f_i s'_ti) / S_t (S_t = sum_j s_tj); ds/du = s (1 - s)."""
    u = u.double()
    tokens, E = u.shape
    K, T = chosen.shape[1], tokens // batch
    f = torch.zeros(batch, E, dtype=torch.float64)
    for t, experts in enumerate(chosen.tolist()):
        for i in experts:
            f[t // T, i] += E / (K * T)
    f = f.repeat_interleave(T, 0)  # each token's sequence's f
    s = u.sigmoid()
    S = s.sum(1, keepdim=True)
    loss = alpha / (batch * T) * (f * s / S).sum()
    grad_s = alpha / (batch * T) * (f - (f * s / S).sum(1, keepdim=True)) / S
    return loss, grad_s * s * (1 - s)


def test_device_and_communication_losses_by_hand():
    # E=4 experts in D=2 groups {0,1} {2,3}, K=2, one sequence of T=2 tokens, uniform softmax scores (P_i = 1/4,
    # so P'_d = 1/2). Token 0 -> experts 0,1 (group 0 only); token 1 -> experts 1,2 (both groups).
    logits = torch.zeros(2, 4)
    chosen = torch.tensor([[0, 1], [1, 2]])
    f = torch.tensor([1.0, 2.0, 1.0, 0.0]) * 4 / (2 * 2)  # routed slots per expert x E/(K T)
    f_dev = torch.stack([f[:2].mean(), f[2:].mean()])  # [1.5, 0.5]
    f_comm = torch.tensor([2.0, 1.0]) * 2 / (2 * 2)  # tokens reaching each group x D/(M T), M = min(K, D) = 2
    want = 0.5 * (f_dev * 0.5).sum() + 0.25 * (f_comm * 0.5).sum()
    got = moe.balance_loss(logits, chosen, batch=1, sigmoid=False, groups=2, alphas=(0.0, 0.5, 0.25))
    assert got.item() == pytest.approx(want.item())


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = compose(SMOKE_MOE)
    model = build_model(cfg.model, seed=0)
    return cfg, model


def _balancer(model, **keys):
    b = OmegaConf.create({"bias_update_speed": 0.01, "seq_aux_alpha": 0.0, "device_aux_alpha": 0.0,
                          "comm_aux_alpha": 0.0, **keys})
    return moe.Balancer.install(model, b, experts=8)


def test_loads_are_counted_once_per_forward_also_when_checkpointing_recomputes(tiny_moe):
    """With checkpointing only: every assertion of a run without it holds here as well, the recomputed forward
    added (a run without checkpointing counts through the same hook in the host-sync test below)."""
    cfg, model = tiny_moe
    found = moe.routers(model)
    assert [r.layer for r in found] == [1, 2] and found[0].biased and found[0].experts == 8 and found[0].top_k == 2
    chosen = []
    seen = found[0].module.register_forward_hook(lambda m, a, out: chosen.append(out[-1].clone()))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    balancer = _balancer(model, seq_aux_alpha=0.5)
    try:
        model.train()
        ids = torch.randint(0, 100, (2, 16))
        out = model(ids).logits.float().mean()
        aux = moe.aux_loss(model)
        (out + aux).backward()
        assert isinstance(aux, torch.Tensor) and aux.item() > 0 and moe.aux_loss(model) == 0.0  # taken once
        # One routing decision of 2 x 16 tokens; the recomputed forward (a second hook call) counts nothing.
        assert len(chosen) == 2
        want = torch.bincount(chosen[0].flatten(), minlength=8).double()
        assert torch.equal(balancer.counts[1], want)
        assert balancer.counts[0].sum() == 0  # layer 0 is dense
        bias = found[0].bias.clone()
        balancer.after_step(lambda t: t)  # one rank: the all-reduced loads are its own
        assert torch.allclose(found[0].bias, bias + 0.01 * torch.sign(want.mean() - want).float())
        m = balancer.metrics()
        assert m["moe/layer_1/max_over_mean"] == pytest.approx(float(want.max() / want.mean()))
        assert m["moe/layer_1/dead_experts"] == float((want == 0).sum())
        assert m["moe/balance_loss"] == pytest.approx(aux.item())
        assert "moe/layer_0/max_over_mean" not in m
    finally:
        seen.remove()
        balancer.close()
        model.activation_checkpointing_disable()
        model.zero_grad()


def test_the_sequence_wise_loss_moves_the_router_gradient_by_its_own_gradient(tiny_moe):
    """One forward + backward of the tiny V3 model with the sequence-wise loss off and on (alpha 0.5; no bias
    update): the last MoE layer's router weight gradients differ by exactly alpha dL/dW worked out by hand from
    its input h and logits u = h W^T (``v3_balance_by_hand``: dL/du, then dL/dW = dL/du^T h), and the loss the
    engines add is the hand value of both layers with sigmoid scores. (The first layer's gradient also gets the
    second layer's loss, through the second's input: it is only shown to move.)"""
    _, model = tiny_moe
    found = moe.routers(model)
    seen = {}

    def keep(layer):
        def hook(module, args, out):
            seen[layer] = (args[0].detach().reshape(-1, args[0].shape[-1]).double(), out[-1])
        return hook

    hooks = [r.module.register_forward_hook(keep(r.layer)) for r in found]
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    try:
        model.train()
        for alpha in (0.0, 0.5):
            balancer = _balancer(model, seq_aux_alpha=alpha, bias_update_speed=0.0)
            try:
                model.zero_grad()
                out = model(ids).logits.float().mean()
                aux = moe.aux_loss(model)
                (out + aux).backward()
                grads[alpha] = [r.module.weight.grad.double() for r in found]
            finally:
                balancer.close()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad()
    by_hand = {r.layer: v3_balance_by_hand(seen[r.layer][0] @ r.module.weight.detach().double().T, seen[r.layer][1],
                                           batch=2, alpha=0.5) for r in found}
    assert isinstance(aux, torch.Tensor) and aux.item() == pytest.approx(sum(v[0].item() for v in by_hand.values()),
                                                                          rel=1e-5)
    h, _ = seen[found[-1].layer]
    want = by_hand[found[-1].layer][1].T @ h  # dL/dW = dL/du^T h
    got = grads[0.5][-1] - grads[0.0][-1]
    assert want.norm() > 0.01 * grads[0.0][-1].norm()  # not lost in the cross-entropy's gradient
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item()), (got - want).abs().max()
    assert not torch.allclose(grads[0.5][0], grads[0.0][0], rtol=1e-3, atol=0)


def test_eval_mode_counts_nothing(tiny_moe):
    _, model = tiny_moe
    balancer = _balancer(model)
    try:
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 100, (1, 8)))
        assert not balancer.counts.any() and balancer.pending == []
    finally:
        balancer.close()
        model.train()


def test_moe_layers_make_the_host_wait_for_nothing_without_expert_parallelism(tiny_moe):
    """Issue 41: a training forward + backward of the MoE layers (router, load counting, balance loss, experts)
    reads nothing back on the host; the loads are still counted, on the device (before: one torch.bincount per
    MoE layer, which on CUDA reads its output size on the host)."""
    _, model = tiny_moe
    balancer = _balancer(model, seq_aux_alpha=0.5)
    try:
        model.train()
        ids = torch.randint(0, 100, (2, 16))
        syncs = moe_step_syncs(model, ids)
        assert syncs == [], syncs
        assert balancer.counts[1].sum() == balancer.counts[2].sum() == 2 * 16 * 2  # tokens x top_k, per layer
    finally:
        balancer.close()
        model.zero_grad()


def test_the_load_metrics_are_read_once_per_log_step_whatever_the_layers(tiny_moe):
    """The loads and balance losses of every layer come to the host in one transfer (before: a few per layer)."""
    _, model = tiny_moe
    balancer = _balancer(model, seq_aux_alpha=0.5)
    try:
        model.train()
        ids = torch.randint(0, 100, (2, 16))
        (model(ids).logits.float().mean() + moe.aux_loss(model)).backward()
        balancer.after_step(lambda t: t)
        want = balancer.window.clone()
        with HostSyncs() as syncs:
            m = balancer.metrics()
        assert len(syncs) == 1, syncs.calls
        for layer in (1, 2):
            load = want[layer]
            assert m[f"moe/layer_{layer}/max_over_mean"] == pytest.approx(float(load.max() / load.mean()))
            assert m[f"moe/layer_{layer}/min_over_mean"] == pytest.approx(float(load.min() / load.mean()))
        assert m["moe/max_over_mean"] == max(m["moe/layer_1/max_over_mean"], m["moe/layer_2/max_over_mean"])
        assert "moe/layer_0/max_over_mean" not in m and m["moe/balance_loss"] > 0
    finally:
        balancer.close()
        model.zero_grad()


@pytest.mark.parametrize("overrides,key", [
    (["model.balance.bias_update_speed=-0.001"], "model.balance.bias_update_speed"),
    (["model.balance.seq_aux_alpha=-1"], "model.balance.seq_aux_alpha"),
    (["model.balance.warn_max_over_mean=0.5"], "model.balance.warn_max_over_mean"),
])
def test_bad_balance_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(UserError) as e:
        validate(compose([*SMOKE_MOE, *overrides]), None)
    assert e.value.key == key


def test_balance_keys_that_would_do_nothing_are_refused():
    with pytest.raises(UserError) as e:  # a dense model has no router
        validate(compose(["model.balance.seq_aux_alpha=0.01"]), None)
    assert e.value.key == "model.balance.seq_aux_alpha" and "no router" in e.value.paragraph()
    with pytest.raises(UserError) as e:  # DeepSeek-V2's softmax router has no selection bias
        validate(compose(["model=deepseek_v2_lite", "model.balance.bias_update_speed=0.01"]), None)
    assert e.value.key == "model.balance.bias_update_speed"


def test_family_defaults_come_from_the_papers():
    v3 = compose(["model=deepseek_v3"]).model.balance
    assert (v3.bias_update_speed, v3.seq_aux_alpha) == (0.001, 0.0001)  # DeepSeek-V3, section 4.2
    lite = compose(["model=deepseek_v2_lite"]).model
    assert lite._target_ == "shardyard.models.build.deepseek_v2" and lite.balance.bias_update_speed == 0
    assert lite.balance.seq_aux_alpha == 0.001  # V2-Lite's released aux_loss_alpha
    dense = compose([]).model.balance
    assert not any(dense[k] for k in ("bias_update_speed", "seq_aux_alpha", "device_aux_alpha", "comm_aux_alpha"))


def test_an_export_with_experts_stored_apart_loads_into_the_fused_experts(tiny_moe, tmp_path):
    """transformers 5 writes a DeepSeek MoE's experts one by one (experts.3.gate_proj.weight ...), as DeepSeek's
    releases do; model.weights reads them into the fused gate_up_proj / down_proj tensors."""
    from shardyard.models.weights import load_weights

    cfg, model = tiny_moe
    model.save_pretrained(str(tmp_path))
    fresh = build_model(cfg.model, seed=1)
    assert not torch.equal(fresh.model.layers[1].mlp.experts.gate_up_proj, model.model.layers[1].mlp.experts.gate_up_proj)
    load_weights(fresh, str(tmp_path))
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("overrides,needle", [
    (["backend=fsdp", "backend.ep=3"], "divide the model's 8 routed experts"),  # 3 does not divide 8
    (["backend=fsdp", "backend.ep=4", "launch.nproc_per_node=2"], "which it must divide"),  # 2 shards, ep 4
    (["backend=zero3", "backend.ep=2", "launch.nproc_per_node=2"], "does not shard experts"),
    (["backend=horovod", "backend.ep=2", "launch.nproc_per_node=2"], "does not shard experts"),
    (["backend=fsdp", "backend.ep=0"], "at least 1"),
])
def test_bad_expert_parallel_degrees_exit_2_naming_backend_ep(overrides, needle):
    with pytest.raises(UserError) as e:
        validate(compose([*SMOKE_MOE, "backend.device=cpu", *overrides]), None)
    assert e.value.key == "backend.ep" and needle in e.value.paragraph(), e.value.paragraph()


@pytest.mark.parametrize("overrides,needle", [
    (["backend.ep=2", "backend.ep_capacity_factor=1.0"], "greater than 1"),
    (["backend.ep=2", "backend.ep_capacity_factor=0.5"], "greater than 1"),
    (["backend.ep=1", "backend.ep_capacity_factor=2"], "backend.ep=1 sends no token"),
])
def test_bad_receive_bounds_exit_2_naming_backend_ep_capacity_factor(overrides, needle):
    with pytest.raises(UserError) as e:
        validate(compose([*SMOKE_MOE, "backend=fsdp", "backend.device=cpu", "launch.nproc_per_node=2", *overrides]),
                 None)
    assert e.value.key == "backend.ep_capacity_factor" and needle in e.value.paragraph(), e.value.paragraph()


def test_expert_parallelism_on_a_dense_model_is_refused():
    with pytest.raises(UserError) as e:
        validate(compose(["backend=fsdp", "backend.ep=2", "launch.nproc_per_node=2", "backend.device=cpu"]), None)
    assert e.value.key == "backend.ep" and "no router" in e.value.paragraph()


def test_the_layout_names_the_expert_degree():
    plan = validate(compose([*SMOKE_MOE, "backend=fsdp", "backend.ep=2", "launch.nproc_per_node=4",
                             "backend.device=cpu", "train.micro_batch_size=2"]), None)
    assert (plan.dims.dp_shard, plan.dims.ep, plan.dims.world_size) == (4, 2, 4)
    assert "ep 2" in plan.dims.describe()
