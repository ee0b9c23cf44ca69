"""Corpora -> cached tokenizer + token arrays -> packed, sharded, resumable batches.

Documents come in a fixed order; each is assigned to train or val by a stable hash of its name, then
tokenized and concatenated with an end-of-text token after each. Training sequences are the
non-overlapping ``seq_len + 1`` windows of the train stream; every epoch visits them in a seeded
permutation. Optimizer step ``s`` consumes permutation slots ``[s*G, (s+1)*G)`` (G = global batch), and
rank ``r`` reads its contiguous share of them, split into micro-batches. So the data position is a pure
function of the step count and the global batch: resuming is exact.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import numpy as np
from omegaconf import DictConfig

from shardyard.errors import UserError

EOT = "<|endoftext|>"


# ------------------------------------------------------------------------------------------- documents
class DocumentSource(Protocol):
    """What ``data._target_`` builds: documents in a fixed order, and a fingerprint of their content."""

    def documents(self) -> Iterable[tuple[str, str]]:
        """``(stable name, text)`` for every document, always in the same order. The name decides the
        train/val split (a stable hash), so it must not change between runs."""

    def fingerprint(self) -> str:
        """Changes whenever the documents do: the key of the tokenizer and token caches."""


class StdlibCode:
    """The running interpreter's standard-library ``.py`` files (about 12 MB of real code, always present)."""

    def __init__(self, exclude_dirs: list[str]):
        self.exclude_dirs = list(exclude_dirs)
        self._files: list[Path] | None = None
        self._fingerprint: str | None = None

    def files(self) -> list[Path]:
        if self._files is None:
            root = sysconfig.get_paths()["stdlib"]
            excluded, found = set(self.exclude_dirs), []
            for here, dirs, names in os.walk(root):
                dirs[:] = [d for d in dirs if d not in excluded]  # pruned: site-packages alone is ~50k entries
                found += [Path(here, n) for n in names if n.endswith(".py")]
            self._files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
        return self._files

    def documents(self) -> Iterator[tuple[str, str]]:
        for p in self.files():
            yield p.name + ":" + str(p.stat().st_size), p.read_text(encoding="utf-8", errors="replace")

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _files_fingerprint(self.files(), f"stdlib|{sys.version_info[:2]}")
        return self._fingerprint


SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


class TextFiles:
    """Local ``.txt`` files (one document each), ``.jsonl``/``.json`` and ``.parquet`` files (one document per
    row, from ``text_field``), given as files, directories or glob patterns."""

    def __init__(self, paths: list[str], text_field: str = "text"):
        if not paths:
            raise UserError("data.paths", list(paths), "No input files are given.", "Use data.paths=[/path/to/corpus].")
        self.paths, self.text_field = list(paths), text_field
        for pattern in self.paths:
            if not glob.glob(os.path.expanduser(pattern), recursive=True):
                raise UserError("data.paths", pattern, "Nothing exists at that path or pattern.",
                                "Give existing .txt/.jsonl/.parquet files, directories or glob patterns.")
        # The file list is taken once: caches written under a listed directory later are not documents.
        self._files: list[Path] = []
        self._fingerprint: str | None = None
        for pattern in self.paths:
            for hit in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)):
                p = Path(hit)
                self._files += sorted(q for q in p.rglob("*") if q.suffix in SUFFIXES) if p.is_dir() else [p]
        bad = [str(p) for p in self._files if p.suffix not in SUFFIXES]
        if bad:
            raise UserError("data.paths", bad[0], "Only .txt, .jsonl/.json and .parquet files can be read.",
                            "Convert the file or leave it out of data.paths.")
        if not self._files:
            raise UserError("data.paths", self.paths, "The corpus has no input files.",
                            "Give existing .txt/.jsonl/.parquet files.")

    def files(self) -> list[Path]:
        return self._files

    def documents(self) -> Iterator[tuple[str, str]]:
        # Names (which decide the train/val split) are relative to the files' common directory: a corpus
        # copied or moved elsewhere keeps its split (absolute paths gave every temp copy another split).
        root = os.path.commonpath([str(p.parent) for p in self.files()])
        for p in self.files():
            name = os.path.relpath(p, root)
            if p.suffix == ".txt":
                yield name, p.read_text(encoding="utf-8", errors="replace")
                continue
            import datasets  # lazy: heavy

            datasets.disable_progress_bars()
            kind = "parquet" if p.suffix == ".parquet" else "json"
            ds = datasets.load_dataset(kind, data_files=str(p), split="train")
            if self.text_field not in ds.column_names:
                raise UserError("data.text_field", self.text_field, f"{p} has no such column (it has {ds.column_names}).",
                                f"Use data.text_field=<one of {ds.column_names}>.")
            for i, text in enumerate(ds[self.text_field]):
                yield f"{name}:{i}", text or ""

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _files_fingerprint(self.files(), f"text|{self.text_field}")
        return self._fingerprint


