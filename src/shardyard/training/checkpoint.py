"""Checkpoints: sharded state in each engine's natural form, hashed, published atomically, resumed exactly.

Layout of ``checkpoint.dir`` (default ``<run_dir>/checkpoints``)::

    step-00000003/      engine files (DCP shards, DeepSpeed partitions or rank-0 files) + meta.json
    step-00000006/
    latest              name of the newest complete checkpoint
    .tmp-step-00000009  (only while it is being written; never looks complete; removed at the next start)

A checkpoint is written under ``.tmp-…`` by every rank, each with its RNG state in ``rng-rank<R>.json``; then every
rank hashes (sha256) and fsyncs the files it wrote (DCP's ``__R_0.distcp``, DeepSpeed's ``zero_pp_rank_R_*``, its
RNG file, the HF export's shards it wrote; rank 0 the rest), in parallel, and hands rank 0 their manifest
(``part-rank<R>.json``); a large file one rank wrote for all (ZeRO-1/2's ``mp_rank_00_model_states.pt``: the whole
16-bit model) is hashed in pieces, piece i by rank i % world (``piece_bytes``). Rank 0 merges them into
``meta.json`` (step, tokens, data position, scheduler and loss-scaler state, engine, world size, the model's
architecture and the manifest: every file's size and sha256 or its pieces', dotfiles such as DCP's ``.metadata``
included: nothing in it but the manifest grows with the world),
fsyncs the directories, renames the directory, fsyncs its parent and only then moves ``latest``; ``keep_last``
prunes after that, by ``stat`` alone (nothing is read back). Resume verifies the hashes, each rank its share
(what it reads back, and its pieces), and, with ``resume=auto``, walks back to the newest checkpoint that verifies and loads.
``async_save``: the state is copied into one host buffer, reused by every save of the run (``HostStaging``:
torch's ``DefaultStager``, pinned on CUDA), and everything after it runs in a thread, whose collectives run on a
gloo group of their own with the run's ``launch.timeout_s``.
"""

from __future__ import annotations

import base64
import errno
import glob
import hashlib
import json
import os
import random
import shutil
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from shardyard.backends import Backend
from shardyard.core import moved
from shardyard.core.facts import Plan

from shardyard.core import drills
from shardyard import monitors
from shardyard.core.errors import UserError
from shardyard.models.shape import signature
from shardyard.training import integrity

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def rng_of(path: str, meta: dict, rank: int) -> dict:
    """``rank``'s RNG state in the checkpoint at ``path``: its own ``rng-rank<r>.json`` (verified with the rank's
    share), or, in a checkpoint saved before those, its entry of ``meta.json``'s ``rng`` (every rank's)."""
    if "rng" in meta:
        return meta["rng"][rank]
    with open(os.path.join(path, f"rng-rank{rank}.json")) as f:
        return json.load(f)


def _fsync_dirs(path: str) -> None:
    """fsync every directory under ``path`` and ``path`` itself (deepest first): the names of the files in it
    are durable, not only their bytes."""
    for root, _, _ in sorted(os.walk(path), key=lambda w: -w[0].count(os.sep)):
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names
               if os.path.isfile(os.path.join(root, n)))


class CheckpointSaveError(UserError):
    """A save that failed on the disk (full, read-only, no permission): one paragraph, exit code 1 (the run
    failed; the config is not at fault)."""

    exit_code = 1


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed save: raised directly, chained, or inside DCP's CheckpointException (which
    carries every failed rank's exception)."""
    seen: list[BaseException] = [e]
    while seen:
        x = seen.pop()
        if isinstance(x, OSError) and x.errno is not None:
            return x
        seen += [c for c in (x.__cause__, x.__context__) if c is not None]
        seen += [pair[0] for pair in getattr(x, "failures", {}).values()]
    return None


