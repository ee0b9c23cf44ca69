"""GRPO's reward functions: ``objective.rewards``, a list of ``_target_``s, each with its own keys and a
``weight``. A completion's reward is the weighted sum of every function's value (``Reward.weight``).

A reward is a callable ``f(completions: list[str], rows: list[dict]) -> list[float]`` (one number per completion;
``rows[i]`` is the data row completion ``i`` answers, every field but the prompt) with a ``name`` (its metric:
``rewards/<name>``) and ``fields`` (the row fields it reads: checked when the run starts, a row without one exits
2 naming its file:line). ``build_rewards`` makes each entry of ``objective.rewards`` a ``Reward``:

- a class: built by hydra's ``instantiate`` with the entry's keys; its instance is the callable;
- a plain function ``f(completions, rows, **keys)``: called with the entry's other keys (hydra's ``_partial_``);
  its ``name`` is ``f.__name__`` and its ``fields`` the function's ``fields`` attribute (or none).

``weight`` (default 1.0) and ``name`` are keys of every entry; they are passed to a class that takes them.

The shipped rewards (``NumericAnswer``, ``FormatRegex``) never raise and never run generated text as code: no
``eval``, no sympy parsing; hostile completions (huge numbers, unicode digits, no answer, megabyte strings, regex
bombs) get a defined reward, in bounded time. A user's reward that raises, or returns something other than one
finite number per completion, stops the run with exit 2 naming its entry (``Reward.__call__``): a NaN or a
silently zeroed reward would move the policy with no signal, or on a wrong one.
"""

from __future__ import annotations

import inspect
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Optional

from shardyard.core.errors import UserError

_NUMERAL = re.compile(
    r"[-+]?"
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?"  # 1,234,567.5: commas only as thousands separators
    r"|[0-9]+(?:\.[0-9]*)?"  # 42, 42., 3.25
    r"|\.[0-9]+)"  # .5
    r"(?:[eE][-+]?[0-9]+)?"  # 1e309, 2.5E-3
)
"""A number as a model writes it, ASCII only. ``[0-9]``, not ``\\d`` (which matches every script's digits). One
fixed pattern without nested quantifiers: linear time on any text."""


_SEPARATOR = re.compile(r"[^0-9,.eE+-]")
"""A character no numeral contains: scanning for numerals from either side of one finds the same ones after it."""


def _last_numeral(text: str, start: int) -> Optional[re.Match[str]]:
    """The last ``_NUMERAL`` match in ``text[start:]``, scanning back from the end in growing windows (a 1 MB
    completion full of numbers costs a few milliseconds, not one match object per number)."""
    width = 4096
    while True:
        lo = max(start, len(text) - width)
        last = None
        for last in _NUMERAL.finditer(text, lo):
            pass
        # The window's last match is the text's once a separator lies between the window's edge and it.
        if lo == start or (last is not None and _SEPARATOR.search(text, lo, last.start())):
            return last
        width *= 4


def _decimal(numeral: str, max_chars: int) -> Optional[Decimal]:
    """The exact value of ``numeral`` (a match of ``_NUMERAL``), or None when it is longer than ``max_chars``."""
    if len(numeral) > max_chars:
        return None
    try:
        return Decimal(numeral.replace(",", ""))
    except InvalidOperation:  # not reachable for a _NUMERAL match; kept so a reward never raises
        return None


