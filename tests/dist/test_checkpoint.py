"""Checkpoints on every engine: a run resumed from step 3 reproduces the uninterrupted run's losses at steps
4-6 bit for bit (fp32, CPU); DDP and FSDP checkpoints resume at other world sizes through DCP resharding."""

import json
import os
from types import SimpleNamespace

import pytest

from conftest import TINY, train_py
from shardyard.checkpoint import Checkpointer, _manifest, _meta_digest, verify
from shardyard.testing import run_many

STEPS = [*TINY, "train.steps=6", "train.eval_every_n_steps=0", "train.global_batch_size=8"]


def losses(r):
    return [loss for _, loss in r["summary"]["train_losses"]]


RESUME = [("single", 1), ("ddp", 2), ("fsdp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2)]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per engine: a 6-step run saving at step 3, then a run resumed from that checkpoint. Every world-2 engine
    runs in one set of 2 processes (each run with its own process group and run dir)."""
    d = tmp_path_factory.mktemp("resume")
    out = {}
    for world in (1, 2):
        engines = [e for e, w in RESUME if w == world]
        jobs = []
        for e in engines:
            jobs += [([*STEPS, f"backend={e}", "checkpoint.every_n_steps=3"], str(d / e / "a")),
                     ([*STEPS, f"backend={e}", f"checkpoint.resume={d / e}/a/checkpoints/step-00000003"], str(d / e / "b"))]
        results = run_many(world, jobs)
        for i, e in enumerate(engines):
            out[e] = (results[2 * i], results[2 * i + 1], d / e / "a")
    return out


@pytest.mark.parametrize("engine,world", RESUME)
def test_resume_is_bitwise_exact(engine, world, resumed):
    full, again, a = resumed[engine]
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step-00000003", "step-00000006"]
    meta = json.load(open(a / "checkpoints/step-00000003/meta.json"))
    assert meta["step"] == 3 and meta["world_size"] == world and len(meta["rng"]) == world
    assert meta["data"] == {"epoch": 0, "step_in_epoch": 3, "samples_seen": 24}
    # Every file the engine wrote (DCP's .metadata, DeepSpeed's zero/ partitions and scripts) carries its sha256.
    ck = a / "checkpoints/step-00000003"
    files = {str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file()} - {"meta.json"}
    assert set(meta["manifest"]) == files and all(len(e["sha256"]) == 64 for e in meta["manifest"].values())
    assert verify(str(ck)) is None
    # The resumed run trains steps 4-6 only, and reports the run's own history before them.
    assert len(again[0]["summary"]["step_wall_s"]) == 3 and again[0]["summary"]["tokens"] == 3 * 8 * 64
    assert [s for s, _ in again[0]["summary"]["train_losses"]] == [1, 2, 3, 4, 5, 6]
    assert losses(again[0]) == losses(full[0])  # bit for bit (steps 1-3 read back, 4-6 recomputed)


def test_horovod_resume_is_bitwise_exact(tmp_path):
    pytest.importorskip("horovod.torch")
    hv = [*STEPS, "backend=horovod", "launch.nproc_per_node=2"]
    pa = train_py(*hv, "checkpoint.every_n_steps=3", run_dir=tmp_path / "a")
    assert pa.returncode == 0, pa.stderr[-2000:]
    pb = train_py(*hv, f"checkpoint.resume={tmp_path}/a/checkpoints/step-00000003", run_dir=tmp_path / "b")
    assert pb.returncode == 0, pb.stderr[-2000:]
    la = json.load(open(tmp_path / "a/summary.json"))["train_losses"]
    lb = json.load(open(tmp_path / "b/summary.json"))["train_losses"]
    assert lb == la and [s for s, _ in lb] == [1, 2, 3, 4, 5, 6]  # steps 1-3 from the checkpoint, 4-6 bit for bit
    assert "resumed from" in pb.stdout and len(json.load(open(tmp_path / "b/summary.json"))["step_wall_s"]) == 3


def _two_to_four_to_one(tmp_path, runs: dict[str, tuple[str, str, str]]) -> dict[str, tuple[list, list]]:
    """Per name, (backend at world 2, at 4, at 1): the same recipe (6 steps, global batch 8) saved at step 2 by
    world 2, resumed and saved at step 4 by world 4, finished by world 1. One process set per world size."""
    seg = {}
    for world, (i, extra) in {2: (0, ["checkpoint.every_n_steps=2"]),
                              4: (1, ["train.micro_batch_size=2", "checkpoint.every_n_steps=2"]), 1: (2, [])}.items():
        jobs = []
        for name, engines in runs.items():
            resume = {2: [], 4: [f"checkpoint.resume={tmp_path}/{name}-w2/checkpoints/step-00000002"],
                      1: [f"checkpoint.resume={tmp_path}/{name}-w4/checkpoints/step-00000004"]}[world]
            jobs.append(([*STEPS, f"backend={engines[i]}", *extra, *resume], str(tmp_path / f"{name}-w{world}")))
        for name, result in zip(runs, run_many(world, jobs)):
            seg[(name, world)] = result
    # Steps 3-4 at world 4, steps 5-6 at world 1, against the uninterrupted world-2 run.
    # Each resumed run's summary starts with the curve it resumed with (carried in the checkpoints).
    for name in runs:
        assert [len(seg[(name, w)][0]["summary"]["step_wall_s"]) for w in (2, 4, 1)] == [6, 4, 2]  # really resumed
        assert [s for s, _ in seg[(name, 1)][0]["summary"]["train_losses"]] == [1, 2, 3, 4, 5, 6]
        assert losses(seg[(name, 1)][0])[:2] == losses(seg[(name, 2)][0])[:2]
    return {name: (losses(seg[(name, 1)][0])[2:], losses(seg[(name, 2)][0])[2:]) for name in runs}


def test_world_size_2_to_4_to_1(tmp_path):
    """DDP and FSDP (DCP reshards); ZeRO-1 -> 2 -> 1 and ZeRO-3 through DeepSpeed's universal checkpoint
    (converted by shardyard, once, and removed once loaded; stages 1 and 2 read each other's)."""
    runs = {"ddp": ("ddp",) * 3, "fsdp": ("fsdp",) * 3, "zero12": ("zero1", "zero2", "zero1"), "zero3": ("zero3",) * 3}
    curves = _two_to_four_to_one(tmp_path, runs)
    for name, (got, want) in curves.items():
        assert len(got) == 4 and max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-4, (name, got, want)
    for name in ("zero12", "zero3"):
        assert os.listdir(tmp_path / f"{name}-w4/universal") == []
    # Saved at world 4, every rank hashed (and fsynced) the files it wrote: about a quarter of the bytes each, rank 0
    # its own shard and DCP's .metadata, the ZeRO ranks their partitions (rank 0 also the model file).
    for name, slack in (("fsdp", 0.1), ("zero3", 0.1)):
        meta = json.load(open(tmp_path / f"{name}-w4/checkpoints/step-00000004/meta.json"))
        hashed, total = meta["hashed_bytes"], sum(e["bytes"] for e in meta["manifest"].values())
        assert len(hashed) == 4 and sum(hashed) == total, (name, hashed, total)
        assert all(0.25 - slack <= h / total <= 0.25 + slack for h in hashed[1:]), (name, hashed, total)
        assert hashed[0] / total <= 0.25 + slack + 0.1, (name, hashed, total)
    stage = json.load(open(tmp_path / "zero12-w4/checkpoints/step-00000004/meta.json"))["training_state"]["zero_stage"]
    assert stage == 2


def test_deepspeed_stage_3_to_2_is_refused_with_the_supported_pairs(tmp_path):
    run_many(2, [([*STEPS, "backend=zero3", "train.steps=2", "checkpoint.every_n_steps=2"], str(tmp_path / "a"))])
    proc = train_py(*STEPS, "backend=zero2", "launch.nproc_per_node=1",
                    f"checkpoint.resume={tmp_path}/a/checkpoints/step-00000002", run_dir=tmp_path / "b")
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert "holds ZeRO-3 partitions and this run is ZeRO-2" in err
    assert "any world size within ZeRO-1/2" in err and "backend=zero3" in err
    assert "Traceback" not in err


def _checkpoints(d, steps):
    for s in steps:
        p = d / f"step-{s:08d}"
        p.mkdir()
        (p / "__0_0.distcp").write_bytes(bytes([s]) * 100)
        (p / ".metadata").write_bytes(b"metadata %d" % s)
        meta = {"step": s, "manifest": _manifest(str(p))}
        (p / "meta.json").write_text(json.dumps({**meta, "meta_sha256": _meta_digest(meta)}))


def _flip(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))


def _truncate(file):
    file.write_bytes(file.read_bytes()[:-1])


def test_keep_last_counts_only_whole_checkpoints_and_never_reads_one(tmp_path, monkeypatch):
    """Pruning reads no checkpoint's bytes (a 70B checkpoint is ~840 GB, and rank 0 prunes while the others wait):
    an older checkpoint counts toward keep_last when its meta.json verifies and every file is there at its size."""
    import shardyard.checkpoint as checkpoint

    ck = Checkpointer.__new__(Checkpointer)  # only what pruning reads
    ck.dir, ck.c, ck._good = str(tmp_path), SimpleNamespace(keep_last=2), set()
    _checkpoints(tmp_path, [1, 2, 3, 4, 5])
    _truncate(tmp_path / "step-00000004/.metadata")
    _flip(tmp_path / "step-00000003/__0_0.distcp")  # same size: only a read tells, and pruning does not read
    read = []
    hash_file = checkpoint._hash_file
    monkeypatch.setattr(checkpoint, "_hash_file", lambda *a, **k: read.append(a) or hash_file(*a, **k))
    ck._prune(str(tmp_path / "step-00000005"), 5)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004", "step-00000005"]  # 5 and 3 count
    assert read == []
    ck.c.keep_last = 1
    _checkpoints(tmp_path, [6])
    ck._prune(str(tmp_path / "step-00000006"), 6)
    assert os.listdir(tmp_path) == ["step-00000006"]
    _checkpoints(tmp_path, [9])  # a newer one of another timeline (a rollback): never counted, never the reason
    _checkpoints(tmp_path, [7])  # the new one is pruned
    read.clear()
    ck._prune(str(tmp_path / "step-00000007"), 7)
    assert sorted(os.listdir(tmp_path)) == ["step-00000007", "step-00000009"]
    assert read == []


def test_each_rank_verifies_its_share_and_the_shares_cover_the_checkpoint_once(tmp_path):
    """On resume each rank hashes what it wrote (rank 0 the shared files) at the saved world size, a balanced
    quarter of the bytes at another: the bytes are read once over the world, and a damaged file is found by
    the rank whose share it is."""
    from shardyard.checkpoint import share, verify_share, writer

    ck = tmp_path / "step-00000001"
    ck.mkdir()
    for r in range(4):
        (ck / f"__{r}_0.distcp").write_bytes(bytes([r]) * (1000 + r))
    (ck / ".metadata").write_bytes(b"m" * 50)
    meta = {"step": 1, "world_size": 4, "manifest": _manifest(str(ck))}
    (ck / "meta.json").write_text(json.dumps({**meta, "meta_sha256": _meta_digest(meta)}))
    assert [writer(f"__{r}_0.distcp", 4) for r in range(4)] == [0, 1, 2, 3]
    assert writer(".metadata", 4) == writer("__7_0.distcp", 4) == 0  # shared, or a rank this world lacks
    assert writer("zero/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt", 4) == 3
    assert writer("zero/mp_rank_00_model_states.pt", 4) == 0
    total = sum(e["bytes"] for e in meta["manifest"].values())
    for world in (4, 2, 3):
        shares = [share(meta["manifest"], r, world, 4) for r in range(world)]
        assert sorted(f for s in shares for f in s) == sorted(meta["manifest"])  # each file once
        got = [verify_share(str(ck), r, world) for r in range(world)]
        assert all(problem is None for problem, _ in got) and sum(n for _, n in got) == total
        assert max(n for _, n in got) <= total / world + 1003  # no rank more than its share and one file
    assert shares[0] and share(meta["manifest"], 1, 4, 4) == ["__1_0.distcp"]
    _flip(ck / "__2_0.distcp")
    found = [verify_share(str(ck), r, 4)[0] for r in range(4)]
    assert [p is not None for p in found] == [False, False, True, False] and "sha256 differs" in found[2]
    # A checkpoint from before the hashes (sizes only, no meta_sha256) and a malformed one: a verdict on every rank
    # alike, never an exception on one (the others would wait in the all-reduce that follows)
    (ck / "meta.json").write_text(json.dumps({"step": 1, "world_size": 4, "manifest": {
        rel: e["bytes"] for rel, e in meta["manifest"].items()}}))
    assert [verify_share(str(ck), r, 4) for r in range(4)] == [(None, n) for n in (1050, 1001, 1002, 1003)]
    (ck / "meta.json").write_text(json.dumps({"step": 1, "manifest": {"__0_0.distcp": {"sha256": "x"}}}))
    assert all("malformed" in verify_share(str(ck), r, 4)[0] for r in range(4))


def test_meta_json_is_verified_too_and_a_malformed_one_is_a_reason_not_a_crash(tmp_path):
    _checkpoints(tmp_path, [1])
    meta_file = tmp_path / "step-00000001/meta.json"
    meta = json.loads(meta_file.read_text())
    assert verify(str(meta_file.parent)) is None
    meta_file.write_text(json.dumps({**meta, "step": 7}))  # a flipped digit: the step resumed from would lie
    assert "meta.json is corrupt" in verify(str(meta_file.parent))
    for manifest in ({"__0_0.distcp": {"sha256": "x"}}, [], "x", {}, {"__0_0.distcp": {"bytes": 100}}):
        body = {"step": 1, "manifest": manifest}
        meta_file.write_text(json.dumps({**body, "meta_sha256": _meta_digest(body)}))
        assert "malformed" in verify(str(meta_file.parent)), manifest
