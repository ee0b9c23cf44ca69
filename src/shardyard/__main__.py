"""``python -m shardyard report RUN_DIR``."""

from shardyard.cli import main

main()
