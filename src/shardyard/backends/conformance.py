"""mypy's proof that every engine is a ``Backend``: the Protocol's methods, attributes and signatures, also those
an engine declares with ``forward_to``. Nothing imports this module at run time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardyard.backends import Backend
    from shardyard.backends.ddp import DDPBackend
    from shardyard.backends.deepspeed import DeepSpeedBackend
    from shardyard.backends.fsdp import FSDPBackend
    from shardyard.backends.fsdp_tp import FSDPTPBackend
    from shardyard.backends.horovod import HorovodBackend
    from shardyard.backends.pipeline import PipelineBackend
    from shardyard.backends.single import SingleBackend

    ENGINES: list[type[Backend]] = [SingleBackend, DDPBackend, FSDPBackend, FSDPTPBackend, PipelineBackend,
                                    HorovodBackend, DeepSpeedBackend]
