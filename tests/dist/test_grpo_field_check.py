"""GRPO's start-of-run check of the prompt rows (issue 45's follow-up of issue 44): over 2 real gloo ranks each rank
parses only its strided share (rows ``rank::2``), stopping at its first bad row, and every rank raises the same
error, the one a single process's plain scan finds first."""

import json

import numpy as np

from shardyard.testing import on_ranks

NUMERIC = [{"_target_": "shardyard.objectives.rewards.NumericAnswer"}]


def _split(prefix: str, fields: list[dict]) -> None:
    """One split's cache files as the token cache writes them (``prompts.left_padded``, one ``.npy`` per array)."""
    from shardyard.data.prompts import left_padded

    rows = [([7], json.dumps(f), f"p.jsonl:{i + 1}") for i, f in enumerate(fields)]
    for name, array in left_padded(rows, 4, 0).items():
        np.save(f"{prefix}.{name}.npy", array)


def _checks(rank: int, world: int, root: str, cases: list[str]) -> None:
    """Every case's check on this rank (the engines' own all-reduce over a gloo group): its error (key, value,
    problem) or None, and the rows it parsed, written to ``<root>/<case>.rank<r>.json``."""
    import types

    import torch
    import torch.distributed as dist

    from shardyard.backends import process_group
    from shardyard.data.pipeline import PromptRows
    from shardyard.core.errors import UserError
    from shardyard.objectives.grpo import GRPO

    class Counted(PromptRows):
        """The rows, recording which ones were parsed."""

        def fields(self, indices):
            self.read.extend(int(i) for i in indices)
            return super().fields(indices)

    dist.init_process_group("gloo")
    try:
        backend = types.SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"),
                                        all_reduce_mean=process_group.all_reduce_mean)
        for case in cases:
            splits = [Counted(f"{root}/{case}.{split}") for split in ("train", "val")]
            for rows in splits:
                rows.read = []
            try:
                GRPO(rewards=NUMERIC)._check_fields(splits, backend)
                error = None
            except UserError as e:
                assert e.all_ranks
                error = [e.key, e.value, e.problem]
            with open(f"{root}/{case}.rank{rank}.json", "w") as f:
                json.dump({"error": error, "read": [rows.read for rows in splits]}, f)
    finally:
        dist.destroy_process_group()


def _first_bad(splits: dict[str, list[dict]]) -> tuple[str, int] | None:
    """The reference: a plain scan, train then val, for the first row without an ``answer`` of digits."""
    for split, fields in splits.items():
        for i, f in enumerate(fields):
            if not str(f.get("answer", "")).isdigit():
                return split, i
    return None


def _single(root: str, case: str) -> list | None:
    """The check in this one process (world 1: the single engine's all-reduce is the identity)."""
    import types

    import torch

    from shardyard.data.pipeline import PromptRows
    from shardyard.core.errors import UserError
    from shardyard.objectives.grpo import GRPO

    one = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), all_reduce_mean=lambda t: t)
    try:
        GRPO(rewards=NUMERIC)._check_fields([PromptRows(f"{root}/{case}.{s}") for s in ("train", "val")], one)
    except UserError as e:
        return [e.key, e.value, e.problem]
    return None


def test_each_rank_checks_its_share_and_all_raise_the_first_bad_row(tmp_path):
    """Rows parsed per rank, by hand: a rank stops at its first bad row (and reads no later split), then every rank
    parses the first bad row of all once more, to raise its error."""
    good = [{"answer": str(i)} for i in range(101)]
    evens, odds = list(range(0, 101, 2)), list(range(1, 101, 2))
    cases = {
        # first bad row 37 is rank 1's; rank 0 finds 60 in its share and stops there
        "two_bad": ({"train": [{"solution": "7"} if i in (37, 60) else f for i, f in enumerate(good)], "val": good[:9]},
                    [[list(range(0, 61, 2)) + [37], []], [list(range(1, 38, 2)) + [37], []]]),
        # clean train rows; held-out row 4 (rank 0's) is not one number, row 8 (also rank 0's) has no answer
        "val_bad": ({"train": good, "val": [{"answer": "four"} if i == 4 else {} if i == 8 else f
                                            for i, f in enumerate(good[:9])]},
                    [[evens, [0, 2, 4, 4]], [odds, [1, 3, 5, 7, 4]]]),
        "clean": ({"train": good, "val": good[:9]}, [[evens, [0, 2, 4, 6, 8]], [odds, [1, 3, 5, 7]]]),
    }
    for case, (splits, _) in cases.items():
        for split, fields in splits.items():
            _split(f"{tmp_path}/{case}.{split}", fields)
    on_ranks(2, _checks, str(tmp_path), list(cases))
    for case, (splits, reads) in cases.items():
        got = [json.loads((tmp_path / f"{case}.rank{r}.json").read_text()) for r in range(2)]
        assert [g["read"] for g in got] == reads, case
        error = got[0]["error"]
        assert got[1]["error"] == error == _single(str(tmp_path), case), case
        first = _first_bad(splits)
        if first is None:
            assert error is None
            continue
        bad = splits[first[0]][first[1]]
        assert error[:2] == ["data.paths", f"p.jsonl:{first[1] + 1}"], (case, error)
        assert ("no field 'answer'" if "answer" not in bad else "is not one number") in error[2], error
