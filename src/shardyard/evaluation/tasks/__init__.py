"""Local lm-evaluation-harness tasks shipped with shardyard (``shardyard eval`` always includes this directory)."""
