"""Document sources: where a run's text comes from, before any tokenizer sees it.

``data._target_`` builds one source (the standard library's code, local files of any format ``shardyard.data.corpus``
reads, your own), or ``data=mixture`` lists several with weights (``mixture``). A source hands out its documents
in a fixed order, each under a stable name (which decides the train/val split, ``is_val``), and a fingerprint
of their content (the key of the tokenizer and token caches). The public names are importable from
``shardyard.data.pipeline`` too, and the ``_target_`` strings stay ``shardyard.data.pipeline.*`` (they are part of every cache key).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Protocol

from omegaconf import DictConfig, OmegaConf

from shardyard.data.corpus import HELD_OUT, KNOWN, TRAINING, Piece, Records, file_format, path_bytes, saved_dataset
from shardyard.core.errors import UserError
from shardyard.data.shards import MANIFEST


class DocumentSource(Protocol):
    """What ``data._target_`` builds: documents in a fixed order, and a fingerprint of their content. A source
    may also have ``pieces()`` (``shardyard.data.corpus.Piece``: documents handed out in parts) and ``bytes_read()``
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
    """Local files of the formats ``shardyard.data.corpus`` reads (text, JSONL, JSON, Parquet, Arrow, CSV; text-like
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
            self._done += path_bytes(p)
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
        return sum(path_bytes(p) for p in self.files())

    def bytes_read(self) -> int:
        return self._done + (self._current.bytes_read() if self._current is not None else 0)

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _files_fingerprint(self.files(), f"text|{self.text_field}|{self.template}")
        return self._fingerprint


def input_files(paths: list[str], suffixes: tuple[str, ...] | None = None, key: str = "data.paths") -> list[Path]:
    """The files ``paths`` names (files, directories searched recursively, glob patterns), in a fixed order:
    those ``shardyard.data.corpus`` reads, or those ending in ``suffixes``; and directories written by HF
    ``datasets``' ``save_to_disk`` (named, or found under a named directory), each one entry. A pattern that matches nothing, a named
    file of another format, an unreadable file, or no file at all is refused (exit 2): a corpus is never
    silently smaller than the user listed, nor replaced."""
    known = "/".join(suffixes) if suffixes else KNOWN

    def readable(p: Path) -> bool:
        if p.is_dir():
            return saved_dataset(p) is not None
        return p.suffix in suffixes if suffixes else file_format(p) is not None

    known += " files or save_to_disk directories"

    files: list[Path] = []
    for pattern in paths:
        hits = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not hits:
            raise UserError(key, pattern, "Nothing exists at that path or pattern.",
                            f"Give existing {known}, directories or glob patterns.")
        for hit in hits:
            p = Path(hit)
            if p.is_dir():
                refuse_partial_save(p, key)
            if p.is_dir() and not readable(p):
                found = _files_under(p, readable, key)
                if not found:
                    raise UserError(key, hit, f"The directory holds no {known} (searched recursively).",
                                    f"Put the data there as {known}, or name the files themselves.")
                files += found
            elif not readable(p):
                raise UserError(key, hit, f"Only {known} can be read, and this one is not of those "
                                "formats.", "Convert the file, or leave it out of the paths.")
            else:
                files.append(p)
    for p in files:
        if not os.access(p, os.R_OK):
            raise UserError(key, str(p), "The file cannot be read (no read permission).",
                            "Fix its permissions (chmod u+r), or leave it out of the paths.")
    return files


SAVED_MARKERS = ("dataset_info.json", "state.json")
"""The files HF ``datasets``' ``Dataset.save_to_disk`` writes beside its Arrow files; ``load_from_disk`` reads
both (``DatasetDict.save_to_disk`` writes ``dataset_dict.json`` and one such directory per split)."""


def partial_save(path: Path) -> tuple[Path, str] | None:
    """A directory written by ``save_to_disk`` that ``load_from_disk`` cannot read, as ``(the file at fault, why)``;
    None for a whole one, or a directory that holds no sign of ``save_to_disk`` (a ``dataset_dict.json``, a
    ``dataset_info.json``, or a ``state.json`` listing ``_data_files``)."""
    import json

    def read(f: Path) -> Any:
        try:
            return json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    if (path / "dataset_dict.json").is_file():
        saved = read(path / "dataset_dict.json")
        splits = saved.get("splits") if isinstance(saved, dict) else None
        if not isinstance(splits, list):
            return path / "dataset_dict.json", "it is not the JSON DatasetDict.save_to_disk writes (no \"splits\" list)"
        for split in splits:
            if not (path / str(split)).is_dir():
                return path / str(split), "the split directory dataset_dict.json lists is not there"
            bad = partial_save(path / str(split)) or (None if saved_dataset(path / str(split)) else (
                path / str(split) / SAVED_MARKERS[0], "it is not there"))
            if bad:
                return bad
        return None
    state = read(path / "state.json") if (path / "state.json").is_file() else None
    if not (path / "dataset_info.json").is_file() and not (isinstance(state, dict) and "_data_files" in state):
        return None  # no sign of save_to_disk: a directory of files
    for marker in SAVED_MARKERS:
        if not (path / marker).is_file():
            return path / marker, "it is not there"
    if not isinstance(state, dict) or not isinstance(state.get("_data_files"), list):
        return path / "state.json", "it is not the JSON save_to_disk writes (no \"_data_files\" list)"
    for entry in state["_data_files"]:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not (path / name).is_file():
            return path / str(name), "state.json lists it as a data file, and it is not there"
    return None


def refuse_partial_save(path: Path, key: str = "data.paths") -> None:
    """``partial_save``'s finding as a ``UserError`` naming ``key`` and the file at fault: such a directory is
    neither a dataset to load nor a directory of JSON files (its ``state.json`` is no data)."""
    bad = partial_save(path)
    if bad is not None:
        where, why = bad
        raise UserError(key, str(where), f"{path} looks written by HF datasets' save_to_disk, and {where.name}: "
                        f"{why}; so it cannot be loaded as a saved dataset (and its JSON files are not data).",
                        "Save the dataset again (dataset.save_to_disk(DIR)) or copy the whole directory again, or "
                        "leave it out of the paths.")


def _files_under(root: Path, readable, key: str = "data.paths") -> list[Path]:
    """Readable files under ``root``, less hidden ones and shardyard's own caches (a ``data.cache_dir`` inside
    the corpus holds .json and .bin files that are not documents). A directory written by ``save_to_disk`` that
    cannot be loaded (``partial_save``) is refused naming the file at fault."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not os.path.isfile(os.path.join(here, d, MANIFEST))
                   and ".partial-" not in d]
        for d in [here, *(os.path.join(here, d) for d in dirs)]:
            refuse_partial_save(Path(d), key)
        saved = [d for d in dirs if saved_dataset(Path(here, d))]  # one entry each, never walked into
        dirs[:] = [d for d in dirs if d not in saved]
        found += [Path(here, d) for d in saved]
        found += [Path(here, n) for n in names if not n.startswith(".") and readable(Path(here, n))]
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
        for f in sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]:  # a saved dataset: its files
            st = f.stat()
            h.update(f"{f}|{st.st_size}|{int(st.st_mtime)}".encode())
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
        node = OmegaConf.create({"_target_": "shardyard.data.sources.TextFiles", **e})
        extra = {"key": key} if node._target_ == "shardyard.data.sources.TextFiles" else {}
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
    """Whether the document ``name`` is held out: a stable hash of the name below ``val_fraction``, unless its
    data fixes its split (a saved ``DatasetDict``'s train and validation splits: ``corpus.HELD_OUT`` /
    ``corpus.TRAINING``)."""
    if name.startswith(HELD_OUT):
        return True
    if name.startswith(TRAINING):
        return False
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little")
    return (h % 1_000_000) < val_fraction * 1_000_000
