"""The dry run (``plan.dry_run=true``, issue 40): the engine's own prepare and a step on a fake process group and
fake tensors, set beside the plan. What each recipe's dry run says is tests/e2e/test_recipes.py's (but the two run
here: ZERO_TINY); the simulation against a real 4-rank gloo run is tests/dist/test_model_states.py's. Here: that it
can fail, and its refusals."""

import pytest
from omegaconf import open_dict

from shardyard.planning import dryrun
from shardyard.planning import simulation
from shardyard.planning import plan as memory_plan
from shardyard.planning import hardware as plan_hardware
from shardyard.core.errors import UserError
from shardyard.testing import compose
from shardyard.planning.validate import validate

TINY = ["recipe=deepseek_tiny_fsdp2", "plan.dry_run=true", "plan.hardware=2xcpu"]
ZERO_TINY = ["recipe=deepseek_tiny_zero3", "plan.dry_run=true", "plan.hardware=2xcpu"]
"""The dry runs of deepseek_tiny_fsdp2 and deepseek_tiny_zero3 at their headers' size: tests/e2e/test_recipes.py leaves
those recipes' dry runs to the two tests here that run them (and holds these lists to their headers)."""


@pytest.fixture(scope="module", autouse=True)
def simulated_once():
    """Each simulation this module asks for again is run once: TINY's rank 0 (the plan's two verdicts, and FSDP's
    alike shards), the HSDP rank that test's ``dryrun.main`` simulates after the test itself. ``simulate`` reads its
    arguments alone (the config, the batch made from it, the role's rank, its flags), never the plan the tests
    break on purpose: a repeat measures the same figures. A test that replaces ``simulate`` replaces this too."""
    import inspect

    from omegaconf import OmegaConf

    real, seen = simulation.simulate, {}
    signature = inspect.signature(real)

    def memo(cfg, batch, role, *args, **kwargs):
        bound = signature.bind(cfg, batch, role, *args, **kwargs)
        bound.apply_defaults()  # `replica=False` said or not: one simulation
        flags = tuple((k, v) for k, v in bound.arguments.items() if k not in ("cfg", "batch", "role"))
        key = (OmegaConf.to_yaml(cfg), repr(batch), role.rank, role.kind, flags)
        if key not in seen:
            seen[key] = real(cfg, batch, role, *args, **kwargs)
        return dict(seen[key])  # the caller's own copy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulation, "simulate", memo)
        yield


def test_a_plan_broken_on_purpose_exits_1(monkeypatch, capsys):
    """The same dry run agrees (0) with the plan as it is and disagrees (1) once the plan's optimizer-state factor
    is wrong by half: the comparison is what decides, not the run finishing (both verdicts on one simulation,
    ``simulated_once``: it reads nothing of the plan)."""
    cfg = compose(TINY)
    batch = validate(cfg, None)
    assert dryrun.main(cfg, batch) == 0
    assert "every figure within 10%" in capsys.readouterr().out
    real = memory_plan.optimizer_bytes_per_param
    monkeypatch.setattr(memory_plan, "optimizer_bytes_per_param", lambda o: 1.5 * real(o))  # AdamW: 12, not 8
    assert dryrun.main(cfg, batch) == 1
    out = capsys.readouterr().out
    assert "DISAGREES" in out and "furthest off: optimizer" in out, out


def test_a_layout_that_cannot_use_the_nodes_names_plan_nodes():
    """256 ranks would fit deepseek_v3_pipeline_ep; 264 (33 nodes) cannot hold 8 stages x ep 16 over its batch."""
    with pytest.raises(UserError) as e:
        validate(compose(["recipe=deepseek_v3_pipeline_ep", "plan.dry_run=true", "plan.hardware=8xH200-141GB",
                          "plan.nodes=33"]), None)
    assert e.value.key == "plan.nodes" and e.value.value == 33
    assert "[16, 32, 64]" in e.value.paragraph()  # the node counts that can


