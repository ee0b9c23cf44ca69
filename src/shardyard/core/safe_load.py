"""Loading checkpoints without unpickling code: every pickle shardyard reads, or lets a library read, resolves
only an exact set of ``(module, qualified name)`` pairs, and a file naming anything else exits 2 (naming the
file and the global) before any of it runs.

Model weights and adapters are read from safetensors only (``.bin`` pickles are refused by name), run state
from JSON. The pickles we cannot avoid:

- DCP's ``.metadata`` is a plain pickle, which DCP reads with ``pickle.load``. ``dcp_load`` reads it with
  ``exact_load`` (``read_dcp_metadata``) and hands DCP that object: DCP never unpickles it.
- DCP's planner reads non-tensor values (optimizer hyper-parameters) with ``torch.load(weights_only=False)``,
  and DeepSpeed 0.19 reads all its files that way. ``weights_only_loads`` turns every ``torch.load`` inside
  it into ``weights_only=True`` with an explicit list of classes (DeepSpeed's four data classes, none for
  DCP); torch's weights-only unpickler resolves globals by exact name and calls only those. Horovod's
  ``optimizer.pt`` goes through ``load_weights_only``. Their refusals become the same exit 2.
- The elastic rendezvous state (``process_group.elastic_start``) goes through ``exact_loads``.

``ExactUnpickler`` is Python's own pure-Python unpickler with every opcode that can reach code fenced:

1. ``find_class`` looks ``(module, name)`` up in a dict of objects resolved when shardyard built it; it
   imports nothing and never walks a dotted name (``pickle``'s own ``find_class`` resolves
   ``"torch.serialization" + "os.system"`` by attribute walk, so a check on the module string is no fence).
   A shardyard module path from before issue 55 (``shardyard.facts``) is looked up under its new module
   (``core.moved.MOVED``: ``shardyard.core.facts``), exactly, with one deprecation line.
2. ``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` and ``INST`` call only objects of that set (data classes,
   whose constructors only store fields); ``BUILD`` sets state only on instances of its classes, never on a
   class or an enum member (process-wide objects).
3. Extension codes (``EXT1/2/4``: ``copyreg``'s registry, whose cache the C unpickler consults without
   ``find_class``) and persistent ids are refused outright.

``FastExactUnpickler`` gives the same guarantees at the speed of the C unpickler (``pickle.Unpickler``, which
has no per-opcode hook: its ``find_class`` and ``persistent_load`` are the only ones), because what its
``find_class`` hands out fences the rest:

1. ``find_class`` looks up the same exact set, but returns stand-ins (``_stand_ins``): a class defined in
   Python becomes a class of ``_StandInClass``, whose instances are made by the real class (``NEWOBJ``:
   ``real.__new__``; a call: ``real(...)``), and which refuses ``BUILD`` itself (``__setstate__`` is a
   property of the metaclass that raises, and a data descriptor of the metaclass wins every lookup); a
   function or enum becomes a ``_CallStandIn`` that refuses ``BUILD``, and an enum's members come out as
   ``_Member`` (equal to the member, but its own object, refusing ``BUILD``): DCP's only enum is read by
   ``TensorProperties.__setstate__``, which keeps the real ``torch.memory_format`` it maps to. Immutable C
   classes whose instances have no ``__dict__`` (``torch.Size``, ``datetime``) and such values (dtypes)
   are handed out as they are: ``BUILD`` on them fails without changing anything.
2. So everything the C unpickler's stack can hold is a value pickle builds itself (``None``, numbers,
   strings, tuples, and fresh lists, dicts and sets), a stand-in, an immutable C class or value, or what
   calling one returned (a fresh instance of an allowed class, an immutable value, a ``_Member``). Only
   stand-ins and the immutable classes are callable, so ``REDUCE``, ``NEWOBJ``, ``OBJ`` and ``INST`` call
   only the allowed set, and ``BUILD`` fills only fresh instances of its classes, as in ``ExactUnpickler``.
3. Persistent ids: ``persistent_load`` refuses them. Extension codes: the C unpickler resolves a code that
   ``copyreg`` has not registered through nothing (an error), one it has through ``find_class`` (refused),
   but one in ``copyreg``'s cache without asking anyone. ``exact_load`` therefore takes the C reader only
   where ``copyreg`` registers and caches no code as the read starts (no package shardyard installs
   registers one), and ``ExactUnpickler`` otherwise.

``exact_load`` pauses the cyclic garbage collector while it reads (``_gc_paused``): every object of a
``.metadata`` stays alive, and the collections its millions of allocations trigger find nothing (they were most
of ``pickle.load``'s own time). The ``.metadata`` of a 1,000-rank FSDP checkpoint of a Llama-7B (873k shards,
133 MB; ``bench/dcp_metadata.py``) reads in 2.3 CPU seconds, against 28 s for ``ExactUnpickler`` and 10 s for
DCP's own ``pickle.load``; the stand-ins cost 12% over a plain ``pickle.load`` with the collector handled alike.
"""

