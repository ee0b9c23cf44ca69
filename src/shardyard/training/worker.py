"""One training worker: backend.init -> data, model, optimizer -> resume -> loop -> export -> backend.close.

Started in-process by run.py (world of one), by our launcher as ``python -m shardyard.training.worker RUN_DIR`` (it
reads the config and plan the parent wrote there), or by run.py under an external launcher (torchrun,
srun, deepspeed, horovodrun). It never composes or validates: it trains the plan it is given.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from shardyard.data import pipeline as data
from shardyard.core import drills
from shardyard.evaluation import harness
from shardyard.training import loop
from shardyard.models import moe
from shardyard import monitors, objectives
from shardyard.backends import Backend
from shardyard.backends import sequence_parallel
from shardyard.backends.process_group import elastic_start
from shardyard.training.checkpoint import Checkpointer
from shardyard.core.facts import Plan
from shardyard.core.errors import Preempted, UserError, report_and_exit
from shardyard.training.metrics import reset_host_peak, run_peak_memory
from shardyard.models import adapters
from shardyard.backends.torch_step import COMPUTE_DTYPES
from shardyard.models.generation import generate
from shardyard.models.build import SpecialTokens, build_model, wants_meta
from shardyard.models.weights import load_weights, weights_dir
from shardyard.training.trial import Trial


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def deterministic(on: bool) -> None:
    """``train.deterministic``: deterministic kernels (an op without one raises, naming itself) and cuDNN without
    autotuning; the environment (``dist_env.DETERMINISTIC_ENV``) was set before this worker started. Set either
    way: the jobs of an in-process sweep share this process."""
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if on:
        torch.backends.cudnn.benchmark = False


def determinism() -> dict:
    """What this worker runs under, as ``summary.json`` records it (``deterministic``)."""
    from shardyard.core.dist_env import DETERMINISTIC_ENV

    return {"algorithms": torch.are_deterministic_algorithms_enabled(), "cudnn": torch.backends.cudnn.deterministic,
            **{key: os.environ.get(key) for key in DETERMINISTIC_ENV}}


def main(cfg: DictConfig, plan: Plan, after_train: Callable[[Backend], None] | None = None) -> dict:
    """Train one worker; ``after_train(backend)`` (a test seam) sees the engine before it closes."""
    from hydra.utils import get_object

    deterministic(bool(OmegaConf.select(cfg, "train.deterministic", default=False)))  # before any kernel runs
    backend: Backend = get_object(cfg.backend._target_)(cfg, plan)
    backend.init()
    hosts = _hosts_by_rank(cfg.launch, plan)
    failed = True
    try:
        summary = train(cfg, plan, backend)
        if after_train is not None:
            after_train(backend)
        failed = False
        return summary
    except Exception as e:
        if hosts:
            _name_lost_peers(e, hosts, cfg.launch)
        raise
    finally:
        try:
            backend.run_failed = failed  # type: ignore[attr-defined]  # its teardown waits on no peer (teardown)
            backend.close()
        except Exception:
            if not failed:
                raise  # a failed run's teardown fails too when its peers are gone: its first error is the one to read


def _hosts_by_rank(launch: DictConfig, plan: Plan) -> list[str] | None:
    """Multi-node: every rank's host address (``launch.socket_ifname``'s, else the hostname), so that a lost
    connection can be named by rank and node."""
    import socket

    import torch.distributed as dist

    from shardyard.core.dist_env import interface_address

    if plan.nnodes == 1 or not dist.is_initialized():
        return None
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, interface_address(launch.socket_ifname) or socket.gethostname())
    return table


def _name_lost_peers(e: Exception, hosts: list[str], launch: DictConfig) -> None:
    """gloo names the peer it lost ("Read error [10.0.0.2]:41234: Connection reset by peer"); a cable pulled
    shows as a timeout only."""
    import re

    import torch.distributed as dist

    text, me = str(e), dist.get_rank()
    addrs = set(re.findall(r"\[([0-9A-Fa-f.:]+)\]:\d+", text))
    lost = [f"rank {r} at {h}" for r, h in enumerate(hosts) if h in addrs and r != me]
    node = os.environ.get("GROUP_RANK", launch.node_rank)
    if lost:
        why = f"lost its connection to {', '.join(lost)}: that node's workers stopped or the node is unreachable"
    elif "timeout" in text.lower() or "timed out" in text.lower():
        others = ", ".join(sorted(set(hosts) - {hosts[me]})) or "the other ranks"
        why = (f"heard nothing from {others} within launch.timeout_s={launch.timeout_s} s: a node stopped "
               "or its network went down")
    else:
        return
    print(f"shardyard | rank {me} (node {node}) {why}.", file=sys.stderr, flush=True)


def train(cfg: DictConfig, plan: Plan, backend: Backend) -> dict:
    rank0 = backend.rank == 0
    seed_everything(cfg.seed)

    # 1. Data: the parent (or the first rank) built the caches; every rank reads its own share.
    prepared = data.prepare(cfg)
    total_samples = cfg.train.steps * plan.global_batch_size
    seqs = data.open_train(prepared, cfg.data, cfg.seed, total_samples)
    val = data.open_val(prepared, cfg.data)
    if rank0 and prepared.stats and "summary" in prepared.stats:  # a source that words its own counts
        print(f"shardyard | data: {prepared.stats['summary']}", flush=True)
    elif rank0 and prepared.stats:
        st = prepared.stats
        print(f"shardyard | data: {st['conversations']:,} conversations, {st['truncated']:,} longer than data.seq_len="
              f"{cfg.data.seq_len} ({st['dropped']:,} dropped), {st['label_tokens']:,} of {st['tokens']:,} tokens "
              "carry a label (assistant tokens)", flush=True)
    log = None
    if cfg.data.log_sample_ids:
        os.makedirs(os.path.join(cfg.run_dir, "samples"), exist_ok=True)
        log = os.path.join(cfg.run_dir, "samples", f"rank{backend.rank}.jsonl")
    # Sequence or context parallelism (backend.sp, backend.cp): a sequence group reads one share of the batch, and
    # each of its ranks trains its share of those sequences' positions (shardyard.backends.sequence_parallel).
    # DPO and GRPO cut their own rows (pairs, rollouts: objectives.Objective.splits_sequences).
    shards = sequence_parallel.groups(plan.world_size, plan.dims, backend.rank)
    readers = shards.data_rank(backend.dp_rank, backend.dp_size) if shards else (backend.dp_rank, backend.dp_size)
    stream: Any = data.TrainStream(seqs, cfg.seed, plan.global_batch_size, plan.micro_batch_size, *readers, log=log)
    objective = objectives.build(cfg)
    if shards is not None and not getattr(objective, "splits_sequences", False):  # each micro-batch this rank's shard
        stream = sequence_parallel.ShardedStream(stream, shards, int(OmegaConf.select(cfg, "model.mtp.depth") or 0))
    if rank0 and len(prepared.parts) > 1:
        shares = ", ".join(f"{p.name} {w:.1%} ({len(r):,} sequences)"
                           for p, w, r in zip(prepared.parts, stream.weights().values(), seqs.parts))
        print(f"shardyard | data: mixture of {len(prepared.parts)} sources, shares of the samples: {shares}", flush=True)

    # 2. Model, engine, optimizer, schedule. The engine calls `build` where and how it needs the model
    # (meta device, deepspeed.zero.Init); the model is seeded identically on every rank.
    step = {"now": 1}  # the step being trained, for the NaN drill
    # The model's config (and so every export's config.json) says the special tokens of the tokenizer it trains with
    tokens = SpecialTokens.of(data.load_tokenizer(prepared.tokenizer_dir))

    def build(allow_meta: bool, model_cfg: DictConfig | None = None) -> torch.nn.Module:
        """``model_cfg``: another ``model`` section (a post-training reference's other weights:
        ``backends.reference.options``)."""
        m = cfg.model if model_cfg is None else model_cfg
        # QLoRA quantises the loaded weights as it builds: never on the meta device.
        meta = allow_meta and wants_meta(m, plan.facts) and not adapters.method(cfg.peft).quantized_base
        model = build_model(m, cfg.seed, on_meta=meta, tokens=tokens)
        if shards is not None:
            sequence_parallel.install(model)  # attention over the whole sequence, from shards of its positions
        weights = weights_dir(m)
        if weights is not None and not any(p.is_meta for p in model.parameters()):
            load_weights(model, weights)  # a model on the meta device loads them as it is materialised
        model = adapters.apply(model, cfg.peft, cfg.seed, COMPUTE_DTYPES[cfg.precision.name])  # before the engine
        drills.poison_gradient(model, backend.rank, lambda: step["now"])
        return model

    reset_host_peak()  # the peak measured beside the plan is the training's, not the data preparation's
    backend.prepare(build, cfg.train.steps)
    # What the step optimises (objective=lm|dpo|grpo): DPO's and GRPO's reference model is built here, after the
    # policy, as the engine shards it; their loss is installed on the engine's model (shardyard.objectives).
    objective.setup(objectives.Setup(backend, build, cfg, prepared.tokenizer_dir, seqs, val, shards))
    # MoE routers, wherever the engine put them: their loads counted, their balance kept (shardyard.models.moe).
    balancer = moe.Balancer.install(backend.hf_model(), cfg.model.balance, plan.facts.routed_experts, plan.dims.ep,
                                    backend.device, moe.SequenceSplit(shards.size, shards.group) if shards else None)
    if rank0:
        trainable = plan.facts.trainable  # counted on the meta build at validation
        tuned = (f" ({trainable:,} trainable: {cfg.peft.name} adapters, {100 * trainable / plan.facts.params:.2f}%)"
                 if trainable is not None else "")
        print(f"shardyard | model {cfg.model.name}: {plan.facts.params:,} parameters{tuned}, "
              f"{plan.facts.flops_per_token / 1e9:.4g} GFLOPs per training token | engine {cfg.backend.name} | "
              f"precision {cfg.precision.name} | {len(seqs):,} train / {sum(map(len, val.values())):,} val sequences "
              f"({stream.steps_per_epoch} steps per epoch)", flush=True)

    # 3. Resume: model, optimizer, schedule, RNG and data position, or a fresh start.
    seed_everything(cfg.seed + backend.rank)  # per-rank streams (dropout, sampling) after identical init
    ckpt = Checkpointer(cfg.checkpoint, backend, plan, run_dir=cfg.run_dir, tokenizer_dir=prepared.tokenizer_dir,
                        engine=cfg.backend.name, model_name=cfg.model.name,
                        restarted=elastic_start(cfg) > 0,  # a restart of the workers (on any node of the job)
                        objective=objective, timeout_s=cfg.launch.timeout_s)
    start = ckpt.restore()
    if start >= cfg.train.steps:
        return _already_complete(cfg, start, rank0)
    step["now"] = start + 1

    # 4. Train.
    mon = monitors.build(cfg.monitor, run_dir=cfg.run_dir, config=cfg, is_rank0=rank0)
    mon.resume(ckpt.start)  # an earlier attempt's steps after the checkpoint are logged again: each step once
    try:
        def after_step(done: int) -> None:
            step["now"] = done + 1
            ckpt.maybe_save(done, stream)
            drills.crash_after(done, backend.rank, cfg.run_dir)

        trial = Trial.of(OmegaConf.select(cfg, "sweep"), backend)
        result = loop.train(cfg, plan, backend, stream, val, mon, start_step=start, after_step=after_step,
                            after_eval=trial.should_stop if trial else None, history=ckpt.history,
                            balancer=balancer, objective=objective,
                            eval_tasks=harness.InTraining.of(cfg.train, backend, prepared.tokenizer_dir,
                                                             plan.micro_batch_size))
        if result.preempted_at is not None:
            raise _preempted(cfg, ckpt, stream, result, rank0)
        summary = _finish(cfg, plan, backend, prepared, result, ckpt, objective, shards)
    except BaseException as e:  # mark wandb/mlflow runs failed, flush the event files, then re-raise
        mon.fail(e.paragraph() if isinstance(e, UserError) else f"{type(e).__name__}: {e}")
        try:
            ckpt.close()  # a background save in flight ends before the engine's groups go
        except BaseException:
            pass  # the run's first error is the one to read
        raise
    mon.close(summary)
    if rank0 and cfg.metrics.report and not cfg.debug.fast_dev_run and cfg.scale._target_ is None:  # (a check run: none)
        _draw_report(cfg.run_dir)
    return summary


def _preempted(cfg: DictConfig, ckpt: Checkpointer, stream: data.TrainStream, result: loop.LoopResult,
               rank0: bool) -> Preempted:
    """A preemption signal stopped the loop after ``result.preempted_at`` (every rank alike): that step is saved
    (or its save in flight finished) and published, then every rank exits ``EXIT_REQUEUE``."""
    step = result.preempted_at
    assert step is not None
    ckpt.save_now(step, stream)
    text = (f"preempted ({result.preempted_by}) after step {step}: its checkpoint is published "
            f"({os.path.join(ckpt.dir, f'step-{step:08d}')}); exit {Preempted('').code} to requeue the job, which "
            "resumes there with checkpoint.resume=auto")
    if rank0:
        print(f"shardyard | {text}", flush=True)
    return Preempted(text)


def _finish(cfg: DictConfig, plan: Plan, backend: Backend, prepared: data.Prepared, result: loop.LoopResult,
            ckpt: Checkpointer, objective: objectives.Objective,
            shards: sequence_parallel.Shards | None = None) -> dict:
    """Export, sample and summary. A resumed run's curves start from its own history (metrics.jsonl), so it
    reports what an uninterrupted run would."""
    rank0 = backend.rank == 0
    export = None
    ckpt.close()  # the last background save published (or its failure raised) before the run reports
    if result.pruned_at is not None and rank0:
        print(f"shardyard | the sweep's pruner stopped this trial after step {result.pruned_at}'s evaluation "
              "(no export, no sample)", flush=True)
    if result.pruned_at is None:
        export = ckpt.export_final()
    history = ckpt.history
    eval_losses = history["eval_losses"] + result.eval_losses
    summary = {
        "steps": cfg.train.steps, "wall_s": result.wall_s, "tokens": result.tokens,
        "tokens_per_s": result.tokens / max(result.wall_s, 1e-9), "params": plan.facts.params,
        "backend": cfg.backend.name, "world_size": backend.world_size, "final_train_loss": result.final_train_loss,
        "eval_losses": eval_losses, "train_losses": history["train_losses"] + result.train_losses,
        "grad_norms": history["grad_norms"] + result.grad_norms,
        "median_step_s": float(np.median(result.step_wall_s)), "step_wall_s": result.step_wall_s,
        "run_dir": cfg.run_dir, "export": export,
        "skipped_steps": result.skipped_steps, "pruned_at": result.pruned_at,
        "stopped_early_at": result.stopped_early_at, "warnings": result.warnings, "deterministic": determinism(),
        "speed_options": result.speed_options,  # what model.loss_chunk/compile/checkpointing did (model.SpeedProbe)
        "final_eval": result.final_eval,  # the last evaluation's metrics (DPO's reward accuracy, GRPO's reward, ...)
    }
    if shards is not None:  # how this rank's sequences were split, as the last micro-batch was cut (backend.sp/cp)
        summary["sequence_share"] = {"style": shards.style, "size": shards.size, "index": shards.index,
                                     **sequence_parallel.LAST_SHARE}
    if "eval/ppl" in result.final_eval or (not result.final_eval and objective.data_kind == "text"):  # objective=lm
        # (a resumed run may evaluate nothing: its history's eval losses are cross-entropies then)
        summary["final_eval_ppl"] = float(np.exp(min(eval_losses[-1][1], 50.0)))
    if cfg.train.sample_tokens > 0 and result.pruned_at is None:  # every rank: sharded engines all-gather inside the forward
        summary["sample"] = sample_text(backend.hf_model(), prepared.tokenizer_dir, cfg.train, seed=cfg.seed,
                                        seq_len=cfg.data.seq_len, device=backend.device)
        if rank0:
            print(f"sample ({cfg.train.sample_tokens} tokens after {cfg.train.sample_prompt!r}):\n"
                  f"{summary['sample']}\n", flush=True)
    if plan.memory:  # the measured peak beside the plan's, every rank's in its summary, rank 0's printed
        peak = run_peak_memory(backend.device)
        summary.update(memory_peak_bytes=peak, memory_plan_bytes=plan.memory["peak"])
        if rank0:
            what = "max_memory_allocated" if backend.device.type == "cuda" else "peak RSS"
            print(f"shardyard | memory, rank 0: measured {what} {peak / 2**30:.2f} GiB beside the plan's "
                  f"{plan.memory['peak'] / 2**30:.2f} GiB ({100 * (peak / plan.memory['peak'] - 1):+.0f}%)", flush=True)
    if rank0:
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _already_complete(cfg: DictConfig, step: int, rank0: bool) -> dict:
    """Re-running a finished run (``checkpoint.resume=auto``): nothing to train; say so and exit 0."""
    if rank0:
        print(f"shardyard | the run is already complete: its checkpoint is at step {step} and train.steps is "
              f"{cfg.train.steps}. Raise train.steps to train on. Run dir: {cfg.run_dir}", flush=True)
    path = os.path.join(cfg.run_dir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"steps": cfg.train.steps, "run_dir": cfg.run_dir, "already_complete": True}


def _draw_report(run_dir: str) -> None:
    """The end-of-run picture; a plotting problem must not fail a finished run."""
    try:
        from shardyard.monitors.report import draw

        print(f"shardyard | report: {draw(run_dir)}", flush=True)
    except Exception as e:
        print(f"shardyard | could not draw the report ({type(e).__name__}: {e}); "
              f"retry with: shardyard report {run_dir}", file=sys.stderr, flush=True)


@torch.no_grad()
def sample_text(model: torch.nn.Module, tokenizer_dir: str, train: DictConfig, *, seed: int, seq_len: int,
                device: torch.device) -> str:
    """``train.sample_tokens`` tokens after ``train.sample_prompt`` (``train``: the run's ``train`` section): top-k 20
    at temperature 0.8, KV-cached (``generation.generate``), ending early at the tokenizer's eos. Every rank runs
    the same number of forwards (sharded engines all-gather inside them). The model sees the prompt's last
    ``seq_len - sample_tokens`` tokens (at least one), so that prompt and sample fit the trained length."""
    tok = data.load_tokenizer(tokenizer_dir)
    ids = tok(train.sample_prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    seen = ids[:, -max(1, seq_len - train.sample_tokens):]
    pad = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
    out, mask = generate(model, seen, torch.ones_like(seen), max_new_tokens=train.sample_tokens, temperature=0.8,
                         top_k=20, eos_id=tok.eos_token_id, pad_id=pad, generator=g, lockstep=True)
    return tok.decode(torch.cat([ids[0], out[0][mask[0].bool()]]), skip_special_tokens=True)


def from_run_dir(run_dir: str) -> None:
    """A worker started by our launcher: the config and plan the parent wrote; a user error exits 2."""
    from shardyard.training import rundir

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # A worker forked from the parent inherits its intra-op thread pool (all cores), which the launcher's
        # OMP_NUM_THREADS no longer resizes: N ranks x all cores threads made every CPU step ~3x slower.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        main(*rundir.load(run_dir))
    except UserError as err:
        report_and_exit(err)
    except Exception as e:
        # A bug's traceback on this worker's own stderr, as it happens, on every rank that raises: a forked
        # worker's exception otherwise reaches only the launcher, which reports one failed rank (the first it
        # polls, not always the first to fail). A rank that failed only because a peer went away says so in a
        # line: the peer's own error (a user error's paragraph, a bug's traceback) is the story, and a traceback
        # beside a user error's paragraph made it look like a bug (seen under load: a stale build lock's exit 2).
        lost = _lost_peer(e)
        if lost is None:
            import traceback

            traceback.print_exc()
        else:
            # Horovod's "shut down" also follows a collective another rank never made (no rank raised): said so
            why = ("Horovod stopped: another rank failed (its error is above or below) or did not make a collective "
                   "this one made" if "Horovod has been shut down" in str(lost)
                   else "another rank failed first, its error is above or below")
            print(f"shardyard | rank {_rank_name()} lost a peer ({type(lost).__name__}: "
                  f"{' '.join(str(lost).split())[:300]}): {why}", file=sys.stderr, flush=True)
            _let_the_first_failure_be_seen()
        sys.stderr.flush()
        raise


def _rank_name() -> str:
    """This worker's rank as its launcher set it (torch's RANK; Horovod's HOROVOD_RANK), for a line it prints."""
    return os.environ.get("RANK") or os.environ.get("HOROVOD_RANK") or "?"


LOST_PEER_MARKS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Horovod has been shut down")
"""What gloo's (and the TCP store's) error says when the process at the other end of a connection has gone, and
Horovod's once its background loop has stopped on such an error."""

PEER_LOST_GRACE_S = 5.0
"""How long a worker that failed only because a peer went away waits before it exits (its launcher ends it sooner)."""


def _lost_peer(e: BaseException | None) -> BaseException | None:
    """The error in ``e``'s chain that says a peer's connection went away (gloo's reset, torch's
    ``DistNetworkError``), or None: a worker that failed for that reason alone."""
    import torch.distributed as dist

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistNetworkError) or any(mark in str(e) for mark in LOST_PEER_MARKS):
            return e
        e = e.__cause__ or e.__context__
    return None


