"""The lm-evaluation-harness in shardyard: the harness's tasks (its own, shardyard's shipped local ones, the user's
``include_path``) run as ``lm_eval.simple_evaluate`` runs them (``_evaluate``) with the harness's ``HFLM`` wrapper
over a loaded model object (``shardyard eval``), or, during training (``train.eval_tasks``), over the engine's model
on every rank in lockstep (``InTraining``). ``lm_eval`` (the ``eval`` extra) is imported only inside these functions."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import random
from typing import Any, Callable, Iterator

from shardyard.config.preflight import install_command
from shardyard.core.errors import UserError

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
"""The local tasks shipped with shardyard (one directory per task: its harness YAML and data)."""


def require_harness(key: str = "tasks", instead: str = "leave tasks unset for perplexity alone") -> None:
    """``lm_eval`` is importable, or a ``UserError`` naming ``key`` (the option that asked for tasks), the extra
    that installs it, and ``instead``: what to do without it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(key, "(lm-eval not installed)", "The lm-evaluation-harness (the `lm-eval` package) is "
                        "not installed, and scoring tasks needs it.",
                        f"Install it once with `{install_command(['eval'])}` (shardyard's eval extra), "
                        f"or {instead}.") from None


def task_manager(include_path: str | None, defaults: bool = True, include_key: str = "include_path") -> Any:
    """lm-eval's ``TaskManager`` over shardyard's shipped tasks, ``include_path`` and (``defaults``) the harness's
    own (indexing those 14,000 task YAMLs takes about 11 s on 2 cores; the local ones alone 0.1 s).
    ``include_key``: the option that gave ``include_path``, named when it is no directory."""
    from lm_eval.tasks import TaskManager

    paths = [TASKS_DIR]
    if include_path is not None and not str(include_path).strip():
        raise UserError(include_key, include_path, "The value is empty.",
                        f"Give the directory holding your task YAMLs, or leave {include_key} unset.")
    if include_path:
        if not os.path.isdir(include_path):
            raise UserError(include_key, include_path, "There is no such directory.",
                            "Give the directory holding your task YAMLs (each with `task: NAME`).")
        paths.append(os.path.abspath(include_path))
    return TaskManager(include_path=paths, include_defaults=defaults)


def check_tasks(tasks: list[str], include_path: str | None, key: str = "tasks",
                include_key: str = "include_path") -> Any:
    """Every task name is one the harness knows (shipped, ``include_path``, its own); returns the manager that
    holds them: the local tasks' alone when they are all local. ``key``, ``include_key``: the options that named
    the tasks and the directory (``shardyard eval``'s, or ``train.eval_tasks``'). A YAML of ``include_path`` that
    the harness skips (it does not parse, or is no task or group) is named when it declares a task asked for, or
    when a task asked for is unknown (lm-eval itself skips such a file without a word)."""
    local = task_manager(include_path, defaults=False, include_key=include_key)
    skipped = _skipped_yamls(include_path)
    declared = [(path, problem) for path, problem, names in skipped if names & set(tasks)]
    if declared:
        path, problem = declared[0]
        raise UserError(include_key, path, f"This task YAML cannot be read by the lm-evaluation-harness: {problem}; "
                        "so the task it declares is not registered.",
                        "Correct the YAML (`python -c \"import yaml; yaml.safe_load(open('FILE'))\"` shows where it "
                        "breaks), or leave the task out of " + key + ".")
    if all(t in set(local.all_tasks) for t in tasks):
        return local
    manager = task_manager(include_path, include_key=include_key)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        close = sorted({c for t in unknown for c in difflib.get_close_matches(t, known, n=3, cutoff=0.6)})
        unread = (f" {include_key} holds task YAMLs the harness skips: "
                  + "; ".join(f"{path}: {problem}" for path, problem, _ in skipped[:3])
                  + (f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else "") + "." if skipped else "")
        raise UserError(key, unknown[0] if len(unknown) == 1 else unknown,
                        "The lm-evaluation-harness knows no such task" + (f" (close: {', '.join(close)})." if close
                                                                          else ".") + unread,
                        ("Correct those YAMLs, or use" if skipped else "Use") + " a task `lm-eval ls tasks` lists, "
                        f"the shipped stdlib_qa, or your own task YAML in a directory given as {include_key}=DIR "
                        f"(shipped ones live in {TASKS_DIR}).")
    return manager


