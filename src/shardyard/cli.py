"""``shardyard report RUN_DIR`` (also ``python -m shardyard report RUN_DIR``): re-draw a run's picture.

Training itself is ``python train.py ...`` (Hydra owns that command line).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from shardyard.errors import UserError, report_and_exit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shardyard", description="shardyard tools (training: python train.py)")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="draw RUN_DIR/report.png from metrics.jsonl (a sweep dir: all its jobs)")
    rep.add_argument("run_dir", help="a run directory, or a multirun sweep directory")
    rep.add_argument("--out", help="PNG path (default: RUN_DIR/report.png)")
    pl = sub.add_parser("plan", help="the memory and launch plan of every engine for a recipe: the same "
                        "overrides as python train.py (e.g. model=deepseek7b plan.hardware=8xH100-80GB)")
    pl.add_argument("overrides", nargs=argparse.REMAINDER, help="train.py overrides")
    args = parser.parse_args(argv)
    if args.command == "plan":
        _plan(args.overrides)
    if args.command == "report":
        try:
            if not os.path.isdir(args.run_dir):
                raise UserError("run_dir", args.run_dir, "There is no such directory.",
                                "Give a run directory (outputs/...) or a sweep directory (outputs/multirun/...).")
            from shardyard.report import draw

            try:
                print(draw(args.run_dir, args.out))
            except FileNotFoundError as e:
                raise UserError("run_dir", args.run_dir, f"Nothing to draw: {e}.",
                                "Point it at a directory a training run wrote (it holds metrics.jsonl).") from None
        except UserError as err:
            report_and_exit(err)
    sys.exit(0)


def _plan(overrides: list[str]) -> None:
    """``shardyard plan ...`` is ``python train.py plan.only=true ...``: same composition, same checks."""
    import runpy
    from pathlib import Path

    train_py = Path(__file__).resolve().parents[2] / "train.py"
    if not train_py.is_file():
        report_and_exit(UserError("shardyard plan", str(train_py), "It needs the repository's train.py and conf/, "
                                  "and this installation has no train.py beside src/.",
                                  "Run it from a checkout of shardyard (pip install -e .), or use "
                                  "`python train.py plan.only=true ...` there."))
    sys.argv = [str(train_py), "plan.only=true", *overrides]
    runpy.run_path(str(train_py), run_name="__main__")


def hydra_entry(hydra_main) -> None:
    """``train.py``'s ``__main__``: take what launchers add to the command line, check a given run dir, run
    Hydra, and turn Hydra's exit code 1 for composition errors (unknown option, misspelt key, wrong type)
    into 2, like every other user error."""
    from shardyard import run
    from shardyard.rundir import check_command_line_dirs

    _take_local_rank_arg()
    try:
        check_command_line_dirs(sys.argv[1:])
    except UserError as err:
        report_and_exit(err)
    try:
        hydra_main()
    except SystemExit as e:
        if e.code == 1 and not run.STARTED:
            print("shardyard: the command line names a config group option, key or value that the schemas do "
                  "not accept (see above). `python train.py --help` lists groups and options; "
                  "`python train.py --cfg job` prints every key.", file=sys.stderr)
            leave(2)
        if e.code is None or isinstance(e.code, int):
            leave(e.code or 0)
        raise
    leave(0)


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


def _take_local_rank_arg() -> None:
    """`deepspeed train.py ...` appends --local_rank=N; Hydra would reject it, and LOCAL_RANK says the same."""
    for i, arg in enumerate(sys.argv[1:], start=1):
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            value = arg.split("=", 1)[1] if "=" in arg else sys.argv.pop(i + 1)
            os.environ.setdefault("LOCAL_RANK", value)
            del sys.argv[i]
            return


if __name__ == "__main__":
    main()
