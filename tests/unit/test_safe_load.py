"""Checkpoint loading never runs code named by a file: a generated corpus of hostile pickles (dotted names
through every trusted module, plain globals, REDUCE/BUILD/INST/OBJ/NEWOBJ/NEWOBJ_EX, extension codes,
persistent ids, payloads nested in real DCP metadata, protocols 0-5) goes through the functions the real
``checkpoint.resume=`` path calls, and through both readers (``ExactUnpickler``, pure Python, and
``FastExactUnpickler``, the C unpickler behind stand-ins). Every file is refused naming it and what it asked
for, and no sentinel appears; the same files loaded by plain ``pickle`` do create their sentinels (the corpus
is live). A generated 64-rank FSDP ``.metadata`` reads as ``pickle`` reads it (tests/fsdp_metadata.py)."""

from __future__ import annotations

import contextlib
import copyreg
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from forge import FORGER, Call, G, Raw, Seq, forge
from shardyard.core.errors import UserError
from shardyard.core.safe_load import dcp_load, dcp_metadata_globals, load_weights_only, read_dcp_metadata, weights_only_loads


@dataclass
class Case:
    name: str
    obj: object
    proto: int
    expect: str  # what the refusal must name
    sentinel: Path


def _actions(s: Path) -> list[tuple[str, tuple]]:
    """Dotted targets and the arguments that make each create ``s`` (the ones that resolve, when called)."""
    return [("os.makedirs", (str(s),)), ("os.mkdir", (str(s),)), ("os.system", (f"mkdir {s}",)),
            ("subprocess.call", (["mkdir", str(s)],)), ("builtins.exec", (f"import os; os.makedirs({str(s)!r})",)),
            ("shutil.os.makedirs", (str(s),)), ("sys.modules.get", ("os",)), ("importlib.import_module", ("os",))]


EXT_CODES = {1: ("os", "makedirs"), 300: ("subprocess", "call"), 70000: ("posix", "mkdir")}  # EXT1, EXT2, EXT4


