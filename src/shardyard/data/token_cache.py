"""The tokenizer and token caches: built once, published in one rename, verified once per node.

A cache is a directory under ``data.cache_dir`` (``tokenizers/<key>``, ``tokens/<key>``), keyed by the
fingerprints of what it was made from. It holds a manifest (``shards.MANIFEST``: every file's size and sha256)
and a stamp (``STAMP``: every file's size, mtime, ctime and inode when it was last hashed or written).

1. Build: under a file lock beside the cache, one builder per machine; where the file system refuses locks
   (NFS without lockd, Lustre mounted noflock), a lock in the node's temp directory. The build goes to a temp
   (or ``.partial-<host>``) directory, published in one rename with its manifest and stamp. Hosts whose locks
   are not shared may build the same cache: the loser of the rename verifies the winner's cache and uses it.
2. Verify (``data.verify``): ``stamp`` (the default) takes a cache whose stamp holds, checked by ``stat`` only;
   a cache without one (copied, or written by an older shardyard) is hashed by the node's first rank to take
   the node's lock, and the node's other ranks then find its stamp. ``full`` hashes every file at every start,
   once per node: the node's local rank 0 hashes; its other ranks wait for that rank's stamp.
   A cache that does not verify is rebuilt, saying so, never used as it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from omegaconf import DictConfig

from shardyard.core import dist_env
from shardyard.data import shards
from shardyard.core.errors import UserError
from shardyard.data.shards import MANIFEST
from shardyard.data.sources import Source, is_val, pieces_of

EOT = "<|endoftext|>"

STAMP = ".shardyard_verified.json"
"""A cache directory's stamp: ``{verified_at, host, files: {name: [size, mtime_ns, ctime_ns, inode]}}`` of the
manifest and every file it lists, taken when they were hashed (or written by the build that published them)."""
LOCKS_REFUSED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF}
"""What ``flock`` raises on a file system that does not lock: NFS without lockd, Lustre mounted noflock, FUSE; and
NFS refusing an exclusive lock on a read-only descriptor (EBADF: a lock file opened read-only)."""
FULL_WAIT_S = 60.0
"""``data.verify=full``: how long a rank that is not its node's local rank 0 waits for that rank's stamp (it
blocks meanwhile on the node's lock while that rank hashes) before it hashes the cache itself."""

_verified: dict[str, str] = {}
"""Cache directories this process verified, with a digest of their entries' (name, size, mtime) then: checked
once unless a file changes. ``prepare`` hands them to the processes it starts (``VERIFIED_ENV``)."""
VERIFIED_ENV = "SHARDYARD_VERIFIED_CACHES"


# ----------------------------------------------------------------------------------------------- locks
@contextlib.contextmanager
def _held(path: str) -> Iterator[OSError | None]:
    """An exclusive ``flock`` on ``path`` for the block (released when its descriptor closes). Yields None, or the
    error of a file system that refuses locks (then nothing is held)."""
    try:  # read-write: NFS emulates flock with byte-range locks, whose exclusive kind needs a writable descriptor
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (PermissionError, OSError) as e:
        if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
            raise
        fd = os.open(path, os.O_RDONLY)  # a lock file another user created, or a read-only mount: flock may still work
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            refused = None
        except OSError as e:
            if e.errno not in LOCKS_REFUSED:
                raise
            refused = e
        yield refused
    finally:
        os.close(fd)


def _node_dir() -> str:
    """A directory on this node's own disk, shared by its ranks: ``$TMPDIR`` (per job and node under Slurm), else
    the system's temp directory. Its file system always locks."""
    return os.environ.get("TMPDIR") or tempfile.gettempdir()


@contextlib.contextmanager
def _node_locked(key: str) -> Iterator[None]:
    """A lock that this node's processes share, and no other node's: named by ``key``, in the node's temp dir."""
    name = f"shardyard-{os.getuid()}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):  # no temp directory to lock in: unlocked (the work may be done twice)
            stack.enter_context(_held(os.path.join(_node_dir(), name)))
        yield


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """One builder per machine: ``flock`` on ``path`` beside the cache; the others wait, then find its result.
    Where the file system refuses locks, the node's own lock: this machine's processes still build once, and other
    hosts (whose lock was never shared anyway) race to publish: ``publish`` lets the first one win."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _held(path) as refused:
        if refused is None:
            yield
            return
        print(f"shardyard | the file system under {os.path.dirname(path)} refuses file locks ({refused.strerror}): "
              "this machine builds the cache once, under a lock in its temp directory; another host may build it "
              "too, and the first to publish it wins", flush=True)
        with _node_locked(f"build|{os.path.realpath(path)}"):
            yield


# ---------------------------------------------------------------------------------------- verification
def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _listing(out: str) -> str:
    """The cache's files as they are now (name, size, mtime), what this process verified (``_remember``); raises
    ``FileNotFoundError`` when ``out`` is missing. The stamp and its temporary copies are not the cache's: another
    host rewrites them at any time, and a temporary one vanishes when it is renamed (seen: a 2-node start whose
    rank listed one between its scandir and its stat, FileNotFoundError, in a full suite)."""
    entries = []
    for e in os.scandir(out):
        if e.name.startswith(STAMP):
            continue
        try:
            st = e.stat()
        except FileNotFoundError:
            continue  # gone since the scan: not part of the cache as it is now
        entries.append((e.name, st.st_size, st.st_mtime_ns))
    return hashlib.sha256(repr(sorted(entries)).encode()).hexdigest()


def _remember(out: str) -> None:
    _verified[out] = _listing(out)


def _share_verified() -> None:
    os.environ[VERIFIED_ENV] = json.dumps(_verified)


def _take_handed_over() -> None:
    """The caches the parent verified (``VERIFIED_ENV``), taken once."""
    if not _verified and os.environ.get(VERIFIED_ENV):
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            _verified.update({str(k): str(v) for k, v in json.loads(os.environ[VERIFIED_ENV]).items()})


def _stat_of(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _write_stamp(out: str) -> None:
    """Record every file of the manifest (and the manifest) as it is now, just hashed or written. A cache
    directory that cannot be written (read-only) gets none: it is hashed at every start, as before stamps."""
    try:
        names = [MANIFEST, *json.loads(Path(out, MANIFEST).read_text())["files"]]
        stamp = {"verified_at": time.time(), "host": socket.gethostname(),
                 "files": {name: _stat_of(os.path.join(out, name)) for name in names}}
        tmp = os.path.join(out, f"{STAMP}.{socket.gethostname()}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(stamp, f)
        os.replace(tmp, os.path.join(out, STAMP))
    except (OSError, ValueError, KeyError, TypeError):
        pass


def _stamp_holds(out: str, since: float | None = None) -> bool:
    """``out``'s stamp lists its manifest, and every listed file has the size, mtime, ctime and inode it had when
    it was hashed (``stat`` only: no byte is read); ``since``: and it was taken at or after that time."""
    try:
        stamp = json.loads(Path(out, STAMP).read_text())
        if MANIFEST not in stamp["files"] or (since is not None and float(stamp["verified_at"]) < since):
            return False
        return all(_stat_of(os.path.join(out, name)) == list(was) for name, was in stamp["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _hash_problem(out: str) -> str | None:
    """Every file of ``out``'s manifest hashed: why it does not verify, or None (then it is stamped). A cache that
    fails loses its stamp, so no rank takes it on the stamp's word."""
    problem = _manifest_problem(out)
    if problem is None:
        _write_stamp(out)
    else:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(out, STAMP))
    return problem


