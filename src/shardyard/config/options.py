"""``KEY=VALUE`` commands over a dataclass of options (``shardyard sbatch``, ``generate``, ``eval``): the help text
from the fields' docstrings, and one value read by the field's declared type.

Nothing heavy is imported here: ``shardyard --help`` builds every command's help.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from typing import Any, Mapping, Sequence

from shardyard.core.errors import UserError


def keys_help(cls: type, head: Sequence[str], width: int = 15, one_line: bool = True) -> str:
    """``head``'s lines, then one line per field of the dataclass ``cls``: its name and its docstring (the string
    right below it in the class body; whitespace folded to one line unless ``one_line`` is False). Installed
    without sources: the names alone."""
    lines = list(head)
    try:
        node = ast.parse(inspect.getsource(cls)).body[0]
    except (OSError, TypeError):
        return "\n".join(lines + ["  " + ", ".join(f.name for f in fields(cls))])
    assert isinstance(node, ast.ClassDef)
    for field_node, doc in zip(node.body, node.body[1:]):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            text = " ".join(doc.value.value.split()) if one_line else doc.value.value
            lines.append(f"  {field_node.target.id:{width}} {text}")
    return "\n".join(lines)


def value(key: str, text: str, kind: Any, choices: Mapping[str, Sequence[Any]] | None = None) -> Any:
    """``text`` read as the field ``key`` of declared type ``kind`` (the annotation as a string, as
    ``from __future__ import annotations`` leaves it): ``null``/``none`` for an Optional, ``true``/``false``, an
    int, a float (a finite one); else the string itself, which must be one of ``choices[key]`` when the key has
    choices. An empty value or a wrong one is a ``UserError`` naming the key. Lists are the caller's (one item per
    repeated key)."""
    kind = str(kind)
    nonempty(key, text)
    if text.lower() in ("null", "none") and "Optional" in kind:
        return None
    if "bool" in kind:
        if text.lower() not in ("true", "false"):
            raise UserError(key, text, "It is true or false.", f"Write {key}=true or {key}=false.")
        return text.lower() == "true"
    for name, cast, example in (("int", int, "1"), ("float", float, "0.7")):
        if name in kind:
            try:
                got = cast(text)
            except ValueError:
                raise UserError(key, text, f"It must be a{'n integer' if name == 'int' else ' number'}.",
                                f"Write e.g. {key}={example}.") from None
            if got != got or got in (float("inf"), float("-inf")):
                raise UserError(key, text, "It must be a finite number.", f"Write e.g. {key}={example}.")
            return got
    allowed = (choices or {}).get(key)
    if allowed is not None and text not in allowed:
        named = [str(c) for c in allowed if c is not None]
        raise UserError(key, text, f"It is one of {', '.join(named)}.", f"Write e.g. {key}={named[0]}.")
    return text


def nonempty(key: str, text: str) -> str:
    """``text`` (a ``KEY=VALUE`` argument's value) when it holds more than blanks, else a ``UserError`` naming
    ``key``: ``out=`` with nothing after it is a mistake (a variable that expanded to nothing), refused before any
    work rather than read as a file named ''."""
    if not text.strip():
        raise UserError(key, text, "The value is empty.",
                        f"Give {key}=VALUE (`--help` says what each key takes), or leave the key out for its default.")
    return text


DTYPES = ("float32", "bfloat16", "float16")
"""The dtype names the commands take (``dtype=``)."""


def dtype(name: str | None) -> Any:
    """``torch.<name>`` (``float32``, ``bfloat16``, ``float16``; the short ``fp32``/``bf16``/``fp16`` too), or None
    for None; another name is a ``UserError`` naming ``dtype``."""
    if name is None:
        return None
    import torch

    full = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if full not in DTYPES:
        raise UserError("dtype", name, "It is not a dtype shardyard runs a model in.",
                        "Use dtype=float32, dtype=bfloat16 or dtype=float16 (or leave it unset).")
    return getattr(torch, full)


DEVICES = "cpu, cuda, cuda:N or auto"
"""The devices the commands take (``device=``)."""


def device(name: str) -> Any:
    """``torch.device`` of ``device=NAME``: ``cpu``, ``cuda``, ``cuda:N`` (a visible GPU's index) or ``auto`` (the
    first GPU when there is one, else the CPU). Another name, or a GPU this process does not see, is a
    ``UserError`` naming ``device``."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, colon, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind != "cuda" or not index.isdigit())):
        raise UserError("device", name, "It is not a device shardyard runs a model on.",
                        "Use device=cpu, device=cuda, device=cuda:N (a GPU's index) or device=auto.")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError("device", name, "No CUDA GPU is visible to this process.",
                            "Use device=cpu (or device=auto: a GPU when there is one).")
        if colon and int(index) >= count:
            raise UserError("device", name, f"This process sees {count} GPU(s): cuda:0 to cuda:{count - 1}.",
                            f"Use device=cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}, or check "
                            "CUDA_VISIBLE_DEVICES.")
    return torch.device(name)


def limit(key: str, number: Any) -> int | float | None:
    """The harness's ``limit`` rule: None (every document), a count of documents per task (a whole number, 1 or
    more: returned as an int) or a fraction of them below 1 (a float in (0, 1)). Anything else is a ``UserError``
    naming ``key``."""
    import math

    if number is None:
        return None
    if (isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)
            or not (number > 0 and (number < 1 or number == int(number)))):
        raise UserError(key, number, "It must be a count of documents per task (a whole number) or a fraction "
                        "of them below 1.", f"Use e.g. {key}=100 or {key}=0.1, or leave it unset for every document.")
    return int(number) if number >= 1 else float(number)
