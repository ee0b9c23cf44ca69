"""The training loop. It reads the same for every engine: the backend owns wrapping, sync and stepping."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from omegaconf import DictConfig

from shardyard.backends import Backend
from shardyard.backends.sequence_parallel import Shards, sharded_micro_batches
from shardyard.core.facts import Plan
from shardyard.data.pipeline import TrainStream, eval_batches
from shardyard.training.debug import NonFiniteGuard, anomaly_detection
from shardyard.core import drills
from shardyard.training.metrics import memory_metrics, peak_tflops
from shardyard.models import mtp
from shardyard.models.prepare import SpeedProbe
from shardyard.models.moe import Balancer
from shardyard.monitors import Monitors
from shardyard.objectives import Objective, to_device
from shardyard.training.profiling import StepProfiler


@dataclass
class LoopResult:
    final_train_loss: float = float("nan")
    eval_losses: list = field(default_factory=list)  # [(step, loss)]
    final_eval: dict = field(default_factory=dict)  # the last evaluation's metrics (eval/ppl only for objective=lm)
    train_losses: list = field(default_factory=list)  # [(step, loss)] at every log step
    grad_norms: list = field(default_factory=list)  # [(step, global pre-clip grad norm)] at every log step
    step_wall_s: list = field(default_factory=list)  # wall time of each step, logging included, eval not
    tokens: int = 0
    wall_s: float = 0.0
    skipped_steps: int = 0  # updates dropped for non-finite gradients (debug.nan_policy=skip)
    stopped_early_at: int | None = None  # the step after whose evaluation train.early_stopping_patience stopped
    warnings: list = field(default_factory=list)  # what Health printed
    pruned_at: int | None = None  # the step after whose evaluation a sweep's pruner stopped the run
    speed_options: dict = field(default_factory=dict)  # model.SpeedProbe's record of the first step trained here
    preempted_at: int | None = None  # the step after which a preemption signal stopped the run (Preemption)
    preempted_by: str = ""  # which signal, as this rank knows it


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What asks a run to save and stop: Slurm's SIGTERM before it kills a job (preemption, scancel, the time limit),
or the signal its ``--signal`` sends ahead of the time limit (``shardyard sbatch`` asks for SIGUSR1)."""


