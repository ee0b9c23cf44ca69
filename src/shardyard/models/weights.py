"""Pretrained weights: ``model.weights=DIR`` read into a built model wherever its parameters live (``load_weights``).

The checkpoint is a directory of safetensors files (``model.safetensors``, or shards beside an index), named as
transformers and DeepSeek's own releases name them. Besides plain bf16/fp16/fp32 tensors it reads:

* experts stored one by one (``mlp.experts.{e}.gate_proj.weight`` ...) into transformers' fused expert tensors
  (``_StackedExperts``);
* DeepSeek-V3's FP8 release: ``*.weight`` as float8_e4m3fn with ``*.weight_scale_inv`` (fp32, one per 128 x 128
  block), dequantised as they are read (``_BlockFP8``), slice by slice like any tensor;
* DeepSeek-V3's multi-token prediction module (``model.layers.{num_hidden_layers}.*``, ``shardyard.models.mtp``) with the
  copies of the embedding and head the official files keep beside it (``_MTPLayout``).

This module sits below ``shardyard.models.mtp`` in the layers: it reads a model's MTP depth from the attribute
``mtp.attach`` sets (``shardyard_mtp_depth``), not through ``mtp``.
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
from typing import Any

import torch
from omegaconf import DictConfig

from shardyard.models.adapters import checkpoint_name
from shardyard.core.errors import UserError

FP8_BLOCK = 128
"""The side of the square blocks DeepSeek-V3's FP8 weights are scaled by (its ``quantization_config``'s
``weight_block_size: [128, 128]``)."""


def has_weights(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "*.bin")))


def weights_dir(m: DictConfig) -> str | None:
    """``model.weights``: the HF directory whose safetensors are loaded into the model, or None (fresh init).
    ``auto`` (``model=hf``): ``model.path`` when it holds weights."""
    w = m.get("weights")
    if w == "auto":
        path = m.get("path")
        return os.path.expanduser(path) if isinstance(path, str) and has_weights(os.path.expanduser(path)) else None
    return os.path.expanduser(w) if w else None


def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it (``model.safetensors`` or a sharded index)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UserError("model.weights", path, "No *.safetensors files are there (PyTorch .bin pickles are not read: "
                        "loading them would execute code from the file).",
                        "Convert them once with transformers (from_pretrained, then save_pretrained(safe_serialization"
                        "=True)), or point model.weights at a safetensors export.")
    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            where.update({k: f for k in st.keys()})
    return where


def scale_name(name: str) -> str:
    """The FP8 block scales of a weight, as DeepSeek-V3's release names them (``x.weight`` -> ``x.weight_scale_inv``)."""
    return name + "_scale_inv"


