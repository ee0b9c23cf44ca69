"""2 Horovod workers equal the single-process run: under the Gloo controller (our launcher, which on CPU forks the
workers beside Horovod's rendezvous server; ``horovodrun --gloo`` across hosts is tests/cluster/test_multinode.py's)
and under MPI (our launcher with ``backend.controller=mpi``, the user's own ``mpirun`` and ``horovodrun --mpi``)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, train_py

hvd = pytest.importorskip("horovod.torch", reason="Horovod is built by `make setup` (SHARDYARD_SKIP_HOROVOD=1 skips it)")
needs_mpi = pytest.mark.skipif(not (hvd.mpi_built() and shutil.which("mpirun")),
                               reason="Open MPI and a Horovod built with it: `make test` installs openmpi-bin and "
                                      "libopenmpi-dev (apt, as root) before setup builds Horovod")

STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8"]


def losses(run_dir, key="train_losses"):
    return [loss for _, loss in json.load(open(run_dir / "summary.json"))[key]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    proc = train_py(*STEPS, "backend=single", run_dir=d)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return losses(d), losses(d, "grad_norms"), d


def run_horovod(tmp_path, *extra, controller="GLOO"):
    proc = train_py(*STEPS, "backend=horovod", "launch.nproc_per_node=2", *extra, run_dir=tmp_path)
    return finished(proc, tmp_path, controller)


def finished(proc, run_dir, controller):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"horovod: 2 workers, {controller} controller" in proc.stdout, proc.stdout[-3000:]  # hvd.mpi_enabled()
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["world_size"] == 2 and summary["backend"] == "horovod"
    return losses(run_dir)


def mpi_launch(launcher, run_dir, *overrides):
    """The user's own launch: ``mpirun -np 2 python train.py ...`` (``horovodrun --mpi``, which runs mpirun, is
    what our launcher starts with ``backend.controller=mpi``)."""
    assert launcher == "mpirun", launcher
    cmd = ["mpirun", "-np", "2", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]  # root: Open MPI asks
    cmd += [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *STEPS, "backend=horovod", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})


def allreduces(events, pid):
    """The shapes of the ALLREDUCE operations in one row of a Horovod timeline, in order: its begin (B) and
    end (E) events nest, and the end of an operation carries the tensor's shape."""
    stack, shapes = [], []
    for e in events:
        if e.get("pid") != pid or e.get("ph") not in ("B", "E"):
            continue
        if e["ph"] == "B":
            stack.append(e)
            continue
        begin = stack.pop()
        assert e["ts"] >= begin["ts"] > 0, (begin, e)
        if begin["name"] == "ALLREDUCE":
            shapes.append(e["args"]["shape"])
    assert not stack, stack
    return shapes


