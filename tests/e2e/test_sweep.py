"""Sweeps (``python train.py -m``) as a user runs them: multi-process jobs side by side (joblib) on ddp and
fsdp, each equal to the same job run alone; a ranked summary with the best job marked, files a real reader
reads back; a failed job recorded while the others finish, then the same command with
``checkpoint.resume=auto`` skips the finished jobs and resumes the failed one from its checkpoint; a sweep
with one impossible job refused before any starts; an Optuna search whose pruned trials stop early.
(The Slurm sweep is in tests/cluster/test_slurm.py.)"""

import csv
import json
import os

import pytest
from conftest import ROOT, TINY, train_py
from shardyard.testing import run_python

SWEEP = [*TINY, "train.steps=4", "train.eval_every_n_steps=2", "checkpoint.every_n_steps=2"]


def multirun(*overrides, env=None, timeout=600):
    """``python train.py -m ...`` as a user runs it, forked warm as train_py's runs are."""
    return run_python([str(ROOT / "train.py"), "-m", *overrides], str(ROOT),
                      {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout)


def train_losses(run_dir):
    return [v for _, v in json.load(open(os.path.join(run_dir, "summary.json")))["train_losses"]]


def close(a, b, rtol=1e-5):
    return len(a) == len(b) and max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= rtol


def test_parallel_sweep_of_two_rank_jobs_ranks_them_survives_a_failure_and_resumes(tmp_path):
    root = tmp_path / "multirun"
    args = ["backend=ddp,fsdp", "optim.lr=1e-3,3e-3", *SWEEP, "launch.nproc_per_node=2", "checkpoint.resume=auto",
            "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={root}/" + "${now:%H-%M-%S-%f}"]
    # Rank 1 of one job dies after step 3 (its checkpoint of step 2 is complete): that job alone fails.
    first = multirun(*args, env={"SHARDYARD_TEST_CRASH_AT_STEP": "3:1@backend=fsdp,lr=3e-3"})
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # after the summary: 1 job failed
    assert "1 of 4 jobs did not finish: 3_backend=fsdp,lr=3e-3" in first.stderr
    (sweep_dir,) = list(root.iterdir())
    names = ["0_backend=ddp,lr=1e-3", "1_backend=ddp,lr=3e-3", "2_backend=fsdp,lr=1e-3", "3_backend=fsdp,lr=3e-3"]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")) == names

    summary = json.load(open(sweep_dir / "sweep_summary.json"))
    rows = {r["job"]: r for r in summary["jobs"]}
    assert rows[names[3]]["status"] == "failed" and "worker rank 1 failed with exit code 13" in rows[names[3]]["error"]
    assert all(rows[n]["status"] == "finished" for n in names[:3]), rows
    assert f"{names[3]}" in first.stdout and "failed: worker rank 1" in first.stdout
    # Ranked by the final eval loss, failures last, the best marked in the table, the csv and the json.
    ranked = [r["objective"] for r in summary["jobs"] if r["status"] == "finished"]
    assert ranked == sorted(ranked) and summary["jobs"][-1]["job"] == names[3]
    assert summary["best"]["job"] == summary["jobs"][0]["job"] and summary["jobs"][0]["best"]
    best_line = next(line for line in first.stdout.splitlines() if line.startswith("*  "))
    assert summary["best"]["job"] in best_line
    table = list(csv.DictReader(open(sweep_dir / "sweep_summary.csv")))
    assert [r["job"] for r in table] == [r["job"] for r in summary["jobs"]] and table[0]["best"] == "True"
    assert {"+backend", "+lr"} <= set(table[0]), table[0]
    import matplotlib.image

    assert matplotlib.image.imread(sweep_dir / "report.png").shape[0] > 100

    # Jobs that ran at the same time held different slots and rendezvous ports.
    results = [json.load(open(sweep_dir / n / "result.json")) for n in names]
    assert {r["slots"] for r in results} == {2}
    for a in results:
        for b in results:
            if a is not b and a["started"] < b["ended"] and b["started"] < a["ended"]:
                assert a["slot"] != b["slot"] and a["master_port"] != b["master_port"], (a, b)

    # The same command again: the finished jobs are not run again, the failed one resumes from step 2.
    before = {n: (sweep_dir / n / "metrics.jsonl").read_bytes() for n in names[:3]}
    again = multirun(*args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(list(root.iterdir())) == 1 and f"resuming the sweep in {sweep_dir}" in again.stdout
    for n in names[:3]:
        assert f"job {n}: finished before, not run again" in again.stdout
        assert (sweep_dir / n / "metrics.jsonl").read_bytes() == before[n]
    assert "step-00000002 (step 2" in again.stdout, again.stdout[-3000:]
    summary = json.load(open(sweep_dir / "sweep_summary.json"))
    assert all(r["status"] == "finished" for r in summary["jobs"]), summary

    # Each job equals the same job run alone (ddp and fsdp alike: the engines are equal): the 1e-3 pair against
    # a run alone; the 3e-3 pair, one finished and one crashed and resumed inside the sweep, against each other.
    alone = tmp_path / "alone-1e-3"
    proc = train_py(*SWEEP, "backend=ddp", "optim.lr=1e-3", "launch.nproc_per_node=2", run_dir=alone)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in names[0::2]:
        assert close(train_losses(sweep_dir / n), train_losses(alone)), (n, train_losses(sweep_dir / n))
    assert close(train_losses(sweep_dir / names[3]), train_losses(sweep_dir / names[1]))
    assert not close(train_losses(sweep_dir / names[1]), train_losses(alone))  # the learning rate took


def test_hydras_joblib_launcher_runs_jobs_side_by_side_in_their_own_slots(tmp_path):
    proc = multirun(*TINY, "backend=single", "optim.lr=1e-3,3e-3", "train.steps=3", "hydra/launcher=joblib",
                    "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.load(open(tmp_path / n / "result.json")) for n in ("0_lr=1e-3", "1_lr=3e-3")]
    assert [r["status"] for r in results] == ["finished", "finished"]
    assert {r["slot"] for r in results} == {0, 1} and len({r["master_port"] for r in results}) == 2
    assert json.load(open(tmp_path / "sweep_summary.json"))["best"] is not None


def test_a_sweep_with_one_impossible_job_is_refused_before_any_job_starts(tmp_path):
    proc = multirun(*TINY, "backend=single", "train.global_batch_size=8", "train.micro_batch_size=4,3",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert "error in `train.global_batch_size`" in err and "Job 1_micro_batch_size=3 of the sweep cannot run" in err
    assert "No job was started" in err and "Traceback" not in proc.stderr
    assert not any(p.is_dir() for p in (tmp_path / "sweep").glob("*")) and "run dir" not in proc.stdout


def test_a_sweep_dir_holding_another_sweep_is_refused(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps({"identity": [["optim.lr=0.1"]], "jobs": []}))
    proc = multirun(*TINY, "backend=single", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert "error in `hydra.sweep.dir`" in err and "earlier sweep of other jobs" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]


def test_optuna_search_prunes_trials_and_its_best_is_the_summarys_best(tmp_path):
    import yaml

    sweep_dir = tmp_path / "optuna"
    proc = multirun("recipe=sweep_optuna_lr", *TINY, "train.steps=8", "train.eval_every_n_steps=2",
                    "hydra.sweeper.n_trials=4", "hydra.sweeper.pruner_startup_trials=1",
                    "hydra.sweeper.pruner_warmup_steps=0", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.load(open(sweep_dir / "sweep_summary.json"))
    assert len(summary["jobs"]) == 4 and {r["status"] for r in summary["jobs"]} <= {"finished", "pruned"}
    pruned = [r for r in summary["jobs"] if r["status"] == "pruned"]
    assert pruned, summary  # seeded TPE, median pruner after 1 trial: trials 1, 2 and 3 trail it at step 2
    for r in pruned:  # stopped early: fewer logged steps than train.steps, and no export
        steps = [s for s, _ in json.load(open(sweep_dir / r["job"] / "summary.json"))["train_losses"]]
        assert max(steps) < 8, (r["job"], steps)
    best = yaml.safe_load(open(sweep_dir / "optimization_results.yaml"))
    assert best["best_value"] == pytest.approx(summary["best"]["objective"], abs=1e-9)
    config = yaml.safe_load(open(sweep_dir / summary["best"]["job"] / "config.yaml"))
    assert config["optim"]["lr"] == pytest.approx(best["best_params"]["optim.lr"])
    assert config["sched"]["warmup_steps"] == best["best_params"]["sched.warmup_steps"]
