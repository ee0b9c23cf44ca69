"""``python train.py checkpoint.resume=DIR`` on a checkpoint whose ``.metadata`` was replaced by a hostile
pickle (its manifest rewritten to match, as an attacker would): exit 2 naming the file and the global, and
the payload never runs. The full corpus goes through the same reader in tests/unit/test_safe_load.py."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TINY, train_py
from forge import Call, G, Raw, Seq, forge

RUN = [*TINY, "backend=single", "train.eval_every_n_steps=0", "train.global_batch_size=4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("trusted")
    proc = train_py(*RUN, "train.steps=2", "checkpoint.every_n_steps=2", run_dir=d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "checkpoints" / "step-00000002"


def _metadata_with(payload):
    """The checkpoint's real metadata, with ``payload`` among its planner data."""
    import pickle

    def nested(ckpt):
        md = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own trusted file
        md.planner_data["evil"] = payload
        return md
    return nested


@pytest.mark.parametrize("make,proto,named", [
    # nested in the real metadata: a dotted name through a module the old prefix rule trusted (plain
    # pickle resolves it to os.system by attribute walk)
    (lambda ckpt, s: _metadata_with(Call(G("torch.distributed.checkpoint.metadata", "os.system"),
                                         f"mkdir {s}"))(ckpt), 4, "torch.distributed.checkpoint.metadata.os.system"),
    # BUILD {"__setstate__": posix.system}, then BUILD "cmd": calls posix.system("cmd") on plain pickle
    (lambda ckpt, s: Seq(Call(G("torch.distributed.checkpoint.metadata", "StorageMeta")),
                         {"__setstate__": G("posix", "system")}, Raw(b"b"), f"mkdir {s}", Raw(b"b")), 2,
     "posix.system"),
], ids=["nested-dotted", "build"])
def test_resume_from_a_hostile_checkpoint_exits_2_and_runs_nothing(checkpoint, tmp_path, make, proto, named):
    from shardyard.training.integrity import _manifest, _meta_digest

    ckpt = tmp_path / "step-00000002"
    shutil.copytree(checkpoint, ckpt)
    sentinel = tmp_path / "sentinel"
    (ckpt / ".metadata").write_bytes(forge(make(checkpoint, sentinel), proto))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["manifest"] = _manifest(str(ckpt))  # sizes (and hashes) match: the manifest is no signature
    meta["meta_sha256"] = _meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))

    proc = train_py(*RUN, "train.steps=4", f"checkpoint.resume={ckpt}", run_dir=tmp_path / "run")
    err = " ".join(proc.stderr.split())  # the paragraph is wrapped at spaces
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{ckpt / '.metadata'}" in err and named in err and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not sentinel.exists()
