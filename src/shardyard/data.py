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
        # The file list is taken once: caches written under a listed directory later are not documents.
        self._files = input_files(self.paths, SUFFIXES)
        self._fingerprint: str | None = None

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
            if p.suffix == ".parquet":
                yield from self._parquet(p, name)
                continue
            for i, (_, line, record) in enumerate(read_records(p)):
                text = record.get(self.text_field)
                if not isinstance(text, str):
                    problem = "has no" if self.text_field not in record else f"has {JSON_TYPES.get(type(text))} in its"
                    raise UserError("data.text_field", self.text_field, f"The record at {p}:{line} {problem} "
                                    f"`{self.text_field}` field (its keys: {sorted(record)}); every record needs its "
                                    "text there as a string.", "Correct or remove that record, or name the field that holds "
                                    "the text: data.text_field=<key>.")
                yield f"{name}:{i}", text

    def _parquet(self, p: Path, name: str) -> Iterator[tuple[str, str]]:
        import datasets  # lazy: heavy

        datasets.disable_progress_bars()
        ds = datasets.load_dataset("parquet", data_files=str(p), split="train")
        if self.text_field not in ds.column_names:
            raise UserError("data.text_field", self.text_field, f"{p} has no such column (it has {ds.column_names}).",
                            f"Use data.text_field=<one of {ds.column_names}>.")
        for i, text in enumerate(ds[self.text_field]):
            if not isinstance(text, str):  # a null, or a column of another type
                raise UserError("data.text_field", self.text_field, f"Row {i} of {p} has a {type(text).__name__} in "
                                "that column, not a text.", "Correct or remove that row, or name the column that holds "
                                "the text: data.text_field=<column>.")
            yield f"{name}:{i}", text

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _files_fingerprint(self.files(), f"text|{self.text_field}")
        return self._fingerprint


