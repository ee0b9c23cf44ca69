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
from shardyard.model import build_model, flops_per_token, param_count


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
    current = {"step": 0}  # the step being trained (set by the loop's callbacks), for the NaN drill

    def build(allow_meta: bool):
        built["model"] = build_model(cfg.model, cfg.seed, allow_meta=allow_meta)
        built["params"] = param_count(built["model"])
        _poison_gradient(built["model"], backend.rank, current)
        return built["model"]

    # Before prepare: a ZeRO-3 engine makes HF build every model under zero.Init from then on.
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    backend.prepare(build, cfg.train.steps)
    n_params = built["params"]
    if rank0:
        print(f"shardyard | model {cfg.model.name}: {n_params:,} parameters, {flops / 1e9:.4g} GFLOPs per "
              f"training token | engine {cfg.backend.name} | "
              f"precision {cfg.precision.name} | {len(seqs):,} train / {len(val):,} val sequences "
              f"({stream.steps_per_epoch} steps per epoch)", flush=True)
    mon = monitors.build(cfg, rank0)
    try:
        summary = _train_loop(cfg, plan, backend, prepared, stream, val, mon, n_params, current, flops)
    except BaseException as e:  # mark wandb/mlflow runs failed, flush the event files, then re-raise
        mon.fail(e.paragraph() if isinstance(e, UserError) else f"{type(e).__name__}: {e}")
        raise
    mon.close(summary)
    if rank0:
        _draw_report(cfg.run_dir)
    return summary


def _train_loop(cfg: DictConfig, plan, backend, prepared, stream, val, mon, n_params: int, current: dict,
                flops: float) -> dict:
    rank0 = backend.rank == 0
    seed_everything(cfg.seed + backend.rank)  # per-rank streams (dropout, sampling) after identical init
    ckpt = Checkpointer(cfg, backend, plan, prepared.tokenizer_dir)
    start = ckpt.restore()  # 0, or the step of the checkpoint (RNG, scheduler, scaler, data position too)
    current["step"] = start + 1

    def after_step(done: int) -> None:
        current["step"] = done + 1
        ckpt.maybe_save(done, stream)
        _inject_fault(done, backend.rank)

    result = loop.train(cfg, plan, backend, stream, val, mon, flops_per_token=flops, start_step=start,
                        after_step=after_step)
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
        "skipped_steps": result.skipped_steps,
    }
    if cfg.train.sample_tokens > 0:  # every rank: sharded engines all-gather inside the forward
        summary["sample"] = sample_text(backend.hf_model(), prepared.tokenizer_dir, cfg, backend.device)
        if rank0:
            print(f"sample ({cfg.train.sample_tokens} tokens after {cfg.train.sample_prompt!r}):\n"
                  f"{summary['sample']}\n", flush=True)
    if rank0:
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _draw_report(run_dir: str) -> None:
    """The end-of-run picture; a plotting problem must not fail a finished run."""
    try:
        from shardyard.report import draw

        print(f"shardyard | report: {draw(run_dir)}", flush=True)
    except Exception as e:
        print(f"shardyard | could not draw the report ({type(e).__name__}: {e}); "
              f"retry with: shardyard report {run_dir}", file=sys.stderr, flush=True)


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


def _poison_gradient(model, rank: int, current: dict) -> None:
    """NaN drill for the tests: ``SHARDYARD_TEST_POISON_GRAD=STEP:RANK:PARAM`` turns the gradient of the
    parameter named PARAM into NaN on that rank during that step. The tensor hook is registered on the bare
    model, before the engine wraps it, so it runs first: before any engine hook and any reduction."""
    spec = os.environ.get("SHARDYARD_TEST_POISON_GRAD")
    if not spec:
        return
    at, who, name = spec.split(":", 2)
    if int(who) != rank:
        return
    param = dict(model.named_parameters())[name]
    param.register_hook(lambda g: g * float("nan") if current["step"] == int(at) else g)


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
