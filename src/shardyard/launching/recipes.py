"""The recipe book: ``recipes/NAME.yaml`` (``python train.py recipe=NAME``), browsed with ``shardyard recipes``.

Every recipe opens with a header of comment lines that people read and the tests check::

    # @package _global_                (Hydra reads it only before any other comment)
    # <the exact launch command; it names recipe=NAME>
    # hardware: <what it is for, in plan.hardware syntax: 8xH100-80GB, 2xcpu>[, <N> nodes]
    # plan: <peak> GiB per GPU|rank[ + <host> GiB host RAM per rank]    (shardyard.planning.plan on that hardware)
    # for: <what it is for, one line>

``tests/e2e/test_recipes.py`` discovers every file: it composes, its launch command parses and names it, its
plan fits the hardware it names and equals the header's figure, and it trains scaled down (``+scale=smoke``)
with a falling loss. A recipe added later is covered without a new test. After a change to the plan,
``python -m shardyard.launching.recipes --write-plans`` rewrites the ``# plan:`` lines.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardyard.config import CONF_DIR

RECIPE_DIR = CONF_DIR / "recipe"
"""``conf/recipe`` (the checkout's ``recipes/``)."""
GiB = 1024**3


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    command: str
    """The header's launch command, as written."""
    argv: list[str]
    """Its ``train.py`` arguments (Hydra overrides; ``-m`` dropped)."""
    multirun: bool
    """The command is a sweep (``-m``)."""
    hardware: str
    """``plan.hardware`` syntax: ``8xH100-80GB``, ``2xcpu``."""
    nodes: int
    plan: str
    """The header's planned memory, e.g. ``23.5 GiB per GPU``."""
    purpose: str
    engine: str
    model: str


def read(path: Path) -> Recipe:
    """A recipe's header and its engine and model (from its defaults list); ``ValueError`` names what is wrong."""
    lines = path.read_text().splitlines()
    header: dict[str, str] = {}
    command = ""
    for line in lines:
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if not command and not text.startswith("@"):
            command = text
        m = re.fullmatch(r"(hardware|plan|for):\s*(.*)", text)
        if m:
            header[m.group(1)] = m.group(2).strip()
    missing = [k for k in ("hardware", "plan", "for") if k not in header]
    if not command or missing:
        raise ValueError(f"{path}: the header needs the launch command (after `# @package _global_`) and `# hardware:`, `# plan:` and "
                         f"`# for:` lines (missing: {', '.join(missing) or 'the command'})")
    words = shlex.split(command)
    script = next((i for i, w in enumerate(words) if w.endswith("train.py")), None)
    if script is None:
        raise ValueError(f"{path}: the header's first line must be the command that runs it (`... train.py "
                         f"recipe={path.stem}`), not {command!r}")
    argv = words[script + 1:]
    multirun = any(w in ("-m", "--multirun") for w in argv)
    argv = [w for w in argv if w not in ("-m", "--multirun")]
    if f"recipe={path.stem}" not in argv:
        raise ValueError(f"{path}: its launch command does not name recipe={path.stem}: {command!r}")
    hw = re.fullmatch(r"(\S+?)(?:,\s*(\d+)\s+nodes?)?", header["hardware"])
    if hw is None:
        raise ValueError(f"{path}: `# hardware: {header['hardware']}` is not `SPEC[, N nodes]` (e.g. 8xH100-80GB, 2 nodes)")
    chosen = {"backend": "ddp", "model": "deepseek_tiny", **_defaults(CONF_DIR / "train.yaml")}
    chosen.update(_defaults(path))
    return Recipe(path.stem, path, command, argv, multirun, hw.group(1), int(hw.group(2) or 1), header["plan"],
                  header["for"], chosen["backend"], chosen["model"])


def _defaults(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, str]:
    """``group: option`` of a config's defaults list (``override /backend: zero3`` -> backend: zero3); a recipe
    that starts from another (``- deepseek_moe_16b_fsdp``, a file beside it) has that one's choices first."""
    import yaml

    out: dict[str, str] = {}
    for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
        if isinstance(entry, str) and (path.parent / f"{entry}.yaml").is_file():
            base = path.parent / f"{entry}.yaml"
            if base in seen or base == path:
                raise ValueError(f"{path}: its defaults start from {entry}, which starts from it again")
            out.update(_defaults(base, (*seen, path)))
        elif isinstance(entry, dict):
            for key, value in entry.items():
                group = key.replace("override", "").strip().lstrip("/")
                if isinstance(value, str):
                    out[group] = value
    return out


def catalogue(directory: Path = RECIPE_DIR) -> list[Recipe]:
    return [read(p) for p in sorted(directory.glob("*.yaml"))]


def find(name: str) -> Recipe:
    from shardyard.core.errors import UserError

    path = RECIPE_DIR / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(p.stem for p in sorted(RECIPE_DIR.glob("*.yaml")))
        raise UserError("recipe", name, f"There is no such recipe; the book has: {names}.",
                        "`shardyard recipes` lists them with their hardware and purpose.")
    return read(path)


def compose(r: Recipe, extra: list[str] | None = None) -> Any:
    """The recipe's config as its launch command composes it (outside a Hydra app)."""
    from shardyard import config

    return config.compose([*r.argv, *(extra or [])])


def planned(r: Recipe) -> tuple[str, bool]:
    """The plan of ``r`` on the hardware its header names, as the header writes it, and whether it fits."""
    from shardyard.planning import plan
    from shardyard.planning import hardware as plan_hardware
    from shardyard.planning.validate import validate

    # Planned, not launched: the header's hardware fixes the ranks per node and its nodes the world, so the
    # batch arithmetic and a pipeline's or tensor-parallel split see the world the launch command starts.
    cfg = compose(r, [f"plan.hardware={r.hardware}", f"plan.nodes={r.nodes}", "plan.only=true",
                      "launch.nproc_per_node=auto"])
    batch = validate(cfg, None)
    hw = plan_hardware.hardware(cfg, batch)
    assert batch.dims.world_size == hw.world, (batch.dims, hw)
    e = plan.estimate(cfg, batch, hw)
    text = f"{_gib(e.device_peak)} GiB per {'GPU' if hw.device == 'cuda' else 'rank'}"
    if e.host_peak:
        text += f" + {_gib(e.host_peak)} GiB host RAM per rank"
    return text, e.fits


def _gib(b: float) -> str:
    return f"{b / GiB:.1f}" if b >= 9.95 * GiB else f"{b / GiB:.2f}"


def write_plans(directory: Path = RECIPE_DIR) -> list[str]:
    """Rewrite every header's ``# plan:`` line from the plan as it is now; the changed ones, described."""
    changed = []
    for r in catalogue(directory):
        text, fits = planned(r)
        if text != r.plan:
            r.path.write_text(r.path.read_text().replace(f"# plan: {r.plan}\n", f"# plan: {text}\n", 1))
            changed.append(f"{r.name}: {r.plan} -> {text}{'' if fits else ' (DOES NOT FIT)'}")
    return changed


def listing() -> str:
    """``shardyard recipes``: one line per recipe."""
    rows = [(r.name, r.engine, r.model, r.hardware + (f" x{r.nodes} nodes" if r.nodes > 1 else ""), r.plan,
             r.purpose) for r in catalogue()]
    head = ("recipe", "engine", "model", "hardware", "plan (peak per rank)", "for")
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(5)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths) + "  {}"
    lines = [fmt.format(*head)] + [fmt.format(*row[:5], _short(row[5])) for row in rows]
    return "\n".join(lines) + ("\n\nrun one: the command in its header (`shardyard recipes show NAME`); scaled down to "
                               "this machine: python train.py recipe=NAME +scale=smoke")


def _short(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0] + " ..."


def show(name: str) -> str:
    """``shardyard recipes show NAME``: the header, and the whole config the recipe composes (resolved)."""
    from omegaconf import OmegaConf

    r = find(name)
    cfg = compose(r)
    head = "\n".join(line for line in r.path.read_text().splitlines() if line.startswith("#") and "@package" not in line)
    body = OmegaConf.to_yaml(OmegaConf.to_container(cfg, resolve=True))
    return f"{head}\n# file: {r.path}\n\n{body}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-plans"]:
        print("\n".join(write_plans()) or "every header's plan is current")
    else:
        print(listing())
