"""shardyard's Hydra sweepers: ``hydra/sweeper=shardyard`` (the grid, the default) and ``hydra/sweeper=optuna``.

They live in the ``hydra_plugins`` namespace because Hydra instantiates sweepers only from there.

Both hand the jobs to whichever launcher is chosen (basic, joblib, submitit) and share ``shardyard.launching.sweep``:
readable job dirs, every job checked before the first starts, failures recorded while the sweep goes on,
resume with ``checkpoint.resume=auto``, and the summary at the end.

Why our own Optuna sweeper rather than hydra-optuna-sweeper 1.3.0 (the last release, 2023): it pins
``optuna<3`` (2.10, from 2021), has no pruner, and gives the task no way to reach its ``Trial``, so a trial
can neither report its evaluations nor stop early. This one is ~100 lines on current Optuna: the study lives
in a journal file in the sweep dir (``JournalFileBackend``: safe for several processes and for a file system
shared by Slurm nodes, no database server), each job receives its trial number (``sweep.trial``), rank 0
reports every evaluation to the trial, and all ranks stop together when the pruner says so.
"""

# No `from __future__ import annotations` here: Hydra's plugin scan executes this module without putting it in
# sys.modules, and @dataclass resolves string annotations through sys.modules[cls.__module__] (None then), so
# every Hydra program in the environment crashed at start (tests/e2e/test_foreign_hydra_app.py). Keep this
# module light too: the scan runs it for every Hydra app, so it imports no torch (optuna only in a sweep).
import os
import sys

from typing import Any, Dict, List, Optional, Sequence


from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from shardyard.launching import sweep
from shardyard.launching.sweep import Job
from shardyard.core import errors
from shardyard.config import preflight
from shardyard.config.sweepers import register  # noqa: F401 - Hydra's name for the plug-in's configs
from shardyard.core.errors import UserError, report_and_exit


def _setup(self: Any, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
    from hydra.core.plugins import Plugins

    self.hydra_context, self.config = hydra_context, config
    try:  # the sweeper's own packages (optuna), before any job or its launcher is built
        preflight.check_hydra(config.hydra)
    except UserError as err:
        report_and_exit(err)
    self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context, task_function=task_function,
                                                            config=config)


