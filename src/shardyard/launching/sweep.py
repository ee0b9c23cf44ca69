"""Sweeps (``python train.py -m ...``): what every job of a multirun does around its run, and what the sweep
shares between its sweepers (``hydra_plugins.shardyard_sweepers``: the grid sweeper, the default, and ``optuna``).

A sweep, start to end:

1. The sweeper expands the jobs, names each job's directory by the overrides that vary (``0_lr=1e-3``), and
   with ``checkpoint.resume=auto`` finds the earlier sweep of the same jobs (``sweep.json``) to continue.
2. Every job is composed, validated and its memory plan checked before the first one starts (``check``); one
   impossible job refuses the whole sweep, naming it.
3. The launcher runs the jobs (one after another, ``hydra/launcher=joblib`` several at once, submitit on
   Slurm). Each job runs ``job()``: a local slot of its own when jobs run side by side (rendezvous port range,
   GPUs, CPU threads), the run, and ``result.json`` with its status and objective. A failure is recorded and
   the sweep goes on; the task function returns the objective (``sweep.objective``), for any Hydra sweeper.
4. ``summarize`` prints the table ranked by the objective with the best job marked, and writes
   ``sweep_summary.csv``, ``sweep_summary.json`` and ``report.png`` (every job's curves) in the sweep dir.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from omegaconf import DictConfig

from shardyard.core.errors import UserError
from shardyard.training.trial import PRUNER_ATTR, make_pruner  # noqa: F401 - the sweeper reaches them here

RESULT = "result.json"
"""Each job's record in its own directory: status, error, objective value, slot and port (written by rank 0)."""
SWEEP = "sweep.json"
"""The sweep's record in the sweep dir: its jobs (names and overrides), parallel slots, objective."""
DONE = ("finished", "pruned")
"""Statuses of a job that a resumed sweep does not run again."""


# --------------------------------------------------------------------------------- the objective
def direction(sweep_cfg: Any) -> str:
    if sweep_cfg.direction != "auto":
        return str(sweep_cfg.direction)
    return "maximize" if str(sweep_cfg.objective).endswith("_per_s") or sweep_cfg.objective in ("mfu",) else "minimize"


def objective_value(metrics: dict[str, list[tuple[int, float]]], objective: str) -> float | None:
    """The job's objective from its metrics: the last value; for a throughput the mean over the logged
    intervals after the first (the first holds compilation and warm-up)."""
    points = metrics.get(objective)
    if not points:
        return None
    if objective.endswith("_per_s"):
        values = [v for _, v in points[1:]] or [points[0][1]]
        return sum(values) / len(values)
    return points[-1][1]