def test_an_impossible_layout_at_256_ranks_names_its_key():
    """At deepseek_v3_pipeline_ep's own 256 ranks, 7 pipeline stages cannot divide the world: the node counts that
    7 stages can use are named; 3-way expert parallelism can use none (256 experts), and its own key is named."""
    with pytest.raises(UserError) as e:
        validate(compose(["recipe=deepseek_v3_pipeline_ep", "plan.dry_run=true", "plan.hardware=8xH200-141GB",
                          "plan.nodes=32", "backend.stages=7"]), None)
    assert e.value.key == "plan.nodes" and "[14, 28, 56]" in e.value.paragraph()  # 7 stages x ep 16 x the batch
    with pytest.raises(UserError) as e:
        validate(compose(["recipe=deepseek_v3_pipeline_ep", "plan.dry_run=true", "plan.hardware=8xH200-141GB",
                          "plan.nodes=32", "backend.ep=3"]), None)
    assert e.value.key == "backend.ep" and e.value.value == 3


def test_a_dry_run_needs_the_hardware_it_simulates():
    with pytest.raises(UserError) as e:
        validate(compose(["recipe=deepseek_tiny_fsdp2", "plan.dry_run=true"]), None)
    assert e.value.key == "plan.dry_run" and "plan.hardware" in e.value.paragraph()


def test_an_engine_that_says_nothing_of_dry_runs_is_refused_with_those_that_can():
    cfg = compose(TINY)
    batch = validate(cfg, None)
    with open_dict(cfg):
        cfg.backend._target_ = "shardyard.backends.process_group.init_process_group"  # a user's, without `dry_run`
    with pytest.raises(UserError) as e:
        dryrun.main(cfg, batch)
    assert e.value.key == "backend" and "fsdp_tp, pipeline" in e.value.paragraph()


V3_EP = ["recipe=deepseek_v3_pipeline_ep", "plan.dry_run=true", "plan.hardware=8xH200-141GB"]


def test_a_dry_run_that_does_not_fit_exits_1_and_names_the_nodes_that_do(monkeypatch, capsys):
    """Issue 54, point 1: deepseek_v3_pipeline_ep on 16 nodes of H200 agrees with the plan and does not fit (the
    real simulation measures 145 GiB on the last stage of a 139.8 GiB GPU: tests/e2e/test_plan_e2e.py). Here each
    simulated rank measures exactly the plan's figures for its stage (the verdict is under test, not the
    simulation): every figure agrees, the last stage's 152 GiB + 1 GiB of CUDA runtime exceeds 90% of 139.8 GiB,
    so exit 1, saying it does not fit and naming 32 nodes, the count plan.only names; at 32 nodes, exit 0."""
    for nodes, code in ((16, 1), (32, 0)):
        cfg = compose([*V3_EP, f"plan.nodes={nodes}"])
        batch = validate(cfg, None)
        hw = plan_hardware.hardware(cfg, batch)
        kinds = memory_plan.estimate_kinds(cfg, batch, hw)
        monkeypatch.setattr(simulation, "simulate", lambda c, b, role, **kw: dryrun.planned(kinds[role.kind], hw))
        assert dryrun.main(cfg, batch) == code
        out = " ".join(capsys.readouterr().out.split())
        assert "agrees with the plan: yes, every figure within 10% of the plan" in out, out
        if code:
            assert "fits 16 node(s) of 8xH200-141GB: NO" in out and "125.8 GiB the plan may fill" in out, out
            assert "does not fit: dry-run plan.nodes=32" in out and "does not fit, exit 1" in out, out
        else:
            assert "fits 32 node(s) of 8xH200-141GB: yes" in out and "fits and agrees, exit 0" in out, out