from __future__ import annotations

import contextlib
import copyreg
import enum
import functools
import gc
import os
import pickle
import re
import types
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch

from shardyard.core.errors import UserError
from shardyard.core.moved import deprecated, new_pair


class Refused(pickle.UnpicklingError):
    """A pickle asked for something outside the exact set: ``what`` names it (the global, opcode or code)."""

    def __init__(self, what: str, reason: str):
        self.what = what
        super().__init__(f"{what} {reason}")


def _pairs(*objects: Any) -> dict[tuple[str, str], Any]:
    """The (module, qualified name) under which pickle writes each class or function."""
    return {(o.__module__, o.__qualname__): o for o in objects}


class ExactUnpickler(pickle._Unpickler):
    """Unpickles only the objects of ``allowed`` ({(module, qualname): object}); see the module docstring."""

    stack: list[Any]  # the pure-Python unpickler's state (typeshed describes only the C one)
    metastack: list[Any]
    read: Callable[[int], bytes]

    def __init__(self, file, allowed: Mapping[tuple[str, str], Any]):
        super().__init__(file)
        self.allowed = allowed
        self._ids = {id(o) for o in allowed.values()}  # alive as long as ``allowed``: ids are unique

    def find_class(self, module: str, name: str) -> Any:
        return _global(self.allowed, module, name)

    def persistent_load(self, pid: Any) -> Any:
        return _no_persistent_id(pid)

    def _callable(self, func: Any, opcode: str) -> None:
        if id(func) not in self._ids:
            raise Refused(_describe(func), f"is called by {opcode}, and it is not in the allowed set")

    def _load_reduce(self) -> None:
        self._callable(self.stack[-2], "REDUCE")
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    def _load_newobj(self) -> None:
        self._callable(self.stack[-2], "NEWOBJ")
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]

    def _load_newobj_ex(self) -> None:
        self._callable(self.stack[-3], "NEWOBJ_EX")
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]

    def _load_obj(self) -> None:
        if self.stack:  # the items after MARK: the class, then its arguments
            self._callable(self.stack[0], "OBJ")
        pickle._Unpickler.load_obj(self)  # type: ignore[attr-defined]

    def _load_build(self) -> None:
        inst = self.stack[-2]
        # Never a class (a trusted class's attributes would change for the whole process), nor an enum
        # member (a process-wide singleton): only fresh instances of the allowed classes take state.
        if isinstance(inst, (type, enum.Enum)) or id(type(inst)) not in self._ids:
            raise Refused(_describe(inst), "is given state by BUILD, and its type is not in the allowed set")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def _load_ext(self, size: int) -> None:
        code = int.from_bytes(self.read(size), "little", signed=size == 4)
        key = copyreg._inverted_registry.get(code)  # type: ignore[attr-defined]
        raise Refused(f"extension code {code}" + (f" ({key[0]}.{key[1]})" if key else ""),
                      "is refused (copyreg extension codes resolve globals outside find_class's check)")

    # INST goes through find_class (the class) and so needs no check of its own.
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
                **pickle._Unpickler.dispatch,
                pickle.REDUCE[0]: _load_reduce, pickle.NEWOBJ[0]: _load_newobj,
                pickle.NEWOBJ_EX[0]: _load_newobj_ex, pickle.OBJ[0]: _load_obj, pickle.BUILD[0]: _load_build,
                pickle.EXT1[0]: lambda self: self._load_ext(1), pickle.EXT2[0]: lambda self: self._load_ext(2),
                pickle.EXT4[0]: lambda self: self._load_ext(4)}