class Preemption:
    """A preemption signal (``PREEMPTION_SIGNALS``) stops the run at the next step boundary, on every rank
    together: the handler only notes it (nothing else is safe inside a handler, and a rank may be inside a
    collective); at the end of each step every rank adds its note to one all-reduce of one float, so all of
    them see the same answer after the same step, whichever received the signal and when. The worker then
    saves that step (or finishes the save of it in flight) and exits ``errors.EXIT_REQUEUE``.

    Its cost: that all-reduce (4 bytes: its latency, microseconds on NVLink, tens across nodes) and reading its
    result on the host, once per step. With ``debug.nan_policy`` on (the default) the guard has read the
    step's gradient norm on the host just before, so the step's work is done by then and the read waits only
    for the all-reduce itself; with ``nan_policy=off`` it is that step's one host sync.

    Installed in the main thread only (Python runs signal handlers there); elsewhere (a sweep job in a thread)
    the signals keep their previous handling. After a stop the handlers stay, so a repeated signal cannot kill
    the worker while it saves; otherwise the previous ones are put back at the end of the loop."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.received = 0  # the signal's number; 0: none
        self.flag = torch.zeros(1, device=backend.device)  # filled in place: no host-to-device copy per step
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame) -> None:
        self.received = self.received or signum

    def agreed(self) -> bool:
        """Collective, at a step boundary: whether any rank has received a preemption signal."""
        self.flag.fill_(float(self.received))
        return float(self.backend.all_reduce_mean(self.flag).item()) > 0

    def close(self, stopped: bool) -> None:
        if stopped:
            return
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Health:
    """The troubleshooting table of a fine-tuning guide, read off the run's own metrics and printed as a
    warning when it applies (rank 0; every rank sees the same reduced numbers and stops together):

    * eval loss rising ``train.warn_after_evals`` evaluations in a row: overfitting (fewer epochs or steps, a
      lower learning rate, more data, more dropout);
    * train loss not below its first logged value after a third of the run: the learning rate is too low,
      the labels are all masked, or the data is wrong;
    * train loss oscillating (its logged values alternate up and down, with swings over 10%): learning rate
      too high or batch too small;
    * ``train.early_stopping_patience``: stop when the eval loss has not improved for that many evaluations.
    """

    def __init__(self, train: DictConfig, rank0: bool, history: dict | None = None, warn_max_over_mean: float = 2.0):
        """``train``: the run's ``train`` section (``steps``, ``warn_after_evals``, ``early_stopping_patience``);
        ``warn_max_over_mean``: ``model.balance``'s MoE imbalance limit."""
        self.tr, self.rank0, self.warn_max_over_mean = train, rank0, warn_max_over_mean
        self.imbalanced = 0  # log steps in a row with a MoE layer above the limit
        history = history or {}  # a resumed run goes on from its own curves (the checkpoint carries them)
        self.evals: list[float] = [v for _, v in history.get("eval_losses", [])]
        self.train: list[float] = [v for _, v in history.get("train_losses", [])]
        self.said: set[str] = set()
        self.warnings: list[str] = []

    def _warn(self, key: str, text: str) -> None:
        if key in self.said:
            return
        self.said.add(key)
        self.warnings.append(text)
        if self.rank0:
            print(f"shardyard | warning: {text}", flush=True)

    def on_train(self, step: int, loss: float) -> None:
        self.train.append(loss)
        t = self.train
        if step >= self.tr.steps / 3 and len(t) >= 4 and min(t[1:]) >= t[0]:
            self._warn("flat", f"the train loss has not fallen below its first value ({t[0]:.4f}) by step {step}: "
                       "raise optim.lr, check that the data has labelled tokens, or check the data itself.")
        last = t[-6:]
        if len(last) == 6:
            ups = [b > a for a, b in zip(last, last[1:])]
            swings = [abs(b - a) / max(abs(a), 1e-9) for a, b in zip(last, last[1:])]
            if all(u != v for u, v in zip(ups, ups[1:])) and min(swings) > 0.1:
                self._warn("oscillating", f"the train loss oscillates (last values {', '.join(f'{x:.3f}' for x in last)}): "
                           "lower optim.lr or raise train.global_batch_size.")

    def on_moe(self, step: int, metrics: dict) -> None:
        """A MoE layer whose busiest expert stays above ``model.balance.warn_max_over_mean`` times the mean load
        at 5 log steps in a row, after the first tenth of the run: its routing has collapsed onto few experts."""
        worst = max(((v, k.split("/")[1]) for k, v in metrics.items() if k.endswith("/max_over_mean")
                     and k.count("/") == 2), default=None)
        limit = self.warn_max_over_mean
        self.imbalanced = self.imbalanced + 1 if worst is not None and worst[0] > limit and step >= self.tr.steps / 10 else 0
        if self.imbalanced >= 5 and worst is not None:
            self._warn("moe", f"MoE {worst[1].replace('_', ' ')} sends {worst[0]:.2f}x the mean load to its busiest "
                       f"expert (above model.balance.warn_max_over_mean={limit:g} for 5 log steps, at step {step}): "
                       "raise model.balance.bias_update_speed (DeepSeek-V3 routers) or model.balance.seq_aux_alpha.")

    def on_eval(self, step: int, loss: float) -> bool:
        """True: stop here (early stopping)."""
        self.evals.append(loss)
        e, n = self.evals, self.tr.warn_after_evals
        if n and len(e) > n and all(b > a for a, b in zip(e[-n - 1:], e[-n:])):
            self._warn("rising", f"the eval loss rose {n} evaluations in a row (to {loss:.4f} at step {step}): the "
                       "model is overfitting; train fewer steps, lower optim.lr, use more data, or set "
                       "train.early_stopping_patience.")
        patience = self.tr.early_stopping_patience
        if patience and len(e) > patience and min(e[-patience:]) >= min(e[:-patience]):
            if self.rank0:
                print(f"shardyard | early stopping after step {step}: the eval loss has not improved on "
                      f"{min(e):.4f} for {patience} evaluations (train.early_stopping_patience={patience})", flush=True)
            return True
        return False


