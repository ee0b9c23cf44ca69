"""``shardyard new DIR --recipe NAME``: a standalone project that keeps running a copied recipe, and its entry.

The project holds only what the user owns: a short ``train.py``, ``conf/project.yaml`` (the recipe it runs),
``conf/recipe/NAME.yaml`` (the copies), empty group folders for the user's own options, a ``pyproject.toml``
pinning this shardyard, a README, and ``shardyard.lock.yaml``: the version it was made with and every key of
each copied recipe as that version composed it. shardyard's own configs are not copied: they ship inside the
installed package and sit on Hydra's search path (``pkg://shardyard.conf``), so every group still works and
a file the user adds under ``conf/<group>/`` extends them or, with the same name, replaces one.

Drift (torchtune's ``tune cp`` copies drift silently): when the installed shardyard is not the locked one,
``python train.py`` first prints what changed for the keys the recipes use (renamed, removed, default
changed) and refuses, naming them, keys that no longer exist (``shardyard.config.migrations``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from shardyard import __version__
from shardyard.core.errors import UserError

LOCK = "shardyard.lock.yaml"
GROUPS = ("backend", "model", "data", "optim", "sched", "precision", "checkpoint", "monitor")

TRAIN_PY = '''\
# python train.py                 runs the recipe that conf/project.yaml names ({recipe})
# python train.py backend=fsdp    any shardyard option still works; your own ones live in conf/<group>/
"""This project's entry point: shardyard composes conf/ over its own packaged configs, checks the locked
version (shardyard.lock.yaml), and trains."""
from pathlib import Path

from shardyard.launching.project import main

if __name__ == "__main__":
    main(Path(__file__).resolve().parent)
'''

PROJECT_YAML = '''\
# python train.py          the recipe below, over shardyard's own configs (from the installed package)
# Your options: conf/<group>/NAME.yaml (e.g. conf/model/mymodel.yaml, or conf/backend/my_zero3.yaml with
# `defaults: [zero3, _self_]`); a file named like one of shardyard's replaces it. Your code: `_target_`.
defaults:
  - train                  # shardyard's conf/train.yaml (every default lives in its schemas)
  - _self_
  - override recipe: {recipe}
hydra:
  searchpath:
    - pkg://shardyard.conf
'''

PYPROJECT = '''\
[project]
name = "{name}"
version = "0.1.0"
description = "Training recipes run with shardyard"
requires-python = ">=3.10"
# The version this project was made with (shardyard.lock.yaml records it too); torch comes from your
# environment (a CUDA build on a cluster, torch==2.13.0 for CPU).
dependencies = ["shardyard=={version}"]
'''

README = '''\
# {name}

Training recipes run with [shardyard](https://pypi.org/project/shardyard/) {version}.

```bash
pip install -e .                     # shardyard=={version} (bring your own torch)
python train.py                      # the recipe conf/project.yaml names: {recipe}
```

- `python train.py recipe=NAME` runs another copied recipe (`conf/recipe/`); `shardyard recipes` lists
  the book's, `shardyard new . --recipe NAME` is not needed to use one: `python train.py recipe=NAME`
  finds shardyard's own too.
- Any shardyard option works as usual: `python train.py backend=fsdp model=deepseek7b plan.only=true`.
- Your own options: `conf/model/mymodel.yaml` (`python train.py model=mymodel`), `conf/backend/my_zero3.yaml`
  starting `defaults: [zero3, _self_]`; your own code plugs in by `_target_: mypackage.build_model`.
- `shardyard.lock.yaml` records the shardyard this was made with; under another version `python train.py`
  prints what changed for your recipes, and `shardyard lock` records the new one once you have checked.
'''


def new(directory: str, recipes: list[str]) -> Path:
    """Write the project; an existing non-empty directory is refused (nothing the user made is overwritten)."""
    from shardyard.launching import recipes as book

    root = Path(directory).resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UserError("shardyard new", directory, "The directory exists and is not empty; shardyard new never "
                        "writes over files you made.", "Give a new (or empty) directory, e.g. shardyard new my-llm.")
    chosen = [book.find(name) for name in recipes]  # unknown names are refused before anything is written
    conf = root / "conf"
    for group in GROUPS:
        (conf / group).mkdir(parents=True, exist_ok=True)
        (conf / group / ".keep").write_text("")
    (conf / "recipe").mkdir()
    for r in chosen:
        (conf / "recipe" / r.path.name).write_text(r.path.read_text())
    first = chosen[0].name
    (root / "train.py").write_text(TRAIN_PY.format(recipe=first))
    (conf / "project.yaml").write_text(PROJECT_YAML.format(recipe=first))
    (root / "pyproject.toml").write_text(PYPROJECT.format(name=root.name, version=__version__))
    (root / "README.md").write_text(README.format(name=root.name, version=__version__, recipe=first))
    lock(root)
    return root


def lock(root: Path) -> None:
    """``shardyard.lock.yaml``: this version, and every key of each recipe in ``conf/recipe`` as it composes now."""
    import yaml

    snapshot = {p.stem: _flat(_compose(root, [f"recipe={p.stem}"])) for p in sorted((root / "conf" / "recipe").glob("*.yaml"))}
    text = ("# Written by shardyard (`shardyard new`, `shardyard lock`): the version this project was made with and\n"
            "# every key of its recipes as that version composed them. `python train.py` compares them with the\n"
            "# installed shardyard and says what changed.\n")
    (root / LOCK).write_text(text + yaml.safe_dump({"shardyard_version": __version__, "recipes": snapshot},
                                                   sort_keys=False, width=200))


def _compose(root: Path, overrides: list[str]) -> Any:
    from shardyard import config

    return config.compose(overrides, conf_dir=root / "conf", config_name="project")


def _flat(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=False, enum_to_str=True), "")
    out.pop("run_dir", None)
    return out


def _set_keys(recipe_file: Path) -> tuple[dict[str, Any], list[str]]:
    """The keys a recipe file sets (dotted; ``defaults`` and ``hydra`` aside) and its group choices as overrides."""
    import yaml

    body = yaml.safe_load(recipe_file.read_text()) or {}
    groups = []
    for entry in body.pop("defaults", []) or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                groups.append(f"{key.replace('override', '').strip().lstrip('/')}={value}")
    body.pop("hydra", None)
    keys: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            keys[prefix] = node

    walk(body, "")
    return keys, groups


def check_drift(root: Path) -> None:
    """Under another shardyard than the locked one: refuse recipe keys that no longer exist, naming them (and
    their new names), then print what changed for the keys the recipes take from shardyard's defaults."""
    import yaml

    from shardyard.config.migrations import renamed_since

    path = root / LOCK
    if not path.is_file():
        return
    locked = yaml.safe_load(path.read_text()) or {}
    made_with = str(locked.get("shardyard_version"))
    if made_with == __version__:
        return
    report = []
    for name, before in (locked.get("recipes") or {}).items():
        recipe_file = root / "conf" / "recipe" / f"{name}.yaml"
        if not recipe_file.is_file():
            continue
        try:
            sets, groups = _set_keys(recipe_file)
            base = _flat(_compose(root, ["~recipe", *groups]))
        except Exception:  # noqa: BLE001 - a file that does not parse or compose: Hydra reports it, exit 2
            continue
        gone = [k for k in sets if k not in base and not any(b.startswith(k + ".") for b in base)]
        if gone:
            moves = renamed_since(made_with)
            named = ", ".join(f"{k} (now {moves[k]})" if k in moves else f"{k} (removed)" for k in gone)
            raise UserError(f"conf/recipe/{name}.yaml", ", ".join(gone),
                            f"This project was made with shardyard {made_with}; the installed shardyard {__version__} "
                            f"has no such keys: {named}.",
                            f"Rename or delete them in conf/recipe/{name}.yaml (then `shardyard lock` records "
                            f"{__version__}), or install the locked version: pip install shardyard=={made_with}.")
        try:
            now = _flat(_compose(root, [f"recipe={name}"]))
        except Exception:  # noqa: BLE001 - as above
            continue
        for key in sorted(set(before) | set(now)):
            if key in sets:
                continue  # the recipe sets it: its value is the recipe's, whatever the default
            if key not in now:
                report.append(f"  {name}: {key} removed (was {before[key]!r})")
            elif key not in before:
                report.append(f"  {name}: {key} is new: {now[key]!r}")
            elif before[key] != now[key]:
                report.append(f"  {name}: {key} default changed: {before[key]!r} -> {now[key]!r}")
    print(f"shardyard | this project was made with shardyard {made_with}; {__version__} is installed. What changed "
          f"for its recipes:\n" + ("\n".join(report) or "  nothing they use") +
          "\nshardyard | `shardyard lock` records the installed version once you have checked.", flush=True)


def main(root: Path) -> None:
    """A project's ``train.py``: the drift check, then shardyard's Hydra app over ``conf/project.yaml``."""
    from shardyard.launching import app
    from shardyard.core.errors import report_and_exit

    try:
        check_drift(root)
    except UserError as err:
        report_and_exit(err)
    app.train(sys.argv[1:], conf_dir=root / "conf", config_name="project", prog="train.py")
