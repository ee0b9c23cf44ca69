"""Preparing a built model for training: the options that change how it computes, applied by every engine
before it wraps or shards the model (``prepare_model``: float8 linears, activation checkpointing, regional compile,
the chunked loss head), and ``SpeedProbe``, what they did at one step (``summary.json``'s ``speed_options``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from shardyard.config import checkpointing_mode
from shardyard.core.errors import UserError
from shardyard.models.build import _FAKE_STORAGE, materialize
from shardyard.models.shape import _bare, block_norms, dense_mlp, is_hf, transformer_blocks


def _saved_ops() -> set:
    """What a ``selective`` block keeps for backward: the outputs of its matmuls and of attention (the costly
    ops); every other op (norms, activations, rotary, elementwise products) is recomputed from them."""
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention"]
    ops = (getattr(torch.ops.aten, name, None) for name in names)  # some exist only in newer torch builds
    return {op.default for op in ops if op is not None}


def _selective_context() -> Any:
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def apply_activation_checkpointing(model: Any, m: DictConfig) -> None:
    """``model.activation_checkpointing`` on every ``model.activation_checkpointing_every``-th block.

    1. Non-reentrant checkpointing: it composes with DDP/FSDP hooks, torch.compile and keyword arguments.
    2. ``selective`` passes torch's selective policy (``_selective_context``) as the checkpoint's
       ``context_fn``: the same wrapper, only what it keeps differs.
    3. HF models checkpoint through their own layers' switch (``gradient_checkpointing``, set per layer), which
       keeps FSDP's hooks outside the recomputed forward and the parameter names unchanged; others are wrapped
       with torch's ``checkpoint_wrapper`` (its state dict drops the wrapper's prefix)."""
    mode = checkpointing_mode(m)
    if mode == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}  # 1
    if mode == "selective":
        kwargs["context_fn"] = _selective_context()  # 2
    every = int(m.get("activation_checkpointing_every", 1))
    blocks = transformer_blocks(model)
    chosen = {id(b) for i, b in enumerate(blocks) if i % every == 0}
    if is_hf(model) and getattr(model, "supports_gradient_checkpointing", False):  # 3
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for block in blocks:
            if hasattr(block, "gradient_checkpointing"):
                setattr(block, "gradient_checkpointing", id(block) in chosen)
        return
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing as wrap,
                                                                             checkpoint_wrapper)

    wrap(model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, **kwargs), check_fn=lambda mod: id(mod) in chosen)


_OFFLOAD: dict[str, Any] = {"host": None}  # the dry run's stand-in for host RAM ("meta": ``offload_to``)


_HOST_POOL: dict[tuple, list[torch.Tensor]] = {}
"""Page-locked host buffers of offloaded block inputs, by (shape, dtype), free for the next block (``_park``)."""


def _page_locked(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of exactly ``shape`` page-locked with ``cudaHostRegister``: torch's pinned allocator rounds
    each allocation up to a power of two (4.5 GiB would take 8) and keeps it cached."""
    t = torch.empty(shape, dtype=dtype)
    cudart, ptr = torch.cuda.cudart(), t.data_ptr()
    err = cudart.cudaHostRegister(ptr, t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed ({err}): the host's "
                           "locked-memory limit (ulimit -l) may be below what model.activation_offload parks")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