def _manifest_problem(out: str) -> str | None:
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
    return None


def _local_rank() -> int:
    """This process's rank on its node as its launcher says (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK:
    ``dist_env.detect``); 0 for a process no launcher started (the parent, ``shardyard data``)."""
    env = dist_env.detect()
    return env.local_rank if env is not None else 0


def _process_start() -> float:
    """When this process started (wall clock, to a second), from /proc; now where /proc cannot say."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def cache_problem(out: str, verify: str = "stamp") -> str | None:
    """Why the cache directory ``out`` cannot be used (missing, no or a broken manifest, a file missing, of
    another size or another sha256), or None when it verifies. ``verify``: ``stamp`` or ``full`` (module doc)."""
    try:
        listing = _listing(out)
    except FileNotFoundError:
        return "missing"
    _take_handed_over()
    if _verified.get(out) == listing:
        return None
    # 1. Who hashes: with `stamp`, the node's first rank to find no stamp that holds; with `full`, local rank 0,
    #    whatever the stamp, while the node's other ranks take only a stamp of this start (taken at most a minute
    #    before they started: the ranks of one start begin within seconds of each other).
    full = verify == "full"
    leader = _local_rank() == 0
    since = _process_start() - 60.0 if full else None
    takes_stamp = not (full and leader)
    if takes_stamp and _stamp_holds(out, since):
        _remember(out)
        return None
    waiting = time.monotonic()
    while True:
        # 2. The node's lock: its ranks take turns, so the first hashes and the others find its stamp.
        with _node_locked(f"verify|{os.path.realpath(out)}"):
            if takes_stamp and _stamp_holds(out, since):
                _remember(out)
                return None
            # 3. `full`'s other ranks hash it themselves when local rank 0 did not stamp it in time.
            if not full or leader or time.monotonic() - waiting > FULL_WAIT_S:
                if not os.path.isdir(out):
                    return "missing"
                problem = _hash_problem(out)
                if problem is None:
                    _remember(out)
                return problem
        time.sleep(0.5)  # `full`, not local rank 0: its stamp is not there yet


# ---------------------------------------------------------------------------------------- build, publish
def _move_aside(out: str) -> None:
    """``out`` out of the way in one rename, then removed (another host may have moved it first)."""
    aside = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".corrupt-")
    with contextlib.suppress(FileNotFoundError):
        os.replace(out, os.path.join(aside, "cache"))
    shutil.rmtree(aside, ignore_errors=True)


def publish(tmp: str, final: str, verify: str, hashes: dict[str, str] | None = None) -> None:
    """Record every file's size and sha256 in ``tmp``'s manifest, stamp it, and make it visible under ``final`` in
    one rename. ``hashes``: sha256 digests already taken as the files were written (token shards). When another
    host published ``final`` first (its lock was not this one's), its cache is verified and used, and ``tmp``
    removed; one that does not verify is replaced by this one."""
    hashes = hashes or {}
    files = {name: {"size": os.path.getsize(os.path.join(tmp, name)),
                    "sha256": hashes.get(name) or _sha256(os.path.join(tmp, name))}
             for name in sorted(os.listdir(tmp)) if name not in (MANIFEST, STAMP)}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"key": os.path.basename(final), "files": files}, f, indent=1)
    _write_stamp(tmp)  # the files as written and hashed: no rank hashes a fresh build again
    while True:
        try:
            os.replace(tmp, final)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        problem = cache_problem(final, verify)
        if problem is None:
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"shardyard | {final} was published by another host meanwhile; it verifies: using it, this host's "
                  "build removed", flush=True)
            return
        print(f"shardyard | {final}, published by another host meanwhile, does not verify ({problem}): replacing it "
              "with this host's build", flush=True)
        _move_aside(final)


def cached(out: str, what: str, build: Callable[[str], None], verify: str = "stamp") -> str:
    """The cache directory ``out``, verified; built (once per machine, under a file lock) when it is missing, and
    rebuilt, saying so, when it does not verify (never used as it is)."""
    if cache_problem(out, verify) is None:
        return out
    with _locked(out + ".lock"):
        problem = cache_problem(out, verify)  # another process may have built it meanwhile
        if problem is None:
            return out
        if problem != "missing":
            print(f"shardyard | the cached {what} {out} does not verify ({problem}): rebuilding it", flush=True)
            _move_aside(out)
        build(out)
    return out


def cache_key(target: str, val_fraction: float, fingerprint: str, extra: str) -> str:
    h = hashlib.sha256(f"{target}|{val_fraction}|{fingerprint}|{extra}".encode())
    return f"{target.rsplit('.', 1)[-1].lower()}-{h.hexdigest()[:16]}"


def verify_mode(d: DictConfig) -> str:
    """``data.verify`` as a plain string (``stamp`` for a config written before the key existed)."""
    return str(d.get("verify") or "stamp")


# ------------------------------------------------------------------------------------------- tokenizers
def tokenizer_dir(d: DictConfig, sources: list[Source]) -> str:
    """A byte-level BPE tokenizer trained on the first ``data.tokenizer.train_bytes`` of the train text (of a
    mixture: an equal share of each source's, so that reweighting a mixture keeps its tokenizer and caches)."""
    fingerprint = "|".join(f"{s.target}:{s.docs.fingerprint()}" for s in sources)
    target = sources[0].target if len(sources) == 1 else "mixture"
    digits = "|digits" if d.tokenizer.get("split_digits") else ""  # absent: the key of caches made before the key
    key = cache_key(target, d.val_fraction, fingerprint, f"bpe|{d.tokenizer.vocab_size}|{d.tokenizer.train_bytes}{digits}")
    out = os.path.join(d.cache_dir, "tokenizers", f"{key}-bpe{d.tokenizer.vocab_size}")
    return cached(out, "tokenizer", lambda out: _train_tokenizer(d, sources, out), verify_mode(d))


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
    if d.tokenizer.get("split_digits"):  # every digit its own token (as DeepSeek's and LLaMA's tokenizers): numbers
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=d.tokenizer.vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=".tmp-tok-")
    fast.save_pretrained(tmp)
    publish(tmp, out, verify_mode(d))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


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


# ------------------------------------------------------------------------------------------ token caches
SHARDS_FORMAT = "shards-v1"
"""``meta.json``'s ``format`` of a token cache written as shards (``shardyard.data.shards``)."""


def token_dir(d: DictConfig, s: Source, tok_dir: str) -> str:
    tok_hash = hashlib.sha256(Path(tok_dir, "tokenizer.json").read_bytes()).hexdigest()[:12]
    rows = hasattr(s.docs, "tokenize_rows")
    if rows:  # SFT rows depend on the row length and on the tokenizer's chat template and special tokens
        extra = b"".join(Path(tok_dir, f).read_bytes() for f in ("tokenizer_config.json", "chat_template.jinja",
                                                                "special_tokens_map.json") if Path(tok_dir, f).is_file())
        tok_hash += f"|rows-v2|{d.seq_len}|" + hashlib.sha256(extra).hexdigest()[:8]  # v2: one .npy per array
    else:
        tok_hash += f"|{SHARDS_FORMAT}"
    out = os.path.join(d.cache_dir, "tokens", cache_key(s.target, d.val_fraction, s.docs.fingerprint(), f"tok|{tok_hash}"))
    if rows:
        return cached(out, "token arrays", lambda out: _tokenize_rows(d, s.docs, tok_dir, out), verify_mode(d))
    return cached(out, "token shards", lambda out: _tokenize(d, s, tok_dir, out), verify_mode(d))


def num_proc(d: DictConfig) -> int:
    """``data.num_proc``, or the cores this process may use."""
    n = d.num_proc if d.num_proc is not None else len(os.sched_getaffinity(0))
    if not isinstance(n, int) or n < 1:
        raise UserError("data.num_proc", n, "Tokenization needs at least one process.",
                        "Use data.num_proc=1 or more, or null for one per core.")
    return n


def _tokenize(d: DictConfig, s: Source, tok_dir: str, out: str) -> None:
    """Token shards of ``s`` (``shardyard.data.shards.build``), built in ``<out>.partial-<host>`` (kept when the build
    is killed, and resumed), then published under ``out`` with every file's size and sha256."""
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
    publish(partial, out, verify_mode(d),
            hashes={sh["file"]: sh["sha256"] for split in built["shards"].values() for sh in split})


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
        json.dump({"rows": {s: int(len(next(iter(built[s].values())))) for s in ("train", "val")}, "stats": built["stats"],
                   "tokenizer": tok_dir, "vocab_size": len(tok)}, f, indent=1)
    publish(tmp, out, verify_mode(d))
