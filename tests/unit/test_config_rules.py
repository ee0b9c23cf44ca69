"""The config tree's own rules: one source of truth per default, variants hold only their differences, closed
choices are Enums, every key is read by a schema or a plug-in, every schema field is documented."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from shardyard.config import schema
from shardyard.planning.validate import validate
from shardyard.core.errors import UserError
from shardyard.testing import CONF_DIR, compose

ROOT = Path(CONF_DIR).parent


def _raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _inherited(path: Path) -> dict:
    """What an option file inherits through its defaults list: schema defaults, then parent option files."""
    merged = OmegaConf.create({})
    for entry in _raw(path).get("defaults", []):
        if entry == "_self_" or not isinstance(entry, str):
            continue
        name = entry.split("@")[0].lstrip("/")
        if name in schema.SCHEMAS:
            merged = OmegaConf.merge(merged, OmegaConf.structured(schema.SCHEMAS[name]))
        else:  # a sibling option of the same group
            parent = path.parent / f"{name}.yaml"
            merged = OmegaConf.merge(merged, _inherited(parent), _body(parent))
    return OmegaConf.to_container(merged, resolve=False, enum_to_str=True)


def _body(path: Path) -> dict:
    return {k: v for k, v in _raw(path).items() if k != "defaults"}


def _restated(body: dict, inherited: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in body.items():
        if key not in inherited:
            continue
        if isinstance(value, dict) and isinstance(inherited[key], dict):
            out += _restated(value, inherited[key], f"{prefix}{key}.")
        elif value == inherited[key] or (isinstance(value, float) and isinstance(inherited[key], (int, float))
                                         and value == float(inherited[key])):
            out.append(f"{prefix}{key}={value!r}")
    return out


OPTION_FILES = sorted(p for p in Path(CONF_DIR).glob("*/*.yaml"))


@pytest.mark.parametrize("path", OPTION_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_option_restates_a_value_it_inherits(path):
    assert not _restated(_body(path), _inherited(path)), f"{path} restates inherited values"


def test_the_restated_value_check_can_fail(tmp_path):
    (tmp_path / "fsdp.yaml").write_text((Path(CONF_DIR) / "backend" / "fsdp.yaml").read_text())
    child = tmp_path / "child.yaml"
    child.write_text("defaults:\n  - fsdp\n  - _self_\nname: child\nreshard_after_forward: true\ndevice: auto\n")
    assert sorted(_restated(_body(child), _inherited(child))) == ["device='auto'", "reshard_after_forward=True"]


def test_zero_infinity_comments_quote_the_schema_defaults():
    """zero_infinity.yaml lists the drive's knobs as comments, `key (default)`: those defaults are the schema's."""
    text = (Path(CONF_DIR) / "backend" / "zero_infinity.yaml").read_text()
    quoted = dict(re.findall(r"(aio_\w+|nvme_\w+) \(([^)]+)\)", text))
    defaults = schema.ZeroBackendConfig()
    assert len(quoted) == 8, quoted
    for key, value in quoted.items():
        parsed = yaml.safe_load(value)
        parsed = float(parsed) if isinstance(parsed, str) else parsed  # YAML 1.1 reads "1e8" as a string
        assert parsed == getattr(defaults, key), (key, value, getattr(defaults, key))


def test_the_primary_config_only_chooses_options():
    """train.yaml holds no value of its own that a schema defines: the schema is the one source."""
    body = _body(Path(CONF_DIR) / "train.yaml")
    assert set(body) <= {"run_dir", "hydra"}, sorted(body)


def test_every_schema_field_has_a_docstring():
    tree = ast.parse(Path(schema.__file__).read_text())
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                    missing.append(f"{cls.name}.{stmt.target.id}")
    assert not missing, missing


@pytest.mark.parametrize("override,allowed", [
    ("precision.name=fp4", "fp32, bf16, fp16, fp8"),
    ("debug.nan_policy=ignore", "stop, skip, off"),
    ("model.attn_implementation=flash", "sdpa, eager, flash_attention_2"),
    ("model.init_device=gpu", "auto, cpu, meta"),
    ("backend=zero3 backend.offload_param=gpu", "none, cpu, nvme"),
    ("monitor.console.style=fancy", "auto, rich, plain"),
])
def test_closed_choices_fail_at_composition_naming_the_allowed_ones(override, allowed):
    with pytest.raises(ConfigCompositionException) as e:
        compose(override.split())
    text = f"{e.value} {e.value.__cause__}"
    assert allowed in text and override.split()[-1].split("=")[0] in text, text


def test_precision_cannot_contradict_itself():
    """The compute dtype follows from precision.name; there is no second key to disagree with it."""
    with pytest.raises(ConfigCompositionException):
        compose(["precision=bf16", "precision.compute_dtype=float16"])


@pytest.mark.parametrize("overrides,key", [
    (["+some.key=value"], "some"),
    (["+train.stepz=3"], "train.stepz"),
    (["+model.hiden_size=3"], "model.hiden_size"),
    (["+optim.momentum=0.9"], "optim.momentum"),  # AdamW takes no momentum
    (["+monitor.console.colour=red"], "monitor.console.colour"),
    (["optim._target_=torch.optim.SGD"], "optim.betas"),  # adamw's keys handed to SGD
    (["model._target_=shardyard.models.build.no_such_builder"], "model._target_"),
    (["data._target_=nowhere.Corpus"], "data._target_"),
])
def test_keys_no_schema_or_plugin_reads_are_refused(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == key, e.value.paragraph()


@pytest.mark.parametrize("overrides,key", [
    (["model.num_heads=7"], "model.num_heads"),
    (["model.num_kv_heads=3"], "model.num_kv_heads"),
    (["model=deepseek_moe_tiny", "model.num_experts_per_tok=9"], "model.num_experts_per_tok"),
    (["checkpoint.every_n_steps=-1"], "checkpoint.every_n_steps"),
    (["checkpoint.keep_last=-2"], "checkpoint.keep_last"),
    (["checkpoint.overwrite_run_dir=true", "checkpoint.resume=auto"], "checkpoint.overwrite_run_dir"),
    (["train.eval_every_n_steps=-5"], "train.eval_every_n_steps"),
    (["train.max_grad_norm=-1"], "train.max_grad_norm"),
    (["model=hf"], "model.path"),  # a required value left as ???
    # the speed options (issue 34): their values, and each engine's refusal of what it cannot take
    (["model.activation_checkpointing=some"], "model.activation_checkpointing"),
    (["model.activation_checkpointing_every=0"], "model.activation_checkpointing_every"),
    (["model.loss_chunk=-1"], "model.loss_chunk"),
    (["backend=zero3", "model.compile=true"], "model.compile"),
    (["backend=zero3", "model.activation_checkpointing=selective"], "model.activation_checkpointing"),
    (["model=deepseek_moe_tiny", "backend=fsdp", "backend.ep=2", "launch.nproc_per_node=2",
      "model.activation_checkpointing=selective"], "model.activation_checkpointing"),  # the experts' FSDP unit
    (["backend=zero2", "precision=fp8"], "precision"),
    (["backend=pipeline", "launch.nproc_per_node=2", "model.loss_chunk=256"], "model.loss_chunk"),
    (["backend=fsdp_tp", "launch.nproc_per_node=2", "precision=fp8"], "precision"),
    (["precision=fp8", "peft=lora"], "precision"),
    # tiled MLPs (issue 56, point 5): a negative count, what they do not combine with, the engines without them
    (["model.mlp_tiles=-1"], "model.mlp_tiles"),
    (["model.mlp_tiles=4", "model.activation_checkpointing=selective"], "model.mlp_tiles"),
    (["model.mlp_tiles=4", "model.compile=true"], "model.mlp_tiles"),
    (["model.mlp_tiles=4", "peft=lora"], "model.mlp_tiles"),
    (["backend=fsdp_tp", "launch.nproc_per_node=2", "model.mlp_tiles=4"], "model.mlp_tiles"),
    (["backend=pipeline", "launch.nproc_per_node=2", "model.mlp_tiles=4"], "model.mlp_tiles"),
    (["model.norm_tiles=-1"], "model.norm_tiles"),
    (["model.norm_tiles=4", "model.activation_checkpointing=selective"], "model.norm_tiles"),
    (["model.norm_tiles=4", "model.compile=true"], "model.norm_tiles"),
    (["backend=fsdp_tp", "launch.nproc_per_node=2", "model.norm_tiles=4"], "model.norm_tiles"),
    (["model.activation_offload=true"], "model.activation_offload"),  # no checkpointing: nothing kept to offload
    (["backend=ddp", "launch.nproc_per_node=2", "backend.sp=2", "objective=dpo", "data=preference",
      "objective.precompute_ref_logps=true"], "objective.precompute_ref_logps"),  # whole rows on every rank
    (["backend=fsdp_tp", "backend.tp=2", "launch.nproc_per_node=4", "backend.cp=2", "objective=dpo",
      "data=preference"], "backend.cp"),  # not tried beside tensor parallel
    (["model.activation_offload=true", "model.activation_checkpointing=selective"], "model.activation_offload"),
    (["model.activation_offload=true", "model.activation_checkpointing=full", "model.activation_checkpointing_every=2"],
     "model.activation_offload"),
    (["backend=pipeline", "launch.nproc_per_node=2", "model.activation_offload=true",
      "model.activation_checkpointing=full"], "model.activation_offload"),
    # HSDP (issue 57): copies that do not divide the world or the data-parallel ranks tp / stages leave, none, and
    # expert parallelism over more than one copy's shards
    (["backend=fsdp", "backend.replicate=3", "launch.nproc_per_node=4"], "backend.replicate"),
    (["backend=fsdp", "backend.replicate=0"], "backend.replicate"),
    (["backend=fsdp_tp", "launch.nproc_per_node=4", "backend.tp=2", "backend.replicate=4"], "backend.replicate"),
    (["backend=pipeline", "launch.nproc_per_node=4", "backend.stages=2", "backend.replicate=4"], "backend.replicate"),
    (["model=deepseek_moe_tiny", "backend=fsdp", "backend.ep=4", "backend.replicate=2", "launch.nproc_per_node=4"],
     "backend.ep"),
    # Ulysses sequence parallelism (issue 56): an engine that does not split sequences, heads or a sequence length
    # it does not divide, a world it does not divide, and what it does not combine with yet
    (["backend=pipeline", "launch.nproc_per_node=2", "backend.sp=2"], "backend.sp"),  # cp only on the pipeline
    (["backend=ddp", "launch.nproc_per_node=3", "backend.sp=3", "data.seq_len=63"], "backend.sp"),  # 4 heads
    (["backend=ddp", "launch.nproc_per_node=2", "backend.sp=2", "data.seq_len=63"], "backend.sp"),
    (["backend=ddp", "launch.nproc_per_node=3", "backend.sp=2"], "backend.sp"),
    (["backend=ddp", "launch.nproc_per_node=2", "backend.sp=0"], "backend.sp"),
    # (an objective other than lm that does not cut its own rows: DPO and GRPO do, objectives.splits_sequences)
    (["backend=ddp", "launch.nproc_per_node=2", "backend.sp=2", "objective.name=mine"], "backend.sp"),
    # ... and all-gather context parallelism: both at once, an engine without it, 2 x cp not dividing the sequence
    (["backend=ddp", "launch.nproc_per_node=4", "backend.sp=2", "backend.cp=2"], "backend.cp"),
    (["backend=fsdp_tp", "launch.nproc_per_node=4", "backend.sp=2"], "backend.sp"),  # cp only beside tp
    (["backend=fsdp_tp", "launch.nproc_per_node=4", "backend.cp=2", "data.seq_len=66"], "backend.cp"),
    (["backend=ddp", "launch.nproc_per_node=2", "backend.cp=2", "data.seq_len=66"], "backend.cp"),
    # the pipeline's context parallelism and documents: not with MTP depths, whose targets its last stage rolls
    (["backend=pipeline", "launch.nproc_per_node=4", "backend.cp=2", "model=deepseek_moe_tiny", "model.mtp.depth=1"],
     "backend.cp"),
    (["backend=pipeline", "launch.nproc_per_node=2", "data.document_mask=true", "model=deepseek_moe_tiny",
      "model.mtp.depth=1"], "data.document_mask"),
    (["backend=pipeline", "launch.nproc_per_node=4", "backend.cp=2", "data.seq_len=66"], "backend.cp"),
])
def test_bad_values_name_the_key(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == key, e.value.paragraph()


def test_the_pipeline_and_tensor_parallel_take_context_parallelism():
    """``backend.cp`` is a mesh dimension of the pipeline (each stage's cp ranks among its data-parallel ones), whose
    packed documents reach every stage, and of fsdp_tp (beside tp); tests/dist/test_sequence_parallel.py trains
    them."""
    for overrides in (["backend.cp=2"], ["backend.cp=2", "data.document_mask=true"], ["data.document_mask=true"]):
        plan = validate(compose(["backend=pipeline", "launch.nproc_per_node=4", *overrides]), None)
        assert plan.dims.pp == 2 and plan.dims.cp * plan.dims.dp == 2, (overrides, plan.dims)
    plan = validate(compose(["backend=fsdp_tp", "backend.tp=2", "launch.nproc_per_node=4", "backend.cp=2"]), None)
    assert plan.dims.describe() == "world 4 = cp 2 x tp 2", plan.dims.describe()  # and so is tensor parallel's


@pytest.mark.parametrize("overrides", [
    ["backend=ddp", "backend.sp=2", "objective=dpo", "data=preference"],
    ["backend=zero2", "backend.cp=2", "objective=dpo", "data=preference"],
    ["backend=fsdp", "backend.sp=2", "objective=grpo", "data=prompts"],
])
def test_dpo_and_grpo_split_their_sequences(overrides):
    """DPO's pairs and GRPO's rollouts are split as the LM's rows (issue 56 point 4): validated, not refused."""
    validate(compose([*overrides, "launch.nproc_per_node=2"]), None)


def test_a_new_optimizer_is_one_yaml_file():
    """Adafactor is conf/optim/adafactor.yaml and nothing else; it builds and steps."""
    import torch

    from shardyard.backends.optim import build_optimizer

    cfg = compose(["optim=adafactor"])
    validate(cfg, None)
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, cfg.optim)
    assert isinstance(opt, torch.optim.Adafactor) and opt.param_groups[0]["weight_decay"] == cfg.optim.weight_decay
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def test_deepspeed_expresses_torch_optimizers_and_refuses_a_factory_under_offload():
    from shardyard.backends.deepspeed import ds_config

    plan = validate(compose(["backend=zero2", "optim=adafactor"]), None)
    section = ds_config(compose(["backend=zero2", "optim=adafactor"]), plan)["optimizer"]
    assert section == {"type": "Adafactor", "params": {"lr": 1e-2, "weight_decay": 0.0, "beta2_decay": -0.8, "d": 1.0}}
    adamw = ds_config(compose(["backend=zero2"]), plan)["optimizer"]
    assert adamw == {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}}
    factory = [f"optim=sgd", f"optim._target_={__name__}.sgd_factory"]  # a factory, not a torch.optim class
    validate(compose(["backend=zero2", *factory]), None)  # handed to DeepSpeed as a client optimizer
    with pytest.raises(UserError) as e:
        validate(compose(["backend=zero2_offload", *factory]), None)
    assert e.value.key == "optim._target_" and "ZeRO-Offload" in e.value.paragraph()


