"""Monitoring, profiling and the report, read back with each tool's real reader (issue: monitoring plugins).

One short CPU run selects every plugin, the profiler and an MFU peak override; each reader must return the
values metrics.jsonl holds for the same steps.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, run_python, train_py
from readers import csv_by_step, jsonl_by_step, tensorboard_scalars, wandb_offline_run

RUN = [*TINY, "backend=single", "backend.device=cpu", "train.steps=6", "train.log_every_n_steps=2", "train.eval_every_n_steps=3",
       "checkpoint.save_final=true", "monitor=[console,tensorboard,wandb,mlflow,csv]",
       "profile.enabled=true", "profile.steps=[2,3]", "metrics.peak_tflops=0.5", "metrics.report=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("monitored")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = run_python([str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *RUN], str(ROOT),
                      {**env, "NETRC": str(run_dir / "no-netrc")}, 600)  # forked warm, as train_py
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_jsonl_holds_every_metric(run):
    run_dir, _ = run
    by_step = jsonl_by_step(run_dir)
    assert sorted(by_step) == [0, 2, 3, 4, 6]
    # Training FLOPs per token counted here (PaLM's 6N + 12*L*H*Q*T): N without the input embedding (a lookup);
    # TINY's 2 layers x 4 heads of 16, seq 64.
    from shardyard.models.build import shape_model
    from shardyard.testing import compose

    n = sum(p.numel() for name, p in shape_model(compose(RUN).model).named_parameters() if "embed_tokens" not in name)
    flops = 6 * n + 12 * 2 * 4 * 16 * 64
    assert set(by_step[0]) == {"eval/loss", "eval/ppl"} and "eval/loss" in by_step[6]
    for step in (2, 4, 6):
        m = by_step[step]
        for key in ("train/loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "data_time_s",
                    "tflops_per_device", "mfu", "memory/rss_gib"):
            assert key in m and math.isfinite(m[key]), (step, key)
        assert m["tflops_per_device"] == pytest.approx(flops * m["tokens_per_s"] / 1e12, rel=1e-6)  # world 1
        assert m["mfu"] == pytest.approx(m["tflops_per_device"] / 0.5)  # the peak override
        assert 0.05 < m["memory/rss_gib"] < 20 and "memory/max_allocated_gib" not in m  # CPU: RSS
        assert m["tokens_seen"] == step * 4 * 64
    assert by_step[6]["eval/ppl"] == pytest.approx(math.exp(by_step[6]["eval/loss"]))


def test_tensorboard_event_files_equal_jsonl(run):
    run_dir, _ = run
    want, got = jsonl_by_step(run_dir), tensorboard_scalars(run_dir / "tensorboard")
    for tag in ("train/loss", "eval/loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory/rss_gib"):
        steps = {s: m[tag] for s, m in want.items() if tag in m}
        assert sorted(got[tag]) == sorted(steps), tag
        for s, v in steps.items():
            assert got[tag][s] == pytest.approx(v, rel=1e-6), (tag, s)  # event files store float32


def test_wandb_offline_run_holds_config_and_history(run):
    run_dir, proc = run
    assert "running offline" in proc.stdout
    config, history = wandb_offline_run(run_dir)
    resolved = json.loads(json.dumps(__import__("yaml").safe_load(open(run_dir / "config.yaml"))))
    for key in ("train", "model", "backend", "optim", "debug"):
        assert config[key] == resolved[key], key
    want = jsonl_by_step(run_dir)
    assert sorted(history) == sorted(want)
    for step, metrics in want.items():
        for k, v in metrics.items():
            assert history[step][k] == v, (step, k)  # JSON both ways: exactly equal


def test_mlflow_run_has_params_metrics_and_the_export(run):
    from mlflow import MlflowClient

    run_dir, _ = run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow/mlflow.db")
    [exp] = [e for e in client.search_experiments() if e.name == "shardyard"]
    [r] = client.search_runs([exp.experiment_id])
    assert r.info.status == "FINISHED" and r.info.run_name == os.path.basename(run_dir)
    assert r.data.params["train.steps"] == "6" and r.data.params["backend.name"] == "single"
    assert r.data.params["optim.betas"] == "[0.9, 0.95]" and r.data.params["model.hidden_size"] == "64"
    want = jsonl_by_step(run_dir)
    for key in ("train/loss", "eval/loss", "grad_norm", "mfu"):
        hist = {m.step: m.value for m in client.get_metric_history(r.info.run_id, key)}
        assert hist == {s: m[key] for s, m in want.items() if key in m}, key
    files = {f.path for f in client.list_artifacts(r.info.run_id, "hf")}
    assert {"hf/config.json", "hf/model.safetensors", "hf/tokenizer.json"} <= files
    assert os.path.isfile(run_dir / "mlflow/artifacts" / r.info.run_id / "artifacts/hf/model.safetensors")


def test_csv_has_one_row_per_logged_step(run):
    run_dir, _ = run
    want, got = jsonl_by_step(run_dir), csv_by_step(run_dir / "metrics.csv")
    assert sorted(got) == sorted(want)  # train and eval metrics of step 6 share one row
    for step, metrics in want.items():
        assert got[step] == pytest.approx(metrics, rel=1e-12), step


def test_profiler_writes_a_chrome_trace_of_the_requested_steps(run):
    run_dir, proc = run
    trace = json.load(open(run_dir / "profile/rank0.trace.json"))
    names = [e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert names.count("forward_backward") == 2 and names.count("optimizer_step") == 2  # steps 2 and 3
    assert any(n and n.startswith("aten::mm") for n in names)
    assert "profile of steps 2-3" in proc.stdout


def test_report_png_is_drawn_and_redrawn_by_the_cli(run, tmp_path):
    run_dir, _ = run
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    cli = os.path.join(os.path.dirname(sys.executable), "shardyard")
    proc = subprocess.run([cli, "report", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and proc.stdout.strip() == str(png)
    # A sweep directory: every job's curves in the same panels.
    sweep = tmp_path / "multirun"
    for job in ("0_optim.lr=1e-3", "1_optim.lr=3e-3"):
        (sweep / job).mkdir(parents=True)
        (sweep / job / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    proc = subprocess.run([sys.executable, "-m", "shardyard", "report", str(sweep)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([cli, "report", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "run_dir" in proc.stderr and "Traceback" not in proc.stderr


def test_fast_dev_run_is_two_steps_and_one_eval(tmp_path):
    proc = train_py(*TINY, "backend=single", "debug.fast_dev_run=true", "checkpoint.every_n_steps=1",
                    "checkpoint.save_final=true", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by_step = jsonl_by_step(tmp_path)
    assert sorted(by_step) == [1, 2]
    assert [s for s, m in by_step.items() if "eval/loss" in m] == [2]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "hf").exists()
