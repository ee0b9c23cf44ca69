"""Corpora -> cached tokenizer + token shards -> packed, mixed, sharded, resumable batches.

This module is the data API the worker, the loop and the tests use: ``prepare`` (sources -> caches), the splits'
rows, and the sample order. Its parts live by concern: the document sources in ``shardyard.data.sources``, the
tokenizer and token caches (build, publish, verify once per node) in ``shardyard.data.token_cache``, the shard files in
``shardyard.data.shards``, the file formats in ``shardyard.data.corpus``; their public names are importable from here too.

Each document goes to train or val by a stable hash of its name, is tokenized (``shardyard.data.shards``: worker
processes, bounded memory, resumable) and followed by an end-of-text token. Every source has its own cache, keyed
by its fingerprint and the tokenizer: with a given tokenizer (``data.tokenizer.path``, a model's), adding a source
to a mixture tokenizes only that one; a BPE trained on the mixture's text changes (and so re-tokenizes) when its
sources do, not when their weights do.

Training sequences are the non-overlapping ``seq_len + 1`` windows of a source's train stream. Sample ``k`` of
a run (``k = step x global batch + ...``) is a pure function of the seed and ``k``: a seeded block schedule picks
its source (the weights' shares, exact within each block of ``BLOCK`` samples), and a seeded permutation of that
source's windows (a new one each pass over them) picks its window, computed per index with no table. Rank ``r``
reads its contiguous share of a step's samples, split into micro-batches. So the data position is the step
count: a resume at any world size consumes exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from omegaconf import DictConfig

from shardyard.data import shards
from shardyard.data.corpus import JSON_TYPES, KNOWN, Piece, Records, file_format, read_records  # noqa: F401 (sft's)
from shardyard.core.errors import UserError
from shardyard.data.sources import (  # noqa: F401 (the data API's names, and the _target_s shardyard.data.pipeline.*)
    SOURCE_KEYS, DocumentSource, Source, StdlibCode, TextFiles, _files_fingerprint, input_files, is_val, mixture,
    open_source, open_sources, pieces_of)
from shardyard.data.token_cache import (  # noqa: F401 (the data API's names)
    EOT, SHARDS_FORMAT, VERIFIED_ENV, cache_problem, check_tokenizer, has_tokenizer, load_tokenizer, num_proc,
    token_dir, tokenizer_dir, tokenizer_path, tokenizer_source)
from shardyard.data.token_cache import _share_verified


# ----------------------------------------------------------------------------------------------- prepare
class Part(NamedTuple):
    """One source's token cache in a prepared run."""

    name: str
    token_dir: str
    weight: float
    epochs: float | None


@dataclass(frozen=True)
class Prepared:
    tokenizer_dir: str
    token_dir: str
    """The first source's token cache (the only one unless ``data=mixture``)."""
    vocab_size: int
    stats: dict | None = None
    """What a source that makes its own rows reports (``data=sft``: conversations, truncated, dropped)."""
    parts: tuple[Part, ...] = ()
    """Every source's token cache, weight and epochs cap, in ``data.sources`` order."""


def prepare(cfg: DictConfig, embedding_rows: int | None = None) -> Prepared:
    """Build (or find) the tokenizer and token caches; safe to call from many processes at once.
    ``embedding_rows``: the model's input embedding size, checked against the tokenizer."""
    d = cfg.data
    sources = open_sources(d)
    tok_dir = tokenizer_path(cfg) or tokenizer_dir(d, sources)
    parts = tuple(Part(s.name, token_dir(d, s, tok_dir), s.weight, s.epochs) for s in sources)
    metas = [json.loads(Path(p.token_dir, "meta.json").read_text()) for p in parts]
    meta = metas[0]
    if embedding_rows is not None and meta["vocab_size"] > embedding_rows:
        key = "model.vocab_size" if "vocab_size" in cfg.model else "data.tokenizer.path"
        raise UserError(key, cfg.model.get("vocab_size", tok_dir),
                        f"The tokenizer ({tok_dir}) has {meta['vocab_size']} tokens, more than the model's "
                        f"{embedding_rows} embedding rows.",
                        f"Use model.vocab_size>={meta['vocab_size']}, a smaller data.tokenizer.vocab_size, or the "
                        "model's own tokenizer.")
    for s, m in zip(sources, metas):
        for split in ("train", "val"):
            if "rows" in m and m["rows"][split] < 1:
                raise UserError("data.val_fraction" if split == "val" else "data.paths", d.get(
                    "val_fraction" if split == "val" else "paths"), f"The {split} split has no conversation.",
                    "Give more conversations, or another data.val_fraction.")
            if "tokens" in m and m["tokens"][split] < d.seq_len + 1:
                where = f"The {split} split{' of source ' + s.name if len(sources) > 1 else ''}"
                raise UserError("data.seq_len", d.seq_len, f"{where} has only {m['tokens'][split]} tokens, "
                                "less than one sequence.", "Use more data, a shorter data.seq_len or another "
                                "data.val_fraction.")
    _share_verified()
    return Prepared(tok_dir, parts[0].token_dir, meta["vocab_size"], meta.get("stats"), parts)


