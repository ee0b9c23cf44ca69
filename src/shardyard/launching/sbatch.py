"""``shardyard sbatch recipe=NAME nodes=N gpus_per_node=G [KEY=VALUE ...] [--submit]``: a ready Slurm batch
script for a recipe, written beside its future run dirs, and with ``--submit`` handed to ``sbatch``.

The script is plain bash that a user can read, edit and keep: one ``srun`` task per worker (per GPU, or
``tasks_per_node`` on CPU nodes); every task is a worker of ``train.py`` that maps SLURM_* onto its rank
(``dist_env``), with rank 0 listening on the first node of the job. The run dir is fixed by the job id,
which Slurm keeps across requeues, so a preempted or ``scontrol requeue``-d job starts again in the same run
dir and resumes from its newest complete checkpoint (``checkpoint.resume=auto``). Ahead of the time limit Slurm
signals the script (``--signal=B:USR1@signal_s``), which passes the signal to the workers through srun: they save
at their next step boundary and exit ``errors.EXIT_REQUEUE`` (75), and the script requeues the job.
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from shardyard.core.errors import EXIT_REQUEUE, UserError


@dataclass
class SbatchOptions:
    """The keys ``shardyard sbatch`` takes for itself; every other ``KEY=VALUE`` is a ``train.py`` override."""

    nodes: int = 1
    """Nodes of the job (``--nodes``)."""
    gpus_per_node: int = 0
    """GPUs per node (``--gpus-per-node``); one worker task per GPU. 0: CPU nodes, see ``tasks_per_node``."""
    tasks_per_node: Optional[int] = None
    """Worker tasks per node; default ``gpus_per_node``, or 1 on CPU nodes."""
    cpus_per_task: Optional[int] = None
    """``--cpus-per-task`` (data loading and the optimizer step on CPU); Slurm's default when unset."""
    partition: Optional[str] = None
    """``--partition``; the cluster's default when unset."""
    time: Optional[str] = None
    """``--time`` limit, e.g. ``2-00:00:00``; the partition's default when unset."""
    account: Optional[str] = None
    """``--account``."""
    qos: Optional[str] = None
    """``--qos``."""
    job_name: Optional[str] = None
    """``--job-name``; default the recipe's name."""
    out_dir: Optional[str] = None
    """Where the script, Slurm's log and the run dirs (one per job id) go; default ``outputs/sbatch/JOB_NAME``."""
    signal_s: int = 300
    """Seconds before the time limit at which Slurm sends SIGUSR1 to the script (``--signal=B:USR1@N``), which
    passes it to the workers: they save at their next step boundary, exit 75, and the script requeues the job.
    Leave room for a step and a save (Slurm may signal up to a minute early). 0: no warning (at the limit Slurm's
    SIGTERM still lets the workers save within its ``KillWait``, but nothing requeues the job)."""


def check_value(key: str, value: str, directive: bool = False) -> str:
    """A value that goes into the script: one line of printable text, which ``shlex.quote`` then makes one
    shell word. A newline would end the quoted word's line and start a command of its own; other control
    characters (a carriage return, an escape sequence) make the script read differently on a terminal than it
    runs. In an ``#SBATCH`` line (``directive``) a backslash is refused too: Slurm's parser of those lines takes
    it as an escape even inside quotes, so Slurm would read another value than bash."""
    bad = next((c for c in value if ord(c) < 32 or 127 <= ord(c) < 160), None)
    if bad is not None:
        raise UserError(key, value, f"It holds the control character {bad!r}, and every value written into the job "
                        "script must be one line of printable text (a newline would start a command of its own).",
                        f"Give {key} without newlines or control characters.")
    if directive and "\\" in value:
        raise UserError(key, value, "It holds a backslash, which Slurm's #SBATCH parser reads as an escape "
                        "character (even inside quotes), so Slurm would see another value than the one given.",
                        f"Give {key} without a backslash.")
    return value


