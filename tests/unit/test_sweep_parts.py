"""The pieces of a sweep that need no training: job names, the objective, Optuna's search space, the
summary's ranking (from job records written as a job writes them)."""

import json

import pytest
from omegaconf import OmegaConf

from shardyard.launching import sweep


def test_job_names_show_only_what_varies_readably():
    jobs = sweep.name_jobs([["backend=ddp", "optim.lr=0.001", "train.steps=4"],
                            ["backend=ddp", "optim.lr=0.003", "train.steps=4"],
                            ["backend=fsdp", "optim.lr=0.001", "train.steps=4"]])
    assert [j.name for j in jobs] == ["0_backend=ddp,lr=1e-3", "1_backend=ddp,lr=3e-3", "2_backend=fsdp,lr=1e-3"]
    assert jobs[2].varying == {"backend": "fsdp", "lr": "1e-3"}
    assert [j.name for j in sweep.name_jobs([["optim.lr=1e-3"], ["optim.lr=3e-3"]])] == ["0_lr=1e-3", "1_lr=3e-3"]
    assert [j.name for j in sweep.name_jobs([["train.steps=4"]])] == ["0"]


def test_job_names_keep_keys_apart_and_stay_short():
    keys = sweep.short_keys(["optim.lr", "model.lr", "sched.warmup_steps"])
    assert keys == {"optim.lr": "optim.lr", "model.lr": "model.lr", "sched.warmup_steps": "warmup_steps"}
    long = sweep.name_jobs([["data.paths=[" + "a" * 120 + "]"], ["data.paths=[b]"]])
    assert len(long[0].name) == 80 and long[0].name.startswith("0_paths=_aaa") and long[1].name == "1_paths=_b_"


@pytest.mark.parametrize("value,shown", [("0.001", "1e-3"), ("0.0003", "3e-4"), ("0.1", "0.1"), ("3e-4", "3e-4"),
                                         ("0.0025533788", "0.002553"), ("50", "50"), ("ddp", "ddp"), ("1000.0", "1e3")])
def test_values_in_names_take_their_shortest_form(value, shown):
    assert sweep.fmt_value(value) == shown


def test_objective_is_the_last_value_or_mean_throughput_and_its_direction():
    metrics = {"eval/loss": [(0, 9.0), (10, 7.0), (20, 7.5)], "tokens_per_s": [(1, 10.0), (2, 100.0), (3, 200.0)]}
    assert sweep.objective_value(metrics, "eval/loss") == 7.5
    assert sweep.objective_value(metrics, "tokens_per_s") == 150.0  # the first interval (warm-up) left out
    assert sweep.objective_value(metrics, "train/loss") is None
    cfg = OmegaConf.create({"objective": "tokens_per_s", "direction": "auto"})
    assert sweep.direction(cfg) == "maximize"
    cfg.objective = "eval/loss"
    assert sweep.direction(cfg) == "minimize"


def test_summary_ranks_finished_jobs_then_pruned_then_failed(tmp_path, capsys):
    jobs = sweep.name_jobs([["optim.lr=1e-3"], ["optim.lr=3e-3"], ["optim.lr=1e-2"], ["optim.lr=1e-1"]])
    records = [("finished", 7.0), ("finished", 6.0), ("pruned", 8.0), ("failed", None)]
    for j, (status, value) in zip(jobs, records):
        (tmp_path / j.name).mkdir()
        (tmp_path / j.name / "result.json").write_text(json.dumps(
            {"status": status, "value": value, "started": 0.0, "ended": 2.0,
             "error": "shardyard: error in `x` (value: 1).\nFix: y" if status == "failed" else None}))
        if value is not None:
            (tmp_path / j.name / "metrics.jsonl").write_text(
                json.dumps({"step": 1, "train/loss": value + 1, "tokens_per_s": 5.0}) + "\n"
                + json.dumps({"step": 2, "eval/loss": value}) + "\n")
    summary = sweep.summarize(str(tmp_path), jobs, OmegaConf.create({"objective": "eval/loss", "direction": "auto"}))
    assert [r["job"] for r in summary["jobs"]] == ["1_lr=3e-3", "0_lr=1e-3", "2_lr=0.01", "3_lr=0.1"]
    assert summary["best"]["job"] == "1_lr=3e-3" and summary["jobs"][3]["error"] == "shardyard: error in `x` (value: 1). Fix: y"
    out = capsys.readouterr().out
    assert "\n*  1_lr=3e-3" in out and "failed: shardyard: error in `x`" in out
    assert (tmp_path / "sweep_summary.csv").read_text().splitlines()[0].startswith("best,job,+lr,status,objective")


def test_optuna_search_space_from_hydras_grammar():
    import optuna  # the sweep extra (make setup installs it)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.shardyard_sweepers import distribution

    parse = OverridesParser.create().parse_overrides
    lr, warm, layers, steps = parse(["optim.lr=tag(log, interval(1e-4, 1e-2))", "sched.warmup_steps=choice(10, 50)",
                                     "model.num_layers=interval(2, 8)", "train.steps=range(10, 40, step=10)"])
    assert distribution(lr) == optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    assert distribution(warm) == optuna.distributions.CategoricalDistribution([10, 50])
    assert distribution(layers) == optuna.distributions.IntDistribution(2, 8)
    assert distribution(steps) == optuna.distributions.CategoricalDistribution([10, 20, 30])


def test_jobs_left_to_run_are_launched_in_runs_of_consecutive_numbers():
    from hydra_plugins.shardyard_sweepers import _batches

    assert _batches([1, 2, 3, 5, 6], None) == [[1, 2, 3], [5, 6]]
    assert _batches([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("override,key", [("sweep.objective=eval/los", "sweep.objective"),
                                          ("sweep.base_port=80", "sweep.base_port")])
def test_bad_sweep_settings_name_their_key(override, key):
    from shardyard.planning.validate import validate
    from shardyard.core.errors import UserError
    from shardyard.testing import compose

    with pytest.raises(UserError) as e:
        validate(compose([override]), None)
    assert e.value.key == key
