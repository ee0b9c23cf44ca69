"""Keys renamed between shardyard versions: what a project made by an older version (``shardyard.lock.yaml``)
is told when its recipe sets one. Removed keys and changed defaults need no table: ``shardyard.launching.project``
finds them by comparing the lock's snapshot with what the installed version composes.

Add a line to ``RENAMED`` with every release that renames a key (the release that renamed it, old -> new).
"""

RENAMED: dict[str, list[tuple[str, str]]] = {
    # 0.1.0: one dispatch mechanism (`_target_` everywhere) and one source of truth for defaults.
    "0.1.0": [
        ("model.pretrained_path", "model.path (model=hf)"),
        ("model.arch", "model._target_ (e.g. shardyard.models.build.llama)"),
        ("data.name", "data._target_ (e.g. shardyard.data.sources.StdlibCode)"),
        ("optim.name", "optim._target_ (e.g. torch.optim.AdamW)"),
        ("sched.name", "sched._target_ (e.g. shardyard.backends.optim.WarmupCosine)"),
    ],
}


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def renamed_since(version: str) -> dict[str, str]:
    """Old key -> its new name, over the releases after ``version``."""
    out: dict[str, str] = {}
    for release, moves in sorted(RENAMED.items(), key=lambda kv: _key(kv[0])):
        if _key(release) > _key(version):
            out.update(dict(moves))
    return out
