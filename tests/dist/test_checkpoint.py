"""Checkpoints on every engine: a run resumed from step 3 reproduces the uninterrupted run's losses at steps
4-6 bit for bit (fp32, CPU); DDP and FSDP checkpoints resume at other world sizes through DCP resharding."""

import json
import os
from types import SimpleNamespace

import pytest

from conftest import TINY
from shardyard.training.checkpoint import Checkpointer
from shardyard.training.integrity import _manifest, _meta_digest, verify
from shardyard.testing import on_ranks, run_many

STEPS = [*TINY, "train.steps=6", "train.eval_every_n_steps=0", "train.global_batch_size=8"]


def losses(r):
    return [loss for _, loss in r["summary"]["train_losses"]]


RESUME = [("single", 1), ("ddp", 2), ("fsdp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2)]


_OPENS: list = []


def _observe(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str) and args[0].endswith("metrics.jsonl"):
        _OPENS.append(str(args[1]))


def _counted(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """``testing.run_many``'s job on a pool rank, with what this rank read to hash checkpoint files
    (``integrity.HASHED``, counted where the bytes are read) and every open of ``metrics.jsonl`` (seen by an audit
    hook: real file accesses) written to ``counted-rank<r>.json``."""
    import sys

    from shardyard import testing
    from shardyard.training import integrity

    if _observe not in getattr(sys, "_shardyard_hooks", []):  # audit hooks stay for the process: one per rank
        sys.addaudithook(_observe)
        sys._shardyard_hooks = [_observe]  # type: ignore[attr-defined]
    integrity.HASHED["bytes"] = 0
    _OPENS.clear()
    testing._one_run(rank, world, overrides, run_dir)
    with open(os.path.join(run_dir, f"counted-rank{rank}.json"), "w") as f:
        json.dump({"hashed": integrity.HASHED["bytes"], "metrics_opens": list(_OPENS)}, f)


def _run(world: int, overrides: list, run_dir) -> list[dict]:
    import torch

    from shardyard.testing import on_ranks

    os.makedirs(run_dir, exist_ok=True)
    on_ranks(world, _counted, list(overrides), str(run_dir))
    return [{**torch.load(os.path.join(run_dir, f"rank{r}.pt"), weights_only=False),
             **json.load(open(os.path.join(run_dir, f"counted-rank{r}.json")))} for r in range(world)]


def _old_format(src, dst) -> None:
    """A copy of checkpoint ``src`` as shardyard wrote it before each rank's RNG state had a file of its own: every
    rank's state in ``meta.json``'s ``rng`` (re-digested, as it was written)."""
    import shutil

    shutil.copytree(src, dst)
    meta = json.load(open(dst / "meta.json"))
    meta["rng"] = [json.load(open(dst / f"rng-rank{r}.json")) for r in range(meta["world_size"])]
    for r in range(meta["world_size"]):
        os.remove(dst / f"rng-rank{r}.json")
        del meta["manifest"][f"rng-rank{r}.json"]
    del meta["meta_sha256"]
    (dst / "meta.json").write_text(json.dumps({**meta, "meta_sha256": _meta_digest(meta)}))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per engine: a 6-step run saving at step 3 (world 2: with an HF export in each checkpoint), then a run
    resumed from that checkpoint; DDP's also resumed from a copy of it in the old format (``_old_format``). Every
    world-2 engine runs in one set of 2 processes (each run with its own process group and run dir)."""
    d = tmp_path_factory.mktemp("resume")
    out = {}
    for e, world in RESUME:
        export = ["checkpoint.export_hf=true"] if world > 1 else []
        a = _run(world, [*STEPS, f"backend={e}", "checkpoint.every_n_steps=3", *export], d / e / "a")
        b = _run(world, [*STEPS, f"backend={e}", f"checkpoint.resume={d / e}/a/checkpoints/step-00000003"], d / e / "b")
        out[e] = (a, b, d / e / "a")
        if e == "ddp":
            _old_format(d / e / "a/checkpoints/step-00000003", d / e / "old-step-00000003")
            out["ddp-old"] = (a, _run(world, [*STEPS, f"backend={e}", f"checkpoint.resume={d / e}/old-step-00000003"],
                                      d / e / "c"), d / e / "a")
    return out


@pytest.mark.parametrize("engine,world", [*RESUME, ("ddp-old", 2)])
def test_resume_is_bitwise_exact(engine, world, resumed):
    full, again, a = resumed[engine]
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step-00000003", "step-00000006"]
    meta = json.load(open(a / "checkpoints/step-00000003/meta.json"))
    assert meta["step"] == 3 and meta["world_size"] == world
    # Each rank's RNG state in a file of its own (meta.json does not grow with the world), hashed by its rank.
    assert "rng" not in meta and all(meta["manifest"][f"rng-rank{r}.json"] for r in range(world))
    assert not [k for k, v in meta.items() if k not in ("manifest", "hashed_bytes") and isinstance(v, list)
                and len(v) == world and world > 1]
    assert meta["data"] == {"epoch": 0, "step_in_epoch": 3, "samples_seen": 24}
    # Every file the engine wrote (DCP's .metadata, DeepSpeed's zero/ partitions and scripts) carries its sha256,
    # or the sha256 of each of its pieces.
    ck = a / "checkpoints/step-00000003"
    files = {str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file()} - {"meta.json"}
    assert set(meta["manifest"]) == files
    assert all(len(e["sha256"]) == 64 if "sha256" in e else all(len(p) == 64 for p in e["pieces"])
               for e in meta["manifest"].values())
    assert verify(str(ck)) is None
    # The resumed run trains steps 4-6 only, and reports the run's own history before them.
    assert len(again[0]["summary"]["step_wall_s"]) == 3 and again[0]["summary"]["tokens"] == 3 * 8 * 64
    assert [s for s, _ in again[0]["summary"]["train_losses"]] == [1, 2, 3, 4, 5, 6]
    assert losses(again[0]) == losses(full[0])  # bit for bit (steps 1-3 read back, 4-6 recomputed)


@pytest.mark.parametrize("engine", [e for e, w in RESUME if w == 2])
def test_no_rank_hashes_the_whole_model_while_the_others_wait(engine, resumed):
    """With an HF export in each checkpoint, at 2 ranks: each rank hashes the export's shards it wrote (DDP, ZeRO-1/2
    and ZeRO-3 write theirs by the ranks, as FSDP does: ZeRO-3 gathers each module on both ranks and its owner
    writes it, where rank 0 used to gather the whole model and write it alone), and the whole 16-bit model ZeRO-1/2
    keeps in one file (``mp_rank_00_model_states.pt``) is hashed in pieces by both: the bytes each rank read to
    hash (counted where they are read, at the save and at the resume's verification) are within 2x of each
    other's, and within 20% of half the checkpoint. The exported tensors are the engine's own gathered ones. Only rank 0 opens metrics.jsonl (the history it writes into meta.json)."""
    full, again, a = resumed[engine]
    metas = [json.load(open(a / f"checkpoints/step-0000000{s}/meta.json")) for s in (3, 6)]
    meta, total = metas[1], sum(e["bytes"] for e in metas[1]["manifest"].values())
    saved = [r["hashed"] for r in full]  # the two saves (steps 3 and 6)
    verified = [r["hashed"] for r in again]  # the resume's verification of step 3 (and any save of its own)
    assert saved == [sum(m["hashed_bytes"][r] for m in metas) for r in range(2)], (saved, metas[1]["hashed_bytes"])
    assert sum(meta["hashed_bytes"]) == total
    for got in (saved, meta["hashed_bytes"]):
        assert max(got) <= 2 * min(got), (engine, got, total)
        assert all(abs(h / sum(got) - 0.5) <= 0.2 for h in got), (engine, got, total)
    exported = [rel for rel in meta["manifest"] if rel.startswith("hf/") and rel.endswith(".safetensors")]
    assert len(exported) == 2 and [e.get("rank", 0) for rel, e in sorted(meta["manifest"].items())
                                   if rel in exported] == [0, 1], exported  # one shard each, hashed by its writer
    # written by the ranks: every tensor the engine's own gathered one (at step 6)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = a / "checkpoints/step-00000006/hf"
    got = {k: v for rel in exported for k, v in load_file(str(a / "checkpoints/step-00000006" / rel)).items()}
    want = full[0]["full"]
    assert got.keys() == want.keys() - {"lm_head.weight"} or got.keys() == want.keys(), got.keys() ^ want.keys()
    assert all(torch.equal(v, want[k]) for k, v in got.items())
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True, dtype=next(iter(got.values())).dtype)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    if engine in ("zero1", "zero2"):
        states = meta["manifest"]["zero/mp_rank_00_model_states.pt"]
        assert len(states["pieces"]) == 2 and "sha256" not in states, states
    assert verified[1] > 0 and max(verified) <= 2 * min(verified), (engine, verified)
    assert full[1]["metrics_opens"] == [] and again[1]["metrics_opens"] == [], (full[1], again[1])
    assert "r" in full[0]["metrics_opens"], full[0]["metrics_opens"]  # rank 0 read it (the observation works)


# Horovod's resume (bit for bit, at accumulation 2): tests/dist/test_horovod.py, on its one Gloo run.


def _background_saves(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """A rank of a run with ``checkpoint.async_save``: after each save, the storages it staged (address and
    size; every staged dict is kept alive here, so a new copy could never reuse a freed address) and the
    timeout of the background saves' process group, in ``saves-rank<r>.json``; and the bytes of the parameters
    and AdamW state this rank holds, as the engine holds them."""
    import torch

    from shardyard.training import checkpoint, worker
    from shardyard.core.dist_env import detect
    from shardyard.core.memory import local
    from shardyard.training.rundir import resolved
    from shardyard.testing import compose
    from shardyard.planning.validate import validate

    cfg = compose(overrides, run_dir)
    plan = validate(cfg, detect())
    seen, held, kept = [], {}, []
    save, stage = checkpoint.Checkpointer.save, checkpoint.HostStaging.stage

    def staged(self, state_dict):
        out = stage(self, state_dict)
        kept.append(out)
        return out

    def recorded(self, step, stream):
        out = save(self, step, stream)
        storages = {}
        for t in torch.utils._pytree.tree_leaves(kept[-1]):
            if isinstance(t, torch.Tensor):
                st = local(t).untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        seen.append({"step": step, "storages": sorted(storages.items()), "bytes": self._staging.bytes,
                     "timeout_s": self._group._get_backend(torch.device("cpu")).options._timeout.total_seconds()})
        return out

    def grab(backend):
        stepper = backend.stepper
        params = [local(p) for p in stepper.model.parameters()]
        moments = [local(v) for st in stepper.optimizer.state.values() for k, v in st.items() if k != "step"]
        held.update(params=sum(t.nbytes for t in params), moments=sum(t.nbytes for t in moments), tensors=len(params))

    checkpoint.Checkpointer.save, checkpoint.HostStaging.stage = recorded, staged  # type: ignore[method-assign]
    try:
        worker.main(resolved(cfg), plan, after_train=grab)
    finally:
        checkpoint.Checkpointer.save, checkpoint.HostStaging.stage = save, stage  # type: ignore[method-assign]
    with open(os.path.join(run_dir, f"saves-rank{rank}.json"), "w") as f:
        json.dump({"saves": seen, "held": held}, f)


def test_background_saves_reuse_one_planned_host_buffer_on_a_group_with_the_runs_timeout(tmp_path):
    """``checkpoint.async_save`` on FSDP x2, a save at every step: each rank stages into one host buffer, the same
    storages at every save (host memory does not grow with the saves); its bytes are this rank's parameter
    shards and AdamW moments (and the step counters), the plan's ``checkpoint_staging`` within 0.1%; the
    background saves' gloo group has ``launch.timeout_s``, not torch's default 30 minutes; meta.json's
    ``staged_bytes`` says what each rank staged."""
    from shardyard.planning import plan as memory_plan
    from shardyard.planning import hardware as plan_hardware
    from shardyard.testing import compose
    from shardyard.planning.validate import validate

    over = [*STEPS, "backend=fsdp", "train.steps=3", "checkpoint.every_n_steps=1", "checkpoint.async_save=true",
            "launch.timeout_s=97"]
    on_ranks(2, _background_saves, over, str(tmp_path))
    cfg = compose([*over, "launch.nproc_per_node=2"])
    batch = validate(cfg, None)
    planned = memory_plan.estimate(cfg, batch, plan_hardware.hardware(cfg, batch)).device["checkpoint_staging"]
    for rank in range(2):
        got = json.load(open(tmp_path / f"saves-rank{rank}.json"))
        saves, held = got["saves"], got["held"]
        assert [s["step"] for s in saves] == [1, 2, 3] and all(s["timeout_s"] == 97 for s in saves), saves
        assert all(s["storages"] == saves[0]["storages"] for s in saves), saves  # one buffer, reused
        staged = sum(n for _, n in saves[0]["storages"])
        assert all(s["bytes"] == staged for s in saves)
        assert held["moments"] == 2 * held["params"]
        assert 3 * held["params"] <= staged <= 3 * held["params"] + 8 * held["tensors"], (staged, held)  # + steps
        assert abs(staged / planned - 1) < 1e-3, (staged, planned)
        # what each rank staged, in the checkpoint's meta.json (bench/checkpoint.py prints it beside the plan)
        meta = json.load(open(tmp_path / "checkpoints" / "step-00000003" / "meta.json"))
        assert meta["staged_bytes"][rank] == staged, (meta["staged_bytes"], staged)


def _two_to_four_to_one(tmp_path, resumed, runs: dict[str, tuple[str, str, str]]) -> dict[str, tuple[list, list]]:
    """Per name, (backend at world 2, at 4, at 1): the same recipe (6 steps, global batch 8) saved at step 3 by
    world 2 (the ``resumed`` fixture's uninterrupted run of the world-2 engine: it saves at steps 3 and 6),
    resumed and saved at step 4 by world 4, finished by world 1. One process set per world size."""
    seg = {(name, 2): resumed[engines[0]][0] for name, engines in runs.items()}
    for world, (i, extra) in {4: (1, ["train.micro_batch_size=2", "checkpoint.every_n_steps=2"]), 1: (2, [])}.items():
        jobs = []
        for name, engines in runs.items():
            resume = {4: [f"checkpoint.resume={resumed[engines[0]][2]}/checkpoints/step-00000003"],
                      1: [f"checkpoint.resume={tmp_path}/{name}-w4/checkpoints/step-00000004"]}[world]
            jobs.append(([*STEPS, *f"backend={engines[i]}".split(), *extra, *resume], str(tmp_path / f"{name}-w{world}")))
        for name, result in zip(runs, run_many(world, jobs)):
            seg[(name, world)] = result
    # Step 4 at world 4, steps 5-6 at world 1, against the uninterrupted world-2 run.
    # Each resumed run's summary starts with the curve it resumed with (carried in the checkpoints).
    for name in runs:
        assert [len(seg[(name, w)][0]["summary"]["step_wall_s"]) for w in (2, 4, 1)] == [6, 3, 2]  # really resumed
        assert [s for s, _ in seg[(name, 1)][0]["summary"]["train_losses"]] == [1, 2, 3, 4, 5, 6]
        assert losses(seg[(name, 1)][0])[:3] == losses(seg[(name, 2)][0])[:3]
    return {name: (losses(seg[(name, 1)][0])[3:], losses(seg[(name, 2)][0])[3:]) for name in runs}


def test_world_size_2_to_4_to_1(tmp_path, resumed):
    """DDP and FSDP (DCP reshards), FSDP -> HSDP (2 copies x 2 shards) -> FSDP; ZeRO-1 -> 2 -> 1 and ZeRO-3
    through DeepSpeed's universal checkpoint (converted by shardyard, once, and removed once loaded; stages 1 and 2
    read each other's)."""
    runs = {"ddp": ("ddp",) * 3, "fsdp": ("fsdp",) * 3, "hsdp": ("fsdp", "fsdp backend.replicate=2", "fsdp"),
            "zero12": ("zero1", "zero2", "zero1"), "zero3": ("zero3",) * 3}
    curves = _two_to_four_to_one(tmp_path, resumed, runs)
    for name, (got, want) in curves.items():
        assert len(got) == 3 and max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-4, (name, got, want)
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


def test_deepspeed_stage_3_to_2_is_refused_with_the_supported_pairs(tmp_path, resumed):
    """On the module's warm ranks (a cold DeepSpeed start cost this test 26 s in the suite): the refusal is a
    UserError naming the supported pairs; how a worker's UserError ends a run (exit 2, one paragraph, no
    traceback) is tests/dist/test_expert_parallel.py's and tests/dist/test_debug.py's."""
    from shardyard.testing import RankFailed

    zero3 = resumed["zero3"][2]  # a world-2 ZeRO-3 run's checkpoints (steps 3 and 6)
    with pytest.raises(RankFailed) as failed:
        run_many(2, [([*STEPS, "backend=zero2", f"checkpoint.resume={zero3}/checkpoints/step-00000003"],
                      str(tmp_path / "b"))])
    err = " ".join(str(failed.value).split())
    assert "UserError" in err and "holds ZeRO-3 partitions and this run is ZeRO-2" in err, err[-3000:]
    assert "any world size within ZeRO-1/2" in err and "backend=zero3" in err


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
    import shardyard.training.integrity as integrity

    ck = Checkpointer.__new__(Checkpointer)  # only what pruning reads
    ck.dir, ck.c, ck._good = str(tmp_path), SimpleNamespace(keep_last=2), set()
    _checkpoints(tmp_path, [1, 2, 3, 4, 5])
    _truncate(tmp_path / "step-00000004/.metadata")
    _flip(tmp_path / "step-00000003/__0_0.distcp")  # same size: only a read tells, and pruning does not read
    read = []
    hash_file = integrity._hash_file
    monkeypatch.setattr(integrity, "_hash_file", lambda *a, **k: read.append(a) or hash_file(*a, **k))
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
    from shardyard.training.integrity import share, verify_share, writer

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


def test_a_file_one_rank_wrote_for_all_is_verified_in_pieces_by_every_rank(tmp_path):
    """ZeRO-1/2's ``mp_rank_00_model_states.pt`` (the whole 16-bit model, written by rank 0) is kept in pieces of
    whole MiB, piece i verified by rank i % world, each against the sha256 of its byte range (computed here with
    hashlib); the bytes each rank reads are counted where they are read (``integrity.HASHED``). A flipped byte is
    found by the rank of its piece; a manifest of whole-file hashes (older checkpoints) still verifies; a
    manifest whose pieces do not cover the file is malformed on every rank."""
    import hashlib

    from shardyard.training import integrity
    from shardyard.training.integrity import piece_bytes, verify_share

    mib = 2**20
    ck = tmp_path / "step-00000001"
    (ck / "zero").mkdir(parents=True)
    data = bytes(range(256)) * (5 * mib // 256 + 3)  # 5 MiB and 768 bytes
    states, optim = "zero/mp_rank_00_model_states.pt", "zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (ck / states).write_bytes(data)
    (ck / optim).write_bytes(b"o" * 100)
    assert piece_bytes(len(data), 4) == 2 * mib and piece_bytes(len(data), 1) == 0  # 4 ranks: 3 pieces of <= 2 MiB
    assert piece_bytes(100, 4) == 0 and piece_bytes(200 * mib, 1000) == 4 * mib  # at most 64 pieces
    cuts = [(0, 2 * mib), (2 * mib, 2 * mib), (4 * mib, mib + 768)]
    manifest = {states: {"bytes": len(data), "piece_bytes": 2 * mib,
                         "pieces": [hashlib.sha256(data[a:a + n]).hexdigest() for a, n in cuts]},
                optim: {"bytes": 100, "sha256": hashlib.sha256(b"o" * 100).hexdigest()}}

    def write(manifest):
        meta = {"step": 1, "world_size": 4, "manifest": manifest}
        (ck / "meta.json").write_text(json.dumps({**meta, "meta_sha256": _meta_digest(meta)}))

    write(manifest)
    assert verify(str(ck)) is None
    read = []
    for r in range(4):
        integrity.HASHED["bytes"] = 0
        read.append(verify_share(str(ck), r, 4))
        assert integrity.HASHED["bytes"] == read[-1][1]
    assert read == [(None, 2 * mib), (None, 2 * mib + 100), (None, mib + 768), (None, 0)]
    assert [n for _, n in (verify_share(str(ck), r, 2) for r in range(2))] == [3 * mib + 768 + 100, 2 * mib]
    flipped = bytearray(data)
    flipped[3 * mib] ^= 1
    (ck / states).write_bytes(bytes(flipped))
    found = [verify_share(str(ck), r, 4)[0] for r in range(4)]
    assert [p is not None for p in found] == [False, True, False, False], found
    assert "bytes 2,097,152-4,194,304 differs" in found[1] and "sha256" in verify(str(ck))
    (ck / states).write_bytes(data)
    write({**manifest, states: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}})  # an older one
    assert [verify_share(str(ck), r, 4) for r in range(4)] == [(None, len(data)), (None, 100), (None, 0), (None, 0)]
    write({**manifest, states: {**manifest[states], "pieces": manifest[states]["pieces"][:2]}})
    assert all("malformed" in str(verify_share(str(ck), r, 4)[0]) for r in range(4))
