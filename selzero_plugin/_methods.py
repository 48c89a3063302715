"""Replacing a method on one object (not its class) the way host libraries expect."""

from __future__ import annotations

import functools
import types
from typing import Any, Callable


def replace_method(obj: Any, name: str, fn: Callable[..., Any]) -> None:
    """Set ``obj.<name>`` to ``fn`` bound to ``obj`` (a bound method, not a plain function).

    torch's LR schedulers wrap ``optimizer.step`` through ``step.__func__``, so a scheduler built
    after the replacement (the HF Trainer builds its scheduler after ``accelerator.prepare``)
    needs a bound method. ``fn`` takes the call's arguments, without ``self``.
    """
    original = getattr(obj, name)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(obj, name, types.MethodType(method, obj))