def _skipped_yamls(include_path: str | None) -> list[tuple[str, str, set[str]]]:
    """``(path, why, names it declares)`` of each ``*.yaml`` under ``include_path`` that lm-eval's index skips (it
    does not parse, or is neither a task nor a group): read as the index reads them (``TaskIndex.build``); the
    names are the ``task:``/``group:`` lines of its raw text."""
    import re
    from pathlib import Path

    if not include_path or not os.path.isdir(include_path):
        return []
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    found = []
    for path in TaskIndex._iter_yaml_files(Path(include_path)):
        try:
            TaskIndex._kind_of(load_yaml(path, resolve_func=False, recursive=True))
        except Exception as e:  # what the index skips: a YAML error, an include that is not there, no task/group
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
            names = set(re.findall(r"^\s*(?:task|group)\s*:\s*[\"']?([^\s\"'#]+)", text, re.M))
            found.append((str(path), _one_line(e), names))
    return found


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def build_tasks(manager: Any, tasks: list[str], key: str = "tasks") -> dict:
    """Every task of ``tasks`` built as the harness builds it before scoring (``manager.load``: its YAML read, its
    ``!function``s imported, its dataset loaded, its documents' templates checked): the ``load`` result, which
    ``harness`` (``loaded=``) scores without building them again. A task that does not build is a ``UserError``
    naming ``key``, the task, its YAML and the field at fault (``_build_error``). lm-eval's warnings while building
    (its defaults filled in) are not printed: a check says nothing when it passes."""
    with _held_logs() as held:
        try:
            return manager.load(list(tasks))
        except Exception as failure:  # lm-eval's own errors: ValueError, KeyError, FileNotFoundError, jinja2's ...
            raise _build_error(manager, tasks, key, failure, held) from None


@contextlib.contextmanager
def _held_logs() -> Iterator[list]:
    """lm-eval's log records of WARNING and above, held in a list instead of printed (its loggers' handlers and
    propagation put back after)."""
    held: list = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    logger = logging.getLogger("lm_eval")
    handlers, propagate = logger.handlers[:], logger.propagate
    hold = Hold(logging.WARNING)
    logger.handlers[:], logger.propagate = [hold], False
    try:
        yield held
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate


def _build_error(manager: Any, tasks: list[str], key: str, failure: BaseException, held: list) -> UserError:
    """The refusal of a task that does not build (``failure``, with lm-eval's warnings ``held``): each task, then
    each member task of a group or tag, is built alone (one task alone: not again) until one fails; its YAML and
    the field whose value the error (else a warning before it) names are named."""
    index = manager.task_index
    for name in tasks:
        members = _members(index, name)
        for leaf in [*members, name]:
            if len(tasks) > 1 or members:
                with _held_logs() as held:
                    try:
                        manager.load([leaf])
                        continue
                    except Exception as e:
                        failure = e
            entry = index.get(leaf)
            path = getattr(entry, "yaml_path", None)
            cfg = getattr(entry, "cfg", None)
            cfg = cfg if isinstance(cfg, dict) else {}
            field = _field_at_fault(cfg, [str(failure)]) or _field_at_fault(cfg, [r.getMessage() for r in held])
            what = f"task {leaf}" + (f" (of {name})" if leaf != name else "")
            where = f"its YAML {path}" if path else "it"
            problem = (f"The {what} does not build: {where} gives `{field}` a value the harness cannot use "
                       f"({_one_line(failure)})." if field else
                       f"The {what} does not build ({where}): {_one_line(failure)}.")
            files = ("data_files" in (field or "") or isinstance(failure, FileNotFoundError))
            return UserError(key, name, problem, (f"Correct `{field}` in {path}" if field and path else
                                                 f"Correct {path}" if path else "Correct the task")
                             + (" (a local data file: an absolute path, or relative to the directory the command "
                                "runs in)" if files else "") + f", or leave {name} out of {key}.")
    return UserError(key, list(tasks), f"The tasks do not build together: {_one_line(failure)}.",
                     f"Build them one at a time (`shardyard eval ... {key}=[NAME]`) to find the one at fault.")