class NumericAnswer:
    """1.0 when the last number after the last ``marker`` in the completion equals the row's ``field``, else 0.0.

    - ``marker`` is a literal string, not a regex (found with ``str.rfind``: no user regex runs on generated text
      here); ``""`` reads the whole completion. No marker, or no number after it: 0.0.
    - A number is ASCII: an optional sign, digits with an optional decimal part (``3.``, ``.5``, ``3.25``),
      optional ``,`` thousands separators (``1,234``), an optional exponent (``1e309``). Other scripts' digits
      (Arabic-Indic ``١٢٣``, fullwidth ``１２３``) and the unicode minus ``−`` are not read as numbers: a model is
      rewarded for writing the answer as the data writes it, and Python's ``int("١٢٣") == 123`` does not leak in.
    - Values are compared exactly as decimals (``Decimal`` equality: ``3.50 == 3.5``, ``1e3 == 1000``, never via
      floats: ``1e309`` is not infinity). A numeral longer than ``max_chars`` characters (e.g. a 5000-digit
      number) is unreadable and scores 0.0, so no conversion ever runs long or hits Python's int-string limit.
    - The row's answer: an int, a finite float (read as its shortest repr: ``0.1`` is ``0.1``) or a string that is
      one number by the same grammar (surrounding spaces allowed). Anything else scores every completion 0.0;
      ``check`` names such a row before the run starts.

    Never raises, whatever the completion; linear time in its length.
    """

    def __init__(self, field: str = "answer", marker: str = "Answer:", weight: float = 1.0,
                 name: str = "numeric_answer", max_chars: int = 100):
        if not isinstance(field, str) or not field:
            raise UserError("field", field, "It names the row field holding the answer.", "Use e.g. field=answer.")
        if not isinstance(marker, str):
            raise UserError("marker", marker, "It is the literal text that precedes the answer.",
                            "Use e.g. marker='Answer:', or '' to read the whole completion.")
        if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
            raise UserError("max_chars", max_chars, "It is the longest numeral read, in characters.",
                            "Use a positive integer, e.g. 100.")
        self.field, self.marker, self.weight, self.name, self.max_chars = field, marker, weight, name, max_chars
        self.fields: tuple[str, ...] = (field,)

    def answer(self, completion: str) -> Optional[Decimal]:
        """The number the completion gives as its answer, or None."""
        if not isinstance(completion, str):
            return None
        start = completion.rfind(self.marker) if self.marker else 0
        if start < 0:
            return None
        last = _last_numeral(completion, start + len(self.marker))
        return None if last is None else _decimal(last.group(), self.max_chars)

    def reference(self, row: Any) -> Optional[Decimal]:
        """The row's answer as a decimal, or None when it has none that reads as one number."""
        value = row.get(self.field) if isinstance(row, dict) else None
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            text = repr(value) if value.bit_length() <= 4 * self.max_chars else ""
        elif isinstance(value, float):
            text = repr(value) if math.isfinite(value) else ""
        elif isinstance(value, str):
            text = value.strip()
        else:
            return None
        return _decimal(text, self.max_chars) if _NUMERAL.fullmatch(text) else None

    def check(self, row: dict) -> Optional[str]:
        """Why ``row`` cannot be graded (for the start-of-run data check), or None."""
        if self.field not in row:
            return f"it has no field {self.field!r}"
        if self.reference(row) is None:
            return f"its {self.field!r} ({str(row[self.field])[:40]!r}) is not one number"
        return None

    def __call__(self, completions: list[str], rows: list[dict]) -> list[float]:
        out = []
        for completion, row in zip(completions, rows):
            expected = self.reference(row)
            got = self.answer(completion) if expected is not None else None
            out.append(1.0 if got is not None and got == expected else 0.0)
        return out


