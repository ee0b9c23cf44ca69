"""The plan as a user meets it: refused before launch, planned for hardware they do not have, and the
measured peak of a real run beside the plan."""

import json

import pytest

from conftest import train_py

ENGINES = ["ddp", "horovod", "fsdp", "fsdp_offload", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload",
           "zero_infinity"]


def test_headline_command_is_refused_before_anything_starts(tmp_path):
    """`python train.py backend=zero3 model=deepseek7b` on this machine: the plan, the shortfall, and what
    would fit, exit 2, and no run written. (bench/startup.py times it.)"""
    proc = train_py("backend=zero3", "model=deepseek7b", run_dir=tmp_path / "run", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())  # the paragraph is wrapped
    assert "Traceback" not in err and "error in `backend` (value: 'zero3')" in err
    assert "GiB per rank and does not fit" in err and "of host RAM" in err
    assert "Alternatives that fit, best first: (1)" in err and "nodes like this one" in err
    assert "zero3" in proc.stdout and "peak/host RAM" in proc.stdout  # the plan's table
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_plan_only_for_8xh100(tmp_path):
    """One table holds every engine; the run's own engine comes first."""
    proc = train_py("backend=zero3", "model=deepseek7b", "precision=bf16", "plan.only=true",
                    "plan.hardware=8xH100-80GB", run_dir=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split() and line.split()[0] in ENGINES}
    assert set(rows) == set(ENGINES), proc.stdout
    fits = {name: line.split("|")[2].strip() for name, line in rows.items()}
    assert fits["ddp"].startswith("no") and fits["zero3"] == "yes" and fits["fsdp"] == "yes", fits
    assert "rules of thumb" in proc.stdout and "DeepSpeed's estimators" in proc.stdout
    assert next(iter(rows)) == "zero3"
    assert not (tmp_path / "summary.json").exists()


def test_shardyard_plan_is_train_py_plan_only(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "shardyard", "plan", "launch.nproc_per_node=2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "plan for this machine" in proc.stdout and "2 rank(s)" in proc.stdout
    assert proc.stdout.splitlines()[3].split()[0] == "ddp" and "zero3" in proc.stdout and "WARNING" not in proc.stderr


def test_671b_on_one_node_names_the_nodes_it_needs(tmp_path):
    proc = train_py("backend=zero3", "model=deepseek_v3", "precision=bf16", "plan.hardware=8xH100-80GB",
                    "data.seq_len=4096", "train.micro_batch_size=1", run_dir=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert "nodes of 8xH100-80GB (plan.nodes=" in err and "does not fit" in err


RSS_MODEL = ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8", "model.num_heads=8",
             "data.seq_len=128", "train.micro_batch_size=4", "train.steps=2", "train.eval_batches=1",
             "train.sample_tokens=0", "checkpoint.save_final=false", "monitor=[console]", "launch.nproc_per_node=2"]


def test_measured_peak_rss_is_within_25_percent_of_the_plan(tmp_path):
    """A ~30M-parameter model on 2 DDP ranks, without and with activation checkpointing: rank 0's peak RSS
    beside the plan's peak for that rank, and the memory checkpointing saves beside what the plan says it saves
    (the 25% band alone passes a DDP engine that ignores checkpointing, or a plan that does)."""
    s = {}
    for ckpt in (False, True):
        run_dir = tmp_path / f"ckpt-{ckpt}"
        proc = train_py(*RSS_MODEL, f"model.activation_checkpointing={str(ckpt).lower()}", run_dir=run_dir)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        s[ckpt] = json.loads((run_dir / "summary.json").read_text())
        assert 25e6 < s[ckpt]["params"] < 35e6
        assert s[ckpt]["memory_peak_bytes"] == pytest.approx(s[ckpt]["memory_plan_bytes"], rel=0.25), s[ckpt]
        assert "plan per rank: peak" in proc.stdout and "measured peak RSS" in proc.stdout
    saved = s[False]["memory_peak_bytes"] - s[True]["memory_peak_bytes"]
    planned = s[False]["memory_plan_bytes"] - s[True]["memory_plan_bytes"]
    assert planned > 0 and abs(saved - planned) <= 0.5 * planned, \
        f"checkpointing saved {saved / 2**20:.0f} MiB of peak RSS, the plan says {planned / 2**20:.0f} MiB"
