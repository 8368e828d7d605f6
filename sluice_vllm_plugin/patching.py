"""What the plugin's patches of vLLM classes share."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def then(hook: Callable[[Any], None]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A wrapper for a class's ``__init__`` that runs ``hook(instance)`` once the original
    ``__init__`` has built it."""
    def wrap(orig: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(orig)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            hook(self)
        return __init__
    return wrap


class MethodPatches:
    """Wrappers put on methods of vLLM classes, and taken off again (tests, a second load).

    Invariant 1: while applied, ``_originals`` holds each patched method as vLLM defined it;
    applying twice is a no-op, so the original is never a wrapper."""

    def __init__(self, wrappers: list[tuple[type, str, Callable[[Any], Any]]]) -> None:
        self._wrappers = wrappers
        self._originals: dict[tuple[type, str], Any] = {}

    def apply(self) -> None:
        if self._originals:
            return  # applied already: wrapping again would record a wrapper (invariant 1)
        for cls, name, wrap in self._wrappers:
            orig = cls.__dict__[name]
            self._originals[(cls, name)] = orig
            setattr(cls, name, wrap(orig))

    def remove(self) -> None:
        for (cls, name), orig in self._originals.items():
            setattr(cls, name, orig)
        self._originals.clear()
