"""Token shards: documents -> ``num_proc`` tokenizer processes -> memory-mapped token files, written as they come.

Writing (``build``):

1. The main process reads the pieces of documents in their fixed order and groups them into chunks of at most
   ``chunk_chars`` characters; at most ``2 x num_proc`` chunks are in flight, so what it holds is bounded by
   ``buffer_bytes`` (the chunks' text and their returned token arrays), whatever the corpus size.
2. Workers tokenize a chunk in small batches and return compact arrays (a Python list of token ids costs 36
   bytes a token; an Encoding far more), never the whole chunk's encodings at once.
3. Results are taken in submission order, so the shards are the same whatever ``num_proc`` is. Each piece goes
   to the train or val stream by its document's name; an end-of-text token follows each document.
4. A shard closes when its train part reaches ``shard_tokens``, after the piece that fills it; its files are fsynced
   and the progress file (every finished shard, its size and sha256, and how many pieces precede the cut)
   is replaced in one rename. A build killed midway resumes from there: finished shards are kept, the
   unfinished one is dropped, the pieces before the cut are read again but not tokenized.

Reading (``TokenShards``): one virtual stream per split over its shards, read with ``pread``: a shard is opened
when a window first needs it and at most ``OPEN_SHARDS`` stay open, so a rank's descriptors do not grow with the
shard count (a 69B-token corpus of 256 MB shards is ~540 of them, past 1,024 with a few sources and their val
splits). A rank reads only the windows it is given.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from shardyard.data.corpus import Piece

PROGRESS = "progress.json"
"""A build's progress, in its partial directory (``<cache>.partial``): finished shards and the pieces before them."""
MANIFEST = "shardyard_cache.json"
"""A published cache directory's manifest (``shardyard.data.token_cache``): its key and every other file's size and
sha256, written last before the directory is published. A directory holding one is a cache, never a corpus."""
OPEN_SHARDS = 64
"""Shards of one split a process keeps open at once: more than a rank's windows of a step, so the shards its
prefetch opened are still open when the next step reads those windows."""

# ------------------------------------------------------------------------------------------ the workers
_tok = None


def _init_worker(tokenizer_file: str, one_thread: bool = True) -> None:
    global _tok
    from tokenizers import Tokenizer

    if one_thread:  # a worker process: num_proc decides how many cores tokenize, not Rayon's threads in each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tok = Tokenizer.from_file(tokenizer_file)


def _encode(texts: list[str], dtype: str) -> list[np.ndarray]:
    """Token ids of each text (no special tokens added), as compact arrays."""
    assert _tok is not None
    out: list[np.ndarray] = []
    batch: list[str] = []
    size = 0

    def flush() -> None:
        for enc in _tok.encode_batch_fast(batch, add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=dtype))
        batch.clear()

    for t in texts:  # ~256 kB of text per encode_batch call: its Encoding objects stay small
        batch.append(t)
        size += len(t)
        if size >= 1 << 18:
            flush()
            size = 0
    if batch:
        flush()
    return out


# ------------------------------------------------------------------------------------------- the writer
@dataclass
class BuildOptions:
    tokenizer_file: str
    eot: int
    dtype: str
    """``uint16`` for vocabularies up to 65,536 tokens, else ``uint32``."""
    is_val: Callable[[str], bool]
    num_proc: int
    buffer_bytes: int
    shard_tokens: int
    label: str = ""
    """What the progress bar says it tokenizes."""


class _Split:
    """The open shard of one split, written as token arrays arrive, hashed as it is written."""

    def __init__(self, dirname: str, split: str, index: int, dtype: str):
        self.name = f"{split}-{index:05d}.bin"
        self.path = os.path.join(dirname, self.name)
        self.f = open(self.path, "wb")
        self.h = hashlib.sha256()
        self.tokens, self.itemsize = 0, np.dtype(dtype).itemsize

    def write(self, ids: np.ndarray) -> None:
        b = ids.tobytes()
        self.f.write(b)
        self.h.update(b)
        self.tokens += len(ids)

    def close(self) -> dict | None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.tokens == 0:
            os.remove(self.path)
            return None
        return {"file": self.name, "tokens": self.tokens, "bytes": self.tokens * self.itemsize,
                "sha256": self.h.hexdigest()}


