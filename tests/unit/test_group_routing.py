"""Group-limited routing (issue 43, point 3): ``model.n_group`` / ``model.topk_group`` route as transformers'
DeepSeek-V3 router does, checked against a brute-force reference; the plan says whether the groups line up with
the expert-parallel ranks or nodes and counts the all-to-all the dispatch really sends; bad values exit 2."""

import itertools

import pytest
import torch

from shardyard.models import moe
from shardyard.planning import plan as memory_plan
from shardyard.planning import hardware as plan_hardware
from shardyard.core.errors import UserError
from shardyard.models.build import build_model
from shardyard.testing import compose
from shardyard.planning.validate import validate

TINY = ["model=deepseek_moe_tiny", "model.hidden_size=64", "model.num_heads=2", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.intermediate_size=96",
        "model.moe_intermediate_size=32"]


def reference_route(scores: torch.Tensor, bias: torch.Tensor, groups: int, topk_group: int, top_k: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited routing by brute force, token by token, in float64: every set of
    ``topk_group`` groups is tried and the one whose groups' scores (each the sum of its two best biased expert
    scores) add up the most is kept; then every set of ``top_k`` experts inside it is tried and the one whose
    biased scores add up the most is chosen. Weights: the unbiased scores of the chosen, normalised, times
    ``scale``. Returns the chosen experts (sorted) and their weights, [tokens, top_k] each."""
    scores, bias = scores.double(), bias.double()
    E = scores.shape[1]
    per = E // groups
    chosen, weights = [], []
    for s in scores:
        biased = (s + bias).tolist()
        group_score = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        best = max(itertools.combinations(range(groups), topk_group), key=lambda gs: sum(group_score[g] for g in gs))
        allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
        pick = sorted(max(itertools.combinations(allowed, top_k), key=lambda es: sum(biased[e] for e in es)))
        w = s[pick]
        chosen.append(pick)
        weights.append((w / w.sum() * scale).tolist())
    return torch.tensor(chosen), torch.tensor(weights, dtype=torch.float64)


def sorted_route(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = idx.argsort(-1)
    return idx.gather(-1, order), w.gather(-1, order)


def tiny_model(*extra: str) -> torch.nn.Module:
    cfg = compose([*TINY, "model.n_group=4", "model.topk_group=2", *extra])
    model = build_model(cfg.model, seed=0)
    g = torch.Generator().manual_seed(1)
    for r in moe.routers(model):  # random router weights and a random nonzero selection bias
        r.module.weight.data = torch.randn(r.module.weight.shape, generator=g)
        r.module.e_score_correction_bias.data = torch.randn(r.experts, generator=g) * 0.3
    return model


def test_the_built_model_routes_within_its_best_groups_as_the_brute_force_reference():
    """8 experts in 4 groups of 2, the best 2 groups kept, top 2: on 600 random tokens through the router the
    built model holds, and on the tokens its own forward sends it, the chosen experts equal the reference's
    and their weights agree to 1e-5. The limit binds: on a sizeable share of the tokens the top 2 of all 8
    experts lie outside the 2 best groups."""
    model = tiny_model()
    found = moe.routers(model)
    assert len(found) == 2 and all(r.experts == 8 and r.top_k == 2 and r.biased for r in found)
    scale = model.config.routed_scaling_factor
    r = found[0].module
    h = torch.randn(600, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, w, idx = r(h)
    ref_idx, ref_w = reference_route(logits.sigmoid(), r.e_score_correction_bias, 4, 2, 2, scale)
    idx, w = sorted_route(idx, w)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-6)
    # the group limit decides: ungrouped top-2 (by biased score) differs on many tokens
    free = (logits.sigmoid() + r.e_score_correction_bias).topk(2, dim=-1).indices.sort(-1).values
    assert (free != ref_idx).any(-1).float().mean() > 0.1

    # the routers as the model's forward calls them (nothing of shardyard wraps or replaces them)
    seen = []
    hooks = [x.module.register_forward_hook(lambda m, a, out: seen.append((m, a[0], out))) for x in found]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3)))
    for hk in hooks:
        hk.remove()
    assert len(seen) == 2
    for m, hidden, (logits, w, idx) in seen:
        ref_idx, ref_w = reference_route(logits.sigmoid(), m.e_score_correction_bias, 4, 2, 2, scale)
        idx, w = sorted_route(idx, w)
        assert torch.equal(idx, ref_idx) and hidden.shape[-1] == model.config.hidden_size
        torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-6)


def hf_router(experts: int, groups: int, topk_group: int, top_k: int, seed: int = 0):
    """transformers' own DeepSeek-V3 router at DeepSeek-V3's routing sizes (a small hidden size), with random
    weights and selection bias."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=experts, n_group=groups, topk_group=topk_group,
                           num_experts_per_tok=top_k)
    r = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    r.weight.data = torch.randn(r.weight.shape, generator=g)
    r.e_score_correction_bias.data = torch.randn(experts, generator=g) * 0.1
    return r


