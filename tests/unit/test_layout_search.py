"""The layout search (``plan.search=true``, issue 57 points 2-5): the step-time model against published runs, a
search whose fastest layout is known by construction, the winner's dry run, and the refusals (exit 2's UserError)."""

import dataclasses

import pytest

from shardyard.core.errors import UserError
from shardyard.planning import dryrun, layouts, steptime
from shardyard.planning import hardware as plan_hardware
from shardyard.planning import plan as memory_plan
from shardyard.planning.validate import validate
from shardyard.testing import compose

# torchtitan (arXiv 2410.06511, Table 1; its docs/performance.md): Llama 3.1 8B on 8 H100 (96 GB HBM2e, 500 W), FSDP,
# bf16, seq 8,192, local batch 2, selective activation checkpointing, no compile: 5,762 tokens/s/GPU. The model is
# built from Llama 3.1 8B's published shape (hidden 4,096, MLP 14,336, 32 layers, 32 heads, 8 key/value heads,
# vocabulary 128,256) on the LLaMA builder.
LLAMA31_8B = ["model=deepseek7b", "model.vocab_size=128256", "model.hidden_size=4096", "model.intermediate_size=14336",
              "model.num_layers=32", "model.num_heads=32", "+model.num_kv_heads=8",
              "model.max_position_embeddings=8192", "data.seq_len=8192", "train.micro_batch_size=2", "backend=fsdp",
              "precision=bf16", "model.activation_checkpointing=selective", "plan.hardware=8xH100-96GB-500W"]
# llm-foundry's MPT-1B on 8 H100-80GB (scripts/train/benchmarking/README.md): seq 2,048, micro batch 14, FSDP full
# shard, bf16, no checkpointing, 41.82% MFU = 45,455 tokens/s/GPU. MPT's block (d 2,048, 24 layers, 16 heads, a 4d
# GELU MLP, vocabulary 50,368) as a LLaMA block of the same parameters and FLOPs (a SwiGLU MLP of 8d/3).
MPT_1B = ["model=deepseek7b", "model.vocab_size=50368", "model.hidden_size=2048", "model.intermediate_size=5461",
          "model.num_layers=24", "model.num_heads=16", "model.max_position_embeddings=2048", "data.seq_len=2048",
          "train.micro_batch_size=14", "backend=fsdp", "precision=bf16", "model.activation_checkpointing=false",
          "plan.hardware=8xH100-80GB"]
OPTIONS = ["ddp", "fsdp", "fsdp_offload", "fsdp_tp", "horovod", "pipeline", "single", "zero1", "zero2",
           "zero2_offload", "zero3", "zero3_offload", "zero_infinity"]


def planned(overrides):
    cfg = compose([*overrides, "plan.search=true", "backend.device=cpu"])
    batch = validate(cfg, None)
    return cfg, batch, plan_hardware.hardware(cfg, batch)


# torchtitan's Llama 3 on 64 A100-80GB (8 nodes; its docs/performance.md): FSDP, local batch 1 (global 64), seq 8,192;
# 8B with selective op checkpointing 2,973 tokens/s/GPU (A100's matmul efficiency is fitted to it: its row holds the
# fit, the 70B's is the independent check), 70B (hidden
# 8,192, MLP 28,672, 80 layers, 64 heads, 8 key/value heads) with full checkpointing 331.
A100_64 = ["plan.hardware=8xA100-80GB", "plan.nodes=8", "train.micro_batch_size=1", "train.global_batch_size=64"]
LLAMA3_8B_A100 = [*(o for o in LLAMA31_8B if not o.startswith(("plan.hardware", "train.micro_batch_size"))), *A100_64]
LLAMA3_70B_A100 = [*(o for o in LLAMA3_8B_A100 if not o.startswith(("model.hidden_size", "model.intermediate_size",
                                                                      "model.num_layers", "model.num_heads",
                                                                      "model.activation_checkpointing"))),
                   "model.hidden_size=8192", "model.intermediate_size=28672", "model.num_layers=80",
                   "model.num_heads=64", "model.activation_checkpointing=full"]


@pytest.mark.parametrize("overrides,published", [(LLAMA31_8B, 5762), (MPT_1B, 45455), (LLAMA3_8B_A100, 2973),
                                                 (LLAMA3_70B_A100, 331)],
                         ids=["torchtitan-8B", "mpt-1B", "torchtitan-8B-64xA100", "torchtitan-70B-64xA100"])
def test_the_predictions_are_within_15_percent_of_the_published_runs(overrides, published):
    cfg, batch, hw = planned(overrides)
    t = steptime.predict(cfg, batch, hw, batch.grad_accum_steps)
    assert t is not None and t.tokens_per_s_per_gpu == pytest.approx(published, rel=0.15), t.tokens_per_s_per_gpu
    assert t.bottleneck == "compute"  # one node's NVLink hides FSDP's gathers behind these steps