def _global(table: Mapping[tuple[str, str], Any], module: str, name: str) -> Any:
    """Both readers' ``find_class``: the exact (module, name) pair's entry, or a refusal."""
    try:
        return table[(module, name)]
    except KeyError:
        pass
    moved = new_pair(module, name)  # a pickle written before issue 55 names shardyard's old module paths
    if moved is not None and moved in table:
        deprecated(module, moved[0])
        return table[moved]
    raise Refused(f"{module}.{name}", "is a global outside the allowed set")


def _no_persistent_id(pid: Any) -> Any:
    raise Refused(f"persistent id {str(pid)[:60]!r}", "is refused (nothing shardyard reads uses one)")


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None)
    return f"{getattr(obj, '__module__', '?')}.{name}" if isinstance(name, str) else f"a {type(obj).__name__}"


class FastExactUnpickler(pickle.Unpickler):
    """The C unpickler with ``ExactUnpickler``'s guarantees, through stand-ins; see the module docstring."""

    def __init__(self, file, allowed: Mapping[tuple[str, str], Any]):
        super().__init__(file)
        self.stand_ins = _stand_ins(allowed)

    def find_class(self, module: str, name: str) -> Any:
        return _global(self.stand_ins, module, name)

    def persistent_load(self, pid: Any) -> Any:
        return _no_persistent_id(pid)


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: no attribute of the class can be set (C classes)


