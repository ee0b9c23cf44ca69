"""kill -9 during training and during a save, and elastic restarts: nothing half-written ever looks complete,
and ``checkpoint.resume=auto`` (or the agent's restart) continues from the newest checkpoint that verifies
(sha256 of every file) and loads; damaged ones are skipped with a line saying why. A full disk ends the run
with one paragraph and leaves the older checkpoints intact."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, TINY, train_py
from shardyard.training.integrity import _files, _meta_digest, verify, writer
from shardyard.core.drills import SAVE_POINTS

RUN = [*TINY, "train.eval_every_n_steps=0", "train.global_batch_size=8", "launch.nproc_per_node=2",
       "checkpoint.every_n_steps=2", "train.log_every_n_steps=1"]


def start(run_dir, *extra, env=None):
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *RUN, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)


def wait_for(path, proc, timeout=300):
    t = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t < timeout, f"{path} never appeared"
        time.sleep(0.2)


def workers(proc):
    """The worker processes of a `python train.py` job: on CPU they fork from it (same command line)."""
    parent = psutil.Process(proc.pid)
    return [c for c in parent.children(recursive=True)
            if "shardyard.training.worker" in " ".join(c.cmdline()) or c.cmdline() == parent.cmdline()]


def _consumed(run_dir, last: int, steps: int) -> list[int]:
    """The sample ids a killed-and-resumed run trained on (``data.log_sample_ids``): steps up to ``last`` from
    the first attempt's two ranks (its logs moved to ``samples-killed`` before the resume), the rest from the
    resumed attempt's one rank. Which attempt wrote a line is known by its file, never guessed from its order
    (the killed attempt may have stopped at the checkpoint's own step, or past it)."""
    def ids(folder: str, ranks: tuple[int, ...], up_to: int) -> list[int]:
        return [i for rank in ranks for line in open(run_dir / folder / f"rank{rank}.jsonl")
                for rec in [json.loads(line)] if rec["step"] <= up_to for i in rec["ids"]]
    resumed = ids("samples", (0,), steps)
    assert min(json.loads(line)["step"] for line in open(run_dir / "samples/rank0.jsonl")) == last + 1
    return sorted(ids("samples-killed", (0, 1), last) + resumed)


def test_kill_9_a_worker_then_resume_auto_at_another_world_size(tmp_path):
    """kill -9 of one of two workers, then ``resume=auto`` with one: the samples trained on (by their ids, a
    two-source mixture with document masking) are exactly an uninterrupted run's, no repeat, no skip."""
    from shardyard.data import pipeline as data
    from shardyard.testing import compose, synthetic_corpus

    for i in (0, 1):
        (tmp_path / f"corpus{i}").mkdir()
        synthetic_corpus(str(tmp_path / f"corpus{i}/c.jsonl"), 0.3, seed=i)
    mix = ["data=mixture", "data.tokenizer.vocab_size=1000", "data.document_mask=true", "data.log_sample_ids=true",
           f"data.sources=[{{name: one, paths: [{tmp_path}/corpus0], weight: 3}}, "
           f"{{name: two, paths: [{tmp_path}/corpus1], weight: 1}}]"]
    run = tmp_path / "run"
    proc = start(run, "train.steps=400", *mix)
    wait_for(run / "checkpoints/step-00000002/meta.json", proc)
    workers(proc)[-1].send_signal(signal.SIGKILL)
    try:  # the survivor ends the job. A hang guard, not a latency bound: python bench/failure_detection.py times it
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("hang guard: the job had not ended 600 s after one of its workers was killed (how "
                             "soon it ends is measured, never asserted: python bench/failure_detection.py)") from None
    assert proc.returncode != 0 and "failed" in err and "rank" in err, err[-3000:]
    done = sorted(p for p in os.listdir(run / "checkpoints") if p.startswith("step-"))
    assert done and all(verify(str(run / "checkpoints" / d)) is None for d in done)
    last = int(done[-1].split("-")[1])
    os.rename(run / "samples", run / "samples-killed")  # the resumed attempt logs afresh
    proc2 = train_py(*RUN, *mix, "train.steps=%d" % (last + 2), "checkpoint.resume=auto", "launch.nproc_per_node=1",
                     run_dir=run)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/{done[-1]}" in proc2.stdout
    cfg = compose([*RUN, *mix, "train.steps=%d" % (last + 2)])
    samples = data.open_train(data.prepare(cfg), cfg.data, cfg.seed, (last + 2) * 8)
    expected = sorted(samples.sample_ids(range((last + 2) * 8)).tolist())
    assert _consumed(run, last, last + 2) == expected
    final = [json.loads(line) for line in open(run / "metrics.jsonl") if "eval/loss" in line][-1]
    assert {"eval/loss/one", "eval/loss/two"} <= set(final)  # each source evaluated on its own held-out documents
    assert final["eval/loss"] == pytest.approx(0.75 * final["eval/loss/one"] + 0.25 * final["eval/loss/two"])


def test_damaged_checkpoints_are_skipped_back_to_the_newest_good_one(tmp_path):
    """Four checkpoints, the newest three damaged three ways: step 8 verifies but cannot be loaded (its
    ``.metadata`` replaced, manifest updated), step 6 has a truncated shard, step 4 one flipped byte of
    ``.metadata`` (same size: only the hash sees it). resume=auto says why it skips each and resumes at 2."""
    proc = train_py(*RUN, "train.steps=8", "checkpoint.keep_last=0", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ck = tmp_path / "checkpoints"
    assert all(".metadata" in json.load(open(ck / d / "meta.json"))["manifest"] for d in os.listdir(ck) if d.startswith("step-"))
    meta8 = json.load(open(ck / "step-00000008/meta.json"))
    (ck / "step-00000008/.metadata").write_bytes(b"not a pickle")
    meta8["manifest"][".metadata"] = {"bytes": 12, "sha256": hashlib.sha256(b"not a pickle").hexdigest()}
    meta8["meta_sha256"] = _meta_digest(meta8)  # hashes are no signature: a whole rewrite verifies
    (ck / "step-00000008/meta.json").write_text(json.dumps(meta8))
    shard = max((p for p in (ck / "step-00000006").rglob("*") if p.is_file() and p.name != "meta.json"),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    flipped = bytearray((ck / "step-00000004/.metadata").read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    (ck / "step-00000004/.metadata").write_bytes(bytes(flipped))
    assert verify(str(ck / "step-00000008")) is None and "sha256 differs" in verify(str(ck / "step-00000004"))
    bad = train_py(*RUN, "train.steps=9", f"checkpoint.resume={ck / 'step-00000004'}", run_dir=tmp_path / "x")
    assert bad.returncode == 2 and "truncated or corrupt" in bad.stderr and ".metadata" in bad.stderr  # named: refused
    proc = train_py(*RUN, "train.steps=9", "checkpoint.keep_last=0", "checkpoint.resume=auto", run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert f"skipping {ck}/step-00000008: it could not be loaded" in err
    assert f"skipping {ck}/step-00000006: {shard.relative_to(ck / 'step-00000006')} is truncated or corrupt" in err
    assert f"skipping {ck}/step-00000004: .metadata is truncated or corrupt: its sha256 differs" in err
    assert f"resumed from {ck}/step-00000002" in proc.stdout and "3 newer one(s) skipped" in proc.stdout
    assert all(verify(str(ck / f"step-{s:08d}")) is None for s in (2, 4, 6, 8))  # saved again, whole
    aside = sorted(d for d in os.listdir(ck) if d.startswith("abandoned-"))  # the skipped ones: renamed, not deleted
    assert [d.split("-")[1:3] for d in aside] == [["step", "00000004"], ["step", "00000006"], ["step", "00000008"]]


def test_max_restarts_survives_a_crash_with_the_clean_final_loss(tmp_path):
    """(Also once test_changed_model_is_refused_naming_the_keys, which trained a 2-step run of its own for a
    checkpoint of step 2: the clean run's serves.)"""
    clean = train_py(*RUN, "train.steps=6", run_dir=tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-2000:]
    # A model that differs from the checkpoint's is refused, naming the keys it lacks.
    bad = train_py(*RUN, "train.steps=3", "model.num_layers=3",
                   f"checkpoint.resume={tmp_path}/clean/checkpoints/step-00000002", run_dir=tmp_path / "changed")
    text = " ".join(bad.stderr.split())
    assert bad.returncode == 2 and "parameter(s) of this model are not in it (model.layers.2." in text, text
    # Started from the clean run's step 2 (checkpoint.resume=PATH); the restart after the crash resumes from
    # this run's own newest good checkpoint (step 4), not from PATH again.
    crashed = train_py(*RUN, "train.steps=6", "launch.max_restarts=1",
                       f"checkpoint.resume={tmp_path}/clean/checkpoints/step-00000002", run_dir=tmp_path / "crash",
                       env={"SHARDYARD_TEST_CRASH_AT_STEP": "4:1"})
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "rank 1 dies after step 4" in crashed.stderr
    assert f"resumed from {tmp_path}/clean/checkpoints/step-00000002" in crashed.stdout
    assert f"resumed from {tmp_path}/crash/checkpoints/step-00000004" in crashed.stdout
    final = [json.load(open(tmp_path / d / "summary.json"))["final_train_loss"] for d in ("clean", "crash")]
    assert final[0] == final[1]


DRILL = [*TINY, "train.eval_every_n_steps=0", "train.global_batch_size=8", "checkpoint.every_n_steps=1",
         "checkpoint.keep_last=2", "checkpoint.save_final=true"]
PLACED = {"zero2": [("engine_written", 1, 0), ("before_hash", 2, 0)]}
"""Kill moments chosen rather than drawn (point, step, rank). ZeRO-2's two are where its own files are written
(engine_written: rank 0's engine files, nothing hashed) and where every rank's files are there, hashed by their
ranks, without meta.json (before_hash). It drew before_meta too (a start of the job of its own), and dropped it:
between before_hash and before_meta rank 0 only hashes and fsyncs, in place, the files no rank claimed and builds
meta.json's dict in memory (the part-rank<r>.json handoffs are removed before before_hash), so a kill -9 at
either leaves the same directory (``left_by`` asserts the same of both), and before_meta is rank 0's publishing,
the same code for every engine, which the single chain kills at (step 6)."""
DRILLS = {"single": 8, "fsdp": 6, "zero2": len(PLACED["zero2"])}
"""Kill moments per engine: 16 in all. Each engine's drill is one chain in one run dir (killed, resumed and
killed again), so a moment costs one start of the job. ZeRO-2's are placed (``PLACED``); the points after them
are rank 0's publishing, the same code for every engine, which the single and fsdp chains kill at (before_meta,
before_fsync, before_rename, before_latest, before_prune)."""


def left_by(ck, point: str, step: int, rank: int, world: int, files: list[str]) -> str | None:
    """Asserts what a kill at ``point`` of the save of ``step`` (reached by ``rank``) leaves: the state that
    point implies (``SAVE_POINTS``, in order), so a kill that fired anywhere else fails. ``files``: a whole
    checkpoint's files (the engine writes the same names at every step). Returns the checkpoint resume=auto
    must take next: the newest published one, or None."""
    name, at = f"step-{step:08d}", SAVE_POINTS.index(point)
    tmp = ck / f".tmp-{name}"
    published = sorted(d for d in os.listdir(ck) if d.startswith("step-"))
    assert all(verify(str(ck / d)) is None for d in published), (point, step)  # nothing half-published
    latest = (ck / "latest").read_text().strip() if (ck / "latest").exists() else None
    assert latest is None or latest in published, (point, step, latest)
    if at >= SAVE_POINTS.index("before_latest"):  # renamed: published whole; `latest` names it from before_prune
        assert name in published and not tmp.exists() and (latest == name) == (point == "before_prune"), (point, latest)
        return published[-1]
    assert name not in published and latest != name, (point, step, published, latest)
    if point != "begin":  # rank 0 made the .tmp directory; from engine_written on it holds the step's files:
        here = set(_files(str(tmp)))  # the killing rank's, and from before_hash on every rank's (the rest of the
        want = {f for f in files if at >= SAVE_POINTS.index("before_hash") or writer(f, world) == rank}  # save: rank 0)
        if at < SAVE_POINTS.index("rank_written"):  # the rank's RNG state follows its engine files
            want = {f for f in want if not f.startswith("rng-rank")}
        assert want and want <= here, (point, step, sorted(want - here))
        problem = verify(str(tmp))  # meta.json comes between before_meta and before_fsync: whole, not yet published
        if at >= SAVE_POINTS.index("before_fsync"):
            assert problem is None, (point, step, problem)
        else:
            assert problem == "it has no meta.json (it was never completed)", (point, step, problem)
    return published[-1] if published else None


def moments(engine: str, world: int) -> list[tuple[str, int, int]]:
    """Seeded (point, step, rank) kills at steps 1, 2, ... (``PLACED`` where they are chosen): a kill after the
    rename leaves that step's checkpoint published, so the next moment must come later. Each engine draws
    distinct points; points before the barrier fire on a random rank, the rest of the save is rank 0's."""
    if engine in PLACED:
        return PLACED[engine]
    rng = random.Random(f"shardyard-drill-{engine}")
    points = rng.sample(SAVE_POINTS, DRILLS[engine])
    return [(p, step, rng.randrange(world) if p in ("begin", "engine_written", "rank_written") else 0)
            for step, p in enumerate(points, 1)]


@pytest.mark.parametrize("engine,world,background", [("single", 1, False), ("fsdp", 2, True), ("zero2", 2, False)])
def test_kill_9_inside_saves_then_resume_auto_is_bitwise_exact(engine, world, background, tmp_path):
    """The job is killed by SIGKILL at seeded (ZeRO-2: placed) moments inside checkpoint saves (one rank reaches
    a named point of the save and kills every process of the job); each time the directory holds what that point
    implies (``left_by``: the step's files in its .tmp directory, meta.json or not, published or not, ``latest``),
    every published checkpoint still verifies, the next start removes the unfinished save and resumes from the
    newest published one, and resume=auto finishes with weights equal to an uninterrupted run's, byte for byte.
    This is also the kill-during-a-save test of a plain job: no sleep places a kill. FSDP saves in the
    background (``checkpoint.async_save``): the points after the state is staged are reached in the save's
    thread while training goes on."""
    args = [*DRILL, f"backend={engine}", f"launch.nproc_per_node={world}", f"train.steps={DRILLS[engine] + 1}",
            f"checkpoint.async_save={str(background).lower()}"]
    clean = train_py(*args, run_dir=tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    run, ck = tmp_path / "drill", tmp_path / "drill/checkpoints"
    files = _files(str(tmp_path / "clean/checkpoints" / f"step-{DRILLS[engine] + 1:08d}"))
    resumes, stale = None, None
    for i, (point, step, rank) in enumerate(moments(engine, world)):
        env = {"SHARDYARD_TEST_KILL_IN_SAVE": f"{point}@{step}:{rank}"}
        proc = train_py(*args, *(["checkpoint.resume=auto"] if i else []), run_dir=run, env=env)
        assert proc.returncode == -signal.SIGKILL, (point, step, proc.stderr[-3000:])
        assert f"kills the job at {point} of step {step}" in proc.stderr
        assert (f"resumed from {ck}/{resumes} " in proc.stdout) if resumes else "resumed from" not in proc.stdout
        assert stale is None or f"removing {stale}: an unfinished save" in proc.stderr, (stale, proc.stderr[-3000:])
        resumes = left_by(ck, point, step, rank, world, files)
        stale = ck / f".tmp-step-{step:08d}" if (ck / f".tmp-step-{step:08d}").exists() else None
    done = train_py(*args, "checkpoint.resume=auto", run_dir=run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ck}/{resumes} " in done.stdout and not [d for d in os.listdir(ck) if d.startswith(".tmp")]
    assert sorted(d for d in os.listdir(ck) if d.startswith("step-")) == [f"step-{s:08d}" for s in
                                                                          (DRILLS[engine], DRILLS[engine] + 1)]
    final = [json.load(open(d / "summary.json")) for d in (tmp_path / "clean", run)]
    assert final[0]["train_losses"] == final[1]["train_losses"] and final[0]["grad_norms"] == final[1]["grad_norms"]
    # ZeRO-2 on CPU too: its Adam kernel's beta powers are rebuilt on resume (backends/deepspeed_patches.py
    # continue_adam_bias_correction); without that, the run resumed at step 5 differed by 1 ulp from step 6 on.
    weights = sorted(p.name for p in (tmp_path / "clean/hf").glob("*.safetensors"))  # one file, or shards
    assert weights and weights == sorted(p.name for p in (run / "hf").glob("*.safetensors"))
    assert all((run / "hf" / w).read_bytes() == (tmp_path / "clean/hf" / w).read_bytes() for w in weights)


def test_a_full_disk_stops_the_save_with_one_paragraph(tmp_path):
    """checkpoint.dir on a tmpfs that holds two checkpoints: the third save fails on ENOSPC, exit 1 with the
    paragraph (directory, bytes needed and free), no partial directory, the two older checkpoints intact."""
    if os.geteuid() != 0:
        print("skipped: mounting a small tmpfs needs root")
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [*TINY, "train.eval_every_n_steps=0", "train.global_batch_size=8", "backend=single",
            "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", f"checkpoint.dir={disk}"]
    probe = train_py(*args[:-1], "train.steps=1", run_dir=tmp_path / "probe")  # one checkpoint's size
    assert probe.returncode == 0, probe.stderr[-2000:]
    size = sum(p.stat().st_size for p in (tmp_path / "probe/checkpoints/step-00000001").rglob("*") if p.is_file())
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(5 * size // 2) // 1024 + 64}k", "tmpfs", str(disk)],
                   check=True)
    try:
        proc = train_py(*args, "train.steps=5", run_dir=tmp_path / "run")
        err = " ".join(proc.stderr.split())
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in err and f"error in `checkpoint.dir` (value: '{disk}')" in err, err
        assert "Saving the checkpoint of step 3 failed: No space left on device (ENOSPC" in err, err
        assert "bytes: the previous checkpoint) and" in err and "are free there" in err, err
        assert "older checkpoints (step-00000001, step-00000002) are intact" in err, err
        assert sorted(d for d in os.listdir(disk) if d.startswith((".tmp", "step-"))) == ["step-00000001",
                                                                                          "step-00000002"]
        print(proc.stderr[-1500:])
        assert all(verify(str(disk / d)) is None for d in ("step-00000001", "step-00000002"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)
