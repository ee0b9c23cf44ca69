"""How long a rank takes to read the ``.metadata`` of a 1,000-rank FSDP checkpoint (issue 41): the generated
metadata of a Llama-7B's 291 tensors and their two Adam moments, each split in one chunk per rank
(tests/fsdp_metadata.py: the shapes DCP writes, pickled as its FileSystemWriter does).

    python bench/dcp_metadata.py [--world 1000] [--repeats 3] [--skip-old]

Each read runs in a fresh interpreter (a rank reads it once, at resume), the readers interleaved, timed in CPU
seconds together with the young collections it leaves (``gc.collect(1)``):

- old: ``ExactUnpickler`` as every rank ran it before (pure Python, the collector running);
- new: ``exact_load``, what ``read_dcp_metadata`` runs now;
- plain ``pickle.load`` (unsafe): what DCP itself runs, the collector running; and with the collector handled
  as ``exact_load`` handles it (``_gc_paused``), which leaves the stand-ins' own cost.

Prints the file's size, each reader's median and the ratios. The old reader takes long: it runs once
(``--skip-old`` leaves it out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

READERS = {
    "old: ExactUnpickler (pure Python, gc on)": "old",
    "new: exact_load": "new",
    "pickle.load (unsafe), gc on": "pickle",
    "pickle.load (unsafe), gc as exact_load": "pickle-gc-paused",
}


def read(kind: str, file: str) -> float:
    """CPU seconds to unpickle ``file`` with reader ``kind``, in this interpreter (torch imported first), and
    to collect the young generations after it. CPU time: the read is one thread, and on a shared machine its
    wall time also counts other processes' turns."""
    import gc
    import pickle

    from shardyard.core.safe_load import ExactUnpickler, _gc_paused, dcp_metadata_globals, exact_load

    allowed = dcp_metadata_globals()
    with open(file, "rb") as f:
        t0 = time.process_time()
        if kind == "old":
            metadata = ExactUnpickler(f, allowed).load()
        elif kind == "new":
            metadata = exact_load(f, allowed)
        elif kind == "pickle":
            metadata = pickle.load(f)
        else:
            with _gc_paused():
                metadata = pickle.load(f)
        gc.collect(1)  # counted too: the young collections a paused collector leaves for its next passes
        seconds = time.process_time() - t0
    assert type(metadata).__name__ == "Metadata"  # alive until here: the collection above traversed it
    return seconds


def timed(kind: str, file: Path) -> float:
    proc = subprocess.run([sys.executable, __file__, "--read", kind, str(file)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-old", action="store_true")
    ap.add_argument("--read", nargs=2, help=argparse.SUPPRESS)  # (kind, file): one timed read, in a child
    a = ap.parse_args()
    if a.read:
        print(f"{read(*a.read):.4f}")
        return
    from fsdp_metadata import llama_params, write_fsdp_metadata

    with tempfile.TemporaryDirectory(prefix="bench-dcp-metadata-") as tmp:
        t0 = time.perf_counter()
        file = write_fsdp_metadata(Path(tmp), a.world)
        n = len(llama_params())
        shards = 3 * n * a.world + n + 12  # a chunk of each tensor and moment per rank, the steps, the param group
        print(f"bench/dcp_metadata.py on {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}): "
              f"{a.world} FSDP ranks, {n} tensors + 2 Adam moments each, "
              f"{shards} shards; .metadata {file.stat().st_size / 1e6:.1f} MB "
              f"(written in {time.perf_counter() - t0:.0f} s)")
        times: dict[str, list[float]] = {name: [] for name in READERS}
        for i in range(a.repeats):  # interleaved, so machine load drifts hit every reader alike
            for name, kind in READERS.items():
                if kind == "old" and (a.skip_old or i > 0):
                    continue
                times[name].append(timed(kind, file))
                print(f"  {name:40} {times[name][-1]:8.2f} s", flush=True)
    med = {name: statistics.median(v) for name, v in times.items() if v}
    print(f"medians of {a.repeats} (the old reader: 1 run):")
    for name, value in med.items():
        print(f"  {name:40} {value:8.2f} s")
    new = med["new: exact_load"]
    if "old: ExactUnpickler (pure Python, gc on)" in med:
        print(f"  ratio old / new: {med['old: ExactUnpickler (pure Python, gc on)'] / new:.1f}x faster")
    print(f"  ratio new / pickle.load, gc as exact_load: {new / med['pickle.load (unsafe), gc as exact_load']:.2f}"
          f"  (the stand-ins' cost)")
    print(f"  ratio pickle.load, gc on / new: {med['pickle.load (unsafe), gc on'] / new:.1f}  (what DCP itself pays)")


if __name__ == "__main__":
    main()
