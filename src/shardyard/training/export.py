"""HF export: safetensors shards + index + config + tokenizer, loadable by ``AutoModelForCausalLM.from_pretrained``
(a model that is not an HF model exports its safetensors and the tokenizer, for its own builder to load). With
adapters (``peft=lora``) the export is the merged model, and the adapter alone goes to ``adapter/`` beside it in
PEFT's format.

Who writes what (docs/architecture.md, "The HF export"):

1. Engines whose parameters are DTensors (fsdp, fsdp_tp, pipeline): the ranks that hold a tensor's shards write
   it, and no rank ever holds the model. Tensors go one module at a time (``_plan``): each is gathered whole by
   the ranks holding its shards (``full_tensor``, a collective they all join, in one order) and kept only by its
   owner, the holder with the fewest bytes so far, which converts it to the HF form and streams it into its own
   shard file at once (``_ShardFile``). A pipeline stage's ranks hold only that stage's tensors, so each stage
   writes its own shards. Rank 0 writes the index, the config and the tokenizer once every shard is written.
2. Engines whose every rank holds the whole model (ddp, zero1, zero2, horovod): the same plan and writing with every rank
   a holder, nothing gathered (each rank writes its share of the tensors it already holds).
3. ZeRO-3 (its offload and Infinity engines too): the same plan and writing with every rank a holder; each
   module's partitions are gathered on every rank (``deepspeed.zero.GatheredParameters``, one collective per
   module, as DeepSpeed's own consolidation gathers them) and kept only by the module's owner.
   Horovod's ranks each hold the whole model too: the same, through Horovod's all-reduce (the writing needs no
   torch.distributed group).
4. The others (single, a 4-bit QLoRA base): rank 0 holds the whole model and writes it with ``save_pretrained``,
   sharded above ``MAX_SHARD_BYTES`` (single has no other rank; QLoRA's merge dequantizes the base whole).

Every way, ``config.json`` and ``generation_config.json`` say the exported tokenizer's special tokens
(``model.use_special_tokens``).

A DeepSeek-V3 model with multi-token prediction (``shardyard.models.mtp``) exports in DeepSeek's official layout: depth k
under ``model.layers.{L + k - 1}.*`` (its parameters' own names), beside copies of the shared embedding and head
that the official files keep there (``mtp_copies``), and ``config.json``'s ``num_nextn_predict_layers``. transformers
loads the main model from it (it runs ``layers[:num_hidden_layers]`` and leaves the rest).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

import torch

from shardyard.models import mtp
from shardyard.backends import Backend
from shardyard.data.pipeline import load_tokenizer
from shardyard.models.build import SpecialTokens, use_special_tokens
from shardyard.models.shape import is_hf

MAX_SHARD_BYTES = 50 * 10**9
"""The largest shard file (a tensor bigger than this gets one of its own): ``save_pretrained``'s default, "50GB"."""

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def save_hf(backend: Backend, tokenizer_dir: str, out_dir: str, written: list[str] | None = None) -> str | None:
    """Collective: every rank calls it; ``out_dir`` appears whole or not at all (written in a temporary
    directory beside it, then renamed by rank 0). Returns ``out_dir`` on rank 0, None elsewhere. ``written``:
    filled with the files (relative to ``out_dir``) this rank wrote, rank 0 every file no other rank wrote: what
    each hashes when the export is part of a checkpoint."""
    from torch.distributed.tensor import DTensor

    model = backend.hf_model()
    state = model.state_dict(keep_vars=True)  # FSDP2's pre-save hook reshards first: every parameter a DTensor
    if any(isinstance(t, DTensor) for t in state.values()):
        return _save_by_holders(backend, model, state, tokenizer_dir, out_dir, written=written)
    if backend.world_size > 1 and (_replica(model) or _partitioned_only(model)):
        # every rank holds the whole model (DDP, ZeRO-1/2, Horovod): each writes its share of it, nothing gathered;
        # or a partition of every parameter (ZeRO-3): each module is gathered on every rank, its owner writes it
        return _save_by_holders(backend, model, state, tokenizer_dir, out_dir, holders=list(range(backend.world_size)),
                                written=written)
    del state
    return _save_on_rank0(backend, tokenizer_dir, out_dir, written=written)


