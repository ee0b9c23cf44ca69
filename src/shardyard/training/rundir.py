"""The run directory: created once by the parent (or rank 0 of an external launch), read by the workers.

``config.yaml`` is the resolved config and ``plan.json`` the validated plan (world size, batch arithmetic,
model facts): a worker started by our launcher reads both and neither re-composes nor re-validates.
"""

from __future__ import annotations

import dataclasses
import json
import os

from omegaconf import DictConfig, OmegaConf

from shardyard.core.errors import UserError
from shardyard.core.facts import Plan


def resolved(cfg: DictConfig) -> DictConfig:
    """Interpolations resolved and closed choices as plain strings: what workers and files hold."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    assert isinstance(out, DictConfig)
    return out


def prepare(cfg: DictConfig, plan: Plan | None = None) -> str:
    """Create the run dir and write ``config.yaml`` (and ``plan.json``) atomically. Called once per run, by the
    process that owns the dir (the parent, node 0, or rank 0 of an external launch), before anything else is
    written: a dir holding another run's results is refused (or moved aside with
    ``checkpoint.overwrite_run_dir``), and so is a ``checkpoint.dir`` another run writes."""
    run_dir = cfg.run_dir
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError("hydra.run.dir", run_dir, f"The run directory cannot be created or written ({e.strerror}).",
                        "Choose a writable place, e.g. hydra.run.dir=outputs/my-run.") from None
    _check_checkpoint_owner(cfg)
    held = find(cfg)
    if held is not None:
        _claim(cfg, held)
    _claim_checkpoint_dir(cfg)
    path = os.path.join(run_dir, "config.yaml")
    text = OmegaConf.to_yaml(resolved(cfg))
    if os.path.exists(path) and _read(path) != text:  # a resumed run with other overrides: keep what it ran with
        os.replace(path, _free(os.path.join(run_dir, "config.previous"), ".yaml"))
    if not os.path.exists(path):
        _write(path, text)
    if plan is not None:
        from shardyard.core.facts import to_json

        _write(os.path.join(run_dir, "plan.json"), json.dumps(to_json(plan), indent=1))
    return run_dir


def release(cfg: DictConfig) -> None:
    """Undo ``prepare`` in a run dir that held no run before it (``find`` was None), for a run refused before
    anything ran (its data: ``data.prepare``): ``config.yaml`` and ``plan.json`` are removed, so the corrected rerun
    in the same ``hydra.run.dir`` is not refused as "another run's results"."""
    for name in ("config.yaml", "plan.json"):
        try:
            os.remove(os.path.join(cfg.run_dir, name))
        except FileNotFoundError:
            pass


# ------------------------------------------------------------------------------ one run per run dir
RESULTS = ("config.yaml", "plan.json", "summary.json", "metrics.jsonl", "metrics.csv", "hf")
"""What a run writes into its run dir, besides its checkpoints, that makes the dir that run's. Hydra's own
``.hydra/`` and job log (``*.log``), and a sweep job's ``result.json``, are written before shardyard runs and
are not a run's results."""

OWNER = "OWNER"
"""In ``checkpoint.dir``: the absolute path of the run dir whose run writes (and prunes) checkpoints there."""


@dataclasses.dataclass
class Held:
    """What an earlier run left in a run dir."""

    names: list[str]
    """Its results there (``RESULTS`` present, and ``checkpoints`` when it saved any)."""
    finished_at: int | None
    """The step its ``summary.json`` says it finished at (or stopped early at); ``None``: it never finished."""
    checkpoint_at: int | None
    """Its newest checkpoint's step; ``None``: no checkpoint."""
    target: int | None = None
    """The ``train.steps`` of the run that wrote ``summary.json``: done with anything up to it."""

    def describe(self) -> str:
        state = (f"a run that finished at step {self.finished_at}" if self.finished_at is not None else
                 f"a run with checkpoints up to step {self.checkpoint_at}" if self.checkpoint_at is not None else
                 "a run that started but has no checkpoint")
        names = [f"checkpoints up to step {self.checkpoint_at}" if n == "checkpoints" and self.finished_at is not None
                 else n for n in self.names]
        return f"{state} ({', '.join(names)})"


def checkpoint_dir(cfg: DictConfig) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run_dir, "checkpoints")


