"""``python -m shardyard train ...`` (and every other ``shardyard`` command)."""

from shardyard.cli import main

main()