class Checkpointer:
    def __init__(self, checkpoint: DictConfig, backend: Backend, plan: Plan, *, run_dir: str, tokenizer_dir: str,
                 engine: str, model_name: str, restarted: bool, objective: Any = None, timeout_s: float = 1800):
        """``checkpoint``: the run's ``checkpoint`` section. The rest come from other concerns, by name:
        ``engine`` (``backend.name``) and ``model_name`` (``model.name``) are recorded in ``meta.json``;
        ``restarted``: this start is a restart of the workers (``launch.max_restarts``), which resumes from the
        run's own newest good checkpoint whatever ``checkpoint.resume`` says. ``objective``: the run's objective
        (``shardyard.objectives``), whose own state (GRPO's batch of rollouts in use) goes into each checkpoint.
        ``timeout_s``: ``launch.timeout_s``, the timeout of the background saves' process group (as of the
        training's: a lost node ends a save's collective then, not after torch's default 30 minutes)."""
        self.backend, self.plan, self.tokenizer_dir, self.objective = backend, plan, tokenizer_dir, objective
        self.timeout_s = timeout_s
        self.c, self.run_dir, self.engine, self.model_name, self.restarted = (checkpoint, run_dir, engine,
                                                                              model_name, restarted)
        self.dir = self.c.dir or os.path.join(run_dir, "checkpoints")
        self.rank0 = backend.rank == 0
        self.signature = signature(backend.hf_model())  # parameter names and full shapes
        self.start = -1  # the step resumed from; -1: a fresh run, whose own log holds its whole curve
        self.history: dict[str, list] = {"eval_losses": [], "train_losses": [], "grad_norms": []}
        """The run's curves up to the step it resumed from (from the checkpoint), for its summary."""
        self._good: set[str] = set()
        """Checkpoints verified or written by this process (checking each once is enough for ``keep_last``)."""
        self.verified_bytes = 0
        """Bytes this rank hashed to verify the checkpoint it resumed from (its ``share``)."""
        self._pending: Any = None
        """The background save in flight (``checkpoint.async_save``): a Future."""
        self._pool: Any = None
        self._group: Any = None
        self._staging: HostStaging | None = None
        self._exported: list[str] = []
        """The HF export's files this rank wrote in the save in progress (``checkpoint.export_hf``): it hashes them."""
        """The host buffer of background saves, made at the first one and reused by every later one."""
        self.last_saved = -1
        """The step of the newest save this process started (a background one may be in flight)."""

    # ----------------------------------------------------------------------------------------- saving
    def export_final(self) -> str | None:
        """``checkpoint.save_final``: the HF export at the end of the run, in ``<run_dir>/hf`` (every rank: sharded
        engines gather the weights); None when not asked."""
        self.wait()
        if not self.c.save_final:
            return None
        from shardyard.training.export import save_hf

        return save_hf(self.backend, self.tokenizer_dir, os.path.join(self.run_dir, "hf"))

    def maybe_save(self, step: int, stream) -> None:
        if self.c.every_n_steps and step % self.c.every_n_steps == 0:
            self.save(step, stream)

    def save(self, step: int, stream) -> str:
        """Every rank writes its part; every rank hashes and fsyncs the files it wrote and hands rank 0 their
        manifest; rank 0 merges the manifests, writes meta.json and publishes. ``checkpoint.async_save``: the
        state is copied to host memory here and everything after runs in a thread (``_complete``)."""
        t0 = time.perf_counter()
        self.wait()  # the last background save first: one at a time, in order
        name = f"step-{step:08d}"
        tmp, final = os.path.join(self.dir, f".tmp-{name}"), os.path.join(self.dir, name)
        rank, background = self.backend.rank, bool(self.c.get("async_save", False))
        error: BaseException | None = None
        write = None
        rng: dict = {}
        try:
            if self.rank0:
                shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash mid-save
                os.makedirs(tmp)
            drills.save_point("begin", step, rank)
            self.backend.barrier()
            if background:  # collective: every rank stages its part in host memory, then writes it in a thread
                if self._staging is None:
                    self._staging = HostStaging(pin=self.backend.device.type == "cuda")
                write = self.backend.save_checkpoint_async(tmp, self._async_group(),  # type: ignore[attr-defined]
                                                           self._staging)
            else:
                self.backend.save_checkpoint(tmp)  # collective: every rank writes its own part
                drills.save_point("engine_written", step, rank)
            if self.objective is not None:  # e.g. GRPO's rollouts in use, rank r's in rollouts/rank<r>/
                self.objective.save(tmp, rank, step)
            rng = rng_state()
            self._exported = []
            if self.c.export_hf:
                from shardyard.training.export import save_hf

                written: list[str] = []  # the export's files this rank wrote: it hashes them (its shards)
                save_hf(self.backend, self.tokenizer_dir, os.path.join(tmp, integrity._EXPORT.rstrip("/")),
                        written=written)
                self._exported = [integrity._EXPORT + rel for rel in written]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = e
        # Every rank learns whether all wrote (or staged) their part (one all-reduce, in place of a barrier): a rank
        # that failed alone must not remove the directory under the others, nor leave them waiting.
        if not self._all_ok(error is None):
            self._save_failed(step, tmp, error)
        self.last_saved = step
        facts = {"tokens_seen": step * self.plan.tokens_per_step, "data": stream.position(step),
                 "training_state": self.backend.training_state(),
                 "history": self._history_until(step) if self.rank0 else None}  # metrics.jsonl: rank 0's alone
        if not background:
            self._complete(step, tmp, final, None, rng, facts, None, t0)
            return final
        from concurrent.futures import ThreadPoolExecutor

        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="shardyard-save")
        self._pending = self._pool.submit(self._complete, step, tmp, final, write, rng, facts, self._async_group(),
                                          t0, time.perf_counter() - t0)
        return final

    def wait(self) -> None:
        """Wait for the background save in flight, if any (``checkpoint.async_save``); its failure is raised
        here, on every rank (they decided it together)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """The end of the run, whichever way it ends (before the engine's groups are torn down): the background
        save in flight finishes (its failure is raised), and its thread goes."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._staging is not None:  # the host buffer goes (unpinned) once no save can use it
                self._staging.close()
                self._staging = None

    def save_now(self, step: int, stream) -> None:
        """A checkpoint of ``step`` before the run stops early (a preemption): the save of ``step`` in flight is
        finished, or a new one written (every rank together); either way it is published when this returns."""
        if self.last_saved != step:
            self.save(step, stream)
        self.wait()

    def _complete(self, step: int, tmp: str, final: str, write: Any, rng: dict, facts: dict, group: Any,
                  t0: float, blocked: float | None = None) -> None:
        """After the engine's write: this rank's files hashed and fsynced by this rank (its manifest and RNG
        state handed to rank 0 in ``part-rank<r>.json``), then rank 0 publishes and prunes. ``write``: the
        background write to wait for first; ``group``: the process group of a background save (gloo, its own);
        ``t0``: when the save began; ``blocked``: how long the step waited for a background save."""
        rank, world = self.backend.rank, self.backend.world_size
        hashing = 0.0
        error: BaseException | None = None
        try:
            if write is not None:
                write.result()
                drills.save_point("engine_written", step, rank)
            # this rank's RNG state in a file of its own (meta.json does not grow with the world; each rank reads
            # back only its own), hashed with its files: written before "rank_written", as the engine's files
            _write_atomic(os.path.join(tmp, f"rng-rank{rank}.json"), json.dumps(rng))
            drills.save_point("rank_written", step, rank)
            t = time.perf_counter()
            part = self._hash_share(tmp, rank, world)
            hashing = time.perf_counter() - t
            part["staged"] = self._staging.bytes if self._staging is not None else 0  # a background save's host copy
            _write_atomic(os.path.join(tmp, f"part-rank{rank}.json"), json.dumps(part))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            error = e
        if not self._all_ok(error is None, group):
            self._save_failed(step, tmp, error, group)
        if self.rank0:
            try:
                self._publish(tmp, final, step, facts)
            except OSError as e:
                error = e
        if not self._all_ok(error is None, group):  # rank 0's publish: the others stop with it
            self._save_failed(step, tmp, error, group)
        if self.rank0:
            self._prune(final, step)
        self._all_ok(True, group)  # as a barrier: nobody goes on before the checkpoint is published
        if self.rank0:
            took = time.perf_counter() - t0
            waited = (f"the step waited {blocked:.2f} s, then the background write, hashing and publish took "
                      f"{took:.2f} s" if blocked is not None else f"the step waited {took:.2f} s")
            staged = (f"; staged {_size(self._staging.bytes)} in host memory (one buffer, reused by every save)"
                      if self._staging is not None else "")
            print(f"shardyard | saved {os.path.basename(final)} ({_size(_du(final))}): {waited}; rank 0 hashed and "
                  f"fsynced its files in {hashing:.2f} s{staged}", flush=True)

    def _hash_share(self, tmp: str, rank: int, world: int) -> dict:
        """What this rank hands rank 0 (``part-rank<r>.json``): the manifest of the files it wrote, hashed and
        fsynced here (its engine shards and RNG state, the HF export's shards it wrote; rank 0 the other files),
        and its pieces of the large files one rank wrote for all (``piece_bytes``: every rank lists the same
        files, whole once the engine's write returned on every rank: after the save's all-reduce, or DCP's own
        finish for a background save), and the bytes it read. The writer of a file hashed in pieces fsyncs it
        without reading it."""
        files = [rel for rel in integrity._files(tmp) if not integrity._HANDOFF.match(rel)]
        cut: dict[str, tuple[int, int]] = {}
        for rel in files:
            if integrity._shared(rel):
                size = os.path.getsize(os.path.join(tmp, rel))
                if integrity.piece_bytes(size, world):
                    cut[rel] = (size, integrity.piece_bytes(size, world))
        exported = set(self._exported)
        mine = [rel for rel in files if rel not in cut and (
            rel in exported if rel.startswith(integrity._EXPORT) else integrity.writer(rel, world) == rank)]
        manifest = integrity._manifest(tmp, sync=True, files=mine)  # what each rank wrote: hashed once, in parallel
        todo = [(rel, i, start, length) for rel, (size, step) in sorted(cut.items())
                for i, (start, length) in enumerate(integrity._pieces_of(size, step)) if i % world == rank]
        digests = integrity._hash_pieces(tmp, todo)
        pieces: dict[str, dict] = {rel: {"bytes": size, "piece_bytes": step, "digests": {}}
                                   for rel, (size, step) in cut.items()}
        for (rel, i, _, _), digest in zip(todo, digests):
            pieces[rel]["digests"][str(i)] = digest
        if rank == 0:
            for rel in cut:  # rank 0 wrote them: durable before the publish
                fd = os.open(os.path.join(tmp, rel), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        hashed = sum(e["bytes"] for e in manifest.values()) + sum(length for _, _, _, length in todo)
        return {"manifest": manifest, "pieces": pieces, "hashed": hashed}

    def _async_group(self) -> Any:
        """The gloo group of background saves (DCP's own collectives and ours run in a thread beside the
        training's, so never on its group); made at the first one (collective), with the run's timeout
        (``launch.timeout_s``): ``new_group`` would give it torch's default of 30 minutes, not the world's."""
        import datetime

        import torch.distributed as dist

        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._group

    def _publish(self, tmp: str, final: str, step: int, facts: dict) -> None:
        """Rank 0: every rank's manifest merged (a file no rank claimed is hashed here), meta.json written, the
        directories fsynced, then one rename and ``latest``."""
        world = self.backend.world_size
        manifest: dict[str, dict] = {}
        hashed: list[int] = []
        staged: list[int] = []
        pieces: dict[str, dict] = {}
        for r in range(world):
            f = os.path.join(tmp, f"part-rank{r}.json")
            with open(f) as fh:
                part = json.load(fh)
            os.remove(f)
            for rel, entry in part["manifest"].items():
                # who hashed it verifies it on resume: recorded where the name does not say (the export's shards)
                manifest[rel] = entry if integrity.writer(rel, world) == r else {**entry, "rank": r}
            for rel, got in part["pieces"].items():
                pieces.setdefault(rel, {**got, "digests": {}})["digests"].update(got["digests"])
            hashed.append(part["hashed"])
            staged.append(part.get("staged", 0))
        for rel, got in pieces.items():
            n = len(integrity._pieces_of(got["bytes"], got["piece_bytes"]))
            if sorted(got["digests"], key=int) != [str(i) for i in range(n)]:
                raise OSError(errno.EIO, f"the pieces of {rel} hashed by the ranks are not all there "
                              f"({len(got['digests'])} of {n})")
            manifest[rel] = {"bytes": got["bytes"], "piece_bytes": got["piece_bytes"],
                             "pieces": [got["digests"][str(i)] for i in range(n)]}
        drills.save_point("before_hash", step, 0)
        unclaimed = [rel for rel in integrity._files(tmp) if rel not in manifest]
        manifest.update(integrity._manifest(tmp, sync=True, files=unclaimed))
        hashed[0] += sum(manifest[rel]["bytes"] for rel in unclaimed)
        meta = {
            "step": step, "tokens_seen": facts["tokens_seen"], "data": facts["data"],
            "training_state": facts["training_state"], "engine": self.engine,
            "format": self.backend.checkpoint_format, "world_size": self.backend.world_size,
            "global_batch_size": self.plan.global_batch_size, "model_name": self.model_name,
            "history": facts["history"],
            "model": self.signature,
            "model_hash": hashlib.sha256(json.dumps(self.signature, sort_keys=True).encode()).hexdigest()[:16],
            "manifest": dict(sorted(manifest.items())),
            "hashed_bytes": hashed,  # by each rank, when it was saved (each the files it wrote, and its pieces)
        }
        if any(staged):  # a background save: the host copy each rank staged (bench/checkpoint.py sets it by the plan's)
            meta["staged_bytes"] = staged
        meta["meta_sha256"] = integrity._meta_digest(meta)
        drills.save_point("before_meta", step, 0)
        _write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        drills.save_point("before_fsync", step, 0)
        _fsync_dirs(tmp)
        drills.save_point("before_rename", step, 0)
        aside = None
        if os.path.exists(final):  # the same step saved again after a resume: replace it only now
            aside = os.path.join(self.dir, f".tmp-{os.path.basename(final)}.replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)  # a rename, so a kill never leaves a half-deleted step-N behind
        os.replace(tmp, final)  # complete checkpoints appear in one rename
        _fsync_dir(self.dir)
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
        drills.save_point("before_latest", step, 0)
        _write_atomic(os.path.join(self.dir, "latest"), os.path.basename(final) + "\n")
        _fsync_dir(self.dir)

    def _prune(self, final: str, step: int) -> None:
        """Keep the newest ``keep_last`` checkpoints that look whole; delete older ones only once the new one is
        published, and never the newest whole one. Nothing is read back: the new checkpoint's hashes were just
        taken by the ranks that wrote it, and an older one counts when its meta.json verifies and every file of
        its manifest is there at its size (``stat``)."""
        drills.save_point("before_prune", step, 0)
        self._good.add(final)
        if self.c.keep_last <= 0:
            return
        good = []
        for path in reversed([p for p in self.complete() if p <= final]):  # names sort by step
            if path == final or path in self._good or integrity.verify(path, read=False) is None:
                self._good.add(path)
                good.append(path)
            if len(good) == self.c.keep_last:
                break
        else:
            return  # fewer good ones than keep_last: keep them all
        for old in self.complete():
            if old < good[-1]:  # names sort by step
                shutil.rmtree(old, ignore_errors=True)
                self._good.discard(old)

    def _save_failed(self, step: int, tmp: str, e: BaseException | None, group: Any = None) -> None:
        """A save that failed on some rank (every rank calls this together): rank 0 removes the partial
        directory; a rank whose own write failed on the disk raises the paragraph (exit 1), any other failure
        is raised as it was; a rank that wrote its part raises a note naming the others (rank 0 prints it)."""
        written = _du(tmp) if self.rank0 and os.path.isdir(tmp) else 0
        if self.rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        everyone = self._all_ok(e is not None, group)  # (also: the directory is gone before any rank reports)
        if e is None:
            raise CheckpointSaveError("checkpoint.dir", self.dir, f"Saving the checkpoint of step {step} failed on "
                                      "another rank (its error is above). The partial directory was removed; the "
                                      "older checkpoints are intact.", "See the other rank's error; then run the "
                                      "same command with checkpoint.resume=auto.").on_every_rank()
        err = _os_error(e)
        if err is None:
            raise e
        older = [os.path.basename(p) for p in self.complete()]
        previous = _du(os.path.join(self.dir, older[-1])) if older else 0
        needed = max(written, previous)
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = 0
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = ("Free space there (or lower checkpoint.keep_last), or set checkpoint.dir to a disk with room; "
               "then run the same command with checkpoint.resume=auto." if full else
               "Make that directory writable by this user, or set checkpoint.dir to one that is; then run the same "
               "command with checkpoint.resume=auto.")
        out = CheckpointSaveError(
            "checkpoint.dir", self.dir,
            f"Saving the checkpoint of step {step} failed: {err.strerror or err} ({errno.errorcode.get(err.errno or 0, '?')}"
            f"{', ' + err.filename if err.filename else ''}). It needs about {_size(needed)} ({needed:,} bytes: "
            f"{'the previous checkpoint' if previous >= written else 'what was written before it failed'}) and "
            f"{_size(free)} ({free:,} bytes) are free there. The partial directory was removed; "
            + (f"the older checkpoints ({', '.join(older)}) are intact." if older else "there is no older checkpoint."),
            fix)
        raise (out.on_every_rank() if everyone else out) from e  # all failed alike (DCP's collective error): rank 0 says it

    def _history_until(self, step: int) -> dict[str, list]:
        """The curve up to ``step``: what the run resumed with, then what this run logged since (its
        metrics.jsonl, whose older lines from crashed attempts are left out by step)."""
        own = monitors.history(self.run_dir, step)
        return {k: [p for p in v if p[0] <= self.start] + [p for p in own[k] if p[0] > self.start]
                for k, v in self.history.items()}

    def complete(self) -> list[str]:
        """Renamed (complete-looking) checkpoints, oldest first."""
        return sorted(p for p in glob.glob(os.path.join(self.dir, "step-*")) if os.path.isdir(p))

    # ---------------------------------------------------------------------------------------- resuming
    def candidates(self) -> tuple[list[str], bool]:
        """The checkpoints to try, best first, and whether the user named one (then only that one, and a
        problem with it is an error). A restart of the workers (``launch.max_restarts``) resumes from the
        run's own newest good checkpoint, whatever ``checkpoint.resume`` says; with a path, that path is the
        last resort (no checkpoint of its own yet)."""
        want, restarted = self.c.resume, self.restarted
        if want is None and not restarted:
            return [], False
        own = list(reversed(self.complete()))
        if want == "auto" or want is None:
            return own, False
        if restarted:
            return own + [want] if want not in own else own, False
        return [want], True

    def _remove_stale(self) -> None:
        """Rank 0, at start: ``.tmp-step-*`` of a save that was killed, in this run's own checkpoint dir. A
        complete ``step-N`` that a killed publish had renamed aside (``.tmp-step-N.replaced``, to replace it
        with a new save of the same step) and not yet replaced is renamed back first."""
        for aside in glob.glob(os.path.join(self.dir, ".tmp-step-*.replaced")):
            final = os.path.join(self.dir, os.path.basename(aside)[len(".tmp-"):-len(".replaced")])
            if not os.path.exists(final):
                print(f"shardyard | restoring {final} from {aside}: a save of the same step was killed while "
                      "replacing it", file=sys.stderr, flush=True)
                os.replace(aside, final)
        for path in sorted(glob.glob(os.path.join(self.dir, ".tmp-step-*")) + glob.glob(os.path.join(self.dir, "latest.tmp"))):
            print(f"shardyard | removing {path}: an unfinished save of an earlier attempt", file=sys.stderr, flush=True)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)

    def _all_ok(self, ok: bool, group: Any = None) -> bool:
        """True when ``ok`` holds on every rank (one all-reduce; a rank-0 decision when the others pass True).
        ``group``: a background save's own (gloo, host tensors), else the engine's."""
        if group is not None:
            import torch.distributed as dist

            flag = torch.tensor([0.0 if ok else 1.0])
            dist.all_reduce(flag, group=group)
            return float(flag.item()) == 0.0
        flag = torch.tensor([0.0 if ok else 1.0], device=self.backend.device)
        return float(self.backend.all_reduce_mean(flag).item()) == 0.0

    def restore(self) -> int:
        """Load the checkpoint to resume from, if any; returns the step to continue from. ``resume=auto``
        walks back from the newest checkpoint to the newest that verifies (sha256 of every file, on rank 0,
        which the others follow) and loads (on every rank: a failure anywhere moves all ranks on together)."""
        if self.rank0:
            self._remove_stale()
        paths, named = self.candidates()
        skipped: list[str] = []
        for path in paths:
            # each rank verifies its share (what it wrote and reads back; rank 0 the shared files): the bytes are
            # read once over the world, in parallel
            problem, self.verified_bytes = integrity.verify_share(path, self.backend.rank, self.backend.world_size)
            if problem is not None and not self.rank0:
                print(f"shardyard | rank {self.backend.rank}: {path}: {problem}", file=sys.stderr, flush=True)
            if not self._all_ok(problem is None):
                problem = problem or "another rank found it damaged (its line is above)"
                if named:
                    raise UserError("checkpoint.resume", path, f"That checkpoint cannot be used: {problem}.",
                                    "Point it at a complete checkpoint directory, or use checkpoint.resume=auto."
                                    ).on_every_rank()
                skipped.append(self._skip(path, problem))
                continue
            self._good.add(path)
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
            self._check_compatible(path, meta)  # a config mismatch, the same for every checkpoint: an error
            error: BaseException | None = None
            try:
                self.backend.load_checkpoint(path, meta)
                self.backend.load_training_state(meta["training_state"])
                if self.objective is not None:
                    self.objective.load(path, self.backend.rank, meta["world_size"] == self.backend.world_size)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                error = e
            if not self._all_ok(error is None):
                if named:
                    raise error or UserError("checkpoint.resume", path, "Another rank could not load it (its error "
                                             "is above).", "Use another checkpoint, or checkpoint.resume=auto.")
                self._good.discard(path)
                why = (error.paragraph() if isinstance(error, UserError) else
                       f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}" if error
                       else "another rank")
                skipped.append(self._skip(path, f"it could not be loaded ({why})"))
                continue
            return self._resumed(path, meta, skipped)
        if skipped:
            raise UserError("checkpoint.resume", self.c.resume, f"None of the {len(skipped)} checkpoint(s) in "
                            f"{self.dir} can be used: {' '.join(skipped)}",
                            "Resume from a checkpoint of another run (checkpoint.resume=PATH), or start this "
                            "recipe in a new run dir (hydra.run.dir=...). The damaged checkpoints are left as they "
                            "are.").on_every_rank()
        return 0

    def _set_aside_newer(self, path: str) -> None:
        """Rank 0, resuming from ``path`` in this run's checkpoint dir while newer checkpoints are there (skipped
        ones, or ``checkpoint.resume=PATH`` rolling back): they belong to a timeline this run leaves. They are
        renamed to ``abandoned-step-N-<time>`` (nothing deleted), so that ``resume=auto`` never jumps back to
        them and ``keep_last`` never counts them."""
        import time

        newer = [p for p in self.complete() if p > path] if os.path.dirname(os.path.abspath(path)) == \
            os.path.abspath(self.dir) else []
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for p in newer:
            aside = os.path.join(self.dir, f"abandoned-{os.path.basename(p)}-{stamp}")
            print(f"shardyard | resuming from {os.path.basename(path)}: the newer {os.path.basename(p)} is left "
                  f"aside as {aside}", file=sys.stderr, flush=True)
            os.replace(p, aside)
        if newer:
            _write_atomic(os.path.join(self.dir, "latest"), os.path.basename(path) + "\n")

    def _skip(self, path: str, why: str) -> str:
        if self.rank0:
            print(f"shardyard | checkpoint.resume=auto: skipping {path}: {why}; trying the previous one",
                  file=sys.stderr, flush=True)
        return f"{os.path.basename(path)}: {why}."

    def _resumed(self, path: str, meta: dict, skipped: list[str]) -> int:
        if self.rank0:
            self._set_aside_newer(path)
        self.start = meta["step"]
        self.history = meta.get("history") or monitors.history(self.run_dir, self.start)
        if meta["world_size"] == self.backend.world_size:
            set_rng_state(rng_of(path, meta, self.backend.rank))
        if self.rank0:
            fell_back = f"; {len(skipped)} newer one(s) skipped" if skipped else ""
            print(f"shardyard | resumed from {path} (step {meta['step']}, {meta['tokens_seen']:,} tokens, "
                  f"epoch {meta['data']['epoch']}; saved by {meta['engine']} x{meta['world_size']}{fell_back})",
                  flush=True)
        return meta["step"]

    def _check_compatible(self, path: str, meta: dict) -> None:
        have, want = meta["model"], self.signature
        problems = [(f"{len(names)} parameter(s) of this model are not in it", names) for names in
                    [sorted(want.keys() - have.keys())] if names]
        problems += [(f"{len(names)} of its parameters are not in this model", names) for names in
                     [sorted(have.keys() - want.keys())] if names]
        problems += [(f"{len(names)} parameter(s) differ in shape", [f"{k} {have[k]} vs {want[k]}" for k in names])
                     for names in [sorted(k for k in have.keys() & want.keys() if have[k] != want[k])] if names]
        if problems:
            shown = "; ".join(f"{what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                              for what, names in problems)
            raise UserError("checkpoint.resume", path, f"The checkpoint holds a different model "
                            f"({meta.get('model_name', '?')}): {shown}.",
                            "Resume with the model config it was saved with, or start a new run.")
        if meta["format"] != self.backend.checkpoint_format:
            raise UserError("checkpoint.resume", path, f"It was saved by backend={meta['engine']} "
                            f"({meta['format']} format), which backend={self.engine} cannot read.",
                            "Resume with the same engine family, or move weights across engines through "
                            "an HF export: model=hf model.path=<run_dir>/hf.")
        if meta["global_batch_size"] != self.plan.global_batch_size and self.rank0:
            warnings.warn(f"shardyard: the global batch changed ({meta['global_batch_size']} -> "
                          f"{self.plan.global_batch_size}); the data order continues by step, not by sample")


class HostStaging:
    """The host copy a background save writes from (``checkpoint.async_save``), made once and reused by every
    save of the run: torch's ``DefaultStager`` (``torch.distributed.checkpoint.staging``), synchronous, which
    keeps one host storage per storage of the state it stages and copies into it again at the next save; pinned
    on CUDA (the device-to-host copy runs at the link's speed). A save stages only after the previous one has
    been written (``Checkpointer.save`` waits first), so the buffer is never overwritten while in use. Passed to
    ``dcp.async_save`` as its ``async_stager``; ``bytes``: the host bytes it holds (each storage once), and
    ``storages``: their addresses, the same at every save."""

    def __init__(self, pin: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        self.bytes = 0
        self.storages: dict[int, int] = {}

    # dcp.async_save's AsyncStager protocol: stage (synchronously), then nothing to wait for
    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        from shardyard.core.memory import local

        staged = self.stager.stage(state_dict)
        storages: dict[int, int] = {}

        def walk(x: Any) -> None:
            if isinstance(x, torch.Tensor):
                st = local(x).untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(staged)
        self.storages, self.bytes = storages, sum(storages.values())
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.stager.close()


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# The public names that moved out (core.moved.NAMES_MOVED) still import from here, with a deprecation line.
__getattr__ = moved.names_moved_from(__name__)