# --------------------------------------------------------------------------------------------- batches
def open_split(prepared: Prepared, split: str, seq_len: int, document_mask: bool = False, part: int = 0):
    """The rows of one source's ``split``: packed text windows (``PackedSequences``), a source's own rows
    (``SFTRows``: SFT, preference pairs) or prompts (``PromptRows``)."""
    tdir = prepared.parts[part].token_dir if prepared.parts else prepared.token_dir
    if os.path.exists(os.path.join(tdir, f"{split}.prompt_ids.npy")):
        return PromptRows(os.path.join(tdir, split))
    if os.path.exists(os.path.join(tdir, f"{split}.input_ids.npy")):
        return SFTRows(os.path.join(tdir, split))
    meta = json.loads(Path(tdir, "meta.json").read_text())
    tokens = shards.TokenShards(tdir, meta["shards"][split], meta["dtype"])
    return PackedSequences(tokens, seq_len, eot=meta["eot"] if document_mask else None)


def open_train(prepared: Prepared, d: DictConfig, seed: int, total_samples: int):
    """The training samples: one source's rows, or the weighted ``Mixture`` of several."""
    rows = [open_split(prepared, "train", d.seq_len, d.document_mask, i) for i in range(len(prepared.parts))]
    if len(rows) == 1:
        return rows[0]
    return Mixture([p.name for p in prepared.parts], rows, [p.weight for p in prepared.parts],
                   [p.epochs for p in prepared.parts], seed, total_samples)


def open_val(prepared: Prepared, d: DictConfig) -> dict:
    """Every source's held-out rows, by source name (evaluated apart, ``eval/loss/<name>``)."""
    return {p.name: open_split(prepared, "val", d.seq_len, d.document_mask, i) for i, p in enumerate(prepared.parts)}


