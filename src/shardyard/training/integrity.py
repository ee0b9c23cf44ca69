"""A checkpoint's integrity: the sha256 of every file it holds (a large file one rank wrote for all in pieces,
``piece_bytes``), which rank writes and which verifies each (``writer``, ``share``, ``piece_share``), the manifest
``meta.json`` keeps of them and the check of a checkpoint against it (``verify``; ``verify_share``: one rank's part
on resume). ``checkpoint.Checkpointer`` writes and reads checkpoints with it; ``shardyard generate`` and the run dir's
checks verify one with it. Imports nothing of shardyard (the standard library only).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor


_CHUNK = 4 << 20
"""Bytes read per hash update: large enough to run at the hash's speed, small enough to keep memory flat."""


_HASH_THREADS = min(8, os.cpu_count() or 1)
"""Files hashed at once: hashlib releases the GIL, so a checkpoint of several shards hashes in parallel."""


def _files(path: str) -> list[str]:
    """Every file under ``path`` (dotfiles such as DCP's ``.metadata`` included) but the top ``meta.json``."""
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in names]
    return sorted(f for f in out if f != "meta.json")


HASHED = {"bytes": 0}
"""Bytes this process has read to hash checkpoint files (saves and resume verification), counted where they are
read: what the tests and bench/checkpoint.py read to see how the hashing is spread over the ranks."""


_COUNT = threading.Lock()


def _hash_file(file: str, sync: bool = False, start: int = 0, length: int | None = None) -> tuple[int, str]:
    """(bytes, sha256) of a file read in chunks (``start``/``length``: of that byte range only, one ``piece``);
    ``sync`` also fsyncs it (whichever rank wrote it)."""
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        f.seek(start)
        while (length is None or size < length) and (
                chunk := f.read(_CHUNK if length is None else min(_CHUNK, length - size))):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    with _COUNT:
        HASHED["bytes"] += size
    return size, h.hexdigest()


def _hash_all(path: str, files: list[str], sync: bool = False) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return list(pool.map(lambda rel: _hash_file(os.path.join(path, rel), sync), files))


_PIECE_MIN = 1 << 20
"""The smallest piece of a shared file hashed apart (``piece_bytes``)."""


_PIECES_MAX = 64
"""The most pieces one file is cut into: its manifest entry (one sha256 a piece) stays small at any world size."""


