"""DeepSpeed's own profiling switches in the zero backends: flops_profiler and wall_clock_breakdown."""

import re

from conftest import TINY, train_py
from shardyard.models.build import shape_model
from shardyard.models.shape import flops_per_token
from shardyard.testing import compose


def test_flops_profiler_and_wall_clock_breakdown(tmp_path):
    run = [*TINY, "backend=zero2", "train.steps=3", "backend.flops_profiler=true", "backend.flops_profiler_step=2",
           "backend.wall_clock_breakdown=true"]
    proc = train_py(*run, run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "deepspeed_flops_profile.txt").read_text()
    assert "DeepSpeed Flops Profiler" in report and "Profile Summary at step 2" in report
    # DeepSpeed counts the forward's FLOPs by module; training is ~3x that. Our MFU numerator (6N + 12LHQT)
    # must agree with it on this model.
    value, unit = re.search(r"fwd flops per GPU:\s+([\d.]+) (\w?)", report).groups()
    ds_train_flops = 3 * float(value) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[unit]
    cfg = compose(run)
    ours = flops_per_token(shape_model(cfg.model), cfg.data.seq_len) * cfg.train.micro_batch_size * cfg.data.seq_len
    assert abs(ours / ds_train_flops - 1) < 0.01, (ours, ds_train_flops, ours / ds_train_flops - 1)  # the README: within 1%
    # wall_clock_breakdown: DeepSpeed's per-phase timers, printed every log interval.
    assert proc.stdout.count("fwd_microstep") + proc.stderr.count("fwd_microstep") >= 3
