"""Data: the pipeline from corpora to batches (``pipeline``: ``prepare``, the splits, packing, the mixture),
document sources (``sources``: the ``data.sources[*]._target_``s), file formats (``corpus``), the tokenizer and
token caches (``token_cache``), token shard files (``shards``), and the rows of post-training: SFT (``sft``),
preferences (``preference``), prompts (``prompts``) and the synthetic sets they draw on (``synthetic``).

May import: ``core``, ``config``. Independent of ``models`` and ``monitors`` (same level). Importing this package
imports none of its modules. ``shardyard.data.<name>`` of the old ``data.py`` module (``shardyard.data.mixture``)
still resolves, with a deprecation line (``core.moved``).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    from shardyard.core.moved import attribute

    return attribute(__name__, name)
