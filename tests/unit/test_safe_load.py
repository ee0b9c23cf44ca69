"""Checkpoint loading never runs code named by a file: DCP metadata is vetted, torch.load is weights-only."""

import os
import pickle
from dataclasses import dataclass

import pytest
import torch

from shardyard.errors import UserError
from shardyard.safe_load import check_dcp_metadata, weights_only_loads


class _Payload:
    """Unpickling this calls os.makedirs(target): a stand-in for any code a tampered file could run."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return os.makedirs, (self.target,)


@dataclass
class _Plain:
    x: int


def test_dcp_metadata_is_vetted_before_dcp_unpickles_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(6.0), "lr": 0.1, "betas": (0.9, 0.95)}, checkpoint_id=str(ckpt))
    check_dcp_metadata(str(ckpt))  # what DCP itself wrote passes

    pwned = tmp_path / "pwned"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(_Payload(str(pwned)), f)
    with pytest.raises(UserError) as e:
        check_dcp_metadata(str(ckpt))
    assert "posix.makedirs" in str(e.value) or "os.makedirs" in str(e.value)
    assert e.value.key == "checkpoint.resume" and not pwned.exists()


def test_weights_only_loads_refuses_globals_outside_the_allow_list(tmp_path):
    f = tmp_path / "state.pt"
    pwned = tmp_path / "pwned"
    torch.save({"t": torch.ones(2), "evil": _Payload(str(pwned))}, f)
    with weights_only_loads([_Plain]), pytest.raises(pickle.UnpicklingError):
        torch.load(f, weights_only=False)  # what DeepSpeed calls: turned into weights_only=True
    assert not pwned.exists()

    torch.save({"t": torch.ones(2), "plain": _Plain(3)}, f)
    with weights_only_loads([_Plain]):
        got = torch.load(f, weights_only=False)
    assert got["plain"] == _Plain(3) and torch.equal(got["t"], torch.ones(2))
    assert torch.load is torch.serialization.load  # restored on exit
