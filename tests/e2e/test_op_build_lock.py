"""Issue 41, "No silent waits", through ``python train.py``: a DeepSpeed engine whose op has a build lock left
behind (what a killed compile leaves: an empty ``lock`` file no process holds) exits 2 before DeepSpeed waits on
it, one paragraph per host naming the key that asks for the op and the file (tests/unit/test_op_builds.py kills
a real compile)."""

from conftest import TINY, train_py


def test_a_stale_cpu_adam_lock_exits_2_naming_the_key_and_the_file(tmp_path):
    extensions = tmp_path / "torch_extensions"
    (extensions / "cpu_adam").mkdir(parents=True)
    lock = extensions / "cpu_adam" / "lock"
    lock.touch()
    proc = train_py(*TINY, "train.steps=2", "train.eval_every_n_steps=0", "backend=zero2_offload",
                    "launch.nproc_per_node=2", run_dir=tmp_path / "run", timeout=300,
                    env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    assert err.count("shardyard: error in `backend.offload_optimizer` (value: 'cpu')") == 1  # both ranks, one host
    assert f"(rm {lock})" in err and "left from a build that was interrupted" in err
    assert lock.exists() and not list((extensions / "cpu_adam").glob("*.so"))  # nothing compiled, nothing removed