def evaluate(backend: Backend, val: dict, batches: int, plan: Plan, weights: dict | None = None,
             shards: Shards | None = None) -> dict:
    """The held-out loss of each source (``val``: name -> rows) over ``batches`` (``train.eval_batches``)
    micro-batches, on every rank: ``{"eval/loss": overall}``, plus ``eval/loss/<name>`` per source when there
    are several, whose weighted mean (``weights``: the mixture's) is the overall loss. Like the training loss,
    a source's loss is the mean over its label tokens (a micro-batch's mean weighted by its label count), so
    SFT rows with few labels do not weigh as much as full ones. ``shards``: a sequence group reads one share of the
    batches, each of its ranks its share of their positions (``backend.sp``, ``backend.cp``)."""
    model = backend.hf_model()
    readers = shards.data_rank(backend.dp_rank, backend.dp_size) if shards else (backend.dp_rank, backend.dp_size)
    was_training = model.training
    model.eval()
    sums = []
    for name, rows in val.items():
        total, count = torch.zeros((), device=backend.device), torch.zeros((), device=backend.device)
        for x, y in sharded_micro_batches(eval_batches(rows, batches, plan.micro_batch_size, *readers), shards):
            n = (y != -100).sum().to(backend.device).float()
            mean = backend.eval_loss(to_device(x, backend.device), y.to(backend.device)).float()
            total += torch.where(n > 0, mean * n, 0.0)  # a batch without labels: NaN mean, no weight
            count += n
        sums += [total, count]
    model.train(was_training)
    reduced = backend.all_reduce_mean(torch.stack(sums)).tolist()  # one all-reduce: every source's sum and count
    names = list(val)
    means = [reduced[2 * i] / max(reduced[2 * i + 1], 1e-12) for i in range(len(names))]
    if len(names) == 1:
        return {"eval/loss": means[0]}
    w = weights or {n: 1 / len(names) for n in names}
    return {"eval/loss": sum(w[n] * m for n, m in zip(names, means)), **{f"eval/loss/{n}": m for n, m in zip(names, means)}}


def train(cfg: DictConfig, plan: Plan, backend: Backend, stream: TrainStream, val: dict,
          monitors: Monitors, start_step: int = 0, after_step: Callable[[int], None] | None = None,
          after_eval: Callable[[int, dict], bool] | None = None, history: dict | None = None,
          balancer: Balancer | None = None, *, objective: Objective,
          eval_tasks: Callable[[int], dict] | None = None) -> LoopResult:
    """Steps ``start_step .. train.steps``; ``after_step(done)`` runs after each (checkpointing), and
    ``after_eval(step, metrics)`` after each evaluation: True stops the run there (a sweep's pruner; every
    rank must return the same). ``balancer``: a MoE model's routing balance, stepped after every update.
    ``eval_tasks(step)``: more metrics of each evaluation, called on every rank (``train.eval_tasks``: the
    lm-evaluation-harness's scores, ``harness.InTraining``).
    ``objective``: what the step optimises (``shardyard.objectives``, set up already).
    A preemption signal stops the loop after the step it arrives in (``Preemption``: ``preempted_at``, every rank
    alike; the caller saves that step), the last step aside (the run finishes then).
    The plan's FLOPs per token turn throughput into TFLOP/s and MFU. The loop is where the step's parts meet, so
    it reads the whole ``cfg``; each part it builds gets only its sections."""
    preemption = Preemption(backend)
    res: LoopResult | None = None
    try:
        res = _train(cfg, plan, backend, stream, val, monitors, start_step, after_step, after_eval, history, balancer,
                     objective=objective, eval_tasks=eval_tasks, preemption=preemption)
        return res
    finally:
        preemption.close(stopped=res is not None and res.preempted_at is not None)