def _load_progress(partial: str) -> dict:
    """The finished shards of an earlier, interrupted build (each checked by size), files of the unfinished one
    removed; an empty progress when there is none or it does not hold."""
    empty = {"pieces": 0, "cuts": 0, "shards": {"train": [], "val": []}, "documents": {"train": 0, "val": 0}}
    try:
        progress = json.loads(open(os.path.join(partial, PROGRESS)).read())
        listed = {s["file"]: s["bytes"] for split in ("train", "val") for s in progress["shards"][split]}
        ok = all(os.path.getsize(os.path.join(partial, f)) == n for f, n in listed.items())
    except (OSError, ValueError, KeyError, TypeError):
        progress, listed, ok = empty, {}, True
    if not ok:
        progress, listed = empty, {}
    for name in os.listdir(partial):  # the shard being written when the build stopped, or what its end wrote
        if name not in listed and name != PROGRESS:  # meta.json, the manifest and stamp of a publish cut short
            os.remove(os.path.join(partial, name))
    return progress


def _save_progress(partial: str, progress: dict) -> None:
    tmp = os.path.join(partial, PROGRESS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(progress, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(partial, PROGRESS))


def build(pieces: Iterable[Piece], partial: str, opt: BuildOptions, total_bytes: int | None = None,
          bytes_read: Callable[[], int] | None = None) -> dict:
    """Tokenize ``pieces`` into shards in the directory ``partial`` (resumed when it holds an earlier build's
    progress). Returns the shard lists and counts for ``meta.json``. ``total_bytes`` / ``bytes_read``: the
    input's size and how much of it is read (the progress bar)."""
    os.makedirs(partial, exist_ok=True)
    progress = _load_progress(partial)
    skip = progress["pieces"]
    if skip:
        print(f"shardyard | resuming after {progress['cuts']} finished shards ({skip:,} pieces of documents) of an "
              f"interrupted build in {partial}", flush=True)
    chunk_chars = max(1 << 16, opt.buffer_bytes // (4 * max(opt.num_proc, 1)))
    bar = _Bar(opt.label, total_bytes, bytes_read)

    def chunks() -> Iterator[list[Piece]]:
        chunk: list[Piece] = []
        size = 0
        for i, piece in enumerate(pieces):
            if i < skip:  # tokenized by the interrupted build: its shards are kept
                continue
            chunk.append(piece)
            size += len(piece.text)
            if size >= chunk_chars:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    index = progress["cuts"]  # shard files are numbered by the cut they end at, the same in both splits
    open_ = {s: _Split(partial, s, index, opt.dtype) for s in ("train", "val")}
    eot = np.asarray([opt.eot], dtype=opt.dtype)
    done_pieces = skip

    def take(chunk: list[Piece], arrays: list[np.ndarray]) -> None:
        nonlocal done_pieces, index, open_
        for piece, ids in zip(chunk, arrays):
            split = "val" if opt.is_val(piece.name) else "train"
            open_[split].write(ids)
            if piece.last:
                open_[split].write(eot)
                progress["documents"][split] += 1
            done_pieces += 1
            if open_["train"].tokens >= opt.shard_tokens:  # cut here, after a piece: the same cuts whatever the
                _close(open_)                              # chunking (num_proc, buffer_mb); both splits together
                index += 1
                open_ = {s: _Split(partial, s, index, opt.dtype) for s in ("train", "val")}
        bar.update(sum(len(p.text) for p in chunk))

    def _close(splits: dict[str, _Split]) -> None:
        for split, w in splits.items():
            info = w.close()
            if info is not None:
                progress["shards"][split].append(info)
        progress["pieces"], progress["cuts"] = done_pieces, index + 1
        _save_progress(partial, progress)

    if opt.num_proc == 1:  # no pool to start: tokenized in this process, by the tokenizer's own Rayon threads
        _init_worker(opt.tokenizer_file, one_thread=False)
        for chunk in chunks():
            take(chunk, _encode([p.text for p in chunk], opt.dtype))
    else:
        ctx = multiprocessing.get_context("spawn")  # never fork a parent that may hold torch's threads
        with ctx.Pool(opt.num_proc, initializer=_init_worker, initargs=(opt.tokenizer_file,)) as pool:
            pending: deque = deque()
            for chunk in chunks():
                pending.append((chunk, pool.apply_async(_encode, ([p.text for p in chunk], opt.dtype))))
                if len(pending) >= 2 * opt.num_proc:  # the bound: chunks in flight
                    c, r = pending.popleft()
                    take(c, r.get())
            while pending:
                c, r = pending.popleft()
                take(c, r.get())
    _close(open_)
    bar.close()
    return {"shards": progress["shards"], "documents": progress["documents"],
            "tokens": {s: sum(x["tokens"] for x in progress["shards"][s]) for s in ("train", "val")}}


class _Bar:
    """Progress of a build, by input bytes read (or text bytes tokenized when the input cannot say): rate and ETA."""

    def __init__(self, label: str, total: int | None, bytes_read: Callable[[], int] | None):
        from tqdm import tqdm

        self.bytes_read, self.text = bytes_read, 0
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"shardyard | tokenizing {label}",
                        mininterval=0.5 if tty else 10.0, file=sys.stderr, dynamic_ncols=tty, leave=True,
                        delay=0 if tty else 2.0)
        self.start = time.perf_counter()

    def update(self, text_bytes: int) -> None:
        self.text += text_bytes
        now = self.bytes_read() if self.bytes_read is not None else self.text
        if self.bar.total is not None:
            now = min(now, self.bar.total)
        self.bar.update(now - self.bar.n)

    def close(self) -> None:
        if self.bar.total is not None:
            self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


# ------------------------------------------------------------------------------------------- the reader
class TokenShards:
    """One split's shards read as one stream of tokens, with ``pread``. A shard is opened when a read first needs
    it, and at most ``max_open`` stay open (the least recently used is closed first): descriptors stay bounded
    whatever the shard count. A read copies its window (a few hundred bytes), so closing a shard never touches an
    array already returned; reopening one costs an ``open`` (~5 us here; a mapping's ``mmap`` and ``munmap``
    cost ~30 us more, ``bench/token_cache.py``)."""

    def __init__(self, dirname: str, shards: list[dict], dtype: str, max_open: int = OPEN_SHARDS):
        self.paths = [os.path.join(dirname, s["file"]) for s in shards]
        self.dtype, self.itemsize, self.max_open = np.dtype(dtype), np.dtype(dtype).itemsize, max(1, max_open)
        self.starts = np.cumsum([0] + [int(s["tokens"]) for s in shards])  # from the listing: no file opened
        self._open: OrderedDict[int, int] = OrderedDict()  # shard -> descriptor, least recently used first
        self._closer = weakref.finalize(self, _close_all, self._open)  # when the reader is collected

    def close(self) -> None:
        """Close every open shard now (a later read opens them again)."""
        self._closer.detach()
        _close_all(self._open)
        self._closer = weakref.finalize(self, _close_all, self._open)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _fd(self, i: int) -> int:
        fd = self._open.get(i)
        if fd is not None:
            self._open.move_to_end(i)
            return fd
        fd = self._open[i] = os.open(self.paths[i], os.O_RDONLY)
        if len(self._open) > self.max_open:
            os.close(self._open.popitem(last=False)[1])
        return fd

    def _spans(self, start: int, stop: int):
        """``(shard, first, end)`` pieces of the token range ``[start, stop)``."""
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            base = int(self.starts[i])
            end = min(stop, int(self.starts[i + 1]))
            yield i, start - base, end - base
            start, i = end, i + 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (across a shard boundary when the range spans one)."""
        parts = []
        for i, a, b in self._spans(start, stop):
            want = (b - a) * self.itemsize
            raw = os.pread(self._fd(i), want, a * self.itemsize)
            if len(raw) != want:
                raise RuntimeError(f"{self.paths[i]} ends before token {b}: the cache changed after it was verified")
            parts.append(np.frombuffer(raw, dtype=self.dtype))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def prefetch(self, start: int, stop: int) -> None:
        """Ask the kernel to read ``[start, stop)`` in the background (``POSIX_FADV_WILLNEED``): a step's windows
        are scattered over the corpus, and on a cold page cache each costs a disk read when it is read."""
        for i, a, b in self._spans(start, stop):
            os.posix_fadvise(self._fd(i), a * self.itemsize, (b - a) * self.itemsize, os.POSIX_FADV_WILLNEED)


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
