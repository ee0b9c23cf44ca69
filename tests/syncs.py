"""Counting host syncs on CPU: the calls that make the host wait for the device on a GPU (issue 41).

``torch.cuda.set_sync_debug_mode`` sees them only on CUDA. On CPU nothing waits, so ``HostSyncs`` counts instead
what would: ops whose output size or value the host must read (``aten._local_scalar_dense``: ``item()``,
``float()``, ``bool()`` of a tensor; ``nonzero``, ``bincount``, ``unique``, ``masked_select``, ``repeat_interleave``
without ``output_size``; a copy off an accelerator), seen through a ``TorchDispatchMode`` (autograd's backward
included), and the ``Tensor`` methods that hand data to Python without an op on a CPU tensor (``tolist``,
``cpu``, ``numpy``), patched while it counts. Each sync is kept with the line that asked for it."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.bincount.default,
                  aten.masked_select.default, aten._unique.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default}
"""Ops whose output the host must read first (``histc`` with explicit bounds and ``nonzero_static`` need not)."""
METHODS = ("tolist", "cpu", "numpy")


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as s: ...``; then ``s.calls``: one ``(what, where)`` per sync, ``where`` the innermost
    line of shardyard or transformers that asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._inside = 0  # inside a patched method: its own ops are that one sync
        self.paused = False  # not counting for now (code outside what is measured)
        self._saved: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.calls)

    def _record(self, what: str) -> None:
        if self.paused:
            return
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "/shardyard/" in f.filename or "/transformers/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.calls.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside and self._syncs(func, args, kwargs):
            self._record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    @staticmethod
    def _syncs(func: Any, args: tuple, kwargs: dict) -> bool:
        if func in DATA_DEPENDENT:
            return True
        if func is aten.repeat_interleave.Tensor:  # its output size is the sum of the repeats, unless given
            return kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
        if func in (aten._to_copy.default, aten.copy_.default):  # device -> host
            src = args[1] if func is aten.copy_.default else args[0]
            dst = (args[0].device if func is aten.copy_.default else kwargs.get("device"))
            return isinstance(src, torch.Tensor) and src.device.type != "cpu" and getattr(dst, "type", None) == "cpu"
        return False

    def __enter__(self) -> HostSyncs:
        for name in METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved = {}
        return super().__exit__(*exc)

    def _counted(self, name: str, method: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._inside:
                self._record(name)
            self._inside += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._inside -= 1
        return call


def moe_step_syncs(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[str, str]]:
    """The host syncs of one training forward + backward of ``model`` on ``ids`` (its balance losses added, as the
    engines add them) that belong to its MoE layers: those inside each MoE block's forward (router, balancer
    hook, experts, their all-to-alls), the taking of the balance losses, and the whole backward. The dense rest
    of the forward is not counted (transformers checks once per forward for packed sequences)."""
    from shardyard.models import moe

    blocks = [model.get_submodule(name.rsplit(".", 1)[0]) for name, m in model.named_modules()
              if any(r.module is m for r in moe.routers(model))]
    backward = [False]  # the whole backward counts, also a recomputed forward's dense part
    with HostSyncs() as syncs:
        def turn(on: bool) -> Any:
            def hook(*_: Any) -> None:
                syncs.paused = not (on or backward[0])
            return hook

        hooks = [model.register_forward_pre_hook(turn(False)), model.register_forward_hook(turn(True))]
        for b in blocks:
            hooks += [b.register_forward_pre_hook(turn(True)), b.register_forward_hook(turn(False))]
        try:
            logits = model(ids).logits
            loss = logits.float().mean() + moe.aux_loss(model)
            backward[0] = True
            loss.backward()
        finally:
            for h in hooks:
                h.remove()
    assert blocks, "no MoE block in the model"
    return syncs.calls
