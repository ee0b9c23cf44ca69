"""User-facing errors: one paragraph naming the key, the value and the fix; exit code 2."""

from __future__ import annotations

import os
import sys
import textwrap
from typing import NoReturn

EXIT_USER_ERROR = 2
EXIT_REQUEUE = 75
"""A run stopped by a preemption signal (SIGTERM, SIGUSR1) once its checkpoint is published: requeue the job
and it resumes there (``checkpoint.resume=auto``). 75 is ``EX_TEMPFAIL`` of sysexits.h: a temporary failure,
try again later; ``shardyard sbatch``'s script requeues the job on it."""
JOB_STARTED = False
"""Set once a composed job starts running (``run.run``, the sweepers): Hydra's exit code 1 after that is the
job's own, not a composition error that ``app.hydra_entry`` turns into 2."""


class UserError(ValueError):
    """A mistake in the user's config, command line or environment (never an internal bug)."""

    all_ranks = False
    """True when every rank raises the same error together (then only rank 0 prints it)."""

    def __init__(self, key: str, value: object, problem: str, fix: str):
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        super().__init__(f"{key}={value!r}: {problem} Fix: {fix}")

    def __reduce__(self) -> tuple:
        # pickled by its four fields, not by the message: a UserError raised in another process (a dry run's role,
        # simulated in a pool) reaches the parent whole, as one paragraph, not as a TypeError of the unpickling
        return type(self), (self.key, self.value, self.problem, self.fix), {"all_ranks": self.all_ranks}

    def on_every_rank(self) -> "UserError":
        """Mark an error every rank raises together (a collective decision): rank 0 alone prints it."""
        self.all_ranks = True
        return self

    def paragraph(self) -> str:
        text = f"shardyard: error in `{self.key}` (value: {self.value!r}). {self.problem} Fix: {self.fix}"
        return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


class Preempted(SystemExit):
    """Raised on every rank of a run stopped by a preemption signal, after its checkpoint is published: the
    process exits with ``EXIT_REQUEUE`` (a ``SystemExit``: no traceback, no error handler takes it)."""

    def __init__(self, message: str):
        super().__init__(EXIT_REQUEUE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def report_and_exit(err: UserError) -> None:
    """Print the paragraph on stderr and leave with exit code 2 (no traceback)."""
    sys.stdout.flush()
    if not (err.all_ranks and os.environ.get("RANK", "0") != "0"):
        print(err.paragraph(), file=sys.stderr, flush=True)
    sys.exit(getattr(err, "exit_code", EXIT_USER_ERROR))  # a failed checkpoint save: 1 (the run failed)


def leave(code: int) -> NoReturn:
    """Exit without the interpreter's teardown of torch and transformers (about 1.3 s on 2 cores, what every
    short job and test pays): the atexit handlers (logging, wandb, mlflow, horovod) still run and stdio is
    flushed; everything shardyard writes is closed by its own ``with`` block or monitor ``close`` before this.
    Only for a process that has finished normally or with a clean exit code; a traceback exits as usual."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
