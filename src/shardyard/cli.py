"""``shardyard report RUN_DIR`` (also ``python -m shardyard report RUN_DIR``): re-draw a run's picture.

Training itself is ``python train.py ...`` (Hydra owns that command line).
"""

from __future__ import annotations

import argparse
import os
import sys

from shardyard.errors import UserError, report_and_exit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shardyard", description="shardyard tools (training: python train.py)")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="draw RUN_DIR/report.png from metrics.jsonl (a sweep dir: all its jobs)")
    rep.add_argument("run_dir", help="a run directory, or a multirun sweep directory")
    rep.add_argument("--out", help="PNG path (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