def _stand_ins(allowed: Mapping[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """What ``FastExactUnpickler.find_class`` returns for each allowed object (fresh for each load)."""
    out: dict[tuple[str, str], Any] = {}
    for key, obj in allowed.items():
        cls = obj if isinstance(obj, type) else type(obj)
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            out[key] = _CallStandIn(obj)  # its members are process-wide: they come out as _Member
        elif isinstance(obj, type) and not cls.__flags__ & _IMMUTABLE_TYPE:
            out[key] = _StandInClass.of(obj)
        elif isinstance(obj, types.FunctionType):
            out[key] = _CallStandIn(obj)
        elif cls.__flags__ & _IMMUTABLE_TYPE and cls.__dictoffset__ == 0:
            out[key] = obj  # torch.Size, datetime, a dtype: BUILD on it or on its instances changes nothing
        else:
            raise TypeError(f"{_describe(obj)}: no stand-in fences BUILD on it; give it one in _stand_ins")
    return out


class _StandInClass(type):
    """The metaclass of a Python class's stand-in: the stand-in makes instances of the real class and refuses
    ``BUILD`` on itself."""

    real: type

    @classmethod
    def of(mcs, real: type) -> _StandInClass:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ, NEWOBJ_EX and OBJ/INST without arguments
            return real.__new__(real, *args, **kwargs)

        if real.__new__ is object.__new__ and real.__init__ is not object.__init__:  # type: ignore[misc]
            # a data class: object.__new__(real, ...) ignores its arguments, the stand-in's too (slot_tp_new
            # passes it first). A C call: no Python frame for each of the million instances.
            __new__ = functools.partial(object.__new__, real)
        return mcs(real.__qualname__, (), {"__new__": __new__, "__slots__": (), "real": real})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # REDUCE, OBJ/INST with arguments
        return cls.real(*args, **kwargs)

    @property
    def __setstate__(cls) -> Any:  # a data descriptor of the metaclass: what BUILD looks up first
        raise Refused(_describe(cls.real), "is given state by BUILD, and it is a class (state of the whole process)")


class _CallStandIn:
    """A function's or an enum's stand-in: calls it (an enum member comes out as ``_Member``), refuses ``BUILD``."""

    __slots__ = ("real",)

    def __init__(self, real: Any):
        self.real = real

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.real(*args, **kwargs)
        return _Member(out) if isinstance(out, enum.Enum) else out

    def __setstate__(self, state: Any) -> None:
        raise Refused(_describe(self.real), "is given state by BUILD, and it is a function or enum of the process")


class _Member:
    """An enum member as ``FastExactUnpickler`` returns it: equal to the member and hashing like it (what
    ``TensorProperties.__setstate__`` compares), refusing ``BUILD`` (the member itself is process-wide)."""

    __slots__ = ("member",)

    def __init__(self, member: enum.Enum):
        self.member = member

    def __eq__(self, other: object) -> bool:
        return self.member == (other.member if isinstance(other, _Member) else other)

    def __hash__(self) -> int:
        return hash(self.member)

    def __repr__(self) -> str:
        return repr(self.member)

    def __setstate__(self, state: Any) -> None:
        raise Refused(_describe(self.member), "is given state by BUILD, and it is an enum member (process-wide)")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside, and what was built inside is then old: an unpickler's objects all
    stay alive, so collecting them finds nothing.

    1. Paused: the collections its allocations trigger (ever larger full ones, as the heap grows) were about
       80% of ``pickle.load``'s time on a large ``.metadata``.
    2. Then moved to the oldest generation (``freeze`` and ``unfreeze``: lists spliced, nothing traversed):
       else the next young collections traverse all of it twice more (about half of the read's time). Not
       where objects are frozen already (a fork server's): ``unfreeze`` would release them too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def exact_load(file: Any, allowed: Mapping[tuple[str, str], Any]) -> Any:
    """``pickle.load`` of only the objects of ``allowed`` (raises ``Refused`` or the parse's own error):
    ``FastExactUnpickler``, or ``ExactUnpickler`` while ``copyreg`` holds extension codes (whose cache the C
    unpickler reads without ``find_class``)."""
    codes = copyreg._inverted_registry or copyreg._extension_cache  # type: ignore[attr-defined]
    reader = ExactUnpickler if codes else FastExactUnpickler
    with _gc_paused():
        return reader(file, allowed).load()


def exact_loads(data: bytes, allowed: Mapping[tuple[str, str], Any]) -> Any:
    """``exact_load`` of bytes."""
    import io

    return exact_load(io.BytesIO(data), allowed)


# ------------------------------------------------------------------------------------------- DCP metadata
@functools.cache
def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """What torch 2.13's DCP pickles into ``.metadata`` (recorded from the find_class calls of checkpoints of
    every DCP engine: single, ddp, fsdp, pipeline, peft=lora; fp32 and bf16; DTensors, non-tensor values and
    nested dicts): its metadata classes, the storage info of the file-system writer, ``torch.Size``, a
    layout, the checkpoint path, and each dtype under its canonical name (``torch.float32``)."""
    import pathlib

    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    allowed = _pairs(md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
                     md.TensorProperties, md.MetadataIndex, md.StorageMeta, md._MEM_FORMAT_ENCODING,
                     fs._StorageInfo, torch.Size, torch.serialization._get_layout, pathlib.PosixPath)
    dtypes = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    allowed.update({("torch", n): t for n, t in dtypes.items() if str(t) == f"torch.{n}"})  # no aliases
    return allowed


def read_dcp_metadata(path: str):
    """``path/.metadata`` as DCP's ``Metadata``, read by ``exact_load``; ``UserError`` (every rank) if the
    file names anything outside DCP's metadata classes or is not DCP metadata at all."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = exact_load(f, dcp_metadata_globals())
    except Refused as e:
        raise refused(file, e.what, "a DCP metadata file").on_every_rank() from None
    except OSError as e:
        raise _unreadable(file, f"It cannot be read ({e.strerror or e})").on_every_rank() from None
    except Exception as e:  # noqa: BLE001  any parse error of untrusted bytes: the file is not DCP metadata
        raise _unreadable(file, f"It is not a DCP metadata pickle ({type(e).__name__}: {e})").on_every_rank() from None
    if not isinstance(metadata, Metadata):
        raise _unreadable(file, f"It holds a {type(metadata).__name__}, not DCP metadata").on_every_rank()
    for info in (metadata.storage_data or {}).values():  # DCP reads each shard from path/<relative_path>
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or rel != os.path.basename(rel) or rel in (".", ".."):
            raise _unreadable(file, f"It points DCP at {rel!r}, outside the checkpoint's own directory"
                              ).on_every_rank()
    return metadata


def dcp_load(state: dict, path: str) -> None:
    """``dcp.load(state, checkpoint_id=path)`` with nothing unpickled but data: the metadata through
    ``read_dcp_metadata`` (handed to DCP by ``dcp_reader``), non-tensor values (read by DCP's planner with
    ``weights_only=False``) and tensors through ``weights_only_loads``."""
    import torch.distributed.checkpoint as dcp

    reader = dcp_reader(path, read_dcp_metadata(path))
    with weights_only_loads(source=os.path.join(path, "*.distcp")):  # a stream: named by its files
        dcp.load(state, storage_reader=reader)


def dcp_reader(path: str, metadata):
    """A DCP storage reader for ``path`` that hands DCP ``metadata`` (from ``read_dcp_metadata``) instead of
    unpickling ``.metadata`` itself (``FileSystemReader.read_metadata`` is a plain ``pickle.load``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _VettedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if metadata.storage_meta is None:  # what FileSystemReader.read_metadata does after unpickling
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _VettedReader(path)


# ----------------------------------------------------------------------------------- torch.load, fenced
def load_weights_only(file: Any, allowed_globals: list | tuple = (), source: str = "",
                      _load: Callable = torch.load, **kwargs: Any) -> Any:
    """``torch.load(file, weights_only=True)`` with ``allowed_globals`` (classes or functions, which torch
    matches on their exact module and qualified name). A refused file raises ``UserError`` naming it (or
    ``source``, for a stream) and the global."""
    for g in allowed_globals:  # torch also takes (object, "any.name") pairs: an alias is not an exact name
        assert isinstance(g, type) or callable(g) and hasattr(g, "__qualname__"), f"not a class or function: {g!r}"
    kwargs["weights_only"] = True
    try:
        with torch.serialization.safe_globals(list(allowed_globals)):
            return _load(file, **kwargs)
    except pickle.UnpicklingError as e:
        raise _weights_only_refusal(file, source, e) from None


@contextlib.contextmanager
def weights_only_loads(allowed_globals: list | tuple = (), source: str = "") -> Iterator[None]:
    """Every ``torch.load`` inside (a library's, which may pass ``weights_only=False``) becomes
    ``load_weights_only``. A refusal is re-raised when the block ends even where the library catches or wraps
    it (DCP gathers its ranks' errors into a ``CheckpointException``), or swallows it and goes on."""
    real_load = torch.load
    refusals: list[UserError] = []

    def safe_load(f, *args: Any, **kwargs: Any) -> Any:
        if args:  # torch.load(f, map_location, pickle_module, ...): only map_location is ever positional
            kwargs["map_location"] = args[0]
        kwargs.pop("pickle_module", None)
        try:
            return load_weights_only(f, allowed_globals, source, real_load, **kwargs)
        except UserError as e:
            refusals.append(e)
            raise

    torch.load = safe_load
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # DCP's CheckpointException is a BaseException
        if refusals:
            raise refusals[0] from None
        raise
    finally:
        torch.load = real_load
    if refusals:
        raise refusals[0]


_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL (\S+)")
_UNSUPPORTED_OPERAND = re.compile(r"Unsupported operand (\d+)")


def _weights_only_refusal(file: Any, source: str, e: pickle.UnpicklingError) -> UserError:
    """torch's weights-only refusal as a UserError naming the file (``source`` for a stream) and the global.
    torch names a global it refuses; an opcode it does not support (STACK_GLOBAL, EXT, ...) comes first in
    some files, so then the globals the pickle names are read out of it (by pickletools, which runs nothing)."""
    text, name = str(e), str(file) if isinstance(file, (str, os.PathLike)) else source
    if m := _UNSUPPORTED_GLOBAL.search(text):
        glob = m.group(1)  # torch writes builtins' names bare ("GLOBAL eval")
        return refused(name, glob if "." in glob else f"builtins.{glob}", "a weights-only torch file")
    if m := _UNSUPPORTED_OPERAND.search(text):
        op = next((k for k, v in vars(pickle).items() if isinstance(v, bytes) and len(v) == 1
                   and k.isupper() and v[0] == int(m.group(1))), m.group(1))
        named = [g for g in _globals_named(file) if g not in torch._weights_only_unpickler._get_allowed_globals()]
        return refused(name, ", ".join(named[:3]) + f" (through the pickle opcode {op})" if named
                       else f"the pickle opcode {op}", "a weights-only torch file")
    reason = text.split("WeightsUnpickler error:", 1)[-1].split("\n\n", 1)[0].strip()
    return _unreadable(name, f"torch's weights-only loader refused it ({reason[:300]})")


def _opcodes(*ops: bytes) -> frozenset[str]:
    """pickletools' ``op.code`` (a one-character str) of each of pickle's opcode constants."""
    return frozenset(o.decode("latin-1") for o in ops)


_NAMES_A_GLOBAL = _opcodes(pickle.GLOBAL, pickle.INST)  # the global's module and name in the argument
_STACK_GLOBAL = _opcodes(pickle.STACK_GLOBAL)  # ... in the last two values pushed
_EXTENSION = _opcodes(pickle.EXT1, pickle.EXT2, pickle.EXT4)  # ... in copyreg's extension registry
_MEMOIZE = _opcodes(pickle.MEMOIZE)
_PUT = _opcodes(pickle.MEMOIZE, pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT)
_GET = _opcodes(pickle.GET, pickle.BINGET, pickle.LONG_BINGET)


def _globals_named(file: Any) -> list[str]:
    """The globals (and extension codes) the pickle in a torch file names, in order; [] if unreadable."""
    import pickletools
    import zipfile

    try:
        if hasattr(file, "seek"):
            file.seek(0)
        with zipfile.ZipFile(file) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    except Exception:  # noqa: BLE001  not a zip: torch's legacy format starts with a pickle
        try:
            if hasattr(file, "seek"):
                file.seek(0)
            data = file.read() if hasattr(file, "read") else open(file, "rb").read()
        except Exception:  # noqa: BLE001
            return []
    names: list[str] = []
    pushed: list[Any] = [None, None]  # the last two values pushed (STACK_GLOBAL's module and name)
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.code in _NAMES_A_GLOBAL:
                names.append(str(arg).replace(" ", "."))
            elif op.code in _STACK_GLOBAL:
                names.append(f"{pushed[-2]}.{pushed[-1]}")
            elif op.code in _EXTENSION:
                key = copyreg._inverted_registry.get(arg)  # type: ignore[attr-defined]
                names.append(f"extension code {arg}" + (f" ({key[0]}.{key[1]})" if key else ""))
            elif op.code in _PUT:
                memo[len(memo) if op.code in _MEMOIZE else arg] = pushed[-1]
                continue
            if op.code in _GET:
                pushed.append(memo.get(arg))
            elif op.stack_after:
                pushed.append(arg if isinstance(arg, str) else None)
    except Exception:  # noqa: BLE001  a damaged pickle: what was read so far
        pass
    return names


def unsafe_global_in(directory: str, allowed_globals: list | tuple = ()) -> tuple[str, str] | None:
    """The first ``(file, global)`` that a torch checkpoint file under ``directory`` names outside torch's
    weights-only set and ``allowed_globals``, or ``None``. The pickles are read as opcodes
    (``torch.serialization.get_unsafe_globals_in_checkpoint``): nothing is unpickled. One rank can thus vet
    every rank's files before a collective load, so that a file only one rank reads cannot leave the others
    waiting in a collective (the load itself stays weights-only on every rank)."""
    import zipfile

    with torch.serialization.safe_globals(list(allowed_globals)):
        for root, _, names in sorted(os.walk(directory)):
            for name in sorted(names):
                file = os.path.join(root, name)
                if not zipfile.is_zipfile(file):
                    continue  # not a torch.save file (safetensors, JSON, DCP shards: read elsewhere)
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
                except Exception as e:  # noqa: BLE001  a zip torch cannot read: the load names it on every rank
                    return file, f"an unreadable pickle ({type(e).__name__})"
                if unsafe:
                    return file, unsafe[0]
    return None


def refused(file: str, what: str, kind: str) -> UserError:
    return UserError("checkpoint.resume", file, f"It asks for {what}, which {kind} never holds; it was refused "
                     "before anything in it ran (shardyard unpickles only an exact set of data classes).",
                     "Resume only from checkpoints you or a trusted run wrote. If this is one of yours, it was "
                     "altered or is corrupt: resume from an earlier checkpoint of the run.")


def _unreadable(file: str, problem: str) -> UserError:
    return UserError("checkpoint.resume", file, f"{problem}.",
                     "Resume from a checkpoint shardyard (or torch.distributed.checkpoint) wrote; if it is yours, "
                     "it is corrupt: resume from an earlier checkpoint of the run.")


def rendezvous_globals() -> dict[tuple[str, str], Any]:
    """What torch's dynamic rendezvous pickles into its store (``_RendezvousState``): its two classes, and the
    heartbeat times (aware datetimes: ``datetime``, ``timezone``, and the ``timedelta`` of its UTC offset)."""
    import datetime

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    return _pairs(dr._RendezvousState, dr._NodeDesc, datetime.datetime, datetime.timezone, datetime.timedelta)