def checkpoint_steps(directory: str) -> list[int]:
    """The steps of the complete-looking (published) checkpoints in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()
                  and os.path.isdir(os.path.join(directory, n)))


def find(cfg: DictConfig, results: tuple[str, ...] = RESULTS) -> Held | None:
    """The results of a run already in ``cfg.run_dir`` (and its checkpoint dir), or ``None`` if it holds none."""
    run_dir = cfg.run_dir
    names = [n for n in results if os.path.exists(os.path.join(run_dir, n))]
    steps = checkpoint_steps(checkpoint_dir(cfg))
    if steps:
        names.append("checkpoints")
    if not names:
        return None
    summary = _summary(run_dir)
    target = summary.get("steps") if summary is not None else None
    target = target if isinstance(target, int) else None
    stopped = summary.get("stopped_early_at") or summary.get("pruned_at") if summary is not None else None
    return Held(names, stopped if isinstance(stopped, int) else target, steps[-1] if steps else None, target)


def finished(cfg: DictConfig) -> str | None:
    """``checkpoint.resume=auto`` on a run that has nothing left to do: the line saying so, else ``None``.
    Read-only, so every process of a job (every node, every rank of an external launch) decides the same."""
    if cfg.checkpoint.resume != "auto" or cfg.checkpoint.overwrite_run_dir:
        return None
    _check_checkpoint_owner(cfg)  # another run's checkpoints say nothing about this one
    held = find(cfg)
    if held is None:
        return None
    want = cfg.train.steps
    if held.checkpoint_at is not None and held.checkpoint_at >= want:
        from shardyard.training.integrity import verify  # torch: loaded by now in every process that gets here

        newest = os.path.join(checkpoint_dir(cfg), f"step-{held.checkpoint_at:08d}")
        if verify(newest) is None:  # a broken newest one is the worker's to fall back from
            return (f"the run is already complete: its checkpoint {newest} is at step {held.checkpoint_at} and "
                    f"train.steps is {want}; nothing was changed. Raise train.steps to train on.")
    if held.target is not None and held.target >= want and (held.checkpoint_at or 0) <= held.target:
        more = ("Raise train.steps to train on from its newest checkpoint." if held.checkpoint_at is not None else
                "It saved no checkpoint to train on from (checkpoint.every_n_steps=0).")
        return (f"the run is already complete: it finished at step {held.finished_at} (summary.json) and "
                f"train.steps is {want}; nothing was changed. {more}")
    return None


def _claim(cfg: DictConfig, held: Held) -> None:
    """The run dir holds results: go on only when this run continues them, or move them aside when asked."""
    run_dir, c = cfg.run_dir, cfg.checkpoint
    if c.overwrite_run_dir:  # validation refuses it beside checkpoint.resume
        moved = move_aside(cfg)
        print(f"shardyard | checkpoint.overwrite_run_dir: {held.describe()} moved aside to "
              f"{', '.join(moved)} (nothing deleted)", flush=True)
        return
    choices = (f"Continue that run with checkpoint.resume=auto, choose a new hydra.run.dir, or set "
               f"checkpoint.overwrite_run_dir=true to move its results aside into {run_dir}/previous-<time>/ "
               "(nothing is deleted).")
    if c.resume is None:
        raise UserError("hydra.run.dir", run_dir, f"It holds another run's results: {held.describe()}.", choices)
    if c.resume != "auto" and not _inside(c.resume, checkpoint_dir(cfg)):
        raise UserError("hydra.run.dir", run_dir, f"It holds another run's results: {held.describe()}; "
                        f"checkpoint.resume={c.resume} is a checkpoint of some other run, whose continuation "
                        "would mix with them.", "Resume into a new hydra.run.dir, or set "
                        "checkpoint.overwrite_run_dir=true to move the old results aside (nothing is deleted).")
    if held.checkpoint_at is None and held.finished_at is not None:  # resume=auto with train.steps raised
        raise UserError("hydra.run.dir", run_dir, f"checkpoint.resume={c.resume}: it holds {held.describe()}, "
                        "which saved no checkpoint to continue from (checkpoint.every_n_steps=0).",
                        "Choose a new hydra.run.dir, or set checkpoint.overwrite_run_dir=true (without "
                        "checkpoint.resume) to move its results aside and train afresh (nothing is deleted).")
    if held.checkpoint_at is None:  # a requeued job that was stopped before its first checkpoint
        print(f"shardyard | checkpoint.resume=auto: {run_dir} holds {held.describe()}; starting from step 0 "
              "(its logged steps are dropped from the metrics)", flush=True)


OUTPUTS = RESULTS + ("checkpoints", "tensorboard", "wandb", "mlflow", "profile", "universal", "report.png",
                     "deepspeed_config.json", "deepspeed_flops_profile.txt", "horovod_timeline.json")
"""Everything a run writes into its run dir (beside the configured monitor outputs): what
``checkpoint.overwrite_run_dir`` moves aside. Anything else there (a user's own files, when the run dir is a
project dir) is not the run's and stays where it is."""


