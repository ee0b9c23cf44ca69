"""``engine=deepspeed`` for generation (issue 45): DeepSpeed's inference engine (``deepspeed.init_inference``),
tensor parallel over ``tp_size`` processes.

1. ``check`` refuses what cannot run, before any process starts (``UserError``, exit 2): DeepSpeed not installed,
   a device that is neither CPU nor CUDA, a ``tp_size`` below 1 or not dividing the model's attention heads and
   key/value heads, more ranks than visible GPUs, a model without a transformers config at ``tp_size`` > 1.
2. ``run_ranks`` runs the caller's ``target(*args)`` on ``tp_size`` processes, each with a process group up
   (gloo on CPU; NCCL for the GPUs' tensors and gloo for the host's on CUDA, ``torch.cuda.set_device(LOCAL_RANK)``)
   and RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* set; in this process, without a group, at ``tp_size`` 1. A
   ``UserError`` raised on any rank is raised again here (exit 2); any other failure is a ``RuntimeError``
   carrying the failing rank's traceback. Every rank runs the whole generation (the same prompts, the same
   seed, identical logits after each all-reduce: the same tokens); rank 0 writes (``rank()``).
3. ``wrap`` hands the model to ``deepspeed.init_inference`` with automatic tensor parallelism (AutoTP): each
   decoder layer's attention projections and MLP are split by heads and columns over the ranks, the output
   projections (``o_proj``, ``down_proj``, the LM head) all-reduce. The returned ``InferenceEngine`` takes the
   keyword forward of the HF model inside it (``input_ids``, ``attention_mask``, ``position_ids``, the HF
   ``DynamicCache``), which is what ``generation.generate`` calls.

What DeepSpeed 0.19 does here, measured on this repo's tiny models (tests/dist/test_ds_inference.py):

* CPU: AutoTP over gloo at any ``tp_size`` dividing the heads: greedy tokens equal the plain model's for LLaMA
  (``deepseek_tiny``, grouped-query attention) and DeepSeek-V3 (``deepseek_moe_tiny``: MLA's ``q_proj`` and
  ``kv_b_proj`` split by heads, the shared experts split, the routed experts replicated on every rank, the
  compressed ``kv_a_proj_with_mqa`` and the router kept whole).
* Kernel injection (``replace_with_kernel_inject=True``) is never used. Its ops are CUDA-only (on CPU:
  "This op had not been implemented on CPU backend"), and on GPUs (read in DeepSpeed 0.19's source, not run) its
  LLaMA policy (``LLAMALayerPolicy``; there is none for DeepSeek-V2/V3) replaces each ``LlamaDecoderLayer`` with a fused layer that keeps its own KV
  cache, ignores the ``DynamicCache`` and the positions of left-padded rows, and returns the pre-transformers-5
  ``(hidden, (key, value))`` tuple where transformers 5's decoder loop takes the hidden states alone.
* DeepSpeed's CPU all-reduce for inference (its shared-memory op, ``deepspeed_shm_comm``) is switched off: it is
  compiled on first use (about 2 minutes on 2 cores), and without ``LOCAL_SIZE`` in the environment (set by
  DeepSpeed's own launcher only) it all-reduces through shared memory it never set up (a segmentation fault in
  ``inference_all_reduce_``). gloo's all-reduce carries the activations instead, as for training
  (``backends.deepspeed``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import socket
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator

from shardyard.core.errors import UserError

if TYPE_CHECKING:  # torch is imported where it runs: `shardyard generate --help` stays fast
    import torch


def check(tp_size: int, model_config: Any, device_type: str) -> None:
    """Refuse (``UserError`` naming ``engine`` or ``tp_size``) an ``engine=deepspeed`` run that cannot work:
    ``model_config`` is the HF config of the model (None: a plain torch module), ``device_type`` ``cpu`` or
    ``cuda``."""
    if tp_size < 1:
        raise UserError("tp_size", tp_size, "The tensor-parallel degree counts processes, at least 1.",
                        "Use tp_size=1 (one process) or a divisor of the model's attention heads.")
    if not _installed("deepspeed"):
        raise UserError("engine", "deepspeed", "DeepSpeed is not installed in this environment, and engine=deepspeed "
                        "runs its inference engine (deepspeed.init_inference).",
                        "Install it (`make setup` does: pip install deepspeed), or use engine=hf.")
    if device_type not in ("cpu", "cuda"):
        raise UserError("engine", "deepspeed", f"DeepSpeed's inference engine runs here on CPU or on CUDA GPUs, not "
                        f"on {device_type!r}.", "Use device=cpu or device=cuda, or engine=hf.")
    if tp_size == 1:
        return
    if model_config is None:
        raise UserError("tp_size", tp_size, "DeepSpeed's automatic tensor parallelism splits a transformers model "
                        "by the head counts of its config; this model is a plain torch module without one.",
                        "Use tp_size=1, or engine=hf.")
    config = getattr(model_config, "text_config", None) or model_config
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise UserError("tp_size", tp_size, f"The model's config ({type(model_config).__name__}) gives no "
                        "num_attention_heads, so its attention cannot be split over ranks by heads.",
                        "Use tp_size=1, or engine=hf.")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        fits = [d for d in range(1, math.gcd(heads, kv_heads) + 1) if math.gcd(heads, kv_heads) % d == 0]
        raise UserError("tp_size", tp_size, f"Tensor parallelism gives each rank an equal share of the attention "
                        f"heads; the model has {heads} attention heads and {kv_heads} key/value heads, which "
                        f"{tp_size} ranks do not share equally.", f"Use a tp_size dividing both: one of {fits}.")
    if device_type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if tp_size > gpus:
            raise UserError("tp_size", tp_size, f"Each tensor-parallel rank runs on a GPU of its own, and "
                            f"{gpus} GPU(s) are visible to this process (CUDA_VISIBLE_DEVICES).",
                            f"Use tp_size<={gpus}, or device=cpu (ranks over gloo, on CPU).")


def wrap(model: torch.nn.Module, *, tp_size: int, dtype: torch.dtype,
         device_type: str | None = None) -> torch.nn.Module:
    """``deepspeed.init_inference(model)`` with AutoTP over ``tp_size`` ranks (the process group's world, as
    ``run_ranks`` starts it) in ``dtype``; the engine moves the model (or this rank's share of it) to this
    rank's device: ``cuda:LOCAL_RANK``, or the CPU. ``device_type`` defaults to where ``model`` is; ``cpu`` on
    a machine with GPUs keeps DeepSpeed on its CPU accelerator. A dtype the device does not take is a
    ``UserError`` naming ``dtype``."""
    device_type = device_type or next(model.parameters()).device.type
    with _messages_to_stderr():
        return _init_inference(model, tp_size, dtype, device_type)


def _init_inference(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, device_type: str) -> torch.nn.Module:
    """``wrap``'s work: DeepSpeed's accelerator and CPU all-reduce chosen, the dtype checked, the engine built."""
    if device_type == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the module docstring's third point
        from deepspeed.accelerator import get_accelerator, set_accelerator

        if get_accelerator().device_name() != "cpu":  # device=cpu on a machine with GPUs
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.inference.engine import InferenceEngine

    supported = get_accelerator().supported_dtypes()
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise UserError("dtype", str(dtype).removeprefix("torch."), f"DeepSpeed's {device_type} accelerator runs "
                        f"inference in {names} only.", f"Use dtype= one of {names}.").on_every_rank()
    if tp_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != tp_size:
            raise RuntimeError(f"ds_inference.wrap(tp_size={tp_size}) needs a process group of {tp_size} ranks "
                               "(ds_inference.run_ranks starts one)")
        # DeepSpeed keeps the tensor-parallel group of its first engine in a class attribute: a process that
        # wraps again after a new process group (a test's kept worker) must not reuse the old one.
        InferenceEngine.inference_mp_group = None
    return deepspeed.init_inference(model, tensor_parallel={"tp_size": tp_size}, dtype=dtype,
                                    replace_with_kernel_inject=False)


@contextlib.contextmanager
def _messages_to_stderr() -> Iterator[None]:
    """DeepSpeed's messages on stderr, where stdout carries generate's JSONL rows: AutoTP prints the layers it
    splits ("AutoTP: [...]"), and DeepSpeed's logger writes to the stdout of its creation (its import: "Setting
    accelerator to CPU" on every rank); only its warnings are kept (its INFO lines: version, config)."""
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils import logger  # created here (sys.stdout is stderr) unless imported before

        logger.setLevel(logging.WARNING)
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
                if getattr(handler.stream, "closed", False):  # the stream of its creation is gone (a test's
                    handler.stream = sys.stderr               # capture): setStream would flush it and raise
                else:
                    handler.setStream(sys.stderr)
        yield


def rank() -> int:
    """This process's rank under ``run_ranks`` (0 in the caller's process at ``tp_size`` 1): rank 0 writes."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def run_ranks(tp_size: int, target: Callable[..., None], *args: Any, device_type: str | None = None) -> None:
    """``target(*args)`` on ``tp_size`` processes with a process group up (module docstring, point 2);
    ``device_type`` ``cpu`` or ``cuda`` (default: ``cuda`` when a GPU is visible). ``target`` and ``args`` must
    pickle (a module-level function): each rank is a fresh interpreter (spawn)."""
    if tp_size == 1:
        target(*args)
        return
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(_rank_main, args=(tp_size, _free_port(), device_type, errors, target, args),
                           nprocs=tp_size, join=True, start_method="spawn")
    except ProcessException as exc:
        if not errors.empty():
            key, value, problem, fix = errors.get()
            raise UserError(key, value, problem, fix) from None
        raise RuntimeError(f"engine=deepspeed: rank {exc.error_index} of {tp_size} failed:\n"
                           f"{getattr(exc, 'msg', exc)}") from None


def _rank_main(local_rank: int, world: int, port: int, device_type: str, errors: Any,
               target: Callable[..., None], args: tuple) -> None:
    """One rank of ``run_ranks``: its environment and process group, then ``target``; a ``UserError`` goes back
    to the caller through ``errors`` (as its fields: its class does not pickle) before it ends the rank."""
    import torch
    import torch.distributed as dist

    from shardyard.backends.process_group import backend_string

    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
        device = torch.device("cpu")
    dist.init_process_group(backend_string(device), rank=local_rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    try:
        target(*args)
    except UserError as err:
        errors.put((err.key, err.value if _pickles(err.value) else repr(err.value), err.problem, err.fix))
        raise
    finally:
        dist.destroy_process_group()


def _installed(name: str) -> bool:
    """Whether ``import name`` would find it, without importing it (DeepSpeed's import takes seconds)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: blocked by a None in sys.modules
        return False


def _pickles(value: Any) -> bool:
    import pickle

    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
