"""Where shardyard's modules moved (issue 55), and the one place old module paths keep working.

Until 0.1 every module sat loose under ``shardyard/`` (``shardyard.sft``, ``shardyard.model``, ...); they now live
in packages by concern (docs/architecture.md, "Layers"). A user's copied recipe, an old run dir's ``config.yaml``
(read back by a resume, an export or ``shardyard generate``), a project's ``train.py`` or a script may still name
an old path. :data:`MOVED` maps each old module to its new one, exact names only (never a prefix), and is read in
three places, all through this module:

* :class:`_OldPaths`, on ``sys.meta_path`` from ``import shardyard`` on: ``import shardyard.sft`` (and so
  Hydra's ``get_object``/``instantiate`` of a ``_target_: shardyard.sft.SFTData``, and a pickle naming
  ``shardyard.sft``) gets the new module itself, the same object, with one deprecation line;
* :func:`attribute`, the ``__getattr__`` of the two packages that took an old module's name (``shardyard.data``
  was ``data.py``, ``shardyard.inference`` was ``inference.py``): ``shardyard.data.mixture`` is
  ``shardyard.data.pipeline.mixture``;
* ``core.safe_load``'s exact (module, name) check, which tries the new module of an old one.

The deprecation line is a warning of the ``shardyard.core.moved`` logger, once per old path and process.
This module imports nothing of shardyard: ``shardyard/__init__.py`` installs the hook.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any, Callable

MOVED: dict[str, str] = {
    "shardyard.errors": "shardyard.core.errors",
    "shardyard.dist_env": "shardyard.core.dist_env",
    "shardyard.facts": "shardyard.core.facts",
    "shardyard.memory": "shardyard.core.memory",
    "shardyard.safe_load": "shardyard.core.safe_load",
    "shardyard.drills": "shardyard.core.drills",
    "shardyard.options": "shardyard.config.options",
    "shardyard.preflight": "shardyard.config.preflight",
    "shardyard.optim": "shardyard.backends.optim",
    "shardyard.op_builds": "shardyard.core.op_builds",
    "shardyard.model": "shardyard.models.build",
    "shardyard.weights": "shardyard.models.weights",
    "shardyard.moe": "shardyard.models.moe",
    "shardyard.mtp": "shardyard.models.mtp",
    "shardyard.adapters": "shardyard.models.adapters",
    "shardyard.generation": "shardyard.models.generation",
    "shardyard.data": "shardyard.data.pipeline",
    "shardyard.sources": "shardyard.data.sources",
    "shardyard.corpus": "shardyard.data.corpus",
    "shardyard.token_cache": "shardyard.data.token_cache",
    "shardyard.shards": "shardyard.data.shards",
    "shardyard.sft": "shardyard.data.sft",
    "shardyard.prompts": "shardyard.data.prompts",
    "shardyard.preference": "shardyard.data.preference",
    "shardyard.synthetic": "shardyard.data.synthetic",
    "shardyard.harness": "shardyard.evaluation.harness",
    "shardyard.eval_tasks": "shardyard.evaluation.tasks",
    "shardyard.eval_tasks.stdlib_qa": "shardyard.evaluation.tasks.stdlib_qa",
    "shardyard.eval_tasks.stdlib_qa.stdlib_qa": "shardyard.evaluation.tasks.stdlib_qa.stdlib_qa",
    "shardyard.worker": "shardyard.training.worker",
    "shardyard.loop": "shardyard.training.loop",
    "shardyard.checkpoint": "shardyard.training.checkpoint",
    "shardyard.export": "shardyard.training.export",
    "shardyard.rundir": "shardyard.training.rundir",
    "shardyard.debug": "shardyard.training.debug",
    "shardyard.profiling": "shardyard.training.profiling",
    "shardyard.metrics": "shardyard.training.metrics",
    "shardyard.trial": "shardyard.training.trial",
    "shardyard.validate": "shardyard.planning.validate",
    "shardyard.plan": "shardyard.planning.plan",
    "shardyard.dryrun": "shardyard.planning.dryrun",
    "shardyard.scale": "shardyard.planning.scale",
    "shardyard.inference": "shardyard.inference.loading",
    "shardyard.generate": "shardyard.inference.generate",
    "shardyard.speculative": "shardyard.inference.speculative",
    "shardyard.ds_inference": "shardyard.inference.ds_inference",
    "shardyard.evaluate": "shardyard.inference.evaluate",
    "shardyard.run": "shardyard.launching.run",
    "shardyard.app": "shardyard.launching.app",
    "shardyard.launch": "shardyard.launching.launch",
    "shardyard.sbatch": "shardyard.launching.sbatch",
    "shardyard.sweep": "shardyard.launching.sweep",
    "shardyard.project": "shardyard.launching.project",
    "shardyard.recipes": "shardyard.launching.recipes",
    "shardyard.report": "shardyard.monitors.report",
}
"""Old module -> new module, exact names."""

NAMES_MOVED: dict[str, str] = {
    **{f"shardyard.models.build.{name}": "shardyard.models.shape" for name in (
        "transformer_blocks", "signature")},  # is_hf, param_count, flops_per_token, ...: build itself imports them
    **{f"shardyard.models.build.{name}": "shardyard.models.prepare" for name in (
        "apply_activation_checkpointing", "apply_compile", "apply_float8", "float8_linears", "apply_chunked_loss",
        "has_chunked_loss", "SpeedProbe", "prepare_model", "prepare_replica")},
    **{f"shardyard.models.build.{name}": "shardyard.models.loss" for name in (
        "logits", "causal_lm_loss", "causal_lm_loss_sum", "packed_kwargs")},
    **{f"shardyard.training.checkpoint.{name}": "shardyard.training.integrity" for name in (
        "HASHED", "piece_bytes", "writer", "share", "piece_share", "verify", "verify_share")},
    **{f"shardyard.planning.plan.{name}": "shardyard.planning.hardware" for name in (
        "hardware", "named", "this_machine")},  # Hardware and the runtime constants: plan imports them
    **{f"shardyard.planning.plan.{name}": "shardyard.planning.search" for name in (
        "before_launch", "plan_report", "engine_variants", "compose_variant", "alternatives", "staging_refusal",
        "refusal", "deepspeed_estimates")},
    "shardyard.planning.validate.check_safetensors_dir": "shardyard.planning.rules",
    "shardyard.planning.validate.SWEEP_METRICS": "shardyard.planning.rules",
}
"""Old ``module.name`` -> its new module, for the public names that left a module that stayed (``models/build.py``
split in four: ``build``, ``shape``, ``prepare``, ``loss``), exact names: read by :func:`moved_name` (that module's
``__getattr__``), so ``from shardyard.models.build import causal_lm_loss_sum`` and ``shardyard.model.SpeedProbe``
keep working; ``training/checkpoint.py``'s hashing and verification went to ``integrity``,
``planning/validate.py``'s group rules to ``rules``, and ``planning/plan.py``'s hardware and search to ``hardware``
and ``search``."""

NOW_PACKAGES = frozenset({"shardyard.data", "shardyard.inference"})
"""Old modules whose name a package took: resolved by :func:`attribute`, not by the import hook."""

log = logging.getLogger(__name__)
_missing = object()
_said: set[str] = set()


def deprecated(old: str, new: str) -> None:
    """The one deprecation line, once per old path and process."""
    if old not in _said:
        _said.add(old)
        log.warning("shardyard: `%s` is deprecated, it moved to `%s` (the old path still works; "
                    "update the _target_ or import)", old, new)


def new_pair(module: str, name: str) -> tuple[str, str] | None:
    """The (module, name) an old (module, name) pair of a pickle names now, or None (not moved)."""
    new = MOVED.get(module, module)
    if f"{new}.{name}" in NAMES_MOVED:  # a name that left its module since (models/build.py's split)
        return NAMES_MOVED[f"{new}.{name}"], name
    return (new, name) if new != module else None


def attribute(package: str, name: str) -> Any:
    """``package.name`` where ``package`` took the name of an old module (``shardyard.data``): the old module's
    ``name``, from its new module, with the deprecation line; ``AttributeError`` otherwise."""
    import importlib.util

    new = MOVED.get(package)
    if new is None or name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(new), name, _missing)
    if value is _missing:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    deprecated(f"{package}.{name}", f"{new}.{name}")
    return value


def names_moved_from(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a module names moved out of (``__getattr__ = moved.names_moved_from(__name__)``):
    :func:`moved_name` for that module."""
    return lambda attr: moved_name(module, attr)


def moved_name(module: str, attr: str) -> Any:
    """``module.attr`` where ``attr`` left ``module`` for another (:data:`NAMES_MOVED`): the new module's, with the
    deprecation line; ``AttributeError`` otherwise (the ``__getattr__`` of a module names moved out of)."""
    new = NAMES_MOVED.get(f"{module}.{attr}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")
    deprecated(f"{module}.{attr}", f"{new}.{attr}")
    return getattr(importlib.import_module(new), attr)


class _OldPaths:
    """``import shardyard.<old>`` gets the new module (the same object, registered under both names): a meta path
    finder and its loader (no ``importlib.abc`` base: importing it costs more than the hook)."""

    def __init__(self) -> None:
        self._specs: dict[int, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None or fullname in NOW_PACKAGES:
            return None
        loader: Any = self  # an importlib.abc.Loader by its methods
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=fullname.startswith("shardyard.eval_tasks"))

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        deprecated(spec.name, new)
        module = importlib.import_module(new)
        self._specs[id(module)] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the new module the alias's spec: it gets its own back (nothing runs again)
        module.__spec__ = self._specs.pop(id(module))


def install() -> None:
    """Put the old-path hook first on ``sys.meta_path`` (once): it answers only the exact old names."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
