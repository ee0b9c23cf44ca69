"""Load what a run trained into one process, for ``shardyard generate`` and ``shardyard eval`` (issue 45).

``load(PATH)`` takes any of:

1. A run dir (it holds ``config.yaml``): its HF export ``hf/`` when there is one, else its newest checkpoint that
   verifies (``checkpoints/latest`` first, then older ones).
2. A checkpoint dir (``<run>/checkpoints/step-N``, it holds ``meta.json``) of any engine, verified first (every
   file's sha256 against its manifest: a damaged or altered file exits 2 naming the checkpoint) and read into ONE
   model built from the run's ``config.yaml`` exactly as a worker builds it (``model.build_model``, the base
   weights of ``model.weights`` when the base is frozen, the adapters of ``peft``), without a process group:

   - ``dcp`` (single, ddp, fsdp, fsdp_tp, pipeline): ``torch.distributed.checkpoint`` reads every rank's shards
     into the whole tensors (``no_dist``), the metadata through ``safe_load.read_dcp_metadata`` (nothing
     unpickled but data). Parameter names are the whole model's on every engine (a pipeline stage keeps
     ``model.layers.17...``), so the keys match.
   - ``torch-rank0`` (horovod): ``model.safetensors``.
   - ``deepspeed`` (zero1/2/3 and their offload variants): DeepSpeed's ``zero_to_fp32`` merges the ranks' fp32
     partitions, every pickle vetted first (``safe_load.unsafe_global_in``) and read with ``weights_only``
     (``safe_load.weights_only_loads``). ZeRO-Infinity's NVMe checkpoints keep their fp32 masters in swap
     files: refused, with the run's HF export as the way.

   A checkpoint with adapters holds only them (the frozen base is re-read from ``model.weights``); they are
   merged into the base as the HF export merges them (``adapters.merged_state``), so the model is a plain
   transformers model either way.
3. An HF export (``<run>/hf``, ``<run>/checkpoints/step-N/hf`` or any directory with ``config.json`` and
   safetensors): the architecture from its ``config.json`` (``AutoModelForCausalLM.from_config``, as
   ``model=hf`` builds it) and its weights through ``weights.load_weights`` (the loader of ``model.weights``:
   safetensors only, FP8 blocks dequantised). A DeepSeek-V3 export with MTP depths (``num_nextn_predict_layers``,
   ``export.py``) gets them attached and loaded (``mtp.attach``), so that speculative decoding can draft with
   them; transformers' own ``from_pretrained`` would drop them. A plain ``CausalLM`` export (``model.safetensors``
   without ``config.json``) is built from the run's config beside it.

Either way the model's special tokens are its tokenizer's (``model.use_special_tokens``), as a worker's model's
are; an export whose config said others (written before shardyard took them from the tokenizer) is warned of in
one line.

``PATH`` may also be ``latest``: the newest run dir under ``./outputs`` (where ``make train`` writes).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from shardyard.core.errors import UserError

LATEST = "latest"
"""The ``PATH`` that names the newest run dir under ``./outputs``."""


@dataclass
class Trained:
    """A trained model loaded into one process."""

    model: torch.nn.Module
    """In eval mode, on the device and dtype asked for: an HF-style causal LM that ``generation.generate`` drives
    (keyword ``input_ids``, ``attention_mask``, ``position_ids``, a KV cache)."""
    tokenizer: Any
    """The run's HF tokenizer (the export's own, else the one the run trained or was given)."""
    cfg: DictConfig | None
    """The run's resolved config (its ``config.yaml``), or None for an export with no run around it."""
    kind: str
    """``export`` or ``checkpoint``: what was read."""
    path: str
    """The directory read (resolved: a run dir becomes its export or checkpoint)."""
    run_dir: str | None
    """Where results of eval/generate go by default: the run dir, or None for a bare export."""


class Source(NamedTuple):
    """What ``resolve`` made of a ``PATH``: pass it to ``load`` (also in another process: it pickles) to read
    it without resolving, and so without hashing its checkpoint, again."""

    kind: str
    """``export`` or ``checkpoint``."""
    where: str
    """The directory to read."""
    run_dir: str | None
    """The run dir around it, or None."""
    given: str
    """The ``PATH`` as the user gave it (what errors name)."""


