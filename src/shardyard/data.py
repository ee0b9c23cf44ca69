"""Corpora -> cached tokenizer + token shards -> packed, mixed, sharded, resumable batches.

Sources: ``data._target_`` builds one document source (the standard library's code, local files of any format
``shardyard.corpus`` reads, your own), or ``data=mixture`` lists several with weights. Each document goes to
train or val by a stable hash of its name, is tokenized (``shardyard.shards``: worker processes, bounded memory,
resumable) and followed by an end-of-text token. Every source has its own cache, keyed by its fingerprint and
the tokenizer: with a given tokenizer (``data.tokenizer.path``, a model's), adding a source to a mixture tokenizes
only that one; a BPE trained on the mixture's text changes (and so re-tokenizes) when its sources do, not when
their weights do.

Training sequences are the non-overlapping ``seq_len + 1`` windows of a source's train stream. Sample ``k`` of
a run (``k = step x global batch + ...``) is a pure function of the seed and ``k``: a seeded block schedule picks
its source (the weights' shares, exact within each block of ``BLOCK`` samples), and a seeded permutation of that
source's windows (a new one each pass over them) picks its window, computed per index with no table. Rank ``r``
reads its contiguous share of a step's samples, split into micro-batches. So the data position is the step
count: a resume at any world size consumes exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Protocol

import numpy as np
from omegaconf import DictConfig, OmegaConf

from shardyard import shards
from shardyard.corpus import JSON_TYPES, KNOWN, Piece, Records, file_format, read_records  # noqa: F401 (sft's)
from shardyard.errors import UserError

EOT = "<|endoftext|>"


# ------------------------------------------------------------------------------------------- documents
class DocumentSource(Protocol):
    """What ``data._target_`` builds: documents in a fixed order, and a fingerprint of their content. A source
    may also have ``pieces()`` (``shardyard.corpus.Piece``: documents handed out in parts) and ``bytes_read()``
    / ``total_bytes()`` (the progress bar)."""

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


class TextFiles:
    """Local files of the formats ``shardyard.corpus`` reads (text, JSONL, JSON, Parquet, Arrow, CSV; text-like
    ones optionally ``.gz``/``.zst``), given as files, directories or glob patterns. A ``.txt`` file is one
    document; every record or row of the others is one, its ``text_field`` or its ``template`` filled in."""

    def __init__(self, paths: list[str], text_field: str = "text", template: str | None = None, key: str = "data"):
        """``key``: where the options live in the config (``data``, ``data.sources[1]``), for error messages."""
        if not paths:
            raise UserError(f"{key}.paths", list(paths), "No input files are given.",
                            f"Use {key}.paths=[/path/to/corpus].")
        self.paths, self.text_field, self.template, self.key = list(paths), text_field, template, key
        # The file list is taken once: caches written under a listed directory later are not documents.
        self._files = input_files(self.paths, key=f"{key}.paths")
        self._fingerprint: str | None = None
        self._done = 0  # bytes of the files read to their end
        self._current: Records | None = None  # the file being read

    def files(self) -> list[Path]:
        return self._files

    def _records(self) -> Iterator[Records]:
        # Names (which decide the train/val split) are relative to the files' common directory: a corpus
        # copied or moved elsewhere keeps its split (absolute paths gave every temp copy another split).
        root = os.path.commonpath([str(p.parent) for p in self.files()])
        self._done = 0
        for p in self.files():
            self._current = records = Records(p, os.path.relpath(p, root), self.text_field, self.template, key=self.key)
            yield records
            self._done += p.stat().st_size
        self._current = None

    def pieces(self) -> Iterator[Piece]:
        for r in self._records():
            yield from r.pieces()

    def documents(self) -> Iterator[tuple[str, str]]:
        """Whole documents (a ``.txt`` file's pieces joined): the tokenizer's training text, user code."""
        parts: list[str] = []
        for piece in self.pieces():
            parts.append(piece.text)
            if piece.last:
                yield piece.name, "".join(parts)
                parts = []

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def bytes_read(self) -> int:
        return self._done + (self._current.bytes_read() if self._current is not None else 0)

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _files_fingerprint(self.files(), f"text|{self.text_field}|{self.template}")
        return self._fingerprint


def input_files(paths: list[str], suffixes: tuple[str, ...] | None = None, key: str = "data.paths") -> list[Path]:
    """The files ``paths`` names (files, directories searched recursively, glob patterns), in a fixed order:
    those ``shardyard.corpus`` reads, or those ending in ``suffixes``. A pattern that matches nothing, a named
    file of another format, an unreadable file, or no file at all is refused (exit 2): a corpus is never
    silently smaller than the user listed, nor replaced."""
    known = "/".join(suffixes) if suffixes else KNOWN

    def readable(p: Path) -> bool:
        return p.suffix in suffixes if suffixes else file_format(p) is not None

    files: list[Path] = []
    for pattern in paths:
        hits = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not hits:
            raise UserError(key, pattern, "Nothing exists at that path or pattern.",
                            f"Give existing {known} files, directories or glob patterns.")
        for hit in hits:
            p = Path(hit)
            if p.is_dir():
                found = _files_under(p, readable)
                if not found:
                    raise UserError(key, hit, f"The directory holds no {known} file (searched recursively).",
                                    f"Put the data there as {known} files, or name the files themselves.")
                files += found
            elif not readable(p):
                raise UserError(key, hit, f"Only {known} files can be read, and this one is not of those "
                                "formats.", "Convert the file, or leave it out of the paths.")
            else:
                files.append(p)
    for p in files:
        if not os.access(p, os.R_OK):
            raise UserError(key, str(p), "The file cannot be read (no read permission).",
                            "Fix its permissions (chmod u+r), or leave it out of the paths.")
    return files


def _files_under(root: Path, readable) -> list[Path]:
    """Readable files under ``root``, less hidden ones and shardyard's own caches (a ``data.cache_dir`` inside
    the corpus holds .json and .bin files that are not documents)."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not os.path.isfile(os.path.join(here, d, MANIFEST))
                   and ".partial-" not in d]
        found += [Path(here, n) for n in names if not n.startswith(".") and readable(Path(n))]
    return sorted(found)


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