def _let_the_first_failure_be_seen() -> None:
    """A rank that dies (a bug, an out-of-memory kill, a drill's exit 13) closes its connections, and every peer
    blocked on it fails within milliseconds with "Connection reset by peer". torch's agent polls its workers
    every 0.2 s and reports the first dead one it finds, in rank order, not the first to die: without this wait
    a job whose rank 1 crashed was reported as "rank 0 failed with exit code 1" (3 runs in 3 on 2 cores, and a
    sweep's summary in CI). So a worker whose error is a lost peer waits ``PEER_LOST_GRACE_S`` (under the
    elastic agent only, which ends it as soon as it has seen the rank that failed first). Not a node's only
    worker (``LOCAL_WORLD_SIZE`` 1): its agent has no other rank to name, and the peer it lost is on another node,
    whose own agent reports it; the wait would only hold this node's report back. Horovod's CPU workers forked by
    our launcher (``launch._horovod_gloo_forked``, which sets ``SHARDYARD_FORKED_HOROVOD``) wait too: it ends them
    once it has seen the first to fail."""
    forked_horovod = os.environ.get("SHARDYARD_FORKED_HOROVOD") == "1"
    if not forked_horovod and ("TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("LOCAL_WORLD_SIZE") == "1"):
        return
    print(f"shardyard | rank {_rank_name()} waits {PEER_LOST_GRACE_S:.0f} s so that the launcher "
          "names the rank that failed first", file=sys.stderr, flush=True)
    import time

    time.sleep(PEER_LOST_GRACE_S)


if __name__ == "__main__":
    from shardyard.core.errors import leave

    try:
        from_run_dir(sys.argv[1])
    except Exception:
        leave(1)  # its traceback is printed already (from_run_dir)
    leave(0)  # a spawned worker (GPU, horovodrun) skips the interpreter's teardown too
