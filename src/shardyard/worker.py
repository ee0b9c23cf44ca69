"""One training worker: backend.init -> model, data, optimizer -> loop -> export -> backend.close.

Started in-process by run.py (world of one), by our launcher as ``python -m shardyard.worker RUN_DIR``
(it then reads the resolved ``RUN_DIR/config.yaml``; workers never re-compose), or by run.py under an
external launcher (torchrun, srun, deepspeed, horovodrun).
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Callable

import numpy as np
import torch
from omegaconf import DictConfig

from shardyard import data, dist_env, loop, monitors
from shardyard.checkpoint import Checkpointer
from shardyard.config.validate import validate
from shardyard.errors import UserError, report_and_exit
from shardyard.export import save_hf
from shardyard.model import build_model, param_count


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def main(cfg: DictConfig, after_train: Callable | None = None) -> dict:
    """Train one worker; ``after_train(backend)`` (a test seam) sees the engine before it closes."""
    import hydra.utils

    plan = validate(cfg, dist_env.detect())
    backend = hydra.utils.get_class(cfg.backend._target_)(cfg, plan)
    backend.init()
    try:
        summary = _train(cfg, plan, backend)
        if after_train is not None:
            after_train(backend)
        return summary
    finally:
        backend.close()


def _train(cfg: DictConfig, plan, backend) -> dict:
    rank0 = backend.rank == 0
    seed_everything(cfg.seed)
    prepared = data.prepare(cfg)  # cache hit (the parent or the first rank built it)
    seqs = data.PackedSequences(os.path.join(prepared.token_dir, "train.npy"), cfg.data.seq_len)
    val = data.PackedSequences(os.path.join(prepared.token_dir, "val.npy"), cfg.data.seq_len)
    stream = data.TrainStream(seqs, cfg.seed, plan.global_batch_size, plan.micro_batch_size, backend.rank, backend.world_size)
    built = {}

    def build(allow_meta: bool):
        built["model"] = build_model(cfg.model, cfg.seed, allow_meta=allow_meta)
        built["params"] = param_count(built["model"])
        return built["model"]

    backend.prepare(build, cfg.train.steps)
    n_params = built["params"]
    if rank0:
        print(f"shardyard | model {cfg.model.name}: {n_params:,} parameters | engine {cfg.backend.name} | "
              f"precision {cfg.precision.name} | {len(seqs):,} train / {len(val):,} val sequences "
              f"({stream.steps_per_epoch} steps per epoch)", flush=True)
    mon = monitors.build(cfg, cfg.run_dir, cfg.train.steps, rank0)
    seed_everything(cfg.seed + backend.rank)  # per-rank streams (dropout, sampling) after identical init
    ckpt = Checkpointer(cfg, backend, plan, prepared.tokenizer_dir)
    start = ckpt.restore()  # 0, or the step of the checkpoint (RNG, scheduler, scaler, data position too)

    def after_step(done: int) -> None:
        ckpt.maybe_save(done, stream)
        _inject_fault(done, backend.rank)

    result = loop.train(cfg, plan, backend, stream, val, mon, start_step=start, after_step=after_step)
    export = None
    if cfg.checkpoint.save_final:
        export = save_hf(backend, prepared.tokenizer_dir, os.path.join(cfg.run_dir, "hf"))
    summary = {
        "steps": cfg.train.steps, "wall_s": result.wall_s, "tokens": result.tokens,
        "tokens_per_s": result.tokens / max(result.wall_s, 1e-9), "params": n_params,
        "backend": cfg.backend.name, "world_size": backend.world_size, "final_train_loss": result.final_train_loss,
        "eval_losses": result.eval_losses, "train_losses": result.train_losses,
        "grad_norms": result.grad_norms,
        "median_step_s": float(np.median(result.step_wall_s)), "step_wall_s": result.step_wall_s,
        "final_eval_ppl": float(np.exp(min(result.eval_losses[-1][1], 50.0))), "run_dir": cfg.run_dir, "export": export,
    }
    if cfg.train.sample_tokens > 0:  # every rank: sharded engines all-gather inside the forward
        summary["sample"] = sample_text(backend.hf_model(), prepared.tokenizer_dir, cfg, backend.device)
        if rank0:
            print(f"sample ({cfg.train.sample_tokens} tokens after {cfg.train.sample_prompt!r}):\n"
                  f"{summary['sample']}\n", flush=True)
    if rank0:
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    mon.close(summary)
    return summary


def _inject_fault(step: int, rank: int) -> None:
    """Fault drill for the tests: ``SHARDYARD_TEST_CRASH_AT_STEP=STEP[:RANK]`` kills that rank after that
    step, on the first attempt only (a restarted worker has TORCHELASTIC_RESTART_COUNT > 0)."""
    spec = os.environ.get("SHARDYARD_TEST_CRASH_AT_STEP")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    at, _, who = spec.partition(":")
    if step == int(at) and rank == int(who or 0):
        print(f"shardyard | SHARDYARD_TEST_CRASH_AT_STEP: rank {rank} dies after step {step}", file=sys.stderr, flush=True)
        os._exit(13)


@torch.no_grad()
def sample_text(model, tokenizer_dir: str, cfg: DictConfig, device) -> str:
    tok = data.load_tokenizer(tokenizer_dir)
    ids = tok(cfg.train.sample_prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    was_training = model.training
    model.eval()
    for _ in range(cfg.train.sample_tokens):  # plain top-k sampling: works for every engine's module
        logits = model(input_ids=ids[:, -cfg.data.seq_len:], use_cache=False).logits[:, -1].float()
        top = torch.topk(logits, 20)
        probs = torch.softmax(top.values / 0.8, dim=-1)
        nxt = top.indices.gather(-1, torch.multinomial(probs, 1, generator=g))
        ids = torch.cat([ids, nxt], dim=1)
    model.train(was_training)
    return tok.decode(ids[0], skip_special_tokens=True)


def _main_from_run_dir() -> None:
    from shardyard.run import load_run_config

    try:
        main(load_run_config(sys.argv[1]))
    except UserError as err:
        report_and_exit(err)


if __name__ == "__main__":
    _main_from_run_dir()
