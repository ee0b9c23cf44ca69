"""Keys nobody would read: every key of the composed config is a schema field, or a parameter of the callable its
option's ``_target_`` names (``check_keys``), and every ``_target_`` imports. Every failure is a ``UserError``
naming the key (exit code 2)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from shardyard.core.errors import UserError


GROUP_SCHEMAS = {"model": "ModelConfig", "data": "DataConfig"}
"""Groups whose options mix shardyard's own keys (these schemas) with their ``_target_``'s arguments."""


def check_keys(cfg: DictConfig) -> None:
    """Refuse keys that no schema or plug-in reads (``+some.key=value``, a misspelt plug-in argument), and
    ``_target_`` values that cannot be imported or called with the keys given. A user's plug-in option
    without a schema gets shardyard's own keys of its group filled in with their defaults."""
    _complete_plugin_options(cfg)
    _unknown_in_schemas(cfg, "")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(missing[0], "???", "This option needs a value, and none is given.",
                        f"Set it on the command line ({missing[0]}=...) or in the recipe.")
    for group in ("model", "data", "optim", "sched", "backend"):
        _check_target(f"{group}", cfg[group])
    for name, node in (cfg.monitor or {}).items():
        _check_target(f"monitor.{name}", node)


def _schema_fields(node: DictConfig) -> set[str] | None:
    typ = OmegaConf.get_type(node)
    return {f.name for f in dataclasses.fields(typ)} if typ is not None and dataclasses.is_dataclass(typ) else None


def _unknown_in_schemas(node: DictConfig, prefix: str) -> None:
    fields = _schema_fields(node)
    open_plugin = OmegaConf.is_struct(node) is False  # schema_*_plugin: its extra keys go to its _target_
    for key in node:
        full = f"{prefix}{key!s}"
        if fields is not None and key not in fields and not open_plugin:
            raise UserError(full, node[key], "No schema or plug-in reads this key, so it would be ignored.",
                            f"Remove it, or spell one of: {', '.join(sorted(fields))}. "
                            "`python train.py --cfg job` prints every key.")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _unknown_in_schemas(child, full + ".")


def _complete_plugin_options(cfg: DictConfig) -> None:
    from shardyard.config import schema

    for group, schema_name in GROUP_SCHEMAS.items():
        node: DictConfig = cfg[group]
        if _schema_fields(node) is not None:
            continue
        base = getattr(schema, schema_name)
        fields = {f.name for f in dataclasses.fields(base)}
        own = {k: node[k] for k in node if k in fields}
        try:
            typed: Any = OmegaConf.merge(OmegaConf.structured(base), own)
        except Exception as e:  # omegaconf.ValidationError: a wrong type for one of our keys
            raise UserError(group, own, f"One of shardyard's own {group} keys has a wrong value: {e}",
                            f"See {schema_name} in src/shardyard/config/schema.py.") from None
        with open_dict(cfg):
            for f in dataclasses.fields(base):
                if f.name not in node and not OmegaConf.is_missing(typed, f.name):
                    node[f.name] = typed[f.name]
            if "name" in fields and "name" not in node:
                node["name"] = str(node.get("_target_", group)).rsplit(".", 1)[-1]


def _check_target(key: str, node: DictConfig) -> None:
    """``node._target_`` imports, and accepts the node's keys (less shardyard's own) as arguments."""
    from hydra.utils import get_object

    from shardyard.config import schema

    target = node.get("_target_")
    if not target:
        raise UserError(f"{key}._target_", target, "Every pluggable option names what builds it.",
                        f"Set {key}._target_ to an importable callable (e.g. mypkg.module.function).")
    try:
        obj = get_object(target)
    except Exception as e:
        raise UserError(f"{key}._target_", target, f"It cannot be imported ({type(e).__name__}: {e}).",
                        "Check the spelling, and that its package is installed or on PYTHONPATH.") from None
    group = key.split(".")[0]
    if group == "backend":
        return  # engines take the whole run config
    own = {f.name for f in dataclasses.fields(getattr(schema, GROUP_SCHEMAS[group]))} if group in GROUP_SCHEMAS else {"_target_"}
    given = [str(k) for k in node if k not in own]
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: let the call itself judge
        return
    if group == "optim":  # shardyard passes the parameter groups first
        params = params[1:]
    if group == "monitor":  # ... and a monitor's run dir and run config
        params = [p for p in params if p.name not in ("run_dir", "config")]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for k in given:
        if k not in names:
            raise UserError(f"{key}.{k}", node[k], f"No schema or plug-in reads this key: {target} takes "
                            f"({', '.join(sorted(names))}).", "Remove it, or spell one of those.")
    for p in params:
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) \
                and p.name not in given:
            raise UserError(f"{key}.{p.name}", None, f"{target} needs this argument, and the config does not give it.",
                            f"Add it to the option's YAML or the command line: +{key}.{p.name}=...")