def default_dtype(device: str | torch.device) -> torch.dtype:
    """fp32 on CPU, bf16 on a GPU that has it, else fp16."""
    if torch.device(device).type == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16


def load(path: str | Source, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Trained:
    """``path`` (see the module docstring; or what ``resolve`` made of one, its checkpoint verified then and not
    again) loaded on ``device``, in ``dtype`` (default ``default_dtype(device)``). Bad paths raise
    ``UserError("path", path, ...)``."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    kind, where, run_dir, given = path if isinstance(path, Source) else resolve(path)
    path = given
    cfg = _run_config(run_dir, given) if run_dir else None
    if kind == "checkpoint":
        assert cfg is not None  # resolve: a checkpoint inside its run dir
        model = _from_checkpoint(where, cfg, path)
        tokenizer = _load_tokenizer(_checkpoint_tokenizer(where, run_dir, cfg), given)
    else:
        model = _from_export(where, cfg, given)
        tokenizer = _load_tokenizer(where if os.path.isfile(os.path.join(where, "tokenizer.json"))
                                    else _run_tokenizer(run_dir, cfg, path), given)
    _use_tokenizers_ids(model, tokenizer, kind, where)
    model.to(device=device, dtype=dtype)
    model.eval()
    return Trained(model, tokenizer, cfg, kind, where, run_dir)


def model_config(path: str | Source) -> Any:
    """The HF config of what ``load(path)`` would build (for checks made before loading: ``ds_inference.check``),
    from the export's ``config.json`` or the run's model built on the meta device."""
    kind, where, run_dir, given = path if isinstance(path, Source) else resolve(path)
    if kind == "export" and os.path.isfile(os.path.join(where, "config.json")):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(where, local_files_only=True)
        except (OSError, ValueError) as e:  # not JSON (transformers says OSError); an unknown model_type
            raise damaged(given, os.path.join(where, "config.json"), e, _NEWER) from None
    assert run_dir is not None  # a checkpoint, or a plain module's export: inside a run
    from shardyard.models.build import shape_model

    return getattr(shape_model(_run_config(run_dir, given).model), "config", None)


# ------------------------------------------------------------------------------------------- what PATH is
def resolve(path: str) -> Source:
    """What ``path`` names; a run dir becomes its export or newest good checkpoint. A checkpoint is verified
    here (every file's sha256), once: ``load(resolve(path))`` does not hash it again."""
    given = path
    if path == LATEST and not os.path.isdir(path):
        path = _latest_run(given)
        print(f"shardyard | latest: {os.path.abspath(path)} (the run under ./outputs whose config.yaml is newest)",
              file=sys.stderr)
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise UserError("path", given, "There is no such directory.",
                        "Give a run dir (outputs/<date>/<time>), a checkpoint (<run>/checkpoints/step-N), an HF "
                        "export (<run>/hf), or `latest` (the newest run under ./outputs).")
    if _is_run(path):
        export = os.path.join(path, "hf")
        if _is_export(export):
            return Source("export", export, path, given)
        return Source("checkpoint", _newest_good_checkpoint(path, given), path, given)
    if os.path.isfile(os.path.join(path, "meta.json")):
        from shardyard.training.integrity import verify

        run = _run_of_checkpoint(path)
        if run is None:
            raise UserError("path", given, f"The checkpoint {path} has no run config.yaml beside it (looked in "
                            f"{os.path.dirname(os.path.dirname(path))}), and a checkpoint holds weights only: "
                            "the model's architecture comes from the run's config.",
                            "Point it at the checkpoint inside its run dir (<run>/checkpoints/step-N), at the "
                            "run dir, or at the run's HF export (<run>/hf).")
        problem = verify(path)
        if problem is not None:
            raise UserError("path", given, f"The checkpoint {path} cannot be used: {problem}.",
                            "Use another checkpoint of the run (checkpoints/step-N), or its HF export (<run>/hf).")
        return Source("checkpoint", path, run, given)
    if _is_export(path):
        parent = os.path.dirname(path)
        run = (parent if _is_run(parent) else _run_of_checkpoint(parent)
               if os.path.isfile(os.path.join(parent, "meta.json")) else None)
        return Source("export", path, run, given)
    raise UserError("path", given, "It is neither a run dir (no config.yaml), a checkpoint (no meta.json) nor an HF "
                    "export (no config.json or *.safetensors).",
                    "Give a run dir (outputs/<date>/<time>), a checkpoint (<run>/checkpoints/step-N) or an HF "
                    "export (<run>/hf, or any directory save_pretrained wrote with safetensors).")


def _is_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.yaml"))


def _is_export(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "*.safetensors"))) and (
        os.path.isfile(os.path.join(path, "config.json")) or _is_run(os.path.dirname(path)))