def sgd_factory(params, lr, weight_decay, momentum, nesterov):
    import torch

    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)


def test_plugin_bases_are_open_only_for_the_target_arguments():
    fields = {f.name for f in dataclasses.fields(schema.DataConfig)}
    assert {"seq_len", "tokenizer", "val_fraction", "cache_dir", "_target_"} <= fields


def _bad_values(r) -> list:
    """Values just outside a schema.Range: below (or at) its low end, above its high end, off its step, inf."""
    bad = [r.low if r.above else r.low - 1, float("inf")]
    if r.high is not None:
        bad.append(r.high + 1)
    if r.multiple_of is not None:
        bad.append(r.low + 1.5 * r.multiple_of)
    return bad


RANGE_OPTIONS = {schema.DDPBackendConfig: ("backend", "backend=ddp"), schema.ZeroBackendConfig: ("backend", "backend=zero3"),
                 schema.PrecisionConfig: ("precision", None), schema.BalanceConfig: ("model.balance", "model=deepseek_moe_tiny"),
                 schema.BackendConfig: ("backend", "backend=fsdp"), schema.FSDPBackendConfig: ("backend", "backend=fsdp"),
                 schema.RopeScalingConfig: ("model.rope_scaling", "model=deepseek_moe_tiny")}


@pytest.fixture(scope="module")
def composed():
    """One composed config per option holding ranged keys (composing costs ~1 s; setting a key does not)."""
    return {option: compose([option] if option else []) for _, option in RANGE_OPTIONS.values()}


