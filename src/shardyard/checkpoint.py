"""Checkpoints: sharded state in each engine's natural form, published atomically, resumed exactly.

Layout of ``checkpoint.dir`` (default ``<run_dir>/checkpoints``)::

    step-00000003/      engine files (DCP shards, DeepSpeed partitions or rank-0 files) + meta.json
    step-00000006/
    latest              name of the newest complete checkpoint
    .tmp-step-00000009  (only while it is being written; never looks complete)

A checkpoint is written under ``.tmp-…`` by every rank, then rank 0 writes ``meta.json`` (step, tokens,
data position, every rank's RNG states, scheduler and loss-scaler state, engine, world size, the model's
architecture and a manifest of file sizes), renames the directory and only then moves ``latest``.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import random
import shutil
import warnings
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from shardyard.backends import Backend
from shardyard.config.validate import Plan

from shardyard import drills, monitors
from shardyard.errors import UserError
from shardyard.model import signature

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


def _manifest(path: str) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)):
        if os.path.isfile(f) and os.path.basename(f) != "meta.json":
            out[os.path.relpath(f, path)] = os.path.getsize(f)
    return out


def verify(path: str) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact, else what is wrong with it."""
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return "it has no meta.json (it was never completed)"
    except (OSError, json.JSONDecodeError) as e:
        return f"its meta.json is unreadable ({e})"
    for rel, size in meta.get("manifest", {}).items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return f"{rel} is missing"
        if os.path.getsize(file) != size:
            return f"{rel} is truncated or corrupt ({os.path.getsize(file)} bytes, {size} written)"
    return None


class Checkpointer:
    def __init__(self, cfg: DictConfig, backend: Backend, plan: Plan, tokenizer_dir: str):
        self.cfg, self.backend, self.plan, self.tokenizer_dir = cfg, backend, plan, tokenizer_dir
        self.c = cfg.checkpoint
        self.dir = self.c.dir or os.path.join(cfg.run_dir, "checkpoints")
        self.rank0 = backend.rank == 0
        self.signature = signature(backend.hf_model())  # parameter names and full shapes
        self.start = -1  # the step resumed from; -1: a fresh run, whose own log holds its whole curve
        self.history: dict[str, list] = {"eval_losses": [], "train_losses": [], "grad_norms": []}
        """The run's curves up to the step it resumed from (from the checkpoint), for its summary."""

    # ----------------------------------------------------------------------------------------- saving
    def maybe_save(self, step: int, stream) -> None:
        if self.c.every_n_steps and step % self.c.every_n_steps == 0:
            self.save(step, stream)

    def save(self, step: int, stream) -> str:
        name = f"step-{step:08d}"
        tmp, final = os.path.join(self.dir, f".tmp-{name}"), os.path.join(self.dir, name)
        if self.rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash mid-save
            os.makedirs(tmp)
        self.backend.barrier()
        self.backend.save_checkpoint(tmp)  # collective: every rank writes its own part
        with open(os.path.join(tmp, f"rng-rank{self.backend.rank}.json"), "w") as f:
            json.dump(rng_state(), f)
        if self.c.export_hf:
            from shardyard.export import save_hf

            save_hf(self.backend, self.tokenizer_dir, os.path.join(tmp, "hf"))
        drills.pause_in_save(step)
        self.backend.barrier()  # every rank has finished writing
        if self.rank0:
            self._publish(tmp, final, step, stream)
        self.backend.barrier()
        return final

    def _publish(self, tmp: str, final: str, step: int, stream) -> None:
        rngs = []
        for r in range(self.backend.world_size):
            f = os.path.join(tmp, f"rng-rank{r}.json")
            with open(f) as fh:
                rngs.append(json.load(fh))
            os.remove(f)
        meta = {
            "step": step, "tokens_seen": step * self.plan.tokens_per_step, "data": stream.position(step),
            "rng": rngs, "training_state": self.backend.training_state(), "engine": self.cfg.backend.name,
            "format": self.backend.checkpoint_format, "world_size": self.backend.world_size,
            "global_batch_size": self.plan.global_batch_size, "model_name": self.cfg.model.name,
            "history": self._history_until(step),
            "model": self.signature,
            "model_hash": hashlib.sha256(json.dumps(self.signature, sort_keys=True).encode()).hexdigest()[:16],
            "manifest": _manifest(tmp),
        }
        _write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        if os.path.exists(final):  # the same step saved again after a resume: replace it only now
            shutil.rmtree(final)
        os.replace(tmp, final)  # complete checkpoints appear in one rename
        _write_atomic(os.path.join(self.dir, "latest"), os.path.basename(final) + "\n")
        for old in self.complete()[:-self.c.keep_last] if self.c.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def _history_until(self, step: int) -> dict[str, list]:
        """The curve up to ``step``: what the run resumed with, then what this run logged since (its
        metrics.jsonl, whose older lines from crashed attempts are left out by step)."""
        own = monitors.history(self.cfg.run_dir, step)
        return {k: [p for p in v if p[0] <= self.start] + [p for p in own[k] if p[0] > self.start]
                for k, v in self.history.items()}

    def complete(self) -> list[str]:
        """Renamed (complete-looking) checkpoints, oldest first."""
        return sorted(p for p in glob.glob(os.path.join(self.dir, "step-*")) if os.path.isdir(p))

    # ---------------------------------------------------------------------------------------- resuming
    def resume_path(self) -> str | None:
        want = self.c.resume
        from shardyard.backends.process_group import elastic_start

        restarted = elastic_start(self.cfg) > 0  # a restart of the workers (on any node of the job)
        if want is None and not restarted:
            return None
        if want in (None, "auto"):
            for path in reversed(self.complete()):
                problem = verify(path)
                if problem is None:
                    return path
                if self.rank0:
                    warnings.warn(f"shardyard: skipping checkpoint {path}: {problem}; trying the previous one")
            return None  # nothing complete yet: a fresh start
        problem = verify(want)
        if problem is not None:
            raise UserError("checkpoint.resume", want, f"That checkpoint cannot be used: {problem}.",
                            "Point it at a complete checkpoint directory, or use checkpoint.resume=auto.")
        return want

    def restore(self) -> int:
        """Load the checkpoint to resume from, if any; returns the step to continue from."""
        path = self.resume_path()
        if path is None:
            return 0
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        self._check_compatible(path, meta)
        self.backend.load_checkpoint(path, meta)
        self.start = meta["step"]
        self.history = meta.get("history") or monitors.history(self.cfg.run_dir, self.start)
        self.backend.load_training_state(meta["training_state"])
        if meta["world_size"] == self.backend.world_size:
            set_rng_state(meta["rng"][self.backend.rank])
        if self.rank0:
            print(f"shardyard | resumed from {path} (step {meta['step']}, {meta['tokens_seen']:,} tokens, "
                  f"epoch {meta['data']['epoch']}; saved by {meta['engine']} x{meta['world_size']})", flush=True)
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
                            f"({meta['format']} format), which backend={self.cfg.backend.name} cannot read.",
                            "Resume with the same engine family, or move weights across engines through "
                            "an HF export: model=hf model.path=<run_dir>/hf.")
        if meta["global_batch_size"] != self.plan.global_batch_size and self.rank0:
            warnings.warn(f"shardyard: the global batch changed ({meta['global_batch_size']} -> "
                          f"{self.plan.global_batch_size}); the data order continues by step, not by sample")


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