class _Iterable:
    """A user's source that returns a plain iterable of texts or ``(name, text)`` pairs: read once, named by
    position, fingerprinted by content."""

    def __init__(self, items: Iterable):
        self.docs = [(d if isinstance(d, tuple) else (str(i), d)) for i, d in enumerate(items)]

    def documents(self) -> list[tuple[str, str]]:
        return self.docs

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, text in self.docs:
            h.update(f"{name}\0{text}\0".encode())
        return h.hexdigest()[:16]


def _files_fingerprint(files: list[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for p in files:
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def open_source(d: DictConfig) -> DocumentSource:
    """``data._target_`` called with the option's keys, less shardyard's own (``DataConfig``)."""
    import dataclasses

    from shardyard.config.plugins import build
    from shardyard.config.schema import DataConfig

    built = build(d, own=[f.name for f in dataclasses.fields(DataConfig)])
    return built if hasattr(built, "documents") and hasattr(built, "fingerprint") else _Iterable(built)


def is_val(name: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little")
    return (h % 1_000_000) < val_fraction * 1_000_000


# ----------------------------------------------------------------------------------------------- cache
@contextlib.contextmanager
def _locked(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # one builder per machine; the others wait, then read its result
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: str, final: str) -> None:
    """Make a fully written directory visible under its final name in one rename."""
    if os.path.exists(final):
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)


def _cache_key(d: DictConfig, src: DocumentSource, extra: str) -> str:
    h = hashlib.sha256(f"{d._target_}|{d.val_fraction}|{src.fingerprint()}|{extra}".encode())
    return f"{d._target_.rsplit('.', 1)[-1].lower()}-{h.hexdigest()[:16]}"


def tokenizer_dir(d: DictConfig, src: DocumentSource) -> str:
    key = _cache_key(d, src, f"bpe|{d.tokenizer.vocab_size}|{d.tokenizer.train_bytes}")
    out = os.path.join(d.cache_dir, "tokenizers", f"{key}-bpe{d.tokenizer.vocab_size}")
    if os.path.exists(out):
        return out
    with _locked(out + ".lock"):
        if not os.path.exists(out):
            _train_tokenizer(d, src, out)
    return out


def _train_tokenizer(d: DictConfig, src: DocumentSource, out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    print(f"shardyard | training a byte-level BPE tokenizer (vocab {d.tokenizer.vocab_size}) -> {out}", flush=True)

    def texts():
        budget = d.tokenizer.train_bytes
        for name, text in src.documents():
            if budget <= 0 or is_val(name, d.val_fraction):
                continue
            budget -= len(text)
            yield text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=d.tokenizer.vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".tmp-tok-")
    fast.save_pretrained(tmp)
    _publish(tmp, out)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def token_dir(d: DictConfig, src: DocumentSource, tok_dir: str) -> str:
    tok_hash = hashlib.sha256(Path(tok_dir, "tokenizer.json").read_bytes()).hexdigest()[:12]
    rows = hasattr(src, "tokenize_rows")
    if rows:  # SFT rows depend on the row length and on the tokenizer's chat template and special tokens
        extra = b"".join(Path(tok_dir, f).read_bytes() for f in ("tokenizer_config.json", "chat_template.jinja",
                                                                "special_tokens_map.json") if Path(tok_dir, f).is_file())
        tok_hash += f"|rows-v2|{d.seq_len}|" + hashlib.sha256(extra).hexdigest()[:8]  # v2: one .npy per array
    out = os.path.join(d.cache_dir, "tokens", _cache_key(d, src, f"tok|{tok_hash}"))
    if os.path.exists(out):
        return out
    with _locked(out + ".lock"):
        if not os.path.exists(out):
            (_tokenize_rows if rows else _tokenize)(d, src, tok_dir, out)
    return out


def _tokenize_rows(d: DictConfig, src, tok_dir: str, out: str) -> None:
    """A source that makes its own rows (``data=sft``: labels and positions per token): ``<split>.<array>.npy``
    for the train and val splits, and the counts it reports (conversations, truncated, dropped, label tokens)."""
    tok = load_tokenizer(tok_dir)
    built = src.tokenize_rows(tok, d.seq_len, lambda name: is_val(name, d.val_fraction))
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".tmp-tokens-")
    for split in ("train", "val"):
        for name, array in built[split].items():  # one .npy per array: every rank memory-maps them
            np.save(os.path.join(tmp, f"{split}.{name}.npy"), array)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"rows": {s: int(len(built[s]["input_ids"])) for s in ("train", "val")}, "stats": built["stats"],
                   "tokenizer": tok_dir, "vocab_size": len(tok)}, f, indent=1)
    _publish(tmp, out)


