"""``shardyard eval``'s lm-evaluation-harness part: the harness's tasks (its own, shardyard's shipped local ones,
the user's ``include_path``) run through ``lm_eval.simple_evaluate`` with the harness's ``HFLM`` wrapper over a
loaded model object. ``lm_eval`` (the ``eval`` extra) is imported only inside these functions."""

from __future__ import annotations

import difflib
import os
from typing import Any

from shardyard.errors import UserError

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_tasks")
"""The local tasks shipped with shardyard (one directory per task: its harness YAML and data)."""


def require_harness() -> None:
    """``lm_eval`` is importable, or a ``UserError`` naming ``tasks`` and the extra that installs it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("tasks", "(lm-eval not installed)", "The lm-evaluation-harness (the `lm-eval` package) is "
                        "not installed, and scoring tasks needs it.",
                        "Install shardyard's eval extra: pip install 'shardyard[eval]' (or pip install lm-eval), "
                        "or leave tasks unset for perplexity alone.") from None


def task_manager(include_path: str | None, defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over shardyard's shipped tasks, ``include_path`` and (``defaults``) the harness's
    own (indexing those 14,000 task YAMLs takes about 11 s on 2 cores; the local ones alone 0.1 s)."""
    from lm_eval.tasks import TaskManager

    paths = [TASKS_DIR]
    if include_path:
        if not os.path.isdir(include_path):
            raise UserError("include_path", include_path, "There is no such directory.",
                            "Give the directory holding your task YAMLs (each with `task: NAME`).")
        paths.append(os.path.abspath(include_path))
    return TaskManager(include_path=paths, include_defaults=defaults)


def check_tasks(tasks: list[str], include_path: str | None) -> Any:
    """Every task name is one the harness knows (shipped, ``include_path``, its own); returns the manager that
    holds them: the local tasks' alone when they are all local."""
    local = task_manager(include_path, defaults=False)
    if all(t in set(local.all_tasks) for t in tasks):
        return local
    manager = task_manager(include_path)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        close = sorted({c for t in unknown for c in difflib.get_close_matches(t, known, n=3, cutoff=0.6)})
        raise UserError("tasks", unknown[0] if len(unknown) == 1 else unknown,
                        "The lm-evaluation-harness knows no such task" + (f" (close: {', '.join(close)})." if close
                                                                          else "."),
                        "Use a task `lm-eval ls tasks` lists, the shipped stdlib_qa, or your own task YAML in a "
                        f"directory given as include_path=DIR (shipped ones live in {TASKS_DIR}).")
    return manager


def harness(model: Any, tokenizer: Any, tasks: list[str], *, include_path: str | None = None,
            limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8, seed: int = 1234,
            manager: Any = None) -> dict:
    """Scores of ``tasks`` through ``lm_eval.simple_evaluate`` with the harness's ``HFLM`` over the loaded model
    object: ``{task: {metric: value, "<metric>_stderr": stderr}}``. ``manager``: a ``TaskManager`` holding the
    tasks (``check_tasks``'), when already built."""
    require_harness()
    manager = manager or check_tasks(tasks, include_path)
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, log_samples=False, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed, verbosity="WARNING")
    return scores(out)


def scores(out: Any) -> dict:
    """``{task: {metric: value}}`` from ``simple_evaluate``'s results (its ``"metric,filter"`` keys named by the
    metric alone when the filter is the default ``none``)."""
    tasks = {}
    for task, metrics in (out or {}).get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or not isinstance(value, (int, float)):
                continue
            row[metric if filt == "none" else f"{metric},{filt}"] = value
        tasks[task] = row
    return tasks
