"""Evaluation on lm-evaluation-harness tasks, inside training (``train.eval_tasks``) and for ``shardyard eval``
(``harness``), and the local tasks shardyard ships (``tasks/``).

May import: ``core``, ``config``, ``models``, ``data``, ``monitors``. Independent of ``backends``. lm-eval is
imported only when tasks are named.
"""