def _tokenize(d: DictConfig, src: DocumentSource, tok_dir: str, out: str) -> None:
    tok = load_tokenizer(tok_dir)
    eot = tok.eos_token_id
    dtype = np.uint16 if len(tok) <= 1 << 16 else np.uint32
    streams: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    batch: list[tuple[str, str]] = []

    def flush():
        enc = tok([t for _, t in batch], add_special_tokens=False)["input_ids"]
        for (name, _), ids in zip(batch, enc):
            split = "val" if is_val(name, d.val_fraction) else "train"
            streams[split].append(np.asarray(ids + [eot], dtype=dtype))
            counts[split] += 1
        batch.clear()

    for doc in src.documents():
        batch.append(doc)
        if len(batch) == 256:
            flush()
    flush()
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".tmp-tokens-")
    for split, parts in streams.items():
        np.save(os.path.join(tmp, f"{split}.npy"), np.concatenate(parts) if parts else np.zeros(0, dtype))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"documents": counts, "tokens": {k: int(sum(map(len, v))) for k, v in streams.items()},
                   "tokenizer": tok_dir, "vocab_size": len(tok)}, f, indent=1)
    _publish(tmp, out)


@dataclass(frozen=True)
class Prepared:
    tokenizer_dir: str
    token_dir: str
    vocab_size: int
    stats: dict | None = None
    """What a source that makes its own rows reports (``data=sft``: conversations, truncated, dropped)."""


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def tokenizer_path(cfg: DictConfig) -> str | None:
    """The tokenizer to use as is: ``data.tokenizer.path``, else the model directory's own (``model=hf``), else
    None (train a BPE tokenizer on the data)."""
    if cfg.data.tokenizer.path is not None:
        return cfg.data.tokenizer.path
    for model_dir in (cfg.model.get("path"), cfg.model.get("weights")):  # a pretrained model brings its tokenizer
        if isinstance(model_dir, str) and model_dir != "auto":
            model_dir = os.path.expanduser(model_dir)
            if os.path.isdir(model_dir) and has_tokenizer(model_dir):
                return model_dir
    return None