def parse(args: list[str]) -> tuple[SbatchOptions, list[str]]:
    """Split the command line into this command's options and the train.py overrides."""
    opts = SbatchOptions()
    names = {f.name: f for f in fields(SbatchOptions)}
    overrides = []
    for arg in args:
        key, eq, value = arg.partition("=")
        check_value(key if eq and key.isprintable() else "shardyard sbatch", arg if key not in names else value,
                    directive=key in names)
        if not eq:
            raise UserError("shardyard sbatch", arg, "Arguments are KEY=VALUE (sbatch keys or train.py overrides).",
                            "Write e.g. `shardyard sbatch recipe=deepseek7b_zero3 nodes=2 gpus_per_node=8`.")
        if key not in names:
            overrides.append(arg)
            continue
        if key in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "signal_s"):
            zero = key in ("gpus_per_node", "signal_s")
            if not value.isdigit() or (int(value) < 1 and not zero):
                raise UserError(key, value, "It must be a whole number" + (" of 0 or more." if zero
                                                                             else " of 1 or more."),
                                f"Use e.g. {key}={2 if key == 'nodes' else 300 if key == 'signal_s' else 8}.")
            setattr(opts, key, int(value))
        else:
            setattr(opts, key, value)
    return opts, overrides


def _compose_check(overrides: list[str], project: bool) -> str:
    """Compose the recipe here, so a misspelt key fails now and not after the job waited in the queue;
    returns the recipe's name."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from shardyard.launching import project as projects
    from shardyard.config import compose

    try:
        projects._compose(Path.cwd(), overrides) if project else compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        problem = str(e).split("Config search path")[0].strip()
        raise UserError("shardyard sbatch", " ".join(overrides), f"The overrides do not compose: {problem}",
                        "Fix the override (`python train.py --help` lists groups, `--cfg job` every key).") from None
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), None)
    return recipe or "shardyard"


def script(opts: SbatchOptions, overrides: list[str], command_line: str, out_dir: Path, python: str,
           workdir: Path, entry: list[str]) -> str:
    """The batch script's text. Each line says why it is there. Every value in it is checked (``check_value``)
    and shell-quoted, the ``#SBATCH`` ones included (Slurm's parser of those lines honours the same quotes)."""
    tasks = opts.tasks_per_node or opts.gpus_per_node or 1
    world = tasks * opts.nodes
    q = shlex.quote
    for key in ("job_name", "partition", "time", "account", "qos"):
        check_value(key, getattr(opts, key) or "", directive=True)
    check_value("out_dir", str(out_dir), directive=True)
    if "%" in str(out_dir):
        raise UserError("out_dir", str(out_dir), "Slurm reads % in the log's path as a file-name pattern (%j: the "
                        "job id), so the log would be written somewhere else.", "Give an out_dir without %.")
    check_value("the working directory", str(workdir))
    check_value("the Python interpreter", python)
    for o in overrides:
        check_value(o.partition("=")[0], o)
    sb = [f"--job-name={opts.job_name}", f"--nodes={opts.nodes}", f"--ntasks-per-node={tasks}"]
    if opts.gpus_per_node:
        sb.append(f"--gpus-per-node={opts.gpus_per_node}")
    for key, flag in (("cpus_per_task", "cpus-per-task"), ("partition", "partition"), ("time", "time"),
                      ("account", "account"), ("qos", "qos")):
        if getattr(opts, key) is not None:
            sb.append(f"--{flag}={getattr(opts, key)}")
    sb += ["--requeue", "--open-mode=append", f"--output={out_dir}/slurm-%j.out"]
    if opts.signal_s:
        sb.append(f"--signal=B:USR1@{opts.signal_s}")
    # The run dir reaches train.py as SHARDYARD_RUN_DIR (the default of hydra.run.dir reads it), not as a
    # hydra.run.dir= override: a path with spaces, commas or quotes would need Hydra's own quoting there.
    train = " ".join([q(python), *map(q, entry), *map(q, overrides), "checkpoint.resume=auto"])
    return "\n".join([
        "#!/bin/bash",
        f"# {command_line}",
        f"# Written by shardyard on {datetime.date.today()}. Submit: sbatch {q(str(out_dir / 'job.sbatch'))}",
        f"# {world} workers: {tasks} srun task(s) per node x {opts.nodes} node(s), each a train.py worker whose rank",
        "# comes from SLURM_PROCID; rank 0 listens on the first node of the job. Requeued after preemption, the job",
        "# keeps its id, so it starts again in the same run dir and resumes from its newest complete checkpoint.",
        "# 1. --requeue: a preempted job (or `scontrol requeue`) goes back to the queue instead of failing.",
        "# 2. --open-mode=append: the requeued start's output follows the first one's in the same log.",
        *([f"# 3. --signal=B:USR1@{opts.signal_s}: {opts.signal_s} s before the time limit Slurm sends SIGUSR1 to "
           "this script (6.)."] if opts.signal_s else []),
        *(f"#SBATCH {q(s)}" for s in sb),
        "set -euo pipefail",
        f"cd {q(str(workdir))}",
        "# Rank 0's address: the job's first node, by name where it resolves, else by Slurm's NodeAddr for it.",
        f"export MASTER_ADDR=$({q(python)} -c 'from shardyard.core.dist_env import slurm_master_address as a; print(a())')",
        "# One port per job (the same after a requeue: the previous run's workers are gone by then).",
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "# The run dir, one per job id; train.py takes it from SHARDYARD_RUN_DIR (hydra.run.dir's default).",
        f"export SHARDYARD_RUN_DIR={q(str(out_dir))}/$SLURM_JOB_ID",
        'RUN_DIR="$SHARDYARD_RUN_DIR"',
        'echo "shardyard sbatch: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, start $((${SLURM_RESTART_COUNT:-0} + 1)), '
        'run dir $RUN_DIR, rank 0 at $MASTER_ADDR:$MASTER_PORT"',
        "# 4. --kill-on-bad-exit: one failed worker ends the step, instead of the others waiting for it until the",
        "#    collective timeout.",
        "# 5. srun runs in the background so that this script can take signals while it waits (bash runs a trap",
        "#    only between commands).",
        "# 6. SIGUSR1 (3., or `scancel --batch --signal=USR1 JOB`): passed to srun, which passes it to every worker;",
        f"#    they save at their next step boundary and exit {EXIT_REQUEUE}, and the job is requeued here (same id,",
        "#    so the same run dir). SIGTERM (scancel, preemption, the time limit itself) reaches the workers from",
        f"#    Slurm: they save and exit {EXIT_REQUEUE} too, and this script waits for them but requeues nothing (a",
        "#    preempted job is requeued by Slurm itself, with --requeue; a cancelled one stays cancelled).",
        'srun_pid="" terminated=0',
        "trap 'echo \"shardyard sbatch: SIGUSR1: the workers save at their next step boundary\"; "
        "kill -USR1 \"$srun_pid\" 2>/dev/null || true' USR1",
        "trap 'terminated=1' TERM",
        f"srun --kill-on-bad-exit=1 {train} &",
        "srun_pid=$!",
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done  # a trap cuts a wait short',
        'code=0; wait "$srun_pid" || code=$?',
        f'if [ "$code" -eq {EXIT_REQUEUE} ] && [ "$terminated" -eq 0 ]; then',
        '  echo "shardyard sbatch: the workers saved and stopped (exit $code): requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
        "",
    ])