def _run_of_checkpoint(ckpt: str) -> str | None:
    """The run dir of a checkpoint in its default place (``<run>/checkpoints/step-N``)."""
    run = os.path.dirname(os.path.dirname(ckpt))
    return run if _is_run(run) else None


def _latest_run(given: str) -> str:
    runs = [os.path.dirname(c) for c in glob.glob(os.path.join("outputs", "*", "*", "config.yaml"))]
    runs = [r for r in runs if _is_export(os.path.join(r, "hf")) or glob.glob(os.path.join(r, "checkpoints", "step-*"))]
    if not runs:
        raise UserError("path", given, f"No run under {os.path.abspath('outputs')} has an HF export or a checkpoint "
                        "to load.", "Train one first (make train, or python train.py), or give a run dir's path.")
    return max(runs, key=lambda r: (os.path.getmtime(os.path.join(r, "config.yaml")), r))


def _run_config(run_dir: str, given: str | None = None) -> DictConfig:
    """The run's ``config.yaml``; one that is not a YAML mapping is a ``UserError`` naming ``given`` (the PATH)
    and the file."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    file = os.path.join(run_dir, "config.yaml")
    try:
        cfg = OmegaConf.load(file)
    except (yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException) as e:
        raise damaged(given or run_dir, file, e) from None
    if not isinstance(cfg, DictConfig):
        raise damaged(given or run_dir, file, ValueError(f"it holds a {type(cfg).__name__}, not a mapping of "
                                                         "config keys"))
    return cfg


def damaged(given: str, file: str, error: BaseException, also: str = "") -> UserError:
    """The ``UserError`` for a file of what PATH names that cannot be read (a damaged or altered export, checkpoint
    or run dir): it names the file and what its reader said; ``also``: a first fix to try."""
    said = " ".join(str(error).split())
    said = said if len(said) <= 300 else said[:300] + "..."
    return UserError("path", given, f"{file} cannot be read ({type(error).__name__}: {said}): it is damaged, "
                     "truncated or was altered" + (", or needs a newer transformers." if also else "."),
                     also + "Restore that file from where the run wrote it (a copy, or export the run again: "
                     "checkpoint.export_hf=true), or load another checkpoint or export of the run.")


def _step_dir(directory: str, step: int) -> str:
    """``step-N`` as the run named it (zero-padded or not)."""
    return next((p for p in glob.glob(os.path.join(directory, "step-*"))
                 if os.path.basename(p)[5:].isdigit() and int(os.path.basename(p)[5:]) == step),
                os.path.join(directory, f"step-{step}"))


def _newest_good_checkpoint(run_dir: str, given: str) -> str:
    """The newest checkpoint of the run that verifies: the one ``checkpoint.resume=auto`` would resume from (the
    complete ``step-N`` dirs newest first, ``rundir.checkpoint_steps``)."""
    from shardyard.training.integrity import verify
    from shardyard.training.rundir import checkpoint_dir, checkpoint_steps

    cfg = _run_config(run_dir, given)
    directory = checkpoint_dir(cfg) if cfg.checkpoint.dir else os.path.join(run_dir, "checkpoints")
    names = [os.path.basename(_step_dir(directory, s)) for s in reversed(checkpoint_steps(directory))]
    if not names:
        raise UserError("path", given, f"The run has no HF export (hf/) and no checkpoint in {directory}.",
                        "Train with checkpoint.save_final=true (the export) or checkpoint.every_n_steps=N, or point "
                        "it at another run.")
    skipped: list[str] = []
    for name in names:
        ckpt = os.path.join(directory, name)
        problem = verify(ckpt)
        if problem is None:
            print(f"shardyard | {run_dir}: {'skipped ' + '; '.join(skipped) + '; ' if skipped else ''}loading "
                  f"{ckpt}", file=sys.stderr)
            return ckpt
        skipped.append(f"{name} ({problem})")
    raise UserError("path", given, f"None of its checkpoints verifies: {'; '.join(skipped)}.",
                    "Point it at another run, or at a checkpoint of another run.")


# ----------------------------------------------------------------------------------------------- exports
def _from_export(path: str, cfg: DictConfig | None, given: str | None = None) -> torch.nn.Module:
    from safetensors import SafetensorError

    from shardyard.models import mtp
    from shardyard.models.weights import load_weights

    given = given or path
    _quiet()
    if os.path.isfile(os.path.join(path, "config.json")):
        from shardyard.models.build import hf

        try:
            model = hf(path)
        except (OSError, ValueError) as e:  # not JSON (transformers says OSError); an unknown model_type
            raise damaged(given, os.path.join(path, "config.json"), e, _NEWER) from None
        depth = int(getattr(model.config, "num_nextn_predict_layers", 0) or 0)
        if depth and type(model).__name__ in mtp.FAMILIES:  # keep DeepSeek-V3's MTP depths (speculative decoding)
            mtp.attach(model, OmegaConf.create({"depth": depth, "weight": 0.0, "final_weight": None,
                                                "final_weight_from_step": None}))
    else:  # a plain nn.Module's export (model.safetensors): its own builder, from the run's config
        assert cfg is not None  # _is_export: a config.json, or a run dir around it
        from shardyard.models.build import build_model

        model = build_model(cfg.model, cfg.seed)
    try:
        load_weights(model, path)
    except UserError as e:
        raise UserError("path", given, e.problem, e.fix) from None
    except (SafetensorError, ValueError) as e:  # a truncated or altered file; a sharded index that is not JSON
        raise damaged(given, _unreadable_weights(path), e) from None
    return model


_NEWER = ("An architecture this transformers does not know (its model_type) may need a newer one (pip install -U "
          "transformers). ")
"""``damaged``'s first fix for a ``config.json`` that does not build."""