def test_a_zero_dry_run_measures_the_activations(monkeypatch, capsys):
    """Issue 54, point 2: a ZeRO dry run compared only the model states with DeepSpeed's estimators and called every
    figure within 10%. It now runs one replica as ZeRO runs it (the model in the compute dtype, no autocast, the
    run's micro-batch and checkpointing) under fake tensors: the activations are measured and compared, and the
    figures it cannot measure are marked as not compared. With the plan's activations halved it exits 1, the
    activations named; as the plan is, 0."""
    cfg = compose(ZERO_TINY)
    batch = validate(cfg, None)
    real, seen = simulation.simulate, {}

    def once(*args, **kwargs):  # the simulation does not depend on the plan: run it once for both verdicts
        if "got" not in seen:
            seen["got"] = real(*args, **kwargs)
        return seen["got"]

    monkeypatch.setattr(simulation, "simulate", once)
    assert dryrun.main(cfg, batch) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "one replica, as ZeRO runs it" in line)
    cells = row.split(")")
    assert [c.strip()[:1] for c in cells[1:5]] == ["~"] * 4  # params, grads, optimizer, buffers: not compared
    assert "-" not in cells[4].split("(")[0].replace("~", "")  # the activations: a measured figure
    assert seen["got"]["activations"] > 0
    assert "every figure within 10% of the plan but those marked ~, not compared (params, grads, optimizer, " \
           "buffers)" in " ".join(out.split()), out
    parts = memory_plan._activation_parts
    monkeypatch.setattr(memory_plan, "_activation_parts", lambda *a, **k: tuple(0.5 * x for x in parts(*a, **k)))
    assert dryrun.main(cfg, batch) == 1
    out = capsys.readouterr().out
    assert "DISAGREES" in out and "furthest off: activations" in out, out


