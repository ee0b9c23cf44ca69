"""The shipped ``stdlib_qa`` task's data: which standard-library module a function comes from, 4 choices.

``load`` is the task's ``custom_dataset`` (lm-eval calls it): it reads ``stdlib_qa.jsonl`` beside this file, so the
task runs from any directory without a hub. ``python -m shardyard.evaluation.tasks.stdlib_qa.stdlib_qa`` rebuilds the
JSONL from the running interpreter's standard library (deterministic: fixed modules, sorted names, a seeded pick of
the wrong choices); the shipped file was built with CPython 3.11.
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "stdlib_qa.jsonl")
MODULES = ["os", "os.path", "json", "re", "shutil", "math", "random", "string", "textwrap", "itertools",
           "functools", "collections", "heapq", "bisect", "base64", "hashlib", "zlib", "gzip", "tarfile",
           "zipfile", "tempfile", "glob", "fnmatch", "subprocess", "threading", "time", "calendar", "datetime",
           "urllib.parse", "html", "csv", "copy", "pickle", "inspect", "ast", "tokenize", "difflib", "statistics",
           "operator", "struct", "socket", "uuid", "platform", "locale", "warnings", "contextlib", "typing",
           "logging", "unittest", "pprint", "keyword", "shlex", "sysconfig", "traceback", "linecache", "weakref"]


def load(**kwargs):
    """lm-eval's ``custom_dataset``: a ``DatasetDict`` with one ``test`` split."""
    import datasets

    with open(DATA, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def build(per_module: int = 3, seed: int = 0) -> list[dict]:
    """Up to ``per_module`` questions per module: a public function defined in it (with a docstring), its
    docstring's first line as a comment, and ``from MODULE import NAME`` to complete; the wrong choices are
    three other modules of the list."""
    import importlib
    import inspect
    import random

    rng = random.Random(seed)
    items = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        found = 0
        for name in sorted(vars(mod)):
            obj = getattr(mod, name)
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            doc = (inspect.getdoc(obj) or "").strip().splitlines()
            if not doc or len(doc[0]) < 16 or doc[0].startswith(name) or not doc[0][0].isupper():
                continue  # no docstring, or a signature line (C functions' style) where a sentence should be
            others = rng.sample([m for m in MODULES if m != mod_name], 3)
            choices = [mod_name, *others]
            rng.shuffle(choices)
            items.append({"question": f"# {name}: {doc[0][:100]}\nfrom", "name": name,
                          "choices": [f" {m} import {name}" for m in choices], "answer": choices.index(mod_name),
                          "module": mod_name})
            found += 1
            if found == per_module:
                break
    return items


if __name__ == "__main__":
    with open(DATA, "w", encoding="utf-8") as f:
        for item in build():
            f.write(json.dumps(item) + "\n")
    print(DATA)
