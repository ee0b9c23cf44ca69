"""A run dir belongs to one run, without training: what is found there, moving it aside, the checkpoint dir's
owner, node k's refusal, and the metrics files cut back to the step a run resumes from."""

import csv
import json
import os

import pytest
from omegaconf import OmegaConf

from shardyard.training import rundir
from shardyard.core.errors import UserError


def cfg(run_dir, **checkpoint):
    c = {"dir": None, "resume": None, "overwrite_run_dir": False, "every_n_steps": 0, **checkpoint}
    return OmegaConf.create({"run_dir": str(run_dir), "checkpoint": c, "train": {"steps": 4},
                             "launch": {"nnodes": 2, "node_rank": 1}})


def finished_run(d, steps=4, ckpts=(2,)):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text("a: 1\n")
    (d / "summary.json").write_text(json.dumps({"steps": steps}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    for s in ckpts:
        (d / f"checkpoints/step-{s:08d}").mkdir(parents=True)


def test_what_a_run_dir_holds_is_said(tmp_path):
    assert rundir.find(cfg(tmp_path)) is None
    finished_run(tmp_path)
    held = rundir.find(cfg(tmp_path))
    assert held.finished_at == 4 and held.checkpoint_at == 2
    assert held.describe() == ("a run that finished at step 4 (config.yaml, summary.json, metrics.jsonl, "
                               "checkpoints up to step 2)")
    done = rundir.finished(cfg(tmp_path, resume="auto"))
    assert "already complete: it finished at step 4" in done and "Raise train.steps" in done
    more = cfg(tmp_path, resume="auto")
    more.train.steps = 6
    assert rundir.finished(more) is None and rundir.finished(cfg(tmp_path)) is None
    (tmp_path / "summary.json").unlink()
    assert rundir.find(cfg(tmp_path)).describe().startswith("a run with checkpoints up to step 2")
    with pytest.raises(UserError) as e:
        rundir.prepare(cfg(tmp_path))
    assert e.value.key == "hydra.run.dir" and "checkpoint.overwrite_run_dir=true" in e.value.fix


def test_overwrite_moves_the_runs_outputs_aside_and_nothing_else(tmp_path):
    run, ext = tmp_path / "run", tmp_path / "ext"
    finished_run(run)
    (run / ".hydra").mkdir()
    (run / "train.log").write_text("hydra's job log")
    (run / "my_data").mkdir()  # the user's own: the run dir is their project dir
    (run / "tensorboard").mkdir()
    (ext / "step-00000002").mkdir(parents=True)
    (ext / "OWNER").write_text(str(run) + "\n")
    inside, outside = rundir.move_aside(cfg(run, dir=str(ext), overwrite_run_dir=True))
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "my_data", os.path.basename(inside), "train.log"]
    assert sorted(p.name for p in (run / inside).iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl",
                                                                "summary.json", "tensorboard"]
    assert (run / inside / "summary.json").read_text() == json.dumps({"steps": 4})  # renamed, not rewritten
    assert outside.startswith(f"{ext}.previous-") and not ext.exists()
    assert sorted(os.listdir(outside)) == ["OWNER", "step-00000002"]


def test_a_checkpoint_dir_of_another_run_is_refused_and_reading_it_is_not(tmp_path):
    finished_run(tmp_path / "a")
    ck = tmp_path / "a/checkpoints"
    (ck / "OWNER").write_text(str(tmp_path / "a") + "\n")
    with pytest.raises(UserError) as e:
        rundir.prepare(cfg(tmp_path / "b", dir=str(ck), every_n_steps=1))
    assert e.value.key == "checkpoint.dir" and f"the run in {tmp_path / 'a'}" in e.value.problem
    assert not (tmp_path / "b/config.yaml").exists()
    rundir.prepare(cfg(tmp_path / "c", resume=str(ck / "step-00000002"), every_n_steps=1))  # reads it: fine
    assert (tmp_path / "c/checkpoints/OWNER").read_text() == f"{tmp_path / 'c'}\n"


def test_node_k_refuses_an_earlier_runs_dir_without_waiting(tmp_path):
    finished_run(tmp_path)
    with pytest.raises(UserError) as e:
        rundir.wait_for_node0(cfg(tmp_path), timeout_s=600)
    assert e.value.key == "hydra.run.dir" and "finished at step 4" in e.value.problem


def test_metrics_files_keep_the_steps_up_to_the_checkpoint(tmp_path):
    from shardyard.monitors import METRICS
    from shardyard.monitors.csv import CsvMonitor
    from shardyard.monitors.jsonl import JsonlMonitor

    lines = [json.dumps({"step": s, "train/loss": s / 10}) for s in range(5)] + [json.dumps({"error": "x"})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "train/lo')  # killed mid-line
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", *METRICS])
        w.writeheader()
        w.writerows({"step": s, "train/loss": s / 10} for s in range(5))
        f.write("5,0.5")  # a short row
    jsonl, table = JsonlMonitor(str(tmp_path)), CsvMonitor(str(tmp_path), OmegaConf.create({}))
    for m in (jsonl, table):
        m.resume(2)
        m.log(3, {"train/loss": 0.33})
        m.close({})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("step") for r in rows] == [0, 1, 2, None, 3] and rows[-1]["train/loss"] == 0.33
    table_rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [(r["step"], r["train/loss"]) for r in table_rows] == [("0", "0.0"), ("1", "0.1"), ("2", "0.2"),
                                                                 ("3", "0.33")]
