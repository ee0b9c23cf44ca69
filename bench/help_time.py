# python bench/help_time.py        (the wall time of `python train.py --help`, beside a bare Hydra app's; target <= 1 s)
"""``--help`` composes the config and lists every group's options. A bare Hydra app (one config, no groups)
is the floor: what importing Hydra and composing costs before shardyard adds anything."""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
BARE = """import hydra

@hydra.main(version_base="1.3", config_path=".", config_name="c")
def main(cfg):
    pass

main()
"""


def median_s(argv: list[str], cwd: Path, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=cwd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


with tempfile.TemporaryDirectory() as bare:
    Path(bare, "app.py").write_text(BARE)
    Path(bare, "c.yaml").write_text("x: 1\n")
    floor = median_s(["app.py", "--help"], Path(bare))
ours = median_s(["train.py", "--help"], root)
print(f"python train.py --help: median {ours:.2f} s over 5 runs (target <= 1 s); a bare Hydra app {floor:.2f} s; "
      f"ratio {ours / floor:.1f}x")
