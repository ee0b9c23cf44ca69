"""Loading checkpoints without unpickling arbitrary code.

Our own files are safetensors, JSON or ``torch.load(weights_only=True)``. Two libraries we load through are
less careful, so we fence them:

- DeepSpeed 0.19 reads its checkpoints with ``torch.load(weights_only=False)``, and DCP's planner reads
  non-tensor values (optimizer hyper-parameters) the same way. ``weights_only_loads`` turns every
  ``torch.load`` inside it into ``weights_only=True`` with an explicit allow-list of data classes.
- DCP's ``.metadata`` file is a plain pickle. ``check_dcp_metadata`` reads it first with an unpickler
  that accepts only DCP's own metadata classes (and torch sizes, dtypes and paths); a file naming any
  other global is refused before DCP touches it.
"""

from __future__ import annotations

import contextlib
import os
import pickle

import torch

from shardyard.errors import UserError


@contextlib.contextmanager
def weights_only_loads(allowed_globals: list | None = None):
    real_load = torch.load

    def safe_load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(list(allowed_globals or [])):
            return real_load(*args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = real_load


_DCP_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                         ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        ok = (module.startswith("torch.distributed.checkpoint.") or (module, name) in _DCP_METADATA_GLOBALS
              or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not ok:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP metadata file never holds")
        return super().find_class(module, name)


def check_dcp_metadata(path: str) -> None:
    """Raise ``UserError`` unless ``path/.metadata`` unpickles to DCP metadata classes only."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            _DCPMetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ValueError) as e:
        raise UserError("checkpoint.resume", path, f"Its DCP metadata (.metadata) was refused: {e}.",
                        "Resume from a checkpoint shardyard (or torch.distributed.checkpoint) wrote; if it is "
                        "yours, it is corrupt: use checkpoint.resume=auto to fall back to the previous one.") from None
