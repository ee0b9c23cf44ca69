"""A real Slurm (``slurm.py``: slurmctld + two slurmd on this host, from Debian's slurm-wlm): ``srun`` of
``train.py`` maps SLURM_* onto ranks on one node, and across two inside the script ``shardyard sbatch`` writes,
which runs to completion and, requeued by ``scontrol requeue``, resumes from its last checkpoint; Hydra's
submitit launcher runs a sweep of two-task jobs (on Slurm a ddp job and an fsdp job, each on two nodes). Every
run is compared with the single-host 2-worker DDP run.
Skipped, with the reason, where Slurm is not installed or this is not root."""

import os
import re
import subprocess
import sys
import time

import pytest
import slurm as local_slurm
from common import RESTARTED, STEPS, close, losses
from conftest import ROOT


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = local_slurm.unavailable()
    if why:
        pytest.skip(why)
    c = local_slurm.start(tmp_path_factory.mktemp("slurm"))
    yield c
    local_slurm.stop(c)


def srun(cluster, layout, run_dir, *overrides, timeout=300):
    return cluster.run("srun", *layout, "--kill-on-bad-exit=1", sys.executable, str(ROOT / "train.py"),
                       f"hydra.run.dir={run_dir}", *STEPS, *overrides, cwd=ROOT, timeout=timeout)