LAYOUT_KEYS = ("backend=", "train.micro_batch_size=", "model.activation_checkpointing=")


@pytest.mark.parametrize("published,gbs", [(LLAMA31_8B, 16), (MPT_1B, 112)], ids=["torchtitan-8B", "mpt-1B"])
def test_the_published_layout_or_one_predicted_as_fast_is_among_the_top_three(published, gbs):
    """Issue 57, point 4: searched with only the published run's model, sequence, precision, hardware and global
    batch (8 GPUs x local batch 2 = 16; 8 x 14 = 112), the top three are predicted as fast as the published layout
    (within 1%) or faster. Neither published layout fits this repo's implementation beside the plan's headroom (90%
    of the GPU), and the plan says so: torchtitan's FSDP, micro batch 2, selective, 87.8 GiB of 95.1 (this repo's
    selective keeps every matmul's output, torchtitan's every second); llm-foundry's micro batch 14 without
    checkpointing (MPT's 4d GELU MLP modelled as a SwiGLU of 8d/3 keeps more, and SDPA beside its flash kernels).
    The search's micro batches are every divisor of the share (7 and 14 of MPT's 14 too, not powers of two only:
    before, its best was micro batch 2, 0.7% slower than the published layout; now 7, 0.1%)."""
    free = [o for o in published if not o.startswith(LAYOUT_KEYS)] + [f"train.global_batch_size={gbs}"]
    cfg, batch, hw = planned([*free, "train.micro_batch_size=1"])
    found = layouts.search(cfg, batch, hw, {}, OPTIONS,
                           lambda extra: compose([*free, "train.micro_batch_size=1", *extra, "plan.search=true",
                                                  "backend.device=cpu"]))
    pcfg, pbatch, phw = planned([*published, f"train.global_batch_size={gbs}"])
    theirs = steptime.predict(pcfg, pbatch, phw, pbatch.grad_accum_steps).step_s
    top = found[:3]
    assert len(found) > 100 and all(lay.time.step_s <= 1.01 * theirs for lay in top), \
        [(lay.overrides, lay.time.step_s) for lay in top] + [theirs]
    e = memory_plan.estimate(pcfg, pbatch, phw)
    assert not e.fits and e.device_peak > 0.9 * phw.device_bytes, e.device_peak
    layout = {o.replace("checkpointing=false", "checkpointing=none") for o in published if o.startswith(LAYOUT_KEYS)}
    assert len(layout) == 3 and not [lay for lay in found if set(lay.overrides) == layout]
    if published is MPT_1B:
        assert "train.micro_batch_size=7" in top[0].overrides, top[0].overrides


def test_the_500w_part_is_not_the_80gb_part():
    """The torchtitan part's lower peak stays in its own row: the same run on H100-80GB is predicted faster."""
    slow, fast = planned(LLAMA31_8B), planned([*LLAMA31_8B, "plan.hardware=8xH100-80GB"])
    rate = [steptime.predict(cfg, b, hw, b.grad_accum_steps).tokens_per_s_per_gpu for cfg, b, hw in (slow, fast)]
    assert rate[1] > 1.1 * rate[0], rate
    assert "500 W" in slow[2].source and "data sheet" in fast[2].source


TINY = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_layers=2", "model.num_heads=4",
        "data.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=16", "backend=fsdp"]


def test_a_slow_network_makes_the_layout_that_keeps_gathers_in_a_node_win():
    """2 nodes x 2 GPUs whose NICs move 1 MB/s: plain FSDP gathers and reduces every micro-batch over all 4 ranks,
    across the nodes; HSDP (replicate=2, a shard group per node) sends only each gradient shard's all-reduce
    across. By hand, per micro-batch: FSDP's ring moves 3/4 of (2 x 4P gathered + 4P reduced) bytes = 9P over the
    network, HSDP's all-reduce 2 x 1/2 of 4P/2 = 2P; compute and NVLink are negligible beside 1 MB/s."""
    cfg, batch, hw = planned([*TINY, "plan.hardware=2xH100-80GB", "plan.nodes=2"])
    slow = dataclasses.replace(hw, inter_bw=1e6)
    fixed = {"backend": "fsdp", "train.micro_batch_size": "4", "model.activation_checkpointing": "none"}
    found = layouts.search(cfg, batch, slow, fixed, OPTIONS, lambda extra: compose(extra))
    P, accum = batch.facts.params, 16 // (4 * 4)
    by = {" ".join(lay.overrides): lay.time for lay in found}
    hsdp = by["backend=fsdp backend.replicate=2 train.micro_batch_size=4 model.activation_checkpointing=none"]
    fsdp = by["backend=fsdp train.micro_batch_size=4 model.activation_checkpointing=none"]
    assert found[0].overrides[1] == "backend.replicate=2"
    assert hsdp.comm_s == pytest.approx(accum * 2 * P / 1e6, rel=0.02)
    assert fsdp.comm_s == pytest.approx(accum * 9 * P / 1e6, rel=0.02)
    assert "inter-node" in hsdp.bottleneck and "dp_replicate" in hsdp.bottleneck
    # with the network as fast as NVLink, crossing the nodes no longer costs the gathers their time
    fast = dataclasses.replace(hw, inter_bw=hw.intra_bw, inter_latency=hw.intra_latency)
    times = {" ".join(lay.overrides): lay.time.comm_s for lay in layouts.search(cfg, batch, fast, fixed, OPTIONS, compose)}
    assert max(times.values()) < 1e-2


