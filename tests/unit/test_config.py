"""Every option of every group composes and validates; schema and validation errors name the key."""

import pytest
from hydra.errors import ConfigCompositionException

from shardyard.planning.validate import plan, validate
from shardyard.core.errors import UserError
from shardyard.testing import CONF_DIR, compose
from pathlib import Path

GROUPS = ["backend", "model", "data", "optim", "sched", "precision", "checkpoint", "recipe"]


def options(group):
    return sorted(p.stem for p in Path(CONF_DIR, group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option, tmp_path):
    extra = []
    if group == "data" and option == "text_files":
        (tmp_path / "a.txt").write_text("hello world\n" * 100)
        extra = [f"data.paths=[{tmp_path}/a.txt]"]
    if group == "data" and option == "mixture":
        (tmp_path / "a.txt").write_text("hello world\n" * 100)
        extra = [f"data.sources=[{{name: a, paths: [{tmp_path}/a.txt], weight: 2}}, "
                 "{name: b, _target_: shardyard.data.sources.StdlibCode, exclude_dirs: [test], weight: 1}]"]
    pairs = {"preference": ["objective=dpo"], "prompts": ["objective=grpo"], "dpo": ["data=preference"],
             "grpo": ["data=prompts"]}
    if group in ("data", "objective") and option in pairs:  # an objective and the rows it trains on go together
        extra = pairs[option]
    if option == "zero_infinity":  # needs the user's NVMe directory
        extra = [f"backend.nvme_path={tmp_path}"]
    if option in ("fsdp_tp", "pipeline"):  # a model split 2 ways needs 2 ranks (4 layers: 2 per pipeline stage)
        extra = ["launch.nproc_per_node=2", "train.micro_batch_size=2"]
    if option == "hf":  # needs a local HF model directory
        from transformers import LlamaConfig

        LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4).save_pretrained(tmp_path)
        extra = [f"model.path={tmp_path}"]
    cfg = compose([f"{group}={option}", *extra])
    try:
        p = validate(cfg, None)
    except UserError as e:  # what this machine cannot run, refused for that reason and no other:
        if option == "zero_infinity":  # it lacks libaio for async I/O
            assert "libaio" in e.paragraph(), e.paragraph()
        elif e.key == "model.weights":  # a fine-tuning recipe's pretrained 7B checkpoint is not on this box
            assert not Path(cfg.model.weights).exists(), e.paragraph()
        elif e.key in ("backend.stages", "backend.tp", "backend.ep"):  # a multi-node recipe's split needs its nodes' ranks
            from shardyard.launching import recipes

            nodes = {r.name: r.nodes for r in recipes.catalogue()}
            assert group == "recipe" and nodes[option] > 1 and "world size" in e.paragraph(), e.paragraph()
        else:  # QLoRA's 4-bit kernels are CUDA-only (this tier sees no GPU: test_the_cpu_tiers_see_no_gpu)
            assert cfg.peft.name == "qlora" and "CUDA" in e.paragraph(), e.paragraph()
        return
    tr = cfg.train  # the plan keeps what the recipe fixed, and the batch adds up (literal cases: test_batch_plan)
    assert p.micro_batch_size == tr.micro_batch_size
    assert tr.global_batch_size in (None, p.global_batch_size) and tr.grad_accum_steps in (None, p.grad_accum_steps)
    assert p.global_batch_size == p.micro_batch_size * p.grad_accum_steps * p.dp_size


@pytest.mark.parametrize("overrides,want", [
    # (world, data-parallel size, micro batch, accumulation, global batch), worked out by hand
    (["backend=ddp", "launch.nproc_per_node=2", "train.micro_batch_size=8"], (2, 2, 8, 1, 16)),
    (["backend=pipeline", "launch.nproc_per_node=2", "train.micro_batch_size=2"], (2, 1, 2, 1, 2)),  # 2 stages
    (["backend=pipeline", "backend.stages=2", "launch.nproc_per_node=4", "train.micro_batch_size=2",
      "train.global_batch_size=16"], (4, 2, 2, 4, 16)),  # 16 / (2 x dp 2)
    (["backend=fsdp_tp", "backend.tp=2", "launch.nproc_per_node=4", "train.micro_batch_size=4",
      "train.grad_accum_steps=3"], (4, 2, 4, 3, 24)),  # 4 x 3 x dp 2
])
def test_batch_plan(overrides, want):
    p = plan(compose(overrides), None)
    assert (p.world_size, p.dp_size, p.micro_batch_size, p.grad_accum_steps, p.global_batch_size) == want


@pytest.mark.parametrize("monitors", ["[console]", "[tensorboard]", "[console,tensorboard]", "[]",
                                      "[console,tensorboard,wandb,mlflow,csv]"])
def test_monitor_list_group(monitors):
    cfg = compose([f"monitor={monitors}"])
    assert sorted(cfg.monitor) == sorted(m for m in monitors.strip("[]").split(",") if m)


def test_misspelt_key_names_the_key():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["backend.bucket_cap_m=10"])
    assert "bucket_cap_m" in f"{e.value} {e.value.__cause__}"


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["train.steps=many"])
    assert "train.steps" in str(e.value.__cause__)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(Exception) as e:
        compose(["backend=ddpp"])
    assert "Available options" in str(e.value) and "single" in str(e.value) and "zero3" in str(e.value)