def _outputs(cfg: DictConfig) -> set[str]:
    names = set(OUTPUTS)
    for key in ("monitor.tensorboard.subdir", "monitor.csv.file"):  # where the selected monitors write
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value and os.sep not in value.strip(os.sep):
            names.add(value.strip(os.sep))
    return names


def move_aside(cfg: DictConfig) -> list[str]:
    """``checkpoint.overwrite_run_dir``: move what a run writes into the run dir (``OUTPUTS``, earlier
    ``config.previous*.yaml`` included) into ``<run_dir>/previous-<time>/``, and a checkpoint dir outside it to
    ``<checkpoint.dir>.previous-<time>``; returns where they went. Renames only: nothing is copied or deleted,
    and nothing that is not the run's (Hydra's ``.hydra/`` and logs, a user's own files) is touched."""
    import time

    run_dir, stamp = cfg.run_dir, time.strftime("%Y%m%d-%H%M%S")
    ours = _outputs(cfg)
    entries = [n for n in sorted(os.listdir(run_dir))
               if n in ours or (n.startswith("config.previous") and n.endswith(".yaml"))]
    moved = []
    if entries:
        aside = _free(os.path.join(run_dir, f"previous-{stamp}"), "")
        os.makedirs(aside)
        for n in entries:
            os.rename(os.path.join(run_dir, n), os.path.join(aside, n))
        moved.append(aside)
    ckpt = checkpoint_dir(cfg)
    if os.path.isdir(ckpt) and not _inside(ckpt, run_dir):
        aside = _free(f"{os.path.normpath(ckpt)}.previous-{stamp}", "")
        os.rename(ckpt, aside)
        moved.append(aside)
    return moved


def _check_checkpoint_owner(cfg: DictConfig) -> None:
    """A ``checkpoint.dir`` outside the run dir that another run writes is refused: this run would publish into
    it and ``keep_last`` would prune that run's checkpoints. Reading one (``checkpoint.resume=PATH``) is fine."""
    ckpt = checkpoint_dir(cfg)
    if _inside(ckpt, cfg.run_dir) or not os.path.isdir(ckpt):
        return
    owner = _read(os.path.join(ckpt, OWNER)).strip() or None
    steps = checkpoint_steps(ckpt)
    if owner is None and not steps:
        return
    if owner is not None and _same(owner, cfg.run_dir):
        return
    if owner is None and _configured_ckpt_dir(cfg.run_dir) == os.path.realpath(ckpt):
        return  # written before owner files existed, by the run in this very dir
    held = f", with checkpoints up to step {steps[-1]}" if steps else ""
    whose = f"the run in {owner} (its {OWNER} file){held}" if owner else f"another run (no {OWNER} file){held}"
    fix = (f"Choose a new checkpoint.dir (or leave it out: <run_dir>/checkpoints), or continue that run: "
           f"hydra.run.dir={owner} checkpoint.resume=auto." if owner else
           "Choose a new checkpoint.dir (or leave it out: <run_dir>/checkpoints).")
    raise UserError("checkpoint.dir", cfg.checkpoint.dir, f"It belongs to {whose}: this run would write its "
                    "checkpoints there and prune that run's.", fix + " Starting from one of its checkpoints "
                    "only reads it: checkpoint.resume=PATH.")


