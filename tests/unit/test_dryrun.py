"""The dry run (``plan.dry_run=true``, issue 40): the engine's own prepare and a step on a fake process group and
fake tensors, set beside the plan. What each recipe's dry run says is tests/e2e/test_recipes.py's; the simulation
against a real 4-rank gloo run is tests/dist/test_model_states.py's. Here: that it can fail, and its refusals."""

import pytest
from omegaconf import open_dict

from shardyard import dryrun
from shardyard import plan as memory_plan
from shardyard.errors import UserError
from shardyard.testing import compose
from shardyard.validate import validate

TINY = ["recipe=deepseek_tiny_fsdp2", "plan.dry_run=true", "plan.hardware=2xcpu"]


def test_a_plan_broken_on_purpose_exits_1(monkeypatch, capsys):
    """The same dry run agrees (0) with the plan as it is and disagrees (1) once the plan's optimizer-state factor
    is wrong by half: the comparison is what decides, not the run finishing."""
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
