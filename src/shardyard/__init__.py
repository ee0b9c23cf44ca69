"""shardyard: declarative distributed LLM training recipes (Hydra + torch.distributed)."""

__version__ = "0.1.0"

import logging as _logging

# torchao (precision=fp8) is imported by transformers whenever it is installed: its CUDA-only kernels' load failures
# on a CPU build and torch's deprecation notes on its enums are noise on every run, and not ours to fix.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

# Modules moved into packages by concern (issue 55): an old path (`_target_: shardyard.sft.SFTData`, a pickle,
# `import shardyard.model`) still resolves, to the same module, with one deprecation line (core/moved.py).
from shardyard.core import moved as _moved  # noqa: E402

_moved.install()

# DeepSpeed's autotuner imports mlflow at DeepSpeed's import (3 s), which shardyard never needs (core/lazy_imports.py).
from shardyard.core import lazy_imports as _lazy_imports  # noqa: E402

_lazy_imports.install()
