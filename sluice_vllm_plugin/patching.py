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