def _members(index: dict, name: str) -> list[str]:
    """The registered tasks a group or tag holds (recursively, each once), in order; none for a task."""
    found: list[str] = []
    seen = {name}

    def visit(n: str) -> None:
        entry = index.get(n)
        kind = getattr(getattr(entry, "kind", None), "name", None)
        cfg = getattr(entry, "cfg", None)
        if kind == "TAG":
            children: list = sorted(getattr(entry, "tags", None) or [])
        elif kind == "GROUP" and isinstance(cfg, dict):
            children = [c if isinstance(c, str) else (c.get("task") or c.get("group")) for c in cfg.get("task") or []
                        if isinstance(c, (str, dict))]
        else:
            return
        for child in children:
            if isinstance(child, str) and child in index and child not in seen:
                seen.add(child)
                visit(child)
                found.append(child)

    visit(name)
    return found


def _field_at_fault(cfg: dict, messages: list[str]) -> str | None:
    """The dotted key of ``cfg`` (a task YAML) whose value the error ``messages`` name: the longest value that one
    of them holds as a whole token (a misspelt ``output_type``, a data file, a split, a metric), else a template
    field that uses a name the message quotes (``'answer' is undefined`` -> ``doc_to_target: "{{answer}}"``)."""
    import re

    leaves: list[tuple[str, str]] = []

    def walk(node: Any, at: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{at}.{k}" if at else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{at}[{i}]")
        elif isinstance(node, (str, int, float)) and not isinstance(node, bool):
            leaves.append((at, str(node)))

    walk({k: v for k, v in cfg.items() if k not in ("task", "tag", "group", "metadata")}, "")
    text = "\n".join(messages)
    hits = [(len(v), k) for k, v in leaves if len(v) >= 3 and "\n" not in v
            and re.search(r"(?<![\w-])" + re.escape(v) + r"(?![\w-])", text)]
    if hits:
        return max(hits)[1]
    for quoted in re.findall(r"'([A-Za-z_][\w.]*)'", text):
        for k, v in leaves:
            if ("{{" in v or "{%" in v) and re.search(r"\b" + re.escape(quoted) + r"\b", v):
                return k
    return None


def harness(model: Any, tokenizer: Any, tasks: list[str], *, include_path: str | None = None,
            limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8, seed: int = 1234,
            manager: Any = None, lm: Any = None, loaded: dict | None = None) -> dict:
    """Scores of ``tasks`` with the harness's ``HFLM`` over the loaded model object:
    ``{task: {metric: value, "<metric>_stderr": stderr}}`` (``_evaluate``). ``manager``: a ``TaskManager`` holding
    the tasks (``check_tasks``'), when already built; ``lm``: the harness's model wrapper, when already built
    (``InTraining``'s lockstep one; ``model``, ``tokenizer`` and ``batch_size`` are then its); ``loaded``: the tasks
    themselves, when already built (``build_tasks``': building draws no random number, so they are the tasks
    ``simple_evaluate`` builds after seeding)."""
    require_harness()
    manager = manager or check_tasks(tasks, include_path)
    from lm_eval.models.huggingface import HFLM

    lm = lm or HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return scores(_evaluate(lm, tasks, manager, limit=limit, num_fewshot=num_fewshot, seed=seed, loaded=loaded))


def _evaluate(lm: Any, tasks: list[str], manager: Any, *, limit: float | None, num_fewshot: int | None,
              seed: int, loaded: dict | None = None) -> Any:
    """What ``lm_eval.simple_evaluate(model=lm, tasks=..., task_manager=manager, log_samples=False, limit=...,
    num_fewshot=..., every seed=seed)`` computes, less its bookkeeping: the same seeding, task loading and
    few-shot settings, then ``lm_eval.evaluator.evaluate``. Skipped: the run's record (``git describe``, the
    environment report, the tokenizer's) that ``simple_evaluate`` gathers where it believes it is rank 0 by
    ``LOCAL_RANK``; so ``InTraining``'s ranks need no faked ``LOCAL_RANK`` to all get the results."""
    import logging

    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.utils import setup_logging

    setup_logging(verbosity=logging.WARNING)  # simple_evaluate's verbosity="WARNING"
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    loaded = loaded or manager.load(list(tasks))
    for task in loaded["tasks"].values():  # simple_evaluate's few-shot rules
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif num_fewshot is None and task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    return evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=False)