def _replica(model: Any) -> bool:
    """Whether this rank holds every parameter of ``model`` whole, as the export writes it: no parameter
    partitioned (ZeRO-3's hold an empty tensor beside their full shape, ``model.signature``) nor packed in 4 bits
    (QLoRA's base, which the merge dequantizes whole: written by rank 0)."""
    from shardyard.models.shape import signature

    full = signature(model)
    return all(list(p.shape) == full.get(name, list(p.shape)) and getattr(p, "quant_state", None) is None
               for name, p in model.named_parameters())


def _partitioned(t: Any) -> bool:
    """A ZeRO-3 parameter: this rank holds a partition of it (``ds_shape`` is its whole shape)."""
    return hasattr(t, "ds_id") and hasattr(t, "ds_shape")


def _partitioned_only(model: Any) -> bool:
    """ZeRO-3's model: every parameter partitioned or whole, none packed in 4 bits."""
    params = list(model.parameters())
    return any(_partitioned(p) for p in params) and all(getattr(p, "quant_state", None) is None for p in params)


def _shape(t: Any) -> list[int]:
    return list(t.ds_shape) if _partitioned(t) else list(t.shape)


@contextlib.contextmanager
def _gathered(tensors: list[Any]) -> Iterator[None]:
    """ZeRO-3: the partitions of ``tensors`` gathered whole on every rank (a collective every rank joins in the
    same order), partitioned again on leaving; nothing for other tensors."""
    partitioned = [t for t in tensors if _partitioned(t)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def _files_in(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, n), path) for root, _, names in os.walk(path) for n in names)


# ------------------------------------------------------------------------------ rank 0 holds the model
def _save_on_rank0(backend: Backend, tokenizer_dir: str, out_dir: str, written: list[str] | None = None) -> str | None:
    state = backend.full_state_dict()  # ZeRO-3: collective
    if backend.rank != 0:
        return None
    assert state is not None  # rank 0 holds the gathered state
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-hf-")
    _quiet_transformers()
    model: Any = backend.hf_model()
    tokenizer = load_tokenizer(tokenizer_dir)
    from shardyard.models import adapters

    if adapters.is_peft(model):
        tmp_adapter = tempfile.mkdtemp(dir=parent, prefix=".tmp-adapter-")
        adapters.save_adapter(model, state, tmp_adapter)
        tokenizer.save_pretrained(tmp_adapter)
        _publish(tmp_adapter, os.path.join(parent, "adapter"))
        state = adapters.merged_state(state, model)
        model = model.get_base_model()
    if is_hf(model):
        _record_mtp(model)
        use_special_tokens(model, SpecialTokens.of(tokenizer))  # config.json says tokenizer.json's ids
        copies = mtp_copies(model, state)  # cloned: save_pretrained drops a name whose storage another holds
        with _unwrapped_as_is():
            model.save_pretrained(tmp, state_dict={**state, **{k: v.clone() for k, v in copies.items()}},
                                  max_shard_size=MAX_SHARD_BYTES)
    else:  # a plain nn.Module (shardyard.models.build.CausalLM): its weights, for its own builder to load
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    if written is not None:
        written += _files_in(tmp)
    _publish(tmp, out_dir)
    return out_dir


@contextlib.contextmanager
def _unwrapped_as_is() -> Iterator[None]:
    """While the export saves: ``save_pretrained`` looks for the model inside a parallel wrapper with
    transformers' ``unwrap_model``, which calls accelerate's ``extract_model_from_parallel``, which imports
    DeepSpeed whenever it is installed (to know its engine class): about 0.1 GiB more at the end of a DDP run, and
    DeepSpeed's accelerator warning in its output. The model saved here is the bare one (``Backend.hf_model``), so
    transformers' own unwrapping for when accelerate is absent (``.module`` while there is one) stands in."""
    import transformers.modeling_utils as modeling

    plain = modeling.unwrap_model

    def unwrap(model: Any, recursive: bool = False) -> Any:
        while hasattr(model, "module"):
            model = model.module
        return model

    modeling.unwrap_model = unwrap
    try:
        yield
    finally:
        modeling.unwrap_model = plain