def pieces_of(src: DocumentSource) -> Iterator[Piece]:
    if hasattr(src, "pieces"):
        yield from src.pieces()
        return
    for name, text in src.documents():
        yield Piece(name, text, True)


class Source(NamedTuple):
    """One source of a run's data: ``data`` itself, or one entry of ``data.sources`` (``data=mixture``)."""

    name: str
    weight: float
    epochs: float | None
    target: str
    docs: Any  # DocumentSource
    key: str
    """Where its options are in the config (``data``, ``data.sources[0]``)."""


SOURCE_KEYS = ("name", "weight", "epochs")
"""A ``data.sources`` entry's own keys; every other is an argument of its ``_target_``."""


def open_sources(d: DictConfig) -> list[Source]:
    """The run's sources: what ``data._target_`` returns, called with the option's keys less shardyard's own
    (``DataConfig``): one document source, or the list ``mixture`` makes of ``data.sources``."""
    import dataclasses

    from shardyard.config.plugins import build
    from shardyard.config.schema import DataConfig

    made = build(d, own=[f.name for f in dataclasses.fields(DataConfig)])
    if isinstance(made, list) and made and all(isinstance(s, Source) for s in made):
        return made
    return [Source(d._target_.rsplit(".", 1)[-1].lower(), 1.0, None, d._target_, _as_source(made), "data")]


def _as_source(made: Any) -> Any:
    return made if hasattr(made, "documents") and hasattr(made, "fingerprint") else _Iterable(made)


def _check_arguments(key: str, node: DictConfig, own: set[str]) -> None:
    """A source entry's keys against what its ``_target_`` takes: a misspelt or missing one exits 2 naming it."""
    import inspect

    from hydra.utils import get_object

    try:
        params = inspect.signature(get_object(node._target_)).parameters
    except Exception as e:
        raise UserError(f"{key}._target_", node._target_, f"It cannot be imported or inspected ({type(e).__name__}: "
                        f"{e}).", "Check the spelling, and that its package is installed.") from None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for k in map(str, node):
        if k != "_target_" and k not in own and k not in params:
            raise UserError(f"{key}.{k}", node[k], f"{node._target_} takes no such key (it takes "
                            f"{', '.join(sorted(p for p in params if p not in own))}).", "Remove it, or spell one of those.")
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in node and name not in own:
            raise UserError(f"{key}.{name}", None, f"{node._target_} needs it, and the source does not give it.",
                            f"Add it: {key}.{name}=...")


