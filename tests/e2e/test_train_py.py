"""``python train.py`` as a user runs it: training, launchers, sweeps, export, and user errors."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, train_py
from shardyard.testing import run_python

FAST = [*TINY, "train.steps=30", "train.log_every_n_steps=5", "train.eval_every_n_steps=15", "optim.lr=3e-3",
        "checkpoint.save_final=true", "train.sample_tokens=8"]


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def check_run(run_dir, proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = metrics(run_dir)
    evals = [x["eval/loss"] for x in m if "eval/loss" in x]
    assert evals[-1] < evals[0] - 0.5, evals  # it learned
    assert (run_dir / "config.yaml").exists() and (run_dir / "summary.json").exists()
    return m


# ``python train.py`` that writes, as its process exits, the names of the modules it imported (issue 53)
WITH_MODULES = """import atexit, json, runpy, sys
atexit.register(lambda: json.dump(sorted(sys.modules), open({out!r}, "w")))
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""
NOT_ASKED = ("deepspeed", "horovod", "lm_eval", "trl")
"""What a run imports only when its config asks for it (backend=zero*, horovod, train.eval_tasks, tests' TRL)."""


def test_default_recipe_trains_and_exports(tmp_path):
    """The default recipe (DDP) trains, exports, and imports nothing of DeepSpeed, Horovod, lm-eval or TRL on the
    way, the export included (transformers' save_pretrained imported DeepSpeed through accelerate). Its export
    ends a transformers generate at the tokenizer's eos and nowhere else (conftest)."""
    from shardyard.testing import run_python

    driver, modules, run_dir = tmp_path / "with_modules.py", tmp_path / "modules.json", tmp_path / "run"
    driver.write_text(WITH_MODULES.format(out=str(modules), train=str(ROOT / "train.py")))
    proc = run_python([str(driver), f"hydra.run.dir={run_dir}", *FAST], str(ROOT),
                      {**os.environ, "PYTHONUNBUFFERED": "1"}, 600)
    m = check_run(run_dir, proc)
    assert "tokens/step" in proc.stdout and "accumulation" in proc.stdout and "world size 1" in proc.stdout
    assert {"train/loss", "lr", "grad_norm", "tokens_per_s"} <= set(m[1])
    imported = {name.split(".")[0] for name in json.load(open(modules))}
    assert {"torch", "transformers", "shardyard"} <= imported and not imported & set(NOT_ASKED), \
        sorted(imported & set(NOT_ASKED))
    assert "Setting accelerator" not in proc.stdout + proc.stderr  # DeepSpeed's warning as it is imported
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import generation_ends_at_the_tokenizers_eos

    generation_ends_at_the_tokenizers_eos(run_dir / "hf")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(run_dir / "hf", local_files_only=True)
    ids = tok("def main(", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 8
    # The export scores the eval set as the trained model did (check_run: that loss fell by more than 0.5 from
    # the step-0 eval of the fresh init, ~8.35): the exported weights are the trained ones.
    from shardyard.testing import compose, hf_eval_loss

    final_eval = [x["eval/loss"] for x in m if "eval/loss" in x][-1]
    got = hf_eval_loss(str(run_dir / "hf"), compose(FAST), 1)
    assert abs(got - final_eval) <= 1e-4 * final_eval, (got, final_eval)


LAUNCH = [*TINY, "train.steps=3", "train.eval_every_n_steps=0", "train.global_batch_size=8"]


def test_every_launcher_runs_the_same_job(tmp_path):
    """Our elastic agent (`launch.nproc_per_node=2`), the user's torchrun and srun-style tasks start the same
    2-rank DDP job from the same train.py: the losses agree bit for bit, and each writes one run dir."""
    agent = train_py(*LAUNCH, "launch.nproc_per_node=2", "metrics.report=true", run_dir=tmp_path / "agent")
    assert agent.returncode == 0, agent.stdout[-3000:] + agent.stderr[-3000:]
    assert "world size 2" in agent.stdout
    assert sorted(os.listdir(tmp_path / "agent")) == ["config.yaml", "metrics.jsonl", "plan.json", "report.png", "summary.json"]
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "train.py", f"hydra.run.dir={tmp_path / 'torchrun'}", *LAUNCH], cwd=ROOT,
                              capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert "report.png" not in os.listdir(tmp_path / "torchrun")  # metrics.report=false (TINY's) draws none
    procs = []  # two processes with the variables srun gives its tasks (no Slurm needed to check the mapping)
    for rank in range(2):
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "127.0.0.1",
               "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen([sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'srun'}", *LAUNCH],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    summaries = {name: json.load(open(tmp_path / name / "summary.json")) for name in ("agent", "torchrun", "srun")}
    assert {s["world_size"] for s in summaries.values()} == {2}
    curves = {name: s["train_losses"] for name, s in summaries.items()}
    assert len(curves["agent"]) == 3 and curves["torchrun"] == curves["agent"] == curves["srun"], curves


