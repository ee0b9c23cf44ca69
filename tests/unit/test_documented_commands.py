"""Every command in a code block of README.md and docs/*.md composes and validates, so no documented command rots.

A command is a ``python train.py ...`` (or ``shardyard train|plan ...``) line inside a fenced code block: line
continuations (``\\``) joined, a ``# comment`` and an ``ENV=1`` prefix ignored, ``...`` (the reader's own
overrides) dropped, and each job of a ``-m`` sweep composed on its own. Each is checked the way ``run.py`` checks
it before any process starts: composed with Hydra, ``+scale=smoke`` and ``fast_dev_run`` applied, validated, and
its memory plan computed; a plan that does not fit is the refusal (exit 2) a user would see.
* Commands that launch big hardware are checked on paper (``plan.only`` semantics): a command that names
  ``plan.hardware`` is planned on that hardware, and a recipe of the book meant for GPUs (its header's
  ``# hardware:``) is planned on its header's hardware and nodes; both must fit. Everything else is planned
  on this machine with ``backend.device=cpu`` (unless the command sets it), so the result does not depend on
  the GPUs of the machine running the test.
* A command meant to fail says so with a trailing comment holding ``exits 2``, or a
  ``<!-- doc-commands: exits 2 -->`` line just before its code block: it must raise ``UserError``.
* ``<!-- doc-commands: not composed (why) -->`` just before a code block leaves its commands out (they need
  files of the reader's own project).
* A value that is a path this machine lacks (``model.weights=DIR``, ``data.paths=[/data/*.jsonl]``): the command
  must compose, and validation may refuse it only for that key (it stops there; keys it checks later are not
  checked for that command).
Parametrized by ``file:line``, so a failure names the doc line.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardyard.core.errors import UserError

try:  # the one composer, wherever it lives now
    from shardyard.config import compose
except ImportError:
    from shardyard.testing import compose
try:
    from shardyard.planning.validate import apply_fast_dev_run, validate
except ImportError:
    from shardyard.config.validate import apply_fast_dev_run, validate

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*doc-commands:\s*(.*?)\s*-->")
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                          "--config-dir", "-cd", "--experimental-rerun"}
ENDS = {"&&", "||", ";", "|", ">", ">>", "2>&1"}


@dataclass(frozen=True)
class Command:
    where: str
    """``README.md:42``: the file and the line the command starts on."""
    text: str
    overrides: tuple[str, ...]
    multirun: bool
    plan_only: bool
    """``shardyard plan ...``: ``python train.py ... plan.only=true`` as a tool."""
    exits_2: bool


def _arguments(words: list[str]) -> tuple[list[str], bool] | None:
    """The arguments after ``train.py`` (or ``shardyard train|plan``) up to the end of the command, or None when
    the words hold no such command; whether it is ``shardyard plan``."""
    for i, w in enumerate(words):
        if w == "train.py" and i and re.fullmatch(r"(.*/)?python3?(\.\d+)?", words[i - 1]):
            start, tool_plan = i + 1, False
        elif w == "shardyard" and words[i + 1:i + 2] in (["train"], ["plan"]) and words[i - 1:i] != ["pip"]:
            start, tool_plan = i + 2, words[i + 1] == "plan"
        else:
            continue
        args = []
        for a in words[start:]:
            if a in ENDS:
                break
            args.append(a)
        return args, tool_plan
    return None


def _split_comment(line: str) -> tuple[str, str]:
    """The shell code and its trailing ``# comment`` (a ``#`` that starts a word outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def parse(where: str, line: str, block_marker: str) -> Command | None:
    line = re.sub(r"^\s*\$\s+", "", line)  # a transcript's prompt
    if not re.search(r"train\.py|shardyard (train|plan)", line):
        return None
    code, comment = _split_comment(line)
    found = _arguments(shlex.split(code))
    if found is None:
        return None
    args, tool_plan = found
    overrides, multirun, skip = [], False, False
    for a in args:
        if skip:
            skip = False
        elif a in ("-m", "--multirun"):
            multirun = True
        elif a in HYDRA_FLAGS_WITH_VALUE:
            skip = True  # --cfg job, --package PKG, ...
        elif a.startswith("-") or a == "...":
            continue  # --help, --hydra-help, --resolve, --info; `...`: the reader's own overrides
        else:
            overrides.append(a)
    exits_2 = "exits 2" in comment or "exits 2" in block_marker
    return Command(where, line.strip(), tuple(overrides), multirun, tool_plan, exits_2)