def generation_tasks(manager: Any, tasks: list[str]) -> list[str]:
    """The tasks among ``tasks`` (a group's or tag's members included) whose harness YAML gives (or defaults to)
    ``output_type: generate_until``, read from ``manager``'s index (no dataset is loaded). Python-class tasks and
    inline members whose type the index does not tell are left out (``InTraining`` refuses them at their first
    evaluation)."""
    index = manager.task_index
    found: list[str] = []
    seen: set[str] = set()

    def visit(name: str, cfg: dict | None = None) -> None:
        if name in seen:
            return
        seen.add(name)
        entry = index.get(name)
        kind = getattr(getattr(entry, "kind", None), "name", None)
        cfg = cfg if cfg is not None else getattr(entry, "cfg", None)
        if kind == "TAG":
            for member in sorted(entry.tags):
                visit(member)
        elif isinstance(cfg, dict) and "group" in cfg:
            for child in cfg.get("task") or []:
                if isinstance(child, str):
                    visit(child)
                elif isinstance(child, dict):  # an inline member: its own type, or its registered task's
                    inline = str(child.get("group") or child.get("task") or "")
                    if "group" in child or "output_type" in child:
                        visit(inline, child)
                    elif inline in index:
                        visit(inline)
        elif isinstance(cfg, dict) and "task" in cfg and "class" not in cfg:
            if cfg.get("output_type", "generate_until") == "generate_until":
                found.append(name)

    for t in tasks:
        visit(t)
    return found


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


# ----------------------------------------------------------------------------------------------- during training
class InTraining:
    """``train.eval_tasks``: the harness's tasks scored at every evaluation of a run (the final one too) on the model
    being trained, as ``shardyard eval`` scores them (``harness``: the same ``_evaluate`` call, seeds and ``HFLM``
    tokenization), so the run's last row equals ``shardyard eval`` on its export.

    The model may be sharded (FSDP, ZeRO-3, tensor parallel), where every rank must join every forward. So every
    rank runs the harness in lockstep: lm-eval is told it runs in one process (its own distributed code, through
    accelerate, never starts; ``LOCAL_RANK`` is left as it is, so a ZeRO-3 forward that reads it finds its own
    device), builds the same requests on every rank, and hands them to ``_lockstep_lm``'s
    ``loglikelihood``, which shares them out over the data-parallel replicas itself (see there) and gives every
    rank all the answers; lm-eval's metrics are then computed on every rank alike, and rank 0's monitors log
    them. The random states of ``random``, numpy and torch are put back after each call (lm-eval seeds all three),
    so a run with tasks trains as it would without. Generation tasks (``generate_until``) are refused: by
    ``validate`` where the task's YAML tells, else at the first evaluation."""

    def __init__(self, tasks: list[str], backend: Any, tokenizer_dir: str, *, batch_size: int,
                 limit: float | None = None, include_path: str | None = None):
        """``backend``: the engine (its ``hf_model()``, ``all_reduce_mean``, ``dp_rank``, ``dp_size``);
        ``tokenizer_dir``: the run's tokenizer (the one its export carries); ``batch_size``: requests per forward
        on each rank."""
        self.tasks, self.backend, self.tokenizer_dir = list(tasks), backend, tokenizer_dir
        self.batch_size, self.limit, self.include_path = batch_size, limit, include_path
        self.lm: Any = None
        self.manager: Any = None

    @classmethod
    def of(cls, train: Any, backend: Any, tokenizer_dir: str, batch_size: int) -> "InTraining | None":
        """The run's (``train``: its ``train`` section), or None when it names no ``eval_tasks``."""
        tasks = list(train.get("eval_tasks") or [])
        if not tasks:
            return None
        from shardyard.config.options import limit

        return cls(tasks, backend, tokenizer_dir, batch_size=batch_size,
                   limit=limit("train.eval_tasks_limit", train.get("eval_tasks_limit")),
                   include_path=train.get("eval_tasks_include_path"))

    def __call__(self, step: int) -> dict:
        """Every rank, together: ``{"eval/<task>/<metric>": value}`` (stderr as ``<metric>_stderr``)."""
        import numpy as np
        import torch

        from shardyard.data.token_cache import load_tokenizer

        model = self.backend.hf_model()
        if self.lm is None:
            self.manager = check_tasks(self.tasks, self.include_path, key="train.eval_tasks",
                                       include_key="train.eval_tasks_include_path")
            self.lm = _lockstep_lm(model, load_tokenizer(self.tokenizer_dir), self.batch_size,
                                   share=lambda t: self.backend.all_reduce_mean(t) * self.backend.dp_size,
                                   dp_rank=self.backend.dp_rank, dp_size=self.backend.dp_size)
        states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
        was_training = model.training
        model.eval()
        try:
            results = harness(model, None, self.tasks, include_path=self.include_path, limit=self.limit,
                              manager=self.manager, lm=self.lm)
        finally:
            model.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])
        return {f"eval/{task}/{metric}": float(value) for task, row in results.items() for metric, value in row.items()}


