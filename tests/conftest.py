import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardyard.testing import TINY  # noqa: E402,F401  (re-exported to the tests)


def train_py(*overrides: str, run_dir: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py`` exactly as a user would, in its own run dir."""
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)