def documented(paths: list[Path] = DOCS) -> list[Command]:
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        in_block, marker, i = False, "", 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                if not in_block:
                    before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                    m = MARKER.search(before)
                    marker = m.group(1) if m else ""
                in_block = not in_block
                i += 1
                continue
            start = i
            while in_block and line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            if in_block and not marker.startswith("not composed"):
                name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                cmd = parse(f"{name}:{start + 1}", line, marker)
                if cmd is not None:
                    out.append(cmd)
            i += 1
    return out


COMMANDS = documented()


def jobs(cmd: Command) -> list[list[str]]:
    """The overrides of each job: a sweep's lists (``KEY=a,b``) expanded as Hydra's basic sweeper does."""
    if not cmd.multirun:
        return [list(cmd.overrides)]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(list(cmd.overrides)):
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(job) for job in itertools.product(*choices)]


def _value(overrides: list[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), None)


def _absent_path(value: str | None) -> bool:
    """A path the reader has and this machine lacks (``DIR``, ``/models/tok``, ``[/data/*.jsonl]``)."""
    if value is None:
        return False
    paths = [p.strip(" '\"") for p in value.strip("[]").split(",")]
    return all(("/" in p or p.isupper()) and not os.path.exists(p) for p in paths)


def _scale(cfg) -> None:
    """``+scale=smoke`` applied as ``run.py`` applies it before validation (``scale._target_``, or the older
    ``scale.name``)."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    target = OmegaConf.select(cfg, "scale._target_")
    if target:
        get_object(target)(cfg)
    elif OmegaConf.select(cfg, "scale.name") not in (None, "full"):
        from shardyard.planning import scale

        scale.apply(cfg)


def check(overrides: list[str], plan_only: bool) -> None:
    """What ``python train.py <overrides>`` does before any process starts; raises ``UserError`` as it would."""
    from shardyard.planning import plan as memory_plan
    from shardyard.planning import hardware as plan_hardware
    from shardyard.launching import recipes
    from shardyard.core.dist_env import DistEnv

    overrides = list(overrides) + (["plan.only=true"] if plan_only else [])
    env = None
    on_paper = _value(overrides, "plan.hardware") is not None
    recipe = _value(overrides, "recipe")
    if recipe and not on_paper and _value(overrides, "+scale") is None and "plan.only=true" not in overrides:
        r = recipes.find(recipe)
        if "cpu" not in r.hardware.lower():  # a GPU recipe: planned on the hardware its header names
            nodes = int(_value(overrides, "launch.nnodes") or r.nodes)
            overrides += [f"plan.hardware={r.hardware}", f"plan.nodes={nodes}"]
            on_paper = True
            per_node = plan_hardware.named(r.hardware, nodes).ranks_per_node
            if nodes > 1 and _value(overrides, "launch.nnodes") is None:  # started by its header's launcher
                env = DistEnv("elastic", 0, 0, per_node * nodes, per_node)
    if _value(overrides, "backend.device") is None:
        overrides.append("backend.device=cpu")
    cfg = compose(overrides)
    _scale(cfg)
    apply_fast_dev_run(cfg)
    batch = validate(cfg, env)
    e = memory_plan.estimate(cfg, batch, plan_hardware.hardware(cfg, batch))
    if cfg.plan.only or cfg.plan.search:
        return  # every engine's plan (or every layout, ranked) is printed, exit 0
    if not e.fits and cfg.plan.check:
        where = f"on {cfg.plan.hardware}" if on_paper else "on this machine"
        raise UserError("plan", where, f"The plan does not fit: {e.device_peak / 2**30:.1f} GiB per rank.",
                        "(the refusal `plan.before_launch` prints, with its alternatives)")


CHECKED: dict[tuple[tuple[str, ...], bool], tuple[UserError, object] | None] = {}
"""(overrides, plan_only) -> what ``check`` gave for them: None, or the UserError it raised and its traceback."""


def checked(overrides: list[str], plan_only: bool) -> None:
    """``check``, once per distinct job: the docs repeat a command line on many pages (the bare ``python train.py``
    seven times), and ``check`` reads nothing but its arguments and this checkout, so a repeat gets the first's
    outcome (its UserError raised again) instead of composing, validating and planning the same job again."""
    key = (tuple(overrides), plan_only)
    if key not in CHECKED:
        try:
            check(overrides, plan_only)
            CHECKED[key] = None
        except UserError as err:
            CHECKED[key] = (err, err.__traceback__)
            raise
    if CHECKED[key] is not None:
        err, tb = CHECKED[key]
        raise err.with_traceback(tb)  # the first run's traceback, not one grown by every repeat


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_composes_and_validates(cmd: Command) -> None:
    for overrides in jobs(cmd):
        if cmd.exits_2:
            with pytest.raises(UserError):
                checked(overrides, cmd.plan_only)
            continue
        try:
            checked(overrides, cmd.plan_only)
        except UserError as err:
            # Refused only for a path the reader has and this machine lacks.
            assert _absent_path(_value(overrides, err.key)), f"{cmd.where}: {cmd.text}\n{err.paragraph()}"


def test_the_docs_hold_the_commands_and_markers_this_test_reads() -> None:
    where = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/engines.md", "docs/sweeps.md", "docs/recipes.md", "docs/plan.md"} <= where, where
    assert sum(c.multirun for c in COMMANDS) >= 3 and sum(c.exits_2 for c in COMMANDS) >= 2
    for path in DOCS:
        for m in MARKER.finditer(path.read_text()):
            assert m.group(1) == "exits 2" or re.fullmatch(r"not composed \(.+\)", m.group(1)), (path, m.group(0))


def test_parse_reads_continuations_comments_prefixes_and_sweeps(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("text python train.py a=1\n\n<!-- doc-commands: exits 2 -->\n```\n"
                   "$ python train.py train.steps=0\n```\n```bash\n"
                   "PYTHONPATH=. python train.py --cfg job model=deepseek_tiny \\\n    optim.lr=1e-3   # a comment=2\n"
                   "cd p && python train.py -m 'optim.lr=1e-3,3e-3' backend=ddp,single ... && ls\n"
                   "shardyard plan model=deepseek7b plan.hardware=8xH100-80GB   # exits 2 if it does not fit\n"
                   "pip install shardyard\n```\n")
    a, b, c, d = documented([doc])
    assert (a.overrides, a.exits_2) == (("train.steps=0",), True)
    assert (b.overrides, b.multirun, b.exits_2) == (("model=deepseek_tiny", "optim.lr=1e-3"), False, False)
    assert jobs(c) == [["optim.lr=0.001", "backend=ddp"], ["optim.lr=0.001", "backend=single"],
                       ["optim.lr=0.003", "backend=ddp"], ["optim.lr=0.003", "backend=single"]]
    assert (d.plan_only, d.exits_2) == (True, True)


def test_the_readme_quickstart_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    block = readme.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in block.splitlines()] == [["make", "train"], ["make", "test"]]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves() -> None:
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    readme = (ROOT / "README.md").read_text()
    assert all(f"(docs/{name})" in readme for name in docs), "every docs/ file is in the README's map"
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.relative_to(ROOT)}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{path.relative_to(ROOT)}: {target}"