def _lockstep_lm(model: Any, tokenizer: Any, batch_size: int, *, share: Callable[[Any], Any], dp_rank: int,
                 dp_size: int) -> Any:
    """The harness's ``HFLM`` over ``model`` (tokenization, truncation and scoring as ``shardyard eval``'s), whose
    log-likelihoods are computed by ``dp_size`` data-parallel replicas together, every rank of the world calling
    this with the same requests:

    1. the requests are ordered longest first (the same order on every rank) and taken in rounds of
       ``batch_size x dp_size``; replica ``dp_rank`` takes every ``dp_size``-th request of a round (strided);
    2. each round is one forward per rank of a ``[batch_size, longest in the round]`` batch, right-padded, with
       dummy rows where a replica's share is short, so every rank runs the same forwards with the same shapes
       (a sharded model gathers its weights inside them; tensor-parallel peers, one replica, run the same rows);
    3. each request's ``(log-likelihood, greedy)`` is written into a ``[requests, 2]`` float64 tensor of zeros
       at its own index; ``share`` (the mean over the world times ``dp_size``: the sum over the replicas) gives
       every rank all of them, exactly."""
    import torch
    import torch.nn.functional as F
    from lm_eval.models.huggingface import HFLM

    class Lockstep(HFLM):
        def get_model_info(self) -> dict:
            return {}  # HFLM's asks the hub for the model's revision: nothing to ask about a model in training

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list:
            tasks = sorted({r.task_name for r in requests if getattr(r, "task_name", None)})
            raise UserError("train.eval_tasks", tasks or "(a generation task)", "Generation tasks (output_type "
                            "generate_until) are not scored during training: only log-likelihood and multiple-"
                            "choice tasks run in lockstep on every rank.",
                            "Score them after the run with `shardyard eval RUN tasks=[...]`, and keep "
                            "train.eval_tasks to log-likelihood and multiple-choice tasks.").on_every_rank()

        def _loglikelihood_tokens(self, requests: Any, disable_tqdm: bool = False,
                                  override_bs: Any = None) -> list:
            rows = [((ctx + cont)[-(self.max_length + 1):][:-1], cont) for _, ctx, cont in requests]  # HFLM's
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # 1
            out = torch.zeros(len(rows), 2, dtype=torch.float64, device=self.device)
            per_round = batch_size * dp_size
            for start in range(0, len(order), per_round):
                members = order[start:start + per_round]
                mine = members[dp_rank::dp_size]
                width = max(len(rows[i][0]) for i in members)
                padded = [rows[i][0] + [0] * (width - len(rows[i][0])) for i in mine]
                padded += [[0] * width] * (batch_size - len(mine))  # 2: dummy rows: 0s
                logits = self._model_call(torch.tensor(padded, dtype=torch.long, device=self.device))
                if not mine:
                    continue
                conts = torch.tensor([t for i in mine for t in rows[i][1]], dtype=torch.long, device=self.device)
                scored, at = [], 0
                for j, i in enumerate(mine):  # each row's continuation alone: no [rows, width, vocab] fp32 copy
                    inp, cont = rows[i]
                    logp = F.log_softmax(logits[j, len(inp) - len(cont):len(inp)], dim=-1, dtype=self.softmax_dtype)
                    want = conts[at:at + len(cont)]
                    at += len(cont)
                    scored.append(torch.stack([logp.gather(1, want[:, None]).sum().double(),
                                               (logp.argmax(-1) == want).all().double()]))
                out[torch.tensor(mine, device=self.device)] = torch.stack(scored)  # 3: on the device, no host sync
            every = (share(out) if rows else out).cpu().tolist()  # the one copy to the host
            answers = [(ll, greedy > 0.5) for ll, greedy in every]
            for (key, _, _), answer in zip(requests, answers):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return answers

    was_training = model.training
    lm = Lockstep(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)  # sets eval mode
    model.train(was_training)
    return lm