# ------------------------------------------------------------------ the holders of the shards write them
@dataclass
class _Piece:
    """The tensors of one module, as this rank names them (``names``), what they become in the export (``out``:
    name -> shape and dtype, after merging adapters and transformers' conversions) and the rank writing them."""

    names: list[str]
    out: dict[str, tuple[list[int], torch.dtype]]
    owner: int
    buffer_elements: int
    """Elements of the piece's buffers (not parameters: the index's ``total_parameters`` leaves them out)."""


def _save_by_holders(backend: Backend, model: Any, state: dict, tokenizer_dir: str, out_dir: str,
                     holders: list[int] | None = None, written: list[str] | None = None) -> str | None:
    """Every rank writes the pieces it owns into its own shard files, in five steps (``holders``: every rank,
    for an engine whose ranks each hold the whole model; else the ranks of the tensors' device meshes;
    ``written``: see ``save_hf``):

    1. The plan, on the meta device (no communication: every holder of a piece computes the same one): the
       pieces, their HF names and shapes, their owners, and this rank's shard files (split above
       ``MAX_SHARD_BYTES``). A replica's tensors are written as they are (nothing to gather).
    2. One all-reduce of every rank's file count numbers the files (``model-00003-of-00008.safetensors``); rank 0
       has created the temporary directory before it. Both of this function's all-reduces are the engine's own
       (``Backend.all_reduce_mean``, ``_sum_over_ranks``), so Horovod's ranks, which have no torch.distributed
       group, take part as every other engine's do.
    3. Piece by piece, every holder gathers each tensor whole (ZeRO-3: the piece's partitions at once); the owner
       keeps a copy, converts the piece and streams it to its file; the others free it at once. Peak memory on any
       rank: one piece beside one gathered tensor (ZeRO-3: one module gathered, as DeepSpeed's consolidation).
       A rank that fails to write keeps joining the gathers, so the others never wait on it forever.
    4. Each rank leaves what it wrote (names -> files, sizes, its error) in ``.written-rank<r>.json`` in the
       directory (every writer sees it: a shared file system, as the shards need); one all-reduce says which
       ranks failed; rank 0 reads the files, removes them and writes the index, the config and the tokenizer
       (and the adapter's own export with ``peft``); then renames the directory into place.
    5. A rank that failed raises; rank 0 raises if any did (its directory is left unpublished).
    """
    from shardyard.models import adapters

    rank, world = backend.rank, backend.world_size
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(out_dir))}")
    made: str | None = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an export that crashed
        try:
            os.makedirs(tmp)
        except OSError as e:  # every rank still joins every collective below; each write then fails and says so
            made = f"{type(e).__name__}: {e}"
    base = model.get_base_model() if adapters.is_peft(model) else model
    pieces = _plan(model, base, state, holders)  # 1
    mine = [(n, shape, dtype) for p in pieces if p.owner == rank for n, (shape, dtype) in p.out.items()]
    files = _split(mine)
    counts = _sum_over_ranks(backend, rank, len(files))  # 2
    first, total = sum(counts[:rank]), sum(counts)
    file_of = {name: "model.safetensors" if total == 1 else f"model-{first + i + 1:05d}-of-{total:05d}.safetensors"
               for i, entries in enumerate(files) for name, _, _ in entries}
    writer = _ShardWriter(tmp, [(file_of[n], n, shape, dtype) for n, shape, dtype in mine])
    writer.error = made
    adapter: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for piece in pieces:  # 3
            kept = {}
            with _gathered([state[name] for name in piece.names]):
                for name in piece.names:
                    full = _whole(state[name])
                    if _partitioned(state[name]) and (piece.owner == rank or rank == 0 and ".lora_" in name):
                        full = full.detach().clone()  # the gathered storage is DeepSpeed's, freed on leaving
                    if piece.owner == rank:
                        kept[name] = full.detach().cpu()
                    if rank == 0 and ".lora_" in name:
                        adapter[name] = full.detach().cpu()
                    del full
            if piece.owner == rank:
                try:  # a failure here is kept like a failed write: this rank goes on joining the gathers
                    out = _to_hf(model, base, kept)
                    for name in piece.out:
                        writer.write(name, out.pop(name))
                except Exception as e:
                    writer.error = writer.error or f"{type(e).__name__}: {e}"
                del kept
    writer.close()
    info = {"weight_map": writer.written, "size": writer.size, "error": writer.error,
            "params": sum(_numel(s) for p in pieces if p.owner == rank for s, _ in p.out.values())
            - sum(p.buffer_elements for p in pieces if p.owner == rank)}
    try:  # 4
        with open(os.path.join(tmp, f".written-rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(info, f)
    except OSError as e:
        writer.error = writer.error or f"{type(e).__name__}: {e}"
    failed = [r for r, n in enumerate(_sum_over_ranks(backend, rank, int(writer.error is not None))) if n]
    if rank != 0:
        if writer.error:  # 5
            raise RuntimeError(f"rank {rank} could not write its shards of the HF export in {tmp}: {writer.error}")
        if written is not None:
            written += sorted(set(writer.written.values()))
        return None
    if failed:
        raise RuntimeError(f"the HF export in {tmp} is incomplete: {_errors(tmp, failed)}")
    infos = []
    for r in range(world):
        with open(os.path.join(tmp, f".written-rank{r}.json"), encoding="utf-8") as f:
            infos.append(json.load(f))
        os.remove(os.path.join(tmp, f".written-rank{r}.json"))
    _quiet_transformers()
    if total > 1:
        index = {"metadata": {"total_parameters": sum(i["params"] for i in infos),
                              "total_size": sum(i["size"] for i in infos)},
                 "weight_map": {k: v for i in infos for k, v in i["weight_map"].items()}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as save_pretrained writes it
    tokenizer = load_tokenizer(tokenizer_dir)
    if is_hf(base):
        _save_config(base, tmp, SpecialTokens.of(tokenizer))
    tokenizer.save_pretrained(tmp)
    if written is not None:
        others = {f for i in infos[1:] for f in i["weight_map"].values()}
        written += [f for f in _files_in(tmp) if f not in others]
    if adapter:
        tmp_adapter = tempfile.mkdtemp(dir=parent, prefix=".tmp-adapter-")
        adapters.save_adapter(model, adapter, tmp_adapter)
        tokenizer.save_pretrained(tmp_adapter)
        _publish(tmp_adapter, os.path.join(parent, "adapter"))
    _publish(tmp, out_dir)
    return out_dir


def _sum_over_ranks(backend: Backend, rank: int, value: int) -> list[int]:
    """Every rank's ``value`` (a small count), known to every rank, in rank order: one all-reduce of a
    world-long vector through the engine's own ``all_reduce_mean`` (times the world: exact in float64)."""
    t = torch.zeros(backend.world_size, dtype=torch.float64, device=backend.device)
    t[rank] = value
    return [round(float(v) * backend.world_size) for v in backend.all_reduce_mean(t).cpu()]


def _errors(tmp: str, ranks: list[int]) -> dict[int, str]:
    """What each failed rank said of its write (its ``.written-rank<r>.json``), or that it left nothing."""
    out = {}
    for r in ranks:
        try:
            with open(os.path.join(tmp, f".written-rank{r}.json"), encoding="utf-8") as f:
                out[r] = json.load(f)["error"]
        except (OSError, ValueError, KeyError):
            out[r] = "it left no record of its write (its own error is in its output)"
    return out


def _plan(model: Any, base: Any, state: dict, holders: list[int] | None = None) -> list[_Piece]:
    """The pieces of this rank's ``state``, in its order, each with its owner:

    1. A piece is one module's tensors (with ``peft``, an adapted layer's base weight and its adapters together:
       the merge needs the three). Transformers' conversions back to the checkpoint layout (fused experts split
       per expert) act within one module, which is checked here: the pieces converted one by one must give what
       the whole state converted at once gives.
    2. A tensor shared by two names (tied embeddings) is written once, under its first name (the embedding:
       ``save_pretrained`` drops the tied head).
    3. The holders are the ranks of the tensors' device meshes (every rank for fsdp and fsdp_tp; a pipeline
       stage's data-parallel ranks), or ``holders`` (every rank of a replica engine, or of ZeRO-3): they hold the same names in
       the same order, so each computes the same owners: in turn, the holder with the fewest bytes so far.
    """
    from torch.distributed.tensor import DTensor

    from shardyard.models.adapters import checkpoint_name

    first: dict[int, str] = {}
    for name, t in state.items():  # 2
        first.setdefault(id(t), name)
    groups: dict[str, list[str]] = {}
    for name, t in state.items():
        if first[id(t)] == name:
            groups.setdefault(_module_of(name), []).append(name)  # 1
    meshes = {id(t.device_mesh): t.device_mesh for t in state.values() if isinstance(t, DTensor)}
    if holders is None:
        holders = sorted({int(r) for m in meshes.values() for r in m.mesh.flatten().tolist()})  # 3
    buffers = {checkpoint_name(n) for n, _ in model.named_buffers()}
    load = dict.fromkeys(holders, 0)
    pieces, whole = [], {}
    for names in groups.values():
        meta = {n: torch.empty(_shape(state[n]), dtype=state[n].dtype, device="meta") for n in names}
        whole.update(meta)
        out = {k: (list(v.shape), v.dtype) for k, v in _to_hf(model, base, meta).items()}
        owner = min(holders, key=lambda r: (load[r], r))
        load[owner] += sum(_numel(s) * dtype.itemsize for s, dtype in out.values())
        pieces.append(_Piece(names, out, owner, sum(state[n].numel() for n in names if checkpoint_name(n) in buffers)))
    together = {k: (list(v.shape), v.dtype) for k, v in _to_hf(model, base, whole).items()}
    apart = {k: v for p in pieces for k, v in p.out.items()}
    if together != apart:  # 1
        differ = sorted(set(together) ^ set(apart))[:4]
        raise RuntimeError("The HF export converts this model's tensors module by module, and transformers' "
                           f"conversion of {type(base).__name__} spans modules: {differ}")
    return pieces


def _module_of(name: str) -> str:
    """The module a tensor belongs to, an adapted layer's adapters (``q_proj.lora_A.default.weight``) and base
    (``q_proj.base_layer.weight``) counted in the adapted layer (``q_proj``)."""
    import re

    adapted = re.match(r"(.*?)\.(base_layer|lora_[A-Za-z_]+)\.", name)
    return adapted.group(1) if adapted else name.rpartition(".")[0]


def _to_hf(model: Any, base: Any, piece: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A piece as ``save_pretrained`` would write it: adapters merged (``peft``), the keys the model never saves
    dropped, and transformers' own conversions reverted (e.g. fused experts split per expert). The same on meta
    tensors (the plan) and real ones (the write)."""
    from shardyard.models import adapters

    if adapters.is_peft(model):
        piece = adapters.merged_state(piece, model)
    for key in getattr(base, "_keys_to_ignore_on_save", None) or []:
        piece.pop(key, None)
    if not is_hf(base):
        return piece
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(base, piece)
    out.update(mtp_copies(base, out))
    return out


def mtp_copies(base: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The copies of the shared embedding and output head that DeepSeek-V3's official checkpoints keep in each
    MTP layer (``model.layers.{L + k - 1}.embed_tokens.weight``, ``...shared_head.head.weight``; vLLM's and
    SGLang's MTP loaders read the head there), made from the tensors of ``state`` (HF names) that are their
    sources: a piece holding the embedding gets the embedding's copies, one holding the head the head's (with
    tied embeddings the embedding is the head: ``save_pretrained`` writes only it). The same tensors, not
    copies of the bytes; empty without MTP."""
    d = mtp.depth(base)
    if not d:
        return {}
    first = base.config.num_hidden_layers
    emb = state.get("model.embed_tokens.weight")
    head = state.get("lm_head.weight")
    if head is None and getattr(base.config, "tie_word_embeddings", False):
        head = emb
    out = {}
    for k in range(1, d + 1):
        layer = f"model.layers.{first + k - 1}"
        if emb is not None:
            out[f"{layer}.embed_tokens.weight"] = emb
        if head is not None:
            out[f"{layer}.shared_head.head.weight"] = head
    return out


def _record_mtp(model: Any) -> None:
    """``config.json``'s ``num_nextn_predict_layers``: the MTP depths the export holds (DeepSeek-V3's config says
    1 by default, also for a model trained without them)."""
    if hasattr(model.config, "num_nextn_predict_layers") or mtp.depth(model):
        model.config.num_nextn_predict_layers = mtp.depth(model)


def _whole(t: Any) -> torch.Tensor:
    """A DTensor gathered whole (a collective every rank of its mesh joins; a shard kept on the host under CPU
    offload goes to the mesh's device first, as NCCL needs); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split(tensors: list[tuple[str, list[int], torch.dtype]]) -> list[list[tuple[str, list[int], torch.dtype]]]:
    """This rank's tensors in shard files, as ``save_pretrained`` splits them (huggingface_hub's
    ``split_state_dict_into_shards_factory``): in order, a new file when the next tensor would take the current
    one over ``MAX_SHARD_BYTES``; a tensor bigger than that in a file of its own, the current one going on after."""
    files: list[list] = []
    current: list = []
    size = 0
    for entry in tensors:
        nbytes = _numel(entry[1]) * entry[2].itemsize
        if nbytes > MAX_SHARD_BYTES:
            files.append([entry])
            continue
        if current and size + nbytes > MAX_SHARD_BYTES:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return files + ([current] if current else [])


class _ShardWriter:
    """This rank's shard files, written as the tensors arrive (``order``: file, name, shape and dtype of each, in
    the order they come): a file's safetensors header (8 bytes of length, then JSON: dtype, shape and byte range of
    each of its tensors) when its first tensor comes, then each tensor's bytes, so a file never needs its tensors
    in memory together; closed after its last. A failed write is kept in ``error`` and the rest skipped (the
    caller goes on joining the gathers)."""

    def __init__(self, directory: str, order: list[tuple[str, str, list[int], torch.dtype]]):
        self.dir, self._order = directory, order
        self.written: dict[str, str] = {}
        self.size = 0
        self.error: str | None = None
        self._last = {fname: i for i, (fname, _, _, _) in enumerate(order)}
        self._next = 0
        self._open: dict[str, BinaryIO] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        i = self._next
        fname, want, shape, dtype = self._order[i]
        self._next += 1
        if self.error:
            return
        try:
            if (name, list(tensor.shape), tensor.dtype) != (want, shape, dtype):
                raise RuntimeError(f"{name} {list(tensor.shape)} {tensor.dtype} came where the plan has {want} "
                                   f"{shape} {dtype}")
            f = self._open.get(fname) or self._start(fname)
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(data.data)
            self.written[name] = fname
            self.size += data.nbytes
            if self._last[fname] == i:
                self._open.pop(fname).close()
        except Exception as e:  # disk full, a permission, a plan mismatch: reported once every rank is done
            self.error = f"{type(e).__name__}: {e}"
            self.close()

    def _start(self, fname: str) -> BinaryIO:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for _, name, shape, dtype in (e for e in self._order if e[0] == fname):
            end = offset + _numel(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        f = self._open[fname] = open(os.path.join(self.dir, fname), "wb")
        f.write(len(raw).to_bytes(8, "little") + raw)
        return f

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _save_config(model: Any, out: str, tokens: SpecialTokens) -> None:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them: the parameters' dtype
    and the architecture (an FSDP2 model's class name without its ``FSDP`` prefix) recorded first, and the special
    tokens of the exported tokenizer (``tokens``)."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    _record_mtp(model)
    use_special_tokens(model, tokens)
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _publish(tmp: str, out_dir: str) -> None:
    if os.path.exists(out_dir):  # replace an older export only once the new one is complete
        old = out_dir + ".old"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