# srun's tasks on one node here. Across two nodes: srun -N2 with 1 task per node is the srun of shardyard sbatch's
# script in test_sbatch_script_runs_and_a_requeued_job_resumes_to_the_clean_result (SLURM_* read as "1/node x 2
# nodes"); FSDP2 on two Slurm nodes is the fsdp job of the submitit_slurm sweep below (it was a -N2 fsdp case of
# this test); ZeRO-2 across hosts is test_multinode.py's DeepSpeed hostfile run.
def test_srun_tasks_train_as_one_host_with_two_workers(cluster, one_host, tmp_path):
    proc = srun(cluster, ["-N1", "-n2"], tmp_path / "run", "backend=ddp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "world size 2 (2/node" in proc.stdout, proc.stdout[-2000:]
    assert close(losses(tmp_path / "run"), one_host("ddp")), (losses(tmp_path / "run"), one_host("ddp"))


def test_sbatch_script_runs_and_a_requeued_job_resumes_to_the_clean_result(cluster, one_host, tmp_path):
    """``shardyard sbatch ... --submit`` on 2 nodes x 1 task; once its first checkpoint is complete the script is
    sent SIGUSR1 as Slurm sends it ahead of the time limit (``scancel --batch --signal=USR1``: to the script
    alone); the script passes it through srun to both workers, which stop after the same step, save it and exit
    75, and the script requeues the job (``scontrol requeue``: the same id). It starts again in the same run
    dir, resumes from the step it was signalled at, and ends with the loss curve of the clean 2-worker run."""
    steps = ["backend=ddp", *RESTARTED]
    out = tmp_path / "job"
    gen = cluster.run(sys.executable, "-m", "shardyard", "sbatch", *STEPS, *steps, "nodes=2", "tasks_per_node=1",
                      f"out_dir={out}", "--submit", cwd=ROOT, timeout=120)
    assert gen.returncode == 0, gen.stdout + gen.stderr
    script = (out / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --requeue" in script and "checkpoint.resume=auto" in script
    assert "#SBATCH --signal=B:USR1@300" in script
    job = re.search(r"submitted job (\d+)", gen.stdout).group(1)
    run_dir = out / job
    cluster.wait_job(job, ("RUNNING",), 60)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] == "RUNNING", (
            cluster.job(job), (out / f"slurm-{job}.out").read_text()[-3000:] if (out / f"slurm-{job}.out").exists() else "")
        time.sleep(0.1)
    signalled = cluster.run("scancel", "--batch", "--signal=USR1", job)
    assert signalled.returncode == 0, signalled.stderr
    # Slurm holds a requeued job back for about two minutes (its BeginTime); an operator may start it sooner,
    # but not within the second of the requeue: slurmd compares whole-second times, and a start in that second
    # still meets the revoked credential of the killed run ("Job credential revoked": the job fails).
    cluster.wait_job(job, ("PENDING",), 120)
    cluster.wait_idle(60)
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    info = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 300)
    log = (out / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    stopped = re.search(r"preempted \(SIGUSR1\) after step (\d+): its checkpoint is published", log)
    both_ends = log[:4000] + "\n[...]\n" + log[-2000:]  # each line below is looked for in the whole log
    # the script's srun over its 2 nodes x 1 task: SLURM_* read across two nodes (srun -N2's own test once)
    assert "world size 2 (1/node x 2 nodes" in log, both_ends
    assert stopped, both_ends
    assert "requeueing job" in log, both_ends
    assert "start 2, run dir" in log, both_ends
    assert f"resumed from {run_dir}/checkpoints/step-{int(stopped.group(1)):08d} " in log, log[-4000:]
    assert close(losses(run_dir), one_host("ddp", *RESTARTED)), (losses(run_dir), one_host("ddp", *RESTARTED))


def test_sbatch_user_errors_name_the_key(tmp_path):
    """Checked before anything is written or submitted (no Slurm needed)."""
    for args, key in [(["recipe=deepseek7b_zero33"], "recipe/deepseek7b_zero33"), (["nodes=0"], "`nodes`"),
                      (["gpus_per_node=eight"], "`gpus_per_node`"), (["nodes"], "KEY=VALUE"),
                      # a value that would write a command of its own into the job script
                      (["job_name=x\necho INJECTED"], "`job_name`"), (["optim.lr=1e-3\necho INJECTED"], "`optim.lr`"),
                      (["partition=a\rb"], "`partition`"), (["account=a\\b"], "`account`")]:
        proc = subprocess.run([sys.executable, "-m", "shardyard", "sbatch", *args, f"out_dir={tmp_path / 'x'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and key in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert not (tmp_path / "x").exists()
    helped = subprocess.run([sys.executable, "-m", "shardyard", "sbatch", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and all(k in helped.stdout for k in ("gpus_per_node", "partition", "out_dir"))


def test_sbatch_script_quotes_every_value_and_runs_from_a_dir_with_spaces(tmp_path, monkeypatch):
    """Values with spaces, quotes and shell syntax reach sbatch and train.py as given: the script parses
    (``bash -n``), its ``#SBATCH`` lines split into the given values, and run under a stand-in ``srun`` (no
    Slurm needed) it changes to the working directory with spaces and hands train.py its arguments unchanged."""
    import shlex

    from shardyard.launching import sbatch

    work = tmp_path / "my work dir"
    out = tmp_path / "out dir, it's $HOME; `x`"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["nodes=2", "tasks_per_node=1", "job_name=it's a \"job\"; echo no", "partition=a b", f"out_dir={out}",
            *STEPS, "optim.lr=1e-3", "train.sample_prompt='a b $(echo no)'"]
    path = sbatch.main(args, submit=False)
    text = path.read_text()
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, text
    # Slurm's #SBATCH parser honours the same quotes as bash (and no backslash is let through).
    directives = [shlex.split(line[len("#SBATCH "):])[0] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert directives[:4] == ["--job-name=it's a \"job\"; echo no", "--nodes=2", "--ntasks-per-node=1",
                              "--partition=a b"], directives
    assert f"--output={out}/slurm-%j.out" in directives
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\npwd\necho "$SHARDYARD_RUN_DIR"\nprintf "%s\\n" "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\nexit 1\n")  # no controller: the script's fallback
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node[01-02]"}
    ran = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert "no" not in lines  # no `echo no` of a value ran
    assert f"run dir {out}/7, rank 0 at node01:20007" in lines[0], lines[0]
    assert lines[1:4] == [str(work), f"{out}/7", "--kill-on-bad-exit=1"], lines
    assert lines[4:] == [sys.executable, "-m", "shardyard", "train", *STEPS, "optim.lr=1e-3",
                         "train.sample_prompt='a b $(echo no)'", "checkpoint.resume=auto"], lines


def test_sbatch_script_passes_sigusr1_on_and_requeues_on_exit_75(tmp_path, monkeypatch):
    """The job script under stand-ins (no Slurm needed): it asks Slurm for SIGUSR1 ahead of the time limit
    (``--signal=B:USR1@N``, ``signal_s``; none with 0), and bash runs it as Slurm would: SIGUSR1 to the script
    reaches the workers through srun (here a stand-in that exits 75 on it, as the workers do once saved) and
    the script requeues its own job; SIGTERM (scancel, preemption) requeues nothing though the workers exit 75;
    a run that ends by itself exits 0 and requeues nothing."""
    import signal as signals

    from shardyard.launching import sbatch

    monkeypatch.chdir(tmp_path)
    text = sbatch.main([*STEPS, "nodes=1", "tasks_per_node=2", f"out_dir={tmp_path / 'out'}"], submit=False).read_text()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    none = sbatch.main([*STEPS, "signal_s=0", f"out_dir={tmp_path / 'none'}"], submit=False).read_text()
    assert "#SBATCH --signal" not in none and "#SBATCH --requeue" in none
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: "started", then 75 on SIGUSR1 or SIGTERM (the workers saved), or 0 when told to end by itself
    (bin_dir / "srun").write_text(f"#!{sys.executable}\nimport os, signal, sys, time\n"
                                  "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))\n"
                                  "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
                                  "open(os.environ['STARTED'], 'w').write(str(os.getpid()))\n"
                                  "time.sleep(0 if os.environ.get('END') else 120)\n")
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n[ "$1" = requeue ]\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    for sent, end, code, requeued in [(signals.SIGUSR1, "", 75, ["requeue 7"]), (signals.SIGTERM, "", 75, []),
                                      (None, "1", 0, [])]:
        started, log = tmp_path / "started", tmp_path / "scontrol.log"
        started.unlink(missing_ok=True)
        log.write_text("")
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
               "SLURM_JOB_NODELIST": "node01", "STARTED": str(started), "SCONTROL_LOG": str(log), "END": end}
        job = subprocess.Popen(["bash", str(tmp_path / "out/job.sbatch")], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not started.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        while not started.read_text():
            time.sleep(0.05)
        if sent is not None:  # to the script alone, as --signal=B: does; SIGTERM from Slurm reaches the steps too
            job.send_signal(sent)
        if sent == signals.SIGTERM:
            os.kill(int(started.read_text()), sent)
        out, err = job.communicate(timeout=60)
        assert job.returncode == code, (sent, job.returncode, out, err)
        assert [line for line in log.read_text().splitlines() if not line.startswith("show")] == requeued, (sent, out)


@pytest.mark.parametrize("launcher", ["submitit_slurm", "submitit_local"])
def test_hydra_submitit_launcher_runs_a_sweep_of_two_task_jobs(launcher, request, one_host, tmp_path):
    """``python train.py -m hydra/launcher=submitit_* backend=ddp,fsdp``: a 2-job sweep whose jobs have 2 tasks
    each; each task runs train.py's task function and is one worker. The Slurm executor's jobs span 2 nodes x 1
    task and read SLURM_*, the local executor's (1 node x 2 tasks) SUBMITIT_LOCAL_*. Every job equals the
    single-host 2-worker DDP run (ddp at 1e-5, fsdp at the engine matrix's 1e-4: the engines are equal there, a
    rank that trained on the wrong shard is ~1e-2 off), runs the engine its name says (its config.yaml), and the
    sweep ends with its summary. The Slurm executor's fsdp job is FSDP2 on two Slurm nodes (once the -N2 case of
    test_srun_tasks_...). The local executor runs the sweep of one job (ddp): a sweep of several jobs, its ranking
    and its best are the Slurm executor's here and the basic launcher's and joblib's in tests/e2e/test_sweep.py
    (the same sweeper), which also sweeps optim.lr (jobs named lr=..., the learning rate taking)."""
    import glob
    import json

    from omegaconf import OmegaConf

    if launcher == "submitit_slurm":
        cluster = request.getfixturevalue("cluster")
        layout, env, run = ["hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"], cluster.env, cluster.run
    else:
        layout, env, run = ["hydra.launcher.tasks_per_node=2"], None, None
    backends = "ddp,fsdp" if env else "ddp"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"hydra/launcher={launcher}", *layout,
           "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={tmp_path}", *STEPS, f"backend={backends}",
           "optim.lr=1e-3"]
    proc = run(*cmd, cwd=ROOT, timeout=300) if run else subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    texts = [open(f).read() for f in sorted(glob.glob(f"{tmp_path}/.submitit/*/*log.*"))]
    logs = "\n".join(t[-2000:] for t in texts)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + logs
    world = "world size 2 (1/node x 2 nodes" if env else "world size 2 (2/node on"
    # job dir -> (its engine, rtol against one_host("ddp")); a name shows what varies
    jobs = {"0_backend=ddp": ("ddp", 1e-5), "1_backend=fsdp": ("fsdp", 1e-4)} if env else {"0": ("ddp", 1e-5)}
    summary = json.load(open(tmp_path / "sweep_summary.json"))
    assert sorted(r["job"] for r in summary["jobs"]) == sorted(jobs), summary
    assert all(r["status"] == "finished" for r in summary["jobs"]), summary
    assert summary["best"]["job"] == min(summary["jobs"], key=lambda r: r["objective"])["job"]
    for job, (engine, rtol) in jobs.items():
        # its rank 0's log (submitit's, one per task) names its run dir and the world it laid out
        said = [t for t in texts if f"/{job} (workers started by submitit)" in t]
        assert len(said) == 1 and world in said[0], (job, logs)
        assert OmegaConf.load(tmp_path / job / "config.yaml").backend.name == engine
        assert json.load(open(tmp_path / job / "summary.json"))["world_size"] == 2
        assert close(losses(tmp_path / job), one_host("ddp"), rtol), (job, losses(tmp_path / job))
