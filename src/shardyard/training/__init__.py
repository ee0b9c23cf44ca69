"""One rank's training run: the worker's life (``worker``), the step loop (``loop``), checkpoints
(``checkpoint``; their hashes, manifest and verification: ``integrity``), HF exports (``export``), the run dir (``rundir``), health checks and the NaN guard
(``debug``), the profiler (``profiling``), throughput and MFU (``metrics``), and the Optuna trial a sweep job
reports to (``trial``).

May import: ``objectives`` and everything below it (``backends``, ``evaluation``, ``models``, ``data``,
``monitors``, ``config``, ``core``). Independent of ``planning`` (same level): nothing here plans or validates.
"""