def mixture(sources: list) -> list[Source]:
    """``data=mixture``'s ``_target_``: the sources of ``data.sources``, each built from its own keys (local files
    unless it names a ``_target_``), its name, weight and epochs cap checked."""
    from shardyard.config.plugins import build

    if not sources:
        raise UserError("data.sources", [], "The mixture lists no source.",
                        "Give data.sources=[{name: web, paths: [...], weight: 1.0}, ...].")
    out: list[Source] = []
    for i, e in enumerate(sources):
        key = f"data.sources[{i}]"
        if not isinstance(e, dict):
            raise UserError(key, e, "A source is a mapping of its options.", f"Write {key}={{name: web, paths: [...], "
                            "weight: 1.0}.")
        name = e.get("name")
        if not isinstance(name, str) or not name or name in {s.name for s in out} or "/" in name:
            raise UserError(f"{key}.name", name, "Every source needs a name of its own (it names its eval loss, "
                            "eval/loss/<name>), without `/`.", f"Give {key}.name=<a new name>.")
        weight = e.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 <= weight < float("inf"):
            raise UserError(f"{key}.weight", weight, "A weight is a finite number, 0 or more (its share is weight / "
                            "the sum of weights).", f"Use e.g. {key}.weight=0.3.")
        epochs = e.get("epochs")
        if epochs is not None and (not isinstance(epochs, (int, float)) or not epochs > 0):
            raise UserError(f"{key}.epochs", epochs, "It caps the passes over the source in the run, so it must be "
                            "above 0.", f"Use e.g. {key}.epochs=2, or null for no cap.")
        if isinstance(e.get("paths"), str):
            e = {**e, "paths": [e["paths"]]}  # one path, not its characters
        node = OmegaConf.create({"_target_": "shardyard.data.TextFiles", **e})
        extra = {"key": key} if node._target_ == "shardyard.data.TextFiles" else {}
        _check_arguments(key, node, {*SOURCE_KEYS, *extra})
        docs = _as_source(build(node, own=SOURCE_KEYS, **extra))
        if hasattr(docs, "tokenize_rows"):
            raise UserError(f"{key}._target_", node._target_, "A source that makes its own rows (data=sft) cannot be "
                            "mixed with others.", "Use data=sft on its own.")
        out.append(Source(name, float(weight), None if epochs is None else float(epochs), node._target_, docs, key))
    if sum(s.weight for s in out) <= 0:
        raise UserError("data.sources", [s.weight for s in out], "The weights sum to 0: no source would be read.",
                        "Give at least one source a weight above 0.")
    return out


def open_source(d: DictConfig) -> DocumentSource:
    """The single source of ``data`` (validation's view of a data option that is not a mixture)."""
    return open_sources(d)[0].docs


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


def _publish(tmp: str, final: str, hashes: dict[str, str] | None = None) -> None:
    """Record every file's size and sha256 in the directory's manifest, then make it visible under its final
    name in one rename. ``hashes``: sha256 digests already taken as the files were written (token shards)."""
    hashes = hashes or {}
    files = {name: {"size": os.path.getsize(os.path.join(tmp, name)),
                    "sha256": hashes.get(name) or _sha256(os.path.join(tmp, name))}
             for name in sorted(os.listdir(tmp)) if name != MANIFEST}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"key": os.path.basename(final), "files": files}, f, indent=1)
    if os.path.exists(final):
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)


MANIFEST = "shardyard_cache.json"
"""A cache directory's manifest: its key and every other file's size and sha256, written last before the
directory is published."""

_verified: dict[str, str] = {}
"""Cache directories this process verified, with a digest of their files' (name, size, mtime) then: hashed once
unless a file changes. ``prepare`` hands them to the processes it starts (``VERIFIED_ENV``), so N ranks do not
hash a 100 GB cache N times again."""
VERIFIED_ENV = "SHARDYARD_VERIFIED_CACHES"


def _share_verified() -> None:
    os.environ[VERIFIED_ENV] = json.dumps(_verified)


