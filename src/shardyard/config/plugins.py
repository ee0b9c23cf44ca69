"""The one way anything pluggable is built: ``_target_`` imported with Hydra's ``get_object`` and called with
the option's own keys (less the keys shardyard reads itself) plus what shardyard supplies.

Model builders, data sources, optimizers, schedules and monitors all go through ``build``; engines are
``Backend(cfg, plan)`` classes named the same way. Validation (``planning.keys.check_keys``) checks the
same keys against the same signatures before launch.
"""

from __future__ import annotations

from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf


def arguments(node: DictConfig, own: Iterable[str] = ()) -> dict:
    """The option's keys as plain Python values, without ``_target_`` and ``own`` (shardyard's keys)."""
    values = OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, DictConfig) else dict(node)
    assert isinstance(values, dict)
    skip = {"_target_", *own}
    return {k: v for k, v in values.items() if k not in skip}


def build(node: DictConfig, *args: Any, own: Iterable[str] = (), **supplied: Any) -> Any:
    """``node._target_(*args, **supplied, **arguments(node, own))``."""
    from hydra.utils import get_object

    return get_object(node._target_)(*args, **supplied, **arguments(node, own))
