"""DCP ``.metadata`` of an FSDP checkpoint at any world size, built by hand without the ranks: what
``dcp.save`` of ``{"model": ..., "optim": ...}`` (``get_state_dict`` of a ``fully_shard`` model and AdamW)
writes (at 2 ranks its pickle holds the opcodes of a real gloo save's, count for count). Every parameter and
each of its two Adam moments is split along dim 0 into one chunk per rank (``__{rank}_0.distcp``); each
``step`` is a replicated scalar written once; the param group's values are bytes. Each rank's write results
reach the coordinator unpickled (a gather), so each rank's keys name their tensor with a string of their own:
pickle's memo shares none of them."""

from __future__ import annotations

import pickle
from pathlib import Path

from shardyard.core.safe_load import _gc_paused


def llama_params(layers: int = 32, hidden: int = 4096, ffn: int = 11008, vocab: int = 32000) -> dict[str, tuple]:
    """A Llama-7B's parameter shapes (291 tensors at the default sizes)."""
    shapes: dict[str, tuple] = {"tok_embeddings.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (hidden, hidden), p + "attention.wk.weight": (hidden, hidden),
                       p + "attention.wv.weight": (hidden, hidden), p + "attention.wo.weight": (hidden, hidden),
                       p + "feed_forward.w1.weight": (ffn, hidden), p + "feed_forward.w3.weight": (ffn, hidden),
                       p + "feed_forward.w2.weight": (hidden, ffn), p + "attention_norm.weight": (hidden,),
                       p + "ffn_norm.weight": (hidden,)})
    shapes.update({"norm.weight": (hidden,), "output.weight": (vocab, hidden)})
    return shapes


def fsdp_metadata(world: int, params: dict[str, tuple] | None = None, checkpoint_id: str = "/ckpt/step-00001000"):
    """The ``Metadata`` object ``dcp.save`` writes for ``world`` FSDP ranks (its shapes as DCP builds them)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    params = llama_params() if params is None else params
    sdm: dict = {}
    planner: dict = {}
    storage: dict = {}
    at = [0] * world  # the next byte offset in each rank's file
    files = [f"__{r}_0.distcp" for r in range(world)]

    def own(name: str) -> str:  # an equal string that is not the same object (as a gathered one is)
        return name.encode().decode()

    def add(fqn: str, path: tuple, shape: tuple, ranks: int) -> None:
        size, rows = torch.Size(shape), -(-shape[0] // ranks) if shape else 0
        chunks = []
        for r in range(ranks):  # FSDP's Shard(0): rank r holds rows [r*rows, (r+1)*rows)
            start = min(r * rows, shape[0]) if shape else 0
            offsets = torch.Size((start, *[0] * (len(shape) - 1))) if shape else torch.Size([])
            sizes = torch.Size((min(rows, shape[0] - start), *shape[1:])) if shape else torch.Size([])
            chunks.append(ChunkStorageMetadata(offsets, sizes))
            length = 1500 + 4 * sizes.numel()  # torch.save's framing + the fp32 bytes
            storage[MetadataIndex(own(fqn), offsets, r)] = _StorageInfo(files[r], at[r], length)
            at[r] += length
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, chunks)
        planner[own(fqn)] = path

    for name, shape in params.items():
        add(f"model.{name}", ("model", name), shape, world)
    for name, shape in params.items():  # AdamW: step (replicated, rank 0 writes it), exp_avg, exp_avg_sq
        add(f"optim.state.{name}.step", ("optim", "state", name, "step"), (), 1)
        for moment in ("exp_avg", "exp_avg_sq"):
            add(f"optim.state.{name}.{moment}", ("optim", "state", name, moment), shape, world)
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                "differentiable", "fused", "decoupled_weight_decay", "params"):
        fqn = f"optim.param_groups.0.{key}"
        sdm[fqn], planner[own(fqn)] = BytesStorageMetadata(), ("optim", "param_groups", 0, key)
        storage[MetadataIndex(fqn)] = _StorageInfo(files[0], at[0], 1261)
        at[0] += 1261
    return Metadata(sdm, planner_data=planner, storage_data=storage, version="1.0.0",
                    storage_meta=StorageMeta(checkpoint_id=Path(checkpoint_id), save_id="0" * 36))


def write_fsdp_metadata(directory: Path, world: int, params: dict[str, tuple] | None = None) -> Path:
    """``directory/.metadata`` as DCP's ``FileSystemWriter`` writes it (``pickle.dump``, default protocol)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".metadata", "wb") as f, _gc_paused():  # millions of objects, all alive
        pickle.dump(fsdp_metadata(world, params, str(directory)), f)
    return directory / ".metadata"
