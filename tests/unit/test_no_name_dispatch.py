"""Nothing outside the engines decides on a config ``name`` (issue 31): the peft method is its ``_target_``, a
check run keeps the monitors whose class says ``in_check_runs``, and ``+scale=smoke`` is ``scale._target_``."""

import pytest

from shardyard.models import adapters
from shardyard.planning import scale
from shardyard.testing import compose


@pytest.mark.parametrize("option, frozen, quantized", [("none", False, False), ("lora", True, False),
                                                        ("qlora", True, True)])
def test_each_peft_option_is_a_method_with_its_facts(option, frozen, quantized):
    method = adapters.method(compose([f"peft={option}"]).peft)
    assert (method.freezes_base, method.quantized_base) == (frozen, quantized)


def test_smoke_keeps_only_quiet_monitors_and_runs_qlora_fp16_as_lora_bf16():
    cfg = compose(["peft=qlora", "precision=fp16", "monitor=[console,csv,tensorboard]", "+scale=smoke"])
    assert scale.apply(cfg).startswith("+scale=smoke: the recipe")
    assert list(cfg.monitor) == ["console"] and cfg.precision.name == "bf16"
    assert cfg.peft.name == "lora" and not adapters.method(cfg.peft).quantized_base
    assert scale.apply(compose(["peft=qlora"])) is None  # no scale: the recipe as written


def test_fast_dev_run_drops_every_monitor_but_the_console():
    from shardyard.planning.validate import apply_fast_dev_run

    cfg = compose(["debug.fast_dev_run=true", "monitor=[console,csv,tensorboard]"])
    apply_fast_dev_run(cfg)
    assert list(cfg.monitor) == ["console"]
