"""Metric sinks. ``jsonl`` is always on; the ``monitor`` list group picks the others. Rank 0 only.

Each plugin module is imported only when selected (tensorboard, wandb and mlflow are heavy), and
``validate`` checks before launch that a selected plugin's package is installed. The end-of-run report
(``report``: report.png) is drawn from the same metrics.

May import: ``config``, ``core``. Independent of ``models`` and ``data``.
"""

from __future__ import annotations

import sys
from typing import Protocol

from omegaconf import DictConfig

# Every metric the loop reports, in the order the CSV columns take. A name absent from a log call is
# simply not reported at that step (eval metrics only at evaluations, MFU only with a known peak...).
METRICS = {
    "train/loss": "mean training loss over the log interval (all ranks)",
    "eval/loss": "mean loss on the held-out set",
    "eval/ppl": "exp(eval/loss)",
    "lr": "learning rate of the step",
    "grad_norm": "global L2 norm of the gradients before clipping",
    "tokens_per_s": "global training throughput, tokens per second",
    "samples_per_s": "global training throughput, sequences per second",
    "step_time_s": "mean wall time of an optimizer step",
    "data_time_s": "mean time per step spent fetching batches",
    "tokens_seen": "tokens trained on so far",
    "tflops_per_device": "achieved model TFLOP/s per device (6N + 12*L*H*Q*T FLOPs per token)",
    "mfu": "model FLOPs utilisation: tflops_per_device / the device's peak (GPUs with a known peak)",
    "memory/max_allocated_gib": "CUDA: peak memory allocated by tensors in the interval (rank 0)",
    "memory/max_reserved_gib": "CUDA: peak memory reserved by the caching allocator in the interval (rank 0)",
    "memory/rss_gib": "CPU: resident memory of the rank-0 process",
    "loss_scale": "dynamic loss scale (fp16 only)",
    "skipped_steps": "optimizer steps skipped for non-finite gradients so far (debug.nan_policy=skip)",
}


def extra_eval_metric(key: str) -> bool:
    """An evaluation metric outside ``METRICS``: a harness task's score (``train.eval_tasks``: the task's, or a
    group's or tag's member tasks', ``eval/<task>/<metric>``), a data source's loss, an objective's own. The CSV
    gives each a column when it first comes; the console's eval line shows them."""
    return key.startswith("eval/") and key not in METRICS


class Monitor(Protocol):
    """Built as ``_target_(run_dir=..., config=<the run config>, **its option's keys)`` on rank 0. A class
    attribute ``requires = "package"`` lets validation name a missing package before launch; a class
    attribute ``in_check_runs = True`` keeps the monitor in a check run (``check_run_only``).

    Optional: ``resume(step)``, called once before the first ``log``. The run trains on from a checkpoint at
    ``step`` (-1: from scratch) in a run dir that may hold an earlier attempt's log (a crash after that
    checkpoint, a requeued job): a monitor that keeps files in the run dir drops what it logged at later
    steps, so that each step is shown once."""

    def log(self, step: int, metrics: dict) -> None: ...

    def close(self, summary: dict) -> None:
        """The run finished; ``summary`` holds its final numbers (and the export path)."""

    def fail(self, error: str) -> None:
        """The run stopped with an error: flush, and mark the run failed where the tool has the notion."""


class Monitors:
    """Fans every call out to the selected monitors."""

    def __init__(self, monitors: list[Monitor]):
        self.monitors = monitors

    def resume(self, step: int) -> None:
        for m in self.monitors:
            hook = getattr(m, "resume", None)  # optional: a monitor that writes no files needs none
            if hook is not None:
                hook(step)

    def log(self, step: int, metrics: dict) -> None:
        for m in self.monitors:
            m.log(step, metrics)

    def close(self, summary: dict) -> None:
        for m in self.monitors:
            m.close(summary)

    def fail(self, error: str) -> None:
        for m in self.monitors:
            try:
                m.fail(error)
            except Exception as e:  # a sink failing must not hide the error that stopped the run
                print(f"shardyard | monitor {type(m).__name__} could not record the failure: {e}", file=sys.stderr)


def build(monitor: DictConfig | None, run_dir: str, config: DictConfig, is_rank0: bool) -> Monitors:
    """Each selected monitor (``monitor``: the run's ``monitor`` section) is
    ``monitor.<name>._target_(run_dir=..., config=<the run config>, **its keys)``. The plug-ins get the whole
    resolved ``config`` on purpose: a tracker records it as the run's parameters (wandb's run config, MLflow's
    params), and one call shape serves every plug-in."""
    if not is_rank0:
        return Monitors([])
    from shardyard.config.plugins import build as build_plugin
    from shardyard.monitors.jsonl import JsonlMonitor

    out: list[Monitor] = [JsonlMonitor(run_dir)]
    for node in (monitor or {}).values():
        out.append(build_plugin(node, run_dir=run_dir, config=config))
    return Monitors(out)


def check_run_only(monitor: DictConfig | None) -> None:
    """A check run (``debug.fast_dev_run``, ``+scale=smoke``) drops from ``monitor`` every monitor whose class
    does not say ``in_check_runs`` (all but the console): nothing of a check run belongs in a tracker or a
    results file. A ``_target_`` that does not import is dropped too (validation would refuse it)."""
    from hydra.utils import get_object

    if monitor is None:
        return

    def kept(node: DictConfig) -> bool:
        try:
            return bool(getattr(get_object(node._target_), "in_check_runs", False))
        except Exception:
            return False

    for name in [n for n, node in monitor.items() if not kept(node)]:
        del monitor[name]


def history(run_dir: str, upto_step: int) -> dict:
    """A run's curves read back from its ``metrics.jsonl``: evaluations, train losses and grad norms logged
    at steps <= ``upto_step``, each step once (its latest line). Checkpoints store them (``meta.json``) so a
    resumed run's summary starts from the run's own step 0."""
    import json
    import os

    out: dict[str, dict[int, float]] = {"eval_losses": {}, "train_losses": {}, "grad_norms": {}}
    path = os.path.join(run_dir, "metrics.jsonl")
    if upto_step <= 0 or not os.path.exists(path):
        return {k: [] for k in out}
    keys = {"eval/loss": "eval_losses", "train/loss": "train_losses", "grad_norm": "grad_norms"}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the last line of a process killed mid-write
                continue
            step = row.get("step")
            if step is None or step > upto_step:
                continue
            for metric, name in keys.items():
                if metric in row:
                    out[name][step] = row[metric]
    return {k: sorted(v.items()) for k, v in out.items()}
