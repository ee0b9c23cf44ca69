"""Documents streamed out of the files people keep their data in: text, JSONL, JSON, Parquet, Arrow and CSV, the
text-like ones optionally gzip- or zstd-compressed. Nothing is read whole except a ``.json`` array (JSON has no
streaming form of an array), so a file may be larger than RAM.

Every record becomes one document: its ``text_field``, or the ``template`` (a Python format string over the
record's fields, e.g. ``"{title}\\n\\n{body}"``). A record without that field, or with a non-string in it, exits 2
naming the file and line (row for Parquet/Arrow/CSV). A ``.txt`` file is one document, handed out in pieces of at
most ``PIECE_CHARS`` characters cut at line ends, so one huge file never sits in memory whole either.

Parquet and Arrow go through HF ``datasets`` in streaming mode (local files, record batches, no Arrow copy in
``~/.cache/huggingface``); JSONL, JSON, CSV and text are read line by line here, because the error messages need
the line and ``datasets`` reports none.

A directory written by HF ``datasets``' ``save_to_disk`` is read as that dataset (``datasets.load_from_disk``:
its Arrow files memory-mapped, rows read in batches of ``SAVED_BATCH``, never the whole dataset at once). A
``Dataset``'s rows are split into train and val by ``data.val_fraction`` like any file's. A ``DatasetDict``'s
splits (``SAVED_SPLITS``): ``train`` is the training data, and the first of ``validation``, ``valid``, ``val``,
``dev``, ``test`` it has is the held-out data, whole (``data.val_fraction`` does not apply); without such a split
``train`` is split by ``data.val_fraction``; a dict without ``train`` but with one split reads that one, split by
``data.val_fraction``. Any other split is left out, saying so; to read one, name its own directory
(``DIR/<split>``: a saved ``Dataset`` of its own)."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import sys
import zlib
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, NamedTuple

from shardyard.core.errors import UserError

FORMATS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
           ".csv": "csv"}
"""File suffix -> format."""
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
"""Compression suffix (after the format's: ``a.jsonl.zst``) -> codec, for the text-like formats."""
STREAMED = ("text", "jsonl", "json", "csv")
"""The formats that may be compressed (Parquet and Arrow compress inside the file)."""
PIECE_CHARS = 1 << 20
"""A ``.txt`` document is handed out in pieces of at most this many characters, cut at line ends."""
KNOWN = "/".join(FORMATS) + " (text-like ones also .gz/.zst)"

SAVED = "saved"
"""The format of a directory written by HF ``datasets``' ``save_to_disk``."""
SAVED_BATCH = 1024
"""Rows read at once from a saved dataset."""
VAL_SPLITS = ("validation", "valid", "val", "dev", "test")
"""A saved ``DatasetDict``'s splits that hold out data, in order of preference (the first one present is used)."""
HELD_OUT, TRAINING = "\0val\0", "\0train\0"
"""Prefixes of a document name whose split is fixed by the data (a saved ``DatasetDict``'s ``train`` and
validation splits), not by the hash of ``sources.is_val``."""

JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


class Piece(NamedTuple):
    """Part of a document: ``name`` (stable: it decides the train/val split), ``text``, and whether the document
    ends with it (an end-of-text token follows)."""

    name: str
    text: str
    last: bool


def saved_dataset(path: Path) -> str | None:
    """``"dict"`` for a directory written by ``DatasetDict.save_to_disk``, ``"dataset"`` for one written by
    ``Dataset.save_to_disk``, else None."""
    if (path / "dataset_dict.json").is_file():
        return "dict"
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "dataset"
    return None


def path_bytes(path: Path) -> int:
    """Size of a file, or of every file under a directory (a saved dataset)."""
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def file_format(path: Path) -> tuple[str, str | None] | None:
    """``(format, compression)`` of a file by its suffixes (``a.jsonl.gz`` -> ``("jsonl", "gzip")``), or None.
    A directory written by ``save_to_disk``: ``(SAVED, None)``."""
    if path.is_dir():
        return (SAVED, None) if saved_dataset(path) else None
    name, codec = path.name, None
    for suffix, c in COMPRESSIONS.items():
        if name.endswith(suffix):
            name, codec = name[: -len(suffix)], c
    fmt = FORMATS.get(os.path.splitext(name)[1])
    if fmt is None or (codec is not None and fmt not in STREAMED):
        return None
    return fmt, codec


def _refuse_unreadable(path: Path, e: Exception, key: str = "data") -> UserError:
    return UserError(f"{key}.paths", str(path), f"The file cannot be decompressed ({type(e).__name__}: {e}).",
                     "Check it (gzip -t FILE, zstd -t FILE) and copy it again, or leave it out of the paths.")


class _Counting(io.RawIOBase):
    """A binary file that counts the compressed bytes read from it (the progress bar's position)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.done = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)  # type: ignore[attr-defined]
        self.done += n or 0
        return n or 0

    def close(self) -> None:
        self.f.close()
        super().close()


class _Zstd(io.RawIOBase):
    """A zstd stream decompressed frame after frame, refusing one that ends before its frame does (zstandard's
    ``stream_reader`` returns EOF there, and a cut file would be read as a shorter corpus)."""

    def __init__(self, raw: IO[bytes]):
        import zstandard  # lazy: only for .zst files

        self.raw, self.new = raw, zstandard.ZstdDecompressor().decompressobj
        self.d, self.started, self.out = self.new(), False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.out:
            data = self.raw.read(1 << 16)
            if not data:
                if self.started and not self.d.eof:
                    raise EOFError("the file ends inside a zstd frame (cut short)")
                return 0
            while data:
                self.started = True
                self.out += self.d.decompress(data)
                data = self.d.unused_data if self.d.eof else b""
                if self.d.eof:  # the next frame, if any, starts in what this one left
                    self.d, self.started = self.new(), bool(data)
        n = min(len(b), len(self.out))
        b[:n], self.out = self.out[:n], self.out[n:]
        return n


def open_text(path: Path, codec: str | None, newline: str | None = None) -> tuple[IO[str], _Counting]:
    """The file as UTF-8 text (a byte-order mark dropped), decompressed as it is read, and the counter of the
    bytes read from disk."""
    raw = _Counting(open(path, "rb"))
    buffered = io.BufferedReader(raw, 1 << 20)
    if codec == "gzip":
        stream: Any = gzip.GzipFile(fileobj=buffered)
    elif codec == "zstd":
        stream = io.BufferedReader(_Zstd(buffered), 1 << 20)
    else:
        stream = buffered
    return io.TextIOWrapper(stream, encoding="utf-8-sig", newline=newline), raw


def _decode_errors() -> tuple:
    """The exceptions a damaged or foreign compressed file raises while it is read (exit 2, naming it)."""
    try:
        import zstandard
        zstd_error: tuple = (zstandard.ZstdError,)
    except ImportError:
        zstd_error = ()
    return (gzip.BadGzipFile, EOFError, zlib.error, *zstd_error)


class Records:
    """The documents of one file, streamed. ``text_field`` or ``template`` picks each record's text."""

    def __init__(self, path: Path, name: str, text_field: str = "text", template: str | None = None, key: str = "data"):
        """``key``: where these options live in the config (``data``, ``data.sources[1]``), for error messages."""
        found = file_format(path)
        if found is None:
            raise UserError(f"{key}.paths", str(path), f"Its format is not one shardyard reads ({KNOWN}).",
                            "Convert the file, or leave it out of data.paths.")
        self.path, self.name, self.text_field, self.template, self.key = path, name, text_field, template, key
        self.format, self.codec = found
        self.done = 0  # bytes of the file read from disk (compressed ones when compressed): the progress bar's
        self._raw: _Counting | None = None

    def bytes_read(self) -> int:
        return self._raw.done if self._raw is not None else self.done

    def _open(self) -> IO[str]:
        f, self._raw = open_text(self.path, self.codec)
        return f

    def pieces(self) -> Iterator[Piece]:
        yield from self._guarded(self._pieces())

    def _pieces(self) -> Iterator[Piece]:
        if self.format == "text":
            yield from self._text()
        elif self.format == "csv":
            yield from self._csv()
        else:
            for name, where, record in self._rows(text=True):
                yield Piece(name, self.text_of(record, where), True)

    def rows(self) -> Iterator[tuple[str, str, dict]]:
        """``(name, where, record)`` of every record of a JSONL / JSON / Parquet / Arrow file or saved dataset:
        its stable name (``<name>:<ordinal>``; it decides the train/val split), where it is for messages
        (``file:line``, ``file row N``, ``DIR/<split> row N``), and the record."""
        if self.format in ("text", "csv"):
            raise UserError(f"{self.key}.paths", str(self.path), "It holds text, not records with named fields.",
                            "Give .jsonl, .json, .parquet or .arrow files or save_to_disk directories.")
        yield from self._guarded(self._rows(text=False))

    def _rows(self, text: bool) -> Iterator[tuple[str, str, dict]]:
        """``text``: the records' text is read (``text_field`` must be a column of a table)."""
        if self.format in ("jsonl", "json"):
            for ordinal, line, record in self._json():
                yield f"{self.name}:{ordinal}", f"{self.path}:{line}", record
        elif self.format == SAVED:
            yield from self._saved(text)
        else:
            yield from self._datasets(text)

    def _guarded(self, items: Iterator) -> Iterator:
        """``items``, with text that is not UTF-8 and a file that does not decompress as exit-2 paragraphs."""
        try:
            yield from items
        except UnicodeDecodeError as e:
            raise UserError(f"{self.key}.paths", str(self.path), f"The file is not UTF-8 text ({e.reason} at byte "
                            f"{e.start} of its text).", "Convert it to UTF-8 (iconv -t utf-8), or leave it out of the "
                            "paths.") from None
        except _decode_errors() as e:
            raise _refuse_unreadable(self.path, e, self.key) from None

    # -------------------------------------------------------------------------------------------- the text
    def text_of(self, record: dict, where: str) -> str:
        """The record's text: its ``text_field``, or the ``template`` filled from its fields."""
        if self.template is not None:
            try:
                return self.template.format_map(record)
            except KeyError as e:
                raise UserError(f"{self.key}.template", self.template, f"The record at {where} has no `{e.args[0]}` field "
                                f"(its keys: {sorted(record)}).", "Correct or remove that record, or use fields every "
                                f"record has in {self.key}.template.") from None
            except (ValueError, IndexError, AttributeError) as e:
                raise UserError(f"{self.key}.template", self.template, f"It is not a Python format string over a record's "
                                f"fields ({e}).", 'Write it like "{title}\\n\\n{body}".') from None
        text = record.get(self.text_field)
        if not isinstance(text, str):
            problem = "has no" if self.text_field not in record else f"has {JSON_TYPES.get(type(text), 'a non-string')} in its"
            raise UserError(f"{self.key}.text_field", self.text_field, f"The record at {where} {problem} `{self.text_field}` "
                            f"field (its keys: {sorted(record)}); every record needs its text there as a string.",
                            "Correct or remove that record, or name the field that holds the text: "
                            f"{self.key}.text_field=<key> (or {self.key}.template).")
        return text

    def _text(self) -> Iterator[Piece]:
        with self._open() as f:
            buf: list[str] = []
            size = 0
            for line in iter(lambda: f.readline(PIECE_CHARS), ""):  # a line longer than a piece comes in parts
                if size + len(line) > PIECE_CHARS and buf:
                    yield Piece(self.name, "".join(buf), False)
                    buf, size = [], 0
                buf.append(line)
                size += len(line)
            yield Piece(self.name, "".join(buf), True)

    def _json(self) -> Iterator[tuple[int, int, dict]]:
        with self._open() as f:
            first, blank = "", 0
            while True:  # the first non-space character says array or one object per line
                c = f.read(1)
                if not c or not c.isspace():
                    first = c
                    break
                blank += c == "\n"
            if self.format == "json" and first == "[":
                text = "\n" * blank + "[" + f.read()  # JSON has no streaming array: read whole
                yield from _array_records(self.path, text, self.key)
                return
            for i, line in enumerate(_prepend(first, f), start=blank):
                if line.strip():
                    try:
                        value = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{self.key}.paths", f"{self.path}:{i + 1}", f"The line is not JSON ({e.msg}, column "
                                        f"{e.colno}).", "Correct or remove that line: each line holds one JSON object.") from None
                    yield i, i + 1, _record(value, self.path, i + 1, self.key)

    def _csv(self) -> Iterator[Piece]:
        csv.field_size_limit(sys.maxsize)  # a document is a field: no 128 kB limit
        f, self._raw = open_text(self.path, self.codec, newline="")  # the csv module handles quoted newlines
        with f:
            reader = csv.DictReader(f, strict=True)  # a stray quote is an error, not a silently merged field
            try:
                fields = reader.fieldnames or []
                if self.template is None and self.text_field not in fields:
                    raise UserError(f"{self.key}.text_field", self.text_field, f"{self.path} has no such column (its "
                                    f"header: {fields}).", f"Use {self.key}.text_field=<one of {fields}>, or "
                                    f"{self.key}.template.")
                for i, row in enumerate(reader):
                    record = {k: v for k, v in row.items() if k is not None}
                    yield Piece(f"{self.name}:{i}", self.text_of(record, f"{self.path}:{reader.line_num}"), True)
            except csv.Error as e:
                # line_num counts the lines read before the one that failed
                raise UserError(f"{self.key}.paths", f"{self.path}:{reader.line_num + 1}", f"The CSV cannot be parsed "
                                f"there ({e}).", "Correct that line, or leave the file out of the paths.") from None

    def _datasets(self, text: bool) -> Iterator[tuple[str, str, dict]]:
        import datasets  # lazy: heavy, and only for Parquet / Arrow

        datasets.disable_progress_bars()
        size = os.path.getsize(self.path)
        try:
            ds = datasets.load_dataset(self.format, data_files=str(self.path), split="train", streaming=True)
            columns = ds.column_names or []
        except Exception as e:  # pyarrow's own error for a file that is not Parquet / Arrow
            raise UserError(f"{self.key}.paths", str(self.path), f"The file cannot be read as {self.format} "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}).",
                            "Copy it again or convert it, or leave it out of data.paths.") from None
        self._check_columns(text, str(self.path), columns)
        row = 0
        batches = iter(ds.iter(batch_size=1024))
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as e:  # pyarrow's error for a damaged row group, met while reading
                raise UserError(f"{self.key}.paths", f"{self.path} row {row}", f"The file cannot be read from there "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}).", "Copy it again or "
                                "convert it, or leave it out of the paths.") from None
            keys = list(batch)
            n = len(batch[keys[0]]) if keys else 0
            for i in range(n):
                yield f"{self.name}:{row}", f"{self.path} row {row}", {k: batch[k][i] for k in keys}
                row += 1
            self.done = min(size, self.done + size // 64)  # rows are not known up front: an estimate
        self.done = size

    def _check_columns(self, text: bool, where: str, columns: list) -> None:
        if text and self.template is None and self.text_field not in columns:
            raise UserError(f"{self.key}.text_field", self.text_field, f"{where} has no such column (it has {columns}).",
                            f"Use {self.key}.text_field=<one of {columns}>, or {self.key}.template.")

    def _saved(self, text: bool) -> Iterator[tuple[str, str, dict]]:
        """The rows of a ``save_to_disk`` directory (module doc: which splits, and where they go)."""
        import datasets  # lazy: heavy

        datasets.disable_progress_bars()
        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as e:
            raise UserError(f"{self.key}.paths", str(self.path), f"The directory looks written by HF datasets' "
                            f"save_to_disk, but it cannot be loaded ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}).", "Save it again (dataset.save_to_disk"
                            "(DIR)), or leave it out of the paths.") from None
        parts = self._saved_splits(loaded) if isinstance(loaded, datasets.DatasetDict) else [(None, "", loaded)]
        total = sum(len(ds) for _, _, ds in parts) or 1
        size, seen = path_bytes(self.path), 0
        for split, tag, ds in parts:
            label = self.path if split is None else self.path / split
            self._check_columns(text, str(label), list(ds.column_names))
            name = self.name if split is None else f"{self.name}/{split}"
            for start in range(0, len(ds), SAVED_BATCH):
                batch = ds[start:start + SAVED_BATCH]  # a slice of the memory-mapped table, as Python objects
                keys = list(batch)
                for i in range(len(batch[keys[0]]) if keys else 0):
                    yield f"{tag}{name}:{start + i}", f"{label} row {start + i}", {k: batch[k][i] for k in keys}
                seen += len(batch[keys[0]]) if keys else 0
                self.done = size * seen // total
        self.done = size

    def _saved_splits(self, dd) -> list[tuple[str, str, Any]]:
        """``(split, name prefix, Dataset)`` of the splits of a saved ``DatasetDict`` that are read."""
        names = list(dd)
        val = next((s for s in VAL_SPLITS if s in dd), None)
        if "train" in dd:
            parts = [("train", TRAINING if val else "", dd["train"])] + ([(val, HELD_OUT, dd[val])] if val else [])
        elif len(names) == 1:
            parts = [(names[0], "", dd[names[0]])]
        else:
            raise UserError(f"{self.key}.paths", str(self.path), f"The saved DatasetDict has no `train` split (its "
                            f"splits: {names}), so which split trains is not clear.", f"Name one split's own "
                            f"directory, e.g. {self.path / names[0]} (its rows are split by data.val_fraction).")
        left = [s for s in names if s not in {p[0] for p in parts}]
        if left:
            print(f"shardyard | {self.path}: reading the saved DatasetDict's split(s) {[p[0] for p in parts]}, "
                  f"leaving out {left} (name {self.path}/<split> to read one of those)", flush=True)
        return parts


def _prepend(first: str, f: IO[str]) -> Iterable[str]:
    """The lines of ``f``, the first of which began with the already-read character ``first``."""
    rest = f.readline()
    yield first + rest
    yield from f


def _record(value, path: Path, line: int, key: str = "data") -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{key}.paths", f"{path}:{line}", f"The record is {JSON_TYPES.get(type(value), 'no object')}, "
                        "not a JSON object ({...}).", "Correct or remove it: every record is a JSON object with named fields.")
    return value


