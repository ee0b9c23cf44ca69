"""The ``shardyard`` command (also ``python -m shardyard``): ``train``, ``plan``, ``data``, ``sbatch``, ``generate PATH``,
``eval PATH``, ``recipes [show NAME]``, ``new DIR --recipe NAME``, ``lock``, ``report RUN_DIR``.

``python train.py ...`` (a checkout, or a project made by ``shardyard new``) and ``shardyard train ...`` are
the same Hydra app; ``shardyard train`` uses the configs inside the installed package, from any directory.
"""

from __future__ import annotations

import argparse
import os
import sys

from shardyard.core.errors import UserError, report_and_exit


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["train"], ["plan"]):  # Hydra owns these command lines (its own --help included)
        from shardyard.launching import app

        extra = ["plan.only=true"] if argv[0] == "plan" else []
        app.train([*extra, *argv[1:]], prog=f"shardyard {argv[0]}")
    if argv[:1] == ["data"] and not {"-h", "--help"} & set(argv):  # train.py's overrides
        try:
            _data(argv[1:])
        except UserError as err:
            report_and_exit(err)
        sys.exit(0)
    if argv[:1] == ["sbatch"] and not {"-h", "--help"} & set(argv):  # KEY=VALUE arguments, as train.py's
        try:
            from shardyard.launching import sbatch

            sbatch.main([a for a in argv[1:] if a != "--submit"], submit="--submit" in argv)
        except UserError as err:
            report_and_exit(err)
        sys.exit(0)
    if argv[:1] in (["generate"], ["eval"]) and not {"-h", "--help"} & set(argv):  # PATH, then KEY=VALUE arguments
        try:
            if argv[0] == "generate":
                from shardyard.inference import generate

                generate.main(argv[1:])
            else:
                from shardyard.inference import evaluate

                evaluate.main(argv[1:])
        except UserError as err:
            report_and_exit(err)
        sys.stdout.flush()
        sys.exit(0)  # not errors.leave's os._exit: a caller in this process (a test) goes on
    parser = argparse.ArgumentParser(
        prog="shardyard", description="shardyard tools. Training: python train.py ... in a checkout or a project made "
        "by `shardyard new`, or `shardyard train ...` from any directory.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train: the same overrides as python train.py (e.g. shardyard train "
                   "recipe=deepseek_tiny_ddp2), with shardyard's packaged configs, from any directory")
    sub.add_parser("plan", help="the memory and launch plan of every engine for a recipe: the same "
                   "overrides as python train.py (e.g. model=deepseek7b plan.hardware=8xH100-80GB)")
    sub.add_parser("data", help="build (or find and verify) the tokenizer and token caches of a run's data, and say "
                   "what they hold: the same overrides as python train.py (e.g. shardyard data data=text_files "
                   "'data.paths=[/corpus/*.jsonl.zst]' data.num_proc=32), on a CPU node before the GPU job")
    sb = sub.add_parser("sbatch", help="a Slurm batch script for a recipe: shardyard sbatch recipe=NAME nodes=N "
                        "gpus_per_node=G [KEY=VALUE ...] [train.py overrides] [--submit]; requeued, it resumes "
                        "(checkpoint.resume=auto)", description=_sbatch_keys(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sb.add_argument("--submit", action="store_true", help="also submit it with sbatch")
    sub.add_parser("generate", help="talk to a trained model: shardyard generate PATH prompt=TEXT [KEY=VALUE ...] "
                   "(PATH: a run dir, a checkpoint of any engine, an HF export, or `latest`)",
                   description=_generate_keys(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_parser("eval", help="score a trained model: shardyard eval PATH [KEY=VALUE ...] [train.py data "
                   "overrides] (perplexity on any data option, lm-evaluation-harness tasks)",
                   description=_eval_keys(), formatter_class=argparse.RawDescriptionHelpFormatter)
    rec = sub.add_parser("recipes", help="the recipe book: list it (engine, model, hardware, planned memory, "
                         "purpose), or `shardyard recipes show NAME` for one recipe's whole config")
    rec.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    rec.add_argument("name", nargs="?", help="with show: a recipe name (recipes/NAME.yaml)")
    new = sub.add_parser("new", help="a standalone project in DIR that runs copied recipes: train.py, conf/ "
                         "(your options), pyproject.toml pinning this shardyard, shardyard.lock.yaml")
    new.add_argument("dir", help="a new or empty directory")
    new.add_argument("--recipe", action="append", help="a recipe to copy (repeatable; the first is the one "
                     "`python train.py` runs; default: deepseek_tiny_ddp2)")
    lk = sub.add_parser("lock", help="record the installed shardyard version in a project's shardyard.lock.yaml "
                        "(after checking what changed)")
    lk.add_argument("dir", nargs="?", default=".", help="the project (default: here)")
    rep = sub.add_parser("report", help="draw RUN_DIR/report.png from metrics.jsonl (a sweep dir: all its jobs)")
    rep.add_argument("run_dir", help="a run directory, or a multirun sweep directory")
    rep.add_argument("--out", help="PNG path (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        if args.command == "recipes":
            _recipes(args.action, args.name)
        if args.command == "new":
            _new(args.dir, args.recipe or ["deepseek_tiny_ddp2"])
        if args.command == "lock":
            _lock(args.dir)
        if args.command == "report":
            _report(args.run_dir, args.out)
    except UserError as err:
        report_and_exit(err)
    sys.exit(0)


def _data(overrides: list[str]) -> None:
    import json
    from pathlib import Path

    from shardyard import config
    from shardyard.data import pipeline as data
    from shardyard.planning.rules import validate_data

    cfg = config.compose(overrides, run_dir="unused")
    validate_data(cfg)  # the data options' own checks, as a training run makes them
    prepared = data.prepare(cfg)
    print(f"shardyard | tokenizer {prepared.tokenizer_dir} ({prepared.vocab_size:,} tokens)")
    for part in prepared.parts:
        meta = json.loads(Path(part.token_dir, "meta.json").read_text())
        counts = meta.get("tokens") or meta.get("rows")
        what = "tokens" if "tokens" in meta else "rows"
        shards = {s: len(v) for s, v in meta.get("shards", {}).items()}
        print(f"shardyard | {part.name}: {part.token_dir}: train {counts['train']:,} / val {counts['val']:,} {what}"
              + (f", {meta['documents']['train']:,} / {meta['documents']['val']:,} documents, {shards['train']} / "
                 f"{shards['val']} shards" if shards else ""))


def _sbatch_keys() -> str:
    """``shardyard sbatch --help``: its own keys, from the docstrings of ``SbatchOptions``."""
    from shardyard.launching import sbatch
    from shardyard.config.options import keys_help

    return keys_help(sbatch.SbatchOptions, [
        "shardyard sbatch recipe=NAME nodes=N gpus_per_node=G [KEY=VALUE ...] [overrides] [--submit]",
        "writes outputs/sbatch/JOB_NAME/job.sbatch (every other KEY=VALUE is a train.py override). Keys:"],
        one_line=False)


def _generate_keys() -> str:
    """``shardyard generate --help``: its keys, from the docstrings of ``GenerateOptions`` (the module imports
    nothing heavy at its top)."""
    from shardyard.inference import generate

    return generate.keys_help()


def _eval_keys() -> str:
    """``shardyard eval --help``: ``shardyard.inference.evaluate``'s own text when it offers one."""
    from shardyard.inference import evaluate

    keys = getattr(evaluate, "keys_help", None)
    return keys() if callable(keys) else (evaluate.__doc__ or "shardyard eval PATH [KEY=VALUE ...]")


def _recipes(action: str, name: str | None) -> None:
    from shardyard.launching import recipes

    if action == "show":
        if not name:
            raise UserError("shardyard recipes show", "(none)", "It needs a recipe name.",
                            "Use e.g. `shardyard recipes show deepseek7b_zero3`; `shardyard recipes` lists them.")
        print(recipes.show(name))
    else:
        print(recipes.listing())


def _new(directory: str, names: list[str]) -> None:
    from shardyard.launching import project

    root = project.new(directory, names)
    print(f"shardyard | a project in {root} running recipe {names[0]} (shardyard {project.__version__})\n"
          f"  cd {directory}\n  python train.py                  # the recipe\n"
          f"  python train.py backend=fsdp     # any shardyard option; your own in conf/<group>/")


def _lock(directory: str) -> None:
    from pathlib import Path

    from shardyard.launching import project

    root = Path(directory).resolve()
    if not (root / "conf" / "project.yaml").is_file():
        raise UserError("shardyard lock", directory, "It is not a project made by `shardyard new` (no conf/project.yaml).",
                        "Run it in the project's directory, or give its path.")
    project.lock(root)
    print(f"shardyard | {root / project.LOCK}: shardyard {project.__version__}")


def _report(run_dir: str, out: str | None) -> None:
    if not os.path.isdir(run_dir):
        raise UserError("run_dir", run_dir, "There is no such directory.",
                        "Give a run directory (outputs/...) or a sweep directory (outputs/multirun/...).")
    from shardyard.monitors.report import draw

    try:
        print(draw(run_dir, out))
    except FileNotFoundError as e:
        raise UserError("run_dir", run_dir, f"Nothing to draw: {e}.",
                        "Point it at a directory a training run wrote (it holds metrics.jsonl).") from None


if __name__ == "__main__":
    main()