def _metadata():
    """A real DCP Metadata (what dcp.save wrote for a tensor and two non-tensor values)."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    size = torch.Size([4, 2])
    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), size,
                                      [ChunkStorageMetadata(torch.Size([0, 0]), size)]),
           "lr": BytesStorageMetadata()}
    storage = {MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 64),
               MetadataIndex("lr"): _StorageInfo("__0_0.distcp", 64, 10)}
    return Metadata(sdm, planner_data={"w": ("w",), "lr": ("lr",)}, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=Path("/ckpt"), modules=["x"]), version="1.0.0")


def corpus(root: Path) -> list[Case]:
    """A few hundred hostile pickles, the same every run; each would create its own sentinel under root."""
    cases: list[Case] = []
    n = iter(range(10**6))

    def add(name, obj_of, proto, expect):
        s = root / f"sentinel-{next(n)}"
        cases.append(Case(name, obj_of(s), proto, expect, s))

    trusted = sorted({m for m, _ in dcp_metadata_globals()})
    for module in trusted:  # 1. dotted names through every trusted module
        for i, (target, _) in enumerate(_actions(root)):
            for proto in range(6):
                add(f"dotted {module} {target} p{proto}",
                    lambda s, i=i, module=module: Call(G(module, _actions(s)[i][0]), *_actions(s)[i][1]),
                    proto, f"{module}.{target}")
    plain = [("os", "system", lambda s: (f"mkdir {s}",)), ("posix", "system", lambda s: (f"mkdir {s}",)),
             ("os", "makedirs", lambda s: (str(s),)), ("posix", "mkdir", lambda s: (str(s),)),
             ("builtins", "eval", lambda s: (f"__import__('os').makedirs({str(s)!r})",)),
             ("builtins", "exec", lambda s: (f"import os; os.makedirs({str(s)!r})",)),
             ("subprocess", "call", lambda s: (["mkdir", str(s)],)), ("nt", "system", lambda s: (f"mkdir {s}",))]
    for proto in range(6):  # 2. plain GLOBAL / STACK_GLOBAL
        for module, name, args in plain:
            add(f"global {module}.{name} p{proto}", lambda s, m=module, f=name, a=args: Call(G(m, f), *a(s)),
                proto, f"{module}.{name}")
        add(f"getattr chain p{proto}", lambda s: Call(Call(G("builtins", "getattr"), Call(G("builtins", "__import__"),
            "os"), "makedirs"), str(s)), proto, "builtins.getattr")
        add(f"__import__ p{proto}", lambda s: Call(G("builtins", "__import__"), "os"), proto, "builtins.__import__")
        add(f"copyreg p{proto}", lambda s: Call(G("copyreg", "_reconstructor"), G("os", "PathLike"), object, None),
            proto, "copyreg._reconstructor")
        # 3. the other opcodes that call or set state
        add(f"INST p{proto}", lambda s: Seq(Raw(pickle.MARK), str(s), Raw(b"ios\nmakedirs\n")), proto, "os.makedirs")
        add(f"OBJ p{proto}", lambda s: Seq(Raw(pickle.MARK), G("os", "makedirs"), str(s), Raw(pickle.OBJ)), proto,
            "os.makedirs")
        add(f"NEWOBJ p{proto}", lambda s: Seq(G("os", "makedirs"), (str(s),), Raw(pickle.NEWOBJ)), proto, "os.makedirs")
        add(f"NEWOBJ_EX p{proto}", lambda s: Seq(G("os", "makedirs"), (str(s),), {}, Raw(pickle.NEWOBJ_EX)), proto,
            "os.makedirs")
        # BUILD {"__setstate__": f} then BUILD arg calls f(arg) on plain pickle
        add(f"BUILD setstate p{proto}", lambda s: Seq(Call(G("torch.distributed.checkpoint.metadata", "StorageMeta")),
            {"__setstate__": G("os", "makedirs")}, Raw(pickle.BUILD), str(s), Raw(pickle.BUILD)), proto, "os.makedirs")
        add(f"BUILD on a class p{proto}", lambda s: Seq(G("torch.distributed.checkpoint.metadata", "Metadata"),
            (None, {"__reduce__": None}), Raw(pickle.BUILD)), proto, "torch.distributed.checkpoint.metadata.Metadata")
        add(f"BUILD on an enum member p{proto}", lambda s: Seq(Call(G("torch.distributed.checkpoint.metadata",
            "_MEM_FORMAT_ENCODING"), 0), {"_value_": 7}, Raw(pickle.BUILD)), proto, "_MEM_FORMAT_ENCODING")
        add(f"PERSID p{proto}", lambda s: Raw(pickle.PERSID + b"os.system\n"), proto, "persistent id")
        add(f"BINPERSID p{proto}", lambda s: Seq("os.system", Raw(pickle.BINPERSID)), proto, "persistent id")
        if proto >= 2:  # 4. extension codes (registered by the test's fixture, as a library could)
            for code, (m, f) in EXT_CODES.items():
                add(f"EXT {code} p{proto}", lambda s, m=m, f=f: Call(_real(m, f), ["mkdir", str(s)] if f == "call"
                                                                  else str(s)), proto,
                    f"extension code {code} ({m}.{f})")
    for proto in range(6):  # 5. nested in a valid-looking Metadata (protocols 0/1 write copy_reg first)
        for where in ("planner_data", "storage_data", "modules", "chunks"):
            def nested(s, where=where):
                md, payload = _metadata(), Call(G("torch.serialization", "os.makedirs"), str(s))
                if where == "modules":
                    md.storage_meta.modules.append(payload)
                elif where == "chunks":
                    md.state_dict_metadata["w"].chunks.append(payload)
                else:
                    getattr(md, where)["evil"] = payload
                return md
            add(f"nested {where} p{proto}", nested, proto,
                "copy_reg._reconstructor" if proto < 2 else "torch.serialization.os.makedirs")
    return cases


def _real(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def extension_codes():
    """copyreg extension codes for dangerous callables, as a library in the process could register them."""
    for code, (m, f) in EXT_CODES.items():
        copyreg.add_extension(m, f, code)
    try:
        yield
    finally:
        for code, (m, f) in EXT_CODES.items():
            copyreg.remove_extension(m, f, code)


@pytest.fixture
def extensions():
    with extension_codes():
        yield


def _resolves(data: bytes) -> bool:
    try:
        pickle.loads(data)
    except Exception:  # noqa: BLE001  a payload whose path does not resolve in this interpreter
        return False
    return True


def test_hostile_dcp_metadata_corpus_is_refused_and_runs_nothing(tmp_path, extensions):
    cases = corpus(tmp_path)
    assert len(cases) > 300
    files = []
    for i, c in enumerate(cases):
        d = tmp_path / "corpus" / f"{i:04d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(forge(c.obj, c.proto))
        files.append(d)
    for c, d in zip(cases, files):
        with pytest.raises(UserError) as e:
            read_dcp_metadata(str(d))  # what every DCP engine's load_checkpoint (checkpoint.resume=) reads first
        assert e.value.key == "checkpoint.resume" and e.value.value == str(d / ".metadata"), c.name
        assert c.expect in e.value.problem, (c.name, e.value.problem)
        assert not c.sentinel.exists(), c.name
    # The corpus is live: plain pickle runs what it names (those that resolve here; dotted names resolve
    # from protocol 4, and only through modules that imported the target). Refused again afterwards,
    # with copyreg's extension cache now filled (which the C unpickler consults before find_class).
    live = [c for c, d in zip(cases, files)  # (BUILD on a class or enum member would change them for good)
            if "BUILD on" not in c.name and _resolves((d / ".metadata").read_bytes()) and c.sentinel.exists()]
    kinds = {c.name.split(" p")[0].split(" ")[0] for c in live}
    assert len(live) >= 100 and {"dotted", "global", "getattr", "INST", "OBJ", "BUILD", "EXT", "nested"} <= kinds, kinds
    for c in live:
        c.sentinel.rmdir()
    for c, d in zip(cases, files):
        if "EXT" in c.name:
            with pytest.raises(UserError, match="extension code"):
                read_dcp_metadata(str(d))
            assert not c.sentinel.exists()


def test_real_dcp_checkpoints_load_and_tampered_values_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    saved = {"w": torch.arange(6.0), "b": torch.ones(3, dtype=torch.bfloat16), "lr": 0.1, "betas": (0.9, 0.95),
             "nest": {"a": [1, {"b": torch.zeros(2)}], "name": "adamw", "none": None}}
    dcp.save(saved, checkpoint_id=str(ckpt))
    assert read_dcp_metadata(str(ckpt)) == pickle.loads((ckpt / ".metadata").read_bytes())
    state = {"w": torch.zeros(6), "b": torch.zeros(3, dtype=torch.bfloat16), "lr": None, "betas": None,
             "nest": {"a": [0, {"b": torch.ones(2)}], "name": None, "none": 1}}
    dcp_load(state, str(ckpt))
    assert torch.equal(state["w"], saved["w"]) and state["lr"] == 0.1 and state["betas"] == (0.9, 0.95)
    assert state["nest"]["a"][1]["b"].sum() == 0 and state["nest"]["name"] == "adamw"

    # A non-tensor value whose bytes name os.makedirs: DCP's planner would torch.load it with
    # weights_only=False. Written by the attacker's own torch.save (a forging pickler).
    evil = tmp_path / "evil"
    sentinel = tmp_path / "sentinel"
    real_save = torch.save
    torch.save = lambda obj, f, **kw: real_save(obj, f, pickle_module=FORGER, pickle_protocol=2)
    try:
        dcp.save({"w": torch.arange(6.0), "lr": Call(G("os", "makedirs"), str(sentinel))}, checkpoint_id=str(evil))
    finally:
        torch.save = real_save
    with pytest.raises(UserError) as e:
        dcp_load({"w": torch.zeros(6), "lr": None}, str(evil))
    assert "os.makedirs" in e.value.problem and str(evil) in e.value.value and not sentinel.exists()
    assert torch.load is torch.serialization.load  # restored


@pytest.mark.parametrize("payload,proto,expect,live", [
    (lambda s: Call(G("os", "makedirs"), s), 2, "os.makedirs", True),
    (lambda s: Call(G("builtins", "eval"), f"__import__('os').makedirs({s!r})"), 2, "builtins.eval", True),
    (lambda s: Call(G("torch", "serialization.os.makedirs"), s), 2, "torch.serialization.os.makedirs", False),
    (lambda s: {"state": [Call(G("posix", "mkdir"), s)]}, 2, "posix.mkdir", True),
    (lambda s: Call(G("os", "makedirs"), s), 4, "os.makedirs (through the pickle opcode", True),
    (lambda s: Call(_real("os", "makedirs"), s), 2, "extension code 1 (os.makedirs)", True),
], ids=["global", "builtins", "dotted", "nested", "stack-global", "extension"])
def test_hostile_torch_files_are_refused_naming_file_and_global(tmp_path, extensions, payload, proto, expect, live):
    """optimizer.pt (Horovod), DeepSpeed's files (through weights_only_loads), DCP non-tensor values."""
    sentinel = tmp_path / "S"
    f = tmp_path / "optimizer.pt"
    torch.save(payload(str(sentinel)), f, pickle_module=FORGER, pickle_protocol=proto)
    with pytest.raises(UserError) as e:
        load_weights_only(str(f))
    assert e.value.value == str(f) and expect in e.value.problem
    with pytest.raises(UserError) as e, weights_only_loads([_Plain], source="x"):
        torch.load(f, weights_only=False)  # what DeepSpeed calls: turned into weights_only=True
    assert e.value.value == str(f) and expect in e.value.problem
    assert not sentinel.exists() and torch.load is torch.serialization.load
    if live:  # torch's full unpickler runs it (torch's own find_class walks no dotted name)
        torch.load(f, weights_only=False)
        assert sentinel.exists()