SMALL = ["data.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=16", "backend=fsdp"]
"""The default deepseek_tiny, whose dry run agrees with the plan (TINY's buffers are too small to agree within 10%)."""


def test_the_winner_is_dry_run_before_it_is_printed(tmp_path, monkeypatch, capsys):
    """The search's first choice runs the dry run (its engine's own prepare on fake tensors at the world); one the
    dry run refuses is not the winner: the next is dry-run in its place."""
    cfg, batch, hw = planned([*SMALL, "plan.hardware=2xH100-80GB", "plan.search_top=3"])
    cfg.run_dir = str(tmp_path)
    fixed = {"backend": "fsdp", "model.activation_checkpointing": "none"}
    ran = []
    real = dryrun.main

    def refuse_the_first(c, b):
        ran.append(c.train.micro_batch_size)
        return 1 if len(ran) == 1 else real(c, b)

    monkeypatch.setattr(dryrun, "main", refuse_the_first)
    text = layouts.report(cfg, batch, hw, fixed, OPTIONS, compose)
    first, second = layouts.search(cfg, batch, hw, fixed, OPTIONS, compose)[:2]
    assert len(ran) == 2 and ran == [first.cfg.train.micro_batch_size, second.cfg.train.micro_batch_size]
    assert "dry run of fsdp at world 2" in capsys.readouterr().out  # the real dry run ran for the second
    assert f"winner (checked by a dry run: it fits as measured and agrees with the plan): {' '.join(second.overrides)}" in text
    saved = (tmp_path / "layout.yaml").read_text()
    assert all(o in saved for o in second.overrides) and "paste" in saved


def test_a_search_needs_the_hardware_it_ranks_for():
    with pytest.raises(UserError) as e:
        validate(compose([*TINY, "plan.search=true"]), None)
    assert e.value.key == "plan.search" and "plan.hardware" in e.value.fix


def test_a_node_count_where_nothing_fits_names_the_fewest_that_do():
    """DeepSeek-7B under FSDP on one 40 GB A100 per node: no layout fits one node; the refusal names the fewest
    nodes on which FSDP's leanest layout fits, as the plan's own node search finds them for that layout."""
    cfg, batch, hw = planned(["model=deepseek7b", "plan.hardware=1xA100-40GB", "precision=bf16"])
    with pytest.raises(UserError) as e:
        layouts.report(cfg, batch, hw, {"backend": "fsdp"}, OPTIONS, compose, dry_run=lambda lay: True)
    lean = compose(["model=deepseek7b", "backend=fsdp", "precision=bf16", "plan.hardware=1xA100-40GB",
                    "train.micro_batch_size=1", "model.activation_checkpointing=full", "backend.device=cpu"])
    least = memory_plan.nodes_needed(lean, dataclasses.replace(batch, micro_batch_size=1), hw)
    assert least and least > 1
    assert e.value.key == "plan.nodes" and e.value.value == 1 and f"plan.nodes={least}" in e.value.fix


@pytest.mark.parametrize("fixed,key", [({"backend.tp": "2", "backend.stages": "2"}, "backend.stages"),
                                       ({"backend.replicate": "4", "backend.tp": "8"}, "backend.replicate"),
                                       ({"backend.replicate": "2", "backend.ep": "4", "backend.tp": "4"}, None),
                                       ({"backend.replicate": "3"}, "backend.replicate"),
                                       ({"backend.stages": "4", "backend.replicate": "1"}, None)])
def test_degrees_fixed_on_the_command_line_that_contradict_each_other(fixed, key):
    if key is None:
        layouts.check_fixed(fixed, 16)  # they compose on 16 ranks: nothing to refuse
        return
    with pytest.raises(UserError) as e:
        layouts.check_fixed(fixed, 16)
    assert e.value.key == key


def test_fixed_keys_are_read_from_the_overrides():
    assert layouts.fixed_keys(["model=deepseek7b", "backend=fsdp_tp", "backend.tp=4", "+train.micro_batch_size=2",
                               "plan.search=true"]) == {"backend": "fsdp_tp", "backend.tp": "4",
                                                        "train.micro_batch_size": "2"}