def distinct(idx: torch.Tensor, per: int) -> torch.Tensor:
    """Distinct units (ranks or nodes, ``per`` consecutive experts each) each token's experts lie on."""
    units = idx // per
    return torch.tensor([len(set(row)) for row in units.tolist()])


@pytest.mark.parametrize("experts, groups, topk_group, top_k, ep, per_node, lined_up, ranks, nodes, where", [
    (256, 8, 4, 8, 8, 8, True, 4, 1, "one per rank of the EP group (device-limited)"),  # deepseek_v3_pipeline
    (256, 8, 4, 8, 64, 8, True, 8, 4, "one per node of the EP group (node-limited)"),  # the paper's: 8 nodes, M=4
    (256, 8, 4, 8, 16, 8, True, 8, 2, "each on 2 ranks of the EP group within a node"),  # deepseek_v3_pipeline_ep
    (256, 32, 2, 8, 8, 8, True, 2, 1, "4 per rank of the EP group"),
    (24, 4, 1, 4, 3, 3, False, 2, 1, None),  # 6-expert groups over 8-expert ranks: group 1 straddles ranks 0, 1
])
def test_groups_line_up_with_ranks_or_nodes_and_bound_the_ranks_a_token_reaches(
        experts, groups, topk_group, top_k, ep, per_node, lined_up, ranks, nodes, where):
    """``moe.RoutingGroups`` against transformers' router on 3000 random tokens: the most ranks (and nodes) of
    the EP group one token's experts lie on, counted token by token, equal its bound; its words name the
    layout (device- or node-limited)."""
    rg = moe.RoutingGroups(experts, groups, topk_group, top_k, ep, per_node)
    router = hf_router(experts, groups, topk_group, top_k)
    with torch.no_grad():
        _, _, idx = router(torch.randn(3000, 16, generator=torch.Generator().manual_seed(5)))
    assert (rg.lined_up, rg.max_ranks, rg.max_nodes) == (lined_up, ranks, nodes)
    assert distinct(idx, experts // ep).max().item() == ranks
    assert distinct(idx, experts // rg.nodes).max().item() == nodes
    note = rg.note([d for d in range(2, experts + 1) if experts % d == 0])
    assert note is not None and note.startswith(memory_plan.ROUTING)
    assert f"reaches at most {ranks} of the {ep} ranks" in note
    if lined_up:
        assert rg.where() in note and rg.where() == where
    else:  # the warning names the values that would line them up
        assert "do not line up" in note and "model.n_group in [3, 6, 12]" in note and "backend.ep in [2, 4, 8, 12, 24]" in note


def test_without_groups_a_token_reaches_more_ranks():
    """The bound is the groups': the same router without them (1 group) sends tokens to more ranks than the
    grouped bound allows, and the plan has no routing line."""
    router = hf_router(256, 1, 1, 8)
    with torch.no_grad():
        _, _, idx = router(torch.randn(3000, 16, generator=torch.Generator().manual_seed(5)))
    assert distinct(idx, 256 // 64).max().item() > 8 // 2 and distinct(idx, 256 // 8).max().item() > 4
    assert moe.RoutingGroups(256, 1, 1, 8, 64, 8).note() is None


def test_the_plans_all_to_all_is_what_the_dispatch_sends_under_the_group_limit():
    """16 experts in 4 groups, each token in its 1 best group, top 4, ep 8 over 4 nodes of 2 ranks: each group
    is one node (node-limited), so a token reaches at most 2 ranks and 1 node, where it would reach 4 ranks
    without groups; the plan says so. Its all-to-all bytes per micro-batch are those of the rows the dispatch
    (``expert_parallel_forward``: one row per token and rank holding any of its experts) sends off each rank:
    counted here by routing random tokens through the built model's router from each of the 8 ranks, x hidden x 2
    bytes (bf16) x 4 passes (dispatch and combine, forward and backward) x 2 MoE layers; within 2% (the tokens
    differ per rank). One row per routed slot, as a dispatch without deduplication sends, would be twice it."""
    over = [*TINY, "model.n_routed_experts=16", "model.n_group=4", "model.topk_group=1", "model.num_experts_per_tok=4",
            "backend=fsdp", "backend.ep=8", "precision=bf16", "plan.only=true", "plan.hardware=2xH100-80GB",
            "plan.nodes=4", "data.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=32"]
    cfg = compose(over)
    batch = validate(cfg, None)
    hw = plan_hardware.hardware(cfg, batch)
    assert (hw.world, hw.ranks_per_node, batch.dims.dp_shard) == (8, 2, 8)
    e = memory_plan.estimate(cfg, batch, hw)
    lines = [n for n in e.notes if n.startswith(memory_plan.ROUTING)]
    assert len(lines) == 1 and "one per node of the EP group (node-limited)" in lines[0], e.notes
    assert "reaches at most 2 of the 8 ranks" in lines[0] and "of its 4 nodes at most 1" in lines[0]
    assert lines[0] in memory_plan.describe(e, hw)  # printed at every start

    from shardyard.backends import engine
    states = engine(cfg.backend).model_states(cfg, batch.facts.params, hw.world, batch.facts.shape,
                                              memory_plan.optimizer_bytes_per_param(cfg.optim))
    model = tiny_model("model.n_routed_experts=16", "model.topk_group=1", "model.num_experts_per_tok=4")
    H, T, ep, per_rank = model.config.hidden_size, 4 * 128, 8, 2
    routers = moe.routers(model)
    sent = reached = 0
    g = torch.Generator().manual_seed(7)
    for rank in range(ep):
        for r in routers:
            with torch.no_grad():
                _, _, idx = r.module(torch.randn(T, H, generator=g))
            sent += (idx // per_rank != rank).sum().item()  # routed slots whose expert lives on another rank
            ranks = distinct(idx, per_rank)
            assert ranks.max().item() == 2 and (idx // 4 == idx[:, :1] // 4).all()  # one node (group) each
            reached += (ranks - torch.tensor([(row == rank).any().item() for row in (idx // per_rank)]).int()).sum().item()
    brute = reached / ep * H * 2 * 4  # per rank: rows x hidden x bf16 bytes x 4 passes
    assert states.all_to_all_per_micro == pytest.approx(brute, rel=0.02), (states.all_to_all_per_micro, brute)
    assert sent / ep * H * 2 * 4 > 1.4 * brute  # what one row per routed slot would send instead


@pytest.mark.parametrize("overrides, key, needle", [
    (["model.n_group=3"], "model.n_group", "so model.n_group must divide it. Fix: Use one of [1, 2, 4, 8]"),
    (["model.n_group=4", "model.topk_group=5"], "model.topk_group", "so it must lie in 1..4"),
    (["model.n_group=0"], "model.n_group", "so model.n_group must divide it"),
    (["model.n_group=8", "model.topk_group=2"], "model.n_group", "the sum of its 2 best experts"),  # groups of 1
    (["model.n_group=4", "model.topk_group=1", "model.num_experts_per_tok=3"], "model.topk_group",
     "which hold 1 x 2 = 2 experts"),
])
def test_bad_group_values_are_refused_naming_the_key(overrides, key, needle):
    with pytest.raises(UserError) as e:
        validate(compose([*TINY, *overrides]), None)
    text = " ".join(e.value.paragraph().split())
    assert e.value.key == key and needle in text, text


def test_bad_groups_exit_2_on_the_command_line(tmp_path):
    """``python train.py model=deepseek_moe_tiny model.n_group=3``: one paragraph naming the key, exit 2."""
    from conftest import train_py

    proc = train_py("model=deepseek_moe_tiny", "model.n_group=3", "plan.only=true", run_dir=tmp_path / "run",
                    timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model.n_group" in proc.stderr and "Traceback" not in proc.stderr
