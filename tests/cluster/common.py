"""What the cluster tier's tests share (the ``one_host`` reference fixture is in ``tests/conftest.py``)."""

import json

from conftest import CLUSTER_STEPS

STEPS = CLUSTER_STEPS

RESTARTED = ("train.steps=40", "checkpoint.every_n_steps=10")
"""The recipe of the restart tests (a checkpoint every 10 of 40 steps), on top of STEPS, with backend=ddp."""


def losses(run_dir):
    return [v for _, v in json.load(open(run_dir / "summary.json"))["train_losses"]]


def close(a, b, rtol=1e-5) -> bool:
    """Equal loss curves: same length, every step within ``rtol``."""
    return len(a) == len(b) and max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= rtol
