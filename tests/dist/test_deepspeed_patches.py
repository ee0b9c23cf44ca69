"""Each fix in ``shardyard.backends.deepspeed_patches`` is still needed by the installed DeepSpeed, and works:
every test first runs DeepSpeed's own behaviour on a tiny case and asserts the defect shows (so it FAILS once a
DeepSpeed release fixes it: then drop the patch and its test), then asserts the patched behaviour is right."""

import copy

import pytest
import torch

from shardyard.backends import deepspeed_patches as patches
from shardyard.testing import on_ranks


def test_zero3_init_ignores_a_given_dtype_without_fp16(monkeypatch):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import Init

    # An accelerator without fp16, as the CPU one is (forced, so the test reads the same on a GPU machine).
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    deepspeeds = getattr(Init._set_dtype, "__wrapped__", Init._set_dtype)
    init = object.__new__(Init)  # _set_dtype reads nothing else of the instance
    deepspeeds(init, None, torch.float32)
    assert init.dtype == torch.bfloat16  # the defect: float32 was asked for

    monkeypatch.setattr(Init, "_set_dtype", deepspeeds)  # undone after the test, whatever this installs
    patches.keep_given_zero3_dtype()
    patches.keep_given_zero3_dtype()  # installed once
    assert Init._set_dtype.__wrapped__ is deepspeeds
    for given, kept in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (None, torch.bfloat16)):
        init._set_dtype(None, given)
        assert init.dtype == kept, given


def test_host_adam_resumed_mid_run_differs_from_the_uninterrupted_run():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=gen)
    grads = [torch.randn(4096, generator=gen) for _ in range(6)]  # beta2=0.95: beta2^t differs at t=6

    def adam(weights, *, state=None, replay=False):
        p = torch.nn.Parameter(weights.clone())
        opt = DeepSpeedCPUAdam([p], lr=1e-2, betas=(0.9, 0.95))
        if state is not None:  # a fresh process's optimizer, resumed at step 5
            opt.load_state_dict(copy.deepcopy(state))
            if replay:
                patches.continue_adam_bias_correction(opt, torch.device("cpu"))
        return p, opt

    def train(p, opt, steps):
        for g in steps:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    whole = train(*adam(start), grads)
    p, opt = adam(start)
    at5 = train(p, opt, grads[:5])
    resumed = train(*adam(at5, state=opt.state_dict()), grads[5:])
    ulp = torch.finfo(torch.float32).eps * whole.abs().clamp(min=1)
    assert (resumed != whole).any() and ((resumed - whole).abs() <= ulp).all()  # the defect: off by an ulp
    assert torch.equal(train(*adam(at5, state=opt.state_dict(), replay=True), grads[5:]), whole)


def _zero3_leftovers(rank: int, world: int, nvme: str) -> None:
    """A ZeRO-3 engine with parameters swapped to NVMe, built under ``zero.Init``, trained a step, destroyed:
    what DeepSpeed keeps of it, then what the patches leave."""
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the backend does: no 2-minute op build
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme,
                                                                  "buffer_count": 2, "buffer_size": 2 ** 16}}}
    try:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(2):  # the second step runs on the first one's trace, through the cached method
            engine.backward(engine(torch.randn(1, 64)).sum())
            engine.step()
        engine.destroy()
        swapper = next(p.nvme_swapper for p in model.parameters())
        # DeepSpeed's own teardown leaves: the model on the module-level stack, coordinators in the class-wide
        # cache, the swapper's page-locked buffers, and its memory-efficient linear in place of torch's.
        assert any(m is model for m in parameter_offload.FWD_MODULE_STACK)
        assert patches.params_to_release_cache().cache_info().currsize > 0
        assert swapper.buffers is not None  # (partitioned_swap_buffer too, once a partition was big enough to swap)
        assert torch.nn.functional.linear is not ZeroInit.linear_bk

        patches.release_zero3(model)
        patches.restore_torch_linear()
        assert not any(m is model for m in parameter_offload.FWD_MODULE_STACK)
        assert patches.params_to_release_cache().cache_info().currsize == 0
        assert swapper.buffers is None and swapper.partitioned_swap_buffer is None
        assert torch.nn.functional.linear is ZeroInit.linear_bk
    finally:
        patches.restore_torch_linear()
        deepspeed.comm.destroy_process_group()


def test_a_destroyed_zero3_engine_leaves_memory_and_its_linear_behind(tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("libaio is missing (make test installs libaio-dev as root)")
    on_ranks(1, _zero3_leftovers, str(tmp_path))