def test_the_docs_dry_run_table_holds_the_plan_as_it_is():
    """docs/plan.md shows the dry run of ``dryrun.DOC_RUN`` (deepseek_v3_pipeline_ep at 16 nodes), written by
    `python -m shardyard.planning.dryrun --write-doc`; tests/e2e/test_plan_e2e.py compares the whole block with a run (a
    minute or more). Here, in seconds: every plan figure of it (in parentheses) is the plan's now for that rank's
    stage, so a change to the plan cannot leave the page behind; each measured figure it does not mark agrees with
    the plan's; the busiest rank and the node count its verdict names are the plan's."""
    import re
    from pathlib import Path

    from shardyard.backends import engine

    block = dryrun.doc_table((Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text())
    cfg = compose(list(dryrun.DOC_RUN))
    batch = validate(cfg, None)
    hw = plan_hardware.hardware(cfg, batch)
    kinds = memory_plan.estimate_kinds(cfg, batch, hw)
    roles = {rank: kind for rank, _, kind in engine(cfg.backend).dry_run_roles(cfg, batch.dims)}
    rows = [line for line in block.splitlines()
            if re.match(r"\s+\d+ ", line) and line.count("(") == len(dryrun.FIGURES)]
    assert sorted(int(line.split()[0]) for line in rows) == sorted(roles), block
    for line in rows:
        plan = dryrun.planned(kinds[roles[int(line.split()[0])]], hw)
        cells = re.findall(r"(\S+) \(\s*([0-9.]+)\)(.)", line + " ")
        assert len(cells) == len(dryrun.FIGURES), line
        for figure, (measured, planned, mark) in zip(dryrun.FIGURES, cells):
            assert planned == f"{plan[figure] / 2**30:.2f}", (figure, line)
            assert (mark == " ") == dryrun.agrees(float(measured), float(planned), plan["peak"] / 2**30), (figure, line)
    busiest = max(dryrun.planned(k, hw)["peak"] for k in kinds)
    assert f"the plan's busiest rank: {busiest / 2**30:.2f} GiB per GPU" in block
    # The middle stages not simulated (5 and 6: 7 layers beside stage 1's 8) are bounded by a simulated one in every
    # figure of the plan: simulating them too (a sixth of this dry run) could not change the verdict.
    skipped = set(range(len(kinds))) - set(roles.values())
    assert skipped == {2, 3, 4, 5, 6}, roles
    for stage in skipped:
        mine = dryrun.planned(kinds[stage], hw)
        assert any(all(mine[f] <= dryrun.planned(kinds[k], hw)[f] for f in mine) for k in roles.values()), stage
    assert memory_plan.nodes_needed(cfg, batch, hw, whole_batch=True) == 32
    assert "does not fit: dry-run plan.nodes=32," in block and "does not fit, exit 1" in block


def test_a_user_error_in_a_simulated_role_reaches_the_parent_whole(monkeypatch):
    """The roles run in forked processes (``simulate_all``): a UserError raised in one comes back as itself (its
    key, value, problem and fix: one paragraph, exit 2), not as a TypeError of unpickling it (the exception's
    message alone does not rebuild it)."""

    def refuse(cfg, batch, role, replica=False):
        raise UserError("backend.ep", role.rank, "Not this role.", "Another.").on_every_rank()

    monkeypatch.setattr(simulation, "simulate", refuse)
    monkeypatch.setattr(simulation, "side_by_side", lambda roles: 2)  # a pool, whatever this machine's cores
    with pytest.raises(UserError) as e:
        simulation.simulate_all(None, None, [simulation.Role(0, "first"), simulation.Role(1, "last")])
    assert (e.value.key, e.value.value, e.value.problem, e.value.fix, e.value.all_ranks) == \
        ("backend.ep", 0, "Not this role.", "Another.", True)


def test_an_fsdp_dry_run_simulates_one_rank_where_every_shard_is_alike():
    """FSDP2 splits every parameter's rows over the shards. Where every row count divides (the tiny model on 2
    ranks) each rank holds the same shapes: the last rank's figures are the first's, so the dry run simulates the
    first alone (``uneven_shard_ends``); where one does not (3 shards of 64 rows, or of a LoRA adapter's 8 on
    16 ranks) both ends, as the last holds only a remainder."""
    from shardyard.backends import engine, uneven_shard_ends

    cfg = compose(TINY)
    batch = validate(cfg, None)
    assert [rank for rank, _, _ in engine(cfg.backend).dry_run_roles(cfg, batch.dims)] == [0]
    assert simulation.simulate(cfg, batch, simulation.Role(0, "")) == simulation.simulate(cfg, batch, simulation.Role(1, ""))
    assert [rank for rank, _, _ in uneven_shard_ends(cfg, 3)] == [0, 2]
    assert [rank for rank, _, _ in uneven_shard_ends(cfg, 16)] == [0]
    lora = compose([*TINY, "peft=lora", "peft.r=8"])
    assert [rank for rank, _, _ in uneven_shard_ends(lora, 16)] == [0, 15]
    # Expert parallel: each rank's E / ep experts, under the dry run's uniform routing, the same on every rank.
    moe = compose(["model=deepseek_moe_tiny", "backend=fsdp", "backend.ep=2", "backend.device=cpu",
                   "launch.nproc_per_node=2", "plan.dry_run=true", "plan.hardware=2xcpu"])
    batch = validate(moe, None)
    assert [rank for rank, _, _ in engine(moe.backend).dry_run_roles(moe, batch.dims)] == [0]
    assert simulation.simulate(moe, batch, simulation.Role(0, "")) == simulation.simulate(moe, batch, simulation.Role(1, ""))


def test_an_hsdp_dry_run_holds_a_copys_shard_and_agrees_with_the_plan(capsys):
    """backend.replicate=2 on 4 ranks (issue 57): a simulated rank holds the parameters plain FSDP's rank holds on
    2 (its copy's shard group), twice FSDP's on 4, and the dry run agrees with the plan, which says the same."""
    held = {}
    for name, over in (("hsdp", ["plan.hardware=4xcpu", "backend.replicate=2"]), ("fsdp4", ["plan.hardware=4xcpu"]),
                       ("fsdp2", ["plan.hardware=2xcpu"])):
        cfg = compose([*TINY[:2], *over, "train.global_batch_size=32"])
        batch = validate(cfg, None)
        held[name] = simulation.simulate(cfg, batch, simulation.Role(0, "first shard"))["params"]
        if name == "hsdp":
            assert batch.dims.describe() == "world 4 = dp_replicate 2 x dp_shard 2"
            assert dryrun.main(cfg, batch) == 0
            assert "every figure within 10% of the plan" in capsys.readouterr().out
    assert held["hsdp"] == held["fsdp2"] > held["fsdp4"], held


@pytest.mark.parametrize("over", [["backend=fsdp_tp", "backend.tp=2"],
                                  ["model=deepseek_moe_tiny", "backend=pipeline", "backend.stages=2",
                                   "backend.microbatches=2", "backend.ep=2"]], ids=["tp", "stages-ep"])
def test_hsdp_beside_tp_stages_and_ep_holds_a_copys_shard_as_the_plan_says(over):
    """backend.replicate=2 on 8 ranks beside tp 2 (the mesh replicate x dp x tp) and beside 2 stages x ep 2
    (pp x replicate x edp x ep), issue 57: the simulated first rank's parameters, gradients and optimizer state
    agree with the plan's (10%), which are those of the same layout on the 4 ranks of one copy and at least 1.5 x
    those of 8 ranks without copies (a rank that ignored the copies would hold the latter)."""
    def kinds(hardware: str, *more: str):
        cfg = compose([*TINY[:2], f"plan.hardware={hardware}", *over, *more, "train.global_batch_size=64"])
        batch = validate(cfg, None)
        return cfg, batch, memory_plan.estimate_kinds(cfg, batch, plan_hardware.hardware(cfg, batch))

    states = ("params", "grads", "optimizer")
    cfg, batch, hsdp = kinds("8xcpu", "backend.replicate=2")
    hw = plan_hardware.hardware(cfg, batch)
    assert batch.dims.dp_replicate == 2 and batch.dims.dp_shard == 2, batch.dims.describe()
    got = simulation.simulate(cfg, batch, simulation.Role(0, "first rank"))
    plan = dryrun.planned(hsdp[0], hw)
    copy, flat = (dryrun.planned(k[2][0], hw) for k in (kinds("4xcpu"), kinds("8xcpu")))
    for f in states:
        assert dryrun.agrees(got[f], plan[f], 0.0), (f, got[f], plan[f])
        assert plan[f] == pytest.approx(copy[f]) and plan[f] >= 1.5 * flat[f], (f, plan[f], copy[f], flat[f])


def test_hsdp_while_accumulating_holds_a_second_gradient_shard_as_the_plan_says():
    """HSDP at accumulation 2 (issue 57): FSDP2 keeps each unit's all-reduced gradient shard referenced until the end
    of the backward, beside the gradient it was added into (``FSDPBackend.model_states``, 10): the simulated peak
    grows by 4 x P / N over accumulation 1, as the plan's does (it did not: the plan had deepseek7b at 2 copies of
    8 ranks 3.22 GiB under its dry run)."""
    def peaks(*over: str) -> tuple[float, float]:
        cfg = compose(["recipe=deepseek_tiny_fsdp2", "plan.dry_run=true", "plan.hardware=4xcpu", "backend.replicate=2",
                       "train.micro_batch_size=1", "model.activation_checkpointing=full", "data.seq_len=16", *over])
        batch = validate(cfg, None)
        hw = plan_hardware.hardware(cfg, batch)
        plan = dryrun.planned(memory_plan.estimate_kinds(cfg, batch, hw)[0], hw)
        return simulation.simulate(cfg, batch, simulation.Role(0, "first shard"))["peak"], plan["peak"]

    # few activations (full checkpointing, 16 positions): the held shards are the peak's, not hidden beneath it
    once, twice = peaks("train.global_batch_size=4"), peaks("train.global_batch_size=8")
    grown, planned = twice[0] - once[0], twice[1] - once[1]
    assert grown > 0.1 * once[0] and planned == pytest.approx(grown, rel=0.05), (once, twice)


def test_offloaded_activations_leave_the_device_as_the_plan_says():
    """``model.activation_offload`` (issue 56) on a GPU plan: the simulated rank's offloaded block inputs, parked on
    the meta device (``prepare.offload_to``), are the plan's host figure (every block's input of the rank's tokens
    in bf16), and its device activations fall by that much against full checkpointing alone, as the plan's do
    (bf16 FSDP2 at 2 x 8,192 positions: the kept inputs are the activations' larger part)."""
    def measured(*over: str):
        cfg = compose(["recipe=deepseek_tiny_fsdp2", "plan.dry_run=true", "plan.hardware=2xH100-80GB",
                       "precision=bf16", "model.activation_checkpointing=full", "data.seq_len=8192",
                       "model.max_position_embeddings=8192", "train.micro_batch_size=2",
                       "train.global_batch_size=4", *over])
        batch = validate(cfg, None)
        hw = plan_hardware.hardware(cfg, batch)
        return simulation.simulate(cfg, batch, simulation.Role(0, "first shard")), \
            dryrun.planned(memory_plan.estimate_kinds(cfg, batch, hw)[0], hw), batch

    kept, kept_plan, batch = measured()
    moved, moved_plan, _ = measured("model.activation_offload=true")
    shape = batch.facts.shape
    inputs = shape["blocks"] * 2 * 8192 * shape["hidden"] * 2  # blocks x rows x positions x hidden x bf16
    assert moved["offloaded"] == moved_plan["offloaded"] == inputs and kept["offloaded"] == 0
    assert kept["activations"] - moved["activations"] == pytest.approx(inputs, rel=0.02)
    assert kept_plan["activations"] - moved_plan["activations"] == pytest.approx(inputs, rel=0.02)
    for f in ("activations", "peak"):
        assert dryrun.agrees(moved[f], moved_plan[f], moved_plan["peak"]), (f, moved[f], moved_plan[f])


def test_tiled_norms_hold_what_the_plan_says():
    """``model.norm_tiles`` (issue 56): at long sequences under full checkpointing a recomputed LLaMA block's
    backward holds RMSNorm's fp32 intermediates beside its activations (the plan's ``backward_half``); tiled, one
    tile's. DeepSeek-7B's shape at a quarter of its width, 65,536 tokens per rank (sp 2 of 131,072), the chunked
    loss small enough that the block is the peak: with 8 tiles the simulated activations are a third below the
    untiled plan (which its own dry run measured at 2.80 GiB beside 2.61), and agree with their own plan (10%)."""
    def run(tiles: int, simulate: bool = True) -> tuple[float, float]:
        cfg = compose(["recipe=deepseek7b_long", "model.num_layers=2", "model.hidden_size=1024",
                       "model.intermediate_size=2752", "model.num_heads=8", "model.loss_chunk=512",
                       "launch.nproc_per_node=2", "backend.sp=2", f"model.norm_tiles={tiles}", "data.seq_len=131072",
                       "model.max_position_embeddings=131072", "plan.dry_run=true", "plan.hardware=2xH100-80GB",
                       "plan.nodes=1"])
        batch = validate(cfg, None)
        hw = plan_hardware.hardware(cfg, batch)
        got = simulation.simulate(cfg, batch, simulation.Role(0, "first shard"))["activations"] if simulate else 0.0
        return got, dryrun.planned(memory_plan.estimate_kinds(cfg, batch, hw)[0], hw)["activations"]

    # the untiled run's simulation (2.80 GiB measured, 2.61 planned: the plan's backward_half) is not repeated here;
    # its plan stands for it
    (_, plain_plan), (tiled, tiled_plan) = run(0, simulate=False), run(8)
    assert tiled < 0.67 * plain_plan, (plain_plan, tiled)  # measured: 1.66 GiB
    assert dryrun.agrees(tiled, tiled_plan, 0.0), (tiled, tiled_plan)  # plan: 1.75


def test_a_pipeline_with_context_parallelism_dry_runs_each_stage_on_its_share():
    """2 stages x cp 2 on 4 ranks (issue 56): the simulated ranks are each stage's first (0 and 2, a stage's world / pp
    ranks apart, cp among them), each runs its stage on its share of the positions with the keys and values
    gathered (no group: buffers only), and its activations are below those of 2 stages x dp 2 on whole sequences
    (measured: the first stage 0.62 of them; the plan says 0.64)."""
    from shardyard.backends import engine

    def run(*over: str) -> tuple[list[int], dict, dict]:
        cfg = compose([*TINY[:2], "plan.hardware=4xcpu", "backend=pipeline", "backend.stages=2",
                       "backend.microbatches=2", "train.micro_batch_size=2", "train.global_batch_size=4",
                       "data.seq_len=256", "data.document_mask=true", *over])
        batch = validate(cfg, None)
        hw = plan_hardware.hardware(cfg, batch)
        roles = [rank for rank, _, _ in engine(cfg.backend).dry_run_roles(cfg, batch.dims)]
        got = simulation.simulate(cfg, batch, simulation.Role(roles[0], "first stage"))
        return roles, got, dryrun.planned(memory_plan.estimate_kinds(cfg, batch, hw)[0], hw)

    roles, split, planned = run("backend.cp=2")
    _, whole, planned_whole = run()
    assert roles == [0, 2], roles
    ratio = split["activations"] / whole["activations"]
    planned_ratio = planned["activations"] / planned_whole["activations"]
    assert ratio < 0.8 and ratio == pytest.approx(planned_ratio, rel=0.1), (ratio, planned_ratio)
