# python bench/help_time.py        (prints the wall time of `python train.py --help`; target < 3 s)
import statistics
import subprocess
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
times = []
for _ in range(5):
    t = time.perf_counter()
    subprocess.run([sys.executable, "train.py", "--help"], cwd=root, check=True, capture_output=True)
    times.append(time.perf_counter() - t)
print(f"python train.py --help: median {statistics.median(times):.2f} s over 5 runs (target < 3 s)")