def _park(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden``'s copy in host RAM (``apply_activation_offload``). From a GPU: into a page-locked buffer of
    ``_HOST_POOL``, on the compute stream (no host sync), which returns to the pool when the copy is dropped (after
    the block's backward): the next copy into it is on the same stream, after the recompute's copy out of it. On
    CPU: a copy in the same RAM. In the dry run (``offload_to``): a tensor of the stand-in device, each time."""
    host = _OFFLOAD["host"]
    if host is not None:
        return torch.empty(hidden.shape, dtype=hidden.dtype, device=host)
    if not hidden.is_cuda:
        return hidden.detach().clone()
    free = _HOST_POOL.setdefault((tuple(hidden.shape), hidden.dtype), [])
    buffer = free.pop() if free else _page_locked(tuple(hidden.shape), hidden.dtype)
    parked = buffer.view(buffer.shape)  # the pool gets the buffer back when this view is collected
    weakref.finalize(parked, free.append, buffer)
    parked.copy_(hidden.detach(), non_blocking=True)
    return parked


def _offloaded_checkpoint(function: Any, hidden: torch.Tensor, *args: Any, checkpoint: Any) -> Any:
    """``checkpoint`` (the block's own non-reentrant one) of ``function`` whose saved input is ``hidden``'s copy
    in host RAM:

    1. The checkpoint holds what its recompute will read: the host copy (``_park``), and an empty tensor on the
       input's device, so that the checkpoint saves and restores that device's random state for the recompute
       (dropout draws the same masks; it looks for device tensors among the arguments).
    2. The forward runs on ``hidden`` itself, handed over once (the box is emptied, so nothing here keeps it): the
       autograd graph is the forward's, so the input's gradient stays on the device.
    3. The recompute (in backward) copies the input back to the device and marks it as the forward's was, so the
       recomputed ops save what the forward's did.
    Per block and micro-batch: one copy out and one back."""
    device, needs_grad = hidden.device, hidden.requires_grad
    box = [hidden]

    def again(parked: torch.Tensor, anchor: torch.Tensor, *rest: Any) -> Any:
        if box:  # 2
            return function(box.pop(), *rest)
        return function(parked.to(device, non_blocking=True).requires_grad_(needs_grad), *rest)  # 3

    parked = _park(hidden)
    if torch._C._current_graph_task_id() == -1:  # a training forward (not a recompute inside one)
        _PROBED["offloaded_bytes"] += parked.numel() * parked.element_size()
    return checkpoint(again, parked, torch.empty(0, device=device), *args)  # 1


def apply_activation_offload(model: Any, m: DictConfig) -> None:
    """``model.activation_offload``: what ``full`` activation checkpointing keeps of each checkpointed block (its
    input, the residual stream) lives in host RAM until the block's backward (ALST's offload of the checkpointed
    hidden states), so the device holds no block's input between its forward and its backward.

    1. Each checkpointed HF block's checkpoint function (``_gradient_checkpointing_func``, which transformers
       calls with the block's forward and its hidden states first) is wrapped by ``_offloaded_checkpoint``.
    2. Per block and micro-batch 2 copies of its input's bytes cross the host link: out after the forward, back
       for the recompute; the step-time model counts them. On CPU the copy stays in the same RAM (the path is the
       same, nothing is saved).
    3. Validation asks for ``full`` checkpointing of an HF model (``validate_speed_options``)."""
    if not m.get("activation_offload"):
        return
    from functools import partial

    blocks = [b for b in transformer_blocks(_bare(model)) if getattr(b, "gradient_checkpointing", False)]
    if not blocks:
        raise UserError("model.activation_offload", True, f"This model ({type(_bare(model)).__name__}) has no "
                        "checkpointed transformer block whose input could move to host RAM.",
                        "Use model.activation_offload=false, or model.activation_checkpointing=full on an HF model.")
    for block in blocks:  # 1
        setattr(block, "_gradient_checkpointing_func",
                partial(_offloaded_checkpoint, checkpoint=block._gradient_checkpointing_func))


class offload_to:
    """The dry run's host RAM for ``model.activation_offload``: the meta device, so the memory tracker counts the
    offloaded inputs apart from the fake device's (``planning.simulation``)."""

    def __init__(self, host: str) -> None:
        self.host = host

    def __enter__(self) -> None:
        self.saved, _OFFLOAD["host"] = _OFFLOAD["host"], self.host

    def __exit__(self, *exc: Any) -> None:
        _OFFLOAD["host"] = self.saved


def apply_compile(model: Any, m: DictConfig) -> None:
    # Per block, not the whole model: blocks are identical, so one compiled graph serves them all, and
    # sharding/DDP hooks stay outside the compiled regions.
    if m.compile:
        for block in transformer_blocks(model):
            block.compile()


def apply_float8(model: Any, precision: DictConfig, device: torch.device) -> None:
    """``precision=fp8``: the transformer blocks' ``nn.Linear`` layers become torchao's ``Float8Linear``
    (dynamic tensorwise scales; e4m3 activations and weights, e5m2 gradients), before checkpointing, compile
    and sharding wrap them, as torchtitan orders it. The LM head and the embeddings stay in bf16 (their
    precision matters most for the loss; torchtitan leaves the output layer out too), and so do layers whose
    dimensions are not multiples of 16 (float8 matmuls need them). On a CPU torchao emulates the float8
    matmuls: the same rounding of inputs to float8, the product in high precision."""
    if precision.name != "fp8":
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    inside = {id(mod) for block in transformer_blocks(model) for mod in block.modules()}

    def wanted(mod: torch.nn.Module, name: str) -> bool:
        return (id(mod) in inside and isinstance(mod, torch.nn.Linear)
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"),
                               module_filter_fn=wanted)


def float8_linears(model: torch.nn.Module) -> int:
    """How many layers ``apply_float8`` converted (tests/unit/test_model.py counts them)."""
    return sum(type(mod).__name__ == "Float8Linear" for mod in model.modules())


_PROBED = {"loss_chunks": 0, "mlp_tiles": 0, "norm_tiles": 0, "offloaded_bytes": 0}  # chunks the chunked heads, tiles the tiled
#    MLPs, bytes the offloaded blocks copied to host RAM, of this process's training forwards (SpeedProbe: the step's)


def _tiled(plain: Any, tiles: int, probe: str) -> Any:
    """``plain`` (a module's forward of one tensor, position by position) run over its tokens in ``tiles`` tiles,
    each inside a non-reentrant checkpoint (the forward of ``apply_mlp_tiles`` and ``apply_norm_tiles``):

    1. The tokens, flattened over the batch (nothing here mixes positions), are split into near-equal tiles
       (``tensor_split``: views of a contiguous input; never more tiles than tokens).
    2. Each tile's checkpoint keeps only its input (a view of the module's input): backward recomputes one tile's
       intermediates at a time. Nested inside ``full`` checkpointing's recompute alike.
    3. Per token the same ops: the output and gradients equal the untiled module's within rounding.
    4. Without gradients (evaluation, generation) the plain forward runs: nothing is kept to save.
    ``probe``: the ``_PROBED`` count of tiles computed in training forwards (not recomputes) that it adds to."""
    from torch.utils.checkpoint import checkpoint

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # 4
            return plain(x)
        flat = x.reshape(-1, x.size(-1))  # 1
        outs = [checkpoint(plain, tile, use_reentrant=False)  # 2
                for tile in flat.tensor_split(min(tiles, max(flat.size(0), 1)))]  # no empty tiles
        if torch._C._current_graph_task_id() == -1:  # a training forward, not full checkpointing's recompute
            _PROBED[probe] += len(outs)
        out = torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.size(-1))

    return forward


def apply_mlp_tiles(model: Any, m: DictConfig) -> None:
    """``model.mlp_tiles``: each dense block's MLP computes its tokens in ``mlp_tiles`` tiles (ALST's TiledMLP;
    ``_tiled``), inside the MLP's own forward (the instance's ``forward`` replaced): its parameter names and the
    engine's hooks on it and on its linears (ZeRO-3's gathers) are unchanged; a block's FSDP unit holds it
    unsharded. Only dense MLPs (``shape.dense_mlp``): routed experts' routing and balancing counts run once per
    call."""
    tiles = int(m.get("mlp_tiles", 0))
    if tiles <= 1:
        return
    mlps = [mlp for mlp in map(dense_mlp, transformer_blocks(_bare(model))) if mlp is not None]
    if not mlps:
        raise UserError("model.mlp_tiles", tiles, f"This model ({type(_bare(model)).__name__}) has no dense MLP in its "
                        "transformer blocks (a block's `mlp` without routed experts) to tile.", "Use model.mlp_tiles=0.")
    for mlp in mlps:
        mlp.forward = _tiled(mlp.forward, tiles, "mlp_tiles")


def apply_norm_tiles(model: Any, m: DictConfig) -> None:
    """``model.norm_tiles``: each block's own norms (``shape.block_norms``: RMSNorm's fp32 upcast, its square, mean,
    scale and their gradients, each hidden x 4 bytes per token) compute their tokens in ``norm_tiles`` tiles
    (``_tiled``), inside the norm's own forward: at long sequences a recomputed block's backward holds most of its
    bytes in these fp32 intermediates (DeepSeek-7B at 131,072 tokens per rank: 28 of 44 x hidden per token,
    measured by the dry run), and the tiles hold one tile's at a time."""
    tiles = int(m.get("norm_tiles", 0))
    if tiles <= 1:
        return
    norms = [n for block in transformer_blocks(_bare(model)) for n in block_norms(block)]
    if not norms:
        raise UserError("model.norm_tiles", tiles, f"This model ({type(_bare(model)).__name__}) has no norm among its "
                        "transformer blocks' children (`input_layernorm`, `post_attention_layernorm`) to tile.",
                        "Use model.norm_tiles=0.")
    for norm in norms:
        norm.forward = _tiled(norm.forward, tiles, "norm_tiles")


def apply_chunked_loss(model: Any, m: DictConfig) -> None:
    """``model.loss_chunk``: the LM head computes the summed cross-entropy itself, ``loss_chunk`` tokens at a
    time, when the loss asks for it (the caller sets ``head.shardyard_targets``: ``_cross_entropy``, and
    ``mtp.head_sum`` for each multi-token-prediction depth); otherwise it is the plain head.

    1. Inside the head's own forward, so each engine's hooks on the head (ZeRO-3's gather, FSDP's unshard)
       run as for any forward, and the parameter names do not change (only the instance's ``forward``).
    2. Each chunk's logits, their fp32 upcast and the softmax live only inside a non-reentrant checkpoint:
       forward keeps the chunk's hidden states (which the model has anyway), backward recomputes the chunk's
       logits, so at most one chunk's ``chunk x vocab`` logits exist at a time; the head's matmul runs once
       more in backward (2 x hidden x vocab FLOPs per token).
    3. The sum of the chunks' sums equals the whole sum (fp32 accumulation), so losses and gradients equal the
       unchunked ones within rounding."""
    chunk = int(m.get("loss_chunk", 0))
    if chunk <= 0:
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if head is None or getattr(config, "final_logit_softcapping", None):
        why = ("has no get_output_embeddings() to run in chunks" if head is None else
               "changes its logits after the head (final_logit_softcapping), which the chunks would skip")
        raise UserError("model.loss_chunk", chunk, f"This model ({type(model).__name__}) {why}.",
                        "Use model.loss_chunk=0 with it.")
    plain = head.forward  # 1
    head.shardyard_targets = None

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        targets = head.shardyard_targets
        if targets is None:
            return plain(hidden)
        h = hidden.reshape(-1, hidden.size(-1))
        t = targets.reshape(-1)
        assert h.size(0) == t.size(0), (h.shape, t.shape)

        def piece(h_c: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(plain(h_c).float(), t_c, ignore_index=-100, reduction="sum")

        from torch.utils.checkpoint import checkpoint

        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, h.size(0), chunk):  # 2, 3
            total = total + checkpoint(piece, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
            _PROBED["loss_chunks"] += 1  # what SpeedProbe reports: this head, not the plain one, computed the loss
        return total

    head.forward = forward
    model.shardyard_loss_chunk = chunk


def has_chunked_loss(model: Any) -> bool:
    return bool(getattr(_bare(model), "shardyard_loss_chunk", 0))


class SpeedProbe:
    """``summary.json``'s ``speed_options``: what the speed options did at one training step (the first this run
    trains), measured inside the engine's own step, so an option that an engine's wrapper or sharding dropped
    shows as nothing done. Entered around the step's forward and backward (``loop.train``); one step only, so
    the cost of measuring (a dispatch mode over that step's ops) stays off every other step.

    * ``loss_chunks``: the chunks the ``model.loss_chunk`` head computed in the step's training forwards
      (micro-batches x ceil(tokens / loss_chunk) x (1 + MTP depths) on every engine that takes it; null when the
      option is off).
    * ``mlp_tiles``: the tiles the ``model.mlp_tiles`` MLPs computed in the step's training forwards
      (micro-batches x dense blocks x mlp_tiles; not their recompute in backward); null when the option is off.
    * ``norm_tiles``: the tiles the ``model.norm_tiles`` norms computed in the step's training forwards
      (micro-batches x blocks x their norms x norm_tiles); null when the option is off.
    * ``offloaded_bytes``: the bytes of block inputs ``model.activation_offload`` copied to host RAM in the step's
      training forwards (micro-batches x checkpointed blocks x the input's bytes); null when the option is off.
    * ``compiled_calls``: the times the step entered compiled code (``model.compile``): dynamo's cached graphs
      that passed their guards, and the graphs it compiled then. Each block's forward once per micro-batch
      (a pipeline stage's blocks once per pipeline micro-batch); 0: the blocks ran eagerly; null when off.
    * ``kept_bytes`` / ``block_kept_bytes``: the bytes of the tensors the step's training forwards created
      that are still alive when backward starts (what backward reads: the activations activation
      checkpointing saves or drops), and of those the ones created inside the transformer blocks. The most
      alive at the start of any backward (a pipeline stage has several micro-batches in flight). Storage
      is counted once however many views share it; a DTensor counts its local shard. Measured only with
      ``debug.measure_activations`` (``measure``), never under ``model.compile`` (null): a dispatch mode
      would run the compiled blocks eagerly."""

    def __init__(self, model: Any, m: DictConfig, measure: bool = True) -> None:
        self.m, self.blocks, self.measure = m, transformer_blocks(_bare(model)), measure
        self.record: dict[str, Any] = {}

    def __enter__(self) -> SpeedProbe:
        self.chunks0, self.tiles0, self.hits = _PROBED["loss_chunks"], _PROBED["mlp_tiles"], 0
        self.offloaded0, self.norms0 = _PROBED["offloaded_bytes"], _PROBED["norm_tiles"]
        self.mode = _KeptBytes(self.blocks).__enter__() if self.measure and not self.m.compile else None
        if self.m.compile:  # dynamo is imported only by runs that compile (about a second of start-up otherwise)
            from torch._C._dynamo.eval_frame import set_guard_complete_hook
            from torch._dynamo.utils import counters

            def guarded(cache_hit: bool) -> bool:  # dynamo's hook at every entry into compiled code (its guards run)
                self.hits += cache_hit
                return self.chained(cache_hit) if self.chained is not None else cache_hit

            self.graphs0 = counters["stats"]["unique_graphs"]
            self.chained = set_guard_complete_hook(guarded)  # e.g. torch.compiler.set_enable_guard_collectives'
        return self

    def __exit__(self, *exc: Any) -> None:
        compiled: int | None = None
        if self.mode is not None:
            self.mode.__exit__(*exc)
        if self.m.compile:
            from torch._C._dynamo.eval_frame import set_guard_complete_hook
            from torch._dynamo.utils import counters

            set_guard_complete_hook(self.chained)
            compiled = self.hits + counters["stats"]["unique_graphs"] - self.graphs0
        mode = self.mode if self.mode is not None and self.mode.counted else None
        self.record = {
            "loss_chunks": _PROBED["loss_chunks"] - self.chunks0 if int(self.m.get("loss_chunk", 0)) > 0 else None,
            "mlp_tiles": _PROBED["mlp_tiles"] - self.tiles0 if int(self.m.get("mlp_tiles", 0)) > 1 else None,
            "norm_tiles": _PROBED["norm_tiles"] - self.norms0 if int(self.m.get("norm_tiles", 0)) > 1 else None,
            "offloaded_bytes": _PROBED["offloaded_bytes"] - self.offloaded0 if self.m.get("activation_offload") else None,
            "compiled_calls": compiled,
            "kept_bytes": mode.kept if mode else None, "block_kept_bytes": mode.block_kept if mode else None}


class _KeptBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """``SpeedProbe``'s memory figures. Every op's outputs in a forward (autograd not running: no graph task)
    are remembered by weak references to their storages, tagged when a transformer block is running (forward
    hooks); at the first op of each backward the storages still alive are summed."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.blocks, self.depth, self.kept, self.block_kept, self.counted = blocks, 0, 0, 0, True
        self.live: dict[int, tuple[Any, int, bool]] = {}  # storage address: (weak ref, bytes, inside a block)
        self.sampled: set[int] = set()

    def __enter__(self) -> _KeptBytes:
        def enter(*_: Any) -> None:
            self.depth += 1

        def leave(*_: Any) -> None:
            self.depth -= 1

        self.hooks = [h for b in self.blocks
                      for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self.hooks:
            h.remove()
        self.live.clear()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.multiprocessing.reductions import StorageWeakRef

        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self.sampled and self.counted:  # a backward starts: what the forwards left
            self.sampled.add(task)
            alive = [(n, inside) for ref, n, inside in self.live.values() if not ref.expired()]
            self.kept = max(self.kept, sum(n for n, _ in alive))
            self.block_kept = max(self.block_kept, sum(n for n, inside in alive if inside))
        out = func(*args, **(kwargs or {}))
        if task == -1 and self.counted:
            try:  # new storages only: a view of its input (a weight's transpose) allocates nothing
                held = {s.data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs)) for s in _storages(t)}
                for storage in (s for t in torch.utils._pytree.tree_leaves(out) for s in _storages(t)):
                    if storage.data_ptr() not in held and (storage.data_ptr() not in self.live
                                                           or self.live[storage.data_ptr()][0].expired()):
                        self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), self.depth > 0)
            except Exception:  # a tensor kind without storages to count: no figure rather than a failed step
                self.counted = False
        return out


def _storages(t: Any) -> list[Any]:
    """The storages a tensor holds: its own, or a wrapper subclass's inner tensors' (a DTensor's local shard,
    a float8 tensor's data and scale)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return []
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return [s for name in t.__tensor_flatten__()[0] for s in _storages(getattr(t, name))]
    return [t.untyped_storage()]


def prepare_model(model: Any, cfg: DictConfig, device: torch.device) -> None:
    """The options that change how a built model computes, in the order every engine applies them before
    it wraps or shards the model: float8 linears -> tiled MLPs and norms -> activation checkpointing (and its offload) ->
    regional compile -> chunked loss head. Float8 first, so checkpointing recomputes and compile traces the float8 layers; the
    MLPs tiled inside the blocks checkpointing wraps; the loss head last, outside the compiled blocks."""
    apply_float8(model, cfg.precision, device)
    apply_mlp_tiles(model, cfg.model)
    apply_norm_tiles(model, cfg.model)
    apply_activation_checkpointing(model, cfg.model)
    apply_activation_offload(model, cfg.model)
    apply_compile(model, cfg.model)
    apply_chunked_loss(model, cfg.model)


def prepare_replica(model: torch.nn.Module, cfg: DictConfig, device: torch.device) -> torch.nn.Module:
    """Full-replica engines (single, DDP, Horovod): materialise, ``prepare_model``, then move."""
    materialize(model, device, cfg.seed, cfg.model)
    prepare_model(model, cfg, device)
    # Always moved (bitsandbytes quantises a 4-bit base as it moves), but for a dry run's fake storage, which is on
    # the device already and cannot be swapped for itself.
    return model if _FAKE_STORAGE["mode"] is not None else model.to(device)
