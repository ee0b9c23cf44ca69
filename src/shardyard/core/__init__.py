"""The foundation every other package stands on: the errors and how a process leaves (``errors``), who-am-I in
a distributed job (``dist_env``), the facts validation derives (``facts``: ``Plan``, ``ModelFacts``), memory
accounting (``memory``), the exact unpickler (``safe_load``), the test drills production code calls
(``drills``), DeepSpeed's compiled ops built ahead and never waited on in silence (``op_builds``: it
imports neither torch nor DeepSpeed, so ``python -m shardyard.core.op_builds`` runs before either), and where
the old module paths went (``moved``).

May import: nothing of shardyard (the standard library, torch and omegaconf only). Importing this package
imports none of its modules.
"""