class PackedSequences:
    """Non-overlapping ``seq_len + 1`` windows over one token stream (memory-mapped shards, or an array).
    ``eot``: document masking: positions restart after every end-of-text token, so attention stops at
    document boundaries (``model.packed_kwargs`` turns the restarts into a block-diagonal mask, or varlen
    boundaries for FlashAttention-2), and the inputs are ``{"input_ids", "position_ids"}``."""

    def __init__(self, tokens, seq_len: int, eot: int | None = None):
        self.tokens = tokens
        self.seq_len, self.eot = seq_len, eot
        self.n = max(0, (len(self.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def _window(self, i: int) -> np.ndarray:
        L = self.seq_len
        if isinstance(self.tokens, shards.TokenShards):
            return self.tokens.read(i * L, i * L + L + 1)
        return self.tokens[i * L: i * L + L + 1]

    def prefetch(self, indices) -> None:
        """Start reading these windows from disk in the background (memory-mapped shards only)."""
        if isinstance(self.tokens, shards.TokenShards):
            for i in indices:
                self.tokens.prefetch(int(i) * self.seq_len, int(i) * self.seq_len + self.seq_len + 1)

    def get(self, indices):
        import torch

        rows = np.stack([np.asarray(self._window(int(i)), dtype=np.int64) for i in indices])
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
        if self.eot is None:
            return x, y
        return {"input_ids": x, "position_ids": torch.from_numpy(document_positions(rows[:, :-1], self.eot))}, y


def document_positions(ids: np.ndarray, eot: int) -> np.ndarray:
    """Positions that restart at 0 on the token after every end-of-text token (and at each row's start)."""
    B, L = ids.shape
    t = np.broadcast_to(np.arange(L), (B, L))
    starts = np.zeros((B, L), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eot
    return t - np.maximum.accumulate(np.where(starts, t, 0), axis=1)


@dataclass
class SFTRows:
    """Rows of one split, read like ``data.PackedSequences``: ``get(indices)`` returns the model's inputs
    (``input_ids``, ``position_ids``) and the targets."""

    prefix: str
    """``<token dir>/<split>``: ``<prefix>.input_ids.npy``, ``.targets.npy``, ``.position_ids.npy``."""

    def __post_init__(self):
        def load(name: str) -> np.ndarray:
            return np.load(f"{self.prefix}.{name}.npy", mmap_mode="r")

        self.input_ids, self.targets, self.position_ids = load("input_ids"), load("targets"), load("position_ids")
        self.n = len(self.input_ids)

    def __len__(self) -> int:
        return self.n

    def get(self, indices):
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        inputs = {"input_ids": torch.from_numpy(self.input_ids[idx].astype(np.int64)),
                  "position_ids": torch.from_numpy(self.position_ids[idx].astype(np.int64))}
        return inputs, torch.from_numpy(self.targets[idx].astype(np.int64))


def utf8_column(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A column of strings as ``PromptRows`` reads it: one UTF-8 byte buffer (``uint8``) and int64 offsets
    (``n + 1``, row ``i`` is ``buffer[offsets[i]:offsets[i + 1]]``). Each row takes its own bytes: a fixed-width
    ``np.str_`` array pads every row to the longest one at 4 bytes a character (one 100 KB field made each of
    10^6 rows 400 KB)."""
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets


class _Utf8Column:
    """One string column of ``PromptRows`` (``utf8_column``), memory-mapped: a row read decodes its bytes only."""

    def __init__(self, prefix: str, name: str):
        self.bytes = np.load(f"{prefix}.{name}.utf8.npy", mmap_mode="r")
        self.offsets = np.load(f"{prefix}.{name}.offsets.npy", mmap_mode="r")

    def __getitem__(self, i: int) -> str:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.bytes[lo:hi].tobytes().decode("utf-8")


@dataclass
class PromptRows:
    """Prompts of one split (``data=prompts``, ``shardyard.data.prompts``): ``get(indices)`` returns the left-padded
    prompts (``prompt_ids``, ``prompt_mask``) and each row's other fields (a dict per row). Every array is
    memory-mapped; the string columns are read per row (``utf8_column``), never whole."""

    prefix: str
    """``<token dir>/<split>``: ``<prefix>.prompt_ids.npy``, ``.prompt_mask.npy``, and per string column
    (``fields``: a JSON object per row, ``where``) ``.<column>.utf8.npy`` and ``.<column>.offsets.npy``."""

    def __post_init__(self):
        self.prompt_ids = np.load(f"{self.prefix}.prompt_ids.npy", mmap_mode="r")
        self.prompt_mask = np.load(f"{self.prefix}.prompt_mask.npy", mmap_mode="r")
        self._fields, self._where = _Utf8Column(self.prefix, "fields"), _Utf8Column(self.prefix, "where")
        self.n = len(self.prompt_ids)

    def __len__(self) -> int:
        return self.n

    def get(self, indices):
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        inputs = {"prompt_ids": torch.from_numpy(self.prompt_ids[idx].astype(np.int64)),
                  "prompt_mask": torch.from_numpy(self.prompt_mask[idx].astype(np.int64))}
        return inputs, self.fields(idx)

    def fields(self, indices) -> list[dict]:
        """Each row's fields other than the prompt (what the rewards read)."""
        return [json.loads(self._fields[int(i)]) for i in indices]

    def where(self, indices) -> list[str]:
        """Where each row came from: ``file:line`` (``DIR row N`` for a saved dataset), or ``generated:<i>``."""
        return [self._where[int(i)] for i in indices]


def permute(i: np.ndarray, n: int, key: list[int]) -> np.ndarray:
    """A seeded bijection of ``[0, n)`` evaluated per index, with no table (a 100 GB corpus has 10^7-10^8
    windows: a permutation array of them on every rank would be GBs): a 4-round Feistel network on the
    smallest even-bit domain holding ``n``, cycle-walked back into ``[0, n)``."""
    i = np.asarray(i, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(i)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(key).integers(0, 1 << 62, size=4, dtype=np.uint64)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(i)
    while True:  # cycle-walking: at most a few rounds, the domain is under 4n
        outside = out >= np.uint64(n)
        if not outside.any():
            return out.astype(np.int64)
        out[outside] = feistel(out[outside])


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


BLOCK = 4096
"""A mixture's samples come in blocks of this many; in each, every source has its weight's share (rounded by
largest remainder), in a seeded order."""


class Mixture:
    """Several sources' rows drawn by weight. Sample ``k`` -> (source, window) depends on the seed and ``k``
    only: block ``k // BLOCK`` holds each source's share in a seeded order, and the ``j``-th sample of a source
    is window ``permute(j % n, n, [seed, source, j // n])`` (a new order every pass over it).

    ``epochs``: a source may be passed over at most that many times in the run (``total_samples``); its weight
    is lowered to that and the others' raised in proportion (printed at start)."""

    def __init__(self, names: list[str], parts: list, weights: list[float], epochs: list[float | None], seed: int,
                 total_samples: int):
        self.names, self.parts, self.seed = names, parts, seed
        self.sizes = [len(p) for p in parts]
        self.offsets = np.cumsum([0] + self.sizes)  # global sample ids: source offset + window
        self.weights = effective_weights(names, weights, epochs, self.sizes, total_samples)
        self.quota = _capped_quota(self.weights, epochs, self.sizes, total_samples)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if b not in self._blocks:
            labels = np.repeat(np.arange(len(self.parts)), self.quota)
            labels = labels[np.random.default_rng([self.seed, 7919, b]).permutation(BLOCK)]
            rank = np.zeros(BLOCK, dtype=np.int64)  # how many of the same source precede, in this block
            for s in range(len(self.parts)):
                where = labels == s
                rank[where] = np.arange(where.sum())
            if len(self._blocks) > 4:
                self._blocks.clear()
            self._blocks[b] = (labels, rank)
        return self._blocks[b]

    def locate(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, window)`` of every sample index in ``ks``."""
        src = np.empty(len(ks), dtype=np.int64)
        nth = np.empty(len(ks), dtype=np.int64)  # the sample's ordinal among its source's samples
        for i, k in enumerate(ks):
            labels, rank = self._block(int(k) // BLOCK)
            p = int(k) % BLOCK
            src[i], nth[i] = labels[p], (int(k) // BLOCK) * self.quota[labels[p]] + rank[p]
        window = np.empty_like(nth)
        for s in np.unique(src):
            at = src == s
            window[at] = _source_windows(nth[at], self.sizes[s], self.seed, int(s))
        return src, window

    def sample_ids(self, ks: np.ndarray) -> np.ndarray:
        src, window = self.locate(ks)
        return self.offsets[src] + window

    def prefetch(self, ks) -> None:
        src, window = self.locate(np.asarray(ks))
        for s in np.unique(src):
            if hasattr(self.parts[s], "prefetch"):
                self.parts[s].prefetch(window[src == s])

    def get(self, ks):
        import torch

        src, window = self.locate(np.asarray(ks))
        parts = [self.parts[s].get(window[src == s]) for s in range(len(self.parts)) if (src == s).any()]
        order = np.concatenate([np.flatnonzero(src == s) for s in range(len(self.parts)) if (src == s).any()])
        back = torch.from_numpy(np.argsort(order))  # rows in sample order again

        def cat(i):
            first = parts[0][i]
            if isinstance(first, dict):
                return {k: torch.cat([p[i][k] for p in parts])[back] for k in first}
            return torch.cat([p[i] for p in parts])[back]
        return cat(0), cat(1)


def _source_windows(nth: np.ndarray, n: int, seed: int, source: int) -> np.ndarray:
    """The window of a source's ``nth`` sample: pass ``nth // n`` over its ``n`` windows, in that pass's order."""
    out = np.empty_like(nth)
    for epoch in np.unique(nth // n):
        at = nth // n == epoch
        out[at] = permute(nth[at] % n, n, [seed, source, int(epoch)])
    return out


def _largest_remainder(weights: list[float], total: int) -> np.ndarray:
    exact = np.asarray(weights) * total
    quota = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - quota), kind="stable")[: total - quota.sum()]:
        quota[i] += 1
    return quota


def _capped_quota(weights: list[float], epochs: list[float | None], sizes: list[int], total: int) -> np.ndarray:
    """Each source's slots per block: its weight's share by largest remainder, but a capped source never more
    than ``epochs x windows / blocks`` (the run's blocks, the last one counted whole), so rounding up can never
    pass its cap; the freed slots go to the uncapped sources by their weights."""
    quota = _largest_remainder(weights, BLOCK)
    blocks = -(-total // BLOCK)
    limit = np.array([BLOCK if e is None else int(e * n // blocks) for e, n in zip(epochs, sizes)])
    over = quota > limit
    if not over.any():
        return quota
    quota[over] = limit[over]
    free = np.array([e is None and w > 0 for e, w in zip(epochs, weights)])
    if not free.any():
        raise UserError("data.sources", [f"epochs={e}" for e in epochs], "Every source is capped, and the caps, in "
                        f"whole samples per block of {BLOCK}, cannot fill the run's {total:,} samples.",
                        "Leave one source uncapped, raise a cap, or train fewer steps.")
    w = np.where(free, weights, 0.0)
    quota[free] += _largest_remainder(list(w / w.sum()), BLOCK - int(quota.sum()))[free]
    return quota


def effective_weights(names: list[str], weights: list[float], epochs: list[float | None], sizes: list[int],
                      total_samples: int) -> list[float]:
    """The weights normalised to sum 1, with each epochs cap applied: a source drawn more than ``epochs x its
    windows`` times in ``total_samples`` gets exactly that share, and the uncapped ones share the rest by
    their weights. No source can fill the run: exit 2."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    cap = np.asarray([np.inf if e is None else e * n / total_samples for e, n in zip(epochs, sizes)])
    capped = np.zeros(len(w), dtype=bool)
    while True:
        over = (w > cap + 1e-12) & ~capped
        if not over.any():
            return [float(x) for x in w]
        capped |= over
        w[capped] = cap[capped]
        free = ~capped & (w > 0)
        if not free.any():
            can = int(sum(cap[capped] * total_samples))
            raise UserError("data.sources", [f"{n}: epochs={e}" for n, e in zip(names, epochs)],
                            f"The epochs caps let the sources give only {can:,} samples, and the run draws "
                            f"{total_samples:,} (train.steps x train.global_batch_size).",
                            "Raise a source's epochs (or remove its cap), add a source, or train fewer steps.")
        w[free] *= (1 - w[capped].sum()) / w[free].sum()


class _One:
    """A single source's rows in a run: sample ``k`` is window ``permute(k % n, n, [seed, 0, k // n])``."""

    def __init__(self, rows, seed: int):
        self.parts, self.seed, self.names = [rows], seed, ["data"]
        self.weights = [1.0]

    def __len__(self) -> int:
        return len(self.parts[0])

    def sample_ids(self, ks: np.ndarray) -> np.ndarray:
        return _source_windows(np.asarray(ks, dtype=np.int64), len(self.parts[0]), self.seed, 0)

    def prefetch(self, ks) -> None:
        if hasattr(self.parts[0], "prefetch"):
            self.parts[0].prefetch(self.sample_ids(ks))

    def get(self, ks):
        return self.parts[0].get(self.sample_ids(ks))


class TrainStream:
    """Batches for (step, micro-step) on this rank. Step ``s`` holds samples ``[s x G, (s + 1) x G)`` (G: the
    global batch) and rank ``r`` its contiguous share of them, so the data position is the step count: exactly
    resumable at any world size. ``log``: a file to which every micro-batch's sample ids are appended (one JSON
    line each: ``data.log_sample_ids``)."""

    def __init__(self, seqs, seed: int, global_batch: int, micro_batch: int, rank: int, world: int,
                 log: str | None = None):
        self.samples = seqs if isinstance(seqs, Mixture) else _One(seqs, seed)
        if len(self.samples) < global_batch:
            raise UserError("train.global_batch_size", global_batch,
                            f"The training split has only {len(self.samples)} sequences, fewer than one global batch.",
                            "Use a smaller batch or data.seq_len, or more data.")
        self.gb, self.mb, self.rank, self.world = global_batch, micro_batch, rank, world
        self.steps_per_epoch = len(self.samples) // global_batch
        self.log = open(log, "a", buffering=1) if log else None

    def weights(self) -> dict[str, float]:
        """Each source's share of the samples (epochs caps applied), by name."""
        return dict(zip(self.samples.names, self.samples.weights))

    def position(self, step: int) -> dict:
        return {"epoch": step // self.steps_per_epoch, "step_in_epoch": step % self.steps_per_epoch,
                "samples_seen": step * self.gb}

    def indices(self, step: int, micro: int) -> np.ndarray:
        """The run's sample indices of this rank's micro-batch."""
        start = step * self.gb + self.rank * (self.gb // self.world) + micro * self.mb
        return np.arange(start, start + self.mb, dtype=np.int64)

    def micro_batch(self, step: int, micro: int):
        ks = self.indices(step, micro)
        if micro == 0:  # the disk reads of the next step's windows overlap this step's compute
            first = (step + 1) * self.gb + self.rank * (self.gb // self.world)
            self.samples.prefetch(np.arange(first, first + self.gb // self.world, dtype=np.int64))
        if self.log is not None:
            self.log.write(json.dumps({"step": step + 1, "micro": micro, "ids": self.samples.sample_ids(ks).tolist()}) + "\n")
        return self.samples.get(ks)


def eval_batches(seqs, n_batches: int, micro_batch: int, rank: int, world: int):
    """A fixed evaluation set: the first ``n_batches x micro x world`` val sequences, sharded by rank."""
    for b in range(n_batches):
        first = (b * world + rank) * micro_batch
        yield seqs.get([(first + i) % len(seqs) for i in range(micro_batch)])