def _listing(out: str) -> str:
    entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(out))
    return hashlib.sha256(repr(entries).encode()).hexdigest()


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_problem(out: str) -> str | None:
    """Why the cache directory ``out`` cannot be used (missing, no or a broken manifest, a file missing,
    of another size or another sha256), or None when it verifies."""
    try:
        listing = _listing(out)
    except FileNotFoundError:
        return "missing"
    if not _verified and os.environ.get(VERIFIED_ENV):
        with contextlib.suppress(ValueError, TypeError):
            _verified.update({str(k): str(v) for k, v in json.loads(os.environ[VERIFIED_ENV]).items()})
    if _verified.get(out) == listing:
        return None
    try:
        manifest = json.loads(Path(out, MANIFEST).read_text())
        files = {str(name): (int(want["size"]), str(want["sha256"])) for name, want in manifest["files"].items()}
    except FileNotFoundError:
        return "it has no manifest (written by an older shardyard, or by a build that was cut short)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its manifest {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name, (size, digest) in files.items():
        path = os.path.join(out, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, not the {size} it was written with"
        if _sha256(path) != digest:
            return f"{name} does not match the sha256 it was written with"
    _verified[out] = listing
    return None


def _cached(out: str, what: str, build) -> str:
    """The cache directory ``out``, verified against its manifest; built (once per machine, under a file lock)
    when it is missing, and rebuilt, saying so, when it does not verify (never used as it is)."""
    if cache_problem(out) is None:
        return out
    with _locked(out + ".lock"):
        problem = cache_problem(out)  # another process may have built it meanwhile
        if problem is None:
            return out
        if problem != "missing":
            print(f"shardyard | the cached {what} {out} does not verify ({problem}): rebuilding it", flush=True)
            aside = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".corrupt-")
            os.replace(out, os.path.join(aside, "cache"))  # out of the way in one rename, then removed
            shutil.rmtree(aside, ignore_errors=True)
        build(out)
    return out


def _cache_key(target: str, val_fraction: float, fingerprint: str, extra: str) -> str:
    h = hashlib.sha256(f"{target}|{val_fraction}|{fingerprint}|{extra}".encode())
    return f"{target.rsplit('.', 1)[-1].lower()}-{h.hexdigest()[:16]}"


def tokenizer_dir(d: DictConfig, sources: list[Source]) -> str:
    """A byte-level BPE tokenizer trained on the first ``data.tokenizer.train_bytes`` of the train text (of a
    mixture: an equal share of each source's, so that reweighting a mixture keeps its tokenizer and caches)."""
    fingerprint = "|".join(f"{s.target}:{s.docs.fingerprint()}" for s in sources)
    target = sources[0].target if len(sources) == 1 else "mixture"
    key = _cache_key(target, d.val_fraction, fingerprint, f"bpe|{d.tokenizer.vocab_size}|{d.tokenizer.train_bytes}")
    out = os.path.join(d.cache_dir, "tokenizers", f"{key}-bpe{d.tokenizer.vocab_size}")
    return _cached(out, "tokenizer", lambda out: _train_tokenizer(d, sources, out))


