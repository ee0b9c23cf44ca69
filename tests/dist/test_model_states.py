"""The plan's model-state figures against what each engine really holds (``shardyard.core.memory.held_by``:
every tensor of parameters, gradients and optimizer state a rank holds, each storage once). Expert parallelism
at world 4 too: the MoE model's experts on (edp 2 x ep 2) leave each rank P / N, as the plan says."""

import pytest

from shardyard.planning import simulation
from shardyard.planning import plan as memory_plan
from shardyard.planning import hardware as plan_hardware
from shardyard.planning.validate import validate
from shardyard.testing import run_measurements
from shardyard.testing import compose

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
MODEL = ["model.hidden_size=128", "model.intermediate_size=344", "model.num_layers=2", "model.num_heads=4",
         "data.seq_len=32", "train.micro_batch_size=1", "optim=adamw", "monitor=[]", "checkpoint.save_final=false"]


def planned(overrides, world):
    cfg = compose([*overrides, f"launch.nproc_per_node={world}"])  # the layout validated at its world
    batch = validate(cfg, None)
    hw = plan_hardware.named(f"{world}xH100-80GB", 1)
    return memory_plan.estimate(cfg, batch, hw).model_states


def jobs(precisions):
    return [[*MODEL, f"backend={e}", f"precision={p}"] for p in precisions for e in ENGINES]


EP = [*MODEL, "model=deepseek_moe_tiny", "backend=fsdp",
      "precision=bf16", "backend.ep=2"]


@pytest.fixture(scope="module")
def measured():
    # N=2 in both precisions; N=4 in bf16 (sharding is the same arithmetic in either precision).
    return {2: run_measurements(2, jobs(["bf16", "fp32"])), 4: run_measurements(4, jobs(["bf16"]) + [EP])}


@pytest.mark.parametrize("world", [2, 4])
def test_plan_equals_what_engines_hold(measured, world):
    rows = []
    for got in measured[world]:
        plan = planned(got["overrides"], world)
        for k in ("params", "grads", "optimizer"):
            rows.append((got["overrides"][-3:], k, plan[k], got[k]))
    bad = [r for r in rows if abs(r[2] - r[3]) > 0.10 * r[3]]
    assert not bad, "plan vs measured bytes (engine, category, plan, measured):\n" + "\n".join(map(str, bad))


@pytest.mark.parametrize("layout", ["fsdp", "fsdp ep=2"])
def test_dry_run_equals_a_real_run_at_world_4(measured, layout):
    """The dry run's simulation (a fake process group and fake tensors, ``shardyard.planning.dryrun``) against reality where
    reality fits on this machine: rank 0 of the real 4-rank gloo run above and the dry run's rank 0 of world 4
    hold the same parameters, gradients and optimizer state, within 5%."""
    ep = layout.endswith("ep=2")
    got = next(g for g in measured[4] if "backend=fsdp" in g["overrides"] and ("backend.ep=2" in g["overrides"]) == ep)
    cfg = compose([*got["overrides"], "launch.nproc_per_node=4"])
    batch = validate(cfg, None)
    assert batch.world_size == 4 and batch.dims.ep == (2 if ep else 1)
    simulated = simulation.simulate(cfg, batch, simulation.Role(0, "first shard"))
    for k in ("params", "grads", "optimizer"):
        assert abs(simulated[k] - got[k]) <= 0.05 * got[k], (layout, k, simulated[k], got[k])