class FormatRegex:
    """1.0 when the completion matches ``pattern``, else 0.0.

    - Matching is ``fullmatch`` (the whole completion, from its first character to its last) with ``DOTALL``
      (``.`` crosses lines); ``search=True`` accepts a match anywhere. Inline flags work (``(?m)``, ``(?-s:...)``).
    - Patterns run on the ``regex`` package (a transformers dependency; ``re``'s syntax) with a time limit per
      completion (``timeout_s``): a pattern that backtracks catastrophically on some text (``(a+)+$`` on
      ``aaa...ab``) scores that completion 0.0 after ``timeout_s`` instead of hanging the run. A completion longer
      than ``max_chars`` characters scores 0.0 unread. Both limits make a hostile completion cost at most
      ``timeout_s``; which completions hit the time limit can depend on the machine's speed, so a pattern that
      needs it should be rewritten (every shipped recipe's pattern runs in linear time).
    - A pattern that does not compile is refused when the run starts (exit 2 naming
      ``objective.rewards[i].pattern``).
    """

    def __init__(self, pattern: str, weight: float = 1.0, name: str = "format", search: bool = False,
                 max_chars: int = 100_000, timeout_s: float = 0.1):
        import regex

        if not isinstance(pattern, str):
            raise UserError("pattern", pattern, "It is a regular expression the completion must match.",
                            "Quote it in YAML: pattern: '^<think>.*</think>\\s*Answer: -?[0-9]+$'.")
        try:
            self._compiled = regex.compile(pattern, regex.DOTALL)
        except (regex.error, ValueError, OverflowError, RecursionError) as e:
            raise UserError("pattern", pattern, f"It is not a regular expression ({e}).",
                            "Fix the pattern (Python re syntax; quote it in YAML).") from None
        if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
            raise UserError("max_chars", max_chars, "It is the longest completion examined, in characters.",
                            "Use a positive integer, e.g. 100000.")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 60):
            raise UserError("timeout_s", timeout_s, "It is the time one completion's match may take, in seconds.",
                            "Use e.g. 0.1.")
        self.pattern, self.weight, self.name, self.search = pattern, weight, name, bool(search)
        self.max_chars, self.timeout_s = max_chars, float(timeout_s)
        self.fields: tuple[str, ...] = ()

    def matches(self, completion: str) -> bool:
        """Whether ``completion`` matches within the limits (False past them)."""
        if not isinstance(completion, str) or len(completion) > self.max_chars:
            return False
        find = self._compiled.search if self.search else self._compiled.fullmatch
        try:
            return find(completion, timeout=self.timeout_s) is not None
        except (TimeoutError, RecursionError, MemoryError):
            return False

    def __call__(self, completions: list[str], rows: list[dict]) -> list[float]:
        return [1.0 if self.matches(c) else 0.0 for c in completions]


class Reward:
    """One entry of ``objective.rewards``, built (``build_rewards``): what GRPO calls and logs."""

    def __init__(self, fn: Callable[[list[str], list[dict]], Any], name: str, fields: tuple[str, ...],
                 weight: float, key: str, target: str):
        self.fn, self.name, self.fields, self.weight = fn, name, fields, weight
        self.key = key
        """``objective.rewards[i]``: where errors point."""
        self.target = target

    def check(self, row: dict) -> Optional[str]:
        """Why ``row`` cannot be graded, when the reward says (``NumericAnswer.check``), or None. Missing
        ``fields`` are the caller's check."""
        check = getattr(self.fn, "check", None)
        return check(row) if callable(check) else None

    def __call__(self, completions: list[str], rows: list[dict]) -> list[float]:
        """One finite float per completion; exit 2 naming the entry when the function raises or returns anything
        else (not a list of that length, a non-number, NaN or infinity)."""
        def refuse(problem: str) -> UserError:
            return UserError(f"{self.key}._target_", self.target, problem,
                             "A reward returns one finite number per completion, for every completion (the shipped "
                             "ones never raise: test yours on empty, huge and non-ASCII text).")

        try:
            out = self.fn(completions, rows)
        except UserError:
            raise
        except Exception as e:
            raise refuse(f"The reward {self.name!r} raised {type(e).__name__}: {str(e)[:200]} (on a batch of "
                         f"{len(completions)} completions).") from e
        try:
            values = list(out)
        except TypeError:
            raise refuse(f"The reward {self.name!r} returned a {type(out).__name__}, not a list.") from None
        if len(values) != len(completions):
            raise refuse(f"The reward {self.name!r} returned {len(values)} values for {len(completions)} "
                         "completions.")
        result = []
        for i, v in enumerate(values):
            number = None
            if not isinstance(v, (str, bytes)) and v is not None:
                try:
                    number = float(v)
                except (TypeError, ValueError, OverflowError):
                    number = None
            if number is None or not math.isfinite(number):
                raise refuse(f"The reward {self.name!r} returned {str(v)[:40]!r} for completion {i}: not a finite "
                             "number.")
            result.append(number)
        return result