def test_the_micro_batch_not_on_the_command_line_is_the_searchs_to_choose():
    """torchtitan's global batch of 16 on 8 GPUs beside the recipe's micro batch of 16: the search refused to start
    (train.global_batch_size, 16 not a multiple of 128) though the micro batch was its to choose. Unless the command
    line fixes it, 1 stands in for it, and the search ranks every micro batch that divides (the test above)."""
    cfg = compose(["train.global_batch_size=16", "plan.search=true", "plan.hardware=8xH100-80GB", "backend=fsdp",
                   "backend.device=cpu"])
    assert cfg.train.micro_batch_size == 16
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == "train.global_batch_size"
    layouts.free_micro_batch(cfg, {"train.micro_batch_size": "16"}, 8)  # fixed by the user: their error stands
    assert cfg.train.micro_batch_size == 16
    layouts.free_micro_batch(cfg, {}, 8)
    assert cfg.train.micro_batch_size == 1 and validate(cfg, None).global_batch_size == 16


LONG = ["model=deepseek7b", "backend=fsdp", "precision=bf16", "data.seq_len=131072", "model.max_position_embeddings=131072",
        "model.rope_scaling={type: yarn, factor: 32, original_max_position_embeddings: 4096}",
        "train.micro_batch_size=1", "train.global_batch_size=8", "plan.hardware=8xH100-80GB"]


def test_a_sequence_too_long_for_one_rank_is_searched_with_sequence_groups():
    """DeepSeek-7B at 128K tokens a sequence on one node of 8 H100s under FSDP (issue 56): no layout holding a whole
    sequence per rank fits, so every layout the search keeps splits it, over a Ulysses sequence group (backend.sp)
    or an all-gather context parallel group (backend.cp), at micro batch 1, and both kinds are among them; the best
    sp layout's all-to-alls, by hand: per micro-batch 8 per block (q, k, v, out, forward and backward), each of the
    rank's T/sp tokens x hidden x 2 bytes, (sp - 1)/sp leaving the rank over NVLink, plus each call's latency, on
    the critical path."""
    cfg, batch, hw = planned(LONG)
    found = layouts.search(cfg, batch, hw, {"backend": "fsdp"}, OPTIONS, compose)
    kinds = [{o.split("=")[0] for o in lay.overrides} & {"backend.sp", "backend.cp"} for lay in found]
    assert found and all(len(k) == 1 for k in kinds), [lay.overrides for lay in found[:5]]
    assert {"backend.sp"} in kinds and {"backend.cp"} in kinds
    assert all("train.micro_batch_size=1" in lay.overrides for lay in found)
    best = next(lay for lay, k in zip(found, kinds) if k == {"backend.sp"})
    sp = int(next(o for o in best.overrides if o.startswith("backend.sp=")).split("=")[1])
    h, blocks, accum = 4096, 30, 8 // (8 // sp)
    calls = 8 * blocks
    per_micro = 8 * blocks * (131072 / sp) * h * 2 * (sp - 1) / sp / hw.intra_bw \
        + calls * (steptime.NCCL_BASE_S + hw.intra_latency)
    assert best.time.parts["all-to-all over sp (intra-node)"] == pytest.approx(accum * per_micro, rel=1e-6)


def test_hsdp_copies_are_searched_beside_tp_and_stages_as_whole_nodes():
    """Issue 57: on 4 nodes of 8, fsdp_tp and pipeline get HSDP copies too, each copy's shard group (with its tp
    ranks) whole nodes: tp 2 and tp 8 with 2 and 4 copies (32 / (tp x copies) shards x tp ranks, a multiple of 8),
    2 stages with 2 copies (8 shards a copy: a node), not with 4 (4 shards), nor 4 stages with 2. The old search
    gave copies to plain FSDP only."""
    from shardyard.backends import engine

    cfg, batch, hw = planned(["model=deepseek7b", "plan.hardware=8xH100-80GB", "plan.nodes=4", "precision=bf16"])
    tp = layouts._degrees(compose(["model=deepseek7b", "backend=fsdp_tp"]), batch, hw, {})
    assert {(d["tp"], d.get("replicate", 1)) for d in tp} >= {(2, 1), (2, 2), (2, 4), (8, 2), (8, 4)}, tp
    pp = layouts._degrees(compose(["model=deepseek7b", "backend=pipeline"]), batch, hw, {})
    copies = {(d["stages"], d.get("replicate", 1)) for d in pp}
    assert (2, 2) in copies and (2, 4) not in copies and (4, 2) not in copies, copies
    assert "backend.replicate" in engine(compose(["backend=pipeline"]).backend).degree_keys.values()