def _train_tokenizer(d: DictConfig, sources: list[Source], out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    print(f"shardyard | training a byte-level BPE tokenizer (vocab {d.tokenizer.vocab_size}) -> {out}", flush=True)

    def texts():
        for s in sources:
            budget = d.tokenizer.train_bytes / len(sources)
            for piece in pieces_of(s.docs):  # pieces: a huge .txt file is not joined whole
                if budget <= 0:
                    break  # the rest of the corpus is not read
                if not is_val(piece.name, d.val_fraction):
                    budget -= len(piece.text)
                    yield piece.text

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


SHARDS_FORMAT = "shards-v1"
"""``meta.json``'s ``format`` of a token cache written as shards (``shardyard.shards``)."""


def token_dir(d: DictConfig, s: Source, tok_dir: str) -> str:
    tok_hash = hashlib.sha256(Path(tok_dir, "tokenizer.json").read_bytes()).hexdigest()[:12]
    rows = hasattr(s.docs, "tokenize_rows")
    if rows:  # SFT rows depend on the row length and on the tokenizer's chat template and special tokens
        extra = b"".join(Path(tok_dir, f).read_bytes() for f in ("tokenizer_config.json", "chat_template.jinja",
                                                                "special_tokens_map.json") if Path(tok_dir, f).is_file())
        tok_hash += f"|rows-v2|{d.seq_len}|" + hashlib.sha256(extra).hexdigest()[:8]  # v2: one .npy per array
    else:
        tok_hash += f"|{SHARDS_FORMAT}"
    out = os.path.join(d.cache_dir, "tokens", _cache_key(s.target, d.val_fraction, s.docs.fingerprint(), f"tok|{tok_hash}"))
    if rows:
        return _cached(out, "token arrays", lambda out: _tokenize_rows(d, s.docs, tok_dir, out))
    return _cached(out, "token shards", lambda out: _tokenize(d, s, tok_dir, out))


def num_proc(d: DictConfig) -> int:
    """``data.num_proc``, or the cores this process may use."""
    n = d.num_proc if d.num_proc is not None else len(os.sched_getaffinity(0))
    if not isinstance(n, int) or n < 1:
        raise UserError("data.num_proc", n, "Tokenization needs at least one process.",
                        "Use data.num_proc=1 or more, or null for one per core.")
    return n


def _tokenize(d: DictConfig, s: Source, tok_dir: str, out: str) -> None:
    """Token shards of ``s`` (``shardyard.shards.build``), built in ``<out>.partial`` (kept when the build is
    killed, and resumed), then published under ``out`` with every file's size and sha256."""
    tok = load_tokenizer(tok_dir)
    dtype = "uint16" if len(tok) <= 1 << 16 else "uint32"
    itemsize = np.dtype(dtype).itemsize
    opt = shards.BuildOptions(
        tokenizer_file=os.path.join(tok_dir, "tokenizer.json"), eot=tok.eos_token_id, dtype=dtype,
        is_val=lambda name: is_val(name, d.val_fraction), num_proc=num_proc(d), buffer_bytes=d.buffer_mb << 20,
        shard_tokens=max(1, (d.shard_mb << 20) // itemsize), label=s.name)
    # One partial build per machine: flock is not cluster-wide on every shared file system, so two nodes never
    # write one directory; a killed build resumes on its own machine, and the first to publish wins.
    partial = f"{out}.partial-{socket.gethostname()}"
    built = shards.build(pieces_of(s.docs), partial, opt, total_bytes=getattr(s.docs, "total_bytes", lambda: None)(),
                         bytes_read=getattr(s.docs, "bytes_read", None))
    os.remove(os.path.join(partial, shards.PROGRESS))
    with open(os.path.join(partial, "meta.json"), "w") as f:
        json.dump({"format": SHARDS_FORMAT, "dtype": dtype, **built, "tokenizer": tok_dir, "vocab_size": len(tok),
                   "eot": tok.eos_token_id}, f, indent=1)
    _publish(partial, out, hashes={sh["file"]: sh["sha256"] for split in built["shards"].values() for sh in split})


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


def has_tokenizer(path: str) -> bool:
    """A fast HF tokenizer is there: its ``tokenizer.json`` (what every cache key and load reads)."""
    return os.path.isfile(os.path.join(os.path.expanduser(path), "tokenizer.json"))


def tokenizer_source(cfg: DictConfig) -> tuple[str, str] | None:
    """``(key, directory)`` of the tokenizer to use as is: ``data.tokenizer.path``, else the model directory's
    own (``model=hf``), else None (train a BPE tokenizer on the data)."""
    if cfg.data.tokenizer.path is not None:
        return "data.tokenizer.path", cfg.data.tokenizer.path
    for key in ("path", "weights"):  # a pretrained model brings its tokenizer
        model_dir = cfg.model.get(key)
        if isinstance(model_dir, str) and model_dir != "auto":
            model_dir = os.path.expanduser(model_dir)
            if os.path.isdir(model_dir) and has_tokenizer(model_dir):
                return f"model.{key}", model_dir
    return None


def tokenizer_path(cfg: DictConfig) -> str | None:
    found = tokenizer_source(cfg)
    return found[1] if found else None


def check_tokenizer(key: str, path: str) -> None:
    """The user's tokenizer directory holds a ``tokenizer.json`` that loads (a truncated or foreign file exits 2
    at validation, not as a traceback in the data build)."""
    from tokenizers import Tokenizer

    file = os.path.join(os.path.expanduser(path), "tokenizer.json")
    if not os.path.isfile(file):
        raise UserError(key, path, "No fast HF tokenizer (tokenizer.json) is in that directory.",
                        "Point it at a directory written by a tokenizer's save_pretrained (a slow, sentencepiece-only "
                        "tokenizer can be converted once: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR2)), "
                        "or set data.tokenizer.path=null to train a BPE tokenizer on the data.")
    try:
        Tokenizer.from_file(file)
    except Exception as e:  # the Rust parser's error: truncated JSON, an unknown model type, ...
        raise UserError(key, path, f"Its tokenizer.json cannot be loaded ({str(e).splitlines()[0][:200]}).",
                        "Copy the tokenizer files again (a truncated copy is the usual cause), or write them anew "
                        "with the tokenizer's save_pretrained(DIR).") from None


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
    """The rows of one source's ``split``: packed text windows (``PackedSequences``) or a source's own rows
    (``SFTRows``)."""
    tdir = prepared.parts[part].token_dir if prepared.parts else prepared.token_dir
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