@dataclass
class _Plain:
    x: int


def test_weights_only_loads_passes_allowed_classes_and_refuses_swallowed_errors(tmp_path):
    f = tmp_path / "state.pt"
    torch.save({"t": torch.ones(2), "plain": _Plain(3)}, f)
    with weights_only_loads([_Plain]):
        got = torch.load(f, weights_only=False)
    assert got["plain"] == _Plain(3) and torch.equal(got["t"], torch.ones(2))
    with pytest.raises(UserError, match="_Plain"), weights_only_loads([], source="x"):
        try:  # a library that catches the refusal and goes on without the value
            torch.load(f, weights_only=False)
        except Exception:  # noqa: BLE001
            pass
    assert torch.load is torch.serialization.load
    with pytest.raises(AssertionError, match="not a class or function"):
        load_weights_only(str(f), [(_Plain, "builtins.dict")])  # torch's alias form: not an exact name


def test_exact_unpickler_reads_every_dcp_metadata_protocol():
    md = _metadata()
    for proto in range(2, 6):  # DCP writes the default protocol (4); 2-5 read the same
        assert _read(pickle.dumps(md, protocol=proto)) == md


def _read(data: bytes):
    from shardyard.core.safe_load import exact_loads

    return exact_loads(data, dcp_metadata_globals())