def _metrics(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from shardyard.monitors.report import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    return read_metrics(path) if os.path.isfile(path) else {}


# --------------------------------------------------------------------------------- one job
def job(cfg: DictConfig, run: Callable[[DictConfig], None]) -> float | None:
    """One job of a multirun, in the launcher's process (or each task of a submitit job): take a slot, run,
    write ``result.json``, return the objective. A failed job is recorded and printed, never raised: the
    sweep goes on with the others (Hydra's sweepers stop at the first job that raises)."""
    from hydra.core.hydra_config import HydraConfig

    from shardyard.core import dist_env

    env = dist_env.detect()
    rank0 = env is None or env.is_rank0
    hc = HydraConfig.get()
    sweep_dir, run_dir = str(hc.sweep.dir), str(cfg.run_dir)
    info = _read_json(os.path.join(sweep_dir, SWEEP)) or {}
    record: dict[str, Any] = {"job": os.path.basename(os.path.normpath(run_dir)), "status": "running",
                              "overrides": list(hc.overrides.task), "started": time.time(), "host": os.uname().nodename}
    status, error = "finished", None
    environ = dict(os.environ)  # a job trained in this process sets RANK, MASTER_PORT...: not the next job's
    slots = int(info.get("slots", 1)) if env is None else 1
    try:  # the slot's own errors (its ports all taken, fewer GPUs than jobs) fail the job like any other
        with _environ_restored(environ), _slot(sweep_dir, slots, cfg) as local:
            record.update(local)
            if rank0:  # a job dir whose result says "running" and whose process is gone did not finish
                os.makedirs(run_dir, exist_ok=True)
                _write_json(os.path.join(run_dir, RESULT), record)
            run(cfg)
    except UserError as err:
        if rank0 or not err.all_ranks:
            print(err.paragraph(), file=sys.stderr, flush=True)
        status, error = "failed", err.paragraph()
    except SystemExit as e:  # our launcher's exit after a worker failed; it printed why
        if e.code not in (0, None):
            from shardyard.launching import launch

            rank0_error = _last_error(run_dir)
            error = launch.LAST_FAILURE or f"the job exited with code {e.code}"
            if rank0_error:
                error += f"; rank 0: {_first_line(rank0_error)}"
            status = "failed"
            launch.LAST_FAILURE = None
    except Exception as e:  # noqa: BLE001 - a job's crash is its row in the summary, not the sweep's end
        import traceback

        traceback.print_exc()
        status, error = "failed", f"{type(e).__name__}: {e}"
    summary = _read_json(os.path.join(run_dir, "summary.json")) or {}
    if status == "finished" and summary.get("pruned_at"):
        status = "pruned"
    value = objective_value(_metrics(run_dir), str(cfg.sweep.objective)) if status != "failed" else None
    if value is not None and value != value:  # NaN: no rank, and Optuna would refuse it
        status, error, value = "failed", error or f"{cfg.sweep.objective} is NaN", None
    record.update(status=status, error=error, objective=str(cfg.sweep.objective), value=value, ended=time.time())
    if rank0:
        os.makedirs(run_dir, exist_ok=True)
        _write_json(os.path.join(run_dir, RESULT), record)
        mark = f"= {value:.6g}" if value is not None else ""
        print(f"shardyard | sweep job {record['job']}: {status} {cfg.sweep.objective} {mark}"
              + (f" ({_first_line(error)})" if error else ""), flush=True)
    return value


@contextlib.contextmanager
def _environ_restored(saved: dict[str, str]) -> Iterator[None]:
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _last_error(run_dir: str) -> str | None:
    """The error a failed run's rank 0 recorded in its metrics.jsonl (a worker's user error or exception)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    last = None
    with open(path) as f:
        for line in f:
            if '"error"' in line:
                with contextlib.suppress(json.JSONDecodeError):
                    last = json.loads(line).get("error") or last
    return last


@contextlib.contextmanager
def _slot(sweep_dir: str, slots: int, cfg: DictConfig) -> Iterator[dict[str, Any]]:
    """Jobs side by side on one machine: hold one of ``slots`` slot locks (``fcntl``, so any local launcher's
    processes share them and a crashed job frees its slot) and give the job that slot's share: a rendezvous
    port range of its own, its GPUs and its CPU threads."""
    if slots <= 1:
        yield {}
        return
    import fcntl

    lock_dir = os.path.join(sweep_dir, ".slots")
    os.makedirs(lock_dir, exist_ok=True)
    while True:
        for k in range(slots):
            f = open(os.path.join(lock_dir, f"slot{k}.lock"), "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            saved = {v: os.environ.get(v) for v in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
            try:
                yield _partition(k, slots, cfg)
            finally:
                for v, old in saved.items():  # a process of the launcher's pool runs the next job too
                    if old is None:
                        os.environ.pop(v, None)
                    else:
                        os.environ[v] = old
                f.close()
            return
        time.sleep(0.2)


def _partition(k: int, slots: int, cfg: DictConfig) -> dict[str, Any]:
    """Slot k of n: ports ``base + 64k ...``, GPUs ``k*g .. (k+1)*g-1`` of the visible ones, ``cores / n``
    threads shared by the job's ranks."""
    from shardyard.launching.launch import port_is_free

    out: dict[str, Any] = {"slot": k, "slots": slots}
    if cfg.launch.master_port is None:
        first = int(cfg.sweep.base_port) + 64 * k
        port = next((p for p in range(first, first + 64) if port_is_free(p)), None)
        if port is None:
            raise UserError("sweep.base_port", cfg.sweep.base_port, f"Ports {first}-{first + 63} (job slot {k}) "
                            "are all taken.", "Choose another sweep.base_port.")
        cfg.launch.master_port = port
        out["master_port"] = port
    visible = _visible_gpus()
    per_job_gpus = len(visible) // slots
    if visible:
        if per_job_gpus == 0:
            raise UserError("hydra.launcher.n_jobs", slots, f"{slots} jobs at once on {len(visible)} GPUs leave "
                            "some job without a GPU.", f"Run at most {len(visible)} jobs at once.")
        mine = visible[k * per_job_gpus:(k + 1) * per_job_gpus]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        out["devices"] = mine
    ranks = cfg.launch.nproc_per_node
    ranks = int(ranks) if str(ranks).isdigit() else max(1, per_job_gpus)
    threads = max(1, (os.cpu_count() or 1) // (slots * ranks))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # a job trained in this process (one rank) uses the pool torch already made
        sys.modules["torch"].set_num_threads(threads)
    out["threads_per_rank"] = threads
    return out


def _visible_gpus() -> list[str]:
    """GPU ids visible to this process, without initialising CUDA (workers fork or spawn from it)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    from shardyard.planning.validate import _cuda_count

    return [str(i) for i in range(_cuda_count())]


# --------------------------------------------------------------------------------- naming and planning
@dataclass
class Job:
    name: str
    """Directory name in the sweep dir: the job number and the overrides that vary (``3_lr=3e-3,warmup=50``)."""
    overrides: list[str]
    """The job's own overrides (the task's, without the sweeper's ``hydra.*`` ones)."""
    varying: dict[str, str] = field(default_factory=dict)
    """Short key -> value of the overrides that vary across the sweep."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each key's shortest dotted suffix that no other key ends with: ``optim.lr`` -> ``lr``."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(o != key and (o == tail or o.endswith("." + tail)) for o in keys):
                break
        out[key] = tail
    return out


def fmt_value(value: str) -> str:
    """A value as a directory name shows it: floats in their shortest form (``0.001`` -> ``1e-3``)."""
    try:
        x = float(value)
    except ValueError:
        return value
    if re.fullmatch(r"[+-]?\d+", value.strip()) or x != x or x in (float("inf"), float("-inf")):
        return value.strip()
    plain = f"{x:.4g}"
    mantissa, exp = f"{x:.3e}".split("e")
    sci = f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
    return sci if len(sci) < len(plain) else plain


def job_name(number: int, shown: dict[str, str], limit: int = 80) -> str:
    """``3_lr=3e-3,warmup=50``: file-system safe, and ending in a short hash past ``limit`` characters."""
    body = ",".join(f"{k}={v}" for k, v in shown.items())
    name = re.sub(r"[^A-Za-z0-9_.=,+\-]", "_", f"{number}_{body}" if body else str(number))
    if len(name) > limit:
        name = f"{name[:limit - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def name_jobs(job_overrides: list[list[str]], first: int = 0, limit: int = 80) -> list[Job]:
    """Readable job directory names from the overrides that vary (the job number keeps them unique; a name
    longer than ``limit`` ends in a short hash)."""
    parsed = [{_key(o): o.split("=", 1)[1] if "=" in o else "" for o in ovr} for ovr in job_overrides]
    keys: list[str] = []
    for p in parsed:
        keys += [k for k in p if k not in keys]
    varying = [k for k in keys if len({p.get(k) for p in parsed}) > 1 and not k.startswith(("sweep.", "hydra."))]
    short = short_keys(varying)
    jobs = []
    for i, (ovr, p) in enumerate(zip(job_overrides, parsed)):
        shown = {short[k]: fmt_value(p[k]) for k in varying if k in p}
        jobs.append(Job(job_name(first + i, shown, limit), list(ovr), shown))
    return jobs


def quoted(value: str) -> str:
    return "'" + value.replace("'", "\\'") + "'"


def hydra_overrides(sweep_dir: str, job_: Job) -> list[str]:
    """What the sweeper adds to a job's overrides: its directory (``hydra.*`` keys stay out of the job's own)."""
    return [f"hydra.sweep.dir={quoted(sweep_dir)}", f"hydra.sweep.subdir={quoted(job_.name)}"]


def identity(overrides: list[str]) -> list[str]:
    """A job's overrides as a resumed sweep compares them (``checkpoint.resume`` aside)."""
    return sorted(o for o in overrides if _key(o) != "checkpoint.resume")


def resuming(overrides: list[str]) -> bool:
    return any(_key(o) == "checkpoint.resume" and o.split("=", 1)[1].strip("'\"") == "auto" for o in overrides)


def find_previous(config: DictConfig, key: Any) -> str | None:
    """The earlier sweep dir whose ``sweep.json`` has this identity ``key``: a fixed ``hydra.sweep.dir`` itself;
    one named by the clock (the default ``outputs/multirun/${now:...}``) the newest such sibling."""
    from omegaconf import OmegaConf

    here = str(config.hydra.sweep.dir)
    node = OmegaConf.to_container(config.hydra.sweep, resolve=False)
    raw = str(node.get("dir") if isinstance(node, dict) else here)
    parent = os.path.dirname(here) or "."
    if "${" not in raw:
        candidates = [here]
    else:
        candidates = [os.path.join(parent, d) for d in os.listdir(parent)] if os.path.isdir(parent) else []
    found = [(os.path.getmtime(p), d) for d in candidates
             if (info := _read_json(p := os.path.join(d, SWEEP))) and info.get("identity") == key]
    return max(found)[1] if found else None


def set_sweep_dir(config: DictConfig, sweep_dir: str) -> None:
    """The launcher reads the sweep dir from the primary config (jobs get it as an override)."""
    from omegaconf import open_dict, read_write

    with read_write(config), open_dict(config):
        config.hydra.sweep.dir = sweep_dir


def launcher_slots(config: DictConfig, jobs: int) -> int:
    """How many jobs a local launcher runs at once: ``n_jobs`` of ``hydra/launcher=parallel`` or ``joblib``
    (-1: one per core), else 1. Remote launchers (submitit) give each job its own allocation: no slots."""
    target = str(config.hydra.launcher.get("_target_", ""))
    if not target.endswith(("JoblibLauncher", "shardyard_sweepers.ParallelLauncher")):
        return 1
    n = int(config.hydra.launcher.n_jobs)
    cores = os.cpu_count() or 1
    n = cores + 1 + n if n < 0 else n
    return max(1, min(n, jobs))


def write_sweep(sweep_dir: str, key: Any, jobs: list[Job], slots: int, config: DictConfig, **extra: Any) -> None:
    os.makedirs(sweep_dir, exist_ok=True)
    _write_json(os.path.join(sweep_dir, SWEEP), {
        "identity": key, "slots": slots, "objective": str(config.sweep.objective), "direction": direction(config.sweep),
        "jobs": [{"name": j.name, "overrides": j.overrides, "varying": j.varying} for j in jobs], **extra})


def finished(sweep_dir: str, name: str) -> bool:
    return job_status(sweep_dir, name) in DONE


def job_status(sweep_dir: str, name: str) -> str | None:
    rec = _read_json(os.path.join(sweep_dir, name, RESULT))
    return rec.get("status") if rec else None


# --------------------------------------------------------------------------------- checked before launch
def check(config_loader: Any, config: DictConfig, sweep_dir: str, jobs: list[tuple[Job, list[str]]]) -> None:
    """Compose, validate and plan every job before the first starts; the first impossible one refuses the
    sweep (``UserError`` naming it). ``jobs``: (job, the overrides to compose it with). Jobs of a remote
    launcher (submitit on Slurm) are composed only, unless ``plan.hardware`` names the nodes' hardware."""
    from omegaconf import open_dict

    from shardyard.planning import search as plan_search
    from shardyard.planning import scale
    from shardyard.planning.validate import apply_fast_dev_run, validate

    env, remote = _launcher_world(config)
    for j, overrides in jobs:
        try:
            cfg = config_loader.load_sweep_config(config, overrides)
            with open_dict(cfg):
                del cfg["hydra"]
                cfg.run_dir = os.path.join(sweep_dir, j.name)
            if remote and not cfg.plan.hardware:
                # The submitting machine is not the nodes (a CPU login node for GPU nodes): validating here
                # would judge the job by the wrong devices. Composed here; validated on the nodes.
                continue
            scale.apply(cfg)
            apply_fast_dev_run(cfg)
            batch = validate(cfg, env)
            if not cfg.plan.only:  # this machine's plan, or with plan.hardware the cluster's
                plan_search.before_launch(cfg, batch, rank0=False)
        except UserError as err:
            raise UserError(err.key, err.value, f"Job {j.name} of the sweep cannot run: "
                            f"{err.problem} No job was started.", err.fix) from None
        except Exception as e:  # a composition error (unknown key or option) names the job too
            raise UserError("the sweep's overrides", " ".join(j.overrides), f"Job {j.name} cannot be composed: "
                            f"{type(e).__name__}: {_first_line(str(e))}. No job was started.",
                            "Correct that override; `python train.py --cfg job` lists every key.") from None


def _launcher_world(config: DictConfig) -> tuple[Any, bool]:
    """The world each job of a submitit launcher gets (nodes x tasks per node), as its workers will see it."""
    from shardyard.core.dist_env import DistEnv

    launcher = config.hydra.launcher
    if "submitit" not in str(launcher.get("_target_", "")):
        return None, False
    nodes = int(launcher.get("nodes", 1) or 1)
    per_node = int(launcher.get("tasks_per_node", 1) or 1)
    return DistEnv("submitit", 0, 0, nodes * per_node, per_node), "Slurm" in str(launcher._target_)


# --------------------------------------------------------------------------------- the summary
COLUMNS = ["job", "status", "objective", "train_loss", "eval_loss", "best_eval_loss", "best_eval_step",
           "tokens_per_s", "wall_s", "error"]


def row(sweep_dir: str, j: Job, objective: str) -> dict[str, Any]:
    run_dir = os.path.join(sweep_dir, j.name)
    rec = _read_json(os.path.join(run_dir, RESULT)) or {}
    m = _metrics(run_dir)
    evals = m.get("eval/loss", [])
    best = min(evals, key=lambda p: p[1]) if evals else None
    status = rec.get("status") or "not run"
    if status == "running":  # its process is gone: killed, or its node was lost
        status = "unfinished"
    trains = m.get("train/loss")
    out: dict[str, Any] = {"job": j.name, **{f"+{k}": v for k, v in j.varying.items()}, "status": status,
                           "objective": rec.get("value") if status in DONE else None,
                           "train_loss": trains[-1][1] if trains else None,
                           "eval_loss": evals[-1][1] if evals else None,
                           "best_eval_loss": best[1] if best else None, "best_eval_step": best[0] if best else None,
                           "tokens_per_s": objective_value(m, "tokens_per_s"),
                           "wall_s": round(rec["ended"] - rec["started"], 1) if rec.get("ended") else None,
                           "error": _first_line(rec.get("error"))}
    return out


def summarize(sweep_dir: str, jobs: list[Job], sweep_cfg: Any, extra: dict | None = None) -> dict[str, Any]:
    """Print the table (ranked by the objective, the best job marked) and write ``sweep_summary.csv``,
    ``sweep_summary.json`` and ``report.png`` in the sweep dir; returns the summary."""
    objective, sense = str(sweep_cfg.objective), direction(sweep_cfg)
    rows = [row(sweep_dir, j, objective) for j in jobs]
    order = {"finished": 0, "pruned": 1}

    def rank(r: dict[str, Any]) -> tuple:
        v = r["objective"]
        return (order.get(r["status"], 2), v is None, (-v if sense == "maximize" else v) if v is not None else 0)

    rows.sort(key=rank)
    best = rows[0] if rows and rows[0]["status"] == "finished" and rows[0]["objective"] is not None else None
    for r in rows:
        r["best"] = r is best
    varying = [k for k in dict.fromkeys(k for r in rows for k in r if k.startswith("+"))]
    summary = {"sweep_dir": sweep_dir, "objective": objective, "direction": sense,
               "best": best, "jobs": rows, **(extra or {})}
    _write_json(os.path.join(sweep_dir, "sweep_summary.json"), summary)
    with open(os.path.join(sweep_dir, "sweep_summary.csv.tmp"), "w", newline="") as f:
        w = csv.DictWriter(f, ["best", "job", *varying, *COLUMNS[1:]], extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    os.replace(os.path.join(sweep_dir, "sweep_summary.csv.tmp"), os.path.join(sweep_dir, "sweep_summary.csv"))
    print(table(rows, varying, objective, sense), flush=True)
    try:
        from shardyard.monitors.report import draw

        print(f"shardyard | sweep report: {draw(sweep_dir)}", flush=True)
    except Exception as e:  # noqa: BLE001 - no metrics at all (every job failed early), or a plotting problem
        print(f"shardyard | no sweep report.png ({type(e).__name__}: {_first_line(str(e))})", flush=True)
    print(f"shardyard | sweep summary: {os.path.join(sweep_dir, 'sweep_summary.csv')} (and .json)", flush=True)
    return summary


def table(rows: list[dict[str, Any]], varying: list[str], objective: str, sense: str) -> str:
    def f(v: Any, spec: str = ".4f") -> str:
        return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)

    head = ["", "job", *[k[1:] for k in varying], objective, "train loss", "eval loss", "best eval @step",
            "tokens/s", "wall s", "status"]
    body = [["*" if r["best"] else "", r["job"], *[f(r.get(k)) for k in varying], f(r["objective"], ".5g"),
             f(r["train_loss"]), f(r["eval_loss"]),
             f"{f(r['best_eval_loss'])} @{r['best_eval_step']}" if r["best_eval_loss"] is not None else "-",
             f(r["tokens_per_s"], ".0f"), f(r["wall_s"], ".1f"),
             r["status"] + (f": {r['error'][:70]}" if r["error"] else "")] for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *body]]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    title = (f"shardyard | sweep summary: {len(rows)} jobs ({', '.join(f'{n} {s}' for s, n in counts.items())}), "
             f"ranked by {objective} ({sense}); * = best")
    return "\n".join([title, *lines])


# --------------------------------------------------------------------------------- small helpers
def _first_line(text: str | None, limit: int = 240) -> str | None:
    """An error's first line; a user error's paragraph (wrapped at 100 columns) is one line, unwrapped."""
    if not text or not text.strip():
        return None
    text = text.strip()
    line = " ".join(text.split()) if text.startswith("shardyard: error in") else text.splitlines()[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)