def _array_records(path: Path, text: str, key: str = "data") -> Iterator[tuple[int, int, dict]]:
    """The elements of a ``.json`` file holding one array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    line, seen = 1, 0  # line = the line of text[seen]

    def line_at(i: int) -> int:
        nonlocal line, seen
        line, seen = line + text.count("\n", seen, i), i
        return line

    def skip(i: int) -> int:  # past JSON whitespace
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def refuse(i: int, problem: str):
        return UserError(f"{key}.paths", f"{path}:{line_at(i)}", problem, "Correct the file: a .json file holds one array "
                         "of JSON objects, [{...}, {...}], or one object per line.")

    pos = skip(text.index("[") + 1)
    index = 0
    while pos < len(text) and text[pos] != "]":
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise refuse(e.pos, f"The array's element {index} is not JSON ({e.msg}).") from None
        yield index, line_at(pos), _record(value, path, line_at(pos), key)
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos, index = skip(pos + 1), index + 1
        elif pos >= len(text) or text[pos] != "]":
            raise refuse(pos, f"A `,` or the closing `]` is missing after the array's element {index}.")
    if pos >= len(text) or text[pos + 1:].strip():
        raise refuse(min(pos, len(text)), "The array is not closed by `]`, or text follows it.")


def read_records(path: Path) -> Iterator[tuple[int, int, dict]]:
    """``(ordinal, line, record)`` for every JSON object of a ``.jsonl`` / ``.json`` file (optionally compressed):
    one object per line, or a ``.json`` array (ordinal: the element's index). Anything else exits 2 naming the
    file and line."""
    r = Records(path, path.name)
    yield from r._guarded(r._json())
