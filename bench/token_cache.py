"""Token caches at scale (issue 41): what a start pays to verify a cache, and what reading through a bounded set
of open shards costs. Prints ratios; nothing here is asserted.

1. Verifying a cache of ``--gb`` GB: every file hashed (``data.verify=full``, or a cache without a stamp that
   holds: what every rank of every start paid before issue 41) against its stamp checked by stat (every later
   start, on every rank). Page cache warm, so the hash is CPU-bound here; from a cold disk or a network file system
   it is slower still.
2. Reading a step's windows from ``--shards`` shards, random windows as the sampler draws them: ``pread`` through
   at most ``shards.OPEN_SHARDS`` open shards (an LRU) against every shard memory-mapped at once (the reader before
   issue 41: one descriptor per shard).

    python bench/token_cache.py [--gb 0.5] [--shards 2000]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from shardyard.data import shards, token_cache  # noqa: E402


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def verification(tmp: str, gb: float, n_files: int) -> None:
    build = os.path.join(tmp, "build")
    os.makedirs(build)
    per = int(gb * 1e9) // n_files
    rng = np.random.default_rng(0)
    for i in range(n_files):
        rng.integers(0, 4096, size=per // 2, dtype=np.uint16).tofile(os.path.join(build, f"train-{i:05d}.bin"))
    out = os.path.join(tmp, "cache")
    token_cache.publish(build, out, "stamp")  # manifest (every sha256) and stamp, as a build leaves them
    full = best(lambda: token_cache._manifest_problem(out), 2)
    stamp = best(lambda: token_cache._stamp_holds(out), 20)
    print(f"verify a {gb:.2f} GB cache ({n_files} files): every file hashed {full:.3f} s, its stamp checked "
          f"{stamp * 1e3:.3f} ms: {full / stamp:,.0f}x; a start of 8 ranks on a node hashed it 8 times before "
          f"({8 * full:.2f} s of reads), now once per node when no stamp holds, else never")


class Mapped:
    """The reader before issue 41: every shard memory-mapped (a descriptor each) when the split is opened."""

    def __init__(self, d: str, listing: list[dict]):
        self.maps = []
        for s in listing:
            with open(os.path.join(d, s["file"]), "rb") as f:
                self.maps.append(np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=np.uint16))
        self.per = len(self.maps[0])

    def read(self, start: int, stop: int) -> np.ndarray:
        i, a = divmod(start, self.per)
        if a + stop - start <= self.per:
            return self.maps[i][a:a + stop - start]
        return np.concatenate([self.maps[i][a:], self.maps[i + 1][: stop - start - (self.per - a)]])


def reading(tmp: str, n_shards: int, seq_len: int = 128, windows: int = 4096) -> None:
    d = os.path.join(tmp, "many")
    os.makedirs(d)
    per = 128 * 1024  # tokens per shard (256 KB)
    rng = np.random.default_rng(1)
    listing = []
    for i in range(n_shards):
        rng.integers(0, 4096, size=per, dtype=np.uint16).tofile(os.path.join(d, f"train-{i:05d}.bin"))
        listing.append({"file": f"train-{i:05d}.bin", "tokens": per})
    starts = rng.integers(0, n_shards * per - seq_len - 1, size=windows)

    for s in listing:  # the page cache warm, as for a corpus read before (each measured window is read once)
        with open(os.path.join(d, s["file"]), "rb") as f:
            f.read()

    def per_window(make) -> float:
        times = []
        for _ in range(3):  # a fresh reader each time (made untimed): a mapping's pages are touched for the first time
            reader = make()
            t = time.perf_counter()
            for s in starts:
                np.asarray(reader.read(int(s), int(s) + seq_len + 1), dtype=np.int64)
            times.append(time.perf_counter() - t)
            del reader
        return min(times) / windows

    fds = len(os.listdir("/proc/self/fd"))
    old = Mapped(d, listing)
    old_fds = len(os.listdir("/proc/self/fd")) - fds
    del old
    new = shards.TokenShards(d, listing, "uint16")
    for s in starts:
        new.read(int(s), int(s) + seq_len + 1)
    new_fds = len(os.listdir("/proc/self/fd")) - fds
    del new
    before = per_window(lambda: Mapped(d, listing))
    now = per_window(lambda: shards.TokenShards(d, listing, "uint16"))
    every = per_window(lambda: shards.TokenShards(d, listing, "uint16", max_open=n_shards))
    print(f"read {windows} random {seq_len + 1}-token windows of {n_shards} shards ({n_shards * per * 2 / 1e9:.2f} GB, "
          f"page cache warm), a fresh reader: every shard mapped at the start (before) {before * 1e6:.1f} us a window "
          f"with {old_fds} descriptors held; pread with at most {shards.OPEN_SHARDS} open {now * 1e6:.1f} us with "
          f"{new_fds}: {now / before:.2f}x (pread, every shard left open: {every * 1e6:.1f} us); a step of 64 "
          f"windows per rank {64 * now * 1e3:.2f} ms against {64 * before * 1e3:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.5, help="size of the verified cache")
    ap.add_argument("--files", type=int, default=8, help="its files")
    ap.add_argument("--shards", type=int, default=2000, help="shards read in part 2")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        verification(tmp, args.gb, args.files)
        reading(tmp, args.shards)


if __name__ == "__main__":
    main()
