"""Token caches at scale (issue 41): a start verifies a cache once per node whoever started the ranks, and a
second start reads no byte of it (its stamp is checked by stat); `data.verify=full` hashes it again, once per node;
hosts whose file locks fail or are not shared both build a cache, and the loser of the publishing rename uses the
winner's."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from shardyard.testing import compose, on_ranks, synthetic_corpus

SMALL = ["data=text_files", "data.shard_mb=1", "data.buffer_mb=1", "data.num_proc=1", "data.tokenizer.vocab_size=1000",
         "data.tokenizer.train_bytes=1000000", "data.seq_len=64"]


def _rchar() -> int:
    """Bytes this process has read through read(2) so far (the kernel's count: hashing a file reads all of it)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _one_start(rank: int, world: int, overrides: list, nodes: int, tmp: str, out: str) -> None:
    """One start of a run's data on this rank, as a worker does it (after the gloo process group is up). The
    launcher's variables place it on node ``rank // (world / nodes)``, with that node's own temp directory."""
    import torch.distributed as dist

    from shardyard.data import pipeline as data, token_cache

    per_node = world // nodes
    node = rank // per_node
    os.makedirs(f"{tmp}/node{node}", exist_ok=True)
    os.environ.update(LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node),
                      TMPDIR=f"{tmp}/node{node}")
    token_cache._verified.clear()  # a fresh worker: nothing verified in this process yet
    cfg = compose(overrides)
    dist.init_process_group("gloo")
    try:
        before = _rchar()
        data.prepare(cfg)
        read = _rchar() - before
        every = [None] * world
        dist.all_gather_object(every, read)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(every, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A corpus, and its tokenizer and token caches built once; returns (corpus, cache dir, bytes of the token
    cache's files: what a rank that hashes it reads, at least)."""
    from shardyard.data import pipeline as data

    root = tmp_path_factory.mktemp("caches")
    synthetic_corpus(str(root / "corpus.jsonl"), 6)
    cache = root / "built"
    tokens = data.prepare(compose([*SMALL, f"data.paths=[{root / 'corpus.jsonl'}]", f"data.cache_dir={cache}"])).token_dir
    return root / "corpus.jsonl", cache, sum(p.stat().st_size for p in os.scandir(tokens))


def _starts(built, tmp_path, nodes: int, *extra: str, copy: bool = True) -> list[int]:
    """Bytes read by each of 4 ranks in one start, the caches a fresh copy of the built ones unless ``copy`` is
    false (then those of the previous start, in ``tmp_path/cache``)."""
    corpus, cache, _ = built
    if copy:  # a cache copied to the cluster's file system: new inodes, so the builder's stamps do not hold
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        shutil.copytree(cache, tmp_path / "cache")
    out = str(tmp_path / "read.json")
    on_ranks(4, _one_start, [*SMALL, f"data.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}", *extra], nodes,
             str(tmp_path), out)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_start_hashes_the_caches_once_per_node_and_a_second_start_reads_none_of_them(built, tmp_path, monkeypatch,
                                                                                       nodes):
    """4 gloo ranks on 1 node, then on 2 (by the launcher's variables and a temp dir per node): before issue 41
    every rank hashed the whole cache at every start (4 x its bytes each time)."""
    monkeypatch.delenv("SHARDYARD_VERIFIED_CACHES", raising=False)  # no parent hands anything over here
    size = built[2]
    noise = size // 4  # what a rank reads besides hashing: tokenizer.json (the cache key), meta.json, stamps
    first = _starts(built, tmp_path, nodes)
    hashed = [r for r, n in enumerate(first) if n >= size]
    assert all(n < noise for r, n in enumerate(first) if r not in hashed), (first, size)
    per_node = [len([r for r in hashed if r // (4 // nodes) == node]) for node in range(nodes)]
    # One node: exactly one rank hashes. Two nodes on one shared file system: each hashes at most once (the other
    # node may find the first one's stamp already).
    assert max(per_node) == 1 and (nodes == 2 or per_node == [1]), (first, size)
    again = _starts(built, tmp_path, nodes, copy=False)
    assert max(again) < noise, (again, size)  # the stamps hold: stat only
    full = _starts(built, tmp_path, nodes, "data.verify=full", copy=False)
    leaders = [r for r in range(4) if r % (4 // nodes) == 0]
    assert [r for r, n in enumerate(full) if n >= size] == leaders, (full, size)  # local rank 0 of every node
    assert all(full[r] < noise for r in range(4) if r not in leaders), (full, size)


BUILDER = r"""
import errno, fcntl, json, os, socket, sys, time

mode, host, peer, barrier, *overrides = sys.argv[1:]


def flock(fd, op):
    if mode == "refused":  # NFS without lockd, Lustre mounted noflock
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    return None  # locks that are not shared between hosts: every host gets every lock


fcntl.flock = flock
socket.gethostname = lambda: host
real_replace, renames = os.replace, [0]


def replace(src, dst, *args, **kwargs):
    # The two hosts finish their builds together: each waits for the other at every directory rename.
    if os.path.isdir(src):
        renames[0] += 1
        open(os.path.join(barrier, f"{host}-{renames[0]}"), "w").close()
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(barrier, f"{peer}-{renames[0]}")) and time.time() < deadline:
            time.sleep(0.02)
    return real_replace(src, dst, *args, **kwargs)


os.replace = replace
from shardyard.data import pipeline as data
from shardyard.testing import compose

p = data.prepare(compose(overrides))
print("PREPARED " + json.dumps([p.tokenizer_dir, p.token_dir]), flush=True)
"""


@pytest.mark.parametrize("locks", ["refused", "unshared"])
def test_two_hosts_whose_locks_fail_build_one_cache_and_both_use_it(tmp_path, locks):
    """Two hosts build the same caches at once, their flock refused (ENOLCK) or granted to both; they rename their
    builds into place at the same moment. Before issue 41 the refused lock was a traceback, and the loser of the
    rename died of ENOTEMPTY."""
    from shardyard.data import pipeline as data, token_cache

    synthetic_corpus(str(tmp_path / "corpus.jsonl"), 0.5)
    (tmp_path / "barrier").mkdir()
    overrides = [*SMALL, f"data.paths=[{tmp_path / 'corpus.jsonl'}]", f"data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("SHARDYARD_VERIFIED_CACHES", None)
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, locks, host, peer, str(tmp_path / "barrier"), *overrides],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for host, peer in (("host-a", "host-b"), ("host-b", "host-a"))]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outs]
    dirs = {line for out, _ in outs for line in out.splitlines() if line.startswith("PREPARED ")}
    assert len(dirs) == 1, outs  # both use the same caches
    tok_dir, tokens = json.loads(dirs.pop()[len("PREPARED "):])
    for kind, published in (("tokenizers", tok_dir), ("tokens", tokens)):
        entries = sorted(p.name for p in (tmp_path / "cache" / kind).iterdir() if not p.name.endswith(".lock"))
        assert entries == [os.path.basename(published)], entries  # one cache, no temp or partial build left
        assert token_cache._manifest_problem(published) is None  # every file's sha256 as written
        assert token_cache._stamp_holds(published)  # stamped as built: no rank hashes it again
    said = "".join(out for out, _ in outs)
    assert said.count("was published by another host meanwhile; it verifies") == 2, said  # tokenizer, tokens
    prepared = data.prepare(compose(overrides))
    assert len(data.open_split(prepared, "train", 64)) > 100
