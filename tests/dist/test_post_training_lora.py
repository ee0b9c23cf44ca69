"""DPO with LoRA (issue 44, item 2): the reference is the policy itself with its adapters disabled, no second
model. On the single process, DDP (2 ranks) and FSDP (2 ranks), two plain-SGD steps (fp32) of the same DPO run
as tests/dist/test_post_training.py's (``OBJECTIVES["dpo"]``) with ``peft=lora``:

- step 0's loss is exactly log 2 and its logged margin exactly 0 (the adapters' B starts at 0: the policy is its
  reference), the second step's loss and margin are not (the adapters moved: every ``lora_B`` is non-zero);
- the engine built no reference model (``Backend.reference_model`` caches it as ``backend.reference``; it is
  never called) and the objective holds none;
- DDP and FSDP end with the single process's adapters and base weights within 1e-4 and log its losses."""

import json
import math
import os

import pytest
import torch

from shardyard.testing import on_ranks
from test_post_training import OBJECTIVES

LORA = [*OBJECTIVES["dpo"], "peft=lora", "peft.r=4", "peft.dropout=0.0"]
LAYOUTS = {"ddp": ["backend=ddp", "train.micro_batch_size=2"],  # 2 ranks x 2 micro-batches of 2 pairs
           "fsdp": ["backend=fsdp", "train.micro_batch_size=4"]}


def _lora_run(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """A pool rank: ``worker.main`` as ``run.py`` calls it, and what the engine and the objective hold after
    training (``after_train``: before the engine closes)."""
    from shardyard.training import worker
    from shardyard.core.dist_env import detect
    from shardyard.training.rundir import resolved
    from shardyard.testing import compose
    from shardyard.planning.validate import validate

    cfg = compose(overrides, run_dir)
    plan = validate(cfg, detect())
    cfg = resolved(cfg)
    out: dict = {}

    def grab(backend):
        objective = backend.hf_model().shardyard_objective  # objectives.install put it there
        out["engine_reference"] = "reference" in backend.__dict__
        out["objective"] = (type(objective).__name__, objective.adapters, objective.reference is None)
        out["full"] = backend.full_state_dict()

    out["summary"] = worker.main(cfg, plan, after_train=grab)
    torch.save(out, os.path.join(run_dir, f"rank{rank}.pt"))


def run(world: int, overrides: list, run_dir) -> list[dict]:
    os.makedirs(run_dir, exist_ok=True)
    on_ranks(world, _lora_run, list(overrides), str(run_dir))
    return [torch.load(os.path.join(run_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def margins(run_dir) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r["train/rewards/margins"] for r in rows if "train/rewards/margins" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_lora")
    out = {"single": (run(1, [*LORA, "backend=single", "train.micro_batch_size=8"], d / "single"), d / "single")}
    for name, layout in LAYOUTS.items():
        out[name] = (run(2, [*LORA, *layout], d / name), d / name)
    return out


@pytest.mark.parametrize("name", ["single", *LAYOUTS])
def test_the_reference_is_the_policy_with_its_adapters_off(runs, name):
    ranks, run_dir = runs[name]
    for r in ranks:
        assert r["objective"] == ("DPO", True, True)  # adapters found, no reference model held
        assert not r["engine_reference"]  # Backend.reference_model was never called
    losses = [v for _, v in ranks[0]["summary"]["train_losses"]]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(2), abs=1e-7)  # policy == reference
    assert abs(losses[1] - losses[0]) > 1e-3  # ... until the adapters move
    m = margins(run_dir)
    assert len(m) == 2 and m[0] == 0.0 and abs(m[1]) > 1e-4, m
    full = ranks[0]["full"]
    lora_b = [k for k in full if ".lora_B." in k]
    assert lora_b and all(full[k].abs().sum() > 0 for k in lora_b)  # every B starts at 0: trained


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_lora_equals_the_single_process(runs, name):
    ref, got = runs["single"][0][0], runs[name][0][0]
    losses = [v for _, v in ref["summary"]["train_losses"]]
    assert abs(losses[1] - losses[0]) > 1e-3  # the first step moved the adapters: no comparison of idle runs
    assert got["full"].keys() == ref["full"].keys()
    worst = max((got["full"][k].float() - ref["full"][k].float()).abs().max().item() for k in ref["full"])
    assert worst < 1e-4, (name, worst)
    for r in runs[name][0]:  # every rank logs the all-reduced step loss
        assert [v for _, v in r["summary"]["train_losses"]] == pytest.approx(losses, abs=1e-5)