def prepare(cfg: DictConfig, embedding_rows: int | None = None) -> Prepared:
    """Build (or find) the tokenizer and token caches; safe to call from many processes at once.
    ``embedding_rows``: the model's input embedding size, checked against the tokenizer."""
    d = cfg.data
    src = open_source(d)
    tok_dir = tokenizer_path(cfg) or tokenizer_dir(d, src)
    tdir = token_dir(d, src, tok_dir)
    meta = json.loads(Path(tdir, "meta.json").read_text())
    if embedding_rows is not None and meta["vocab_size"] > embedding_rows:
        key = "model.vocab_size" if "vocab_size" in cfg.model else "data.tokenizer.path"
        raise UserError(key, cfg.model.get("vocab_size", tok_dir),
                        f"The tokenizer ({tok_dir}) has {meta['vocab_size']} tokens, more than the model's "
                        f"{embedding_rows} embedding rows.",
                        f"Use model.vocab_size>={meta['vocab_size']}, a smaller data.tokenizer.vocab_size, or the "
                        "model's own tokenizer.")
    for split in ("train", "val"):
        if "rows" in meta and meta["rows"][split] < 1:
            raise UserError("data.val_fraction" if split == "val" else "data.paths", d.get(
                "val_fraction" if split == "val" else "paths"), f"The {split} split has no conversation.",
                "Give more conversations, or another data.val_fraction.")
        if "tokens" in meta and meta["tokens"][split] < d.seq_len + 1:
            raise UserError("data.seq_len", d.seq_len, f"The {split} split has only {meta['tokens'][split]} tokens, "
                            "less than one sequence.", "Use more data, a shorter data.seq_len or another data.val_fraction.")
    return Prepared(tok_dir, tdir, meta["vocab_size"], meta.get("stats"))


def open_split(prepared: Prepared, split: str, seq_len: int):
    """The rows of ``split``: packed text windows (``PackedSequences``) or a source's own rows (``SFTRows``)."""
    if os.path.exists(os.path.join(prepared.token_dir, f"{split}.input_ids.npy")):
        from shardyard.sft import SFTRows

        return SFTRows(os.path.join(prepared.token_dir, split))
    return PackedSequences(os.path.join(prepared.token_dir, f"{split}.npy"), seq_len)


# --------------------------------------------------------------------------------------------- batches
class PackedSequences:
    """Non-overlapping ``seq_len + 1`` windows over one memory-mapped token stream."""

    def __init__(self, path: str, seq_len: int):
        self.tokens = np.load(path, mmap_mode="r")
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def get(self, indices):
        import torch

        L = self.seq_len
        rows = torch.from_numpy(np.stack([np.asarray(self.tokens[i * L: i * L + L + 1], dtype=np.int64)
                                          for i in indices]))
        return rows[:, :-1], rows[:, 1:]


class TrainStream:
    """Batches for (step, micro-step) on this rank; data state is the step count (exactly resumable)."""

    def __init__(self, seqs: PackedSequences, seed: int, global_batch: int, micro_batch: int, rank: int, world: int):
        if len(seqs) < global_batch:
            raise UserError("train.global_batch_size", global_batch,
                            f"The training split has only {len(seqs)} sequences, fewer than one global batch.",
                            "Use a smaller batch or data.seq_len, or more data.")
        self.seqs, self.seed, self.gb, self.mb, self.rank, self.world = seqs, seed, global_batch, micro_batch, rank, world
        self.steps_per_epoch = len(seqs) // global_batch
        self._perm_epoch, self._perm = -1, np.arange(0)

    def position(self, step: int) -> dict:
        return {"epoch": step // self.steps_per_epoch, "step_in_epoch": step % self.steps_per_epoch,
                "samples_seen": step * self.gb}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))
            self._perm_epoch = epoch
        return self._perm

    def micro_batch(self, step: int, micro: int):
        pos = self.position(step)
        perm = self._permutation(pos["epoch"])
        start = pos["step_in_epoch"] * self.gb + self.rank * (self.gb // self.world) + micro * self.mb
        return self.seqs.get(perm[start: start + self.mb])


def eval_batches(seqs: PackedSequences, n_batches: int, micro_batch: int, rank: int, world: int):
    """A fixed evaluation set: the first ``n_batches x micro x world`` val sequences, sharded by rank."""
    for b in range(n_batches):
        first = (b * world + rank) * micro_batch
        yield seqs.get([(first + i) % len(seqs) for i in range(micro_batch)])