class _BlockFP8:
    """A float8_e4m3fn weight with its per-block fp32 scales (``weight_scale_inv`` [ceil(out/128), ceil(in/128)]),
    read like a safetensors slice: indexing reads only the rows and columns asked for (an FSDP shard's rows) and
    the scales of the blocks they touch, and returns ``fp8.float() * scale`` (fp32; the parameter's dtype comes
    with the copy), as DeepSeek's own ``weight_dequant`` computes it."""

    def __init__(self, weight: Any, scale: Any, name: str, path: str):
        self.weight, self.scale = weight, scale
        self.shape = list(weight.get_shape())
        want = [math.ceil(n / FP8_BLOCK) for n in self.shape]
        if len(self.shape) != 2 or list(scale.get_shape()) != want or not scale.get_dtype().startswith(("F", "BF")):
            raise UserError("model.weights", path, f"Its FP8 tensor {name} {self.shape} has block scales "
                            f"{scale_name(name)} {list(scale.get_shape())} {scale.get_dtype()}, and "
                            f"{FP8_BLOCK} x {FP8_BLOCK} blocks need {want} floats.",
                            "Use DeepSeek-V3's FP8 release as published (weight_block_size [128, 128]), or a "
                            "bf16/fp16/fp32 checkpoint.")

    def get_shape(self) -> list[int]:
        return self.shape

    def get_dtype(self) -> str:
        return "F32"  # what indexing returns

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 2 or any(i is Ellipsis for i in index):
            return self[:, :][index]
        index = index + (slice(None),) * (2 - len(index))
        spans, rest = [], []
        for i, n in zip(index, self.shape):
            if isinstance(i, slice) and i.indices(n)[2] == 1:  # a range of rows or columns: read only it
                start, stop, _ = i.indices(n)
                spans.append((start, max(start, stop)))
                rest.append(slice(None))
            else:  # a step or an integer: the whole dimension, indexed after
                spans.append((0, n))
                rest.append(i)
        (r0, r1), (c0, c1) = spans
        if r0 == r1 or c0 == c1:
            return torch.empty(r1 - r0, c1 - c0)[tuple(rest)]
        b = FP8_BLOCK
        w = self.weight[r0:r1, c0:c1].float()
        s = self.scale[r0 // b:math.ceil(r1 / b), c0 // b:math.ceil(c1 / b)].float()
        s = s.repeat_interleave(b, 0).repeat_interleave(b, 1)
        s = s[r0 - r0 // b * b:, c0 - c0 // b * b:][:r1 - r0, :c1 - c0]
        return (w * s)[tuple(rest)]


class _StackedExperts:
    """A fused expert tensor (transformers 5's ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) read from a checkpoint that stores each expert's projections apart, as ``save_pretrained`` writes
    them (``experts.3.gate_proj.weight`` ...) and DeepSeek's own releases do: it reads like a safetensors slice,
    and indexing reads only the experts it covers (an FSDP shard holds a range of experts). Each expert's
    projection is read through ``reader`` (FP8 ones dequantised with their scales)."""

    PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

    def __init__(self, reader: Any, prefix: str, parts: tuple[str, ...], experts: int):
        self.reader, self.names = reader, [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(experts)]
        first = [reader(n) for n in self.names[0]]
        rows = sum(f.get_shape()[0] for f in first)
        self.shape, self.dtype = [experts, rows, first[0].get_shape()[1]], first[0].get_dtype()

    @classmethod
    def find(cls, key: str, where: dict[str, str], reader: Any) -> _StackedExperts | None:
        m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", key)
        if m is None or f"{m.group(1)}.0.{cls.PARTS[m.group(2)][0]}.weight" not in where:
            return None
        parts = cls.PARTS[m.group(2)]
        experts = 0
        while all(f"{m.group(1)}.{experts}.{p}.weight" in where for p in parts):
            experts += 1
        return cls(reader, m.group(1), parts, experts)

    def get_shape(self) -> list[int]:
        return self.shape

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows, rest = (index[0], index[1:]) if index else (slice(None), ())
        full = torch.stack([torch.cat([self.reader(n)[:] for n in names])
                            for names in self.names[rows]])  # only the experts asked for
        return full[(slice(None), *rest)]


MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""The tensors DeepSeek-V3's official files keep in each MTP layer as copies of the shared embedding and output
head (``model.layers.{L}.embed_tokens.weight``, ``...shared_head.head.weight``); shardyard's MTP shares the main
model's (as the paper does), so they are read only to check that they are copies."""

_MAIN_OF_COPY = {"embed_tokens.weight": ("model.embed_tokens.weight",),
                 "shared_head.head.weight": ("lm_head.weight", "model.embed_tokens.weight")}  # tied: the embedding


class _MTPLayout:
    """What a checkpoint and a model hold of DeepSeek-V3's multi-token prediction: depth k is
    ``model.layers.{L + k - 1}`` (L: ``config.num_hidden_layers``) in both. Only a model of a family with MTP
    (its config has ``num_nextn_predict_layers``, or MTP is attached) looks for it; a layer past L counts as an
    MTP depth the model lacks only with its ``eh_proj`` (otherwise it is an unused tensor like any other: a
    checkpoint of a deeper model)."""

    def __init__(self, model: torch.nn.Module, where: dict[str, str]):
        config = getattr(model, "config", None)
        self.depth = int(getattr(model, "shardyard_mtp_depth", 0))  # mtp.depth(model), from below mtp's layer
        family = self.depth > 0 or hasattr(config, "num_nextn_predict_layers")
        self.first = getattr(config, "num_hidden_layers", None) if family else None
        held: dict[int, list[str]] = {}
        if isinstance(self.first, int):
            for k in where:
                m = re.match(r"model\.layers\.(\d+)\.", k)
                if m and int(m.group(1)) >= self.first:
                    held.setdefault(int(m.group(1)) - self.first + 1, []).append(k)
        self.held = held
        """Depth k -> the checkpoint's tensors of ``model.layers.{L + k - 1}``."""
        self.extra = sorted(k for k in held if k > self.depth and f"{self.layer(k)}.eh_proj.weight" in where)
        """The checkpoint's MTP depths the model does not have."""

    def layer(self, k: int) -> str:
        return f"model.layers.{self.first + k - 1 if self.first is not None else k}"

    def fresh(self, key: str) -> bool:
        """A tensor of a depth the model has and the checkpoint lacks entirely: it keeps its fresh init."""
        return any(k not in self.held and key.startswith(self.layer(k) + ".") for k in range(1, self.depth + 1))

    def accounted(self) -> set[str]:
        """The checkpoint's MTP tensors that are not "unused": the copies of the loaded depths, and every tensor
        of the depths the model does not have (named by ``report`` instead)."""
        names = {n for k in self.extra for n in self.held[k]}
        names.update(f"{self.layer(k)}.{c}" for k in self.held if k <= self.depth for c in MTP_COPIES)
        return names & {n for held in self.held.values() for n in held}

    def report(self, path: str, where: dict[str, str], reader: Any) -> None:
        """Rank 0 says what became of the MTP depths: loaded, fresh, or in the checkpoint and not trained."""
        if int(os.environ.get("RANK", 0)) != 0 or (not self.depth and not self.extra):
            return
        loaded = [k for k in range(1, self.depth + 1) if k in self.held]
        fresh = [k for k in range(1, self.depth + 1) if k not in self.held]
        for k in loaded:
            print(f"shardyard | model.weights: loaded the MTP depth {k} from {self.layer(k)}.*", flush=True)
        if fresh:
            print(f"shardyard | model.weights: {path} has no MTP depth {', '.join(map(str, fresh))} "
                  f"({', '.join(self.layer(k) + '.*' for k in fresh)}): the main model is loaded and "
                  f"{'this depth starts' if len(fresh) == 1 else 'these depths start'} from a fresh init "
                  "(model.mtp.depth=0 trains without it)", flush=True)
        if self.extra:
            print(f"shardyard | warning: model.weights={path} holds a multi-token-prediction module "
                  f"({', '.join(self.layer(k) + '.*' for k in self.extra)}: DeepSeek-V3's MTP depth "
                  f"{', '.join(map(str, self.extra))}), which this model (model.mtp.depth={self.depth}) does not have: "
                  f"model.mtp.depth={max(self.extra)} would train it (left unused)", file=sys.stderr, flush=True)
        differ = [f"{self.layer(k)}.{c} != {main}" for k in loaded for c in MTP_COPIES
                  if f"{self.layer(k)}.{c}" in where
                  for main in [next((n for n in _MAIN_OF_COPY[c] if n in where), None)]
                  if main is not None and not _equal(reader(f"{self.layer(k)}.{c}"), reader(main))]
        if differ:
            print(f"shardyard | warning: model.weights={path}'s MTP copies of the embedding / output head differ from "
                  f"the main model's ({'; '.join(differ)}): shardyard's MTP shares the main model's (as DeepSeek-V3's "
                  "paper does), so the copies are not loaded", file=sys.stderr, flush=True)


def _equal(a: Any, b: Any, rows: int = 4096) -> bool:
    """Two checkpoint tensors equal as far as a warning needs: their shapes, and their first and last ``rows``
    rows (an embedding is GBs: reading it whole twice would keep this rank busy while its peers wait)."""
    if list(a.get_shape()) != list(b.get_shape()):
        return False
    n = a.get_shape()[0] if a.get_shape() else 0
    if not n:
        return bool(torch.equal(a[()], b[()])) if not a.get_shape() else True
    return all(torch.equal(a[i:j], b[i:j]) for i, j in ((0, min(rows, n)), (max(n - rows, 0), n)))


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: str) -> None:
    """Load the pretrained tensors of ``path`` into ``model`` wherever its parameters live, reading from disk
    only what this rank keeps:

    1. A DTensor (FSDP2's shards): only this rank's rows of each tensor (safetensors reads slices lazily), so
       no rank ever materialises the full model.
    2. A ZeRO-3 partitioned parameter: gathered one at a time, filled by rank 0 (the only reader), and
       re-partitioned on leaving ``GatheredParameters``: at most one full tensor exists at a time.
    3. A plain tensor (single, DDP, Horovod, ZeRO-1/2 replicas): the whole tensor.
    Adapters (LoRA) are not in the checkpoint: they are initialised by ``adapters.init``. A checkpoint that
    misses a tensor of the model, or holds one of another shape, is refused naming it. FP8 weights with block
    scales are dequantised as they are read. An MTP depth the checkpoint lacks entirely keeps its fresh init
    (docs/architecture.md, "DeepSeek-V3's official layout"), and one the model lacks is named, not loaded.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    where = _weight_files(path)
    handles: dict[str, Any] = {}
    used: set[str] = set()  # the checkpoint's tensors read (or accounted for)

    def raw(name: str) -> Any:
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt")
        return handles[f].get_slice(name)

    def reader(name: str) -> Any:
        sl = raw(name)
        if sl.get_dtype() == "F8_E4M3" and scale_name(name) in where:  # DeepSeek-V3's FP8 release
            used.add(scale_name(name))
            return _BlockFP8(sl, raw(scale_name(name)), name, path)
        return sl

    layout = _MTPLayout(model, where)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if checkpoint_name(n) in where)
    missing: list[str] = []
    for name, p in tensors.items():
        key = checkpoint_name(name)
        if "lora_" in key or layout.fresh(key):
            continue
        stacked = _StackedExperts.find(key, where, reader) if key not in where else None
        if key not in where and stacked is None:
            missing.append(key)
            continue
        sl: Any
        if stacked is not None:
            used.update(n for names in stacked.names for n in names)
            used.update(scale_name(n) for names in stacked.names for n in names  # every expert's, read here or not
                        if scale_name(n) in where and raw(n).get_dtype() == "F8_E4M3")
            sl = stacked
        else:
            used.add(key)
            sl = reader(key)
        if not sl.get_dtype().startswith(("F", "BF")) or sl.get_dtype().startswith("F8"):
            raise UserError("model.weights", path, f"Its tensor {key} is stored as {sl.get_dtype()}: a quantised "
                            "checkpoint (FP8 or integer blocks with scales), which is not loaded as plain weights.",
                            "Use a bf16/fp16/fp32 checkpoint of the model (dequantise it once with its own tools).")
        shape = list(getattr(p, "ds_shape", p.shape))
        if list(sl.get_shape()) != shape:
            raise UserError("model.weights", path, f"Its tensor {key} has shape {list(sl.get_shape())}, and the model's "
                            f"has {shape}: the checkpoint is of another architecture or size.",
                            "Use the checkpoint's own config (model=hf model.path=DIR), or the matching model option.")
        if isinstance(p, DTensor):  # 1
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local = p.to_local()
            if local.numel():
                index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
                local.copy_(sl[index] if local.dim() else sl[()])
        elif hasattr(p, "ds_id"):  # 2
            import deepspeed
            import torch.distributed as dist

            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if dist.get_rank() == 0:
                    p.data.copy_(sl[:] if p.dim() else sl[()])
        else:  # 3
            p.data.copy_(sl[:] if p.dim() else sl[()])
    used.update(layout.accounted())
    layout.report(path, where, reader)
    unused = sorted(set(where) - used)
    if unused and int(os.environ.get("RANK", 0)) == 0:
        print(f"shardyard | warning: model.weights={path} holds {len(unused)} tensor(s) the model does not have, "
              f"e.g. {unused[:3]} (left unused)", file=sys.stderr, flush=True)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing:
        raise UserError("model.weights", path, f"It lacks {len(missing)} tensor(s) the model has, e.g. {missing[:3]}.",
                        "Point model.weights at a checkpoint of this architecture (its config.json must match).")