def _parsed(self: Any, arguments: List[str]) -> list[Any]:
    """The sweep's overrides: the recipe's ``hydra.sweeper.params`` then the command line's, parsed by Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert self.config is not None and self.hydra_context is not None
    parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
    return parser.parse_overrides([f"{k}={v}" for k, v in self.params.items()] + list(arguments))


def _launch(self: Any, sweep_dir: str, jobs: list[sweep.Job], first: int) -> list[Any]:
    return list(self.launcher.launch([j.overrides + sweep.hydra_overrides(sweep_dir, j) for j in jobs],
                                     initial_job_idx=first))


class ParallelLauncher(Launcher):
    """``hydra/launcher=parallel``: up to ``n_jobs`` jobs at once, each forked from this process.

    Why not only Hydra's joblib launcher (which also works here, with the same slots): its loky workers are
    fresh interpreters, and each imports torch and transformers again (~5 s of CPU each) before its job starts;
    on a 2-core box that made 2 jobs at a time 1.15-1.45x slower than one after another, where forked jobs
    take 0.77-0.85x (``bench/sweep_parallel.py``). A fork starts with all of it imported, as our own worker
    launch does (``launch.elastic``). This process must not have initialised CUDA (a fork after ``cuInit``
    cannot use it): shardyard's checks ask NVML and nvidia-smi, and a sweep where torch was asked is refused.
    """

    def __init__(self, n_jobs: int = 2) -> None:
        self.n_jobs = n_jobs

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import multiprocessing
        from multiprocessing.connection import wait

        assert self.config is not None
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            report_and_exit(UserError("hydra/launcher", "parallel", "CUDA was initialised in the sweep's own "
                                      "process (nvidia-smi is not on PATH, so torch was asked about the GPUs), and "
                                      "jobs forked from it could not use CUDA.",
                                      "Put nvidia-smi on PATH, or use hydra/launcher=joblib."))
        ctx = multiprocessing.get_context("fork")
        n = sweep.launcher_slots(self.config, len(job_overrides))
        pending = list(enumerate(job_overrides))
        running: dict[Any, tuple[int, Any, Any]] = {}  # sentinel -> (index, process, pipe)
        values: dict[int, tuple[JobStatus, Any]] = {}
        try:
            while pending or running:
                while pending and len(running) < n:
                    i, overrides = pending.pop(0)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=self._child, args=(send, initial_job_idx + i, list(overrides)))
                    proc.start()
                    send.close()
                    running[proc.sentinel] = (i, proc, recv)
                for sentinel in wait(list(running)):
                    i, proc, recv = running.pop(sentinel)
                    proc.join()
                    try:  # a job process killed (OOM, a signal) before it answered has sent nothing
                        got = recv.recv() if recv.poll() else None
                    except EOFError:
                        got = None
                    recv.close()
                    ok = got is not None and got[0] == "COMPLETED" and proc.exitcode == 0
                    values[i] = (JobStatus.COMPLETED, got[1]) if ok and got else (
                        JobStatus.FAILED, RuntimeError(f"job {initial_job_idx + i} ended with exit code {proc.exitcode}"))
        finally:  # interrupted (Ctrl-C): no job outlives the sweep
            for _, proc, _ in running.values():
                proc.terminate()
                proc.join()
        return [JobReturn(overrides=list(o), status=values[i][0], _return_value=values[i][1])
                for i, o in enumerate(job_overrides)]

    def _child(self, pipe: Any, idx: int, overrides: list[str]) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import run_job, setup_globals
        from omegaconf import open_dict

        from shardyard.core.errors import leave

        assert self.hydra_context is not None and self.config is not None
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
            sweep_config.hydra.job.num = idx
        HydraConfig.instance().set_config(sweep_config)
        ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        value = ret._return_value if ret.status == JobStatus.COMPLETED else None
        pipe.send((ret.status.name, value if isinstance(value, (int, float, type(None))) else None))
        leave(0)  # the job wrote and closed everything; skip the interpreter's teardown of torch


def _release_pool(config: DictConfig) -> None:
    """joblib keeps its loky worker processes for reuse, and at exit waited minutes for them (their jobs had
    finished and written everything; a worker that trained holds torch's threads). Nothing runs in them any
    more: end them now."""
    if str(config.hydra.launcher.get("_target_", "")).endswith("JoblibLauncher"):
        from joblib.externals.loky import get_reusable_executor

        get_reusable_executor().shutdown(wait=False, kill_workers=True)


def _prepare(self: Any, key: Any, jobs: list[sweep.Job]) -> tuple[str, bool]:
    """The sweep dir, and whether it continues an earlier sweep of the same jobs (``checkpoint.resume=auto``);
    every job checked. A sweep dir that holds another sweep, or this one without ``checkpoint.resume=auto``, is
    refused: its finished jobs would be taken for this sweep's."""
    from shardyard.launching import run

    config = self.config
    errors.JOB_STARTED = True  # composed: an exit from here on is the sweep's own, not a composition error
    resume = any(sweep.resuming(j.overrides) for j in jobs)
    previous = sweep.find_previous(config, key) if resume else None
    sweep_dir = previous or str(config.hydra.sweep.dir)
    held = sweep._read_json(os.path.join(sweep_dir, sweep.SWEEP))
    if held and not previous:
        same = held.get("identity") == key
        report_and_exit(UserError(
            "hydra.sweep.dir", sweep_dir, "It holds an earlier sweep" + (" of these jobs." if same else
                                                                         " of other jobs (other overrides)."),
            "Continue it with the same command and checkpoint.resume=auto." if same else
            "Choose a new hydra.sweep.dir (or leave it out: outputs/multirun/<time>)."))
    sweep.set_sweep_dir(config, sweep_dir)
    if previous:
        print(f"shardyard | resuming the sweep in {previous} (checkpoint.resume=auto)", flush=True)
    try:
        sweep.check(self.hydra_context.config_loader, config, sweep_dir,
                    [(j, j.overrides + sweep.hydra_overrides(sweep_dir, j)) for j in jobs])
    except UserError as err:
        report_and_exit(err)
    return sweep_dir, previous is not None


def _end(summary: dict[str, Any]) -> None:
    """A sweep with failed jobs exits 1 after its summary, so that a script or CI sees it."""
    failed = [r["job"] for r in summary["jobs"] if r["status"] not in sweep.DONE]
    if failed:
        print(f"shardyard | {len(failed)} of {len(summary['jobs'])} jobs did not finish: {', '.join(failed)}; the "
              "same command with checkpoint.resume=auto runs them again (resuming from their checkpoints)",
              file=sys.stderr, flush=True)
        sys.exit(1)


register()  # at import: Hydra's plugin scan imports this module before it composes `hydra/sweeper`


class GridSweeper(Sweeper):
    """Every combination of the swept values (Hydra's basic-sweeper grammar: ``a=1,2 b=x,y``)."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None) -> None:
        self.max_batch_size, self.params = max_batch_size, dict(params or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        _setup(self, hydra_context, task_function, config)

    def sweep(self, arguments: List[str]) -> Any:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        overrides = _parsed(self, arguments)
        config = self.config
        assert config is not None and self.hydra_context is not None
        expanded = [ovr for batch in BasicSweeper.split_arguments(overrides, None) for ovr in batch]
        jobs = sweep.name_jobs(expanded)
        key = [sweep.identity(j.overrides) for j in jobs]
        sweep_dir, resumed = _prepare(self, key, jobs)
        todo = [j for j in jobs if not (resumed and sweep.finished(sweep_dir, j.name))]
        for j in jobs:
            if j not in todo:
                print(f"shardyard | job {j.name}: {sweep.job_status(sweep_dir, j.name)} before, not run again", flush=True)
        sweep.write_sweep(sweep_dir, key, jobs, sweep.launcher_slots(config, len(todo)), config)
        returns = []
        for batch in _batches([jobs.index(j) for j in todo], self.max_batch_size):
            # Consecutive job numbers per launch: launchers number jobs initial_job_idx, +1, ...
            returns.append(_launch(self, sweep_dir, [jobs[i] for i in batch], batch[0]))
        _release_pool(config)
        _end(sweep.summarize(sweep_dir, jobs, config.sweep))
        return returns


def _batches(indices: list[int], size: int | None) -> list[list[int]]:
    """Runs of consecutive job numbers, at most ``size`` long (``null``: unbounded)."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] == i - 1 and (not size or len(out[-1]) < size):
            out[-1].append(i)
        else:
            out.append([i])
    return out


class OptunaSweeper(Sweeper):
    """Optuna search with pruning (see the module docstring for why not hydra-optuna-sweeper)."""

    requires = "optuna"  # the sweep extra (shardyard.config.preflight.check_hydra, before any job)

    def __init__(self, params: Dict[str, str], n_trials: int, n_jobs: int, sampler: str, seed: Optional[int],
                 pruner: str, pruner_startup_trials: int, pruner_warmup_steps: int, study_name: Optional[str]) -> None:
        self.params, self.n_trials, self.n_jobs = dict(params or {}), n_trials, max(1, n_jobs)
        self.sampler_name, self.seed, self.pruner_name = sampler, seed, pruner
        self.startup, self.warmup, self.study_name = pruner_startup_trials, pruner_warmup_steps, study_name or "shardyard"

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        _setup(self, hydra_context, task_function, config)

    def sweep(self, arguments: List[str]) -> Any:
        import optuna

        overrides = _parsed(self, arguments)
        config = self.config
        assert config is not None and self.hydra_context is not None
        space: dict[str, Any] = {}
        fixed: list[str] = []
        for o in overrides:
            if o.is_sweep_override():
                try:
                    space[o.get_key_element()] = distribution(o)
                except UserError as err:
                    report_and_exit(err)
                except ValueError as e:  # Optuna's own refusal, e.g. a log scale that reaches 0
                    report_and_exit(UserError(f"hydra.sweeper.params.{o.get_key_element()}",
                                              o.input_line.split("=", 1)[-1], f"Optuna refuses it: {str(e).rstrip('.')}.",
                                              "Give a range Optuna can sample (a log scale needs low > 0)."))
            else:
                fixed.append(f"{o.get_key_element()}={o.get_value_element_as_str()}")
        objective, sense = str(config.sweep.objective), sweep.direction(config.sweep)
        if not space:
            report_and_exit(UserError("hydra.sweeper.params", self.params, "The Optuna sweep has no search space.",
                                      "Give parameters such as optim.lr='tag(log, interval(1e-4, 1e-2))'."))
        if self.pruner_name != "none" and not objective.startswith("eval/"):
            report_and_exit(UserError("hydra.sweeper.pruner", self.pruner_name, f"Pruning compares the evaluations "
                                      f"of trials, and sweep.objective={objective} is not an evaluation metric.",
                                      "Use sweep.objective=eval/loss, or hydra.sweeper.pruner=none."))
        try:
            sampler, pruner = self._sampler(space), sweep.make_pruner(self.pruner_name, self.startup, self.warmup)
        except UserError as err:
            report_and_exit(err)
        most = config.scale.get("trials")
        if most is not None and self.n_trials > most:  # +scale=smoke: the search scaled down too
            print(f"shardyard | scale.trials={most}: {most} of the recipe's {self.n_trials} trials", flush=True)
            self.n_trials = most
        key = {"fixed": sorted(sweep.identity(fixed)), "space": {k: repr(v) for k, v in sorted(space.items())}}
        # Checked before the first trial: the search space's corners (trials are sampled inside them).
        corners = sweep.name_jobs([fixed + [f"{k}={_as_override(v)}" for k, v in c.items()] for c in _corners(space)])
        for c in corners:
            c.name = "corner " + c.name.split("_", 1)[-1]
        sweep_dir, resumed = _prepare(self, key, corners)  # resumed: the earlier sweep's dir, and its study
        storage_path = os.path.join(os.path.abspath(sweep_dir), "optuna.journal")
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        os.makedirs(sweep_dir, exist_ok=True)
        storage = JournalStorage(JournalFileBackend(storage_path))
        study = optuna.create_study(study_name=self.study_name, storage=storage,
                                    direction="maximize" if sense == "maximize" else "minimize",
                                    sampler=sampler, pruner=pruner, load_if_exists=resumed)
        # Optuna stores no pruner; each trial's job builds this one from the study (sweep.Trial).
        study.set_user_attr(sweep.PRUNER_ATTR, {"name": self.pruner_name, "startup": self.startup,
                                                "warmup": self.warmup})
        jobs_by_trial = self._earlier_jobs(sweep_dir) if resumed else {}
        for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            # Interrupted with the sweep: failed in the study; its parameters are asked again, in a new job.
            study.tell(stale.number, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(stale.params)
        counted = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        slots = sweep.launcher_slots(config, self.n_jobs)
        returns, failed = [], 0
        # n_trials finished or pruned trials; failed ones are retried with new parameters, but at most
        # n_trials of them, so a recipe whose every trial fails ends.
        while (done := len(study.get_trials(deepcopy=False, states=counted))) < self.n_trials and failed < self.n_trials:
            asked = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            batch = []
            for t in asked:
                ovr = [*fixed, *(f"{k}={_as_override(v)}" for k, v in t.params.items()),
                       f"sweep.trial={t.number}", f"sweep.storage={sweep.quoted(storage_path)}",
                       f"sweep.study={sweep.quoted(self.study_name)}"]
                shown = {k: sweep.fmt_value(str(v)) for k, v in t.params.items()}
                short = sweep.short_keys(list(shown))
                varying = {short[k]: v for k, v in shown.items()}
                jobs_by_trial[t.number] = sweep.Job(sweep.job_name(t.number, varying), ovr, varying)
                batch.append(jobs_by_trial[t.number])
            sweep.write_sweep(sweep_dir, key, [jobs_by_trial[n] for n in sorted(jobs_by_trial)], slots, config,
                              study=self.study_name, storage=storage_path)
            returns.append(_launch(self, sweep_dir, batch, asked[0].number))
            for t, j in zip(asked, batch):
                rec = sweep._read_json(os.path.join(sweep_dir, j.name, sweep.RESULT)) or {}
                status, value = rec.get("status"), rec.get("value")
                if status == "finished" and value is not None:
                    study.tell(t.number, value)
                elif status == "pruned":
                    study.tell(t.number, state=optuna.trial.TrialState.PRUNED)
                else:
                    study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                    failed += 1
        _release_pool(config)
        jobs = [jobs_by_trial[n] for n in sorted(jobs_by_trial)]
        extra = {}
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if complete:
            best = study.best_trial
            extra = {"best_trial": best.number, "best_params": best.params, "best_value": best.value}
            _write_results(sweep_dir, best.params, float(best.value or 0.0))
            print(f"shardyard | optuna: best trial {best.number}: {objective} = {best.value:.6g} with {best.params}",
                  flush=True)
        _end(sweep.summarize(sweep_dir, jobs, config.sweep, extra))
        return returns

    def _earlier_jobs(self, sweep_dir: str) -> dict[int, Job]:
        info = sweep._read_json(os.path.join(sweep_dir, sweep.SWEEP)) or {}
        return {int(j["name"].split("_", 1)[0]): sweep.Job(j["name"], j["overrides"], j.get("varying", {}))
                for j in info.get("jobs", []) if j["name"].split("_", 1)[0].isdigit()}

    def _sampler(self, space: dict[str, Any]) -> Any:
        import optuna

        def grid() -> Any:
            values = {}
            for k, d in space.items():
                if not isinstance(d, optuna.distributions.CategoricalDistribution):
                    raise UserError(f"hydra.sweeper.params.{k}", self.params.get(k), "The grid sampler needs a finite "
                                    "set of values.", "Use choice(...) or range(...), or hydra.sweeper.sampler=tpe.")
                values[k] = list(d.choices)
            size = 1
            for v in values.values():
                size *= len(v)
            if self.n_trials > size:  # the grid sampler would propose its points again
                print(f"shardyard | the grid has {size} points: {size} trials, not {self.n_trials}", flush=True)
                self.n_trials = size
            return optuna.samplers.GridSampler(values, seed=self.seed)

        samplers = {"tpe": lambda: optuna.samplers.TPESampler(seed=self.seed),
                    "random": lambda: optuna.samplers.RandomSampler(seed=self.seed), "grid": grid}
        if self.sampler_name not in samplers:
            raise UserError("hydra.sweeper.sampler", self.sampler_name, "Unknown sampler.", "Use tpe, random or grid.")
        return samplers[self.sampler_name]()


def distribution(o: Any) -> Any:
    """A swept override as an Optuna distribution: choice and range -> categorical, interval -> float (int when
    both ends are written as integers, or with ``tag(int, ...)``), log-scaled with ``tag(log, ...)``."""
    import optuna.distributions as d
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    v = o.value()
    log = "log" in getattr(v, "tags", set())
    if isinstance(v, ChoiceSweep):
        choices: list[Any] = list(v.list)
        if not choices or not all(isinstance(c, (int, float, str, bool)) for c in choices):
            raise UserError(f"hydra.sweeper.params.{o.get_key_element()}", o.input_line.split("=", 1)[-1],
                            "Optuna's choices must be numbers, strings or booleans (and at least one).",
                            "Sweep a list-valued key as strings, or choose its values in a config group.")
        return d.CategoricalDistribution(choices)
    if isinstance(v, RangeSweep):
        values = list(o.sweep_iterator())
        return d.CategoricalDistribution(values)
    if isinstance(v, IntervalSweep):
        assert v.start is not None and v.end is not None
        # Hydra makes both ends floats; integers are asked for by tag(int, ...) or by integer ends as written.
        import re

        if "int" in v.tags or re.search(r"interval\(\s*-?\d+\s*,\s*-?\d+\s*\)", o.input_line):
            return d.IntDistribution(int(v.start), int(v.end), log=log)
        return d.FloatDistribution(float(v.start), float(v.end), log=log)
    raise UserError(f"hydra.sweeper.params.{o.get_key_element()}", o.input_line.split("=", 1)[-1],
                    "This sweep form has no Optuna equivalent.",
                    "Use choice(...), range(...) or interval(...), tagged log for a log scale.")


def _corners(space: dict[str, Any]) -> list[dict[str, Any]]:
    """The search space's extremes to check before the first trial: the combinations of each parameter's ends
    (its low and high, or each choice); the first 64 of them where there are more."""
    import itertools

    import optuna.distributions as d

    ends = {k: (list(v.choices) if isinstance(v, d.CategoricalDistribution) else sorted({v.low, v.high}))
            for k, v in space.items()}
    combos = [dict(zip(ends, c)) for c in itertools.product(*ends.values())]
    return combos[:64]


def _as_override(value: Any) -> str:
    import re

    if isinstance(value, str):
        return value if re.fullmatch(r"[\w./-]+", value) else sweep.quoted(value)
    return repr(value) if isinstance(value, float) else str(value)


def _write_results(sweep_dir: str, params: dict, value: float) -> None:
    """``optimization_results.yaml``, the file hydra-optuna-sweeper writes, for scripts that read it."""
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": params, "best_value": value}),
                   os.path.join(sweep_dir, "optimization_results.yaml"))
