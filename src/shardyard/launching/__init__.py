"""What runs before a worker exists: ``train.py``'s Hydra app (``app``), the parent process of a run (``run``),
launchers (``launch``: in-process, the elastic agent, deepspeed, horovodrun, srun), ``shardyard sbatch``
(``sbatch``), sweeps (``sweep``), projects made by ``shardyard new`` (``project``) and the recipe book
(``recipes``).

May import: ``planning``, ``training`` and everything below them. Independent of ``inference`` (same level).
Importing this package imports none of its modules (``train.py --help`` stays fast).
"""
