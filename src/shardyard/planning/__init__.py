"""Before a run starts: the cross-group checks that turn a config into a ``Plan`` (``validate``; each group's own
rules, ``rules``; the keys nobody would read, ``keys``), the hardware a plan is for (``hardware``), one
rank's memory and time plan (``plan``), every other engine and layout with the check before launch (``search``:
``plan.only``, a refusal's alternatives), the dry run on fake tensors (one rank, ``simulation``; the verdict,
``dryrun``) and ``+scale=smoke`` (``scale``).

May import: ``objectives`` and everything below it. Independent of ``training`` (same level).
"""