def test_batch_arithmetic_names_the_numbers():
    cfg = compose(["train.global_batch_size=20", "train.micro_batch_size=8"])
    with pytest.raises(UserError) as e:
        plan(cfg, None)
    assert e.value.key == "train.global_batch_size" and "20" in e.value.paragraph() and "8" in e.value.paragraph()


def test_global_batch_derives_accumulation():
    from shardyard.core.dist_env import DistEnv

    cfg = compose(["train.global_batch_size=64", "train.micro_batch_size=8"])
    p = plan(cfg, DistEnv("elastic", 0, 0, 4, 4))
    assert (p.world_size, p.grad_accum_steps, p.tokens_per_step) == (4, 2, 64 * cfg.data.seq_len)


def test_contradicting_accumulation_is_refused():
    cfg = compose(["train.global_batch_size=64", "train.micro_batch_size=8", "train.grad_accum_steps=3"])
    with pytest.raises(UserError) as e:
        plan(cfg, None)
    assert e.value.key == "train.grad_accum_steps"


def test_the_cpu_tiers_see_no_gpu():
    """Every tier but tests/gpu runs on CPU on every machine: tests/conftest.py hides a GPU machine's GPUs from
    the session and all it starts, so the refusals below that only a machine without GPUs makes (marked) hold
    there too; tests/gpu/test_gpu.py::test_what_a_machine_without_gpus_refuses_validates_here checks that a GPU
    machine accepts them."""
    import os

    import torch

    from shardyard.planning.validate import device_type

    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and torch.cuda.device_count() == 0
    assert device_type(compose([])) == "cpu"


@pytest.mark.parametrize("overrides,key", [
    (["launch.nproc_per_node=zero"], "launch.nproc_per_node"),
    (["backend.device=cuda"], "backend.device"),  # without GPUs
    (["data=text_files", "data.paths=[/nonexistent/corpus.txt]"], "data.paths"),
    (["data.tokenizer.path=/nonexistent/tok"], "data.tokenizer.path"),
    (["model=hf", "model.path=/nonexistent/model"], "model.path"),
    (["model.attn_implementation=flash_attention_2"], "model.attn_implementation"),  # without GPUs (or flash-attn)
    (["backend=single", "launch.nproc_per_node=2"], "backend"),
    (["data.seq_len=100000"], "data.seq_len"),
    (["backend.dist_backend=nccl"], "backend.dist_backend"),  # without GPUs
    (["profile.enabled=true", "profile.steps=[5,2]"], "profile.steps"),
    (["profile.enabled=true", "profile.steps=[1,9999]"], "profile.steps"),
    (["debug.max_skipped=0"], "debug.max_skipped"),
    (["metrics.peak_tflops=-1"], "metrics.peak_tflops"),
    (["backend=zero1", "backend.offload_param=cpu"], "backend.offload_param"),
    (["backend=zero_infinity"], "backend.nvme_path"),
    (["backend=fsdp", "precision=fp16"], "precision"),  # without GPUs
    (["backend=ddp", "+backend.cpu_offload=true"], "backend.cpu_offload"),  # an offload knob DDP does not have
])
def test_user_errors_name_the_key(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == key
    text = e.value.paragraph()
    assert "Fix:" in text and "\n\n" not in text


def test_recipe_sets_its_keys():
    cfg = compose(["recipe=deepseek_tiny_ddp2"])
    assert cfg.launch.nproc_per_node == 2 and cfg.train.global_batch_size == 16


def test_every_recipe_file_starts_with_its_command():
    for f in Path(CONF_DIR).rglob("*.yaml"):
        head = f.read_text().splitlines()[:3]
        assert any(line.startswith("# python train.py") or line.startswith("# Shared") for line in head), f


def test_a_missing_monitor_package_is_named_before_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = compose(["monitor=[console,mlflow]"])
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == "monitor" and e.value.value == "mlflow"
    assert "setup EXTRAS=monitors`" in e.value.paragraph()  # make setup EXTRAS=monitors (shardyard.config.preflight)


def test_fast_dev_run_shortens_the_run_and_saves_nothing():
    from shardyard.planning.validate import apply_fast_dev_run

    cfg = compose(["debug.fast_dev_run=true", "checkpoint.every_n_steps=10", "checkpoint.export_hf=true"])
    apply_fast_dev_run(cfg)
    assert cfg.train.steps == 2 and cfg.train.eval_every_n_steps == 0 and cfg.train.sample_tokens == 0
    assert cfg.checkpoint.every_n_steps == 0 and not cfg.checkpoint.save_final and not cfg.checkpoint.export_hf
    assert list(cfg.monitor) == ["console"] and cfg.train.eval_batches == 1


def test_plugins_import_nothing_heavy_until_built():
    import subprocess
    import sys

    code = ("import sys; import shardyard.monitors, shardyard.planning.validate; "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'matplotlib', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_deepspeed_loads_without_mlflow_and_mlflow_still_loads_after_it():
    """DeepSpeed 0.19's autotuner imports mlflow at DeepSpeed's import (3 s of every ZeRO rank's start here) when
    it is installed (`make test` installs it): kept out for that one importer (core.lazy_imports); a monitor or a
    user importing mlflow afterwards gets the real module."""
    import subprocess
    import sys

    code = ("import sys, shardyard, deepspeed; print('mlflow' in sys.modules, "
            "deepspeed.autotuning.autotuner.has_mlflow); import mlflow; print(mlflow.MlflowClient.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-2:] == ["False False", "MlflowClient"], out  # (DeepSpeed prints its accelerator first)