def piece_bytes(size: int, world: int) -> int:
    """The piece size a shared file of ``size`` bytes is hashed in at ``world`` ranks (0: whole, by one rank): a
    file one rank wrote for all (DeepSpeed ZeRO-1/2's ``mp_rank_00_model_states.pt``, the whole 16-bit model;
    Horovod's rank-0 files; DCP's ``.metadata``) is cut into at most ``min(world, _PIECES_MAX)`` byte ranges of a
    whole number of MiB, piece i hashed by rank ``i % world`` at the save and at resume (at any world size), so no
    rank reads the whole model while the others wait."""
    n = min(world, _PIECES_MAX, -(-size // _PIECE_MIN))
    if n <= 1:
        return 0
    per = -(-size // n)
    return -(-per // _PIECE_MIN) * _PIECE_MIN


def _pieces_of(size: int, step: int) -> list[tuple[int, int]]:
    """(start, length) of each piece of a file of ``size`` bytes cut every ``step`` bytes."""
    return [(start, min(step, size - start)) for start in range(0, size, step)]


def _hash_pieces(path: str, todo: list[tuple[str, int, int, int]]) -> list[str]:
    """sha256 of each (file, index, start, length) piece, in parallel."""
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return list(pool.map(lambda p: _hash_file(os.path.join(path, p[0]), start=p[2], length=p[3])[1], todo))


def _manifest(path: str, sync: bool = False, files: list[str] | None = None) -> dict:
    files = _files(path) if files is None else files
    return {rel: {"bytes": size, "sha256": digest} for rel, (size, digest) in zip(files, _hash_all(path, files, sync))}


_WRITER = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$|zero_pp_rank_(\d+)_|(?:^|/)rank(\d+)/|^rng-rank(\d+)\.json(?:\.tmp)?$")
"""The rank a checkpoint file's name says wrote it: DCP's ``__R_i.distcp``, DeepSpeed's ``*zero_pp_rank_R_*``,
ZeRO-Infinity's ``offloaded_tensors/rankR/``, each rank's RNG state ``rng-rankR.json``."""


_HANDOFF = re.compile(r"^part-rank\d+\.json(\.tmp)?$")
"""What each rank hands rank 0 inside the directory being saved (its files' hashes)."""


_EXPORT = "hf/"
"""The HF export inside a checkpoint (``checkpoint.export_hf``): its shards are claimed by the ranks that wrote them
(``export.save_hf``'s ``written``), rank 0 the rest."""


def writer(rel: str, world: int, entry: dict | None = None) -> int:
    """The rank that wrote the checkpoint file ``rel``: the one its manifest ``entry`` names (``rank``, recorded
    since the HF export's shards are hashed by their writers), else the one its name says (``_WRITER``); rank 0
    for every other file (DCP's ``.metadata``, a replica engine's files, an older HF export) and for a rank this
    world does not have."""
    if entry is not None and isinstance(entry.get("rank"), int):
        rank = entry["rank"]
    else:
        m = _WRITER.search(rel)
        rank = int(next(g for g in m.groups() if g is not None)) if m else 0
    return rank if rank < world else 0


def _shared(rel: str) -> bool:
    """A file one rank (rank 0) writes for all, hashed in pieces over the ranks when large (``piece_bytes``): no
    rank's name in it and not part of the HF export (whose shards their writers hash)."""
    return _WRITER.search(rel) is None and not _HANDOFF.match(rel) and not rel.startswith(_EXPORT)


def share(manifest: dict, rank: int, world: int, saved_world: int) -> list[str]:
    """The files of a checkpoint that ``rank`` verifies whole on resume: at the world size it was saved with, those
    it wrote (what it reads back: its own shards), rank 0 the shared ones; at another, a 1/world share of the bytes
    (largest files first, each to the rank with the fewest bytes so far: every rank computes the same split). A
    file hashed in pieces (``pieces`` in its entry) is in no rank's share: ``piece_share`` splits it."""
    whole = {rel: e for rel, e in manifest.items() if "pieces" not in e}
    if saved_world == world:
        return [rel for rel in sorted(whole) if writer(rel, world, whole[rel]) == rank]
    load = [0] * world
    mine = []
    for rel in sorted(whole, key=lambda r: (-int(whole[r]["bytes"]), r)):
        r = load.index(min(load))
        load[r] += int(whole[rel]["bytes"])
        if r == rank:
            mine.append(rel)
    return sorted(mine)


def piece_share(manifest: dict, rank: int, world: int) -> list[tuple[str, int]]:
    """The (file, piece index) pairs ``rank`` hashes of the files kept in pieces: piece i of each, by rank
    ``i % world`` (at the save's world size and at any other)."""
    return [(rel, i) for rel in sorted(manifest) if "pieces" in manifest[rel]
            for i in range(len(manifest[rel]["pieces"])) if i % world == rank]


def _meta_digest(meta: dict) -> str:
    """sha256 of ``meta.json``'s content less its own ``meta_sha256``: a flipped digit of the step, the data
    position or an RNG state is caught like a flipped byte of a shard."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def verify(path: str, files: list[str] | None = None, read: bool = True,
           pieces: list[tuple[str, int]] | None = None) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact (``meta.json`` matches its own sha256, and
    every file of its manifest is present with the size and sha256 it was written with, or the sha256 of each of
    its pieces), else what is wrong with it. Checkpoints written before shardyard kept hashes (no
    ``meta_sha256``) have sizes checked only. ``files``: only these of the manifest, and of the files kept in
    pieces only the ``pieces`` named (a rank's ``share`` and ``piece_share`` on resume); ``read=False``: sizes only
    (``stat``, no byte read: pruning)."""
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return "it has no meta.json (it was never completed)"
    except (OSError, ValueError) as e:
        return f"its meta.json is unreadable ({type(e).__name__}: {e})"
    try:
        return _verify(path, meta, files, read, pieces)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:  # a manifest of the wrong shape
        return f"its meta.json is malformed ({type(e).__name__}: {e})"


def _entries(manifest: dict) -> dict[str, dict]:
    """A manifest's entries as dicts (the oldest checkpoints kept a file's size alone)."""
    return {rel: e if isinstance(e, dict) else {"bytes": int(e)} for rel, e in manifest.items()}


def verify_share(path: str, rank: int, world: int) -> tuple[str | None, int]:
    """``verify`` of this rank's ``share`` and ``piece_share`` of the checkpoint at ``path`` (every rank checks
    ``meta.json``): what is wrong, and the bytes this rank read to tell."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        manifest = _entries(meta["manifest"])
        for e in manifest.values():  # a size for every file, pieces that cover it (else: malformed, said by verify
            int(e["bytes"])          # on every rank alike)
            if "pieces" in e and len(e["pieces"]) != len(_pieces_of(int(e["bytes"]), int(e["piece_bytes"]))):
                raise ValueError("pieces")
        files = share(manifest, rank, world, int(meta.get("world_size", world)))
        pieces = piece_share(manifest, rank, world)
        read = sum(int(manifest[rel]["bytes"]) for rel in files) + sum(
            length for rel, i in pieces
            for length in [_pieces_of(int(manifest[rel]["bytes"]), int(manifest[rel]["piece_bytes"]))[i][1]])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return verify(path), 0  # what is wrong with meta.json (or its manifest), said by verify: every rank alike
    return verify(path, files, pieces=pieces), read


def _verify(path: str, meta: dict, files: list[str] | None = None, read: bool = True,
            pieces: list[tuple[str, int]] | None = None) -> str | None:
    hashed_meta = "meta_sha256" in meta
    if hashed_meta and meta["meta_sha256"] != _meta_digest(meta):
        return "meta.json is corrupt: its sha256 differs from the one recorded when it was saved"
    manifest = meta["manifest"]
    if not isinstance(manifest, dict) or (hashed_meta and not manifest):
        return "its meta.json is malformed (no manifest of its files)"
    want = _entries(manifest)
    if files is None:  # the whole checkpoint: every piece too
        pieces = [(rel, i) for rel, e in sorted(want.items()) if "pieces" in e for i in range(len(e["pieces"]))]
    else:
        want = {rel: want[rel] for rel in [*files, *sorted({rel for rel, _ in pieces or []})]}
    for rel, entry in want.items():
        if hashed_meta and not isinstance(entry.get("sha256"), str) and not (
                isinstance(entry.get("pieces"), list) and isinstance(entry.get("piece_bytes"), int)
                and entry["piece_bytes"] > 0
                and len(entry["pieces"]) == len(_pieces_of(int(entry["bytes"]), entry["piece_bytes"]))):
            return f"its meta.json is malformed ({rel} has no sha256)"
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return f"{rel} is missing"
        if os.path.getsize(file) != entry["bytes"]:
            return f"{rel} is truncated or corrupt ({os.path.getsize(file)} bytes, {entry['bytes']} written)"
    hashed = sorted(rel for rel, entry in want.items() if "sha256" in entry) if read else []
    cut = [(rel, i, *_pieces_of(int(want[rel]["bytes"]), int(want[rel]["piece_bytes"]))[i])
           for rel, i in (pieces or [])] if read else []
    try:
        got = _hash_all(path, hashed)
        got_pieces = _hash_pieces(path, cut)
    except OSError as e:
        return f"a file is unreadable ({e})"
    for rel, (_, digest) in zip(hashed, got):
        if digest != want[rel]["sha256"]:
            return (f"{rel} is truncated or corrupt: its sha256 differs from the one recorded when it was saved "
                    f"(same size, {want[rel]['bytes']} bytes)")
    for (rel, i, start, length), digest in zip(cut, got_pieces):
        if digest != want[rel]["pieces"][i]:
            return (f"{rel} is corrupt: the sha256 of its bytes {start:,}-{start + length:,} differs from the one "
                    f"recorded when it was saved (same size, {want[rel]['bytes']} bytes)")
    return None
