"""The run directory: created once by the parent (or rank 0 of an external launch), read by the workers.

``config.yaml`` is the resolved config and ``plan.json`` the validated plan (world size, batch arithmetic,
model facts): a worker started by our launcher reads both and neither re-composes nor re-validates.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig, OmegaConf

from shardyard.errors import UserError


def resolved(cfg: DictConfig) -> DictConfig:
    """Interpolations resolved and closed choices as plain strings: what workers and files hold."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    assert isinstance(out, DictConfig)
    return out


def prepare(cfg: DictConfig, plan=None) -> str:
    """Create the run dir and write ``config.yaml`` (and ``plan.json``) atomically, without clobbering a run."""
    run_dir = cfg.run_dir
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError("hydra.run.dir", run_dir, f"The run directory cannot be created or written ({e.strerror}).",
                        "Choose a writable place, e.g. hydra.run.dir=outputs/my-run.") from None
    path = os.path.join(run_dir, "config.yaml")
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    if os.path.exists(path) and cfg.checkpoint.resume is None and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise UserError("hydra.run.dir", run_dir, "That run directory already holds a run with checkpoints.",
                        "Continue it with checkpoint.resume=auto, or choose a new hydra.run.dir.")
    if os.path.exists(path):  # keep the config the run started with beside the new one
        os.replace(path, os.path.join(run_dir, "config.previous.yaml"))
    _write(path, OmegaConf.to_yaml(resolved(cfg)))
    if plan is not None:
        from shardyard.config.validate import to_json

        _write(os.path.join(run_dir, "plan.json"), json.dumps(to_json(plan), indent=1))
    return run_dir


def wait_for_node0(cfg: DictConfig, timeout_s: float) -> str:
    """Node k > 0 of a multi-node run: node 0 writes the shared run dir; wait until its ``config.yaml`` is
    this node's own config (``launch.node_rank`` aside), so that every node trains the same recipe."""
    import time

    run_dir, n, r = cfg.run_dir, cfg.launch.nnodes, cfg.launch.node_rank
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
    from shardyard.config.validate import from_json

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