def test_multirun_sweep_runs_each_job_in_its_own_dir(tmp_path):
    cmd = [sys.executable, "train.py", "-m", "optim.lr=1e-3,3e-3", "launch.nproc_per_node=2",
           f"hydra.sweep.dir={tmp_path}", *[o for o in FAST if not o.startswith("optim.lr")], "train.steps=4",
           "checkpoint.save_final=false"]
    proc = run_python(cmd[1:], str(ROOT), {**os.environ, "PYTHONUNBUFFERED": "1"}, 600)  # forked warm, as train_py
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [j.name[:2] for j in jobs] == ["0_", "1_"] and all(len(j.name) <= 64 for j in jobs)
    from omegaconf import OmegaConf

    assert [OmegaConf.load(j / "config.yaml").optim.lr for j in jobs] == [1e-3, 3e-3]
    assert all(json.load(open(j / "summary.json"))["world_size"] == 2 for j in jobs)


@pytest.mark.parametrize("overrides,expect", [
    (["backend=ddpp"], "Available options in 'backend'"),
    (["recipe=deepseek7b_zero33"], "Available options in 'recipe'"),  # a misspelt recipe never trains the default
    (["train.stepz=3"], "train.stepz"),
    (["train.global_batch_size=30", "train.micro_batch_size=8"], "not a multiple of micro batch 8"),
    (["model.num_heads=7"], "`model.num_heads` (value: 7)"),  # before any process starts, not transformers'
    (["hydra.run.dir=/proc/forbidden"], "`hydra.run.dir` (value: '/proc/forbidden')"),  # before Hydra makes it
    (["checkpoint.every_n_steps=-1"], "`checkpoint.every_n_steps` (value: -1)"),
    (["+some.key=value"], "`some`"),
])
def test_bad_input_exits_2_with_one_paragraph(overrides, expect, tmp_path):
    proc = train_py(*overrides, run_dir=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert expect in proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


@pytest.mark.parametrize("engine", ["ddp", "horovod"])
def test_a_worker_that_raises_shows_its_traceback_once(engine, tmp_path):
    """A bug in a worker (an exception, not a user error) ends the job with exit 1 at once, and its traceback
    reaches the user once: a forked CPU worker's exception reached only the launcher and was lost (issue 42's EP +
    selective checkpointing crash showed nothing but an exit code), and the raising rank then waited in its
    teardown's barrier for peers that were in another collective (the job hung until the group's timeout). The
    launcher names the rank that raised, not rank 0, which fails too on losing its peer (torch's agent reports the
    first dead worker it polls, in rank order: rank 0 was named 3 runs in 3 before the lost peer's wait). Horovod's
    CPU workers, forked by our launcher, alike (its rank 0 fails with "Horovod has been shut down")."""
    proc = train_py(*TINY, f"backend={engine}", "launch.nproc_per_node=2", "train.steps=3", "train.eval_every_n_steps=0",
                    "train.global_batch_size=8", run_dir=tmp_path, timeout=300,
                    env={"SHARDYARD_TEST_CRASH_AT_STEP": "1:1=raise"})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "worker rank 1 failed with exit code 1 " in proc.stderr, proc.stderr[-3000:]
    said = "RuntimeError: SHARDYARD_TEST_CRASH_AT_STEP: rank 1 raises after step 1"
    assert proc.stderr.count(said) == 1 and "Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert "drills.py" in proc.stderr.split(said)[0].rsplit("Traceback", 1)[1]  # the frames of the raising code
    # Rank 0 failed only on losing rank 1: one line, no traceback of its own beside the real one (a traceback beside a
    # peer's user error read as a bug: a stale build lock's exit 2 under load, test_op_build_lock.py)
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "shardyard | rank 0 lost a peer (" in proc.stderr, proc.stderr[-3000:]


def test_help_lists_groups_and_options():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    from shardyard.testing import CONF_DIR
    from pathlib import Path

    for group in ["backend", "model", "data", "optim", "sched", "precision", "checkpoint", "monitor"]:
        options = ", ".join(sorted(p.stem for p in Path(CONF_DIR, group).glob("*.yaml")))
        assert f"{group}: {options}" in proc.stdout


@pytest.mark.parametrize("flag", [["--help"], ["--cfg", "job"]])
def test_help_and_cfg_do_not_import_torch(flag):
    """train.py leaves through os._exit after running the atexit handlers (cli.leave), so the check is one."""
    code = ("import atexit, sys, runpy\n"
            "atexit.register(lambda: print('torch imported' if 'torch' in sys.modules else 'clean', flush=True))\n"
            f"sys.argv = ['train.py', *{flag!r}]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit: pass\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("clean"), proc.stdout[-500:] + proc.stderr


def test_rerunning_a_finished_run_says_complete_then_trains_on(tmp_path):
    """checkpoint.resume=auto on a finished run exits 0 saying so; with train.steps raised it trains on, and its
    summary's eval baseline is the run's own step-0 evaluation (from metrics.jsonl), as if uninterrupted."""
    run = [*TINY, "backend=single", "train.eval_every_n_steps=2", "checkpoint.every_n_steps=2",
           "checkpoint.resume=auto"]
    first = train_py(*run, "train.steps=4", run_dir=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    baseline = json.load(open(tmp_path / "summary.json"))["eval_losses"][0]
    again = train_py(*run, "train.steps=4", run_dir=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete" in again.stdout and "Traceback" not in again.stderr
    more = train_py(*run, "train.steps=6", run_dir=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert "resumed from" in more.stdout and len(summary["step_wall_s"]) == 2  # trained steps 5-6 only
    assert summary["eval_losses"][0] == baseline and baseline[0] == 0
    assert [s for s, _ in summary["eval_losses"]] == [0, 2, 4, 6]
    assert f"eval loss {baseline[1]:.4f} (step 0)" in more.stdout


def _files(run_dir):
    """Every file under ``run_dir`` with its bytes' hash and mtime (what a refused or finished rerun must keep)."""
    import hashlib

    return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_run_dir_belongs_to_one_run(tmp_path):
    """The same command twice into one run dir is refused saying what is there; checkpoint.resume=auto on the
    finished run exits 0 and touches nothing; checkpoint.overwrite_run_dir moves the old results aside intact;
    a checkpoint.dir that another run writes is refused."""
    run = [*TINY, "backend=single", "train.steps=2", "train.eval_every_n_steps=0", "checkpoint.save_final=true"]
    r = tmp_path / "r"
    first = train_py(*run, run_dir=r)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(r)
    assert {"config.yaml", "summary.json", "metrics.jsonl"} <= set(before) and (r / "hf").is_dir()

    again = train_py(*run, run_dir=r)
    said = " ".join(again.stderr.split())
    assert again.returncode == 2 and "error in `hydra.run.dir`" in said and "finished at step 2" in said, said
    assert "checkpoint.resume=auto" in said and "checkpoint.overwrite_run_dir=true" in said
    assert "Traceback" not in again.stderr and _files(r) == before

    done = train_py(*run, "checkpoint.resume=auto", run_dir=r)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already complete" in done.stdout and "finished at step 2" in done.stdout
    assert _files(r) == before  # not one byte or mtime changed, nothing added

    fresh = train_py(*run, "checkpoint.overwrite_run_dir=true", "checkpoint.every_n_steps=2", run_dir=r)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (aside,) = [p for p in r.iterdir() if p.name.startswith("previous-")]
    assert f"moved aside to {aside}" in fresh.stdout
    assert {k: v[0] for k, v in _files(aside).items()} == {k: v[0] for k, v in before.items()}  # byte-identical
    steps = [[json.loads(line)["step"] for line in open(d / "metrics.jsonl")] for d in (r, aside)]
    assert steps[0] == steps[1] == [0, 1, 2, 2], steps  # the new run's lines alone (eval 0, train 1-2, eval 2)
    assert (r / "checkpoints" / "OWNER").read_text().strip() == str(r)

    other = tmp_path / "other"
    foreign = train_py(*run, f"checkpoint.dir={r / 'checkpoints'}", "checkpoint.every_n_steps=1", run_dir=other)
    said = " ".join(foreign.stderr.split())
    assert foreign.returncode == 2 and "error in `checkpoint.dir`" in said and f"the run in {r}" in said, said
    assert f"hydra.run.dir={r} checkpoint.resume=auto" in said and "Traceback" not in foreign.stderr
    assert not (other / "config.yaml").exists() and not (r / "checkpoints" / "step-00000001").exists()


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Resumed from its step-2 checkpoint after it had logged steps 3-4, the run logs them again: metrics.jsonl,
    the CSV and TensorBoard (read by its own reader) hold each step once, the replayed values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = [*TINY, "backend=single", "train.steps=4", "train.eval_every_n_steps=2", "checkpoint.every_n_steps=2",
           "monitor=[console,csv,tensorboard]"]
    first = train_py(*run, run_dir=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = train_py(*run, f"checkpoint.resume={tmp_path}/checkpoints/step-00000002", run_dir=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    train_steps = [r["step"] for r in metrics(tmp_path) if "train/loss" in r]
    eval_steps = [r["step"] for r in metrics(tmp_path) if "eval/loss" in r]
    assert train_steps == [1, 2, 3, 4] and eval_steps == [0, 2, 4], (train_steps, eval_steps)
    import csv

    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4], rows
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, 2, 4]
    replayed = {r["step"]: r["train/loss"] for r in metrics(tmp_path) if "train/loss" in r}
    assert [round(e.value, 5) for e in acc.Scalars("train/loss")] == [round(replayed[s], 5) for s in (1, 2, 3, 4)]
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    newest = max((tmp_path / "tensorboard").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    starts = [e.step for e in EventFileLoader(str(newest)).Load() if e.HasField("session_log")]
    assert starts == [3]  # TensorBoard's purge marker: every reader drops the earlier files' steps >= 3
