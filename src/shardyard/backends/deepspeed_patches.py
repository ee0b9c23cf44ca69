"""Fixes for DeepSpeed 0.19 (``deepspeed==0.19.*`` in pyproject.toml), applied by ``backends/deepspeed.py``.

Each function names the DeepSpeed behaviour it works around. ``tests/dist/test_deepspeed_patches.py`` runs
each defect unpatched on a tiny case and fails once the installed DeepSpeed no longer shows it: then the
patch goes (and its test with it)."""

from __future__ import annotations

import math
from typing import Any

import torch


def keep_given_zero3_dtype() -> None:
    """Make ZeRO-3's ``Init`` use the dtype the engine passes it (idempotent: installed once per process).

    DeepSpeed 0.19's ``Init._set_dtype`` reads ``dtype or torch.float16 if <fp16 supported> else torch.bfloat16
    if ...``, which Python parses as ``(dtype or float16) if <fp16 supported> else bfloat16 ...``: on an
    accelerator without fp16 (the CPU) the dtype the engine passes is ignored and every ZeRO-3 conversion
    gets bfloat16. Training is unaffected until ZeRO-Infinity swaps parameters: its swapper takes that dtype
    and stored fp32 weights as bf16 (measured on 1 rank: first loss 8.351967 against ZeRO-3's 8.351947).
    Upstream PR deepspeedai/DeepSpeed#8428 adds the missing ``()`` after ``is_bf16_supported`` but keeps the
    precedence. A dtype that is given is kept; without one DeepSpeed's own choice stands."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype
    if getattr(original, "shardyard", False):
        return

    def _set_dtype(self, ds_config, dtype):
        original(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    _set_dtype.shardyard = True  # type: ignore[attr-defined]
    _set_dtype.__wrapped__ = original  # type: ignore[attr-defined]  # DeepSpeed's own, for the test
    Init._set_dtype = _set_dtype


def release_zero3(module: torch.nn.Module) -> None:
    """Free what DeepSpeed 0.19's ZeRO-3 keeps of a model after ``engine.destroy()``, for the processes that
    run several engines: an in-process sweep, the tests' kept ranks. Measured by the RSS a process kept after
    each 2-rank ZeRO-Infinity run: about 1.9 GB per run per rank before, none after (upstream:
    deepspeedai/DeepSpeed#7204, "Re-initializing the Engine", RAM grows with each engine).

    1. ``DeepSpeedZeRoOffload`` pushes the model onto the module-level ``parameter_offload.FWD_MODULE_STACK``
       and never pops it.
    2. ``PartitionedParameterCoordinator.__params_to_release`` is a method under ``functools.lru_cache``,
       whose class-wide cache holds every coordinator and the submodules it was asked about. Clearing it
       costs only a recomputation; this process runs one engine at a time.
    3. ZeRO-Infinity's parameter swapper takes its buffers (``buffers``: ``nvme_buffer_count`` x
       ``nvme_buffer_size`` elements, and ``partitioned_swap_buffer``) as page-locked memory from the
       process-wide pinned-tensor manager, which keeps them until ``free_cpu_locked_tensor``; DeepSpeed frees
       its optimizer swapper's buffers that way, but never these."""
    from deepspeed.runtime.zero import parameter_offload

    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if m is not module]
    cache = params_to_release_cache()
    if cache is not None:
        cache.cache_clear()
    swapper = next((getattr(p, "nvme_swapper") for p in module.parameters() if getattr(p, "nvme_swapper", None)), None)
    if swapper is not None:
        for handle, name in ((swapper.aio_read_handle, "buffers"), (swapper.aio_write_handle, "partitioned_swap_buffer")):
            if getattr(swapper, name, None) is not None:
                handle.free_cpu_locked_tensor(getattr(swapper, name))
                setattr(swapper, name, None)


def params_to_release_cache() -> Any:
    """The ``functools.lru_cache`` behind ``PartitionedParameterCoordinator.__params_to_release`` (inside
    DeepSpeed's NVTX wrapper), or None."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    wrapped = vars(PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    return next((c.cell_contents for c in wrapped.__closure__ or () if hasattr(c.cell_contents, "cache_clear")), None)


def restore_torch_linear() -> None:
    """Give ``torch.nn.functional.linear`` back. ZeRO-3's ``Init`` (``memory_efficient_linear``, on by default)
    replaces it with DeepSpeed's ``zero3_linear_wrap``, which DeepSpeed 0.19 says "will persist unless manually
    reset" and never resets: left in place it slows down (and changes the autograd graph of) any later model
    in this process."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

    if hasattr(ZeroInit, "linear_bk"):
        torch.nn.functional.linear = ZeroInit.linear_bk


def continue_adam_bias_correction(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Give DeepSpeed's host Adam kernel the beta powers an uninterrupted process holds at the restored step
    of ``opt`` (ZeRO's base optimizer, just loaded), so that a resumed run continues bit for bit.

    Its C++ optimizer (csrc/includes/cpu_adam.h ``IncrementStep``: FusedAdam on the CPU accelerator, and
    DeepSpeedCPUAdam, which every ``_offload`` engine uses on GPUs too) keeps beta^t across calls: a float32
    product, times beta at each step, in a process that counts from step 1, but ``pow(beta, t)`` in one
    that starts at t > 1, as a resumed process does. The two differ in the last bit at some t (beta2 = 0.95:
    t = 6), so the bias correction, and then every weight, differed by up to 1 ulp from the uninterrupted
    run (measured: ZeRO-2 on CPU resumed at step 5; Adam's moments stayed equal). Replaying steps 1..t, group
    by group as ZeRO steps them, on 1-element tensors rebuilds that product. The CUDA FusedAdam computes
    pow at every step. Measured: about 3 us per replayed step and group (one thread)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if not (isinstance(opt, DeepSpeedCPUAdam) or (isinstance(opt, FusedAdam) and device.type == "cpu")):
        return
    steps = max((int(s["step"]) for s in opt.state.values() if "step" in s), default=0)
    steps = min(steps, max(_steps_that_matter(b, steps) for g in opt.param_groups for b in g["betas"]))
    p, g, m, v = (torch.zeros(1) for _ in range(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel's OpenMP loop over one element: its thread start-up is the cost
    try:
        for step in range(1, steps + 1):
            for group in opt.param_groups:
                b1, b2 = group["betas"]
                if isinstance(opt, DeepSpeedCPUAdam):
                    opt.ds_opt_adam.adam_update(opt.opt_id, step, group["lr"], b1, b2, group["eps"],
                                                group["weight_decay"], group["bias_correction"], p, g, m, v)
                else:
                    opt.multi_tensor_adam(2048 * 32, opt._dummy_overflow_buf, [[g], [p], [m], [v]], group["lr"],
                                          b1, b2, group["eps"], step, opt.adam_w_mode,
                                          int(group["bias_correction"]), group["weight_decay"])
    finally:
        torch.set_num_threads(threads)


def _steps_that_matter(beta: float, steps: int) -> int:
    """The steps after which beta^t < 2^-27 (by a margin, whether computed as a product or by pow): then
    ``1 - beta^t`` rounds to 1.0 in float32, so the bias correction no longer depends on how it was computed."""
    if beta <= 0:
        return 1
    if beta >= 1:
        return steps
    return math.ceil(-27 * math.log(2) / math.log(beta)) + 1