def _claim_checkpoint_dir(cfg: DictConfig) -> None:
    """Name this run in its checkpoint dir before it writes there (``OWNER``, beside the ``step-*`` dirs)."""
    ckpt = checkpoint_dir(cfg)
    if not cfg.checkpoint.every_n_steps and not os.path.isdir(ckpt):
        return  # no checkpoint will be written: no empty dir either
    os.makedirs(ckpt, exist_ok=True)
    if not os.path.exists(os.path.join(ckpt, OWNER)):
        _write(os.path.join(ckpt, OWNER), os.path.abspath(cfg.run_dir) + "\n")


def _configured_ckpt_dir(run_dir: str) -> str | None:
    try:
        ckpt = OmegaConf.load(os.path.join(run_dir, "config.yaml")).checkpoint.dir
    except Exception:  # noqa: BLE001 - no config, or not one of ours: no claim
        return None
    return os.path.realpath(ckpt) if ckpt else None


def _summary(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _inside(path: str, directory: str) -> bool:
    p, d = os.path.realpath(path), os.path.realpath(directory)
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _free(stem: str, suffix: str) -> str:
    """``stem + suffix``, or ``stem-2 + suffix``, ``stem-3``...: the first name not taken (nothing is replaced)."""
    path, n = stem + suffix, 1
    while os.path.lexists(path):
        n += 1
        path = f"{stem}-{n}{suffix}"
    return path


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def wait_for_node0(cfg: DictConfig, timeout_s: float) -> str:
    """Node k > 0 of a multi-node run: node 0 writes the shared run dir; wait until its ``config.yaml`` is
    this node's own config (``launch.node_rank`` aside), so that every node trains the same recipe."""
    import time

    run_dir, n, r = cfg.run_dir, cfg.launch.nnodes, cfg.launch.node_rank
    # Node 0 refuses a run dir holding another run; an old config.yaml equal to ours must not let this node
    # go on alone. What the new run writes after config.yaml and plan.json (metrics, checkpoints, summary)
    # appears only once every node has joined it, so these are an earlier run's.
    held = find(cfg, tuple(x for x in RESULTS if x not in ("config.yaml", "plan.json")))
    if held is not None and cfg.checkpoint.resume is None and not cfg.checkpoint.overwrite_run_dir:
        _claim(cfg, held)  # raises, as on node 0
    path = os.path.join(run_dir, "config.yaml")
    mine = _without_node_rank(resolved(cfg))
    theirs = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.exists(os.path.join(run_dir, "plan.json")):
            theirs = _without_node_rank(OmegaConf.load(path))
            if theirs == mine:
                return run_dir
        time.sleep(0.2)
    if theirs is None:
        raise UserError("hydra.run.dir", run_dir,
                        f"This is node {r} of {n}: node 0 writes the run's config.yaml there, and none appeared "
                        f"within launch.timeout_s={timeout_s} s.",
                        "Start node 0 as well, with the same hydra.run.dir on a file system every node shares.")
    diff = sorted(_differences(theirs, mine))
    raise UserError("launch.node_rank", r,
                    f"Node 0's config in {run_dir} differs from this node's at {', '.join(diff[:6])}.",
                    "Start every node with the same overrides; only launch.node_rank differs between nodes.")


def _without_node_rank(cfg) -> dict:
    d = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(d, dict)
    d.get("launch", {}).pop("node_rank", None)
    return d


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in a.keys() | b.keys() for k in _differences(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load(run_dir: str):
    """``(config, plan)`` as the parent wrote them."""
    from shardyard.core.facts import from_json

    with open(os.path.join(run_dir, "plan.json")) as f:
        plan = from_json(json.load(f))
    return OmegaConf.load(os.path.join(run_dir, "config.yaml")), plan


def check_command_line_dirs(argv: list[str]) -> None:
    """Hydra creates the run (or sweep) directory before shardyard runs; an unwritable one would end in
    Hydra's tracebacks. A literal ``hydra.run.dir=`` / ``hydra.sweep.dir=`` is checked here first."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or not value or "${" in value:
            continue
        try:
            os.makedirs(value, exist_ok=True)
            if not os.access(value, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise UserError(key, value, f"That directory cannot be created or written ({e.strerror}).",
                            f"Choose a writable place, e.g. {key}=outputs/my-run.") from None