def main(args: list[str], submit: bool) -> Path:
    """Write the script (and submit it); returns its path."""
    opts, overrides = parse(args)
    workdir = Path.cwd()
    project = (workdir / "conf" / "project.yaml").is_file() and (workdir / "train.py").is_file()
    checkout = (workdir / "train.py").is_file() and (workdir / "conf" / "train.yaml").is_file()
    name = _compose_check(overrides, project)
    opts.job_name = opts.job_name or name
    out_dir = Path(opts.out_dir or f"outputs/sbatch/{opts.job_name}").resolve()
    path = out_dir / "job.sbatch"
    if path.exists():
        raise UserError("out_dir", str(out_dir), "It holds a job script already (and perhaps that job's runs).",
                        "Choose another job_name=... or out_dir=..., or remove that directory first.")
    entry = ["train.py"] if project or checkout else ["-m", "shardyard", "train"]
    command_line = " ".join(["shardyard sbatch", *map(shlex.quote, args), *(["--submit"] if submit else [])])
    text = script(opts, overrides, command_line, out_dir, sys.executable, workdir, entry)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    print(f"shardyard | wrote {path}: {opts.nodes} node(s) x {opts.tasks_per_node or opts.gpus_per_node or 1} "
          f"task(s), runs in {out_dir}/<job id>")
    if submit:
        try:
            out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
        except FileNotFoundError:
            path.unlink()
            raise UserError("--submit", "sbatch", "There is no `sbatch` on this machine's PATH.",
                            f"Run it where Slurm is installed, or copy {path} to a login node and run sbatch there.") from None
        if out.returncode:
            path.unlink()  # nothing was submitted: the same command, fixed, may write it again
            raise UserError("--submit", str(path), f"sbatch refused the script: {out.stderr.strip()}",
                            "Fix the sbatch keys (partition=..., account=..., time=...) and run again.")
        job = out.stdout.strip().split(";")[0]
        print(f"shardyard | submitted job {job}: log {out_dir}/slurm-{job}.out, run dir {out_dir}/{job}")
    return path
