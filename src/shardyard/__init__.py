"""shardyard: declarative distributed LLM training recipes (Hydra + torch.distributed)."""

__version__ = "0.1.0"
