"""Models: the builders ``model._target_`` names and how shardyard builds and checks what they return (``build``),
what it reads of a built model (``shape``: blocks, counts, FLOPs, what the memory plan reads), how it prepares one
for training (``prepare``: float8, activation checkpointing, compile, the chunked loss head) and computes its loss
(``loss``), pretrained weights (``weights``), mixture-of-experts layers (``moe``), multi-token prediction
(``mtp``), adapters (``adapters``: ``peft=lora|qlora``) and sampling with a KV cache (``generation``).

May import: ``core``, ``config``. Independent of ``data`` and ``monitors`` (same level). Importing this package
imports none of its modules (torch loads with them).
"""
