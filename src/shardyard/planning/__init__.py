"""Before a run starts: the cross-group checks that turn a config into a ``Plan`` (``validate``; each group's own
rules, ``rules``; the keys nobody would read, ``keys``), the memory
and time plan and ``plan.only`` (``plan``), the dry run on the meta device (``dryrun``) and ``+scale=smoke``
(``scale``).

May import: ``objectives`` and everything below it. Independent of ``training`` (same level).
"""
