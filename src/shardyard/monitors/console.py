"""Rank-0 console: a rich progress bar on a TTY, plain lines otherwise, and the end-of-run summary."""

from __future__ import annotations

import sys
import time

from omegaconf import DictConfig

from shardyard.monitors import extra_eval_metric


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


HEADLINES = {"reward": "reward", "accuracy": "accuracy", "rewards/accuracies": "pref. accuracy",
             "rewards/margins": "margin", "kl": "KL"}
"""Post-training objectives' metrics shown on the step and eval lines (``train/<key>``, ``eval/<key>``)."""


def _headlines(m: dict, prefix: str) -> str:
    return "".join(f" | {label} {m[prefix + key]:.4f}" for key, label in HEADLINES.items() if prefix + key in m)


class ConsoleMonitor:
    in_check_runs = True
    """Kept by a check run (``debug.fast_dev_run``, ``+scale=smoke``): it writes nothing and reaches no service."""

    def __init__(self, run_dir: str, config: DictConfig, style: str = "auto"):
        self.total, self.t0 = config.train.steps, time.perf_counter()
        self.rich = style == "rich" or (style == "auto" and sys.stdout.isatty())
        self.progress = None
        if self.rich:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.progress.add_task("train", total=self.total, info="")
            self.progress.start()

    def log(self, step: int, m: dict) -> None:
        if "train/loss" in m:
            mtp = " ".join(f"{m[k]:.4f}" for k in sorted(m) if k.startswith("train/mtp_loss_"))
            info = (f"loss {m['train/loss']:.4f}" + (f" | MTP {mtp}" if mtp else "") + _headlines(m, "train/") + f" | lr {m['lr']:.2e} | grad {m['grad_norm']:.3f} | "
                    f"{m['tokens_per_s']:,.0f} tok/s" + (f" | MFU {100 * m['mfu']:.1f}%" if "mfu" in m else "")
                    + (f" | scale {m['loss_scale']:.0f}" if "loss_scale" in m else "")
                    + (f" | skipped {m['skipped_steps']}" if m.get("skipped_steps") else "")
                    + (f" | MoE max/mean {m['moe/max_over_mean']:.2f}" if "moe/max_over_mean" in m else ""))
            if self.progress is not None:
                self.progress.update(self.task, completed=step, info=info)
            else:
                elapsed = time.perf_counter() - self.t0
                eta = elapsed / max(step, 1) * (self.total - step)
                print(f"step {step:>{len(str(self.total))}}/{self.total} | {info} | eta {_fmt_time(eta)}", flush=True)
        if "eval/loss" in m:
            line = (f"eval @ step {step}: loss {m['eval/loss']:.4f}" + (f" | ppl {m['eval/ppl']:.2f}" if "eval/ppl" in m else "")
                    + _headlines(m, "eval/") + "".join(f" | {k[5:]} {v:.4f}" for k, v in m.items()
                                                       if extra_eval_metric(k) and k[5:] not in HEADLINES
                                                       and "_stderr" not in k))
            (self.progress.console.print if self.progress is not None else print)(line)

    def fail(self, error: str) -> None:
        if self.progress is not None:
            self.progress.stop()

    def close(self, s: dict) -> None:
        if self.progress is not None:
            self.progress.stop()
        first, last = s["eval_losses"][0], s["eval_losses"][-1]
        change = f", {100 * (1 - last[1] / first[1]):.1f}% lower" if first[1] else ""
        print("\n".join([
            "-" * 72,
            f"done: {s['steps']} steps in {_fmt_time(s['wall_s'])} | {s['tokens']:,} tokens | "
            f"{s['tokens_per_s']:,.0f} tok/s | {s['params']:,} parameters | engine {s['backend']} x{s['world_size']}",
            f"train loss {s['final_train_loss']:.4f} | eval loss {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} "
            f"(step {last[0]}){change}" + (f" | eval ppl {s['final_eval_ppl']:.2f}" if "final_eval_ppl" in s else ""),
            f"run dir: {s['run_dir']}" + (f" | HF export: {s['export']}" if s.get("export") else ""),
            "-" * 72,
        ]), flush=True)
