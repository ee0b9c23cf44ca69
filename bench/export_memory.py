"""python bench/export_memory.py [--width 384] [--layers 8]

What the HF export (``export.save_hf``) costs each rank on 4 gloo ranks, for a pipeline of 2 stages x dp 2, of 4
stages, and FSDP over 4 ranks, beside what gathering the model on rank 0 costs (``backend.full_state_dict()``,
which the export did before issue 41 and the tests still use): every rank's resident high-water mark above its
resident size at the start (glibc's mmap threshold fixed at 64 KiB, so the resident size follows the live
tensors), and the wall time. Prints MiB, and rank 0's peak as a fraction of the model's fp32 bytes. Asserts
nothing (numbers belong here, not in tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardyard import testing  # noqa: E402

LAYOUTS = {"pipeline 2 stages x dp 2": ["backend=pipeline", "backend.stages=2", "backend.microbatches=2"],
           "pipeline 4 stages": ["backend=pipeline", "backend.stages=4", "backend.microbatches=4",
                                 "train.micro_batch_size=8"],
           "fsdp x4": ["backend=fsdp"]}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _measure(fn):
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, t0 = _status("VmRSS"), time.perf_counter()
    out = fn()
    return out, {"peak": _status("VmHWM") - base, "s": time.perf_counter() - t0}


def _rank(rank: int, world: int, overrides: list, run_dir: str) -> None:
    """One run on a pool rank: the export measured inside the run, the gather on rank 0 after it."""
    import ctypes

    from shardyard.training import export, worker
    from shardyard.core.dist_env import detect
    from shardyard.training.rundir import resolved
    from shardyard.planning.validate import validate

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    plain, got = export.save_hf, {}

    def measured(backend, tokenizer_dir, out_dir):
        backend.hf_model().state_dict()  # FSDP's root, gathered since the last eval, resharded: the export's start
        out, got["export"] = _measure(lambda: plain(backend, tokenizer_dir, out_dir))
        return out

    def gather(backend):
        full, got["gather"] = _measure(backend.full_state_dict)
        del full

    cfg = testing.compose(overrides, run_dir)
    plan = validate(cfg, detect())
    export.save_hf = measured
    try:
        worker.main(resolved(cfg), plan, after_train=gather)
    finally:
        export.save_hf = plain
        libc.mallopt(-3, 128 * 1024)
    with open(os.path.join(run_dir, f"measured{rank}.json"), "w") as f:
        json.dump(got, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    model = [f"model.hidden_size={a.width}", f"model.intermediate_size={a.width * 8 // 3 // 64 * 64}",
             f"model.num_layers={a.layers}", f"model.num_heads={a.width // 64}", f"model.num_kv_heads={a.width // 64}"]
    base = [*testing.TINY, *model, "train.steps=1", "train.eval_every_n_steps=0", "train.global_batch_size=8",
            "train.micro_batch_size=2", "checkpoint.save_final=true"]
    mib = 2 ** 20
    print(f"HF export on 4 gloo ranks, {a.layers} layers of width {a.width}: each rank's peak above its start (MiB)")
    print(f"{'layout':26} {'model':>6} | {'export: peak per rank':>27} {'s':>5} {'rank 0 / model':>14} | "
          f"{'gather on rank 0: peak':>22} {'s':>5} {'/ model':>7}")
    for name, layout in LAYOUTS.items():
        run_dir = tempfile.mkdtemp(prefix="bench-export-")
        testing.on_ranks(4, _rank, [*base, *layout], run_dir)
        got = [json.load(open(os.path.join(run_dir, f"measured{r}.json"))) for r in range(4)]
        size = sum(os.path.getsize(p) for p in Path(run_dir, "hf").glob("*.safetensors"))
        peaks = " ".join(f"{g['export']['peak'] / mib:6.1f}" for g in got)
        print(f"{name:26} {size / mib:6.1f} | {peaks:>27} {got[0]['export']['s']:5.2f} "
              f"{got[0]['export']['peak'] / size:14.2f} | {got[0]['gather']['peak'] / mib:22.1f} "
              f"{got[0]['gather']['s']:5.2f} {got[0]['gather']['peak'] / size:7.2f}")


if __name__ == "__main__":
    main()
