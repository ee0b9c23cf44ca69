"""``forward_to``: an engine method that is a method of one of its parts (its ``TorchStepper``), declared in
one line instead of written out again in every engine."""

from __future__ import annotations

from typing import Any, Callable, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")


class forward_to(Generic[P, R]):
    """``step = forward_to("stepper", TorchStepper.step)`` in an engine's class body: ``engine.step(guard)``
    is ``engine.stepper.step(guard)``.

    Composition, not inheritance: each engine names the methods it hands over and writes the others itself
    (a base class would have some engines override half of what it gives them). The signature is the target
    method's, so mypy checks the engine against the ``Backend`` Protocol (``backends/conformance.py``) as if
    the method were written out."""

    def __init__(self, attr: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self.attr, self.method = attr, method

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> forward_to[P, R]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> forward_to[P, R] | Callable[P, R]:
        if obj is None:
            return self
        return getattr(getattr(obj, self.attr), self.method.__name__)  # the part's own bound method