def _train(cfg: DictConfig, plan: Plan, backend: Backend, stream: TrainStream, val: dict, monitors: Monitors,
           start_step: int, after_step: Callable[[int], None] | None, after_eval: Callable[[int, dict], bool] | None,
           history: dict | None, balancer: Balancer | None, *, objective: Objective,
           eval_tasks: Callable[[int], dict] | None, preemption: Preemption) -> LoopResult:
    tr = cfg.train
    flops_per_token = plan.facts.flops_per_token
    total, accum, dev = tr.steps, plan.grad_accum_steps, backend.device
    res = LoopResult()
    guard = NonFiniteGuard(cfg.debug, precision=cfg.precision.name, backend=backend)
    profiler = StepProfiler(cfg.profile, run_dir=cfg.run_dir, rank=backend.rank, device=dev)
    peak = peak_tflops(dev, cfg.precision.name, cfg.metrics.peak_tflops)

    health = Health(tr, backend.rank == 0, history, warn_max_over_mean=cfg.model.balance.warn_max_over_mean)
    res.warnings = health.warnings

    def run_eval(step: int) -> bool:
        metrics = objective.evaluate(backend, val, tr.eval_batches, plan.micro_batch_size)
        if metrics is None:  # the held-out cross-entropy (objective=lm) and its perplexity
            metrics = evaluate(backend, val, tr.eval_batches, plan, weights=stream.weights(),
                               shards=getattr(stream, "shards", None))
            metrics["eval/ppl"] = math.exp(min(metrics["eval/loss"], 50.0))
        if eval_tasks is not None:  # logged in the evaluation's row, to every monitor
            metrics.update(eval_tasks(step))
        loss = metrics["eval/loss"]
        res.eval_losses.append((step, loss))
        res.final_eval = metrics
        monitors.log(step, metrics)
        if health.on_eval(step, loss) and step < total:
            res.stopped_early_at = step
            return True
        return after_eval is not None and after_eval(step, metrics)

    if start_step == 0 and not cfg.debug.fast_dev_run:
        run_eval(0)  # the untrained model's loss: the baseline every later eval is compared with
    mtp_cfg = cfg.model.get("mtp")
    depths = objective.terms() - 1  # multi-token prediction depths (objective=lm): loss terms beside the main one
    loss_acc = torch.zeros(1 + depths, device=dev)
    n_acc, step_time, data_time, interval_start = 0, 0.0, 0.0, time.perf_counter()
    t_begin = time.perf_counter()
    done = start_step
    for step in range(start_step, total):
        done = step + 1  # steps are counted from 1 in logs, checkpoints and profile.steps
        profiler.before_step(done)
        t0 = time.perf_counter()
        with anomaly_detection(cfg.debug), torch.profiler.record_function("forward_backward"):
            td = time.perf_counter()
            batches = objective.micro_batches(step, accum, stream, backend)  # GRPO: its rollouts (generated here)
            data_time += time.perf_counter() - td
            # Token-weighted loss (docs/architecture.md): a step's loss is the cross-entropy summed over the label
            # tokens of every micro-batch and rank, divided by their number N; with multi-token prediction
            # (model.mtp) each depth is such a term of its own, over its own label tokens, times weight / depths.
            # Other objectives count their own units (objective.counts: DPO's pairs, GRPO's completion tokens).
            # 1. N (one per term) is needed before the first backward: one small all-reduce per step of this rank's
            #    counts (float64, exact once rounded); the ranks of one replica read the same batches, so the
            #    world's mean times dp_size is the sum over the replicas.
            # 2. Engines average the micro-batch losses they backpropagate over accumulation and data-parallel
            #    ranks; weighting each summed cross-entropy by accum x dp_size / N makes that average sum / N.
            # 3. A step without any label (N = 0) counts N as 1: its summed cross-entropy is 0, so are its
            #    gradient (MoE balance losses aside) and its logged loss, where a mean would be NaN.
            labels = torch.stack([objective.counts(x, y) for x, y in batches]).sum(0).double()
            n = (backend.all_reduce_mean(labels) * backend.dp_size).round().clamp(min=1)
            weight = (accum * backend.dp_size / n).float() * objective.factors(done)
            step_ce = torch.zeros(1 + depths, device=dev)
            probing = step == start_step  # one step: the options' record (debug.measure_activations: its bytes)
            with SpeedProbe(backend.hf_model(), cfg.model, bool(cfg.debug.measure_activations)) if probing \
                    else contextlib.nullcontext() as probe:
                for micro, (x, y) in enumerate(batches):
                    step_ce += backend.forward_backward(x, y, is_last_micro=micro == accum - 1, weight=weight).float()
                    drills.signal_in_step(done, backend.rank)
            if probe is not None:  # what the speed options did, measured on this engine (summary.json)
                res.speed_options = probe.record
        # This rank's share of each term's token-weighted mean: the mean over ranks (at log steps) is sum / N.
        step_loss = step_ce * (backend.dp_size / n).float()
        with torch.profiler.record_function("optimizer_step"):
            stats = backend.step(guard=guard.active)
            if balancer is not None:  # one all-reduce of every MoE layer's loads, then the routers' biases
                balancer.after_step(backend.all_reduce_mean, applied=stats.applied)
        if guard.active:  # stop (raise) or count a skipped update; one host sync per step
            guard.check(done, step_loss.sum(), stats)
        loss_acc += step_loss
        n_acc += 1
        step_time += time.perf_counter() - t0
        profiler.after_step(done)
        if done % tr.log_every_n_steps == 0 or done == total:
            # One small all-reduce per log interval, not per step: the loss is the interval's mean.
            losses = backend.all_reduce_mean(loss_acc / n_acc).tolist()
            loss = losses[0]
            wall = time.perf_counter() - interval_start
            tokens_per_s = plan.tokens_per_step * n_acc / wall
            metrics = {"train/loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm.item(),
                       "tokens_per_s": tokens_per_s, "samples_per_s": plan.global_batch_size * n_acc / wall,
                       "step_time_s": step_time / n_acc, "data_time_s": data_time / n_acc,
                       "tokens_seen": done * plan.tokens_per_step,
                       "tflops_per_device": flops_per_token * tokens_per_s / backend.world_size / 1e12,
                       **memory_metrics(dev)}
            if peak is not None:
                metrics["mfu"] = metrics["tflops_per_device"] / peak
            for k, depth_loss in enumerate(losses[1:], 1):  # each MTP depth's token-weighted mean (model.mtp)
                metrics[f"train/mtp_loss_{k}"] = depth_loss
            if depths:
                metrics["train/mtp_weight"] = mtp.term_weights(mtp_cfg, done)[1] * depths
            metrics.update(objective.train_metrics(backend.all_reduce_mean))
            if stats.loss_scale is not None:
                metrics["loss_scale"] = stats.loss_scale
            if guard.policy == "skip":
                metrics["skipped_steps"] = guard.skipped
            if balancer is not None:
                metrics.update(balancer.metrics())
                health.on_moe(done, metrics)
            monitors.log(done, metrics)
            res.train_losses.append((done, loss))
            if objective.loss_falls:
                health.on_train(done, loss)
            res.grad_norms.append((done, metrics["grad_norm"]))
            res.final_train_loss = loss
            loss_acc.zero_()
            n_acc, step_time, data_time, interval_start = 0, 0.0, 0.0, time.perf_counter()
        res.step_wall_s.append(time.perf_counter() - t0)
        if done == total or (tr.eval_every_n_steps and done % tr.eval_every_n_steps == 0):
            te = time.perf_counter()
            stop = run_eval(done)
            interval_start += time.perf_counter() - te  # throughput counts training time, not evaluation
            if stop and done < total:  # a trial that trained to the end is complete, whatever the pruner says
                if res.stopped_early_at is None:
                    res.pruned_at = done
                break
        if after_step is not None:
            after_step(done)
        if done < total and preemption.agreed():  # every rank alike; the caller saves this step and exits
            res.preempted_at = done
            res.preempted_by = (signal.Signals(preemption.received).name if preemption.received
                                else "a signal to another rank")
            break
    res.tokens = (done - start_step) * plan.tokens_per_step
    res.skipped_steps = guard.skipped
    res.wall_s = time.perf_counter() - t_begin
    return res
