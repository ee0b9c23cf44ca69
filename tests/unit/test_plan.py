"""The plan's pieces against what they model: activation bytes against autograd's own saved tensors,
DeepSpeed's estimators, the optimizer probe, hardware names, and what a refusal says."""

import pytest
import torch

from shardyard.planning import plan as memory_plan
from shardyard.planning import hardware as plan_hardware
from shardyard.planning import search as plan_search
from shardyard.models.shape import model_shape
from shardyard.planning.validate import validate
from shardyard.core.errors import UserError
from shardyard.models.loss import causal_lm_loss
from shardyard.testing import compose


def saved_by(model, run):
    """Bytes of the tensors autograd saves for backward while ``run()`` computes, each storage once, ``model``'s
    parameters excluded (they are model states)."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = [0]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes() > 0:
            seen.add(st.data_ptr())
            total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total[0]


def saved_bytes(model, x, autocast=False):
    """Bytes of the tensors autograd saves for backward in one forward + loss (``saved_by``)."""
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            causal_lm_loss(model, x, x)
    return saved_by(model, run)


def block_bytes(build, regime):
    """Per-block saved bytes per token: a 2-block model minus a 1-block model."""
    b, s = 2, 32
    out = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = build(layers)
        if regime == "half":
            model = model.to(torch.bfloat16)
        out.append(saved_bytes(model, torch.randint(0, 512, (b, s)), autocast=regime == "autocast"))
    return (out[1] - out[0]) / (b * s), model


LLAMA = dict(_target_="shardyard.models.build.llama", name="t", vocab_size=512, hidden_size=96, intermediate_size=200,
             num_heads=6, num_kv_heads=2)
V3 = dict(_target_="shardyard.models.build.deepseek_v3", name="t", vocab_size=512, hidden_size=96, intermediate_size=160,
          num_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
          n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=48)


def builder(spec):
    from omegaconf import OmegaConf

    from shardyard.models.build import call_builder

    return lambda layers: call_builder(OmegaConf.create({**spec, "num_layers": layers}))


@pytest.mark.parametrize("spec,regime,rel", [(LLAMA, "fp32", 0.0), (LLAMA, "autocast", 0.0), (LLAMA, "half", 0.0),
                                             (V3, "fp32", 0.03), (V3, "half", 0.05), (V3, "autocast", 0.05)])
def test_block_activations_equal_what_autograd_saves(spec, regime, rel):
    measured, model = block_bytes(builder(spec), regime)
    shape = model_shape(model)
    act = shape["activation_bytes_per_token"][regime]
    planned = act["max_block"]
    if regime == "autocast":  # autocast's bf16 weight copies are per block, not per token
        measured -= 2 * shape["block_params"] / shape["blocks"] / 64 if spec is LLAMA else 0
    assert planned == pytest.approx(measured, rel=rel, abs=8), (planned, measured)


@pytest.mark.parametrize("kv_heads", [2, 6])
def test_simulated_block_activations_equal_what_autograd_saves(kv_heads):
    """The dry run's LLaMA block (fake tensors, a GPU's attention) saves what the plan says, with grouped-query
    attention (2 key/value heads for 6) or without. On fake tensors transformers took the rows for packed ones and
    made a [rows, 1, T, T] causal mask a run does not make: with it SDPA saved K and V repeated for every query head
    (+4 (h - hkv) bytes per token) and the mask's additive copy (+2 T): 12% over the plan at 8192 tokens, h 4096,
    hkv 1024 (``simulation.unpacked_rows``, ``simulation.gpu_attention``). Measured as the growth from 64 to 128
    tokens (what fake mode copies of the weights, per block, cancels out; a mask's copy would add 2 x 192 bytes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardyard.planning.simulation import gpu_attention, unpacked_rows

    def saved(layers, tokens):
        model = builder({**LLAMA, "num_kv_heads": kv_heads})(layers).to(torch.bfloat16)
        seen, total = set(), [0]

        def pack(t):  # fake storages have no data_ptr: a storage is told by its _cdata
            st = t.untyped_storage()
            if st._cdata not in seen and st.nbytes() > 0:
                seen.add(st._cdata)
                total[0] += st.nbytes()
            return t

        with FakeTensorMode(allow_non_fake_inputs=True), unpacked_rows(), gpu_attention():
            x = torch.randint(0, 512, (1, tokens))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                causal_lm_loss(model, x, x)
        return total[0]

    per_block = {t: saved(2, t) - saved(1, t) for t in (64, 128)}
    measured = (per_block[128] - per_block[64]) / 64
    planned = model_shape(builder({**LLAMA, "num_kv_heads": kv_heads})(1))["activation_bytes_per_token"]["half"]
    planned = planned["max_block"]
    assert planned == pytest.approx(measured, abs=8), (planned, measured)


@pytest.mark.parametrize("regime", ["fp32", "autocast"])
@pytest.mark.parametrize("dropout", [0.05, 0.0])
def test_lora_block_activations_equal_what_autograd_saves(regime, dropout):
    """A LoRA block (adapters on every projection, a frozen base) keeps what the plan says: the full block's
    activations less what the frozen base does not keep, plus the adapters' own (their dropped inputs and masks,
    their low-rank outputs). The full block's are 20-30% off it either way (sft_tiny's dry run: +25%)."""
    from omegaconf import OmegaConf

    from shardyard.models.adapters import activation_bytes_per_token, apply

    peft = OmegaConf.create({"_target_": "shardyard.models.adapters.LoRA", "name": "lora", "r": 8, "alpha": 16,
                             "dropout": dropout, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"]})
    build = builder(LLAMA)
    per_block, model = block_bytes(lambda layers: apply(build(layers), peft, 0), regime)
    act = model_shape(model)["activation_bytes_per_token"][regime]
    keeps = activation_bytes_per_token(model)[regime]["cpu"] / act_blocks(model)
    planned = act["max_block"] - act["frozen_blocks"] / act_blocks(model) + keeps
    if regime == "autocast":  # each frozen linear keeps its weight's bf16 cast (the plan's copies), per block
        per_block -= 2 * model_shape(model)["block_params"] / act_blocks(model) / 64
    assert planned == pytest.approx(per_block, rel=0.06), (planned, per_block, act["max_block"])
    assert abs(act["max_block"] - per_block) > 0.15 * per_block or dropout == 0.0


def act_blocks(model):
    return model_shape(model)["blocks"]


def test_checkpointing_keeps_only_block_inputs():
    build = builder(LLAMA)
    out = []
    for layers in (1, 2):
        model = build(layers)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        out.append(saved_bytes(model, torch.randint(0, 512, (2, 32))))
    shape = model_shape(model)
    assert (out[1] - out[0]) / 64 == shape["activation_bytes_per_token"]["fp32"]["ckpt_per_block"]


def test_optimizer_probe():
    for option, expect in [("adamw", 8), ("sgd", 4)]:
        assert memory_plan.optimizer_bytes_per_param(compose([f"optim={option}"]).optim) == expect
    assert memory_plan.optimizer_bytes_per_param(compose(["optim=adafactor"]).optim) < 1


def deepseek7b(*extra):
    cfg = compose(["model=deepseek7b", "precision=bf16", *extra])
    return cfg, validate(cfg, None)


@pytest.mark.parametrize("offload", [False, True])
def test_deepspeed_estimators_agree(offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    hw = plan_hardware.named("8xH100-80GB", 2)
    for stage, backend in [(2, "zero2_offload" if offload else "zero2"), (3, "zero3_offload" if offload else "zero3")]:
        cfg, batch = deepseek7b(f"backend={backend}")
        e = memory_plan.estimate(cfg, batch, hw)
        P, shape = batch.model.params, batch.model.shape
        if stage == 2:
            _, gpu = estimate_zero2_model_states_mem_needs(P, 8, 2, cpu_offload=offload)
        else:
            _, gpu, _ = estimate_zero3_model_states_mem_needs(P, shape["max_module_params"], 8, 2, cpu_offload=offload,
                                                              cpu_offload_params=offload)
        ours = sum(e.device[k] for k in ("params", "grads", "optimizer", "master"))
        if stage == 3:  # theirs counts the largest module gathered (4 bytes x its parameters) in the states
            ours += 4 * shape["max_module_params"]
        assert ours == pytest.approx(gpu, rel=0.10), (backend, ours / 2**30, gpu / 2**30)


def test_hardware_names():
    hw = plan_hardware.named("8xh100", 2)
    assert (hw.name, hw.world, hw.device) == ("8xH100-80GB", 16, "cuda")
    with pytest.raises(UserError) as e:
        plan_hardware.named("8xH900", 1)
    assert e.value.key == "plan.hardware" and "H100-80GB" in e.value.paragraph()


def test_named_hardware_fixes_the_ranks_of_an_auto_launch():
    """`plan.only=true plan.hardware=8xH100-80GB backend=fsdp_tp backend.tp=8` on this box: nproc `auto` takes the
    named hardware's 8 GPUs per node (x plan.nodes), one layout is derived (tp 8 x FSDP 1) and planned; a tp that
    does not divide the world is refused with the layout's paragraph."""
    from shardyard.core.facts import from_json, to_json

    over = ["plan.only=true", "plan.hardware=8xH100-80GB", "backend=fsdp_tp", "backend.tp=8"]
    cfg = compose(over)
    p = validate(cfg, None)
    assert (p.world_size, p.nproc_per_node, p.nnodes) == (8, 8, 1)
    assert (p.dims.tp, p.dims.dp_shard, p.dims.dp_replicate, p.dims.pp, p.dp_size, p.model_parallel) == (8, 1, 1, 1, 1, 8)
    assert p.global_batch_size == p.micro_batch_size * p.grad_accum_steps  # one data-parallel replica
    assert memory_plan.estimate(cfg, p, plan_hardware.hardware(cfg, p)).fits
    assert from_json(to_json(p)) == p  # plan.json rebuilds the layout
    two = validate(compose([*over, "plan.nodes=2"]), None)
    assert (two.world_size, two.nnodes, two.dims.tp, two.dims.dp_shard) == (16, 2, 8, 2)
    with pytest.raises(UserError) as e:
        validate(compose([*over[:-1], "backend.tp=3"]), None)
    assert e.value.key == "backend.tp" and e.value.value == 3
    assert "world size 8 must be a multiple" in e.value.problem and "tensor parallel x pipeline stages = 3" in e.value.problem


def test_every_engine_shards_as_its_paper_says():
    """Per-rank model states fall with N exactly where the engine shards (ZeRO paper's table)."""
    for backend, sharded in [("ddp", ()), ("zero1", ("optimizer",)), ("zero2", ("grads", "optimizer")),
                             ("zero3", ("params", "grads", "optimizer")), ("fsdp", ("params", "grads", "optimizer"))]:
        cfg, batch = deepseek7b(f"backend={backend}")
        a = memory_plan.estimate(cfg, batch, plan_hardware.named("8xH100-80GB", 1)).model_states
        b = memory_plan.estimate(cfg, batch, plan_hardware.named("8xH100-80GB", 2)).model_states
        for k in ("params", "grads", "optimizer"):
            if k in sharded:
                assert b[k] < a[k], (backend, k)
            elif backend != "zero1" or k != "grads":
                assert b[k] == a[k], (backend, k)


def test_hsdp_shards_over_its_group_and_sends_a_shards_gradients_across_the_copies():
    """HSDP (backend.replicate=2) on 2 nodes of 8 holds what FSDP holds on one node's 8 ranks (its shard group),
    not FSDP's 16-way shards, and each reduction also all-reduces the fp32 gradient shard across the copies
    (ring: 2 x 4 x P / 8 bytes sent, every micro-batch by default)."""
    cfg, batch = deepseek7b("backend=fsdp")
    hsdp_cfg, hsdp_batch = deepseek7b("backend=fsdp", "backend.replicate=2", "launch.nproc_per_node=2")
    one_node = memory_plan.estimate(cfg, batch, plan_hardware.named("8xH100-80GB", 1))
    two_nodes = memory_plan.estimate(cfg, batch, plan_hardware.named("8xH100-80GB", 2))
    hsdp = memory_plan.estimate(hsdp_cfg, hsdp_batch, plan_hardware.named("8xH100-80GB", 2))
    for k in ("params", "grads", "optimizer"):
        assert hsdp.model_states[k] == one_node.model_states[k] > two_nodes.model_states[k], k
    from shardyard.backends.fsdp import FSDPBackend

    P, shape = batch.facts.params, batch.facts.shape
    plain8, hsdp16 = (FSDPBackend.model_states(c, P, world, shape, 12.0) for c, world in ((cfg, 8), (hsdp_cfg, 16)))
    assert hsdp16.comm_per_micro - plain8.comm_per_micro == pytest.approx(2 * 4 * P / 8, rel=1e-12)
    assert hsdp16.comm_per_step == plain8.comm_per_step == 0.0


def test_fsdp_gradients_overlap_activations_or_accumulate_unsharded():
    """Without accumulation FSDP's gradients (freed by every step) grow as the activations shrink, so the
    peak counts the larger; FSDP's backward-only buffers (its gradients before their reduce-scatter, the root's
    reduced last) never meet the activations either, with or without accumulation; reducing once per step keeps
    the whole model's unsharded fp32 gradients while accumulating, and reducing every micro-batch sends more
    instead."""
    hw = plan_hardware.named("8xH100-80GB", 1)

    def plan(*extra):
        cfg, batch = deepseek7b("backend=fsdp", "train.micro_batch_size=1", *extra)
        return memory_plan.estimate(cfg, batch, hw), batch.model.params

    one, P = plan("train.global_batch_size=8")
    every, _ = plan("train.global_batch_size=32")
    once, _ = plan("train.global_batch_size=32", "backend.reduce_every_micro_batch=false")
    assert one.grad_accum == 1 and every.grad_accum == once.grad_accum == 4
    apart = every.overlap  # with accumulation, only the buffers that never meet the activations' peak
    assert 0 < apart < every.device["buffers"] and apart <= every.device["activations"]
    acts = one.device["activations"]
    assert one.overlap == min(min(one.device["grads"], acts) + apart, acts) >= apart
    assert one.device_peak == sum(one.device.values()) - one.overlap
    assert every.device["grads"] == one.device["grads"] == 4 * P / 8
    assert once.device["grads"] - every.device["grads"] == 4 * P
    assert once.comm_bytes < every.comm_bytes


def test_tensor_and_pipeline_parallel_divide_what_they_split():
    """fsdp_tp: FSDP's figures for a 1/tp slice over world/tp ranks, and 1/tp of the activations. pipeline: every
    stage planned (its layers, 1/stages of the blocks plus the embedding or the head, over world/stages ranks),
    the activations of its micro-batches in flight (every one under GPipe, stages - s under 1F1B), one block
    recomputed for one pipeline micro-batch, the loss's logits on the last stage only (all micro-batches' under
    GPipe, one under 1F1B), the logits and the recomputed block never together."""
    hw = plan_hardware.named("8xH100-80GB", 1)
    mbs = ["train.micro_batch_size=4", "train.global_batch_size=32", "launch.nproc_per_node=8"]
    fsdp_cfg, batch = deepseek7b("backend=fsdp", *mbs)
    fsdp = memory_plan.estimate(fsdp_cfg, batch, hw)
    P, shape = batch.model.params, batch.model.shape
    for tp in (2, 8):
        e = memory_plan.estimate(deepseek7b("backend=fsdp_tp", f"backend.tp={tp}", *mbs)[0], batch, hw)
        assert e.device["params"] == pytest.approx(4 * P / 8, rel=1e-6)  # 1/tp of the model on 8/tp ranks
        assert e.device["activations"] == pytest.approx(fsdp.device["activations"] / tp, rel=1e-9)
        assert e.grad_accum == 32 // (4 * (8 // tp))  # accumulation over the data-parallel ranks only
    stage = shape["block_params"] / 2 + shape["root_params"] / 2
    kept, recomputed, loss, _ = memory_plan._activation_parts(shape, "half", 4 * batch.seq_len, "full", 1.0)
    # beside them the edges torch's PipelineStage allocates, in hidden states of one pipeline micro-batch (h x bf16
    # x its seq_len tokens): the first stage 4 output-gradient buffers (one per pipeline micro-batch) and its outputs
    # in flight; the last 4 input buffers and the input gradient being sent, less those in flight (its first layer's
    # inputs, in its kept activations); and the root's gradient made in backward: the embedding's on the first stage,
    # the head's on the last
    edge = 2 * shape["hidden"] * batch.seq_len
    root = 2 * shape["root_params"] / 2
    expected = {"gpipe": [kept / 2 + recomputed / 4 + (4 + 4) * edge + 1.36 * root,  # 4 of 4 in flight
                          kept / 2 + max(recomputed / 4, loss) + (4 + 1 - 4) * edge + 3.13 * root],
                "1f1b": [kept / 4 + recomputed / 4 + (4 + 2) * edge + 1.36 * root,  # 2, then 1
                         kept / 8 + max(recomputed / 4, loss / 4) + (4 + 1 - 1) * edge + 3.13 * root]}
    for schedule in ("gpipe", "1f1b"):
        cfg, _ = deepseek7b("backend=pipeline", "backend.stages=2", f"backend.schedule={schedule}",
                            "backend.microbatches=4", *mbs)
        kinds = memory_plan.estimate_kinds(cfg, batch, hw)
        assert len(kinds) == 2 and memory_plan.estimate(cfg, batch, hw) in kinds
        for e, acts in zip(kinds, expected[schedule]):
            assert e.device["params"] == pytest.approx(4 * int(stage) / 4, rel=1e-6)  # FSDP over 4 ranks per stage
            assert e.device["activations"] == pytest.approx(acts, rel=1e-9)


def test_background_saves_stage_params_and_optimizer_in_the_host_column_and_are_refused_where_it_does_not_fit():
    """``checkpoint.async_save``: the host copy a background save writes from is each rank's parameters (fp32) and
    AdamW's two moments, 12 bytes a parameter of what the rank holds: the whole model under DDP, 1/8 under FSDP
    on 8 ranks, in the host column (on CPU in the one pool). A run that fits without it and not with it is
    refused naming checkpoint.async_save, the copy per rank and per node, and the node's host RAM."""
    GiB = 2 ** 30
    hw = plan_hardware.named("8xH100-80GB", 1)
    for backend, share in [("ddp", 1), ("fsdp", 8)]:
        cfg, batch = deepseek7b(f"backend={backend}", "checkpoint.async_save=true")
        P = batch.facts.params
        e = memory_plan.estimate(cfg, batch, hw)
        assert e.host == {"checkpoint_staging": 12 * P / share}, (backend, e.host)  # fp32 params 4P + AdamW 8P
        assert f"plan per rank in host RAM: {12 * P / share / GiB:.2f} GiB (background save staging" in \
            memory_plan.describe(e, hw)
        off = memory_plan.estimate(*deepseek7b(f"backend={backend}"), hw)
        assert off.host == {} and off.device == e.device
    cpu = plan_hardware.named("2xcpu", 1)  # one pool: the device is host RAM
    cfg, batch = deepseek7b("backend=ddp", "checkpoint.async_save=true")
    assert memory_plan.estimate(cfg, batch, cpu).device["checkpoint_staging"] == 12 * batch.facts.params
    # 2 GPUs of 48 GB with 192 GiB of host RAM: FSDP's offloaded shards (16 bytes a parameter) fit there, the
    # shards and the staged copy (12 more) do not.
    over = ["backend=fsdp_offload", "plan.hardware=2xL40S-48GB"]
    assert plan_search.before_launch(*deepseek7b(*over)) is not None
    with pytest.raises(UserError) as err:
        plan_search.before_launch(*deepseek7b(*over, "checkpoint.async_save=true"))
    P, text = batch.facts.params, " ".join(err.value.paragraph().split())
    assert err.value.key == "checkpoint.async_save", text
    assert f"{6 * P / GiB:.1f} GiB per rank, {12 * P / GiB:.1f} GiB for the 2 rank(s) of a node" in text, text
    assert f"that is {28 * P / GiB:.1f} GiB of host RAM per node, and 2xL40S-48GB has 192.0 GiB" in text, text


def test_plan_only_plans_the_nodes_named_whatever_the_launch_says():
    """`model=deepseek7b backend=fsdp launch.nproc_per_node=8 plan.only=true plan.hardware=8xH100-80GB
    plan.nodes=16`: the launch's 8 processes do not make it one node of 8 GPUs; the plan is of 16 x 8 ranks, as
    with launch.nproc_per_node=auto (issue 54, point 7)."""
    named = ["model=deepseek7b", "backend=fsdp", "launch.nproc_per_node=8", "train.grad_accum_steps=4",
             "plan.only=true", "plan.hardware=8xH100-80GB", "plan.nodes=16"]
    cfg = compose(named)
    p = validate(cfg, None)
    auto = validate(compose([*named, "launch.nproc_per_node=auto"]), None)
    assert (p.world_size, p.nnodes, p.nproc_per_node, p.dims.dp_shard) == (128, 16, 8, 128)
    assert (p.world_size, p.grad_accum_steps, p.global_batch_size) == \
        (auto.world_size, auto.grad_accum_steps, auto.global_batch_size)
    assert memory_plan.estimate(cfg, p, plan_hardware.hardware(cfg, p)).world == 128


V3_EP = ["recipe=deepseek_v3_pipeline_ep", "plan.hardware=8xH200-141GB"]


@pytest.mark.parametrize("mode", ["plan.dry_run=true", "plan.only=true"])
@pytest.mark.parametrize("override,key", [("plan.nodes=0", "plan.nodes"), ("plan.nodes=-2", "plan.nodes"),
                                          ("plan.hardware=0xH200-141GB", "plan.hardware"),
                                          ("plan.hardware=0xcpu", "plan.hardware"),
                                          ("plan.hardware=8xH900", "plan.hardware")])
def test_bad_plan_values_are_blamed_on_their_own_key(mode, override, key):
    """A node count of 0 or below, or a hardware string of 0 devices per node, is a world of 0 ranks: refused
    naming plan.nodes / plan.hardware, not the first degree that cannot divide it (it was backend.stages or
    backend.ep); a GPU the plan does not know is named before the layout it would hold is judged."""
    with pytest.raises(UserError) as e:
        validate(compose([*V3_EP, mode, override]), None)
    assert e.value.key == key, e.value.paragraph()


@pytest.mark.parametrize("mode", ["plan.dry_run=true", "plan.only=true"])
def test_a_node_count_no_layout_can_use_names_those_that_can(mode):
    """deepseek_v3_pipeline_ep (8 stages x ep 16, global batch 1024 of micro batches of 16) can use 16, 32 and 64
    nodes of 8 GPUs, and no other count: asked for 2, or 40, the refusal names plan.nodes and those three,
    searched over every count the global batch allows (the search stopped at 4x the count given, so 2 found none
    and the global batch or backend.ep was blamed)."""
    for nodes in (2, 40):
        with pytest.raises(UserError) as e:
            validate(compose([*V3_EP, mode, f"plan.nodes={nodes}"]), None)
        assert (e.value.key, e.value.value) == ("plan.nodes", nodes), e.value.paragraph()
        assert "Use plan.nodes in [16, 32, 64]" in " ".join(e.value.paragraph().split())
    # by hand: pp 8 x dp; ep 16 divides dp; micro batch 16 x dp divides 1024: dp in {16, 32, 64}, nodes = dp
    cfg = compose([*V3_EP, mode])
    assert cfg.train.global_batch_size == 1024 and cfg.train.micro_batch_size == 16
    assert (cfg.backend.stages, cfg.backend.ep) == (8, 16)
    assert validate(compose([*V3_EP, mode, "plan.nodes=64"]), None).world_size == 512


def test_the_plan_names_the_nodes_that_fit_among_those_allowed():
    """At 16 nodes of H200 deepseek_v3_pipeline_ep does not fit (152 GiB on its last stage); the fewest nodes
    that fit, among the counts its layout allows (multiples of 16: 8 stages x ep 16 over 8 GPUs), are 32, as
    plan.only's table says; with the global batch a constraint too (the dry run's advice), 32 as well; and
    the search starts at the count given."""
    cfg = compose([*V3_EP, "plan.only=true", "plan.nodes=16"])
    batch = validate(cfg, None)
    hw = plan_hardware.hardware(cfg, batch)
    assert not memory_plan.estimate(cfg, batch, hw).fits
    assert memory_plan.nodes_needed(cfg, batch, hw) == 32
    assert memory_plan.nodes_needed(cfg, batch, hw, whole_batch=True) == 32
    assert memory_plan.estimate(cfg, batch, plan_hardware.named("8xH200-141GB", 32)).fits
    assert memory_plan.nodes_needed(cfg, batch, plan_hardware.named("8xH200-141GB", 48)) == 48
    assert memory_plan.nodes_needed(cfg, batch, plan_hardware.named("8xH200-141GB", 40)) == 48  # 40: not allowed


def test_a_smoke_dry_run_is_refused_for_what_it_is():
    """`+scale=smoke` drops the named hardware (it runs here): a dry run of it was refused for a plan.hardware
    'missing' that the user had given. It is refused for the contradiction, naming both."""
    from shardyard.planning import scale

    cfg = compose(["recipe=deepseek_tiny_fsdp2", "+scale=smoke", "plan.dry_run=true", "plan.hardware=8xH100-80GB"])
    with pytest.raises(UserError) as e:
        scale.apply(cfg)
        validate(cfg, None)
    text = e.value.paragraph()
    assert e.value.key == "plan.dry_run" and "+scale=smoke" in text and "names none" not in text, text