def _unreadable_weights(path: str) -> str:
    """The export's safetensors file whose header does not read (else its files, as a glob)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(f, framework="pt"):
                pass
        except (SafetensorError, OSError):
            return f
    return os.path.join(path, "*.safetensors*")


# ------------------------------------------------------------------------------------------- checkpoints
def _from_checkpoint(path: str, cfg: DictConfig, given: str) -> torch.nn.Module:
    from shardyard.models import adapters
    from shardyard.models.build import build_model
    from shardyard.models.weights import load_weights, weights_dir

    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    _quiet()
    model = build_model(cfg.model, cfg.seed)
    peft = cfg.get("peft")
    if peft is not None and adapters.method(peft).quantized_base:
        raise UserError("path", given, "It is a QLoRA checkpoint (a 4-bit base, which bitsandbytes runs on a GPU "
                        "only, and shardyard reads the adapters into one process on any device).",
                        "Load the run's HF export (<run>/hf: the merged model in full precision).")
    model = adapters.apply(model, peft, cfg.seed, torch.float32) if peft is not None else model
    base = weights_dir(cfg.model)
    if adapters.frozen(model):  # the checkpoint holds the adapters only: the base from model.weights
        if base is None or not os.path.isdir(base):
            raise UserError("path", given, f"It holds adapters only, and their base (model.weights={base}) is not "
                            "there.", "Restore the base model's directory, or load the run's HF export.")
        load_weights(model, base)
    from shardyard.backends import engine

    try:  # the engine that wrote it reads it (its format, its pickle vetting)
        got = engine(cfg.backend).read_model_state(path, model, meta)
    except UserError as e:  # training's keys (safe_load names checkpoint.resume): here the input is PATH
        if e.key == "path":
            raise UserError("path", given, e.problem, e.fix) from None
        raise UserError("path", given, f"{e.value}: {e.problem}", "Load only checkpoints you or a trusted run "
                        "wrote. If this one is yours, it was altered or is damaged: load an earlier checkpoint of "
                        "the run (checkpoints/step-N) or its HF export (<run>/hf).") from None
    wanted = adapters.checkpoint_state(model)
    missing = sorted(set(wanted) - set(got))
    if missing:
        raise UserError("path", given, f"It lacks {len(missing)} tensor(s) of the model built from the run's "
                        f"config, e.g. {missing[:3]}.", "Load it with the run's own config.yaml beside it, or load "
                        "the run's HF export.")
    model.load_state_dict(got, strict=False)
    if adapters.is_peft(model):  # merged as the export merges them: a plain transformers model
        merged = adapters.merged_state(model.state_dict(), model)
        peft_model: Any = model
        model = peft_model.unload()  # the base model without the adapter layers
        model.load_state_dict(merged, strict=False)
    return model


# -------------------------------------------------------------------------------------------- tokenizers
def _use_tokenizers_ids(model: torch.nn.Module, tokenizer: Any, kind: str, where: str) -> None:
    """The model's config and generation config say the tokenizer's special tokens, as a worker's model does
    (``model.use_special_tokens``): a checkpoint's model is built from the run's config (its builder's defaults);
    an export written before shardyard took them from the tokenizer says transformers' defaults for its family
    (LLaMA's eos 2, ``"`` in shardyard's BPE tokenizers), which would end every completion there: it loads with
    the tokenizer's ids and a one-line warning."""
    from shardyard.models.build import SpecialTokens, use_special_tokens
    from shardyard.models.shape import is_hf

    if not is_hf(model):
        return
    changed = use_special_tokens(model, SpecialTokens.of(tokenizer))
    if changed and kind == "export":
        print(f"shardyard | warning: {where}'s config.json / generation_config.json name other special tokens than "
              f"its tokenizer ({', '.join(changed)}; an export written before shardyard took them from the "
              "tokenizer): the tokenizer's are used. Export the run again for other readers (transformers, vLLM) to "
              "agree.", file=sys.stderr, flush=True)


def _checkpoint_tokenizer(ckpt: str, run_dir: str | None, cfg: DictConfig) -> str:
    beside = os.path.join(ckpt, "hf")  # checkpoint.export_hf=true
    if os.path.isfile(os.path.join(beside, "tokenizer.json")):
        return beside
    return _run_tokenizer(run_dir, cfg, ckpt)


def _run_tokenizer(run_dir: str | None, cfg: DictConfig | None, given: str) -> str:
    """The run's export's tokenizer, else the one the run was given or trained (found in the data cache, or
    trained again from the same text: the same tokenizer)."""
    if run_dir and os.path.isfile(os.path.join(run_dir, "hf", "tokenizer.json")):
        return os.path.join(run_dir, "hf")
    if cfg is None:
        raise UserError("path", given, "It has no tokenizer (tokenizer.json) and no run config beside it to find "
                        "the run's.", "Copy the tokenizer's files (tokenizer.json, tokenizer_config.json) into it.")
    from shardyard.data.pipeline import open_sources, tokenizer_dir, tokenizer_path

    return tokenizer_path(cfg) or tokenizer_dir(cfg.data, open_sources(cfg.data))


def _load_tokenizer(path: str, given: str | None = None) -> Any:
    from shardyard.data.pipeline import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:  # tokenizer.json / tokenizer_config.json not JSON (JSONDecodeError)
        raise damaged(given or path, _unreadable_json(path, "tokenizer.json"), e) from None


def _unreadable_json(path: str, default: str) -> str:
    """The first of the directory's tokenizer JSON files that is not JSON (else ``default`` in it)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        f = os.path.join(path, name)
        try:
            with open(f, encoding="utf-8") as fh:
                json.load(fh)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return f
    return os.path.join(path, default)


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