def _accepts(target: Callable[..., Any], keyword: str) -> bool:
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _check_weight(key: str, weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise UserError(f"{key}.weight", weight, "A reward's weight multiplies its values in the sum.",
                        "Use a finite number, e.g. 1.0.")


def _callable_as_reward(fn: Any) -> bool:
    """Whether ``fn(completions, rows)`` binds (positionally), the entry's keys included."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(["completion"], [{}])
    except (TypeError, ValueError):  # ValueError: a partial whose keys the function does not take
        return False
    return True


def build_rewards(cfgs: Any) -> list[Reward]:
    """Each entry of ``objective.rewards`` (a list of mappings with a ``_target_``), built, in order; exit 2
    naming ``objective.rewards[i]...`` for an empty list, an entry that is not a mapping, a ``_target_`` that
    cannot be imported or built or is not callable as ``f(completions, rows)``, a key its constructor refuses
    (a shipped reward's own check names its key: ``objective.rewards[i].pattern``), a weight that is not a
    finite number, or two entries with the same name."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_object, instantiate
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfgs):
        cfgs = OmegaConf.to_container(cfgs, resolve=True)
    fix_target = ("Use shardyard.objectives.rewards.NumericAnswer or shardyard.objectives.rewards.FormatRegex, "
                  "or your own function f(completions, rows) -> list[float] (or a class whose instances are).")
    if not isinstance(cfgs, (list, tuple)) or not cfgs:
        raise UserError("objective.rewards", cfgs, "GRPO needs at least one reward function, as a list.",
                        "E.g. objective.rewards=[{_target_: shardyard.objectives.rewards.NumericAnswer}].")
    built: list[Reward] = []
    for i, entry in enumerate(cfgs):
        key = f"objective.rewards[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("_target_"), str):
            raise UserError(key, entry, "Each reward is a mapping with a `_target_`.", fix_target)
        target = entry["_target_"]
        keys = {k: v for k, v in entry.items() if k != "_target_"}
        if "weight" in keys:
            _check_weight(key, keys["weight"])
        try:
            obj = get_object(target)
        except Exception as e:
            raise UserError(f"{key}._target_", target, f"It cannot be imported ({type(e).__name__}: {e}).",
                            fix_target) from None
        if inspect.isclass(obj):
            passed = {k: v for k, v in keys.items() if k not in ("weight", "name") or _accepts(obj, k)}
            spec = {"_target_": target, **passed}
        elif callable(obj):
            passed = {k: v for k, v in keys.items() if k not in ("weight", "name")}
            try:
                inspect.signature(obj).bind(["completion"], [{}], **passed)
            except TypeError as e:
                raise UserError(key, keys, f"{target}(completions, rows, **keys) does not fit its signature ({e}).",
                                "A reward function takes (completions, rows) and then the entry's other keys "
                                "(weight and name are shardyard's).") from None
            except ValueError:  # no signature to read (a builtin): the call decides
                pass
            spec = {"_target_": target, "_partial_": True, **passed}
        else:
            raise UserError(f"{key}._target_", target,
                            f"It names an object of type {type(obj).__name__}, not a class or function.", fix_target)
        try:
            fn = instantiate(spec)
        except InstantiationException as e:
            cause = e.__cause__
            if isinstance(cause, UserError):  # the reward's own check, naming its constructor's key
                raise UserError(f"{key}.{cause.key}", cause.value, cause.problem, cause.fix) from None
            why = f"{type(cause).__name__}: {cause}" if cause is not None else " ".join(str(e).split())
            raise UserError(key, {"_target_": target, **keys}, f"Building this reward failed ({why[:300]}).",
                            "Give only the keys its constructor takes (weight and name are always allowed); "
                            "hydra refuses targets that run code or change the system.") from None
        if not _callable_as_reward(fn):
            raise UserError(f"{key}._target_", target, "It does not give a callable f(completions, rows).",
                            fix_target)
        base = obj if not inspect.isclass(obj) else fn
        weight = keys["weight"] if "weight" in keys else getattr(base, "weight", 1.0)
        _check_weight(key, weight)
        name = keys.get("name", getattr(base, "name", None) or getattr(obj, "__name__", target))
        fields = getattr(base, "fields", ())
        if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
            raise UserError(f"{key}._target_", target, f"Its `fields` ({fields!r}) is not a list of field names.",
                            "Set fields = ('answer',) (the row fields it reads), or leave it out.")
        if not isinstance(name, str) or not name:
            raise UserError(f"{key}.name", name, "A reward's name is its metric (rewards/<name>).",
                            "Use a short non-empty string.")
        if any(r.name == name for r in built):
            raise UserError(f"{key}.name", name, "Two rewards have this name (their metrics would collide).",
                            f"Give this entry its own name: {key}.name=...")
        built.append(Reward(fn, name, tuple(fields), float(weight), key, target))
    return built
