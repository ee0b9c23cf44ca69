"""The layering (pyproject.toml's import-linter contracts, docs/architecture.md "Layers") holds, and the check
has teeth: a low module that imports a high one, even inside a function, breaks it."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root / "src"), "PYTHONNOUSERSITE": "1"}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layers_hold_and_a_function_level_upward_import_breaks_them(tmp_path):
    ok = _lint(ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "5 kept, 0 broken" in ok.stdout

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "conf"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    errors = copy / "src" / "shardyard" / "core" / "errors.py"  # the floor
    errors.write_text(errors.read_text() + "\n\ndef _upward() -> None:\n    from shardyard.training import worker  # noqa: F401\n")
    facts = copy / "src" / "shardyard" / "core" / "facts.py"
    facts.write_text(facts.read_text() + "\n\ndef _harness() -> None:\n    from shardyard import testing  # noqa: F401\n")
    bad = _lint(copy)
    assert bad.returncode != 0
    assert "0 kept, 5 broken" in bad.stdout, bad.stdout  # the layers, the three independences, the harness
    assert "shardyard.core.errors -> shardyard.training.worker" in bad.stdout, bad.stdout
    assert "shardyard.core.facts -> shardyard.testing" in bad.stdout, bad.stdout
