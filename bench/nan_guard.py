# python bench/nan_guard.py      (step time with debug.nan_policy=stop, the default, vs off; prints the ratio)
#
# The guard reads the global gradient norm on the host every step (one sync). On CPU that is free; run this
# on a GPU box (it picks CUDA when present) to see what the sync costs there.
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[1]
RUN = ["backend=single", "train.steps=60", "train.eval_every_n_steps=0", "train.sample_tokens=0", "train.eval_batches=1",
       "checkpoint.save_final=false", "monitor=[]", "train.log_every_n_steps=20"]


def median_step(policy: str) -> float:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "train.py", f"hydra.run.dir={d}", *RUN, f"debug.nan_policy={policy}"],
                       cwd=root, check=True, capture_output=True)
        steps = json.load(open(Path(d) / "summary.json"))["step_wall_s"][5:]  # past the warm-up
    return statistics.median(steps)


times = {"off": [], "stop": []}
for _ in range(3):  # alternate, so machine-load drift hits both alike
    for policy in times:
        times[policy].append(median_step(policy))
off, stop = statistics.median(times["off"]), statistics.median(times["stop"])
print(f"median step: nan_policy=off {1000 * off:.1f} ms, stop {1000 * stop:.1f} ms: ratio {stop / off:.3f} "
      f"(3 alternating runs of 60 steps, default model)")