def test_an_engine_key_out_of_range_exits_2_naming_it():
    """The issue's case: DeepSpeed's pydantic error at engine start became a refusal at validation."""
    with pytest.raises(UserError) as e:
        validate(compose(["backend=zero3", "backend.reduce_bucket_size=-1"]), None)
    assert e.value.key == "backend.reduce_bucket_size" and "zero_optimization.reduce_bucket_size" in e.value.paragraph()


@pytest.mark.parametrize("cls,key,value", [(cls, key, v) for cls, table in schema.RANGES.items()
                                           for key, r in table.items() for v in _bad_values(r)],
                         ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_every_engine_range_is_refused_at_validation_naming_the_key(composed, cls, key, value):
    group, option = RANGE_OPTIONS[cls]
    cfg = composed[option].copy()
    field_type = {f.name: f.type for f in dataclasses.fields(cls)}[key]
    node = OmegaConf.select(cfg, group)
    if field_type == "int" and not float(value).is_integer():
        with pytest.raises(Exception):  # an int key refuses a fraction or inf already when it is set (composition)
            node[key] = value
        return
    node[key] = value
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    assert e.value.key == f"{group}.{key}", e.value.paragraph()
    assert schema.RANGES[cls][key].becomes.split(" ")[0] in e.value.paragraph()


def test_the_ranges_cover_every_numeric_engine_key_and_the_deepspeed_json_uses_them():
    """A numeric ZeRO or precision key added without a range fails here; each range names a key the generated
    DeepSpeed JSON really has, holding that value (``becomes``), and the defaults pass."""
    from shardyard.backends.deepspeed import ds_config

    for cls in (schema.BackendConfig, schema.ZeroBackendConfig, schema.PrecisionConfig, schema.DDPBackendConfig):
        inherited = {k for base in cls.__mro__[1:] for k in schema.RANGES.get(base, {})}  # checked with the base
        numeric = {f.name for f in dataclasses.fields(cls) if f.type in ("int", "float") and f.name != "stage"}
        assert numeric - inherited == set(schema.RANGES[cls]), (cls.__name__, numeric ^ set(schema.RANGES[cls]))
    cfg = compose(["backend=zero_infinity", "backend.nvme_path=/tmp", "backend.flops_profiler=true",
                   "precision=fp16"])
    validate_ranges = __import__("shardyard.planning.validate", fromlist=["check_ranges"]).check_ranges
    validate_ranges(cfg)  # the defaults are in range
    from shardyard.core.facts import ParallelDims

    plan = type("P", (), {"global_batch_size": 8, "micro_batch_size": 8, "grad_accum_steps": 1,
                          "dims": ParallelDims(1)})
    ds = ds_config(cfg, plan)
    for cls, group in ((schema.ZeroBackendConfig, "backend"), (schema.PrecisionConfig, "precision")):
        for key, r in schema.RANGES[cls].items():
            path = r.becomes.split(" ")[0].split(".")
            node = ds
            for part in path:
                node = node[part]
            assert node == cfg[group][key] - (1 if key == "flops_profiler_step" else 0), (key, node)