def test_horovod_matches_single_process_resumes_bit_for_bit_and_times_every_gradient(reference, tmp_path):
    """Our launcher's Gloo controller at accumulation 2 (micro batch 2 of 4 per worker; MPI's: the user's own mpirun
    below) equals the single process; the same run preempted in step 3 (SIGUSR1 to ``python train.py``, passed on
    to the workers it forks on CPU) saves that step and exits 75, and resumes to the same losses bit for bit (steps
    4-5 trained again, 1-3 read from the checkpoint); and its timeline (``backend.timeline``) holds, for every parameter of the
    exported model, one allreduce of its gradient per optimizer step with the tensor's shape: accumulation
    allreduces once a step (``backward_passes_per_step``). Accumulation 1 (micro 4) equals the single process too,
    under this Gloo controller in tests/dist/test_finetune.py (LoRA: loss and grad norm 1e-4), test_post_training.py
    (weights 1e-4) and test_moe_engines.py (MTP losses 1e-4, router biases 1e-6), on 2 workers at accumulation 1.
    Its HF exports (in the checkpoints and the final one) are written by both workers, a shard each.
    (One run for what were three: the resume was test_checkpoint's, the timeline test_engines_e2e's.)"""
    from transformers import AutoModelForCausalLM

    got = run_horovod(tmp_path / "a", "train.micro_batch_size=2", "checkpoint.every_n_steps=3",
                      "checkpoint.save_final=true", "checkpoint.export_hf=true", "backend.timeline=true")
    assert max(abs(a - b) / b for a, b in zip(got, reference[0])) <= 1e-4, (got, reference[0])
    # The global pre-clip grad norm too: hvd.broadcast_optimizer_state on a fresh AdamW once ran a zero-gradient
    # step whose weight decay shrank every weight by (1 - lr * wd) before training (1e-4 off here, 1e-3 in LoRA).
    norms = losses(tmp_path / "a", "grad_norms")
    assert max(abs(a - b) / b for a, b in zip(norms, reference[1])) <= 1e-5, (norms, reference[1])

    events = json.load(open(tmp_path / "a" / "horovod_timeline.json"))
    pids = {e["args"]["name"]: e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}
    steps = json.load(open(tmp_path / "a" / "summary.json"))["steps"]
    # The export is written by both workers, a shard each, as DDP's ranks write theirs (rank 0 wrote it alone while
    # the other waited): in the checkpoint of step 3 each shard hashed by its writer, and the run's final hf/.
    meta = json.load(open(tmp_path / "a" / "checkpoints" / "step-00000003" / "meta.json"))
    shards = sorted((rel, e.get("rank", 0)) for rel, e in meta["manifest"].items()
                    if rel.startswith("hf/") and rel.endswith(".safetensors"))
    assert [r for _, r in shards] == [0, 1], shards
    assert sorted(p.name for p in (tmp_path / "a" / "hf").glob("*.safetensors")) == \
        [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "hf", local_files_only=True)
    for name, p in model.named_parameters():
        assert allreduces(events, pids[f"allreduce.{name}"]) == [str(list(p.shape))] * steps, name

    # Preempted in step 3 (rank 1 sends SIGUSR1 to python train.py, as Slurm signals a job: our launcher passes it
    # on to its forked workers, which save step 3 and exit 75, and so does the job); resume=auto trains steps 4-5
    # to run a's losses bit for bit.
    stopped = train_py(*STEPS, "backend=horovod", "launch.nproc_per_node=2", "train.micro_batch_size=2",
                       run_dir=tmp_path / "b", env={"SHARDYARD_TEST_SIGNAL_AT_STEP": "3:1=USR1"})
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "preempted (SIGUSR1) after step 3: its checkpoint is published" in stopped.stdout + stopped.stderr
    resumed = run_horovod(tmp_path / "b", "train.micro_batch_size=2", "checkpoint.resume=auto")
    la = json.load(open(tmp_path / "a/summary.json"))["train_losses"]
    lb = json.load(open(tmp_path / "b/summary.json"))["train_losses"]
    assert lb == la and [s for s, _ in lb] == [1, 2, 3, 4, 5] and resumed == got  # 1-3 read back, 4-5 bit for bit
    assert len(json.load(open(tmp_path / "b/summary.json"))["step_wall_s"]) == 2  # really resumed


@needs_mpi
def test_users_own_mpirun_matches_single_process(reference, tmp_path):
    """``mpirun -np 2 python train.py backend=horovod``: no controller named (auto), MPI used, accumulation 2."""
    got = finished(mpi_launch("mpirun", tmp_path, "train.micro_batch_size=2"), tmp_path, "MPI")
    assert max(abs(a - b) / b for a, b in zip(got, reference[0])) <= 1e-4, (got, reference[0])
    norms = losses(tmp_path, "grad_norms")
    assert max(abs(a - b) / b for a, b in zip(norms, reference[1])) <= 1e-5, (norms, reference[1])


@needs_mpi
def test_horovod_over_mpi_with_fp16_compression_and_timeline(reference, tmp_path):
    """Our launcher with ``backend.controller=mpi`` (``horovodrun --mpi``, which runs ``mpirun``; accumulation 1):
    fp16 on the wire trains close to fp32, and the timeline is a Chrome trace whose events name the all-reduces.
    (MPI's exact equality with one process: the user's own mpirun above, at accumulation 2; accumulation 1 equals
    it under Gloo in tests/dist/test_finetune.py, test_post_training.py and test_moe_engines.py. Gloo's fp16
    compression: the deepseek_tiny_horovod2 recipe's smoke run. One run for what were two, the suite's time.)"""
    got = run_horovod(tmp_path, "backend.controller=mpi", "backend.compression=fp16", "backend.timeline=true",
                      controller="MPI")
    assert got[-1] < got[0] - 0.05, got  # it trains (the fp32 reference falls by 0.09 in these 5 steps)
    assert got != reference[0] and max(abs(a - b) / b for a, b in zip(got, reference[0])) <= 2e-2, (got, reference[0])
    trace = json.load(open(tmp_path / "horovod_timeline.json"))
    assert any("ALLREDUCE" in str(e.get("name", "")) for e in trace), trace[:20]


@needs_mpi
def test_gloo_controller_under_mpirun_is_a_user_error(tmp_path):
    proc = mpi_launch("mpirun", tmp_path, "backend.controller=gloo")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "backend.controller" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