def test_the_rendezvous_state_round_trips_through_the_exact_set():
    """What torch's dynamic rendezvous stores (heartbeats are aware datetimes: timezone and timedelta too) is read
    back by ``elastic_start`` through the exact set, at the protocol torch writes it with."""
    import datetime

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from shardyard.core.safe_load import exact_loads, rendezvous_globals

    state = _RendezvousState()
    state.round, node = 3, _NodeDesc("host-a", 11, 0)
    state.participants = {node: 0}
    state.last_heartbeats = {node: datetime.datetime.now(datetime.timezone.utc)}
    got = exact_loads(pickle.dumps(state), rendezvous_globals())
    assert got.round == 3 and got.participants == state.participants and got.last_heartbeats == state.last_heartbeats


def test_metadata_cannot_point_dcp_outside_the_checkpoint(tmp_path):
    """Only classes of the exact set, yet a path: a shard's ``relative_path`` must be a name in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    from shardyard.core.safe_load import read_dcp_metadata

    dcp.save({"w": torch.arange(6.0), "lr": 0.1}, checkpoint_id=str(tmp_path))
    metadata = read_dcp_metadata(str(tmp_path))
    for escape in ("../../etc/passwd", "/etc/passwd", ".."):
        for info in metadata.storage_data.values():
            info.relative_path = escape
        with open(tmp_path / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        with pytest.raises(UserError) as e:
            read_dcp_metadata(str(tmp_path))
        assert "outside the checkpoint's own directory" in str(e.value) and e.value.key == "checkpoint.resume"


def test_every_ranks_torch_files_are_vetted_as_opcodes_without_unpickling(tmp_path):
    """What rank 0 runs over a DeepSpeed checkpoint before any collective load (``unsafe_global_in``): the data
    classes of the allow-list pass, a hostile global in any rank's file is named, and nothing runs."""
    from shardyard.core.safe_load import unsafe_global_in

    (tmp_path / "global_step3").mkdir()
    torch.save({"t": torch.ones(2), "plain": _Plain(1)}, tmp_path / "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "meta.json").write_text("{}")
    assert unsafe_global_in(str(tmp_path), [_Plain]) is None
    pwned = tmp_path / "pwned"
    bad = tmp_path / "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"

    class Payload:  # unpickling it would call os.makedirs(pwned)
        def __reduce__(self):
            import os

            return os.makedirs, (str(pwned),)

    torch.save({"t": torch.ones(2), "evil": Payload()}, bad)
    file, name = unsafe_global_in(str(tmp_path), [_Plain])
    assert file == str(bad) and name.endswith("makedirs") and not pwned.exists()


# ------------------------------------------------------------------- the C reader (FastExactUnpickler)
def _refusal(reader, data: bytes, allowed) -> BaseException:
    import io

    with pytest.raises(Exception) as e:
        reader(io.BytesIO(data), allowed).load()
    return e.value


def test_the_fast_reader_refuses_the_corpus_as_the_pure_python_one_does(tmp_path):
    """What ``read_dcp_metadata`` takes while ``copyreg`` holds no extension code: the C unpickler with
    stand-ins. Every file of the corpus is refused naming what ``ExactUnpickler`` names, through the reader
    and through ``read_dcp_metadata``, and runs nothing. Extension codes that ``copyreg`` does not hold are
    an error of the C unpickler itself (``ExactUnpickler`` refuses them by name)."""
    from shardyard.core.safe_load import ExactUnpickler, FastExactUnpickler, Refused

    cases = corpus(tmp_path)
    with extension_codes():  # the EXT cases written as a library's codes would let them be written
        files = [forge(c.obj, c.proto) for c in cases]
    assert not copyreg._inverted_registry and not copyreg._extension_cache  # type: ignore[attr-defined]
    allowed = dcp_metadata_globals()
    for i, (c, data) in enumerate(zip(cases, files)):
        old, new = _refusal(ExactUnpickler, data, allowed), _refusal(FastExactUnpickler, data, allowed)
        assert isinstance(old, Refused), (c.name, old)
        if "EXT" in c.name:
            assert isinstance(new, ValueError) and "unregistered extension code" in str(new), (c.name, new)
        else:
            assert isinstance(new, Refused) and new.what == old.what and c.expect in str(new), (c.name, new, old)
        d = tmp_path / "files" / f"{i:04d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(data)
        with pytest.raises(UserError) as e:
            read_dcp_metadata(str(d))
        assert e.value.value == str(d / ".metadata") and (c.expect if "EXT" not in c.name else "extension code") in \
            e.value.problem, (c.name, e.value.problem)
        assert not c.sentinel.exists(), c.name


def _changeable_state(obj) -> tuple:
    """What BUILD could change on an object: its attribute dict, or None where it has none."""
    d = getattr(obj, "__dict__", None)
    return (type(obj), None if d is None else dict(d))


@pytest.mark.parametrize("which", ["dcp", "rendezvous"])
def test_build_on_every_allowed_object_and_on_shared_results_is_refused_by_both_readers(which):
    """BUILD (dict state, slot state) on each object of the exact set, and on the process-wide objects that
    calling one returns (an enum member, a layout, the UTC timezone): both readers refuse, nothing changes."""
    from shardyard.core.safe_load import ExactUnpickler, FastExactUnpickler, rendezvous_globals

    allowed = dcp_metadata_globals() if which == "dcp" else rendezvous_globals()
    targets = [G(m, n) for m, n in allowed]
    if which == "dcp":
        targets += [Call(G("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"), 1),
                    Call(G("torch.serialization", "_get_layout"), "torch.strided")]
    else:
        targets += [Call(G("datetime", "timezone"), Call(G("datetime", "timedelta"), 0))]
    shared = [*allowed.values(), *_memory_format_encodings(), torch.strided]
    before = [_changeable_state(o) for o in shared]
    for target in targets:
        for state in ({"zz": 1}, (None, {"zz": 1}), (None, {"__reduce_ex__": None}), {"_value_": 7}):
            for proto in (2, 4):
                data = forge(Seq(target, state, Raw(pickle.BUILD)), proto)
                for reader in (ExactUnpickler, FastExactUnpickler):
                    _refusal(reader, data, allowed)
    assert [_changeable_state(o) for o in shared] == before


def _memory_format_encodings() -> list:
    """DCP's one enum's members: process-wide objects with a ``__dict__``."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return list(_MEM_FORMAT_ENCODING)


def test_the_fast_reader_hands_out_nothing_it_cannot_fence():
    """An allowed object BUILD could change, with no stand-in for it (an instance with a ``__dict__``), is a
    programming error when the table is built, not an object handed to a hostile file."""
    from shardyard.core.safe_load import _stand_ins

    with pytest.raises(TypeError, match="no stand-in"):
        _stand_ins({("tests", "plain"): _Plain(1)})


def test_a_64_rank_fsdp_metadata_reads_as_pickle_reads_it_without_a_python_opcode_loop(tmp_path):
    """DCP metadata of a 64-rank FSDP checkpoint (a Llama's 291 tensors and their Adam moments, 56k shards):
    ``read_dcp_metadata`` returns exactly what ``pickle.load`` does, and no opcode of it was dispatched by
    Python (no function of pickle.py ran: the pure-Python reader's loop is what made 1,000 ranks take
    minutes; bench/dcp_metadata.py times it). The garbage collector is running again afterwards."""
    import gc
    import sys

    from fsdp_metadata import write_fsdp_metadata

    from shardyard.core.safe_load import _gc_paused

    file = write_fsdp_metadata(tmp_path, world=64)
    with _gc_paused():
        expected = pickle.loads(file.read_bytes())
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == pickle.__file__:
            ran.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        got = read_dcp_metadata(str(tmp_path))
    finally:
        sys.setprofile(None)
    assert not ran, sorted(ran)[:10]
    assert got == expected and len(got.storage_data) == 291 * 3 * 64 + 291 + 12  # + steps, param group
    props = got.state_dict_metadata["model.output.weight"].properties
    assert props.memory_format is torch.contiguous_format and props.dtype is torch.float32
    assert gc.isenabled()


def test_both_readers_build_the_same_objects_through_every_calling_opcode():
    """Allowed classes through REDUCE, NEWOBJ, NEWOBJ_EX, OBJ and INST (with and without arguments), at
    protocols 0-5: the stand-ins make what the real classes make, as ``ExactUnpickler`` does."""
    import io

    from shardyard.core.safe_load import ExactUnpickler, FastExactUnpickler

    md = "torch.distributed.checkpoint.metadata"
    size = Call(G("torch", "Size"), [4, 2])
    payloads = {
        "REDUCE": Call(G(md, "ChunkStorageMetadata"), size, size),
        "REDUCE path": Call(G("pathlib", "PosixPath"), "/ckpt", "step-1"),
        "NEWOBJ": Seq(G(md, "StorageMeta"), ("x",), Raw(pickle.NEWOBJ)),
        "NEWOBJ path": Seq(G("pathlib", "PosixPath"), ("/ckpt",), Raw(pickle.NEWOBJ)),
        "NEWOBJ_EX": Seq(G(md, "MetadataIndex"), ("w",), {"index": 3}, Raw(pickle.NEWOBJ_EX)),
        "OBJ": Seq(Raw(pickle.MARK), G(md, "StorageMeta"), "id", Raw(pickle.OBJ)),
        "OBJ bare": Seq(Raw(pickle.MARK), G(md, "Metadata"), Raw(pickle.OBJ)),
        "INST": Seq(Raw(pickle.MARK), "fqn", size, Raw(f"i{md}\nMetadataIndex\n".encode())),
        "INST bare": Seq(Raw(pickle.MARK), Raw(f"i{md}\nBytesStorageMetadata\n".encode())),
        "layout": Call(G("torch.serialization", "_get_layout"), "torch.strided"),
        "properties": _metadata().state_dict_metadata["w"].properties,
    }

    def same(a, b) -> bool:
        return type(a) is type(b) and (vars(a) == vars(b) if hasattr(a, "__dict__") else a == b)

    allowed = dcp_metadata_globals()
    for name, payload in payloads.items():
        for proto in range(6):
            data = forge(payload, proto)
            try:
                old = ExactUnpickler(io.BytesIO(data), allowed).load()
            except Exception as e:  # noqa: BLE001  NEWOBJ below protocol 2, say: the fast reader fails too
                with pytest.raises(type(e)):
                    FastExactUnpickler(io.BytesIO(data), allowed).load()
                continue
            assert same(FastExactUnpickler(io.BytesIO(data), allowed).load(), old), (name, proto)
