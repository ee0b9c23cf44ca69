"""Installing shardyard breaks no other Hydra program: a user's own ``@hydra.main`` app, in the same environment,
runs ``--help``, a run and a ``-m`` sweep with the basic and the joblib launchers. Hydra's plugin scan executes
``hydra_plugins.shardyard_sweepers`` without putting it in ``sys.modules``; the plug-in must load that way too,
in either import order (scanned first, or imported by shardyard's schema first)."""

import subprocess
import sys

import pytest

APP = '''\
{preamble}
from dataclasses import dataclass
import hydra
from hydra.core.config_store import ConfigStore

@dataclass
class Conf:
    x: int = 1
    name: str = "a"

ConfigStore.instance().store(name="conf", node=Conf)

@hydra.main(version_base="1.3", config_name="conf")
def main(cfg: Conf) -> None:
    print(f"RESULT x={{cfg.x}} name={{cfg.name}}")

if __name__ == "__main__":
    main()
'''


def run(app, *args):
    # The venv's real interpreter (not the fork server): Hydra scans its plug-ins at start, as a user's would.
    proc = subprocess.run([sys.executable, str(app), *args], cwd=app.parent, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("order", ["scanned_first", "shardyard_first"])
def test_a_users_own_hydra_app_runs_beside_shardyard(order, tmp_path):
    preamble = "import shardyard.config  # the schema imports the plug-in before Hydra scans" if order != "scanned_first" else ""
    app = tmp_path / "app.py"
    app.write_text(APP.format(preamble=preamble))
    assert "x: 1" in run(app, "--help")
    assert "RESULT x=3 name=a" in run(app, "x=3")
    if order != "scanned_first":
        return  # one sweep per launcher is enough: the import order matters at start, not per job
    out = run(app, "-m", "x=1,2", "name=b", "hydra.sweep.dir=basic")
    assert "RESULT x=1 name=b" in out and "RESULT x=2 name=b" in out
    # The joblib launcher (shardyard's `sweep` extra installs it) runs the jobs in loky worker processes.
    out = run(app, "-m", "x=4,5", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweep.dir=joblib")
    assert "RESULT x=4 name=a" in out and "RESULT x=5 name=a" in out
    for sweep_dir, xs in (("basic", ["1", "2"]), ("joblib", ["4", "5"])):  # a dir per job, with its overrides
        jobs = [tmp_path / sweep_dir / str(i) / ".hydra" / "overrides.yaml" for i in range(2)]
        assert [j.read_text().splitlines()[0] for j in jobs] == [f"- x={x}" for x in xs]


def test_the_plugin_scan_imports_no_torch():
    """Hydra executes shardyard's plug-in module at the start of every Hydra program: it stays light."""
    code = "import sys, hydra_plugins.shardyard_sweepers; print(sorted({'torch', 'transformers', 'optuna'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