def input_files(paths: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    """The files ``data.paths`` names (files, directories searched recursively, glob patterns), in a fixed
    order. A pattern that matches nothing, a named file of another format, an unreadable file, or no file at
    all is refused (exit 2): a corpus is never silently smaller than the user listed, nor replaced."""
    known = "/".join(suffixes)
    files: list[Path] = []
    for pattern in paths:
        hits = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not hits:
            raise UserError("data.paths", pattern, "Nothing exists at that path or pattern.",
                            f"Give existing {known} files, directories or glob patterns.")
        for hit in hits:
            p = Path(hit)
            if p.is_dir():
                found = _files_under(p, suffixes)
                if not found:
                    raise UserError("data.paths", hit, f"The directory holds no {known} file (searched recursively).",
                                    f"Put the data there as {known} files, or name the files themselves.")
                files += found
            elif p.suffix not in suffixes:
                raise UserError("data.paths", hit, f"Only {known} files can be read, and this one is not of those "
                                "formats.", "Convert the file, or leave it out of data.paths.")
            else:
                files.append(p)
    for p in files:
        if not os.access(p, os.R_OK):
            raise UserError("data.paths", str(p), "The file cannot be read (no read permission).",
                            "Fix its permissions (chmod u+r), or leave it out of data.paths.")
    return files


def _files_under(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files of these formats under ``root``, less hidden ones and shardyard's own caches (a ``data.cache_dir``
    inside the corpus holds .json files that are not documents)."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not os.path.isfile(os.path.join(here, d, MANIFEST))]
        found += [Path(here, n) for n in names if not n.startswith(".") and Path(n).suffix in suffixes]
    return sorted(found)


def read_records(path: Path) -> Iterator[tuple[int, int, dict]]:
    """``(ordinal, line, record)`` for every JSON object of a ``.jsonl`` file (one object per line) or a ``.json``
    file (a JSON array of objects, or one object per line). The ordinal is the 0-based line of a line-per-record
    file and the element index of an array. Anything else (a line that is not JSON, a value that is not an
    object, text that is not UTF-8) exits 2 naming the file and line: a file is read whole or refused."""
    try:
        if path.suffix == ".json":
            text = path.read_text(encoding="utf-8")
            if text.lstrip().startswith("["):
                yield from _array_records(path, text)
                return
            lines: Iterable[str] = text.splitlines()
        else:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise UserError("data.paths", str(path), f"The file is not UTF-8 text ({e.reason} at byte {e.start}).",
                        "Convert it to UTF-8 (iconv -t utf-8), or leave it out of data.paths.") from None
    for i, line in enumerate(lines):
        if line.strip():
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError("data.paths", f"{path}:{i + 1}", f"The line is not JSON ({e.msg}, column {e.colno}).",
                                "Correct or remove that line: each line holds one JSON object.") from None
            yield i, i + 1, _record(value, path, i + 1)


def _array_records(path: Path, text: str) -> Iterator[tuple[int, int, dict]]:
    """The elements of a ``.json`` file holding one array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    pos, line, seen = 0, 1, 0  # line = the line of text[seen]

    def line_at(i: int) -> int:
        nonlocal line, seen
        line, seen = line + text.count("\n", seen, i), i
        return line

    def skip(i: int) -> int:  # past JSON whitespace
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def refuse(i: int, problem: str):
        return UserError("data.paths", f"{path}:{line_at(i)}", problem, "Correct the file: a .json file holds one array "
                         "of JSON objects, [{...}, {...}], or one object per line.")

    pos = skip(text.index("[") + 1)
    index = 0
    while pos < len(text) and text[pos] != "]":
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise refuse(e.pos, f"The array's element {index} is not JSON ({e.msg}).") from None
        yield index, line_at(pos), _record(value, path, line_at(pos))
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos, index = skip(pos + 1), index + 1
        elif pos >= len(text) or text[pos] != "]":
            raise refuse(pos, f"A `,` or the closing `]` is missing after the array's element {index}.")
    if pos >= len(text) or text[pos + 1:].strip():
        raise refuse(min(pos, len(text)), "The array is not closed by `]`, or text follows it.")


JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


def _record(value, path: Path, line: int) -> dict:
    if not isinstance(value, dict):
        raise UserError("data.paths", f"{path}:{line}", f"The record is {JSON_TYPES.get(type(value), 'no object')}, "
                        "not a JSON object ({...}).", "Correct or remove it: every record is a JSON object with named fields.")
    return value


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
    """Record every file's size and sha256 in the directory's manifest, then make it visible under its final
    name in one rename."""
    files = {name: {"size": os.path.getsize(os.path.join(tmp, name)), "sha256": _sha256(os.path.join(tmp, name))}
             for name in sorted(os.listdir(tmp))}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"key": os.path.basename(final), "files": files}, f, indent=1)
    if os.path.exists(final):
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)


MANIFEST = "shardyard_cache.json"
"""A cache directory's manifest: its key and every other file's size and sha256, written last before the
directory is published."""

_verified: dict[str, list] = {}
"""Cache directories this process verified, with their files' (name, size, mtime) then: hashed once per process
unless a file changes."""


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_problem(out: str) -> str | None:
    """Why the cache directory ``out`` cannot be used (missing, no or a broken manifest, a file missing,
    of another size or another sha256), or None when it verifies."""
    try:
        listing = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(out))
    except FileNotFoundError:
        return "missing"
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


def _cache_key(d: DictConfig, src: DocumentSource, extra: str) -> str:
    h = hashlib.sha256(f"{d._target_}|{d.val_fraction}|{src.fingerprint()}|{extra}".encode())
    return f"{d._target_.rsplit('.', 1)[-1].lower()}-{h.hexdigest()[:16]}"


def tokenizer_dir(d: DictConfig, src: DocumentSource) -> str:
    key = _cache_key(d, src, f"bpe|{d.tokenizer.vocab_size}|{d.tokenizer.train_bytes}")
    out = os.path.join(d.cache_dir, "tokenizers", f"{key}-bpe{d.tokenizer.vocab_size}")
    return _cached(out, "tokenizer", lambda out: _train_tokenizer(d, src, out))


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
    return _cached(out, "token arrays", lambda out: (_tokenize_rows if rows else _tokenize)(d, src, tok_dir, out))


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
