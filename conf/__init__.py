"""shardyard's own configs as a package (``pkg://shardyard.conf`` on Hydra's search path of projects made by
``shardyard new``; Hydra needs this file to accept the package). Installed as ``shardyard/conf``."""
